"""A log of every engine.generate call of each actor: when, with which policy version, how many.

`GenerateLogEngine` wraps an actor's Engine and appends one JSON line per call to
<run_dir>/generate_calls_actor_<id>.jsonl:

    {"t0": start, "t1": end (time.time()), "version": policy version at the start,
     "version_end": at the end, "n": prompts, "tokens": tokens returned,
     "switched": generations whose tokens carry more than one version,
     "lag_hist": [tokens whose version is d above their generation's first token's, d = 0..],
     "lengths": [tokens of each generation]}

It forwards the weight-sync contract (weight_sync_mode, offer_weights, weight_sync_counters) to
the engine it wraps, so logging does not turn interruptible weight sync off.

`make_program_with_generate_log` is the SAO program with such actors (builder.make_program's
actor_factory). The lock-step test (tests/entry_points/test_lockstep.py) counts the rollouts each version
generated; the async-vs-sync benchmark (programs/benchmarks/async_vs_sync.py) takes the first
call as its clock's zero and the time inside calls as the actors' busy time; the staleness
planner (experiments/staleness/inputs.py) fits its generation cost and length distribution to
the calls.
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Dict, List

from sao_actor_learner import core

LOG_PREFIX = "generate_calls_actor_"


class GenerateLogEngine(core.EngineWrapper):
    """An Engine that delegates to `engine` and logs each generate call to `log_path`."""

    def __init__(self, engine: core.Engine, log_path: str):
        super().__init__(engine)
        self._log = open(log_path, "a", buffering=1)   # line-buffered: whole lines on disk

    def generate(self, prompts, params):
        t0, version = time.time(), self._engine.version
        gens = self._engine.generate(prompts, params)
        lag: List[int] = []
        for g in gens:
            for v in g.versions:
                d = int(v) - int(g.versions[0])
                lag.extend([0] * (d + 1 - len(lag)))
                lag[d] += 1
        self._log.write(json.dumps({"t0": t0, "t1": time.time(), "version": version,
                                    "version_end": self._engine.version,
                                    "n": len(prompts), "tokens": sum(lag),
                                    "switched": sum(len(set(g.versions)) > 1 for g in gens),
                                    "lag_hist": lag,
                                    "lengths": [len(g.versions) for g in gens]}) + "\n")
        return gens

    def close(self):
        self._log.close()
        super().close()


def make_actor_with_generate_log(config, actor_id, replay_address, variables_address,
                                 run_dir=None, **kwargs):
    """builder.make_actor, with a GenerateLogEngine around the actor's engine."""
    from sao_actor_learner import builder
    path = os.path.join(run_dir or config.run_dir, f"{LOG_PREFIX}{actor_id}.jsonl")
    return builder.make_actor(config, actor_id, replay_address, variables_address, run_dir,
                              wrap_engine=lambda engine: GenerateLogEngine(engine, path),
                              **kwargs)


def make_program_with_generate_log(config, **kwargs):
    """builder.make_program whose actors log their generate calls."""
    from sao_actor_learner import builder
    return builder.make_program(config, actor_factory=make_actor_with_generate_log, **kwargs)


def read_generate_calls(run_dir: str) -> Dict[int, List[dict]]:
    """actor id -> its logged generate calls, in order ({} when none were logged)."""
    out: Dict[int, List[dict]] = {}
    for name in sorted(os.listdir(run_dir)):
        if name.startswith(LOG_PREFIX) and name.endswith(".jsonl"):
            actor_id = int(name[len(LOG_PREFIX):-len(".jsonl")])
            with open(os.path.join(run_dir, name)) as f:
                out[actor_id] = [json.loads(line) for line in f if line.strip()]
    return out
