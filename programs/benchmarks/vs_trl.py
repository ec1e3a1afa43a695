r"""Benchmark 1: this project (SAO) against a peer, TRL's GRPOTrainer, on the same task.

  make trl-env
  OMP_NUM_THREADS=1 .venv/bin/python programs/benchmarks/vs_trl.py --threshold=0.9 --repeats=3
  make warm-start-dataset
  OMP_NUM_THREADS=1 .venv/bin/python programs/benchmarks/vs_trl.py --workload=dataset \
      --threshold=0.5 --eval_every=5 --sao_max_steps=100 --trl_lrs=5e-5,2e-4 --trl_group_sizes=4,8

Two workloads (--workload; WORKLOADS below has each one's warm start, completion length and
SAO recipe):
  arithmetic  the char-level sums task from checkpoints/warm_start (greedy held-out accuracy
              0.355), 8-token completions, SAO with `make run`'s settings.
  dataset     the GSM8K-style parquet files of `make run-dataset` from
              checkpoints/warm_start_dataset (a Qwen3-shaped model with a BPE tokenizer and chat
              template), the gsm8k reward, 96-token completions, SAO with `make run-dataset`'s
              recipe before the critic fix (cosine policy lr 2e-4, critic lr 2e-4, value
              pretraining of 1,280 rollouts inside the clock; the value-pretrained critic of
              `make run-dataset` now is not used here yet).
Both sides train on the task's training prompts and are scored on the same --eval_size held-out
prompts with the same greedy evaluation (max_new_tokens tokens, the task's is_correct) every
--eval_every steps and at step 0. Each runs in its own process with OMP_NUM_THREADS=1:

  sao        programs/sao.py (run_program(make_program(config))) from this venv: the default
             program (local_mp launcher, the recipe's actors, learner, evaluator, replay,
             variable server), --rollouts_per_step rollouts a step, one per prompt.
  trl        programs/benchmarks/trl_grpo.py with .venv-trl/bin/python: GRPOTrainer
             (TRL's default, on-policy: one generation batch per optimizer step) with the same
             number of rollouts a step, as prompts x G (GRPO refuses G=1): 32 = 16 x 2 or 8 x 4...
  trl_same_prompts  (--trl_same_prompts_variant) TRL with as many prompts a step as SAO (32), so
             32 x G rollouts a step: more samples per step for TRL.

Fairness: same sampling (temperature 1, top_p 1, the workload's max_new_tokens), fp32,
grad-norm clip 1.0. SAO keeps the workload's recipe (arithmetic: policy_lr 5e-5 constant, the
critic and DIS loss of `make run`; dataset: `make run-dataset`'s, whose value pretraining runs
inside SAO's training clock and is reported as value_pretrain_s). TRL (constant lr) gets its
learning rate and G tuned first: every (G, lr) of --trl_group_sizes x --trl_lrs runs once (seed
--tune_seed, --tune_budget_s of training); the one that reaches the threshold soonest (training
clock) is measured. A grid of one is not tuned.

Clocks (evaluation excluded on both sides):
  time to threshold  from the start of training to the moment the first policy that scored
             >= --threshold existed. TRL: trainer.train() start to the end of that step, with the
             clock paused while evaluating (inline, in a callback). SAO: the learner's start (it
             publishes version 0, actors start) to the learner publishing that version; SAO's
             evaluator is its own process, so it adds no time but its CPU use, which competes
             for the same cores, stays in SAO's clock. SAO's evaluator evaluates the newest
             version when due, so under load it may skip to a later version than TRL would.
  incl. start-up  the same moment measured from the subprocess launch (imports, model loading,
             SAO's process launch, Reverb and gRPC start-up included).
  rollouts/s, tokens/s  rollouts trained and their generated (completion) tokens, <eos>
             included, per second of training clock over each side's whole run.
  cpu_s      CPU seconds of the side's whole process tree (RUSAGE_CHILDREN).

The sides run interleaved (sao, trl, trl_same_prompts, sao, ...) --repeats times; medians and
[min, max] are reported. SAO varies by its asynchrony (its task seed must stay the warm start's,
0); TRL's training seed is the repeat index. TRL stops at the threshold or after
--trl_time_budget_s of training ("not reached within X s"); SAO runs --sao_max_steps steps.
The target: SAO's median time to threshold <= 1/3 of TRL's. Ends with one JSON line.

Ratios (ratio_sao_over_trl, SAO's median time over the other side's) are
{"value", "bound", "reason"} and never an error: value is the ratio when both sides reached the
threshold after 0 s; a side that did not reach it, or the other side reaching it at 0 s (its
step-0 evaluation already meets the threshold: no finite ratio), gives value null with the
reason, plus an upper bound from TRL's budget when only TRL did not reach it. A threshold the
warm start already meets makes the comparison vacuous (target_note says so).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:   # programs.benchmarks.vs_trl_budget, run as a script
    sys.path.insert(0, REPO)
TRL_SCRIPT = os.path.join(REPO, "programs", "benchmarks", "trl_grpo.py")
SAO_SCRIPT = os.path.join(REPO, "programs", "sao.py")

GSM_TINY = "data/gsm_tiny"
# Per workload: the shared warm start, the completion length, and SAO's recipe (the flags of
# `make run` / `make run-dataset`: the project's settings for that task, not tuned here).
WORKLOADS = {
    "arithmetic": {"init_checkpoint": "checkpoints/warm_start", "max_new_tokens": 8,
                   "sao_policy_lr": 5e-5, "sao_num_actors": 2, "sao_flags": []},
    "dataset": {"init_checkpoint": "checkpoints/warm_start_dataset", "max_new_tokens": 96,
                "max_sequence_length": 512, "sao_policy_lr": 2e-4, "sao_num_actors": 1,
                "sao_flags": ["--actor_batch=16", "--lr_schedule=cosine", "--critic_lr=2e-4",
                              "--value_pretrain_rollouts=1280"]},
}

FLAGS = flags.FLAGS


def define_flags() -> None:
    from programs.benchmarks.vs_trl_budget import define_budget_flags
    define_budget_flags()
    flags.DEFINE_enum("mode", "threshold", ["threshold", "budget"], "threshold: time to "
                      "--threshold (below); budget: equal wall-clock budgets, accuracy-vs-time "
                      "curves (programs/benchmarks/vs_trl_budget.py).")
    """The command-line flags (defined only when run as a script: importing the module for its
    pure functions defines nothing)."""
    flags.DEFINE_float("threshold", 0.9, "Held-out greedy accuracy to reach.")
    flags.DEFINE_list("also_thresholds", ["0.8"], "Lower thresholds also timed, from the same "
                      "evaluation curves (TRL stops at --threshold, so they must be below it).")
    flags.DEFINE_integer("eval_every", 5,
                         "Both sides evaluate every this many steps (and at 0).")
    flags.DEFINE_integer("eval_size", 200, "Held-out prompts.")
    flags.DEFINE_integer("rollouts_per_step", 32, "Rollouts per optimizer step, both sides.")
    flags.DEFINE_integer("repeats", 3, "Interleaved repeats of each side.")
    flags.DEFINE_enum("workload", "arithmetic", list(WORKLOADS), "arithmetic: the char-level "
                      "sums task (3-token answers); dataset: the GSM8K-style files of "
                      "`make run-dataset` (BPE tokenizer, Qwen3-shaped model, tens to about a "
                      "hundred generated tokens).")
    flags.DEFINE_string("init_checkpoint", "", "The shared warm start (default: the "
                        "workload's, see WORKLOADS).")
    flags.DEFINE_integer("max_new_tokens", 0, "Generated tokens per completion, both sides "
                         "(default: the workload's).")
    flags.DEFINE_list("train_files", [f"{GSM_TINY}/train.parquet"],
                      "dataset workload: training files.")
    flags.DEFINE_list("eval_files", [f"{GSM_TINY}/test.parquet"],
                      "dataset workload: held-out files.")
    flags.DEFINE_string("reward", "gsm8k", "dataset workload: the reward (a builtin).")
    flags.DEFINE_integer("task_seed", 0,
                         "The task's split seed (the warm start's; SAO's --seed).")
    flags.DEFINE_string("run_root", "runs/bench_vs_trl",
                        "Run folders of both sides go under here.")
    # SAO
    flags.DEFINE_integer("sao_max_steps", 60, "SAO learner steps per run.")
    flags.DEFINE_integer("sao_num_actors", 0, "SAO actors (default: the workload's recipe).")
    flags.DEFINE_string("sao_launch", "local_mp", "SAO launcher.")
    flags.DEFINE_float("sao_policy_lr", 0.0, "SAO policy learning rate (default: the "
                       "workload's recipe, see WORKLOADS).")
    flags.DEFINE_list("sao_extra_flags", [], "More programs/sao.py flags, e.g. "
                      "--sao_extra_flags=--critic_updates=1.")
    # TRL
    flags.DEFINE_string("trl_python", ".venv-trl/bin/python", "The TRL environment's python.")
    flags.DEFINE_list("trl_group_sizes", ["2", "4", "8"], "GRPO group sizes G to tune over.")
    flags.DEFINE_list("trl_lrs", ["3e-5", "5e-5", "1e-4"], "TRL learning rates to tune over "
                      "(2e-4 and 1e-3 diverged in every trial).")
    flags.DEFINE_float("tune_budget_s", 15.0, "Training seconds of each TRL tuning run.")
    flags.DEFINE_integer("tune_seed", 100, "TRL training seed of the tuning runs.")
    flags.DEFINE_float("trl_time_budget_s", 60.0, "Training seconds (evaluation excluded) after "
                       "which a TRL run stops: 'not reached within X s'.")
    flags.DEFINE_integer("trl_max_steps", 2000, "Step cap of a TRL run.")
    flags.DEFINE_bool("trl_same_prompts_variant", True, "Also run TRL with SAO's prompts per "
                      "step (rollouts_per_step prompts x G).")
    flags.DEFINE_float("subprocess_timeout_s", 900.0,
                       "A side's process running longer is an error.")
    flags.DEFINE_float("stall_timeout_s", 180.0, "An SAO run whose metrics.jsonl does not grow "
                       "for this long (start-up included) is killed as stalled.")


def _side_env(threads: int = 1) -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}


def session_cpu_s(sid: int) -> float:
    """CPU seconds (user + system, with reaped children) of the live processes of session
    `sid`, from /proc (for runs killed whole: their nodes are never reaped by this process)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()   # from field 3 (state) on
        if int(fields[3]) == sid:
            total += sum(int(x) for x in fields[11:15])   # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


