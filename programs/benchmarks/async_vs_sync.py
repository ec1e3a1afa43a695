r"""Asynchronous SAO vs the same program in lock-step, under heavy-tailed environment latency.

The same program (builder.make_program, local_mp: replay, variable server, learner, N actors,
evaluator) on the same task, warm start, seeds, batch and actors, in two modes:

  sync   --lockstep: actors generate one batch with version v, then idle while the learner
         trains it; the learner idles while they generate (admission with max_staleness 0).
  async  SAO as shipped: admission lets actors run up to --max_staleness versions ahead, the
         learner trains whatever arrives within the staleness bound.

Environment latency: every rollout is held back by a delay drawn per episode from a Pareto II
(Lomax) with tail index --delay_tail and mean --delay_mean_s, capped at --delay_max_s (the
actor-delay mechanism, actors/delays.py), as if each episode waited on a tool or environment
whose response time is heavy-tailed: most episodes are quick, a few are very late. An actor
generates its --actor_batch episodes together and inserts each when its latency has passed,
from a delivery thread, while it goes on to its next batch (at most 4 batches waiting: Actor's
max_waiting); in lock-step admission still gives it one batch per version. The regime is
"NxA": N actors of A episodes each (--regimes).

Measured per run (all on one clock; t0 = the first generate call of any actor, so process
start-up is excluded alike from both modes):
  steps/s            --max_steps / (time the learner logged its last step - t0).
  time to threshold  the first version whose held-out accuracy (the evaluator: greedy, on
                     --eval_size held-out prompts, every version it can catch: eval_every=1) is
                     >= --threshold; its time is when the learner logged (published) that
                     version, minus t0.
Repeats run interleaved (sync, async, sync, async, per regime), seed = --seed + repeat for both
modes. Reported: the median of the repeats with min..max, and the ratios async/sync of the
medians (steps/s) and sync/async (time to threshold). Ends with one JSON line.

  OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python programs/benchmarks/async_vs_sync.py \
      --regimes=2x8,8x4 --repeats=2 --max_steps=40
"""
from __future__ import annotations

import json
import os
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

FLAGS = flags.FLAGS
flags.DEFINE_list("regimes", ["2x8", "8x4"], "NxA: N actors generating A episodes each.")
flags.DEFINE_integer("repeats", 2, "Interleaved repeats (sync, async) per regime.")
flags.DEFINE_integer("max_steps", 40, "Learner steps per run.")
flags.DEFINE_integer("batch_size", 32, "Rollouts per learner step (B).")
flags.DEFINE_integer("max_staleness", 4, "async: the staleness bound (the program's default).")
flags.DEFINE_float("threshold", 0.9, "Held-out accuracy that counts as reached.")
flags.DEFINE_integer("eval_size", 200, "Held-out prompts per evaluation.")
flags.DEFINE_enum("delay", "heavy_tailed", ["none", "fixed", "uniform", "heavy_tailed"],
                  "Per-episode latency distribution (actors/delays.py).")
flags.DEFINE_float("delay_mean_s", 0.25, "Mean per-episode latency (seconds).")
flags.DEFINE_float("delay_tail", 1.5, "Pareto tail index (> 1; <= 2: infinite variance).")
flags.DEFINE_float("delay_max_s", 5.0, "Cap on one episode's latency (seconds).")
flags.DEFINE_string("task", "arithmetic", "Task (arithmetic or calculator_tool).")
flags.DEFINE_string("tool_latency", None, "calculator_tool: per tool call latency spec (tasks/"
                    "tools.py), e.g. pareto:0.02,1.2; None: the config default.")
flags.DEFINE_string("init_checkpoint", "", "Warm start; '': the task's.")
flags.DEFINE_integer("seed", 0, "Seed of repeat 0 (repeat r uses seed + r in both modes).")
flags.DEFINE_string("out_dir", "runs/bench_async_vs_sync", "Run folders go here.")
flags.DEFINE_enum("launch", "local_mp", ["local_mp", "local_mt"], "local_mp: the measurement; "
                  "local_mt (one process, the GIL shared) only for quick smoke tests.")

MODES = ("sync", "async")
TARGET_RATIO = 2.5


def parse_regime(text: str):
    try:
        n, a = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--regimes entry {text!r}: must be NxA, e.g. 2x8 (2 actors of 8 "
                         "episodes)") from None
    return n, a


