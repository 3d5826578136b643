"""Forward kernels: the gathered gate/up GEMM (clamped SwiGLU epilogue), the grouped row GEMM, the combine,
and a row-dot for the shared output gate's logits.

    x_TH[sorted_routes // K] --_gate_up_kernel (gather in the loads)--> gu_N2I = [g | u] (sorted, saved),
        h_NI = swiglu(g, u) (sorted, transient)
    h_NI --_grouped_rows_kernel (down[e], rows scattered to their route)--> y_NH (route order)
    y_NH, router_weights, shared s_TH, sigmoid(x @ w_gate^T) --_combine_kernel--> y_TH (fp32 sum in k order)

Weights are operands read as [E, n, k] (k the reduction dim) through their strides: bf16/fp16/fp32
tensors, or MXFP8 e4m3 data with E8M0 scales per 32 along k (`w_tile` dequantizes in registers; MX*
constexprs), so one kernel family serves both.

Tiles: a program owns a BLOCK_M x BLOCK_N tile of one expert's rows. The grid is the worst case
cdiv(N, BLOCK_M) + E + 1 row tiles (from shapes only); `_tile_rows` finds each program's expert
from the device offsets (a prefix sum of per-expert tile counts) and idle programs exit. The shared
expert runs the same kernels with SINGLE=True: one group of T rows, no gather.

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token (TOPK in kernels),
N = T*K routes (M rows in a grouped kernel), G groups (E, or E + 1 with the `-1` tail).
"""

from __future__ import annotations

import enum
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .. import options, reference
from ..types import Operand
from . import _launch
from ._launch import cfg, mma, to_out

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
def swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile `pid` of a num_m x num_n grid, GROUP_M row tiles at a time (L2 reuse: a
    column block is read once per group of row tiles, not once per row tile)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % gsize, (pid % per_group) // gsize


