"""The SAO algorithm's estimator (registry entry "sao"): its critic and GAE, with the critic
config.critic chose (separate: `critic_gae.CriticGAE`; shared_trunk: a value head on the
policy's trunk, `shared_trunk.SharedTrunkGAE`)."""
from __future__ import annotations

from typing import Optional

from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import distributed
from sao_actor_learner.learner.critic_gae import CriticGAE
from sao_actor_learner.learner.estimator_base import AdvantageEstimator
from sao_actor_learner.learner.shared_trunk import SharedTrunkGAE
from sao_actor_learner.models.value import ValueModel


def make_critic_estimator(config: LearnerConfig, critic: Optional[ValueModel],
                          collective: Optional[distributed.Collective] = None,
                          policy_trainer=None) -> AdvantageEstimator:
    """CriticGAE on `critic` (its own network), or SharedTrunkGAE with critic=shared_trunk
    (`policy_trainer` for its one-pass estimate)."""
    collective = collective or distributed.SINGLE
    if critic is None:
        raise ValueError(f"algorithm={config.algorithm!r} needs a critic "
                         "(models.value.ValueModel)")
    if config.critic == "shared_trunk":
        return SharedTrunkGAE(critic, config, collective, policy_trainer)
    if critic.shares_trunk:
        raise ValueError("critic=separate needs its own network, not a head on the "
                         "policy's trunk (ValueModel.from_policy or .load)")
    return CriticGAE(critic, config, collective)
