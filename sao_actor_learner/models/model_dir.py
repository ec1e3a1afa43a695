"""Checks of model directories that need neither torch nor transformers (the launcher runs
them before any node starts).

A model directory is a Hugging Face causal-LM folder: config.json, weights (safetensors or
.bin), tokenizer files (or our char_tokenizer.json). A critic directory (models.value) holds a
body config, weights and value_head.safetensors.

Weights are checked without torch: every *.safetensors file's header is read
(`read_safetensors_header`: an 8-byte little-endian length N, N bytes of JSON naming each
tensor's dtype, shape and data_offsets, then the data; the file is exactly 8 + N + the largest end
offset bytes), so a 0-byte, truncated or garbled file fails here, naming the file, instead of
crashing every node. `check_critic_dir` checks that a critic reads the policy's tokens with the
policy's architecture.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
from typing import Any, Dict, Optional

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
    if not os.path.exists(path):
        parent = os.path.dirname(os.path.normpath(path))
        hint = ""
        if parent and os.path.isdir(parent):   # a local path: its folder is there, it is not
            hint = f" ({parent!r} exists but holds no {os.path.basename(path)!r})"
        elif not os.path.isabs(path) and path.count("/") == 1 and not path.startswith("."):
            hint = (f". If you meant the Hugging Face hub id {path!r}: this system loads models "
                    f"offline only; download it first (e.g. `huggingface-cli download {path} "
                    f"--local-dir DIR`) and pass {flag}=DIR")
        raise ModelDirError(f"{flag}={path!r}: no such directory ({os.path.abspath(path)!r} "
                            f"does not exist){hint}. A model directory holds config.json, "
                            "weights and tokenizer files.")
    if not os.path.isdir(path):
        raise ModelDirError(f"{flag}={path!r} is a file, not a directory (a model directory "
                            "holds config.json, weights and tokenizer files)")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelDirError(f"{flag}={path!r} holds no config.json: not a Hugging Face model "
                            "directory (save_pretrained writes one)")
    if not any(glob.glob(os.path.join(glob.escape(path), pattern)) for pattern in WEIGHT_PATTERNS):
        raise ModelDirError(f"{flag}={path!r} holds no weights (no *.safetensors or "
                            "pytorch_model*.bin): download the weight files too")
    if not any(os.path.exists(os.path.join(path, f))
               for f in TOKENIZER_FILES + (CHAR_TOKENIZER_FILE,)):
        raise ModelDirError(f"{flag}={path!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)} "
                            "missing): copy the model's tokenizer files into it")
    config = read_config(path, flag)
    archs = config.get("architectures") or []
    if archs and not any(a.endswith("ForCausalLM") for a in archs):
        raise ModelDirError(f"{flag}={path!r} is a {', '.join(archs)}, not a causal LM "
                            "(architectures must end in ForCausalLM)")
    check_weight_files(path, flag, config)


def read_config(path: str, flag: str) -> Dict[str, Any]:
    """config.json of the directory `path`, which must be a JSON object."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise ModelDirError(f"{flag}={path!r} holds no config.json: not a Hugging Face model "
                            "directory (save_pretrained writes one)")
    with open(file, "rb") as f:
        try:
            config = json.loads(f.read().decode("utf-8"))
        except ValueError as e:
            raise ModelDirError(f"{flag}={path!r}: config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{flag}={path!r}: config.json is a JSON {type(config).__name__}, "
                            "not a JSON object: not a Hugging Face model config")
    return config


# Bytes per element of safetensors' dtypes (its format description); others are not sized here.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_HEADER_LIMIT = 100 << 20           # safetensors' own limit on the JSON header
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight",
                       "embed_in.weight")