def run_side(cmd: List[str], log_path: str, progress_file: Optional[str] = None,
             on_tick: Optional[Callable[[int], None]] = None,
             stop_when: Optional[Callable[[], bool]] = None, threads: int = 1) -> Dict:
    """Runs one side's process (its own session, so a stuck run is killed whole); returns its
    stdout, launch time, wall and CPU seconds. With `progress_file`, a run whose file has not
    grown for --stall_timeout_s is killed and reported as stalled. `on_tick(pid)` is called
    every 0.5 s while it runs (pid: the process, also its session's id). `stop_when()` true
    ends the run (its whole session killed; a time budget spent: not an error; its CPU seconds
    then come from /proc). `threads`: the side's OMP/MKL thread count."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t_launch = time.time()
    stalled = stopped = False
    session_cpu = 0.0
    with open(log_path, "w") as log, open(log_path + ".stdout", "w+") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_side_env(threads), stdout=out, stderr=log,
                                text=True, start_new_session=True)
        last_size, last_change = -1, time.time()
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                if on_tick is not None:
                    on_tick(proc.pid)
                if stop_when is not None:
                    session_cpu = max(session_cpu, session_cpu_s(proc.pid))
                    if stop_when():
                        stopped = True
                        break
                now = time.time()
                if progress_file is not None:
                    size = os.path.getsize(progress_file) if os.path.exists(progress_file) else 0
                    if size != last_size:
                        last_size, last_change = size, now
                    stalled = now - last_change > FLAGS.stall_timeout_s
                if stalled or now - t_launch > FLAGS.subprocess_timeout_s:
                    break
        finally:   # stalled, too slow, or this process interrupted: the side's whole tree goes
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        stdout = out.read()
    wall = time.time() - t_launch
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0 and not stopped:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        why = (f"made no progress ({progress_file} unchanged) for {FLAGS.stall_timeout_s:g}s"
               if stalled else f"exited {proc.returncode} after {wall:.0f}s")
        raise RuntimeError(f"{' '.join(cmd[:2])} {why}; log {log_path}:\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"stdout": stdout, "t_launch": t_launch, "wall_s": wall,
            "cpu_s": max(cpu, session_cpu) if stopped else cpu, "stopped": stopped}


def _read_jsonl(path: str) -> List[Dict]:
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _first_reached(curve: List[Dict], threshold: float) -> Optional[Dict]:
    for point in curve:
        if point["accuracy"] >= threshold:
            return point
    return None


def sao_task_flags() -> List[str]:
    """programs/sao.py's flags for the workload's task, model and completion length."""
    if FLAGS.workload == "arithmetic":
        return ["--task=arithmetic", f"--init_checkpoint={FLAGS.init_checkpoint}",
                f"--max_new_tokens={FLAGS.max_new_tokens}"]
    return ["--task=dataset", f"--model={FLAGS.init_checkpoint}",
            f"--train_files={','.join(FLAGS.train_files)}",
            f"--eval_files={','.join(FLAGS.eval_files)}", f"--reward={FLAGS.reward}",
            f"--max_new_tokens={FLAGS.max_new_tokens}",
            f"--max_sequence_length={WORKLOADS['dataset']['max_sequence_length']}"]


def trl_task_flags() -> List[str]:
    """trl_grpo.py's flags for the same task, model, prompts and completion length."""
    out = [f"--workload={FLAGS.workload}", f"--init_checkpoint={FLAGS.init_checkpoint}",
           f"--max_new_tokens={FLAGS.max_new_tokens}"]
    if FLAGS.workload == "dataset":
        max_prompt = WORKLOADS["dataset"]["max_sequence_length"] - FLAGS.max_new_tokens
        out += ["--train_files", *FLAGS.train_files, "--eval_files", *FLAGS.eval_files,
                f"--reward={FLAGS.reward}", f"--max_prompt_length={max_prompt}"]
    return out


