r"""The lean profile, one choice at a time: what each of its settings buys on a small model.

  OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python programs/benchmarks/lean_profile.py
  ... --smoke     (2 variants, 1 repeat, a few steps under local_mt: checks the harness only)

One invocation runs the arithmetic task (the warm start, batch 32 = 32 prompts x 1 rollout,
seed 0, --max_steps steps) through programs/sao.py, once per variant and repeat, interleaved
(every variant of repeat 0, then of repeat 1, ...):

  default          the program as shipped (2 actors, SAO's separate critic with K=2 critic
                   steps, the evaluator node every eval_every=10 versions)
  critic_k1        --critic_updates=1: one critic step per policy step (still SAO's critic)
  shared_trunk     --critic=shared_trunk: a value head on the policy's trunk (not SAO)
  one_actor        --num_actors=1
  eval_rare        --eval_every=0: the evaluator node evaluates versions 0 and the last only
  eval_in_learner  --evaluator=in_learner: no evaluator process; the learner evaluates
  eval_off         --evaluator=off: no evaluation at all
  lean             --profile=lean (one actor, shared_trunk, in-learner evaluation)

Held-out accuracy is measured the same way for every variant, outside the run: the learner saves
a checkpoint every --checkpoint_every versions (all variants alike), and after each run this
process scores every saved version (and version 0) greedily on the same --eval_size held-out
prompts (actors/evaluator.evaluate). So the online evaluator's placement and cadence change
only what they cost, not the resolution of the measurement.

Per run (all from the run folder and the process):
  time to threshold  when the learner published the first checkpointed version scoring
                     >= --threshold, from the learner's start (it publishes version 0, actors
                     start); everything the run does meanwhile is in it (an in-learner
                     evaluation's seconds too; also reported without them).
  steps/s            --max_steps / (the last step's time - the learner's start).
  learner step split medians over the steps of: the wait for rollouts (wait_s), the estimate
                     (critic values without gradient + GAE), the policy step (forward,
                     backward, optimizer; with a shared head its value loss too), the critic's
                     K steps, publishing the weights; learner_wait_frac.
  processes          the launcher plus every node (nodes.json); threads under local_mt: 1.
  cpu_s              CPU seconds of the run's whole process tree (RUSAGE_CHILDREN).
  peak RSS           the largest sum of resident memory over the run's processes (its
                     session, sampled every 0.5 s from /proc).
  start-up           launch to the learner's start.
Reported: median [min, max] over --repeats and every variant's ratio to default's median.
A run that stalls or crashes is run again (--retries), then left out and listed under
"failures". Ends with one JSON line.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from typing import Dict, List, Optional

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# Spawned nodes inherit sys.path: without this folder on it, so that kernels.py here cannot
# shadow the `kernels` package transformers probes for.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, REPO)
SAO_SCRIPT = os.path.join(REPO, "programs", "sao.py")

# name -> programs/sao.py flags on top of the common ones (module docstring).
VARIANTS = {
    "default": [],
    "critic_k1": ["--critic_updates=1"],
    "shared_trunk": ["--critic=shared_trunk"],
    "one_actor": ["--num_actors=1"],
    "eval_rare": ["--eval_every=0"],
    "eval_in_learner": ["--evaluator=in_learner"],
    "eval_off": ["--evaluator=off"],
    "lean": ["--profile=lean"],
}
SMOKE_VARIANTS = ["default", "lean"]
SPLIT_KEYS = ("wait_s", "estimate_s", "policy_step_s", "critic_step_s", "publish_s",
              "step_time_s", "learner_wait_frac")

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined only when run as a script)."""
    flags.DEFINE_list("variants", list(VARIANTS), f"Variants to run, of {', '.join(VARIANTS)}.")
    flags.DEFINE_integer("repeats", 2, "Interleaved repeats of every variant (median).")
    flags.DEFINE_integer("max_steps", 30, "Learner steps per run.")
    flags.DEFINE_integer("batch_size", 32, "Rollouts per learner step.")
    flags.DEFINE_integer("actor_batch", 8, "Prompts an actor generates together.")
    flags.DEFINE_float("threshold", 0.9, "Held-out greedy accuracy that counts as reached.")
    flags.DEFINE_list("also_thresholds", ["0.8"], "Lower thresholds also timed.")
    flags.DEFINE_integer("checkpoint_every", 5, "Versions between the checkpoints scored after "
                         "each run (the resolution of time to threshold).")
    flags.DEFINE_integer("eval_size", 200, "Held-out prompts (the same for every variant).")
    flags.DEFINE_string("init_checkpoint", "checkpoints/warm_start", "The warm start.")
    flags.DEFINE_string("run_root", "runs/bench_lean_profile", "Run folders go here.")
    flags.DEFINE_enum("launch", "local_mp", ["local_mp", "local_mt"], "local_mp: the "
                      "measurement (a process per node); local_mt: threads, for --smoke.")
    flags.DEFINE_bool("smoke", False, "A quick check of the harness: variants default and "
                      "lean, 1 repeat, 4 steps of 8 rollouts, 20 prompts, local_mt.")
    flags.DEFINE_float("subprocess_timeout_s", 900.0, "A run taking longer is an error.")
    flags.DEFINE_float("stall_timeout_s", 240.0, "A run whose metrics.jsonl does not grow for "
                       "this long (start-up included) is killed as stalled.")
    flags.DEFINE_integer("retries", 1, "A failed (stalled, crashed) run is run again this many "
                         "times; one failing every time is left out and listed in failures.")


