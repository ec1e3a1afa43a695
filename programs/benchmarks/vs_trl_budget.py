r"""vs_trl.py --mode=budget: SAO and TRL each train for the same wall-clock budget.

  OMP_NUM_THREADS=1 .venv/bin/python programs/benchmarks/vs_trl.py --mode=budget \
      --workload=dataset --budget_s=600 --repeats=3 --trl_lrs=5e-5,2e-4 --trl_group_sizes=4,8 \
      --sao_max_steps=300 --staleness_sweep=lockstep,1,2,4,8 --out=results/vs_trl/budget

Each side trains for --budget_s seconds of its training clock (evaluation excluded from both):
  trl                 TRL's GRPOTrainer (trl_grpo.py, its own venv), evaluating inline every
                      --budget_eval_every steps with its clock paused. It gets both cores as a
                      TRL user would run it: its thread count (--trl_threads candidates) and
                      G x lr (--trl_group_sizes x --trl_lrs) are tuned first, in this invocation,
                      by the budget-mean accuracy of --tune_budget_s runs (threads: by steps per
                      second of the tuned G x lr).
  sao_shared          programs/sao.py as `make run-dataset` runs it: every node on both cores.
  sao_disaggregated   the same with --placement=actor:cpu0,learner:cpu1 (generation and
                      training on their own cores, the deployment shape of asynchronous RL).
  sao_pretrain_in_clock  (--sao_pretrain_in_clock) disaggregated, without the reusable critic:
                      value pretraining (--sao_pretrain_rollouts) runs inside the clock.
SAO's policy versions are recorded by the recorder node (--evaluator=record, every
--budget_eval_every versions) and evaluated after the run (programs/evaluate_versions.py): no
evaluation competes with SAO's training for the cores. SAO's clock starts when its learner
starts (the first train row's time minus its wall_time_s) and the run is killed --budget_s later;
a version counts at the moment the learner published it.

Reported per side (median [min, max] over --repeats interleaved repeats): held-out accuracy at
each --report_at_s, the budget-mean accuracy (area under the accuracy-vs-time step function /
budget), the time to each --budget_thresholds and the time to holding it (three evaluations in
a row at or above it: one lucky evaluation does not count), rollouts/s and tokens/s of training, start-up
(launch to training clock start), CPU seconds of the process tree, steps. A PNG of the curves
(median line, min-max band). --staleness_sweep runs disaggregated SAO once per setting
(lockstep, max_staleness k) and reports rollouts/s against lock-step's, learner wait fraction,
time to --sweep_threshold, accuracy at the budget, mean KL (rollout vs current) and masked
fraction, with a throughput-against-drift plot. --resummarize=OUT.json recomputes the figures
of a stored result from its runs (nothing is run).
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

from absl import flags

from experiments.benchmarks import budget_curves as bc

FLAGS = flags.FLAGS
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVALUATE_VERSIONS = os.path.join(REPO, "programs", "evaluate_versions.py")
DISAGGREGATED = "--placement=actor:cpu0,learner:cpu1"


def define_budget_flags() -> None:
    flags.DEFINE_float("budget_s", 600.0, "mode=budget: training seconds of each run "
                       "(evaluation excluded).")
    flags.DEFINE_list("report_at_s", ["150", "300", "600"], "mode=budget: report the held-out "
                      "accuracy at these training-clock times.")
    flags.DEFINE_list("budget_thresholds", ["0.5", "0.55", "0.6", "0.65"],
                      "mode=budget: report the time to each of these accuracies.")
    flags.DEFINE_integer("budget_eval_every", 2, "mode=budget: evaluate every this many policy "
                         "steps (TRL inline, SAO recorded and evaluated after the run).")
    flags.DEFINE_list("sao_layouts", ["shared", "disaggregated"], "mode=budget: SAO's placements "
                      "(shared: all nodes on all cores; disaggregated: " + DISAGGREGATED + ").")
    flags.DEFINE_string("sao_critic_model", "checkpoints/critic_dataset", "mode=budget: SAO's "
                        "value-pretrained critic (made once, `make critic-dataset`); empty or "
                        "missing: no critic checkpoint.")
    flags.DEFINE_bool("sao_pretrain_in_clock", True, "mode=budget: also run disaggregated SAO "
                      "with value pretraining inside its clock instead of the critic checkpoint.")
    flags.DEFINE_integer("sao_pretrain_rollouts", 2400, "mode=budget: value pretraining rollouts "
                         "of the in-clock variant (the critic checkpoint's budget).")
    flags.DEFINE_list("trl_threads", ["1", "2"], "mode=budget: TRL thread counts to measure; "
                      "the fastest (steps/s) is used.")
    flags.DEFINE_list("staleness_sweep", [], "mode=budget: disaggregated SAO once per entry "
                      "(lockstep or a max_staleness k), e.g. lockstep,1,2,4,8.")
    flags.DEFINE_float("sweep_budget_s", 0.0, "mode=budget: training seconds of each staleness "
                       "sweep run (0: --budget_s).")
    flags.DEFINE_list("sao_policy_lrs", [], "mode=budget: SAO policy learning rates to tune over "
                      "(as TRL's G x lr: --tune_budget_s disaggregated runs, by budget-mean "
                      "accuracy); one or none: --sao_policy_lr, untuned.")
    flags.DEFINE_float("sweep_threshold", 0.6, "mode=budget: the staleness table's time-to.")
    flags.DEFINE_string("out", "", "mode=budget: write OUT.json and OUT.png (e.g. "
                        "results/vs_trl/budget_2026-12-03).")
    flags.DEFINE_string("resummarize", "", "mode=budget: run nothing; recompute the summary, "
                        "targets, staleness table and plot of this results JSON (an OUT.json) "
                        "from its stored runs with this code and --report_at_s, "
                        "--budget_thresholds, --sweep_threshold, and write them back.")


def _floats(values) -> List[float]:
    return [float(v) for v in values]


# --- one run of each side ------------------------------------------------------------------------
def _first_train_row(path: str) -> Optional[Dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            if '"kind": "train"' in line:
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    return None
    return None


def run_sao_budget(name: str, extra: List[str], budget_s: float,
                   policy_lr: Optional[float] = None) -> Dict:
    """One SAO run of `budget_s` training seconds; its recorded versions evaluated after it.
    policy_lr: the policy's learning rate (default --sao_policy_lr; 0: the recipe's)."""
    lr = FLAGS.sao_policy_lr if policy_lr is None else policy_lr
    from programs.benchmarks import vs_trl

    run_dir = os.path.join(FLAGS.run_root, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    cmd = [sys.executable, vs_trl.SAO_SCRIPT, *vs_trl.sao_task_flags(), f"--run_dir={run_dir}",
           f"--max_steps={FLAGS.sao_max_steps}", f"--batch_size={FLAGS.rollouts_per_step}",
           f"--eval_every={FLAGS.budget_eval_every}", "--evaluator=record",
           f"--eval_size={FLAGS.eval_size}", f"--seed={FLAGS.task_seed}",
           f"--num_actors={FLAGS.sao_num_actors}", "--launch=local_mp",
           f"--policy_lr={lr}", "--threads_per_process=1", "--progress=false",
           *budget_recipe(), *extra, *FLAGS.sao_extra_flags]
    clock: Dict[str, float] = {}
    verdicts = os.path.join(os.environ.get("SAO_CACHE_DIR", ""), "preflight")
    warm = os.path.isdir(verdicts) and bool(os.listdir(verdicts))   # the start-up cache

    def budget_over() -> bool:
        if "start" not in clock:
            row = _first_train_row(metrics)
            if row is None:
                return False
            clock["start"] = row["time"] - row["wall_time_s"]
        return time.time() > clock["start"] + budget_s

    proc = vs_trl.run_side(cmd, os.path.join(FLAGS.run_root, "logs", f"{name}.log"),
                           progress_file=metrics, stop_when=budget_over)
    if "start" not in clock:
        raise RuntimeError(f"SAO run {run_dir}: no train row before it ended")
    start = clock["start"]
    ev = subprocess.run([sys.executable, EVALUATE_VERSIONS, f"--run_dir={run_dir}",
                         f"--up_to_time={start + budget_s}", "--threads=2"],
                        cwd=REPO, capture_output=True, text=True, env=vs_trl._side_env())
    if ev.returncode != 0:
        raise RuntimeError(f"evaluate_versions on {run_dir} failed:\n{ev.stderr[-3000:]}")
    evals = json.loads(ev.stdout.strip().splitlines()[-1])["evals"]
    rows = vs_trl._read_jsonl(metrics)
    train = sorted((r for r in rows if r.get("kind") == "train" and r["time"] <= start + budget_s),
                   key=lambda r: r["step"])
    published = {0: start, **{r["step"]: r["time"] for r in train}}
    curve = [(round(published[e["policy_version"]] - start, 3), e["eval_accuracy"])
             for e in evals if e["policy_version"] in published]
    pretrain = [r["time"] for r in rows if r.get("kind") == "value_pretrain"]
    last = train[-1] if train else None
    clock_s = (last["time"] - start) if last else 0.0
    tokens = sum(r["response_length_mean"] * r["batch_size"] for r in train)

    def mean_of(key):
        vals = [r[key] for r in train if r.get(key) is not None]
        return round(statistics.fmean(vals), 4) if vals else None

    actors = []   # each actor's last counters (actor.py writes them every second)
    for path in sorted(glob.glob(os.path.join(run_dir, "actor_*_stats.json"))):
        with open(path) as f:
            actors.append(json.load(f))

    return {"side": "sao", "name": name, "curve": curve, "steps": last["step"] if last else 0,
            "rollouts_per_s": (last["rollouts_trained"] / clock_s) if last and clock_s else 0.0,
            "tokens_per_s": tokens / clock_s if clock_s else 0.0,
            "startup_s": round(start - proc["t_launch"], 3), "cpu_s": round(proc["cpu_s"], 2),
            "startup_cache": "warm" if warm else "cold",
            "value_pretrain_s": round(max(pretrain) - start, 3) if pretrain else 0.0,
            "learner_wait_frac": mean_of("learner_wait_frac"),
            "staleness_mean": mean_of("staleness_mean"), "kl_rollout": mean_of("kl_rollout"),
            "masked_frac": mean_of("masked_frac"), "explained_variance": mean_of(
                "explained_variance"), "flags": extra, "policy_lr": lr,
            "num_actors": len(actors),   # where an actor's time went, summed over actors:
            "actor_admission_wait_s": round(sum(a.get("admission_wait_s", 0.0) for a in actors), 2),
            "actor_weight_load_s": round(sum(a.get("weight_load_s", 0.0) for a in actors), 2)}


def budget_recipe() -> List[str]:
    """SAO's flags of the workload for budget mode: `make run-dataset`'s recipe (the critic
    from its checkpoint), not the threshold mode's older one."""
    if FLAGS.workload != "dataset":
        return list(vs_trl_workload()["sao_flags"])
    return ["--actor_batch=16", "--lr_schedule=cosine", "--critic_lr=5e-4",
            "--critic_minibatches=2"]