def run_sao(name: str) -> Dict:
    """One SAO run (programs/sao.py); its figures from metrics.jsonl and summary.json."""
    run_dir = os.path.join(FLAGS.run_root, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, SAO_SCRIPT, *sao_task_flags(),
           f"--run_dir={run_dir}", f"--max_steps={FLAGS.sao_max_steps}",
           f"--batch_size={FLAGS.rollouts_per_step}", f"--eval_every={FLAGS.eval_every}",
           f"--eval_size={FLAGS.eval_size}", f"--seed={FLAGS.task_seed}",
           f"--num_actors={FLAGS.sao_num_actors}", f"--launch={FLAGS.sao_launch}",
           f"--policy_lr={FLAGS.sao_policy_lr}", "--threads_per_process=1", "--progress=false",
           *WORKLOADS[FLAGS.workload]["sao_flags"], *FLAGS.sao_extra_flags]
    proc = run_side(cmd, os.path.join(FLAGS.run_root, "logs", f"{name}.log"),
                    progress_file=os.path.join(run_dir, "metrics.jsonl"))
    rows = _read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    train = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])
    evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["policy_version"])
    if not train or not evals:
        raise RuntimeError(f"SAO run {run_dir}: no train or eval rows in metrics.jsonl")
    learner_start = train[0]["time"] - train[0]["wall_time_s"]
    published = {0: learner_start, **{r["step"]: r["time"] for r in train}}
    curve = []
    for e in evals:
        v = e["policy_version"]
        t = published.get(v, e["time"])
        curve.append({"step": v, "accuracy": e["eval_accuracy"],
                      "train_clock_s": round(t - learner_start, 3),
                      "since_launch_s": round(t - proc["t_launch"], 3),
                      "eval_done_s": round(e["time"] - learner_start, 3),
                      "rollouts": v * FLAGS.rollouts_per_step})
    train_s = train[-1]["time"] - learner_start
    pretrain = [r["time"] for r in rows if r.get("kind") == "value_pretrain"]
    tokens = sum(r["response_length_mean"] * r["batch_size"] for r in train)
    rollouts = train[-1]["rollouts_trained"]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return _side_result("sao", name, curve, FLAGS.threshold, FLAGS.also_thresholds,
                        steps=train[-1]["step"], train_s=train_s,
                        rollouts=rollouts, tokens=tokens, proc=proc,
                        startup_s=learner_start - proc["t_launch"],
                        extra={"rollouts_generated": summary.get("rollouts_generated"),
                               # the critic's pretraining before policy step 1, inside the
                               # training clock (0 without --value_pretrain_rollouts)
                               "value_pretrain_s": round(max(pretrain) - learner_start, 3)
                               if pretrain else 0.0,
                               "learner_step_s_median": round(statistics.median(
                                   r["step_time_s"] for r in train), 4),
                               "learner_wait_frac_median": round(statistics.median(
                                   r["learner_wait_frac"] for r in train), 3),
                               "staleness_mean": summary.get("staleness_mean"),
                               "policy_lr": FLAGS.sao_policy_lr,
                               "prompts_per_step": FLAGS.rollouts_per_step,
                               "rollouts_per_step": FLAGS.rollouts_per_step})


