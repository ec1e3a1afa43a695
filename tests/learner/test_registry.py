"""The algorithm registry (learner/registry.py): every entry loads, its options are config fields,
and the config's allowed names are the registered ones."""
import dataclasses
import subprocess
import sys

import pytest

from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import registry

FIELDS = {f.name for f in dataclasses.fields(LearnerConfig)}


@pytest.mark.parametrize("name", registry.ALGORITHM_NAMES)
def test_every_algorithm_entry_loads_and_names_config_fields(name):
    entry = registry.algorithm(name)
    assert callable(registry.load(entry.estimator))
    assert set(entry.options) <= FIELDS


@pytest.mark.parametrize("name", registry.POLICY_LOSS_NAMES)
def test_every_policy_loss_entry_loads_and_names_config_fields(name):
    entry = registry.policy_loss(name)
    assert callable(registry.load(entry.function))
    assert not entry.kernel or callable(registry.load(entry.kernel))
    assert {field for _, field in entry.options} <= FIELDS


def test_unknown_names_are_config_errors_listing_the_registered_ones():
    with pytest.raises(ConfigError, match=", ".join(registry.ALGORITHM_NAMES)):
        SAOConfig(algorithm="ppo")
    with pytest.raises(ConfigError, match=", ".join(registry.POLICY_LOSS_NAMES)):
        SAOConfig(policy_loss="vtrace")
    with pytest.raises(ValueError, match="must be one of"):
        registry.algorithm("ppo")


def test_the_config_validates_the_registry_without_torch():
    code = ("import sys; from sao_actor_learner.config import SAOConfig; "
            "SAOConfig(algorithm='rloo', group_size=2, batch_size=8, actor_batch=4, "
            "policy_loss='gspo'); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
