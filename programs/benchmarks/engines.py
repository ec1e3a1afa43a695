r"""Side by side: the vLLM engine (a CPU vLLM server in .venv-vllm) vs the torch engine.

Both engines serve the same tiny model (default: the arithmetic warm start, a 2-layer Llama,
hidden 128, ~0.5M parameters) in one run, one after the other (never concurrently):

  actor   --actor_batch prompts ("a+b=") x at most --actor_new_tokens tokens, temperature 1:
          what an arithmetic actor asks for (the warm start usually answers in ~3 tokens + <eos>).
  long    --long_batch prompts x at most --long_new_tokens tokens, temperature 1, on the same
          weights with the <eos> row of the LM head zeroed and the head scaled x20 (so <eos> is
          rare and most rows run to the limit): throughput when batches are big.
  log-probs  max |Generation.logprobs - log_softmax(logits / T)| of a teacher-forced
          transformers forward of the same weights, over the last call of each workload.
  update  load_weights of a full state dict (validated, then pushed), --updates times,
          alternating two weight sets; median and p90 seconds. The torch engine copies into the
          module in place; the vLLM engine checks names/shapes/dtypes/finiteness, writes a
          safetensors file to /dev/shm and runs pause / start / update / finish / reset prefix
          cache / resume over HTTP.

tokens/s = generated tokens / wall time of the generate calls (median over --rounds rounds,
after one untimed warm-up call). The torch engine runs in this process on 1 thread; the vLLM
server runs in its own processes (api server + engine core) with OMP_NUM_THREADS=1. Ends with one
JSON line of figures.

  OMP_NUM_THREADS=1 .venv/bin/python programs/benchmarks/engines.py
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "checkpoints/warm_start",
                    "Checkpoint folder both engines serve (save_checkpoint / programs/sft.py).")
flags.DEFINE_integer("actor_batch", 8, "Prompts per generate call in the actor workload.")
flags.DEFINE_integer("actor_new_tokens", 8, "max_new_tokens of the actor workload.")
flags.DEFINE_integer("long_batch", 64, "Prompts per generate call in the long workload.")
flags.DEFINE_integer("long_new_tokens", 100, "max_new_tokens of the long workload.")
flags.DEFINE_integer("rounds", 10, "Timed generate calls per workload and engine.")
flags.DEFINE_integer("updates", 20, "Timed weight updates per engine.")
flags.DEFINE_string("weight_sync_mode", "keep", "VLLMEngine weight_sync_mode.")
flags.DEFINE_integer("seed", 0, "Seed of the prompts and of sampling.")


def _prompts(tokenizer, n: int, seed: int) -> List[List[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [tokenizer.encode(f"{a}+{b}=") for a, b in rng.integers(0, 100, size=(n, 2))]


def _long_weights(state_dict):
    """The same weights with <eos> (id 2) practically never sampled."""
    out = {k: v.clone() for k, v in state_dict.items()}
    out["lm_head.weight"].mul_(20.0)
    out["lm_head.weight"][2] = 0.0
    return out


def _throughput(engine, prompts, params, rounds: int, model) -> Dict[str, float]:
    engine.generate(prompts, params)  # warm-up (first shapes)
    rates, tokens = [], []
    for r in range(rounds):
        p = dataclasses.replace(params, seed=params.seed + r + 1)
        t0 = time.perf_counter()
        gens = engine.generate(prompts, p)
        dt = time.perf_counter() - t0
        n = sum(len(g.tokens) for g in gens)
        rates.append(n / dt)
        tokens.append(n / len(gens))
    return {"tokens_per_s": statistics.median(rates), "tokens_per_row": statistics.mean(tokens),
            "logprob_max_abs_err": _logprob_error(model, prompts, gens, params.temperature)}


def _logprob_error(model, prompts, gens, temperature: float) -> float:
    """max |engine log-prob - teacher-forced log_softmax(logits / T)| over the last call."""
    import torch

    worst = 0.0
    with torch.no_grad():
        for prompt, g in zip(prompts, gens):
            logits = model(input_ids=torch.tensor([list(prompt) + g.tokens])).logits[0].float()
            logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
            ref = logp.gather(-1, torch.tensor(g.tokens)[:, None])[:, 0]
            worst = max(worst, float((torch.tensor(g.logprobs) - ref).abs().max()))
    return worst


def _update_latency(engine, weights: List[dict], n: int) -> Dict[str, float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        engine.load_weights(weights[i % len(weights)], version=engine.version + 1)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"update_median_s": statistics.median(times),
            "update_p90_s": times[min(len(times) - 1, int(0.9 * len(times)))]}


def run_engine(name: str, engine, tokenizer, base: dict, model) -> Dict[str, float]:
    from sao_actor_learner.core import SamplingParams

    out: Dict[str, float] = {}
    model.load_state_dict(base)
    actor = _throughput(engine, _prompts(tokenizer, FLAGS.actor_batch, FLAGS.seed),
                        SamplingParams(max_new_tokens=FLAGS.actor_new_tokens, temperature=1.0,
                                       seed=FLAGS.seed), FLAGS.rounds, model)
    out.update({f"actor_{k}": v for k, v in actor.items()})
    long_sd = _long_weights(base)
    out.update(_update_latency(engine, [base, long_sd], FLAGS.updates))  # ends on long_sd
    model.load_state_dict(long_sd)
    long = _throughput(engine, _prompts(tokenizer, FLAGS.long_batch, FLAGS.seed + 1),
                       SamplingParams(max_new_tokens=FLAGS.long_new_tokens, temperature=1.0,
                                      seed=FLAGS.seed), max(2, FLAGS.rounds // 3), model)
    out.update({f"long_{k}": v for k, v in long.items()})
    logging.info("%s: %s", name, out)
    return out


def main(argv):
    del argv
    import torch

    from sao_actor_learner.engines import TorchEngine, VLLMEngine
    from sao_actor_learner.models import load_policy

    torch.set_num_threads(1)
    if not os.path.exists(os.path.join(FLAGS.checkpoint, "config.json")):
        sys.exit(f"--checkpoint={FLAGS.checkpoint!r} is not a checkpoint folder; build the warm "
                 "start with `make warm-start`")
    model, tokenizer = load_policy(FLAGS.checkpoint)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    n_params = sum(v.numel() for v in base.values())

    results: Dict[str, Dict[str, float]] = {}
    torch_engine = TorchEngine.from_checkpoint(FLAGS.checkpoint)
    results["torch"] = run_engine("torch", torch_engine, tokenizer, base, model)
    del torch_engine

    t0 = time.perf_counter()
    log = os.path.join(tempfile.gettempdir(), f"sao_bench_vllm_{os.getpid()}.log")
    with VLLMEngine.from_checkpoint(FLAGS.checkpoint, weight_sync_mode=FLAGS.weight_sync_mode,
                                    log_path=log, seed=FLAGS.seed) as vllm_engine:
        start_s = time.perf_counter() - t0
        results["vllm"] = run_engine("vllm", vllm_engine, tokenizer, base, model)
    results["vllm"]["server_start_s"] = start_s

    print(f"\nSame model ({FLAGS.checkpoint}, {n_params} parameters), one run; tokens/s is the "
          f"median of {FLAGS.rounds} calls (long: {max(2, FLAGS.rounds // 3)})\n")
    rows = [
        (f"actor: {FLAGS.actor_batch} prompts x <={FLAGS.actor_new_tokens} tok, tokens/s",
         "actor_tokens_per_s", "{:.0f}"),
        ("actor: tokens per row", "actor_tokens_per_row", "{:.1f}"),
        (f"long: {FLAGS.long_batch} prompts x <={FLAGS.long_new_tokens} tok, tokens/s",
         "long_tokens_per_s", "{:.0f}"),
        ("long: tokens per row", "long_tokens_per_row", "{:.1f}"),
        ("log-prob max |err| vs teacher forcing (actor)", "actor_logprob_max_abs_err", "{:.1e}"),
        ("log-prob max |err| vs teacher forcing (long)", "long_logprob_max_abs_err", "{:.1e}"),
        ("weight update, median s", "update_median_s", "{:.4f}"),
        ("weight update, p90 s", "update_p90_s", "{:.4f}"),
    ]
    print(f"{'':<48}{'torch':>10}{'vllm':>10}{'vllm/torch':>12}")
    for label, key, fmt in rows:
        a, b = results["torch"][key], results["vllm"][key]
        ratio = f"{b / a:>12.2f}" if a else f"{'':>12}"
        print(f"{label:<48}{fmt.format(a):>10}{fmt.format(b):>10}{ratio}")
    print(f"{'vllm server start, s':<48}{'':>10}{start_s:>10.1f}\n")
    figures = {"checkpoint": FLAGS.checkpoint, "parameters": n_params, "rounds": FLAGS.rounds,
               "updates": FLAGS.updates, "weight_sync_mode": FLAGS.weight_sync_mode}
    for engine_name, figs in results.items():
        figures.update({f"{engine_name}_{k}": float(f"{v:.4g}") for k, v in figs.items()})
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    app.run(main)
