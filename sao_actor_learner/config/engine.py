"""The engine section of the run configuration: which engine generates, what a new policy
version does to generations in flight, and the vLLM engine's options.

The engine's own checks are its registry entry's (engines/registry.py): the vllm_* options are
checked when --engine=vllm. Standard library only (the registry imports no engine).
"""
from __future__ import annotations

import dataclasses

from sao_actor_learner.config.sections import Fail, Section, choice, option
from sao_actor_learner.core import WEIGHT_SYNC_MODES
from sao_actor_learner.engines.registry import engine_names, engine_spec


@dataclasses.dataclass(frozen=True)
class EngineConfig(Section):
    """The generation engine: the built-in torch engine or a vLLM server per node."""
    engine: str = option("torch", "Generation engine: torch (in-process) or vllm (a vLLM "
                         "server per actor, in its own venv).")
    weight_sync_mode: str = option("off", "What a new version does to an actor's generations "
                                   "in flight (both engines): off: weights change between "
                                   "batches only; keep: they continue on the new weights from "
                                   "the next token; abort: they restart from their prompts.")
    vllm_python: str = option("", "The vLLM environment's python; empty: $SAO_VLLM_PYTHON or "
                              ".venv-vllm/bin/python.")
    vllm_start_timeout_s: float = option(300.0, "A vLLM server not healthy by then is an "
                                         "error (with its log).")
    vllm_max_restarts: int = option(3, "Restarts of a dead vLLM server per engine before "
                                    "errors propagate.")
    vllm_kv_cache_gb: int = option(1, "KV cache of each vLLM server in GiB "
                                   "(VLLM_CPU_KVCACHE_SPACE on CPU).")
    vllm_enforce_eager: bool = option(True, "No torch.compile in the vLLM server (starts ~2x "
                                      "faster on CPU).")
    vllm_evaluator: bool = option(False, "The evaluator uses vLLM too (default: the torch "
                                  "engine).")

    def check(self, fail: Fail) -> None:
        choice(self, "engine", engine_names(), fail)
        if self.weight_sync_mode not in WEIGHT_SYNC_MODES:
            fail(f"weight_sync_mode={self.weight_sync_mode!r}: must be one of "
                 f"{', '.join(WEIGHT_SYNC_MODES)} (keep: generations in flight continue on the "
                 "new weights; abort: they restart from their prompts; off: weights change "
                 "only between batches)")
        if self.engine in engine_names():
            engine_spec(self.engine).check(self, fail)   # the chosen engine's own options
