"""Fused kernels for the learner's hot spots, each with a Triton and a torch backend.

- `fused_logprobs`: log-probabilities (and entropies) of target tokens from hidden states and the
  LM head, never materialising the [N, V] logits.
- `dis_loss`: the DIS policy loss (docs/METHOD.md section 4), forward and backward in one pass.
- `skip_observation_gae`: skip-observation GAE (docs/METHOD.md section 7), one reverse scan per row.

Every function takes backend="auto" | "triton" | "torch"; "auto" runs Triton on CUDA tensors and
the torch reference elsewhere (see `dispatch.py`). This package imports only torch and the
pure-torch references of `sao_actor_learner.learner_math` (never `learner/`): triton is imported
when a Triton kernel first runs, so the package imports where triton is missing; reverb,
tensorflow and grpc are never imported.

To run the Triton kernels on CPU (tests), set TRITON_INTERPRET=1 in the environment before the
first Triton kernel runs in the process.
"""
from .dis import dis_loss
from .dispatch import BACKENDS, interpreter_enabled, resolve_backend, triton_available
from .fused_logprobs import fused_logprobs
from .gae import skip_observation_gae

__all__ = ["BACKENDS", "dis_loss", "fused_logprobs", "interpreter_enabled", "resolve_backend",
           "skip_observation_gae", "triton_available"]