def make_config(mode: str, num_actors: int, actor_batch: int, seed: int, run_dir: str):
    from sao_actor_learner.config import SAOConfig
    extra = {"tool_latency": FLAGS.tool_latency} if FLAGS.tool_latency else {}
    mode_fields = dict(lockstep=True) if mode == "sync" else dict(max_staleness=FLAGS.max_staleness)
    return SAOConfig(task=FLAGS.task, init_checkpoint=FLAGS.init_checkpoint, run_dir=run_dir,
                     launch=FLAGS.launch, seed=seed, max_steps=FLAGS.max_steps,
                     batch_size=FLAGS.batch_size, num_actors=num_actors, actor_batch=actor_batch,
                     eval_every=1, eval_size=FLAGS.eval_size, actor_delay=FLAGS.delay,
                     actor_delay_mean_s=FLAGS.delay_mean_s if FLAGS.delay != "none" else 0.0,
                     actor_delay_tail=FLAGS.delay_tail, actor_delay_max_s=FLAGS.delay_max_s,
                     **mode_fields, **extra)


def measure_run(config, summary: dict) -> Dict:
    """The figures of one finished run (module docstring), from its run folder."""
    from sao_actor_learner.observers import read_metrics
    from experiments.benchmarks.generate_log import read_generate_calls

    train = {r["step"]: r for r in read_metrics(config.run_dir, "train")}
    evals = sorted((r["policy_version"], r["eval_accuracy"])
                   for r in read_metrics(config.run_dir, "eval"))
    calls = read_generate_calls(config.run_dir)
    starts = [c[0]["t0"] for c in calls.values() if c]
    if not starts or config.max_steps not in train:
        raise RuntimeError(f"run {config.run_dir} did not finish (steps {sorted(train)[-1:]}, "
                           f"{len(starts)} actors generated); see its logs/")
    t0 = min(starts)
    t_end = train[config.max_steps]["time"]
    reached = next((v for v, acc in evals if v > 0 and acc >= FLAGS.threshold), None)
    generate_s = sum(min(c["t1"], t_end) - max(c["t0"], t0)
                     for cs in calls.values() for c in cs if c["t0"] < t_end)
    rows = [train[s] for s in sorted(train)]
    return {
        "steps_per_s": config.max_steps / (t_end - t0),
        "wall_s": t_end - t0,
        "time_to_threshold_s": (train[reached]["time"] - t0) if reached else None,
        "steps_to_threshold": reached,
        "initial_accuracy": evals[0][1] if evals and evals[0][0] == 0 else None,
        "final_accuracy": summary.get("final_eval_accuracy"),
        "evaluated_versions": len(evals),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "dropped_stale": summary.get("dropped_stale", 0),
        "learner_wait_frac": statistics.fmean(r["learner_wait_frac"] for r in rows),
        # Share of the actors' time spent in engine.generate (the rest: latency, admission).
        "actor_generate_frac": generate_s / (config.num_actors * (t_end - t0)),
        "rollouts_generated": summary.get("rollouts_generated"),
    }


