"""Fault injection for whole-program tests (module-level so spawned nodes can unpickle it)."""
import functools
import math

from sao_actor_learner import builder, core


class CorruptingEngine(core.EngineWrapper):
    """Wraps a real engine and breaks some of its generations, as a buggy engine would.

    Every 3rd generation gets a NaN log-prob, every 5th an out-of-vocabulary token id.
    """

    def __init__(self, engine, vocab_size):
        super().__init__(engine)
        self._vocab_size = vocab_size
        self._count = 0

    def generate(self, prompts, params):
        gens = self._engine.generate(prompts, params)
        for g in gens:
            self._count += 1
            if self._count % 3 == 0 and g.logprobs:
                g.logprobs[0] = math.nan
            elif self._count % 5 == 0 and g.tokens:
                g.tokens[0] = self._vocab_size + 7
        return gens


def make_corrupting_actor(config, actor_id, replay_address, variables_address, run_dir=None,
                          **kwargs):
    """Every actor runs a CorruptingEngine (so rejections come whichever actor is faster)."""
    return builder.make_actor(
        config, actor_id, replay_address, variables_address, run_dir,
        wrap_engine=lambda e: CorruptingEngine(e, e.tokenizer.vocab_size), **kwargs)


make_program_with_corrupting_actors = functools.partial(builder.make_program,
                                                        actor_factory=make_corrupting_actor)


# Forged replay items inserted into a running program (actor 0 inserts them, through the
# program's own unauthenticated Reverb port, before it sends its first real rollout). What each
# kind should be refused as by the learner's reader:
FORGERIES = {"other_secret": 3, "unsigned": 2, "other_actor": 2, "garbage": 2}
FORGERY_REASONS = {"other_secret": "bad_signature", "unsigned": "bad_signature",
                   "other_actor": "bad_signature", "garbage": "malformed"}


def forged_rollout(seq, vocab_size, max_len, actor_id=0):
    """A well-formed rollout with plausible columns (what a forger who read types.py makes)."""
    import numpy as np

    from sao_actor_learner.types import Rollout

    rng = np.random.default_rng(seq)
    length = min(max_len, 12)
    mask = np.zeros(length, np.int8)
    mask[4:] = 1
    return Rollout(tokens=rng.integers(0, vocab_size, length), action_mask=mask,
                   rollout_logp=np.where(mask == 1, -0.5, 0.0),
                   versions=np.where(mask == 1, 0, -1),
                   rewards=np.where(np.arange(length) == length - 1, 1.0, 0.0),
                   prompt_id=10 ** 9 + seq, actor_id=actor_id, group_id=10 ** 9 + seq, seq=seq,
                   start_time=0.0, end_time=0.0, truncated=0)


class ForgingActor(core.Worker):
    """A real actor whose node first inserts FORGERIES into the program's replay table:
    rollouts signed with another secret, unsigned ones (a writer without a signer), ones
    signed with its own key but claiming actor 1, and raw items that are not rollouts at all;
    then runs the real actor unchanged."""

    def __init__(self, actor, replay_address, vocab_size, max_len, rollout_key, run_id):
        self._actor = actor
        self._address = replay_address
        self._vocab_size = vocab_size
        self._max_len = max_len
        self._key, self._run_id = rollout_key, run_id

    def _forge(self):
        import secrets

        import numpy as np

        from sao_actor_learner.replay import RolloutWriter, connect
        from sao_actor_learner.replay.tables import DEFAULT_TABLE
        from sao_actor_learner.replay.validation import ActorSigner, RolloutSigner

        seq = 10 ** 6   # keys far from the actor's own
        for kind, signer, claimed in (
                ("other_secret", RolloutSigner(secrets.token_hex(32), self._run_id).for_actor(0),
                 0),
                ("unsigned", None, 0),
                ("other_actor", ActorSigner(self._key, self._run_id), 1)):   # its own key
            writer = RolloutWriter(self._address, max_sequence_length=self._max_len,
                                   vocab_size=self._vocab_size, signer=signer)
            for _ in range(FORGERIES[kind]):
                seq += 1
                assert writer.write(forged_rollout(seq, self._vocab_size, self._max_len,
                                                   claimed), 60.0)
            writer.close()
        # Through Reverb's C++ client as the node loads it (this process may not import the
        # reverb package: replay/client.py), without the table-signature check.
        client = connect(self._address)
        for i in range(FORGERIES["garbage"]):
            raw = client.trajectory_writer(num_keep_alive_refs=1, validate_items=False)
            raw.append_item(DEFAULT_TABLE, [np.arange(5 + i, dtype=np.float64)])
            raw.flush(timeout_ms=60_000)
            raw.close()

    def run(self):
        if self._actor.actor_id == 0:
            self._forge()
        self._actor.run()

    def stop(self):
        self._actor.stop()


def make_forging_actor(config, actor_id, replay_address, variables_address, run_dir=None,
                       **kwargs):
    engines = []
    actor = builder.make_actor(config, actor_id, replay_address, variables_address, run_dir,
                               wrap_engine=lambda e: engines.append(e) or e, **kwargs)
    return ForgingActor(actor, replay_address, engines[0].tokenizer.vocab_size,
                        config.max_sequence_length, kwargs["rollout_key"], kwargs["run_id"])


make_program_with_forging_actor = functools.partial(builder.make_program,
                                                    actor_factory=make_forging_actor)
