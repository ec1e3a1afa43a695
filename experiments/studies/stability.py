"""The stability study's own outputs (study kinds "stability" and "calibration";
experiments/studies/stability_presets.py), beside the tables every study writes. From the
finished runs' metrics.jsonl and results.csv's records (whose collapse_step is the rule of
experiments/studies/collapse.py):

  survival.csv           per variant and evaluation step: runs not yet collapsed, the fraction
                         and its Wilson 95% interval
  collapse.csv           per variant: collapsed runs (Wilson interval), time to collapse (mean
                         [t interval] and median of the collapsed runs; the restricted mean
                         min(collapse step, max_steps) over all runs), the causes, and final and
                         mean held-out accuracy [t interval]
  early_warning_runs.csv per run, indicator and threshold: fire step, outcome, lead time
  early_warning.csv      per variant (and "all" of them) and (indicator, threshold): hits, misses,
                         false alarms, rates with Wilson intervals, lead times
  stability.md           those tables in readable form
  survival.png, early_warning.png
  calibration.csv, calibration.md (calibration only): per policy_lr x batch point and arm, the
                         k = 0 runs collapsed and the k = 8 runs' mean KL and ESS; the point
                         passes when no k = 0 run of any arm collapsed and every arm drifts
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

from experiments import sweeps
from experiments.studies import collapse as cl
from experiments.studies import early_warning as ew
from experiments.studies import metrics as sm
from experiments.studies import plots
from experiments.studies import stability_presets as sp
from sao_actor_learner.observers import read_metrics

KINDS = ("stability", "calibration")
SURVIVAL_COLUMNS = ("variant", "label", "series", "param", "step", "runs", "surviving",
                    "fraction", "lo", "hi")
COLLAPSE_COLUMNS = ("variant", "label", "series", "param", "runs", "collapsed",
                    "collapsed_frac", "collapsed_lo", "collapsed_hi", "mean_step", "mean_lo",
                    "mean_hi", "median_step", "rmst", "rmst_lo", "rmst_hi", "causes",
                    "final_eval_accuracy_mean", "final_eval_accuracy_lo",
                    "final_eval_accuracy_hi", "mean_eval_accuracy_mean", "mean_eval_accuracy_lo",
                    "mean_eval_accuracy_hi")
WARNING_RUN_COLUMNS = ("variant", "seed", "indicator", "key", "direction", "threshold",
                       "fire_step", "collapse_step", "outcome", "lead")
WARNING_COLUMNS = ("variant", "indicator", "threshold", "runs", "collapsed", "hit", "miss",
                   "false_alarm", "quiet", "hit_rate", "hit_lo", "hit_hi", "false_alarm_rate",
                   "false_alarm_lo", "false_alarm_hi", "lead_mean", "lead_lo", "lead_hi",
                   "lead_median", "lead_min", "lead_max")
CALIBRATION_COLUMNS = ("point", "policy_lr", "batch", "arm", "k0_runs", "k0_collapsed",
                       "drift_k", "drift_runs", "drift_kl", "drift_ess", "drifts", "holds")
OUTPUTS = ("survival.csv", "collapse.csv", "early_warning_runs.csv", "early_warning.csv",
           "stability.md")
CALIBRATION_OUTPUTS = ("calibration.csv", "calibration.md")


def output_names(study) -> Tuple[str, ...]:
    return OUTPUTS + (CALIBRATION_OUTPUTS if study.kind == "calibration" else ())


def _ok(records: Sequence[Dict], vid: str) -> List[Dict]:
    return [r for r in records if r["variant"] == vid and r.get("status") == "ok"]


def run_series(run_dir: str) -> Dict[str, List[Tuple[int, float]]]:
    """{train-row key: [(step, value)]} of the indicators' keys (finite values only)."""
    keys = {ind.key for ind in ew.INDICATORS}
    out: Dict[str, List[Tuple[int, float]]] = {k: [] for k in keys}
    for r in read_metrics(run_dir, "train"):
        for k in keys:
            v = sm.finite_values([r.get(k)])
            if v:
                out[k].append((r["step"], v[0]))
    return out


