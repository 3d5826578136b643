"""The grouped weight-gradient GEMM with the main-grad accumulating epilogue.

    d_down[e] (+)= dy[tok]^T @ (rw * h)
    [d_gate[e]; d_up[e]] (+)= [dg | du]^T @ x[tok]   (one GEMM of 2I rows, each half stored to its weight's
                                                      gradient, or to their common [E, 2I, H] buffer)

A fixed-order loop over expert e's rows (deterministic, no atomics), written or ADDED into the destination
(float32 or bfloat16 main grads; per-expert lists through one float32 buffer).

Shape legend: E experts, MD, ND the destination's dims, M sorted rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common
from .common import GROUP_M, cfg, mma, swizzle, to_out
from .configs import Family, dtype_name, register


# 128 x 256 first (the best plain Triton GEMM at the training shapes)
_WGRAD_CONFIGS = [cfg(128, 256, 64, 8, 3), cfg(256, 128, 64, 8, 3), cfg(128, 128, 64, 8, 3), cfg(128, 128, 64, 8, 4),
                  cfg(64, 128, 64, 4, 4), cfg(128, 64, 64, 4, 4), cfg(128, 128, 128, 8, 3)]


@triton.jit
def _wgrad_tiles(r0, hi, ks, nxt, tokens_ptr, a_ptr, stride_ar, a_cols, mmask, b_ptr, stride_br, b_cols, nmask,
                 GATHER: tl.constexpr, A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, OFF32: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The row step r0 of `_wgrad_body`: (A^T tile [BLOCK_M, BLOCK_K], B tile [BLOCK_K, BLOCK_N], the gather
    index of the next step). Each operand gathered by token or read by sorted row; the rows past hi (the last,
    partial step) load zeros."""
    rows = r0 + ks
    if GATHER:
        tok = nxt
        nxt = tl.load(tokens_ptr + rows + BLOCK_K, mask=rows + BLOCK_K < hi, other=0)
    else:
        tok = rows
    rmask = rows < hi
    ar = tok if A_GATHER else rows
    br = tok if B_GATHER else rows
    if not OFF32:
        ar = ar.to(tl.int64)
        br = br.to(tl.int64)
    b = tl.load(b_ptr + br[:, None] * stride_br + b_cols, mask=rmask[:, None] & nmask[None, :], other=0.0)
    a = tl.load(a_ptr + ar[None, :] * stride_ar + a_cols, mask=mmask[:, None] & rmask[None, :], other=0.0)
    return a, b, nxt


