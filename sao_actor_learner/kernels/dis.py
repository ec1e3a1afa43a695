"""DIS policy loss (docs/METHOD.md section 4), forward and backward in one pass, with its statistics.

    r_t    = exp(clamp(logp[t] - rollout_logp[t], -20, 20))      (0 log-ratio off action tokens)
    keep_t = mask[t] * 1[1 - eps_low <= r_t <= 1 + eps_high]      (no gradient through keep)
    L      = - sum_t keep_t * r_t * A_t / sum_t mask[t]           (or / sum_t keep_t)

Same arguments and results as `learner_math.dis_policy_loss`, which is the torch backend.
The Triton kernel reads each token once and writes dL/dlogp (up to the normaliser) in the same
pass, so the backward is one multiply; all statistics come back in one device-to-host copy.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from sao_actor_learner import learner_math as reference
from .dispatch import load_triton_module, resolve_backend


class _TritonDIS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, rollout_logp, advantages, mask, lo, hi, kept_tokens, normalizer):
        mod = load_triton_module("_triton_dis")
        coef, totals = mod.forward(logp.reshape(-1).contiguous(),
                                   rollout_logp.reshape(-1).contiguous(),
                                   advantages.reshape(-1).contiguous(), mask, lo, hi)
        if normalizer is not None:
            denom = torch.full_like(totals[mod.MASK], float(normalizer)).clamp(min=1.0)
        else:
            denom = (totals[mod.KEEP] if kept_tokens else totals[mod.MASK]).clamp(min=1.0)
        loss = (-totals[mod.KAR] / denom).to(logp.dtype)
        ctx.save_for_backward(coef, denom)
        ctx.shape, ctx.dtype = logp.shape, logp.dtype
        ctx.mark_non_differentiable(totals)
        return loss, totals

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_totals):
        coef, denom = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * 8
        grad = (coef * (grad_loss.float() / denom)).reshape(ctx.shape).to(ctx.dtype)
        grad_ref = -grad if ctx.needs_input_grad[1] else None
        return grad, grad_ref, None, None, None, None, None, None


def _stats_from_totals(totals: torch.Tensor, loss: torch.Tensor, mod) -> Dict[str, float]:
    t = totals.tolist() + [float(loss.detach())]  # the one device sync
    n_mask, count = t[mod.MASK], t[mod.COUNT]
    n = max(n_mask, 1.0)
    stats = {
        "num_action_tokens": n_mask,
        "num_kept_tokens": t[mod.KEEP],
        "masked_below_frac": t[mod.BELOW] / n,
        "masked_above_frac": t[mod.ABOVE] / n,
    }
    stats["masked_frac"] = stats["masked_below_frac"] + stats["masked_above_frac"]
    if count > 0:
        stats["ratio_mean"] = t[mod.RSUM] / count
        stats["ratio_max"] = t[mod.RMAX]
        stats["ratio_min"] = t[mod.RMIN]
        stats["kl_rollout"] = t[mod.KL] / count
        stats["ess"] = t[mod.RSUM] ** 2 / max(count * t[mod.R2], 1e-12)
    else:
        stats.update(ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0, kl_rollout=0.0, ess=1.0)
    stats["policy_loss"] = t[-1]
    return stats


def dis_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
             action_mask: torch.Tensor, eps_low: float, eps_high: float,
             normalization: str = "action_tokens", backend: str = "auto",
             normalizer: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Direct double-sided importance sampling loss and its statistics.

    Args and returns as `learner_math.dis_policy_loss` (logp, rollout_logp, advantages,
    action_mask all [B, T] or any common shape; the loss is differentiable w.r.t. logp, and
    rollout_logp if it requires grad; advantages get no gradient). Stats: masked_below_frac,
    masked_above_frac, masked_frac, ratio_mean, ratio_max, ratio_min, kl_rollout, ess,
    num_action_tokens, num_kept_tokens, policy_loss. backend: "auto" | "triton" | "torch" (see
    dispatch.py). normalizer: divide by this instead (a whole batch's count, for micro-batches).
    The Triton backend computes in fp32 whatever the input float dtype; the loss has logp's dtype.
    """
    if normalization not in reference.NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: must be one of "
                         f"{reference.NORMALIZATIONS}")
    shapes = {tuple(x.shape) for x in (logp, rollout_logp, advantages, action_mask)}
    if len(shapes) != 1:
        raise ValueError(f"dis_loss: logp, rollout_logp, advantages and action_mask must have one "
                         f"shape, got {sorted(shapes)}")
    chosen = resolve_backend(backend, "dis_loss", (logp, rollout_logp, advantages, action_mask))
    if chosen == "torch":
        return reference.dis_policy_loss(logp, rollout_logp, advantages, action_mask, eps_low,
                                    eps_high, normalization, normalizer=normalizer)
    mod = load_triton_module("_triton_dis")
    mask = action_mask.reshape(-1).contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    loss, totals = _TritonDIS.apply(logp, rollout_logp, advantages.detach(), mask,
                                    1.0 - eps_low, 1.0 + eps_high,
                                    normalization == "kept_tokens", normalizer)
    return loss, _stats_from_totals(totals, loss, mod)
