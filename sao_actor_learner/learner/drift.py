"""Drift metrics of a policy step and the alarms on them (docs/METHOD.md section 11, "Drift
metrics"). Pure functions on whole-batch [B, T] tensors (the policy step gathers every rank's
rows first, so in a learner group they are the group's numbers); no reverb, tensorflow or grpc.

With d_t = clamp(logp_theta[t] - rollout_logp[t], -20, 20) on the action tokens (the same clamp
as the losses) and w_t = exp(d_t):
  chi2_token          mean_t w_t^2 - 1
  chi2_seq            mean_s W_s^2 - 1,  W_s = exp(clamp(sum_{t in s} d_t, -20, 20))
  log_ppl_ratio       mean_t (-d_t) = log(ppl_theta / ppl_mu) over all action tokens (the k1
                      estimate of KL(mu || pi_theta)); ppl_ratio its exp
  ppl_ratio_seq_mean  mean_s exp(-mean_{t in s} d_t) (per-sequence perplexity ratios, averaged)
  token_entropy_mean  mean_t H_t, H_t the entropy of the current sampling distribution at t
  ratio_outside_band_frac  the fraction of action tokens with w_t outside DIS's band
                      [1 - eps_low, 1 + eps_high], whatever the loss (DIS's masked_frac; a
                      drift indicator also for losses that mask nothing against the behaviour
                      policy, e.g. PPO-clip at one minibatch)
plus advantage statistics over the action tokens and per-rollout staleness spans.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

MAX_LOG_RATIO = 20.0   # the clamp of token log-ratios (as in losses.py) and of sequence sums
ALARMS = ("ess_low", "kl_high", "chi2_high")


def log_ratios(logp: torch.Tensor, rollout_logp: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float64 d_t = clamp(logp - rollout_logp, -20, 20) on action tokens, 0 elsewhere."""
    m = mask.bool()
    d = (logp.double() - rollout_logp.double()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.where(m, d, torch.zeros_like(d))


def ratio_metrics(logp: torch.Tensor, rollout_logp: torch.Tensor,
                  mask: torch.Tensor) -> Dict[str, float]:
    """chi2_token, chi2_seq, log_ppl_ratio, ppl_ratio, ppl_ratio_seq_mean (module docstring).
    Sequences without action tokens (padding rows) are left out of the sequence means; with no
    action token at all every metric is that of identical policies (0, or 1 for ratios)."""
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        return {"chi2_token": 0.0, "chi2_seq": 0.0, "log_ppl_ratio": 0.0, "ppl_ratio": 1.0,
                "ppl_ratio_seq_mean": 1.0}
    d = log_ratios(logp, rollout_logp, mask)
    chi2_token = float(torch.exp(2.0 * d[m]).mean() - 1.0)
    counts = m.sum(1)
    rows = counts > 0
    seq_sum = d.sum(1)[rows].clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    chi2_seq = float(torch.exp(2.0 * seq_sum).mean() - 1.0)        # at most e^40 - 1
    log_ppl = float(-d[m].sum() / n)
    seq_log_ppl = -d.sum(1)[rows] / counts[rows].double()
    return {"chi2_token": chi2_token, "chi2_seq": chi2_seq, "log_ppl_ratio": log_ppl,
            "ppl_ratio": math.exp(log_ppl),
            "ppl_ratio_seq_mean": float(torch.exp(seq_log_ppl).mean())}


def outside_band_frac(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                      low: float, high: float) -> float:
    """The fraction of action tokens whose ratio exp(d_t) is < low or > high (0 when there
    are none): the tokens DIS with the band [low, high] masks."""
    m = mask.bool()
    if not bool(m.any()):
        return 0.0
    w = torch.exp(log_ratios(logp, rollout_logp, mask))[m]
    return float(((w < low) | (w > high)).double().mean())


def token_entropy_mean(entropy: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of the per-token entropies [B, T] over the action tokens (0 when there are none)."""
    m = mask.bool()
    return float(entropy.double()[m].mean()) if bool(m.any()) else 0.0


def advantage_stats(advantages: torch.Tensor, mask: torch.Tensor) -> Dict[str, float]:
    """advantage_mean, advantage_std (population), advantage_min, advantage_max and
    advantage_pos_frac (the fraction with A > 0) over the action tokens (0 when none)."""
    a = advantages.double()[mask.bool()]
    if a.numel() == 0:
        return {"advantage_mean": 0.0, "advantage_std": 0.0, "advantage_min": 0.0,
                "advantage_max": 0.0, "advantage_pos_frac": 0.0}
    return {"advantage_mean": float(a.mean()), "advantage_std": float(a.std(unbiased=False)),
            "advantage_min": float(a.min()), "advantage_max": float(a.max()),
            "advantage_pos_frac": float((a > 0).double().mean())}


def version_spans(versions: torch.Tensor, mask: torch.Tensor) -> List[int]:
    """Per row: the newest minus the oldest policy version of its action tokens (0 for a row
    without action tokens): how many versions the weights moved while it was generated."""
    m = mask.bool()
    big = torch.iinfo(torch.int64).max
    v = versions.long()
    newest = torch.where(m, v, torch.full_like(v, -big)).max(1).values
    oldest = torch.where(m, v, torch.full_like(v, big)).min(1).values
    return torch.where(m.any(1), newest - oldest, torch.zeros_like(newest)).tolist()


def staleness_stats(rollout_staleness: Sequence[int], spans: Sequence[int]) -> Dict[str, float]:
    """staleness_rollout_mean (mean over rollouts of version - oldest version of its action
    tokens; its max is staleness_max), staleness_span_mean and staleness_span_max."""
    if not spans:
        return {"staleness_rollout_mean": 0.0, "staleness_span_mean": 0.0,
                "staleness_span_max": 0}
    return {"staleness_rollout_mean": sum(rollout_staleness) / max(len(rollout_staleness), 1),
            "staleness_span_mean": sum(spans) / len(spans),
            "staleness_span_max": int(max(spans))}


def drift_stats(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, entropy: Optional[torch.Tensor] = None,
                band: Optional[Tuple[float, float]] = None) -> Dict[str, float]:
    """Everything above a policy step logs from its tensors: ratio_metrics, advantage_stats,
    token_entropy_mean when the step's forward gave the entropies, and
    ratio_outside_band_frac when `band` (low, high) is given."""
    stats = ratio_metrics(logp, rollout_logp, mask)
    stats.update(advantage_stats(advantages, mask))
    if band is not None:
        stats["ratio_outside_band_frac"] = outside_band_frac(logp, rollout_logp, mask, *band)
    if entropy is not None:
        stats["token_entropy_mean"] = token_entropy_mean(entropy, mask)
    return stats


class DriftAlarms:
    """Counts the policy steps whose drift crossed a threshold, per alarm (cumulative):
    ess_low (ess < min_ess), kl_high (kl_rollout > max_kl), chi2_high (chi2_token > max_chi2).
    A statistic that is missing or not a number raises nothing."""

    def __init__(self, min_ess: float = 0.3, max_kl: float = 0.1, max_chi2: float = 1.0):
        self.min_ess, self.max_kl, self.max_chi2 = min_ess, max_kl, max_chi2
        self.counts = {name: 0 for name in ALARMS}

    def check(self, stats: Mapping[str, float]) -> List[str]:
        """Counts the alarms `stats` (one step's) raises; returns a message for each."""
        def value(key):
            v = stats.get(key)
            return float(v) if isinstance(v, (int, float)) and v == v else None

        ess, kl, chi2 = value("ess"), value("kl_rollout"), value("chi2_token")
        raised = []
        if ess is not None and ess < self.min_ess:
            raised.append(("ess_low", f"ess {ess:.4g} < {self.min_ess:g}"))
        if kl is not None and kl > self.max_kl:
            raised.append(("kl_high", f"kl_rollout {kl:.4g} > {self.max_kl:g}"))
        if chi2 is not None and chi2 > self.max_chi2:
            raised.append(("chi2_high", f"chi2_token {chi2:.4g} > {self.max_chi2:g}"))
        for name, _ in raised:
            self.counts[name] += 1
        return [f"{name}: {text} ({self.counts[name]} steps so far)" for name, text in raised]

    def counters(self) -> Dict[str, int]:
        """drift_alarm_<name>: the steps that raised it so far."""
        return {f"drift_alarm_{name}": count for name, count in self.counts.items()}

    def state_dict(self) -> Dict[str, int]:
        return dict(self.counts)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for name in ALARMS:
            self.counts[name] = int(state.get(name, 0))

