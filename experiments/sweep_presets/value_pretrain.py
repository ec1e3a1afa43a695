"""The value-pretraining sweep: SAO runs that differ only in value_pretrain_rollouts
(`programs/study.py --preset=value_pretrain_sweep`).

The paper calls the critic's cold start the main bottleneck and its pretraining scale
"essential" without giving it (docs/METHOD.md section 6). This sweeps the scale:

  python programs/study.py --preset=value_pretrain_sweep --size=full \
      --out_dir=runs/value_pretrain --results_dir=results/value_pretrain
  python programs/study.py --preset=value_pretrain_sweep --size=smoke --out_dir=/tmp/vp  # seconds
  python programs/study.py --preset=value_pretrain_sweep --pretrain_rollouts=0,80,320 \
      --seeds=0,1,2 --max_steps=30 --method=sao --shape=16x1 --out_dir=runs/vp

Value pretraining fits the critic on a budget of the fixed initial policy's rollouts in epochs
until its held-out explained variance stops improving (critic/fit.py). Writes results.csv
(the sweep columns plus pretrain_final_ev: the held-out explained variance it ended with, and
early_ev: mean explained variance over the first 5 RL steps), value_pretrain.png (explained
variance vs step per setting; final accuracy, reward and early EV vs the budget).
Resumable like every sweep. Every other SAOConfig field is a flag and applies to every run.
"""
import os
from typing import Callable, Dict

from experiments import sweeps
from experiments.studies import metrics as study_metrics
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.flags import config_from_flags
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.preflight import check_before_launch

OUT_DIR = "runs/value_pretrain"
# The SAOConfig fields each cell sets.
CELL_FIELDS = ("algorithm", "policy_loss", "batch_size", "group_size", "seed", "run_dir",
               "value_pretrain_rollouts", "forced_staleness")
# The sweep flags of programs/study.py this preset reads.
OWN_FLAGS = ("pretrain_rollouts", "seeds", "method", "shape")
EARLY_STEPS = 5
# --size: the grid and run size; a flag given on the command line wins.
SIZES = {
    "smoke": dict(pretrain_rollouts=["0", "24"], seeds=["0"], shape="4x1", max_steps=3,
                  num_actors=1, actor_batch=4, eval_every=0, eval_size=20, launch="local_mt"),
    # ~8-10 min on 2 shared cores: 5 settings x 3 seeds, 30 RL steps of 16 rollouts.
    "full": dict(pretrain_rollouts=["0", "80", "240", "480", "960"], seeds=["0", "1", "2"],
                 shape="16x1",
                 max_steps=30, num_actors=2, actor_batch=8, eval_every=10, eval_size=100),
}
COLUMNS = sweeps.RESULT_COLUMNS + ("pretrain_final_ev", "early_ev")


def add_pretrain_columns(rows):
    """Adds pretrain_final_ev and early_ev (see the module docstring) to each finished row."""
    for row in rows:
        if row.get("status") != "ok":
            continue
        pre = read_metrics(row["run_dir"], "value_pretrain_done")
        train = read_metrics(row["run_dir"], "train")[:EARLY_STEPS]
        row["pretrain_final_ev"] = pre[-1]["heldout_ev"] if pre else None
        evs = [r["explained_variance"] for r in train if "explained_variance" in r]
        row["early_ev"] = sum(evs) / len(evs) if evs else None
    return rows


def plot(rows, path, title):
    """value_pretrain.png: explained variance vs step per budget; final accuracy, reward and
    early EV vs the budget."""
    plt = sweeps.pyplot()
    rows = [r for r in rows if r.get("status") == "ok"]
    by_steps = {}
    for r in rows:
        by_steps.setdefault(int(r["value_pretrain_rollouts"]), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for n, group in sorted(by_steps.items()):
        steps, ev = sweeps.mean_curve([r["run_dir"] for r in group], "explained_variance")
        axes[0].plot(steps, study_metrics.moving_average(ev, 3),
                     label=f"pretrain {n} rollouts (n={len(group)})")
    axes[0].set_xlabel("RL step")
    axes[0].set_ylabel("critic explained variance")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    xs = sorted(by_steps)
    for key, label in (("final_eval_accuracy", "final held-out accuracy"),
                       ("final_reward", "final training reward"), ("early_ev", "early EV")):
        ys = []
        for n in xs:
            vals = [v for v in (sweeps.finite_number(r.get(key)) for r in by_steps[n])
                    if v is not None]
            ys.append(sum(vals) / len(vals) if vals else float("nan"))
        axes[1].plot(xs, ys, marker="o", label=label)
    axes[1].set_xlabel("value_pretrain_rollouts")
    axes[1].set_xticks(xs)
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    return sweeps.save_figure(fig, path, title)


def run(flag_values, run_fn: Callable[[SAOConfig], Dict]) -> None:
    """Builds and checks every cell's config (ConfigError before anything runs), runs the
    unfinished cells with `run_fn`, writes results.csv and the plot into --out_dir and prints
    a table per budget."""
    base = config_from_flags(SAOConfig, flag_values)
    check_before_launch(base)
    method, shape, seeds = flag_values.method, flag_values.shape, flag_values.seeds
    if sweeps.METHODS.get(method, {}).get("algorithm") != "sao":
        raise ConfigError(f"method={method!r}: value pretraining needs a critic; pick "
                          "a method with algorithm sao (sao, sao_tis, ...)")
    extras = [(("value_pretrain_rollouts", int(n)),) for n in flag_values.pretrain_rollouts]
    cells, _ = sweeps.grid([method], [shape], [base.max_staleness],
                           [int(s) for s in seeds], "limit", extras)
    out_dir = flag_values.out_dir
    for cell in cells:
        cell.config(base, out_dir)
    rows = sweeps.run_cells(cells, base, out_dir, run_fn, progress=flag_values.progress)
    add_pretrain_columns(rows)
    sweeps.write_csv(rows, os.path.join(out_dir, "results.csv"), COLUMNS)
    title = (f"{method} {shape}, max_staleness={base.max_staleness}, "
             f"{base.max_steps} RL steps, seeds={','.join(seeds)}")
    path = plot(rows, os.path.join(out_dir, "value_pretrain.png"), title)
    print(f"{'pretrain':>8} {'seeds':>5} {'pretrain EV':>11} {'early EV':>9} "
          f"{'final reward':>12} {'final acc':>9}")
    for n in [int(x) for x in flag_values.pretrain_rollouts]:
        group = [r for r in rows if r.get("status") == "ok" and r["value_pretrain_rollouts"] == n]

        def mean(key):
            vals = [v for v in (sweeps.finite_number(r.get(key)) for r in group) if v is not None]
            return f"{sum(vals) / len(vals):.3f}" if vals else "-"
        print(f"{n:>8} {len(group):>5} {mean('pretrain_final_ev'):>11} {mean('early_ev'):>9} "
              f"{mean('final_reward'):>12} {mean('final_eval_accuracy'):>9}")
    sweeps.finish(rows, out_dir, flag_values.results_dir, ("results.csv", "value_pretrain.png"),
                  f"; plot: {path}")
