"""The sampling distribution of a rollout, shared by the engines and the learner.

An engine samples token x from softmax(logits / temperature), restricted with top_p < 1 to the
nucleus (the smallest set of most likely tokens whose mass reaches top_p) and renormalised over
it; it records log pi(x) under that distribution (the behaviour policy). The learner's
importance ratios compare log-probs of the same kind, so it computes them with the same function
and the same temperature and top_p: on-policy data then has ratio exactly 1. A token outside the
learner's current nucleus has log-prob -inf (ratio 0: DIS masks it).

Pure torch; no reverb, tensorflow or grpc.
"""
from __future__ import annotations

import torch


def nucleus_logprobs(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs [..., V] renormalised over the smallest set of top tokens whose mass reaches
    `top_p` (the top token is always kept); -inf outside it. The set is chosen without
    gradient; gradients flow through the renormalised log-softmax."""
    if top_p >= 1.0:
        return logp
    with torch.no_grad():
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        sorted_p = sorted_logp.exp()
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p      # mass of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


def sampling_logprobs(logits: torch.Tensor, temperature: float = 1.0,
                      top_p: float = 1.0) -> torch.Tensor:
    """log pi(. | context) [..., V] of the sampling distribution, in float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return nucleus_logprobs(logp, top_p)
