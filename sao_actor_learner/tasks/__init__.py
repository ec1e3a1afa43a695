"""Verifiable tasks. `make_task(name, seed)` builds one by name (config.TASKS lists the names)."""
from sao_actor_learner import core
from sao_actor_learner.tasks.arithmetic import ArithmeticTask

_TASKS = {"arithmetic": ArithmeticTask}


def make_task(name: str, seed: int = 0, **kwargs) -> core.Task:
    """The task called `name`, built with `seed` and any task-specific keyword arguments."""
    if name not in _TASKS:
        raise ValueError(f"task={name!r}: must be one of {', '.join(sorted(_TASKS))}")
    return _TASKS[name](seed=seed, **kwargs)


__all__ = ["ArithmeticTask", "make_task"]