def _collapse_step(rec: Dict):
    c = rec.get("collapse_step")
    return None if c in (None, "") else int(c)


def panels(study) -> List[Tuple[str, List[str]]]:
    """The survival figure's panels: [(title, variant ids)]. Stability: one per staleness k for
    the arms, one per other series (critic quality, ...); calibration: one per point."""
    arm_labels = {a[1] for a in sp.arms()}
    out: Dict[str, List[str]] = {}
    for v in study.variants:
        key = (f"staleness k = {v.param:g}" if study.kind == "stability" and v.series in
               arm_labels else v.series)
        out.setdefault(key, []).append(v.id)
    return list(out.items())


def survival_rows(study, records: Sequence[Dict], steps: Sequence[int]) -> List[Dict]:
    out = []
    for v in study.variants:
        ok = _ok(records, v.id)
        if not ok:
            continue
        for row in cl.survival([_collapse_step(r) for r in ok], steps):
            out.append(dict(row, variant=v.id, label=v.label, series=v.series, param=v.param))
    return out


def collapse_rows(study, records: Sequence[Dict], summary: Sequence[Dict], max_steps: int
                  ) -> List[Dict]:
    by_id = {s["variant"]: s for s in summary}
    out = []
    for v in study.variants:
        ok = _ok(records, v.id)
        causes: Dict[str, int] = {}
        for r in ok:
            if r.get("collapse_cause"):
                causes[r["collapse_cause"]] = causes.get(r["collapse_cause"], 0) + 1
        row = dict(variant=v.id, label=v.label, series=v.series, param=v.param,
                   causes=" ".join(f"{c}:{n}" for c, n in sorted(causes.items())),
                   **cl.time_to_collapse([_collapse_step(r) for r in ok], max_steps))
        s = by_id.get(v.id, {})
        for m in ("final_eval_accuracy", "mean_eval_accuracy"):
            row.update({f"{m}_{x}": s.get(f"{m}_{x}") for x in ("mean", "lo", "hi")})
        out.append(row)
    return out


def warning_run_rows(study, records: Sequence[Dict]) -> List[Dict]:
    out = []
    for v in study.variants:
        for r in _ok(records, v.id):
            start = (int(r["max_staleness"]) + 1 if r.get("staleness_mode") == "forced"
                     else 1)   # forced staleness reaches k at step k + 1
            for w in ew.run_warnings(run_series(r["run_dir"]), _collapse_step(r),
                                     start=start):
                out.append(dict(w, variant=v.id, seed=r["seed"]))
    return out


def warning_rows(study, run_rows: Sequence[Dict]) -> List[Dict]:
    """Per variant, then over all variants ("all"), per (indicator, threshold)."""
    out = []
    groups = [(v.id, [r for r in run_rows if r["variant"] == v.id]) for v in study.variants]
    groups.append(("all", list(run_rows)))
    for vid, rows in groups:
        if not rows:
            continue
        for ind in ew.INDICATORS:
            for thr in ind.thresholds:
                pick = [r for r in rows if r["indicator"] == ind.name and r["threshold"] == thr]
                out.append(dict(variant=vid, indicator=ind.name, threshold=thr,
                                **ew.summarize(pick)))
    return out


