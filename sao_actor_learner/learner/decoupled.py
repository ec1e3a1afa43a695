"""Decoupled PPO-clip and GSPO (registry entries "ppo_clip_decoupled" and "gspo_decoupled";
docs/METHOD.md section 5): the decoupled objective of AReaL's asynchronous PPO (Fu et al. 2025),
which separates the two jobs the old policy does in PPO.

Three log-probs per token: mu = rollout_logp (the behaviour policy: what the actor really sampled
with, saved by the engine), pi_prox = old_logp (the proximal policy: the learner's policy at the
start of the step, recomputed without gradient) and pi_theta = logp (being optimised).

    k_t  = exp(old_logp[t] - rollout_logp[t])                   pi_prox / mu     (no gradient)
    w_t  = k_t if k_t <= cap else 0                             (AReaL: beyond the cap, dropped)
    ppo_clip_decoupled:  L = - sum_t m_t w_t min(rho_t A_t, clip(rho_t, 1 - lo, 1 + hi) A_t) / D
                         rho_t = pi_theta / pi_prox   (the PPO ratio, clipped: the trust region)
    gspo_decoupled:      L = - sum_t m_t w_t min(s_it A_t, clip(s_it, 1 - lo, 1 + hi) A_t) / D
                         s_it: GSPO's sequence ratio against pi_prox (learner/gspo.py)

The clip keeps pi_theta near pi_prox; the behaviour weight w corrects for the rollouts having
been sampled by mu, however stale. With one optimizer step per batch pi_theta == pi_prox, rho = 1,
and the gradient is - sum_t w_t A_t grad log pi_theta / D: importance sampling from mu with the
weight pi_theta / mu, tokens beyond the cap dropped. The plain `ppo_clip` and `gspo` take no
behaviour weight (w = 1), so there they are the uncorrected policy gradient. The weight is per
token in both (as AReaL's sequence-level option: only the clipped ratio is per sequence).

D: the action tokens (loss_normalization=action_tokens) or those with w > 0 (kept_tokens).
Stats: those of the underlying loss (drift stats against mu, clip fractions, the proximal ratio,
num_kept_tokens, policy_loss) with masked_frac = behaviour_capped_frac (action tokens dropped by
the cap), plus behaviour_weight_mean (of w over action tokens, dropped ones as 0),
behaviour_weight_max (of k, before the cap) and kl_behaviour (k3 estimate of KL(mu || pi_prox):
mean of k - 1 - log k). No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from sao_actor_learner.learner.gspo import gspo_policy_loss
from sao_actor_learner.learner.losses import clamped_log_ratio, ppo_clip_loss


def behaviour_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                      action_mask: torch.Tensor, cap: float
                      ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """(w [B, T], stats): w_t = pi_prox / mu on action tokens, 0 beyond `cap` and off them (no
    gradient); stats behaviour_capped_frac, behaviour_weight_mean, behaviour_weight_max,
    kl_behaviour (module docstring)."""
    if not cap > 1.0:
        raise ValueError(f"cap={cap}: the behaviour weight cap must be > 1 so on-policy tokens "
                         "(weight 1) are kept (AReaL: 5; inf: no cap)")
    mask = action_mask.to(old_logp.dtype)
    with torch.no_grad():
        log_k = clamped_log_ratio(old_logp.detach(), rollout_logp.detach(), mask)
        k = torch.exp(log_k)
        capped = (k > cap).to(mask.dtype) * mask
        weights = k * mask * (1.0 - capped)
        m = mask.bool()
        n = mask.sum().clamp(min=1.0)
        stats = {"behaviour_capped_frac": float(capped.sum() / n),
                 "behaviour_weight_mean": float(weights.sum() / n),
                 "behaviour_weight_max": float(k[m].max()) if m.any() else 1.0,
                 "kl_behaviour": float(((k - 1.0 - log_k) * mask).sum() / n)}
    return weights, stats


def ppo_clip_decoupled_loss(logp: torch.Tensor, old_logp: torch.Tensor,
                            rollout_logp: torch.Tensor, advantages: torch.Tensor,
                            action_mask: torch.Tensor, clip_low: float, clip_high: float,
                            cap: float, normalization: str = "action_tokens",
                            normalizer: Optional[float] = None
                            ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO-clip against the proximal policy (old_logp), weighted by the behaviour weight
    pi_prox / mu (module docstring). The clip statistics stay clip_frac / clip_below_frac /
    clip_above_frac; masked_frac is the cap's."""
    weights, extra = behaviour_weights(old_logp, rollout_logp, action_mask, cap)
    loss, stats = ppo_clip_loss(logp, old_logp, advantages, action_mask, clip_low, clip_high,
                                normalization, behaviour_weights=weights,
                                rollout_logp=rollout_logp, normalizer=normalizer)
    stats.update(extra)
    stats["masked_frac"] = extra["behaviour_capped_frac"]
    return loss, stats


def gspo_decoupled_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                        advantages: torch.Tensor, action_mask: torch.Tensor, clip_low: float,
                        clip_high: float, cap: float, normalization: str = "action_tokens",
                        normalizer: Optional[float] = None
                        ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """GSPO(-token) with its sequence ratio against the proximal policy (old_logp), each token
    weighted by the behaviour weight pi_prox / mu (module docstring). The clip statistics stay
    clip_frac and gspo_*; masked_frac is the cap's."""
    weights, extra = behaviour_weights(old_logp, rollout_logp, action_mask, cap)
    loss, stats = gspo_policy_loss(logp, old_logp, advantages, action_mask, clip_low, clip_high,
                                   normalization, rollout_logp=rollout_logp,
                                   normalizer=normalizer, behaviour_weights=weights)
    stats.update(extra)
    stats["masked_frac"] = extra["behaviour_capped_frac"]
    return loss, stats
