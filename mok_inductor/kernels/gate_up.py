"""The gathered gate/up GEMM of the forward, with the clamped SwiGLU in its epilogue.

    x_TH[sorted_routes // K] --_gate_up_kernel (gather in the loads)--> gu_N2I = [g | u] (sorted, saved for
        backward; the `-1` routes' rows zero), h_NI = swiglu(g, u) (sorted, transient: the down GEMM's A)

Where the tables pick it (`GATE_UP_STAGE`), the stage runs instead as torch._grouped_mm over the gathered sorted
rows and `_act_rows_kernel` (h from the rounded g, u; the `-1` rows zeroed): only where that computes the same.

g and u are rounded to the saved dtype without crossing the clamp bound (KEEP_CLIP), and h is computed from
the rounded values: backward recomputes h from the saved g, u exactly. MXFP8 gate/up at decode sizes run the
fp16 K loops of mx_loop.py (MX_LOOP), the rest the dequantizing loop (TMA descriptors for the weights' whole
K steps where `operands.tma_eligible`).

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token (TOPK), M = N = T*K sorted
rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..types import Operand
from . import common
from .common import GROUP_M, _tile_ids, _tile_rows, cfg, mma, round_gu, row_tiles_worst, swiglu, to_out
from .configs import Family, dtype_name, register, stage
from .mx_loop import (_MX_F16_CONFIGS, MX_F16_SMALL_GATE_UP, _gate_up_mx_block, act_step_t, group_scales, mx_group, mx_one, mx_rows, mx_step_t, mx_trans, scale_step, step_scales, use_mx_loop, w_block_scales)
from .operands import (concatenated, interleaved, row_desc, tma_eligible, tma_pre_hook, tma_weights, w_args, w_bases,
                       w_meta, w_tile, w_tma_tile)


# the last: decode (a few rows per expert, the weights streamed)
_GATE_UP_CONFIGS = [cfg(128, 128, 64, 8, 3), cfg(128, 64, 64, 4, 4), cfg(64, 128, 64, 4, 4), cfg(128, 64, 64, 8, 4),
                    cfg(64, 64, 128, 4, 3), cfg(64, 64, 64, 4, 6)]


@triton.jit
def _x_tile(a_row, stride_xh, a_desc, row_start, k0, ks, rmask, SORTED_X: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] x tile of a whole K step: by TMA from the sorted rows (SORTED_X; rows past the
    expert's end are the next expert's, their results masked at the store), else gathered by pointers."""
    if SORTED_X:
        a = a_desc.load([row_start, k0])
    else:
        a = tl.load(a_row + (k0 + ks)[None, :] * stride_xh, mask=rmask[:, None], other=0.0)
    return a


