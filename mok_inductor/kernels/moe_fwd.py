"""Forward kernels: the gathered gate/up GEMM with the clamped SwiGLU, the grouped row GEMM, the
combine, and a row-dot for the shared output gate's logits.

    x_TH[sorted_routes // K] --_gate_up_kernel (gather in the loads, SwiGLU epilogue)--> h_NI (sorted)
    h_NI --_grouped_rows_kernel (down[e], rows scattered to their route)--> y_NH (route order, x.dtype)
    y_NH, router_weights, shared s_TH, sigmoid(x @ w_gate^T) --_combine_kernel--> y_TH (fp32 sum in k order)

Tiles: a program owns a BLOCK_M x BLOCK_N tile of one expert's rows. The grid is the worst case
cdiv(N, BLOCK_M) + E + 1 row tiles (from shapes only); `_tile_rows` finds each program's expert
from the device offsets (a prefix sum of per-expert tile counts) and idle programs exit. The shared
expert runs the same kernels with SINGLE=True: one group of T rows, no gather.

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token (TOPK in kernels),
N = T*K routes (M rows in a grouped kernel), G groups (E, or E + 1 with the `-1` tail).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._launch import cfg, mma, pick_configs, to_out

GROUP_M = 8  # row tiles per L2 group (see _tile_ids)

# ---------------------------------------------------------------------------------------------
# Tile enumeration


@triton.jit
def _tile_rows(pid_m, offsets_ptr, M, E, SINGLE: tl.constexpr, WITH_TAIL: tl.constexpr,
               BLOCK_M: tl.constexpr, GROUPS_POW2: tl.constexpr):
    """(group, row_start, row_end) of row tile `pid_m`; row_start >= row_end for an idle program.
    Groups are the experts [0, E) and, WITH_TAIL, group E = the `-1` routes' slots [offsets[E], M)."""
    if SINGLE:
        group = pid_m * 0
        row_start = pid_m * BLOCK_M
        row_end = M + pid_m * 0
    else:
        idx = tl.arange(0, GROUPS_POW2)
        lo = tl.load(offsets_ptr + idx, mask=idx <= E, other=M)
        hi = tl.load(offsets_ptr + idx + 1, mask=idx + 1 <= E, other=M)
        if WITH_TAIL:
            num_groups = E + 1
        else:
            num_groups = E
        ntiles = tl.where(idx < num_groups, tl.cdiv(hi - lo, BLOCK_M), 0)
        cum = tl.cumsum(ntiles, axis=0)
        group = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
        sel = idx == group
        first = tl.sum(tl.where(sel, cum - ntiles, 0), axis=0)
        lo_g = tl.sum(tl.where(sel, lo, 0), axis=0)
        hi_g = tl.sum(tl.where(sel, hi, 0), axis=0)
        row_start = lo_g + (pid_m - first) * BLOCK_M
        row_end = tl.where(group < num_groups, hi_g, row_start)
    return group, row_start, row_end


