"""Triton kernels of `fused_logprobs` (imported only when the Triton backend runs).

Notation: h = hidden [N, H], W = LM head [V, H], y = targets [N], z = h W^T / temperature.

Forward (`forward`): one program per (split of the vocabulary, block of BLOCK_N tokens). It walks
its vocabulary tiles of BLOCK_V, computes each z tile in fp32 with tl.dot over H in chunks of
BLOCK_H, and keeps an online log-sum-exp per token: running max m, s = sum exp(z - m), and for
the entropy t = sum exp(z - m) * z; the target's logit is picked out of the tile that holds it.
The splits' partial (m, s, t) are merged in torch ([splits, N] floats). Nothing of size [N, V]
exists at any time.

Backward (`backward`): dL/dz_iv = g_i (1[v = y_i] - p_iv) - e_i p_iv (z_iv - mu_i), with p from
the saved lse and mu = E_p[z]. A Triton kernel recomputes z tile by tile (fp32) for a slice of
the vocabulary and writes dL/dz for that slice only ([N, Vc], in the input dtype: bf16 for bf16
inputs, like eager PyTorch's logit gradient), then two cuBLAS matmuls give
    grad_W[slice] = dz^T h / T      (written straight into its rows: no accumulation, no atomics)
    grad_h       += dz W[slice] / T  (accumulated in fp32 over the slices)
The slice width Vc is chosen so that N * Vc <= chunk_elems (default 2**28 elements = 512 MiB in
bf16). Cost: the forward's matmul (2NVH flops) is recomputed once in the backward, so the whole
op is 8NVH flops against eager's 6NVH; what it saves is the [N, V] fp32 traffic and memory.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .dispatch import interpreter_enabled

INTERPRETED = interpreter_enabled()


@triton.jit
def _lse_fwd_kernel(h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr,
                    N, V, H, stride_hn, stride_hk, stride_wv, stride_wk,
                    inv_temp, tiles_per_split, n_vtiles,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr,
                    DOT_UPCAST: tl.constexpr):
    # Launch order: the splits of one token block are consecutive programs, so the programs
    # resident at a time cover a few token blocks x many splits: each h block is shared in L2 by
    # the splits, each W tile by the token blocks walking the same split in step.
    pid_s = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    offs_v = tl.arange(0, BLOCK_V)
    offs_h = tl.arange(0, BLOCK_H)
    m = tl.full([BLOCK_N], -1.0e30, tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    zt = tl.zeros([BLOCK_N], tl.float32)
    tile_lo = pid_s * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, n_vtiles)
    for vt in range(tile_lo, tile_hi):
        cols = vt * BLOCK_V + offs_v
        col_ok = cols < V
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + offs_h
            k_ok = ks < H
            a = tl.load(h_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hk,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + cols[None, :] * stride_wv + ks[:, None] * stride_wk,
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_UPCAST:  # the interpreter multiplies bf16 bit patterns as integers
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        z = tl.where(col_ok[None, :], acc * inv_temp, -1.0e30)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new[:, None])  # exactly 0 on padded columns
        s = s * alpha + tl.sum(p, axis=1)
        if WITH_ENTROPY:
            t = t * alpha + tl.sum(p * z, axis=1)
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        m = m_new
    part = pid_s * N + rows
    tl.store(m_ptr + part, m, mask=row_ok)
    tl.store(s_ptr + part, s, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(t_ptr + part, t, mask=row_ok)
    in_split = (tgt >= tile_lo * BLOCK_V) & (tgt < tile_hi * BLOCK_V) & (tgt < V)
    tl.store(zt_ptr + rows, zt, mask=row_ok & in_split)


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, mu_ptr, glp_ptr, gent_ptr, dz_ptr,
                    N, V, H, v_lo, v_count, stride_hn, stride_hk, stride_wv, stride_wk, stride_dz,
                    inv_temp,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                    GROUP_N: tl.constexpr, WITH_ENTROPY: tl.constexpr, PRECISION: tl.constexpr,
                    DOT_UPCAST: tl.constexpr):
    # Grouped launch order: GROUP_N token blocks sweep the vocabulary tiles together, so each W
    # tile is read from HBM once per group and from L2 by the others.
    pid = tl.program_id(0)
    n_bn = tl.cdiv(N, BLOCK_N)
    n_bv = tl.cdiv(v_count, BLOCK_V)
    per_group = GROUP_N * n_bv
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(n_bn - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column within the slice
    col_ok = local < v_count
    cols = v_lo + local
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + offs_h
        k_ok = ks < H
        a = tl.load(h_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_wv + ks[:, None] * stride_wk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_UPCAST:  # the interpreter multiplies bf16 bit patterns as integers
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    z = acc * inv_temp
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    p = tl.exp(z - lse[:, None])
    dz = tl.where(cols[None, :] == tgt[:, None], g[:, None], 0.0) - g[:, None] * p
    if WITH_ENTROPY:
        e = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        mu = tl.load(mu_ptr + rows, mask=row_ok, other=0.0)
        dz -= e[:, None] * p * (z - mu[:, None])
    dz = dz * inv_temp
    tl.store(dz_ptr + rows[:, None] * stride_dz + local[None, :], dz.to(dz_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# Tile sizes. CUDA: tuned by reasoning for Hopper (H100/H200), not measured here: 128x128 output
# tiles with 64-wide K steps and 3 pipeline stages keep ~96 KiB of shared memory per program in
# bf16. fp32 uses IEEE products (no TF32) and smaller tiles. The interpreter uses small tiles.
_CUDA_16BIT = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_H=64, num_warps=8, num_stages=3)
_CUDA_FP32 = dict(BLOCK_N=64, BLOCK_V=64, BLOCK_H=32, num_warps=4, num_stages=2)
_INTERPRETER = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_H=16, num_warps=4, num_stages=1)


def default_config(dtype: torch.dtype) -> dict:
    if INTERPRETED:
        return dict(_INTERPRETER)
    return dict(_CUDA_FP32 if dtype == torch.float32 else _CUDA_16BIT)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs


def _dot_upcast(dtype: torch.dtype) -> bool:
    # Triton's interpreter (3.7) keeps bf16 as uint16 and tl.dot multiplies the bit patterns;
    # upcasting first is exact (bf16 products are exact in fp32). Compiled kernels never do it.
    return INTERPRETED and dtype == torch.bfloat16


def _num_splits(n_row_blocks: int, n_vtiles: int, device: torch.device) -> int:
    """Vocabulary splits of the forward: ~2 resident programs per SM spread over ~8 token blocks
    (what fits L2: 8 h blocks + ~33 W tiles of 1 MiB at H=4096), and enough programs in all."""
    if INTERPRETED or device.type != "cuda":
        return max(1, min(n_vtiles, 2))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(2 * sms // 8, -(-4 * sms // max(n_row_blocks, 1)))
    return max(1, min(n_vtiles, splits))


def forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_temp: float,
            with_entropy: bool, config: Optional[dict] = None, num_splits: Optional[int] = None
            ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Returns (lse [N], target logit [N], mu = E_p[z] [N] or None), all fp32.

    A target outside [0, V) gives a NaN target logit (no device sync to check it).
    """
    cfg = dict(default_config(hidden.dtype), **(config or {}))
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    bn, bv, bh = cfg["BLOCK_N"], cfg["BLOCK_V"], cfg["BLOCK_H"]
    n_rb = triton.cdiv(N, bn)
    n_vt = triton.cdiv(V, bv)
    splits = num_splits or _num_splits(n_rb, n_vt, dev)
    tiles_per_split = triton.cdiv(n_vt, splits)
    splits = triton.cdiv(n_vt, tiles_per_split)  # every split holds at least one tile
    m = torch.empty(splits, N, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    t = torch.empty_like(m) if with_entropy else m  # unused pointer when no entropy
    zt = torch.full((N,), float("nan"), dtype=torch.float32, device=dev)
    if N:
        _lse_fwd_kernel[(splits, n_rb)](
            hidden, weight, targets, m, s, t, zt, N, V, H,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            inv_temp, tiles_per_split, n_vt,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh, WITH_ENTROPY=with_entropy,
            PRECISION=_precision(hidden.dtype), DOT_UPCAST=_dot_upcast(hidden.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    m_all = m.max(dim=0).values
    scale = torch.exp(m - m_all)
    s_all = (s * scale).sum(0)
    lse = m_all + torch.log(s_all)
    mu = (t * scale).sum(0) / s_all if with_entropy else None
    return lse, zt, mu


_MM_OUT_DTYPE_OK = [True]


def _mm_accumulate_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b in their own (16-bit or fp32) dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda and _MM_OUT_DTYPE_OK[0]:
        try:  # cuBLAS writes the product in fp32, unrounded (mm.dtype, torch >= 2.8 on CUDA)
            acc.add_(torch.mm(a, b, out_dtype=torch.float32))
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE_OK[0] = False
    acc.add_(torch.mm(a, b).float())


def backward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
             lse: torch.Tensor, mu: Optional[torch.Tensor], grad_logp: Optional[torch.Tensor],
             grad_entropy: Optional[torch.Tensor], inv_temp: float, need_hidden: bool,
             need_weight: bool, chunk_elems: int, config: Optional[dict] = None
             ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    cfg = dict(default_config(hidden.dtype), **(config or {}))
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    bn, bv, bh = cfg["BLOCK_N"], cfg["BLOCK_V"], cfg["BLOCK_H"]
    with_entropy = grad_entropy is not None
    if grad_logp is None:
        grad_logp = torch.zeros(N, dtype=torch.float32, device=dev)
    grad_logp = grad_logp.float().contiguous()
    gent = grad_entropy.float().contiguous() if with_entropy else grad_logp
    mu_arg = mu if with_entropy else lse
    # Vocabulary slice: a multiple of BLOCK_V with N * Vc <= chunk_elems (at least one tile).
    vc = max(bv, (max(chunk_elems, 1) // max(N, 1)) // bv * bv)
    vc = min(vc, triton.cdiv(V, bv) * bv)
    grad_w = (torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight
              else None)
    n_slices = triton.cdiv(V, vc)
    # One slice with 16-bit inputs: cuBLAS writes grad_h in the input dtype (fp32 accumulation
    # inside). Several slices: accumulate in fp32 across them.
    direct_h = n_slices == 1 and hidden.dtype != torch.float32
    grad_h = None
    if need_hidden and not direct_h:
        grad_h = torch.zeros(N, H, dtype=torch.float32, device=dev)
    dz_buf = torch.empty(N, min(vc, V), dtype=hidden.dtype, device=dev)
    for v0 in range(0, V, vc):
        width = min(vc, V - v0)
        dz = dz_buf[:, :width]
        if N:
            grid = (triton.cdiv(N, bn) * triton.cdiv(width, bv),)
            _dlogits_kernel[grid](
                hidden, weight, targets, lse, mu_arg, grad_logp, gent, dz,
                N, V, H, v0, width,
                hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
                dz.stride(0), inv_temp,
                BLOCK_N=bn, BLOCK_V=bv, BLOCK_H=bh, GROUP_N=8, WITH_ENTROPY=with_entropy,
                PRECISION=_precision(hidden.dtype), DOT_UPCAST=_dot_upcast(hidden.dtype),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        w_slice = weight[v0:v0 + width]
        if need_weight:
            torch.mm(dz.t(), hidden, out=grad_w[v0:v0 + width])
        if need_hidden:
            if direct_h:
                grad_h = torch.mm(dz, w_slice)
            else:
                _mm_accumulate_f32(grad_h, dz, w_slice)
    if grad_h is not None:
        grad_h = grad_h.to(hidden.dtype)
    return grad_h, grad_w