@triton.jit
def _gate_up_tile(
    x_ptr, stride_xt, stride_xh, xr_ptr, routes_ptr,
    wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k, wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k,
    gu_ptr, stride_gm, stride_gn, h_ptr, stride_hm, stride_hi, g_desc, u_desc, w_rows, a_desc,
    H, I, E, TOPK, limit, above, below, group, row_start, row_end, pid_n,
    bias_ptr, b_e, b_c, b_i, alpha, beta, HAS_BIAS: tl.constexpr,
    SINGLE: tl.constexpr, MX_G: tl.constexpr, MX_U: tl.constexpr, WRITE_H: tl.constexpr,
    HAS_LIMIT: tl.constexpr, KEEP_CLIP: tl.constexpr, DOT_PREC: tl.constexpr,
    W_TABLE: tl.constexpr, MX_LOOP: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
    INTERLEAVED: tl.constexpr, SORTED_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The K loop and epilogue of one tile of expert `group`'s rows [row_start, row_end).
    INTERLEAVED: gate and up are one [E, 2I, H] weight (wg_ptr) whose rows alternate gate and up
    (`operands.interleaved`): each K step loads one [BLOCK_K, 2 BLOCK_N] tile of it, along its contiguous
    dim, and the accumulator's columns split into g and u after the loop.
    MX_LOOP (`MxLoop`, not DEQUANTIZE): MXFP8 gate and up on the fp16 tensor cores by 32-blocks (`mx_dot`),
    BLOCK_K // 32 scale blocks per K step; x the fp16 rows of `row_f16`, xr_ptr their float32 scales.
    TMA: the weight tiles of the whole K steps through descriptors (`w_tma_tile`), the tail step and the
    gathered x rows by pointers. SORTED_X (with TMA): x is the rows already gathered in sorted order (row r is
    route r's token), and the whole K steps load its tiles through a_desc too."""
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    rows64 = rows[:, None].to(tl.int64)
    g_ptrs = gu_ptr + rows64 * stride_gm + cols[None, :] * stride_gn
    h_ptrs = h_ptr + rows64 * stride_hm + cols[None, :] * stride_hi
    omask = rmask[:, None] & cmask[None, :]
    if SINGLE or SORTED_X:
        tok = rows
    else:
        tok = tl.load(routes_ptr + rows, mask=rmask, other=0) // TOPK
    ks = tl.arange(0, BLOCK_K)
    e64 = group.to(tl.int64)
    wg, gs = w_bases(wg_ptr, gs_ptr, e64, g_e, gs_e, E, W_TABLE, MX_G)
    wu, us = w_bases(wu_ptr, us_ptr, e64, u_e, us_e, E, W_TABLE, MX_U)
    a_row = x_ptr + tok[:, None].to(tl.int64) * stride_xt
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MX_LOOP:  # the whole K steps, BLOCK_K // 32 blocks each, then the tail's blocks one by one (no k masks)
        k_full = H - H % BLOCK_K
        TRANS: tl.constexpr = mx_trans(MX_LOOP, BLOCK_M)
        G: tl.constexpr = mx_group(MX_LOOP, BLOCK_K)
        ONE: tl.constexpr = mx_one(MX_LOOP, TRANS)
        a_row_t = x_ptr + tok[None, :].to(tl.int64) * stride_xt
        if TRANS:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, k_full, BLOCK_K):
            if ONE:
                a_t = act_step_t(a_row_t, stride_xh, 0, k0, rmask, BLOCK_K)
                acc_g = mx_step_t(a_t, wg, k0, cols, cmask, g_n, g_k,
                                  step_scales(gs, k0, cols, cmask, gs_n, BLOCK_K), acc_g, DOT_PREC, BLOCK_K)
                acc_u = mx_step_t(a_t, wu, k0, cols, cmask, u_n, u_k,
                                  step_scales(us, k0, cols, cmask, us_n, BLOCK_K), acc_u, DOT_PREC, BLOCK_K)
            else:
                cur_g = scale_step(gs, k0, k_full, cols, cmask, gs_n, G == 4, BLOCK_K)
                cur_u = scale_step(us, k0, k_full, cols, cmask, us_n, G == 4, BLOCK_K)
                for q in tl.static_range(BLOCK_K // (32 * G)):
                    kb0 = k0 // 32 + G * q
                    for j in tl.static_range(G):
                        acc_g, acc_u = _gate_up_mx_block(
                            acc_g, acc_u, a_row, a_row_t, stride_xh, kb0 + j, rmask,
                            wg, group_scales(cur_g, q, j, gs, kb0, cols, cmask, gs_n, gs_k, G == 4),
                            wu, group_scales(cur_u, q, j, us, kb0, cols, cmask, us_n, us_k, G == 4),
                            cols, cmask, g_n, g_k, u_n, u_k, TRANS, DOT_PREC)
        for kb in range(k_full // 32, H // 32):
            acc_g, acc_u = _gate_up_mx_block(acc_g, acc_u, a_row, a_row_t, stride_xh, kb, rmask,
                                             wg, w_block_scales(gs, kb, cols, cmask, gs_n, gs_k),
                                             wu, w_block_scales(us, kb, cols, cmask, us_n, us_k),
                                             cols, cmask, g_n, g_k, u_n, u_k, TRANS, DOT_PREC)
        if TRANS:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        r_s = tl.load(xr_ptr + tok, mask=rmask, other=1.0)[:, None]  # x's row scales
        acc_g *= r_s
        acc_u *= r_s
    elif INTERLEAVED:
        cols2 = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        cmask2 = cols2 < 2 * I
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        k_start = 0
        if TMA:
            k_start = H - H % BLOCK_K
            for k0 in range(0, k_start, BLOCK_K):
                a = _x_tile(a_row, stride_xh, a_desc, row_start, k0, ks, rmask, SORTED_X)
                acc = mma(a, w_tma_tile(g_desc, group * w_rows, pid_n * 2 * BLOCK_N, k0, W_KMAJOR), acc, DOT_PREC)
        for k0 in range(k_start, H, BLOCK_K):
            kk = k0 + ks
            kmask = kk < H
            a = tl.load(a_row + kk[None, :] * stride_xh, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = w_tile(wg, gs, kk, cols2, kmask, cmask2, g_n, g_k, gs_n, gs_k, x_ptr, False, DOT_PREC)
            acc = mma(a, b, acc, DOT_PREC)
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        k_start = 0
        if TMA:
            k_start = H - H % BLOCK_K
            for k0 in range(0, k_start, BLOCK_K):
                a = _x_tile(a_row, stride_xh, a_desc, row_start, k0, ks, rmask, SORTED_X)
                acc_g = mma(a, w_tma_tile(g_desc, group * w_rows, pid_n * BLOCK_N, k0, W_KMAJOR), acc_g, DOT_PREC)
                acc_u = mma(a, w_tma_tile(u_desc, group * w_rows, pid_n * BLOCK_N, k0, W_KMAJOR), acc_u, DOT_PREC)
        for k0 in range(k_start, H, BLOCK_K):
            kk = k0 + ks
            kmask = kk < H
            a = tl.load(a_row + kk[None, :] * stride_xh, mask=rmask[:, None] & kmask[None, :], other=0.0)
            bg = w_tile(wg, gs, kk, cols, kmask, cmask, g_n, g_k, gs_n, gs_k, x_ptr, MX_G, DOT_PREC)
            bu = w_tile(wu, us, kk, cols, kmask, cmask, u_n, u_k, us_n, us_k, x_ptr, MX_U, DOT_PREC)
            acc_g = mma(a, bg, acc_g, DOT_PREC)
            acc_u = mma(a, bu, acc_u, DOT_PREC)
    if HAS_BIAS:  # the FC1 bias, in the accumulators: before the rounding and the clamp
        b_ptrs = bias_ptr + e64 * b_e + cols * b_i
        acc_g += tl.load(b_ptrs, mask=cmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + b_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    g, u = round_gu(acc_g, acc_u, gu_ptr, limit, above, below, KEEP_CLIP, DOT_PREC)
    tl.store(g_ptrs, g.to(gu_ptr.dtype.element_ty), mask=omask)
    tl.store(g_ptrs + I * stride_gn, u.to(gu_ptr.dtype.element_ty), mask=omask)
    if WRITE_H:
        h = swiglu(g, u, limit, alpha, beta, HAS_LIMIT)
        tl.store(h_ptrs, to_out(h, h_ptr, DOT_PREC), mask=omask)


@triton.jit(do_not_specialize=["M"])  # (a new token count compiles nothing)
def _gate_up_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H] (MX_LOOP: fp16, `row_f16`)
    xr_ptr,  # MX_LOOP: x's row scales [T] float32 (else unused)
    routes_ptr, offsets_ptr,  # sorted_routes [M] int32, expert_offsets [E+1] int32
    wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k,  # gate read as [E, I, H]: data, scales [E, I, H/32] (MX_G)
    wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k,  # up read as [E, I, H]
    gu_ptr, stride_gm, stride_gn,  # gu [M, 2I] out: g in [0, I), u in [I, 2I) (tail rows zeroed)
    h_ptr, stride_hm, stride_hi,  # h [M, I] out (WRITE_H)
    g_desc, u_desc, w_rows,  # TMA: host descriptors of gate's and up's 2-D views, their R (`tma_weights`)
    a_desc,  # SORTED_X: host descriptor of x (the sorted rows)
    M, H, I, E, TOPK,  # rows (routes), hidden, intermediate, experts, routes per token
    limit, above, below,  # swiglu clamp (HAS_LIMIT); the stored dtype's neighbours of it (KEEP_CLIP)
    bias_ptr, b_e, b_c, b_i,  # FC1 bias read as [E, 2, I] (HAS_BIAS): gate row, up row
    alpha, beta,  # the gated activation g * sigmoid(alpha g) * (u + beta) (`types.Activation`)
    HAS_BIAS: tl.constexpr,
    SINGLE: tl.constexpr, MX_G: tl.constexpr, MX_U: tl.constexpr, WRITE_H: tl.constexpr,
    HAS_LIMIT: tl.constexpr, KEEP_CLIP: tl.constexpr, DOT_PREC: tl.constexpr, W_TABLE: tl.constexpr,
    MX_LOOP: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr, INTERLEAVED: tl.constexpr,
    SORTED_X: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Inductor passes Python floats as fp64 (the epilogue would compute in fp64): float32 scalars
    limit = tl.cast(limit, tl.float32)
    above = tl.cast(above, tl.float32)
    below = tl.cast(below, tl.float32)
    alpha = tl.cast(alpha, tl.float32)
    beta = tl.cast(beta, tl.float32)
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, I, SINGLE, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, SINGLE, True, BLOCK_M, GROUPS_POW2)
    if row_start >= row_end:
        return
    if group >= E:  # the `-1` routes' slots: their g, u and h rows are zero
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        omask = (rows < row_end)[:, None] & (cols < I)[None, :]
        rows64 = rows[:, None].to(tl.int64)
        g_ptrs = gu_ptr + rows64 * stride_gm + cols[None, :] * stride_gn
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=gu_ptr.dtype.element_ty)
        tl.store(g_ptrs, zero, mask=omask)
        tl.store(g_ptrs + I * stride_gn, zero, mask=omask)
        if WRITE_H:
            tl.store(h_ptr + rows64 * stride_hm + cols[None, :] * stride_hi, zero.to(h_ptr.dtype.element_ty),
                     mask=omask)
        return
    _gate_up_tile(x_ptr, stride_xt, stride_xh, xr_ptr, routes_ptr, wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k,
                  wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k, gu_ptr, stride_gm, stride_gn, h_ptr, stride_hm,
                  stride_hi, g_desc, u_desc, w_rows, a_desc, H, I, E, TOPK, limit, above, below, group, row_start,
                  row_end, pid_n, bias_ptr, b_e, b_c, b_i, alpha, beta, HAS_BIAS, SINGLE, MX_G, MX_U, WRITE_H,
                  HAS_LIMIT, KEEP_CLIP, DOT_PREC, W_TABLE, MX_LOOP, TMA, W_KMAJOR, INTERLEAVED, SORTED_X,
                  BLOCK_M, BLOCK_N, BLOCK_K)


# one jitted body (its name is the one Inductor's code and profiles show), tuned as two families: the MXFP8 fp16
# K loops' row tiles are not the dequantizing loop's
# MX: MXFP8 weights dequantized in the K loop (no TMA then), tuned apart from bf16 weights' loads
_FIELDS = ("dtype", "H", "I", "E", "TMA", "MX")
_OUTPUTS = ("gu_ptr", "h_ptr")
GATE_UP = register(Family("gate_up", _gate_up_kernel, _GATE_UP_CONFIGS, fields=_FIELDS, sizes=("H", "I", "E"),
                          outputs=_OUTPUTS, interpret=cfg(16, 16, 32, 1, 1), field_defaults={"MX": False},
                          pre_hook=tma_pre_hook(("a_desc",), ("g_desc", "u_desc"))))
GATE_UP_MX = register(Family("gate_up_mx", _gate_up_kernel, _MX_F16_CONFIGS, fields=("dtype", "H", "I", "E", "MX_LOOP"),
                             sizes=("H", "I", "E"), outputs=_OUTPUTS, interpret=cfg(16, 16, 32, 1, 1),
                             small=MX_F16_SMALL_GATE_UP))
# how the gate/up stage runs where both ways compute the same (`_grouped_mm_weight`): the fused kernel, or
# torch._grouped_mm on the sorted rows and an activation pass (faster at some large-expert shapes; the
# tables say where, searched like the tiles)
GATE_UP_STAGE = register(stage("gate_up_stage", fields=("dtype", "H", "I", "E"), sizes=("H", "I", "E"),
                               ways=("fused", "grouped_mm")))


def gate_up(x_TH, gate, up, rows, gu_dtype, routes_N, offsets_E1, topk, limit, *, h_out=None, single=False,
            act=None, bias_E2I=None):
    """-> gu [rows, 2I] (gu_dtype) = [x[r] @ gate[e]^T + b_g[e] | x[r] @ up[e]^T + b_u[e]] per sorted row r
    (before the clamp), and h_out[rows, I] = the activation `act` (`types.Activation`; None: the SwiGLU) of those
    (rounded) values when given. gate, up: `types.Operand`s read as [E, I, H] (SINGLE: all T rows, one expert
    given as [1, I, H] views); bias_E2I: optional [E, 2, I] (any strides). gu is allocated by the way the stage
    runs (`GATE_UP_STAGE`): the fused kernel's buffer, or `torch._grouped_mm`'s own output."""
    E, I, H = gate.data.shape
    args = (x_TH, gate, up, rows, gu_dtype, routes_N, offsets_E1, topk, limit, h_out, single, act, bias_E2I)
    if not _same_by_grouped_mm(x_TH, rows, gu_dtype, h_out, single, limit, bias_E2I):
        return _gate_up_fused(*args)

    def by_grouped_mm():
        w = _grouped_mm_weight(x_TH, gate, up)
        return None if w is None else lambda: _gate_up_grouped_mm(x_TH, w, routes_N[:rows] // topk, offsets_E1,
                                                                  h_out, act)

    return common.run_stage(GATE_UP_STAGE, (dtype_name(x_TH.dtype), H, I, E), rows, x_TH.device,
                            {"fused": lambda: lambda: _gate_up_fused(*args), "grouped_mm": by_grouped_mm})


def _same_by_grouped_mm(x_TH, rows, gu_dtype, h_out, single, limit, bias_E2I) -> bool:
    """Whether the call is one `torch._grouped_mm` and `_act_rows_kernel` compute as the fused kernel does (up to
    the GEMM's summation order), the weights aside (`_grouped_mm_weight`): an eager call at a known row count
    (traced launches are the fused kernel's: a graph holds no stage search, and a symbolic count no bucket),
    bf16 activations, saved g, u and h in bf16 (a contiguous h), no clamp (the fused kernel rounds g and u
    without crossing it, from float32 values a bf16 GEMM output no longer has), no FC1 biases (added before the
    rounding), routed (not the shared expert's single group)."""
    if single or limit is not None or bias_E2I is not None or h_out is None or isinstance(rows, torch.SymInt):
        return False
    if not (x_TH.dtype == gu_dtype == h_out.dtype == torch.bfloat16) or h_out.stride(1) != 1 or rows == 0:
        return False
    return not common.traced((x_TH, h_out))


def _grouped_mm_weight(x_TH, gate, up):
    """The [E, 2I, H] gate_up weight `torch._grouped_mm` can run the stage on, else None: bf16 weights as the
    halves of one tensor (either dim of each expert's matrix contiguous), 16-byte aligned (its address and every
    stride but the unit one), on sm_90/sm_100 (where torch runs CUTLASS's grouped GEMM, with no host
    synchronisation) or the CPU."""
    if gate.data.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return None
    w = concatenated(gate, up)  # (row-major [E, 2I, H] as HF and Megatron store it, or its transpose)
    unit = w is not None and (2 if w.stride(2) == 1 else 1 if w.stride(1) == 1 else None)
    if not unit or any(v % 8 for v in (*w.shape[1:], *(st for d, st in enumerate(w.stride()) if d != unit))):
        return None
    if w.data_ptr() % 16 or x_TH.data_ptr() % 16:
        return None
    dev = x_TH.device
    on_cutlass = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] in (9, 10)
    return w if on_cutlass or dev.type == "cpu" else None


def _gate_up_grouped_mm(x_TH, w_E2IH, tokens_M, offsets_E1, h_out, act):
    """The stage as `torch._grouped_mm` over the sorted rows (cuBLAS/CUTLASS's grouped GEMM, deterministic),
    then `_act_rows_kernel`: h from the rounded g, u as the fused epilogue computes it, the `-1` routes' rows
    zeroed. -> gu [M, 2I]."""
    E = w_E2IH.shape[0]
    xs = x_TH.index_select(0, tokens_M)
    gu = torch._grouped_mm(xs, w_E2IH.transpose(1, 2), offs=offsets_E1[1:E + 1])
    M, I = h_out.shape
    grid = (common.cdiv(M, _ACT_ROWS), common.cdiv(I, _ACT_COLS))
    common.launch(_act_rows_kernel, grid, gu, gu.stride(0), h_out, h_out.stride(0), offsets_E1, M, I, E,
                  1.0 if act is None else act.alpha, 0.0 if act is None else act.beta,
                  DOT_PREC=common.dot_precision(x_TH.dtype), BLOCK_M=_ACT_ROWS, BLOCK_N=_ACT_COLS, num_warps=4)
    return gu


_ACT_ROWS, _ACT_COLS = 32, 128


@triton.jit(do_not_specialize=["M"])
def _act_rows_kernel(gu_ptr, stride_gm, h_ptr, stride_hm, offsets_ptr, M, I, E, alpha, beta,
                     DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """h [M, I] = the gated activation of gu [M, 2I] = [g | u] (rounded already) on the rows of the experts'
    routes (the first offsets[E]); the rows after them (the `-1` routes', which the grouped GEMM leaves
    unwritten) zeroed in gu and h, as the fused kernel leaves them."""
    alpha = tl.cast(alpha, tl.float32)
    beta = tl.cast(beta, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows < M)[:, None] & (cols < I)[None, :]
    routed = (rows < tl.load(offsets_ptr + E))[:, None] & inside
    g_ptrs = gu_ptr + rows[:, None].to(tl.int64) * stride_gm + cols[None, :]
    g = tl.load(g_ptrs, mask=routed, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + I, mask=routed, other=0.0).to(tl.float32)
    h = swiglu(g, u, 0.0, alpha, beta, False)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :], to_out(h, h_ptr, DOT_PREC), mask=inside)
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=gu_ptr.dtype.element_ty)
    tl.store(g_ptrs, zero, mask=inside & ~routed)
    tl.store(g_ptrs + I, zero, mask=inside & ~routed)


