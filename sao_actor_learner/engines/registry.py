"""The engine registry: every engine the config's --engine accepts, with how to build it from a
run configuration, the checks of its options and a one-paragraph description.

`ENGINE_SPECS` is the registration: one `EngineSpec` per engine. Each spec's `build` imports
its engine module when called, so this module (which the launcher's config validation imports)
loads neither torch nor the vLLM client. Adding an engine is its module plus its entry here
(docs/DESIGN.md, "Adding an algorithm, a task, an engine").
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, Optional, Tuple

from sao_actor_learner import core

Fail = Callable[[str], None]


def no_checks(config: Any, fail: Fail) -> None:
    """The checks of an engine that reads no options of its own."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the program knows of an engine.

    name:        the --engine value.
    description: one paragraph: where generation runs and what the engine needs.
    build:       build(config, role, run_dir, weight_sync_mode) -> core.Engine (with its
                 `tokenizer`), the engine of node `role` ("actor_<i>" or "evaluator").
    check:       check(config, fail): calls fail(message) for an invalid option of the engine
                 (run with the engine section's checks when the engine is chosen).
    """
    name: str
    description: str
    build: Callable[[Any, str, Optional[str], str], core.Engine]
    check: Callable[[Any, Fail], None] = no_checks


def build_torch_engine(config, role: str, run_dir: Optional[str],
                       weight_sync_mode: str) -> core.Engine:
    import torch

    from sao_actor_learner.config.drift import actor_dtype
    from sao_actor_learner.engines.torch_engine import TorchEngine
    # Actors sample from a copy in --actor_dtype (a precision mismatch); the evaluator in float32.
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = actor_dtype(config) if role.startswith("actor") else "float32"
    return TorchEngine.from_checkpoint(config.model, weight_sync_mode=weight_sync_mode,
                                       dtype=dtypes[dtype])


def build_vllm_engine(config, role: str, run_dir: Optional[str],
                      weight_sync_mode: str) -> core.Engine:
    """A vLLM server for node `role`, its log at <run_dir>/logs/vllm_<role>.log."""
    from sao_actor_learner.engines.vllm_engine import VLLMEngine
    log_dir = os.path.join(run_dir or config.run_dir, "logs")
    return VLLMEngine.from_checkpoint(
        config.model, weight_sync_mode=weight_sync_mode,
        python=config.vllm_python, log_path=os.path.join(log_dir, f"vllm_{role}.log"),
        start_timeout_s=config.vllm_start_timeout_s, max_restarts=config.vllm_max_restarts,
        kv_cache_gb=config.vllm_kv_cache_gb, threads=config.threads_per_process,
        enforce_eager=config.vllm_enforce_eager, seed=config.seed,
        max_concurrency=max(config.actor_batch * max(config.group_size, 1), 1))


def check_vllm_options(config, fail: Fail) -> None:
    """The vllm_* options, and that the vLLM environment's python exists."""
    from sao_actor_learner.engines.vllm_process import resolve_vllm_python  # no torch, no vllm
    if not config.vllm_start_timeout_s > 0:
        fail(f"vllm_start_timeout_s={config.vllm_start_timeout_s}: must be > 0 seconds")
    if config.vllm_max_restarts < 0:
        fail(f"vllm_max_restarts={config.vllm_max_restarts}: must be >= 0 (0: never restart)")
    if config.vllm_kv_cache_gb < 1:
        fail(f"vllm_kv_cache_gb={config.vllm_kv_cache_gb}: must be >= 1 (GiB of KV cache)")
    python = resolve_vllm_python(config.vllm_python)
    if not os.path.exists(python):
        fail(f"engine='vllm' needs the vLLM environment: vllm_python={python!r} does not "
             "exist; build it with `make vllm-env` or set --vllm_python to a python with "
             "vllm installed")


# The registration, in --engine's order.
ENGINE_SPECS: Dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec(
        name="torch",
        description="The built-in engine: the policy's Hugging Face model in the node's own "
                    "process, batched sampling with a KV cache, per-token log-probs of the "
                    "weights that sampled them, and weight changes in flight (keep, abort). "
                    "Needs nothing beyond the main venv.",
        build=build_torch_engine),
    EngineSpec(
        name="vllm",
        description="A vLLM server per node, started from its own environment "
                    "(--vllm_python, `make vllm-env`) and driven over HTTP: token ids in, "
                    "tokens with processed log-probs and per-token weight versions out; weights "
                    "pushed through a shared-memory file and vLLM's weight-transfer API, and a "
                    "dead server restarted up to --vllm_max_restarts times.",
        build=build_vllm_engine, check=check_vllm_options),
)}


def engine_names() -> Tuple[str, ...]:
    """The registered engine names, in --engine's order."""
    return tuple(ENGINE_SPECS)


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine `name`; a ValueError names the registered engines."""
    if name not in ENGINE_SPECS:
        raise ValueError(f"engine={name!r}: must be one of {', '.join(ENGINE_SPECS)}")
    return ENGINE_SPECS[name]
