"""Records the rollout length mix of a policy on a task, for learner_step.py --lengths_file.

    python programs/benchmarks/rollout_lengths.py --task=dataset \
        --train_files=data/gsm_tiny/train.parquet --eval_files=data/gsm_tiny/test.parquet \
        --reward=gsm8k --max_new_tokens=96 --model=checkpoints/warm_start_dataset \
        --prompts=256 --out=results/learner_step/gsm_tiny_lengths.json

Samples one rollout (temperature 1) of each of --prompts distinct training prompts with the
actors' own episode loop (critic/rollout_set.sample_rollouts, the torch engine) and writes a JSON
file: per rollout its length (prompt + response tokens) and its prompt length, the settings, and
summary statistics. Every SAOConfig field is a flag (the task, its files, the model, the token
limits), as in programs/pretrain_critic.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# This folder is not a package: its kernels.py must not shadow the `kernels` package.
sys.path = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") !=
                     os.path.dirname(os.path.abspath(__file__))]

from absl import app, flags  # noqa: E402

from sao_actor_learner.config import ConfigError, SAOConfig  # noqa: E402
from sao_actor_learner.flags import config_from_flags, define_flags_from_dataclass  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    define_flags_from_dataclass(SAOConfig)
    flags.DEFINE_integer("prompts", 256, "Distinct training prompts, one rollout each.")
    flags.DEFINE_string("out", "results/learner_step/gsm_tiny_lengths.json",
                        "The JSON file to write.")


def main(argv) -> None:
    del argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch

    from sao_actor_learner.builder import make_engine, make_task, sampling_params
    from sao_actor_learner.critic.probe import distinct_prompts
    from sao_actor_learner.critic.rollout_set import sample_rollouts

    try:
        config = config_from_flags(SAOConfig)
        if not config.model:
            raise ConfigError("--model: the policy whose rollouts are measured (e.g. "
                              "checkpoints/warm_start_dataset)")
        if FLAGS.prompts < 1:
            raise ConfigError(f"--prompts={FLAGS.prompts}: must be >= 1")
    except ConfigError as e:
        sys.exit(f"invalid configuration: {e}")
    torch.set_num_threads(max(1, config.threads_per_process))
    torch.manual_seed(config.seed)
    t0 = time.time()
    engine = make_engine(config, "actor_0")
    task = make_task(config, tokenizer=engine.tokenizer)
    try:
        chosen = distinct_prompts(task, FLAGS.prompts, config.seed)
        params = dataclasses.replace(sampling_params(config, stop_ids=engine.tokenizer.stop_ids),
                                     temperature=1.0, top_p=1.0, seed=config.seed)
        rollouts = sample_rollouts(engine, task, chosen, params, batch=64,
                                   max_turns=config.max_turns,
                                   max_total_tokens=config.max_sequence_length)
    finally:
        task.close()
    lengths = np.array([r.length for r in rollouts])
    prompt_lengths = np.array([int(np.argmax(r.action_mask)) if r.action_mask.any()
                               else r.length for r in rollouts])
    out = {"model": config.model, "task": config.task, "train_files": list(config.train_files),
           "max_new_tokens": config.max_new_tokens,
           "max_sequence_length": config.max_sequence_length, "temperature": 1.0,
           "seed": config.seed, "rollouts": len(rollouts), "sample_s": time.time() - t0,
           "length_mean": float(lengths.mean()), "length_min": int(lengths.min()),
           "length_max": int(lengths.max()),
           "length_p50_p90_p99": [float(x) for x in np.percentile(lengths, [50, 90, 99])],
           "padding_fraction_batch32": _padding_fraction(lengths, 32),
           "lengths": lengths.tolist(), "prompt_lengths": prompt_lengths.tolist()}
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k not in ("lengths", "prompt_lengths")}))


def _padding_fraction(lengths, batch: int):
    """Mean over consecutive batches of `batch` rollouts of the padded share of [batch, max]."""
    fractions = []
    for i in range(0, len(lengths) - batch + 1, batch):
        part = lengths[i:i + batch]
        fractions.append(1.0 - float(part.sum()) / (len(part) * float(part.max())))
    return sum(fractions) / len(fractions) if fractions else None


if __name__ == "__main__":
    define_flags()
    app.run(main)
