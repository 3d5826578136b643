"""The grouped row GEMM: the forward's down GEMM and the backward's data gradient.

    out[dest(r), n] = sum_k A[r, k] W1[e][n, k] (+ sum_k A[r, KD + k] W2[e][n, k])

for each sorted row r of expert e, dest(r) its route (SCATTER) or r. Forward: h_NI @ down[e]^T -> y per route.
Backward: dgu_N2I = [dg | du] @ [gate[e]; up[e]] (TWO: both halves in one K loop) -> dx per route. MXFP8
weights at decode sizes run the fp16 K loops of mx_loop.py (MX_LOOP), the rest the dequantizing loop (TMA
descriptors for A's and the weights' whole K steps where `operands.tma_eligible`).

Shape legend: M sorted rows, NCOL output columns, KD the reduction dim (per half with TWO), E experts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common
from .common import GROUP_M, _tile_ids, _tile_rows, cfg, mma, row_tiles_worst, to_out
from .configs import Family, dtype_name, register
from .mx_loop import (_MX_F16_CONFIGS, MX_F16_SMALL_DOWN, MxLoop, _mx_block, act_step_t, group_scales, mx_group, mx_one, mx_rows, mx_step_t, mx_trans, scale_step, step_scales, use_mx_loop, w_block_scales)
from .operands import row_desc, tma_eligible, tma_pre_hook, tma_weights, w_args, w_bases, w_meta, w_tile, w_tma_tile


# 128 x 256 first: the searched pick for both launches (the forward down GEMM and the dx GEMM) at the
# training shapes; compiled graphs run it
_GROUPED_ROWS_CONFIGS = [cfg(128, 256, 64, 8, 3), cfg(128, 128, 64, 8, 3), cfg(64, 128, 64, 4, 4),
                         cfg(128, 128, 64, 4, 4), cfg(64, 64, 128, 4, 3)]


@triton.jit
def _grouped_rows_k_loop(acc, a_row, a_row_t, stride_ak, a_k0, k_start, rmask, w_ptr, s_ptr, s_n, s_k, ss_n,
                         ss_k, cols, cmask, KD, like_ptr, MX: tl.constexpr, MX_LOOP: tl.constexpr,
                         TRANS: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A[rows, a_k0 + k] @ W[e][cols, k]^T over k in [k_start, KD) (w_ptr, s_ptr: expert e's starts);
    TRANS: acc and the sum transposed (`mx_dot_t`), a_row_t the rows' starts as a [1, BLOCK_M] tile."""
    if MX_LOOP:  # the whole K steps, BLOCK_K // 32 blocks each, then the tail's blocks one by one (no k masks)
        k_full = KD - KD % BLOCK_K
        G: tl.constexpr = mx_group(MX_LOOP, BLOCK_K)
        ONE: tl.constexpr = mx_one(MX_LOOP, TRANS)
        for k0 in range(0, k_full, BLOCK_K):
            if ONE:
                acc = mx_step_t(act_step_t(a_row_t, stride_ak, a_k0, k0, rmask, BLOCK_K), w_ptr, k0, cols, cmask,
                                s_n, s_k, step_scales(s_ptr, k0, cols, cmask, ss_n, BLOCK_K), acc, DOT_PREC,
                                BLOCK_K)
            else:
                cur = scale_step(s_ptr, k0, k_full, cols, cmask, ss_n, G == 4, BLOCK_K)
                for q in tl.static_range(BLOCK_K // (32 * G)):
                    kb0 = k0 // 32 + G * q
                    for j in tl.static_range(G):
                        acc = _mx_block(acc, a_row, a_row_t, stride_ak, a_k0, kb0 + j, rmask, w_ptr,
                                        group_scales(cur, q, j, s_ptr, kb0, cols, cmask, ss_n, ss_k, G == 4), cols,
                                        cmask, s_n, s_k, TRANS, DOT_PREC)
        for kb in range(k_full // 32, KD // 32):
            acc = _mx_block(acc, a_row, a_row_t, stride_ak, a_k0, kb, rmask, w_ptr,
                            w_block_scales(s_ptr, kb, cols, cmask, ss_n, ss_k), cols, cmask, s_n, s_k, TRANS,
                            DOT_PREC)
    else:
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(k_start, KD, BLOCK_K):
            kk = k0 + ks
            kmask = kk < KD
            a = tl.load(a_row + (a_k0 + kk[None, :]) * stride_ak, mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = w_tile(w_ptr, s_ptr, kk, cols, kmask, cmask, s_n, s_k, ss_n, ss_k, like_ptr, MX, DOT_PREC)
            acc = mma(a, w, acc, DOT_PREC)
    return acc


@triton.jit
def _tma_k_loop(acc, a_desc, a_k0, row_start, w_desc, w_row0, n0, kd_full, W_KMAJOR: tl.constexpr,
                DOT_PREC: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A[row_start:, a_k0 + k] @ W[e][n0:, k]^T over the whole K steps k < kd_full, both tiles loaded by
    TMA (A from its [M, KA] descriptor). Rows of A past the expert's (the next expert's) give garbage the
    store masks; past a descriptor's shape TMA loads zeros. No step runs past KD, so no other expert's or
    half's k enters the sum."""
    for k0 in range(0, kd_full, BLOCK_K):
        a = a_desc.load([row_start, a_k0 + k0])
        acc = mma(a, w_tma_tile(w_desc, w_row0, n0, k0, W_KMAJOR), acc, DOT_PREC)
    return acc


@triton.jit(do_not_specialize=["M"])  # (a new token count compiles nothing)
def _grouped_rows_kernel(
    a_ptr, stride_am, stride_ak,  # A [M, KD or 2*KD], sorted rows (MX_LOOP: fp16, `row_f16`)
    ar_ptr,  # MX_LOOP: A's row scales [M] float32 (else unused)
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    w1_ptr, s1_e, s1_n, s1_k, q1_ptr, q1_e, q1_n, q1_k,  # W1[e] (n, k) data and scales (MX1), [E, NCOL, KD]
    w2_ptr, s2_e, s2_n, s2_k, q2_ptr, q2_e, q2_n, q2_k,  # W2[e], multiplies A's columns [KD, 2 KD) (TWO)
    out_ptr, stride_om, stride_on,  # out [rows, NCOL]; row = route (SCATTER) or the sorted row
    a_desc, w1_desc, w2_desc, w_rows,  # TMA: host descriptors of A and of W1's, W2's 2-D views, R (`_tma_args`)
    M, NCOL, KD, E,
    bias_ptr, b_e, b_n,  # bias [E, NCOL] added to the accumulator (HAS_BIAS): the down GEMM's FC2 bias
    HAS_BIAS: tl.constexpr,
    SINGLE: tl.constexpr, SCATTER: tl.constexpr, TWO: tl.constexpr, MX1: tl.constexpr, MX2: tl.constexpr,
    DOT_PREC: tl.constexpr, W_TABLE: tl.constexpr, MX_LOOP: tl.constexpr, TMA: tl.constexpr,
    W_KMAJOR: tl.constexpr, GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, NCOL, SINGLE, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, SINGLE, False, BLOCK_M, GROUPS_POW2)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < NCOL
    e64 = group.to(tl.int64)
    w1, q1 = w_bases(w1_ptr, q1_ptr, e64, s1_e, q1_e, E, W_TABLE, MX1)
    TRANS: tl.constexpr = mx_trans(MX_LOOP, BLOCK_M)
    if TRANS:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_row = a_ptr + rows[:, None].to(tl.int64) * stride_am
    a_row_t = a_ptr + rows[None, :].to(tl.int64) * stride_am
    k_start = 0
    if TMA:
        k_start = KD - KD % BLOCK_K
        acc = _tma_k_loop(acc, a_desc, 0, row_start, w1_desc, group * w_rows, pid_n * BLOCK_N, k_start, W_KMAJOR,
                          DOT_PREC, BLOCK_K)
    acc = _grouped_rows_k_loop(acc, a_row, a_row_t, stride_ak, 0, k_start, rmask, w1, q1, s1_n, s1_k, q1_n,
                               q1_k, cols, cmask, KD, out_ptr, MX1, MX_LOOP, TRANS, DOT_PREC, BLOCK_K)
    if TWO:
        w2, q2 = w_bases(w2_ptr, q2_ptr, e64, s2_e, q2_e, E, W_TABLE, MX2)
        if TMA:
            acc = _tma_k_loop(acc, a_desc, KD, row_start, w2_desc, group * w_rows, pid_n * BLOCK_N, k_start,
                              W_KMAJOR, DOT_PREC, BLOCK_K)
        acc = _grouped_rows_k_loop(acc, a_row, a_row_t, stride_ak, KD, k_start, rmask, w2, q2, s2_n, s2_k,
                                   q2_n, q2_k, cols, cmask, KD, out_ptr, MX2, MX_LOOP, TRANS, DOT_PREC, BLOCK_K)
    if TRANS:
        acc = tl.trans(acc)
    if MX_LOOP:  # A's row scales
        acc *= tl.load(ar_ptr + rows, mask=rmask, other=1.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e64 * b_e + cols * b_n, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if SCATTER:
        dest = tl.load(routes_ptr + rows, mask=rmask, other=0)
    else:
        dest = rows
    o_ptrs = out_ptr + dest[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(o_ptrs, to_out(acc, out_ptr, DOT_PREC), mask=rmask[:, None] & cmask[None, :])


# TWO and SCATTER in the problem: the down GEMM and the dx GEMM have the same sizes at some shapes
GROUPED_ROWS = register(Family(
    "grouped_rows", _grouped_rows_kernel, _GROUPED_ROWS_CONFIGS,
    fields=("dtype", "NCOL", "KD", "E", "TWO", "SCATTER", "TMA", "MX"), field_defaults={"MX": False},
    sizes=("NCOL", "KD", "E"), outputs=("out_ptr",),
    interpret=cfg(16, 16, 32, 1, 1), pre_hook=tma_pre_hook(("a_desc",), ("w1_desc", "w2_desc"))))
GROUPED_ROWS_MX = register(Family(
    "grouped_rows_mx", _grouped_rows_kernel, _MX_F16_CONFIGS, fields=("dtype", "NCOL", "KD", "E", "TWO", "MX_LOOP"),
    sizes=("NCOL", "KD", "E"), outputs=("out_ptr",), interpret=cfg(16, 16, 32, 1, 1), small=MX_F16_SMALL_DOWN))


def _tma_args(a_MK, w1, w2, two: bool, mx_loop: MxLoop):
    """Kernel arguments (a_desc, w1_desc, w2_desc, R) and meta (TMA, W_KMAJOR) of a launch of the grouped row
    GEMM: host TMA descriptors for A and the weights where `tma_eligible`, A has contiguous rows with
    16-byte aligned strides, and `tma_weights` takes the weights; otherwise none (TMA=0: pointer loads)."""
    off = (None, None, None, 1), dict(TMA=False, W_KMAJOR=False)
    if mx_loop or not tma_eligible(a_MK, a_MK.shape[0], w1.data.shape[0]):
        return off
    if two and (a_MK.shape[1] // 2 * a_MK.element_size()) % 16:  # (W2's A columns start at KD: TMA offsets
        return off  # along the contiguous dim are 16-byte aligned)
    a_desc = row_desc(a_MK)
    w = tma_weights((w1, w2) if two else (w1,)) if a_desc is not None else None
    if w is None:
        return off
    descs, R, kmajor = w
    return (a_desc, descs[0], descs[-1], R), dict(TMA=True, W_KMAJOR=kmajor)


def grouped_rows(a_MK, w1, out, routes_N, offsets_E1, *, w2=None, scatter=True, single=False, bias_EN=None):
    """out[dest(r)] = A[r, :KD] @ W1[e]^T (+ A[r, KD:] @ W2[e]^T) (+ bias_EN[e], in the float32 accumulator);
    w1, w2: `types.Operand`s read as [E, NCOL, KD]."""
    M = a_MK.shape[0]
    NCOL = out.shape[1]
    KD = a_MK.shape[1] // (2 if w2 is not None else 1)
    if M == 0 or NCOL == 0:
        return out
    E = w1.data.shape[0]
    two = w2 is not None
    w2 = w2 if two else w1
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], single) * common.cdiv(NCOL, meta["BLOCK_N"]),)
    mx_loop = use_mx_loop(a_MK.dtype, M, E, w1, w2)
    tma, tma_meta = _tma_args(a_MK, w1, w2, two, mx_loop)
    dot_prec = common.dot_precision(a_MK.dtype)
    dtype = dtype_name(a_MK.dtype)
    a_MK, ar, mx_loop = mx_rows(a_MK, mx_loop, w1, w2)
    common.launch(
        GROUPED_ROWS_MX if mx_loop else GROUPED_ROWS, grid,
        a_MK, a_MK.stride(0), a_MK.stride(1), ar, routes_N, offsets_E1,
        *w_args(w1), *w_args(w2),
        out, out.stride(0), out.stride(1), *tma,
        M, NCOL, KD, E,
        # (without a bias: a read-only input in its place, never read; an output there would alias a written one)
        *((a_MK, 0, 0) if bias_EN is None else (bias_EN, *bias_EN.stride())), HAS_BIAS=bias_EN is not None,
        SINGLE=single, SCATTER=scatter, TWO=two, MX1=w1.quantized, MX2=w2.quantized,
        DOT_PREC=dot_prec, MX_LOOP=int(mx_loop), GROUP_M=GROUP_M, GROUPS_POW2=common.next_pow2(E + 1),
        **tma_meta, **w_meta(w1, w2), rows=M,
        problem=((dtype, NCOL, KD, E, two, int(mx_loop)) if mx_loop
                 else (dtype, NCOL, KD, E, two, scatter, tma_meta["TMA"], bool(w1.quantized or w2.quantized))),
    )
    return out
