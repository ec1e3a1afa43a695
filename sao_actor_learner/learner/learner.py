"""The learner loop, the same for every algorithm (the algorithm is its advantage estimator).

One step:
  1. draw the batch (the sampler drops and counts rollouts staler than max_staleness);
  2. `estimator.estimate(batch)`: advantages (SAO: critic values and skip-observation GAE);
  3. `policy.step(batch, advantages)`: the policy optimizer step(s), against the rollout
     log-probs (DIS) or a recomputed old policy (PPO-clip, TIS, IcePop); with a shared-trunk
     value head its value loss joins the policy loss here (`estimator.joint_loss`);
  4. `estimator.update(batch, estimate)`: the critic's K steps (SAO), nothing (GRPO);
  5. version += 1; publish the weights and report progress (admission credit) to the variable
     server; log the step (with the seconds of 2, 3, 4 and the publish); checkpoint when due;
     then, with an in-process `evaluation` (evaluator=in_learner), evaluate the version when
     due, while this loop waits.

The version counts policy steps only. Before the first one the critic may train alone on the
initial policy's rollouts: value pretraining (a budget of rollouts fitted in epochs until a
held-out plateau, learner/value_pretraining.py) and critic warm-up (`warmup_steps`, a fixed
number of critic-only steps). Neither bumps the version, so those rollouts stay on-policy, and the
rollouts they consume are admission credit (like rollouts dropped as stale), reported as small
progress messages, never by re-sending weights.

Exactly once, end to end: actors keep every rollout until the learner acknowledges it (the
acknowledgements travel with each progress report), and re-insert what is not acknowledged when
the learner reports a new loss epoch: when it starts (what its predecessor had in transit may
be gone) and when its connection to replay broke (a replay restart). The sampler skips every
key already consumed, so at-least-once delivery trains each rollout once.

In a learner group every rank runs this loop on its share of each batch; rank 0 alone
publishes, reports, logs and writes checkpoints. The ranks exchange the keys of each batch
before training (a key two ranks drew is kept by the lower rank; the other draws again) and
after it, so every rank skips what any rank consumed. `update(batch)` is the math of steps 2-4 on a
collated batch and needs no replay or network: tests drive it directly.

Checkpoints (`save_checkpoint`): checkpoints/step_<version>/ holds the policy as a Hugging Face
model directory and learner_state.pt (optimizers, critic, estimator and sampler state, counters,
RNG states) and manifest.json (each file's size and sha256), fsynced and renamed into place
(learner/checkpoint_files.py); the rollout source's journal is rotated with it
(core.RolloutSource.checkpoint), so a restarted learner resumes from the newest intact one and
redoes the journalled steps exactly (learner/journal.py).
"""
from __future__ import annotations

import os
import random
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from absl import logging

from sao_actor_learner import core
from sao_actor_learner.learner import distributed, drift
from sao_actor_learner.learner.estimators import AdvantageEstimator
from sao_actor_learner.learner.checkpoint_files import write_checkpoint
from sao_actor_learner.learner.disk_bounds import checkpoint_due
from sao_actor_learner.learner.journal import (LEARNER_STATE_FILE, checkpoint_path,
                                               prune_checkpoints)
from sao_actor_learner.learner.policy import PolicyTrainer
from sao_actor_learner.learner.sampling import RolloutSampler
from sao_actor_learner.models.checkpoint import save_checkpoint, sync_state_dict
from sao_actor_learner.models.lora import save_adapter
from sao_actor_learner.types import Batch, Rollout, collate


