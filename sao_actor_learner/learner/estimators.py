"""Advantage estimators: what turns a batch into per-token advantages, and what they learn.

The learner loop (learner.py) is the same for every algorithm; the algorithm is its estimator:

  CriticGAE        SAO (docs/METHOD.md): a critic's values, skip-observation (or standard) GAE
                   with length-adaptive lambda for the policy and lambda_critic for the critic's
                   targets, optional bootstrap of truncated episodes; `update` runs K critic
                   optimizer steps on the same batch, values recomputed each time, attention
                   frozen; micro-batched and summed over the learner group like the policy step.
  SharedTrunkGAE   the same values and GAE from a value head on the policy's own trunk
                   (critic=shared_trunk, not SAO): the head is trained inside the policy step,
                   its value loss added to the policy loss (`joint_loss`), so the trunk gets
                   both gradients; no separate critic passes (K does not apply).
  GroupNormalized  GRPO: (R - mean_group R) / std_group R on every action token of a rollout.
  TrackedBaseline  the critic-free single-rollout baseline: R - b(prompt), b a running-mean or
                   per-prompt tracker read before the batch updates it.

`estimate(batch)` returns an `Estimate`; `joint_loss(batch, estimate)` is what the policy step
adds to its loss (None but for SharedTrunkGAE); `update(batch, estimate)` trains the estimator
(a no-op for GRPO) and returns its statistics. Statistics are whole-batch (and whole-group) numbers.
With a learner group every rank calls both on its share; the trackers see every rank's rewards,
so their state is the same on every rank.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Dict, Optional

import numpy as np
import torch
from absl import logging

from sao_actor_learner import kernels
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import advantages as adv_lib
from sao_actor_learner.learner import distributed, losses, minibatches, packing
from sao_actor_learner.learner.baselines import (baseline_stats, broadcast_to_action_tokens,
                                                 make_baseline, prompt_key, sequence_rewards)
from sao_actor_learner.learner.grpo import group_normalized_advantages
from sao_actor_learner.learner.policy import autocast, gather_rows
from sao_actor_learner.models.value import ValueModel
from sao_actor_learner.types import Batch


@dataclasses.dataclass
class Estimate:
    """advantages [B, T] (zero off action tokens); the critic's returns and values [B, T] when it
    has one, or the baseline [B] each rollout's reward was compared with; statistics."""
    advantages: torch.Tensor
    stats: Dict[str, float]
    returns: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    baseline: Optional[torch.Tensor] = None
    joint: Optional[object] = None   # the joint loss the policy step trained (shared trunk)
    forward_cache: Optional[tuple] = None   # shared trunk, one pass: (logp, hidden, entropy)


