"""The online-shift sweep: the reward's preference flips every --shift_every policy versions
(`programs/study.py --preset=online_shift_sweep`).

task=online_shift (tasks/online_shift.py): phase 0 rewards the true sum (37+45 -> 82), phase 1
the carry-free sum (-> 72), alternating. SAO (single rollouts, critic) against GRPO (groups),
and any other method of sweeps.METHODS; reports how many learner steps each needs to recover
after each shift.

  python programs/study.py --preset=online_shift_sweep --size=full \
      --out_dir=runs/online_shift --results_dir=results/online_shift
  python programs/study.py --preset=online_shift_sweep --size=smoke --out_dir=/tmp/shift  # seconds
  python programs/study.py --preset=online_shift_sweep --methods=sao,grpo,critic_free \
      --shapes=16x1,4x4 --shift_every=20 --max_steps=80 --seeds=0,1 --out_dir=runs/shift

Recovery after a shift at version s: the pre-shift level L is the mean training reward of the
--window steps up to s; the dip is the lowest --window-step moving average in the new phase
(rollouts trained right after s were made before it, so the fall comes a few steps late); the
run has recovered at the first step t after the dip whose moving average reaches
--recover_fraction x L: steps_to_recover = t - s (0: it never fell that low; empty: not within
the phase). The same on held-out accuracy under the current rule
(greedy, less noisy, one point per --eval_every versions): eval_steps_to_recover is the first
evaluated version v >= s with accuracy >= --recover_fraction x the last accuracy before s,
minus s. phase_mean_reward (mean training reward over the new phase) summarises both.
Writes results.csv (one row per run), recovery.csv (one row per run and shift),
online_shift.png (reward and held-out accuracy under the current rule vs step, shifts marked).
Resumable like every sweep; every other SAOConfig field is a flag.
"""
import os
from typing import Callable, Dict

from experiments import sweeps
from experiments.studies import metrics as study_metrics
from sao_actor_learner.config import ConfigError, SAOConfig
from sao_actor_learner.flags import config_from_flags
from sao_actor_learner.observers import read_metrics
from sao_actor_learner.preflight import check_before_launch

OUT_DIR = "runs/online_shift"
# The SAOConfig fields each cell sets (task: always online_shift).
CELL_FIELDS = ("algorithm", "policy_loss", "batch_size", "group_size", "seed", "run_dir",
               "forced_staleness", "task")
# The sweep flags of programs/study.py this preset reads.
OWN_FLAGS = ("methods", "shapes", "seeds", "window", "recover_fraction")
# --size: the grid and run size; a flag given on the command line wins.
SIZES = {
    "smoke": dict(methods=["sao", "grpo"], shapes=["4x1", "2x2"], seeds=["0"], shift_every=2,
                  max_steps=4, window=1, num_actors=1, actor_batch=4, eval_every=2,
                  eval_size=20, launch="local_mt"),
    # ~10-15 min on 2 shared cores: 3 method x shape pairs x 2 seeds, 100 steps of 32
    # rollouts, 3 shifts.
    "full": dict(methods=["sao", "grpo"], shapes=["32x1", "8x4"], seeds=["0", "1"],
                 shift_every=25, max_steps=100, window=3, num_actors=2, actor_batch=8,
                 eval_every=5, eval_size=100),
}
RECOVERY_COLUMNS = ("method", "batch_shape", "seed", "shift", "shift_step", "to_phase",
                    "pre_level", "dip", "dip_step", "phase_mean_reward", "steps_to_recover",
                    "eval_pre", "eval_at_shift", "eval_steps_to_recover")


def recovery(rewards_by_step, shift_every, max_steps, window, fraction, eval_by_step=None):
    """One dict per shift: pre-shift level, dip (lowest moving average in the new phase), the
    phase's mean reward (higher: faster adaptation) and steps to recover (None when not within
    the phase). With `eval_by_step` (held-out accuracy under the current rule by version) also
    eval_pre (the last accuracy before the shift), eval_at_shift and eval_steps_to_recover (first
    evaluated version in the phase at fraction x eval_pre, minus the shift version). The rules
    are experiments/studies/metrics.py's `recovery` and `eval_recovery`."""
    evals = {e["shift"]: e for e in study_metrics.eval_recovery(eval_by_step or {}, shift_every,
                                                                max_steps, fraction)}
    out = []
    for r in study_metrics.recovery(rewards_by_step, shift_every, max_steps, window, fraction):
        row = {k: v for k, v in r.items() if k != "phase_mean"}
        row["phase_mean_reward"] = r["phase_mean"]
        e = evals.get(r["shift"])
        if e is not None:
            row.update(eval_pre=e["pre_level"], eval_at_shift=e["at_shift"],
                       eval_steps_to_recover=e["steps_to_recover"])
        out.append(row)
    return out