def vs_trl_workload() -> Dict:
    from programs.benchmarks import vs_trl
    return vs_trl.WORKLOADS[FLAGS.workload]


def critic_flags() -> List[str]:
    path = FLAGS.sao_critic_model
    if path and os.path.exists(os.path.join(REPO, path, "critic_pretrain.json")):
        return [f"--critic_model={path}"]
    return []


def run_trl_budget(name: str, group_size: int, lr: float, seed: int, threads: int,
                   budget_s: float) -> Dict:
    """One TRL run of `budget_s` training seconds (its clock paused while it evaluates)."""
    from programs.benchmarks import vs_trl

    cmd = [FLAGS.trl_python, vs_trl.TRL_SCRIPT, *vs_trl.trl_task_flags(),
           f"--task_seed={FLAGS.task_seed}", f"--seed={seed}", f"--eval_size={FLAGS.eval_size}",
           f"--rollouts_per_step={FLAGS.rollouts_per_step}", f"--num_generations={group_size}",
           f"--learning_rate={lr}", f"--max_steps={FLAGS.trl_max_steps}",
           f"--eval_every={FLAGS.budget_eval_every}", "--threshold=2", "--no-stop_at_threshold",
           f"--time_budget_s={budget_s}", f"--output_dir={os.path.join(FLAGS.run_root, name)}"]
    proc = vs_trl.run_side(cmd, os.path.join(FLAGS.run_root, "logs", f"{name}.log"),
                           threads=threads)
    lines = proc["stdout"].strip().splitlines()
    out = json.loads(lines[-1]) if lines else None
    if not out or out.get("side") != "trl_grpo":
        raise RuntimeError(f"{name}: no result line from {vs_trl.TRL_SCRIPT}")
    curve = [(c["train_clock_s"], c["accuracy"]) for c in out["eval_curve"]]
    return {"side": "trl", "name": name, "curve": curve, "steps": out["steps"],
            "rollouts_per_s": out["rollouts_per_s"], "tokens_per_s": out["tokens_per_s"],
            "startup_s": round(out["train_begin_time"] - proc["t_launch"], 3),
            "cpu_s": round(proc["cpu_s"], 2), "train_s": out["train_clock_s"],
            "group_size": group_size, "learning_rate": lr, "threads": threads, "seed": seed}


