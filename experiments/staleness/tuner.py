"""The staleness tuner: short measured runs of the user's config over a grid of limits.

Every run is the whole program (run.run_program, with the generate-call log of
experiments/benchmarks/generate_log.py, as programs/benchmarks/async_vs_sync.py runs it) with
the user's config and one limit (0 = lock-step), `repeats` times with seeds seed, seed+1, ...,
interleaved (every limit of repeat 0, then of repeat 1, ...), each in
<out_dir>/runs/eta<k>_r<repeat>. Like the sweeps (experiments/sweeps.py) it resumes: a run whose
folder holds a summary of the same config is read, not run again.

Per run (`measure_run`; t0 = the first generate call of any actor, as async_vs_sync.py counts,
t_end = the last train row):
  rollouts_per_s, tokens_per_s   trained over t_end - t0 (tokens: prompt + response)
  learner_busy_frac              the learner's step time outside waiting for data, of the span
  admission_wait_frac            the actors' admission_wait_s, of num_actors x span
  dropped_stale, staleness_hist  the learner's counters and the trained rollouts by staleness
  kl, ess, masked_frac           means over the steps of kl_rollout, ess, dis_masked_frac;
  alarm_frac                     drift-alarm raises per step
  learning                       the slope of reward_mean against rollouts trained, per 1000
                                 rollouts (learning_se its standard error)
  heldout_gain_per_1k            (last - first held-out accuracy) per 1000 rollouts trained, where
                                 the task evaluates; final_accuracy the last evaluation
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from experiments import sweeps
from experiments.staleness.recommend import LimitMeasurement, Recommendation, Rule, recommend
from experiments.studies.metrics import mean_ci
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.observers import read_metrics

# The figures of a run that get a mean and an interval over repeats.
FIGURES = ("rollouts_per_s", "tokens_per_s", "learner_busy_frac", "admission_wait_frac",
           "dropped_stale", "staleness_rollout_mean", "kl", "ess", "masked_frac", "alarm_frac",
           "learning", "heldout_gain_per_1k", "final_accuracy", "wall_s")


def parse_limits(entries: Sequence[str], flag: str = "--limits") -> List[int]:
    """Staleness limits from flag entries ("lockstep" or an integer >= 0), sorted, with
    lock-step (0) added: it is every limit's baseline. ConfigError naming `flag` when the grid
    is empty or an entry is not a limit."""
    limits = set()
    for entry in entries:
        text = str(entry).strip().lower()
        if not text:
            continue
        if text in ("lockstep", "lock-step", "sync"):
            limits.add(0)
            continue
        try:
            k = int(text)
        except ValueError:
            k = -1
        if k < 0:
            raise ConfigError(f"{flag} entry {entry!r}: must be lockstep or an integer >= 0 "
                              "(a max_staleness), e.g. --limits=lockstep,1,2,4,8")
        limits.add(k)
    if not limits:
        raise ConfigError(f"{flag} is empty: give the staleness limits to measure, e.g. "
                          "--limits=lockstep,1,2,4,8")
    return sorted(limits | {0})


def limit_config(base: SAOConfig, limit: int, repeat: int, out_dir: str) -> SAOConfig:
    """The user's config at one limit and repeat (limit 0 runs --lockstep)."""
    return base.replace(lockstep=limit == 0, max_staleness=limit, seed=base.seed + repeat,
                        run_dir=os.path.join(out_dir, "runs", f"eta{limit}_r{repeat}"))


