"""The tuner's and the planner's reports: Markdown, PNG plots (matplotlib, Agg) and a JSON line."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence

from experiments import sweeps

TUNE_COLUMNS = (
    ("rollouts_per_s", "rollouts/s", 2), ("tokens_per_s", "tokens/s", 0),
    ("learner_busy_frac", "learner busy", 2), ("admission_wait_frac", "admission wait", 2),
    ("dropped_stale", "dropped stale", 1), ("staleness_rollout_mean", "staleness", 2),
    ("kl", "KL", 4), ("ess", "ESS", 3), ("masked_frac", "masked", 3),
    ("alarm_frac", "alarmed steps", 2), ("learning", "reward slope /1k", 3),
    ("heldout_gain_per_1k", "held-out gain /1k", 3), ("final_accuracy", "final acc", 3))


def _cell(ci: Dict, digits: int) -> str:
    if ci.get("mean") is None:
        return "-"
    text = f"{ci['mean']:.{digits}f}"
    if ci.get("half") is not None:
        text += f" ± {ci['half']:.{digits}f}"
    return text


def _name(k: int) -> str:
    return "0 (lock-step)" if k == 0 else str(k)


def tune_json(result) -> Dict:
    """The tuner's one JSON line (printed last and written beside the report)."""
    rec = result.recommendation
    return {"tool": "tune_staleness", "recommended_limit": rec.limit, "why": rec.why,
            "rule": rec.rule, "limits": result.limits, "repeats": result.repeats,
            "task": result.base.task, "num_actors": result.base.num_actors,
            "batch_size": result.base.batch_size, "max_steps": result.base.max_steps,
            "lockstep_band": rec.lockstep_band, "wall_s": round(result.wall_s, 1),
            "verdicts": {str(k): v for k, v in rec.verdicts.items()},
            "failed_runs": result.failed,
            "summary": {str(k): {f: (v["mean"] if isinstance(v, dict) else v)
                                 for f, v in row.items()}
                        for k, row in result.summary.items()}}


def tune_markdown(result, plots: Sequence[str], command: str = "") -> str:
    rec = result.recommendation
    base = result.base
    lines = [f"# Staleness tuner: recommended limit {rec.limit}", "",
             f"Task {base.task}, {base.num_actors} actor(s) x {base.actor_batch}, batch "
             f"{base.batch_size}, {base.max_steps} steps per run, {result.repeats} repeat(s) per "
             f"limit, limits {', '.join(map(str, result.limits))}; {result.wall_s:.0f} s.", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += [f"**Rule**: {rec.rule}.", "", f"**Why**: {rec.why}.", ""]
    if result.failed:
        lines += [f"**{len(result.failed)} run(s) failed** (left out; the same command runs "
                  "them again):", "", *[f"- {f}" for f in result.failed], ""]
    if rec.lockstep_band:
        b = rec.lockstep_band
        lines += [f"Lock-step's learning per rollout: {b['mean']:.3f} ± {b['half']:.3f} "
                  f"(reward slope per 1000 rollouts); the band's low edge {b['low']:.3f}.", ""]
    lines += ["Mean ± half-width of the 95% interval over repeats (one repeat: the value).", "",
              "| limit | " + " | ".join(c[1] for c in TUNE_COLUMNS) + " | passes |",
              "|---|" + "---|" * (len(TUNE_COLUMNS) + 1)]
    for k in result.limits:
        row, v = result.summary[k], rec.verdicts[k]
        passes = "/".join(name for name, ok in (("tput", v["throughput_ok"]),
                                               ("drift", v["drift_ok"]),
                                               ("learn", v["learning_ok"])) if ok) or "none"
        lines.append(f"| {_name(k)} | " + " | ".join(_cell(row[c], d) for c, _, d in TUNE_COLUMNS)
                     + f" | {passes} |")
    planned = [k for k in result.limits if "planned_rollouts_per_s" in result.summary[k]]
    if planned:
        lines += ["", "The planner's rollouts/s with the costs and lengths fitted to the first "
                  "lock-step run (programs/plan_staleness.py --from_run=" +
                  result.runs[0][0]["run_dir"] + "): " + ", ".join(
                      f"limit {k}: {result.summary[k]['planned_rollouts_per_s']:.2f} (measured "
                      f"{result.summary[k]['rollouts_per_s']['mean']:.2f})" for k in planned)
                  + "."]
    lines += ["", "Trained rollouts by staleness (all repeats):", ""]
    for k in result.limits:
        lines.append(f"- limit {_name(k)}: {result.summary[k]['staleness_hist']}")
    lines += ["", *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots], ""]
    return "\n".join(lines)


