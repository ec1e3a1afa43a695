"""A CPU weight-transfer backend for vLLM: the full state dict as a safetensors file.

Runs inside the vLLM environment (imports vllm, torch, safetensors; nothing from
sao_actor_learner). vLLM's own backends move weights over NCCL or CUDA IPC and need a GPU; on
one host a file in shared memory (/dev/shm) is as fast as a copy and works everywhere.

Protocol (vLLM's weight-transfer HTTP API, server started with
`--weight-transfer-config '{"backend": "sao_shm_file"}'` and this module's worker extension):

  POST /init_weight_transfer_engine {"init_info": {}}
  POST /start_weight_update
  POST /update_weights  {"update_info": {"path": ..., "names": [...], "dtype_names": [...],
                                         "shapes": [[...], ...]}}
  POST /finish_weight_update {"weight_version": "7"}

The update is all or nothing in the worker: the file's tensors are checked against the declared
names, shapes and dtypes AND against the served checkpoint's (every name present, no extra name,
same shape and dtype) before the model is touched, because a load that fails half way leaves
vLLM's layer-wise reload with parameters on the meta device (a dead engine). Only then does it
run vLLM's layer-wise reload (initialize, `model.load_weights`, finalize), which re-runs each
layer's `process_weights_after_loading` so fused (qkv_proj, gate_up_proj) and repacked CPU
kernel weights are rebuilt from the Hugging Face names.

Tied weights (`tie_word_embeddings`: the LM head IS embed_tokens' weight, and no lm_head.weight
is sent): the reload processes only the layer that loads the tensor (vLLM's layer-wise reload,
limitation 2), and on CPU the head's processing packs its weight for the logits GEMM
(`dispatch_cpu_unquantized_gemm`, a oneDNN / sgl-kernel copy). Without more, the head would keep
computing logits from the OLD packed weight while the embedding moved on. `reprocess_tied_layers`
re-runs that processing for every unquantized embedding or head sharing its weight with another
layer (on GPU that processing does nothing).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Dict, List, Tuple

import torch

BACKEND_NAME = "sao_shm_file"

# safetensors dtype names -> the torch dtype names the trainer side sends (str(torch.float32)
# without the "torch." prefix).
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}

ExpectedWeights = Dict[str, Tuple[Tuple[int, ...], str]]  # name -> (shape, dtype name)


def checkpoint_weight_metadata(model_dir: str) -> ExpectedWeights:
    """name -> (shape, dtype name) of every tensor in the checkpoint folder's safetensors files.

    Reads only the files' headers. These are the Hugging Face names the served model was loaded
    from, i.e. exactly what a full weight update must send.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir!r}: the served checkpoint's "
                                "weights must be safetensors (save_pretrained does that)")
    out: ExpectedWeights = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(int(d) for d in sl.get_shape()),
                             _SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower()))
    return out


def compare_weights(expected: ExpectedWeights, got: ExpectedWeights) -> List[str]:
    """Every difference between two name -> (shape, dtype) maps, as readable strings."""
    problems = []
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        problems.append(f"missing {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected {_short(unexpected)}")
    for name in sorted(set(expected) & set(got)):
        (eshape, edtype), (gshape, gdtype) = expected[name], got[name]
        if tuple(eshape) != tuple(gshape):
            problems.append(f"{name}: shape {tuple(gshape)} != served {tuple(eshape)}")
        if edtype != gdtype:
            problems.append(f"{name}: dtype {gdtype} != served {edtype}")
    return problems


def _short(names: List[str], limit: int = 6) -> str:
    return "[" + ", ".join(names[:limit]) + (", ..." if len(names) > limit else "") + \
        f"] ({len(names)})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _make_engine_class():
    """Builds the engine class (vLLM imports deferred so this module imports cheaply)."""
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                       WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclasses.dataclass
    class SharedMemoryFileInitInfo(WeightTransferInitInfo):
        """Nothing to rendezvous: the file path comes with each update."""

    @dataclasses.dataclass
    class SharedMemoryFileUpdateInfo(WeightTransferUpdateInfo):
        """One whole state dict: a safetensors file and what it must contain."""
        path: str
        names: List[str]
        dtype_names: List[str]
        shapes: List[List[int]]

        def __post_init__(self):
            if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
                raise ValueError(f"names ({len(self.names)}), dtype_names "
                                 f"({len(self.dtype_names)}) and shapes ({len(self.shapes)}) "
                                 "must have the same length")

    class SharedMemoryFileWeightTransferEngine(
            WeightTransferEngine[SharedMemoryFileInitInfo, SharedMemoryFileUpdateInfo]):
        """Loads a full Hugging Face-named state dict from a safetensors file, validated first."""

        init_info_cls = SharedMemoryFileInitInfo
        update_info_cls = SharedMemoryFileUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.expected = checkpoint_weight_metadata(vllm_config.model_config.model)

        def init_transfer_engine(self, init_info) -> None:
            pass

        def start_weight_update(self) -> None:
            pass  # all the work happens in receive_weights, after validation

        def finish_weight_update(self) -> None:
            pass

        def update_weights(self, update_info) -> None:
            # The base class ends with torch.accelerator.synchronize(), which has no CPU backend.
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info) -> None:
            from safetensors.torch import load_file

            declared = {n: (tuple(s), d) for n, s, d in
                        zip(update_info.names, update_info.shapes, update_info.dtype_names)}
            problems = compare_weights(self.expected, declared)
            if problems:
                raise ValueError("weight update rejected (nothing was loaded): "
                                 + "; ".join(problems))
            if not os.path.exists(update_info.path):
                raise FileNotFoundError(f"weight update file {update_info.path!r} does not exist")
            tensors = load_file(update_info.path, device="cpu")
            found = {n: (tuple(t.shape), _dtype_name(t.dtype)) for n, t in tensors.items()}
            problems = compare_weights(declared, found)
            if problems:
                raise ValueError(f"weight update file {update_info.path!r} does not hold what "
                                 "was declared (nothing was loaded): " + "; ".join(problems))
            from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                                 initialize_layerwise_reload)
            initialize_layerwise_reload(self.model)
            self.model.load_weights(iter(tensors.items()))
            finalize_layerwise_reload(self.model, self.model_config)
            reprocess_tied_layers(self.model)

        def shutdown(self) -> None:
            pass

    return SharedMemoryFileWeightTransferEngine


def reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Re-runs `process_weights_after_loading` of each unquantized embedding / LM head whose
    weight is shared with another layer (tied embeddings), so processed copies of it (CPU's
    packed logits GEMM) follow the weight a reload just wrote; returns how many it re-ran."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: Dict[Tuple[int, int], List[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.numel() and not param.is_meta:
                owners.setdefault((param.data_ptr(), param.numel()), []).append(module)
    done = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                done += 1
    return done


def register() -> None:
    """Registers the backend under BACKEND_NAME with vLLM's factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, _make_engine_class())


def expected_weights_json(model_dir: str) -> str:
    """checkpoint_weight_metadata as JSON ({name: [shape, dtype]})."""
    return json.dumps({n: [list(s), d] for n, (s, d) in
                       checkpoint_weight_metadata(model_dir).items()})
