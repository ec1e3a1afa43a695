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
the critic's passes, the policy's LM head only where it runs; attention FLOPs left out).

Sizes: tiny (the arithmetic warm start's shape), small (the GSM-style workload's, 1.4M), 25m,
150m, qwen3-0.6b (hidden 1024, 28 layers, 16 heads x 128, 8 KV heads, FFN 3072, vocab 151936);
smollm2-135m loads checkpoints/smollm2-135m-instruct (`make real-model`: SmolLM2-135M-Instruct,
a Llama of 134.5M parameters, 30 layers, hidden 576, vocab 49152) with its pretrained weights.
The last line printed is one JSON object with every cell.

Packed vs padded micro-batches (config micro_batch_layout, learner/packing.py): --layouts=
padded,packed runs every cell in both layouts; --lengths_file takes the rollouts' lengths (and
prompt lengths) from a recorded length mix (programs/benchmarks/rollout_lengths.py; e.g.
results/learner_step/gsm_tiny_lengths.json, the gsm_tiny warm start's rollouts), --batch of them
drawn with a fixed seed, instead of --seq_len for every rollout. tokens/s counts real tokens (no
padding) in both layouts; the "ratios" printed last are packed over padded per cell.

The learner step's exact savings (config logprob_positions=actions: the policy step's LM head
reads only the hidden states that predict action tokens; critic_reuse_estimate_forward: the
first of the K critic steps reuses the estimate's forward): --savings=off,on runs every cell
without and with them; "savings_ratios" gives each part of the step (estimate, policy step,
critic steps) both ways. Both give the same parameters (tests/learner/test_exact_savings.py).

The critic off the policy's critical path (config critic_concurrent, learner/critic_worker.py:
the K critic steps in a thread of their own during the policy step, exact): --critic_concurrent=
off,on runs every cell both ways; --placement=learner:cpu0,critic:cpu1 pins the cell's process
to the learner's cores (its torch threads: one per core) and, in the "on" cells, the critic's
thread to its own. "concurrent_ratios" gives the sequential step over the concurrent one
(speedup), with critic_wait_s (the critic's seconds left on the critical path after the policy
step) and critic_overlap_frac. On a quiet machine:
    python programs/benchmarks/learner_step.py --sizes=small --micro_batch_tokens=0 \
        --dtypes=float32 --lengths_file=results/learner_step/gsm_tiny_lengths.json --batch=16 \
        --steps=5 --critic_concurrent=off,on --placement=learner:cpu0,critic:cpu1

LoRA vs full fine-tuning of the policy (config lora_rank, models/lora.py): --lora_ranks=0,16
runs every cell with full fine-tuning and rank-16 adapters (the architecture's default targets,
alpha = 2 x rank; the critic stays a full copy of the base body). Each cell also reports the
policy step's own seconds (policy_step_s) and the trainable parameters; model MiB includes the
optimisers' state (Adam's two moments of every trainable parameter), and "lora_ratios" compares
each rank with rank 0.
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
# Real model directories, loaded with their own weights (a Llama here; `make real-model`).
MODEL_DIRS = {"smollm2-135m": os.path.join(REPO, "checkpoints", "smollm2-135m-instruct")}

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["tiny", "small", "25m", "qwen3-0.6b"],
                  f"model shapes: {list(SIZES)}, or model directories: {list(MODEL_DIRS)}")
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
flags.DEFINE_list("layouts", ["padded"], "micro-batch layouts to compare: padded and/or packed "
                  "(config micro_batch_layout)")
flags.DEFINE_string("lengths_file", "", "a JSON length mix (rollout_lengths.py: lengths and "
                    "prompt_lengths) the rollouts' lengths are drawn from; empty: every rollout "
                    "--seq_len tokens")
flags.DEFINE_string("cell_layout", "padded", "internal: the layout of the --cell run")
flags.DEFINE_list("lora_ranks", ["0"], "policy LoRA ranks to compare (models/lora.py; the "
                  "architecture's default targets, alpha = 2 x rank); 0: full fine-tuning")
