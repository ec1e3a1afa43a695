"""The learner loop, the same for every algorithm (the algorithm is its advantage estimator).

One step:
  1. draw the batch (the sampler drops and counts rollouts staler than max_staleness);
  2. `estimator.estimate(batch)`: advantages (SAO: critic values and skip-observation GAE);
  3. `policy.step(batch, advantages)`: the policy optimizer step(s), against the rollout
     log-probs (DIS) or a recomputed old policy (PPO-clip, TIS, IcePop); with a shared-trunk
     value head its value loss joins the policy loss here (`estimator.joint_loss`);
  4. `estimator.update(batch, estimate)`: the critic's K steps (SAO), nothing (GRPO); with
     critic_concurrent during step 3 in a thread of its own (learner/critic_worker.py);
  5. version += 1; publish the weights and report progress (admission credit) to the variable
     server; log the step (with the seconds of 2, 3, 4 and the publish); checkpoint when due;
     then, with an in-process `evaluation` (evaluator=in_learner), evaluate the version when
     due, while this loop waits.

The version counts policy steps only. Before the first one the critic may train alone on the
initial policy's rollouts: value pretraining (learner/value_pretraining.py) and critic warm-up
(`warmup_steps` critic-only steps). Neither bumps the version, so those rollouts stay on-policy,
and the rollouts they consume are admission credit (like rollouts dropped as stale), reported
as small progress messages, never by re-sending weights.

Exactly once, end to end: actors keep every rollout until the learner acknowledges it (the
acknowledgements travel with each progress report), and re-insert what is not acknowledged when
the learner reports a new loss epoch: when it starts (what its predecessor had in transit may
be gone) and when its connection to replay broke (a replay restart). The sampler skips every
key already consumed, so at-least-once delivery trains each rollout once.

In a learner group every rank runs this loop on its share of each batch; rank 0 alone
publishes, reports, logs and writes checkpoints. The ranks exchange the keys of each batch
before training (a key two ranks drew is kept by the lower rank; the other draws again) and
after it, so every rank skips what any rank consumed (learner/group_keys.py). `update(batch)` is
the math of steps 2-4 on a collated batch and needs no replay or network: tests drive it
directly.

Its parts: learner/critic_phases.py (value pretraining, warm-up), progress.py (publishing,
progress reports, loss epochs), group_keys.py (the key exchange between ranks), step_stats.py
(staleness, reward and integrity statistics), checkpointing.py (the learner state, checkpoints).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.learner import (checkpointing, critic_phases, distributed, group_keys,
                                       step_stats)
from sao_actor_learner.learner.critic_worker import CriticUpdate
from sao_actor_learner.learner.disk_bounds import checkpoint_due
from sao_actor_learner.learner.estimator_base import AdvantageEstimator
from sao_actor_learner.learner.policy import PolicyTrainer
from sao_actor_learner.learner.progress import LearnerProgress
from sao_actor_learner.learner.sampling import RolloutSampler
from sao_actor_learner.models.checkpoint import sync_state_dict
from sao_actor_learner.types import Batch, Rollout, collate


class Learner(core.Learner):
    """Trains a policy with `estimator`'s advantages on batches from `sampler`.

    Args:
      policy: the PolicyTrainer (the model, its optimizer, the policy step).
      estimator: the AdvantageEstimator (critic + GAE, group normalisation, a tracked baseline).
      sampler: a RolloutSampler (or GroupSampler) over the learner's RolloutSource.
      max_steps: policy versions to train.
      batch_size: rollouts per step on this rank (its share of the group's batch).
      value_pretraining: a learner.value_pretraining.ValuePretraining or None.
      yardstick: a CriticYardstick (the critic's EV on fixed held-out rollouts) or None;
        value pretraining gives one from its held-out part when this is None.
      warmup_steps: critic-only steps before the first policy step (after value pretraining);
        they and value pretraining need an estimator with a critic.
      checkpoint_every: save every this many versions (0: only at the end).
      publisher: a core.WeightPublisher or None; used on rank 0 only (learner/progress.py).
      serialize: state dict -> payload buffers for the publisher.
      logger: a MetricsLogger (write(row), close()) or None.
      checkpoint_root: where checkpoints go (None: none are written).
      tokenizer: saved with each checkpoint so it is a model directory.
      keep_checkpoints: the newest kept (0: all).
      pad_id: the id padding batches.
      journal_max_bytes: also checkpoint once the journal holds this many bytes (0: no limit).
      collective: the learner group.
      evaluation: an actors.evaluator.InLearnerEvaluation or None: evaluation(version,
        weights) after version 0 is published and after every step (rank 0), `weights()` the
        policy's sync state dict; it evaluates when due and returns whether it did; closed when
        the run ends. None: evaluation is another node's (or off).
      critic_update: a critic_worker.CriticUpdate (the estimator's update, in sequence or
        concurrent with the policy step); None: in sequence.
    """

    def __init__(self, policy: PolicyTrainer, estimator: AdvantageEstimator,
                 sampler: RolloutSampler, *, max_steps: int, batch_size: int,
                 value_pretraining=None, yardstick=None, critic_eval_every: int = 0,
                 warmup_steps: int = 0,
                 checkpoint_every: int = 0, publisher: Optional[core.WeightPublisher] = None,
                 serialize: Optional[Callable[[dict], object]] = None, logger=None,
                 checkpoint_root: Optional[str] = None, tokenizer: Optional[core.Tokenizer] = None,
                 keep_checkpoints: int = 0, pad_id: int = 0, journal_max_bytes: int = 0,
                 collective: distributed.Collective = distributed.SINGLE,
                 evaluation=None, critic_update: Optional[CriticUpdate] = None):
        critic_only = value_pretraining is not None or warmup_steps
        if critic_only and not estimator.has_critic:
            raise ValueError(f"value pretraining or warmup_steps={warmup_steps}: "
                             f"{type(estimator).__name__} has no critic to train alone")
        if critic_only and estimator.critic.shares_trunk:
            raise ValueError(f"value pretraining or warmup_steps={warmup_steps}: a "
                             "value head on the policy's trunk cannot train alone without "
                             "moving the policy (critic=shared_trunk)")
        self.policy_trainer = policy
        self.estimator = estimator
        self.critic_update = critic_update or CriticUpdate(estimator)
        self.sampler = sampler
        self.max_steps = max_steps
        self.batch_size = batch_size
        self.value_pretraining = value_pretraining
        self.value_pretrain_summary: Dict[str, float] = {}
        self.yardstick = yardstick
        self.critic_eval_every = critic_eval_every
        self.warmup_steps = warmup_steps
        self.checkpoint_every = checkpoint_every
        self.collective = collective
        main = collective.is_main
        self.progress = LearnerProgress(publisher if main else None, serialize,
                                        self._progress_counters)
        self._logger = logger if main else None
        self._checkpoint_root = checkpoint_root
        self._tokenizer = tokenizer
        self._keep = keep_checkpoints
        self.journal_max_bytes = journal_max_bytes
        self.pad_id = pad_id
        self._stop = threading.Event()
        self._start_time = time.time()
        self.version = 0                 # policy steps done = policy version
        self.critic_only_steps = 0       # value-pretraining and warm-up steps done
        self.warmup_done = 0             # of which warm-up steps
        self.consumed_without_version = 0  # rollouts those steps consumed (admission credit)
        self.rollouts_trained = 0
        self.pretrain_done = False
        self.resumed_from: Optional[int] = None   # version of the checkpoint resumed from
        self.checkpointed_version: Optional[int] = None
        self._evaluation = evaluation if main else None
        self.in_learner_eval_s = 0.0     # seconds this loop spent evaluating (in_learner)
        sampler.on_drop = self._on_drop
        sampler.on_wait = self._check_replay_interruptions   # also while waiting for a batch

    @property
    def policy(self) -> torch.nn.Module:
        return self.policy_trainer.policy

    @property
    def source(self) -> core.RolloutSource:
        return self.sampler.source

    @property
    def dropped_stale(self) -> int:
        return self.sampler.dropped

    @property
    def resume_publish_conflicts(self) -> int:
        """Republished versions the server refused as different (learner/progress.py)."""
        return self.progress.resume_publish_conflicts

    @property
    def loss_epoch(self) -> int:
        """Bumped whenever rollouts in transit may have been lost (learner/progress.py)."""
        return self.progress.loss_epoch

    @loss_epoch.setter
    def loss_epoch(self, value: int) -> None:
        self.progress.loss_epoch = value

    # --- core interfaces ------------------------------------------------------------------------
    def get_variables(self) -> Tuple[int, dict]:
        return self.version, sync_state_dict(self.policy)

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # --- the math ---------------------------------------------------------------------------------
    def update(self, batch: Batch, train_policy: bool = True) -> Dict[str, float]:
        """Estimate, policy step (unless not train_policy), estimator update (concurrent with
        the policy step with critic_concurrent, joined before this returns); statistics. Does
        not bump the version. The batch moves to the policy's device."""
        batch = batch.to(self.policy_trainer.device)
        t0 = time.perf_counter()
        estimate = self.estimator.estimate(batch)
        t1 = time.perf_counter()
        stats: Dict[str, float] = dict(estimate.stats)
        self.critic_update.start(batch, estimate)   # concurrent: from now on, in its thread
        if train_policy:
            stats["policy_lr"] = self.policy_trainer.set_learning_rate(self.version,
                                                                       self.max_steps)
            stats.update(self.policy_trainer.step(
                batch, estimate.advantages, joint=self.estimator.joint_loss(batch, estimate)))
        t2 = time.perf_counter()
        stats.update(self.critic_update.join())   # concurrent: waits for the K critic steps
        # Where the step's compute went (docs/METHOD.md section 11): the estimate (the critic's
        # or shared head's values without gradient, GAE), the policy step (with a shared head
        # its value loss too), the estimator's own update (the K critic steps: critic_step_s,
        # of which critic_wait_s after the policy step; learner/critic_worker.py).
        stats.update({"estimate_s": t1 - t0, "policy_step_s": t2 - t1})
        mask = batch.action_mask.bool()
        n, s = self.collective.sum([float(mask.sum()), float(estimate.advantages[mask].sum())])
        stats["advantage_mean"] = s / n if n else 0.0
        return stats

    # --- progress: admission credit, publishing (learner/progress.py) ---------------------------
    @property
    def credit(self) -> int:
        """Rollouts admitted that will never count toward a version: dropped as too stale (by
        any rank) or consumed by critic-only steps."""
        return self.collective_dropped() + self.consumed_without_version

    def collective_dropped(self) -> int:
        """Rollouts dropped as too stale by every rank (a group keeps the sum in its store)."""
        if self.collective.world_size == 1:
            return self.sampler.dropped
        return int(self.collective.counter_total("dropped", 0))

    def _progress_counters(self) -> dict:
        return {"version": self.version, "dropped_total": self.credit,
                "trained_total": self.rollouts_trained, "acks": self.sampler.consumed.acks()}

    def _on_drop(self, rollouts: List[Rollout]) -> None:
        """The sampler dropped stale rollouts: count them group-wide and report the credit at
        once (actors that filled their admission quota with them would otherwise wait for a
        version that never comes)."""
        if self.collective.world_size > 1:
            self.collective.counter_total("dropped", len(rollouts))
        self.report_progress()

    def report_progress(self):
        """Sends the admission credit and counters to the variable server (rank 0; a small
        message, no weights); the server's answer or None."""
        return self.progress.report()

    def start_loss_epoch(self) -> None:
        """Starts a new loss epoch (above any the server holds) and reports it: actors re-insert
        every rollout they still hold that was sent before it."""
        self.progress.start_loss_epoch()

    def _check_replay_interruptions(self) -> None:
        """A broken replay stream, or items taken from the table by someone else: a loss epoch."""
        self.progress.notice_interruptions(self.source.interruptions)

    def publish(self) -> None:
        """Publishes the current version's weights (rank 0)."""
        self.progress.publish(self.version, distributed.sync_weights(self.policy),
                              dropped_total=self.credit, resumed=self.resumed_from is not None)

    def log(self, row: dict) -> None:
        """Writes a metrics row (rank 0)."""
        if self._logger is not None:
            self._logger.write(row)

    # --- steps ----------------------------------------------------------------------------------
    def draw_critic_only(self, count: int) -> List[Rollout]:
        """`count` rollouts of this rank for a critic-only phase (value pretraining): drawn a
        batch at a time, counted as admission credit and reported after each batch, so the
        actors keep producing; fewer when stopped."""
        rollouts: List[Rollout] = []
        while len(rollouts) < count and not self._stop.is_set():
            got, _, _ = self.draw(min(self.batch_size, count - len(rollouts)))
            rollouts.extend(got)
            self.consumed_without_version += int(self.collective.sum([len(got)])[0])
            self._share_consumed()
            self.report_progress()
        return rollouts

    def pretrain_value(self) -> Dict[str, float]:
        """Value pretraining; its summary (critic_phases.py)."""
        return critic_phases.pretrain_value(self)

    def measure_critic(self, final: bool = False) -> None:
        """The critic's EV on the yardstick's rollouts when due (every rank: collective)."""
        if self.yardstick is None or not self.yardstick.due(self.version, final):
            return
        self.log({"kind": "critic_eval", "policy_version": self.version,
                  **self.yardstick.measure(self.estimator, self.version)})

    def draw(self, count: int = 0) -> Tuple[List[Rollout], float, int]:
        """This rank's rollouts of the next batch (or `count` of them), (rollouts, seconds
        waited, dropped now); in a group no key is drawn by two ranks (group_keys.py)."""
        return group_keys.draw_exclusive(self.sampler, self.collective, count or self.batch_size,
                                         self.version, self._stop)

    def _share_consumed(self) -> None:   # every rank learns every rank's consumed keys
        group_keys.share_consumed(self.sampler, self.collective)

    def step(self) -> Dict[str, float]:
        """One policy step (see the module docstring); {} when stopped before a batch came."""
        t_start = time.time()
        replaying = self.source.replaying
        self._check_replay_interruptions()
        rollouts, waited, dropped = self.draw()
        if not rollouts:
            return {}
        batch = collate(rollouts, self.pad_id)
        stats = self.update(batch)
        trained_version = self.version
        self.version += 1
        self.rollouts_trained += int(self.collective.sum([len(rollouts)])[0])
        self._share_consumed()
        t_publish = time.perf_counter()
        self.publish()
        self.report_progress()
        stats["publish_s"] = time.perf_counter() - t_publish
        elapsed = time.time() - t_start
        stats.update(self._batch_stats(batch, rollouts, trained_version))
        tokens = self.collective.sum([float(batch.attention_mask.sum())])[0]
        stats.update({
            "step": self.version, "policy_version": self.version,
            "dropped_stale": self.collective_dropped(), "dropped_stale_step": dropped,
            "learner_wait_frac": waited / max(elapsed, 1e-9), "step_time_s": elapsed,
            "wait_s": waited, "in_learner_eval_s": self.in_learner_eval_s,
            "samples_per_s": len(rollouts) * self.collective.world_size / max(elapsed, 1e-9),
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            "queue_size": self.source.queue_size(), "rollouts_trained": self.rollouts_trained,
            "wall_time_s": time.time() - self._start_time,
            "dis_masked_frac": stats.get("masked_frac", 0.0),
            "learners": self.collective.world_size,
            "loss_epoch": self.loss_epoch,
            **step_stats.integrity_counters(self.source, self.sampler, self.collective),
        })
        if self.resumed_from is not None:
            stats.update({"resumed_from": self.resumed_from, "replayed": int(replaying),
                          "resume_publish_conflicts": self.resume_publish_conflicts})
        self.log(stats)
        if checkpoint_due(self.version, self.checkpoint_every, self._journal_bytes,
                          self.journal_max_bytes if self._checkpoint_root else 0):
            self.save_checkpoint()
        self._evaluate()
        return stats

    def _evaluate(self) -> None:
        """The in-process evaluation of the current version, when there is one and it is due;
        its seconds are counted (in_learner_eval_s of the next rows)."""
        if self._evaluation is None:
            return
        t = time.perf_counter()
        if self._evaluation(self.version, lambda: sync_state_dict(self.policy)):
            self.in_learner_eval_s += time.perf_counter() - t

    def _batch_stats(self, batch: Batch, rollouts: Sequence[Rollout],
                     version: int) -> Dict[str, float]:
        """The whole group's batch statistics for `version` (step_stats.py)."""
        return step_stats.batch_stats(batch, rollouts, version, self.sampler.max_staleness,
                                      self.collective)

    def run(self) -> None:
        self._start_time = time.time()
        self.progress.interruptions_seen = self.source.interruptions
        self.start_loss_epoch()   # a predecessor's rollouts in transit may be lost
        self.publish()   # version 0: the warm start (or the version resumed from)
        self._evaluate()
        if not self.pretrain_done:
            critic_phases.run_critic_phases(self, self._stop)
        self.measure_critic()
        while self.version < self.max_steps and not self._stop.is_set():
            self.step()
            self.measure_critic()
        if not self._stop.is_set():
            self.measure_critic(final=True)
        if self._checkpoint_root is not None and self.version > 0:
            self.save_checkpoint()
        self.critic_update.close()
        if self._evaluation is not None:
            self._evaluation.close()
        if self._logger is not None:
            self._logger.close()   # its trackers log every queued row and end their runs
        logging.info("learner finished at version %d (%d rollouts trained, %d dropped stale)",
                     self.version, self.rollouts_trained, self.dropped_stale)

    # --- state and checkpoints (checkpointing.py) -----------------------------------------------
    def learner_state(self) -> dict:
        """Everything but the policy weights that a resumed learner needs to continue exactly."""
        return checkpointing.learner_state(self)

    def restore(self, state: dict) -> None:
        """Loads `learner_state()` output (the policy weights are loaded separately)."""
        checkpointing.restore_learner_state(self, state)

    def _journal_bytes(self) -> int:
        """Bytes journalled since the newest checkpoint, all ranks together (a collective)."""
        return int(self.collective.sum([self.source.journal_bytes()])[0])

    def save_checkpoint(self) -> Optional[str]:
        """Writes checkpoints/step_<version>/ with the journal rotated (checkpointing.py); every
        rank must call it. Returns the path (rank 0) or None; None when there is no
        checkpoint_root."""
        if self._checkpoint_root is None:
            return None
        return checkpointing.save_checkpoint(self, self._checkpoint_root, self._tokenizer,
                                             self._keep)
