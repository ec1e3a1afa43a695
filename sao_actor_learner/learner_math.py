"""The math the learner and the kernels share: pure torch functions on [B, T] tensors.

- GAE (docs/METHOD.md section 7): the length-adaptive lambda, skip-observation GAE (the torch
  reference of `kernels.skip_observation_gae`), plain token-level GAE (its ablation), whitening.
- The DIS policy loss (docs/METHOD.md section 4; the torch reference of `kernels.dis_loss`) and
  the ratio statistics every policy loss reports (learner/losses.py builds on them).

Every tensor is aligned to token positions: index t describes token x_t. `values[:, t]` is the
critic's estimate of the state before action token x_t is emitted (the learner reads it from the
critic's output at position t-1). `rewards[:, t]` is the reward credited at token t; rewards on
non-action tokens are ignored (the actor credits a turn's reward to the turn's last action token).

Layering: `kernels/` and `learner/` both import this module; it imports neither (nor reverb,
tensorflow, grpc or triton), and `kernels/` imports nothing of `learner/`.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

Lambda = Union[float, torch.Tensor]


def length_adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float) -> torch.Tensor:
    """lambda = 1 - 1 / (alpha * n), clamped to [0, 1]; n = 0 gives 0 (VAPO's rule).

    num_action_tokens: [B] counts (int or float). Returns a float [B] tensor.
    """
    if alpha <= 0:
        raise ValueError(f"alpha={alpha}: must be > 0 (SAO review: 1.5; VAPO: 0.05)")
    n = torch.as_tensor(num_action_tokens).to(torch.float32)
    lam = 1.0 - 1.0 / (alpha * n.clamp(min=1e-8))
    return torch.where(n > 0, lam.clamp(0.0, 1.0), torch.zeros_like(lam))


def as_row_tensor(x: Lambda, batch: int, like: torch.Tensor) -> torch.Tensor:
    """`x` (a float or a [B] tensor) as a [B] tensor of `like`'s dtype and device."""
    t = torch.as_tensor(x, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"lambda must be a float or a [B]={batch} tensor, got shape "
                         f"{tuple(t.shape)}")
    return t


def _reverse_gae_scan(rewards: torch.Tensor, values: torch.Tensor, step_mask: torch.Tensor,
                      gamma: float, lam: torch.Tensor, bootstrap: torch.Tensor) -> torch.Tensor:
    """GAE over the steps marked in `step_mask`, each step's successor being the next marked step.

    The marked steps of every row are compacted to the front (a stable sort keeps their order),
    scanned backwards in one loop over columns (vectorised over rows), and scattered back.
    bootstrap: [B] value after the last step (0 for terminal rows).
    """
    B, T = rewards.shape
    order = torch.argsort((~step_mask).to(torch.int8), dim=1, stable=True)  # marked steps first
    r = rewards.gather(1, order)
    v = values.gather(1, order)
    m = step_mask.gather(1, order)
    n_max = int(step_mask.sum(1).max().item()) if B else 0
    adv = torch.zeros_like(r)
    next_value = bootstrap.to(r.dtype)
    next_adv = torch.zeros(B, dtype=r.dtype, device=r.device)
    for k in range(n_max - 1, -1, -1):
        mk = m[:, k]
        delta = r[:, k] + gamma * next_value - v[:, k]
        a = delta + gamma * lam * next_adv
        adv[:, k] = torch.where(mk, a, torch.zeros_like(a))
        next_value = torch.where(mk, v[:, k], next_value)
        next_adv = torch.where(mk, a, next_adv)
    return torch.zeros_like(adv).scatter(1, order, adv)


def skip_observation_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor,
                         gamma: float, lam: Lambda,
                         bootstrap_values: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation token-level GAE (docs/METHOD.md section 7).

    The successor of action token t_k is the next action token t_{k+1}, whatever observation
    tokens lie between them; the last action token of a row is terminal (plus
    gamma * bootstrap_values[b] when given, for truncated rows).

        delta_k = r[t_k] + gamma * V(t_{k+1}) - V(t_k);   A_k = delta_k + gamma * lam * A_{k+1}

    Args:
      rewards, values, action_mask: [B, T], aligned to token positions.
      lam: a float or a [B] tensor (e.g. `length_adaptive_lambda`).
      bootstrap_values: optional [B] value after the last action token (0 = terminal).
    Returns:
      (advantages, returns), [B, T]; returns = advantages + values; both zero off action tokens.
    """
    mask = action_mask.bool()
    values = values.detach()
    B = rewards.shape[0]
    lam_t = as_row_tensor(lam, B, values)
    boot = torch.zeros(B, dtype=values.dtype, device=values.device) if bootstrap_values is None \
        else bootstrap_values.detach().to(values.dtype)
    adv = _reverse_gae_scan(rewards.to(values.dtype), values, mask, gamma, lam_t, boot)
    zero = torch.zeros_like(adv)
    adv = torch.where(mask, adv, zero)
    returns = torch.where(mask, adv + values, zero)
    return adv, returns


def token_level_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor,
                    gamma: float, lam: Lambda,
                    bootstrap_values: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain token-level GAE, the ablation of `skip_observation_gae`.

    Every token from a row's first to its last action token is a step, observation tokens
    included: the recursion bootstraps through the critic's values on observation tokens as if
    they were actions. Advantages and returns are reported on action tokens only.
    """
    mask = action_mask.bool()
    values = values.detach()
    B, T = mask.shape
    pos = torch.arange(T, device=mask.device).expand(B, T)
    big = torch.full_like(pos, T)
    first = torch.where(mask, pos, big).min(1).values
    last = torch.where(mask, pos, -torch.ones_like(pos)).max(1).values
    span = (pos >= first[:, None]) & (pos <= last[:, None])
    lam_t = as_row_tensor(lam, B, values)
    boot = torch.zeros(B, dtype=values.dtype, device=values.device) if bootstrap_values is None \
        else bootstrap_values.detach().to(values.dtype)
    rew = torch.where(mask, rewards.to(values.dtype), torch.zeros_like(values))
    adv = _reverse_gae_scan(rew, values, span, gamma, lam_t, boot)
    zero = torch.zeros_like(adv)
    adv = torch.where(mask, adv, zero)
    returns = torch.where(mask, adv + values, zero)
    return adv, returns


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked entries; zero elsewhere. Used to normalise advantages."""
    m = mask.bool()
    n = m.sum()
    if n < 2:
        return torch.where(m, x, torch.zeros_like(x))
    vals = x[m]
    mean = vals.mean()
    std = vals.std(unbiased=False)
    return torch.where(m, (x - mean) / (std + eps), torch.zeros_like(x))


# --- the DIS policy loss ----------------------------------------------------------------------
NORMALIZATIONS = ("action_tokens", "kept_tokens")
# exp() of log-ratios beyond this is clamped; such tokens are far outside any trust band.
MAX_LOG_RATIO = 20.0


def ratio_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor,
                below: torch.Tensor, above: torch.Tensor) -> Dict[str, float]:
    """Statistics of the ratios r = exp(log_ratio) over the action tokens (`mask`) and of the
    tokens a trust band dropped (`below`, `above`: 1 where dropped)."""
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


def loss_denominator(normalizer: Optional[float], count: torch.Tensor) -> torch.Tensor:
    """The loss denominator: `normalizer` when given, else `count`; at least 1."""
    if normalizer is not None:
        return count.new_tensor(max(float(normalizer), 1.0))
    return count.clamp(min=1.0)


def clamped_log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """logp - ref_logp on action tokens (0 elsewhere), clamped to +-MAX_LOG_RATIO."""
    lr = torch.where(mask.bool(), logp - ref_logp, torch.zeros_like(logp))
    return lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def dis_policy_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                    action_mask: torch.Tensor, eps_low: float, eps_high: float,
                    normalization: str = "action_tokens", normalizer: Optional[float] = None
                    ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Direct double-sided importance sampling (docs/METHOD.md section 4).

        r_t    = exp(logp[t] - rollout_logp[t])
        keep_t = mask[t] * 1[1 - eps_low <= r_t <= 1 + eps_high]        (no gradient through keep)
        L      = - sum_t keep_t * r_t * A_t / sum_t mask[t]

    Tokens outside the band are dropped from the gradient, not clipped. normalization=
    "kept_tokens" divides by sum(keep) instead (the alternative kept as an option); a given
    `normalizer` replaces either (a whole batch's count when this call sees a micro-batch).
    Returns (loss, stats) with masked_below_frac, masked_above_frac, masked_frac, ratio_mean,
    ratio_max, ratio_min, kl_rollout, ess, num_action_tokens, num_kept_tokens.
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: must be one of {NORMALIZATIONS}")
    mask = action_mask.to(logp.dtype)
    log_ratio = clamped_log_ratio(logp, rollout_logp, mask)
    ratio = torch.exp(log_ratio)
    with torch.no_grad():
        below = (ratio < 1.0 - eps_low).to(logp.dtype)
        above = (ratio > 1.0 + eps_high).to(logp.dtype)
        keep = mask * (1.0 - below) * (1.0 - above)
    denom = loss_denominator(normalizer, mask.sum() if normalization == "action_tokens"
                             else keep.sum())
    loss = -(keep * ratio * advantages.detach()).sum() / denom
    stats = ratio_stats(log_ratio.detach(), ratio.detach(), mask, below, above)
    stats["num_kept_tokens"] = float(keep.sum())
    stats["policy_loss"] = float(loss.detach())
    return loss, stats
