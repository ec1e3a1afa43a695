"""The critic-free single-rollout estimator (registry entry "critic_free"): A = R - b(prompt),
b a running-mean or per-prompt tracker (learner/baselines.py) read before the batch updates it.
"""
from __future__ import annotations

from typing import Optional

import torch

from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import distributed
from sao_actor_learner.learner.baselines import (baseline_stats, broadcast_to_action_tokens,
                                                 make_baseline)
from sao_actor_learner.learner.estimator_base import (AdvantageEstimator, Estimate,
                                                      rewards_everywhere, whiten)
from sao_actor_learner.types import Batch


class TrackedBaseline(AdvantageEstimator):
    """A = R - b(prompt) with a running-mean or per-prompt tracker (see baselines.py)."""

    def __init__(self, baseline: str = "running_mean", decay: float = 0.9,
                 normalize_advantages: bool = True,
                 collective: distributed.Collective = distributed.SINGLE):
        self.tracker = make_baseline(baseline, decay)
        self.normalize_advantages = normalize_advantages
        self.collective = collective

    @classmethod
    def from_config(cls, config: LearnerConfig, critic=None,
                    collective: Optional[distributed.Collective] = None,
                    policy_trainer=None) -> "TrackedBaseline":
        return cls(config.baseline, config.baseline_decay, config.normalize_advantages,
                   collective or distributed.SINGLE)

    def estimate(self, batch: Batch) -> Estimate:
        """Reads the tracker for every rank's rollouts, then updates it with all of them (the
        same on every rank); this rank's rows get R - b."""
        rewards, keys, mine = rewards_everywhere(batch, self.collective, with_keys=True)
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