def run_trl(name: str, group_size: int, lr: float, seed: int, budget_s: float,
            prompts_per_step: Optional[int] = None) -> Dict:
    """One TRL GRPOTrainer run (trl_grpo.py in the TRL venv)."""
    rollouts_per_step = (prompts_per_step * group_size if prompts_per_step
                         else FLAGS.rollouts_per_step)
    cmd = [FLAGS.trl_python, TRL_SCRIPT, *trl_task_flags(),
           f"--task_seed={FLAGS.task_seed}", f"--seed={seed}", f"--eval_size={FLAGS.eval_size}",
           f"--rollouts_per_step={rollouts_per_step}", f"--num_generations={group_size}",
           f"--learning_rate={lr}", f"--max_steps={FLAGS.trl_max_steps}",
           f"--eval_every={FLAGS.eval_every}", f"--threshold={FLAGS.threshold}",
           f"--time_budget_s={budget_s}", "--stop_at_threshold",
           f"--output_dir={os.path.join(FLAGS.run_root, name)}"]
    proc = run_side(cmd, os.path.join(FLAGS.run_root, "logs", f"{name}.log"))
    lines = proc["stdout"].strip().splitlines()
    out = json.loads(lines[-1]) if lines else None
    if not out or out.get("side") != "trl_grpo":
        raise RuntimeError(f"{name}: no result line from {TRL_SCRIPT}; see "
                           f"{FLAGS.run_root}/logs/{name}.log")
    curve = [{"step": c["step"], "accuracy": c["accuracy"], "train_clock_s": c["train_clock_s"],
              "since_launch_s": round(c["time"] - proc["t_launch"], 3),
              "rollouts": c["rollouts"]} for c in out["eval_curve"]]
    return _side_result("trl", name, curve, FLAGS.threshold, FLAGS.also_thresholds,
                        steps=out["steps"], train_s=out["train_clock_s"],
                        rollouts=out["rollouts"], tokens=out["completion_tokens"], proc=proc,
                        startup_s=out["train_begin_time"] - proc["t_launch"],
                        extra={"group_size": group_size, "learning_rate": lr, "seed": seed,
                               "prompts_per_step": rollouts_per_step // group_size,
                               "rollouts_per_step": rollouts_per_step,
                               "time_budget_s": budget_s, "stopped_by": out["stopped_by"],
                               "step_s_mean": round(out["train_clock_s"] / max(out["steps"], 1), 4),
                               "trl_version": out["versions"]["trl"]})


