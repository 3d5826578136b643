"""The backward's first GEMM: dy @ down[e] with the SwiGLU backward in its epilogue, or in a second pass.

    dy_TH[tok] @ down[e] --_bwd_act_kernel, epilogue on the saved gu_N2I = [g | u]--> dgu_N2I = [dg | du]
        (dy.dtype, sorted rows), dscale_PN (partial <dy_t @ down[e], h> per I-tile, at the route: d router
        weights without y_tk), hs_NI = rw * h (the down weight gradient's operand); h is recomputed from
        g, u elementwise, no GEMM is recomputed
      or, with many rows per expert (`options.two_pass_min_rows`): --_bwd_gemm_kernel--> dh_NI (float32,
        transient) --_swiglu_bwd_kernel--> the same dgu, hs and d scale (the fused epilogue's register
        pressure keeps its GEMM to 64-wide tiles; the plain GEMM runs 128 x 128)

The shared expert runs the same kernels with SINGLE=True and the sigmoid output gate in the place of the
router weight. down^T is read as [E, I, H] (operands.w_tile): bf16/fp16/fp32, or MXFP8 column-wise data.

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token (TOPK), N = T*K routes
(M rows), P I-tiles of the partial router-weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import options
from . import common
from .common import GROUP_M, _tile_ids, _tile_rows, cfg, clamp_gu, mma, row_tiles_worst, to_out
from .configs import Family, dtype_name, register
from .operands import tma_eligible, tma_pre_hook, tma_weights, w_args, w_bases, w_meta, w_tile, w_tma_tile


# (Register pressure: the epilogue holds acc, g, u, h and the gradients, so tiles of 128 x 128 spill; these
# are the configs that did not, or nearly not)
_BWD_ACT_CONFIGS = [cfg(64, 128, 64, 8, 3), cfg(128, 64, 64, 8, 4), cfg(64, 64, 64, 4, 4), cfg(64, 128, 64, 8, 4),
                    cfg(128, 64, 64, 8, 3), cfg(64, 64, 128, 4, 3)]


_BWD_ACT_INTERPRET = cfg(16, 16, 32, 1, 1)


def _min_block_n(configs) -> int:
    """The smallest BLOCK_N a launch may pick: the partial router-gradient buffer has one row per I-tile."""
    picked = [_BWD_ACT_INTERPRET] if common.INTERPRET else configs
    return min(c.block_n for c in picked)


_BWD_ACT_MIN_BLOCK_N = _min_block_n(_BWD_ACT_CONFIGS)


# The two-pass variant's GEMM holds only its accumulator: the large tiles of a plain GEMM; 128 x 256 first,
# the searched pick at the training shapes
_BWD_GEMM_CONFIGS = [cfg(128, 256, 64, 8, 3), cfg(128, 128, 64, 8, 3), cfg(128, 128, 64, 8, 4), cfg(64, 128, 64, 4, 4),
                     cfg(128, 64, 64, 4, 4)]


_SWIGLU_BWD_BLOCK = (16, 32) if common.INTERPRET else (32, 256)  # (rows, columns per step) of the second pass


@triton.jit(do_not_specialize=["M", "stride_sp"])  # (a new token count compiles nothing)
def _bwd_act_body(
    dy_ptr, stride_dt, stride_dh,  # dy [T, H] (any strides, stride 0 too)
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    wd_ptr, d_e, d_n, d_k, ds_ptr, ds_e, ds_n, ds_k,  # down^T read as [E, I, H] (MX_D: column-wise MXFP8)
    gu_ptr, stride_gm, stride_gn,  # gu [M, 2I] saved (sorted rows, any float dtype): g in [0, I), u in [I, 2I)
    scale_ptr,  # float32 router weight per route [T*K] (SINGLE: per token [T]) (HAS_SCALE)
    dgu_ptr, stride_om, stride_on, up_off,  # dgu [M, 2I] out: dg at column c, du at c + up_off (elements);
    # INTERLEAVE: dg at 2c, du at 2c + 1, dgu's columns contiguous
    dscale_ptr, stride_sp,  # float32 [P, T*K] out: partial <dy @ down, h> of I-tile p at the route
    hs_ptr,  # [M, I] out (the activation dtype): (scale *) h, rounded: the down weight-gradient's operand
    dh_ptr,  # float32 [M, I] out (STORE_ACC: the accumulator only, no epilogue)
    wd_desc, w_rows,  # TMA: the host descriptor of down^T's 2-D view and its R (operands.tma_weights)
    M, H, I, E, TOPK, limit,
    alpha, beta,  # the gated activation g * sigmoid(alpha g) * (u + beta) (`types.Activation`)
    SINGLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LIMIT: tl.constexpr, MX_D: tl.constexpr, STORE_ACC: tl.constexpr,
    INTERLEAVE: tl.constexpr, DOT_PREC: tl.constexpr, W_TABLE: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
    GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    limit = tl.cast(limit, tl.float32)  # Inductor passes a Python float as fp64: keep the epilogue in fp32
    alpha = tl.cast(alpha, tl.float32)
    beta = tl.cast(beta, tl.float32)
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
    part = _swiglu_bwd_tile(acc, rows64, pid_n * BLOCK_N, omask, route, rmask, gu_ptr, stride_gm, stride_gn,
                            scale_ptr, dgu_ptr, stride_om, stride_on, up_off, hs_ptr, I, limit, alpha, beta,
                            HAS_SCALE, HAS_LIMIT, DOT_PREC, INTERLEAVE, BLOCK_N)
    tl.store(dscale_ptr + pid_n * stride_sp + route, part, mask=rmask)


_FIELDS = ("dtype", "H", "I", "E", "TMA", "MX")  # MX: MXFP8 down weights dequantized in the K loop
_OUTPUTS = ("dgu_ptr", "dscale_ptr", "hs_ptr", "dh_ptr")
_tma_hook = tma_pre_hook((), ("wd_desc",))
BWD_ACT = register(Family("bwd_act", _bwd_act_body, _BWD_ACT_CONFIGS, fields=_FIELDS, sizes=("H", "I", "E"),
                          outputs=_OUTPUTS, field_defaults={"MX": False}, interpret=_BWD_ACT_INTERPRET,
                          pre_hook=_tma_hook))
BWD_GEMM = register(Family("bwd_gemm", _bwd_act_body, _BWD_GEMM_CONFIGS, fields=_FIELDS, sizes=("H", "I", "E"),
                           outputs=_OUTPUTS, field_defaults={"MX": False}, interpret=_BWD_ACT_INTERPRET,
                           pre_hook=_tma_hook))


@triton.jit
def _swiglu_bwd_tile(acc, rows64, col0, omask, route, rmask, gu_ptr, stride_gm, stride_gn, scale_ptr, dgu_ptr,
                     stride_om, stride_on, up_off, hs_ptr, I, limit, alpha, beta, HAS_SCALE: tl.constexpr,
                     HAS_LIMIT: tl.constexpr, DOT_PREC: tl.constexpr, INTERLEAVE: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """The gated activation's backward (h = g' sigmoid(alpha g') (u' + beta); the SwiGLU is alpha 1, beta 0)
    of one [rows, col0 + BLOCK_N) tile of acc = dy @ down[e] (float32): writes dg, du and (scale *) h; returns
    the tile's share of d scale = <acc, h> per row (h in float32). INTERLEAVE: dg and du alternate in dgu's
    columns, stored as one contiguous [rows, 2 BLOCK_N] tile (two stride-2 stores would write every sector
    twice, element by element)."""
    cols = col0 + tl.arange(0, BLOCK_N)
    g_ptrs = gu_ptr + rows64 * stride_gm + cols[None, :] * stride_gn
    g = tl.load(g_ptrs, mask=omask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + I * stride_gn, mask=omask, other=0.0).to(tl.float32)
    gc, uc = clamp_gu(g, u, limit, HAS_LIMIT)
    uc = uc + beta
    sig = tl.sigmoid(alpha * gc)
    h32 = gc * sig * uc  # the activation of (g, u), its clamp and sigmoid reused by the gradient below
    part = tl.sum(acc * h32, axis=1)
    h = to_out(h32, hs_ptr, DOT_PREC).to(tl.float32)  # the forward's h, as the down GEMM read it
    if HAS_SCALE:
        scale = tl.load(scale_ptr + route, mask=rmask, other=0.0)[:, None]
        tl.store(hs_ptr + rows64 * I + cols[None, :], to_out(h * scale, hs_ptr, DOT_PREC), mask=omask)
        dh = acc * scale
    else:
        tl.store(hs_ptr + rows64 * I + cols[None, :], to_out(h, hs_ptr, DOT_PREC), mask=omask)
        dh = acc
    dg = dh * uc * (sig * (1.0 + alpha * gc * (1.0 - sig)))
    du = dh * gc * sig
    if HAS_LIMIT:  # the clamp passes no gradient where it clipped (NaN is not clipped)
        dg = tl.where(g > limit, 0.0, dg)
        du = tl.where((u > limit) | (u < -limit), 0.0, du)
    if INTERLEAVE:
        both = tl.reshape(tl.join(dg, du), [acc.shape[0], 2 * BLOCK_N])  # column 2c + h: dg (h = 0) or du of c
        cols2 = 2 * col0 + tl.arange(0, 2 * BLOCK_N)
        tl.store(dgu_ptr + rows64 * stride_om + cols2[None, :], to_out(both, dgu_ptr, DOT_PREC),
                 mask=rmask[:, None] & (cols2 < 2 * I)[None, :])
    else:
        o_ptrs = dgu_ptr + rows64 * stride_om + cols[None, :] * stride_on
        tl.store(o_ptrs, to_out(dg, dgu_ptr, DOT_PREC), mask=omask)
        tl.store(o_ptrs + up_off, to_out(du, dgu_ptr, DOT_PREC), mask=omask)
    return part


@triton.jit(do_not_specialize=["M"])
def _swiglu_bwd_kernel(
    dh_ptr,  # float32 [M, I]: dy @ down[e] per sorted row (from _bwd_act_kernel with STORE_ACC)
    routes_ptr, offsets_ptr, gu_ptr, stride_gm, stride_gn, scale_ptr, dgu_ptr, stride_om, stride_on, up_off,
    dscale_ptr, hs_ptr, M, E, I, limit, alpha, beta,
    SINGLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_PREC: tl.constexpr,
    INTERLEAVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The second pass of the two-pass bwd_act: BLOCK_M rows, all of I in BLOCK_N steps (d scale summed
    in that fixed order; rows of the `-1` tail are skipped, their d scale stays 0)."""
    limit = tl.cast(limit, tl.float32)  # (fp64 under Inductor, see _bwd_act_body)
    alpha = tl.cast(alpha, tl.float32)
    beta = tl.cast(beta, tl.float32)
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
        total += _swiglu_bwd_tile(acc, rows64, n0, omask, route, rmask, gu_ptr, stride_gm, stride_gn, scale_ptr,
                                  dgu_ptr, stride_om, stride_on, up_off, hs_ptr, I, limit, alpha, beta, HAS_SCALE,
                                  HAS_LIMIT, DOT_PREC, INTERLEAVE, BLOCK_N)
    tl.store(dscale_ptr + route, total, mask=rmask)


