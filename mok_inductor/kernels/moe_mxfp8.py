"""MXFP8 routed-weight kernels: the forward and backward GEMMs of `moe_fwd` / `moe_bwd` with weights read
as float8_e4m3fn data + uint8 E8M0 scales (one per 32 elements along the reduction dim, shared/SPEC.md
section 6), and the orchestration of a whole MXFP8 forward / backward.

    x_TH[tok] --_gate_up_mx_kernel (row-wise gate/up, gather, SwiGLU)--> h_NI
    h_NI --_grouped_rows_mx_kernel (row-wise down)--> y_NH --moe_fwd.combine--> y_TH
    backward: _bwd_act_mx_kernel (column-wise down: dy @ down -> d router weights and dh; row-wise gate/up
    recompute) -> dgu_N2I; _grouped_rows_mx_kernel (column-wise gate/up) -> dx per route -> combine;
    weight gradients: moe_bwd.wgrad (activations and dy only: no weights, identical to bf16)

How the weights enter the tensor cores: each K step loads the e4m3 tile and its scales and dequantizes
it in registers (e4m3 * 2**(s - 127) is exact in bf16/fp16/fp32), then runs the activation dtype's
`tl.dot` (bf16 wgmma on Hopper). The result equals the bf16 computation on the dequantized weights up to
the float32 accumulation order, and the weights cost half the bytes of bf16 (what decode is bound by).
BLOCK_K is a multiple of 32, so a K step holds whole scale blocks. `tl.dot_scaled` is not used: on
Hopper Triton decomposes it into the same bf16 upcast, and the interpreter rejects it.

A weight operand is read as [E, n, k] (k the reduction dim) with its own strides: row-wise data for the
forward and the recompute, column-wise (transposed) data for the data gradient. A plain float operand
(a bf16 down_proj next to an MXFP8 gate_up_proj) runs the same kernels with MX=False.

The shared expert stays bf16 (as in MoK) and runs the kernels of moe_fwd / moe_bwd. Split per-expert
MXFP8 weights are stacked once per call here (a copy of the quantized bytes); the reference path reads
them in place.

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per token
(TOPK), N = T*K routes (M rows in a grouped kernel), P I-tiles of the partial router-weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from ..mxfp8 import BLOCK, Operand, RoutedOperands
from . import _launch
from ._launch import cfg, mma, pick_configs, to_out
from .moe_bwd import shared_backward, wgrad
from .moe_fwd import GROUP_M, _tile_ids, _tile_rows, combine, flat, row_tiles_worst, shared_forward

assert BLOCK == 32

# ---------------------------------------------------------------------------------------------
# A [BLOCK_K, BLOCK_N] weight tile W[e][n, k] (k down the tile), dequantized when MX


@triton.jit
def _w_tile(w_ptr, s_ptr, e64, kk, cols, kmask, cmask, s_e, s_n, s_k, ss_e, ss_n, ss_k, like_ptr,
            MX: tl.constexpr, DOT_PREC: tl.constexpr):
    m = kmask[:, None] & cmask[None, :]
    w = tl.load(w_ptr + e64 * s_e + kk[:, None] * s_k + cols[None, :] * s_n, mask=m, other=0.0)
    if MX:
        sc = tl.load(s_ptr + e64 * ss_e + (kk // 32)[:, None] * ss_k + cols[None, :] * ss_n, mask=m, other=0)
        # 2**(sc - 127) built from its float32 bits (exact; sc = 0, an all-zero block, gives 0)
        factor = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w = w.to(tl.float32) * factor
        if DOT_PREC != "interp":
            w = w.to(like_ptr.dtype.element_ty)
    return w


# ---------------------------------------------------------------------------------------------
# Gate/up GEMM with the gather of x rows and the clamped SwiGLU epilogue (MXFP8 weights)


def _gate_up_configs():
    return pick_configs(
        [cfg(128, 128, 64, 8, 3), cfg(128, 64, 64, 4, 4), cfg(64, 128, 64, 4, 4), cfg(64, 64, 128, 4, 3),
         cfg(64, 64, 64, 4, 4)],
        cfg(16, 16, 32, 1, 1),
    )


@triton.autotune(configs=_gate_up_configs(), key=["M", "H", "I", "E", "TOPK"])
@triton.jit
def _gate_up_mx_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H]
    routes_ptr, offsets_ptr,  # sorted_routes [M] int32, expert_offsets [E+1] int32
    wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k,  # gate [E, I, H] data, scales [E, I, H/32]
    wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k,  # up [E, I, H] data, scales
    h_ptr, stride_hm, stride_hi,  # h [M, I] out, sorted slot order (tail rows zeroed)
    M, H, I, E, TOPK, limit,
    MX_G: tl.constexpr, MX_U: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_PREC: tl.constexpr,
    GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, I, False, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, False, True, BLOCK_M, GROUPS_POW2)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :] * stride_hi
    omask = rmask[:, None] & cmask[None, :]
    if group >= E:  # the `-1` routes' slots: their h rows are zero
        tl.store(h_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=h_ptr.dtype.element_ty), mask=omask)
        return
    tok = tl.load(routes_ptr + rows, mask=rmask, other=0) // TOPK
    ks = tl.arange(0, BLOCK_K)
    e64 = group.to(tl.int64)
    a_row = x_ptr + tok[:, None].to(tl.int64) * stride_xt
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        kmask = kk < H
        a = tl.load(a_row + kk[None, :] * stride_xh, mask=rmask[:, None] & kmask[None, :], other=0.0)
        bg = _w_tile(wg_ptr, gs_ptr, e64, kk, cols, kmask, cmask, g_e, g_n, g_k, gs_e, gs_n, gs_k, x_ptr,
                     MX_G, DOT_PREC)
        bu = _w_tile(wu_ptr, us_ptr, e64, kk, cols, kmask, cmask, u_e, u_n, u_k, us_e, us_n, us_k, x_ptr,
                     MX_U, DOT_PREC)
        acc_g = mma(a, bg, acc_g, DOT_PREC)
        acc_u = mma(a, bu, acc_u, DOT_PREC)
    if HAS_LIMIT:  # where() rather than min/max: a NaN is not clipped, it propagates
        acc_g = tl.where(acc_g > limit, limit, acc_g)
        acc_u = tl.where(acc_u > limit, limit, tl.where(acc_u < -limit, -limit, acc_u))
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptrs, to_out(h, h_ptr, DOT_PREC), mask=omask)


def _w_args(op: Operand):
    """Kernel arguments of an operand read as [E, n, k]: data, its strides, scales, their strides."""
    d = op.data
    s = op.scale if op.scale is not None else d
    return (d, d.stride(0), d.stride(1), d.stride(2), s, s.stride(0), s.stride(1), s.stride(2))


def gate_up_mx(x_TH, gate: Operand, up: Operand, h_out, routes_N, offsets_E1, topk, limit):
    """h_out[M, I] = swiglu(x[rows] @ gate[e]^T, x[rows] @ up[e]^T) per sorted row, gate/up read as
    [E, I, H] operands (MXFP8 or plain)."""
    M, I = h_out.shape
    if M == 0 or I == 0:
        return h_out
    E, _, H = gate.data.shape
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], False) * triton.cdiv(I, meta["BLOCK_N"]),)
    _launch.launch(
        _gate_up_mx_kernel, grid,
        x_TH, x_TH.stride(0), x_TH.stride(1), routes_N, offsets_E1,
        *_w_args(gate), *_w_args(up),
        h_out, h_out.stride(0), h_out.stride(1),
        M, H, I, E, topk, 0.0 if limit is None else float(limit),
        MX_G=gate.quantized, MX_U=up.quantized, HAS_LIMIT=limit is not None,
        DOT_PREC=_launch.dot_precision(x_TH.dtype), GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=GROUP_M,
    )
    return h_out


# ---------------------------------------------------------------------------------------------
# Grouped row GEMM: out[dest(r), n] = sum_k A[r, k] W1[e][n, k] (+ sum_k A[r, KD + k] W2[e][n, k])


def _grouped_rows_configs():
    return pick_configs(
        [cfg(128, 128, 64, 8, 3), cfg(128, 256, 64, 8, 3), cfg(64, 128, 64, 4, 4), cfg(128, 128, 64, 4, 4),
         cfg(64, 64, 128, 4, 3)],
        cfg(16, 16, 32, 1, 1),
    )


@triton.autotune(configs=_grouped_rows_configs(), key=["M", "NCOL", "KD", "E"])
@triton.jit
def _grouped_rows_mx_kernel(
    a_ptr, stride_am, stride_ak,  # A [M, KD or 2*KD], sorted rows
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    w1_ptr, s1_e, s1_n, s1_k, q1_ptr, q1_e, q1_n, q1_k,  # W1[e] (n, k) data and scales, [E, NCOL, KD]
    w2_ptr, s2_e, s2_n, s2_k, q2_ptr, q2_e, q2_n, q2_k,  # W2[e], multiplies A's columns [KD, 2 KD) (TWO)
    out_ptr, stride_om, stride_on,  # out [rows, NCOL]; row = route (SCATTER) or the sorted row
    M, NCOL, KD, E,
    SCATTER: tl.constexpr, TWO: tl.constexpr, MX1: tl.constexpr, MX2: tl.constexpr, DOT_PREC: tl.constexpr,
    GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, NCOL, False, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, False, False, BLOCK_M, GROUPS_POW2)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < NCOL
    ks = tl.arange(0, BLOCK_K)
    e64 = group.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_row = a_ptr + rows[:, None].to(tl.int64) * stride_am
    for k0 in range(0, KD, BLOCK_K):
        kk = k0 + ks
        kmask = kk < KD
        a = tl.load(a_row + kk[None, :] * stride_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = _w_tile(w1_ptr, q1_ptr, e64, kk, cols, kmask, cmask, s1_e, s1_n, s1_k, q1_e, q1_n, q1_k, a_ptr,
                    MX1, DOT_PREC)
        acc = mma(a, w, acc, DOT_PREC)
    if TWO:
        for k0 in range(0, KD, BLOCK_K):
            kk = k0 + ks
            kmask = kk < KD
            a = tl.load(a_row + (KD + kk[None, :]) * stride_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = _w_tile(w2_ptr, q2_ptr, e64, kk, cols, kmask, cmask, s2_e, s2_n, s2_k, q2_e, q2_n, q2_k,
                        a_ptr, MX2, DOT_PREC)
            acc = mma(a, w, acc, DOT_PREC)
    if SCATTER:
        dest = tl.load(routes_ptr + rows, mask=rmask, other=0)
    else:
        dest = rows
    o_ptrs = out_ptr + dest[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(o_ptrs, to_out(acc, out_ptr, DOT_PREC), mask=rmask[:, None] & cmask[None, :])


def grouped_rows_mx(a_MK, w1: Operand, out, routes_N, offsets_E1, *, w2: Operand = None, scatter=True):
    """out[dest(r)] = A[r, :KD] @ W1[e]^T (+ A[r, KD:] @ W2[e]^T), W read as [E, NCOL, KD] operands."""
    M = a_MK.shape[0]
    NCOL = out.shape[1]
    KD = a_MK.shape[1] // (2 if w2 is not None else 1)
    if M == 0 or NCOL == 0:
        return out
    E = w1.data.shape[0]
    two = w2 is not None
    w2 = w2 if two else w1
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], False) * triton.cdiv(NCOL, meta["BLOCK_N"]),)
    _launch.launch(
        _grouped_rows_mx_kernel, grid,
        a_MK, a_MK.stride(0), a_MK.stride(1), routes_N, offsets_E1,
        *_w_args(w1), *_w_args(w2),
        out, out.stride(0), out.stride(1),
        M, NCOL, KD, E,
        SCATTER=scatter, TWO=two, MX1=w1.quantized, MX2=w2.quantized, DOT_PREC=_launch.dot_precision(a_MK.dtype),
        GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=GROUP_M,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Fused down-dgrad (column-wise down) + gate/up recompute (row-wise) + SwiGLU backward


_BWD_ACT_MIN_BLOCK_N = 16 if _launch.INTERPRET else 64


def _bwd_act_configs():
    return pick_configs(
        [cfg(128, 64, 64, 8, 3), cfg(64, 64, 64, 4, 4), cfg(64, 128, 64, 8, 3), cfg(128, 64, 32, 8, 4)],
        cfg(16, 16, 32, 1, 1),
    )


@triton.autotune(configs=_bwd_act_configs(), key=["M", "H", "I", "E", "TOPK"])
@triton.jit
def _bwd_act_mx_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H]
    dy_ptr, stride_dt, stride_dh,  # dy [T, H]
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    wd_ptr, d_e, d_n, d_k, ds_ptr, ds_e, ds_n, ds_k,  # down^T read as [E, I, H] (column-wise down)
    wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k,  # gate [E, I, H] (row-wise)
    wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k,  # up [E, I, H] (row-wise)
    h_ptr, stride_hm, stride_hi,  # h [M, I] saved (sorted rows)
    scale_ptr,  # float32 router weight per route [T*K]
    dgu_ptr, stride_gm, stride_gn,  # dgu [M, 2I] out: dg in [0, I), du in [I, 2I)
    dscale_ptr, stride_sp,  # float32 [P, T*K] out: partial <dy @ down, h> of I-tile p at the route
    hs_ptr,  # [M, I] out: rw * h, rounded: the down weight-gradient's operand
    M, H, I, E, TOPK, limit,
    MX_D: tl.constexpr, MX_G: tl.constexpr, MX_U: tl.constexpr, HAS_LIMIT: tl.constexpr,
    DOT_PREC: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, I, False, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, False, False, BLOCK_M, GROUPS_POW2)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    route = tl.load(routes_ptr + rows, mask=rmask, other=0)
    tok = route // TOPK
    ks = tl.arange(0, BLOCK_K)
    e64 = group.to(tl.int64)
    tok64 = tok[:, None].to(tl.int64)
    acc_q = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        kmask = kk < H
        amask = rmask[:, None] & kmask[None, :]
        xa = tl.load(x_ptr + tok64 * stride_xt + kk[None, :] * stride_xh, mask=amask, other=0.0)
        dya = tl.load(dy_ptr + tok64 * stride_dt + kk[None, :] * stride_dh, mask=amask, other=0.0).to(xa.dtype)
        wd = _w_tile(wd_ptr, ds_ptr, e64, kk, cols, kmask, cmask, d_e, d_n, d_k, ds_e, ds_n, ds_k, x_ptr,
                     MX_D, DOT_PREC)
        acc_q = mma(dya, wd, acc_q, DOT_PREC)
        wg = _w_tile(wg_ptr, gs_ptr, e64, kk, cols, kmask, cmask, g_e, g_n, g_k, gs_e, gs_n, gs_k, x_ptr,
                     MX_G, DOT_PREC)
        acc_g = mma(xa, wg, acc_g, DOT_PREC)
        wu = _w_tile(wu_ptr, us_ptr, e64, kk, cols, kmask, cmask, u_e, u_n, u_k, us_e, us_n, us_k, x_ptr,
                     MX_U, DOT_PREC)
        acc_u = mma(xa, wu, acc_u, DOT_PREC)
    omask = rmask[:, None] & cmask[None, :]
    h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :] * stride_hi,
                mask=omask, other=0.0).to(tl.float32)
    # d router weight = <dy_t @ down[e], h>: this tile's share of the sum over I
    tl.store(dscale_ptr + pid_n * stride_sp + route, tl.sum(acc_q * h, axis=1), mask=rmask)
    scale = tl.load(scale_ptr + route, mask=rmask, other=0.0)[:, None]
    dh = acc_q * scale
    tl.store(hs_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], to_out(h * scale, hs_ptr, DOT_PREC),
             mask=omask)
    if HAS_LIMIT:
        gc = tl.where(acc_g > limit, limit, acc_g)
        uc = tl.where(acc_u > limit, limit, tl.where(acc_u < -limit, -limit, acc_u))
    else:
        gc = acc_g
        uc = acc_u
    sig = tl.sigmoid(gc)
    dg = dh * uc * (sig * (1.0 + gc * (1.0 - sig)))
    du = dh * gc * sig
    if HAS_LIMIT:  # the clamp passes no gradient where it clipped (NaN is not clipped)
        dg = tl.where(acc_g > limit, 0.0, dg)
        du = tl.where((acc_u > limit) | (acc_u < -limit), 0.0, du)
    o_ptrs = dgu_ptr + rows[:, None].to(tl.int64) * stride_gm + cols[None, :] * stride_gn
    tl.store(o_ptrs, to_out(dg, dgu_ptr, DOT_PREC), mask=omask)
    tl.store(o_ptrs + I * stride_gn, to_out(du, dgu_ptr, DOT_PREC), mask=omask)


def bwd_act_mx(x_TH, dy_TH, gate: Operand, up: Operand, down_t: Operand, h_MI, rw_N, routes_N, offsets_E1,
               topk, limit):
    """-> (dgu [M, 2I] x.dtype, d router weights [N] float32 = <dy @ down[e], h> per route,
    hs [M, I] = rw * h in x.dtype). down_t: the down weight's transpose read as [E, I, H]."""
    M, I = h_MI.shape
    E, _, H = gate.data.shape
    n_routes = routes_N.numel()
    P = triton.cdiv(I, _BWD_ACT_MIN_BLOCK_N)
    dgu = torch.empty(M, 2 * I, dtype=x_TH.dtype, device=x_TH.device)
    dscale_P = torch.zeros(P, n_routes, dtype=torch.float32, device=x_TH.device)
    hs = torch.empty(M, I, dtype=x_TH.dtype, device=x_TH.device)
    if M == 0 or I == 0:
        return dgu, dscale_P.sum(0), hs
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], False) * triton.cdiv(I, meta["BLOCK_N"]),)
    _launch.launch(
        _bwd_act_mx_kernel, grid,
        x_TH, x_TH.stride(0), x_TH.stride(1), dy_TH, dy_TH.stride(0), dy_TH.stride(1), routes_N, offsets_E1,
        *_w_args(down_t), *_w_args(gate), *_w_args(up),
        h_MI, h_MI.stride(0), h_MI.stride(1), rw_N,
        dgu, dgu.stride(0), dgu.stride(1), dscale_P, dscale_P.stride(0), hs,
        M, H, I, E, topk, 0.0 if limit is None else float(limit),
        MX_D=down_t.quantized, MX_G=gate.quantized, MX_U=up.quantized, HAS_LIMIT=limit is not None,
        DOT_PREC=_launch.dot_precision(x_TH.dtype), GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=GROUP_M,
    )
    return dgu, dscale_P.sum(0), hs  # fixed-order reduction over the I-tiles