def tune_trl_budget() -> Dict:
    """G x lr by budget-mean accuracy over --tune_budget_s (at the largest thread count), then
    the thread count by steps per training second of the winner."""
    threads = sorted({int(t) for t in FLAGS.trl_threads})
    candidates = [(int(g), float(lr)) for g in FLAGS.trl_group_sizes for lr in FLAGS.trl_lrs]
    runs = []
    if len(candidates) > 1:
        for g, lr in candidates:
            r = run_trl_budget(f"tune_trl_G{g}_lr{lr:g}", g, lr, FLAGS.tune_seed, threads[-1],
                               FLAGS.tune_budget_s)
            r["mean_accuracy"] = bc.mean_accuracy(r["curve"], FLAGS.tune_budget_s)
            runs.append(r)
            print(f"tune trl G={g} lr={lr:g}: mean accuracy {r['mean_accuracy']:.3f} over "
                  f"{FLAGS.tune_budget_s:g}s", flush=True)
        best = max(runs, key=lambda r: r["mean_accuracy"])
        g, lr = best["group_size"], best["learning_rate"]
    else:
        g, lr = candidates[0]
    speed = {}
    for t in threads if len(threads) > 1 else []:
        r = run_trl_budget(f"tune_trl_threads{t}", g, lr, FLAGS.tune_seed, t, FLAGS.tune_budget_s)
        speed[t] = r["steps"] / max(r["train_s"], 1e-9)
        print(f"tune trl threads={t}: {speed[t]:.3f} steps/s", flush=True)
    best_threads = max(speed, key=speed.get) if speed else threads[-1]
    return {"group_size": g, "learning_rate": lr, "threads": best_threads,
            "steps_per_s_by_threads": speed,
            "runs": [{k: r[k] for k in ("group_size", "learning_rate", "mean_accuracy", "steps")}
                     for r in runs]}


