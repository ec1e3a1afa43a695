"""GRPO's estimator (registry entry "grpo"): group-normalised advantages, (R - mean_group R) /
std_group R on every action token of a rollout (learner/grpo.py has the pure function; whole
groups are within one rank's share)."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import numpy as np
import torch

from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import distributed
from sao_actor_learner.learner.baselines import (baseline_stats, broadcast_to_action_tokens,
                                                 sequence_rewards)
from sao_actor_learner.learner.estimator_base import AdvantageEstimator, Estimate
from sao_actor_learner.learner.grpo import group_normalized_advantages
from sao_actor_learner.types import Batch


class GroupBaselineEstimator(AdvantageEstimator):
    """Advantages from each rollout's prompt group alone: `group_advantages(rewards, group_ids,
    scale_by_std) -> (advantages [B], baselines [B])`, a pure function of the group estimator
    (GRPO's here, RLOO's in rloo.py), on every action token."""

    group_advantages: Callable[..., Tuple[torch.Tensor, torch.Tensor]]

    def __init__(self, scale_by_std: bool = True,
                 collective: distributed.Collective = distributed.SINGLE):
        self.scale_by_std = scale_by_std
        self.collective = collective

    def estimate(self, batch: Batch) -> Estimate:
        rewards = sequence_rewards(batch).double()
        adv, baseline = self.group_advantages(rewards, [r.group_id for r in batch.rollouts],
                                              self.scale_by_std)
        parts = self.collective.gather_objects((rewards.cpu().numpy(), baseline.cpu().numpy()))
        stats = baseline_stats(np.concatenate([p[0] for p in parts]),
                               np.concatenate([p[1] for p in parts]))
        return Estimate(broadcast_to_action_tokens(adv, batch.action_mask), stats,
                        baseline=baseline)


class GroupNormalized(GroupBaselineEstimator):
    """GRPO's group-normalised advantages (scale_by_std=False: Dr. GRPO's, centred only)."""

    group_advantages = staticmethod(group_normalized_advantages)

    @classmethod
    def from_config(cls, config: LearnerConfig, critic=None,
                    collective: Optional[distributed.Collective] = None,
                    policy_trainer=None) -> "GroupNormalized":
        return cls(config.grpo_scale_by_std, collective or distributed.SINGLE)
