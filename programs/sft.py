"""Supervised warm start: trains a tiny model on the task's (imperfect) demonstrations.

  python programs/sft.py --task=arithmetic --out_dir=checkpoints/warm_start
  python programs/sft.py --task=calculator_tool --out_dir=checkpoints/warm_start_calculator_tool

Builds the char tokenizer and a tiny model, trains on demonstrations with the loss on answer
tokens only (prompt tokens are context), then measures on the held-out prompts:
  greedy_accuracy                    greedy decoding (temperature 0)
  sampled_accuracy                   temperature-1 samples, mean over all samples
  sampled_accuracy_on_greedy_wrong   temperature-1 samples on the prompts greedy gets wrong
and writes the checkpoint (models.checkpoint.save_checkpoint) plus `warm_start.json` with those
numbers and the settings. The demonstrations forget carries part of the time
(ArithmeticTask.carry_noise), so the model is partly right and RL has something to sharpen.

--task=calculator_tool trains on whole multi-turn episodes (tasks/calculator_tool.py): the loss
is on the teacher's actions (tool calls, answers, <eos>), never on the prompt or the tool's
observations. The teacher often answers sums in its head (wrongly) instead of calling the tool,
and sometimes miscopies the tool's result. Evaluation runs real episodes with the calculator
(actors.rollout.run_episodes, no tool latency) and reports greedy_accuracy (held-out success),
per kind, the rate of episodes that call the tool, and temperature-1 success.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Dict, List

# Runnable as a script from the repository root without installation.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from sao_actor_learner import core  # noqa: E402
from sao_actor_learner.actors.rollout import run_episodes  # noqa: E402
from sao_actor_learner.engines.torch_engine import TorchEngine  # noqa: E402
from sao_actor_learner.models import (CharTokenizer, count_parameters, make_tiny_model,  # noqa: E402
                                      save_checkpoint)
from sao_actor_learner.tasks import make_task  # noqa: E402
from sao_actor_learner.tasks.arithmetic import has_carry  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("task", "arithmetic", "Task to warm-start on.")
flags.DEFINE_string("out_dir", "", "Checkpoint folder to write; empty: checkpoints/warm_start "
                    "for arithmetic, checkpoints/warm_start_<task> for other tasks.")
flags.DEFINE_integer("steps", 2000, "Optimiser steps.")
flags.DEFINE_integer("batch_size", 64, "Demonstrations per step.")
flags.DEFINE_float("lr", 1e-3, "Peak AdamW learning rate (linear warm-up, cosine decay).")
flags.DEFINE_integer("warmup_steps", 50, "Linear learning-rate warm-up steps.")
flags.DEFINE_integer("seed", 0, "Seed for the model, the task split and the data.")
flags.DEFINE_enum("model_kind", "llama", ["llama", "qwen3_moe"], "Model family.")
flags.DEFINE_integer("hidden_size", 128, "Model width.")
flags.DEFINE_integer("num_layers", 2, "Decoder layers.")
flags.DEFINE_integer("num_heads", 4, "Attention heads (head_dim = hidden_size / num_heads >= 32).")
flags.DEFINE_integer("intermediate_size", 256, "MLP width.")
flags.DEFINE_float("carry_noise", 0.6, "Probability a demonstration forgets its carries.")
flags.DEFINE_integer("num_eval", 200, "Held-out prompts to evaluate on.")
flags.DEFINE_integer("eval_samples", 8, "Temperature-1 samples per held-out prompt.")
flags.DEFINE_integer("max_new_tokens", 0, "Generation budget (per turn) at evaluation; 0: the "
                     "task's default (arithmetic 8, calculator_tool 16).")
# calculator_tool: the teacher's imperfections (tasks/calculator_tool.py) and the episode limits.
flags.DEFINE_float("guess_prob_sum", 0.7, "calculator_tool: P(the teacher answers a sum in its "
                   "head instead of calling the tool).")
flags.DEFINE_float("guess_prob_product", 0.2, "calculator_tool: the same for products.")
flags.DEFINE_float("slip_prob", 0.1, "calculator_tool: P(the teacher miscopies one digit of the "
                   "tool's result).")
flags.DEFINE_float("typo_prob", 0.1, "calculator_tool: P(the teacher's first call is broken and "
                   "retried after the error observation).")
flags.DEFINE_integer("max_turns", 4, "calculator_tool: model turns per evaluation episode.")
flags.DEFINE_integer("max_total_tokens", 96, "calculator_tool: the longest evaluation episode.")

DEFAULT_MAX_NEW_TOKENS = {"arithmetic": 8, "calculator_tool": 16}
flags.DEFINE_integer("threads", 1, "torch.set_num_threads.")
flags.DEFINE_integer("log_every", 100, "Log the training loss every this many steps.")


def demonstration(task, rng: np.random.Generator):
    """(token ids, loss mask) of one demonstration of `task`; the mask marks trained tokens."""
    if task.name == "calculator_tool":
        return task.demonstration(rng)
    a, b = task.sample_operands(rng)
    prompt, answer = task.demonstration_tokens(a, b, rng)
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def make_batch(task, rng: np.random.Generator, batch_size: int, pad_id: int):
    """(input_ids [B, L], target mask [B, L]): right-padded demonstrations; the mask marks the
    action tokens (answers, tool calls, <eos>) whose prediction is trained."""
    seqs, masks = [], []
    for _ in range(batch_size):
        ids, mask = demonstration(task, rng)
        seqs.append(ids)
        masks.append(mask)
    width = max(len(s) for s in seqs)
    ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch_size, width), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, mask


def answer_loss(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the masked tokens, each predicted from the one before."""
    logits = model(input_ids=ids).logits[:, :-1].float()          # [B, L-1, V]
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]               # [B, L-1]
    target_mask = mask[:, 1:]
    return (nll * target_mask).sum() / target_mask.sum()


