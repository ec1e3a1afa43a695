"""Policy and value losses (docs/METHOD.md sections 4-6). Pure functions on [B, T] tensors.

Every loss is a token-level mean over the action tokens of the whole batch. Statistics are
returned as plain floats so callers can log them. The policy losses are registered by name in
learner/registry.py (their function, their options as config fields, whether they need the old
policy's log-probs); `policy_loss(name, ...)` runs one by its entry. The DIS loss and the ratio
helpers are in `sao_actor_learner.learner_math` (shared with the kernels) and re-exported here.
No reverb, tensorflow or grpc here.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from sao_actor_learner.config.learner import LearnerConfig
from sao_actor_learner.learner import registry
from sao_actor_learner.learner_math import (  # noqa: F401  (re-exported)
    NORMALIZATIONS, clamped_log_ratio, dis_policy_loss, loss_denominator, ratio_stats)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(x_t | x_<t) aligned to token positions: out[:, t] from logits[:, t-1]; out[:, 0] = 0.

    logits: [B, T, V]; tokens: [B, T]. Returns float32 [B, T].
    """
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def value_loss(values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               old_values: Optional[torch.Tensor] = None, clip: float = 0.0,
               normalizer: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """0.5 * (V(t) - R_t)^2, token mean over action tokens (docs/METHOD.md section 6).

    With clip > 0 and old_values given, PPO-style value clipping: the max of the unclipped loss and
    the loss of old_values + clamp(V - old_values, -clip, clip). `normalizer` replaces the
    number of action tokens as the denominator (a whole batch's, for micro-batches).
    """
    mask = action_mask.to(values.dtype)
    returns = returns.detach()
    err = 0.5 * (values - returns) ** 2
    if clip > 0 and old_values is not None:
        old = old_values.detach()
        clipped = old + (values - old).clamp(-clip, clip)
        err = torch.maximum(err, 0.5 * (clipped - returns) ** 2)
    loss = (err * mask).sum() / loss_denominator(normalizer, mask.sum())
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


# --- Comparison losses for baselines and drift studies (docs/METHOD.md section 5) ------
#
# The learner recomputes `old_logp` (log-probs of the policy it holds before this step's
# optimizer steps, no gradient) for the losses that need it. Three log-probs per token then:
#   rollout_logp  mu:      the behaviour policy that sampled the token (saved by the engine)
#   old_logp      pi_old:  the learner's policy at the start of the step (recomputed)
#   logp          pi_theta: the policy being optimised (with gradient)
# PPO-clip keeps pi_theta near pi_old; TIS and IcePop additionally correct for mu != pi_old with a
# per-token behaviour weight k = pi_old / mu (truncated, or masked outside a band); "none" treats
# the data as on-policy. With one optimizer step per batch pi_theta == pi_old at the step, so the
# PPO ratio is 1 and PPO-clip is the plain policy gradient; the clip acts from the second
# minibatch on (config policy_minibatches).

POLICY_LOSS_NAMES = registry.POLICY_LOSS_NAMES
# Losses whose ratio is taken against the recomputed old policy.
NEEDS_OLD_LOGP = tuple(p.name for p in registry.POLICY_LOSSES.values() if p.needs_old_logp)


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r}: must be one of {NORMALIZATIONS}")


