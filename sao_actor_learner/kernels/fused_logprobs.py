"""Log-probabilities (and entropies) of target tokens straight from hidden states and the LM head.

    z_i       = hidden_i @ W^T / temperature                      (the [V] logits of token i)
    logp_i    = z_i[target_i] - logsumexp(z_i)
    entropy_i = logsumexp(z_i) - sum_v softmax(z_i)_v z_iv

Gradients, with g = dL/dlogp, e = dL/dentropy, p = softmax(z_i), mu_i = sum_v p_v z_iv:

    dL/dz_iv    = g_i (1[v = target_i] - p_iv) - e_i p_iv (z_iv - mu_i)
    grad_hidden = (dL/dz) W / temperature,   grad_W = (dL/dz)^T hidden / temperature

Logits for 32k tokens over a 152k vocabulary are ~20 GB in fp32; neither backend ever holds them
all. The torch backend (the reference, any device) works on chunks of tokens: it holds at most
`chunk_size` logits at a time in fp32 (forward, and again in the backward, which recomputes
them). The Triton backend (CUDA, or the CPU interpreter for tests) computes the forward with an
online log-sum-exp over vocabulary tiles and recomputes logits tile by tile in the backward; see
`_triton_logprobs.py`.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .dispatch import load_triton_module, resolve_backend

# Logits held at once: torch backend (fp32, several temporaries of this size), and the Triton
# backward's logit-gradient slice (input dtype: 512 MiB in bf16).
_TORCH_CHUNK_ELEMS = 1 << 25
_TRITON_CHUNK_ELEMS = 1 << 28


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class _TorchFusedLogprobs(torch.autograd.Function):
    """The reference: exact fp32 (fp64 for fp64 inputs) math, chunked over tokens."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, rows):
        N = hidden.shape[0]
        cdt = _compute_dtype(hidden, weight)
        w = weight.to(cdt)
        logp = torch.empty(N, dtype=cdt, device=hidden.device)
        lse = torch.empty_like(logp)
        mu = torch.empty_like(logp) if with_entropy else None
        for s in range(0, N, rows):
            z = (hidden[s:s + rows].to(cdt) @ w.t()) / temperature
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s:s + rows] = lse_c
            logp[s:s + rows] = z.gather(1, targets[s:s + rows, None]).squeeze(1) - lse_c
            if with_entropy:
                p = torch.exp(z - lse_c[:, None])
                mu[s:s + rows] = (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, mu)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)
        entropy = lse - mu if with_entropy else torch.empty(0, dtype=cdt, device=hidden.device)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, mu = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_entropy is not None and grad_entropy.numel() == 0:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        N = hidden.shape[0]
        cdt = lse.dtype
        w = weight.to(cdt)
        grad_h = torch.empty(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        for s in range(0, N, rows):
            h = hidden[s:s + rows].to(cdt)
            z = (h @ w.t()) / T
            p = torch.exp(z - lse[s:s + rows, None])
            if grad_logp is not None:
                g = grad_logp[s:s + rows].to(cdt)
                dz = -p * g[:, None]
                dz.scatter_add_(1, targets[s:s + rows, None], g[:, None])
            else:
                dz = torch.zeros_like(z)
            if grad_entropy is not None:
                e = grad_entropy[s:s + rows].to(cdt)
                dz -= e[:, None] * p * (z - mu[s:s + rows, None])
            dz /= T
            if need_h:
                grad_h[s:s + rows] = dz @ w
            if need_w:
                grad_w.addmm_(dz.t(), h)
        return (grad_h.to(hidden.dtype) if need_h else None,
                grad_w.to(weight.dtype) if need_w else None, None, None, None, None)


class _TritonFusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, chunk_elems, config):
        mod = load_triton_module("_triton_logprobs")
        inv_temp = 1.0 / temperature
        lse, zt, mu = mod.forward(hidden, weight, targets, inv_temp, with_entropy, config)
        ctx.save_for_backward(hidden, weight, targets, lse, mu)
        ctx.inv_temp, ctx.chunk_elems, ctx.config = inv_temp, chunk_elems, config
        ctx.set_materialize_grads(False)
        logp = zt - lse
        entropy = lse - mu if with_entropy else torch.empty(0, device=hidden.device)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, mu = ctx.saved_tensors
        if grad_entropy is not None and grad_entropy.numel() == 0:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
        mod = load_triton_module("_triton_logprobs")
        grad_h, grad_w = mod.backward(
            hidden, weight, targets, lse, mu, grad_logp, grad_entropy, ctx.inv_temp,
            ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.chunk_elems, ctx.config)
        return grad_h, grad_w, None, None, None, None, None


