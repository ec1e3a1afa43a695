"""Forced staleness lags: the distribution an actor draws each batch's lag from (a drift
experiment; docs/METHOD.md section 9, "Drift sources").

With forced staleness an actor admitted at policy version P generates with the weights of
version P - lag. The lag is one constant k, or a draw per admitted actor batch from a
distribution over {0, ..., max_staleness} whose mean is exactly k:

  constant   lag = k.
  geometric  P(lag = l) proportional to q^l on {0, ..., M}, q in (0, 1) solved so the mean is k
             (needs k < M/2: q -> 1 is the uniform distribution, mean M/2).
  zipf       P(lag = l) proportional to (l + c)^-alpha on {0, ..., M} (a Zipf-Mandelbrot law,
             a discrete power law with tail exponent alpha), c > 0 solved so the mean is k (needs
             k < M/2 too: c -> infinity is the uniform distribution). alpha > 2: the untruncated
             law then has a finite mean, so the tail, not the cut at M, sets the mean.

M is max_staleness: no lag ever exceeds it (the learner would drop the rollout). Each lag is
the batch's, not the rollout's: an engine generates a batch with one set of weights, so one
actor batch (one admission grant) shares one lag, and a learner batch of batch_size rollouts
holds batch_size / actor_batch independent draws. The actor's draws are seeded by (seed,
actor id): a run draws the same lags again. A version P < lag gives version 0 (lag P).

Standard library only (the config's checks import it without numpy or torch).
"""
from __future__ import annotations

import bisect
import math
import random
from typing import List, Optional, Sequence

LAG_DISTRIBUTIONS = ("constant", "geometric", "zipf")


def lag_problem(distribution: str, mean: int, alpha: float, max_lag: int) -> Optional[str]:
    """Why (distribution, mean, alpha, max_lag) has no lag distribution here; None if it has."""
    if distribution not in LAG_DISTRIBUTIONS:
        return f"must be one of {', '.join(LAG_DISTRIBUTIONS)}"
    if distribution == "constant" or mean == 0:
        return None
    if distribution == "zipf" and not alpha > 2.0:
        return (f"a power-law tail with exponent alpha={alpha} <= 2 has no finite mean, so "
                "forced_staleness could not be the mean of the law (the truncation at "
                "max_staleness would set it); use alpha > 2")
    if not 2 * mean < max_lag:
        return (f"a {distribution} lag over [0, max_staleness={max_lag}] has a mean below "
                f"max_staleness/2 (its flattest form is the uniform distribution), so it cannot "
                f"have mean forced_staleness={mean}; raise max_staleness above {2 * mean}")
    return None


def _normalised(weights: Sequence[float]) -> List[float]:
    total = math.fsum(weights)
    return [w / total for w in weights]


def _mean(pmf: Sequence[float]) -> float:
    return math.fsum(i * p for i, p in enumerate(pmf))


def _geometric(q: float, max_lag: int) -> List[float]:
    return _normalised([q ** i for i in range(max_lag + 1)])


def _zipf(c: float, alpha: float, max_lag: int) -> List[float]:
    # (l + c)^-alpha relative to l = 0, in logs (c may be tiny or huge)
    return _normalised([math.exp(-alpha * (math.log(i + c) - math.log(c)))
                        for i in range(max_lag + 1)])


def _solve(pmf_of, low: float, high: float, mean: float, log_scale: bool) -> List[float]:
    """The pmf of the parameter in [low, high] whose mean is `mean` (the mean increases with
    the parameter), by bisection to float precision."""
    for _ in range(200):
        mid = math.sqrt(low * high) if log_scale else (low + high) / 2
        if _mean(pmf_of(mid)) < mean:
            low = mid
        else:
            high = mid
    return pmf_of(math.sqrt(low * high) if log_scale else (low + high) / 2)


def lag_pmf(distribution: str, mean: int, alpha: float, max_lag: int) -> List[float]:
    """P(lag = l) for l = 0..max_lag (module docstring); ValueError when `lag_problem` says
    there is none."""
    problem = lag_problem(distribution, mean, alpha, max_lag)
    if problem is not None:
        raise ValueError(f"forced_staleness_distribution={distribution!r}: {problem}")
    if not 0 <= mean <= max_lag:
        raise ValueError(f"forced_staleness={mean}: must be in [0, max_staleness={max_lag}]")
    if distribution == "constant" or mean == 0:
        return [1.0 if i == mean else 0.0 for i in range(max_lag + 1)]
    if distribution == "geometric":
        return _solve(lambda q: _geometric(q, max_lag), 0.0, 1.0, mean, log_scale=False)
    return _solve(lambda c: _zipf(c, alpha, max_lag), 1e-12, 1e12, mean, log_scale=True)


class LagSampler:
    """Draws lags from `lag_pmf(...)` with its own seeded generator (one per actor)."""

    def __init__(self, distribution: str, mean: int, alpha: float, max_lag: int, seed=0):
        self.pmf = lag_pmf(distribution, mean, alpha, max_lag)
        self.max_lag = max(i for i, p in enumerate(self.pmf) if p > 0)
        self._cdf = []
        total = 0.0
        for p in self.pmf:
            total += p
            self._cdf.append(total)
        self._rng = random.Random(repr(seed))

    def draw(self) -> int:
        """One lag."""
        u = self._rng.random() * self._cdf[-1]
        return min(bisect.bisect_right(self._cdf, u), self.max_lag)

    @property
    def mean(self) -> float:
        return _mean(self.pmf)

    @property
    def variance(self) -> float:
        m = self.mean
        return math.fsum(p * (i - m) ** 2 for i, p in enumerate(self.pmf))
