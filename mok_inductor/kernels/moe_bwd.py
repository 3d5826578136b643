"""Backward kernels: the down-dgrad GEMM with the SwiGLU backward (fused in its epilogue, or a second
elementwise pass), and the grouped weight-gradient GEMM with the main-grad accumulating epilogue.

    dy_TH[tok] @ down[e] --_bwd_act_kernel, epilogue on the saved gu_N2I = [g | u]--> dgu_N2I = [dg | du]
        (x.dtype, sorted rows), dscale_PN (partial <dy_t @ down[e], h> per I-tile, at the route: d router
        weights without y_tk), hs_NI = rw * h (the down weight gradient's operand); h is recomputed from
        g, u elementwise, no GEMM is recomputed
      or, with many rows per expert (`options.two_pass_min_rows`): --_bwd_gemm_kernel--> dh_NI (float32, transient)
        --_swiglu_bwd_kernel--> the same dgu, hs and d scale (the fused epilogue's register pressure keeps
        its GEMM to 64-wide tiles; the plain GEMM runs 128 x 128)
    dgu_N2I --grouped_rows (gate[e], up[e])--> dx per route --combine over k--> dx_TH
    wgrad: d_down[e] = dy[tok]^T @ (rw * h), and [d_gate[e]; d_up[e]] = [dg | du]^T @ x[tok] as one GEMM
        (each half of its rows stored to its own weight's gradient): a fixed-order loop over expert e's rows
        (deterministic, no atomics), written or ADDED into the destination (float32 or bfloat16 main grads).

The shared expert runs the same kernels with SINGLE=True (one group of T rows, no gather) and the
sigmoid output gate in the place of the router weight. Weights are operands read as [E, n, k] (see
moe_fwd.w_tile): bf16/fp16/fp32, or MXFP8 column-wise data for the data gradients.

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token (TOPK), N = T*K
routes (M rows in a grouped kernel), P I-tiles of the partial router-weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import options
from . import _launch
from ._launch import cfg, mma, to_out
from .moe_fwd import (GROUP_M, _tile_ids, _tile_rows, clamp_gu, grouped_rows, plain_t, row_tiles_worst, rowdot,
                      swizzle, tma_eligible, tma_pre_hook, tma_weights, w_args, w_bases, w_meta, w_tile, w_tma_tile)

# (Register pressure: the epilogue holds acc, g, u, h and the gradients, so tiles of 128 x 128 spill; these
# are the configs that did not, or nearly not)
_BWD_ACT_CONFIGS = [cfg(64, 128, 64, 8, 3), cfg(128, 64, 64, 8, 4), cfg(64, 64, 64, 4, 4), cfg(64, 128, 64, 8, 4),
                    cfg(128, 64, 64, 8, 3), cfg(64, 64, 128, 4, 3)]
_BWD_ACT_INTERPRET = cfg(16, 16, 32, 1, 1)


def _min_block_n(configs) -> int:
    """The smallest BLOCK_N a launch may pick: the partial router-gradient buffer has one row per I-tile."""
    picked = [_BWD_ACT_INTERPRET] if _launch.INTERPRET else configs
    return min(c.kwargs["BLOCK_N"] for c in picked)


_BWD_ACT_MIN_BLOCK_N = _min_block_n(_BWD_ACT_CONFIGS)


# The two-pass variant's GEMM holds only its accumulator: the large tiles of a plain GEMM; 128 x 256 first,
# the eager autotuner's pick at the training shapes
_BWD_GEMM_CONFIGS = [cfg(128, 256, 64, 8, 3), cfg(128, 128, 64, 8, 3), cfg(128, 128, 64, 8, 4), cfg(64, 128, 64, 4, 4),
                     cfg(128, 64, 64, 4, 4)]
_SWIGLU_BWD_BLOCK = (16, 32) if _launch.INTERPRET else (32, 256)  # (rows, columns per step) of the second pass


@triton.jit
def _bwd_act_body(
    dy_ptr, stride_dt, stride_dh,  # dy [T, H] (any strides, stride 0 too)
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    wd_ptr, d_e, d_n, d_k, ds_ptr, ds_e, ds_n, ds_k,  # down^T read as [E, I, H] (MX_D: column-wise MXFP8)
    gu_ptr, stride_gm, stride_gn,  # gu [M, 2I] saved (sorted rows, any float dtype): g in [0, I), u in [I, 2I)
    scale_ptr,  # float32 router weight per route [T*K] (SINGLE: per token [T]) (HAS_SCALE)
    dgu_ptr, stride_om, stride_on,  # dgu [M, 2I] out: dg in [0, I), du in [I, 2I)
    dscale_ptr, stride_sp,  # float32 [P, T*K] out: partial <dy @ down, h> of I-tile p at the route
    hs_ptr,  # [M, I] out (the activation dtype): (scale *) h, rounded: the down weight-gradient's operand
    dh_ptr,  # float32 [M, I] out (STORE_ACC: the accumulator only, no epilogue)
    wd_desc, w_rows,  # TMA: the host descriptor of down^T's 2-D view and its R (moe_fwd.tma_weights)
    M, H, I, E, TOPK, limit,
    SINGLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LIMIT: tl.constexpr, MX_D: tl.constexpr, STORE_ACC: tl.constexpr,
    DOT_PREC: tl.constexpr, W_TABLE: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
    GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    limit = tl.cast(limit, tl.float32)  # Inductor passes a Python float as fp64: keep the epilogue in fp32
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, I, SINGLE, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, SINGLE, False, BLOCK_M, GROUPS_POW2)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    if SINGLE:
        route = rows
        tok = rows
    else:
        route = tl.load(routes_ptr + rows, mask=rmask, other=0)
        tok = route // TOPK
    ks = tl.arange(0, BLOCK_K)
    e64 = group.to(tl.int64)
    wd, ds = w_bases(wd_ptr, ds_ptr, e64, d_e, ds_e, E, W_TABLE, MX_D)
    dy_row = dy_ptr + tok[:, None].to(tl.int64) * stride_dt
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = 0
    if TMA:  # the weight tiles of the whole K steps through the descriptor, the tail step by pointers
        k_start = H - H % BLOCK_K
        for k0 in range(0, k_start, BLOCK_K):
            dya = tl.load(dy_row + (k0 + ks)[None, :] * stride_dh, mask=rmask[:, None], other=0.0)
            acc = mma(dya.to(hs_ptr.dtype.element_ty), w_tma_tile(wd_desc, group * w_rows, pid_n * BLOCK_N, k0, W_KMAJOR),
                      acc, DOT_PREC)
    for k0 in range(k_start, H, BLOCK_K):
        kk = k0 + ks
        kmask = kk < H
        dya = tl.load(dy_row + kk[None, :] * stride_dh, mask=rmask[:, None] & kmask[None, :], other=0.0)
        wd_t = w_tile(wd, ds, kk, cols, kmask, cmask, d_n, d_k, ds_n, ds_k, hs_ptr, MX_D, DOT_PREC)
        acc = mma(dya.to(hs_ptr.dtype.element_ty), wd_t, acc, DOT_PREC)
    omask = rmask[:, None] & cmask[None, :]
    rows64 = rows[:, None].to(tl.int64)
    if STORE_ACC:  # the two-pass variant: dy @ down in float32, the SwiGLU backward in _swiglu_bwd_kernel
        tl.store(dh_ptr + rows64 * I + cols[None, :], acc, mask=omask)
        return
    part = _swiglu_bwd_tile(acc, rows64, cols, omask, route, rmask, gu_ptr, stride_gm, stride_gn, scale_ptr,
                            dgu_ptr, stride_om, stride_on, hs_ptr, I, limit, HAS_SCALE, HAS_LIMIT, DOT_PREC)
    tl.store(dscale_ptr + pid_n * stride_sp + route, part, mask=rmask)


_BWD_ACT_KEY = ["M", "H", "I", "E", "TOPK", "TMA"]
_tma_hook = tma_pre_hook((), ("wd_desc",))
_bwd_act_kernel = _launch.autotune(_BWD_ACT_CONFIGS, _BWD_ACT_INTERPRET, key=_BWD_ACT_KEY,
                                   eager_pre_hook=_tma_hook)(_bwd_act_body)
_bwd_gemm_kernel = _launch.autotune(_BWD_GEMM_CONFIGS, _BWD_ACT_INTERPRET, key=_BWD_ACT_KEY,
                                    eager_pre_hook=_tma_hook)(_bwd_act_body)


@triton.jit
def _swiglu_bwd_tile(acc, rows64, cols, omask, route, rmask, gu_ptr, stride_gm, stride_gn, scale_ptr, dgu_ptr,
                     stride_om, stride_on, hs_ptr, I, limit, HAS_SCALE: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    """The SwiGLU backward of one [rows, cols] tile of acc = dy @ down[e] (float32): writes dg, du and
    (scale *) h; returns the tile's share of d scale = <acc, h> per row (h in float32)."""
    g_ptrs = gu_ptr + rows64 * stride_gm + cols[None, :] * stride_gn
    g = tl.load(g_ptrs, mask=omask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + I * stride_gn, mask=omask, other=0.0).to(tl.float32)
    gc, uc = clamp_gu(g, u, limit, HAS_LIMIT)
    sig = tl.sigmoid(gc)
    h32 = gc * sig * uc  # swiglu(g, u), its clamp and sigmoid reused by the gradient below
    part = tl.sum(acc * h32, axis=1)
    h = to_out(h32, hs_ptr, DOT_PREC).to(tl.float32)  # the forward's h, as the down GEMM read it
    if HAS_SCALE:
        scale = tl.load(scale_ptr + route, mask=rmask, other=0.0)[:, None]
        tl.store(hs_ptr + rows64 * I + cols[None, :], to_out(h * scale, hs_ptr, DOT_PREC), mask=omask)
        dh = acc * scale
    else:
        tl.store(hs_ptr + rows64 * I + cols[None, :], to_out(h, hs_ptr, DOT_PREC), mask=omask)
        dh = acc
    dg = dh * uc * (sig * (1.0 + gc * (1.0 - sig)))
    du = dh * gc * sig
    if HAS_LIMIT:  # the clamp passes no gradient where it clipped (NaN is not clipped)
        dg = tl.where(g > limit, 0.0, dg)
        du = tl.where((u > limit) | (u < -limit), 0.0, du)
    o_ptrs = dgu_ptr + rows64 * stride_om + cols[None, :] * stride_on
    tl.store(o_ptrs, to_out(dg, dgu_ptr, DOT_PREC), mask=omask)
    tl.store(o_ptrs + I * stride_on, to_out(du, dgu_ptr, DOT_PREC), mask=omask)
    return part