def settings() -> Dict:
    """The flags, with --smoke's overrides."""
    s = {k: FLAGS[k].value for k in ("variants", "repeats", "max_steps", "batch_size",
                                     "actor_batch", "threshold", "also_thresholds",
                                     "checkpoint_every", "eval_size", "init_checkpoint",
                                     "run_root", "launch")}
    if FLAGS.smoke:
        s.update(variants=[v for v in s["variants"] if v in SMOKE_VARIANTS] or SMOKE_VARIANTS,
                 repeats=1, max_steps=4, batch_size=8, actor_batch=4, eval_size=20,
                 checkpoint_every=2, launch="local_mt")
    for v in s["variants"]:
        if v not in VARIANTS:
            raise app.UsageError(f"--variants: unknown {v!r}; choose from {', '.join(VARIANTS)}")
    return s


def command(s: Dict, variant: str, run_dir: str) -> List[str]:
    return [sys.executable, SAO_SCRIPT, "--task=arithmetic", f"--init_checkpoint="
            f"{s['init_checkpoint']}", f"--run_dir={run_dir}", f"--max_steps={s['max_steps']}",
            f"--batch_size={s['batch_size']}", f"--actor_batch={s['actor_batch']}",
            f"--eval_size={s['eval_size']}", "--seed=0", f"--launch={s['launch']}",
            "--threads_per_process=1", "--progress=false",
            f"--checkpoint_every={s['checkpoint_every']}", "--keep_checkpoints=0",
            *VARIANTS[variant]]


