"""Checkpoint folders and weight bytes.

A checkpoint folder is what `save_pretrained` writes (config.json, generation_config.json,
model.safetensors) plus our `char_tokenizer.json` and the Hugging Face fast tokenizer files
(tokenizer.json, tokenizer_config.json), so the same folder loads here (`load_policy`), with
`AutoModelForCausalLM` / `AutoTokenizer`, and in vLLM.

Weights travel between processes as safetensors bytes of a state dict with Hugging Face names
(`state_dict_to_bytes` / `bytes_to_state_dict`). Without copies of gigabytes (issue 8,
BENCHMARKS.md section 4): `state_dict_to_buffers` gives the same payload as a header plus views of
the tensors (the variable publisher streams them as they are), and `bytes_to_state_dict_views`
decodes into tensors that view the payload. `check_compatible` validates a new state dict
against a reference one before anything is loaded: a failed load half way would leave an engine
with mixed weights.

No reverb, tensorflow or grpc here (the GPU kernel machine has neither).
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import warnings
from typing import Dict, Iterator, List, Mapping, Tuple

import torch

from sao_actor_learner.models.tokenizer import CharTokenizer

HF_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # the name transformers 4.x and 5.x both resolve


def save_checkpoint(model: torch.nn.Module, tokenizer: CharTokenizer, path: str) -> str:
    """Writes `model` (safetensors) and `tokenizer` (ours + Hugging Face fast) into `path`."""
    os.makedirs(path, exist_ok=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    if vocab < tokenizer.vocab_size:
        raise ValueError(f"model vocab_size={vocab} < tokenizer vocab_size={tokenizer.vocab_size}: "
                         "the model cannot embed every token; build it with the tokenizer's size")
    with _no_progress_bars():
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.to_hf().save_pretrained(path)
    tokenizer.save(path)
    # transformers 5 writes tokenizer_class "TokenizersBackend", unknown to transformers 4.x (which
    # a vLLM environment may carry); "PreTrainedTokenizerFast" loads in both.
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = HF_TOKENIZER_CLASS
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return path


def load_policy(path: str, dtype: torch.dtype = torch.float32) -> Tuple[torch.nn.Module, CharTokenizer]:
    """(model in eval mode, CharTokenizer) from a folder written by `save_checkpoint`."""
    from transformers import AutoModelForCausalLM

    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"no config.json in {path!r}: not a checkpoint folder; write one with "
            "save_checkpoint (programs/sft.py --out_dir=... does)")
    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    tokenizer = CharTokenizer.load(path)
    return model, tokenizer


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