# Two passes (a plain GEMM writing dy @ down in float32, then the SwiGLU backward elementwise) at
# `options.two_pass_min_rows` rows per expert and more: the fused epilogue's register pressure holds the GEMM
# to 64-wide tiles; below it, one launch is cheaper.


def bwd_act(dy_TH, down_t, gu_M2I, scale, routes_N, offsets_E1, topk, limit, *, single=False, two_pass=None,
            act=None, interleave=False):
    """-> (dgu [M, 2I] dy.dtype, dscale [routes] float32 = <dy @ down[e], h> per route, hs [M, I] = scale * h
    in dy.dtype (h without a scale)). act: the gated activation (`types.Activation`; None: the SwiGLU).
    down_t: the down weight's transpose as a `types.Operand` read as [E, I, H]; gu: the forward's saved [g | u].
    two_pass: None picks by rows per expert (shapes only).
    interleave: dgu's columns alternate dg and du (dg_i at 2i, du_i at 2i + 1) instead of [dg | du]: the layout
    of an interleaved gate/up weight (`operands.interleaved`), whose data gradient and weight gradient then read
    dgu as one operand along that weight's contiguous dim."""
    M = gu_M2I.shape[0]
    I = gu_M2I.shape[1] // 2
    E, _, H = down_t.data.shape
    dev, dtype = gu_M2I.device, dy_TH.dtype  # dy is in the activation dtype (gu may be float32)
    n_routes = M if single else routes_N.numel()
    if two_pass is None:  # (dynamic shapes: two passes, the choice at training sizes)
        two_pass = common.at_least(M, options.current().two_pass_min_rows * (1 if single else E), symbolic=True)
    P = 1 if two_pass else common.cdiv(I, _BWD_ACT_MIN_BLOCK_N)
    dgu = torch.empty(M, 2 * I, dtype=dtype, device=dev)
    dscale_P = torch.zeros(P, n_routes, dtype=torch.float32, device=dev)
    hs = torch.empty(M, I, dtype=dtype, device=dev)
    if M == 0 or I == 0:
        return dgu, dscale_P.sum(0), hs
    # pointer arguments the launch does not use (dh in one pass, scale without one) get a read-only input in
    # their place, never an output (`common.launch`)
    dh = torch.empty(M, I, dtype=torch.float32, device=dev) if two_pass else gu_M2I
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], single) * common.cdiv(I, meta["BLOCK_N"]),)
    scale_arg = scale if scale is not None else gu_M2I
    flags = dict(SINGLE=single, HAS_SCALE=scale is not None, HAS_LIMIT=limit is not None,
                 DOT_PREC=common.dot_precision(dtype), INTERLEAVE=interleave)
    lim = 0.0 if limit is None else float(limit)
    ab = (1.0, 0.0) if act is None else (act.alpha, act.beta)
    tma = tma_weights((down_t,)) if tma_eligible(dy_TH, M, E) else None
    out_cols = (dgu.stride(1), I * dgu.stride(1))  # (column stride, du's offset; INTERLEAVE stores whole rows)
    common.launch(
        BWD_GEMM if two_pass else BWD_ACT, grid,
        dy_TH, dy_TH.stride(0), dy_TH.stride(1), routes_N, offsets_E1, *w_args(down_t),
        gu_M2I, gu_M2I.stride(0), gu_M2I.stride(1), scale_arg,
        dgu, dgu.stride(0), *out_cols, dscale_P, dscale_P.stride(0), hs, dh,
        *((None, 1) if tma is None else (tma[0][0], tma[1])),
        M, H, I, E, topk, lim, *ab, MX_D=down_t.quantized, STORE_ACC=two_pass,
        TMA=tma is not None, W_KMAJOR=tma is not None and tma[2],
        GROUPS_POW2=common.next_pow2(E + 1), GROUP_M=GROUP_M, **w_meta(down_t), **flags,
        rows=M, problem=(dtype_name(dtype), H, I, E, tma is not None, bool(down_t.quantized)),
    )
    if two_pass:
        bm, bn = _SWIGLU_BWD_BLOCK
        common.launch(
            _swiglu_bwd_kernel, (common.cdiv(M, bm),),
            dh, routes_N, offsets_E1, gu_M2I, gu_M2I.stride(0), gu_M2I.stride(1), scale_arg,
            dgu, dgu.stride(0), *out_cols, dscale_P, hs, M, E, I, lim, *ab,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=8, **flags,
        )
    return dgu, dscale_P[0] if P == 1 else dscale_P.sum(0), hs  # fixed-order reduction over the I-tiles