def drift_stats(logp: torch.Tensor, rollout_logp: torch.Tensor,
                action_mask: torch.Tensor) -> Dict[str, float]:
    """Behaviour-vs-current drift over action tokens, whatever the loss (docs/METHOD.md section 11).

    With r = pi_theta / mu: ratio_mean, ratio_max, ratio_min, kl_rollout (mean of r - 1 - log r,
    an estimate of KL(mu || pi_theta)), ess ((sum r)^2 / (n sum r^2)), num_action_tokens.
    """
    mask = action_mask.to(logp.dtype)
    log_ratio = clamped_log_ratio(logp.detach(), rollout_logp, mask)
    ratio = torch.exp(log_ratio)
    zero = torch.zeros_like(mask)
    stats = ratio_stats(log_ratio, ratio, mask, zero, zero)
    for key in ("masked_below_frac", "masked_above_frac", "masked_frac"):
        del stats[key]
    return stats


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1.0))


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                  action_mask: torch.Tensor, clip_low: float, clip_high: float,
                  normalization: str = "action_tokens",
                  behaviour_weights: Optional[torch.Tensor] = None,
                  rollout_logp: Optional[torch.Tensor] = None, normalizer: Optional[float] = None
                  ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """PPO-clip against the recomputed old policy (the GRPO baseline's loss).

        rho_t = exp(logp[t] - old_logp[t])                                   (old_logp: no grad)
        L     = - sum_t mask_t * w_t * min(rho_t A_t, clip(rho_t, 1-clip_low, 1+clip_high) A_t)
                / sum_t mask_t

    w_t = behaviour_weights (no gradient; 1 when None) is how TIS and IcePop plug in.
    normalization="kept_tokens" divides by the number of action tokens with w_t > 0 instead.
    Stats: clip_frac (tokens where the clip is active, i.e. no gradient), clip_below_frac,
    clip_above_frac, masked_frac (= clip_frac here), ppo_ratio_mean/max, policy_loss, and the
    drift stats of `drift_stats` against rollout_logp (against old_logp when it is None).
    """
    check_normalization(normalization)
    mask = action_mask.to(logp.dtype)
    old = old_logp.detach()
    log_rho = clamped_log_ratio(logp, old, mask)
    rho = torch.exp(log_rho)
    adv = advantages.detach()
    weights = torch.ones_like(mask) if behaviour_weights is None else behaviour_weights.detach()
    surr = rho * adv
    surr_clipped = rho.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(surr, surr_clipped) * weights
    with torch.no_grad():
        clip_below = ((rho < 1.0 - clip_low) & (adv < 0)).to(logp.dtype) * mask
        clip_above = ((rho > 1.0 + clip_high) & (adv > 0)).to(logp.dtype) * mask
        nonzero = mask * (weights > 0).to(logp.dtype)
    denom = loss_denominator(normalizer, mask.sum() if normalization == "action_tokens"
                         else nonzero.sum())
    loss = (per_token * mask).sum() / denom
    stats = drift_stats(logp, rollout_logp if rollout_logp is not None else old, action_mask)
    n = mask.sum().clamp(min=1.0)
    stats["clip_below_frac"] = float(clip_below.sum() / n)
    stats["clip_above_frac"] = float(clip_above.sum() / n)
    stats["clip_frac"] = stats["clip_below_frac"] + stats["clip_above_frac"]
    stats["masked_frac"] = stats["clip_frac"]
    m = mask.bool()
    stats["ppo_ratio_mean"] = float(rho.detach()[m].mean()) if m.any() else 1.0
    stats["ppo_ratio_max"] = float(rho.detach()[m].max()) if m.any() else 1.0
    stats["num_kept_tokens"] = float(nonzero.sum())
    stats["policy_loss"] = float(loss.detach())
    return loss, stats