flags.DEFINE_integer("cell_lora_rank", 0, "internal: the LoRA rank of the --cell run")
flags.DEFINE_list("savings", ["on"], "the learner step's exact savings (logprob_positions="
                  "actions and critic_reuse_estimate_forward): on, off, or off,on to compare "
                  "them in one run (savings_ratios)")
flags.DEFINE_string("cell_savings", "on", "internal: the savings of the --cell run")
flags.DEFINE_integer("critic_minibatches", 1, "critic optimizer steps per epoch (the dataset "
                     "recipe's 2: the reused forward is then the first slice's)")
flags.DEFINE_list("critic_concurrent", ["off"], "the critic's K steps in sequence (off) or in a "
                  "thread of their own during the policy step (on), or off,on to compare "
                  "(concurrent_ratios)")
flags.DEFINE_string("cell_critic_concurrent", "off", "internal: critic_concurrent of the --cell run")
flags.DEFINE_list("placement", [], "learner:cpuN[-M] pins each cell's process (and sizes its torch "
                  "threads); critic:cpuN[-M] pins the concurrent critic's thread (config "
                  "--placement's critic entry)")
flags.DEFINE_integer("top_ops", 0, "profile one more step of each cell with torch.profiler and "
                     "report its N largest operators by self CPU time (0: no profile)")
flags.DEFINE_integer("max_cell_s", 1800, "a cell running longer than this is reported as such")


