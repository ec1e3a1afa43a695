"""Early warning of a collapse: do the drift metrics cross a threshold before a run collapses,
how many steps ahead, and how often do they cross in runs that never collapse?
(docs/REPRODUCTION.md, "Stability"). Pure functions, standard library only; tested on synthetic
runs in tests/experiments/test_stability_analysis.py.

An indicator is a learner metric (one value per step), a direction and thresholds. It fires at
the first step whose trailing median over `WINDOW` steps (only full windows; a median, so one
spike does not fire it) is below (ESS) or above (the rest) the threshold.

A relative indicator ("..._rel") fires on a rise over the run's own level instead: with the
excess e = value (1 - value for ESS), its baseline is the median of e over the BASELINE steps
from `start` (the caller's: the step at which forced staleness has reached k, 1 otherwise), and
it fires at the first later step whose trailing median of e exceeds both factor x baseline and
the indicator's floor (so a run without drift, e ~ 0, never fires). Under a constant forced
staleness the absolute thresholds fire as soon as the staleness is there; the relative ones ask
whether drift grows before a collapse. A run that collapses before its baseline is complete
cannot be warned by them (a miss). Per run and
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
BASELINE = 10


@dataclasses.dataclass(frozen=True)
class Indicator:
    name: str
    key: str                       # the metrics.jsonl train-row key
    direction: str                 # "below" or "above"
    thresholds: Tuple[float, ...]      # relative: factors over the run's baseline
    label: str = ""
    relative: bool = False
    floor: float = 0.0                 # relative: the excess must also be above this

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
    # rises over the run's own level (floors: the smallest absolute thresholds above)
    Indicator("ess_drop_rel", "ess", "below", (2.0, 4.0), "1 - ESS over its baseline, x",
              relative=True, floor=0.05),
    Indicator("chi2_rise_rel", "chi2_token", "above", (2.0, 4.0),
              "chi-square over its baseline, x", relative=True, floor=0.1),
    Indicator("k3_kl_rise_rel", "kl_rollout", "above", (2.0, 4.0), "k3 KL over its baseline, x",
              relative=True, floor=0.01),
    Indicator("masked_rise_rel", "ratio_outside_band_frac", "above", (2.0, 4.0),
              "band fraction over its baseline, x", relative=True, floor=0.01),
)
OUTCOMES = ("hit", "miss", "false_alarm", "quiet")


def middle(ind: Indicator) -> float:
    """The threshold the figure and stability.md show per variant (the lower middle one)."""
    return ind.thresholds[(len(ind.thresholds) - 1) // 2]


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


def _median(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2.0


def relative_fire_step(points: Sequence[Tuple[int, float]], direction: str, factor: float,
                       floor: float, start: int = 1, window: int = WINDOW,
                       baseline: int = BASELINE) -> Optional[int]:
    """The first step after the baseline (the BASELINE steps from `start`) whose trailing
    median excess exceeds factor x the baseline's median excess and `floor`, or None (also
    when the run has no complete baseline). Excess: the value, or 1 - value for "below"."""
    excess = sorted((s, v if direction == "above" else 1.0 - v) for s, v in points)
    base = [e for s, e in excess if s >= start][:baseline]
    if len(base) < baseline:
        return None
    level = _median(base)
    after = [s for s, _ in excess if s >= start][baseline - 1]
    for step, m in trailing_medians(excess, window):
        if step > after and m > factor * level and m > floor:
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
                 indicators: Sequence[Indicator] = INDICATORS, window: int = WINDOW,
                 start: int = 1) -> List[Dict[str, object]]:
    """One row per (indicator, threshold) of one run: fire_step, outcome, lead. `series`:
    {metric key: [(step, value)]}; a missing key gives no fire. `start`: where a relative
    indicator's baseline begins."""
    out = []
    for ind in indicators:
        for thr in ind.thresholds:
            points = series.get(ind.key, ())
            fire = (relative_fire_step(points, ind.direction, thr, ind.floor, start, window)
                    if ind.relative else fire_step(points, ind.direction, thr, window))
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
