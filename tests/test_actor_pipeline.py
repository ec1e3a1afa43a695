"""The actor's delayed-delivery pipeline (issue 8, actors/actor.py): with injected per-episode
delays, a generated batch waits out its delays in a delivery thread while the actor generates the
next batch, so one slow episode no longer holds back the actor.

A real Actor writes through a real RolloutWriter into a real Reverb replay server and keeps a
real on-disk RolloutSpool; the engine (records when each generate call ran), the task (one-turn
episodes, reward 1) and the variable client (version 0, grants what is asked) are small fakes.
"""
import threading
import time

import numpy as np
import pytest

from sao_actor_learner import core
from sao_actor_learner.actors.actor import Actor
from sao_actor_learner.actors.spool import RolloutSpool, read_ledger
from sao_actor_learner.models import CharTokenizer
from sao_actor_learner.replay import ReplayServer, RolloutReader, RolloutWriter
from sao_actor_learner.variables.client import AdmitResult

TOK = CharTokenizer()
PARAMS = core.SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(TOK.eos_id,))
BATCH = 4


class TimedEngine(core.Engine):
    """Answers "7<eos>" to every prompt after `busy_s`; logs (start, end, prompt ids) per call."""

    version = 0

    def __init__(self, busy_s=0.05):
        self.busy_s, self.calls = busy_s, []

    def generate(self, prompts, params):
        t0 = time.monotonic()
        time.sleep(self.busy_s)
        self.calls.append((t0, time.monotonic(), len(prompts)))
        return [core.Generation(tokens=[TOK.token_id("7"), TOK.eos_id], logprobs=[-0.1, -0.2],
                                versions=[0, 0], finish_reason="stop") for _ in prompts]

    def load_weights(self, state_dict, version):
        raise AssertionError("version 0 throughout: no weight load expected")


class OneTurnEnv(core.Environment):
    def step(self, action_tokens):
        return core.StepResult([], 1.0, True, {})


class NumberedTask(core.Task):
    """Prompt k has prompt_id k (1, 2, ...)."""
    name = "numbered"
    tokenizer = TOK
    turn_stop_token_ids = ()

    def __init__(self):
        self.n = 0

    def sample_prompt(self, rng):
        self.n += 1
        return core.Prompt(prompt_id=self.n, token_ids=tuple(TOK.encode("1+6=")), text="1+6=")

    def eval_prompts(self):
        return []

    def make_environment(self, prompt):
        return OneTurnEnv()

    def is_correct(self, prompt, completion_tokens):
        return True


class GrantingVariables:
    """A variable client at version 0 that admits every request."""
    version = 0

    def update(self):
        pass

    def update_and_wait(self):
        pass

    def get_variables(self):
        return 0, None

    def admit_details(self, actor_id, count, released=0):
        return AdmitResult(count, 0, count, 1 << 20)


class TimedWriter:
    """A RolloutWriter that notes (prompt_id, time) of every rollout it inserted."""

    def __init__(self, writer):
        self._writer, self.inserts = writer, []

    def write(self, rollout, timeout_s):
        ok = self._writer.write(rollout, timeout_s)
        if ok:
            self.inserts.append((rollout.prompt_id, time.monotonic()))
        return ok

    def __getattr__(self, name):
        return getattr(self._writer, name)


def scripted_delays(batches):
    """A delay sampler returning the given per-batch delays, then `batches[-1]` for ever."""
    it = iter(batches)
    last = [batches[-1]]

    def sample(n):
        d = next(it, last[0])
        assert len(d) == n, (d, n)
        return np.asarray(d, dtype=np.float64)
    return sample


@pytest.fixture()
def replay():
    server = ReplayServer(64).start()
    try:
        yield server
    finally:
        server._shutdown()


def _actor(replay, spool_dir, delays, **kwargs):
    writer = TimedWriter(RolloutWriter(replay.address, max_sequence_length=32,
                                       vocab_size=TOK.vocab_size))
    engine = TimedEngine()
    actor = Actor(0, NumberedTask(), engine, GrantingVariables(), writer, decode=None,
                  params=PARAMS, actor_batch=BATCH, delay_sampler=delays,
                  spool=RolloutSpool(str(spool_dir)), **kwargs)
    return actor, engine, writer


