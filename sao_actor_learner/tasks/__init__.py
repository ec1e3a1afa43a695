"""Verifiable tasks. Each task module describes itself with a `TASK_SPEC` and is registered by
one line of `registry.TASK_MODULES`; `make_task(name, seed)` builds one by name.

The task classes are imported on first use (PEP 562), so importing the package (the launcher
does, to validate a config) does not load the task modules.
"""
import importlib

from sao_actor_learner import core
from sao_actor_learner.tasks.registry import task_names, task_spec

_CLASSES = {"ArithmeticTask": "sao_actor_learner.tasks.arithmetic",
            "CalculatorToolTask": "sao_actor_learner.tasks.calculator_tool",
            "OnlineShiftTask": "sao_actor_learner.tasks.online_shift",
            "PreferenceDriftTask": "sao_actor_learner.tasks.preference_drift"}


def make_task(name: str, seed: int = 0, **kwargs) -> core.Task:
    """The task called `name`, built with `seed` and any task-specific keyword arguments (a
    registered task with a `task_class`; the dataset task is built from a config:
    `task_spec("dataset").build`)."""
    spec = task_spec(name)
    if spec.task_class is None:
        names = [n for n in task_names() if task_spec(n).task_class is not None]
        raise ValueError(f"task={name!r} is built from a run configuration (task_spec({name!r})"
                         f".build); make_task builds {', '.join(names)}")
    return spec.task_class(seed=seed, **kwargs)


def __getattr__(attr: str):
    if attr in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[attr]), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["ArithmeticTask", "CalculatorToolTask", "OnlineShiftTask", "PreferenceDriftTask",
           "make_task", "task_names", "task_spec"]
