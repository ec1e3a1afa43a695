"""The actor node: prompt -> one rollout -> reward -> spool -> replay, with fresh weights.

One straight data path per generated batch:
  1. admission (docs/METHOD.md: no rollout is started that would be too stale when consumed);
  2. `run_episodes`: one rollout per admitted prompt (multi-turn with tools where the task has
     them);
  3. the writer's check: an invalid rollout (a broken engine's NaN log-probs, ids outside the
     vocabulary) is refused here, counted by reason, and its admission slot returned;
  4. the spool keeps every valid rollout under its sequence number (actors/spool.py);
  5. `_send` hands it to replay (at once, or after its injected delay: actors/delivery.py).
And continually: the learner's acknowledgements (through the variable server) let the spool
forget what was trained or dropped, and a new loss epoch makes the actor send again whatever it
still holds from before it. Everything a rollout goes through is in that order, in this file;
what it costs to keep it is in spool.py, what delays it in delivery.py.

Weights: the variable client fetches new versions in the background; the engine switches
between batches. With an engine whose weight_sync_mode is keep or abort, a weight thread
(`_feed_weights`) also hands every new version to the engine (`offer_weights`) as soon as the
client holds it, while a batch is being generated, so it reaches the generations in flight
(docs/DESIGN.md "Weight sync modes"); a rollout's per-token versions record the switch and its
staleness is that of its oldest token, so admission and the learner's bound still hold. Forced
staleness (a drift experiment) generates with the weights of version P - k, P being the version
admission granted at (no weight thread then).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

import numpy as np
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.actors.delivery import DelayedDelivery
from sao_actor_learner.actors.rollout import run_episodes
from sao_actor_learner.actors.spool import RolloutSpool
from sao_actor_learner.observers.metrics import write_json_atomic
from sao_actor_learner.types import Rollout
from sao_actor_learner.variables.channel import VariableClientError


def _retryable(error: BaseException) -> bool:
    """A variable-server call that failed because the server is away (killed, restarting)."""
    return isinstance(error, VariableClientError) and error.retryable


class Actor(core.Worker):
    """Generates rollouts with the newest policy it has and delivers them to replay.

    Args:
      actor_id: this actor's id (stamped on every rollout).
      task: the Task prompts come from.
      engine: the Engine that samples.
      variables: a variables.VariableClient (weights, admission, acknowledgements).
      sink: a core.RolloutSink (the replay writer: `check`, `send`).
      decode: payload -> state_dict, to load fetched weights into the engine.
      params: SamplingParams for training rollouts.
      spool: the actor's RolloutSpool (every rollout is kept there until acknowledged).
      actor_batch: prompts generated together.
      admission_control: wait for the variable server's grant before starting rollouts (it
        is asked either way: its grants bound what progress reports may acknowledge).
      stats_path: where to write this actor's counters (JSON, rewritten every second).
      max_rollouts: stop after generating this many (tests); None: until stop().
      max_turns, max_total_tokens, env_threads: multi-turn episode limits and the threads that
        step environments (actors/rollout.py).
      group_size: G > 1 rolls each prompt out G times (GRPO); admission counts rollouts.
      delay_sampler: n -> n injected delays in seconds (actors/delays.py); None: none.
      forced_staleness: k >= 0 generates every rollout with the weights of version P - k (needs
        admission with max_staleness 0 and keep_versions > k; the builder sets both). -1: off.
      max_waiting: with delays, the most rollouts waiting at once; None: 4 actor batches.
      ack_period_s: how often the actor asks which of its rollouts the learner consumed.
      weight_poll_s: with engine.weight_sync_mode keep/abort, how often the weight thread
        looks for a new version (the variable client's update period).
    """

    def __init__(self, actor_id: int, task: core.Task, engine: core.Engine, variables,
                 sink: core.RolloutSink, decode: Callable, params: core.SamplingParams,
                 spool: RolloutSpool, actor_batch: int = 8, admission_control: bool = True,
                 seed: int = 0, max_turns: int = 1, max_total_tokens: int = 1 << 30,
                 env_threads: int = 1, stats_path: Optional[str] = None,
                 max_rollouts: Optional[int] = None, group_size: int = 1,
                 delay_sampler=None, forced_staleness: int = -1,
                 max_waiting: Optional[int] = None, ack_period_s: float = 0.5,
                 weight_poll_s: float = 0.05):
        if group_size < 1 or forced_staleness < -1:
            raise ValueError(f"group_size={group_size}, forced_staleness={forced_staleness}: "
                             "need group_size >= 1 and forced_staleness >= -1")
        max_waiting = 4 * actor_batch if max_waiting is None else int(max_waiting)
        if max_waiting < actor_batch:
            raise ValueError(f"max_waiting={max_waiting}: must be >= actor_batch ({actor_batch})"
                             ", else no batch could ever be handed to delivery")
        self.actor_id = actor_id
        self._task, self._engine, self._variables = task, engine, variables
        self._sink, self._decode, self._params = sink, decode, params
        self._spool = spool
        self._actor_batch = actor_batch
        self._admission = admission_control
        self._rng = np.random.default_rng([seed, actor_id])
        self._episode_limits = dict(max_turns=max_turns, max_total_tokens=max_total_tokens,
                                    env_threads=env_threads)
        self.env_counters: Dict[str, float] = {}
        self._stats_path = stats_path
        self._max_rollouts = max_rollouts
        self._group_size = group_size
        self._forced_staleness = forced_staleness
        self._weights_by_version: Dict[int, dict] = {}
        self._ack_period_s = ack_period_s
        self._stop = threading.Event()
        self._lock = threading.Lock()        # counters, _in_delivery, _release_owed
        # Weights in flight (docs/DESIGN.md "Weight sync modes"): the weight thread offers each
        # new version to the engine while it generates; _weights_lock makes the thread's offers
        # and the loop's loads one sequence, so the engine's version never goes back.
        self._feeding = engine.weight_sync_mode != "off" and forced_staleness < 0
        self._weight_poll_s = float(weight_poll_s)
        self._weights_lock = threading.Lock()
        self._offered = -1
        self._feeder: Optional[threading.Thread] = None
        self._feeder_error: Optional[BaseException] = None
        self.counters: Dict[str, float] = {
            "rollouts_generated": spool.completed + sum(spool.refused.values()),
            "rollouts_inserted": spool.sent_once, "rollouts_resent": 0,
            "rollouts_acknowledged": spool.acknowledged, "admission_waits": 0,
            "weight_updates": 0, "weights_offered": 0, "reward_sum": 0.0,
            "injected_delay_s": 0.0}
        self._loss_epoch = 0                  # the learner's, as last acknowledged
        self._last_ack_poll = 0.0
        self._admit_failures = 0
        self._in_delivery: set = set()        # seqs handed to delivery, not yet sent
        # Admission slots to return with the next Admit: rollouts refused by the check, and at a
        # restart those lost in the generation of a crashed incarnation (spool.owed_releases).
        self._release_owed = spool.owed_releases()
        self._delivery = None if delay_sampler is None else DelayedDelivery(
            self._send, delay_sampler, max_waiting, self._stop, self._delivered)
        # A restarted actor continues its prompt stream after the prompts its previous
        # incarnations used, instead of drawing the same prompts (and ids) again.
        for _ in range(int(self.counters["rollouts_generated"]) // group_size):
            task.sample_prompt(self._rng)

    def stop(self) -> None:
        self._stop.set()
        if self._delivery is not None:
            self._delivery.notify()

    # --- delivery ---------------------------------------------------------------------------------
    def _send(self, rollouts: List[Rollout]) -> None:
        """Hands `rollouts` (spooled) to replay, retrying while the table is full, until all are
        in or the actor stops (what is left stays in the spool, unsent)."""
        pending = list(rollouts)
        while pending and not self._stop.is_set():
            epoch = self._loss_epoch      # read before sending: a bump meanwhile re-sends
            sent = self._sink.send(pending, timeout_s=1.0)
            done = [r for r, ok in zip(pending, sent) if ok]
            first = self._spool.sent([r.seq for r in done], epoch)
            with self._lock:
                self.counters["rollouts_inserted"] += first
                self.counters["rollouts_resent"] += len(done) - first
            pending = [r for r, ok in zip(pending, sent) if not ok]
            if self._loss_epoch > epoch:   # sent into an epoch that has ended: again
                pending = done + pending
        with self._lock:
            self._in_delivery.difference_update(r.seq for r in rollouts)

    def _delivered(self, rollout: Rollout, delay: float) -> None:
        with self._lock:
            self.counters["injected_delay_s"] += delay

    def _deliver(self, rollouts: List[Rollout]) -> None:
        if self._delivery is None:
            self._send(rollouts)
            return
        with self._lock:
            self._in_delivery.update(r.seq for r in rollouts)
        self._delivery.schedule(rollouts)

    def _spool_valid(self, rollouts: List[Rollout]) -> List[Rollout]:
        """The rollouts that pass the sink's check, each spooled (its seq set); the others are
        refused, counted, and their admission slots owed back."""
        valid = []
        for r in rollouts:
            reason = self._sink.check(r)
            if reason is None:
                self._spool.put(r)
                valid.append(r)
            else:
                self._spool.refuse(reason)
                with self._lock:
                    self._release_owed += 1
        return valid

    # --- acknowledgements -------------------------------------------------------------------------
    def _poll_acks(self, force: bool = False) -> None:
        """Forgets what the learner consumed; on a new loss epoch sends again what is held from
        before it."""
        if not force and time.monotonic() - self._last_ack_poll < self._ack_period_s:
            return
        self._last_ack_poll = time.monotonic()
        try:
            info = self._variables.acknowledged(self.actor_id)
        except Exception as e:
            if not _retryable(e):
                raise
            return   # the variable server is away; next time
        forgotten = self._spool.acknowledge(info.consumed)
        with self._lock:
            self.counters["rollouts_acknowledged"] += forgotten
        if info.loss_epoch > self._loss_epoch:
            self._loss_epoch = info.loss_epoch
            self._send_held()

    def _send_held(self) -> None:
        """Sends every held rollout never sent, or sent before the current loss epoch (not those
        waiting in delivery)."""
        with self._lock:
            skip = set(self._in_delivery)
        held = [r for seq, r in self._spool.to_send(self._loss_epoch) if seq not in skip]
        if held:
            logging.info("actor %d: sending %d held rollouts (loss epoch %d)", self.actor_id,
                         len(held), self._loss_epoch)
            self._send(held)

    # --- weights and admission --------------------------------------------------------------------
    def _maybe_update_weights(self, wait: bool = False) -> None:
        if wait:
            self._variables.update_and_wait()
        else:
            self._variables.update()
        if self._forced_staleness >= 0 and self._engine.version >= 0:
            return  # the engine runs an older version on purpose; `_admitted` picks it
        v, params = self._variables.get_variables()  # one consistent (version, weights) pair
        with self._weights_lock:
            current = self._engine.version
            if v >= 0 and (v > current if self._feeding else v != current):
                self._engine.load_weights(self._decode(params), v)
                self.counters["weight_updates"] += 1

    def _feed_weights(self) -> None:
        """The weight thread (weight_sync_mode keep/abort): offers the engine every version
        newer than its own as soon as the variable client holds it, also mid-generation. A
        failure stops the actor; run() raises it."""
        try:
            while not self._stop.wait(self._weight_poll_s):
                try:
                    self._variables.update()      # a background fetch, when one is due
                except Exception as e:
                    if not _retryable(e):
                        raise
                    continue
                v, params = self._variables.get_variables()
                with self._weights_lock:
                    if v < 0 or v <= max(self._offered, self._engine.version):
                        continue
                    self._engine.offer_weights(self._decode(params), v)
                    self._offered = v
                with self._lock:
                    self.counters["weights_offered"] += 1
        except BaseException as e:  # noqa: BLE001 - re-raised by run()
            self._feeder_error = e
            self._stop.set()

    def _admitted(self) -> int:
        """How many rollouts this actor may start now.

        Admission counts a rollout started at version v as trainable until version v + eta. That
        holds only if the engine already runs version v, so when the server's version is ahead of
        the engine's, the actor first waits for (and loads) those weights.
        """
        # Without admission control the server grants every request in full, but the actor
        # still asks: the grants bound what the learner's reports may acknowledge for it
        # (variables/progress.beyond_admitted).
        with self._lock:
            owed = self._release_owed
        self._spool.asking(self._actor_batch)
        try:
            decision = self._variables.admit_details(str(self.actor_id), self._actor_batch,
                                                     released=owed)
        except Exception as e:
            if not _retryable(e):
                raise
            # The variable server went away mid-call: ask again after a backoff. The unanswered
            # "ask" counts as granted (returning a slot too many only loosens admission; the
            # learner's staleness filter still holds the bound).
            self._admit_failures += 1
            logging.log_every_n(logging.WARNING, "actor %d: admission request failed (%s); "
                                "retrying", 10, self.actor_id, e)
            self._stop.wait(min(0.05 * 2 ** min(self._admit_failures, 6), 2.0))
            return 0
        self._admit_failures = 0
        with self._lock:
            self._release_owed -= owed
        self._spool.released(owed)
        self._spool.admitted(decision.granted)
        if not self._admission:
            return decision.granted
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

    def prompts_for(self, n: int) -> list:
        """n prompts to roll out: n distinct ones, or in group mode each prompt G times in a row
        (a grant that is not a multiple of G ends with a shorter group)."""
        prompts = []
        while len(prompts) < n:
            p = self._task.sample_prompt(self._rng)
            prompts.extend([p] * min(self._group_size, n - len(prompts)))
        return prompts

    # --- the loop ---------------------------------------------------------------------------------
    def _write_stats(self) -> None:
        if self._stats_path:
            with self._lock:
                counters = dict(self.counters)
            write_json_atomic(self._stats_path, {
                **counters, "actor_id": self.actor_id, "engine_version": self._engine.version,
                "rollouts_held": self._spool.held, "loss_epoch": self._loss_epoch,
                "rejected": self._spool.refused, "env_counters": dict(self.env_counters),
                "weight_sync_mode": self._engine.weight_sync_mode if self._feeding else "off",
                "engine_counters": self._engine.weight_sync_counters(),
                # how versions arrived: shm_loads, grpc_loads, shm_fallback_<why> (client.py)
                "weight_transport_counters": dict(getattr(self._variables, "counters", {})),
                "time": time.time()})

    def run(self) -> None:
        if self._feeding:
            logging.info("actor %d: weight_sync_mode=%s: new versions reach generations in "
                         "flight", self.actor_id, self._engine.weight_sync_mode)
            self._feeder = threading.Thread(target=self._feed_weights, daemon=True,
                                            name=f"actor-{self.actor_id}-weights")
            self._feeder.start()
        try:
            self._run()
            if self._feeder_error is not None:
                raise self._feeder_error
            if self._delivery is not None:
                self._delivery.close(drain=True)
        except BaseException:
            self._stop.set()
            if self._delivery is not None:
                self._delivery.close(drain=False)   # what waits stays in the spool
            raise
        finally:
            if self._feeder is not None:
                self._stop.set()
                self._feeder.join(timeout=60.0)
            self._task.close()
            # The actor owns its sink. A Reverb writer left open is flushed by its C++
            # destructor with no timeout: collected at interpreter exit, after replay has
            # stopped, it waited forever for a confirmation (a hang, 1 exit in ~60).
            self._sink.close()
        self._write_stats()

    def _run(self) -> None:
        self._poll_acks(force=True)   # the loss epoch first: it decides what is sent again
        self._send_held()             # what a previous incarnation never sent
        while not self._stop.is_set() and self._variables.version < 0:
            self._maybe_update_weights(wait=False)   # no rollout with unknown weights
            self._poll_acks()
            time.sleep(0.05)
        # The learner reports its loss epoch before it publishes a version: with one published,
        # the epoch is known, so nothing is sent in an epoch about to end.
        self._poll_acks(force=True)
        last_stats = 0.0
        while not self._stop.is_set():
            if self._max_rollouts is not None and \
                    self.counters["rollouts_generated"] >= self._max_rollouts:
                break
            if self._delivery is not None:
                self._delivery.wait_for_room(self._actor_batch)
                if self._stop.is_set():
                    break
            self._poll_acks()
            self._maybe_update_weights()
            n = self._admitted()
            if n <= 0:
                self.counters["admission_waits"] += 1
                time.sleep(0.02)
                continue
            rollouts = run_episodes(self._engine, self._task, self.prompts_for(n), self._params,
                                    actor_id=self.actor_id, counters=self.env_counters,
                                    **self._episode_limits)
            with self._lock:
                self.counters["rollouts_generated"] += len(rollouts)
                self.counters["reward_sum"] += sum(r.total_reward for r in rollouts)
            self._deliver(self._spool_valid(rollouts))
            if time.time() - last_stats > 1.0:
                self._write_stats()
                last_stats = time.time()
