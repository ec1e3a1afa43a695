"""The advantage-estimator interface and what estimators share.

`AdvantageEstimator`: `estimate(batch)` -> an `Estimate` (per-token advantages and statistics);
`joint_loss(batch, estimate)` -> what the policy step adds to its loss (None but for the shared
trunk); `update(batch, estimate)` -> trains what the estimator learns (the critic's K steps, a
no-op for the group estimators) and returns its statistics. Statistics are whole-batch (and
whole-group) numbers. With a learner group every rank calls both on its share.

`whiten` whitens advantages over the whole group's action tokens; `rewards_everywhere` gives
every rank's sequence rewards (for estimators whose baseline reads them all).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Dict, Optional

import numpy as np
import torch

from sao_actor_learner.learner import distributed
from sao_actor_learner.learner.baselines import prompt_key, sequence_rewards
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
    # A forward with gradient the step's update may use instead of running it again, once:
    # shared trunk, one pass: (logp, hidden, entropy); separate critic: (raw values [B, w],).
    forward_cache: Optional[tuple] = None


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


def rewards_everywhere(batch: Batch, collective: distributed.Collective, with_keys: bool):
    """(every rank's rewards [sum B] float64, their prompt keys or None, this rank's slice)."""
    rewards = sequence_rewards(batch).double().cpu().numpy()
    keys = [prompt_key(r) for r in batch.rollouts] if with_keys else None
    parts = collective.gather_objects((rewards, keys))
    start = sum(len(p[0]) for p in parts[:collective.rank])
    all_rewards = np.concatenate([p[0] for p in parts])
    all_keys = [k for p in parts for k in p[1]] if with_keys else None
    return all_rewards, all_keys, slice(start, start + len(rewards))
