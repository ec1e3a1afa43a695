"""Evaluates the policy versions a run recorded (--evaluator=record), after the run.

  python programs/sao.py ... --evaluator=record --eval_every=2 --run_dir=runs/x
  python programs/evaluate_versions.py --run_dir=runs/x

The run's own config (run_dir/config.json) gives the task, held-out prompts, model and
completion length; each version in run_dir/policy_versions/ (sao_actor_learner/actors/
version_recorder.py) is loaded into a torch engine and scored with the evaluator's greedy
evaluation (actors/evaluator.evaluate), version 0 from the model the run started from. Nothing
of this touches the run's training clock. Writes run_dir/versions_eval.jsonl (one row per
version: policy_version, eval_accuracy, eval_size, recorded_time, eval_time_s) and prints it as
one JSON line. --up_to_time drops versions recorded after that Unix time (a budget's end).
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

from sao_actor_learner.config import SAOConfig

FLAGS = flags.FLAGS


def define_flags() -> None:   # not on import: tests import this module beside other flags
    flags.DEFINE_string("run_dir", None, "A run folder whose run used --evaluator=record.")
    flags.DEFINE_float("up_to_time", 0.0, "Only versions recorded at or before this Unix time "
                       "(0: all).")
    flags.DEFINE_integer("threads", 2, "torch threads.")


def evaluate_versions(run_dir: str, up_to_time: float = 0.0, threads: int = 2) -> list:
    """[{policy_version, eval_accuracy, eval_size, recorded_time, eval_time_s}] of the run's
    version 0 and recorded versions, in version order."""
    import torch

    from sao_actor_learner.actors.evaluator import evaluate
    from sao_actor_learner.actors.version_recorder import read_index, version_path
    from sao_actor_learner.builder import make_engine, make_task, sampling_params
    from sao_actor_learner.models.checkpoint import bytes_to_state_dict

    config_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} does not exist: --run_dir must be a run folder")
    with open(config_path) as f:
        config = SAOConfig.from_json(f.read()).replace(engine="torch")
    index = [r for r in read_index(run_dir) if not up_to_time or r["time"] <= up_to_time]
    if not index and config.evaluator != "record":
        raise ValueError(f"{run_dir} holds no recorded versions: its run used "
                         f"--evaluator={config.evaluator}; record with --evaluator=record")
    torch.set_num_threads(threads)
    engine = make_engine(config, role="evaluator", run_dir=run_dir)
    task = make_task(config, tokenizer=engine.tokenizer)
    prompts = task.eval_prompts()
    params = sampling_params(config, greedy=True, stop_ids=engine.tokenizer.stop_ids)
    limits = dict(max_turns=config.max_turns, max_total_tokens=config.max_sequence_length,
                  env_threads=config.env_threads)
    versions = [{"version": 0, "time": None}] + [r for r in index if r["version"] != 0]
    rows = []
    try:
        for entry in sorted(versions, key=lambda r: r["version"]):
            v = entry["version"]
            if v != 0:
                with open(version_path(run_dir, v), "rb") as f:
                    engine.load_weights(bytes_to_state_dict(f.read()), v)
            t0 = time.time()
            acc = evaluate(engine, task, prompts, params, **limits)
            rows.append({"kind": "eval", "policy_version": v, "eval_accuracy": acc,
                         "eval_size": len(prompts), "recorded_time": entry["time"],
                         "eval_time_s": round(time.time() - t0, 3)})
    finally:
        task.close()
        engine.close()
    with open(os.path.join(run_dir, "versions_eval.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def main(argv):
    del argv
    if not FLAGS.run_dir:
        sys.exit("--run_dir is required")
    try:
        rows = evaluate_versions(FLAGS.run_dir, FLAGS.up_to_time, FLAGS.threads)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(str(e))
    print(json.dumps({"run_dir": FLAGS.run_dir, "evals": rows}))


if __name__ == "__main__":
    define_flags()
    app.run(main)
