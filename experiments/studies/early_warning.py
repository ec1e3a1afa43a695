"""Early warning of a collapse: do the drift metrics cross a threshold before a run collapses,
how many steps ahead, and how often do they cross in runs that never collapse?
(docs/REPRODUCTION.md, "Stability"). Pure functions, standard library only; tested on synthetic
runs in tests/experiments/test_stability_analysis.py.

An indicator is a learner metric (one value per step), a direction and thresholds. It fires at
the first step whose trailing median over `WINDOW` steps (only full windows; a median, so one
spike does not fire it) is below (ESS) or above (the rest) the threshold. Per run and
(indicator, threshold), with C the collapse step (experiments/studies/collapse.py) and F the
fire step:
  hit          C and F, F <= C; lead time C - F (0: fired at the collapse step)
  miss         C, and no F or F > C (fired late or never)
  false alarm  F, no C (the run never collapsed)
  quiet        neither
Per arm: counts, the hit rate among collapsed runs and the false-alarm rate among the others
(Wilson 95% intervals), and the lead times' mean [t interval], median, min and max.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from experiments.studies import collapse as cl
from experiments.studies import metrics as sm

WINDOW = 5


@dataclasses.dataclass(frozen=True)
class Indicator:
    name: str
    key: str                       # the metrics.jsonl train-row key
    direction: str                 # "below" or "above"
    thresholds: Tuple[float, ...]
    label: str = ""

    def __post_init__(self):
        if self.direction not in ("below", "above"):
            raise ValueError(f"direction={self.direction!r}: must be below or above")


INDICATORS = (
    Indicator("ess_drop", "ess", "below", (0.95, 0.9, 0.8), "ESS below"),
    Indicator("chi2_rise", "chi2_token", "above", (0.1, 0.5, 2.0), "token chi-square above"),
    Indicator("k3_kl_rise", "kl_rollout", "above", (0.01, 0.05, 0.1), "k3 KL above"),
    # DIS's band whatever the loss (learner/drift.py): PPO-clip's own clip fraction is 0 here
    Indicator("masked_rise", "ratio_outside_band_frac", "above", (0.01, 0.05, 0.1),
              "fraction outside DIS's band above"),
)
OUTCOMES = ("hit", "miss", "false_alarm", "quiet")


def trailing_medians(points: Sequence[Tuple[int, float]], window: int = WINDOW
                     ) -> List[Tuple[int, float]]:
    """(step, median of the `window` values ending at it) for each step with a full window."""
    pts = sorted(points)
    out = []
    for i in range(window - 1, len(pts)):
        vals = sorted(v for _, v in pts[i - window + 1:i + 1])
        mid = window // 2
        out.append((pts[i][0], vals[mid] if window % 2 else (vals[mid - 1] + vals[mid]) / 2))
    return out


def fire_step(points: Sequence[Tuple[int, float]], direction: str, threshold: float,
              window: int = WINDOW) -> Optional[int]:
    """The first step whose trailing median crosses `threshold` in `direction`, or None."""
    for step, m in trailing_medians(points, window):
        if (m < threshold) if direction == "below" else (m > threshold):
            return step
    return None


def outcome(collapse_step: Optional[int], fire: Optional[int]) -> Tuple[str, Optional[int]]:
    """(hit | miss | false_alarm | quiet, lead time for a hit else None)."""
    if collapse_step is not None:
        if fire is not None and fire <= collapse_step:
            return "hit", collapse_step - fire
        return "miss", None
    return ("false_alarm", None) if fire is not None else ("quiet", None)


def run_warnings(series: Dict[str, Sequence[Tuple[int, float]]], collapse_step: Optional[int],
                 indicators: Sequence[Indicator] = INDICATORS, window: int = WINDOW
                 ) -> List[Dict[str, object]]:
    """One row per (indicator, threshold) of one run: fire_step, outcome, lead. `series`:
    {metric key: [(step, value)]}; a missing key gives no fire."""
    out = []
    for ind in indicators:
        for thr in ind.thresholds:
            fire = fire_step(series.get(ind.key, ()), ind.direction, thr, window)
            kind, lead = outcome(collapse_step, fire)
            out.append({"indicator": ind.name, "key": ind.key, "direction": ind.direction,
                        "threshold": thr, "fire_step": fire, "collapse_step": collapse_step,
                        "outcome": kind, "lead": lead})
    return out


def summarize(rows: Sequence[Dict[str, object]]) -> Dict[str, object]:
    """Counts, rates with Wilson intervals and lead-time statistics of the per-run rows of
    one arm and one (indicator, threshold)."""
    counts = {k: sum(1 for r in rows if r["outcome"] == k) for k in OUTCOMES}
    collapsed = counts["hit"] + counts["miss"]
    stable = counts["false_alarm"] + counts["quiet"]
    leads = sorted(r["lead"] for r in rows if r["outcome"] == "hit")
    hit_lo, hit_hi = cl.wilson(counts["hit"], collapsed)
    fa_lo, fa_hi = cl.wilson(counts["false_alarm"], stable)
    ci = sm.mean_ci(leads)
    median = None
    if leads:
        mid = len(leads) // 2
        median = float(leads[mid]) if len(leads) % 2 else (leads[mid - 1] + leads[mid]) / 2.0
    return {"runs": len(rows), "collapsed": collapsed, **counts,
            "hit_rate": counts["hit"] / collapsed if collapsed else None,
            "hit_lo": hit_lo, "hit_hi": hit_hi,
            "false_alarm_rate": counts["false_alarm"] / stable if stable else None,
            "false_alarm_lo": fa_lo, "false_alarm_hi": fa_hi,
            "lead_mean": ci["mean"], "lead_lo": ci["lo"], "lead_hi": ci["hi"],
            "lead_median": median, "lead_min": leads[0] if leads else None,
            "lead_max": leads[-1] if leads else None}
