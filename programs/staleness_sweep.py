"""A grid of methods x staleness x batch shapes x seeds, with results.csv and PNG plots.

  python programs/staleness_sweep.py --preset=full --out_dir=runs/staleness_sweep \
      --results_dir=results/staleness_sweep
  python programs/staleness_sweep.py --preset=smoke --out_dir=/tmp/sweep        # ~1 min
  python programs/staleness_sweep.py --methods=sao,grpo_dis --shapes=16x1,4x4 \
      --staleness=0,2,4 --seeds=0,1 --staleness_mode=limit --actor_delay=heavy_tailed \
      --actor_delay_mean_s=0.05 --max_steps=40 --out_dir=runs/my_sweep

Methods (sweeps.METHODS): sao (critic + DIS), sao_ppo_clip / sao_tis / sao_icepop / sao_none
(other corrections), grpo (PPO-clip, old log-probs recomputed), grpo_dis, grpo_tis,
critic_free (single rollout, running-mean baseline), critic_free_per_prompt. Shapes "PxG": P
prompts x G rollouts each. --staleness_mode=forced makes every rollout exactly k versions stale
(k = each --staleness value); limit only caps staleness at it (add --actor_delay to make rollouts
late). Every other SAOConfig field is a flag too and applies to every run.

Resumable: run it again with the same flags and finished cells are skipped. Writes
<out_dir>/results.csv (one row per run), reward_vs_step.png (training reward per method, one
panel per staleness) and drift_vs_staleness.png (KL, masked fraction, ESS, final accuracy).
"""
import os
import sys

from absl import app, flags

# Runnable as a script from the repository root without installation (programs.sweeps).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from programs import sweeps  # noqa: E402
from sao_actor_learner.builder import make_program
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass
from sao_actor_learner.preflight import check_before_launch
from sao_actor_learner.run import run_program

# The grid sets these per cell.
GRID_FIELDS = ("algorithm", "policy_loss", "batch_size", "group_size", "max_staleness",
               "forced_staleness", "seed", "run_dir")
define_flags_from_dataclass(SAOConfig, skip=GRID_FIELDS)
flags.DEFINE_enum("preset", "full", ["smoke", "full"], "Grid and run size; explicit flags win.")
flags.DEFINE_string("out_dir", "runs/staleness_sweep", "Where runs/, results.csv and plots go.")
flags.DEFINE_list("methods", ["sao", "grpo", "grpo_dis", "critic_free"], "Methods to compare.")
flags.DEFINE_list("shapes", ["16x1", "4x4"], "Batch shapes PROMPTSxGROUP.")
flags.DEFINE_list("staleness", ["0", "2", "4"], "Staleness values (k, or max_staleness).")
flags.DEFINE_list("seeds", ["0"], "Seeds.")
flags.DEFINE_enum("staleness_mode", "forced", ["forced", "limit"],
                  "forced: every rollout exactly k stale; limit: max_staleness only.")
flags.DEFINE_bool("progress", True, "Show progress.")
flags.DEFINE_string("results_dir", "",
                    "Also copy the CSV files and plots here (e.g. results/...).")
FLAGS = flags.FLAGS

PRESETS = {
    # Seconds: a 3-step run per cell in threads (local_mt), 2 methods x 2 staleness values.
    "smoke": dict(methods=["sao", "grpo"], shapes=["4x1", "2x2"], staleness=["0", "1"],
                  seeds=["0"], staleness_mode="forced", max_steps=3, num_actors=1,
                  actor_batch=4, eval_every=0, eval_size=20, launch="local_mt"),
    # ~10-15 min on 2 shared cores: 18 runs of 30 steps, 16 rollouts per step.
    "full": dict(methods=["sao", "grpo", "grpo_dis", "critic_free"], shapes=["16x1", "4x4"],
                 staleness=["0", "2", "4"], seeds=["0"], staleness_mode="forced", max_steps=30,
                 num_actors=2, actor_batch=8, eval_every=10, eval_size=100),
}


def main(argv):
    del argv
    sweeps.apply_preset(FLAGS, PRESETS[FLAGS.preset])
    try:
        base = config_from_flags(SAOConfig)
        check_before_launch(base)
        cells, skipped = sweeps.grid(FLAGS.methods, FLAGS.shapes,
                                     [int(x) for x in FLAGS.staleness],
                                     [int(x) for x in FLAGS.seeds], FLAGS.staleness_mode)
        for cell in cells:  # every cell's config is valid before the first run starts
            cell.config(base, FLAGS.out_dir)
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    for s in skipped:
        print(f"skipped: {s}")
    rows = sweeps.run_cells(cells, base, FLAGS.out_dir,
                            lambda config: run_program(config, make_program,
                                                       progress=FLAGS.progress),
                            progress=FLAGS.progress)
    title = (f"{FLAGS.staleness_mode} staleness, {base.max_steps} steps, task={base.task}, "
             f"seeds={','.join(FLAGS.seeds)}")
    plots = [sweeps.plot_reward_curves(rows, os.path.join(FLAGS.out_dir, "reward_vs_step.png"),
                                       title),
             sweeps.plot_drift_vs_staleness(rows, os.path.join(FLAGS.out_dir,
                                                               "drift_vs_staleness.png"), title)]
    sweeps.finish(rows, FLAGS.out_dir, FLAGS.results_dir,
                  ("results.csv", "reward_vs_step.png", "drift_vs_staleness.png"),
                  f"; plots: {', '.join(plots)}")


if __name__ == "__main__":
    app.run(main)
