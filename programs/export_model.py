"""Exports a checkpoint (LoRA merged) or model directory as a plain Hugging Face model directory
with its tokenizer, chat template and generation config.

  python programs/export_model.py --model=runs/real_model --out_dir=exports/smollm2-arith

--model is a model directory, a learner checkpoint (runs/x/checkpoints/step_N) or a run folder
(its newest complete checkpoint). The export loads in plain transformers
(`AutoModelForCausalLM.from_pretrained(out_dir)`) and vLLM. An --out_dir holding files this
project did not make is refused, as is a source without a chat template or
generation_config.json (sao_actor_learner/export.py). Prints the export record as JSON.
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
    flags.DEFINE_string("model", "", "A model directory, learner checkpoint or run folder.")
    flags.DEFINE_string("out_dir", "", "The folder to write (new, empty, or an earlier export).")
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                      "The exported weights' dtype.")


def main(argv):
    del argv
    from sao_actor_learner.config import ConfigError
    from sao_actor_learner.export import export_model
    from sao_actor_learner.models.model_dir import ModelDirError

    if not FLAGS.model:
        sys.exit("export_model: --model is required (a model directory, checkpoint or run folder)")
    try:
        record = export_model(FLAGS.model, FLAGS.out_dir, FLAGS.dtype)
    except (ConfigError, ModelDirError, FileNotFoundError) as e:
        sys.exit(f"export_model: {e}")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    define_flags()
    app.run(main)
