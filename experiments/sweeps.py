"""Grids of runs for studies: methods x staleness x batch shapes x seeds (and other axes).

Used by the study presets (experiments/studies/) and the sweep presets of programs/study.py
(experiments/sweep_presets/). A sweep is a list of `Cell`s, each one run of the whole program
(`run.run_program`) in its own folder `<out_dir>/runs/<cell name>`. Sweeps are resumable: a cell
whose folder already holds a summary.json made by the same config is not run again. After every
cell the sweep rewrites `<out_dir>/results.csv` (one row per run); programs then draw PNG plots
with matplotlib (Agg backend, no display needed).

A method is a named set of config overrides (METHODS). A batch shape "PxG" is P prompts with G
rollouts each (batch_size = P*G, group_size = G): SAO's 128x1 against GRPO's 16x8, scaled down.
GRPO needs G >= 2; its cells with G = 1 are left out (and listed as skipped).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from experiments.studies.metrics import moving_average
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.observers import read_metrics, write_json_atomic

# name -> config overrides. "sao" is the paper's method; the rest are baselines and ablations.
METHODS: Dict[str, Dict] = {
    "sao": dict(algorithm="sao", policy_loss="dis"),
    "sao_ppo_clip": dict(algorithm="sao", policy_loss="ppo_clip"),
    "sao_tis": dict(algorithm="sao", policy_loss="tis"),
    "sao_icepop": dict(algorithm="sao", policy_loss="icepop"),
    "sao_none": dict(algorithm="sao", policy_loss="none"),
    "grpo": dict(algorithm="grpo", policy_loss="ppo_clip"),
    "grpo_dis": dict(algorithm="grpo", policy_loss="dis"),
    "grpo_tis": dict(algorithm="grpo", policy_loss="tis"),
    "critic_free": dict(algorithm="critic_free", policy_loss="dis", baseline="running_mean"),
    "critic_free_per_prompt": dict(algorithm="critic_free", policy_loss="dis",
                                   baseline="per_prompt"),
}

# A run is "collapsed" when its last rewards fall below this fraction of its best, or its final
# held-out accuracy ends this far below the warm start's, or a loss went non-finite.
COLLAPSE_REWARD_FRACTION = 0.5
COLLAPSE_EVAL_DROP = 0.10
REWARD_WINDOW = 5  # steps averaged for "final reward" and the collapse test

RESULT_COLUMNS = (
    "method", "algorithm", "policy_loss", "staleness_mode", "max_staleness", "batch_shape",
    "prompts_per_batch", "group_size", "seed", "value_pretrain_rollouts", "steps",
    "final_reward", "best_reward", "initial_eval_accuracy", "final_eval_accuracy", "mean_kl",
    "mean_masked_frac", "mean_ess", "mean_staleness", "max_staleness_seen", "dropped_stale",
    "mean_explained_variance", "collapsed", "wall_time_s", "status", "run_dir")


def parse_shape(shape: str) -> Tuple[int, int]:
    """"16x8" -> (16 prompts, 8 rollouts per prompt)."""
    try:
        p, g = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise ConfigError(f"batch shape {shape!r}: write it as PROMPTSxGROUP, e.g. 16x1 or 4x4")
    if p < 1 or g < 1:
        raise ConfigError(f"batch shape {shape!r}: prompts and group size must be >= 1")
    return p, g


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of a sweep: a method, a batch shape, a staleness setting, a seed, and extras."""
    method: str
    shape: str
    max_staleness: int
    seed: int
    staleness_mode: str = "limit"       # limit: max_staleness only; forced: exactly k stale
    extra: Tuple[Tuple[str, object], ...] = ()   # further config overrides, e.g. pretrain steps
    tag: str = ""    # names the extras in the folder name instead of spelling them out

    @property
    def name(self) -> str:
        extra = f"_{self.tag}" if self.tag else "".join(f"_{k}{v}" for k, v in self.extra)
        mode = "k" if self.staleness_mode == "forced" else "eta"
        return f"{self.method}_{self.shape}_{mode}{self.max_staleness}{extra}_seed{self.seed}"

    def config(self, base: SAOConfig, out_dir: str) -> SAOConfig:
        if self.method not in METHODS:
            raise ConfigError(f"method {self.method!r}: must be one of {', '.join(METHODS)}")
        prompts, group = parse_shape(self.shape)
        batch = prompts * group
        overrides = dict(METHODS[self.method])
        overrides.update(
            batch_size=batch, group_size=group, max_staleness=self.max_staleness,
            seed=self.seed, run_dir=os.path.join(out_dir, "runs", self.name),
            forced_staleness=self.max_staleness if self.staleness_mode == "forced" else -1,
            # keep actor batches whole groups and no larger than the queue
            actor_batch=_actor_batch(base.actor_batch, group, batch),
            queue_capacity=base.queue_capacity if base.queue_capacity >= batch else 0)
        overrides.update(dict(self.extra))
        return base.replace(**overrides)


