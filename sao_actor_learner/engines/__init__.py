"""Engines: the built-in torch engine and the vLLM engine (a vLLM server in `.venv-vllm`).
`registry.py` registers them (--engine's values, how each is built from a config, its checks).

Exports are imported on first use (PEP 562), so `import sao_actor_learner.engines` costs
nothing and `vllm_server/` (which runs inside the vLLM environment) is never imported here.
"""
import importlib

_EXPORTS = {
    "TorchEngine": "sao_actor_learner.engines.torch_engine",
    "VLLMEngine": "sao_actor_learner.engines.vllm_engine",
    "VLLMServer": "sao_actor_learner.engines.vllm_engine",
    "VLLMServerError": "sao_actor_learner.engines.vllm_engine",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(list(globals()) + __all__)