def _slope(xs: Sequence[float], ys: Sequence[float]):
    """(OLS slope, its standard error); (None, None) with fewer than 3 points or no spread."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 3 or np.ptp(x) == 0:
        return None, None
    sxx = float(((x - x.mean()) ** 2).sum())
    slope = float(((x - x.mean()) * (y - y.mean())).sum() / sxx)
    resid = y - y.mean() - slope * (x - x.mean())
    return slope, math.sqrt(float((resid ** 2).sum()) / (len(x) - 2) / sxx)


def _mean(rows: Sequence[Dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and
            math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else None


def measure_run(config: SAOConfig, summary: Dict) -> Dict:
    """The figures of one finished run (module docstring), from its run folder."""
    from experiments.benchmarks.generate_log import read_generate_calls
    run_dir = config.run_dir
    train = sorted(read_metrics(run_dir, "train"), key=lambda r: r["step"])
    evals = sorted((r["policy_version"], r["eval_accuracy"]) for r in read_metrics(run_dir, "eval"))
    starts = [c[0]["t0"] for c in read_generate_calls(run_dir).values() if c]
    if not starts or not train or train[-1]["step"] < config.max_steps:
        raise RuntimeError(f"run {run_dir} did not finish ({len(train)} train rows, "
                           f"{len(starts)} actors generated); see its logs/")
    span = max(train[-1]["time"] - min(starts), 1e-9)
    rollouts = train[-1]["rollouts_trained"]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in train)
    actors = [os.path.join(run_dir, f"actor_{i}_stats.json") for i in
              range(config.first_actor_id, config.first_actor_id + config.num_actors)]
    admission_wait = 0.0
    for path in actors:
        if os.path.exists(path):
            with open(path) as f:
                admission_wait += float(json.load(f).get("admission_wait_s", 0.0))
    width = max(len(r.get("staleness_hist", [])) for r in train)
    hist = [sum(r["staleness_hist"][k] for r in train if k < len(r.get("staleness_hist", [])))
            for k in range(width)]
    alarms = sum(int(v) for k, v in train[-1].items() if k.startswith("drift_alarm_"))
    slope, se = _slope([r["rollouts_trained"] for r in train], [r["reward_mean"] for r in train])
    by_version = {r["policy_version"]: r["rollouts_trained"] for r in train}
    gain = None
    if len(evals) >= 2 and evals[-1][0] in by_version and by_version[evals[-1][0]]:
        gain = 1000.0 * (evals[-1][1] - evals[0][1]) / by_version[evals[-1][0]]
    return {
        "limit": config.max_staleness, "seed": config.seed, "run_dir": run_dir,
        "steps": train[-1]["step"], "wall_s": span, "rollouts_trained": rollouts,
        "rollouts_per_s": rollouts / span, "tokens_per_s": tokens / span,
        "learner_busy_frac": sum(r["step_time_s"] - r.get("wait_s", 0.0) for r in train) / span,
        "admission_wait_frac": admission_wait / (config.num_actors * span),
        "dropped_stale": summary.get("dropped_stale", train[-1].get("dropped_stale", 0)),
        "staleness_hist": hist, "staleness_rollout_mean": _mean(train, "staleness_rollout_mean"),
        "kl": _mean(train, "kl_rollout"), "ess": _mean(train, "ess"),
        "masked_frac": _mean(train, "dis_masked_frac"), "alarm_frac": alarms / len(train),
        "learning": None if slope is None else 1000.0 * slope,
        "learning_se": None if se is None else 1000.0 * se,
        "heldout_gain_per_1k": gain, "final_accuracy": evals[-1][1] if evals else None,
        "load_avg_1m": os.getloadavg()[0],
    }


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "#" * filled + "." * (width - filled)


def run_grid(base: SAOConfig, limits: Sequence[int], repeats: int, out_dir: str,
             run_fn: Callable[[SAOConfig], Dict], progress: bool = True,
             out=sys.stdout) -> Tuple[Dict[int, List[Dict]], List[str]]:
    """Runs (or reads, when already finished) every limit x repeat, interleaved: (limit ->
    the measured runs, the runs that failed, each with its error). Every config is built (and
    so checked) before the first run; a run that fails is reported and left out, and runs
    again with the next invocation."""
    if repeats < 1:
        raise ConfigError(f"--repeats={repeats}: must be >= 1")
    plan = [limit_config(base, k, r, out_dir) for r in range(repeats) for k in limits]
    runs: Dict[int, List[Dict]] = {k: [] for k in limits}
    failed: List[str] = []
    t0, ran = time.time(), 0
    for i, config in enumerate(plan):
        done = sweeps.finished_summary(config)
        if progress:
            eta = ""
            if ran:
                eta = f", about {(time.time() - t0) / ran * (len(plan) - i) / 60:.1f} min left"
            state = "done earlier, read" if done is not None else \
                f"running ({time.time() - t0:.0f}s elapsed{eta})"
            out.write(f"[{_bar(i, len(plan))}] {i + 1}/{len(plan)} limit "
                      f"{config.max_staleness}{' (lock-step)' if config.lockstep else ''} repeat "
                      f"{config.seed - base.seed}: {state}\n")
            out.flush()
        try:
            if done is None:
                ran += 1
                done = run_fn(config)
            runs[config.max_staleness].append(measure_run(config, done))
        except Exception as e:  # noqa: BLE001 - one failed run must not end the grid
            traceback.print_exc()
            failed.append(f"{config.run_dir}: {type(e).__name__}: {e}"[:300])
    if progress:
        out.write(f"[{_bar(1, 1)}] {len(plan)} runs ({ran} now, {len(failed)} failed) in "
                  f"{time.time() - t0:.0f}s\n")
    return runs, failed


def summarize(runs: Dict[int, List[Dict]]) -> Dict[int, Dict]:
    """limit -> {figure: mean_ci over repeats} plus the summed staleness histogram."""
    out = {}
    for k, rs in runs.items():
        row = {f: mean_ci([r.get(f) for r in rs]) for f in FIGURES}
        width = max((len(r["staleness_hist"]) for r in rs), default=0)
        row["staleness_hist"] = [sum(r["staleness_hist"][j] for r in rs
                                     if j < len(r["staleness_hist"])) for j in range(width)]
        row["repeats"] = len(rs)
        out[k] = row
    return out


def measurements(runs: Dict[int, List[Dict]]) -> List[LimitMeasurement]:
    """The recommendation rule's inputs from the measured runs."""
    def values(rs, key):
        return [r[key] for r in rs if r.get(key) is not None]
    return [LimitMeasurement(k, values(rs, "rollouts_per_s"), values(rs, "kl"),
                             values(rs, "ess"), values(rs, "alarm_frac"), values(rs, "learning"),
                             values(rs, "learning_se")) for k, rs in sorted(runs.items())]