def whiten(x: torch.Tensor, mask: torch.Tensor, collective: distributed.Collective,
           eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries of the whole group's batch; zero elsewhere."""
    m = mask.bool()
    vals = x[m].double()
    n, s, s2 = collective.sum([vals.numel(), float(vals.sum()), float((vals ** 2).sum())])
    if n < 2:
        return torch.where(m, x, torch.zeros_like(x))
    mean = s / n
    std = max(s2 / n - mean * mean, 0.0) ** 0.5
    return torch.where(m, (x - mean) / (std + eps), torch.zeros_like(x))


class AdvantageEstimator(abc.ABC):
    """See the module docstring."""
    has_critic = False

    @abc.abstractmethod
    def estimate(self, batch: Batch) -> Estimate:
        """Advantages for `batch` (no gradient)."""

    def joint_loss(self, batch: Batch, estimate: Estimate):
        """A policy.JointLoss the policy step trains with the policy loss, or None."""
        return None

    def update(self, batch: Batch, estimate: Estimate) -> Dict[str, float]:
        """Trains what the estimator learns from `batch`; returns statistics."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _aligned_values(raw: torch.Tensor, batch: Batch) -> tuple:
    """(values aligned to token positions [B, T]: V(t) = raw[t-1], V(0) = 0; the value after
    each row's last token [B]) from the value model's raw outputs [B, T]."""
    aligned = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)
    last = raw.gather(1, (batch.lengths - 1).clamp(min=0)[:, None])[:, 0]
    return aligned, last


def _gae_function(config: LearnerConfig):
    """config.gae's advantage function (the Triton/torch dispatcher for skip_observation)."""
    if config.gae == "skip_observation":
        return functools.partial(kernels.skip_observation_gae, backend=config.kernel_backend)
    return adv_lib.token_level_gae


class CriticGAE(AdvantageEstimator):
    """SAO's critic and GAE (see the module docstring).

    Args:
      critic: a ValueModel, already frozen as configured and prepared for the group.
      config: the learner section.
      collective: the learner group.
    """
    has_critic = True

    def __init__(self, critic: ValueModel, config: LearnerConfig,
                 collective: distributed.Collective = distributed.SINGLE):
        self.critic = critic
        self.config = config
        self.collective = collective
        self.params = [p for p in critic.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.critic_lr, betas=(0.9, 0.999),
                                           weight_decay=0.0)
        self.nonfinite_skipped = 0
        self._gae = _gae_function(config)
        if config.gradient_checkpointing:
            critic.body.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.micro_batch_layout == "packed":
            packing.prepare_packed_attention(critic.body, "the critic")

    @property
    def device(self) -> torch.device:
        return self.critic.head.weight.device

    def _raw_values(self, batch: Batch) -> torch.Tensor:
        """[B, T] critic outputs (value of the state after reading x_0..x_t); a packed
        micro-batch runs as one row (learner/packing.py) and comes back as [B, T]."""
        packed = packing.maybe_pack(batch, self.config.micro_batch_layout)
        with autocast(self.config.dtype, self.device):
            if packed is None:
                return self.critic(batch.tokens, batch.attention_mask).float()
            hidden = packing.packed_hidden(self.critic.body, packed)
            return packed.unpack(self.critic.head(hidden).squeeze(-1).float())

    def values(self, batch: Batch) -> tuple:
        """(values aligned to token positions [B, T], value after each row's last token [B]),
        without gradient, micro-batch by micro-batch."""
        raw = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=batch.tokens.device)
        with torch.no_grad():
            for rows in minibatches.micro_batch_groups(batch.lengths.tolist(),
                                                       self.config.micro_batch_tokens,
                                                       self.config.micro_batch_layout):
                micro = minibatches.select_rows(batch, rows, trim=True)
                raw[torch.as_tensor(rows, device=raw.device),
                    :micro.tokens.shape[1]] = self._raw_values(micro)
        return _aligned_values(raw, batch)

    def estimate(self, batch: Batch) -> Estimate:
        return self._estimate_from(batch, *self.values(batch))

    def _estimate_from(self, batch: Batch, values: torch.Tensor, last: torch.Tensor
                       ) -> Estimate:
        """Advantages and targets from the values [B, T] (aligned) and last values [B]."""
        cfg = self.config
        mask = batch.action_mask
        boot = None
        if cfg.bootstrap_truncated:
            boot = torch.where(batch.truncated, last, torch.zeros_like(last))
        n_actions = mask.sum(1)
        lam_policy = adv_lib.length_adaptive_lambda(n_actions, cfg.lambda_alpha) \
            if cfg.adaptive_lambda else torch.full_like(n_actions, cfg.lambda_policy)
        advantages, _ = self._gae(batch.rewards, values, mask, cfg.gamma, lam_policy, boot)
        _, returns = self._gae(batch.rewards, values, mask, cfg.gamma, cfg.lambda_critic, boot)
        if cfg.normalize_advantages:
            advantages = whiten(advantages, mask, self.collective)
        n, lam_sum = self.collective.sum([lam_policy.numel(), float(lam_policy.sum())])
        stats = {"lambda_policy_mean": lam_sum / max(n, 1),
                 "bootstrapped_rollouts": self.collective.sum(
                     [float(batch.truncated.sum()) if boot is not None else 0.0])[0]}
        return Estimate(advantages, stats, returns=returns, values=values)

    def update(self, batch: Batch, estimate: Estimate) -> Dict[str, float]:
        """K critic epochs over the batch (config.critic_updates), each of critic_minibatches
        optimizer steps on consecutive slices of the rows, values recomputed each time;
        statistics of the values the advantages came from (value_loss, explained_variance) and
        of the last values computed (value_loss_last, critic_grad_norm of the last step)."""
        cfg = self.config
        self.critic.train()
        mask = batch.action_mask
        last_values = torch.zeros(batch.tokens.shape, dtype=torch.float32,
                                  device=batch.tokens.device)
        norm = 0.0
        slices = minibatches.row_splits(batch.size, min(cfg.critic_minibatches, batch.size))
        for _ in range(cfg.critic_updates):
            for rows in slices:
                norm = self.optimizer_step(batch, estimate, rows, last_values)
        t = gather_rows(self.collective, {"values": estimate.values, "returns": estimate.returns,
                                          "last": last_values, "mask": mask.float()})
        _, first = losses.value_loss(t["values"], t["returns"], t["mask"])
        _, last = losses.value_loss(t["last"], t["returns"], t["mask"])
        return {"value_loss": first["value_loss"],
                "explained_variance": first["explained_variance"],
                "value_loss_last": last["value_loss"], "critic_grad_norm": norm,
                "critic_nonfinite_skipped": self.nonfinite_skipped,
                "critic_optimizer_steps": cfg.critic_updates * len(slices)}

    def optimizer_step(self, batch: Batch, estimate: Estimate, rows, recomputed: torch.Tensor
                       ) -> float:
        """One critic optimizer step on the batch rows `rows` (every rank its own rows; the
        loss divided by the group's action tokens in them), micro-batched by token budget;
        writes the values it computed into `recomputed` [B, T]; returns the gradient norm."""
        rows = np.asarray(rows, dtype=np.int64)
        n_actions = self.collective.sum([float(batch.action_mask[torch.as_tensor(rows)].sum())])[0]
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        lengths = batch.lengths[torch.as_tensor(rows)].tolist()
        for group in minibatches.micro_batch_groups(lengths, self.config.micro_batch_tokens,
                                                    self.config.micro_batch_layout):
            micro = minibatches.select_rows(batch, rows[group], trim=True)
            width = micro.tokens.shape[1]
            r = torch.as_tensor(rows[group], device=batch.tokens.device)
            loss, values = self.micro_value_loss(self._raw_values(micro), r, micro.action_mask,
                                                 estimate, n_actions)
            loss.backward()
            loss_total += float(loss.detach())
            recomputed[r, :width] = values.detach()
        return self.reduce_and_step(loss_total, "critic")

    def micro_value_loss(self, raw: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                         estimate: Estimate, n_actions: float) -> tuple:
        """(value loss, values aligned to token positions) of the value model's raw outputs
        [b, w] for the batch rows `rows`, against `estimate`'s targets and old values."""
        width = raw.shape[1]
        values = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)
        loss, _ = losses.value_loss(values, estimate.returns[rows, :width], mask,
                                    estimate.values[rows, :width], self.config.value_clip,
                                    normalizer=n_actions)
        return loss, values

    def reduce_and_step(self, loss_total: float, what: str) -> float:
        """Sums the gradients over the group, clips them, steps the optimizer unless the loss
        or the norm is non-finite (then skips and counts); returns the norm."""
        distributed.all_reduce_gradients(self.params, self.collective)
        norm = distributed.clip_grad_norm(self.params, self.config.max_grad_norm,
                                          self.collective)
        loss_total = self.collective.sum([loss_total])[0]
        if not all(x == x and abs(x) != float("inf") for x in (norm, loss_total)):
            self.nonfinite_skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            logging.warning("%s step skipped: non-finite loss %s or gradient norm %s", what,
                            loss_total, norm)
        else:
            self.optimizer.step()
        return norm

    def state_dict(self) -> dict:
        return {"critic": distributed.full_state_dict(self.critic),
                "critic_opt": distributed.optimizer_state(self.critic, self.optimizer),
                "nonfinite_skipped": self.nonfinite_skipped}

    def load_state_dict(self, state: dict) -> None:
        if state.get("critic") is None:
            if state.get("value_head") is not None:
                raise ValueError("the checkpoint's value head is on the policy's trunk "
                                 "(critic=shared_trunk); resume with --critic=shared_trunk")
            raise ValueError("the checkpoint has no critic (a checkpoint of another "
                             "algorithm?); resume with the same --algorithm")
        self.critic.load_state_dict(state["critic"])
        distributed.load_optimizer_state(self.critic, self.optimizer, state["critic_opt"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))


