"""The actor node: prompt -> one rollout -> reward -> insert, with fresh weights.

Loop: poll the variable server (background fetch); switch the engine to a newer version when one
has arrived; ask for admission (SAO.md section 6: no rollout is started that would be too stale
when consumed); generate one rollout per admitted prompt; write each to replay, waiting while
the rate limiter holds the table full.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, Dict, Optional

import numpy as np
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.actors.rollout import run_episodes
from sao_actor_learner.observers.metrics import write_json_atomic


class Actor(core.Worker):
    """Generates rollouts with the newest policy it has and inserts them into replay.

    Args:
      actor_id: this actor's id (stamped on every rollout).
      task: the Task prompts come from.
      engine: the Engine that samples.
      variables: a VariableClient (update(), version, params, admit()).
      writer: a RolloutWriter (write(rollout, timeout_s) -> bool, rejected, inserted).
      decode: bytes -> state_dict, to load fetched weights into the engine.
      params: SamplingParams for training rollouts.
      actor_batch: prompts generated together.
      admission_control: ask the variable server before starting rollouts.
      stats_path: where to write this actor's counters (JSON, rewritten periodically).
    """

    def __init__(self, actor_id: int, task: core.Task, engine: core.Engine, variables, writer,
                 decode: Callable[[bytes], dict], params: core.SamplingParams,
                 actor_batch: int = 8, admission_control: bool = True, seed: int = 0,
                 max_turns: int = 1, max_total_tokens: int = 1 << 30,
                 stats_path: Optional[str] = None, max_rollouts: Optional[int] = None):
        self.actor_id = actor_id
        self._task = task
        self._engine = engine
        self._variables = variables
        self._writer = writer
        self._decode = decode
        self._params = params
        self._actor_batch = actor_batch
        self._admission = admission_control
        self._rng = np.random.default_rng([seed, actor_id])
        self._max_turns = max_turns
        self._max_total_tokens = max_total_tokens
        self._stats_path = stats_path
        self._max_rollouts = max_rollouts
        self._stop = threading.Event()
        self.counters: Dict[str, float] = {"rollouts_generated": 0, "rollouts_inserted": 0,
                                           "admission_waits": 0, "weight_updates": 0,
                                           "reward_sum": 0.0}

    def stop(self) -> None:
        self._stop.set()

    def _maybe_update_weights(self, wait: bool = False) -> None:
        if wait:
            self._variables.update_and_wait()
        else:
            self._variables.update()
        v, params = self._variables.get_variables()  # one consistent (version, weights) pair
        if v >= 0 and v != self._engine.version:
            self._engine.load_weights(self._decode(params), v)
            self.counters["weight_updates"] += 1

    def _admitted(self) -> int:
        """How many rollouts this actor may start now.

        Admission counts a rollout started at version v as trainable until version v + eta. That
        holds only if the engine already runs version v, so when the server's version is ahead of
        the engine's, the actor first waits for (and loads) those weights.
        """
        if not self._admission:
            return self._actor_batch
        decision = self._variables.admit_details(str(self.actor_id), self._actor_batch)
        if decision.granted and decision.policy_version > self._engine.version:
            self._variables.wait_for_version(decision.policy_version)
            self._maybe_update_weights()
        return decision.granted

    def _write(self, rollout) -> bool:
        while not self._stop.is_set():
            if self._writer.write(rollout, timeout_s=1.0):
                return True
            if self._last_write_rejected():
                return False
        return False

    def _last_write_rejected(self) -> bool:
        rejected = sum(self._writer.rejected.values())
        changed = rejected != getattr(self, "_rejected_seen", 0)
        self._rejected_seen = rejected
        return changed

    def _write_stats(self) -> None:
        if self._stats_path:
            write_json_atomic(self._stats_path, {
                **self.counters, "actor_id": self.actor_id, "engine_version": self._engine.version,
                "rejected": dict(self._writer.rejected), "time": time.time()})

    def run(self) -> None:
        # Wait for the learner's first publish (version 0) so no rollout uses unknown weights.
        while not self._stop.is_set() and self._variables.version < 0:
            self._maybe_update_weights(wait=False)
            time.sleep(0.05)
        last_stats = 0.0
        while not self._stop.is_set():
            if self._max_rollouts is not None and \
                    self.counters["rollouts_generated"] >= self._max_rollouts:
                break
            self._maybe_update_weights()
            n = self._admitted()
            if n <= 0:
                self.counters["admission_waits"] += 1
                time.sleep(0.02)
                continue
            prompts = [self._task.sample_prompt(self._rng) for _ in range(n)]
            rollouts = run_episodes(self._engine, self._task, prompts, self._params,
                                    actor_id=self.actor_id, max_turns=self._max_turns,
                                    max_total_tokens=self._max_total_tokens)
            self.counters["rollouts_generated"] += len(rollouts)
            for r in rollouts:
                self.counters["reward_sum"] += r.total_reward
                if self._write(r):
                    self.counters["rollouts_inserted"] += 1
            if time.time() - last_stats > 1.0:
                self._write_stats()
                last_stats = time.time()
        self._write_stats()