def read_safetensors_header(path: str) -> Dict[str, Any]:
    """The JSON header of the safetensors file `path` (without __metadata__), after checking
    that it parses and that the file holds exactly the bytes it describes; ModelDirError naming
    the file and what is wrong otherwise. Reads the header only."""
    size = os.path.getsize(path)
    if size == 0:
        raise ModelDirError(f"{path}: the file is empty (0 bytes): a safetensors file starts "
                            "with an 8-byte header length")
    if size < 8:
        raise ModelDirError(f"{path}: truncated: {size} bytes, fewer than the 8-byte header "
                            "length")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _HEADER_LIMIT:
            raise ModelDirError(f"{path}: header length {length} is not plausible (over "
                                f"{_HEADER_LIMIT} bytes): not a safetensors file")
        if 8 + length > size:
            raise ModelDirError(f"{path}: truncated: expected at least {8 + length} bytes for "
                                f"its header, found {size}")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError as e:
        raise ModelDirError(f"{path}: the header is not JSON ({e}): not a safetensors file "
                            "or a damaged one") from None
    if not isinstance(header, dict):
        raise ModelDirError(f"{path}: the header is a JSON {type(header).__name__}, not an "
                            "object: not a safetensors file")
    header.pop("__metadata__", None)
    data_end = 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not (all(isinstance(d, int) and d >= 0 for d in shape) and
                    isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
                raise ValueError
        except (TypeError, ValueError, KeyError):
            raise ModelDirError(f"{path}: tensor {name!r} has a malformed header entry "
                                f"{entry!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if dtype in _DTYPE_BYTES and end - begin != numel * _DTYPE_BYTES[dtype]:
            raise ModelDirError(f"{path}: tensor {name!r} is {dtype}{list(shape)} "
                                f"({numel * _DTYPE_BYTES[dtype]} bytes) but its data_offsets "
                                f"[{begin}, {end}] hold {end - begin} bytes")
        data_end = max(data_end, end)
    expected = 8 + length + data_end
    if size != expected:
        what = "truncated" if size < expected else "has bytes past its last tensor"
        raise ModelDirError(f"{path}: {what}: expected {expected} bytes, found {size} (was the "
                            "download or copy cut short?)")
    return header


def check_weight_files(path: str, flag: str, config: Optional[Dict[str, Any]] = None) -> None:
    """Reads the header of every safetensors file in `path` (read_safetensors_header), checks
    that a sharded index names files that exist and that no .bin file is empty, and, when the
    embedding tensor is found, that it has config's vocab_size rows."""
    for index in sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors.index.json"))):
        try:
            with open(index) as f:
                shards = set(json.load(f)["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelDirError(f"{flag}={path!r}: {os.path.basename(index)} is not a "
                                f"safetensors index ({e!r})") from None
        missing = sorted(s for s in shards if not os.path.exists(os.path.join(path, s)))
        if missing:
            raise ModelDirError(f"{flag}={path!r}: {os.path.basename(index)} names weight "
                                f"files that are missing: {missing[:4]}; download them too")
    vocab = (config or {}).get("vocab_size")
    for file in sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors"))):
        try:
            header = read_safetensors_header(file)
        except ModelDirError as e:
            raise ModelDirError(f"{flag}={path!r}: {e}") from None
        for name, entry in header.items():
            if isinstance(vocab, int) and name.endswith(_EMBEDDING_SUFFIXES) and \
                    entry["shape"] and entry["shape"][0] != vocab:
                raise ModelDirError(
                    f"{flag}={path!r}: {os.path.basename(file)}: the embedding {name} has "
                    f"{entry['shape'][0]} rows but config.json's vocab_size is {vocab}: the "
                    "weights and the config do not belong together")
    for file in sorted(glob.glob(os.path.join(glob.escape(path), "pytorch_model*.bin"))):
        if os.path.getsize(file) == 0:
            raise ModelDirError(f"{flag}={path!r}: {file} is empty (0 bytes)")


# Fields a critic must share with the policy: it reads the policy's token ids with the
# policy's architecture (models/value.py).
CRITIC_MATCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
# Files that define token ids; a critic directory holding one must hold the policy's.
_VOCAB_FILES = ("tokenizer.json", CHAR_TOKENIZER_FILE, "vocab.json", "merges.txt",
                "tokenizer.model")


def check_critic_dir(path: str, model: str, flag: str = "--critic_model",
                     model_flag: str = "--model") -> None:
    """Raises ModelDirError unless `path` (a critic directory of ValueModel.save, or a causal-LM
    directory) has a config and intact weights, matches `model`'s config in
    CRITIC_MATCH_FIELDS, and holds either no tokenizer or `model`'s. The message names both
    directories and the field or file that differs."""
    if not os.path.isdir(path):
        raise ModelDirError(f"{flag}={path!r} is not a directory (a critic directory written by "
                            "ValueModel.save, or a causal-LM directory)")
    config = read_config(path, flag)
    if not any(glob.glob(os.path.join(glob.escape(path), pattern)) for pattern in WEIGHT_PATTERNS):
        raise ModelDirError(f"{flag}={path!r} holds no weights (no *.safetensors or "
                            "pytorch_model*.bin)")
    check_weight_files(path, flag, config)
    policy = read_config(model, model_flag)
    both = f"{flag}={path!r} does not match {model_flag}={model!r}"
    for field in CRITIC_MATCH_FIELDS:
        if config.get(field) != policy.get(field):
            raise ModelDirError(
                f"{both}: {field} is {config.get(field)!r} in the critic's config.json and "
                f"{policy.get(field)!r} in the policy's; the critic must read the policy's "
                "tokens with the policy's architecture (use a critic made from this policy)")
    for name in _VOCAB_FILES:
        if not os.path.exists(os.path.join(path, name)):
            continue
        if not os.path.exists(os.path.join(model, name)):
            raise ModelDirError(f"{both}: the critic's tokenizer has {name}, the policy's has "
                                "none: they do not tokenize alike")
        if _vocab_fingerprint(os.path.join(path, name)) != \
                _vocab_fingerprint(os.path.join(model, name)):
            raise ModelDirError(f"{both}: their tokenizers differ ({name}): the critic would "
                                "read other tokens than the policy writes")


def _vocab_fingerprint(file: str) -> str:
    """sha256 of what in a tokenizer file decides the token ids: of tokenizer.json its model
    (merges in one spelling), added tokens, normalizer and pre-tokenizer; of other JSON files
    their parsed content; of merges.txt its merge lines; of others their bytes. Formatting and
    the tokenizers version that saved a file aside."""
    with open(file, "rb") as f:
        raw = f.read()
    name = os.path.basename(file)
    if name.endswith(".json"):
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError:
            return hashlib.sha256(raw).hexdigest()
        if isinstance(data, dict) and name == "tokenizer.json":
            data = {k: data.get(k) for k in ("model", "added_tokens", "normalizer",
                                             "pre_tokenizer")}
            model = data["model"]
            if isinstance(model, dict) and isinstance(model.get("merges"), list):
                # tokenizers >= 0.20 saves a merge as a pair, older versions as "a b"
                model = dict(model, merges=[" ".join(m) if isinstance(m, list) else m
                                            for m in model["merges"]])
                data["model"] = model
        raw = json.dumps(data, sort_keys=True).encode("utf-8")
    elif name == "merges.txt":
        raw = b"\n".join(line.rstrip() for line in raw.splitlines()
                         if line.strip() and not line.startswith(b"#version"))
    return hashlib.sha256(raw).hexdigest()


