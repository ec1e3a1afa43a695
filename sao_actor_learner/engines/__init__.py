"""Engines: the built-in torch engine (the vLLM HTTP client lives beside it)."""
from sao_actor_learner.engines.torch_engine import TorchEngine

__all__ = ["TorchEngine"]
