"""Value-pretraining sensitivity: SAO runs that differ only in --value_pretrain_rollouts.

The paper calls the critic's cold start the main bottleneck and its pretraining scale
"essential" without giving it (docs/METHOD.md section 6). This sweeps the scale:

  python programs/value_pretrain_sweep.py --preset=full --out_dir=runs/value_pretrain \
      --results_dir=results/value_pretrain
  python programs/value_pretrain_sweep.py --preset=smoke --out_dir=/tmp/vp     # seconds
  python programs/value_pretrain_sweep.py --pretrain_rollouts=0,80,320 --seeds=0,1,2 \
      --max_steps=30 --method=sao --shape=16x1 --out_dir=runs/vp

Value pretraining fits the critic on a budget of the fixed initial policy's rollouts in epochs
until its held-out explained variance stops improving (critic/fit.py). Writes results.csv
(the sweep columns plus pretrain_final_ev: the held-out explained variance it ended with, and
early_ev: mean explained variance over the first 5 RL steps), value_pretrain.png (explained
variance vs step per setting; final accuracy, reward and early EV vs the budget).
Resumable like every sweep. Every other SAOConfig field is a flag and applies to every run.
"""
import os
import sys

from absl import app, flags

# Runnable as a script from the repository root without installation (programs.sweeps).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from programs import sweeps  # noqa: E402
from programs.studies import metrics as study_metrics  # noqa: E402
from sao_actor_learner.builder import make_program
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.preflight import check_before_launch
from sao_actor_learner.run import run_program

GRID_FIELDS = ("algorithm", "policy_loss", "batch_size", "group_size", "seed", "run_dir",
               "value_pretrain_rollouts", "forced_staleness")
define_flags_from_dataclass(SAOConfig, skip=GRID_FIELDS)
flags.DEFINE_enum("preset", "full", ["smoke", "full"], "Grid and run size; explicit flags win.")
flags.DEFINE_string("out_dir", "runs/value_pretrain", "Where runs/, results.csv and plots go.")
flags.DEFINE_list("pretrain_rollouts", ["0", "80", "240", "480", "960"],
                  "value_pretrain_rollouts values (the budgets).")
flags.DEFINE_list("seeds", ["0", "1"], "Seeds.")
flags.DEFINE_string("method", "sao", "A method with a critic (sweeps.METHODS).")
flags.DEFINE_string("shape", "16x1", "Batch shape PROMPTSxGROUP.")
flags.DEFINE_bool("progress", True, "Show progress.")
flags.DEFINE_string("results_dir", "",
                    "Also copy the CSV files and plots here (e.g. results/...).")
FLAGS = flags.FLAGS

EARLY_STEPS = 5
PRESETS = {
    "smoke": dict(pretrain_rollouts=["0", "24"], seeds=["0"], shape="4x1", max_steps=3,
                  num_actors=1, actor_batch=4, eval_every=0, eval_size=20, launch="local_mt"),
    # ~8-10 min on 2 shared cores: 5 settings x 3 seeds, 30 RL steps of 16 rollouts.
    "full": dict(pretrain_rollouts=["0", "80", "240", "480", "960"], seeds=["0", "1", "2"],
                 shape="16x1",
                 max_steps=30, num_actors=2, actor_batch=8, eval_every=10, eval_size=100),
}
COLUMNS = sweeps.RESULT_COLUMNS + ("pretrain_final_ev", "early_ev")


def add_pretrain_columns(rows):
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
    plt = sweeps.pyplot()
    rows = [r for r in rows if r.get("status") == "ok"]
    by_steps = {}
    for r in rows:
        by_steps.setdefault(int(r["value_pretrain_rollouts"]), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for n, group in sorted(by_steps.items()):
        steps, ev = sweeps.mean_curve([r["run_dir"] for r in group], "explained_variance")
        axes[0].plot(steps, study_metrics.moving_average(ev, 3), label=f"pretrain {n} rollouts (n={len(group)})")
    axes[0].set_xlabel("RL step")
    axes[0].set_ylabel("critic explained variance")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    xs = sorted(by_steps)
    for key, label in (("final_eval_accuracy", "final held-out accuracy"),
                       ("final_reward", "final training reward"), ("early_ev", "early EV")):
        ys = []
        for n in xs:
            vals = [v for v in (sweeps._num(r.get(key)) for r in by_steps[n]) if v is not None]
            ys.append(sum(vals) / len(vals) if vals else float("nan"))
        axes[1].plot(xs, ys, marker="o", label=label)
    axes[1].set_xlabel("value_pretrain_rollouts")
    axes[1].set_xticks(xs)
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    return sweeps.save_figure(fig, path, title)


def main(argv):
    del argv
    sweeps.apply_preset(FLAGS, PRESETS[FLAGS.preset])
    try:
        base = config_from_flags(SAOConfig)
        check_before_launch(base)
        if sweeps.METHODS.get(FLAGS.method, {}).get("algorithm") != "sao":
            raise ConfigError(f"method={FLAGS.method!r}: value pretraining needs a critic; pick "
                              "a method with algorithm sao (sao, sao_tis, ...)")
        extras = [(("value_pretrain_rollouts", int(n)),) for n in FLAGS.pretrain_rollouts]
        cells, _ = sweeps.grid([FLAGS.method], [FLAGS.shape], [base.max_staleness],
                               [int(s) for s in FLAGS.seeds], "limit", extras)
        for cell in cells:
            cell.config(base, FLAGS.out_dir)
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    rows = sweeps.run_cells(cells, base, FLAGS.out_dir,
                            lambda config: run_program(config, make_program,
                                                       progress=FLAGS.progress),
                            progress=FLAGS.progress)
    add_pretrain_columns(rows)
    sweeps.write_csv(rows, os.path.join(FLAGS.out_dir, "results.csv"), COLUMNS)
    title = (f"{FLAGS.method} {FLAGS.shape}, max_staleness={base.max_staleness}, "
             f"{base.max_steps} RL steps, seeds={','.join(FLAGS.seeds)}")
    path = plot(rows, os.path.join(FLAGS.out_dir, "value_pretrain.png"), title)
    print(f"{'pretrain':>8} {'seeds':>5} {'pretrain EV':>11} {'early EV':>9} "
          f"{'final reward':>12} {'final acc':>9}")
    for n in [int(x) for x in FLAGS.pretrain_rollouts]:
        group = [r for r in rows if r.get("status") == "ok" and r["value_pretrain_rollouts"] == n]

        def mean(key):
            vals = [v for v in (sweeps._num(r.get(key)) for r in group) if v is not None]
            return f"{sum(vals) / len(vals):.3f}" if vals else "-"
        print(f"{n:>8} {len(group):>5} {mean('pretrain_final_ev'):>11} {mean('early_ev'):>9} "
              f"{mean('final_reward'):>12} {mean('final_eval_accuracy'):>9}")
    sweeps.finish(rows, FLAGS.out_dir, FLAGS.results_dir, ("results.csv", "value_pretrain.png"),
                  f"; plot: {path}")


if __name__ == "__main__":
    app.run(main)
