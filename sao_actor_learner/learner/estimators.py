"""Advantage estimators: what turns a batch into per-token advantages, and what they learn.

The learner loop (learner.py) is the same for every algorithm; the algorithm is its estimator,
made by its entry in `registry.py` (`make_estimator`). One file each:

  critic_gae.CriticGAE            SAO (docs/METHOD.md): a critic's values, skip-observation (or
                                  standard) GAE with length-adaptive lambda, K critic steps.
  shared_trunk.SharedTrunkGAE     the same values and GAE from a value head on the policy's own
                                  trunk (critic=shared_trunk, not SAO), trained in the policy step.
  group_normalized.GroupNormalized  GRPO: (R - mean_group R) / std_group R.
  tracked_baseline.TrackedBaseline  critic_free: R - b(prompt), b a running-mean or per-prompt
                                  tracker.
  rloo.LeaveOneOut                RLOO: R_i - mean of the other rollouts of its group.

The interface (`AdvantageEstimator`, `Estimate`, `whiten`) is in estimator_base.py; the names
are re-exported here for the modules and tests that import them from this one.
"""
from __future__ import annotations

from typing import Optional

from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import distributed, registry
from sao_actor_learner.learner.critic_gae import CriticGAE  # noqa: F401  (re-exported)
from sao_actor_learner.learner.estimator_base import (  # noqa: F401  (re-exported)
    AdvantageEstimator, Estimate, whiten)
from sao_actor_learner.learner.group_normalized import GroupNormalized  # noqa: F401
from sao_actor_learner.learner.shared_trunk import SharedTrunkGAE  # noqa: F401
from sao_actor_learner.learner.tracked_baseline import TrackedBaseline  # noqa: F401
from sao_actor_learner.models.value import ValueModel


def make_estimator(config: LearnerConfig, critic: Optional[ValueModel] = None,
                   collective: distributed.Collective = distributed.SINGLE,
                   policy_trainer=None) -> AdvantageEstimator:
    """The estimator of config.algorithm, as its registry entry makes it (an algorithm that
    needs a critic needs `critic`; critic=shared_trunk uses `policy_trainer` for its one-pass
    estimate)."""
    return registry.algorithm(config.algorithm).make_estimator(config, critic, collective,
                                                               policy_trainer)
