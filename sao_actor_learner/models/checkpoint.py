"""Model directories, checkpoint folders and weight bytes.

A model directory is any Hugging Face causal-LM folder: config.json, safetensors (or .bin)
weights, tokenizer files, optionally generation_config.json and a chat template. `load_policy`
loads one with `AutoModelForCausalLM` and its tokenizer (`load_tokenizer`): the char tokenizer
when the folder has our `char_tokenizer.json` (the toy tasks' checkpoints), else `HFTokenizer`.
`check_model_dir` says, before anything starts, what a folder lacks. `save_checkpoint` writes a
folder that loads the same way here, with `AutoModelForCausalLM` / `AutoTokenizer`, and in vLLM.

Weights travel between processes as safetensors bytes of the *sync state dict*
(`sync_state_dict`): the model's state dict without the names of tied parameters (with tied
input/output embeddings, `lm_head.weight` is `embed_tokens.weight`; safetensors refuses shared
tensors and a checkpoint does not store it, so neither do we). `load_sync_state_dict` loads one
back. Without copies of gigabytes: `state_dict_to_buffers` gives the payload as a header plus views
of the tensors (the variable publisher streams them as they are), and
`bytes_to_state_dict_views` decodes into tensors that view the payload. `check_compatible`
validates a new state dict against a reference one before anything is loaded: a failed load
half way would leave an engine with mixed weights.

No reverb, tensorflow or grpc here (the GPU kernel machine has neither).
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import warnings
from typing import Dict, Iterator, List, Mapping, Optional, Set, Tuple

import torch

from sao_actor_learner import core
from sao_actor_learner.models.hf_tokenizer import HFTokenizer, make_tokenizer_config_portable
from sao_actor_learner.models.lora import merged_state_dict
from sao_actor_learner.models.model_dir import (CHAR_TOKENIZER_FILE, ModelDirError,
                                                check_model_dir)
from sao_actor_learner.models.tokenizer import CharTokenizer

def load_tokenizer(path: str) -> core.Tokenizer:
    """The tokenizer of a model directory: CharTokenizer for folders with char_tokenizer.json,
    else the directory's Hugging Face tokenizer (HFTokenizer)."""
    if os.path.exists(os.path.join(path, CHAR_TOKENIZER_FILE)):
        return CharTokenizer.load(path)
    return HFTokenizer.from_pretrained(path)


def save_tokenizer(tokenizer: core.Tokenizer, path: str) -> None:
    """Writes `tokenizer` into the folder `path` so `load_tokenizer(path)` returns it."""
    if isinstance(tokenizer, CharTokenizer):
        tokenizer.to_hf().save_pretrained(path)
        tokenizer.save(path)
    elif isinstance(tokenizer, HFTokenizer):
        tokenizer.save(path)
    else:
        raise TypeError(f"cannot save a {type(tokenizer).__name__}; save_checkpoint writes "
                        "CharTokenizer and HFTokenizer")
    make_tokenizer_config_portable(path)


def save_checkpoint(model: torch.nn.Module, tokenizer: core.Tokenizer, path: str) -> str:
    """Writes `model` (safetensors, tied weights once) and `tokenizer` into `path`."""
    os.makedirs(path, exist_ok=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    if vocab < tokenizer.vocab_size:
        raise ValueError(f"model vocab_size={vocab} < tokenizer vocab_size={tokenizer.vocab_size}: "
                         "the model cannot embed every token; build it with the tokenizer's size")
    with _no_progress_bars():
        model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(tokenizer, path)
    return path


def load_policy(path: str, dtype: torch.dtype = torch.float32
                ) -> Tuple[torch.nn.Module, core.Tokenizer]:
    """(model in eval mode, tokenizer) from a model directory (`check_model_dir`)."""
    from transformers import AutoModelForCausalLM

    try:
        check_model_dir(path, flag="model directory")
    except ModelDirError as e:
        raise FileNotFoundError(str(e)) from None
    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.eval()
    return model, load_tokenizer(path)


def token_limit(model: torch.nn.Module, tokenizer: core.Tokenizer) -> Optional[int]:
    """How many leading rows of the LM head are real tokens: tokenizer.vocab_size when the
    embedding has more rows (padded vocabularies), else None (every row is a token)."""
    rows = model.get_output_embeddings().weight.shape[0]
    if tokenizer.vocab_size > rows:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                         f"{rows} output rows: they do not belong together")
    return tokenizer.vocab_size if tokenizer.vocab_size < rows else None


def tied_parameter_names(model: torch.nn.Module) -> Set[str]:
    """State-dict names whose tensor is the same storage as an earlier name's (tied weights,
    e.g. lm_head.weight with tie_word_embeddings)."""
    seen: Dict[Tuple[int, int, Tuple[int, ...]], str] = {}
    tied = set()
    for name, t in model.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            tied.add(name)
        else:
            seen.setdefault(key, name)
    return tied


def sync_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The state dict that weight sync sends: the model's, tied duplicates left out (their
    names are the ones a saved checkpoint leaves out too), LoRA adapters merged into their base
    weights under the base model's names (models/lora.py: engines never see an adapter)."""
    tied = tied_parameter_names(model)
    return {k: v for k, v in merged_state_dict(model).items() if k not in tied}


