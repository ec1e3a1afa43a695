"""Checkpoint folders and weight bytes.

A checkpoint folder is what `save_pretrained` writes (config.json, generation_config.json,
model.safetensors) plus our `char_tokenizer.json` and the Hugging Face fast tokenizer files
(tokenizer.json, tokenizer_config.json), so the same folder loads here (`load_policy`), with
`AutoModelForCausalLM` / `AutoTokenizer`, and in vLLM.

Weights travel between processes as safetensors bytes of a state dict with Hugging Face names
(`state_dict_to_bytes` / `bytes_to_state_dict`). `check_compatible` validates a new state dict
against a reference one before anything is loaded: a failed load half way would leave an engine
with mixed weights.

No reverb, tensorflow or grpc here (the GPU kernel machine has neither).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Dict, Iterator, Mapping, Tuple

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


def state_dict_to_bytes(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """Safetensors bytes of `state_dict` (tensors are copied to contiguous CPU memory)."""
    from safetensors.torch import save

    tensors = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        tensors[name] = t.detach().to("cpu").contiguous()
    if len({t.data_ptr() for t in tensors.values() if t.numel()}) < sum(
            1 for t in tensors.values() if t.numel()):
        # Tied weights share storage; safetensors refuses them. Clone so each name has its own.
        tensors = {n: t.clone() for n, t in tensors.items()}
    return save(tensors)


def bytes_to_state_dict(data: bytes) -> Dict[str, torch.Tensor]:
    """The state dict that `state_dict_to_bytes` encoded (CPU tensors)."""
    from safetensors.torch import load

    return load(bytes(data))


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
