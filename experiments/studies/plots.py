"""The reproduction study's figures: means over seeds with 95% t-interval bands
(study_metrics.band), matplotlib's Agg backend (no display). Used by programs/study.py; what
each figure shows is listed in docs/REPRODUCTION.md."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from experiments.studies import metrics as sm
from experiments.sweeps import pyplot, save_figure

PLOTS = {"curves": ("accuracy.png", "reward.png"),
         "staleness": ("accuracy.png", "staleness.png"),
         "ablation": ("accuracy.png", "ablation.png"),
         "pretrain": ("accuracy.png", "value_pretrain.png"),
         "shift": ("reward.png", "online_shift.png"),
         # survival.png and early_warning.png: experiments/studies/stability.py draws them
         "stability": ("accuracy.png", "reward.png", "survival.png", "early_warning.png"),
         "calibration": ("accuracy.png", "survival.png", "early_warning.png")}


def plot_names(study) -> Tuple[str, ...]:
    return PLOTS[study.kind]


def _per_seed(curves: Sequence[Dict], vid: str, key: str) -> List[Dict[int, float]]:
    """One {step: value} per seed of variant `vid` (rows where `key` is a number)."""
    by_seed: Dict[object, Dict[int, float]] = {}
    for r in curves:
        if r["variant"] != vid:
            continue
        v = sm.finite_values([r.get(key)])
        if v:
            by_seed.setdefault(r["seed"], {})[int(r["step"])] = v[0]
    return list(by_seed.values())


def _x_of(curves: Sequence[Dict], vid: str, steps: Sequence[int], x: str) -> List[float]:
    """Mean over seeds of column `x` (rollouts, wall_time_s) at each step; the step itself for
    x == "step"."""
    if x == "step":
        return list(steps)
    per = _per_seed(curves, vid, x)
    out = []
    for s in steps:
        vals = [p[s] for p in per if s in p]
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out


def _band_plot(ax, curves, variants, key: str, x: str = "step", smooth: int = 1,
               markers: bool = False) -> None:
    for v in variants:
        per = _per_seed(curves, v.id, key)
        if smooth > 1:
            per = [dict(zip(sorted(p), sm.moving_average([p[s] for s in sorted(p)], smooth)))
                   for p in per]
        steps, mean, lo, hi = sm.band(per)
        if not steps:
            continue
        xs = _x_of(curves, v.id, steps, x)
        line, = ax.plot(xs, mean, marker="o" if markers else None, markersize=3,
                        label=f"{v.label} (n={len(per)})")
        if all(b is not None for b in lo):
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.18, linewidth=0)
    ax.grid(alpha=0.3)


X_LABELS = {"step": "learner step (policy version)", "rollouts": "rollouts trained",
            "wall_time_s": "wall-clock seconds (learner)"}


def accuracy_figure(study, curves, path: str, title: str, groups=None,
                    xs: Sequence[str] = ("step",)) -> str:
    """Held-out accuracy (mean and 95% band over seeds): one panel per x axis, or one per group
    of variants (groups: [(panel title, variants)])."""
    plt = pyplot()
    panels = ([(X_LABELS[x], study.variants, x) for x in xs] if groups is None
              else [(name, vs, "step") for name, vs in groups])
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.5, 4.6 * len(panels)), 3.8),
                             squeeze=False)
    for ax, (name, vs, x) in zip(axes[0], panels):
        _band_plot(ax, curves, vs, "eval_accuracy", x, markers=True)
        ax.set_xlabel(X_LABELS[x])
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=6.5, loc="best")
    axes[0][0].set_ylabel("held-out accuracy (greedy)")
    return save_figure(fig, path, title)


def reward_figure(study, curves, path: str, title: str, smooth: int = 5,
                  shifts: Sequence[int] = ()) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(1, 1, figsize=(6.5, 3.8))
    _band_plot(ax, curves, study.variants, "reward_mean", smooth=smooth)
    for s in shifts:
        ax.axvline(s, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel(X_LABELS["step"] + (" (dashed: the reward rule flips)" if shifts else ""))
    ax.set_ylabel(f"training reward ({smooth}-step moving average)")
    ax.legend(fontsize=7)
    return save_figure(fig, path, title)


def _errorbar_lines(ax, summary: Sequence[Dict], metric: str) -> None:
    series: Dict[str, List[Dict]] = {}
    for r in summary:
        series.setdefault(r["series"], []).append(r)
    for name, rows in series.items():
        rows = sorted((r for r in rows if r.get(f"{metric}_mean") is not None),
                      key=lambda r: float(r["param"]))
        if not rows:
            continue
        xs = [float(r["param"]) for r in rows]
        ys = [r[f"{metric}_mean"] for r in rows]
        err = [[y - (r[f"{metric}_lo"] if r[f"{metric}_lo"] is not None else y) for y, r in
                zip(ys, rows)],
               [(r[f"{metric}_hi"] if r[f"{metric}_hi"] is not None else y) - y for y, r in
                zip(ys, rows)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
    ax.grid(alpha=0.3)


def staleness_figure(study, summary, path: str, title: str) -> str:
    plt = pyplot()
    panels = (("final_eval_accuracy", "final held-out accuracy"),
              ("late_kl", "KL(rollout || current), 2nd half"),
              ("late_masked_frac", "masked / clipped fraction, 2nd half"),
              ("late_ess", "ESS, 2nd half"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (m, name) in zip(axes[0], panels):
        _errorbar_lines(ax, summary, m)
        ax.set_xlabel(study.param_name)
        ax.set_xticks(sorted({float(r["param"]) for r in summary}))
        ax.set_title(name, fontsize=9)
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, path, title)


def bars_figure(study, summary, path: str, title: str,
                metrics=(("final_eval_accuracy", "final held-out accuracy"),
                         ("gain", "accuracy gain over the warm start"))) -> str:
    """Horizontal bars (mean, 95% CI whiskers) per variant, one panel per metric."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics),
                                                       0.45 * len(summary) + 1.4),
                             squeeze=False)
    labels = [r["label"] for r in summary]
    for ax, (m, name) in zip(axes[0], metrics):
        ys = list(range(len(summary)))[::-1]
        means = [r.get(f"{m}_mean") or 0.0 for r in summary]
        lo = [mean - (r[f"{m}_lo"] if r.get(f"{m}_lo") is not None else mean)
              for mean, r in zip(means, summary)]
        hi = [(r[f"{m}_hi"] if r.get(f"{m}_hi") is not None else mean) - mean
              for mean, r in zip(means, summary)]
        colors = [f"C{sorted({r['series'] for r in summary}).index(r['series'])}"
                  for r in summary]
        ax.barh(ys, means, xerr=[lo, hi], color=colors, alpha=0.75, capsize=3)
        ax.set_yticks(ys)
        ax.set_yticklabels(labels if ax is axes[0][0] else [""] * len(labels), fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    return save_figure(fig, path, title)


def pretrain_figure(study, curves, summary, path: str, title: str) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    _band_plot(axes[0], curves, study.variants, "explained_variance", smooth=3)
    axes[0].set_xlabel(X_LABELS["step"])
    axes[0].set_title("critic explained variance during RL (3-step average)", fontsize=9)
    axes[0].legend(fontsize=6.5)
    for m, name in (("pretrain_final_ev", "EV at the end of pretraining"),
                    ("early_ev", "EV over the first 5 RL steps")):
        _errorbar_lines(axes[1], [dict(r, series=name) for r in summary], m)
    axes[1].set_title("explained variance", fontsize=9)
    axes[1].legend(fontsize=7)
    _errorbar_lines(axes[2], [dict(r, series="final accuracy") for r in summary],
                    "final_eval_accuracy")
    _errorbar_lines(axes[2], [dict(r, series="mean accuracy (AUC)") for r in summary],
                    "mean_eval_accuracy")
    axes[2].set_title("held-out accuracy", fontsize=9)
    axes[2].legend(fontsize=7)
    for ax in axes[1:]:
        ax.set_xlabel(study.param_name)
        ax.set_xticks(sorted({float(r["param"]) for r in summary}))
    return save_figure(fig, path, title)


def shift_figure(study, curves, summary, path: str, title: str, shifts: Sequence[int]) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    _band_plot(axes[0], curves, study.variants, "eval_accuracy", markers=True)
    for s in shifts:
        axes[0].axvline(s, color="gray", linestyle="--", linewidth=0.8)
    axes[0].set_xlabel(X_LABELS["step"] + " (dashed: the reward rule flips)")
    axes[0].set_ylabel("held-out accuracy, current rule")
    axes[0].legend(fontsize=7)
    ys = list(range(len(summary)))[::-1]
    m = "eval_steps_to_recover"
    means = [r.get(f"{m}_mean") or 0.0 for r in summary]
    err = [[mu - (r[f"{m}_lo"] if r.get(f"{m}_lo") is not None else mu)
            for mu, r in zip(means, summary)],
           [(r[f"{m}_hi"] if r.get(f"{m}_hi") is not None else mu) - mu
            for mu, r in zip(means, summary)]]
    axes[1].barh(ys, means, xerr=err, capsize=3, alpha=0.75,
                 color=[f"C{i}" for i in range(len(summary))])
    axes[1].set_yticks(ys)
    axes[1].set_yticklabels([r["label"] for r in summary], fontsize=7)
    axes[1].set_title("steps to recover 75% of the pre-shift held-out accuracy\n(not "
                      "recovered within the phase: the phase length)", fontsize=9)
    axes[1].grid(alpha=0.3, axis="x")
    return save_figure(fig, path, title)


def draw(study, curves: Sequence[Dict], summary: Sequence[Dict], out: str, title: str,
         shift_every: Optional[int] = None, max_steps: Optional[int] = None) -> List[str]:
    """Every figure of `study` into folder `out`; returns the paths."""
    import os
    p = lambda name: os.path.join(out, name)  # noqa: E731
    if study.kind == "curves":
        return [accuracy_figure(study, curves, p("accuracy.png"), title,
                                xs=("step", "rollouts", "wall_time_s")),
                reward_figure(study, curves, p("reward.png"), title)]
    if study.kind == "staleness":
        ks = sorted({v.param for v in study.variants})
        groups = [(f"k = {k:g}", [v for v in study.variants if v.param == k]) for k in ks]
        return [accuracy_figure(study, curves, p("accuracy.png"), title, groups),
                staleness_figure(study, summary, p("staleness.png"), title)]
    if study.kind == "ablation":
        names = []
        for v in study.variants:
            if v.series not in names:
                names.append(v.series)
        groups = [(n, [v for v in study.variants if v.series == n]) for n in names]
        return [accuracy_figure(study, curves, p("accuracy.png"), title, groups),
                bars_figure(study, summary, p("ablation.png"), title)]
    if study.kind == "pretrain":
        return [accuracy_figure(study, curves, p("accuracy.png"), title),
                pretrain_figure(study, curves, summary, p("value_pretrain.png"), title)]
    if study.kind in ("stability", "calibration"):
        from experiments.studies.stability import panels
        by_id = {v.id: v for v in study.variants}
        groups = [(name, [by_id[i] for i in ids]) for name, ids in panels(study)]
        figs = [accuracy_figure(study, curves, p("accuracy.png"), title, groups)]
        if study.kind == "stability":
            figs.append(reward_figure(study, curves, p("reward.png"), title, smooth=10))
        return figs
    if study.kind == "shift":
        shifts = list(range(shift_every, max_steps, shift_every)) if shift_every else []
        return [reward_figure(study, curves, p("reward.png"), title, shifts=shifts),
                shift_figure(study, curves, summary, p("online_shift.png"), title, shifts)]
    raise ValueError(f"study kind {study.kind!r}")


def survival_figure(survival: Sequence[Dict], panels: Sequence[Tuple[str, Sequence[str]]],
                    path: str, title: str) -> str:
    """Fraction of runs not yet collapsed against step (a step function) with its Wilson 95%
    band, one line per variant, one panel per group of variants (stability.panels)."""
    plt = pyplot()
    panels = [(name, ids) for name, ids in panels
              if any(r["variant"] in ids for r in survival)] or [("no runs", [])]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.5, 4.4 * len(panels)), 3.8),
                             squeeze=False, sharey=True)
    for ax, (name, ids) in zip(axes[0], panels):
        for vid in ids:
            rows = [r for r in survival if r["variant"] == vid]
            if not rows:
                continue
            xs = [r["step"] for r in rows]
            line, = ax.step(xs, [r["fraction"] for r in rows], where="post",
                            label=f"{rows[0]['label']} (n={rows[0]['runs']})")
            ax.fill_between(xs, [r["lo"] for r in rows], [r["hi"] for r in rows], step="post",
                            color=line.get_color(), alpha=0.12, linewidth=0)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel(X_LABELS["step"])
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower left")
    axes[0][0].set_ylabel("runs not yet collapsed (Wilson 95%)")
    return save_figure(fig, path, title)