@triton.jit(do_not_specialize=["M"])  # (a new token count compiles nothing)
def _wgrad_body(
    a_ptr, stride_ar, stride_am,  # A: row index = token (A_GATHER) or sorted row; [*, MD] (SPLIT: [*, 2 MD])
    b_ptr, stride_br, stride_bn,  # B: row index = token (B_GATHER) or sorted row; [*, ND]
    tokens_ptr, offsets_ptr,  # int32 token of each sorted row [M] (the gather index), expert_offsets [E+1]
    dst_ptr, stride_de, stride_dm, stride_dn,  # dst [E, MD, ND] (any float dtype, strided)
    dst2_ptr, stride2_de, stride2_dm, stride2_dn,  # dst2 [E, MD, ND] (SPLIT): A[:, MD:]^T @ B, dst's dtype
    MD, ND, M, E,
    SINGLE: tl.constexpr, A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, ACCUMULATE: tl.constexpr,
    GATHER: tl.constexpr, SPLIT: tl.constexpr, OFF32: tl.constexpr, DOT_PREC: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of expert e's A^T @ B, reducing over its rows in order. SPLIT: A has two
    halves of MD columns (d_gate's and d_up's operands) reduced as one GEMM of 2 MD rows, each half's rows
    stored to its own destination. (The gather index loaded one step ahead, int32 offsets (OFF32, when every
    offset fits) and one GEMM of 2 MD rows instead of two accumulators: each made the gate/up weight
    gradient faster.)"""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    if SPLIT:
        rows_out = 2 * MD
    else:
        rows_out = MD
    pid_m, pid_n = swizzle(pid, tl.cdiv(rows_out, BLOCK_M), tl.cdiv(ND, BLOCK_N), GROUP_M)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = ms < rows_out
    nmask = ns < ND
    if SINGLE:
        lo = 0
        hi = M
    else:
        lo = tl.load(offsets_ptr + e)
        hi = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    if OFF32:
        a_cols = ms[:, None] * stride_am
        b_cols = ns[None, :] * stride_bn
    else:  # every term of the offsets in int64
        a_cols = ms[:, None].to(tl.int64) * stride_am
        b_cols = ns[None, :].to(tl.int64) * stride_bn
    if GATHER:  # the gather index of the next step is loaded one step ahead, off the loads' critical path
        nxt = tl.load(tokens_ptr + lo + ks, mask=lo + ks < hi, other=0)
    else:
        nxt = lo + ks  # (unused)
    for r0 in range(lo, hi, BLOCK_K):
        a, b, nxt = _wgrad_tiles(r0, hi, ks, nxt, tokens_ptr, a_ptr, stride_ar, a_cols, mmask, b_ptr, stride_br,
                                 b_cols, nmask, GATHER, A_GATHER, B_GATHER, OFF32, BLOCK_K)
        acc = mma(a.to(b.dtype), b, acc, DOT_PREC)
    dmask = mmask[:, None] & nmask[None, :]
    e64 = e.to(tl.int64)
    ms64 = ms[:, None].to(tl.int64)  # (the epilogue's offsets in int64: any destination layout)
    ns64 = ns[None, :].to(tl.int64)
    d_ptrs = dst_ptr + e64 * stride_de + ms64 * stride_dm + ns64 * stride_dn
    if SPLIT:
        d2_ptrs = dst2_ptr + e64 * stride2_de + (ms64 - MD) * stride2_dm + ns64 * stride2_dn
        d_ptrs = tl.where((ms < MD)[:, None], d_ptrs, d2_ptrs)
    if ACCUMULATE:  # Megatron main_grad fusion: one rounding of (dst + grad) into dst's dtype
        acc += tl.load(d_ptrs, mask=dmask, other=0.0).to(tl.float32)
    tl.store(d_ptrs, to_out(acc, dst_ptr, DOT_PREC), mask=dmask)


# (SPLIT and A_GATHER in the problem: at H == I the down and the gate/up weight gradients share MD, ND, E)
WGRAD = register(Family("wgrad", _wgrad_body, _WGRAD_CONFIGS, fields=("dtype", "MD", "ND", "E", "SPLIT", "A_GATHER"),
                        sizes=("MD", "ND", "E"), outputs=("dst_ptr", "dst2_ptr"), interpret=cfg(16, 16, 16, 1, 1)))


def _span(t) -> int:
    """The largest element offset a view reaches from its first element."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # (torch strides are never negative)


def offsets_fit_int32(*views) -> bool:
    """Whether every element offset of these views fits int32, decided without a guard: a symbolic size
    that may reach 2**31 counts as not fitting (int64 offsets, the safe choice)."""
    return not any(common.at_least(_span(v), 2 ** 31, symbolic=True) for v in views)


def wgrad(a, b, dst_EMN, routes_N, offsets_E1, topk, *, a_gather, b_gather, accumulate=False, single=False,
          n_rows=None, dst2_EMN=None, tokens_N=None):
    """dst[e] (+)= A_e^T @ B_e over expert e's rows (A, B 2-D; rows gathered by token when *_gather). With
    dst2 given, A has 2 MD columns: dst[e] (+)= A_e[:, :MD]^T @ B_e and dst2[e] (+)= A_e[:, MD:]^T @ B_e in one
    GEMM (dst2 of dst's dtype). dst_EMN: [E, MD, ND] (for SINGLE, a [1, MD, ND] view). tokens_N: the int32
    token of each sorted route (routes_N // topk, computed here when not given)."""
    E, MD, ND = dst_EMN.shape
    if E == 0 or MD == 0 or ND == 0:
        return dst_EMN
    split = dst2_EMN is not None
    if split:
        assert dst2_EMN.shape == dst_EMN.shape and dst2_EMN.dtype == dst_EMN.dtype and a.shape[1] == 2 * MD
    # (without dst2: a read-only input in its place, never read or written, and never dst, `common.launch`)
    d2, d2_strides = (dst2_EMN, dst2_EMN.stride()) if split else (b, (0, 0, 0))
    M = n_rows if single else routes_N.numel()
    gather = (a_gather or b_gather) and not single
    if gather and tokens_N is None:
        tokens_N = routes_N // topk
    idx = tokens_N if gather else offsets_E1
    off32 = offsets_fit_int32(a, b)
    rows_out = 2 * MD if split else MD
    grid = lambda meta: (common.cdiv(rows_out, meta["BLOCK_M"]) * common.cdiv(ND, meta["BLOCK_N"]), E)
    common.launch(
        WGRAD, grid,
        a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), idx, offsets_E1,
        dst_EMN, dst_EMN.stride(0), dst_EMN.stride(1), dst_EMN.stride(2), d2, *d2_strides,
        MD, ND, M, E,
        SINGLE=single, A_GATHER=a_gather, B_GATHER=b_gather, GATHER=gather, ACCUMULATE=accumulate, SPLIT=split,
        OFF32=off32, DOT_PREC=common.dot_precision(b.dtype), GROUP_M=GROUP_M,
        rows=M, problem=(dtype_name(b.dtype), MD, ND, E, split, a_gather),
    )
    return dst_EMN


