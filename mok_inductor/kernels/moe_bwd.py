"""Backward kernels: the fused down-dgrad + gate/up recompute + SwiGLU backward, and the grouped
weight-gradient GEMM with the main-grad accumulating epilogue.

    dy_TH[tok], x_TH[tok], h_NI --_bwd_act_kernel--> dgu_N2I = [dg | du] (x.dtype, sorted rows),
        dscale_PN (partial <dy_t @ down[e], h> per I-tile, at the route: d router_weights without y_tk),
        hs_NI = rw * h (the down weight gradient's operand, so that its GEMM needs no scaling pass)
    dgu_N2I --grouped_rows (gate[e], up[e])--> dx per route --combine over k--> dx_TH
    wgrad: d_down[e] = dy[tok]^T @ (rw * h), d_gate[e] = dg^T @ x[tok], d_up[e] = du^T @ x[tok]:
        a fixed-order loop over expert e's rows (deterministic, no atomics), written or ADDED into
        the destination (float32 or bfloat16 main grads).

The shared expert runs the same kernels with SINGLE=True (one group of T rows, no gather) and the
sigmoid output gate in the place of the router weight.

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token (TOPK), N = T*K
routes (M rows in a grouped kernel), P I-tiles of the partial router-weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._launch import cfg, mma, pick_configs, to_out
from .moe_fwd import GROUP_M, _tile_ids, _tile_rows, grouped_rows, nk_strides, row_tiles_worst, rowdot

# the smallest BLOCK_N of _bwd_act_configs(): the partial router-gradient buffer has one row per tile
_BWD_ACT_MIN_BLOCK_N = 16 if _launch.INTERPRET else 64


def _bwd_act_configs():
    return pick_configs(
        [cfg(128, 64, 64, 8, 3), cfg(64, 64, 64, 4, 4), cfg(64, 128, 64, 8, 3), cfg(128, 64, 32, 8, 4)],
        cfg(16, 16, 16, 1, 1),
    )


@triton.autotune(configs=_bwd_act_configs(), key=["M", "H", "I", "E", "TOPK"])
@triton.jit
def _bwd_act_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H]
    dy_ptr, stride_dt, stride_dh,  # dy [T, H] (any strides, stride 0 too)
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    wd_ptr, stride_de, stride_dh_, stride_di,  # down [E, H, I]
    wg_ptr, stride_ge, stride_gi, stride_gh,  # gate [E, I, H]
    wu_ptr, stride_ue, stride_ui, stride_uh,  # up [E, I, H]
    h_ptr, stride_hm, stride_hi,  # h [M, I] saved (sorted rows)
    scale_ptr,  # float32 router weight per route [T*K] (SINGLE: per token [T]) (HAS_SCALE)
    dgu_ptr, stride_gm, stride_gn,  # dgu [M, 2I] out: dg in [0, I), du in [I, 2I)
    dscale_ptr, stride_sp,  # float32 [P, T*K] out: partial <dy @ down, h> of I-tile p at the route
    hs_ptr,  # [M, I] out (HAS_SCALE): scale * h, rounded: the down weight-gradient's operand
    M, H, I, E, TOPK, limit,
    SINGLE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_PREC: tl.constexpr,
    GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
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
    tok64 = tok[:, None].to(tl.int64)
    x_ptrs = x_ptr + tok64 * stride_xt + ks[None, :] * stride_xh
    dy_ptrs = dy_ptr + tok64 * stride_dt + ks[None, :] * stride_dh
    d_ptrs = wd_ptr + e64 * stride_de + ks[:, None] * stride_dh_ + cols[None, :] * stride_di
    g_ptrs = wg_ptr + e64 * stride_ge + ks[:, None] * stride_gh + cols[None, :] * stride_gi
    u_ptrs = wu_ptr + e64 * stride_ue + ks[:, None] * stride_uh + cols[None, :] * stride_ui
    acc_q = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = (k0 + ks) < H
        amask = rmask[:, None] & kmask[None, :]
        bmask = kmask[:, None] & cmask[None, :]
        xa = tl.load(x_ptrs, mask=amask, other=0.0)
        dya = tl.load(dy_ptrs, mask=amask, other=0.0).to(xa.dtype)
        acc_q = mma(dya, tl.load(d_ptrs, mask=bmask, other=0.0), acc_q, DOT_PREC)
        acc_g = mma(xa, tl.load(g_ptrs, mask=bmask, other=0.0), acc_g, DOT_PREC)
        acc_u = mma(xa, tl.load(u_ptrs, mask=bmask, other=0.0), acc_u, DOT_PREC)
        x_ptrs += BLOCK_K * stride_xh
        dy_ptrs += BLOCK_K * stride_dh
        d_ptrs += BLOCK_K * stride_dh_
        g_ptrs += BLOCK_K * stride_gh
        u_ptrs += BLOCK_K * stride_uh
    omask = rmask[:, None] & cmask[None, :]
    h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :] * stride_hi,
                mask=omask, other=0.0).to(tl.float32)
    # d router weight = <dy_t @ down[e], h>: this tile's share of the sum over I
    tl.store(dscale_ptr + pid_n * stride_sp + route, tl.sum(acc_q * h, axis=1), mask=rmask)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + route, mask=rmask, other=0.0)[:, None]
        dh = acc_q * scale
        tl.store(hs_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], to_out(h * scale, hs_ptr, DOT_PREC),
                 mask=omask)
    else:
        dh = acc_q
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


def bwd_act(x_TH, dy_TH, w_gate, w_up, w_down, h_MI, scale, routes_N, offsets_E1, topk, limit, *,
            single=False):
    """-> (dgu [M, 2I] x.dtype, dscale [routes] float32 = <dy @ down[e], h> per route,
    hs [M, I] = scale * h in x.dtype (h itself without a scale))."""
    M, I = h_MI.shape
    E, _, H = w_gate.shape
    n_routes = M if single else routes_N.numel()
    P = triton.cdiv(I, _BWD_ACT_MIN_BLOCK_N)
    dgu = torch.empty(M, 2 * I, dtype=x_TH.dtype, device=x_TH.device)
    dscale_P = torch.zeros(P, n_routes, dtype=torch.float32, device=x_TH.device)
    hs = torch.empty(M, I, dtype=x_TH.dtype, device=x_TH.device) if scale is not None else h_MI
    if M == 0 or I == 0:
        return dgu, dscale_P.sum(0), hs
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], single) * triton.cdiv(I, meta["BLOCK_N"]),)
    _launch.launch(
        _bwd_act_kernel, grid,
        x_TH, x_TH.stride(0), x_TH.stride(1), dy_TH, dy_TH.stride(0), dy_TH.stride(1), routes_N, offsets_E1,
        w_down, w_down.stride(0), w_down.stride(1), w_down.stride(2),
        w_gate, w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
        w_up, w_up.stride(0), w_up.stride(1), w_up.stride(2),
        h_MI, h_MI.stride(0), h_MI.stride(1),
        scale if scale is not None else dscale_P,
        dgu, dgu.stride(0), dgu.stride(1), dscale_P, dscale_P.stride(0), hs,
        M, H, I, E, topk, 0.0 if limit is None else float(limit),
        SINGLE=single, HAS_SCALE=scale is not None, HAS_LIMIT=limit is not None,
        DOT_PREC=_launch.dot_precision(x_TH.dtype), GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=GROUP_M,
    )
    return dgu, dscale_P.sum(0), hs  # fixed-order reduction over the I-tiles


# ---------------------------------------------------------------------------------------------
# Weight gradients: dst[e][m, n] (+)= sum over expert e's rows r of A[r, m] * B[r, n]


def _wgrad_configs():
    return pick_configs(
        [cfg(128, 128, 64, 8, 3), cfg(128, 128, 32, 4, 4), cfg(64, 128, 64, 4, 4), cfg(128, 128, 64, 8, 4),
         cfg(128, 64, 64, 4, 4)],
        cfg(16, 16, 16, 1, 1),
    )


@triton.autotune(configs=_wgrad_configs(), key=["MD", "ND", "M", "E", "TOPK"], restore_value=["dst_ptr"])
@triton.jit
def _wgrad_kernel(
    a_ptr, stride_ar, stride_am,  # A: row index = token (A_GATHER) or sorted row; [*, MD]
    b_ptr, stride_br, stride_bn,  # B: row index = token (B_GATHER) or sorted row; [*, ND]
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    scale_ptr,  # float32 per route (SINGLE: per token): A rows are scaled, then rounded (A_SCALE)
    dst_ptr, stride_de, stride_dm, stride_dn,  # dst [E, MD, ND] (any float dtype, strided)
    MD, ND, M, E, TOPK,
    SINGLE: tl.constexpr, A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, A_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_n = tl.cdiv(ND, BLOCK_N)
    ms = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = ms < MD
    nmask = ns < ND
    if SINGLE:
        lo = 0
        hi = M
    else:
        lo = tl.load(offsets_ptr + e)
        hi = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for r0 in range(lo, hi, BLOCK_K):
        rows = r0 + ks
        rmask = rows < hi
        if SINGLE:
            route = rows
            tok = rows
        else:
            route = tl.load(routes_ptr + rows, mask=rmask, other=0)
            tok = route // TOPK
        if A_GATHER:
            ar = tok
        else:
            ar = rows
        if B_GATHER:
            br = tok
        else:
            br = rows
        a = tl.load(a_ptr + ar[None, :].to(tl.int64) * stride_ar + ms[:, None] * stride_am,
                    mask=mmask[:, None] & rmask[None, :], other=0.0)  # A^T tile [BLOCK_M, BLOCK_K]
        b = tl.load(b_ptr + br[:, None].to(tl.int64) * stride_br + ns[None, :] * stride_bn,
                    mask=rmask[:, None] & nmask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if A_SCALE:
            s = tl.load(scale_ptr + route, mask=rmask, other=0.0)
            a = to_out(a.to(tl.float32) * s[None, :], b_ptr, DOT_PREC)
        else:
            a = a.to(b.dtype)
        acc = mma(a, b, acc, DOT_PREC)
    d_ptrs = dst_ptr + e.to(tl.int64) * stride_de + ms[:, None] * stride_dm + ns[None, :] * stride_dn
    dmask = mmask[:, None] & nmask[None, :]
    if ACCUMULATE:  # Megatron main_grad fusion: one rounding of (dst + grad) into dst's dtype
        acc += tl.load(d_ptrs, mask=dmask, other=0.0).to(tl.float32)
    tl.store(d_ptrs, to_out(acc, dst_ptr, DOT_PREC), mask=dmask)


def wgrad(a, b, dst_EMN, routes_N, offsets_E1, topk, *, a_gather, b_gather, scale=None, accumulate=False,
          single=False, n_rows=None):
    """dst[e] (+)= A_e^T @ B_e over expert e's rows (A, B 2-D; rows gathered by token when *_gather).
    dst_EMN: [E, MD, ND] (for SINGLE, a [1, MD, ND] view)."""
    E, MD, ND = dst_EMN.shape
    if E == 0 or MD == 0 or ND == 0:
        return dst_EMN
    M = n_rows if single else routes_N.numel()
    grid = lambda meta: (triton.cdiv(MD, meta["BLOCK_M"]) * triton.cdiv(ND, meta["BLOCK_N"]), E)
    _launch.launch(
        _wgrad_kernel, grid,
        a, a.stride(0), a.stride(1), b, b.stride(0), b.stride(1), routes_N, offsets_E1,
        scale if scale is not None else b,
        dst_EMN, dst_EMN.stride(0), dst_EMN.stride(1), dst_EMN.stride(2),
        MD, ND, M, E, topk,
        SINGLE=single, A_GATHER=a_gather, B_GATHER=b_gather, A_SCALE=scale is not None,
        ACCUMULATE=accumulate, DOT_PREC=_launch.dot_precision(b.dtype),
    )
    return dst_EMN


# ---------------------------------------------------------------------------------------------
# The shared expert's backward, shared by the bf16 (kernels.moe_backward) and MXFP8 paths


def shared_backward(x_TH, dy_TH, s_gate, s_up, s_down, s_out_gate_1H, h_shared_TIs, swiglu_limit, sorted_N,
                    offsets_E1, grads, accumulate):
    """Weight gradients of the shared expert and its output gate into `grads` (written or ADDED), and the
    combine's inputs for dx: (dx_s [T, H] or None, bias [H] or None, bias scale [T] or None)."""
    if s_gate is None:
        return None, None, None
    T, H = x_TH.shape
    gate_T = torch.sigmoid(rowdot(x_TH, s_out_gate_1H)) if s_out_gate_1H is not None else None
    sg, su, sd = s_gate[None], s_up[None], s_down[None]
    dgu_s, dgate_T, hs_s = bwd_act(x_TH, dy_TH, sg, su, sd, h_shared_TIs, gate_T, sorted_N, offsets_E1, 1,
                                   swiglu_limit, single=True)
    Is = s_gate.shape[0]
    for dst, a, b, a_gather in ((grads.d_s_down, dy_TH, hs_s, True), (grads.d_s_gate, dgu_s[:, :Is], x_TH, False),
                                (grads.d_s_up, dgu_s[:, Is:], x_TH, False)):
        wgrad(a, b, dst[None], sorted_N, offsets_E1, 1, a_gather=a_gather, b_gather=not a_gather,
              accumulate=accumulate, single=True, n_rows=T)
    dx_s = torch.empty(T, H, dtype=x_TH.dtype, device=x_TH.device)
    grouped_rows(dgu_s, sg, dx_s, sorted_N, offsets_E1, w1_nk_strides=nk_strides(sg, 2, 1), w2=su,
                 w2_nk_strides=nk_strides(su, 2, 1), scatter=False, single=True)
    if s_out_gate_1H is None:
        return dx_s, None, None
    d_logit = dgate_T * gate_T * (1.0 - gate_T)
    d_w = d_logit[None, :] @ x_TH.float()  # [1, H] float32, a fixed-order GEMV
    if accumulate:
        grads.d_s_out_gate.add_(d_w)
    else:
        grads.d_s_out_gate.copy_(d_w)
    return dx_s, s_out_gate_1H.reshape(-1), d_logit