def calibration_rows(study, records: Sequence[Dict]) -> List[Dict]:
    """One row per (point, arm): its k = 0 runs and collapses, its k >= 8 runs' mean KL and
    ESS; `drifts` (KL >= CALIBRATION_MIN_KL or ESS <= CALIBRATION_MAX_ESS) and `holds` (no
    k = 0 collapse); the point passes when every arm of it drifts and holds."""
    out = []
    for lr in sp.CALIBRATION_LRS:
        for batch in sp.CALIBRATION_BATCHES:
            point = sp.calibration_point(lr, batch)
            for aid, *_ in sp.arms(batch):
                k0 = _ok(records, f"{aid}_{point}_k0")
                drift = [r for k in sp.CALIBRATION_K if k >= 8
                         for r in _ok(records, f"{aid}_{point}_k{k}")]
                kl = sm.mean_ci([r.get("mean_kl") for r in drift])["mean"]
                ess = sm.mean_ci([r.get("mean_ess") for r in drift])["mean"]
                drifts = bool(drift) and ((kl is not None and kl >= sp.CALIBRATION_MIN_KL) or
                                          (ess is not None and ess <= sp.CALIBRATION_MAX_ESS))
                collapsed = sum(1 for r in k0 if _collapse_step(r) is not None)
                out.append(dict(point=point, policy_lr=lr, batch=batch, arm=aid,
                                k0_runs=len(k0), k0_collapsed=collapsed,
                                drift_k=max(sp.CALIBRATION_K), drift_runs=len(drift),
                                drift_kl=kl, drift_ess=ess, drifts="yes" if drifts else "no",
                                holds="yes" if k0 and not collapsed else "no"))
    return out


def passing_points(rows: Sequence[Dict]) -> List[str]:
    points = []
    for r in rows:
        if r["point"] not in points:
            points.append(r["point"])
    return [p for p in points if all(r["drifts"] == "yes" and r["holds"] == "yes"
                                     for r in rows if r["point"] == p)]


def _f(x, digits: int = 3) -> str:
    if x is None or x == "":
        return "-"
    x = float(x)
    return f"{x:.1e}" if 0 < abs(x) < 0.5 * 10 ** -digits else f"{x:.{digits}f}"


def _ci(row: Dict, mean: str, lo: str, hi: str, digits: int = 3) -> str:
    """row[mean] [row[lo], row[hi]] ("-" without a mean; the mean alone without an interval)."""
    if row.get(mean) is None:
        return "-"
    if row.get(lo) is None:
        return _f(row[mean], digits)
    return f"{_f(row[mean], digits)} [{_f(row[lo], digits)}, {_f(row[hi], digits)}]"


def _acc(row: Dict, m: str) -> str:
    return _ci(row, f"{m}_mean", f"{m}_lo", f"{m}_hi")