class Learner(core.Worker, core.VariableSource):
    """Trains a policy with `estimator`'s advantages on batches from `sampler`.

    Args:
      policy: the PolicyTrainer (the model, its optimizer, the policy step).
      estimator: the AdvantageEstimator (critic + GAE, group normalisation, a tracked baseline).
      sampler: a RolloutSampler (or GroupSampler) over the learner's RolloutSource.
      max_steps: policy versions to train.
      batch_size: rollouts per step on this rank (its share of the group's batch).
      value_pretraining: a learner.value_pretraining.ValuePretraining (the critic fitted on a
        budget of the initial policy's rollouts before the first policy step) or None.
      yardstick: a CriticYardstick (the critic's EV on fixed held-out rollouts at a cadence)
        or None; value pretraining gives one from its held-out part when this is None.
      warmup_steps: critic-only steps before the first policy step (after value pretraining);
        they and value pretraining need an estimator with a critic.
      checkpoint_every: save every this many versions (0: only at the end); needs
        checkpoint_root.
      publisher: a variables.VariablePublisher (publish, report_progress) or None.
      serialize: state dict -> payload buffers for the publisher.
      logger: a MetricsLogger (write(row)) or None.
      checkpoint_root: where checkpoints go (None: none are written).
      tokenizer: saved with each checkpoint so it is a model directory.
      keep_checkpoints: the newest kept (0: all).
      pad_id: the id padding batches.
      journal_max_bytes: also checkpoint once the journal since the newest checkpoint holds
        this many bytes (all ranks together; 0: no limit), which bounds the journal.
      collective: the learner group.
      evaluation: called as evaluation(version, weights) after version 0 is published and
        after every step (rank 0), `weights()` giving the policy's sync state dict; it
        evaluates when the version is due (actors/evaluator.InLearnerEvaluation) and returns
        whether it did. None: evaluation is another node's (or off).
    """

    def __init__(self, policy: PolicyTrainer, estimator: AdvantageEstimator,
                 sampler: RolloutSampler, *, max_steps: int, batch_size: int,
                 value_pretraining=None, yardstick=None, critic_eval_every: int = 0,
                 warmup_steps: int = 0,
                 checkpoint_every: int = 0, publisher=None,
                 serialize: Optional[Callable[[dict], object]] = None, logger=None,
                 checkpoint_root: Optional[str] = None, tokenizer: Optional[core.Tokenizer] = None,
                 keep_checkpoints: int = 0, pad_id: int = 0, journal_max_bytes: int = 0,
                 collective: distributed.Collective = distributed.SINGLE,
                 evaluation: Optional[Callable[[int, Callable[[], dict]], bool]] = None):
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
        self._publisher = publisher if main else None
        self._serialize = serialize
        self._logger = logger if main else None
        self._checkpoint_root = checkpoint_root
        self._tokenizer = tokenizer
        self._keep = keep_checkpoints
        self.journal_max_bytes = journal_max_bytes
        self.pad_id = pad_id
        self._stop = threading.Event()
        self._report_lock = threading.Lock()
        self._start_time = time.time()
        self.version = 0                 # policy steps done = policy version
        self.critic_only_steps = 0       # value-pretraining and warm-up steps done
        self.warmup_done = 0             # of which warm-up steps
        self.consumed_without_version = 0  # rollouts those steps consumed (admission credit)
        self.rollouts_trained = 0
        self.pretrain_done = False
        self.resumed_from: Optional[int] = None   # version of the checkpoint resumed from
        self.resume_publish_conflicts = 0         # republished versions the server refused
        self.checkpointed_version: Optional[int] = None
        self.loss_epoch = 0              # bumped when rollouts in transit may have been lost
        self._interruptions_seen = 0
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
        """Estimate, policy step (unless not train_policy), estimator update; statistics. Does
        not bump the version. The batch moves to the policy's device."""
        batch = batch.to(self.policy_trainer.device)
        t0 = time.perf_counter()
        estimate = self.estimator.estimate(batch)
        t1 = time.perf_counter()
        stats: Dict[str, float] = dict(estimate.stats)
        if train_policy:
            stats["policy_lr"] = self.policy_trainer.set_learning_rate(self.version,
                                                                       self.max_steps)
            stats.update(self.policy_trainer.step(
                batch, estimate.advantages, joint=self.estimator.joint_loss(batch, estimate)))
        t2 = time.perf_counter()
        stats.update(self.estimator.update(batch, estimate))
        t3 = time.perf_counter()
        # Where the step's compute went (docs/METHOD.md section 11): the estimate (the critic's
        # or shared head's values without gradient, GAE), the policy step (with a shared head
        # its value loss too), the estimator's own update (the K critic steps).
        stats.update({"estimate_s": t1 - t0, "policy_step_s": t2 - t1, "critic_step_s": t3 - t2})
        mask = batch.action_mask.bool()
        n, s = self.collective.sum([float(mask.sum()), float(estimate.advantages[mask].sum())])
        stats["advantage_mean"] = s / n if n else 0.0
        return stats

    # --- progress: admission credit, publishing -------------------------------------------------
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

    def _on_drop(self, rollouts: List[Rollout]) -> None:
        """The sampler dropped stale rollouts: count them group-wide and report the credit at
        once (actors that filled their admission quota with them would otherwise wait for a
        version that never comes)."""
        if self.collective.world_size > 1:
            self.collective.counter_total("dropped", len(rollouts))
        self.report_progress()

    def report_progress(self) -> None:
        """Sends the admission credit and counters to the variable server (rank 0; a small
        message, no weights)."""
        if self._publisher is None:
            return
        with self._report_lock:
            try:
                result = self._publisher.report_progress(
                    version=self.version, dropped_total=self.credit,
                    trained_total=self.rollouts_trained,
                    loss_epoch=self.loss_epoch, acks=self.sampler.consumed.acks())
            except Exception as e:   # the variable server is away (restarting): next time
                logging.log_every_n_seconds(logging.WARNING, "progress report failed: %s", 30, e)
                return
        return result

    def start_loss_epoch(self) -> None:
        """Starts a new loss epoch (above any the server holds) and reports it: actors re-insert
        every rollout they still hold that was sent before it."""
        self.loss_epoch += 1
        result = self.report_progress()
        if result is not None and result.loss_epoch >= self.loss_epoch and \
                result.loss_epoch != self.loss_epoch:
            self.loss_epoch = result.loss_epoch + 1      # a predecessor got further
            self.report_progress()
        logging.info("learner: loss epoch %d", self.loss_epoch)

    def _check_replay_interruptions(self) -> None:
        """A broken replay stream (replay restarted, or the network), or items taken from the
        table by someone else (replay/loss.py): start a loss epoch."""
        interruptions = self.source.interruptions
        if interruptions > self._interruptions_seen:
            self._interruptions_seen = interruptions
            logging.warning("learner: replay lost rollouts (the stream broke, or items left the "
                            "table that the learner never fetched; %d times so far): starting a "
                            "loss epoch", interruptions)
            self.start_loss_epoch()

    def publish(self) -> None:
        """Publishes the current version's weights (rank 0)."""
        if self._publisher is None:
            return
        payload = self._serialize(sync_state_dict(self.policy))
        try:
            self._publisher.publish(self.version, payload, dropped_total=self.credit)
        except Exception as e:
            # A resumed learner redoes the steps its crashed predecessor published (journal.py):
            # the server refuses versions older than its newest ("not newer") and accepts its
            # newest again only with identical weights; anything else means the redo diverged.
            code = getattr(getattr(e, "code", None), "name", "")
            if self.resumed_from is None or code != "FAILED_PRECONDITION":
                raise
            if "different payload" in str(e):
                self.resume_publish_conflicts += 1
                logging.warning("resumed learner: version %d differs from the one published "
                                "before the crash (the redo diverged): %s", self.version, e)
            else:
                logging.info("resumed learner: version %d was published before the crash",
                             self.version)

    def log(self, row: dict) -> None:
        """Writes a metrics row (rank 0)."""
        if self._logger is not None:
            self._logger.write(row)

    # --- steps ----------------------------------------------------------------------------------
    def critic_only_step(self, kind: str) -> Dict[str, float]:
        """One critic-only step (value pretraining or warm-up) on a fresh batch; the version
        does not change."""
        rollouts, _, _ = self.sampler.sample(self.batch_size, self.version, self._stop)
        if not rollouts:
            return {}
        stats = self.update(collate(rollouts, self.pad_id), train_policy=False)
        self.critic_only_steps += 1
        self.warmup_done += kind == "critic_warmup"
        self.consumed_without_version += int(self.collective.sum([len(rollouts)])[0])
        stats = {f"{kind}_step": self.critic_only_steps, "policy_version": self.version, **stats}
        self.log({"kind": kind, **stats})
        self.report_progress()
        return stats

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
        """Value pretraining (learner/value_pretraining.py); its held-out part becomes the
        critic's yardstick when there is none."""
        out = self.value_pretraining.run(self)
        if out:
            self.value_pretrain_summary = out["summary"]
            if self.yardstick is None:
                from sao_actor_learner.learner.value_pretraining import CriticYardstick
                self.yardstick = CriticYardstick(out["heldout"], self.critic_eval_every,
                                                 self.pad_id)
        return self.value_pretrain_summary

    def measure_critic(self, final: bool = False) -> None:
        """The critic's EV on the yardstick's rollouts when due (every rank: collective)."""
        if self.yardstick is None or not self.yardstick.due(self.version, final):
            return
        self.log({"kind": "critic_eval", "policy_version": self.version,
                  **self.yardstick.measure(self.estimator, self.version)})

    def draw(self, count: int = 0) -> Tuple[List[Rollout], float, int]:
        """This rank's rollouts of the next batch (or `count` of them), (rollouts, seconds
        waited, dropped now); in a group no key is drawn by two ranks (module docstring)."""
        want = count or self.batch_size
        rollouts, waited, dropped = self.sampler.sample(want, self.version, self._stop)
        while self.collective.world_size > 1:
            drawn = self.collective.gather_objects([r.key for r in rollouts])
            taken = {k for keys in drawn[:self.collective.rank] for k in keys}
            mine = [r for r in rollouts if r.key not in taken]
            short = self.collective.max([len(rollouts) - len(mine)])[0]
            if not short:
                break
            self.sampler.duplicates += len(rollouts) - len(mine)
            more, w, d = self.sampler.sample(want - len(mine), self.version, self._stop)
            rollouts, waited, dropped = mine + more, waited + w, dropped + d
        return rollouts, waited, dropped

    def _share_consumed(self) -> None:
        """Group: every rank adds every rank's consumed keys (taken and dropped since the last
        exchange), so duplicates are skipped wherever they arrive."""
        if self.collective.world_size == 1:
            return
        for state in self.collective.gather_objects(self.sampler.consumed.state_dict()):
            self.sampler.consumed.merge(state)

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
            **self._integrity_counters(),
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

    def _integrity_counters(self) -> Dict[str, int]:
        """Group-wide counts of what the learner refused to train on: duplicates (keys already
        consumed), rollouts from the future, and replay items the reader refused, by reason."""
        refused = self.source.rejected
        names = sorted(set().union(*self.collective.gather_objects(sorted(refused))))
        values = self.collective.sum([self.sampler.duplicates, self.sampler.from_future] +
                                     [refused.get(n, 0) for n in names])
        out = {"duplicates_skipped": int(values[0]), "refused_version_from_future": int(values[1])}
        out.update({f"refused_{n}": int(v) for n, v in zip(names, values[2:])})
        out["refused_total"] = sum(v for k, v in out.items() if k.startswith("refused_"))
        return out

    def _batch_stats(self, batch: Batch, rollouts: Sequence[Rollout],
                     version: int) -> Dict[str, float]:
        """Staleness (with the per-rollout version spans, drift.py), reward and length
        statistics of the whole group's batch."""
        mask = batch.action_mask.bool()
        token_staleness = (version - batch.versions)[mask].double()
        staleness = [r.staleness(version) for r in rollouts]
        rewards = [r.total_reward for r in rollouts]
        parts = self.collective.gather_objects(
            (staleness, rewards, float(token_staleness.sum()), int(token_staleness.numel()),
             float(mask.sum(1).double().sum()), drift.version_spans(batch.versions, mask)))
        staleness = [s for p in parts for s in p[0]]
        spans = [s for p in parts for s in p[5]]
        rewards = np.array([r for p in parts for r in p[1]])
        n_tokens = sum(p[3] for p in parts)
        hist = np.bincount(np.array(staleness, dtype=np.int64),
                           minlength=self.sampler.max_staleness + 1)
        return {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "staleness_mean": sum(p[2] for p in parts) / n_tokens if n_tokens else 0.0,
            "staleness_max": int(max(staleness)), "staleness_hist": hist.tolist(),
            "response_length_mean": sum(p[4] for p in parts) / len(staleness),
            "batch_size": len(staleness), **drift.staleness_stats(staleness, spans),
        }

    def run(self) -> None:
        self._start_time = time.time()
        self._interruptions_seen = self.source.interruptions
        self.start_loss_epoch()   # a predecessor's rollouts in transit may be lost
        self.publish()   # version 0: the warm start (or the version resumed from)
        self._evaluate()
        if not self.pretrain_done:
            if self.value_pretraining is not None:
                self.pretrain_value()
            while self.warmup_done < self.warmup_steps and not self._stop.is_set():
                self.critic_only_step("critic_warmup")
            self.pretrain_done = not self._stop.is_set()
        self.measure_critic()
        while self.version < self.max_steps and not self._stop.is_set():
            self.step()
            self.measure_critic()
        if not self._stop.is_set():
            self.measure_critic(final=True)
        if self._checkpoint_root is not None and self.version > 0:
            self.save_checkpoint()
        close = getattr(self._evaluation, "close", None)
        if close is not None:
            close()
        if self._logger is not None:
            self._logger.close()   # its trackers log every queued row and end their runs
        logging.info("learner finished at version %d (%d rollouts trained, %d dropped stale)",
                     self.version, self.rollouts_trained, self.dropped_stale)

    # --- state and checkpoints ------------------------------------------------------------------
    def learner_state(self) -> dict:
        """Everything but the policy weights that a resumed learner needs to continue exactly."""
        return {
            "version": self.version, "policy": self.policy_trainer.state_dict(),
            "estimator": self.estimator.state_dict(),
            # Every rank's sampler (its share's counters, its group assembler): a collective.
            "samplers": self.collective.gather_objects(self.sampler.state_dict()),
            "critic_only_steps": self.critic_only_steps, "warmup_done": self.warmup_done,
            "loss_epoch": self.loss_epoch,
            "consumed_without_version": self.consumed_without_version,
            "rollouts_trained": self.rollouts_trained, "pretrain_done": self.pretrain_done,
            "value_pretrain_summary": self.value_pretrain_summary,
            # This rank's yardstick rollouts (value pretraining's held-out part) and readings.
            "yardstick": (None if self.yardstick is None else
                          {"rollouts": self.yardstick.rollouts,
                           "measured": dict(self.yardstick.measured)}),
            # The group's totals (rank 0's sampler state counts only its own share).
            "group_totals": dict(zip(("dropped", "from_future", "duplicates"), map(int, (
                self.collective.sum([self.sampler.dropped, self.sampler.from_future,
                                     self.sampler.duplicates]))))),
            # For accounting: rollouts taken from replay that no step has used yet.
            "reader_buffered": self.source.buffered,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                    "python": random.getstate()},
        }

    def restore(self, state: dict) -> None:
        """Loads `learner_state()` output (the policy weights are loaded separately)."""
        self.estimator.load_state_dict(state["estimator"])
        self.policy_trainer.load_state_dict(state["policy"])
        samplers = state["samplers"]
        self.sampler.load_state_dict(samplers[self.collective.rank] if
                                     self.collective.rank < len(samplers) else samplers[0])
        self.version = int(state["version"])
        self.critic_only_steps = int(state.get("critic_only_steps", 0))
        self.warmup_done = int(state.get("warmup_done", 0))
        self.loss_epoch = int(state.get("loss_epoch", 0))
        self.consumed_without_version = int(state.get("consumed_without_version", 0))
        self.rollouts_trained = int(state["rollouts_trained"])
        self.pretrain_done = bool(state.get("pretrain_done", self.version > 0))
        self.value_pretrain_summary = dict(state.get("value_pretrain_summary") or {})
        yard = state.get("yardstick")
        if yard is not None and self.yardstick is None and yard["rollouts"]:
            from sao_actor_learner.learner.value_pretraining import CriticYardstick
            self.yardstick = CriticYardstick(yard["rollouts"], self.critic_eval_every,
                                             self.pad_id)
        if yard is not None and self.yardstick is not None:
            self.yardstick.measured.update(yard["measured"])
        if self.collective.world_size > 1:   # the group's store counts anew: add this rank's
            self.collective.counter_total("dropped", self.sampler.dropped)
        rng = state.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            np.random.set_state(rng["numpy"])
            random.setstate(rng["python"])
        self.resumed_from = self.version

    def _journal_bytes(self) -> int:
        """Bytes journalled since the newest checkpoint, all ranks together (a collective)."""
        return int(self.collective.sum([self.source.journal_bytes()])[0])

    def save_checkpoint(self) -> Optional[str]:
        """Writes checkpoints/step_<version>/ (see the module docstring) with the journal
        rotated; every rank must call it. Returns the path (rank 0) or None."""
        if self._checkpoint_root is None:
            return None
        step = self.version
        path = checkpoint_path(self._checkpoint_root, step)
        if self.checkpointed_version == step:
            return path
        weights = distributed.full_state_dict(self.policy)   # a collective under fsdp2
        state = self.learner_state()

        def commit() -> Optional[str]:
            self.collective.barrier()          # every rank's new journal segment is on disk
            if self.collective.is_main:
                def write(tmp: str) -> None:   # into step_<N>.tmp-<pid>, marked (run_dirs.py)
                    save_checkpoint(_WithStateDict(self.policy, weights), self._tokenizer, tmp)
                    save_adapter(self.policy, tmp)   # LoRA: adapter/ in PEFT's format
                    torch.save(state, os.path.join(tmp, LEARNER_STATE_FILE))
                # then manifest, fsync, rename; CheckpointWriteError naming it when the disk is
                # full (checkpoint_files.py)
                write_checkpoint(path, write)
            self.collective.barrier()          # the checkpoint is complete before old segments go
            return path

        result = self.source.checkpoint(step, commit)
        self.checkpointed_version = step
        if self.collective.is_main:
            prune_checkpoints(self._checkpoint_root, self._keep)
        return result if self.collective.is_main else None


class _WithStateDict:
    """`model` for save_pretrained, with `weights` (gathered on rank 0) as its state dict."""

    def __init__(self, model: torch.nn.Module, weights: dict):
        self._model, self._weights = model, weights

    def get_input_embeddings(self):
        return self._model.get_input_embeddings()

    def save_pretrained(self, path: str, **kwargs) -> None:
        self._model.save_pretrained(path, state_dict=self._weights, **kwargs)
