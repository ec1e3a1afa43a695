r"""Weight sync modes side by side: off vs keep vs abort, under heavy-tailed generation lengths.

The same program (builder.make_program, local_mp: replay, variable server, learner, N actors,
evaluator; torch engine) run once per `--weight_sync_mode` (docs/DESIGN.md "Weight sync
modes"):

  off    an actor loads a new version between its batches only: a long generation keeps the
         weights it started with to its last token;
  keep   the actor's weight thread offers each new version to the engine as soon as it is
         fetched; in-flight rows continue on it from their next token (KV recomputed);
  abort  the same, but in-flight rows restart from their prompts on the new weights.

Generation lengths: every generate call of an actor (its batch of --actor_batch rows) gets a
max_new_tokens drawn from a Pareto II (Lomax) with mean --length_mean tokens and tail index
--length_tail, capped at --length_max (the heavy-tailed distribution of actors/delays.py, in
tokens): most batches are short, a few are very long and span several learner versions. The
model is a tiny random Llama (LM head x20, <eos> row zeroed, built once into --out_dir) whose
<eos> is practically never sampled, so a call runs to its drawn length: what is measured is the
system, not what the model learns (it learns nothing on the arithmetic task's reward).

Measured per run (t0 = the first generate call of any actor; t1 = the learner's last step):
  rollouts/s, tokens/s   rollouts the learner trained / (t1 - t0); tokens the engines returned
                         (kept) and sampled (kept + discarded by abort) / (t1 - t0);
  regenerated            tokens discarded by abort / tokens sampled;
  staleness              token staleness mean (learner version - token version, over trained
                         action tokens: the learner's staleness_mean), rollout staleness mean
                         and max (learner version - oldest token's version) and its histogram
                         over all trained rollouts, rollouts dropped as stale;
  token lag              histogram of generated tokens by (their version - the version of
                         their generation's first token), and the share of generations that
                         switched weights mid-way (the actors' generate logs);
  learner waiting        mean learner_wait_frac (share of its time waiting for rollouts).
Repeats are interleaved (off, keep, abort, off, ...), seed --seed + repeat in every mode; the
median with min..max is reported. Ends with one JSON line.

  OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python programs/benchmarks/interruptible.py

`--smoke` (tests/entry_points/test_bench_interruptible.py): one repeat, 3 steps, short lengths, local_mt.
"""
from __future__ import annotations

import dataclasses
import functools
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

from sao_actor_learner import core  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("modes", ["off", "keep", "abort"], "weight_sync_mode values to compare.")
flags.DEFINE_integer("repeats", 2, "Interleaved repeats of every mode.")
flags.DEFINE_integer("max_steps", 30, "Learner steps per run.")
flags.DEFINE_integer("batch_size", 8, "Rollouts per learner step.")
flags.DEFINE_integer("num_actors", 2, "Actors.")
flags.DEFINE_integer("actor_batch", 4, "Rows an actor generates together.")
flags.DEFINE_integer("max_staleness", 4, "The staleness bound (the program's default).")
flags.DEFINE_float("length_mean", 24.0, "Mean drawn max_new_tokens per generate call.")
flags.DEFINE_float("length_tail", 1.5, "Pareto tail index of the lengths (> 1).")
flags.DEFINE_integer("length_max", 256, "Cap on a drawn length (the config's max_new_tokens).")
flags.DEFINE_integer("seed", 0, "Seed of repeat 0 (repeat r uses seed + r in every mode).")
flags.DEFINE_string("out_dir", "runs/bench_interruptible", "Run folders (and the model) go here.")
flags.DEFINE_enum("launch", "local_mp", ["local_mp", "local_mt"], "local_mp: the measurement; "
                  "local_mt only for smoke runs.")
flags.DEFINE_bool("smoke", False, "Tiny settings (1 repeat, 3 steps, lengths <= 16, local_mt): "
                  "checks the program end to end, measures nothing.")


# --- what runs inside the actor nodes (module level: pickled by reference) ----------------------
class HeavyTailedLengths(core.EngineWrapper):
    """Delegates to `engine` (the whole contract, so the mode under test applies), with
    max_new_tokens of each generate call drawn heavy-tailed (module docstring)."""

    def __init__(self, engine: core.Engine, mean: float, tail: float, seed):
        import numpy as np
        super().__init__(engine)
        self._mean, self._tail = mean, tail
        self._rng = np.random.default_rng(seed)

    def generate(self, prompts, params):
        from sao_actor_learner.actors.delays import sample_delays
        cap = params.max_new_tokens
        n = sample_delays("heavy_tailed", 1, self._rng, self._mean, float(cap), self._tail)[0]
        n = max(1, min(cap, int(round(float(n)))))
        return self._engine.generate(prompts, dataclasses.replace(params, max_new_tokens=n))


