"""The actor node: prompt -> one rollout -> reward -> spool -> replay, with fresh weights.

One straight data path per generated batch, in `Actor._run`:
  1. admission (`_admitted`; docs/METHOD.md: no rollout is started that would be too stale when
     consumed): the variable server says how many rollouts may start, and at which version;
     the engine is moved to that version first (`EngineWeights.catch_up`);
  2. `run_episodes`: one rollout per admitted prompt (multi-turn with tools where the task has
     them; each prompt G times in group mode);
  3. the outbox (actors/outbox.py) checks, spools and sends the batch to replay (at once, or
     after its injected delay: actors/delivery.py), and, continually, forgets what the learner
     acknowledged and sends again what a new loss epoch lost.

The actor is three jobs, a class each: this generation loop; weight following
(actors/engine_weights.py: the engine takes the versions the variable client fetches in the
background, between batches or, with weight_sync_mode keep/abort, while a batch is generated);
and the outbox. All three talk to the variable server through one core.ActorCoordination (a
variables.VariableClient).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional

import numpy as np
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.actors.delivery import default_max_waiting
from sao_actor_learner.actors.engine_weights import EngineWeights
from sao_actor_learner.actors.outbox import Outbox
from sao_actor_learner.actors.rollout import run_episodes
from sao_actor_learner.actors.spool import RolloutSpool
from sao_actor_learner.observers.metrics import write_json_atomic
from sao_actor_learner.variables.channel import VariableClientError


# How long an actor sleeps before asking again when admission granted nothing.
ADMISSION_RETRY_S = 0.02


class Actor(core.Worker):
    """Generates rollouts with the newest policy it has and delivers them to replay.

    Args:
      actor_id: this actor's id (stamped on every rollout).
      task: the Task prompts come from.
      engine: the Engine that samples.
      variables: the actor's core.ActorCoordination (weights, admission, acknowledgements): a
        variables.VariableClient.
      sink: a core.RolloutSink (the replay writer: `check`, `send`); the actor closes it.
      decode: params -> state_dict, to load fetched weights into the engine.
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
      lags: with forced staleness, an actors/lags.LagSampler drawing each batch's lag (its mean
        is k); None: the constant k.
      max_waiting: with delays, the most rollouts waiting at once; None: 4 actor batches.
      ack_period_s: how often the actor asks which of its rollouts the learner consumed.
      weight_poll_s: with engine.weight_sync_mode keep/abort, how often the weight thread
        looks for a new version (the variable client's update period).
    """

    def __init__(self, actor_id: int, task: core.Task, engine: core.Engine,
                 variables: core.ActorCoordination, sink: core.RolloutSink,
                 decode: Callable, params: core.SamplingParams,
                 spool: RolloutSpool, actor_batch: int = 8, admission_control: bool = True,
                 seed: int = 0, max_turns: int = 1, max_total_tokens: int = 1 << 30,
                 env_threads: int = 1, stats_path: Optional[str] = None,
                 max_rollouts: Optional[int] = None, group_size: int = 1,
                 delay_sampler=None, forced_staleness: int = -1,
                 max_waiting: Optional[int] = None, ack_period_s: float = 0.5,
                 weight_poll_s: float = 0.05, lags=None):
        if group_size < 1 or forced_staleness < -1:
            raise ValueError(f"group_size={group_size}, forced_staleness={forced_staleness}: "
                             "need group_size >= 1 and forced_staleness >= -1")
        max_waiting = default_max_waiting(actor_batch) if max_waiting is None \
            else int(max_waiting)
        if max_waiting < actor_batch:
            raise ValueError(f"max_waiting={max_waiting}: must be >= actor_batch ({actor_batch})"
                             ", else no batch could ever be handed to delivery")
        self.actor_id = actor_id
        self._task, self._engine, self._variables = task, engine, variables
        self._params = params
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
        self._stop = threading.Event()
        self._lock = threading.Lock()        # the loop's counters
        self._weights = EngineWeights(engine, variables, decode, forced_staleness,
                                      weight_poll_s, self._stop,
                                      thread_name=f"actor-{actor_id}-weights", lags=lags)
        self._feeding = self._weights.feeding
        self._outbox = Outbox(actor_id, sink, spool, variables, self._stop, delay_sampler,
                              max_waiting, ack_period_s)
        self._loop_counters: Dict[str, float] = {
            "rollouts_generated": spool.completed + sum(spool.refused.values()),
            "admission_waits": 0, "admission_wait_s": 0.0, "reward_sum": 0.0}
        self._admit_failures = 0
        # A restarted actor continues its prompt stream after the prompts its previous
        # incarnations used, instead of drawing the same prompts (and ids) again.
        for _ in range(int(self._loop_counters["rollouts_generated"]) // group_size):
            task.sample_prompt(self._rng)

    @property
    def counters(self) -> Dict[str, float]:
        """The actor's counters so far: rollouts_generated, rollouts_inserted, rollouts_resent,
        rollouts_acknowledged, admission_waits (and admission_wait_s: seconds the loop slept
        for want of admission, the staleness limit or lock-step), weight_updates (and
        weight_load_s: seconds spent putting versions into the engine), weights_offered,
        reward_sum, injected_delay_s (a snapshot)."""
        with self._lock:
            counters = dict(self._loop_counters)
        return {**counters, **self._outbox.counters, **self._weights.counters}

    def stop(self) -> None:
        self._stop.set()
        self._outbox.notify_stop()

    # --- admission --------------------------------------------------------------------------------
    def _admitted(self) -> int:
        """How many rollouts this actor may start now.

        Admission counts a rollout started at version v as trainable until version v + eta. That
        holds only if the engine already runs version v, so when the server's version is ahead of
        the engine's, the actor first waits for (and loads) those weights.
        """
        # Without admission control the server grants every request in full, but the actor
        # still asks: the grants bound what the learner's reports may acknowledge for it
        # (variables/progress.beyond_admitted).
        owed = self._outbox.owed_releases()
        self._spool.asking(self._actor_batch)
        try:
            decision = self._variables.admit_details(str(self.actor_id), self._actor_batch,
                                                     released=owed)
        except VariableClientError as e:
            if not e.retryable:
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
        self._outbox.released(owed)
        self._spool.admitted(decision.granted)
        if self._admission and decision.granted:
            self._weights.catch_up(decision.policy_version)
        return decision.granted

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
            write_json_atomic(self._stats_path, {
                **self.counters, "actor_id": self.actor_id,
                "engine_version": self._engine.version,
                "forced_lag_hist": list(self._weights.lag_hist),   # lags drawn, by lag
                "rollouts_held": self._spool.held, "loss_epoch": self._outbox.loss_epoch,
                "rejected": self._spool.refused, "env_counters": dict(self.env_counters),
                "weight_sync_mode": self._engine.weight_sync_mode if self._feeding else "off",
                "engine_counters": self._engine.weight_sync_counters(),
                # how versions arrived: shm_loads, grpc_loads, shm_fallback_<why> (client.py)
                "weight_transport_counters": dict(self._variables.counters),
                "time": time.time()})

    def run(self) -> None:
        if self._feeding:
            logging.info("actor %d: weight_sync_mode=%s: new versions reach generations in "
                         "flight", self.actor_id, self._engine.weight_sync_mode)
        self._weights.start()
        try:
            self._run()
            if self._weights.error is not None:
                raise self._weights.error
            self._outbox.finish(drain=True)
        except BaseException:
            self._stop.set()
            self._outbox.finish(drain=False)   # what waits stays in the spool
            raise
        finally:
            if self._feeding:
                self._stop.set()
                self._weights.join(timeout_s=60.0)
            self._task.close()
            self._outbox.close()   # the actor owns its sink
        self._write_stats()

    def _run(self) -> None:
        self._outbox.poll_acks(force=True)   # the loss epoch first: it decides what is sent again
        self._outbox.send_held()             # what a previous incarnation never sent
        while not self._stop.is_set() and self._variables.version < 0:
            self._weights.update(wait=False)   # no rollout with unknown weights
            self._outbox.poll_acks()
            time.sleep(0.05)
        # The learner reports its loss epoch before it publishes a version: with one published,
        # the epoch is known, so nothing is sent in an epoch about to end.
        self._outbox.poll_acks(force=True)
        last_stats = 0.0
        while not self._stop.is_set():
            with self._lock:
                generated = self._loop_counters["rollouts_generated"]
            if self._max_rollouts is not None and generated >= self._max_rollouts:
                break
            self._outbox.wait_for_room(self._actor_batch)
            if self._stop.is_set():
                break
            self._outbox.poll_acks()
            self._weights.update()
            n = self._admitted()
            if n <= 0:
                t_wait = time.monotonic()
                time.sleep(ADMISSION_RETRY_S)
                with self._lock:
                    self._loop_counters["admission_waits"] += 1
                    self._loop_counters["admission_wait_s"] += time.monotonic() - t_wait
                continue
            rollouts = run_episodes(self._engine, self._task, self.prompts_for(n), self._params,
                                    actor_id=self.actor_id, counters=self.env_counters,
                                    **self._episode_limits)
            with self._lock:
                self._loop_counters["rollouts_generated"] += len(rollouts)
                self._loop_counters["reward_sum"] += sum(r.total_reward for r in rollouts)
            self._outbox.accept(rollouts)
            if time.time() - last_stats > 1.0:
                self._write_stats()
                last_stats = time.time()
