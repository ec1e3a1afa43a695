"""Delay distributions in seconds, from specs such as "lognormal:0.02,1.0".

    none                   no delay
    constant:S             always S
    uniform:LO,HI          uniform on [LO, HI]
    exponential:MEAN       exponential with mean MEAN
    lognormal:MEDIAN,SIGMA exp(N(log MEDIAN, SIGMA^2)): a long right tail
    pareto:SCALE,ALPHA     SCALE * (1 + Lomax(ALPHA)), i.e. Pareto with minimum SCALE and tail
                           index ALPHA: heavy-tailed (infinite variance for ALPHA <= 2)

Tool calls draw their latency from one (tasks/tools.py). Only numpy is imported here, so config
validation can parse specs cheaply.
"""
from __future__ import annotations

import dataclasses
from typing import Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class LatencyDistribution:
    """A tool-call delay distribution in seconds; `sample(rng)` draws one delay."""
    kind: str
    params: Tuple[float, ...] = ()

    def sample(self, rng: np.random.Generator) -> float:
        k, p = self.kind, self.params
        if k == "none":
            return 0.0
        if k == "constant":
            return p[0]
        if k == "uniform":
            return float(rng.uniform(p[0], p[1]))
        if k == "exponential":
            return float(rng.exponential(p[0]))
        if k == "lognormal":
            return float(p[0] * np.exp(p[1] * rng.standard_normal()))
        if k == "pareto":
            return float(p[0] * (1.0 + rng.pareto(p[1])))
        raise AssertionError(k)

    @property
    def mean(self) -> float:
        """The distribution's mean (inf for a Pareto with ALPHA <= 1)."""
        k, p = self.kind, self.params
        if k == "none":
            return 0.0
        if k == "constant":
            return p[0]
        if k == "uniform":
            return 0.5 * (p[0] + p[1])
        if k == "exponential":
            return p[0]
        if k == "lognormal":
            return p[0] * float(np.exp(0.5 * p[1] ** 2))
        return p[0] * p[1] / (p[1] - 1.0) if p[1] > 1.0 else float("inf")  # pareto


_LATENCY_ARITY = {"none": 0, "constant": 1, "uniform": 2, "exponential": 1, "lognormal": 2,
                  "pareto": 2}
LATENCY_FORMS = ("none", "constant:S", "uniform:LO,HI", "exponential:MEAN",
                 "lognormal:MEDIAN,SIGMA", "pareto:SCALE,ALPHA")


def parse_latency(spec: str) -> LatencyDistribution:
    """A LatencyDistribution from "kind:p1,p2" (see the module docstring); ValueError if bad."""
    forms = ", ".join(LATENCY_FORMS)
    kind, _, rest = spec.strip().partition(":")
    if kind not in _LATENCY_ARITY:
        raise ValueError(f"latency {spec!r}: unknown kind {kind!r}; use one of {forms}")
    try:
        params = tuple(float(x) for x in rest.split(",")) if rest.strip() else ()
    except ValueError:
        raise ValueError(f"latency {spec!r}: parameters must be numbers; use one of "
                         f"{forms}") from None
    if len(params) != _LATENCY_ARITY[kind]:
        raise ValueError(f"latency {spec!r}: {kind} takes {_LATENCY_ARITY[kind]} parameter(s), "
                         f"got {len(params)}; use one of {forms}")
    if any(not np.isfinite(x) or x < 0 for x in params):
        raise ValueError(f"latency {spec!r}: parameters must be finite and >= 0")
    if kind == "uniform" and params[0] > params[1]:
        raise ValueError(f"latency {spec!r}: uniform needs LO <= HI")
    if kind in ("lognormal", "pareto", "exponential") and params[0] <= 0:
        raise ValueError(f"latency {spec!r}: {kind} needs a first parameter > 0")
    if kind == "pareto" and params[1] <= 0:
        raise ValueError(f"latency {spec!r}: pareto needs ALPHA > 0 (tail index)")
    return LatencyDistribution(kind, params)