def tune_sao_budget() -> Dict:
    """SAO's policy learning rate by the protocol TRL's is tuned with: the budget-mean accuracy
    of a --tune_budget_s disaggregated run per --sao_policy_lrs candidate (seed --tune_seed)."""
    candidates = [float(lr) for lr in FLAGS.sao_policy_lrs]
    if len(candidates) < 2:
        return {"policy_lr": candidates[0] if candidates else FLAGS.sao_policy_lr, "runs": []}
    runs = []
    for lr in candidates:
        r = run_sao_budget(f"tune_sao_lr{lr:g}", [DISAGGREGATED, *critic_flags(),
                                                  f"--seed={FLAGS.tune_seed}"],
                           FLAGS.tune_budget_s, policy_lr=lr)
        r["mean_accuracy"] = bc.mean_accuracy(r["curve"], FLAGS.tune_budget_s)
        runs.append(r)
        print(f"tune sao lr={lr:g}: mean accuracy {r['mean_accuracy']:.3f} over "
              f"{FLAGS.tune_budget_s:g}s, {r['steps']} steps", flush=True)
    best = max(runs, key=lambda r: r["mean_accuracy"])
    return {"policy_lr": best["policy_lr"],
            "runs": [{k: r[k] for k in ("policy_lr", "mean_accuracy", "steps")} for r in runs],
            "startup_runs": [{k: r[k] for k in ("startup_s", "startup_cache")} for r in runs]}