def make_bench_actor(config, actor_id, replay_address, variables_address, run_dir=None,
                     length_mean=24.0, length_tail=1.5, **kwargs):
    """builder.make_actor with heavy-tailed lengths and a generate-call log around its engine."""
    from sao_actor_learner import builder
    from experiments.benchmarks.generate_log import LOG_PREFIX, GenerateLogEngine
    path = os.path.join(run_dir or config.run_dir, f"{LOG_PREFIX}{actor_id}.jsonl")
    return builder.make_actor(
        config, actor_id, replay_address, variables_address, run_dir,
        wrap_engine=lambda e: GenerateLogEngine(
            HeavyTailedLengths(e, length_mean, length_tail, [config.seed, actor_id, 7]), path),
        **kwargs)


# --- the benchmark ------------------------------------------------------------------------------
def settings() -> Dict:
    s = dict(modes=list(FLAGS.modes), repeats=FLAGS.repeats, max_steps=FLAGS.max_steps,
             batch_size=FLAGS.batch_size, num_actors=FLAGS.num_actors,
             actor_batch=FLAGS.actor_batch, max_staleness=FLAGS.max_staleness,
             length_mean=FLAGS.length_mean, length_tail=FLAGS.length_tail,
             length_max=FLAGS.length_max, launch=FLAGS.launch)
    if FLAGS.smoke:
        s.update(repeats=1, max_steps=3, batch_size=4, num_actors=1, actor_batch=2,
                 length_mean=4.0, length_max=16, launch="local_mt")
    return s