def _gate_up_fused(x_TH, gate, up, M, gu_dtype, routes_N, offsets_E1, topk, limit, h_out, single, act, bias_E2I):
    E, I, H = gate.data.shape
    gu_out = torch.empty(M, 2 * I, dtype=gu_dtype, device=x_TH.device)
    if M == 0 or I == 0:
        return gu_out

    def tiles(meta):
        return row_tiles_worst(M, E, meta["BLOCK_M"], single) * common.cdiv(I, meta["BLOCK_N"])

    mx_loop = use_mx_loop(x_TH.dtype, M, E, gate, up)
    mx_weights = bool(gate.quantized or up.quantized)
    both = None if mx_loop else interleaved(gate, up, 1)  # [E, 2I, H] (GPT-OSS's layout)
    if both is not None:
        gate = up = Operand(both, None)
    tma = None if mx_loop or not tma_eligible(x_TH, M, E) else tma_weights((gate, up))
    a_desc = None
    if tma is not None and not single:
        # the token rows gathered once into sorted order, every whole K step's x tile then one TMA load (the
        # descriptor first: no gather where TMA cannot read the rows)
        xs = x_TH.new_empty(M, H)
        a_desc = row_desc(xs)
        if a_desc is not None:
            x_TH = torch.index_select(x_TH, 0, routes_N[:M] // topk, out=xs)
    h = h_out if h_out is not None else x_TH  # (no h: a read-only input in its place, `common.launch`)
    dtype = dtype_name(x_TH.dtype)
    x_TH, xr, mx_loop = mx_rows(x_TH, mx_loop, gate, up)
    lim, above, below, keep_clip = common.clamp_args(limit, gu_out.dtype)
    common.launch(
        GATE_UP_MX if mx_loop else GATE_UP, lambda meta: (tiles(meta),),
        x_TH, x_TH.stride(0), x_TH.stride(1), xr, routes_N, offsets_E1,
        *w_args(gate), *w_args(up),
        gu_out, gu_out.stride(0), gu_out.stride(1), h, h.stride(0), h.stride(1),
        *((None, None, 1) if tma is None else (*tma[0], tma[1])), a_desc,
        M, H, I, E, topk, lim, above, below,
        # (without a bias: a read-only input in its place, never read; an output there would alias a written one)
        *((x_TH, 0, 0, 0) if bias_E2I is None else (bias_E2I, *bias_E2I.stride())),
        1.0 if act is None else act.alpha, 0.0 if act is None else act.beta, HAS_BIAS=bias_E2I is not None,
        SINGLE=single, MX_G=gate.quantized, MX_U=up.quantized, WRITE_H=h_out is not None,
        HAS_LIMIT=limit is not None, KEEP_CLIP=keep_clip, DOT_PREC=common.dot_precision(x_TH.dtype),
        MX_LOOP=int(mx_loop), TMA=tma is not None, W_KMAJOR=tma is not None and tma[2],
        INTERLEAVED=both is not None, SORTED_X=a_desc is not None,
        GROUPS_POW2=common.next_pow2(E + 1), GROUP_M=GROUP_M, **w_meta(gate, up), rows=M,
        problem=(dtype, H, I, E, int(mx_loop)) if mx_loop else (dtype, H, I, E, tma is not None, mx_weights),
    )
    return gu_out
