"""The rule that recommends a staleness limit from measurements (pure: no runs, no files).

Per limit the tuner measures, over repeats, throughput (rollouts/s), drift (mean KL of rollout
vs current policy, mean ESS, the share of steps that raised a drift alarm) and learning per
rollout (the slope of the training reward against rollouts trained, per 1000 rollouts). A
limit passes when
  throughput  its mean rollouts/s is within `throughput_tolerance` (5%) of the best limit's;
  drift       its mean KL <= max_kl and mean ESS >= min_ess (the learner's drift-alarm
              thresholds, config alarm_max_kl and alarm_min_ess), and at most `max_alarm_frac` of
              its steps raised a drift alarm;
  learning    its mean learning per rollout is not below lock-step's noise band: lock-step's
              mean minus the half-width of its 95% interval (over repeats when there are 2 or
              more; with one repeat, 1.96 standard errors of that run's fitted slope).
The recommendation is the smallest limit that passes all three (the least staleness that buys
the throughput); when none does, the fastest of those that pass drift and learning (lock-step
always passes those: it is its own noise band's centre and trains on-policy).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence

from experiments.studies.metrics import finite_values, mean_ci


@dataclasses.dataclass(frozen=True)
class LimitMeasurement:
    """One limit's measurements, a value per repeat (0 is lock-step)."""
    limit: int
    rollouts_per_s: Sequence[float]
    kl: Sequence[float] = ()
    ess: Sequence[float] = ()
    alarm_frac: Sequence[float] = ()
    learning: Sequence[float] = ()          # reward slope per 1000 rollouts
    learning_se: Sequence[float] = ()       # that slope's standard error, per repeat


@dataclasses.dataclass(frozen=True)
class Rule:
    throughput_tolerance: float = 0.05
    max_kl: float = 0.1
    min_ess: float = 0.3
    max_alarm_frac: float = 0.1

    def __post_init__(self):
        if not 0 <= self.throughput_tolerance < 1:
            raise ValueError(f"--throughput_tolerance={self.throughput_tolerance}: must be in "
                             "[0, 1) (0.05: within 5% of the best throughput)")
        if not 0 <= self.max_alarm_frac <= 1:
            raise ValueError(f"--max_alarm_frac={self.max_alarm_frac}: must be in [0, 1]")

    def text(self) -> str:
        return (f"the smallest limit whose rollouts/s is within {self.throughput_tolerance:.0%} "
                f"of the best, whose drift stays under the alarms (mean KL <= {self.max_kl:g}, "
                f"mean ESS >= {self.min_ess:g}, at most {self.max_alarm_frac:.0%} of steps "
                "alarmed) and whose learning per rollout is not below lock-step's noise band; "
                "if none passes, the fastest that passes drift and learning")


@dataclasses.dataclass(frozen=True)
class Recommendation:
    limit: int
    rule: str
    why: str
    verdicts: Dict[int, Dict]             # limit -> {throughput_ok, drift_ok, learning_ok, notes}
    lockstep_band: Optional[Dict[str, float]]


def _mean(values: Sequence[float]) -> Optional[float]:
    xs = finite_values(values)
    return sum(xs) / len(xs) if xs else None


def noise_band(lockstep: LimitMeasurement) -> Optional[Dict[str, float]]:
    """Lock-step's learning per rollout: {"mean", "half", "low"} (module docstring), or None
    when it cannot be told (no value, or one value without a standard error)."""
    values = finite_values(lockstep.learning)
    if not values:
        return None
    if len(values) >= 2:
        ci = mean_ci(values)
        half = ci["half"]
    else:
        se = finite_values(lockstep.learning_se)
        if not se:
            return None
        half = 1.96 * se[0]
    mean = sum(values) / len(values)
    return {"mean": mean, "half": half, "low": mean - half}


def recommend(measurements: Sequence[LimitMeasurement], rule: Rule = Rule()) -> Recommendation:
    """The recommended limit and why (module docstring). ValueError when there is no
    measurement, no lock-step (limit 0) among them, or a limit without throughput."""
    if not measurements:
        raise ValueError("no limits measured: give --limits with at least one limit")
    by_limit = {m.limit: m for m in measurements}
    if len(by_limit) != len(measurements):
        raise ValueError(f"limits measured twice: {sorted(m.limit for m in measurements)}")
    if 0 not in by_limit:
        raise ValueError("no lock-step (limit 0) measurement: its learning per rollout is the "
                         "noise band every limit is held to")
    throughput = {k: _mean(m.rollouts_per_s) for k, m in by_limit.items()}
    missing = [k for k, v in throughput.items() if v is None]
    if missing:
        raise ValueError(f"limits {missing}: no finite rollouts/s measured")
    best = max(throughput.values())
    band = noise_band(by_limit[0])
    verdicts: Dict[int, Dict] = {}
    for k in sorted(by_limit):
        m = by_limit[k]
        notes: List[str] = []
        fast = throughput[k] >= (1.0 - rule.throughput_tolerance) * best
        notes.append(f"{throughput[k]:.3g} rollouts/s = {throughput[k] / best:.1%} of the best")
        kl, ess, alarms = _mean(m.kl), _mean(m.ess), _mean(m.alarm_frac)
        drift_ok = ((kl is None or kl <= rule.max_kl) and (ess is None or ess >= rule.min_ess)
                    and (alarms is None or alarms <= rule.max_alarm_frac))
        if not drift_ok:
            notes.append(f"drift over the alarms (KL {kl}, ESS {ess}, alarmed steps {alarms})")
        learning = _mean(m.learning)
        if band is None or learning is None or k == 0:
            learning_ok = True
            if k != 0:
                notes.append("learning per rollout not compared (no noise band)")
        else:
            learning_ok = learning >= band["low"]
            if not learning_ok:
                notes.append(f"learning per rollout {learning:.3g} below lock-step's band "
                             f"(>= {band['low']:.3g})")
        verdicts[k] = {"throughput_ok": fast, "drift_ok": drift_ok, "learning_ok": learning_ok,
                       "rollouts_per_s": throughput[k], "of_best": throughput[k] / best,
                       "learning": learning, "notes": notes}
    passing = [k for k, v in verdicts.items()
               if v["throughput_ok"] and v["drift_ok"] and v["learning_ok"]]
    if passing:
        chosen = min(passing)
        why = (f"limit {chosen} is the smallest that passes all three: "
               + "; ".join(verdicts[chosen]["notes"]))
    else:
        safe = [k for k, v in verdicts.items() if v["drift_ok"] and v["learning_ok"]]
        chosen = max(safe, key=lambda k: (throughput[k], -k)) if safe else 0
        why = (f"no limit passes all three; limit {chosen} is the fastest that keeps drift "
               "under the alarms and learning inside lock-step's band")
    if band is not None and not math.isfinite(band["half"]):
        band = None
    return Recommendation(chosen, rule.text(), why, verdicts, band)