# --- the comparison --------------------------------------------------------------------------------
def sao_variants() -> Dict[str, List[str]]:
    variants = {}
    if "shared" in FLAGS.sao_layouts:
        variants["sao_shared"] = critic_flags()
    if "disaggregated" in FLAGS.sao_layouts:
        variants["sao_disaggregated"] = [DISAGGREGATED, *critic_flags()]
    if FLAGS.sao_pretrain_in_clock and FLAGS.workload == "dataset":
        variants["sao_pretrain_in_clock"] = [
            DISAGGREGATED, f"--value_pretrain_rollouts={FLAGS.sao_pretrain_rollouts}"]
    return variants


def side_metrics(run: Dict, budget_s: float, report_at: List[float],
                 thresholds: List[float]) -> Dict:
    return {**bc.curve_metrics(run["curve"], budget_s, report_at, thresholds),
            **{k: run.get(k) for k in ("rollouts_per_s", "tokens_per_s", "startup_s", "cpu_s",
                                       "steps", "value_pretrain_s")}}


def metric_keys(report_at: List[float], thresholds: List[float]) -> List[str]:
    return ([f"accuracy_at_{t:g}s" for t in report_at] + ["mean_accuracy"]
            + [f"time_to_{a:g}_s" for a in thresholds]
            + [f"held_time_to_{a:g}_s" for a in thresholds]
            + ["rollouts_per_s", "tokens_per_s", "startup_s", "cpu_s", "steps",
               "value_pretrain_s"])


def summarize_budget(sides: Dict[str, List[Dict]], budget_s: float, report_at: List[float],
                     thresholds: List[float]) -> Dict:
    """Per side, the spread of each metric over its repeats; the targets of SAO disaggregated
    against TRL (accuracy at 5 and 10 minutes >= TRL's, time to 0.6 <= 0.5x TRL's; a target
    whose figure is not reported is left out)."""
    keys = metric_keys(report_at, thresholds)
    per = {s: bc.aggregate_runs([side_metrics(r, budget_s, report_at, thresholds)
                                 for r in runs], keys) for s, runs in sides.items()}
    targets = {}
    if "sao_disaggregated" in per and "trl" in per:
        ours, theirs = per["sao_disaggregated"], per["trl"]
        for t in (300.0, 600.0):
            key = f"accuracy_at_{t:g}s"
            if key in ours and ours[key]["median"] is not None and theirs[key]["median"] is not None:
                targets[f"accuracy_at_{t:g}s_ge_trl"] = {
                    "met": ours[key]["median"] >= theirs[key]["median"],
                    "by": round(ours[key]["median"] - theirs[key]["median"], 4)}
        a, b = ours["startup_s"]["median"], theirs["startup_s"]["median"]
        if a is not None and b:
            targets["startup_le_1.5x_trl"] = {"met": a <= 1.5 * b, "ratio": round(a / b, 4)}
        for key in ("time_to_0.6_s", "held_time_to_0.6_s"):
            if key in ours:
                a, b = ours[key]["median"], theirs[key]["median"]
                targets[f"{key[:-2]}_le_half_trl"] = {
                    "met": a is not None and (b is None or a <= 0.5 * b),
                    "ratio": round(a / b, 4) if a is not None and b else None}
    return {"summary": per, "targets": targets}


def cold_startup(runs: List[Dict]) -> Optional[float]:
    """The start-up of the SAO run that found the start-up cache empty (the invocation's
    first), or None when every run found it filled."""
    cold = [r["startup_s"] for r in runs if r.get("startup_cache") == "cold"]
    return cold[0] if cold else None


