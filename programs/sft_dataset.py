"""Supervised warm start of a Hugging Face model directory on chat demonstrations.

  python programs/sft_dataset.py --model=checkpoints/tiny_qwen3 \
      --sft_files=data/gsm_tiny/sft.jsonl --eval_files=data/gsm_tiny/test.jsonl \
      --out_dir=checkpoints/warm_start_dataset

Loads the model and tokenizer with AutoModelForCausalLM / AutoTokenizer, trains on the
(prompt messages, response) rows of --sft_files through the chat template with the loss on the
response tokens only (experiments/workloads/chat_sft.py has the rendering contract and the
recipe), evaluates on the first --eval_size rows of --eval_files (verl's schema: `prompt`,
`reward_model.ground_truth`), and writes the trained directory with save_pretrained (weights,
config, tokenizer, generation config) plus `warm_start.json` with the held-out numbers and
the settings. The directory is a `--model` for programs/sao.py.

The defaults are the gsm_tiny recipe: 1200 steps of 16 demonstrations at lr 2e-3 give a tiny
Qwen3 of 1.4M parameters that is right on most problems without a "gives" step and wrong on
most with one, because the demonstrations add where they should subtract (docs/USAGE.md
section 2, "The tested tiny equivalent"; experiments/workloads/word_problems.py).
"""
from __future__ import annotations

import json
import os
import sys
import time

# Runnable as a script from the repository root without installation.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command-line flags (defined only when run as a script, so importing is free)."""
    flags.DEFINE_string("model", "checkpoints/tiny_qwen3", "The Hugging Face model directory "
                        "to start from (programs/make_tiny_model.py writes one).")
    flags.DEFINE_list("sft_files", ["data/gsm_tiny/sft.jsonl"], "JSONL or parquet files of "
                      "{prompt: chat messages, response: text} rows.")
    flags.DEFINE_list("eval_files", ["data/gsm_tiny/test.jsonl"], "Held-out rows in verl's "
                      "schema (prompt, reward_model.ground_truth).")
    flags.DEFINE_string("out_dir", "checkpoints/warm_start_dataset", "Directory to write.")
    flags.DEFINE_integer("steps", 1200, "Optimizer steps.")
    flags.DEFINE_integer("batch_size", 16, "Demonstrations per step.")
    flags.DEFINE_float("lr", 2e-3, "Peak AdamW learning rate (linear warm-up, cosine decay).")
    flags.DEFINE_integer("eval_size", 500, "Held-out problems evaluated (the first rows).")
    flags.DEFINE_integer("eval_samples", 1, "Temperature-1 samples per greedy-wrong problem.")
    flags.DEFINE_integer("max_new_tokens", 128, "Longest evaluated completion.")
    flags.DEFINE_integer("seed", 0, "Seed of the batch order and the samples.")
    flags.DEFINE_integer("threads", 2, "torch.set_num_threads.")


def main(argv) -> None:
    del argv
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from experiments.workloads import chat_sft
    from sao_actor_learner.tasks.dataset_files import read_rows

    torch.set_num_threads(FLAGS.threads)
    torch.manual_seed(FLAGS.seed)
    tokenizer = AutoTokenizer.from_pretrained(FLAGS.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(FLAGS.model, dtype=torch.float32,
                                                 local_files_only=True)
    sft = [(r["prompt"], r["response"]) for path in FLAGS.sft_files for r in read_rows(path)]
    test = [(r["prompt"], str(r["reward_model"]["ground_truth"]))
            for path in FLAGS.eval_files for r in read_rows(path)][:FLAGS.eval_size]
    if not sft or not test:
        raise app.UsageError(f"--sft_files={FLAGS.sft_files} gave {len(sft)} rows and "
                             f"--eval_files={FLAGS.eval_files} {len(test)}: both need rows")
    logging.info("%s: %d parameters; %d demonstrations, %d held-out problems", FLAGS.model,
                 sum(p.numel() for p in model.parameters()), len(sft), len(test))
    t0 = time.time()
    losses = chat_sft.train(model, tokenizer, sft, steps=FLAGS.steps,
                            batch_size=FLAGS.batch_size, lr=FLAGS.lr, seed=FLAGS.seed,
                            log_every=100, log=logging.info)
    train_s = time.time() - t0
    metrics = chat_sft.evaluate(model, tokenizer, test, num_samples=FLAGS.eval_samples,
                                max_new_tokens=FLAGS.max_new_tokens, seed=FLAGS.seed)
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    model.save_pretrained(FLAGS.out_dir)
    tokenizer.save_pretrained(FLAGS.out_dir)
    report = {**metrics, "train_seconds": train_s,
              "final_loss": sum(losses[-50:]) / len(losses[-50:]),
              "settings": {"model": FLAGS.model, "sft_files": FLAGS.sft_files,
                           "eval_files": FLAGS.eval_files, "steps": FLAGS.steps,
                           "batch_size": FLAGS.batch_size, "lr": FLAGS.lr,
                           "eval_size": FLAGS.eval_size, "seed": FLAGS.seed,
                           "threads": FLAGS.threads}}
    with open(os.path.join(FLAGS.out_dir, "warm_start.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"warm start in {FLAGS.out_dir}: greedy held-out accuracy "
          f"{metrics['greedy_accuracy']:.3f} on {len(test)} problems ({train_s:.0f} s training)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