def _eval_pair(group):
    pairs = [(s["eval_pre"], s["eval_at_shift"]) for s in group if "eval_pre" in s]
    if not pairs:
        return "-"
    return (f"{sum(p for p, _ in pairs) / len(pairs):.2f}->"
            f"{sum(a for _, a in pairs) / len(pairs):.2f}")


def _eval_back(group):
    return ",".join("-" if s.get("eval_steps_to_recover") is None else
                    str(s["eval_steps_to_recover"]) for s in group)


def plot(rows, shift_every, max_steps, eval_every, path, title):
    plt = sweeps.pyplot()
    rows = [r for r in rows if r.get("status") == "ok"]
    groups = {}
    for r in rows:
        groups.setdefault(f"{r['method']} {r['batch_shape']}", []).append(r["run_dir"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for label, dirs in sorted(groups.items()):
        steps, reward = sweeps.mean_curve(dirs, "reward_mean")
        axes[0].plot(steps, study_metrics.moving_average(reward, 3), label=f"{label} (n={len(dirs)})")
        steps, acc = sweeps.mean_curve(dirs, "eval_accuracy", kind="eval",
                                       bin_size=eval_every)
        axes[1].plot(steps, acc, marker="o", markersize=3, label=label)
    for ax, name in zip(axes, ("training reward (current rule)", "held-out accuracy (current rule)")):
        for s in range(shift_every, max_steps, shift_every):
            ax.axvline(s, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xlabel("learner step (dashed: reward rule flips)")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return sweeps.save_figure(fig, path, title)


def run(flag_values, run_fn: Callable[[SAOConfig], Dict]) -> None:
    """Builds and checks every cell's config (ConfigError before anything runs), runs the
    unfinished cells with `run_fn`, writes results.csv, recovery.csv and the plot into
    --out_dir and prints the recovery table."""
    base = config_from_flags(SAOConfig, flag_values, task="online_shift")
    check_before_launch(base)
    if base.max_steps <= base.shift_every:
        raise ConfigError(f"max_steps={base.max_steps} <= shift_every={base.shift_every}: "
                          "the reward would never shift; raise max_steps")
    if not 1 <= flag_values.window <= base.shift_every:
        raise ConfigError(f"window={flag_values.window}: must be in [1, shift_every="
                          f"{base.shift_every}]")
    cells, skipped = sweeps.grid(flag_values.methods, flag_values.shapes, [base.max_staleness],
                                 [int(s) for s in flag_values.seeds], "limit")
    for cell in cells:
        cell.config(base, flag_values.out_dir)
    for s in skipped:
        print(f"skipped: {s}")
    rows = sweeps.run_cells(cells, base, flag_values.out_dir, run_fn, progress=flag_values.progress)
    shifts = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        rewards = {m["step"]: m["reward_mean"] for m in read_metrics(r["run_dir"], "train")}
        evals = {}
        for m in read_metrics(r["run_dir"], "eval"):  # binned as in the plot
            evals.setdefault(m["step"] // max(base.eval_every, 1) * max(base.eval_every, 1),
                             m["eval_accuracy"])
        for rec in recovery(rewards, base.shift_every, base.max_steps, flag_values.window,
                            flag_values.recover_fraction, evals):
            shifts.append({"method": r["method"], "batch_shape": r["batch_shape"],
                           "seed": r["seed"], **rec})
    sweeps.write_csv(shifts, os.path.join(flag_values.out_dir, "recovery.csv"), RECOVERY_COLUMNS)
    title = (f"online shift every {base.shift_every} versions, max_staleness="
             f"{base.max_staleness}, seeds={','.join(flag_values.seeds)}")
    path = plot(rows, base.shift_every, base.max_steps, max(base.eval_every, 1),
                os.path.join(flag_values.out_dir, "online_shift.png"), title)
    print(f"{'method':<18} {'shift':>5} {'pre level':>9} {'dip':>6} {'phase mean':>10} "
          f"{'steps to recover':>16} {'eval pre->at shift':>18} {'eval steps back':>15}")
    keys = sorted({(s["method"], s["batch_shape"], s["shift"]) for s in shifts})
    for method, shape, j in keys:
        group = [s for s in shifts if (s["method"], s["batch_shape"], s["shift"]) == (method, shape, j)]
        rec = [s["steps_to_recover"] for s in group]
        done = [x for x in rec if x is not None]
        shown = ",".join("-" if x is None else str(x) for x in rec)
        print(f"{method + ' ' + shape:<18} {j:>5} "
              f"{sum(s['pre_level'] for s in group) / len(group):>9.3f} "
              f"{sum(s['dip'] for s in group) / len(group):>6.3f} "
              f"{sum(s['phase_mean_reward'] for s in group) / len(group):>10.3f} "
              f"{shown:>16} {_eval_pair(group):>18} {_eval_back(group):>15}"
              + (f"  (reward recovery mean {sum(done) / len(done):.1f})" if done else ""))
    sweeps.finish(rows, flag_values.out_dir, flag_values.results_dir,
                  ("results.csv", "recovery.csv", "online_shift.png"),
                  f", recovery.csv; plot: {path}")