@triton.jit
def _swiglu_bwd_kernel(
    dh_ptr,  # float32 [M, I]: dy @ down[e] per sorted row (from _bwd_act_kernel with STORE_ACC)
    routes_ptr, offsets_ptr, gu_ptr, stride_gm, stride_gn, scale_ptr, dgu_ptr, stride_om, stride_on,
    dscale_ptr, hs_ptr, M, E, I, limit,
    SINGLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The second pass of the two-pass bwd_act: BLOCK_M rows, all of I in BLOCK_N steps (d scale summed
    in that fixed order; rows of the `-1` tail are skipped, their d scale stays 0)."""
    limit = tl.cast(limit, tl.float32)  # (fp64 under Inductor, see _bwd_act_body)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if SINGLE:
        rmask = rows < M
        route = rows
    else:
        rmask = rows < tl.load(offsets_ptr + E)
        route = tl.load(routes_ptr + rows, mask=rmask, other=0)
    rows64 = rows[:, None].to(tl.int64)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, I, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        omask = rmask[:, None] & (cols < I)[None, :]
        acc = tl.load(dh_ptr + rows64 * I + cols[None, :], mask=omask, other=0.0)
        total += _swiglu_bwd_tile(acc, rows64, cols, omask, route, rmask, gu_ptr, stride_gm, stride_gn, scale_ptr,
                                  dgu_ptr, stride_om, stride_on, hs_ptr, I, limit, HAS_SCALE, HAS_LIMIT, DOT_PREC)
    tl.store(dscale_ptr + route, total, mask=rmask)


# Two passes (a plain GEMM writing dy @ down in float32, then the SwiGLU backward elementwise) at
# `options.two_pass_min_rows` rows per expert and more: the fused epilogue's register pressure holds the GEMM
# to 64-wide tiles; below it, one launch is cheaper.


def bwd_act(dy_TH, down_t, gu_M2I, scale, routes_N, offsets_E1, topk, limit, *, single=False, two_pass=None):
    """-> (dgu [M, 2I] dy.dtype, dscale [routes] float32 = <dy @ down[e], h> per route, hs [M, I] = scale * h
    in dy.dtype (h without a scale)). down_t: the down weight's transpose as an `mxfp8.Operand` read as
    [E, I, H]; gu: the forward's saved [g | u]. two_pass: None picks by rows per expert (shapes only)."""
    M = gu_M2I.shape[0]
    I = gu_M2I.shape[1] // 2
    E, _, H = down_t.data.shape
    dev, dtype = gu_M2I.device, dy_TH.dtype  # dy is in the activation dtype (gu may be float32)
    n_routes = M if single else routes_N.numel()
    if two_pass is None:  # (dynamic shapes: two passes, the choice at training sizes)
        two_pass = _launch.at_least(M, options.current().two_pass_min_rows * (1 if single else E), symbolic=True)
    P = 1 if two_pass else _launch.cdiv(I, _BWD_ACT_MIN_BLOCK_N)
    dgu = torch.empty(M, 2 * I, dtype=dtype, device=dev)
    dscale_P = torch.zeros(P, n_routes, dtype=torch.float32, device=dev)
    hs = torch.empty(M, I, dtype=dtype, device=dev)
    if M == 0 or I == 0:
        return dgu, dscale_P.sum(0), hs
    dh = torch.empty(M, I, dtype=torch.float32, device=dev) if two_pass else dscale_P
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], single) * _launch.cdiv(I, meta["BLOCK_N"]),)
    scale_arg = scale if scale is not None else dscale_P
    flags = dict(SINGLE=single, HAS_SCALE=scale is not None, HAS_LIMIT=limit is not None,
                 DOT_PREC=_launch.dot_precision(dtype))
    lim = 0.0 if limit is None else float(limit)
    tma = tma_weights((down_t,)) if tma_eligible(dy_TH, M, E) else None
    _launch.launch(
        _bwd_gemm_kernel if two_pass else _bwd_act_kernel, grid,
        dy_TH, dy_TH.stride(0), dy_TH.stride(1), routes_N, offsets_E1, *w_args(down_t),
        gu_M2I, gu_M2I.stride(0), gu_M2I.stride(1), scale_arg,
        dgu, dgu.stride(0), dgu.stride(1), dscale_P, dscale_P.stride(0), hs, dh,
        *((None, 1) if tma is None else (tma[0][0], tma[1])),
        M, H, I, E, topk, lim, MX_D=down_t.quantized, STORE_ACC=two_pass,
        TMA=tma is not None, W_KMAJOR=tma is not None and tma[2],
        GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=GROUP_M, **w_meta(down_t), **flags,
    )
    if two_pass:
        bm, bn = _SWIGLU_BWD_BLOCK
        _launch.launch(
            _swiglu_bwd_kernel, (_launch.cdiv(M, bm),),
            dh, routes_N, offsets_E1, gu_M2I, gu_M2I.stride(0), gu_M2I.stride(1), scale_arg,
            dgu, dgu.stride(0), dgu.stride(1), dscale_P, hs, M, E, I, lim,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=8, **flags,
        )
    return dgu, dscale_P[0] if P == 1 else dscale_P.sum(0), hs  # fixed-order reduction over the I-tiles


