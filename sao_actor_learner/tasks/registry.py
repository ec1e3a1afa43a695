"""The task registry: every task the config's --task accepts, each described by its own module.

A task module defines `TASK_SPEC`, a `TaskSpec`: a one-paragraph description, how to build the
task from a run configuration, its defaults for the config fields left at 0 / "", the checks of
the options it reads, and the options only it may be given. `TASK_MODULES` below is the
registration: one line per task, name -> the module holding its spec. Adding a task is its module
plus that line (docs/DESIGN.md, "Adding an algorithm, a task, an engine").

Task modules are imported when first asked for (`task_spec`); the config's checks ask every
registered task (each checks the options only it may be given), so validating a config imports
every task module: they import numpy, never torch. Nothing here
imports `config`: a `fail(message)` callback turns a check's message into a ConfigError there.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from sao_actor_learner import core

Fail = Callable[[str], None]

# The registration: task name -> the module whose TASK_SPEC describes it (in --task's order).
TASK_MODULES: Dict[str, str] = {
    "arithmetic": "sao_actor_learner.tasks.arithmetic",
    "online_shift": "sao_actor_learner.tasks.online_shift",
    "preference_drift": "sao_actor_learner.tasks.preference_drift",
    "calculator_tool": "sao_actor_learner.tasks.calculator_tool",
    "dataset": "sao_actor_learner.tasks.dataset",
}


def no_checks(config: Any, fail: Fail) -> None:
    """The checks of a task that reads no options of its own."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the program knows of a task.

    name:        the --task value.
    description: one paragraph: what the task asks of the model and how it is scored.
    build:       build(config, actor_id, tokenizer) -> core.Task, the task of one actor
                 (prompt ids offset by actor_id, strided by config.num_actors) or of the
                 evaluator (actor_id 0); `tokenizer` is the model's (None: the task's own).
    defaults:    config field -> the value it takes when left at 0 / "" ("actor_batch": the
                 config's actor_batch).
    check:       check(config, fail): calls fail(message) for an invalid option of the task
                 (run with the checks across config sections).
    exclusive_options: config fields only this task reads; giving them with another task is
                 a config error.
    task_class:  the class `tasks.make_task(name, seed, **kwargs)` builds; None when the task
                 needs more than keyword arguments (the dataset task's files and reward).
    """
    name: str
    description: str
    build: Callable[[Any, int, Optional[core.Tokenizer]], core.Task]
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    check: Callable[[Any, Fail], None] = no_checks
    exclusive_options: Tuple[str, ...] = ()
    task_class: Optional[type] = None


def task_names() -> Tuple[str, ...]:
    """The registered task names, in --task's order."""
    return tuple(TASK_MODULES)


def task_spec(name: str) -> TaskSpec:
    """The spec of task `name`; a ValueError names the registered tasks."""
    if name not in TASK_MODULES:
        raise ValueError(f"task={name!r}: must be one of {', '.join(TASK_MODULES)}")
    spec = importlib.import_module(TASK_MODULES[name]).TASK_SPEC
    if spec.name != name:
        raise ValueError(f"task {name!r} is registered to {TASK_MODULES[name]}, whose TASK_SPEC "
                         f"is named {spec.name!r}")
    return spec


def resolved_defaults(name: str, actor_batch: int) -> Dict[str, Any]:
    """Task `name`'s defaults with "actor_batch" replaced by `actor_batch`."""
    return {field: actor_batch if value == "actor_batch" else value
            for field, value in task_spec(name).defaults.items()}


def check_task(config: Any, fail: Fail) -> None:
    """The chosen task's checks, then that no other task's exclusive options are given (a
    task that is not registered is the task field's own error, not checked here)."""
    if config.task not in TASK_MODULES:
        return
    task_spec(config.task).check(config, fail)
    fields = {f.name: f for f in dataclasses.fields(config)}
    for name in TASK_MODULES:
        if name == config.task:
            continue
        for option in task_spec(name).exclusive_options:
            if getattr(config, option) != fields[option].default:
                fail(f"{option}={getattr(config, option)!r} applies only to --task={name} "
                     f"(task={config.task!r}); add --task={name} or drop --{option}")