def session_rss_mb(sid: int) -> float:
    """The resident memory (MiB) of every process in session `sid`, summed (Linux /proc)."""
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:          # field 6 of stat: the session id
                continue
            with open(f"/proc/{name}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):   # it exited meanwhile
            continue
    return total / 2 ** 20


def run_process(cmd: List[str], log_path: str, progress_file: str) -> Dict:
    """Runs `cmd` in its own session (vs_trl.run_side: a stalled run is killed whole); its
    launch time, wall and CPU seconds (the whole tree) and peak summed RSS."""
    from programs.benchmarks.vs_trl import run_side
    peak = [0.0]

    def sample(pid: int) -> None:
        peak[0] = max(peak[0], session_rss_mb(pid))

    out = run_side(cmd, log_path, progress_file, on_tick=sample)
    return {"t_launch": out["t_launch"], "wall_s": out["wall_s"], "cpu_s": out["cpu_s"],
            "peak_rss_mb": peak[0]}


class HeldOut:
    """Scores model directories greedily on the task's held-out prompts (the evaluator's
    evaluation, in this process)."""

    def __init__(self, s: Dict):
        from sao_actor_learner.builder import make_task, sampling_params
        from sao_actor_learner.config import SAOConfig
        config = SAOConfig(task="arithmetic", init_checkpoint=s["init_checkpoint"], seed=0,
                           eval_size=s["eval_size"])
        self._config = config
        self._task = make_task(config)
        self._prompts = self._task.eval_prompts()
        self._sampling_params = sampling_params
        self._cache: Dict[str, float] = {}

    def accuracy(self, model_dir: str) -> float:
        from sao_actor_learner.actors.evaluator import evaluate
        from sao_actor_learner.engines import TorchEngine
        if model_dir in self._cache:
            return self._cache[model_dir]
        engine = TorchEngine.from_checkpoint(model_dir)
        params = self._sampling_params(self._config, greedy=True,
                                       stop_ids=engine.tokenizer.stop_ids)
        acc = evaluate(engine, self._task, self._prompts, params)
        if model_dir == self._config.init_checkpoint:
            self._cache[model_dir] = acc
        return acc


def _median(rows: List[Dict], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def measure(s: Dict, variant: str, rep: int, held_out: HeldOut) -> Dict:
    from sao_actor_learner.observers import read_metrics
    run_dir = os.path.join(s["run_root"], f"{variant}_r{rep}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.join(s["run_root"], "logs"), exist_ok=True)
    proc = run_process(command(s, variant, run_dir),
                       os.path.join(s["run_root"], "logs", f"{variant}_r{rep}.log"),
                       os.path.join(run_dir, "metrics.jsonl"))
    train = {r["step"]: r for r in read_metrics(run_dir, "train")}
    if s["max_steps"] not in train:
        raise RuntimeError(f"{run_dir}: the run did not reach step {s['max_steps']}")
    first = train[min(train)]
    learner_start = first["time"] - first["wall_time_s"]
    t_end = train[s["max_steps"]]["time"]
    # Held-out accuracy of version 0 and of every checkpoint, from the model directories.
    curve = [{"version": 0, "accuracy": held_out.accuracy(s["init_checkpoint"]), "t": 0.0,
              "t_excl_eval": 0.0}]
    ckpt_root = os.path.join(run_dir, "checkpoints")
    for name in sorted(os.listdir(ckpt_root)):
        if not name.startswith("step_") or "." in name:
            continue
        v = int(name[len("step_"):])
        row = train[v]
        t = row["time"] - learner_start
        curve.append({"version": v, "accuracy": held_out.accuracy(os.path.join(ckpt_root, name)),
                      "t": round(t, 3), "t_excl_eval": round(t - row["in_learner_eval_s"], 3)})

    def reached(threshold: float) -> Optional[Dict]:
        return next((c for c in curve if c["accuracy"] >= threshold), None)

    hit = reached(s["threshold"])
    rows = [train[k] for k in sorted(train)][1:] or [first]   # step 1 waits for start-up
    out = {
        "variant": variant, "repeat": rep, "run_dir": run_dir,
        "time_to_threshold_s": hit["t"] if hit else None,
        "time_to_threshold_excl_eval_s": hit["t_excl_eval"] if hit else None,
        "steps_to_threshold": hit["version"] if hit else None,
        "steps_per_s": s["max_steps"] / max(t_end - learner_start, 1e-9),
        "train_s": t_end - learner_start,
        "startup_s": learner_start - proc["t_launch"],
        "cpu_s": proc["cpu_s"], "wall_s": proc["wall_s"], "peak_rss_mb": proc["peak_rss_mb"],
        "processes": _processes(run_dir, s["launch"]),
        "final_accuracy": curve[-1]["accuracy"], "initial_accuracy": curve[0]["accuracy"],
        "best_accuracy": max(c["accuracy"] for c in curve),
        "online_evals": len(read_metrics(run_dir, "eval")),
        "in_learner_eval_s": train[s["max_steps"]]["in_learner_eval_s"],
        "curve": curve, "load_avg_1m": os.getloadavg()[0],
    }
    for key in SPLIT_KEYS:
        out[f"{key}_median"] = _median(rows, key)
    out["compute_s_median"] = sum(out[f"{k}_median"] or 0.0 for k in
                                  ("estimate_s", "policy_step_s", "critic_step_s"))
    for t in s["also_thresholds"]:
        h = reached(float(t))
        out[f"time_to_{float(t):g}_s"] = h["t"] if h else None
        out[f"steps_to_{float(t):g}"] = h["version"] if h else None
    return out


def _processes(run_dir: str, launch: str) -> int:
    if launch == "local_mt":
        return 1
    with open(os.path.join(run_dir, "nodes.json")) as f:
        return 1 + len(json.load(f)["nodes"])   # the launcher and its nodes


def _stat(values: List[Optional[float]]) -> Dict:
    """median, min, max; None (threshold not reached) counts as +inf; n reached."""
    vals = [float("inf") if v is None else float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}

    def clean(x):
        return None if x == float("inf") else round(x, 4)

    return {"median": clean(statistics.median(vals)), "min": clean(min(vals)),
            "max": clean(max(vals)), "n": sum(v is not None for v in values)}


AGGREGATED = ("time_to_threshold_s", "time_to_threshold_excl_eval_s", "steps_to_threshold",
              "steps_per_s", "train_s", "startup_s", "cpu_s", "wall_s", "peak_rss_mb",
              "processes",
              "final_accuracy", "best_accuracy", "online_evals", "in_learner_eval_s",
              "compute_s_median", *(f"{k}_median" for k in SPLIT_KEYS))
# Ratios to default: a time or cost (lower is better) as variant / default, a rate as
# variant / default too (higher is better): each says which.
RATIOS = {"time_to_threshold_s": "lower", "steps_per_s": "higher", "cpu_s": "lower",
          "peak_rss_mb": "lower",
          "compute_s_median": "lower", "step_time_s_median": "lower", "startup_s": "lower",
          "processes": "lower"}


def aggregate(runs: Dict[str, List[Dict]], also_thresholds) -> Dict:
    keys = AGGREGATED + tuple(f"{k}_{float(t):g}{s}" for t in also_thresholds
                              for k, s in (("time_to", "_s"), ("steps_to", "")))
    agg = {v: {k: _stat([r[k] for r in rs]) for k in keys} for v, rs in runs.items()}
    base = agg.get("default")
    for v, a in agg.items():
        a["ratio_to_default"] = {}
        for key in RATIOS:
            ours = a[key]["median"]
            theirs = base[key]["median"] if base else None
            a["ratio_to_default"][key] = round(ours / theirs, 3) if ours is not None and \
                theirs else None
    return agg


def _fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(agg: Dict, s: Dict) -> None:
    cols = [("time to %g (s)" % s["threshold"], "time_to_threshold_s", 1),
            ("excl. eval", "time_to_threshold_excl_eval_s", 1),
            ("steps to", "steps_to_threshold", 0), ("steps/s", "steps_per_s", 2),
            ("wait", "wait_s_median", 3), ("estimate", "estimate_s_median", 3),
            ("policy", "policy_step_s_median", 3), ("critic", "critic_step_s_median", 3),
            ("publish", "publish_s_median", 3), ("wait frac", "learner_wait_frac_median", 2),
            ("procs", "processes", 0), ("CPU s", "cpu_s", 1), ("RSS MiB", "peak_rss_mb", 0),
            ("start-up s", "startup_s", 1),
            ("final acc", "final_accuracy", 3)]
    print("| variant | " + " | ".join(c[0] for c in cols) + " |")
    print("|" + " --- |" * (len(cols) + 1))
    for v, a in agg.items():
        cells = []
        for _, key, d in cols:
            st = a[key]
            cell = _fmt(st["median"], d)
            if st["min"] is not None and st["max"] != st["min"]:
                cell += f" [{_fmt(st['min'], d)}, {_fmt(st['max'], d)}]"
            if key == "time_to_threshold_s":
                cell += f" ({st['n']}/{s['repeats']})"
            cells.append(cell)
        print(f"| {v} | " + " | ".join(cells) + " |")
    print()
    print("ratios to default (median / default's median): " + "; ".join(
        f"{v}: " + ", ".join(f"{k.replace('_median', '')} {_fmt(r, 2)}"
                             for k, r in a["ratio_to_default"].items())
        for v, a in agg.items() if v != "default"))


def main(argv):
    del argv
    s = settings()
    os.makedirs(s["run_root"], exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.time()
    held_out = HeldOut(s)
    runs: Dict[str, List[Dict]] = {v: [] for v in s["variants"]}
    failures: List[Dict] = []
    for rep in range(s["repeats"]):
        for variant in s["variants"]:
            r = None
            for attempt in range(1 + FLAGS.retries):
                try:
                    r = measure(s, variant, rep, held_out)
                    break
                except RuntimeError as e:   # a stalled or crashed run: once more, then record
                    failures.append({"variant": variant, "repeat": rep, "attempt": attempt,
                                     "error": str(e)[:2000]})
                    print(f"{variant} r{rep}: run failed (attempt {attempt}): "
                          f"{str(e).splitlines()[0]}", flush=True)
            if r is None:
                continue
            runs[variant].append(r)
            print(f"{variant} r{rep}: to {s['threshold']:g} {_fmt(r['time_to_threshold_s'], 1)} s "
                  f"(step {r['steps_to_threshold']}), {r['steps_per_s']:.2f} steps/s, "
                  f"compute {r['compute_s_median']:.3f} s/step, wait "
                  f"{_fmt(r['learner_wait_frac_median'])}, {r['processes']} processes, "
                  f"{r['cpu_s']:.1f} CPU s, {r['peak_rss_mb']:.0f} MiB, load "
                  f"{r['load_avg_1m']:.1f}", flush=True)
    runs = {v: rs for v, rs in runs.items() if rs}
    if not runs:
        raise SystemExit(f"every run failed: {failures}")
    agg = aggregate(runs, s["also_thresholds"])
    print()
    print_table(agg, s)
    print(json.dumps({"benchmark": "lean_profile", "settings": s, "smoke": FLAGS.smoke,
                      "variants": {v: VARIANTS[v] for v in s["variants"]},
                      "load_avg_before": list(load_before), "load_avg_after":
                      list(os.getloadavg()), "elapsed_s": round(time.time() - t0, 1),
                      "summary": agg, "runs": runs, "failures": failures}, sort_keys=True))


if __name__ == "__main__":
    define_flags()
    app.run(main)