class SharedTrunkGAE(CriticGAE):
    """Values from a value head on the policy's trunk, trained jointly with the policy
    (config critic=shared_trunk; docs/METHOD.md section 6, the shared-trunk option).

    `estimate`: when the policy step is one optimizer step on one micro-batch (policy_minibatches
    1, the batch within micro_batch_tokens) and the policy trainer is given, ONE forward of the
    policy with gradient gives the log-probs, the hidden state and from it the values; the
    advantages come from those values (detached) and the policy step reuses the forward (its
    loss, its backward), so a learner step runs the trunk once forward and once backward.
    Otherwise CriticGAE's: a forward of the trunk without gradient for the values, then the
    policy step's own forwards. Both give the same numbers. `joint_loss` is what the policy
    step adds to each micro-batch's policy loss: value_loss_coef x the value loss of the head
    on the same hidden state the LM head reads (one forward, one backward), so the trunk's
    gradient is the policy gradient plus value_loss_coef x the value-loss gradient (both losses
    divided by the batch's action tokens; the sum clipped to max_grad_norm with the policy's
    other gradients). The head has its own AdamW (critic_lr), gradients summed over the group
    and clipped to max_grad_norm apart from the policy's, and steps with every policy optimizer
    step. `update` then runs the other K-1 critic steps (critic_updates K; the joint step is the
    first): steps of the head alone on the hidden states the policy step computed (detached,
    so the trunk does not move and no forward of the trunk is run again).

    Args:
      critic: ValueModel.sharing_trunk(policy) (its body is the policy's).
      config: the learner section.
      collective: the learner group.
      policy_trainer: the PolicyTrainer of the same policy, for the one-pass estimate; None:
        always the two-pass one.
    """

    def __init__(self, critic: ValueModel, config: LearnerConfig,
                 collective: distributed.Collective = distributed.SINGLE,
                 policy_trainer=None):
        if not critic.shares_trunk:
            raise ValueError("SharedTrunkGAE needs ValueModel.sharing_trunk(policy): a head on "
                             "the policy's own body")
        self.critic = critic
        self.config = config
        self.collective = collective
        self.params = list(critic.head.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=config.critic_lr, betas=(0.9, 0.999),
                                           weight_decay=0.0)
        self.nonfinite_skipped = 0
        self._gae = _gae_function(config)
        self._trainer = policy_trainer
        # The trunk's gradient checkpointing is the policy trainer's (the same module).

    def one_pass(self, batch: Batch) -> bool:
        """Whether the policy step will run one forward over the whole batch (see above)."""
        return (self._trainer is not None and self.config.policy_minibatches == 1 and
                len(minibatches.micro_batch_groups(batch.lengths.tolist(),
                                                   self.config.micro_batch_tokens,
                                                   self.config.micro_batch_layout)) == 1)

    def estimate(self, batch: Batch) -> Estimate:
        if not self.one_pass(batch):
            return super().estimate(batch)
        self._trainer.policy.train()               # as the policy step's own forward would be
        # With gradient: the policy step's forward (and its token entropies, for the metrics).
        logp, hidden, entropy = self._trainer.forward_and_entropy(batch)
        with torch.no_grad():
            raw = self.head_values(hidden)
        estimate = self._estimate_from(batch, *_aligned_values(raw, batch))
        estimate.forward_cache = (logp, hidden, entropy)
        return estimate

    def head_values(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, w] float32 raw values of the head on the trunk's hidden state [b, w, H]."""
        with autocast(self.config.dtype, hidden.device):
            return self.critic.head(hidden).squeeze(-1).float()

    def joint_loss(self, batch: Batch, estimate: Estimate) -> "_JointValueLoss":
        return _JointValueLoss(self, batch, estimate)

    def update(self, batch: Batch, estimate: Estimate) -> Dict[str, float]:
        """The K-1 head-only steps after the joint one (see the class docstring); statistics."""
        joint = estimate.joint
        if joint is None or not joint.steps:
            raise ValueError("critic=shared_trunk trains its value head inside the policy step; "
                             "a critic-only step (value pretraining, warm-up) needs "
                             "critic=separate")
        for _ in range(self.config.critic_updates - 1):
            self._head_step(batch, estimate, joint)
        t = gather_rows(self.collective, {"values": estimate.values, "returns": estimate.returns,
                                          "last": joint.recomputed, "mask":
                                          batch.action_mask.float()})
        _, first = losses.value_loss(t["values"], t["returns"], t["mask"])
        _, last = losses.value_loss(t["last"], t["returns"], t["mask"])
        finite = [n for n in joint.norms if n == n and n != float("inf")]
        return {"value_loss": first["value_loss"],
                "explained_variance": first["explained_variance"],
                "value_loss_last": last["value_loss"],
                "critic_grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                "critic_nonfinite_skipped": self.nonfinite_skipped}

    def _head_step(self, batch: Batch, estimate: Estimate, joint: "_JointValueLoss") -> None:
        """One optimizer step of the head alone on the policy step's hidden states."""
        self.optimizer.zero_grad(set_to_none=True)
        n_actions = self.collective.sum([float(batch.action_mask.sum())])[0]
        loss_total = 0.0
        for rows, hidden, mask in joint.features:
            loss, values = self.micro_value_loss(self.head_values(hidden), rows, mask, estimate,
                                                 n_actions)
            loss.backward()
            loss_total += float(loss.detach())
            joint.recomputed[rows, :values.shape[1]] = values.detach()
        joint.norms.append(self.reduce_and_step(loss_total, "value-head"))

    def state_dict(self) -> dict:
        # The trunk is the policy's (saved with it); only the head and its optimizer are ours.
        return {"value_head": {k: v.detach().cpu() for k, v in
                               self.critic.head.state_dict().items()},
                "value_head_opt": self.optimizer.state_dict(),
                "nonfinite_skipped": self.nonfinite_skipped}

    def load_state_dict(self, state: dict) -> None:
        if state.get("value_head") is None:
            raise ValueError("the checkpoint has no shared-trunk value head (its critic is "
                             "separate, or it is of another algorithm); resume with the same "
                             "--critic and --algorithm")
        self.critic.head.load_state_dict(state["value_head"])
        self.optimizer.load_state_dict(state["value_head_opt"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))


class _JointValueLoss:
    """SharedTrunkGAE's policy.JointLoss for one batch: the value loss of the head on the
    trunk's hidden state, against the targets and old values of `estimate`; records the values
    it computed (the last minibatch's for each row) and the head's gradient norms."""

    def __init__(self, owner: SharedTrunkGAE, batch: Batch, estimate: Estimate):
        self.owner = owner
        self.estimate = estimate
        self._cache = estimate.forward_cache   # used once, by the whole-batch micro-batch
        estimate.forward_cache = None
        self.recomputed = torch.zeros(batch.tokens.shape, dtype=torch.float32,
                                      device=batch.tokens.device)
        self.norms: list = []
        self.steps = 0
        self._loss_total = 0.0
        # (rows, hidden detached, action mask) of every micro-batch, for the head-only steps.
        self.features: list = []
        self._keep_features = owner.config.critic_updates > 1
        estimate.joint = self

    def zero_grad(self) -> None:
        self.owner.optimizer.zero_grad(set_to_none=True)
        self._loss_total = 0.0

    def cached_forward(self, rows: torch.Tensor, micro: Batch) -> Optional[tuple]:
        """The estimate's (log-probs, hidden, entropy) when `micro` is the whole batch it came
        from."""
        cache, self._cache = self._cache, None
        if cache is None or cache[0].shape != micro.tokens.shape or not torch.equal(
                rows.cpu(), torch.arange(cache[0].shape[0])):
            return None
        return cache

    def loss(self, rows: torch.Tensor, micro: Batch, hidden: torch.Tensor,
             normalizer: float) -> torch.Tensor:
        loss, values = self.owner.micro_value_loss(self.owner.head_values(hidden), rows,
                                                   micro.action_mask, self.estimate, normalizer)
        self._loss_total += float(loss.detach())
        self.recomputed[rows, :values.shape[1]] = values.detach()
        if self._keep_features:
            self.features.append((rows, hidden.detach(), micro.action_mask))
        return self.owner.config.value_loss_coef * loss

    def reduce_and_clip(self) -> list:
        owner = self.owner
        distributed.all_reduce_gradients(owner.params, owner.collective)
        norm = distributed.clip_grad_norm(owner.params, owner.config.max_grad_norm,
                                          owner.collective)
        self.norms.append(norm)
        return [owner.collective.sum([self._loss_total])[0], norm]

    def step(self) -> None:
        self.owner.optimizer.step()
        self.steps += 1

    def skip(self) -> None:
        self.owner.optimizer.zero_grad(set_to_none=True)
        self.owner.nonfinite_skipped += 1
        self.steps += 1
        logging.warning("value-head step skipped with the policy step (non-finite)")


def _rewards_everywhere(batch: Batch, collective: distributed.Collective, with_keys: bool):
    """(every rank's rewards [sum B] float64, their prompt keys or None, this rank's slice)."""
    rewards = sequence_rewards(batch).double().cpu().numpy()
    keys = [prompt_key(r) for r in batch.rollouts] if with_keys else None
    parts = collective.gather_objects((rewards, keys))
    start = sum(len(p[0]) for p in parts[:collective.rank])
    all_rewards = np.concatenate([p[0] for p in parts])
    all_keys = [k for p in parts for k in p[1]] if with_keys else None
    return all_rewards, all_keys, slice(start, start + len(rewards))


class GroupNormalized(AdvantageEstimator):
    """GRPO's group-normalised advantages (whole groups are within one rank's share)."""

    def __init__(self, scale_by_std: bool = True,
                 collective: distributed.Collective = distributed.SINGLE):
        self.scale_by_std = scale_by_std
        self.collective = collective

    def estimate(self, batch: Batch) -> Estimate:
        rewards = sequence_rewards(batch).double()
        adv, means = group_normalized_advantages(rewards, [r.group_id for r in batch.rollouts],
                                                 self.scale_by_std)
        parts = self.collective.gather_objects((rewards.cpu().numpy(), means.cpu().numpy()))
        stats = baseline_stats(np.concatenate([p[0] for p in parts]),
                               np.concatenate([p[1] for p in parts]))
        return Estimate(broadcast_to_action_tokens(adv, batch.action_mask), stats,
                        baseline=means)


class TrackedBaseline(AdvantageEstimator):
    """A = R - b(prompt) with a running-mean or per-prompt tracker (see baselines.py)."""

    def __init__(self, baseline: str = "running_mean", decay: float = 0.9,
                 normalize_advantages: bool = True,
                 collective: distributed.Collective = distributed.SINGLE):
        self.tracker = make_baseline(baseline, decay)
        self.normalize_advantages = normalize_advantages
        self.collective = collective

    def estimate(self, batch: Batch) -> Estimate:
        """Reads the tracker for every rank's rollouts, then updates it with all of them (the
        same on every rank); this rank's rows get R - b."""
        rewards, keys, mine = _rewards_everywhere(batch, self.collective, with_keys=True)
        b = self.tracker.values(keys, rewards)
        self.tracker.update(keys, rewards)
        adv = broadcast_to_action_tokens(
            torch.as_tensor(rewards[mine] - b[mine], device=batch.action_mask.device),
            batch.action_mask)
        if self.normalize_advantages:
            adv = whiten(adv, batch.action_mask, self.collective)
        return Estimate(adv, baseline_stats(rewards, b), baseline=torch.as_tensor(b[mine]))

    def state_dict(self) -> dict:
        return {"tracker": self.tracker}

    def load_state_dict(self, state: dict) -> None:
        if state.get("tracker") is not None:
            self.tracker = state["tracker"]


def make_estimator(config: LearnerConfig, critic: Optional[ValueModel] = None,
                   collective: distributed.Collective = distributed.SINGLE,
                   policy_trainer=None) -> AdvantageEstimator:
    """The estimator of config.algorithm (sao needs `critic`; critic=shared_trunk uses
    `policy_trainer` for its one-pass estimate)."""
    if config.algorithm == "sao":
        if critic is None:
            raise ValueError("algorithm='sao' needs a critic (models.value.ValueModel)")
        if config.critic == "shared_trunk":
            return SharedTrunkGAE(critic, config, collective, policy_trainer)
        if critic.shares_trunk:
            raise ValueError("critic=separate needs its own network, not a head on the "
                             "policy's trunk (ValueModel.from_policy or .load)")
        return CriticGAE(critic, config, collective)
    if config.algorithm == "grpo":
        return GroupNormalized(config.grpo_scale_by_std, collective)
    return TrackedBaseline(config.baseline, config.baseline_decay, config.normalize_advantages,
                           collective)
