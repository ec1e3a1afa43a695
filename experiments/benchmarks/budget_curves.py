"""Accuracy-against-time curves of an equal-wall-clock comparison (vs_trl.py --mode=budget).

A curve is a list of (train_clock_s, accuracy) points: each point is a policy that existed at
that moment of its side's training clock (evaluation excluded) and its held-out accuracy. The
accuracy a side "has" at time t is that of its newest evaluated policy published at or before t
(a step function: what a user stopping the run at t would get, at the evaluation cadence's
resolution). From it:

  accuracy_at(curve, t)    the step function at t
  time_to(curve, a)        the first time the step function reaches a (None: never)
  mean_accuracy(curve, B)  the area under the step function over [0, B] divided by B: the
                           accuracy averaged over the budget (1.0 only if perfect from t=0)
  held_time_to(curve, a)   the first time from which the accuracy stays >= a for `hold`
                           evaluations in a row (or to the budget's end): a crossing that one
                           lucky evaluation makes does not count

Pure functions; tests/entry_points/test_bench_budget.py checks each against a slow grid version.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional, Sequence, Tuple

Curve = List[Tuple[float, float]]

__all__ = ["accuracy_at", "time_to", "held_time_to", "mean_accuracy", "curve_metrics", "spread",
           "aggregate_runs", "median_curve"]


def _sorted(curve: Sequence[Tuple[float, float]]) -> Curve:
    return sorted((float(t), float(a)) for t, a in curve)


def accuracy_at(curve: Sequence[Tuple[float, float]], t: float) -> Optional[float]:
    """Accuracy of the newest point at or before t (None before the first point)."""
    acc = None
    for ti, ai in _sorted(curve):
        if ti > t:
            break
        acc = ai
    return acc


def time_to(curve: Sequence[Tuple[float, float]], threshold: float,
            budget_s: Optional[float] = None) -> Optional[float]:
    """The first point's time whose accuracy >= threshold (within the budget), or None."""
    for ti, ai in _sorted(curve):
        if budget_s is not None and ti > budget_s:
            return None
        if ai >= threshold:
            return ti
    return None


def held_time_to(curve: Sequence[Tuple[float, float]], threshold: float,
                 budget_s: Optional[float] = None, hold: int = 3) -> Optional[float]:
    """The first point's time from which this point and the next hold - 1 points (those within
    the budget; fewer where the budget ends first) all have accuracy >= threshold, or None."""
    if hold < 1:
        raise ValueError(f"hold={hold}: must be >= 1")
    points = [(t, a) for t, a in _sorted(curve) if budget_s is None or t <= budget_s]
    for i, (ti, _) in enumerate(points):
        if all(a >= threshold for _, a in points[i:i + hold]):
            return ti
    return None


def mean_accuracy(curve: Sequence[Tuple[float, float]], budget_s: float) -> float:
    """Area under the step function over [0, budget_s] / budget_s (0 before the first point)."""
    if budget_s <= 0:
        raise ValueError(f"budget_s={budget_s}: must be > 0")
    points = [(max(t, 0.0), a) for t, a in _sorted(curve) if t <= budget_s]
    ends = [t for t, _ in points[1:]] + [budget_s]
    area = sum(a * (end - start) for (start, a), end in zip(points, ends))
    return area / budget_s


def curve_metrics(curve: Sequence[Tuple[float, float]], budget_s: float,
                  report_at: Sequence[float], thresholds: Sequence[float]) -> Dict:
    """One run's figures: accuracy at each report time, the budget-mean accuracy, the time to
    each threshold and the time to holding it (None: not within the budget)."""
    return {
        **{f"accuracy_at_{t:g}s": accuracy_at(curve, t) for t in report_at},
        "mean_accuracy": round(mean_accuracy(curve, budget_s), 4),
        **{f"time_to_{a:g}_s": time_to(curve, a, budget_s) for a in thresholds},
        **{f"held_time_to_{a:g}_s": held_time_to(curve, a, budget_s) for a in thresholds},
    }


def spread(values: Sequence[Optional[float]]) -> Dict:
    """median, min, max; None ("not reached") counts as +inf, a median that is None means most
    runs did not get there."""
    vals = [float("inf") if v is None else float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}

    def clean(x: float) -> Optional[float]:
        return None if x == float("inf") else round(x, 4)

    return {"median": clean(statistics.median(vals)), "min": clean(min(vals)),
            "max": clean(max(vals)), "n": len(vals)}


def aggregate_runs(runs: Sequence[Dict], keys: Sequence[str]) -> Dict:
    """{key: spread of that key over the runs}."""
    return {k: spread([r.get(k) for r in runs]) for k in keys}


def median_curve(curves: Sequence[Sequence[Tuple[float, float]]], grid: Sequence[float]
                 ) -> Dict[str, List[Optional[float]]]:
    """The step functions of several runs on a common time grid: median, min and max at each
    grid time (None where no run has a point yet)."""
    out: Dict[str, List[Optional[float]]] = {"median": [], "min": [], "max": []}
    for t in grid:
        vals = [a for a in (accuracy_at(c, t) for c in curves) if a is not None]
        out["median"].append(statistics.median(vals) if vals else None)
        out["min"].append(min(vals) if vals else None)
        out["max"].append(max(vals) if vals else None)
    return out