# ---------------------------------------------------------------------------------------------
# Orchestration: the MXFP8 counterparts of mok_inductor.kernels.moe_forward / moe_backward


def _stacked(ops: RoutedOperands) -> RoutedOperands:
    return RoutedOperands(*(None if o is None else o.stacked() for o in ops))


def moe_forward(x_TH, router_weights_TK, top_experts_TK, schedule, ops: RoutedOperands, s_gate=None, s_up=None,
                s_down=None, s_out_gate_1H=None, swiglu_limit=None) -> reference.ForwardResult:
    """reference.moe_forward with the routed weights given as `ops` (mok_inductor.mxfp8.routed_operands)."""
    ops = _stacked(ops)
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    N = T * K
    I = ops.gate.data.shape[1]
    dev, dtype = x_TH.device, x_TH.dtype
    sorted_N, offsets_E1 = schedule.sorted_routes_N, schedule.expert_offsets_E1

    h_NI = torch.empty(N, I, dtype=dtype, device=dev)
    gate_up_mx(x_TH, ops.gate, ops.up, h_NI, sorted_N, offsets_E1, K, swiglu_limit)
    y_NH = torch.empty(N, H, dtype=dtype, device=dev)  # route order; rows of `-1` routes unwritten
    grouped_rows_mx(h_NI, ops.down, y_NH, sorted_N, offsets_E1, scatter=True)

    h_shared, s_TH, logit_T = shared_forward(x_TH, s_gate, s_up, s_down, s_out_gate_1H, sorted_N, offsets_E1,
                                             swiglu_limit)

    y_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine(y_NH, flat(top_experts_TK), y_TH, rw_N=flat(router_weights_TK.float()), s_TH=s_TH, logit_T=logit_T)
    return reference.ForwardResult(y_TH, h_NI, h_shared)