def _side_result(side, name, curve, threshold, also_thresholds, steps, train_s, rollouts, tokens,
                 proc, startup_s, extra):
    hit = _first_reached(curve, threshold)
    also = {}
    for t in also_thresholds:
        h = _first_reached(curve, float(t))
        also[f"time_to_{float(t):g}_s"] = h["train_clock_s"] if h else None
        also[f"time_to_{float(t):g}_incl_startup_s"] = h["since_launch_s"] if h else None
        also[f"steps_to_{float(t):g}"] = h["step"] if h else None
    return {
        "side": side, "name": name, "reached": hit is not None,
        "time_to_threshold_s": hit["train_clock_s"] if hit else None,
        "time_to_threshold_incl_startup_s": hit["since_launch_s"] if hit else None,
        "steps_to_threshold": hit["step"] if hit else None,
        "rollouts_to_threshold": hit["rollouts"] if hit else None,
        "initial_accuracy": curve[0]["accuracy"], "final_accuracy": curve[-1]["accuracy"],
        "best_accuracy": max(c["accuracy"] for c in curve),
        "steps": steps, "train_s": round(train_s, 3), "rollouts": rollouts,
        "step_s": round(train_s / max(steps, 1), 4),
        "completion_tokens": int(tokens),
        "rollouts_per_s": rollouts / max(train_s, 1e-9),
        "tokens_per_s": tokens / max(train_s, 1e-9),
        "startup_s": round(startup_s, 3), "total_wall_s": round(proc["wall_s"], 3),
        "cpu_s": round(proc["cpu_s"], 2), **also, "eval_curve": curve, **extra,
    }


def tune_trl() -> Dict:
    """Each (G, lr) once on a short budget; the soonest to the threshold (training clock) wins,
    then the best accuracy reached. A single candidate is returned untried."""
    candidates = [(int(g), float(lr)) for g in FLAGS.trl_group_sizes for lr in FLAGS.trl_lrs]
    for g, _ in candidates:
        if g < 2 or FLAGS.rollouts_per_step % g:
            raise app.UsageError(f"--trl_group_sizes has {g}: each G must be >= 2 (GRPO) and "
                                 f"divide --rollouts_per_step={FLAGS.rollouts_per_step}")
    if len(candidates) == 1:
        return {"group_size": candidates[0][0], "learning_rate": candidates[0][1], "runs": []}
    runs = []
    for g, lr in candidates:
        r = run_trl(f"tune_trl_G{g}_lr{lr:g}", g, lr, FLAGS.tune_seed, FLAGS.tune_budget_s)
        runs.append(r)
        print(f"tune trl G={g} lr={lr:g}: "
              + (f"reached {FLAGS.threshold} at step {r['steps_to_threshold']} in "
                 f"{r['time_to_threshold_s']:.2f}s" if r["reached"] else
                 f"not reached in {r['train_s']:.1f}s (best {r['best_accuracy']:.3f})"), flush=True)

    def key(r):
        return (0, r["time_to_threshold_s"], 0) if r["reached"] else (1, 0, -r["best_accuracy"])

    best = min(runs, key=key)
    return {"group_size": best["group_size"], "learning_rate": best["learning_rate"],
            "runs": [{k: r[k] for k in ("group_size", "learning_rate", "reached",
                                        "time_to_threshold_s", "steps_to_threshold",
                                        "best_accuracy", "final_accuracy", "steps", "train_s")}
                     for r in runs]}


