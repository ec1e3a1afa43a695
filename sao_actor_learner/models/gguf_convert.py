"""A GGUF file (a quantized llama.cpp checkpoint with its tokenizer inside) into a plain Hugging
Face model directory that `--model`, the critic, checkpoints, weight sync and vLLM all load.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=name)`, with the `gguf` package
installed): the tokenizer (vocabulary, merges, special tokens, chat template) and the model,
dequantized to float32. It refuses to `save_pretrained` such a model ("quantized with gguf and
is not serializable"), so `convert_gguf` builds a plain model of the same config (without its
`quantization_config`), copies the dequantized state dict into it, and writes:

  config.json, model.safetensors   the plain model (tied embeddings stored once)
  generation_config.json           bos / eos / pad ids of the GGUF's tokenizer metadata
  tokenizer.json, tokenizer_config.json, ...   the tokenizer and its chat template, in the
                                   portable form `HFTokenizer.save` writes (transformers 4 and 5)
  gguf_source.json                 the source file, its size and sha256, the architecture

into `<out_dir>.partial` first, checks that the written directory gives the GGUF model's logits
on a probe prompt, and renames it to `out_dir`: a conversion that stops half way leaves no
directory that looks finished.

`check_gguf_file` reads only the file's header (gguf.GGUFReader, memory-mapped) and raises
GGUFConversionError naming the file and what is missing: not a GGUF file, a damaged header, no
architecture, no tokenizer, no token embedding. What transformers then cannot load (an
architecture, tensor type or tokenizer model it does not know) is reported the same way.

Imports no reverb, tensorflow or grpc; torch, transformers and gguf on first use.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from typing import Any, Dict

GGUF_MAGIC = b"GGUF"
# Metadata keys a convertible file must hold (GGUF's key names), and what each one is.
REQUIRED_KEYS = {
    "general.architecture": "the model architecture",
    "tokenizer.ggml.model": "the tokenizer type",
    "tokenizer.ggml.tokens": "the tokenizer vocabulary",
}
EMBEDDING_TENSOR = "token_embd.weight"
SOURCE_FILE = "gguf_source.json"
PROBE_TEXT = "The capital of France is Paris. 3 + 4 = 7."


class GGUFConversionError(ValueError):
    """A GGUF file or directory that cannot be converted; the message names the file and what
    is missing."""


def find_gguf_file(path: str) -> str:
    """`path` itself when it is a file, else the one *.gguf file in the directory `path`."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise GGUFConversionError(f"{path}: no such file or directory (pass a .gguf file, or a "
                                  "directory holding one)")
    found = sorted(glob.glob(os.path.join(glob.escape(path), "*.gguf")))
    if not found:
        raise GGUFConversionError(f"{path}: the directory holds no *.gguf file (pass the GGUF "
                                  "file itself, e.g. .../SmolLM2-135M-Instruct.Q4_1.gguf)")
    if len(found) > 1:
        names = ", ".join(os.path.basename(f) for f in found)
        raise GGUFConversionError(f"{path}: the directory holds {len(found)} GGUF files "
                                  f"({names}); pass the one to convert")
    return found[0]