def run_cell(size: str, micro: int, dtype: str) -> dict:
    """Builds the learner for one cell in this process and times its steps."""
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sao_actor_learner.builder import assemble_learner
    from sao_actor_learner.config import SAOConfig
    from sao_actor_learner.learner_builder import critic_device
    from sao_actor_learner.models.value import ValueModel
    from sao_actor_learner.types import Rollout, collate

    concurrent = FLAGS.cell_critic_concurrent == "on"
    shapes = _rollout_shapes()   # (length, prompt length) per rollout
    config = SAOConfig(batch_size=FLAGS.batch, actor_batch=FLAGS.batch, max_steps=10,
                       micro_batch_tokens=micro, dtype=dtype, fused_logprobs=True,
                       micro_batch_layout=FLAGS.cell_layout,
                       gradient_checkpointing=FLAGS.gradient_checkpointing,
                       max_sequence_length=max([FLAGS.seq_len] + [n for n, _ in shapes]) + 1,
                       max_new_tokens=FLAGS.seq_len // 2,
                       logprob_positions="actions" if FLAGS.cell_savings == "on" else "all",
                       critic_reuse_estimate_forward=FLAGS.cell_savings == "on",
                       critic_minibatches=FLAGS.critic_minibatches,
                       critic_concurrent=concurrent,
                       placement=tuple(e for e in FLAGS.placement if e.startswith("critic:"))
                       if concurrent else ())   # checked against every core, before pinning
    learner_cores = _learner_cores()
    if learner_cores:   # before torch starts its threads: they inherit the cores
        os.sched_setaffinity(0, learner_cores)
    torch.set_num_threads(len(learner_cores) or FLAGS.threads)
    device = torch.device(FLAGS.device)
    shape = SIZES.get(size)
    torch.manual_seed(0)
    if size in MODEL_DIRS:   # a real model directory (its own weights; random-init otherwise)
        from sao_actor_learner.models import load_policy
        policy = load_policy(MODEL_DIRS[size])[0].train()
        shape = {"vocab_size": policy.config.vocab_size}
    else:
        policy = Qwen3ForCausalLM(Qwen3Config(**shape, tie_word_embeddings=True,
                                              max_position_embeddings=max(4096, FLAGS.seq_len)))
    policy.to(device)
    critic = ValueModel.from_policy(policy)
    critic.freeze(config.critic_frozen_patterns)
    critic.to(critic_device(config, device))   # critic:gpuN with --critic_concurrent=on
    if FLAGS.cell_lora_rank:   # after the critic's copy of the body: the critic stays full
        from sao_actor_learner.models import lora
        lora.add_adapters(policy, lora.LoraSpec(FLAGS.cell_lora_rank, 2.0 * FLAGS.cell_lora_rank))
    learner = assemble_learner(config, policy, critic)
    rng = np.random.default_rng(0)
    V, L = shape["vocab_size"], FLAGS.seq_len
    rollouts = [Rollout(tokens=rng.integers(0, V, size=L), action_mask=[0] * prompt + [1] *
                        (L - prompt), rollout_logp=[0.0] * prompt + [-5.0] * (L - prompt),
                        versions=[-1] * prompt + [0] * (L - prompt),
                        rewards=[0.0] * (L - 1) + [float(i % 2)], prompt_id=i)
                for i, (L, prompt) in enumerate(shapes)]
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
    times, policy_times = [], []
    parts = {k: [] for k in ("estimate_s", "critic_step_s", "critic_wait_s",
                             "critic_overlap_frac")}
    for i in range(FLAGS.steps + 1):
        t0 = time.perf_counter()
        stats = learner.update(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
            policy_times.append(stats["policy_step_s"])
            for key in parts:
                parts[key].append(stats[key])
    top_ops = _profile_step(learner, batch, FLAGS.top_ops) if FLAGS.top_ops else []
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step_s = statistics.median(times)
    tokens = sum(n for n, _ in shapes)   # real tokens: padding is not work done
    # policy fwd+bwd (6NP; with logprob_positions=actions the LM head, V x hidden, runs only at
    # the positions that predict an action token: one per response token), critic: one no-grad
    # forward (2NP; the first of M slices' part is the first critic step's when it is reused)
    # + K fwd+bwd (6NP each).
    head = policy.get_output_embeddings().weight.numel()
    head_positions = sum(n - prompt for n, prompt in shapes) \
        if config.logprob_positions == "actions" else tokens
    estimate_flops = 2 * (1 - 1 / config.critic_minibatches) \
        if config.critic_reuse_estimate_forward else 2
    flops = 6 * (params - head) * tokens + 6 * head * head_positions + \
        (estimate_flops + 6 * config.critic_updates) * critic_params * tokens
    out = {"size": size, "micro_batch_tokens": micro, "dtype": dtype, "device": FLAGS.device,
           "params": params, "critic_params": critic_params, "batch": FLAGS.batch,
           "critic_minibatches": config.critic_minibatches,
           "seq_len": L, "step_s": step_s, "tokens_per_s": tokens / step_s,
           "layout": FLAGS.cell_layout, "tokens": tokens,
           "lora_rank": FLAGS.cell_lora_rank, "policy_step_s": statistics.median(policy_times),
           **{key: statistics.median(v) for key, v in parts.items()},
           "savings": FLAGS.cell_savings, "top_ops": top_ops,
           "critic_concurrent": FLAGS.cell_critic_concurrent,
           "placement": ",".join(FLAGS.placement) if FLAGS.placement else "",
           "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
           "padded_tokens": len(shapes) * max(n for n, _ in shapes),
           "lengths_file": FLAGS.lengths_file,
           "peak_above_model_mib": max(peak - base, 0) / 2 ** 20,
           "model_mib": base / 2 ** 20, "policy_loss_finite": bool(np.isfinite(
               stats["policy_loss"])), "gradient_checkpointing": FLAGS.gradient_checkpointing}
    if device.type == "cuda":
        out["mfu"] = flops / step_s / (FLAGS.peak_tflops * 1e12)
    return out


def _learner_cores() -> tuple:
    """The cores --placement gives the learner (empty: not placed)."""
    from sao_actor_learner.config.sections import PROGRAM_GROUPS
    from sao_actor_learner.launch.placement import IN_PROCESS_GROUPS, parse_placement
    placement = parse_placement(FLAGS.placement, PROGRAM_GROUPS + IN_PROCESS_GROUPS)
    return placement["learner"].cpus if "learner" in placement else ()


def _profile_step(learner, batch, n: int) -> list:
    """One more learner step under torch.profiler: its n largest operators by self CPU time
    (name, calls, self seconds, share of the step's self time)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        learner.update(batch)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"op": e.key, "calls": e.count, "self_s": round(e.self_cpu_time_total / 1e6, 4),
             "share": round(e.self_cpu_time_total / total, 4)} for e in top]


def _rollout_shapes() -> list:
    """(length, prompt length) of each of the --batch rollouts: --seq_len (half prompt), or
    drawn from --lengths_file with seed 0 (without replacement when it holds enough)."""
    if not FLAGS.lengths_file:
        return [(FLAGS.seq_len, FLAGS.seq_len // 2)] * FLAGS.batch
    import numpy as np
    with open(FLAGS.lengths_file) as f:
        mix = json.load(f)
    lengths, prompts = mix["lengths"], mix["prompt_lengths"]
    pick = np.random.default_rng(0).choice(len(lengths), size=FLAGS.batch,
                                           replace=len(lengths) < FLAGS.batch)
    return [(int(lengths[i]), min(int(prompts[i]), int(lengths[i]) - 1)) for i in pick]


def _ratios(cells: list) -> list:
    """Packed over padded, per (size, micro-batch budget, dtype) measured in both layouts."""
    by_key = {}
    for c in cells:
        if "error" not in c:
            by_key.setdefault((c["size"], c["micro_batch_tokens"], c["dtype"],
                               c.get("lora_rank", 0), c.get("critic_concurrent", "off")), {})[
                c.get("layout", "padded")] = c
    out = []
    for (size, micro, dtype, _, _), pair in by_key.items():
        if {"padded", "packed"} <= set(pair):
            a, b = pair["padded"], pair["packed"]
            out.append({"size": size, "micro_batch_tokens": micro, "dtype": dtype,
                        "tokens_per_s_packed_over_padded": b["tokens_per_s"] / a["tokens_per_s"],
                        "peak_above_model_packed_over_padded":
                            b["peak_above_model_mib"] / max(a["peak_above_model_mib"], 1e-9)})
    return out


def _lora_ratios(cells: list) -> list:
    """Each LoRA rank against full fine-tuning (rank 0), per (size, micro-batch budget, dtype,
    layout) measured both ways."""
    by_key = {}
    for c in cells:
        if "error" not in c:
            by_key.setdefault((c["size"], c["micro_batch_tokens"], c["dtype"],
                               c.get("layout", "padded"), c.get("critic_concurrent", "off")),
                              {})[c.get("lora_rank", 0)] = c
    out = []
    for (size, micro, dtype, layout, _), by_rank in by_key.items():
        full = by_rank.get(0)
        for rank, c in sorted(by_rank.items()):
            if full is None or not rank:
                continue
            out.append({"size": size, "micro_batch_tokens": micro, "dtype": dtype,
                        "layout": layout, "lora_rank": rank,
                        "trainable_params": c["trainable_params"],
                        "step_s_lora_over_full": c["step_s"] / full["step_s"],
                        "policy_step_s_lora_over_full":
                            c["policy_step_s"] / full["policy_step_s"],
                        "model_mib_full": full["model_mib"], "model_mib_lora": c["model_mib"],
                        "peak_above_model_mib_full": full["peak_above_model_mib"],
                        "peak_above_model_mib_lora": c["peak_above_model_mib"]})
    return out


def _savings_ratios(cells: list) -> list:
    """The step with the exact savings over the step without, per cell measured both ways."""
    by_key = {}
    for c in cells:
        if "error" not in c:
            by_key.setdefault((c["size"], c["micro_batch_tokens"], c["dtype"], c["layout"],
                               c.get("lora_rank", 0), c.get("critic_concurrent", "off")),
                              {})[c.get("savings", "on")] = c
    out = []
    for (size, micro, dtype, layout, rank, _), pair in by_key.items():
        if {"off", "on"} <= set(pair):
            off, on = pair["off"], pair["on"]
            out.append({"size": size, "micro_batch_tokens": micro, "dtype": dtype,
                        "layout": layout, "lora_rank": rank,
                        **{f"{k}_off": off[k] for k in ("step_s", "estimate_s", "policy_step_s",
                                                        "critic_step_s")},
                        **{f"{k}_on": on[k] for k in ("step_s", "estimate_s", "policy_step_s",
                                                      "critic_step_s")},
                        "step_s_on_over_off": on["step_s"] / off["step_s"],
                        "peak_above_model_mib_off": off["peak_above_model_mib"],
                        "peak_above_model_mib_on": on["peak_above_model_mib"]})
    return out


def _concurrent_ratios(cells: list) -> list:
    """The sequential step over the concurrent one, per cell measured both ways."""
    by_key = {}
    for c in cells:
        if "error" not in c:
            by_key.setdefault((c["size"], c["micro_batch_tokens"], c["dtype"], c["layout"],
                               c.get("lora_rank", 0), c.get("savings", "on")), {})[
                c.get("critic_concurrent", "off")] = c
    out = []
    for (size, micro, dtype, layout, rank, saving), pair in by_key.items():
        if {"off", "on"} <= set(pair):
            off, on = pair["off"], pair["on"]
            out.append({"size": size, "micro_batch_tokens": micro, "dtype": dtype,
                        "layout": layout, "lora_rank": rank, "savings": saving,
                        **{f"{k}_off": off[k] for k in ("step_s", "policy_step_s",
                                                        "critic_step_s")},
                        **{f"{k}_on": on[k] for k in ("step_s", "policy_step_s",
                                                      "critic_step_s", "critic_wait_s",
                                                      "critic_overlap_frac")},
                        "speedup_off_over_on": off["step_s"] / on["step_s"]})
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
          f"{'tokens/s':>9} {'peak above model MiB':>21} {'model MiB':>10} {'layout':>7} "
          f"{'lora':>4} {'savings':>7} {'critic':>6}")
    for size in FLAGS.sizes:
        if size not in SIZES and size not in MODEL_DIRS:
            raise SystemExit(f"--sizes: unknown {size!r}; choose from "
                             f"{list(SIZES) + list(MODEL_DIRS)}")
        if size in MODEL_DIRS and not os.path.isdir(MODEL_DIRS[size]):
            raise SystemExit(f"--sizes={size}: {MODEL_DIRS[size]} is missing: run `make "
                             "real-model` first")
        for micro, layout, rank, saving, conc in [
                (m, la, int(r), sv, cc) for m in FLAGS.micro_batch_tokens for la in FLAGS.layouts
                for r in FLAGS.lora_ranks for sv in FLAGS.savings
                for cc in FLAGS.critic_concurrent]:
            for dtype in FLAGS.dtypes:
                args = [sys.executable, os.path.abspath(__file__),
                        f"--cell={size},{int(micro)},{dtype}", f"--cell_layout={layout}",
                        f"--cell_lora_rank={rank}", f"--cell_savings={saving}",
                        f"--cell_critic_concurrent={conc}"] + \
                    [a for a in sys.argv[1:] if not a.startswith("--cell")]
                try:
                    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO,
                                          timeout=FLAGS.max_cell_s,
                                          env={**os.environ, "OMP_NUM_THREADS":
                                               str(FLAGS.threads)})
                except subprocess.TimeoutExpired:
                    cells.append({"size": size, "micro_batch_tokens": int(micro),
                                  "dtype": dtype, "layout": layout, "lora_rank": rank,
                                  "savings": saving, "critic_concurrent": conc,
                                  "error": f"over {FLAGS.max_cell_s} s"})
                    continue
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                if proc.returncode or not lines:
                    cells.append({"size": size, "micro_batch_tokens": int(micro),
                                  "dtype": dtype, "layout": layout, "lora_rank": rank,
                                  "savings": saving, "critic_concurrent": conc,
                                  "error": proc.stderr.strip()[-300:]})
                    print(f"{size:<11} failed: {proc.stderr.strip()[-200:]}")
                    continue
                c = json.loads(lines[-1])
                cells.append(c)
                print(f"{size:<11} {c['params']:>11,} {c['micro_batch_tokens']:>6} "
                      f"{c['dtype']:>9} {c['step_s']:>8.3f} {c['tokens_per_s']:>9.0f} "
                      f"{c['peak_above_model_mib']:>21.1f} {c['model_mib']:>10.1f}"
                      f" {c['layout']:>7} {c['lora_rank']:>4} {c['savings']:>7}"
                      f" {'conc' if c['critic_concurrent'] == 'on' else 'seq':>6}")
    ratios = _ratios(cells)
    savings = _savings_ratios(cells)
    for r in savings:
        print(f"savings on/off {r['size']} micro {r['micro_batch_tokens']} {r['dtype']} "
              f"{r['layout']}: step {r['step_s_off']:.3f} -> {r['step_s_on']:.3f} s "
              f"(x{r['step_s_on_over_off']:.2f}); estimate {r['estimate_s_off']:.3f} -> "
              f"{r['estimate_s_on']:.3f}, policy {r['policy_step_s_off']:.3f} -> "
              f"{r['policy_step_s_on']:.3f}, critic {r['critic_step_s_off']:.3f} -> "
              f"{r['critic_step_s_on']:.3f}; peak above model "
              f"{r['peak_above_model_mib_off']:.0f} -> {r['peak_above_model_mib_on']:.0f} MiB")
    concurrent = _concurrent_ratios(cells)
    for r in concurrent:
        print(f"critic concurrent off/on {r['size']} micro {r['micro_batch_tokens']} "
              f"{r['dtype']} {r['layout']}: step {r['step_s_off']:.3f} -> {r['step_s_on']:.3f} s "
              f"(x{r['speedup_off_over_on']:.2f} faster); critic {r['critic_step_s_off']:.3f} -> "
              f"{r['critic_step_s_on']:.3f} s, of which {r['critic_wait_s_on']:.3f} s after the "
              f"policy step (overlap {r['critic_overlap_frac_on']:.2f})")
    lora_ratios = _lora_ratios(cells)
    for r in lora_ratios:
        print(f"lora {r['lora_rank']} / full, {r['size']} micro {r['micro_batch_tokens']} "
              f"{r['dtype']} {r['layout']}: step x{r['step_s_lora_over_full']:.2f}, policy step "
              f"x{r['policy_step_s_lora_over_full']:.2f}, model + optimizers "
              f"{r['model_mib_full']:.0f} -> {r['model_mib_lora']:.0f} MiB, peak above it "
              f"{r['peak_above_model_mib_full']:.0f} -> {r['peak_above_model_mib_lora']:.0f} MiB")
    for r in ratios:
        print(f"packed/padded {r['size']} micro {r['micro_batch_tokens']} {r['dtype']}: "
              f"tokens/s x{r['tokens_per_s_packed_over_padded']:.2f}, peak above model "
              f"x{r['peak_above_model_packed_over_padded']:.2f}")
    print(json.dumps({"benchmark": "learner_step", "device": FLAGS.device,
                      "batch": FLAGS.batch, "seq_len": FLAGS.seq_len, "threads": FLAGS.threads,
                      "lengths_file": FLAGS.lengths_file, "cells": cells, "ratios": ratios,
                      "lora_ratios": lora_ratios, "savings_ratios": savings,
                      "concurrent_ratios": concurrent}))


if __name__ == "__main__":
    app.run(main)