def _wgrad_into(dst, a, b, sorted_N, offsets_E1, K, *, a_gather, b_gather, accumulate):
    """wgrad into a 3-D destination, or into E per-expert tensors through one float32 buffer."""
    if dst is None:
        return
    if isinstance(dst, torch.Tensor):
        wgrad(a, b, dst, sorted_N, offsets_E1, K, a_gather=a_gather, b_gather=b_gather, accumulate=accumulate)
        return
    tmp = torch.empty(len(dst), *dst[0].shape, dtype=torch.float32, device=b.device)
    wgrad(a, b, tmp, sorted_N, offsets_E1, K, a_gather=a_gather, b_gather=b_gather, accumulate=False)
    for e, t in enumerate(dst):
        (t.add_ if accumulate else t.copy_)(tmp[e])


def moe_backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule, ops: RoutedOperands, h_NI,
                 s_gate=None, s_up=None, s_down=None, s_out_gate_1H=None, h_shared_TIs=None, swiglu_limit=None,
                 *, grads: reference.GradBuffers, accumulate=False) -> reference.BackwardResult:
    """reference.moe_backward with the routed weights given as `ops` (column-wise operands required).
    `grads`: destinations; a None routed entry skips that weight gradient (no master weight)."""
    ops = _stacked(ops)
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    I = ops.gate.data.shape[1]
    dev, dtype = x_TH.device, x_TH.dtype
    if dy_TH.dtype != dtype:
        dy_TH = dy_TH.to(dtype)
    sorted_N, offsets_E1 = schedule.sorted_routes_N, schedule.expert_offsets_E1
    rw_N = flat(router_weights_TK.float())
    te_N = flat(top_experts_TK)

    dgu_N2I, drw_N, hs_NI = bwd_act_mx(x_TH, dy_TH, ops.gate, ops.up, ops.down_t, h_NI, rw_N, sorted_N,
                                       offsets_E1, K, swiglu_limit)
    _wgrad_into(grads.d_down, dy_TH, hs_NI, sorted_N, offsets_E1, K, a_gather=True, b_gather=False,
                accumulate=accumulate)
    _wgrad_into(grads.d_gate, dgu_N2I[:, :I], x_TH, sorted_N, offsets_E1, K, a_gather=False, b_gather=True,
                accumulate=accumulate)
    _wgrad_into(grads.d_up, dgu_N2I[:, I:], x_TH, sorted_N, offsets_E1, K, a_gather=False, b_gather=True,
                accumulate=accumulate)
    dx_NH = torch.empty(T * K, H, dtype=dtype, device=dev)  # route order
    grouped_rows_mx(dgu_N2I, ops.gate_t, dx_NH, sorted_N, offsets_E1, w2=ops.up_t, scatter=True)

    # the shared expert (bf16) and its output gate: the kernels of moe_bwd, as in kernels.moe_backward
    dx_s, bias, d_logit = shared_backward(x_TH, dy_TH, s_gate, s_up, s_down, s_out_gate_1H, h_shared_TIs,
                                          swiglu_limit, sorted_N, offsets_E1, grads, accumulate)

    dx_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine(dx_NH, te_N, dx_TH, s_TH=dx_s, bias_H=bias, bscale_T=d_logit)
    return reference.BackwardResult(dx_TH, drw_N.view(T, K), grads)
