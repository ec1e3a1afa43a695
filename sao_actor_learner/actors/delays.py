"""Injected actor delays, for controlled staleness studies (config actor_delay*).

Each rollout an actor generates is held back `delay` seconds before it is inserted into replay,
as if its generation had taken that much longer; an actor inserts a batch's rollouts in the
order they become ready. Slow rollouts make the policy move on while they wait, so they arrive
staler: the learner's staleness limit and admission control are what keep them in bounds.

  fixed:        every delay is `mean_s`.
  uniform:      U(0, 2 mean_s).
  heavy_tailed: Pareto II (Lomax) with shape a > 1 and mean `mean_s` (scale = mean_s (a - 1));
                a <= 2 has infinite variance: most rollouts are quick, a few are very late.
Every delay is capped at `max_s`.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

DELAY_KINDS = ("none", "fixed", "uniform", "heavy_tailed")

DelaySampler = Callable[[int], np.ndarray]


def sample_delays(kind: str, n: int, rng: np.random.Generator, mean_s: float,
                  max_s: float = float("inf"), tail: float = 1.5) -> np.ndarray:
    """n delays in seconds from the distribution `kind` (see the module docstring)."""
    if kind not in DELAY_KINDS:
        raise ValueError(f"actor_delay={kind!r}: must be one of {', '.join(DELAY_KINDS)}")
    if mean_s < 0 or max_s <= 0:
        raise ValueError(f"mean_s={mean_s}, max_s={max_s}: need mean_s >= 0 and max_s > 0")
    if kind == "none" or mean_s == 0:
        d = np.zeros(n)
    elif kind == "fixed":
        d = np.full(n, float(mean_s))
    elif kind == "uniform":
        d = rng.uniform(0.0, 2.0 * mean_s, size=n)
    else:
        if tail <= 1.0:
            raise ValueError(f"tail={tail}: the Pareto shape must be > 1 for a finite mean")
        d = mean_s * (tail - 1.0) * rng.pareto(tail, size=n)
    return np.minimum(d, max_s)


def make_delay_sampler(kind: str, mean_s: float, max_s: float, tail: float,
                       rng: np.random.Generator) -> Optional[DelaySampler]:
    """A function n -> n delays, or None when no delay is injected."""
    if kind == "none" or mean_s <= 0:
        return None
    sample_delays(kind, 1, np.random.default_rng(0), mean_s, max_s, tail)  # validate now
    return lambda n: sample_delays(kind, n, rng, mean_s, max_s, tail)
