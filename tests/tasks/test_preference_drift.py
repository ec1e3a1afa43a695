"""task=preference_drift (tasks/preference_drift.py): the preference weight is a seeded
sinusoid plus random walk over policy versions, the same in every process whatever order it is
asked in; an episode's reward is the mixture at the version of the engine that starts it; the
options are checked before launch."""
import math

import numpy as np
import pytest

from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.tasks import make_task
from sao_actor_learner.tasks.arithmetic import has_carry, no_carry_sum
from sao_actor_learner.tasks.preference_drift import (DEFAULT_DRIFT, PreferenceDriftTask,
                                                      PreferenceWeight, weight_of_config)


def test_the_weight_is_a_seeded_sinusoid_plus_random_walk():
    w = PreferenceWeight(period=40, amplitude=0.3, walk_std=0.02, seed=1)
    backwards = PreferenceWeight(period=40, amplitude=0.3, walk_std=0.02, seed=1)
    versions = list(range(0, 900, 7))
    forward = [w(v) for v in versions]
    assert [backwards(v) for v in reversed(versions)] == forward[::-1]   # order-free
    assert forward != [PreferenceWeight(40, 0.3, 0.02, seed=2)(v) for v in versions]
    assert forward[0] == 0.5 and all(0.0 <= x <= 1.0 for x in forward)
    # The walk's increments are N(0, walk_std^2): their sample sd over 2000 versions is within
    # 10% of walk_std (fixed seed).
    steps = np.diff([w.walk(v) for v in range(2001)])
    assert abs(steps.std() / 0.02 - 1) < 0.1
    # Without the walk it is the sinusoid exactly; gradual: one version moves it little.
    sine = PreferenceWeight(period=40, amplitude=0.3, walk_std=0.0)
    assert sine(10) == pytest.approx(0.8) and sine(30) == pytest.approx(0.2)
    assert max(abs(w(v + 1) - w(v)) for v in range(500)) < 2 * math.pi * 0.3 / 40 + 6 * 0.02


def test_reward_is_the_mixture_at_the_engines_version():
    version = {"v": 0}
    weight = PreferenceWeight(period=8, amplitude=0.4, walk_std=0.0)
    task = PreferenceDriftTask(weight, seed=0, num_eval=10)
    task.set_version_source(lambda: version["v"])
    tok = task.tokenizer
    rng = np.random.default_rng(0)
    while True:
        prompt = task.sample_prompt(rng)
        a, b = map(int, prompt.text.rstrip("=").split("+"))
        if has_carry(a, b):
            break
    true, slip = tok.encode(str(a + b), add_bos=False), tok.encode(str(no_carry_sum(a, b)),
                                                                    add_bos=False)
    for v in (0, 2, 6):
        version["v"] = v
        w = weight(v)
        env = task.make_environment(prompt)
        version["v"] = v + 1          # the episode keeps the weight it started with
        assert env.step(true + [tok.eos_id]).reward == pytest.approx(w)
        assert task.make_environment(prompt).step(slip + [tok.eos_id]).reward == \
            pytest.approx(1 - weight(v + 1))
        version["v"] = v
        assert task.is_correct(prompt, true) == (w >= 0.5)
        assert task.is_correct(prompt, slip) == (w < 0.5)
    assert task.make_environment(prompt).step([tok.eos_id]).reward == 0.0


def test_options_are_checked_and_only_for_this_task():
    config = SAOConfig(task="preference_drift", reward_drift_period=50,
                       reward_drift_amplitude=0.2, reward_drift_walk_std=0.01, seed=4)
    assert SAOConfig.from_json(config.to_json()) == config
    w = weight_of_config(config)
    assert (w.period, w.amplitude, w.walk_std) == (50, 0.2, 0.01)
    assert w(123) == PreferenceWeight(50, 0.2, 0.01, seed=4)(123)
    for flags, message in [
            (dict(reward_drift_period=0), "reward_drift_period=0: must be > 0"),
            (dict(reward_drift_amplitude=0.7), r"reward_drift_amplitude=0.7: must be in \[0"),
            (dict(reward_drift_walk_std=-1.0), "reward_drift_walk_std=-1.0: must be >= 0"),
            (dict(reward_drift_amplitude=0.0, reward_drift_walk_std=0.0), "never moves")]:
        with pytest.raises(ConfigError, match=message):
            SAOConfig(task="preference_drift", **flags)
    with pytest.raises(ConfigError, match="reward_drift_period=50.*applies only to "
                       "--task=preference_drift"):
        SAOConfig(task="arithmetic", reward_drift_period=50)


def test_make_task_builds_it_with_the_configs_default_drift():
    task = make_task("preference_drift", seed=6, num_eval=10)
    default = SAOConfig(task="preference_drift", seed=6)
    assert isinstance(task, PreferenceDriftTask)
    assert (default.reward_drift_period, default.reward_drift_amplitude,
            default.reward_drift_walk_std) == DEFAULT_DRIFT
    assert [task.weight(v) for v in range(0, 300, 13)] == \
        [weight_of_config(default)(v) for v in range(0, 300, 13)]
