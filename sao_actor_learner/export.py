"""Exporting a trained policy as a plain Hugging Face model directory (programs/export_model.py).

The source is a model directory, a learner checkpoint (`<run_dir>/checkpoints/step_N`) or a run
folder (its newest complete checkpoint; evaluation.resolve_model). A checkpoint's model files
already hold the LoRA-merged weights under the base model's names (models/lora.py): the export
loads them with `AutoModelForCausalLM` and writes only what a user of the model needs, the
weights (safetensors, tied weights once, in --dtype), config.json, the tokenizer files with the
chat template, generation_config.json, and `export.json` (the source, the step, the dtype); the
checkpoint's learner state, adapters and manifest stay behind.

Refused before anything is written, naming the file or flag:
  - a source without a chat template (chat_template.jinja, or a "chat_template" entry in
    tokenizer_config.json) or without generation_config.json: a model people chat with needs
    both, and a checkpoint of such a model has both (ModelDirError);
  - an export folder that holds files this project did not make (run_dirs ownership: only an
    empty folder or one with the project's marker is replaced), or the source itself
    (ConfigError).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict

from sao_actor_learner import run_dirs
from sao_actor_learner.config import ConfigError
from sao_actor_learner.models.model_dir import ModelDirError, check_model_dir

EXPORT_RECORD = "export.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
DTYPES = ("float32", "bfloat16", "float16")


def has_chat_template(model_dir: str) -> bool:
    if os.path.isfile(os.path.join(model_dir, CHAT_TEMPLATE)):
        return True
    path = os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        try:
            return bool(json.load(f).get("chat_template"))
        except (ValueError, AttributeError):
            return False


def check_exportable(model_dir: str, flag: str = "--model") -> None:
    """ModelDirError naming the missing file unless `model_dir` is a model directory with a
    chat template and a generation config."""
    check_model_dir(model_dir, flag)
    if not has_chat_template(model_dir):
        raise ModelDirError(
            f"{flag}={model_dir!r} has no chat template: neither {CHAT_TEMPLATE} nor a "
            "\"chat_template\" entry in tokenizer_config.json; copy the base model's "
            f"{CHAT_TEMPLATE} (or tokenizer_config.json) into it")
    if not os.path.isfile(os.path.join(model_dir, GENERATION_CONFIG)):
        raise ModelDirError(
            f"{flag}={model_dir!r} has no {GENERATION_CONFIG} (eos ids and default decoding "
            f"for transformers and vLLM); copy the base model's {GENERATION_CONFIG} into it")


def check_target(out_dir: str, source: str, flag: str = "--out_dir") -> None:
    """ConfigError unless `out_dir` may be (re)written: missing, empty or made by this project,
    and neither the source nor a folder holding it."""
    if not out_dir:
        raise ConfigError(f"{flag} is empty: name the folder to export to")
    out, src = os.path.realpath(out_dir), os.path.realpath(source)
    if out == src or src.startswith(out + os.sep):
        raise ConfigError(f"{flag}={out_dir!r} is (or holds) the source {source!r}: exporting "
                          "would delete it; pick another folder")
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and not os.path.islink(out_dir)
                                         and (run_dirs.is_owned(out_dir)
                                              or not os.listdir(out_dir))):
        raise ConfigError(f"{flag}={out_dir!r} holds files this project did not make (it is not "
                          "an earlier export: no ownership marker), and exporting would replace "
                          "them; pick a new or empty folder, or remove it yourself")


def export_model(source: str, out_dir: str, dtype: str = "float32",
                 flag: str = "--out_dir") -> Dict:
    """Writes the export of `source` into `out_dir` (module docstring); returns the record
    written to export.json."""
    import torch

    from sao_actor_learner.evaluation import resolve_model
    from sao_actor_learner.models.checkpoint import load_policy, save_checkpoint

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r}: one of {', '.join(DTYPES)}")
    model_dir = resolve_model(source)
    check_exportable(model_dir)
    check_target(out_dir, model_dir, flag)
    model, tokenizer = load_policy(model_dir, dtype=getattr(torch, dtype))
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)                # empty, or ours (check_target)
    run_dirs.make_owned_dir(out_dir)
    save_checkpoint(model, tokenizer, out_dir)
    shutil.copyfile(os.path.join(model_dir, GENERATION_CONFIG),
                    os.path.join(out_dir, GENERATION_CONFIG))
    if os.path.isfile(os.path.join(model_dir, CHAT_TEMPLATE)):
        shutil.copyfile(os.path.join(model_dir, CHAT_TEMPLATE),
                        os.path.join(out_dir, CHAT_TEMPLATE))
    check_exportable(out_dir, flag)
    step = os.path.basename(model_dir.rstrip(os.sep))
    record = {"source": source, "model_dir": model_dir, "dtype": dtype,
              "step": int(step[5:]) if step.startswith("step_") and step[5:].isdigit() else None,
              "parameters": sum(p.numel() for p in model.parameters()),
              "files": sorted(f for f in os.listdir(out_dir) if not f.startswith("."))}
    with open(os.path.join(out_dir, EXPORT_RECORD), "w") as f:
        json.dump(record, f, indent=2)
    return record