def evaluate(engine: TorchEngine, task, num_samples: int, max_new_tokens: int,
             seed: int) -> Dict[str, float]:
    """Greedy and temperature-1 held-out accuracies (see the module docstring)."""
    prompts = task.eval_prompts()
    ids = [list(p.token_ids) for p in prompts]
    greedy = engine.generate(ids, core.SamplingParams(max_new_tokens=max_new_tokens,
                                                      temperature=0.0))
    greedy_ok = np.array([task.is_correct(p, g.tokens) for p, g in zip(prompts, greedy)])
    sampled = engine.generate([x for x in ids for _ in range(num_samples)],
                              core.SamplingParams(max_new_tokens=max_new_tokens,
                                                  temperature=1.0, seed=seed))
    sample_ok = np.array([task.is_correct(prompts[i // num_samples], g.tokens)
                          for i, g in enumerate(sampled)]).reshape(len(prompts), num_samples)
    carry = np.array([has_carry(*map(int, p.text[:-1].split("+"))) for p in prompts])
    wrong = ~greedy_ok
    per_prompt = sample_ok.mean(axis=1)

    def mean(x):
        return float(x.mean()) if x.size else float("nan")

    return {
        "greedy_accuracy": mean(greedy_ok),
        "sampled_accuracy": mean(per_prompt),
        "sampled_accuracy_on_greedy_wrong": mean(per_prompt[wrong]),
        f"pass_at_{num_samples}_on_greedy_wrong": mean(sample_ok[wrong].any(axis=1)),
        "greedy_wrong_count": int(wrong.sum()),
        "greedy_accuracy_carry": mean(greedy_ok[carry]),
        "greedy_accuracy_no_carry": mean(greedy_ok[~carry]),
        "sampled_accuracy_carry": mean(per_prompt[carry]),
        "sampled_accuracy_no_carry": mean(per_prompt[~carry]),
        "eval_prompts": len(prompts),
        "eval_samples_per_prompt": num_samples,
    }


def evaluate_episodes(engine: TorchEngine, task, num_samples: int, max_new_tokens: int,
                      seed: int) -> Dict[str, float]:
    """Held-out success of whole tool-using episodes, greedy and at temperature 1."""
    prompts = task.eval_prompts()
    call_id = task.tokenizer.token_id("[")

    def episodes(prompt_list, temperature, sample_seed=None):
        params = core.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                     stop_token_ids=(task.tokenizer.eos_id,), seed=sample_seed)
        rollouts = run_episodes(engine, task, prompt_list, params, max_turns=FLAGS.max_turns,
                                max_total_tokens=FLAGS.max_total_tokens)
        ok = np.array([task.episode_success(r) for r in rollouts])
        used_tool = np.array([int(r.tokens[len(p.token_ids)]) == call_id
                              for r, p in zip(rollouts, prompt_list)])
        return ok, used_tool

    greedy_ok, greedy_tool = episodes(prompts, 0.0)
    sample_ok, sample_tool = episodes([p for p in prompts for _ in range(num_samples)], 1.0, seed)
    sample_ok = sample_ok.reshape(len(prompts), num_samples)
    sample_tool = sample_tool.reshape(len(prompts), num_samples)
    is_sum = np.array([task.kind_of(p) == "sum" for p in prompts])
    wrong = ~greedy_ok

    def mean(x):
        return float(x.mean()) if x.size else float("nan")

    return {
        "greedy_accuracy": mean(greedy_ok),
        "greedy_accuracy_sum": mean(greedy_ok[is_sum]),
        "greedy_accuracy_product": mean(greedy_ok[~is_sum]),
        "greedy_tool_use_sum": mean(greedy_tool[is_sum]),
        "greedy_tool_use_product": mean(greedy_tool[~is_sum]),
        "sampled_accuracy": mean(sample_ok),
        "sampled_accuracy_sum": mean(sample_ok[is_sum]),
        "sampled_accuracy_product": mean(sample_ok[~is_sum]),
        "sampled_tool_use_sum": mean(sample_tool[is_sum]),
        "sampled_tool_use_product": mean(sample_tool[~is_sum]),
        "sampled_accuracy_on_greedy_wrong": mean(sample_ok[wrong].mean(axis=1))
        if wrong.any() else float("nan"),
        f"pass_at_{num_samples}_on_greedy_wrong": mean(sample_ok[wrong].any(axis=1)),
        "greedy_wrong_count": int(wrong.sum()),
        "eval_prompts": len(prompts),
        "eval_samples_per_prompt": num_samples,
    }


def main(argv: List[str]) -> None:
    del argv
    torch.set_num_threads(FLAGS.threads)
    start = time.time()
    tokenizer = CharTokenizer()
    if FLAGS.task == "calculator_tool":
        task_kwargs = dict(guess_prob={"sum": FLAGS.guess_prob_sum,
                                       "product": FLAGS.guess_prob_product},
                           slip_prob=FLAGS.slip_prob, typo_prob=FLAGS.typo_prob)
    else:
        task_kwargs = dict(carry_noise=FLAGS.carry_noise)
    task = make_task(FLAGS.task, FLAGS.seed, num_eval=FLAGS.num_eval, tokenizer=tokenizer,
                     **task_kwargs)
    out_dir = FLAGS.out_dir or ("checkpoints/warm_start" if FLAGS.task == "arithmetic"
                                else f"checkpoints/warm_start_{FLAGS.task}")
    max_new_tokens = FLAGS.max_new_tokens or DEFAULT_MAX_NEW_TOKENS.get(FLAGS.task, 8)
    model = make_tiny_model(FLAGS.model_kind, vocab_size=tokenizer.vocab_size,
                            hidden_size=FLAGS.hidden_size, num_layers=FLAGS.num_layers,
                            num_heads=FLAGS.num_heads, intermediate_size=FLAGS.intermediate_size,
                            seed=FLAGS.seed)
    logging.info("model %s: %d parameters", FLAGS.model_kind, count_parameters(model))

    optimizer = torch.optim.AdamW(model.parameters(), lr=FLAGS.lr, betas=(0.9, 0.98),
                                  weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < FLAGS.warmup_steps:
            return FLAGS.lr * (step + 1) / FLAGS.warmup_steps
        frac = (step - FLAGS.warmup_steps) / max(1, FLAGS.steps - FLAGS.warmup_steps)
        return FLAGS.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    rng = np.random.default_rng([FLAGS.seed, 1])
    model.train()
    running = None
    for step in range(FLAGS.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        ids, mask = make_batch(task, rng, FLAGS.batch_size, tokenizer.pad_id)
        loss = answer_loss(model, ids, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % FLAGS.log_every == 0 or step + 1 == FLAGS.steps:
            logging.info("step %d/%d  loss %.4f  lr %.2e  %.1fs", step + 1, FLAGS.steps, running,
                         lr_at(step), time.time() - start)
    train_s = time.time() - start
    model.eval()

    engine = TorchEngine(model, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    if FLAGS.task == "calculator_tool":
        metrics = evaluate_episodes(engine, task, FLAGS.eval_samples, max_new_tokens, FLAGS.seed)
    else:
        metrics = evaluate(engine, task, FLAGS.eval_samples, max_new_tokens, FLAGS.seed)
    save_checkpoint(model, tokenizer, out_dir)
    total_s = time.time() - start
    record = {
        **metrics,
        "final_train_loss": running,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(total_s, 1),
        "settings": {
            "task": FLAGS.task, "steps": FLAGS.steps, "batch_size": FLAGS.batch_size,
            "lr": FLAGS.lr, "warmup_steps": FLAGS.warmup_steps, "seed": FLAGS.seed,
            "model_kind": FLAGS.model_kind, "hidden_size": FLAGS.hidden_size,
            "num_layers": FLAGS.num_layers, "num_heads": FLAGS.num_heads,
            "intermediate_size": FLAGS.intermediate_size, **task_kwargs,
            "num_eval": FLAGS.num_eval, "eval_samples": FLAGS.eval_samples,
            "max_new_tokens": max_new_tokens, "threads": FLAGS.threads,
            "parameters": count_parameters(model),
        },
    }
    with open(os.path.join(out_dir, "warm_start.json"), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
    print(json.dumps({k: v for k, v in record.items() if k != "settings"}, indent=2,
                     sort_keys=True))
    print(f"wrote {out_dir} in {total_s:.1f}s")


if __name__ == "__main__":
    app.run(main)