def tis_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                    advantages: torch.Tensor, action_mask: torch.Tensor, cap: float,
                    clip_low: float, clip_high: float, normalization: str = "action_tokens",
                    normalizer: Optional[float] = None) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Truncated importance sampling: PPO-clip weighted by w_t = min(k_t, C), k_t = pi_old / mu.

        k_t = exp(old_logp[t] - rollout_logp[t]);   w_t = min(k_t, cap)      (no gradient)
        L   = ppo_clip_loss(..., behaviour_weights=w)

    With one optimizer step per batch (pi_theta == pi_old) the gradient is
    - sum_t min(r_t, C) A_t grad log pi_theta / N with r = pi_theta / mu: classic truncated IS.
    Tokens are never dropped, only down-weighted. Stats add tis_truncated_frac (k > cap, also
    reported as masked_frac) and tis_weight_mean.
    """
    if cap <= 0:
        raise ValueError(f"cap={cap}: the TIS cap C must be > 0 (typical: 2)")
    mask = action_mask.to(logp.dtype)
    with torch.no_grad():
        k = torch.exp(clamped_log_ratio(old_logp.detach(), rollout_logp, mask))
        weights = k.clamp(max=cap)
        truncated = (k > cap).to(logp.dtype) * mask
    loss, stats = ppo_clip_loss(logp, old_logp, advantages, action_mask, clip_low, clip_high,
                                normalization, behaviour_weights=weights,
                                rollout_logp=rollout_logp, normalizer=normalizer)
    stats["tis_truncated_frac"] = _masked_mean(truncated, mask)
    stats["tis_weight_mean"] = _masked_mean(weights, mask)
    stats["masked_frac"] = stats["tis_truncated_frac"]
    return loss, stats


def icepop_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                       advantages: torch.Tensor, action_mask: torch.Tensor, band_low: float,
                       band_high: float, clip_low: float, clip_high: float,
                       normalization: str = "action_tokens", normalizer: Optional[float] = None
                       ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """IcePop-style double-sided masking of the behaviour mismatch, on top of PPO-clip.

        k_t = exp(old_logp[t] - rollout_logp[t]);   w_t = k_t if band_low <= k_t <= band_high else 0
        L   = ppo_clip_loss(..., behaviour_weights=w)

    Unlike DIS, the band is on pi_old / mu (not pi_theta / mu) and kept tokens are re-weighted by
    k. Stats add masked_below_frac / masked_above_frac / masked_frac (k outside the band) and
    icepop_weight_mean.
    """
    if not 0 < band_low <= 1.0 <= band_high:
        raise ValueError(f"band_low={band_low}, band_high={band_high}: need "
                         "0 < band_low <= 1 <= band_high (IcePop: 0.5 and 5)")
    mask = action_mask.to(logp.dtype)
    with torch.no_grad():
        k = torch.exp(clamped_log_ratio(old_logp.detach(), rollout_logp, mask))
        below = (k < band_low).to(logp.dtype) * mask
        above = (k > band_high).to(logp.dtype) * mask
        weights = k * mask * (1.0 - below) * (1.0 - above)
    loss, stats = ppo_clip_loss(logp, old_logp, advantages, action_mask, clip_low, clip_high,
                                normalization, behaviour_weights=weights,
                                rollout_logp=rollout_logp, normalizer=normalizer)
    stats["masked_below_frac"] = _masked_mean(below, mask)
    stats["masked_above_frac"] = _masked_mean(above, mask)
    stats["masked_frac"] = stats["masked_below_frac"] + stats["masked_above_frac"]
    stats["icepop_weight_mean"] = _masked_mean(weights, mask)
    return loss, stats


def no_correction_loss(logp: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor,
                       rollout_logp: Optional[torch.Tensor] = None,
                       normalizer: Optional[float] = None, normalization: str = "action_tokens"
                       ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The plain policy gradient, treating every rollout as on-policy (no IS, no clip, no mask).

        L = - sum_t mask_t * A_t * logp[t] / sum_t mask_t

    Its value is not comparable to the other losses; its gradient is what they correct.
    Drift stats are reported against rollout_logp when given; masked_frac is 0. Every token is
    kept, so both normalizations divide by the action tokens.
    """
    check_normalization(normalization)
    mask = action_mask.to(logp.dtype)
    loss = -(mask * advantages.detach() * logp).sum() / loss_denominator(normalizer, mask.sum())
    ref = rollout_logp if rollout_logp is not None else logp.detach()
    stats = drift_stats(logp, ref, action_mask)
    stats["masked_frac"] = 0.0
    stats["num_kept_tokens"] = float(mask.sum())
    stats["policy_loss"] = float(loss.detach())
    return loss, stats


def policy_loss(name: str, logp: torch.Tensor, rollout_logp: torch.Tensor,
                advantages: torch.Tensor, action_mask: torch.Tensor,
                old_logp: Optional[torch.Tensor] = None, *, options: Optional[LearnerConfig] = None,
                normalizer: Optional[float] = None, kernel: bool = False, **fields
                ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The policy loss registered as `name` (registry.POLICY_LOSSES), its options read from
    `options` (the learner's config section; default LearnerConfig()) with `fields` (config
    field names, e.g. eps_high=0.5) replacing some; loss_normalization from there too.

    `old_logp` is required by the losses that need it (NEEDS_OLD_LOGP). `normalizer` replaces
    each loss's own denominator (a whole batch's, for micro-batches). `kernel`: run the loss's
    kernel (its entry's `kernel`, on options.kernel_backend) when it has one.
    """
    entry = registry.policy_loss(name)
    if entry.needs_old_logp and old_logp is None:
        raise ValueError(f"policy loss {name!r} needs old_logp (log-probs of the policy before "
                         "this step's updates, recomputed without gradient)")
    config = options if options is not None else LearnerConfig()
    if fields:
        config = dataclasses.replace(config, **fields)
    kwargs = {keyword: getattr(config, field) for keyword, field in entry.options}
    if entry.needs_old_logp:
        kwargs["old_logp"] = old_logp
    if kernel and entry.kernel:
        function = registry.load(entry.kernel)
        kwargs["backend"] = config.kernel_backend
    else:
        function = registry.load(entry.function)
    return function(logp=logp, rollout_logp=rollout_logp, advantages=advantages,
                    action_mask=action_mask, normalization=config.loss_normalization,
                    normalizer=normalizer, **kwargs)