def _stats(values: List[Optional[float]]) -> Dict:
    """median, min, max of values, None counting as 'not reached' (+inf)."""
    vals = [float("inf") if v is None else float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None}
    med = statistics.median(vals)

    def clean(x):
        return None if x == float("inf") else round(x, 4)

    return {"median": clean(med), "min": clean(min(vals)), "max": clean(max(vals))}


def _also_keys(also_thresholds) -> List[str]:
    return [f"{k}_{float(t):g}{s}" for t in also_thresholds
            for k, s in (("time_to", "_s"), ("time_to", "_incl_startup_s"), ("steps_to", ""))]


def aggregate(runs: List[Dict], also_thresholds=()) -> Dict:
    out = {"repeats": len(runs), "reached": sum(r["reached"] for r in runs)}
    for key in ("time_to_threshold_s", "time_to_threshold_incl_startup_s", "steps_to_threshold",
                "rollouts_to_threshold", "rollouts_per_s", "tokens_per_s", "startup_s",
                "final_accuracy", "best_accuracy", "initial_accuracy", "cpu_s", "train_s",
                "steps", "step_s", *_also_keys(also_thresholds)):
        out[key] = _stats([r[key] for r in runs])
    return out


def _ratio(ours: Optional[float], theirs: Optional[float],
           theirs_bound: Optional[float]) -> Dict:
    """SAO's time over the other side's, as {"value", "bound", "reason"}; never raises.

      both reached, theirs > 0    value ours / theirs (4 decimals); bound and reason None.
      theirs not reached          value None; bound "< ours / theirs_bound" (theirs would have
                                  needed more than its budget), or None without a positive
                                  budget; reason says so.
      theirs reached at 0 s       value None, bound None: no finite ratio (its step-0
                                  evaluation already met the threshold); reason says so.
      ours not reached            value None, bound None; reason says so.
    """
    if ours is None:
        why = ("neither side reached the threshold" if theirs is None
               else "SAO did not reach the threshold")
        return {"value": None, "bound": None, "reason": why}
    if theirs is None:
        if theirs_bound is None or theirs_bound <= 0:
            return {"value": None, "bound": None,
                    "reason": "TRL did not reach the threshold (no budget to bound it with)"}
        return {"value": None, "bound": f"< {ours / theirs_bound:.3f}",
                "reason": f"TRL did not reach the threshold within {theirs_bound:g} s"}
    if theirs <= 0:
        why = ("both sides reached the threshold at 0 s (their step-0 evaluations)" if ours <= 0
               else "TRL reached the threshold at 0 s (its step-0 evaluation)")
        return {"value": None, "bound": None, "reason": why}
    return {"value": round(ours / theirs, 4), "bound": None, "reason": None}


def _ratio_text(r: Dict) -> str:
    if r["value"] is not None:
        return f"{r['value']}"
    return f"{r['bound']} ({r['reason']})" if r["bound"] else f"n/a ({r['reason']})"


def target_met(ours: Optional[float], theirs: Optional[float], budget: float,
               target: float = 1 / 3) -> bool:
    """SAO's time to threshold <= target x TRL's (no division). TRL not reached: SAO within
    target x TRL's budget. SAO not reached: not met. Both at 0 s (the warm start already meets
    the threshold) is met, vacuously: 0 <= 0; the JSON's target_note says so."""
    if ours is None:
        return False
    return ours <= target * (budget if theirs is None else theirs)


