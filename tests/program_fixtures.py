"""Fault injection for whole-program tests (module-level so spawned nodes can unpickle it)."""
import functools
import math

from sao_actor_learner import builder, core


class CorruptingEngine(core.Engine):
    """Wraps a real engine and breaks some of its generations, as a buggy engine would.

    Every 3rd generation gets a NaN log-prob, every 5th an out-of-vocabulary token id.
    """

    def __init__(self, engine, vocab_size):
        self._engine = engine
        self._vocab_size = vocab_size
        self._count = 0
        self.tokenizer = engine.tokenizer

    def generate(self, prompts, params):
        gens = self._engine.generate(prompts, params)
        for g in gens:
            self._count += 1
            if self._count % 3 == 0 and g.logprobs:
                g.logprobs[0] = math.nan
            elif self._count % 5 == 0 and g.tokens:
                g.tokens[0] = self._vocab_size + 7
        return gens

    def load_weights(self, state_dict, version):
        self._engine.load_weights(state_dict, version)

    @property
    def version(self):
        return self._engine.version


def make_corrupting_actor(config, actor_id, replay_address, variables_address, run_dir=None,
                          **kwargs):
    """Every actor runs a CorruptingEngine (so rejections come whichever actor is faster)."""
    return builder.make_actor(
        config, actor_id, replay_address, variables_address, run_dir,
        wrap_engine=lambda e: CorruptingEngine(e, e.tokenizer.vocab_size), **kwargs)


make_program_with_corrupting_actors = functools.partial(builder.make_program,
                                                        actor_factory=make_corrupting_actor)
