"""Peak memory and time of one SAO learner step, per model size, micro-batch budget and dtype.

    python programs/benchmarks/learner_step.py                       # the CPU grid below
    python programs/benchmarks/learner_step.py --sizes=qwen3-0.6b --batch=8 --seq_len=1024 \
        --micro_batch_tokens=0,4096 --dtypes=bfloat16 --device=cuda  # on a GPU

One learner step = the SAO update on one batch: critic values and GAE, the policy step (DIS,
fused log-probs) and K=2 critic steps, over micro-batches of at most --micro_batch_tokens padded
tokens. Each cell runs in its own process on a random-init Qwen3 of the named shape (tied
embeddings, as the small Qwen3 checkpoints), `--steps` steps after one untimed step. Reported:
seconds per step (median), tokens/s, the process's peak memory above what it held after
building the model, critic and optimisers (CPU: peak RSS from getrusage, which includes the
allocator's cache; CUDA: torch.cuda.max_memory_allocated), and on CUDA the model FLOPs
utilisation against --peak_tflops (6 x parameters x tokens for the policy, the same for each of
the critic's passes; attention FLOPs left out).

Sizes: tiny (the arithmetic warm start's shape), small (the GSM-style workload's, 1.4M), 25m,
150m, qwen3-0.6b (hidden 1024, 28 layers, 16 heads x 128, 8 KV heads, FFN 3072, vocab 151936).
The last line printed is one JSON object with every cell.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app, flags

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# This folder is not a package: its kernels.py must not shadow the `kernels` package that
# transformers looks for.
sys.path = [REPO] + [p for p in sys.path if os.path.abspath(p or ".") !=
                     os.path.dirname(os.path.abspath(__file__))]

SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=32, intermediate_size=256, vocab_size=64),
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=512, vocab_size=3000),
    "25m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, intermediate_size=1536, vocab_size=16384),
    "150m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, intermediate_size=2304, vocab_size=65536),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=151936),
}

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["tiny", "small", "25m", "qwen3-0.6b"], f"model shapes: {list(SIZES)}")
flags.DEFINE_list("micro_batch_tokens", ["0", "1024"], "micro-batch budgets (0: whole batch)")
flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "float32 and/or bfloat16")
flags.DEFINE_integer("batch", 8, "rollouts per step")
flags.DEFINE_integer("seq_len", 256, "tokens per rollout (half prompt, half response)")
flags.DEFINE_integer("steps", 2, "timed steps per cell (after one untimed step)")
flags.DEFINE_string("device", "cpu", "cpu or cuda")
flags.DEFINE_integer("threads", 2, "torch threads per cell (CPU)")
flags.DEFINE_float("peak_tflops", 989.0, "the device's dense bf16 peak for MFU (H200: 989)")
flags.DEFINE_bool("gradient_checkpointing", False, "recompute activations in the backward")
flags.DEFINE_string("cell", "", "internal: run one cell (size,micro,dtype) and print its JSON")
flags.DEFINE_integer("max_cell_s", 1800, "a cell running longer than this is reported as such")


def run_cell(size: str, micro: int, dtype: str) -> dict:
    """Builds the learner for one cell in this process and times its steps."""
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sao_actor_learner.builder import assemble_learner
    from sao_actor_learner.config import SAOConfig
    from sao_actor_learner.models.value import ValueModel
    from sao_actor_learner.types import Rollout, collate

    torch.set_num_threads(FLAGS.threads)
    device = torch.device(FLAGS.device)
    shape = SIZES[size]
    torch.manual_seed(0)
    policy = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=True,
                                          max_position_embeddings=max(4096, FLAGS.seq_len)))
    policy.to(device)
    config = SAOConfig(batch_size=FLAGS.batch, actor_batch=FLAGS.batch, max_steps=10,
                       micro_batch_tokens=micro, dtype=dtype, fused_logprobs=True,
                       gradient_checkpointing=FLAGS.gradient_checkpointing,
                       max_sequence_length=FLAGS.seq_len + 1, max_new_tokens=FLAGS.seq_len // 2)
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    critic.to(device)
    learner = assemble_learner(config, policy, critic)
    rng = np.random.default_rng(0)
    V, L = shape["vocab_size"], FLAGS.seq_len
    prompt = L // 2
    rollouts = [Rollout(tokens=rng.integers(0, V, size=L), action_mask=[0] * prompt + [1] *
                        (L - prompt), rollout_logp=[0.0] * prompt + [-5.0] * (L - prompt),
                        versions=[-1] * prompt + [0] * (L - prompt),
                        rewards=[0.0] * (L - 1) + [float(i % 2)], prompt_id=i)
                for i in range(FLAGS.batch)]
    batch = collate(rollouts).to(device)
    params = sum(p.numel() for p in policy.parameters())
    critic_params = sum(p.numel() for p in critic.parameters())
    for opt in (learner.policy_trainer.optimizer, learner.estimator.optimizer):
        for group in opt.param_groups:   # allocate Adam's state before the baseline reading
            for p in group["params"]:
                opt.state[p]["exp_avg"] = torch.zeros_like(p)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)
                opt.state[p]["step"] = torch.tensor(0.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times = []
    for i in range(FLAGS.steps + 1):
        t0 = time.perf_counter()
        stats = learner.update(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step_s = statistics.median(times)
    tokens = FLAGS.batch * L
    # policy fwd+bwd (6NP), critic: one no-grad forward (2NP) + K fwd+bwd (6NP each).
    flops = 6 * params * tokens + (2 + 6 * config.critic_updates) * critic_params * tokens
    out = {"size": size, "micro_batch_tokens": micro, "dtype": dtype, "device": FLAGS.device,
           "params": params, "critic_params": critic_params, "batch": FLAGS.batch,
           "seq_len": L, "step_s": step_s, "tokens_per_s": tokens / step_s,
           "peak_above_model_mib": max(peak - base, 0) / 2 ** 20,
           "model_mib": base / 2 ** 20, "policy_loss_finite": bool(np.isfinite(
               stats["policy_loss"])), "gradient_checkpointing": FLAGS.gradient_checkpointing}
    if device.type == "cuda":
        out["mfu"] = flops / step_s / (FLAGS.peak_tflops * 1e12)
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv):
    del argv
    if FLAGS.cell:
        size, micro, dtype = FLAGS.cell.split(",")
        print(json.dumps(run_cell(size, int(micro), dtype)))
        return
    cells = []
    print(f"{'size':<11} {'params':>11} {'micro':>6} {'dtype':>9} {'s/step':>8} "
          f"{'tokens/s':>9} {'peak above model MiB':>21} {'model MiB':>10}")
    for size in FLAGS.sizes:
        if size not in SIZES:
            raise SystemExit(f"--sizes: unknown {size!r}; choose from {list(SIZES)}")
        for micro in FLAGS.micro_batch_tokens:
            for dtype in FLAGS.dtypes:
                args = [sys.executable, os.path.abspath(__file__),
                        f"--cell={size},{int(micro)},{dtype}"] + \
                    [a for a in sys.argv[1:] if not a.startswith("--cell")]
                try:
                    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO,
                                          timeout=FLAGS.max_cell_s,
                                          env={**os.environ, "OMP_NUM_THREADS":
                                               str(FLAGS.threads)})
                except subprocess.TimeoutExpired:
                    cells.append({"size": size, "micro_batch_tokens": int(micro),
                                  "dtype": dtype, "error": f"over {FLAGS.max_cell_s} s"})
                    continue
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode or not lines:
                    cells.append({"size": size, "micro_batch_tokens": int(micro),
                                  "dtype": dtype, "error": proc.stderr.strip()[-300:]})
                    print(f"{size:<11} failed: {proc.stderr.strip()[-200:]}")
                    continue
                c = json.loads(lines[-1])
                cells.append(c)
                print(f"{size:<11} {c['params']:>11,} {c['micro_batch_tokens']:>6} "
                      f"{c['dtype']:>9} {c['step_s']:>8.3f} {c['tokens_per_s']:>9.0f} "
                      f"{c['peak_above_model_mib']:>21.1f} {c['model_mib']:>10.1f}")
    print(json.dumps({"benchmark": "learner_step", "device": FLAGS.device,
                      "batch": FLAGS.batch, "seq_len": FLAGS.seq_len, "threads": FLAGS.threads,
                      "cells": cells}))


if __name__ == "__main__":
    app.run(main)