def test_actor_generates_the_next_batch_while_earlier_rollouts_wait_for_their_delay(replay,
                                                                                  tmp_path):
    delays = [[0.8, 0.0, 0.4, 0.1], [0.0, 0.3, 0.05, 0.6], [0.2, 0.2, 0.0, 0.1]]
    actor, engine, writer = _actor(replay, tmp_path / "spool", scripted_delays(delays),
                                   max_rollouts=12)
    actor.run()   # returns after 3 batches, once all 12 rollouts are delivered
    assert [n for _, _, n in engine.calls] == [BATCH] * 3
    when = dict(writer.inserts)
    # Batches 1 and 2 were generated while batch 0's slowest rollout (0.8 s) still waited.
    slowest_0 = when[1]
    assert engine.calls[1][0] < slowest_0 and engine.calls[2][0] < slowest_0, \
        (engine.calls, writer.inserts)
    assert engine.calls[2][0] - engine.calls[0][0] < 0.6   # no batch waited for a delay
    # Every rollout inserted exactly once, each when its delay had passed, and within its
    # batch in ready order (batch k holds prompt ids 4k+1 .. 4k+4).
    assert sorted(p for p, _ in writer.inserts) == list(range(1, 13))
    for k, (d, (_, gen_end, _)) in enumerate(zip(delays, engine.calls)):
        ids = [4 * k + 1 + i for i in range(BATCH)]
        assert [p for p, _ in writer.inserts if p in ids] == \
            [ids[i] for i in np.argsort(d, kind="stable")], (k, writer.inserts)
        for i, p in enumerate(ids):
            assert when[p] >= gen_end + d[i] - 1e-3, (p, when[p] - gen_end, d[i])
    with RolloutReader(replay.address) as reader:
        got = reader.sample(12, timeout_s=5.0, min_items=12)
    assert sorted(r.prompt_id for r in got) == list(range(1, 13))
    assert actor.counters["rollouts_inserted"] == 12
    assert actor.counters["rollouts_generated"] == 12
    assert actor.counters["reward_sum"] == 12.0
    assert actor.counters["injected_delay_s"] == pytest.approx(sum(map(sum, delays)))
    ledger = read_ledger(str(tmp_path / "spool"))
    assert ledger["inserted"] == 12 and ledger["pending"] == 0 and ledger["completed"] == 12


def test_stop_returns_promptly_and_leaves_waiting_rollouts_pending_in_the_spool(replay,
                                                                                tmp_path):
    # Batch 0: two quick rollouts, two that wait 30 s; every later rollout waits 30 s. With at
    # most 8 waiting the actor generates batch 1 (6 waiting) and then waits for room.
    delays = scripted_delays([[0.0, 30.0, 0.0, 30.0], [30.0] * BATCH])
    actor, engine, writer = _actor(replay, tmp_path / "spool", delays, max_waiting=2 * BATCH)
    thread = threading.Thread(target=actor.run)
    thread.start()
    deadline = time.monotonic() + 20
    while (len(writer.inserts) < 2 or len(engine.calls) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)   # time enough for a third batch, were the bound not kept
    assert len(engine.calls) == 2 and sorted(p for p, _ in writer.inserts) == [1, 3]
    t = time.monotonic()
    actor.stop()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - t < 2.0
    assert actor.counters["rollouts_generated"] == 8
    assert actor.counters["rollouts_inserted"] == 2
    assert actor.counters["injected_delay_s"] == 0.0   # no 30 s rollout was delivered
    ledger = read_ledger(str(tmp_path / "spool"))
    assert ledger["completed"] == 8 and ledger["inserted"] == 2 and ledger["pending"] == 6

    # A restarted actor (no delay this time) inserts the 6 pending rollouts first; none twice.
    restarted, _, writer2 = _actor(replay, tmp_path / "spool", None, max_rollouts=8)
    assert restarted.counters["rollouts_inserted"] == 2
    restarted.run()
    assert sorted(p for p, _ in writer2.inserts) == [2, 4, 5, 6, 7, 8]
    assert restarted.counters["rollouts_inserted"] == 8
    ledger = read_ledger(str(tmp_path / "spool"))
    assert ledger["inserted"] == 8 and ledger["pending"] == 0
    with RolloutReader(replay.address) as reader:
        got = reader.sample(8, timeout_s=5.0, min_items=8)
    assert sorted(r.prompt_id for r in got) == list(range(1, 9))


def test_max_waiting_below_one_batch_is_an_error():
    with pytest.raises(ValueError, match="max_waiting=3"):
        Actor(0, NumberedTask(), TimedEngine(), GrantingVariables(), writer=None, decode=None,
              params=PARAMS, actor_batch=BATCH, delay_sampler=lambda n: np.zeros(n),
              max_waiting=3)