def wgrad_into(dsts, a, b, routes_N, offsets_E1, topk, *, a_gather, b_gather, accumulate, single=False,
               n_rows=None, tokens_N=None):
    """dsts[j] (+)= A[:, j*MD:(j+1)*MD]^T @ B per expert, for one or two destinations sharing B (A holds
    their operands side by side): each dst a 3-D tensor, E per-expert tensors (written through a float32
    buffer, then copied or added by one multi-tensor op), or None (the gradient is not wanted, e.g. an
    MXFP8 weight without a master). Two wanted destinations of one kind and dtype share a launch (one GEMM
    over both halves of A)."""
    md = a.shape[1] // len(dsts)
    live = [(d, a[:, j * md:(j + 1) * md]) for j, d in enumerate(dsts) if d is not None]
    if not live:
        return
    kw = dict(a_gather=a_gather, b_gather=b_gather, single=single, n_rows=n_rows, tokens_N=tokens_N)
    split = [not isinstance(d, torch.Tensor) for d, _ in live]
    dtypes = [torch.float32 if sp else d.dtype for (d, _), sp in zip(live, split)]
    if len(live) == 2 and (split[0] != split[1] or dtypes[0] != dtypes[1]):
        for d, part in live:
            wgrad_into((d,), part, b, routes_N, offsets_E1, topk, accumulate=accumulate, **kw)
        return
    if split[0]:
        targets = [torch.empty(len(d), *d[0].shape, dtype=torch.float32, device=b.device) for d, _ in live]
    else:
        targets = [d for d, _ in live]
    two = len(live) == 2
    wgrad(a if two else live[0][1], b, targets[0], routes_N, offsets_E1, topk, accumulate=accumulate and not split[0],
          dst2_EMN=targets[1] if two else None, **kw)
    if split[0]:  # into the E per-expert tensors: one multi-tensor op (each rounds once from float32)
        for (d, _), tmp in zip(live, targets):
            (torch._foreach_add_ if accumulate else torch._foreach_copy_)(list(d), list(tmp.unbind(0)))