def run_one(mode: str, num_actors: int, actor_batch: int, rep: int) -> Dict:
    from sao_actor_learner.run import run_program
    from experiments.benchmarks.generate_log import make_program_with_generate_log
    run_dir = os.path.join(FLAGS.out_dir, f"{num_actors}x{actor_batch}_{mode}_r{rep}")
    config = make_config(mode, num_actors, actor_batch, FLAGS.seed + rep, run_dir)
    t = time.time()
    summary = run_program(config, make_program_with_generate_log, progress=False)
    out = measure_run(config, summary)
    out.update(mode=mode, repeat=rep, seed=config.seed, run_dir=run_dir,
               process_wall_s=time.time() - t, load_avg_1m=os.getloadavg()[0])
    print(f"  {num_actors}x{actor_batch} {mode:5s} r{rep}: {out['steps_per_s']:.3f} steps/s, "
          f"threshold {_fmt(out['time_to_threshold_s'])} s at version "
          f"{out['steps_to_threshold']}, staleness {out['staleness_mean']:.2f}, "
          f"actors generating {out['actor_generate_frac']:.1%}", flush=True)
    return out


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def aggregate(runs: List[Dict]) -> Dict:
    def stat(key):
        vals = [r[key] for r in runs if r[key] is not None]
        if not vals:
            return {"median": None, "min": None, "max": None, "n": 0}
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
                "n": len(vals)}
    return {"steps_per_s": stat("steps_per_s"), "time_to_threshold_s": stat("time_to_threshold_s"),
            "steps_to_threshold": stat("steps_to_threshold"),
            "staleness_mean": stat("staleness_mean"), "learner_wait_frac": stat("learner_wait_frac"),
            "actor_generate_frac": stat("actor_generate_frac"),
            "final_accuracy": stat("final_accuracy")}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def main(argv):
    del argv
    regimes = [parse_regime(r) for r in FLAGS.regimes]
    load_before = os.getloadavg()
    runs: Dict[str, Dict[str, List[Dict]]] = {f"{n}x{a}": {m: [] for m in MODES}
                                               for n, a in regimes}
    print(f"latency per episode: {FLAGS.delay} mean {FLAGS.delay_mean_s}s tail "
          f"{FLAGS.delay_tail} cap {FLAGS.delay_max_s}s; batch {FLAGS.batch_size}, "
          f"{FLAGS.max_steps} steps, async max_staleness {FLAGS.max_staleness}", flush=True)
    for rep in range(FLAGS.repeats):
        for n, a in regimes:
            for mode in MODES:
                runs[f"{n}x{a}"][mode].append(run_one(mode, n, a, rep))
    results = {}
    for regime, by_mode in runs.items():
        agg = {m: aggregate(by_mode[m]) for m in MODES}
        sps = _ratio(agg["async"]["steps_per_s"]["median"], agg["sync"]["steps_per_s"]["median"])
        ttt = _ratio(agg["sync"]["time_to_threshold_s"]["median"],
                     agg["async"]["time_to_threshold_s"]["median"])
        paired = [_ratio(s["steps_per_s"], y["steps_per_s"]) for s, y in
                  zip(by_mode["async"], by_mode["sync"])]
        results[regime] = {**agg, "steps_per_s_ratio": sps, "time_to_threshold_ratio": ttt,
                           "steps_per_s_ratio_per_repeat": paired,
                           "target_met": bool(sps and ttt and sps >= TARGET_RATIO
                                              and ttt >= TARGET_RATIO),
                           "runs": by_mode}

    print()
    header = (f"{'regime':>7} {'mode':>5} {'steps/s (min..max)':>24} {'to acc>=' + str(FLAGS.threshold) + ' s':>22}"
              f" {'at ver':>7} {'stale':>6} {'gen%':>5} {'final':>6}")
    print(header)
    print("-" * len(header))
    for regime, res in results.items():
        for m in MODES:
            s, t = res[m]["steps_per_s"], res[m]["time_to_threshold_s"]
            print(f"{regime:>7} {m:>5} {_fmt(s['median'], 3):>8} ({_fmt(s['min'], 3)}..{_fmt(s['max'], 3)})"
                  f" {_fmt(t['median']):>8} ({_fmt(t['min'])}..{_fmt(t['max'])}) [{t['n']}/{FLAGS.repeats}]"
                  f" {_fmt(res[m]['steps_to_threshold']['median'], 0):>7}"
                  f" {_fmt(res[m]['staleness_mean']['median'], 2):>6}"
                  f" {100 * (res[m]['actor_generate_frac']['median'] or 0):>4.1f}"
                  f" {_fmt(res[m]['final_accuracy']['median'], 3):>6}")
        print(f"{regime:>7} async/sync: steps/s x{_fmt(res['steps_per_s_ratio'], 2)}, time to "
              f"threshold x{_fmt(res['time_to_threshold_ratio'], 2)} (target x{TARGET_RATIO}: "
              f"{'met' if res['target_met'] else 'missed'})")
    print(json.dumps({
        "benchmark": "async_vs_sync", "target_ratio": TARGET_RATIO,
        "latency": {"kind": FLAGS.delay, "mean_s": FLAGS.delay_mean_s, "tail": FLAGS.delay_tail,
                    "max_s": FLAGS.delay_max_s, "tool_latency": FLAGS.tool_latency},
        "task": FLAGS.task, "batch_size": FLAGS.batch_size, "max_steps": FLAGS.max_steps,
        "max_staleness_async": FLAGS.max_staleness, "threshold": FLAGS.threshold,
        "eval_size": FLAGS.eval_size, "repeats": FLAGS.repeats, "launch": FLAGS.launch,
        "load_avg_before": list(load_before), "load_avg_after": list(os.getloadavg()),
        "regimes": results}, sort_keys=True))


if __name__ == "__main__":
    app.run(main)
