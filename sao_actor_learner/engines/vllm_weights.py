"""Weights for the vLLM server: checked against the served model, written as one file, pushed.

A failed weight load kills vLLM's engine, so `check_state_dict` refuses anything but exactly the
served names, shapes and dtypes with finite values before a byte reaches the server; the
server then reads the file `write_weights_file` made (in /dev/shm when writable) through the
weight-transfer backend in `vllm_server/`. torch and safetensors are imported on first use.
"""
from __future__ import annotations

import json
import os
import uuid
from typing import Dict, List, Mapping, Tuple

from sao_actor_learner.engines.vllm_process import VLLMServer, VLLMServerError, shm_dir

# name -> (shape, torch dtype name without "torch.")
Manifest = Mapping[str, Tuple[Tuple[int, ...], str]]
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U8": "uint8", "BOOL": "bool"}


def check_state_dict(state_dict: dict, expected: Manifest, model_dir: str) -> None:
    """Raises ValueError, listing every problem, unless `state_dict` has exactly the names,
    shapes and dtypes of `expected` (the model served from `model_dir`) and finite values."""
    import torch

    problems = []
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing:
        problems.append(f"missing keys {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_short(unexpected)}")
    for name in sorted(set(expected) & set(state_dict)):
        t = state_dict[name]
        shape, dtype = expected[name]
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: a {type(t).__name__}, not a tensor")
            continue
        if tuple(t.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(t.shape)} != served {tuple(shape)}")
        if _dtype_name(t.dtype) != dtype:
            problems.append(f"{name}: dtype {_dtype_name(t.dtype)} != served {dtype}")
        elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
            problems.append(f"{name}: has non-finite values (diverged weights?)")
    if problems:
        raise ValueError(
            "state dict rejected before it reached the vLLM server (the served model is "
            f"{model_dir!r}; was the state dict made from another model config or dtype?): "
            + "; ".join(problems))


def write_weights_file(state_dict: dict, stem: str) -> str:
    """Writes `state_dict` (on CPU, contiguous; tied tensors copied apart) as one safetensors
    file `<shm_dir>/<stem>_<random>.safetensors`; returns its path. The caller removes it."""
    from safetensors.torch import save_file

    path = os.path.join(shm_dir(), f"{stem}_{uuid.uuid4().hex[:6]}.safetensors")
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in state_dict.items()}
    if len({t.data_ptr() for t in tensors.values()}) < len(tensors):
        tensors = {n: t.clone() for n, t in tensors.items()}  # tied weights share storage
    save_file(tensors, path)
    return path


def push_weights(server: VLLMServer, path: str, version: int, mode: str) -> None:
    """Loads the safetensors file `path` into the running `server` as policy `version`:
    pause (mode "keep" freezes in-flight requests, "abort" aborts them), the weight update,
    a prefix-cache reset that also preempts running requests (so no KV computed by the old
    weights survives), resume (always, also after a failure). Raises VLLMServerError, HTTPError
    or a transport error (OSError, http.client.HTTPException)."""
    meta = safetensors_header(path)
    info = {"path": path, "names": list(meta),
            "dtype_names": [d for _, d in meta.values()],
            "shapes": [list(s) for s, _ in meta.values()]}
    server.call("POST", f"/pause?mode={mode}")
    try:
        server.call("POST", "/start_weight_update")
        server.call("POST", "/update_weights", {"update_info": info}, timeout=600.0)
        server.call("POST", "/finish_weight_update", {"weight_version": str(version)})
        # Without this, cached prefixes keep KV computed by the old weights.
        # reset_running_requests preempts running requests so their KV is recomputed too.
        reply = server.call("POST", "/reset_prefix_cache?reset_running_requests=true")
        if not (reply or {}).get("success", False):
            raise VLLMServerError(f"/reset_prefix_cache failed after the update to version "
                                  f"{version}: {reply}; cached prefixes would keep old KV")
    finally:
        server.call("POST", "/resume")


def safetensors_header(path: str) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """name -> (shape, torch dtype name) from a safetensors file's header (in file order)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (tuple(v["shape"]), _SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"].lower()))
            for k, v in header.items()}


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _short(names: List[str], limit: int = 8) -> str:
    return "[" + ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") + \
        f"] ({len(names)} in all)"