def summarize(sides: Dict[str, List[Dict]], budget: float, also_thresholds=()) -> Dict:
    """Aggregates of each side, ratios of SAO over every other side, and the target (SAO vs
    "trl"); pure: any mix of reached at step 0, later or never."""
    agg = {side: aggregate(runs, also_thresholds) for side, runs in sides.items()}
    ratios = {}
    for other in [s for s in sides if s != "sao"]:
        ratios[other] = {
            "time_to_threshold": _ratio(agg["sao"]["time_to_threshold_s"]["median"],
                                        agg[other]["time_to_threshold_s"]["median"], budget),
            "time_to_threshold_incl_startup": _ratio(
                agg["sao"]["time_to_threshold_incl_startup_s"]["median"],
                agg[other]["time_to_threshold_incl_startup_s"]["median"], budget),
            **{f"time_to_{float(t):g}": _ratio(agg["sao"][f"time_to_{float(t):g}_s"]["median"],
                                               agg[other][f"time_to_{float(t):g}_s"]["median"],
                                               budget) for t in also_thresholds},
        }
    ours = agg["sao"]["time_to_threshold_s"]["median"]
    theirs = agg["trl"]["time_to_threshold_s"]["median"] if "trl" in agg else None
    note = None
    if theirs is not None and theirs <= 0:
        note = ("TRL met the threshold at its step-0 evaluation: the comparison is vacuous; "
                "use a --threshold above the warm start's accuracy")
    return {"summary": agg, "ratios": ratios, "target_met": target_met(ours, theirs, budget),
            "target_note": note}


def _table_rows(also_thresholds) -> List:
    return [("time to threshold (s, training)", "time_to_threshold_s", 2, True),
            ("time to threshold (s, incl. start-up)", "time_to_threshold_incl_startup_s", 1,
             False),
            ("steps to threshold", "steps_to_threshold", 0, False),
            ("rollouts to threshold", "rollouts_to_threshold", 0, False),
            *[row for t in also_thresholds for row in (
                (f"time to {float(t):g} (s, training)", f"time_to_{float(t):g}_s", 2, True),
                (f"time to {float(t):g} (s, incl. start-up)",
                 f"time_to_{float(t):g}_incl_startup_s", 1, False),
                (f"steps to {float(t):g}", f"steps_to_{float(t):g}", 0, False))],
            ("rollouts/s (training)", "rollouts_per_s", 0, False),
            ("tokens/s (generated, training)", "tokens_per_s", 0, False),
            ("seconds per step (training)", "step_s", 3, False),
            ("start-up (s)", "startup_s", 1, False),
            ("initial accuracy", "initial_accuracy", 3, False),
            ("final accuracy", "final_accuracy", 3, False),
            ("steps run", "steps", 0, False),
            ("CPU seconds (process tree)", "cpu_s", 1, False)]


def table(result: Dict, names: Dict[str, str], budget: float, also_thresholds=()) -> str:
    """The human-readable table of `summarize`'s result (one string, no JSON in it)."""
    agg = result["summary"]
    width = 40
    lines = [f"{'':{width}}" + "".join(f"{names[s]:>30}" for s in agg)]
    for label, key, digits, budgeted in _table_rows(also_thresholds):
        lines.append(f"{label:{width}}" + "".join(
            f"{_fmt(agg[s][key], digits, budget if budgeted and s != 'sao' else None):>30}"
            for s in agg))
    for other, r in result["ratios"].items():
        lines.append(f"SAO / {names[other]}: " + "; ".join(
            f"{k.replace('_', ' ')} {_ratio_text(v)}" for k, v in r.items()))
    if result["target_note"]:
        lines.append(f"note: {result['target_note']}")
    return "\n".join(lines)


def _fmt(stats: Dict, digits: int = 2, budget: Optional[float] = None) -> str:
    if stats["median"] is None:
        return f"not reached within {budget:g}s" if budget else "not reached"
    spread = ""
    if stats["max"] is None or stats["min"] != stats["max"]:
        hi = "inf" if stats["max"] is None else f"{stats['max']:.{digits}f}"
        spread = f" [{stats['min']:.{digits}f}, {hi}]"
    return f"{stats['median']:.{digits}f}{spread}"


