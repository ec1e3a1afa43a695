"""Verifiable tasks. `make_task(name, seed)` builds one by name (config.TASKS lists the names)."""
from sao_actor_learner import core
from sao_actor_learner.tasks.arithmetic import ArithmeticTask
from sao_actor_learner.tasks.calculator_tool import CalculatorToolTask
from sao_actor_learner.tasks.online_shift import OnlineShiftTask

_TASKS = {"arithmetic": ArithmeticTask, "calculator_tool": CalculatorToolTask,
          "online_shift": OnlineShiftTask}


def make_task(name: str, seed: int = 0, **kwargs) -> core.Task:
    """The task called `name`, built with `seed` and any task-specific keyword arguments."""
    if name not in _TASKS:
        raise ValueError(f"task={name!r}: must be one of {', '.join(sorted(_TASKS))}")
    return _TASKS[name](seed=seed, **kwargs)


__all__ = ["ArithmeticTask", "CalculatorToolTask", "OnlineShiftTask", "make_task"]
