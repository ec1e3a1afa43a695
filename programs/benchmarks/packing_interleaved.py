"""Packed vs padded learner steps, timed interleaved in one process (load-robust time ratio).

    OMP_NUM_THREADS=1 python programs/benchmarks/packing_interleaved.py --sizes=small \
        --micro_batch_tokens=0,1024 --dtypes=float32 --batch=32 \
        --lengths_file=results/learner_step/gsm_tiny_lengths.json --steps=8 --threads=1

learner_step.py runs each layout in a process of its own, one after the other, which is what
peak memory needs, but on a shared machine the load moves between the two processes and their
times by tens of percent. Here one process builds two SAO learners from the same random-init
Qwen3 weights (learner_step.py's shapes and flags: --sizes, --micro_batch_tokens, --dtypes,
--batch, --seq_len or --lengths_file, --threads), one with micro_batch_layout=padded and one
with packed, and alternates their steps on the same batch (one untimed step each first), so both
see the same load. Reported per cell: the median seconds per step of each layout, tokens/s (real
tokens) and the packed/padded ratio of the medians, plus the ratio of every adjacent pair of
steps (its median and range). The last line printed is one JSON object.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import statistics
import sys
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("learner_step", os.path.join(HERE,
                                                                          "learner_step.py"))
learner_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learner_step)   # its flags, SIZES and _rollout_shapes (and sys.path)

FLAGS = flags.FLAGS


def run_pair(size: str, micro: int, dtype: str) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sao_actor_learner.builder import assemble_learner
    from sao_actor_learner.config import SAOConfig
    from sao_actor_learner.models.value import ValueModel
    from sao_actor_learner.types import Rollout, collate

    torch.set_num_threads(FLAGS.threads)
    shape = learner_step.SIZES[size]
    shapes = learner_step._rollout_shapes()
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=True,
                                        max_position_embeddings=4096))
    learners = {}
    for layout in ("padded", "packed"):
        policy = copy.deepcopy(base)
        config = SAOConfig(batch_size=FLAGS.batch, actor_batch=FLAGS.batch, max_steps=10,
                           micro_batch_tokens=micro, dtype=dtype, micro_batch_layout=layout,
                           max_sequence_length=max(n for n, _ in shapes) + 1)
        critic = ValueModel.from_policy(policy)
        critic.freeze(config.critic_frozen_patterns)
        learners[layout] = assemble_learner(config, policy, critic)
    rng = np.random.default_rng(0)
    V = shape["vocab_size"]
    batch = collate([Rollout(tokens=rng.integers(0, V, size=L),
                             action_mask=[0] * p + [1] * (L - p),
                             rollout_logp=[0.0] * p + [-5.0] * (L - p),
                             versions=[-1] * p + [0] * (L - p),
                             rewards=[0.0] * (L - 1) + [float(i % 2)], prompt_id=i)
                     for i, (L, p) in enumerate(shapes)])
    times = {"padded": [], "packed": []}
    for i in range(FLAGS.steps + 1):
        for layout in (("padded", "packed") if i % 2 == 0 else ("packed", "padded")):
            t0 = time.perf_counter()
            learners[layout].update(batch)
            if i:
                times[layout].append(time.perf_counter() - t0)
    tokens = sum(n for n, _ in shapes)
    med = {k: statistics.median(v) for k, v in times.items()}
    pair_ratios = [a / b for a, b in zip(times["padded"], times["packed"])]
    return {"size": size, "micro_batch_tokens": micro, "dtype": dtype, "batch": FLAGS.batch,
            "tokens": tokens, "padded_tokens": len(shapes) * max(n for n, _ in shapes),
            "steps": FLAGS.steps, "padded_step_s": med["padded"],
            "packed_step_s": med["packed"],
            "padded_tokens_per_s": tokens / med["padded"],
            "packed_tokens_per_s": tokens / med["packed"],
            "tokens_per_s_packed_over_padded": med["padded"] / med["packed"],
            "pair_ratio_median": statistics.median(pair_ratios),
            "pair_ratio_min": min(pair_ratios), "pair_ratio_max": max(pair_ratios),
            "padded_times": times["padded"], "packed_times": times["packed"]}


def main(argv):
    del argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cells = []
    for size in FLAGS.sizes:
        if size not in learner_step.SIZES:
            raise SystemExit(f"--sizes: {size!r} is not a random-init shape of learner_step.py "
                             f"({list(learner_step.SIZES)})")
        for micro in FLAGS.micro_batch_tokens:
            for dtype in FLAGS.dtypes:
                c = run_pair(size, int(micro), dtype)
                cells.append(c)
                print(f"{size} micro {micro} {dtype}: padded {c['padded_step_s']:.3f} s/step "
                      f"({c['padded_tokens_per_s']:.0f} tokens/s), packed "
                      f"{c['packed_step_s']:.3f} s/step ({c['packed_tokens_per_s']:.0f} "
                      f"tokens/s): packed/padded tokens/s x"
                      f"{c['tokens_per_s_packed_over_padded']:.2f} (adjacent pairs: median x"
                      f"{c['pair_ratio_median']:.2f}, {c['pair_ratio_min']:.2f}.."
                      f"{c['pair_ratio_max']:.2f})", flush=True)
    print(json.dumps({"benchmark": "packing_interleaved", "threads": FLAGS.threads,
                      "lengths_file": FLAGS.lengths_file, "cells": cells}))


if __name__ == "__main__":
    app.run(main)
