"""The policy's learning-rate schedule: a pure function of the policy version.

    lr(version) = policy_lr * lr_factor(version, schedule, warmup_steps, total_steps)

`version` counts policy steps taken (the learner's version, 0 before the first), so the schedule
needs no state of its own: a resumed learner continues it from its version. Warm-up rises
linearly from 1/(warmup+1) to 1 over `warmup_steps`; then `constant` stays at 1, `linear` falls
to 0 at `total_steps` and `cosine` follows half a cosine to 0 there. Pure Python (the
schedule names come from the config).
"""
from __future__ import annotations

import math

from sao_actor_learner.config.sections import LR_SCHEDULES as SCHEDULES


def lr_factor(version: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The multiplier of policy_lr for the step taken at policy `version` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"lr schedule {schedule!r}: must be one of {', '.join(SCHEDULES)}")
    if version < warmup_steps:
        return (version + 1) / (warmup_steps + 1)
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (version - warmup_steps) / (total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