def _actor_batch(wanted: int, group: int, batch: int) -> int:
    """The actor batch nearest `wanted` that is whole groups and fits a 2x-batch queue."""
    n = max(group, (wanted // group) * group)
    return min(n, 2 * batch)


def grid(methods: Sequence[str], shapes: Sequence[str], staleness: Sequence[int],
         seeds: Sequence[int], staleness_mode: str = "limit",
         extras: Sequence[Tuple[Tuple[str, object], ...]] = ((),)
         ) -> Tuple[List[Cell], List[str]]:
    """All valid cells (methods x shapes x staleness x seeds x extras) and the skipped ones."""
    cells, skipped = [], []
    for method in methods:
        if method not in METHODS:
            raise ConfigError(f"method {method!r}: must be one of {', '.join(METHODS)}")
        for shape in shapes:
            _, group = parse_shape(shape)
            if METHODS[method]["algorithm"] == "grpo" and group < 2:
                skipped.append(f"{method} {shape}: GRPO needs a group of >= 2 rollouts")
                continue
            for eta in staleness:
                for extra in extras:
                    for seed in seeds:
                        cells.append(Cell(method, shape, eta, seed, staleness_mode, tuple(extra)))
    return cells, skipped


# --- one run -> one row ----------------------------------------------------------------------------
def _mean(rows: Sequence[Dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))
            and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else None


def is_collapsed(rewards: Sequence[float], initial_eval: Optional[float],
                 final_eval: Optional[float], nonfinite: bool) -> bool:
    """The collapse rule of this module's docstring constants (see COLLAPSE_*)."""
    if nonfinite:
        return True
    if rewards:
        smooth = moving_average(list(rewards), REWARD_WINDOW)
        if max(smooth) > 0 and smooth[-1] < COLLAPSE_REWARD_FRACTION * max(smooth):
            return True
    if initial_eval is not None and final_eval is not None:
        return final_eval < initial_eval - COLLAPSE_EVAL_DROP
    return False


def result_row(cell: Cell, config: SAOConfig, summary: Dict, status: str = "ok") -> Dict:
    """The results.csv row of one finished run (read from its metrics.jsonl and summary)."""
    train = read_metrics(config.run_dir, "train")
    rewards = [r["reward_mean"] for r in train if isinstance(r.get("reward_mean"), (int, float))]
    nonfinite = any(not isinstance(r.get("policy_loss", 0.0), (int, float)) or
                    not math.isfinite(r.get("policy_loss", 0.0)) for r in train)
    smooth = moving_average(rewards, REWARD_WINDOW) if rewards else []
    prompts, group = parse_shape(cell.shape)
    row = {
        "method": cell.method, "algorithm": config.algorithm, "policy_loss": config.policy_loss,
        "staleness_mode": cell.staleness_mode, "max_staleness": cell.max_staleness,
        "batch_shape": cell.shape, "prompts_per_batch": prompts, "group_size": group,
        "seed": cell.seed, "value_pretrain_rollouts": config.value_pretrain_rollouts,
        "steps": summary.get("steps", len(train)),
        "final_reward": smooth[-1] if smooth else None,
        "best_reward": max(smooth) if smooth else None,
        "initial_eval_accuracy": summary.get("initial_eval_accuracy"),
        "final_eval_accuracy": summary.get("final_eval_accuracy"),
        "mean_kl": _mean(train, "kl_rollout"),
        "mean_masked_frac": _mean(train, "masked_frac"),
        "mean_ess": _mean(train, "ess"),
        "mean_staleness": _mean(train, "staleness_mean"),
        "max_staleness_seen": max((r.get("staleness_max", 0) for r in train), default=None),
        "dropped_stale": summary.get("dropped_stale"),
        "mean_explained_variance": _mean(train, "explained_variance"),
        "collapsed": "yes" if is_collapsed(rewards, summary.get("initial_eval_accuracy"),
                                           summary.get("final_eval_accuracy"),
                                           nonfinite) else "no",
        "wall_time_s": summary.get("wall_time_s"),
        "status": status, "run_dir": config.run_dir,
    }
    return row


def write_csv(rows: Sequence[Dict], path: str, columns: Sequence[str] = RESULT_COLUMNS) -> None:
    """All rows to `path` (rewritten atomically); floats with 6 significant digits."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v)
                             for k, v in row.items()})
    os.replace(tmp, path)


def read_csv(path: str) -> List[Dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


# --- running a sweep --------------------------------------------------------------------------------
def finished_summary(config: SAOConfig) -> Optional[Dict]:
    """The summary of an earlier run of exactly this config, if there is one (resuming)."""
    summary_path = os.path.join(config.run_dir, "summary.json")
    config_path = os.path.join(config.run_dir, "config.json")
    if not (os.path.exists(summary_path) and os.path.exists(config_path)):
        return None
    try:
        with open(config_path) as f:
            same = SAOConfig.from_json(f.read()) == config
        with open(summary_path) as f:
            summary = json.load(f)
    except (ValueError, TypeError, OSError):
        return None
    if not same or summary.get("steps") != config.max_steps:
        return None
    return summary


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "#" * filled + "." * (width - filled)


def run_cells(cells: Sequence[Cell], base: SAOConfig, out_dir: str, run_fn: Callable,
              progress: bool = True, csv_name: str = "results.csv",
              out=sys.stdout, record_name: str = "sweep.json") -> List[Dict]:
    """Runs every cell not already finished; returns one row per cell (results.csv order).

    run_fn(config) -> summary (run.run_program with a program factory bound). A cell that fails
    gets a row with status "failed: ..." and is tried again by the next invocation. csv_name and
    record_name (the sweep's cells and base config) are paths under out_dir, so several sweeps
    can share one out_dir and so reuse each other's finished cells.
    """
    os.makedirs(out_dir, exist_ok=True)
    rows: List[Dict] = []
    t0 = time.time()
    ran = 0
    for i, cell in enumerate(cells):
        config = cell.config(base, out_dir)
        done = finished_summary(config)
        if done is not None:
            rows.append(result_row(cell, config, done))
            if progress:
                out.write(f"[{_bar(i + 1, len(cells))}] {i + 1}/{len(cells)} {cell.name}: "
                          "done earlier, skipped\n")
            write_csv(rows, os.path.join(out_dir, csv_name))
            continue
        if progress:
            eta = ""
            if ran:
                per = (time.time() - t0) / ran
                left = sum(1 for c in cells[i:]
                           if finished_summary(c.config(base, out_dir)) is None)
                eta = f", about {per * left / 60:.1f} min left"
            out.write(f"[{_bar(i, len(cells))}] {i + 1}/{len(cells)} {cell.name}"
                      f" ({time.time() - t0:.0f}s elapsed{eta})\n")
            out.flush()
        try:
            summary = run_fn(config)
            rows.append(result_row(cell, config, summary))
        except Exception as e:  # noqa: BLE001 - one failed cell must not end the sweep
            traceback.print_exc()
            rows.append({"method": cell.method, "batch_shape": cell.shape,
                         "max_staleness": cell.max_staleness, "seed": cell.seed,
                         "staleness_mode": cell.staleness_mode,
                         "status": f"failed: {type(e).__name__}: {e}"[:200],
                         "run_dir": config.run_dir})
        ran += 1
        write_csv(rows, os.path.join(out_dir, csv_name))
    if progress:
        out.write(f"[{_bar(1, 1)}] {len(cells)} cells ({ran} run now) in "
                  f"{time.time() - t0:.0f}s; results in {os.path.join(out_dir, csv_name)}\n")
    write_json_atomic(os.path.join(out_dir, record_name),
                      {"cells": [c.name for c in cells], "base_config": json.loads(base.to_json()),
                       "wall_time_s": time.time() - t0, "cells_run_now": ran})
    return rows


# --- flags and presets ------------------------------------------------------------------------------
def apply_preset(flag_values, preset: Dict[str, object]) -> None:
    """Sets each flag of `preset` unless the user gave it on the command line."""
    for name, value in preset.items():
        if name not in flag_values:
            raise KeyError(f"preset names an unknown flag --{name}")
        if not flag_values[name].present:
            flag_values[name].value = value


def copy_results(out_dir: str, results_dir: str, names: Sequence[str]) -> List[str]:
    """Copies the sweep's small outputs (CSV, PNG) from `out_dir` to `results_dir` (e.g. the
    committed results/ folder; the runs themselves stay in out_dir). Returns the copied paths."""
    import shutil
    if not results_dir:
        return []
    os.makedirs(results_dir, exist_ok=True)
    copied = []
    for name in names:
        src = os.path.join(out_dir, name)
        if os.path.exists(src):
            copied.append(shutil.copy2(src, os.path.join(results_dir, name)))
    return copied


def finish(rows: Sequence[Dict], out_dir: str, results_dir: str, names: Sequence[str],
           outputs: str) -> None:
    """The end of a study program: copies `names` to `results_dir` (copy_results), prints how
    many runs failed and where the results are (`outputs`: what follows results.csv), and exits
    with status 1 if any run failed."""
    import sys
    copy_results(out_dir, results_dir, names)
    failed = [r for r in rows if r.get("status") != "ok"]
    print(f"{len(rows)} runs, {len(failed)} failed; results: "
          f"{os.path.join(out_dir, 'results.csv')}{outputs}")
    if failed:
        sys.exit(1)


# --- plots ----------------------------------------------------------------------------------------
def save_figure(fig, path: str, title: str = "") -> str:
    """Titles (if `title`), lays out, writes `fig` to `path` as a PNG and closes it; `path`."""
    import matplotlib.pyplot as plt
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def finite_number(v) -> Optional[float]:
    """`v` as a finite float; None when it is missing, not a number, NaN or infinite."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def mean_curve(run_dirs: Sequence[str], key: str, kind: str = "train", bin_size: int = 1
               ) -> Tuple[List[int], List[float]]:
    """Step -> mean of `key` over the runs (steps present in every run).

    bin_size > 1 files each row under the multiple of bin_size at or below its step (the
    evaluator evaluates the first version it sees past each multiple of eval_every, which can
    be a version or two late), keeping the first row of each bin.
    """
    per_run = []
    for d in run_dirs:
        curve: Dict[int, float] = {}
        for r in read_metrics(d, kind):
            if isinstance(r.get(key), (int, float)):
                curve.setdefault(r["step"] // bin_size * bin_size, r[key])
        per_run.append(curve)
    if not per_run:
        return [], []
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    return steps, [sum(p[s] for p in per_run) / len(per_run) for s in steps]


def _label(row: Dict) -> str:
    return f"{row['method']} {row['batch_shape']}"


def _ok(rows: Iterable[Dict]) -> List[Dict]:
    return [r for r in rows if str(r.get("status", "ok")) == "ok"]


def plot_reward_curves(rows: Sequence[Dict], path: str, title: str = "",
                       smooth: int = 3) -> str:
    """Training reward vs step, one panel per staleness setting, one line per method x shape
    (mean over seeds, moving average over `smooth` steps)."""
    plt = pyplot()
    rows = _ok(rows)
    etas = sorted({int(r["max_staleness"]) for r in rows})
    fig, axes = plt.subplots(1, max(len(etas), 1), figsize=(4.2 * max(len(etas), 1), 3.4),
                             sharey=True, squeeze=False)
    for ax, eta in zip(axes[0], etas):
        lines: Dict[str, List[str]] = {}
        for r in rows:
            if int(r["max_staleness"]) == eta:
                lines.setdefault(_label(r), []).append(r["run_dir"])
        for label, dirs in sorted(lines.items()):
            steps, values = mean_curve(dirs, "reward_mean")
            if steps:
                ax.plot(steps, moving_average(values, smooth), label=f"{label} (n={len(dirs)})")
        mode = rows[0]["staleness_mode"] if rows else "limit"
        ax.set_title(f"{'staleness k' if mode == 'forced' else 'max_staleness'} = {eta}")
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training reward")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    return save_figure(fig, path, title)


def plot_drift_vs_staleness(rows: Sequence[Dict], path: str, title: str = "") -> str:
    """KL(rollout || current), masked fraction, ESS and final held-out accuracy against the
    staleness setting, one line per method x shape (mean over seeds)."""
    plt = pyplot()
    rows = _ok(rows)
    panels = (("mean_kl", "KL(rollout || current)"), ("mean_masked_frac", "masked fraction"),
              ("mean_ess", "ESS"), ("final_eval_accuracy", "final held-out accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.4), squeeze=False)
    groups: Dict[str, Dict[int, List[Dict]]] = {}
    for r in rows:
        groups.setdefault(_label(r), {}).setdefault(int(r["max_staleness"]), []).append(r)
    for ax, (key, name) in zip(axes[0], panels):
        for label, by_eta in sorted(groups.items()):
            xs, ys = [], []
            for eta in sorted(by_eta):
                vals = [v for v in (finite_number(r.get(key)) for r in by_eta[eta])
                        if v is not None]
                if vals:
                    xs.append(eta)
                    ys.append(sum(vals) / len(vals))
            if xs:
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_xticks(sorted({int(r["max_staleness"]) for r in rows}))
        ax.set_xlabel("staleness (k or limit)")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    return save_figure(fig, path, title)
