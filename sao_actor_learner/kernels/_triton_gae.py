"""Triton kernel of `skip_observation_gae` (imported only when the Triton backend runs).

One program per row walks the row backwards in tiles of BLOCK_T tokens, carrying two scalars
from tile to tile: the advantage of the next action token and its value. Inside a tile the
recursion is solved with two associative scans instead of a token-by-token loop:

  1. next value: V(t_{k+1}) for every token t, i.e. the value of the nearest action token
     strictly after t (the bootstrap value if none). A "last valid" scan, run backwards in time
     over (values[t+1], mask[t+1]).
  2. advantages: A_t = d_t + c_t * A_{t+1} with, on action tokens, c = gamma * lambda and
     d = r_t + gamma * V(next) - V_t, and on other tokens c = 1, d = 0 (they pass A through,
     which is what skipping observations means). A first-order linear recurrence, scanned with
     the associative operator (c1, d1) . (c2, d2) = (c1 c2, d2 + c2 d1).

The scans add in a different order than the reference's sequential loop: results agree to fp32
rounding (~1e-6 relative), not bit for bit. Computes in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import interpreter_enabled

INTERPRETED = interpreter_enabled()


@triton.jit
def _last_valid(v1, f1, v2, f2):
    # Scan order runs backwards in time: the later element of the scan (2) is the nearer token.
    return tl.where(f2 != 0, v2, v1), tl.maximum(f1, f2)


@triton.jit
def _linear_recurrence(c1, d1, c2, d2):
    return c1 * c2, d2 + c2 * d1


@triton.jit
def _gae_kernel(r_ptr, v_ptr, m_ptr, lam_ptr, boot_ptr, adv_ptr, ret_ptr, T, gamma,
                BLOCK_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    lam = tl.load(lam_ptr + row).to(tl.float32)
    carry_v = tl.load(boot_ptr + row).to(tl.float32)  # value after the last action token
    carry_a = tl.full([], 0.0, tl.float32)  # advantage of the next action token (none yet)
    idx = tl.arange(0, BLOCK_T)
    n_tiles = tl.cdiv(T, BLOCK_T)
    for j in range(0, n_tiles):
        t = T - 1 - j * BLOCK_T - idx  # scan element i <-> time t, backwards
        ok = t >= 0
        r = tl.load(r_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
        act = tl.load(m_ptr + base + t, mask=ok, other=0) != 0
        t1 = t + 1
        ok1 = (t1 >= 0) & (t1 < T)
        v1 = tl.load(v_ptr + base + t1, mask=ok1, other=0.0).to(tl.float32)
        f1 = (tl.load(m_ptr + base + t1, mask=ok1, other=0) != 0).to(tl.int32)
        nv, nf = tl.associative_scan((v1, f1), 0, _last_valid)
        next_v = tl.where(nf != 0, nv, carry_v)
        delta = r + gamma * next_v - v
        c = tl.where(act, gamma * lam, 1.0)
        d = tl.where(act, delta, 0.0)
        cc, dd = tl.associative_scan((c, d), 0, _linear_recurrence)
        a = dd + cc * carry_a
        tl.store(adv_ptr + base + t, tl.where(act, a, 0.0).to(adv_ptr.dtype.element_ty), mask=ok)
        tl.store(ret_ptr + base + t, tl.where(act, a + v, 0.0).to(ret_ptr.dtype.element_ty),
                 mask=ok)
        last = idx == BLOCK_T - 1  # the earliest token of the tile
        carry_a = tl.sum(tl.where(last, a, 0.0), axis=0)
        carry_v = tl.sum(tl.where(last, next_v, 0.0), axis=0)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: torch.Tensor, boot: torch.Tensor):
    """rewards, values, mask: contiguous [B, T]; lam, boot: contiguous [B]. Returns (adv, ret)."""
    B, T = values.shape
    adv = torch.empty_like(values)
    ret = torch.empty_like(values)
    if B and T:
        block = 16 if INTERPRETED else min(1024, max(16, triton.next_power_of_2(T)))
        _gae_kernel[(B,)](rewards, values, mask, lam, boot, adv, ret, T, gamma, BLOCK_T=block,
                          num_warps=1 if INTERPRETED else (4 if block <= 512 else 8))
    else:
        adv.zero_()
        ret.zero_()
    return adv, ret
