"""Checks of model directories that need neither torch nor transformers (the launcher runs
them before any node starts).

A model directory is a Hugging Face causal-LM folder: config.json, weights (safetensors or
.bin), tokenizer files (or our char_tokenizer.json). A critic directory (models.value) holds a
body config, weights and value_head.safetensors.
"""
from __future__ import annotations

import glob
import json
import os

from sao_actor_learner.models.hf_tokenizer import TOKENIZER_FILES

CHAR_TOKENIZER_FILE = "char_tokenizer.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")


class ModelDirError(ValueError):
    """A model directory that cannot be loaded; the message says what is missing."""


def check_model_dir(path: str, flag: str = "--model") -> None:
    """Raises ModelDirError unless `path` is a local model directory with a config, weights and
    a tokenizer. Reads no weights. The message names `flag` and what to change."""
    if not path:
        raise ModelDirError(f"{flag} is empty: pass a Hugging Face model directory")
    if not os.path.isdir(path):
        hint = ""
        if not os.path.isabs(path) and path.count("/") == 1 and not path.startswith("."):
            hint = (f" It looks like a hub id; this system loads models offline only: download "
                    f"it first (e.g. `huggingface-cli download {path} --local-dir DIR`) and pass "
                    f"{flag}=DIR.")
        raise ModelDirError(f"{flag}={path!r} is not a directory (a model directory holds "
                            f"config.json, weights and tokenizer files).{hint}")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelDirError(f"{flag}={path!r} holds no config.json: not a Hugging Face model "
                            "directory (save_pretrained writes one)")
    if not any(glob.glob(os.path.join(path, pattern)) for pattern in WEIGHT_PATTERNS):
        raise ModelDirError(f"{flag}={path!r} holds no weights (no *.safetensors or "
                            "pytorch_model*.bin): download the weight files too")
    if not any(os.path.exists(os.path.join(path, f))
               for f in TOKENIZER_FILES + (CHAR_TOKENIZER_FILE,)):
        raise ModelDirError(f"{flag}={path!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)} "
                            "missing): copy the model's tokenizer files into it")
    with open(os.path.join(path, "config.json")) as f:
        try:
            config = json.load(f)
        except ValueError as e:
            raise ModelDirError(f"{flag}={path!r}: config.json is not valid JSON ({e})") from None
    archs = config.get("architectures") or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise ModelDirError(f"{flag}={path!r} is a {', '.join(archs)}, not a causal LM "
                            "(architectures must end in ForCausalLM)")