def main(argv):
    del argv
    if not os.path.isabs(FLAGS.trl_python):
        FLAGS.trl_python = os.path.join(REPO, FLAGS.trl_python)
    if not os.path.exists(FLAGS.trl_python):
        sys.exit(f"--trl_python={FLAGS.trl_python} does not exist: build the TRL environment "
                 "with `make trl-env`")
    for key in ("init_checkpoint", "max_new_tokens", "sao_policy_lr", "sao_num_actors"):
        if not getattr(FLAGS, key):
            setattr(FLAGS, key, WORKLOADS[FLAGS.workload][key])
    if not os.path.exists(os.path.join(REPO, FLAGS.init_checkpoint, "config.json")):
        sys.exit(f"--init_checkpoint={FLAGS.init_checkpoint} holds no checkpoint: "
                 + ("`make warm-start`" if FLAGS.workload == "arithmetic"
                    else "`make warm-start-dataset`"))
    FLAGS.run_root = os.path.abspath(os.path.join(REPO, FLAGS.run_root))
    if FLAGS.mode == "budget":
        from programs.benchmarks.vs_trl_budget import main_budget
        main_budget()
        return
    if any(float(t) >= FLAGS.threshold for t in FLAGS.also_thresholds):
        raise app.UsageError(f"--also_thresholds={FLAGS.also_thresholds}: each must be below "
                             f"--threshold={FLAGS.threshold} (TRL stops at --threshold)")
    if FLAGS.repeats < 1:
        raise app.UsageError(f"--repeats={FLAGS.repeats}: must be >= 1")
    t0 = time.time()
    load_start = os.getloadavg()

    tuned = tune_trl()
    g, lr = tuned["group_size"], tuned["learning_rate"]
    print(f"TRL: G={g}, lr={lr:g} ({FLAGS.rollouts_per_step // g} prompts x {g} a step)",
          flush=True)

    sides: Dict[str, List[Dict]] = {"sao": [], "trl": []}
    if FLAGS.trl_same_prompts_variant:
        sides["trl_same_prompts"] = []
    for i in range(FLAGS.repeats):   # interleaved: sao, trl, trl_same_prompts, sao, ...
        sides["sao"].append(run_sao(f"sao_{i}"))
        sides["trl"].append(run_trl(f"trl_{i}", g, lr, i, FLAGS.trl_time_budget_s))
        if FLAGS.trl_same_prompts_variant:
            sides["trl_same_prompts"].append(run_trl(
                f"trl_same_prompts_{i}", g, lr, i, FLAGS.trl_time_budget_s,
                prompts_per_step=FLAGS.rollouts_per_step))
        for side, runs in sides.items():
            r = runs[-1]
            print(f"repeat {i} {side}: " + (f"{FLAGS.threshold} at step {r['steps_to_threshold']}"
                  f" after {r['time_to_threshold_s']:.2f}s training / "
                  f"{r['time_to_threshold_incl_startup_s']:.1f}s incl. start-up"
                  if r["reached"] else f"not reached (best {r['best_accuracy']:.3f})")
                  + f"; {r['rollouts_per_s']:.0f} rollouts/s", flush=True)

    budget = FLAGS.trl_time_budget_s
    summary = summarize(sides, budget, FLAGS.also_thresholds)
    names = {"sao": "SAO (ours)", "trl": f"TRL GRPO {FLAGS.rollouts_per_step // g}x{g}",
             "trl_same_prompts": f"TRL GRPO {FLAGS.rollouts_per_step}x{g}"}
    print(f"\nthreshold {FLAGS.threshold} held-out greedy accuracy; median [min, max] of "
          f"{FLAGS.repeats} interleaved repeats; load average {load_start[0]:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end")
    print(table(summary, names, budget, FLAGS.also_thresholds))
    print(f"target (SAO <= 1/3 of TRL's time to threshold): "
          f"{'met' if summary['target_met'] else 'NOT met'}; TRL tuned to G={g}, lr={lr:g}")

    result = {
        "benchmark": "vs_trl", "workload": FLAGS.workload,
        "init_checkpoint": FLAGS.init_checkpoint, "max_new_tokens": FLAGS.max_new_tokens,
        "sao_flags": WORKLOADS[FLAGS.workload]["sao_flags"] + list(FLAGS.sao_extra_flags),
        "threshold": FLAGS.threshold, "eval_every": FLAGS.eval_every,
        "eval_size": FLAGS.eval_size, "rollouts_per_step": FLAGS.rollouts_per_step,
        "repeats": FLAGS.repeats, "trl_time_budget_s": budget,
        "trl_tuned": {"group_size": g, "learning_rate": lr, "runs": tuned["runs"]},
        "sao_policy_lr": FLAGS.sao_policy_lr,
        "summary": summary["summary"], "ratio_sao_over_trl": summary["ratios"],
        "target_ratio": 1 / 3, "target_met": summary["target_met"],
        "target_note": summary["target_note"],
        "runs": {side: [{k: v for k, v in r.items() if k != "eval_curve"} | {
            "eval_curve": [(c["step"], c["accuracy"], c["train_clock_s"]) for c in r["eval_curve"]]}
            for r in runs] for side, runs in sides.items()},
        "load_avg_start": list(load_start), "load_avg_end": list(os.getloadavg()),
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    define_flags()
    app.run(main)