def planned(base: SAOConfig, runs: Dict[int, List[Dict]], seeds: int = 3) -> Dict[int, float]:
    """limit -> the planner's rollouts/s with the costs and lengths fitted to the first
    lock-step run ({} when the planner cannot model the config, e.g. groups of rollouts)."""
    from experiments.staleness import planner
    from experiments.staleness.inputs import PlanError, fit_costs, lengths_from_run
    lock = runs.get(0)
    if not lock:
        return {}
    run_dir = lock[0]["run_dir"]
    try:
        costs, _ = fit_costs(run_dir)
        lengths = lengths_from_run(run_dir, "--from_run", base.max_new_tokens or 0)
        rows = planner.curve(planner.Setting.from_config(base), costs, lengths, sorted(runs),
                             seeds)
    except PlanError:
        return {}
    return {r["max_staleness"]: r["rollouts_per_s"] for r in rows}


@dataclasses.dataclass
class TuneResult:
    base: SAOConfig
    limits: List[int]
    repeats: int
    runs: Dict[int, List[Dict]]
    summary: Dict[int, Dict]
    recommendation: Recommendation
    wall_s: float
    failed: List[str] = dataclasses.field(default_factory=list)


def tune(base: SAOConfig, limits: Sequence[int], repeats: int, out_dir: str,
         run_fn: Callable[[SAOConfig], Dict], rule: Optional[Rule] = None,
         progress: bool = True) -> TuneResult:
    """Measures every limit (run_grid) and recommends one (recommend.py); the rule's drift
    thresholds default to the config's alarm_max_kl and alarm_min_ess."""
    rule = rule or Rule(max_kl=base.alarm_max_kl, min_ess=base.alarm_min_ess)
    t0 = time.time()
    runs, failed = run_grid(base, limits, repeats, out_dir, run_fn, progress)
    runs = {k: rs for k, rs in runs.items() if rs}
    if 0 not in runs:
        raise RuntimeError("every lock-step run failed, and every limit is held to lock-step: "
                           + "; ".join(failed))
    summary = summarize(runs)
    for k, rps in planned(base, runs).items():
        summary[k]["planned_rollouts_per_s"] = rps
    return TuneResult(base, sorted(runs), repeats, runs, summary,
                      recommend(measurements(runs), rule), time.time() - t0, failed)
