"""The actor node: prompt -> one rollout -> reward -> insert, with fresh weights.

Loop: poll the variable server (background fetch); switch the engine to a newer version when one
has arrived; ask for admission (SAO.md section 6: no rollout is started that would be too stale
when consumed); generate one rollout per admitted prompt; write each to replay, waiting while
the rate limiter holds the table full.

With injected delays (actors/delays.py) a generated batch is handed to a delivery thread that
inserts each rollout when its delay has passed, in ready order, while the main loop goes on to
ask admission and generate the next batch (issue 8): an episode still "in the environment" no
longer holds back the actor's next batch. At most `max_waiting` rollouts wait for delivery.
"""
from __future__ import annotations

import heapq
import itertools
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

# gRPC status codes (by name) of a variable-server call worth retrying: the server is away.
_RETRYABLE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED")


class Actor(core.Worker):
    """Generates rollouts with the newest policy it has and inserts them into replay.

    Args:
      actor_id: this actor's id (stamped on every rollout).
      task: the Task prompts come from.
      engine: the Engine that samples.
      variables: a VariableClient (update(), version, params, admit()).
      writer: a RolloutWriter (write(rollout, timeout_s) -> bool, rejected, inserted; a
        generation goes through write_many when the writer has it and no delays are injected).
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
      max_waiting: with a delay sampler, the most rollouts waiting for delivery (their delay)
        at once; the actor generates no new batch while another would pass it. None: 4 actor
        batches. A rollout waiting for delivery is admitted and spooled: at stop() it stays
        pending in the spool, and a restarted actor inserts it.
    """

    def __init__(self, actor_id: int, task: core.Task, engine: core.Engine, variables, writer,
                 decode: Callable[[bytes], dict], params: core.SamplingParams,
                 actor_batch: int = 8, admission_control: bool = True, seed: int = 0,
                 max_turns: int = 1, max_total_tokens: int = 1 << 30, env_threads: int = 1,
                 stats_path: Optional[str] = None, max_rollouts: Optional[int] = None,
                 group_size: int = 1, delay_sampler=None, forced_staleness: int = -1,
                 spool=None, max_waiting: Optional[int] = None):
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
        self._spool_unconfirmed: Dict[int, int] = {}   # writer ticket -> spool seq, until it lands
        self._admit_failures = 0       # consecutive admission calls that found no server
        self._spool_reasons_seen: Dict[str, int] = {}
        # Admission slots to return with the next Admit (rejected rollouts; at a restart also
        # those lost in the crashed incarnation's generation, from the spool's ledger).
        self._release_owed = spool.owed_releases() if spool is not None else 0
        # Delayed delivery (issue 8): rollouts waiting out their injected delay, inserted by a
        # background thread. `_book_lock` guards what it shares with the main loop (counters,
        # spool bookkeeping, _release_owed); `_delivery_cv` guards the heap and `_waiting`.
        # While the thread runs it alone calls the writer (and its take_landed).
        self._max_waiting = 4 * actor_batch if max_waiting is None else int(max_waiting)
        if self._max_waiting < actor_batch:
            raise ValueError(f"max_waiting={max_waiting}: must be >= actor_batch ({actor_batch})"
                             ", else no batch could ever be handed to delivery")
        self._book_lock = threading.RLock()
        self._delivery_cv = threading.Condition()
        self._delivery_heap: list = []     # (ready_time, seq, delay, rollout)
        self._delivery_seq = itertools.count()
        self._waiting = 0                  # handed to delivery, not yet written (or refused)
        self._delivery_thread: Optional[threading.Thread] = None
        self._delivery_closing = False
        self._delivery_error: Optional[BaseException] = None
        if spool is not None:
            self.counters["rollouts_generated"] = spool.completed
            self.counters["rollouts_inserted"] = spool.inserted
            # A restarted actor continues its prompt stream after the prompts its previous
            # incarnations completed, instead of drawing the same prompts (and ids) again.
            for _ in range(spool.completed // group_size):
                self._task.sample_prompt(self._rng)

    def stop(self) -> None:
        self._stop.set()
        with self._delivery_cv:
            self._delivery_cv.notify_all()

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
        with self._book_lock:
            owed = self._release_owed
        if self._spool is not None:
            self._spool.asking(self._actor_batch)
        try:
            decision = self._variables.admit_details(str(self.actor_id), self._actor_batch,
                                                     released=owed)
        except RuntimeError as e:   # variables.client.VariableClientError carries a gRPC code
            if getattr(getattr(e, "code", None), "name", None) not in _RETRYABLE_CODES:
                raise
            # The variable server went away mid-call (killed, restarting): ask again after a
            # backoff. The unanswered "ask" counts as granted (returning a slot too many only
            # loosens admission; the learner's staleness filter still holds the bound).
            self._admit_failures += 1
            logging.log_every_n(logging.WARNING, "actor %d: admission request failed (%s); "
                                "retrying", 10, self.actor_id, e)
            self._stop.wait(min(0.05 * 2 ** min(self._admit_failures, 6), 2.0))
            return 0
        self._admit_failures = 0
        with self._book_lock:
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

    # --- delayed delivery (issue 8) -------------------------------------------------------------
    def _deliver_later(self, rollouts) -> None:
        """Hands a generated (and spooled) batch to the delivery thread: each rollout is inserted
        `delay` seconds from now (its injected latency), in ready order. Starts the thread on
        first use."""
        delays = np.asarray(self._delay_sampler(len(rollouts)), dtype=np.float64)
        now = time.monotonic()
        with self._delivery_cv:
            self._raise_delivery_error()
            for r, d in zip(rollouts, delays):
                heapq.heappush(self._delivery_heap,
                               (now + float(d), next(self._delivery_seq), float(d), r))
            self._waiting += len(rollouts)
            if self._delivery_thread is None:
                self._delivery_closing = False
                self._delivery_thread = threading.Thread(
                    target=self._delivery_loop, name=f"actor_{self.actor_id}_delivery",
                    daemon=True)
                self._delivery_thread.start()
            self._delivery_cv.notify_all()

    def _delivery_loop(self) -> None:
        """The delivery thread: pops each rollout when it is due and writes it (`_write`); every
        second without one due it settles landed inserts. Returns at stop() (what still waits
        stays pending in the spool) or when `_close_delivery` closes it."""
        try:
            while True:
                with self._delivery_cv:
                    if self._stop.is_set() or self._delivery_closing:
                        return
                    due_in = (self._delivery_heap[0][0] - time.monotonic()
                              if self._delivery_heap else 1.0)
                    if due_in > 0:
                        self._delivery_cv.wait(min(due_in, 1.0))
                        item = None
                    else:
                        item = heapq.heappop(self._delivery_heap)
                if item is None:
                    self._spool_settle_landed()   # what the main loop does without a delay
                    continue
                _, _, delay, r = item
                with self._book_lock:
                    self.counters["injected_delay_s"] += delay
                    self.counters["reward_sum"] += r.total_reward
                inserted = self._write(r)
                with self._book_lock:
                    if inserted:
                        self.counters["rollouts_inserted"] += 1
                with self._delivery_cv:
                    self._waiting -= 1
                    self._delivery_cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main loop
            with self._delivery_cv:
                self._delivery_error = e
                self._delivery_cv.notify_all()

    def _raise_delivery_error(self) -> None:
        if self._delivery_error is not None:
            raise RuntimeError(f"actor {self.actor_id}: the delivery thread failed: "
                               f"{self._delivery_error!r}") from self._delivery_error

    def _wait_for_delivery_room(self) -> None:
        """Blocks while another batch would put more than `max_waiting` rollouts in delivery
        (or until stop())."""
        with self._delivery_cv:
            while self._waiting + self._actor_batch > self._max_waiting and \
                    not self._stop.is_set():
                self._raise_delivery_error()
                self._delivery_cv.wait(0.5)
            self._raise_delivery_error()

    def _close_delivery(self, drain: bool) -> None:
        """Stops the delivery thread; with `drain`, first lets it write everything handed to it
        (unless stop() comes first)."""
        if self._delivery_thread is None:
            return
        with self._delivery_cv:
            while drain and self._waiting > 0 and not self._stop.is_set() and \
                    self._delivery_error is None:
                self._delivery_cv.wait(0.5)
            self._delivery_closing = True
            self._delivery_cv.notify_all()
        self._delivery_thread.join()
        self._delivery_thread = None
        if drain:
            self._raise_delivery_error()

    def _write(self, rollout) -> bool:
        while not self._stop.is_set():
            if self._writer.write(rollout, timeout_s=1.0):
                with self._book_lock:
                    self._spool_written(
                        rollout, getattr(self._writer, "last_write_confirmed", True),
                        getattr(self._writer, "last_ticket", None))
                    self._spool_settle_landed()
                return True
            if self._last_write_rejected():
                with self._book_lock:
                    self._spool_settle(rollout, rejected=True)
                    self._release_owed += 1    # its admission slot goes back (issue 7)
                return False
        return False

    def _write_batch(self, rollouts) -> int:
        """`_write` for a whole generation through `write_many` (issue 8): one free-slot check
        and one confirmation round trip per call instead of per rollout. Rollouts the table had
        no room for are written again, as `_write` does, until inserted, rejected or the actor
        stops. Returns how many were inserted."""
        pending, inserted = list(rollouts), 0
        while pending and not self._stop.is_set():
            retry = []
            for r, result in zip(pending, self._writer.write_many(pending, timeout_s=1.0)):
                if result.inserted:
                    inserted += 1
                    self._spool_written(r, result.confirmed, result.ticket)
                elif result.rejected is not None:
                    self._spool_settle(r, rejected=True, reason=result.rejected)
                    self._release_owed += 1    # its admission slot goes back (issue 7)
                else:
                    retry.append(r)            # nothing was sent: no duplicate
            pending = retry
            self._spool_settle_landed()
        self._rejected_seen = sum(self._writer.rejected.values())   # see _last_write_rejected
        return inserted

    def _spool_put(self, rollouts) -> None:
        """Spool (issue 7): keeps completed rollouts on disk until replay confirms them."""
        if self._spool is not None:
            for r in rollouts:
                seq = self._spool.put(r)
                with self._book_lock:
                    self._spool_seqs[id(r)] = seq

    def _spool_written(self, rollout, confirmed: bool, ticket) -> None:
        """Spool (issue 7): a write of `rollout` returned inserted. Confirmed: forget it. Still
        waiting in replay's rate limiter: keep it spooled under the writer's `ticket` until
        `_spool_settle_landed` sees it land."""
        if confirmed:
            self._spool_settle(rollout, rejected=False)
            return
        seq = self._spool_seqs.pop(id(rollout), None)
        if seq is not None:
            self._spool_unconfirmed[ticket] = seq

    def _spool_settle_landed(self) -> None:
        """Spool (issue 7): marks inserted the rollouts whose insert was unconfirmed when
        `write` returned and has landed since. One still waiting when the actor stops stays
        pending in the spool (at the end of a run nothing frees its slot; a resumed run or a
        restarted actor inserts it again, at worst a counted duplicate)."""
        with self._book_lock:
            if not self._spool_unconfirmed or not hasattr(self._writer, "take_landed"):
                return
            for ticket in self._writer.take_landed():
                seq = self._spool_unconfirmed.pop(ticket, None)
                if seq is not None and self._spool is not None:
                    self._spool.inserted_seq(seq)

    def _spool_settle(self, rollout, rejected: bool, reason: Optional[str] = None) -> None:
        """Spool (issue 7): forgets a rollout once replay has it or the writer refused it
        (`reason`: why, if known; else read off the writer's counters)."""
        with self._book_lock:
            seq = self._spool_seqs.pop(id(rollout), None)
        if self._spool is None or seq is None:
            return
        if not rejected:
            self._spool.inserted_seq(seq)
            return
        now = dict(self._writer.rejected)
        if reason is None:
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
            with self._book_lock:
                counters = dict(self.counters)
            write_json_atomic(self._stats_path, {
                **counters, "actor_id": self.actor_id, "engine_version": self._engine.version,
                "rejected": dict(self._writer.rejected), "env_counters": dict(self.env_counters),
                "time": time.time()})

    def run(self) -> None:
        try:
            self._run_and_deliver()
        finally:
            self._task.close()

    def _run_and_deliver(self) -> None:
        try:
            self._run()
        except BaseException:
            self._stop.set()   # ends the delivery thread's writes too (`_write` checks it)
            self._close_delivery(drain=False)   # what waits stays pending in the spool
            raise
        self._close_delivery(drain=True)
        self._spool_settle_landed()
        self._write_stats()

    def _run(self) -> None:
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
            if self._delay_sampler is not None:
                self._wait_for_delivery_room()   # bounds what waits for delivery
                if self._stop.is_set():
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
            if self._delay_sampler is not None:
                # Issue 8: the batch waits out its delays in the delivery thread (inserted in
                # ready order) while this loop asks admission and generates the next one.
                self._deliver_later(rollouts)
            elif hasattr(self._writer, "write_many"):
                # Issue 8: the whole generation in one write_many (one free-slot check, one
                # confirmation round trip), not one write per rollout.
                self.counters["reward_sum"] += sum(r.total_reward for r in rollouts)
                self.counters["rollouts_inserted"] += self._write_batch(rollouts)
            else:
                for r in rollouts:
                    self.counters["reward_sum"] += r.total_reward
                    if self._write(r):
                        self.counters["rollouts_inserted"] += 1
            if time.time() - last_stats > 1.0:
                if self._delivery_thread is None:   # else the delivery thread settles them
                    self._spool_settle_landed()
                self._write_stats()
                last_stats = time.time()