@triton.jit
def _tile_ids(pid, M, E, NCOLS, SINGLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`, GROUP_M row tiles at a time (L2 reuse: a weight column block
    is read once per group of row tiles, not once per row tile)."""
    num_n = tl.cdiv(NCOLS, BLOCK_N)
    if SINGLE:
        num_m = tl.cdiv(M, BLOCK_M)
    else:
        num_m = tl.cdiv(M, BLOCK_M) + E + 1
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % gsize
    pid_n = (pid % per_group) // gsize
    return pid_m, pid_n


def row_tiles_worst(M: int, E: int, block_m: int, single: bool) -> int:
    """Upper bound of the row tiles of any schedule of M rows over E (+1) groups: shapes only."""
    return triton.cdiv(M, block_m) if single else triton.cdiv(M, block_m) + E + 1


# ---------------------------------------------------------------------------------------------
# Gate/up GEMM with the gather of x rows and the clamped SwiGLU epilogue


def _gate_up_configs():
    return pick_configs(
        [cfg(128, 128, 64, 8, 3), cfg(128, 64, 64, 4, 4), cfg(64, 128, 64, 4, 4), cfg(128, 64, 64, 8, 4),
         cfg(64, 64, 128, 4, 3)],
        cfg(16, 16, 16, 1, 1),
    )


@triton.autotune(configs=_gate_up_configs(), key=["M", "H", "I", "E", "TOPK"])
@triton.jit
def _gate_up_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H]
    routes_ptr, offsets_ptr,  # sorted_routes [M] int32, expert_offsets [E+1] int32
    wg_ptr, stride_ge, stride_gi, stride_gh,  # gate [E, I, H] (strided view)
    wu_ptr, stride_ue, stride_ui, stride_uh,  # up [E, I, H] (strided view)
    h_ptr, stride_hm, stride_hi,  # h [M, I] out, sorted slot order (tail rows zeroed)
    M, H, I, E, TOPK,  # rows (routes), hidden, intermediate, experts, routes per token
    limit,  # swiglu clamp (used when HAS_LIMIT)
    SINGLE: tl.constexpr, HAS_LIMIT: tl.constexpr, DOT_PREC: tl.constexpr, GROUPS_POW2: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, I, SINGLE, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, SINGLE, True, BLOCK_M, GROUPS_POW2)
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
    if SINGLE:
        tok = rows
    else:
        tok = tl.load(routes_ptr + rows, mask=rmask, other=0) // TOPK
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None].to(tl.int64) * stride_xt + ks[None, :] * stride_xh
    e64 = group.to(tl.int64)
    g_ptrs = wg_ptr + e64 * stride_ge + ks[:, None] * stride_gh + cols[None, :] * stride_gi
    u_ptrs = wu_ptr + e64 * stride_ue + ks[:, None] * stride_uh + cols[None, :] * stride_ui
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = (k0 + ks) < H
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        bg = tl.load(g_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        bu = tl.load(u_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc_g = mma(a, bg, acc_g, DOT_PREC)
        acc_u = mma(a, bu, acc_u, DOT_PREC)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_gh
        u_ptrs += BLOCK_K * stride_uh
    if HAS_LIMIT:  # where() rather than min/max: a NaN is not clipped, it propagates
        acc_g = tl.where(acc_g > limit, limit, acc_g)
        acc_u = tl.where(acc_u > limit, limit, tl.where(acc_u < -limit, -limit, acc_u))
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptrs, to_out(h, h_ptr, DOT_PREC), mask=omask)


def gate_up(x_TH, w_gate, w_up, h_out, routes_N, offsets_E1, topk, limit, *, single=False):
    """h_out[M, I] = swiglu(x[rows] @ gate[e]^T, x[rows] @ up[e]^T) per sorted row (SINGLE: all T rows,
    one expert given as [1, I, H] views)."""
    M, I = h_out.shape
    if M == 0 or I == 0:
        return h_out
    E, _, H = w_gate.shape
    groups_pow2 = _launch.next_pow2(E + 1)
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], single) * triton.cdiv(I, meta["BLOCK_N"]),)
    _launch.launch(
        _gate_up_kernel, grid,
        x_TH, x_TH.stride(0), x_TH.stride(1), routes_N, offsets_E1,
        w_gate, w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
        w_up, w_up.stride(0), w_up.stride(1), w_up.stride(2),
        h_out, h_out.stride(0), h_out.stride(1),
        M, H, I, E, topk, 0.0 if limit is None else float(limit),
        SINGLE=single, HAS_LIMIT=limit is not None, DOT_PREC=_launch.dot_precision(x_TH.dtype),
        GROUPS_POW2=groups_pow2, GROUP_M=GROUP_M,
    )
    return h_out


# ---------------------------------------------------------------------------------------------
# Grouped row GEMM: out[dest(r), n] = sum_k A[r, k] W1[e][n, k] (+ sum_k A[r, KD + k] W2[e][n, k])


def _grouped_rows_configs():
    return pick_configs(
        [cfg(128, 128, 64, 8, 3), cfg(128, 256, 64, 8, 3), cfg(64, 128, 64, 4, 4), cfg(128, 128, 64, 4, 4)],
        cfg(16, 16, 16, 1, 1),
    )


@triton.autotune(configs=_grouped_rows_configs(), key=["M", "NCOL", "KD", "E"])
@triton.jit
def _grouped_rows_kernel(
    a_ptr, stride_am, stride_ak,  # A [M, KD or 2*KD], sorted rows
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    w1_ptr, s1_e, s1_n, s1_k,  # W1[e] element (n, k): [E, NCOL, KD] as strides
    w2_ptr, s2_e, s2_n, s2_k,  # W2[e] element (n, k), multiplies A's columns [KD, 2 KD) (TWO)
    out_ptr, stride_om, stride_on,  # out [rows, NCOL]; row = route (SCATTER) or the sorted row
    M, NCOL, KD, E,
    SINGLE: tl.constexpr, SCATTER: tl.constexpr, TWO: tl.constexpr, DOT_PREC: tl.constexpr,
    GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, NCOL, SINGLE, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, SINGLE, False, BLOCK_M, GROUPS_POW2)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < NCOL
    ks = tl.arange(0, BLOCK_K)
    e64 = group.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
    w_ptrs = w1_ptr + e64 * s1_e + ks[:, None] * s1_k + cols[None, :] * s1_n
    for k0 in range(0, KD, BLOCK_K):
        kmask = (k0 + ks) < KD
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = mma(a, w, acc, DOT_PREC)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * s1_k
    if TWO:
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + (KD + ks[None, :]) * stride_ak
        w_ptrs = w2_ptr + e64 * s2_e + ks[:, None] * s2_k + cols[None, :] * s2_n
        for k0 in range(0, KD, BLOCK_K):
            kmask = (k0 + ks) < KD
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc = mma(a, w, acc, DOT_PREC)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * s2_k
    if SCATTER:
        dest = tl.load(routes_ptr + rows, mask=rmask, other=0)
    else:
        dest = rows
    o_ptrs = out_ptr + dest[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(o_ptrs, to_out(acc, out_ptr, DOT_PREC), mask=rmask[:, None] & cmask[None, :])


def grouped_rows(a_MK, w1, out, routes_N, offsets_E1, *, w1_nk_strides, w2=None, w2_nk_strides=None,
                 scatter=True, single=False):
    """out[dest(r)] = A[r, :KD] @ W1[e]^T (+ A[r, KD:] @ W2[e]^T). w*_nk_strides: (stride_e, stride_n,
    stride_k) of the weight read as [E, NCOL, KD]; KD is the reduction length of one weight."""
    M = a_MK.shape[0]
    NCOL = out.shape[1]
    KD = a_MK.shape[1] // (2 if w2 is not None else 1)
    if M == 0 or NCOL == 0:
        return out
    E = w1.shape[0]
    two = w2 is not None
    if not two:
        w2, w2_nk_strides = w1, w1_nk_strides
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], single) * triton.cdiv(NCOL, meta["BLOCK_N"]),)
    _launch.launch(
        _grouped_rows_kernel, grid,
        a_MK, a_MK.stride(0), a_MK.stride(1), routes_N, offsets_E1,
        w1, *w1_nk_strides, w2, *w2_nk_strides,
        out, out.stride(0), out.stride(1),
        M, NCOL, KD, E,
        SINGLE=single, SCATTER=scatter, TWO=two, DOT_PREC=_launch.dot_precision(a_MK.dtype),
        GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=GROUP_M,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Combine: out[t] = S[t] * (sigmoid(logit[t]) | 1) + bias * bscale[t] + sum_k [valid] rw[t,k] Y[t*K+k]


@triton.jit
def _combine_kernel(
    y_ptr, stride_yr, stride_yh,  # Y [T*K, H] per-route rows
    te_ptr,  # top_experts [T*K] (validity: >= 0)
    rw_ptr,  # float32 [T*K] route weights (HAS_RW)
    s_ptr, stride_st, stride_sh,  # S [T, H] (HAS_S)
    logit_ptr,  # float32 [T]: S is scaled by sigmoid(logit) (S_SIGMOID)
    bias_ptr, bscale_ptr,  # bias [H], float32 [T] (HAS_BIAS)
    out_ptr, stride_ot, stride_oh,  # out [T, H]
    T, H, TOPK,
    HAS_RW: tl.constexpr, HAS_S: tl.constexpr, S_SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    num_h = tl.cdiv(H, BLOCK_H)
    t = pid // num_h
    cols = (pid % num_h) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    t64 = t.to(tl.int64)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if HAS_S:
        acc = tl.load(s_ptr + t64 * stride_st + cols * stride_sh, mask=cmask, other=0.0).to(tl.float32)
        if S_SIGMOID:
            acc = acc * tl.sigmoid(tl.load(logit_ptr + t))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32) * tl.load(bscale_ptr + t)
    for k in range(0, TOPK):
        r = t64 * TOPK + k
        valid = tl.load(te_ptr + r) >= 0
        y = tl.load(y_ptr + r * stride_yr + cols * stride_yh, mask=cmask & valid, other=0.0).to(tl.float32)
        if HAS_RW:
            y = y * tl.load(rw_ptr + r)
        acc += tl.where(valid, y, 0.0)
    out = to_out(acc, out_ptr, DOT_PREC)
    tl.store(out_ptr + t64 * stride_ot + cols * stride_oh, out, mask=cmask)


def combine(y_NH, te_N, out_TH, *, rw_N=None, s_TH=None, logit_T=None, bias_H=None, bscale_T=None):
    T, H = out_TH.shape
    if T == 0 or H == 0:
        return out_TH
    topk = te_N.numel() // T
    block_h = min(1024, _launch.next_pow2(H)) if not _launch.INTERPRET else min(64, _launch.next_pow2(H))
    dummy = out_TH
    _launch.launch(
        _combine_kernel, (T * triton.cdiv(H, block_h),),
        y_NH, y_NH.stride(0), y_NH.stride(1), te_N,
        rw_N if rw_N is not None else dummy,
        s_TH if s_TH is not None else dummy, *(s_TH.stride() if s_TH is not None else (0, 0)),
        logit_T if logit_T is not None else dummy,
        bias_H if bias_H is not None else dummy, bscale_T if bscale_T is not None else dummy,
        out_TH, out_TH.stride(0), out_TH.stride(1),
        T, H, topk,
        HAS_RW=rw_N is not None, HAS_S=s_TH is not None, S_SIGMOID=logit_T is not None,
        HAS_BIAS=bias_H is not None, DOT_PREC=_launch.dot_precision(out_TH.dtype), BLOCK_H=block_h,
        num_warps=4,
    )
    return out_TH


# ---------------------------------------------------------------------------------------------
# Row dot: out[t] = <x[t], w> in float32 (the shared output gate's logits)


@triton.jit
def _rowdot_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H]
    w_ptr, stride_w,  # w [H]
    out_ptr,  # float32 [T] out
    T, H,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cmask = cols < H
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + cols[None, :] * stride_xh,
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols * stride_w, mask=cmask, other=0.0).to(tl.float32)
        acc += tl.sum(x * w[None, :], axis=1)
    tl.store(out_ptr + rows, acc, mask=rmask)


def rowdot(x_TH, w_1H):
    T, H = x_TH.shape
    out = torch.empty(T, dtype=torch.float32, device=x_TH.device)
    if T == 0:
        return out
    w = w_1H.reshape(-1)
    bt, bh = (16, 64) if _launch.INTERPRET else (32, 256)
    _launch.launch(_rowdot_kernel, (triton.cdiv(T, bt),), x_TH, x_TH.stride(0), x_TH.stride(1),
                   w, w.stride(0), out, T, H, BLOCK_T=bt, BLOCK_H=bh)
    return out


# ---------------------------------------------------------------------------------------------
# Pieces of the forward shared by the bf16 (kernels.moe_forward) and MXFP8 (moe_mxfp8.moe_forward) paths


def nk_strides(w, n_dim: int, k_dim: int):
    """(stride_e, stride_n, stride_k) of a 3-D weight read as [E, n, k]."""
    return (w.stride(0), w.stride(n_dim), w.stride(k_dim))


def flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous 1-D tensor (a view when it already is)."""
    t = t.reshape(-1)
    return t if t.is_contiguous() else t.contiguous()


def shared_forward(x_TH, s_gate, s_up, s_down, s_out_gate_1H, sorted_N, offsets_E1, swiglu_limit):
    """The shared expert (always bf16/x.dtype weights) -> (h_shared [T, Is] (empty without one), its output
    s_TH [T, H] or None, the output gate's logits [T] float32 or None): the combine's inputs."""
    T, H = x_TH.shape
    if s_gate is None:
        return x_TH.new_empty(0, 0), None, None
    dev, dtype = x_TH.device, x_TH.dtype
    h_shared = torch.empty(T, s_gate.shape[0], dtype=dtype, device=dev)
    gate_up(x_TH, s_gate[None], s_up[None], h_shared, sorted_N, offsets_E1, 1, swiglu_limit, single=True)
    s_TH = torch.empty(T, H, dtype=dtype, device=dev)
    sd = s_down[None]
    grouped_rows(h_shared, sd, s_TH, sorted_N, offsets_E1, w1_nk_strides=nk_strides(sd, 1, 2), scatter=False,
                 single=True)
    logit_T = rowdot(x_TH, s_out_gate_1H) if s_out_gate_1H is not None else None
    return h_shared, s_TH, logit_T
