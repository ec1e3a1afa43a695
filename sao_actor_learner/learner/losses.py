"""Policy and value losses (SAO.md sections 3 and 4). Pure functions on [B, T] tensors.

Every loss is a token-level mean over the action tokens of the whole batch. Statistics are
returned as plain floats so callers can log them. No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

NORMALIZATIONS = ("action_tokens", "kept_tokens")
# exp() of log-ratios beyond this is clamped; such tokens are far outside any trust band.
_MAX_LOG_RATIO = 20.0


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(x_t | x_<t) aligned to token positions: out[:, t] from logits[:, t-1]; out[:, 0] = 0.

    logits: [B, T, V]; tokens: [B, T]. Returns float32 [B, T].
    """
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def _ratio_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor,
                 below: torch.Tensor, above: torch.Tensor) -> Dict[str, float]:
    n = mask.sum().clamp(min=1.0)
    r = ratio[mask.bool()]
    lr = log_ratio[mask.bool()]
    stats = {
        "num_action_tokens": float(mask.sum()),
        "masked_below_frac": float((below * mask).sum() / n),
        "masked_above_frac": float((above * mask).sum() / n),
    }
    stats["masked_frac"] = stats["masked_below_frac"] + stats["masked_above_frac"]
    if r.numel():
        stats["ratio_mean"] = float(r.mean())
        stats["ratio_max"] = float(r.max())
        stats["ratio_min"] = float(r.min())
        # KL(rollout || current) estimated per token as r - 1 - log r (k3 estimator).
        stats["kl_rollout"] = float((r - 1.0 - lr).mean())
        stats["ess"] = float(r.sum() ** 2 / (r.numel() * (r ** 2).sum()).clamp(min=1e-12))
    else:
        stats.update(ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0, kl_rollout=0.0, ess=1.0)
    return stats


def _log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    lr = torch.where(mask.bool(), logp - ref_logp, torch.zeros_like(logp))
    return lr.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def dis_policy_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                    action_mask: torch.Tensor, eps_low: float, eps_high: float,
                    normalization: str = "action_tokens") -> Tuple[torch.Tensor, Dict[str, float]]:
    """Direct double-sided importance sampling (SAO.md section 3).

        r_t    = exp(logp[t] - rollout_logp[t])
        keep_t = mask[t] * 1[1 - eps_low <= r_t <= 1 + eps_high]        (no gradient through keep)
        L      = - sum_t keep_t * r_t * A_t / sum_t mask[t]

    Tokens outside the band are dropped from the gradient, not clipped. normalization=
    "kept_tokens" divides by sum(keep) instead (the alternative SAO.md keeps as an option).
    Returns (loss, stats) with masked_below_frac, masked_above_frac, masked_frac, ratio_mean,
    ratio_max, ratio_min, kl_rollout, ess, num_action_tokens.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: must be one of {NORMALIZATIONS}")
    mask = action_mask.to(logp.dtype)
    log_ratio = _log_ratio(logp, rollout_logp, mask)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        below = (ratio < 1.0 - eps_low).to(logp.dtype)
        above = (ratio > 1.0 + eps_high).to(logp.dtype)
        keep = mask * (1.0 - below) * (1.0 - above)
    denom = mask.sum() if normalization == "action_tokens" else keep.sum()
    loss = -(keep * ratio * advantages.detach()).sum() / denom.clamp(min=1.0)
    stats = _ratio_stats(log_ratio.detach(), ratio.detach(), mask, below, above)
    stats["policy_loss"] = float(loss.detach())
    return loss, stats


def value_loss(values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               old_values: Optional[torch.Tensor] = None, clip: float = 0.0
               ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """0.5 * (V(t) - R_t)^2, token mean over action tokens (SAO.md section 4).

    With clip > 0 and old_values given, PPO-style value clipping: the max of the unclipped loss and
    the loss of old_values + clamp(V - old_values, -clip, clip).
    """
    mask = action_mask.to(values.dtype)
    returns = returns.detach()
    err = 0.5 * (values - returns) ** 2
    if clip > 0 and old_values is not None:
        old = old_values.detach()
        clipped = old + (values - old).clamp(-clip, clip)
        err = torch.maximum(err, 0.5 * (clipped - returns) ** 2)
    loss = (err * mask).sum() / mask.sum().clamp(min=1.0)
    stats = {"value_loss": float(loss.detach()),
             "explained_variance": explained_variance(values.detach(), returns, mask)}
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over masked entries; 0 when Var(R) is 0 or nothing is masked."""
    m = mask.bool()
    if m.sum() < 2:
        return 0.0
    r = returns[m].double()
    v = values[m].double()
    var_r = r.var(unbiased=False)
    if var_r <= 1e-12:
        return 0.0
    return float(1.0 - (r - v).var(unbiased=False) / var_r)