def tune_plots(result, prefix: str) -> List[str]:
    """tuner.png (throughput, learner and actors, drift, learning per rollout against the
    limit) and staleness.png (histograms); their paths."""
    plt = sweeps.pyplot()
    ks = result.limits
    s = result.summary

    def series(key):
        return ([s[k][key]["mean"] for k in ks], [s[k][key]["half"] or 0.0 for k in ks])

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = ((axes[0], [("rollouts_per_s", "rollouts/s")], "throughput"),
              (axes[1], [("learner_busy_frac", "learner busy"),
                         ("admission_wait_frac", "actors' admission wait")], "fraction of time"),
              (axes[2], [("kl", "KL(rollout||current)"), ("masked_frac", "masked fraction")],
               "drift"),
              (axes[3], [("learning", "reward slope per 1k rollouts")], "learning per rollout"))
    for ax, keys, title in panels:
        for key, label in keys:
            y, e = series(key)
            pts = [(k, a, b) for k, a, b in zip(ks, y, e) if a is not None]
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts],
                            marker="o", capsize=3, label=label)
        ax.set_xticks(ks)
        ax.set_xlabel("staleness limit (0 = lock-step)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    band = result.recommendation.lockstep_band
    if band:
        axes[3].axhspan(band["low"], band["mean"] + band["half"], color="grey", alpha=0.2)
    axes[0].axvline(result.recommendation.limit, color="green", ls="--", lw=1)
    paths = [sweeps.save_figure(fig, f"{prefix}tuner.png",
                                f"recommended limit {result.recommendation.limit}")]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / max(len(ks), 1)
    for i, k in enumerate(ks):
        hist = s[k]["staleness_hist"]
        total = max(sum(hist), 1)
        ax.bar([j + i * width for j in range(len(hist))], [h / total for h in hist], width,
               label=f"limit {_name(k)}")
    ax.set_xlabel("staleness of trained rollouts (versions)")
    ax.set_ylabel("share")
    ax.legend(fontsize=7)
    paths.append(sweeps.save_figure(fig, f"{prefix}staleness.png"))
    return paths


def write_tune_report(result, out_prefix: str, command: str = "") -> Dict[str, str]:
    """<prefix>report.md, tuner.png, staleness.png, result.json; the paths written."""
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix + "x")), exist_ok=True)
    plots = tune_plots(result, out_prefix)
    md = out_prefix + "report.md"
    with open(md, "w") as f:
        f.write(tune_markdown(result, plots, command))
    js = out_prefix + "result.json"
    with open(js, "w") as f:
        json.dump({**tune_json(result), "runs": {str(k): v for k, v in result.runs.items()}},
                  f, indent=1)
    return {"report": md, "json": js, "plots": ",".join(plots)}


# --- the planner ------------------------------------------------------------------------------
PLAN_COLUMNS = (("rollouts_per_s", "rollouts/s", 3), ("tokens_per_s", "tokens/s", 0),
                ("steady_rollouts_per_s", "steady rollouts/s", 3),
                ("learner_busy_frac", "learner busy", 2),
                ("admission_wait_frac", "admission wait", 2),
                ("insert_wait_frac", "queue-full wait", 2),
                ("staleness_rollout_mean", "staleness", 2), ("dropped_stale", "dropped", 1))


def plan_markdown(rows: Sequence[Dict], assumptions: Sequence[str], title: str,
                  command: str = "", plot: Optional[str] = None) -> str:
    lock = next((r for r in rows if r["max_staleness"] == 0), None)
    lines = [f"# {title}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += ["## Assumptions", "", *[f"- {a}" for a in assumptions], "",
              "## Predicted throughput against the limit", "",
              "| limit | " + " | ".join(c[1] for c in PLAN_COLUMNS) + " | vs lock-step |"
              " staleness histogram |", "|---|" + "---|" * (len(PLAN_COLUMNS) + 2)]
    for r in rows:
        ratio = (f"{r['rollouts_per_s'] / lock['rollouts_per_s']:.2f}x"
                 if lock and lock["rollouts_per_s"] else "-")
        total = max(sum(r["staleness_hist"]), 1)
        hist = " ".join(f"{h / total:.2f}" for h in r["staleness_hist"])
        lines.append(f"| {_name(r['max_staleness'])} | " + " | ".join(
            f"{r[c]:.{d}f}" for c, _, d in PLAN_COLUMNS) + f" | {ratio} | {hist} |")
    if plot:
        lines += ["", f"![{os.path.basename(plot)}]({os.path.basename(plot)})"]
    return "\n".join(lines) + "\n"


def plan_plot(rows: Sequence[Dict], path: str, title: str) -> str:
    plt = sweeps.pyplot()
    ks = [r["max_staleness"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(ks, [r["rollouts_per_s"] for r in rows], marker="o", label="whole run")
    axes[0].plot(ks, [r["steady_rollouts_per_s"] for r in rows], marker=".", ls="--",
                 label="steady state")
    axes[0].set_title("rollouts/s", fontsize=9)
    axes[0].legend(fontsize=7)
    axes[1].plot(ks, [r["learner_busy_frac"] for r in rows], marker="o", label="learner busy")
    axes[1].plot(ks, [r["admission_wait_frac"] for r in rows], marker="o",
                 label="actors' admission wait")
    axes[1].set_title("fraction of time", fontsize=9)
    axes[1].legend(fontsize=7)
    axes[2].plot(ks, [r["staleness_rollout_mean"] for r in rows], marker="o")
    axes[2].set_title("mean staleness of trained rollouts", fontsize=9)
    for ax in axes:
        ax.set_xlabel("staleness limit (0 = lock-step)")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
    return sweeps.save_figure(fig, path, title)
