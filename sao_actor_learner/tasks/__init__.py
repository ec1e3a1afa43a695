"""Verifiable tasks. `make_task(name, seed)` builds one by name (config.TASKS lists the names).

The task classes are imported on first use (PEP 562), so importing the package (the launcher
does, to validate a config) does not load torch through the tasks' tokenizer models.
"""
import importlib

from sao_actor_learner import core

_TASKS = {"arithmetic": ("sao_actor_learner.tasks.arithmetic", "ArithmeticTask"),
          "calculator_tool": ("sao_actor_learner.tasks.calculator_tool", "CalculatorToolTask"),
          "online_shift": ("sao_actor_learner.tasks.online_shift", "OnlineShiftTask")}
_CLASSES = {cls: module for module, cls in _TASKS.values()}


def _task_class(name: str):
    module, cls = _TASKS[name]
    return getattr(importlib.import_module(module), cls)


def make_task(name: str, seed: int = 0, **kwargs) -> core.Task:
    """The task called `name`, built with `seed` and any task-specific keyword arguments."""
    if name not in _TASKS:
        raise ValueError(f"task={name!r}: must be one of {', '.join(sorted(_TASKS))}")
    return _task_class(name)(seed=seed, **kwargs)


def __getattr__(attr: str):
    if attr in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[attr]), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["ArithmeticTask", "CalculatorToolTask", "OnlineShiftTask", "make_task"]