def markdown(study, collapses: Sequence[Dict], survival: Sequence[Dict],
             warnings: Sequence[Dict], calibration: Sequence[Dict], max_steps: int) -> str:
    lines = [f"# {study.title}", "",
             f"Collapse rule: experiments/studies/collapse.py ({cl.RULE}).", "",
             "| variant | runs | collapsed [Wilson 95%] | step of collapse, mean [t] | median "
             "| restricted mean (min(step, max_steps)) | causes | final acc | mean acc |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in collapses:
        lines.append(
            f"| {r['label']} | {r['runs']} | {r['collapsed']} "
            f"({_ci(r, 'collapsed_frac', 'collapsed_lo', 'collapsed_hi', 2)}) | "
            f"{_ci(r, 'mean_step', 'mean_lo', 'mean_hi', 0)} | {_f(r['median_step'], 0)} | "
            f"{_ci(r, 'rmst', 'rmst_lo', 'rmst_hi', 0)} | {r['causes'] or '-'} | "
            f"{_acc(r, 'final_eval_accuracy')} | {_acc(r, 'mean_eval_accuracy')} |")
    lines += ["", f"Surviving at step {max_steps} (runs not yet collapsed, Wilson 95%):", ""]
    for r in survival:
        if r["step"] == max_steps:
            lines.append(f"- {r['label']}: {r['surviving']}/{r['runs']} "
                         f"({_f(r['fraction'])} [{_f(r['lo'])}, {_f(r['hi'])}])")
    lines += ["", "Early warning: every threshold over all variants, and each variant with "
              "a run that collapsed or fired at each indicator's middle threshold "
              "(early_warning.csv has every row). Lead = collapse step - fire step; hit: "
              "fired at or before the collapse; false alarm: fired in a run that did not "
              "collapse.", "",
              "| variant | indicator | threshold | collapsed | hits | misses | false alarms / "
              "stable runs | hit rate [Wilson] | false-alarm rate [Wilson] | lead mean [t] | "
              "lead median |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in warnings:
        middle = next(ew.middle(i) for i in ew.INDICATORS if i.name == r["indicator"])
        if r["variant"] != "all" and (r["threshold"] != middle or
                                      not (r["collapsed"] or r["false_alarm"])):
            continue
        lines.append(
            f"| {r['variant']} | {r['indicator']} | {r['threshold']:g} | {r['collapsed']} | "
            f"{r['hit']} | {r['miss']} | {r['false_alarm']}/{r['false_alarm'] + r['quiet']} | "
            f"{_ci(r, 'hit_rate', 'hit_lo', 'hit_hi', 2)} | "
            f"{_ci(r, 'false_alarm_rate', 'false_alarm_lo', 'false_alarm_hi', 2)} | "
            f"{_ci(r, 'lead_mean', 'lead_lo', 'lead_hi', 0)} | "
            f"{_f(r['lead_median'], 0)} |")
    if calibration:
        lines += ["", calibration_markdown(calibration)]
    return "\n".join(lines) + "\n"


def calibration_markdown(rows: Sequence[Dict]) -> str:
    lines = ["## Calibration", "", f"A point passes when no arm's k = 0 run collapses and every "
             f"arm's k = {rows[0]['drift_k']} runs have mean KL >= {sp.CALIBRATION_MIN_KL:g} or "
             f"mean ESS <= {sp.CALIBRATION_MAX_ESS:g}.", "",
             "| point | arm | k=0 collapsed | KL at k=8 | ESS at k=8 | drifts | holds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['point']} | {r['arm']} | {r['k0_collapsed']}/{r['k0_runs']} | "
                     f"{_f(r['drift_kl'])} | {_f(r['drift_ess'])} | {r['drifts']} | "
                     f"{r['holds']} |")
    passing = passing_points(rows)
    lines += ["", "Passing points: " + (", ".join(passing) if passing else "none") + "."]
    return "\n".join(lines)


def write_outputs(study, records: Sequence[Dict], summary: Sequence[Dict], out: str,
                  max_steps: int, eval_every: int, title: str) -> List[str]:
    """Every file of the module docstring into folder `out`; returns their paths."""
    steps = sorted(set(range(0, max_steps + 1, max(eval_every, 1))) | {max_steps})
    survival = survival_rows(study, records, steps)
    collapses = collapse_rows(study, records, summary, max_steps)
    run_warn = warning_run_rows(study, records)
    warnings = warning_rows(study, run_warn)
    calibration = calibration_rows(study, records) if study.kind == "calibration" else []
    p = lambda name: os.path.join(out, name)  # noqa: E731
    sweeps.write_csv(survival, p("survival.csv"), SURVIVAL_COLUMNS)
    sweeps.write_csv(collapses, p("collapse.csv"), COLLAPSE_COLUMNS)
    sweeps.write_csv(run_warn, p("early_warning_runs.csv"), WARNING_RUN_COLUMNS)
    sweeps.write_csv(warnings, p("early_warning.csv"), WARNING_COLUMNS)
    with open(p("stability.md"), "w") as f:
        f.write(markdown(study, collapses, survival, warnings, calibration, max_steps))
    paths = [p(n) for n in OUTPUTS]
    if calibration:
        sweeps.write_csv(calibration, p("calibration.csv"), CALIBRATION_COLUMNS)
        with open(p("calibration.md"), "w") as f:
            f.write(f"# {study.title}\n\n" + calibration_markdown(calibration) + "\n")
        paths += [p(n) for n in CALIBRATION_OUTPUTS]
    paths.append(plots.survival_figure(survival, panels(study), p("survival.png"), title))
    paths.append(plots.early_warning_figure(study, warnings, run_warn, p("early_warning.png"),
                                            title))
    return paths