@triton.jit
def _tile_ids(pid, M, E, NCOLS, SINGLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` over the worst-case row tiles of a schedule (see `swizzle`)."""
    if SINGLE:
        num_m = tl.cdiv(M, BLOCK_M)
    else:
        num_m = tl.cdiv(M, BLOCK_M) + E + 1
    return swizzle(pid, num_m, tl.cdiv(NCOLS, BLOCK_N), GROUP_M)


def row_tiles_worst(M: int, E: int, block_m: int, single: bool) -> int:
    """Upper bound of the row tiles of any schedule of M rows over E (+1) groups: shapes only."""
    return _launch.cdiv(M, block_m) if single else _launch.cdiv(M, block_m) + E + 1


# ---------------------------------------------------------------------------------------------
# Weight operands: [E, n, k] views (k the reduction dim), bf16/fp16/fp32 or MXFP8 data + E8M0 scales


@triton.jit
def expert_ptr(ptr, e64, stride_e, E, TABLE: tl.constexpr, DT: tl.constexpr):
    """The start of expert e's [n, k] matrix: ptr + e * stride_e, or (TABLE: split per-expert allocations)
    the address in entry e of the int64 table at ptr, as a pointer to DT (e clamped into [0, E): the
    tail group's and idle tiles' e is E and they read nothing). TABLE == 2: every address is a multiple of
    16 bytes, which the compiler must be told (a loaded address has no known alignment, and without it
    the weight tiles are loaded element by element instead of by 16-byte asynchronous copies)."""
    if TABLE == 0:
        return ptr + e64 * stride_e
    else:
        p = tl.load(ptr + tl.where(e64 < E, e64, 0)).to(tl.pointer_type(DT))
        if TABLE == 2:
            p = tl.multiple_of(p, 16)
        return p


@triton.jit
def w_bases(w_ptr, s_ptr, e64, s_e, ss_e, E, TABLE: tl.constexpr, MX: tl.constexpr):
    """(data, scales) starts of expert e of an operand (`w_args`); TABLE as in expert_ptr, for the data (a
    scale table is never declared aligned: the up half's scale rows start mid-line). MX: e4m3 data, uint8
    scales. Plain: the scales argument is a tensor of the weight's dtype (through a table, the dtype the
    addresses are cast to), returned as is."""
    if MX:
        w = expert_ptr(w_ptr, e64, s_e, E, TABLE, tl.float8e4nv)
        s = expert_ptr(s_ptr, e64, ss_e, E, TABLE != 0, tl.uint8)  # (a table, never declared aligned)
    else:
        w = expert_ptr(w_ptr, e64, s_e, E, TABLE, s_ptr.dtype.element_ty)
        s = s_ptr
    return w, s


@triton.jit
def w_tile(w_ptr, s_ptr, kk, cols, kmask, cmask, s_n, s_k, ss_n, ss_k, like_ptr,
           MX: tl.constexpr, DOT_PREC: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile W[e][cols, kk] (k down the tile) of one expert's matrix (w_ptr, s_ptr:
    its starts, `w_bases`); MX: e4m3 data dequantized with its per-32 scales in registers (e4m3 * 2**(s -
    127) is exact in bf16/fp16/fp32) into like_ptr's dtype, for the activation dtype's tl.dot. (`tl.dot_scaled`
    is not used: on Hopper Triton decomposes it into the same upcast, and the interpreter rejects it.) BLOCK_K
    is a multiple of 32: a K step holds whole scale blocks."""
    m = kmask[:, None] & cmask[None, :]
    w = tl.load(w_ptr + kk[:, None] * s_k + cols[None, :] * s_n, mask=m, other=0.0)
    if MX:
        # one scale load per element (L1 hits: 32 neighbours share one); a row of scales per 32-block spread
        # with where(), a scale tile broadcast through a 3-D view, inline-PTX conversions and decoding by bit
        # moves were all slower. The conversions (e4m3 -> f16 -> f32 -> bf16: F2F, a quarter of the float32
        # rate on Hopper) bound this loop
        sc = tl.load(s_ptr + (kk // 32)[:, None] * ss_k + cols[None, :] * ss_n, mask=m, other=0)
        w = w.to(tl.float32) * e8m0_factor(sc)
        if DOT_PREC != "interp":
            w = w.to(like_ptr.dtype.element_ty)
    return w


@triton.jit
def w_tma_tile(w_desc, w_row0, n0, k0, W_KMAJOR: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile W[e][n0 + j, k0 + i] through the TMA descriptor of the weight's 2-D view
    (`tma_weights`), expert e's first row w_row0: rows e*R + n, cols k (W_KMAJOR) or rows e*R + k, cols n.
    Columns past the matrix's n (the rows of another expert or matrix) give garbage the caller's store masks;
    a K step must not run past k (callers run whole steps only, the tail through `w_tile`)."""
    if W_KMAJOR:
        w = tl.trans(w_desc.load([w_row0 + n0, k0]))
    else:
        w = w_desc.load([w_row0 + k0, n0])
    return w


@triton.jit
def e8m0_factor(sc):
    """2**(sc - 127) of uint8 E8M0 scales, built from its float32 bits (exact; sc = 0, an all-zero block,
    gives 0)."""
    return (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)


class MxLoop(enum.IntEnum):
    """How a GEMM's K loop reads its weights (the kernels' MX_LOOP constexpr, chosen by `use_mx_loop` and
    `mx_rows`).

    DEQUANTIZE: each weight tile as loaded (`w_tile`: MXFP8 dequantized in registers), the activation dtype's
        dot. Plain weights, float32 activations, and MXFP8 above `mx_f16_dot_max_rows` routes per expert.
    F16: bf16/fp16 activations with MXFP8 weights at few routes per expert (decode, where the weight bytes
        are the cost): the activation rows scaled into fp16 once per call (`row_f16`), each 32-block of k one
        fp16 dot on the e4m3 weights converted to fp16 as loaded (one conversion per two elements, where the
        dequantizing loop's e4m3 -> f32 -> bf16 round trip and per-element scale multiply bound it), scaled by
        the block's weight scales, the row scales applied after the K loop.
    F16_WORDS: F16 with each column's scales of 4 blocks read by one 32-bit word (`scale_words`: 4x fewer
        scale requests) where the scale rows allow it, and on the 8-row tiles each whole K step as one dot
        (`mx_step_t`: splitting the step into 32-wide loads and dots costs more than the scaling).
    """

    DEQUANTIZE = 0
    F16 = 1
    F16_WORDS = 2


# The K loop's plan, computed once here for both MXFP8 kernels (`_gate_up_tile`, `_grouped_rows_k_loop`) from the
# kernel's constexprs
@triton.constexpr_function
def mx_trans(mx_loop, block_m):
    """Whether the tile computes its blocks transposed (`mx_dot_t`): the 8-row tiles of the fp16 loops."""
    return mx_loop != MxLoop.DEQUANTIZE and block_m < 16


@triton.constexpr_function
def mx_group(mx_loop, block_k):
    """The blocks one scale load gives: 4 where the scales are read by words and a K step holds whole words
    (BLOCK_K 128 or 256), else 1."""
    return 4 if mx_loop == MxLoop.F16_WORDS and block_k in (128, 256) else 1


@triton.constexpr_function
def mx_one(mx_loop, trans):
    """Whether each whole K step is one dot (`mx_step_t`): the transposed tiles with scale words."""
    return mx_loop == MxLoop.F16_WORDS and trans


@triton.jit
def act_block(a_row, stride_ak, a_k0, kb, rmask):
    """Scale block kb of the A rows (k = 32 kb + [0, 32), at column a_k0 + k of A; a whole block, MXFP8's k
    being a multiple of 32): fp16 rows scaled by `row_f16`."""
    kk = kb * 32 + tl.arange(0, 32)
    return tl.load(a_row + (a_k0 + kk[None, :]) * stride_ak, mask=rmask[:, None], other=0.0)


@triton.jit
def w_tile_e4m3(w_ptr, kb, cols, cmask, s_n, s_k):
    """The e4m3 tile [32, BLOCK_N] W[e][cols, 32 kb + [0, 32)] of scale block kb (a whole block) as stored."""
    kk = kb * 32 + tl.arange(0, 32)
    return tl.load(w_ptr + kk[:, None] * s_k + cols[None, :] * s_n, mask=cmask[None, :], other=0.0)


@triton.jit
def w_block_scales(s_ptr, kb, cols, cmask, ss_n, ss_k):
    """The [BLOCK_N] float32 factors of W[e][cols]'s scale block kb, one byte load per column."""
    return e8m0_factor(tl.load(s_ptr + kb * ss_k + cols * ss_n, mask=cmask, other=0))


@triton.jit
def w_scale_word(s_ptr, kb0, cols, cmask, ss_n):
    """The scale bytes of blocks kb0 .. kb0 + 3 of W[e][cols] as one int32 word per column, block kb0 + j in
    bits [8j, 8j + 8) (F16_WORDS: the scales' rows contiguous and 4-byte aligned, kb0 a multiple of 4)."""
    return tl.load((s_ptr + kb0 + cols * ss_n).to(tl.pointer_type(tl.int32)), mask=cmask, other=0)


@triton.jit
def scale_step(s_ptr, k0, k_full, cols, cmask, ss_n, WORDS: tl.constexpr, BLOCK_K: tl.constexpr):
    """WORDS: the scale words (`w_scale_word`) of the K step at k0 (BLOCK_K 128 or 256), a pair (the second the
    first's for 128), masked to the whole steps (k0 < k_full); otherwise a pair of zeros, nothing loaded (a
    byte load per block then, in `group_scales`)."""
    if WORDS:
        ok = cmask & (k0 < k_full)
        w0 = w_scale_word(s_ptr, k0 // 32, cols, ok, ss_n)
        if BLOCK_K == 256:
            w1 = w_scale_word(s_ptr, k0 // 32 + 4, cols, ok, ss_n)
        else:
            w1 = w0
        out = w0, w1
    else:
        out = 0, 0
    return out


@triton.jit
def group_scales(words, q: tl.constexpr, j: tl.constexpr, s_ptr, kb0, cols, cmask, ss_n, ss_k, WORDS: tl.constexpr):
    """The float32 factors of block kb0 + j: byte j of word q of `scale_step`'s pair (WORDS), or block kb0 + j's
    byte loads (`w_block_scales`)."""
    if WORDS:
        out = e8m0_factor((words[q] >> (8 * j)) & 0xFF)
    else:
        out = w_block_scales(s_ptr, kb0 + j, cols, cmask, ss_n, ss_k)
    return out


@triton.jit
def mx_dot(a, w, sw, acc, DOT_PREC: tl.constexpr):
    """acc + (a @ fp16(w)) * sw[None, :]: one 32-block of k on the fp16 tensor cores (a: `row_f16`'s rows, w
    the block's e4m3 weights, sw their scale factors; e4m3's values are all fp16 normals, so the product is
    exact before the float32 accumulation), added to the float32 accumulator every 32 of k."""
    if DOT_PREC == "interp":
        p = tl.dot(a.to(tl.float32), w.to(tl.float32))
    else:
        p = tl.dot(a, w.to(tl.float16))
    return acc + p * sw[None, :]


@triton.jit
def w_tile_t(w_ptr, kk, cols, cmask, s_n, s_k):
    """The e4m3 tile [BLOCK_N, 32] W[e][cols, kk] of one scale block as stored (k along the tile's rows)."""
    return tl.load(w_ptr + cols[:, None] * s_n + kk[None, :] * s_k, mask=cmask[:, None], other=0.0)


@triton.jit
def mx_dot_t(a_row_t, stride_ak, a_k0, kb, rmask, w_ptr, cols, cmask, s_n, s_k, sw, acc_t, DOT_PREC: tl.constexpr):
    """acc_t + (fp16(W[e][cols, 32 kb + k]) @ A[rows, a_k0 + 32 kb + k]^T) * sw[:, None]: `mx_dot`'s block
    transposed (acc_t [BLOCK_N, BLOCK_M]), the weights on the MMA's 16-row side and A's few rows (BLOCK_M 8) on
    its 8-column side; a_row_t [1, BLOCK_M] the rows' starts. Against 16-row tiles (sm_90 SASS of the decode
    configs): half the MMAs (m16n8k16: a 16-row tile held 4 real routes in 16), half the float32 rescaling of
    the accumulator, no register copies of the A fragments; an expert past 8 routes has its weights read
    again, so the autotuner picks these tiles at decode sizes only."""
    kk = kb * 32 + tl.arange(0, 32)
    a_t = tl.load(a_row_t + (a_k0 + kk[:, None]) * stride_ak, mask=rmask[None, :], other=0.0)
    w = w_tile_t(w_ptr, kk, cols, cmask, s_n, s_k)
    if DOT_PREC == "interp":
        p = tl.dot(w.to(tl.float32), a_t.to(tl.float32))
    else:
        p = tl.dot(w.to(tl.float16), a_t)
    return acc_t + p * sw[:, None]


@triton.jit
def step_scales(s_ptr, k0, cols, cmask, ss_n, BLOCK_K: tl.constexpr):
    """The scale bytes [BLOCK_N, BLOCK_K // 32] (as int32) of the whole K step at k0 of W[e][cols], the scale
    rows contiguous (F16_WORDS runs where the scale words may be read: `scale_words`). Triton stages this load
    with the tile's (cp.async), as it feeds the dot's operand."""
    j = tl.arange(0, BLOCK_K // 32)
    return tl.load(s_ptr + cols[:, None] * ss_n + (k0 // 32 + j)[None, :], mask=cmask[:, None], other=0).to(tl.int32)


@triton.jit
def step_factors(s):
    """(f, top) of one K step's weight scale bytes s [BLOCK_N, G] (`step_scales`): top [BLOCK_N] each column's
    largest, f [BLOCK_N, G] the fp16 factors 2**(s - top), exact: normal down to 2**-14, subnormal down to
    2**-24, 0 below (a block under 2**-24 of the step's largest is dropped: its weights are under 2**-15 of
    the largest block's largest). Built as float32 powers of two (2**-30 at least) rounded to fp16: a few
    integer instructions an element, where each thread computes the factors of all the weights it holds."""
    top = tl.max(s, axis=1)
    d = tl.maximum(s - top[:, None], -30)
    return ((d + 127) << 23).to(tl.float32, bitcast=True).to(tl.float16), top


@triton.jit
def mx_step_t(a_t, w_ptr, k0, cols, cmask, s_n, s_k, sb, acc_t, DOT_PREC: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc_t + W[e][cols, k0 + k] @ a_t for a whole K step (a_t [BLOCK_K, BLOCK_M] fp16, `row_f16`'s rows
    transposed) as one fp16 dot: the weights scaled per column and 32-block by `step_factors` through a
    [BLOCK_N, BLOCK_K // 32, 32] view of the tile, the product by 2**(top - 127) in float32. What `mx_dot_t`
    computes for the step's blocks one by one, without splitting the step's loads and dots into 32-wide
    blocks: Triton lays the tile's shared-memory load out for the views, so the scaled tile stays in the dot
    operand's registers (no shared-memory round trip but the [BLOCK_N, BLOCK_K // 32] factors')."""
    f, top = step_factors(sb)
    w = w_tile_t(w_ptr, k0 + tl.arange(0, BLOCK_K), cols, cmask, s_n, s_k).to(tl.float16)
    BN: tl.constexpr = w.shape[0]
    w = tl.reshape(tl.reshape(w, (BN, BLOCK_K // 32, 32)) * f[:, :, None], (BN, BLOCK_K))
    if DOT_PREC == "interp":
        p = tl.dot(w.to(tl.float32), a_t.to(tl.float32))
    else:
        p = tl.dot(w, a_t)
    return acc_t + p * e8m0_factor(top)[:, None]


@triton.jit
def act_step_t(a_row_t, stride_ak, a_k0, k0, rmask, BLOCK_K: tl.constexpr):
    """A's rows' K step [k0, k0 + BLOCK_K) transposed, [BLOCK_K, BLOCK_M] (`mx_step_t`'s a_t)."""
    kk = a_k0 + k0 + tl.arange(0, BLOCK_K)
    return tl.load(a_row_t + kk[:, None] * stride_ak, mask=rmask[None, :], other=0.0)


@triton.jit
def _mx_block(acc, a_row, a_row_t, stride_ak, a_k0, kb, rmask, w_ptr, sw, cols, cmask, s_n, s_k,
              TRANS: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + scale block kb of A[rows, a_k0 + k] @ W[e][cols, k]^T through `mx_dot`, sw the block's weight scale
    factors; TRANS: through `mx_dot_t` (acc transposed; a_row_t the rows' starts as a [1, BLOCK_M] tile)."""
    if TRANS:
        out = mx_dot_t(a_row_t, stride_ak, a_k0, kb, rmask, w_ptr, cols, cmask, s_n, s_k, sw, acc, DOT_PREC)
    else:
        a = act_block(a_row, stride_ak, a_k0, kb, rmask)
        out = mx_dot(a, w_tile_e4m3(w_ptr, kb, cols, cmask, s_n, s_k), sw, acc, DOT_PREC)
    return out


@triton.jit
def _gate_up_mx_block(acc_g, acc_u, a_row, a_row_t, stride_xh, kb, rmask, wg, sg, wu, su, cols, cmask, g_n,
                      g_k, u_n, u_k, TRANS: tl.constexpr, DOT_PREC: tl.constexpr):
    """Scale block kb of the gate and up GEMMs (sg, su: the block's weight scale factors) through `_mx_block`;
    not TRANS, the activation block loaded once for both."""
    if TRANS:
        acc_g = _mx_block(acc_g, a_row, a_row_t, stride_xh, 0, kb, rmask, wg, sg, cols, cmask, g_n, g_k, TRANS,
                          DOT_PREC)
        acc_u = _mx_block(acc_u, a_row, a_row_t, stride_xh, 0, kb, rmask, wu, su, cols, cmask, u_n, u_k, TRANS,
                          DOT_PREC)
    else:
        a = act_block(a_row, stride_xh, 0, kb, rmask)
        bg = w_tile_e4m3(wg, kb, cols, cmask, g_n, g_k)
        bu = w_tile_e4m3(wu, kb, cols, cmask, u_n, u_k)
        acc_g = mx_dot(a, bg, sg, acc_g, DOT_PREC)
        acc_u = mx_dot(a, bu, su, acc_u, DOT_PREC)
    return acc_g, acc_u


@triton.jit
def _row_f16_kernel(a_ptr, stride_am, stride_ak, o_ptr, r_ptr, R, KA, BLOCK_R: tl.constexpr,
                    BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    """o[r] = a[r] / r_s[r] in fp16 (o [R, KA] contiguous), r_s[r] float32 the power of two that puts the row's
    largest finite magnitude in [2**14, 2**15) (fp16's largest octave), NaN for a row holding a NaN or an
    Inf (non-finite values propagate). ONE_PASS (BLOCK_K >= KA): each row loaded once, kept in registers
    between its maximum and its scaling; else two passes over BLOCK_K columns."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    a_row = a_ptr + rows[:, None].to(tl.int64) * stride_am
    o_row = o_ptr + rows[:, None].to(tl.int64) * KA
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    bad = tl.zeros((BLOCK_R,), dtype=tl.int32)
    if ONE_PASS:
        kk = tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (kk < KA)[None, :]
        a = tl.load(a_row + kk[None, :] * stride_ak, mask=m, other=0.0).to(tl.float32)
        amax, bad = _row_amax(a, amax, bad)
        mul, r_s = _row_f16_scale(amax, bad)
        _row_store(o_row, kk, a * mul[:, None], m)
    else:
        for k0 in range(0, KA, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_row + kk[None, :] * stride_ak, mask=rmask[:, None] & (kk < KA)[None, :], other=0.0)
            amax, bad = _row_amax(a.to(tl.float32), amax, bad)
        mul, r_s = _row_f16_scale(amax, bad)
        for k0 in range(0, KA, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (kk < KA)[None, :]
            a = tl.load(a_row + kk[None, :] * stride_ak, mask=m, other=0.0)
            _row_store(o_row, kk, a.to(tl.float32) * mul[:, None], m)
    tl.store(r_ptr + rows, r_s, mask=rmask)


@triton.jit
def _row_store(o_row, kk, v, m):
    """Store the scaled rows v (float32, [BLOCK_R, BLOCK_K] at columns kk) in fp16."""
    tl.store(o_row + kk[None, :], v.to(tl.float16), mask=m)


@triton.jit
def _row_amax(a, amax, bad):
    """(running largest finite magnitude, running count of non-finite elements) per row of the float32 tile a."""
    mag = tl.abs(a)
    finite = mag < float("inf")  # (false for NaN)
    amax = tl.maximum(amax, tl.max(tl.where(finite, mag, 0.0), axis=1))
    return amax, bad + tl.sum(tl.where(finite, 0, 1), axis=1)


@triton.jit
def _row_f16_scale(amax, bad):
    """(the factor 1 / r_s that puts amax in fp16's largest octave, r_s: a power of two, NaN where bad > 0)."""
    b = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax's biased exponent
    b = tl.minimum(tl.maximum(b, 15), 254)
    mul = ((268 - b) << 23).to(tl.float32, bitcast=True)  # 2**(141 - b)
    r_s = ((b - 14) << 23).to(tl.float32, bitcast=True)
    return mul, tl.where(bad > 0, float("nan"), r_s)


# rows of at most this many columns are scaled in one pass (`_row_f16_kernel`'s ONE_PASS), one row a program: the
# two-pass form's serial steps cost latency for the few hundred KB of a decode call's activations
ROW_F16_ONE_PASS_MAX = 8192


def row_f16(a_RK: torch.Tensor, one_pass_max: int = ROW_F16_ONE_PASS_MAX):
    """(a16 [R, KA] fp16, r_s [R] float32) with a = a16 * r_s[:, None] (`_row_f16_kernel`): the activations of
    the fp16 K loops; a row of at most `one_pass_max` columns read once, a longer one twice (the second time
    mostly from L2)."""
    R, KA = a_RK.shape
    a16 = torch.empty(R, KA, dtype=torch.float16, device=a_RK.device)
    r_s = torch.empty(R, dtype=torch.float32, device=a_RK.device)
    if R == 0:
        return a16, r_s
    if not _launch.at_least(KA, one_pass_max + 1, True):  # (a symbolic width: two passes, no guard)
        br, bk, one, warps = 1, _launch.next_pow2(KA), True, 4 if KA <= 4096 else 8
    else:
        br, bk, one, warps = 4, 32 if _launch.INTERPRET else 512, False, 4
    _launch.launch(_row_f16_kernel, (_launch.cdiv(R, br),), a_RK, a_RK.stride(0), a_RK.stride(1), a16, r_s, R, KA,
                   BLOCK_R=br, BLOCK_K=bk, ONE_PASS=one, num_warps=warps)
    return a16, r_s


class ExpertTable:
    """E [n, k] matrices of one shape, strides and dtype as one kernel operand read as [E, n, k]: the
    kernels read expert e at the address in entry e of `table` (int64, on the device), with the common
    strides (`expert_ptr`). Has a 3-D tensor's metadata for the launch wrappers: shape, stride() (0 between
    experts), dtype, device; `witness` is a tensor of the weights' dtype (the kernels cast the addresses
    to it), `aligned` whether every address is a multiple of 16 bytes."""

    def __init__(self, table, shape, strides, witness, aligned):
        self.table, self.witness, self.aligned = table, witness, aligned
        self.shape, self._strides = torch.Size(shape), tuple(strides)
        self.dtype, self.device = witness.dtype, witness.device

    @staticmethod
    def of(payload) -> Optional["ExpertTable"]:
        """The table of a 3-D tensor's experts (computed on the device, uncached: capturable, and free for a
        transient copy), or of a sequence of E 2-D tensors of one shape, strides, dtype and device (cached
        per set of addresses, `address_table`); None for a sequence that is not so uniform."""
        if isinstance(payload, torch.Tensor):
            ptr, step = payload.data_ptr(), payload.stride(0) * payload.element_size()
            table = torch.arange(payload.shape[0], dtype=torch.int64, device=payload.device) * step + ptr
            return ExpertTable(table, payload.shape, (0,) + payload.stride()[1:], payload,
                               ptr % 16 == 0 and step % 16 == 0)
        tensors = tuple(payload)
        if not tensors or not isinstance(tensors[0], torch.Tensor) or tensors[0].dim() != 2:
            return None
        t0 = tensors[0]
        meta = (t0.shape, t0.stride(), t0.dtype, t0.device)
        ptrs = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or (t.shape, t.stride(), t.dtype, t.device) != meta:
                return None
            ptrs.append(t.data_ptr())
        return ExpertTable(address_table(tuple(ptrs), t0.device), (len(tensors),) + tuple(t0.shape),
                           (0,) + t0.stride(), t0, all(p % 16 == 0 for p in ptrs))

    def t(self) -> "ExpertTable":
        """The transposed matrices ([E, k, n]): the same addresses, the strides swapped."""
        E, n, k = self.shape
        return ExpertTable(self.table, (E, k, n), (0, self._strides[2], self._strides[1]), self.witness,
                           self.aligned)

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]


# Eager launches load the non-gathered operand tiles (weights; the grouped row GEMM's sorted A rows too)
# through host-built TMA tensor descriptors where the layouts allow it (`tma_eligible`, `tma_weights`; faster
# than pointer loads at training and prefill sizes, slower at decode, where the descriptors' host cost and the
# TMA loads of a few rows do not pay). `options.tma` and `options.tma_min_rows` decide.


def _tma_view(d: torch.Tensor, kmajor: bool):
    """(the 2-D view [rows, cols] a TMA descriptor reads W[e] (n, k) through, R) or None: rows e*R + n, cols k
    (kmajor, k contiguous) or rows e*R + k, cols n. R is the expert stride in rows; the view ends at the last
    expert's last row, so it never reaches past the tensor (e.g. the gate half of a [E, 2I, H] buffer)."""
    E, n, k = d.shape
    s_e, s_n, s_k = d.stride()
    rows_per, cols, row_stride = (n, k, s_n) if kmajor else (k, n, s_k)
    if (s_k if kmajor else s_n) != 1 or row_stride < cols or (E > 1 and s_e % row_stride) or s_e < 0:
        return None
    R = s_e // row_stride if E > 1 else rows_per
    total = (E - 1) * R + rows_per
    if total >= 2 ** 31 or (row_stride * d.element_size()) % 16 or d.data_ptr() % 16:
        return None
    return torch.as_strided(d, (total, cols), (row_stride, 1)), R


def tma_pre_hook(a_names: tuple, w_names: tuple):
    """An eager pre-hook (`_launch.autotune`) giving the host descriptors in the named kernel arguments the
    block shapes of the config being launched: A operands [BLOCK_M, BLOCK_K], weights [BLOCK_N, BLOCK_K]
    (W_KMAJOR) or [BLOCK_K, BLOCK_N]."""
    def hook(nargs):
        if nargs["TMA"]:
            bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
            for a in a_names:
                nargs[a].block_shape = [bm, bk]
            for w in w_names:
                nargs[w].block_shape = [bn, bk] if nargs["W_KMAJOR"] else [bk, bn]

    return hook


# The device address tables of split weights, per (device, addresses), least recently used evicted past
# the bound (a CUDA graph that captured a kernel reading an evicted table would read freed memory at its
# replays: the bound is far above one entry per routed weight of each layer).
_TABLES: dict = {}
_TABLES_MAX = 1 << 14


def address_table(ptrs: tuple, device: torch.device) -> torch.Tensor:
    """int64 [E] on `device` holding `ptrs`, cached. A set of addresses seen for the first time is copied to
    the device synchronously (once per set of weights; then visible to every stream), which a CUDA-graph
    capture cannot do: its first call must come before the capture (warm-up)."""
    key = (device, ptrs)
    hit = _TABLES.pop(key, None)
    if hit is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split per-expert weights: their first call is under CUDA-graph capture, which "
                               "cannot copy the weights' address table to the device; run the layer once "
                               "before capturing (warm-up)")
        hit = torch.tensor(ptrs, dtype=torch.int64).to(device)
        while len(_TABLES) >= _TABLES_MAX:
            _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = hit  # (most recently used last)
    return hit


def w_args(op) -> tuple:
    """Kernel arguments of an operand (`mok_inductor.mxfp8.Operand` of 3-D tensors or of `ExpertTable`s)
    read as [E, n, k]: data, its strides, scales, their strides. A plain operand's scales are its data
    again (through a table: a tensor of its dtype, which the kernel reads the addresses as)."""
    d = op.data
    s = op.scale if op.scale is not None else d
    dp = d.table if isinstance(d, ExpertTable) else d
    if isinstance(s, ExpertTable):
        sp = s.table if op.scale is not None else s.witness
    else:
        sp = s
    return (dp, d.stride(0), d.stride(1), d.stride(2), sp, s.stride(0), s.stride(1), s.stride(2))


def w_meta(*ops) -> dict:
    """W_TABLE of a launch's weight operands, all tensors (0) or all `ExpertTable`s: 2 when every data
    address is 16-byte aligned, else 1."""
    tables = [isinstance(op.data, ExpertTable) for op in ops]
    if not any(tables):
        return dict(W_TABLE=0)
    if not all(tables):
        raise AssertionError("a launch's weight operands are all ExpertTables or all tensors")
    return dict(W_TABLE=2 if all(op.data.aligned for op in ops) else 1)


@triton.jit
def _dequant_kernel(
    w_ptr, s_e, s_n, s_k, q_ptr, q_e, q_n, q_k,  # e4m3 data [E, n, k] and E8M0 scales [E, n, k/32] (strided)
    out_ptr,  # [E, n, k] out, contiguous (the activation dtype)
    NR, KD, E,  # n, k (k a multiple of 32), experts
    TABLE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """[BLOCK_R, BLOCK_B, 32] tiles: BLOCK_B scale blocks of 32 along k per row, one scale load per block.
    TABLE: split per-expert data and scales read through address tables (as in expert_ptr)."""
    e64 = tl.program_id(2).to(tl.int64)
    w_ptr = expert_ptr(w_ptr, e64, s_e, E, TABLE, tl.float8e4nv)
    q_ptr = expert_ptr(q_ptr, e64, q_e, E, TABLE != 0, tl.uint8)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    j = tl.arange(0, 32)
    m2 = (rows < NR)[:, None] & (kb < KD // 32)[None, :]
    sc = tl.load(q_ptr + rows[:, None] * q_n + kb[None, :] * q_k, mask=m2, other=0)
    kk = kb[None, :, None] * 32 + j[None, None, :]
    m3 = m2[:, :, None]
    w = tl.load(w_ptr + rows[:, None, None] * s_n + kk * s_k, mask=m3, other=0.0)
    tl.store(out_ptr + e64 * NR * KD + rows[:, None, None] * KD + kk,
             (w.to(tl.float32) * e8m0_factor(sc)[:, :, None]).to(out_ptr.dtype.element_ty), mask=m3)


def dequantized(op: Operand, dtype: torch.dtype) -> Operand:
    """An MXFP8 operand (3-D) as a plain `dtype` one, [E, n, k] contiguous: one pass over the weight (read
    1 byte + 1/32 of a scale, write 2 per element), for the GEMMs whose rows per expert re-read each weight
    tile often enough that dequantizing it in every K loop costs more (kernels.MX_DEQUANTIZE_MIN_ROWS)."""
    if not op.quantized:
        return op
    d, q = op.data, op.scale
    table = 0
    if not isinstance(d, torch.Tensor):  # split per expert: read in place through address tables
        d, q = _split_payload(d, False), _split_payload(q, False)
        if isinstance(d, ExpertTable) and isinstance(q, ExpertTable):
            table = 2 if d.aligned else 1
        else:  # traced, or experts of different shapes/strides: one copy
            d, q = op.stacked()
    E, n, k = d.shape
    out = torch.empty(E, n, k, dtype=dtype, device=d.device)
    if out.numel() == 0:
        return plain(out)
    dp, qp = (d.table, q.table) if table else (d, q)
    br, bb = (8, 2) if _launch.INTERPRET else (32, 8)
    _launch.launch(_dequant_kernel, (_launch.cdiv(n, br), _launch.cdiv(k // 32, bb), E), dp, d.stride(0),
                   d.stride(1), d.stride(2), qp, q.stride(0), q.stride(1), q.stride(2), out, n, k, E, TABLE=table,
                   BLOCK_R=br, BLOCK_B=bb, num_warps=4)
    return plain(out)


@triton.jit
def clamp_gu(g, u, limit, HAS_LIMIT: tl.constexpr):
    """(clamp(g, max=limit), clamp(u, -limit, limit)); where() rather than min/max: a NaN is not clipped,
    it propagates."""
    if HAS_LIMIT:
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    return g, u


@triton.jit
def swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
    """silu(clamp(g, max=limit)) * clamp(u, -limit, limit) in float32."""
    g, u = clamp_gu(g, u, limit, HAS_LIMIT)
    return g * tl.sigmoid(g) * u


# ---------------------------------------------------------------------------------------------
# Gate/up GEMM with the gather of x rows; writes the pre-activations gu = [g | u] (what backward needs)
# and, WRITE_H, the clamped SwiGLU h of the rounded g, u


# the last: decode (a few rows per expert, the weights streamed)
_GATE_UP_CONFIGS = [cfg(128, 128, 64, 8, 3), cfg(128, 64, 64, 4, 4), cfg(64, 128, 64, 4, 4), cfg(128, 64, 64, 8, 4),
                    cfg(64, 64, 128, 4, 3), cfg(64, 64, 64, 4, 6)]


_GATE_UP_KEY = ["M", "H", "I", "E", "TOPK", "TMA"]


@triton.jit
def _gate_up_tile(
    x_ptr, stride_xt, stride_xh, xr_ptr, routes_ptr,
    wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k, wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k,
    gu_ptr, stride_gm, stride_gn, h_ptr, stride_hm, stride_hi, g_desc, u_desc, w_rows,
    H, I, E, TOPK, limit, above, below, group, row_start, row_end, pid_n,
    SINGLE: tl.constexpr, MX_G: tl.constexpr, MX_U: tl.constexpr, WRITE_H: tl.constexpr,
    HAS_LIMIT: tl.constexpr, KEEP_CLIP: tl.constexpr, DOT_PREC: tl.constexpr,
    W_TABLE: tl.constexpr, MX_LOOP: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The K loop and epilogue of one tile of expert `group`'s rows [row_start, row_end).
    MX_LOOP (`MxLoop`, not DEQUANTIZE): MXFP8 gate and up on the fp16 tensor cores by 32-blocks (`mx_dot`),
    BLOCK_K // 32 scale blocks per K step; x the fp16 rows of `row_f16`, xr_ptr their float32 scales.
    TMA: the weight tiles of the whole K steps through descriptors (`w_tma_tile`), the tail step and the
    gathered x rows by pointers."""
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    rows64 = rows[:, None].to(tl.int64)
    g_ptrs = gu_ptr + rows64 * stride_gm + cols[None, :] * stride_gn
    h_ptrs = h_ptr + rows64 * stride_hm + cols[None, :] * stride_hi
    omask = rmask[:, None] & cmask[None, :]
    if SINGLE:
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
    else:
        k_start = 0
        if TMA:
            k_start = H - H % BLOCK_K
            for k0 in range(0, k_start, BLOCK_K):
                a = tl.load(a_row + (k0 + ks)[None, :] * stride_xh, mask=rmask[:, None], other=0.0)
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
    g = to_out(acc_g, gu_ptr, DOT_PREC).to(tl.float32)
    u = to_out(acc_u, gu_ptr, DOT_PREC).to(tl.float32)
    if KEEP_CLIP:  # never round across a clamp bound (reference.round_keep_clip). where(), not min/max:
        # the GPU's min/max return the non-NaN operand, and a NaN must stay NaN (it compares false here)
        g = tl.where(acc_g > limit, tl.where(g < above, above, g), tl.where(g > below, below, g))
        u = tl.where(acc_u > limit, tl.where(u < above, above, u), tl.where(u > below, below, u))
        u = tl.where(acc_u < -limit, tl.where(u > -above, -above, u), tl.where(u < -below, -below, u))
    tl.store(g_ptrs, g.to(gu_ptr.dtype.element_ty), mask=omask)
    tl.store(g_ptrs + I * stride_gn, u.to(gu_ptr.dtype.element_ty), mask=omask)
    if WRITE_H:
        h = swiglu(g, u, limit, HAS_LIMIT)
        tl.store(h_ptrs, to_out(h, h_ptr, DOT_PREC), mask=omask)


@triton.jit
def _gate_up_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H] (MX_LOOP: fp16, `row_f16`)
    xr_ptr,  # MX_LOOP: x's row scales [T] float32 (else unused)
    routes_ptr, offsets_ptr,  # sorted_routes [M] int32, expert_offsets [E+1] int32
    wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k,  # gate read as [E, I, H]: data, scales [E, I, H/32] (MX_G)
    wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k,  # up read as [E, I, H]
    gu_ptr, stride_gm, stride_gn,  # gu [M, 2I] out: g in [0, I), u in [I, 2I) (tail rows zeroed)
    h_ptr, stride_hm, stride_hi,  # h [M, I] out (WRITE_H)
    g_desc, u_desc, w_rows,  # TMA: host descriptors of gate's and up's 2-D views, their R (`tma_weights`)
    M, H, I, E, TOPK,  # rows (routes), hidden, intermediate, experts, routes per token
    limit, above, below,  # swiglu clamp (HAS_LIMIT); the stored dtype's neighbours of it (KEEP_CLIP)
    SINGLE: tl.constexpr, MX_G: tl.constexpr, MX_U: tl.constexpr, WRITE_H: tl.constexpr,
    HAS_LIMIT: tl.constexpr, KEEP_CLIP: tl.constexpr, DOT_PREC: tl.constexpr, W_TABLE: tl.constexpr,
    MX_LOOP: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr, GROUPS_POW2: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Inductor passes Python floats as fp64 (the epilogue would compute in fp64): float32 scalars
    limit = tl.cast(limit, tl.float32)
    above = tl.cast(above, tl.float32)
    below = tl.cast(below, tl.float32)
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
                  stride_hi, g_desc, u_desc, w_rows, H, I, E, TOPK, limit, above, below, group, row_start, row_end,
                  pid_n, SINGLE, MX_G, MX_U, WRITE_H, HAS_LIMIT, KEEP_CLIP, DOT_PREC, W_TABLE, MX_LOOP, TMA,
                  W_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)


# one jitted body (its name is the one Inductor's code and profiles show), autotuned over two config lists
_gate_up_body = _gate_up_kernel
_gate_up_kernel = _launch.autotune(_GATE_UP_CONFIGS, cfg(16, 16, 32, 1, 1), key=_GATE_UP_KEY,
                                   eager_pre_hook=tma_pre_hook((), ("g_desc", "u_desc")))(_gate_up_body)
# The fp16 K loops (decode sizes): row tiles of 16 (mma.sync's shape, not wgmma's 64: few rows per expert, and the
# per-block scaling is BLOCK_M x BLOCK_N float32 work per 32 of k), long K steps, and the 8-row transposed tiles
# (`mx_dot_t`) that the eager autotuner picks at decode sizes, the down GEMM's with one dot a K step on one warp
_MX_F16_CONFIGS = [cfg(16, 64, 128, 4, 4), cfg(16, 128, 128, 4, 3), cfg(16, 64, 256, 4, 3), cfg(16, 32, 128, 2, 4),
                   cfg(16, 64, 64, 4, 6), cfg(32, 64, 128, 4, 4), cfg(64, 64, 128, 4, 3), cfg(128, 128, 64, 8, 3),
                   cfg(8, 32, 256, 2, 3), cfg(8, 64, 128, 4, 4), cfg(8, 32, 128, 1, 4)]
# compiled graphs (Inductor's default mode: one config) at up to `mx_few_rows` routes per expert on average take
# the eager autotuner's 8-row picks at decode (`few_rows`); the 16-row first config otherwise, and where the row
# count is symbolic (no guard)
_gate_up_f16_kernel = _launch.autotune(_MX_F16_CONFIGS, cfg(16, 16, 32, 1, 1), key=_GATE_UP_KEY + ["MX_LOOP"],
                                       few_rows=cfg(8, 32, 256, 2, 3))(_gate_up_body)


def few_rows_per_expert(M, E: int) -> bool:
    """Whether a launch over M sorted rows of E experts has at most `options.mx_few_rows` rows per expert on
    average (False where M is symbolic and that is not statically known)."""
    return not _launch.at_least(M, options.current().mx_few_rows * max(E, 1) + 1, True)


def scale_words(*ops) -> bool:
    """Whether these MXFP8 operands' scales can be read by 32-bit words of 4 blocks (`MxLoop.F16_WORDS`): plain
    tensors (not `ExpertTable`s) with contiguous rows, and the start, the expert and the row strides multiples
    of 4 bytes. Traced (torch.compile, no address), the start is the view's offset into its storage, the
    storage's own start taken as aligned: CUDA allocations are, and Inductor checks a compiled graph's inputs
    that it takes as aligned (an offset of a multiple of 16 bytes) on each call, copying any that is not
    (`copy_misaligned_inputs`)."""
    for op in ops:
        s = op.scale
        if not isinstance(s, torch.Tensor) or s.stride(2) != 1:
            return False
        start = s.storage_offset() if _launch.without_pointers((s,)) else s.data_ptr()
        if not all(_launch.known_multiple(v, 4) for v in (s.stride(1), s.stride(0), start)):
            return False
    return True


def use_mx_loop(act_dtype: torch.dtype, M, E: int, *ops) -> MxLoop:
    """The K loop of a GEMM of `act_dtype` activations over M sorted rows of E experts with these weight
    operands: `MxLoop.F16` (`mx_rows` may refine it) with every operand MXFP8 and bf16/fp16 activations at most
    `options.mx_f16_dot_max_rows` routes per expert on average, decided without a guard (a symbolic row count
    not statically that small keeps the dequantizing loop, whose 64-128-row tiles read each expert's weights
    once or twice where the fp16 loop's 8- and 16-row tiles read them again every few rows); float32
    activations (SPEC's 1e-4) always dequantize."""
    if not (act_dtype in (torch.bfloat16, torch.float16) and all(op is not None and op.quantized for op in ops)):
        return MxLoop.DEQUANTIZE
    if not _launch.at_least(M, options.current().mx_f16_dot_max_rows * max(E, 1) + 1, True):
        return MxLoop.F16
    return MxLoop.DEQUANTIZE


def mx_rows(a_RK, mx_loop: MxLoop, *ops):
    """(activations, their row scales or None, loop) of a launch: for the fp16 loops, a's rows scaled into fp16
    (`row_f16`), F16_WORDS where the operands' scales can be read by words; otherwise a as is."""
    if mx_loop == MxLoop.DEQUANTIZE:
        return a_RK, None, mx_loop
    a16, r_s = row_f16(a_RK)
    return a16, r_s, MxLoop.F16_WORDS if scale_words(*ops) else MxLoop.F16


def gate_up(x_TH, gate, up, gu_out, routes_N, offsets_E1, topk, limit, *, h_out=None, single=False):
    """gu_out[M, 2I] = [x[rows] @ gate[e]^T | x[rows] @ up[e]^T] per sorted row (before the clamp), and
    h_out[M, I] = swiglu of those (rounded) values when given. gate, up: `mxfp8.Operand`s read as [E, I, H]
    (SINGLE: all T rows, one expert given as [1, I, H] views)."""
    M = gu_out.shape[0]
    I = gu_out.shape[1] // 2
    if M == 0 or I == 0:
        return gu_out
    E, _, H = gate.data.shape
    def tiles(meta):
        return row_tiles_worst(M, E, meta["BLOCK_M"], single) * _launch.cdiv(I, meta["BLOCK_N"])

    mx_loop = use_mx_loop(x_TH.dtype, M, E, gate, up)
    tma = None if mx_loop or not tma_eligible(x_TH, M, E) else tma_weights((gate, up))
    h = h_out if h_out is not None else gu_out
    x_TH, xr, mx_loop = mx_rows(x_TH, mx_loop, gate, up)
    keep_clip = limit is not None and gu_out.dtype in (torch.bfloat16, torch.float16)
    above, below = (float(v) for v in reference.clip_bounds(limit, gu_out.dtype)) if keep_clip else (0.0, 0.0)
    _launch.launch(
        _gate_up_f16_kernel if mx_loop else _gate_up_kernel, lambda meta: (tiles(meta),),
        x_TH, x_TH.stride(0), x_TH.stride(1), xr, routes_N, offsets_E1,
        *w_args(gate), *w_args(up),
        gu_out, gu_out.stride(0), gu_out.stride(1), h, h.stride(0), h.stride(1),
        *((None, None, 1) if tma is None else (*tma[0], tma[1])),
        M, H, I, E, topk, 0.0 if limit is None else float(limit), above, below,
        SINGLE=single, MX_G=gate.quantized, MX_U=up.quantized, WRITE_H=h_out is not None,
        HAS_LIMIT=limit is not None, KEEP_CLIP=keep_clip, DOT_PREC=_launch.dot_precision(x_TH.dtype),
        MX_LOOP=int(mx_loop), TMA=tma is not None, W_KMAJOR=tma is not None and tma[2],
        GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=GROUP_M, **w_meta(gate, up),
        few_rows=bool(mx_loop) and few_rows_per_expert(M, E),
    )
    return gu_out


# ---------------------------------------------------------------------------------------------
# Grouped row GEMM: out[dest(r), n] = sum_k A[r, k] W1[e][n, k] (+ sum_k A[r, KD + k] W2[e][n, k])


# 128 x 256 first: the eager autotuner's pick for both launches (the forward down GEMM and the dx GEMM) at the
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


@triton.jit
def _grouped_rows_kernel(
    a_ptr, stride_am, stride_ak,  # A [M, KD or 2*KD], sorted rows (MX_LOOP: fp16, `row_f16`)
    ar_ptr,  # MX_LOOP: A's row scales [M] float32 (else unused)
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    w1_ptr, s1_e, s1_n, s1_k, q1_ptr, q1_e, q1_n, q1_k,  # W1[e] (n, k) data and scales (MX1), [E, NCOL, KD]
    w2_ptr, s2_e, s2_n, s2_k, q2_ptr, q2_e, q2_n, q2_k,  # W2[e], multiplies A's columns [KD, 2 KD) (TWO)
    out_ptr, stride_om, stride_on,  # out [rows, NCOL]; row = route (SCATTER) or the sorted row
    a_desc, w1_desc, w2_desc, w_rows,  # TMA: host descriptors of A and of W1's, W2's 2-D views, R (`_tma_args`)
    M, NCOL, KD, E,
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
    if SCATTER:
        dest = tl.load(routes_ptr + rows, mask=rmask, other=0)
    else:
        dest = rows
    o_ptrs = out_ptr + dest[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
    tl.store(o_ptrs, to_out(acc, out_ptr, DOT_PREC), mask=rmask[:, None] & cmask[None, :])


# TWO and SCATTER in the key: the down GEMM and the dx GEMM have the same sizes at some shapes
_GROUPED_ROWS_KEY = ["M", "NCOL", "KD", "E", "TWO", "SCATTER", "TMA"]
_grouped_rows_body = _grouped_rows_kernel
_grouped_rows_kernel = _launch.autotune(_GROUPED_ROWS_CONFIGS, cfg(16, 16, 32, 1, 1), key=_GROUPED_ROWS_KEY,
                                        eager_pre_hook=tma_pre_hook(("a_desc",), ("w1_desc", "w2_desc")))(_grouped_rows_body)
_grouped_rows_f16_kernel = _launch.autotune(_MX_F16_CONFIGS, cfg(16, 16, 32, 1, 1),
                                            key=_GROUPED_ROWS_KEY + ["MX_LOOP"],
                                            few_rows=cfg(8, 32, 128, 1, 4))(_grouped_rows_body)


def host_desc(t: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])  # (block shape: tma_pre_hook)


def row_desc(t: torch.Tensor):
    """A host descriptor of the 2-D tensor t read by whole rows, or None where TMA cannot read it: rows
    contiguous and not overlapping, the start and the row stride 16-byte aligned, at least one row."""
    if t.shape[0] == 0 or t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        return None
    if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    return host_desc(t)


def tma_eligible(act: torch.Tensor, rows: int, groups: int) -> bool:
    """Whether a launch with activations `act` and `rows` rows over `groups` experts may use host TMA
    descriptors: `options.tma` on, an eager launch (also under the interpreter) of 16-bit activations, at least
    `options.tma_min_rows` rows per expert on average. AOTAutograd's tracing of `wrap_triton` does not carry descriptor
    arguments (torch 2.11-2.13), and Inductor takes no pre-hook to set their block shapes per config: traced
    launches load every tile by pointers."""
    opts = options.current()
    if not opts.tma or act.element_size() != 2 or _launch.without_pointers((act,)):
        return False
    return rows >= opts.tma_min_rows * groups


def tma_weights(ops) -> Optional[tuple]:
    """(descriptors, R, W_KMAJOR) for the weight operands `ops` (all plain 3-D tensors of one layout and one
    expert stride in rows R, 16-byte aligned), or None (pointer loads)."""
    if any(op.quantized or not isinstance(op.data, torch.Tensor) for op in ops):
        return None
    kmajor = ops[0].data.stride(2) == 1
    views = [_tma_view(op.data, kmajor) for op in ops]
    if any(v is None for v in views) or len({v[1] for v in views}) != 1:
        return None
    return tuple(host_desc(v[0]) for v in views), views[0][1], kmajor


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


def grouped_rows(a_MK, w1, out, routes_N, offsets_E1, *, w2=None, scatter=True, single=False):
    """out[dest(r)] = A[r, :KD] @ W1[e]^T (+ A[r, KD:] @ W2[e]^T); w1, w2: `mxfp8.Operand`s read as
    [E, NCOL, KD]."""
    M = a_MK.shape[0]
    NCOL = out.shape[1]
    KD = a_MK.shape[1] // (2 if w2 is not None else 1)
    if M == 0 or NCOL == 0:
        return out
    E = w1.data.shape[0]
    two = w2 is not None
    w2 = w2 if two else w1
    grid = lambda meta: (row_tiles_worst(M, E, meta["BLOCK_M"], single) * _launch.cdiv(NCOL, meta["BLOCK_N"]),)
    mx_loop = use_mx_loop(a_MK.dtype, M, E, w1, w2)
    tma, tma_meta = _tma_args(a_MK, w1, w2, two, mx_loop)
    dot_prec = _launch.dot_precision(a_MK.dtype)
    a_MK, ar, mx_loop = mx_rows(a_MK, mx_loop, w1, w2)
    _launch.launch(
        _grouped_rows_f16_kernel if mx_loop else _grouped_rows_kernel, grid,
        a_MK, a_MK.stride(0), a_MK.stride(1), ar, routes_N, offsets_E1,
        *w_args(w1), *w_args(w2),
        out, out.stride(0), out.stride(1), *tma,
        M, NCOL, KD, E,
        SINGLE=single, SCATTER=scatter, TWO=two, MX1=w1.quantized, MX2=w2.quantized,
        DOT_PREC=dot_prec, MX_LOOP=int(mx_loop), GROUP_M=GROUP_M, GROUPS_POW2=_launch.next_pow2(E + 1),
        **tma_meta, **w_meta(w1, w2), few_rows=bool(mx_loop) and few_rows_per_expert(M, E),
    )
    return out


# ---------------------------------------------------------------------------------------------
# Combine: out[t] = S[t] * (sigmoid(logit[t]) | 1) + bias * bscale[t] + sum_k [valid] rw[t,k] Y[t*K+k]


@triton.jit
def _combine_kernel(
    y_ptr, stride_yr, stride_yh,  # Y [T*K, H] per-route rows
    te_ptr,  # top_experts [T*K] (validity: >= 0)
    rw_ptr,  # [T*K] route weights (HAS_RW; any float dtype, used in float32)
    s_ptr, stride_st, stride_sh,  # S [T, H] (HAS_S)
    logit_ptr,  # float32 [T]: S is scaled by sigmoid(logit) (S_SIGMOID)
    bias_ptr, bscale_ptr,  # bias [H], float32 [T] (HAS_BIAS)
    out_ptr, stride_ot, stride_oh,  # out [T, H]
    T, H, TOPK,
    HAS_RW: tl.constexpr, HAS_S: tl.constexpr, S_SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_H: tl.constexpr, TOPK_C: tl.constexpr,
):
    """out[t] = (S[t] (* sigmoid(logit[t])) + bias * bscale[t] +) sum over the valid routes k of Y[t*K + k] (* rw),
    in route order, in float32. TOPK_C (K as a constant, 0 where it is symbolic): the route loop unrolled, each
    route's row loaded whether valid or not (every row is in bounds; an invalid one's unwritten values are
    dropped by the select), so that the K loads go out together; the same sums in the same order as the loop
    over TOPK, where each row's load waited on its route's id."""
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
    if TOPK_C > 0:
        for k in tl.static_range(TOPK_C):
            r = t64 * TOPK_C + k
            valid = tl.load(te_ptr + r) >= 0
            y = tl.load(y_ptr + r * stride_yr + cols * stride_yh, mask=cmask, other=0.0).to(tl.float32)
            acc = _combine_route(acc, y, rw_ptr, r, valid, HAS_RW)
    else:
        for k in range(0, TOPK):
            r = t64 * TOPK + k
            valid = tl.load(te_ptr + r) >= 0
            y = tl.load(y_ptr + r * stride_yr + cols * stride_yh, mask=cmask & valid, other=0.0).to(tl.float32)
            acc = _combine_route(acc, y, rw_ptr, r, valid, HAS_RW)
    out = to_out(acc, out_ptr, DOT_PREC)
    tl.store(out_ptr + t64 * stride_ot + cols * stride_oh, out, mask=cmask)


@triton.jit
def _combine_route(acc, y, rw_ptr, r, valid, HAS_RW: tl.constexpr):
    """acc + rw[r] * y where route r is valid (one fused multiply-add, written out: the unrolled and the looped
    route loops are then the same arithmetic, where the compiler was free to contract acc + y * rw into an FMA in
    one and not the other, and the two differed in the last bit), acc where not (an invalid route's row, never
    written, may hold NaN)."""
    if HAS_RW:
        out = tl.where(valid, tl.fma(y, tl.load(rw_ptr + r).to(tl.float32), acc), acc)
    else:
        out = tl.where(valid, acc + y, acc)
    return out


# the combine's route loop unrolled for K up to this (`_combine_kernel`'s TOPK_C)
COMBINE_UNROLL_MAX = 16


def combine(y_NH, te_N, out_TH, *, rw_N=None, s_TH=None, logit_T=None, bias_H=None, bscale_T=None):
    """out[t] = the sum of y's rows of token t's valid routes (y [T*K, H]: every route's row, those of `-1` routes
    unwritten), weighted by rw, plus s (gated by sigmoid(logit)) and bias * bscale: `_combine_kernel`."""
    T, H = out_TH.shape
    if T == 0 or H == 0:
        return out_TH
    topk = te_N.numel() // T
    topk_c = int(topk) if is_concrete_int(topk) and int(topk) <= COMBINE_UNROLL_MAX else 0
    block_h = min(1024, _launch.next_pow2(H)) if not _launch.INTERPRET else min(64, _launch.next_pow2(H))
    dummy = out_TH
    _launch.launch(
        _combine_kernel, (T * _launch.cdiv(H, block_h),),
        y_NH, y_NH.stride(0), y_NH.stride(1), te_N,
        rw_N if rw_N is not None else dummy,
        s_TH if s_TH is not None else dummy, *(s_TH.stride() if s_TH is not None else (0, 0)),
        logit_T if logit_T is not None else dummy,
        bias_H if bias_H is not None else dummy, bscale_T if bscale_T is not None else dummy,
        out_TH, out_TH.stride(0), out_TH.stride(1),
        T, H, topk,
        HAS_RW=rw_N is not None, HAS_S=s_TH is not None, S_SIGMOID=logit_T is not None,
        HAS_BIAS=bias_H is not None, DOT_PREC=_launch.dot_precision(out_TH.dtype), BLOCK_H=block_h,
        TOPK_C=topk_c, num_warps=4,
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
    _launch.launch(_rowdot_kernel, (_launch.cdiv(T, bt),), x_TH, x_TH.stride(0), x_TH.stride(1),
                   w, w.stride(0), out, T, H, BLOCK_T=bt, BLOCK_H=bh)
    return out


# ---------------------------------------------------------------------------------------------
# Pieces of the forward shared by the routed and the shared expert, bf16 and MXFP8

def _split_payload(w, transposed: bool):
    """A sequence of E 2-D weights as an ExpertTable (no copy), or, while traced (no data pointers) or when
    the experts differ in shape or strides, as a tuple of (transposed) tensors, which kernels.forward stacks."""
    w = tuple(w)
    table = None if _launch.without_pointers(w) else ExpertTable.of(w)
    if table is not None:
        return table.t() if transposed else table
    return tuple(t.transpose(-2, -1) for t in w) if transposed else w


def plain(w) -> Operand:
    """A float weight (3-D, or a sequence of E 2-D tensors) as a kernel operand (no scales)."""
    return Operand(w if isinstance(w, torch.Tensor) else _split_payload(w, False), None)


def plain_t(w) -> Operand:
    """The transpose of a float weight ([E, a, b], or E x [a, b], read as [E, b, a]) as a kernel operand."""
    if isinstance(w, torch.Tensor):
        return Operand(w.transpose(-2, -1), None)
    return Operand(_split_payload(w, True), None)


def expert_mlp(x_TH, gate, up, down, gu_out, out, routes_N, offsets_E1, topk, limit, *, scatter, single=False):
    """gu_out = [g | u] (saved for backward) and out[dest(r)] = swiglu(g, u) @ down[e]^T for each sorted
    row r: the gate/up GEMM (which also writes h, freed on return) then the down GEMM. gate, up read as
    [E, I, H], down as [E, H, I]. (A down GEMM applying the SwiGLU to g, u tiles in its K loop instead of
    reading h ran at half the rate: its A operand goes through registers.)"""
    h = torch.empty(gu_out.shape[0], gu_out.shape[1] // 2, dtype=out.dtype, device=gu_out.device)
    gate_up(x_TH, gate, up, gu_out, routes_N, offsets_E1, topk, limit, h_out=h, single=single)
    return grouped_rows(h, down, out, routes_N, offsets_E1, scatter=scatter, single=single)


def flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous 1-D tensor (a view when it already is)."""
    t = t.reshape(-1)
    return t if t.is_contiguous() else t.contiguous()


def shared_forward(x_TH, s_gate, s_up, s_down, s_out_gate_1H, sorted_N, offsets_E1, swiglu_limit):
    """The shared expert (always x.dtype weights) -> (gu_shared [T, 2Is] (empty without one), its output
    s_TH [T, H] or None, the output gate's logits [T] float32 or None): the combine's inputs."""
    T, H = x_TH.shape
    if s_gate is None:
        return x_TH.new_empty(0, 0, dtype=reference.shared_saved_dtype(x_TH.dtype)), None, None
    dev, dtype = x_TH.device, x_TH.dtype
    gu_shared = torch.empty(T, 2 * s_gate.shape[0], dtype=reference.shared_saved_dtype(dtype), device=dev)
    s_TH = torch.empty(T, H, dtype=dtype, device=dev)
    expert_mlp(x_TH, plain(s_gate[None]), plain(s_up[None]), plain(s_down[None]), gu_shared, s_TH, sorted_N,
               offsets_E1, 1, swiglu_limit, scatter=False, single=True)
    logit_T = rowdot(x_TH, s_out_gate_1H) if s_out_gate_1H is not None else None
    return gu_shared, s_TH, logit_T