# ---------------------------------------------------------------------------------------------
# Weight gradients: dst[e][m, n] (+)= sum over expert e's rows r of A[r, m] * B[r, n]


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


@triton.jit
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
    offset fits) and one GEMM of 2 MD rows instead of two accumulators took the gate/up weight gradient from
    about 360 to 520-580 TFLOP/s.)"""
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


# (SPLIT and A_GATHER in the key: at H == I the down and the gate/up weight gradients share MD, ND, M, E)
_WGRAD_KEY = ["MD", "ND", "M", "E", "SPLIT", "A_GATHER"]
_wgrad_kernel = _launch.autotune(_WGRAD_CONFIGS, cfg(16, 16, 16, 1, 1), key=_WGRAD_KEY,
                                 restore_value=["dst_ptr", "dst2_ptr"])(_wgrad_body)


def _span(t) -> int:
    """The largest element offset a view reaches from its first element."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # (torch strides are never negative)


def offsets_fit_int32(*views) -> bool:
    """Whether every element offset of these views fits int32, decided without a guard: a symbolic size
    that may reach 2**31 counts as not fitting (int64 offsets, the safe choice)."""
    return not any(_launch.at_least(_span(v), 2 ** 31, symbolic=True) for v in views)


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
    d2 = dst2_EMN if split else dst_EMN
    M = n_rows if single else routes_N.numel()
    gather = (a_gather or b_gather) and not single
    if gather and tokens_N is None:
        tokens_N = routes_N // topk
    idx = tokens_N if gather else offsets_E1
    off32 = offsets_fit_int32(a, b)
    rows_out = 2 * MD if split else MD
    grid = lambda meta: (_launch.cdiv(rows_out, meta["BLOCK_M"]) * _launch.cdiv(ND, meta["BLOCK_N"]), E)
    _launch.launch(
        _wgrad_kernel, grid,
        a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), idx, offsets_E1,
        dst_EMN, dst_EMN.stride(0), dst_EMN.stride(1), dst_EMN.stride(2), d2, d2.stride(0), d2.stride(1), d2.stride(2),
        MD, ND, M, E,
        SINGLE=single, A_GATHER=a_gather, B_GATHER=b_gather, GATHER=gather, ACCUMULATE=accumulate, SPLIT=split,
        OFF32=off32, DOT_PREC=_launch.dot_precision(b.dtype), GROUP_M=GROUP_M,
    )
    return dst_EMN


