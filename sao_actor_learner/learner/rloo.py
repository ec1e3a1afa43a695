"""RLOO, REINFORCE leave-one-out (registry entry "rloo"; Ahmadian et al. 2024; docs/METHOD.md
section 7): G rollouts per prompt, each compared with the mean reward of the OTHER G - 1,

    A_i = R_i - 1/(G-1) sum_{j != i} R_j  =  G/(G-1) (R_i - mean_g R)

on every action token of rollout i, so a rollout never baselines itself and the baseline is
unbiased. rloo_scale_by_std additionally divides by the group's reward std (unbiased, + eps, as
grpo_scale_by_std). A group of one rollout has advantage 0. No critic; whole groups are within
one rank's share (the learner samples whole groups, as for grpo).
"""
from __future__ import annotations

from typing import Hashable, Optional, Sequence, Tuple

import torch

from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import distributed
from sao_actor_learner.learner.group_normalized import GroupBaselineEstimator
from sao_actor_learner.learner.grpo import group_members


def leave_one_out_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable],
                             scale_by_std: bool = False, eps: float = 1e-6
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-rollout RLOO advantages and baselines.

    rewards: [B]; group_ids: B hashable ids (members of a group need not be adjacent).
    Returns (advantages [B], baseline [B]: the mean reward of the rest of the rollout's group;
    a rollout alone in its group: baseline its own reward, advantage 0), float64.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    adv = torch.zeros_like(rewards)
    baseline = rewards.clone()
    for members in group_members(group_ids, rewards.shape[0]):
        if len(members) < 2:
            continue
        idx = torch.as_tensor(members)
        r = rewards[idx]
        others = (r.sum() - r) / (len(members) - 1)
        a = r - others
        if scale_by_std:
            a = a / (r.std(unbiased=True) + eps)
        adv[idx] = a
        baseline[idx] = others
    return adv, baseline


class LeaveOneOut(GroupBaselineEstimator):
    """RLOO's advantages on every action token (see the module docstring)."""

    group_advantages = staticmethod(leave_one_out_advantages)

    @classmethod
    def from_config(cls, config: LearnerConfig, critic=None,
                    collective: Optional[distributed.Collective] = None,
                    policy_trainer=None) -> "LeaveOneOut":
        return cls(config.rloo_scale_by_std, collective or distributed.SINGLE)