def fused_logprobs(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0, return_entropy: bool = False, backend: str = "auto",
                   chunk_size: Optional[int] = None, _triton_config: Optional[dict] = None
                   ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """log softmax(hidden @ lm_head_weight^T / temperature)[target], without the full logits.

    Args:
      hidden: [..., H] final hidden states (bf16, fp16, fp32; fp64 on the torch backend).
      lm_head_weight: [V, H] LM head (output embedding) weight; the Triton backend wants the
        same dtype as `hidden`.
      targets: [...] integer token ids in [0, V), the token each hidden state predicts (for a
        causal LM: hidden[:, :-1] with tokens[:, 1:]). The torch backend raises on ids outside
        [0, V); the Triton backend returns NaN for them (checking would cost a device sync).
      temperature: logits are divided by it (the sampler's temperature, so that the
        log-probabilities match the rollout's).
      return_entropy: also return the entropy of softmax(z) per token (differentiable).
      backend: "auto" (Triton on CUDA tensors, the torch reference elsewhere), "triton", "torch".
      chunk_size: the most logits held at once: torch backend, rows of tokens with
        rows * V <= chunk_size (default 2**25, ~128 MiB per fp32 temporary; it also makes one
        fp32 copy of a 16-bit weight); Triton backward, vocabulary slices with
        N * slice <= chunk_size (default 2**28, 512 MiB in bf16).
    Returns:
      logp [...] (fp32; fp64 for fp64 inputs on the torch backend), and entropy [...] when
      return_entropy. Differentiable w.r.t. hidden and lm_head_weight (once: no double backward).
    """
    if hidden.shape[-1] != lm_head_weight.shape[-1] or lm_head_weight.ndim != 2:
        raise ValueError(f"fused_logprobs: hidden {tuple(hidden.shape)} and lm_head_weight "
                         f"{tuple(lm_head_weight.shape)} must be [..., H] and [V, H]")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"fused_logprobs: targets {tuple(targets.shape)} must have hidden's "
                         f"leading shape {tuple(hidden.shape[:-1])}")
    if targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"fused_logprobs: targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"fused_logprobs: temperature={temperature}: must be > 0")
    lead = hidden.shape[:-1]
    H = hidden.shape[-1]
    V = lm_head_weight.shape[0]
    h2 = hidden.reshape(-1, H)
    tg = targets.reshape(-1)
    chosen = resolve_backend(backend, "fused_logprobs", (hidden, lm_head_weight, targets))
    if chosen == "torch":
        elems = chunk_size or _TORCH_CHUNK_ELEMS
        rows = max(1, elems // max(V, 1))
        logp, ent = _TorchFusedLogprobs.apply(h2, lm_head_weight, tg.long(), float(temperature),
                                              bool(return_entropy), rows)
    else:
        if hidden.dtype != lm_head_weight.dtype:
            raise TypeError(f"fused_logprobs: backend='triton' wants hidden ({hidden.dtype}) and "
                            f"lm_head_weight ({lm_head_weight.dtype}) in the same dtype")
        if h2.stride(-1) != 1:
            h2 = h2.contiguous()
        logp, ent = _TritonFusedLogprobs.apply(
            h2, lm_head_weight, tg.contiguous(), float(temperature), bool(return_entropy),
            int(chunk_size or _TRITON_CHUNK_ELEMS), _triton_config)
    logp = logp.reshape(lead)
    if return_entropy:
        return logp, ent.reshape(lead)
    return logp
