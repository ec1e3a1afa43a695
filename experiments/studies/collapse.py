"""The stability study's collapse rule, survival curves and time to collapse
(docs/REPRODUCTION.md, "Stability"). Pure functions, standard library only; each is tested on
synthetic curves and against a slow version in tests/experiments/test_stability_analysis.py.

The collapse rule (`CollapseRule`, `collapse`). A run has collapsed at the earliest onset of:

- accuracy: `eval_consecutive` consecutive held-out evaluations, each below BOTH
  `eval_fraction` x the running peak and the running peak - `eval_min_drop` (the peak over the
  evaluations up to and including that one, version 0's included). Dated at the first of them.
  Both conditions: a relative fall alone is noise where the peak is low (0.7 x 0.1), an absolute
  one alone is no fall where it is high. One evaluation below (a noisy dip) is not a collapse,
  nor is a fall in the run's last `eval_consecutive - 1` evaluations (not confirmed).
- reward: the `reward_window`-step trailing mean of the training reward below both
  `reward_fraction` x its running peak and the peak - `reward_min_drop`, for `sustain`
  consecutive steps; only full windows count. Dated at the first of those steps.
- length: the `length_window`-step trailing mean of the response length above `length_high`
  x or below `length_low` x its first full window's value, for `sustain` consecutive steps.
  Dated at the first.
- a non-finite policy loss: at its step.

`collapse` returns (step, cause) or None; cause is accuracy, reward, length or nonfinite.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from experiments.studies import metrics as sm

Z95 = 1.959963984540054     # the standard normal's 97.5% quantile


@dataclasses.dataclass(frozen=True)
class CollapseRule:
    eval_fraction: float = 0.7
    eval_min_drop: float = 0.10
    eval_consecutive: int = 2
    reward_window: int = 10
    reward_fraction: float = 0.6
    reward_min_drop: float = 0.15
    length_window: int = 10
    length_high: float = 2.0
    length_low: float = 0.5
    sustain: int = 10

    def __post_init__(self):
        for name in ("eval_consecutive", "reward_window", "length_window", "sustain"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("eval_fraction", "reward_fraction", "length_low"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)}: must be in (0, 1)")
        if self.length_high <= 1.0:
            raise ValueError(f"length_high={self.length_high}: must be > 1")


RULE = CollapseRule()
CAUSES = ("accuracy", "reward", "length", "nonfinite")


def _first_streak(flags: Sequence[bool], length: int) -> Optional[int]:
    """The index where the first run of `length` consecutive True values starts, or None."""
    run = 0
    for i, f in enumerate(flags):
        run = run + 1 if f else 0
        if run >= length:
            return i - length + 1
    return None


def accuracy_onset(evals: Sequence[Tuple[int, float]], rule: CollapseRule = RULE
                   ) -> Optional[int]:
    """The step of the accuracy criterion's onset (module docstring), or None."""
    return _peak_drop_onset(sorted(evals), rule.eval_fraction, rule.eval_min_drop,
                            rule.eval_consecutive)


def _peak_drop_onset(points: Sequence[Tuple[int, float]], fraction: float, min_drop: float,
                     streak: int) -> Optional[int]:
    """The step starting the first `streak` points in a row each below both `fraction` x the
    running peak and the peak minus `min_drop` (the peak includes the point itself), or None."""
    flags, peak = [], -math.inf
    for _, v in points:
        peak = max(peak, v)
        flags.append(v < min(fraction * peak, peak - min_drop))
    i = _first_streak(flags, streak)
    return None if i is None else points[i][0]


def trailing_full_means(points: Sequence[Tuple[int, float]], window: int
                        ) -> List[Tuple[int, float]]:
    """(step, mean of the `window` values ending at it) for each step with a full window."""
    pts = sorted(points)
    vals = [v for _, v in pts]
    return [(pts[i][0], sum(vals[i - window + 1:i + 1]) / window)
            for i in range(window - 1, len(pts))]


