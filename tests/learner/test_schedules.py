"""The policy's learning-rate schedule (learner/schedules.py) against slow obvious versions, the
trainer's optimizer following it, and bad names refused before launch."""
from __future__ import annotations

import math

import pytest
import torch

from sao_actor_learner.config import SAOConfig
from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.config.sections import ConfigError
from sao_actor_learner.learner.policy import PolicyTrainer
from sao_actor_learner.learner.schedules import lr_factor


def slow_factor(version, schedule, warmup, total):
    """Step by step: the warm-up ramp, then the schedule's shape over the remaining steps."""
    if version < warmup:
        return [(i + 1) / (warmup + 1) for i in range(warmup)][version]
    if schedule == "constant" or total <= warmup:
        return 1.0
    span = total - warmup
    done = min(version - warmup, span)
    if schedule == "linear":
        return (span - done) / span
    return (math.cos(math.pi * done / span) + 1.0) / 2.0


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (5, 5), (0, 1), (4, 200)])
def test_factor_matches_the_slow_version(schedule, warmup, total):
    for version in range(total + 3):
        assert lr_factor(version, schedule, warmup, total) == pytest.approx(
            slow_factor(version, schedule, warmup, total), abs=1e-12), version


def test_shapes():
    assert lr_factor(0, "linear", 0, 100) == 1.0 and lr_factor(100, "linear", 0, 100) == 0.0
    assert lr_factor(50, "linear", 0, 100) == pytest.approx(0.5)
    assert lr_factor(50, "cosine", 0, 100) == pytest.approx(0.5)
    assert lr_factor(25, "cosine", 0, 100) > lr_factor(25, "linear", 0, 100)
    assert [lr_factor(v, "constant", 3, 10) for v in range(4)] == [0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="one of constant, linear, cosine"):
        lr_factor(0, "step", 0, 10)


def test_the_trainer_sets_the_optimizer_to_the_schedule():
    config = LearnerConfig(policy_lr=1e-3, lr_schedule="linear", lr_warmup_steps=2)
    trainer = PolicyTrainer(torch.nn.Linear(3, 2), config)
    seen = [trainer.set_learning_rate(v, total_steps=6) for v in range(7)]
    assert seen == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 0.75e-3, 0.5e-3, 0.25e-3, 0.0])
    assert all(g["lr"] == seen[-1] for g in trainer.optimizer.param_groups)
    constant = PolicyTrainer(torch.nn.Linear(3, 2), LearnerConfig(policy_lr=1e-3))
    assert {constant.set_learning_rate(v, 6) for v in range(7)} == {1e-3}


@pytest.mark.parametrize("changes, message", [
    ({"lr_schedule": "step"}, "lr_schedule='step'"),
    ({"lr_warmup_steps": -1}, "lr_warmup_steps=-1"),
])
def test_bad_schedules_are_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        SAOConfig(**changes)
