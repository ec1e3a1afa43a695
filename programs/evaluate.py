"""Scores a model on a dataset's test split: greedy accuracy, pass@k and maj@k, as JSON.

  python programs/evaluate.py --model=checkpoints/smollm2-135m-instruct \
      --eval_files=data/arith_qa/test.parquet --reward=final_number --eval_size=48 \
      --max_new_tokens=24 --n=8 --k=1,4,8 --out=runs/eval_smollm2.json

--model is a model directory, a learner checkpoint (runs/x/checkpoints/step_N, LoRA merged) or
a run folder (its newest complete checkpoint). Every flag of programs/sao.py means the same
here (--task defaults to dataset; --eval_size to every row of --eval_files; --temperature,
--top_p and --seed are the samples'; --engine=vllm evaluates with vLLM); --n samples per prompt
(0: greedy only) and --k the k of pass@k and maj@k (each <= n). The metrics' definitions are in
sao_actor_learner/evaluation.py. Prints the report as JSON and writes it to --out when given.
"""
from __future__ import annotations

import json
import os
import sys

# Runnable as a script from the repository root without installation.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The config's flags and this program's own (defined only when run as a script)."""
    from sao_actor_learner import flags as config_flags
    from sao_actor_learner.config import SAOConfig
    config_flags.define_flags_from_dataclass(SAOConfig)
    flags.DEFINE_integer("n", 0, "Samples per prompt for pass@k and maj@k (0: greedy only).")
    flags.DEFINE_list("k", [], "The k of pass@k and maj@k, each in 1..n, e.g. 1,4,8.")
    flags.DEFINE_string("out", "", "Also write the JSON report to this file.")
    flags.DEFINE_integer("decode_batch", 64, "Sequences generated together.")


def build_config(model: str):
    """The SAOConfig of the evaluation from the flags (ConfigError / ValueError on bad ones)."""
    from sao_actor_learner import flags as config_flags
    from sao_actor_learner.config import SAOConfig
    from sao_actor_learner.tasks.dataset_files import read_dataset

    overrides = {"model": model, "init_checkpoint": ""}
    if not FLAGS["task"].present:
        overrides["task"] = "dataset"
    if FLAGS.eval_files and not FLAGS.train_files:
        overrides["train_files"] = list(FLAGS.eval_files)   # the task wants some; unused here
    if FLAGS.eval_files and not FLAGS["eval_size"].present:
        overrides["eval_size"] = len(read_dataset(FLAGS.eval_files, FLAGS.prompt_key,
                                                  FLAGS.answer_key))
    if FLAGS.engine == "vllm":
        overrides["vllm_evaluator"] = True
    return config_flags.config_from_flags(SAOConfig, **overrides)


def main(argv):
    del argv
    from sao_actor_learner.config import ConfigError
    from sao_actor_learner.evaluation import check_k, evaluate_model, resolve_model
    from sao_actor_learner.models.model_dir import ModelDirError, check_model_dir
    from sao_actor_learner.tasks.dataset_files import DatasetError

    try:
        try:
            ks = [int(k) for k in FLAGS.k]
        except ValueError:
            raise ValueError(f"--k={','.join(FLAGS.k)}: must be whole numbers, e.g. --k=1,4,8")
        check_k(FLAGS.n, ks)
        if not FLAGS.model:
            raise ValueError("--model is required: a model directory, checkpoint or run folder")
        model = resolve_model(FLAGS.model)
        check_model_dir(model)
        config = build_config(model)
        out_dir = os.path.dirname(os.path.abspath(FLAGS.out)) if FLAGS.out else None
        report = evaluate_model(config, FLAGS.n, ks, run_dir=out_dir,
                                batch_size=FLAGS.decode_batch)
    except (ConfigError, DatasetError, ModelDirError, FileNotFoundError, ValueError) as e:
        sys.exit(f"evaluate: {e}")
    text = json.dumps(report, indent=2)
    if FLAGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
        with open(FLAGS.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    define_flags()
    app.run(main)
