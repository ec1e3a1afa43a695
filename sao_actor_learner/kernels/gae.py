"""Skip-observation token-level GAE (docs/METHOD.md section 7) as one reverse scan, parallel over rows.

    delta_k = r[t_k] + gamma * V(t_{k+1}) - V(t_k);   A_k = delta_k + gamma * lambda_b * A_{k+1}

where t_1 < ... < t_n are a row's action tokens (observation tokens between them are skipped),
V(t_{n+1}) is the row's bootstrap value (0 unless given). Same arguments and results as
`learner_math.skip_observation_gae`, which is the torch backend: its loop runs one step per
action token with several kernel launches each, the Triton kernel is one launch
(`_triton_gae.py`). Timings: BENCHMARKS.md section 6.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from sao_actor_learner import learner_math as reference
from .dispatch import load_triton_module, resolve_backend


def skip_observation_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor,
                         gamma: float, lam: reference.Lambda,
                         bootstrap_values: Optional[torch.Tensor] = None,
                         backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [B, T], zero off action tokens; returns = advantages + values.

    rewards, values, action_mask: [B, T] aligned to token positions; lam: a float or a [B]
    tensor; bootstrap_values: optional [B] value after each row's last action token (truncated
    rows). No gradient flows (values are detached, as in the reference). backend: "auto" |
    "triton" | "torch" (see dispatch.py); the Triton backend computes in fp32 and returns
    values' dtype.
    """
    if values.ndim != 2 or rewards.shape != values.shape or action_mask.shape != values.shape:
        raise ValueError(f"skip_observation_gae: rewards {tuple(rewards.shape)}, values "
                         f"{tuple(values.shape)} and action_mask {tuple(action_mask.shape)} "
                         "must all be [B, T]")
    lam_t = lam if isinstance(lam, torch.Tensor) else None
    chosen = resolve_backend(backend, "skip_observation_gae",
                             (rewards, values, action_mask, lam_t, bootstrap_values))
    if chosen == "torch":
        return reference.skip_observation_gae(rewards, values, action_mask, gamma, lam,
                                         bootstrap_values)
    B, T = values.shape
    vals = values.detach()
    out_dtype = vals.dtype
    if vals.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        vals = vals.float()
    lam_row = reference.as_row_tensor(lam, B, vals).float().contiguous()
    boot = (torch.zeros(B, dtype=torch.float32, device=vals.device) if bootstrap_values is None
            else bootstrap_values.detach().reshape(B).float().contiguous())
    mask = action_mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    mod = load_triton_module("_triton_gae")
    adv, ret = mod.gae(rewards.detach().contiguous(), vals.contiguous(), mask, float(gamma),
                       lam_row, boot)
    return adv.to(out_dtype), ret.to(out_dtype)
