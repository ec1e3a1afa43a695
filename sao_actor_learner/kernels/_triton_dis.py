"""Triton kernel of `dis_loss` (imported only when the Triton backend runs).

One pass over the tokens computes, per token, the ratio, the band test and the loss gradient
coefficient -keep * r * A (the gradient w.r.t. logp before dividing by the normaliser, which is
known only after the reduction), and per program the partial sums behind the loss and every
statistic. The partials ([programs, 11] fp32) are summed in torch: deterministic, no atomics.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .dispatch import interpreter_enabled

INTERPRETED = interpreter_enabled()

# Columns of the partial-sums buffer.
KAR, MASK, KEEP, BELOW, ABOVE, COUNT, RSUM, RMAX, RMIN, KL, R2 = range(11)
NUM_STATS = 11
_MAX_LOG_RATIO = 20.0  # as learner.losses: exp() of log-ratios beyond this is clamped


@triton.jit
def _dis_kernel(logp_ptr, ref_ptr, adv_ptr, mask_ptr, coef_ptr, part_ptr, n, lo, hi, max_lr,
                BLOCK: tl.constexpr, NUM_STATS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    lp = tl.load(logp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    ref = tl.load(ref_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(mask_ptr + offs, mask=ok, other=0).to(tl.float32)
    on = m != 0.0
    raw = lp - ref
    lr = tl.minimum(tl.maximum(tl.where(on, raw, 0.0), -max_lr), max_lr)
    r = tl.exp(lr)
    below = r < lo
    above = r > hi
    keep = tl.where(below | above, 0.0, m)
    # d(clamp)/dx is 1 inside [-max_lr, max_lr] (bounds included, as torch.clamp), 0 outside.
    passes = on & (raw >= -max_lr) & (raw <= max_lr)
    kar = keep * r * adv
    tl.store(coef_ptr + offs, tl.where(passes, -kar, 0.0), mask=ok)
    onf = tl.where(on, 1.0, 0.0)
    base = part_ptr + pid * NUM_STATS
    tl.store(base + 0, tl.sum(kar, axis=0))
    tl.store(base + 1, tl.sum(m, axis=0))
    tl.store(base + 2, tl.sum(keep, axis=0))
    tl.store(base + 3, tl.sum(tl.where(below, m, 0.0), axis=0))
    tl.store(base + 4, tl.sum(tl.where(above, m, 0.0), axis=0))
    tl.store(base + 5, tl.sum(onf, axis=0))
    tl.store(base + 6, tl.sum(r * onf, axis=0))
    tl.store(base + 7, tl.max(tl.where(on, r, -float("inf")), axis=0))
    tl.store(base + 8, tl.min(tl.where(on, r, float("inf")), axis=0))
    tl.store(base + 9, tl.sum(tl.where(on, r - 1.0 - lr, 0.0), axis=0))
    tl.store(base + 10, tl.sum(tl.where(on, r * r, 0.0), axis=0))


def forward(logp: torch.Tensor, rollout_logp: torch.Tensor, advantages: torch.Tensor,
            mask: torch.Tensor, lo: float, hi: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (coef [n] fp32 = -keep*r*A where the gradient passes, totals [11] fp32).

    Every input is flat and contiguous; `mask` any numeric dtype (bool is passed as uint8).
    """
    n = logp.numel()
    block = 128 if INTERPRETED else 1024
    programs = max(1, triton.cdiv(n, block))
    coef = torch.empty(n, dtype=torch.float32, device=logp.device)
    part = torch.empty(programs, NUM_STATS, dtype=torch.float32, device=logp.device)
    if n == 0:
        part.zero_()
        part[:, RMAX] = -float("inf")
        part[:, RMIN] = float("inf")
    else:
        _dis_kernel[(programs,)](logp, rollout_logp, advantages, mask, coef, part, n, lo, hi,
                                 _MAX_LOG_RATIO, BLOCK=block, NUM_STATS=NUM_STATS,
                                 num_warps=4 if not INTERPRETED else 1)
    totals = torch.cat([part[:, :RMAX].sum(0), part[:, RMAX].max().reshape(1),
                        part[:, RMIN].min().reshape(1), part[:, KL:].sum(0)])
    return coef, totals