def early_warning_figure(study, warnings: Sequence[Dict], run_rows: Sequence[Dict], path: str,
                         title: str) -> str:
    """One panel per indicator at its middle threshold (early_warning.middle; absolute ones in
    the first row, relative ones in the second): each collapsed run's lead time (a dot;
    x = collapse step - fire step, hits only) per variant, with hits / collapsed runs and false
    alarms / stable runs written beside it."""
    from experiments.studies.early_warning import INDICATORS, middle
    plt = pyplot()
    vids = [v.id for v in study.variants]
    cols = 4
    rows = (len(INDICATORS) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, rows * (0.32 * len(vids) + 1.6)),
                             squeeze=False, sharey=True)
    ys = {vid: len(vids) - 1 - i for i, vid in enumerate(vids)}
    for ax in list(axes.flat)[len(INDICATORS):]:
        ax.set_visible(False)
    for ax, ind in zip(axes.flat, INDICATORS):
        thr = middle(ind)
        longest = 10
        for vid in vids:
            leads = [r["lead"] for r in run_rows if r["variant"] == vid
                     and r["indicator"] == ind.name and r["threshold"] == thr
                     and r["outcome"] == "hit"]
            longest = max([longest] + leads)
            ax.scatter(leads, [ys[vid]] * len(leads), s=12, alpha=0.7, color="C0")
            s = next((w for w in warnings if w["variant"] == vid and w["indicator"] == ind.name
                      and w["threshold"] == thr), None)
            if s is not None:
                ax.annotate(f"{s['hit']}/{s['collapsed']} hit, {s['false_alarm']}/"
                            f"{s['false_alarm'] + s['quiet']} false alarms", (0.99, ys[vid]),
                            xycoords=("axes fraction", "data"), fontsize=5.5, ha="right",
                            va="center", color="0.3")
        ax.set_xlim(-1, longest * 1.45)      # room on the right for the counts
        ax.set_xlabel("lead time (collapse step - fire step)")
        ax.set_title(f"{ind.label}{'' if ind.relative else ' '}{thr:g}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    # the panels share the y axis: its labels are set once
    axes[0][0].set_ylim(-0.7, len(vids) - 0.3)
    axes[0][0].set_yticks(list(ys.values()))
    axes[0][0].set_yticklabels(list(ys), fontsize=6)
    for row in axes[1:]:
        row[0].tick_params(axis="y", labelleft=True, labelsize=6)
    return save_figure(fig, path, title)
