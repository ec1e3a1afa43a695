"""GSPO, Group Sequence Policy Optimization (Zheng et al. 2025), as a policy loss (registry entry
"gspo"; docs/METHOD.md section 5): PPO's clipped objective on ONE importance ratio per rollout,
the geometric mean of its tokens' ratios against the recomputed old policy,

    s_i    = exp( 1/|y_i| sum_t m_it (logp_it - old_logp_it) )
    s_it   = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))          (GSPO-token: value s_i,
                                                                      gradient s_i grad logp_it)
    L      = - sum_it m_it min(s_it A_it, clip(s_it, 1 - clip_low, 1 + clip_high) A_it)
             / sum_it m_it

With per-token advantages (SAO's critic) this is GSPO-token; with one advantage per rollout (grpo,
rloo, critic_free) every token of rollout i has A_i and the gradient is exactly GSPO's
sequence-level one (times |y_i|: the loss is a token mean over the batch, as every loss here).
The clip acts on whole rollouts: a rollout whose s_i left the range (in the direction its
advantage pushes) gives no gradient at all. GSPO's ranges are small (3e-4 / 4e-4).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from sao_actor_learner.learner.losses import (check_normalization, clamped_log_ratio,
                                              drift_stats, loss_denominator)


def sequence_log_ratios(logp: torch.Tensor, old_logp: torch.Tensor,
                        action_mask: torch.Tensor) -> torch.Tensor:
    """[B] mean over each row's action tokens of logp - old_logp (no gradient; 0 for a row
    without action tokens): log s_i."""
    mask = action_mask.to(logp.dtype)
    log_ratio = clamped_log_ratio(logp.detach(), old_logp.detach(), mask)
    return log_ratio.sum(1) / mask.sum(1).clamp(min=1.0)


def gspo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                     action_mask: torch.Tensor, clip_low: float, clip_high: float,
                     normalization: str = "action_tokens",
                     rollout_logp: Optional[torch.Tensor] = None,
                     normalizer: Optional[float] = None,
                     behaviour_weights: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The GSPO(-token) loss of the module docstring on [B, T] tensors (rows are whole rollouts).

    `behaviour_weights` w_it (no gradient; 1 when None) multiply each token's term (how the
    decoupled form, learner/decoupled.py, plugs in). Without them every action token keeps its
    place in the denominator (kept_tokens equals action_tokens); with them kept_tokens counts
    the action tokens with w > 0. `normalizer` replaces the denominator (a whole batch's count,
    for micro-batches). Stats: the drift stats
    against rollout_logp (against old_logp when None), clip_below_frac / clip_above_frac /
    clip_frac (action tokens whose clip is active: no gradient; also masked_frac),
    gspo_clipped_rollout_frac (rollouts with s_i outside the range), gspo_ratio_mean/max/min
    (over rollouts with action tokens), num_kept_tokens, policy_loss.
    """
    check_normalization(normalization)
    if not 0.0 < clip_low < 1.0 or clip_high <= 0.0:
        raise ValueError(f"clip_low={clip_low}, clip_high={clip_high}: need 0 < clip_low < 1 "
                         "and clip_high > 0 (GSPO: 3e-4 and 4e-4)")
    mask = action_mask.to(logp.dtype)
    seq_ratio = torch.exp(sequence_log_ratios(logp, old_logp, action_mask))   # sg(s_i), [B]
    token_ratio = seq_ratio[:, None] * torch.exp(logp - logp.detach())        # s_it
    adv = advantages.detach()
    weights = torch.ones_like(mask) if behaviour_weights is None else behaviour_weights.detach()
    surrogate = torch.minimum(token_ratio * adv,
                              token_ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    kept = mask * (weights > 0).to(mask.dtype)
    denom = loss_denominator(normalizer, mask.sum() if normalization == "action_tokens"
                             else kept.sum())
    loss = -(surrogate * weights * mask).sum() / denom
    with torch.no_grad():
        below = (seq_ratio < 1.0 - clip_low)[:, None] & (adv < 0)
        above = (seq_ratio > 1.0 + clip_high)[:, None] & (adv > 0)
        n = mask.sum().clamp(min=1.0)
        rows = mask.sum(1) > 0
        outside = (seq_ratio < 1.0 - clip_low) | (seq_ratio > 1.0 + clip_high)
    stats = drift_stats(logp, rollout_logp if rollout_logp is not None else old_logp,
                        action_mask)
    stats["clip_below_frac"] = float((below.to(mask.dtype) * mask).sum() / n)
    stats["clip_above_frac"] = float((above.to(mask.dtype) * mask).sum() / n)
    stats["clip_frac"] = stats["clip_below_frac"] + stats["clip_above_frac"]
    stats["masked_frac"] = stats["clip_frac"]
    if rows.any():
        r = seq_ratio[rows]
        stats.update(gspo_ratio_mean=float(r.mean()), gspo_ratio_max=float(r.max()),
                     gspo_ratio_min=float(r.min()),
                     gspo_clipped_rollout_frac=float(outside[rows].float().mean()))
    else:
        stats.update(gspo_ratio_mean=1.0, gspo_ratio_max=1.0, gspo_ratio_min=1.0,
                     gspo_clipped_rollout_frac=0.0)
    stats["num_kept_tokens"] = float(kept.sum())
    stats["policy_loss"] = float(loss.detach())
    return loss, stats
