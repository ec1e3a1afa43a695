"""Advantage estimators: what turns a batch into per-token advantages, and what they learn.

The learner loop (learner.py) is the same for every algorithm; the algorithm is its estimator:

  CriticGAE        SAO (docs/METHOD.md): a critic's values, skip-observation (or standard) GAE
                   with length-adaptive lambda for the policy and lambda_critic for the critic's
                   targets, optional bootstrap of truncated episodes; `update` runs K critic
                   optimizer steps on the same batch, values recomputed each time, attention
                   frozen; micro-batched and summed over the learner group like the policy step.
  GroupNormalized  GRPO: (R - mean_group R) / std_group R on every action token of a rollout.
  TrackedBaseline  the critic-free single-rollout baseline: R - b(prompt), b a running-mean or
                   per-prompt tracker read before the batch updates it.

`estimate(batch)` returns an `Estimate`; `update(batch, estimate)` trains the estimator (a no-op
for GRPO) and returns its statistics. Statistics are whole-batch (and whole-group) numbers.
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
from sao_actor_learner.learner import distributed, losses, minibatches
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

    def update(self, batch: Batch, estimate: Estimate) -> Dict[str, float]:
        """Trains what the estimator learns from `batch`; returns statistics."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


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
        if config.gae == "skip_observation":
            self._gae = functools.partial(kernels.skip_observation_gae,
                                          backend=config.kernel_backend)
        else:
            self._gae = adv_lib.token_level_gae
        if config.gradient_checkpointing:
            critic.body.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def device(self) -> torch.device:
        return self.critic.head.weight.device

    def _raw_values(self, batch: Batch) -> torch.Tensor:
        """[B, T] critic outputs (value of the state after reading x_0..x_t)."""
        with autocast(self.config.dtype, self.device):
            return self.critic(batch.tokens, batch.attention_mask).float()

    def values(self, batch: Batch) -> tuple:
        """(values aligned to token positions [B, T], value after each row's last token [B]),
        without gradient, micro-batch by micro-batch."""
        raw = torch.zeros(batch.tokens.shape, dtype=torch.float32, device=batch.tokens.device)
        with torch.no_grad():
            for rows in minibatches.pack_by_tokens(batch.lengths.tolist(),
                                                   self.config.micro_batch_tokens):
                micro = minibatches.select_rows(batch, rows, trim=True)
                raw[torch.as_tensor(rows, device=raw.device),
                    :micro.tokens.shape[1]] = self._raw_values(micro)
        aligned = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)
        last = raw.gather(1, (batch.lengths - 1).clamp(min=0)[:, None])[:, 0]
        return aligned, last

    def estimate(self, batch: Batch) -> Estimate:
        cfg = self.config
        values, last = self.values(batch)
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
        """K critic steps (config.critic_updates), each over micro-batches with the whole
        group's denominator; statistics of the values the advantages came from (value_loss,
        explained_variance) and of the last step (value_loss_last, critic_grad_norm)."""
        cfg = self.config
        self.critic.train()
        mask = batch.action_mask
        n_actions = self.collective.sum([float(mask.sum())])[0]
        last_values = estimate.values
        norm = 0.0
        for _ in range(cfg.critic_updates):
            self.optimizer.zero_grad(set_to_none=True)
            recomputed = torch.zeros(batch.tokens.shape, dtype=torch.float32,
                                     device=batch.tokens.device)
            loss_total = 0.0
            for rows in minibatches.pack_by_tokens(batch.lengths.tolist(), cfg.micro_batch_tokens):
                micro = minibatches.select_rows(batch, rows, trim=True)
                width = micro.tokens.shape[1]
                r = torch.as_tensor(rows, device=batch.tokens.device)
                raw = self._raw_values(micro)
                values = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)
                loss, _ = losses.value_loss(values, estimate.returns[r, :width], micro.action_mask,
                                            estimate.values[r, :width], cfg.value_clip,
                                            normalizer=n_actions)
                loss.backward()
                loss_total += float(loss.detach())
                recomputed[r, :width] = values.detach()
            distributed.all_reduce_gradients(self.params, self.collective)
            norm = distributed.clip_grad_norm(self.params, cfg.max_grad_norm, self.collective)
            loss_total = self.collective.sum([loss_total])[0]
            if not all(x == x and abs(x) != float("inf") for x in (norm, loss_total)):
                self.nonfinite_skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                logging.warning("critic step skipped: non-finite loss %s or gradient norm %s",
                                loss_total, norm)
            else:
                self.optimizer.step()
            last_values = recomputed
        t = gather_rows(self.collective, {"values": estimate.values, "returns": estimate.returns,
                                          "last": last_values, "mask": mask.float()})
        _, first = losses.value_loss(t["values"], t["returns"], t["mask"])
        _, last = losses.value_loss(t["last"], t["returns"], t["mask"])
        return {"value_loss": first["value_loss"],
                "explained_variance": first["explained_variance"],
                "value_loss_last": last["value_loss"], "critic_grad_norm": norm,
                "critic_nonfinite_skipped": self.nonfinite_skipped}

    def state_dict(self) -> dict:
        return {"critic": distributed.full_state_dict(self.critic),
                "critic_opt": distributed.optimizer_state(self.critic, self.optimizer),
                "nonfinite_skipped": self.nonfinite_skipped}

    def load_state_dict(self, state: dict) -> None:
        if state.get("critic") is None:
            raise ValueError("the checkpoint has no critic (a checkpoint of another "
                             "algorithm?); resume with the same --algorithm")
        self.critic.load_state_dict(state["critic"])
        distributed.load_optimizer_state(self.critic, self.optimizer, state["critic_opt"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))


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
                   collective: distributed.Collective = distributed.SINGLE
                   ) -> AdvantageEstimator:
    """The estimator of config.algorithm (sao needs `critic`)."""
    if config.algorithm == "sao":
        if critic is None:
            raise ValueError("algorithm='sao' needs a critic (models.value.ValueModel)")
        return CriticGAE(critic, config, collective)
    if config.algorithm == "grpo":
        return GroupNormalized(config.grpo_scale_by_std, collective)
    return TrackedBaseline(config.baseline, config.baseline_decay, config.normalize_advantages,
                           collective)