def sweep_rows(runs: Dict[str, Dict], budget_s: float, threshold: float) -> List[Dict]:
    base = runs.get("lockstep")
    rows = []
    for setting, r in runs.items():
        rows.append({"setting": setting, "rollouts_per_s": round(r["rollouts_per_s"], 3),
                     "throughput_vs_lockstep": round(r["rollouts_per_s"] / base["rollouts_per_s"], 3)
                     if base and base["rollouts_per_s"] else None,
                     "learner_wait_frac": r["learner_wait_frac"],
                     f"time_to_{threshold:g}_s": bc.time_to(r["curve"], threshold, budget_s),
                     "accuracy_at_budget": bc.accuracy_at(r["curve"], budget_s),
                     "staleness_mean": r["staleness_mean"], "kl_rollout": r["kl_rollout"],
                     "masked_frac": r["masked_frac"],
                     # fractions of the actors' budget: waiting for admission (the staleness
                     # limit, lock-step), putting new versions into the engine
                     "actor_admission_wait_frac": _actor_frac(r, "actor_admission_wait_s",
                                                              budget_s),
                     "actor_weight_load_frac": _actor_frac(r, "actor_weight_load_s", budget_s)})
    return rows


def _actor_frac(run: Dict, key: str, budget_s: float) -> Optional[float]:
    if run.get(key) is None or not run.get("num_actors"):
        return None
    return round(run[key] / (budget_s * run["num_actors"]), 4)


def table_text(result: Dict) -> str:
    per = result["summary"]
    lines = [f"{'':34}" + "".join(f"{s:>26}" for s in per)]
    for key in next(iter(per.values())):
        cells = []
        for s in per:
            st = per[s][key]
            if st["median"] is None:
                cells.append("not reached" if key.startswith("time_to") else "-")
            else:
                cells.append(f"{st['median']:.3f} [{st['min']:.3f}, "
                             + ("inf" if st["max"] is None else f"{st['max']:.3f}") + "]")
        lines.append(f"{key:34}" + "".join(f"{c:>26}" for c in cells))
    for name, t in result["targets"].items():
        lines.append(f"target {name}: {'met' if t['met'] else 'NOT met'} ({t})")
    return "\n".join(lines)


