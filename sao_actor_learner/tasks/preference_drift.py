"""Addition whose reward is a mixture of two preferences with a weight that drifts gradually and
noisily over policy versions: non-stationary reward as real environments drift (continuously,
not in `online_shift`'s clean phase flips).

Prompts, split and tokenizer are `ArithmeticTask`'s. Version v's preference weight is

  w(v) = clip(0.5 + amplitude * sin(2 pi v / period) + W(v), 0, 1),
  W(0) = 0, W(v) = W(v - 1) + e_v,  e_v ~ N(0, walk_std^2) i.i.d. (seeded by --seed)

(a sinusoid plus a Gaussian random walk; the same function in every process of a run), and an
episode's reward is

  r = w * [completion == a + b] + (1 - w) * [completion == the carry-free sum]

(problems without carries have one answer, worth 1). The version of an episode is the policy
version of the engine that starts it (actors) or is evaluated (evaluator), as in online_shift;
greedy accuracy counts the answer preferred at that version (w >= 0.5: the true sum). The
learner records w of each step's policy version in its metrics rows (reward_preference_weight).
"""
from __future__ import annotations

import math
import threading
from typing import Callable, List, Optional, Sequence

import numpy as np

from sao_actor_learner import core
from sao_actor_learner.tasks.arithmetic import ARITHMETIC_DEFAULTS, ArithmeticTask
from sao_actor_learner.tasks.online_shift import answer_in_phase
from sao_actor_learner.tasks.registry import TaskSpec

OPTIONS = ("reward_drift_period", "reward_drift_amplitude", "reward_drift_walk_std")
# (period, amplitude, walk_std) of a task made without a weight (make_task): the config's defaults.
DEFAULT_DRIFT = (200.0, 0.4, 0.03)


class PreferenceWeight:
    """w(v) of the module docstring, for versions v >= 0 (negative versions read as 0)."""

    def __init__(self, period: float, amplitude: float, walk_std: float, seed: int = 0):
        if not period > 0 or not amplitude >= 0 or not walk_std >= 0:
            raise ValueError(f"period={period}, amplitude={amplitude}, walk_std={walk_std}: "
                             "need period > 0, amplitude >= 0 and walk_std >= 0")
        self.period, self.amplitude, self.walk_std = float(period), float(amplitude), walk_std
        self._rng = np.random.default_rng([int(seed), 0x5eed])
        self._walk: List[float] = [0.0]
        self._lock = threading.Lock()

    def walk(self, version: int) -> float:
        """W(version): the random walk's value (increments drawn in version order)."""
        version = max(int(version), 0)
        with self._lock:
            while len(self._walk) <= version:
                steps = self._rng.normal(0.0, 1.0, size=max(256, version + 1 - len(self._walk)))
                for e in steps:
                    self._walk.append(self._walk[-1] + self.walk_std * float(e))
            return self._walk[version]

    def __call__(self, version: int) -> float:
        v = max(int(version), 0)
        w = 0.5 + self.amplitude * math.sin(2 * math.pi * v / self.period) + self.walk(v)
        return min(max(w, 0.0), 1.0)


def weight_of_config(config) -> PreferenceWeight:
    """The preference weight of a run configuration (task=preference_drift)."""
    return PreferenceWeight(config.reward_drift_period, config.reward_drift_amplitude,
                            config.reward_drift_walk_std, seed=config.seed)


class PreferenceDriftEnvironment(core.Environment):
    """One single-turn episode scored with the weight fixed when it was made."""

    def __init__(self, task: "PreferenceDriftTask", prompt: core.Prompt, weight: float):
        self._task, self._prompt, self.weight = task, prompt, weight
        self._done = False

    def step(self, action_tokens: Sequence[int]) -> core.StepResult:
        if self._done:
            raise RuntimeError(f"prompt {self._prompt.prompt_id}: the episode is over (single "
                               "turn); make a new environment per episode")
        self._done = True
        completion = self._task.completion_text(action_tokens)
        carry, no_carry = answer_in_phase(self._prompt, 0), answer_in_phase(self._prompt, 1)
        if carry == no_carry:
            reward = 1.0 if completion == carry else 0.0
        else:
            reward = self.weight * (completion == carry) + \
                (1.0 - self.weight) * (completion == no_carry)
        return core.StepResult(observation_tokens=[], reward=float(reward), done=True,
                               info={"completion": completion, "weight": self.weight,
                                     "correct": reward > 0})


class PreferenceDriftTask(ArithmeticTask):
    """Addition with a drifting mixture reward. Takes ArithmeticTask's arguments plus `weight`
    (a PreferenceWeight; None: DEFAULT_DRIFT seeded by `seed`) and `version_source`."""

    name = "preference_drift"

    def __init__(self, weight: Optional[PreferenceWeight] = None,
                 version_source: Optional[Callable[[], int]] = None, **kwargs):
        super().__init__(**kwargs)
        self.weight = weight or PreferenceWeight(*DEFAULT_DRIFT, seed=self.seed)
        self._version_source = version_source

    def set_version_source(self, version_source: Callable[[], int]) -> None:
        """Where the current policy version comes from (the engine's `version`)."""
        self._version_source = version_source

    def current_weight(self) -> float:
        return self.weight(self._version_source() if self._version_source is not None else 0)

    def make_environment(self, prompt: core.Prompt) -> core.Environment:
        return PreferenceDriftEnvironment(self, prompt, self.current_weight())

    def is_correct(self, prompt: core.Prompt, completion_tokens: Sequence[int]) -> bool:
        preferred = answer_in_phase(prompt, 0 if self.current_weight() >= 0.5 else 1)
        return self.completion_text(completion_tokens) == preferred


def build_task(config, actor_id: int = 0, tokenizer=None) -> PreferenceDriftTask:
    """The preference-drift task of `config` for actor `actor_id`."""
    return PreferenceDriftTask(weight_of_config(config), seed=config.seed,
                               num_eval=config.eval_size, prompt_id_offset=actor_id,
                               prompt_id_stride=config.num_actors)


def check_options(config, fail) -> None:
    if not config.reward_drift_period > 0:
        fail(f"reward_drift_period={config.reward_drift_period}: must be > 0 policy versions")
    if not 0 <= config.reward_drift_amplitude <= 0.5:
        fail(f"reward_drift_amplitude={config.reward_drift_amplitude}: must be in [0, 0.5] "
             "(the weight is 0.5 plus the sinusoid, clipped to [0, 1])")
    if not config.reward_drift_walk_std >= 0:
        fail(f"reward_drift_walk_std={config.reward_drift_walk_std}: must be >= 0")
    if config.reward_drift_amplitude == 0 and config.reward_drift_walk_std == 0:
        fail("reward_drift_amplitude=0 and reward_drift_walk_std=0: the preference weight "
             "never moves (a fixed mixture); give one of them a positive value")


TASK_SPEC = TaskSpec(
    name="preference_drift",
    description="The arithmetic task with non-stationary reward: a mixture of the true sum and "
                "the carry-free sum whose weight drifts over policy versions as a sinusoid "
                "(--reward_drift_period, --reward_drift_amplitude) plus a seeded Gaussian random "
                "walk (--reward_drift_walk_std): gradual, noisy preference drift.",
    build=build_task, defaults=ARITHMETIC_DEFAULTS, check=check_options,
    exclusive_options=OPTIONS, task_class=PreferenceDriftTask)
