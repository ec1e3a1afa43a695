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
      stats_path: where to write this actor's counters (JSON, rewritten periodically); its
        "env_counters" holds run_episodes' episode and tool counters (tool errors included).
      max_turns, max_total_tokens, env_threads: the multi-turn episode limits and the threads
        that step environments (actors/rollout.py run_episodes).
      group_size: G > 1 is group mode (GRPO): each prompt is rolled out G times and the G
        rollouts, which share a group_id, are inserted together; admission counts rollouts.
      delay_sampler: n -> n delays in seconds (actors/delays.py); each rollout is inserted that
        long after its batch was generated, in the order they become ready. None: no delay.
      forced_staleness: k >= 0 generates every rollout with the weights of version P - k, P
        being the version admission granted it at (needs admission with max_staleness 0 at the
        variable server and keep_versions > k; the builder sets both). -1: off.
      spool: an actors.spool.RolloutSpool (issue 7): each completed rollout is kept on disk
        until replay confirms it, and a restarted actor inserts what it finds there first;
        the counters continue from its ledger. None: no spool.
    """

    def __init__(self, actor_id: int, task: core.Task, engine: core.Engine, variables, writer,
                 decode: Callable[[bytes], dict], params: core.SamplingParams,
                 actor_batch: int = 8, admission_control: bool = True, seed: int = 0,
                 max_turns: int = 1, max_total_tokens: int = 1 << 30, env_threads: int = 1,
                 stats_path: Optional[str] = None, max_rollouts: Optional[int] = None,
                 group_size: int = 1, delay_sampler=None, forced_staleness: int = -1,
                 spool=None):
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
        self._env_threads = env_threads  # > 1: tool calls overlap generation (actors/rollout.py)
        self.env_counters: Dict[str, float] = {}  # episode/tool counters from run_episodes
        self._stats_path = stats_path
        self._max_rollouts = max_rollouts
        self._stop = threading.Event()
        if group_size < 1 or forced_staleness < -1:
            raise ValueError(f"group_size={group_size}, forced_staleness={forced_staleness}: "
                             "need group_size >= 1 and forced_staleness >= -1")
        self._group_size = group_size
        self._delay_sampler = delay_sampler
        self._forced_staleness = forced_staleness
        self._weights_by_version: Dict[int, dict] = {}  # forced staleness: recent versions
        self.counters: Dict[str, float] = {"rollouts_generated": 0, "rollouts_inserted": 0,
                                           "admission_waits": 0, "weight_updates": 0,
                                           "reward_sum": 0.0, "injected_delay_s": 0.0}
        self._spool = spool                 # issue 7: completed rollouts survive a crash
        self._spool_seqs: Dict[int, int] = {}   # id(rollout) -> its spool sequence number
        self._spool_reasons_seen: Dict[str, int] = {}
        # Admission slots to return with the next Admit (rejected rollouts; at a restart also
        # those lost in the crashed incarnation's generation, from the spool's ledger).
        self._release_owed = spool.owed_releases() if spool is not None else 0
        if spool is not None:
            self.counters["rollouts_generated"] = spool.completed
            self.counters["rollouts_inserted"] = spool.inserted
            # A restarted actor continues its prompt stream after the prompts its previous
            # incarnations completed, instead of drawing the same prompts (and ids) again.
            for _ in range(spool.completed // group_size):
                self._task.sample_prompt(self._rng)

    def stop(self) -> None:
        self._stop.set()

    def _maybe_update_weights(self, wait: bool = False) -> None:
        if wait:
            self._variables.update_and_wait()
        else:
            self._variables.update()
        if self._forced_staleness >= 0 and self._engine.version >= 0:
            return  # the engine runs an older version on purpose; `_admitted` picks it
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
        # Issue 7: slots of admitted rollouts that will never arrive (refused by the writer, lost
        # with a crashed incarnation) go back with the request, else admission shrinks for good.
        owed = self._release_owed
        if self._spool is not None:
            self._spool.asking(self._actor_batch)
        decision = self._variables.admit_details(str(self.actor_id), self._actor_batch,
                                                 released=owed)
        self._release_owed -= owed
        if self._spool is not None:
            self._spool.released(owed)
            self._spool.admitted(decision.granted)
        if decision.granted and self._forced_staleness >= 0:
            self._variables.wait_for_version(decision.policy_version)
            self._load_version(max(0, decision.policy_version - self._forced_staleness))
            return decision.granted
        if decision.granted and decision.policy_version > self._engine.version:
            self._variables.wait_for_version(decision.policy_version)
            self._maybe_update_weights()
        return decision.granted

    def _load_version(self, version: int) -> None:
        """Forced staleness: puts the weights of `version` (an older one) into the engine."""
        if self._engine.version == version:
            return
        weights = self._weights_by_version.get(version)
        if weights is None:
            held, params = self._variables.get_variables()
            weights = self._decode(params) if held == version else \
                self._decode(self._variables.fetch_version(version))
            self._weights_by_version[version] = weights
            for old in sorted(self._weights_by_version)[:-(self._forced_staleness + 2)]:
                del self._weights_by_version[old]
        self._engine.load_weights(weights, version)
        self.counters["weight_updates"] += 1

    def _prompts_for(self, n: int) -> list:
        """n prompts to roll out: n distinct ones, or in group mode each prompt G times in a row
        (a grant that is not a multiple of G ends with a shorter group)."""
        prompts = []
        while len(prompts) < n:
            p = self._task.sample_prompt(self._rng)
            prompts.extend([p] * min(self._group_size, n - len(prompts)))
        return prompts

    def _in_delivery_order(self, rollouts):
        """Yields rollouts when they are due: at once, or after their injected delays."""
        if self._delay_sampler is None:
            yield from rollouts
            return
        delays = np.asarray(self._delay_sampler(len(rollouts)), dtype=np.float64)
        start = time.monotonic()
        for i in np.argsort(delays, kind="stable"):
            if self._stop.wait(max(0.0, start + delays[i] - time.monotonic())):
                return
            self.counters["injected_delay_s"] += float(delays[i])
            yield rollouts[i]

    def _write(self, rollout) -> bool:
        while not self._stop.is_set():
            if self._writer.write(rollout, timeout_s=1.0):
                self._spool_settle(rollout, rejected=False)
                return True
            if self._last_write_rejected():
                self._spool_settle(rollout, rejected=True)
                self._release_owed += 1    # its admission slot goes back (issue 7)
                return False
        return False

    def _spool_put(self, rollouts) -> None:
        """Spool (issue 7): keeps completed rollouts on disk until replay confirms them."""
        if self._spool is not None:
            for r in rollouts:
                self._spool_seqs[id(r)] = self._spool.put(r)

    def _spool_settle(self, rollout, rejected: bool) -> None:
        """Spool (issue 7): forgets a rollout once replay has it or the writer refused it."""
        seq = self._spool_seqs.pop(id(rollout), None)
        if self._spool is None or seq is None:
            return
        if not rejected:
            self._spool.inserted_seq(seq)
            return
        now = dict(self._writer.rejected)
        reason = next((k for k, v in now.items() if v > self._spool_reasons_seen.get(k, 0)),
                      "rejected")
        self._spool_reasons_seen = now
        self._spool.rejected_seq(seq, reason)

    def _redeliver_spooled(self) -> None:
        """Spool (issue 7): inserts the rollouts a previous incarnation completed but never saw
        confirmed, oldest first."""
        if self._spool is None:
            return
        pending = self._spool.pending()
        if pending:
            logging.info("actor %d: re-inserting %d spooled rollouts", self.actor_id,
                         len(pending))
        for seq, r in pending:
            self._spool_seqs[id(r)] = seq
            if self._write(r):
                self.counters["rollouts_inserted"] += 1

    def _last_write_rejected(self) -> bool:
        rejected = sum(self._writer.rejected.values())
        changed = rejected != getattr(self, "_rejected_seen", 0)
        self._rejected_seen = rejected
        return changed

    def _write_stats(self) -> None:
        if self._stats_path:
            write_json_atomic(self._stats_path, {
                **self.counters, "actor_id": self.actor_id, "engine_version": self._engine.version,
                "rejected": dict(self._writer.rejected), "env_counters": dict(self.env_counters),
                "time": time.time()})

    def run(self) -> None:
        self._redeliver_spooled()
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
            prompts = self._prompts_for(n)
            rollouts = run_episodes(self._engine, self._task, prompts, self._params,
                                    actor_id=self.actor_id, max_turns=self._max_turns,
                                    max_total_tokens=self._max_total_tokens,
                                    env_threads=self._env_threads, counters=self.env_counters)
            self.counters["rollouts_generated"] += len(rollouts)
            self._spool_put(rollouts)
            for r in self._in_delivery_order(rollouts):
                self.counters["reward_sum"] += r.total_reward
                if self._write(r):
                    self.counters["rollouts_inserted"] += 1
            if time.time() - last_stats > 1.0:
                self._write_stats()
                last_stats = time.time()
        self._write_stats()