def plot(sides: Dict[str, List[Dict]], sweep: List[Dict], budget_s: float, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [budget_s * i / 200 for i in range(201)]
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 7, 4.5))
    ax = axes[0] if sweep else axes
    for side, runs in sides.items():
        band = bc.median_curve([r["curve"] for r in runs], grid)
        xs = [g / 60 for g, m in zip(grid, band["median"]) if m is not None]
        keep = [i for i, m in enumerate(band["median"]) if m is not None]
        ax.step(xs, [band["median"][i] for i in keep], where="post", label=side)
        ax.fill_between(xs, [band["min"][i] for i in keep], [band["max"][i] for i in keep],
                        step="post", alpha=0.2)
    ax.set_xlabel("training clock (minutes, evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    if sweep:
        ax2 = axes[1]
        xs = [r["kl_rollout"] or 0.0 for r in sweep]
        ys = [r["rollouts_per_s"] for r in sweep]
        ax2.plot(xs, ys, "o-")
        for r, x, y in zip(sweep, xs, ys):
            ax2.annotate(r["setting"], (x, y))
        ax2.set_xlabel("mean KL(rollout policy || current)")
        ax2.set_ylabel("rollouts/s trained")
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resummarize(path: str, report_at: List[float], thresholds: List[float],
                sweep_threshold: float) -> Dict:
    """--resummarize: the figures of a stored run recomputed (new metrics, other thresholds)."""
    with open(path) as f:
        result = json.load(f)
    budget = float(result["budget_s"])
    result.update(summarize_budget(result["runs"], budget, report_at, thresholds))
    result["staleness_sweep"] = sweep_rows(result.get("sweep_runs") or {},
                                           float(result.get("sweep_budget_s") or budget),
                                           sweep_threshold)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plot(result["runs"], result["staleness_sweep"], budget, path[:-len(".json")] + ".png")
    print(table_text(result))
    for row in result["staleness_sweep"]:
        print("staleness " + json.dumps(row))
    return result


def main_budget() -> Dict:
    if FLAGS.resummarize:
        if not FLAGS.resummarize.endswith(".json"):
            raise SystemExit(f"--resummarize={FLAGS.resummarize}: a results .json")
        return resummarize(os.path.join(REPO, FLAGS.resummarize), _floats(FLAGS.report_at_s),
                           _floats(FLAGS.budget_thresholds), FLAGS.sweep_threshold)
    t0, load_start = time.time(), os.getloadavg()
    # SAO's start-up cache (disk_cache.py) is this invocation's, empty at first: its first SAO
    # run starts cold (reported as sao_cold_startup_s), later ones reuse what it wrote.
    cache = os.path.join(REPO, FLAGS.run_root, "startup_cache")
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["SAO_CACHE_DIR"] = cache
    budget = FLAGS.budget_s
    report_at, thresholds = _floats(FLAGS.report_at_s), _floats(FLAGS.budget_thresholds)
    tuned = tune_trl_budget()
    print(f"TRL: G={tuned['group_size']}, lr={tuned['learning_rate']:g}, "
          f"threads={tuned['threads']}", flush=True)
    sao_tuned = tune_sao_budget()
    sao_lr = sao_tuned["policy_lr"]
    print(f"SAO: policy lr {sao_lr:g} (0: the recipe's)", flush=True)
    variants = sao_variants()
    sides: Dict[str, List[Dict]] = {"trl": [], **{v: [] for v in variants}}
    for i in range(FLAGS.repeats):   # interleaved
        sides["trl"].append(run_trl_budget(f"trl_{i}", tuned["group_size"],
                                           tuned["learning_rate"], i, tuned["threads"], budget))
        for v, extra in variants.items():
            sides[v].append(run_sao_budget(f"{v}_{i}", extra, budget, policy_lr=sao_lr))
        for side, runs in sides.items():
            m = side_metrics(runs[-1], budget, report_at, thresholds)
            print(f"repeat {i} {side}: mean accuracy {m['mean_accuracy']:.3f}, final "
                  f"{bc.accuracy_at(runs[-1]['curve'], budget)}, {runs[-1]['steps']} steps",
                  flush=True)
    sweep_runs = {}
    sweep_budget = FLAGS.sweep_budget_s or budget
    for setting in FLAGS.staleness_sweep:
        flag = "--lockstep" if setting == "lockstep" else f"--max_staleness={int(setting)}"
        sweep_runs[setting] = run_sao_budget(f"sweep_{setting}", [DISAGGREGATED, flag,
                                                                   *critic_flags()],
                                             sweep_budget, policy_lr=sao_lr)
    sweep = sweep_rows(sweep_runs, sweep_budget, FLAGS.sweep_threshold)
    result = {"benchmark": "vs_trl", "mode": "budget", "workload": FLAGS.workload,
              "budget_s": budget, "repeats": FLAGS.repeats, "eval_size": FLAGS.eval_size,
              "eval_every_steps": FLAGS.budget_eval_every,
              "rollouts_per_step": FLAGS.rollouts_per_step, "trl_tuned": tuned,
              "sao_tuned": sao_tuned, "sweep_budget_s": sweep_budget,
              "sao_variants": variants, "sao_recipe": budget_recipe(),
              **summarize_budget(sides, budget, report_at, thresholds),
              "staleness_sweep": sweep, "sao_cold_startup_s": cold_startup(   # the first SAO run
                  sao_tuned.get("startup_runs", []) + [r for runs in sides.values() for r in runs]
                  + list(sweep_runs.values())),
              "runs": {s: runs for s, runs in sides.items()},
              "sweep_runs": sweep_runs, "load_avg_start": list(load_start),
              "load_avg_end": list(os.getloadavg()), "wall_s": round(time.time() - t0, 1)}
    print(f"\nbudget {budget:g}s of training each; median [min, max] of {FLAGS.repeats} "
          f"interleaved repeats; load average {load_start[0]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")
    print(table_text(result))
    for row in sweep:
        print("staleness " + json.dumps(row))
    if FLAGS.out:
        out = os.path.join(REPO, FLAGS.out)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        plot(sides, sweep, budget, out + ".png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "sweep_runs")}))
    return result