def load_sync_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Validates `state_dict` against `sync_state_dict(model)` (names, shapes, dtypes; raises
    ValueError naming every difference, nothing loaded) and copies it into the model; tied
    parameters follow the parameter they are tied to."""
    reference = sync_state_dict(model)
    check_compatible(reference, state_dict)
    missing, unexpected = model.load_state_dict(dict(state_dict), strict=False)
    tied = tied_parameter_names(model)
    if set(missing) - tied or unexpected:   # cannot happen after check_compatible
        raise ValueError(f"load_state_dict: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")


# safetensors dtype names (https://github.com/huggingface/safetensors, format description).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2"}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
_HEADER_LIMIT_BYTES = 100 << 20      # safetensors' own limit on the JSON header


def state_dict_to_buffers(state_dict: Mapping[str, torch.Tensor]) -> List:
    """The safetensors payload of `state_dict` as buffers to send back to back: the 8-byte
    length and JSON header, then each tensor's bytes, viewed in place (no copy of a CPU
    contiguous tensor). The views are valid while the tensors are and must not change until
    sent: VariablePublisher.publish streams them. `b"".join(...)` is `state_dict_to_bytes`.

    Tensors are laid out by decreasing item size, then name (as safetensors does), so each one
    starts at a multiple of its item size; tied weights are simply written twice.
    """
    tensors = []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"state_dict[{name!r}] has dtype {t.dtype}, which safetensors does "
                            f"not store; use one of {sorted(map(str, _SAFETENSORS_DTYPES))}")
        tensors.append((name, t.detach().to("cpu").contiguous()))
    tensors.sort(key=lambda item: (-item[1].element_size(), item[0]))
    header, views, offset = {}, [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        views.append(t.reshape(-1).view(torch.uint8).numpy())   # shares the tensor's memory
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)     # the data starts 8-byte aligned
    return [struct.pack("<Q", len(text)) + text] + views


def state_dict_to_bytes(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of `state_dict` (one copy of every tensor, into the result)."""
    return b"".join(state_dict_to_buffers(state_dict))


def _safetensors_layout(data) -> Tuple[memoryview, dict, int]:
    """(byte view, header without __metadata__, data start) of a safetensors payload."""
    view = memoryview(data).cast("B")
    if view.nbytes < 8:
        raise ValueError(f"{view.nbytes} bytes: too short for a safetensors payload")
    (length,) = struct.unpack("<Q", view[:8])
    if length > _HEADER_LIMIT_BYTES or 8 + length > view.nbytes:
        raise ValueError(f"safetensors header length {length} does not fit the "
                         f"{view.nbytes}-byte payload")
    header = json.loads(bytes(view[8:8 + length]).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    start = 8 + length
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {entry['dtype']!r} is not supported here")
        numel = 1
        for d in entry["shape"]:
            numel *= d
        if not 0 <= begin <= end <= view.nbytes - start or \
                end - begin != numel * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: data_offsets {entry['data_offsets']} do not hold "
                             f"{entry['dtype']}{entry['shape']} inside the payload")
    return view, header, start


def bytes_to_state_dict(data, copy: bool = True) -> Dict[str, torch.Tensor]:
    """The state dict that `state_dict_to_bytes` (or safetensors) encoded, as CPU tensors.

    copy=True: each tensor owns its memory (one copy). copy=False: `bytes_to_state_dict_views`.
    """
    view, header, start = _safetensors_layout(data)
    out = {}
    for name, entry in header.items():
        dtype = _TORCH_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if copy or begin == end:
            t = torch.empty(shape, dtype=dtype)
            if end > begin:
                t.reshape(-1).view(torch.uint8).numpy()[:] = view[start + begin:start + end]
        else:
            with warnings.catch_warnings():
                # A read-only payload (bytes) makes torch warn that the tensors could write to
                # it; decoders only read them.
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(view, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                     offset=start + begin).view(shape)
        out[name] = t
    return out


def bytes_to_state_dict_views(data) -> Dict[str, torch.Tensor]:
    """Like `bytes_to_state_dict`, without copying: the tensors view `data` (they keep it
    alive). For readers that copy the weights into a model (Engine.load_weights): do not write
    into them, and do not change `data` while they are in use. VariableClient payloads qualify:
    the client never writes into a payload anything still references."""
    return bytes_to_state_dict(data, copy=False)


def check_compatible(reference_sd: Mapping[str, torch.Tensor],
                     new_sd: Mapping[str, torch.Tensor]) -> None:
    """Raises ValueError naming every missing or unexpected key and shape or dtype mismatch."""
    problems = []
    missing = [k for k in reference_sd if k not in new_sd]
    unexpected = [k for k in new_sd if k not in reference_sd]
    if missing:
        problems.append(f"missing keys {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_short(unexpected)}")
    for k, ref in reference_sd.items():
        new = new_sd.get(k)
        if new is None:
            continue
        if tuple(new.shape) != tuple(ref.shape):
            problems.append(f"{k}: shape {tuple(new.shape)} != expected {tuple(ref.shape)}")
        if new.dtype != ref.dtype:
            problems.append(f"{k}: dtype {new.dtype} != expected {ref.dtype}")
    if problems:
        raise ValueError("state dict does not match the model (was it made from another model "
                         "config or dtype?): " + "; ".join(problems))


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Silences transformers' tqdm bars (one per save/load) for the duration."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _short(keys, limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}] ({len(keys)} in all)"