def check_gguf_file(path: str) -> Dict[str, Any]:
    """Reads the header of the GGUF file `path` and returns {"architecture", "tensors",
    "has_chat_template"}; GGUFConversionError naming the file and what is missing when it
    cannot be converted."""
    if not os.path.isfile(path):
        raise GGUFConversionError(f"{path}: no such file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        what = "it is empty (0 bytes)" if size == 0 else \
            f"it starts with {magic!r}, not the GGUF magic {GGUF_MAGIC!r}"
        raise GGUFConversionError(f"{path}: not a GGUF file: {what}")
    try:
        import gguf
    except ImportError:
        raise GGUFConversionError(f"{path}: reading a GGUF file needs the `gguf` package: pip "
                                  "install -e '.[gguf]' (make venv installs it)") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:   # truncated or garbled header: the reader raises many kinds
        raise GGUFConversionError(f"{path}: the GGUF header does not parse ({e!r}): a damaged "
                                  "or truncated file (download it again)") from None
    missing = [f"{key} ({what})" for key, what in REQUIRED_KEYS.items()
               if key not in reader.fields]
    if missing:
        raise GGUFConversionError(f"{path}: the GGUF metadata lacks {', '.join(missing)}: "
                                  "it cannot become a model directory with its tokenizer")
    architecture = str(reader.fields["general.architecture"].contents())
    names = {t.name for t in reader.tensors}
    if EMBEDDING_TENSOR not in names:
        raise GGUFConversionError(f"{path}: the file holds no {EMBEDDING_TENSOR} tensor (the "
                                  f"token embedding; {len(names)} tensors found): not a "
                                  "complete language model")
    return {"architecture": architecture, "tensors": len(names),
            "has_chat_template": "tokenizer.chat_template" in reader.fields}


def plain_config_dict(config_dict: Dict[str, Any]) -> Dict[str, Any]:
    """A GGUF-loaded model's config as a plain one: without `quantization_config` (a model
    directory with it would be loaded as GGUF again) and the GGUF's file-name bookkeeping."""
    return {k: v for k, v in config_dict.items()
            if k not in ("quantization_config", "_name_or_path", "_model_name_or_path")}


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_gguf(path: str):
    """(model, transformers tokenizer) of the GGUF file `path`, dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                     dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError) as e:
        # e.g. "GGUF model with architecture X is not supported yet.", a tensor type or a
        # tokenizer model transformers cannot read
        raise GGUFConversionError(f"{path}: transformers cannot load it: {e}") from None
    return model.eval(), tokenizer


def to_plain_model(gguf_model):
    """A plain (unquantized) copy of a GGUF-loaded model: same class and config less
    quantization_config, the dequantized weights copied in (every key, strict)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = plain_config_dict(gguf_model.config.to_dict())
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise GGUFConversionError(f"the dequantized weights do not fit a plain "
                                  f"{type(model).__name__}: missing {sorted(missing)[:4]}, "
                                  f"unexpected {sorted(unexpected)[:4]}")
    return model.eval()


def generation_config_of(tokenizer, config) -> Dict[str, int]:
    """generation_config.json's ids: the tokenizer's bos / eos (the end of an assistant turn)
    / pad, else the config's."""
    ids = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is None:
            value = getattr(config, key, None)
        if value is not None:
            ids[key] = int(value)
    if "eos_token_id" not in ids:
        raise GGUFConversionError("the GGUF tokenizer names no eos token (tokenizer.ggml."
                                  "eos_token_id): nothing would end a model turn")
    return ids


def portable_tokenizer_config(directory: str, chat_template) -> None:
    """tokenizer_config.json with the chat template inside (transformers 4.x reads it there;
    5.x writes it to chat_template.jinja only) and without the loading-time keys `is_local`
    and `local_files_only` that a GGUF-loaded tokenizer carries."""
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    if chat_template:
        cfg["chat_template"] = chat_template
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def probe_logits_difference(model_a, model_b, tokenizer) -> float:
    """max |logits_a - logits_b| on PROBE_TEXT."""
    import torch

    ids = torch.tensor([tokenizer.encode(PROBE_TEXT, add_special_tokens=False)])
    with torch.no_grad():
        a = model_a(input_ids=ids).logits
        b = model_b(input_ids=ids).logits
    return float((a - b).abs().max())


def convert_gguf(gguf_path: str, out_dir: str, tolerance: float = 1e-4) -> Dict[str, Any]:
    """Converts the GGUF file (or the directory holding one) `gguf_path` into the model
    directory `out_dir` (module docstring) and returns what gguf_source.json records."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from sao_actor_learner.models.hf_tokenizer import HFTokenizer

    from sao_actor_learner.run_dirs import (check_clearable, make_owned_dir, mark_owned,
                                            remove_if_ours)
    check_clearable(out_dir, "--out_dir")    # only a folder this project made is replaced
    path = find_gguf_file(gguf_path)
    header = check_gguf_file(path)
    gguf_model, hf_tokenizer = load_gguf(path)
    model = to_plain_model(gguf_model)
    generation = generation_config_of(hf_tokenizer, model.config)
    partial = out_dir.rstrip("/") + ".partial"
    remove_if_ours(partial, "the conversion")   # an earlier, interrupted one's: marked
    make_owned_dir(partial)
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(partial, safe_serialization=True)
    HFTokenizer(hf_tokenizer, extra_stop_ids=(generation["eos_token_id"],)).save(partial)
    portable_tokenizer_config(partial, hf_tokenizer.chat_template)
    reloaded = AutoModelForCausalLM.from_pretrained(partial, dtype=torch.float32,
                                                    local_files_only=True).eval()
    difference = probe_logits_difference(gguf_model, reloaded, hf_tokenizer)
    if not difference <= tolerance:
        raise GGUFConversionError(f"{path}: the written directory {partial} gives logits "
                                  f"{difference:.3g} away from the GGUF model's (tolerance "
                                  f"{tolerance}): the conversion lost weights")
    record = {"gguf_file": os.path.abspath(path), "gguf_bytes": os.path.getsize(path),
              "gguf_sha256": sha256_of(path), **header,
              "model_class": type(model).__name__,
              "parameters": sum(p.numel() for p in model.parameters()),
              "vocab_size": len(hf_tokenizer), "generation_config": generation,
              "probe_max_abs_logit_difference": difference}
    with open(os.path.join(partial, SOURCE_FILE), "w") as f:
        json.dump(record, f, indent=2)
    mark_owned(partial)
    check_clearable(out_dir, "--out_dir")   # again: the conversion took a while
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.rename(partial, out_dir)
    return record
