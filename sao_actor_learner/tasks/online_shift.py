"""Addition whose preferred answer flips in phases: the online setting of docs/METHOD.md section 12.

Prompts, split and tokenizer are `ArithmeticTask`'s. The reward rule depends on the phase,
`(policy_version // shift_every) % 2`:

  phase 0 ("carry"):    the true sum, 37+45 -> "82" (the arithmetic task's rule);
  phase 1 ("no_carry"): the carry-free, column-wise sum, 37+45 -> "72" (the schoolchild slip).

Both answers are in the warm start's support (its SFT teacher forgets carries 60% of the time),
so RL can move between them; problems without carries are right under both rules. The phase of
an episode is the policy version of the engine that starts it (actors) or that is evaluated
(evaluator): the builder hands the task a `version_source`, the engine's version. Without one,
the task stays in phase 0.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from sao_actor_learner import core
from sao_actor_learner.models.tokenizer import decode_until_eos
from sao_actor_learner.tasks.arithmetic import (ARITHMETIC_DEFAULTS, ArithmeticTask,
                                               no_carry_sum)
from sao_actor_learner.tasks.registry import TaskSpec

PHASE_RULES = ("carry", "no_carry")


def phase_of(version: int, shift_every: int) -> int:
    """The reward phase (0 or 1) of a policy version."""
    if shift_every < 1:
        raise ValueError(f"shift_every={shift_every}: must be >= 1")
    return (max(int(version), 0) // shift_every) % 2


def operands(prompt: core.Prompt):
    """(a, b) from a prompt's text "a+b="."""
    a, b = prompt.text.rstrip("=").split("+")
    return int(a), int(b)


def answer_in_phase(prompt: core.Prompt, phase: int) -> str:
    """The answer the reward prefers in `phase`."""
    a, b = operands(prompt)
    return str(a + b) if phase == 0 else str(no_carry_sum(a, b))


class OnlineShiftEnvironment(core.Environment):
    """One single-turn episode scored under the phase fixed when it was made."""

    def __init__(self, task: "OnlineShiftTask", prompt: core.Prompt, phase: int):
        self._task = task
        self._prompt = prompt
        self.phase = phase
        self._done = False

    def step(self, action_tokens: Sequence[int]) -> core.StepResult:
        if self._done:
            raise RuntimeError(f"prompt {self._prompt.prompt_id}: the episode is over (single "
                               "turn); make a new environment per episode")
        self._done = True
        completion = decode_until_eos(self._task.tokenizer, action_tokens)
        wanted = answer_in_phase(self._prompt, self.phase)
        correct = completion == wanted
        return core.StepResult(observation_tokens=[], reward=1.0 if correct else 0.0, done=True,
                               info={"completion": completion, "answer": wanted,
                                     "phase": self.phase, "correct": correct})


class OnlineShiftTask(ArithmeticTask):
    """Addition with a reward rule that flips between carry and no-carry every `shift_every`
    policy versions. Takes ArithmeticTask's arguments plus `shift_every` and `version_source`."""

    name = "online_shift"

    def __init__(self, shift_every: int = 20,
                 version_source: Optional[Callable[[], int]] = None, **kwargs):
        super().__init__(**kwargs)
        if shift_every < 1:
            raise ValueError(f"shift_every={shift_every}: must be >= 1")
        self.shift_every = shift_every
        self._version_source = version_source

    def set_version_source(self, version_source: Callable[[], int]) -> None:
        """Where the current policy version comes from (the engine's `version`)."""
        self._version_source = version_source

    def current_phase(self) -> int:
        version = self._version_source() if self._version_source is not None else 0
        return phase_of(version, self.shift_every)

    def make_environment(self, prompt: core.Prompt) -> core.Environment:
        return OnlineShiftEnvironment(self, prompt, self.current_phase())

    def is_correct(self, prompt: core.Prompt, completion_tokens: Sequence[int]) -> bool:
        return decode_until_eos(self.tokenizer, completion_tokens) == \
            answer_in_phase(prompt, self.current_phase())


def build_task(config, actor_id: int = 0, tokenizer=None) -> OnlineShiftTask:
    """The online-shift task of `config` for actor `actor_id` (phase 0 until the builder gives
    it the engine's version)."""
    return OnlineShiftTask(shift_every=config.shift_every, seed=config.seed,
                           num_eval=config.eval_size, prompt_id_offset=actor_id,
                           prompt_id_stride=config.num_actors)


def check_options(config, fail) -> None:
    if config.shift_every < 1:
        fail(f"shift_every={config.shift_every}: must be >= 1 (policy versions per reward phase)")


TASK_SPEC = TaskSpec(
    name="online_shift",
    description="The arithmetic task with a reward rule that flips every --shift_every policy "
                "versions between the true sum and the carry-free sum: the online setting of "
                "docs/METHOD.md section 12, measuring how fast training follows a moving target.",
    build=build_task, defaults=ARITHMETIC_DEFAULTS, check=check_options,
    task_class=OnlineShiftTask)