# ---------------------------------------------------------------------------------------------
# One expert MLP's backward (routed or shared), and the shared expert with its output gate


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


def expert_backward(x_TH, dy_TH, gate_t, up_t, down_t, gu_M2I, scale, routes_N, offsets_E1, topk, limit,
                    d_weights, dx_out, accumulate, *, scatter, single=False, d_gate_up=None):
    """Weight gradients (d_gate, d_up, d_down) = `d_weights` (written or ADDED; None entries skipped) and
    dx_out[dest(r)] = dg @ gate[e] + du @ up[e] of the expert MLPs whose forward saved `gu_M2I`. gate_t, up_t
    read as [E, H, I], down_t as [E, I, H] (the transposed weights). `d_gate_up`: the [E, 2I, H] buffer whose
    row halves d_gate and d_up are, written as one destination (GradBuffers.d_gate_up). Returns d scale
    [routes] float32."""
    n_rows = x_TH.shape[0] if single else None
    dgu, dscale, hs = bwd_act(dy_TH, down_t, gu_M2I, scale, routes_N, offsets_E1, topk, limit, single=single)
    d_gate, d_up, d_down = d_weights
    tokens_N = None if single else routes_N // topk  # the wgrads' gather index, once for both
    kw = dict(accumulate=accumulate, single=single, n_rows=n_rows, tokens_N=tokens_N)
    wgrad_into((d_down,), dy_TH, hs, routes_N, offsets_E1, topk, a_gather=True, b_gather=False, **kw)
    # d_gate and d_up as one GEMM over dgu = [dg | du]: both read the gathered x tile; into their common buffer
    # when there is one (dgu^T @ x is its [2I, H] rows in order)
    pair = (d_gate_up,) if d_gate_up is not None else (d_gate, d_up)
    wgrad_into(pair, dgu, x_TH, routes_N, offsets_E1, topk, a_gather=False, b_gather=True, **kw)
    grouped_rows(dgu, gate_t, dx_out, routes_N, offsets_E1, w2=up_t, scatter=scatter, single=single)
    return dscale


