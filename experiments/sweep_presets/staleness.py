"""The staleness sweep: a grid of methods x staleness x batch shapes x seeds, with results.csv
and PNG plots (`programs/study.py --preset=staleness_sweep`).

  python programs/study.py --preset=staleness_sweep --size=full --out_dir=runs/staleness_sweep \
      --results_dir=results/staleness_sweep
  python programs/study.py --preset=staleness_sweep --size=smoke --out_dir=/tmp/sweep   # ~1 min
  python programs/study.py --preset=staleness_sweep --methods=sao,grpo_dis --shapes=16x1,4x4 \
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
from typing import Callable, Dict

from experiments import sweeps
from sao_actor_learner.config import SAOConfig
from sao_actor_learner.flags import config_from_flags
from sao_actor_learner.preflight import check_before_launch

OUT_DIR = "runs/staleness_sweep"
# The SAOConfig fields each cell sets.
CELL_FIELDS = ("algorithm", "policy_loss", "batch_size", "group_size", "max_staleness",
               "forced_staleness", "seed", "run_dir")
# The sweep flags of programs/study.py this preset reads.
OWN_FLAGS = ("methods", "shapes", "staleness", "seeds", "staleness_mode")
# --size: the grid and run size; a flag given on the command line wins.
SIZES = {
    # Seconds: a 3-step run per cell in threads (local_mt), 2 methods x 2 staleness values.
    "smoke": dict(methods=["sao", "grpo"], shapes=["4x1", "2x2"], staleness=["0", "1"],
                  seeds=["0"], staleness_mode="forced", max_steps=3, num_actors=1,
                  actor_batch=4, eval_every=0, eval_size=20, launch="local_mt"),
    # ~10-15 min on 2 shared cores: 18 runs of 30 steps, 16 rollouts per step.
    "full": dict(methods=["sao", "grpo", "grpo_dis", "critic_free"], shapes=["16x1", "4x4"],
                 staleness=["0", "2", "4"], seeds=["0"], staleness_mode="forced", max_steps=30,
                 num_actors=2, actor_batch=8, eval_every=10, eval_size=100),
}


def run(flag_values, run_fn: Callable[[SAOConfig], Dict]) -> None:
    """Builds and checks every cell's config (ConfigError before anything runs), runs the
    unfinished cells with `run_fn`, writes results.csv and the plots into --out_dir."""
    base = config_from_flags(SAOConfig, flag_values)
    check_before_launch(base)
    cells, skipped = sweeps.grid(flag_values.methods, flag_values.shapes,
                                 [int(x) for x in flag_values.staleness],
                                 [int(x) for x in flag_values.seeds], flag_values.staleness_mode)
    out_dir = flag_values.out_dir
    for cell in cells:  # every cell's config is valid before the first run starts
        cell.config(base, out_dir)
    for s in skipped:
        print(f"skipped: {s}")
    rows = sweeps.run_cells(cells, base, out_dir, run_fn, progress=flag_values.progress)
    title = (f"{flag_values.staleness_mode} staleness, {base.max_steps} steps, task={base.task}, "
             f"seeds={','.join(flag_values.seeds)}")
    plots = [sweeps.plot_reward_curves(rows, os.path.join(out_dir, "reward_vs_step.png"), title),
             sweeps.plot_drift_vs_staleness(rows, os.path.join(out_dir, "drift_vs_staleness.png"),
                                            title)]
    sweeps.finish(rows, out_dir, flag_values.results_dir,
                  ("results.csv", "reward_vs_step.png", "drift_vs_staleness.png"),
                  f"; plots: {', '.join(plots)}")