def reward_onset(rewards: Sequence[Tuple[int, float]], rule: CollapseRule = RULE
                 ) -> Optional[int]:
    return _peak_drop_onset(trailing_full_means(rewards, rule.reward_window),
                            rule.reward_fraction, rule.reward_min_drop, rule.sustain)


def length_onset(lengths: Sequence[Tuple[int, float]], rule: CollapseRule = RULE
                 ) -> Optional[int]:
    smooth = trailing_full_means(lengths, rule.length_window)
    if not smooth or smooth[0][1] <= 0:
        return None
    start = smooth[0][1]
    flags = [v > rule.length_high * start or v < rule.length_low * start for _, v in smooth]
    i = _first_streak(flags, rule.sustain)
    return None if i is None else smooth[i][0]


def collapse(evals: Sequence[Tuple[int, float]], rewards: Sequence[Tuple[int, float]] = (),
             lengths: Sequence[Tuple[int, float]] = (), nonfinite_step: Optional[int] = None,
             rule: CollapseRule = RULE) -> Optional[Tuple[int, str]]:
    """(onset step, cause) of the earliest criterion that fires (module docstring), or None.
    evals: (policy version, held-out accuracy); rewards, lengths: (learner step, value)."""
    found = [(s, c) for s, c in ((accuracy_onset(evals, rule), "accuracy"),
                                 (reward_onset(rewards, rule), "reward"),
                                 (length_onset(lengths, rule), "length"),
                                 (nonfinite_step, "nonfinite")) if s is not None]
    return min(found, key=lambda f: (f[0], CAUSES.index(f[1]))) if found else None


# --- proportions and survival ------------------------------------------------------------------
def wilson(k: int, n: int, z: float = Z95) -> Tuple[Optional[float], Optional[float]]:
    """The Wilson score interval of k successes in n trials: the p with
    (k/n - p)^2 <= z^2 p (1 - p) / n. (None, None) when n = 0."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"k={k}, n={n}: need 0 <= k <= n")
    if n == 0:
        return None, None
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # the ends at k = 0 and k = n are exactly 0 and 1 (the formula's rounding aside)
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else
                                                         min(1.0, centre + half))


def survival(collapse_steps: Sequence[Optional[int]], steps: Sequence[int], z: float = Z95
             ) -> List[Dict[str, object]]:
    """At each step t of `steps`: the runs not yet collapsed (collapse step None or > t) out of
    all of them, the fraction and its Wilson interval. Every run is observed to the end
    (no censoring before max_steps)."""
    n = len(collapse_steps)
    out = []
    for t in steps:
        alive = sum(1 for c in collapse_steps if c is None or c > t)
        lo, hi = wilson(alive, n, z)
        out.append({"step": t, "runs": n, "surviving": alive,
                    "fraction": alive / n if n else None, "lo": lo, "hi": hi})
    return out


def time_to_collapse(collapse_steps: Sequence[Optional[int]], max_steps: int
                     ) -> Dict[str, Optional[float]]:
    """collapsed (count), runs, collapsed_frac with its Wilson interval, the mean step of the
    collapsed runs with a t interval (mean_step, mean_lo, mean_hi), their median, and the
    restricted mean survival time: the mean over all runs of min(collapse step, max_steps)
    with a t interval (rmst, rmst_lo, rmst_hi)."""
    n = len(collapse_steps)
    hit = sorted(c for c in collapse_steps if c is not None)
    lo, hi = wilson(len(hit), n)
    ci = sm.mean_ci(hit)
    rm = sm.mean_ci([max_steps if c is None else min(c, max_steps) for c in collapse_steps])
    median = None
    if hit:
        mid = len(hit) // 2
        median = float(hit[mid]) if len(hit) % 2 else (hit[mid - 1] + hit[mid]) / 2.0
    return {"runs": n, "collapsed": len(hit), "collapsed_frac": len(hit) / n if n else None,
            "collapsed_lo": lo, "collapsed_hi": hi, "mean_step": ci["mean"],
            "mean_lo": ci["lo"], "mean_hi": ci["hi"], "median_step": median,
            "rmst": rm["mean"], "rmst_lo": rm["lo"], "rmst_hi": rm["hi"]}