def shared_backward(x_TH, dy_TH, s_gate, s_up, s_down, s_out_gate_1H, gu_shared_T2Is, swiglu_limit, sorted_N,
                    offsets_E1, grads, accumulate):
    """Weight gradients of the shared expert and its output gate into `grads` (written or ADDED), and the
    combine's inputs for dx: (dx_s [T, H] or None, bias [H] or None, bias scale [T] or None)."""
    if s_gate is None:
        return None, None, None
    T, H = x_TH.shape
    gate_T = torch.sigmoid(rowdot(x_TH, s_out_gate_1H)) if s_out_gate_1H is not None else None
    dx_s = torch.empty(T, H, dtype=x_TH.dtype, device=x_TH.device)
    d_weights = (grads.d_s_gate[None], grads.d_s_up[None], grads.d_s_down[None])
    dgate_T = expert_backward(x_TH, dy_TH, plain_t(s_gate[None]), plain_t(s_up[None]), plain_t(s_down[None]),
                              gu_shared_T2Is, gate_T, sorted_N, offsets_E1, 1, swiglu_limit, d_weights, dx_s,
                              accumulate, scatter=False, single=True,
                              d_gate_up=None if grads.d_s_gate_up is None else grads.d_s_gate_up[None])
    if s_out_gate_1H is None:
        return dx_s, None, None
    d_logit = dgate_T * gate_T * (1.0 - gate_T)
    d_w = d_logit[None, :] @ x_TH.float()  # [1, H] float32, a fixed-order GEMV
    if accumulate:
        grads.d_s_out_gate.add_(d_w)
    else:
        grads.d_s_out_gate.copy_(d_w)
    return dx_s, s_out_gate_1H.reshape(-1), d_logit