def build_model(path: str, max_len: int) -> str:
    """The tiny random Llama of the module docstring, saved once (same seed, same weights)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch

    from sao_actor_learner.models import CharTokenizer, make_tiny_model, save_checkpoint
    tok = CharTokenizer()
    model = make_tiny_model("llama", vocab_size=tok.vocab_size, seed=0,
                            max_position_embeddings=max_len)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        model.lm_head.weight[tok.eos_id].zero_()
    save_checkpoint(model, tok, path)
    return path


def make_config(s: Dict, mode: str, seed: int, model: str, run_dir: str):
    from sao_actor_learner.config import SAOConfig
    return SAOConfig(task="arithmetic", init_checkpoint=model, run_dir=run_dir,
                     launch=s["launch"], seed=seed, max_steps=s["max_steps"],
                     batch_size=s["batch_size"], num_actors=s["num_actors"],
                     actor_batch=s["actor_batch"], max_staleness=s["max_staleness"],
                     max_new_tokens=s["length_max"], max_sequence_length=s["length_max"] + 16,
                     weight_sync_mode=mode, eval_every=0, eval_size=4)


def _lag_hist(calls) -> List[int]:
    out: List[int] = []
    for c in calls:
        for d, n in enumerate(c.get("lag_hist", [])):
            out.extend([0] * (d + 1 - len(out)))
            out[d] += n
    return out


def measure_run(config, summary: dict) -> Dict:
    """The figures of one finished run (module docstring), from its run folder."""
    from sao_actor_learner.observers import read_metrics
    from experiments.benchmarks.generate_log import read_generate_calls

    train = {r["step"]: r for r in read_metrics(config.run_dir, "train")}
    calls = read_generate_calls(config.run_dir)
    starts = [c[0]["t0"] for c in calls.values() if c]
    if not starts or config.max_steps not in train:
        raise RuntimeError(f"run {config.run_dir} did not finish (steps {sorted(train)[-1:]}); "
                           "see its logs/")
    t0, t1 = min(starts), train[config.max_steps]["time"]
    wall = t1 - t0
    rows = [train[s] for s in sorted(train)]
    hist: List[int] = []
    for r in rows:
        for s, n in enumerate(r["staleness_hist"]):
            hist.extend([0] * (s + 1 - len(hist)))
            hist[s] += n
    trained = sum(hist)
    engine = {}
    for i in range(config.num_actors):
        path = os.path.join(config.run_dir, f"actor_{i}_stats.json")
        with open(path) as f:
            for k, v in json.load(f).get("engine_counters", {}).items():
                engine[k] = engine.get(k, 0) + v
    kept, discarded = engine.get("tokens", 0), engine.get("tokens_discarded", 0)
    all_calls = [c for cs in calls.values() for c in cs]
    lag = _lag_hist(all_calls)
    generations = sum(c["n"] for c in all_calls)
    return {
        "wall_s": wall, "steps_per_s": config.max_steps / wall,
        "rollouts_per_s": trained / wall,
        "tokens_per_s": kept / wall, "sampled_tokens_per_s": (kept + discarded) / wall,
        "regenerated_frac": discarded / (kept + discarded) if kept + discarded else 0.0,
        "token_staleness_mean": statistics.fmean(r["staleness_mean"] for r in rows),
        "rollout_staleness_mean": sum(s * n for s, n in enumerate(hist)) / max(trained, 1),
        "rollout_staleness_max": max(r["staleness_max"] for r in rows),
        "rollout_staleness_hist": hist,
        "dropped_stale": summary.get("dropped_stale", 0),
        "rollouts_generated": summary.get("rollouts_generated"),
        # rollouts the learner dropped as too stale, of those it drew (trained + dropped)
        "dropped_stale_frac": summary.get("dropped_stale", 0) / max(
            trained + summary.get("dropped_stale", 0), 1),
        "response_length_mean": statistics.fmean(r["response_length_mean"] for r in rows),
        "learner_wait_frac": statistics.fmean(r["learner_wait_frac"] for r in rows),
        "token_lag_hist": lag,
        "switched_frac": sum(c.get("switched", 0) for c in all_calls) / max(generations, 1),
        "engine_counters": engine,
    }


def run_one(s: Dict, mode: str, rep: int, model: str) -> Dict:
    from sao_actor_learner import builder
    from sao_actor_learner.run import run_program
    run_dir = os.path.join(FLAGS.out_dir, f"{mode}_r{rep}")
    config = make_config(s, mode, FLAGS.seed + rep, model, run_dir)
    factory = functools.partial(
        builder.make_program, actor_factory=functools.partial(
            make_bench_actor, length_mean=s["length_mean"], length_tail=s["length_tail"]))
    t = time.time()
    summary = run_program(config, factory, progress=False)
    out = measure_run(config, summary)
    out.update(mode=mode, repeat=rep, seed=config.seed, run_dir=run_dir,
               process_wall_s=time.time() - t, load_avg_1m=os.getloadavg()[0])
    print(f"  {mode:5s} r{rep}: {out['rollouts_per_s']:.2f} rollouts/s, "
          f"{out['tokens_per_s']:.0f} tokens/s, token staleness "
          f"{out['token_staleness_mean']:.2f}, rollout staleness "
          f"{out['rollout_staleness_mean']:.2f} (max {out['rollout_staleness_max']}), "
          f"regenerated {out['regenerated_frac']:.1%}, switched {out['switched_frac']:.1%}, "
          f"learner waiting {out['learner_wait_frac']:.1%}", flush=True)
    return out


STATS = ("rollouts_per_s", "tokens_per_s", "sampled_tokens_per_s", "regenerated_frac",
         "token_staleness_mean", "rollout_staleness_mean", "rollout_staleness_max",
         "learner_wait_frac", "switched_frac", "response_length_mean", "steps_per_s",
         "dropped_stale_frac")


def aggregate(runs: List[Dict]) -> Dict:
    out = {}
    for key in STATS:
        vals = [r[key] for r in runs]
        out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
                    "n": len(vals)}
    return out


def _fmt(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv):
    del argv
    s = settings()
    for mode in s["modes"]:
        if mode not in core.WEIGHT_SYNC_MODES:
            raise app.UsageError(f"--modes: {mode!r} is not one of {core.WEIGHT_SYNC_MODES}")
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    model = build_model(os.path.join(FLAGS.out_dir, f"model_{s['length_max'] + 32}"),
                        s["length_max"] + 32)
    load_before = os.getloadavg()
    print(f"lengths per generate call: Lomax mean {s['length_mean']} tail {s['length_tail']} cap "
          f"{s['length_max']}; {s['num_actors']} actors x {s['actor_batch']}, batch "
          f"{s['batch_size']}, {s['max_steps']} steps, max_staleness {s['max_staleness']}",
          flush=True)
    runs: Dict[str, List[Dict]] = {m: [] for m in s["modes"]}
    for rep in range(s["repeats"]):
        for mode in s["modes"]:
            runs[mode].append(run_one(s, mode, rep, model))
    results = {m: {**aggregate(rs), "runs": rs} for m, rs in runs.items()}

    print()
    header = (f"{'mode':>5} {'rollouts/s':>18} {'tokens/s':>16} {'regen':>6} {'tok stale':>10}"
              f" {'roll stale':>10} {'max':>4} {'dropped':>8} {'switched':>8}"
              f" {'learner wait':>12}")
    print(header)
    print("-" * len(header))
    for m, res in results.items():
        r = res["rollouts_per_s"]
        print(f"{m:>5} {_fmt(r['median'])} ({_fmt(r['min'])}..{_fmt(r['max'])})"
              f" {_fmt(res['tokens_per_s']['median'], 0):>16}"
              f" {100 * res['regenerated_frac']['median']:>5.1f}%"
              f" {_fmt(res['token_staleness_mean']['median']):>10}"
              f" {_fmt(res['rollout_staleness_mean']['median']):>10}"
              f" {res['rollout_staleness_max']['max']:>4}"
              f" {100 * res['dropped_stale_frac']['median']:>7.1f}%"
              f" {100 * res['switched_frac']['median']:>7.1f}%"
              f" {100 * res['learner_wait_frac']['median']:>11.1f}%")
    print(json.dumps({"benchmark": "interruptible", "settings": s, "seed": FLAGS.seed,
                      "smoke": FLAGS.smoke, "load_avg_before": list(load_before),
                      "load_avg_after": list(os.getloadavg()), "modes": results},
                     sort_keys=True))


if __name__ == "__main__":
    app.run(main)
