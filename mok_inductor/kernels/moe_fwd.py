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

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from .. import reference
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
        # one scale load per element (L1 hits: 32 neighbours share one). Measured on the H200 (session 4): a
        # [BLOCK_N] row of scales per 32-block of k, spread with where(), was slower (decode 0.52 vs 0.37 ms);
        # so was (session 8) a [BLOCK_K/32, 32, BLOCK_N] tile times one [BLOCK_K/32, BLOCK_N] scale tile
        # broadcast in registers: fewer instructions in the sm_90 PTX, but decode 0.411 vs 0.359 ms. The
        # conversions (e4m3 -> f16 -> f32 -> bf16: F2F, a quarter of the float32 rate on Hopper) bound this
        # loop; an inline-PTX route with one F2F per two elements measured slower still (0.589 ms: Triton
        # packs the elements for the asm one by one), and Inductor cannot embed its multi-line asm string.
        # Decoding by bit moves measured slower too (session 11): e4m3's sign, exponent and mantissa shifted
        # into a bf16's (or a float32's) bits, NaN selected, then exact multiplies gave decode 0.600 (bf16)
        # and 0.595 ms (float32) against 0.362; Triton turns such 8- and 16-bit integer tiles into byte
        # permutes (PRMT) and integer multiply-adds, more instructions than the conversions they replace
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


# MXFP8 weights on the fp8 tensor cores (MX_DOT): each 32-block of k is one e4m3 x e4m3 tl.dot per activation
# term, scaled in float32 by the weight block's and the activation block's powers of two. The activations
# are split per 32-block into two e4m3 terms, hi + lo (about 2**-8 relative, bf16's precision: SPEC section 6
# asks for the bf16 computation on the dequantized weights within bf16's tolerance; one e4m3 term alone,
# 3 mantissa bits, is 3.6% off in tests/test_mxfp8.py). The weight tile goes to the dot as loaded (no
# per-element scale load; below wgmma's 64-row tiles Triton runs an e4m3 dot on sm_90 as fp16 MMAs, both
# operands unpacked e4m3 -> f16 first: sm_90 SASS, session 11). For bf16/fp16 activations at the K-loop
# sizes (few rows per expert: decode) when MX_FP8_DOT is on (off: measured slower, see there); float32
# activations (SPEC's 1e-4) always keep the dequantizing loop. MX_DOT == 2 (MX_F16_DOT, on at decode sizes:
# see there): the same blocks on the fp16 tensor cores instead, one activation term, exact: the block scaled
# by a power of two into fp16's range, where bf16's 8 significant bits fit in fp16's 11, and each weight
# e4m3 -> fp16 by one conversion per two elements (e4m3's values are all fp16 normals), without the
# dequantizing loop's float32 round trip and per-element scale multiply. MX_DOT == 3 (MX_F16_MODE 3, the
# default): the fp16 loop of 2 with the activations scaled per row, not per block, into fp16 once per call
# (`row_f16`), so that no program splits blocks; each block's product is scaled by the weight scales only, the
# row scales applied after the K loop (exact but for activations under 2**-24 of their row's largest).
# MX_DOT == 4: 3 with the weight scales read by 32-bit words of 4 blocks (SCALE_WORDS, `scale_words`); 5: with
# a K step's two words read by one 64-bit load (SCALE_WIDE); 8: 4 with each whole K step of the 8-row tiles as
# one dot (MX_ONE_DOT, `mx_step_t`).
# In modes 3 to 5 and 8 a row tile of 8 (BLOCK_M < 16: configs of _MX_DOT_CONFIGS) computes each block transposed
# (`mx_dot_t`); with words it loads each K step's words one step ahead.


# The K loop's plan of a mode, computed once here for both MXFP8 kernels (`_gate_up_tile`, `_grouped_rows_kernel`
# and its `_grouped_rows_k_loop`): each is a compile-time value of the kernel's constexprs.
@triton.constexpr_function
def mx_trans(mx_dot, block_m):
    """Whether the tile computes its blocks transposed (`mx_dot_t`): the 8-row tiles of modes 3 to 5 and 8, and
    every tile of the e4m3 pair modes 6 and 7."""
    return (mx_dot >= 3 and block_m < 16) or mx_dot in (6, 7)


@triton.constexpr_function
def mx_group(mx_dot, block_k):
    """The blocks one scale load gives: 4 where the scales are read by words (modes 4 to 6 and 8) and a K step
    holds whole words (BLOCK_K 128 or 256), else 1."""
    words = 4 <= mx_dot <= 6 or mx_dot == 8
    return 4 if words and block_k in (128, 256) else 1


@triton.constexpr_function
def mx_one(mx_dot, trans):
    """Whether each whole K step is one dot (`mx_step_t`): mode 8's transposed tiles."""
    return mx_dot == 8 and trans


@triton.constexpr_function
def mx_ahead(mx_dot, trans, block_k):
    """Whether the block loop loads the scale words one K step ahead: transposed tiles with words, but not those
    of one dot a step."""
    return trans and mx_group(mx_dot, block_k) == 4 and not mx_one(mx_dot, trans)


@triton.constexpr_function
def mx_wide(mx_dot, block_k):
    """Whether a K step's two scale words come by one 64-bit load (`w_scale_pair`): mode 5 at BLOCK_K 256."""
    return mx_dot == 5 and block_k == 256


@triton.constexpr_function
def mx_blk(mx_dot):
    """The mode of the loops by 32-blocks: mode 8's tail and its 16-row tiles run mode 4's."""
    return 4 if mx_dot == 8 else mx_dot


@triton.jit
def to_e4m3(v, DOT_PREC: tl.constexpr):
    """float32 v (|v| < 448) as e4m3, rounded to nearest even. The interpreter's conversion drops the carry
    when the mantissa rounds up into the next power of two (1.97 * 2**-6 -> 2**-6), so there the rounding is
    done by hand first: to the e4m3 spacing of v's octave (2**-9 below 2**-6, subnormals), by the float32
    add-and-subtract of 1.5 * 2**23 (exact, ties to even), leaving a value the conversion keeps as is."""
    if DOT_PREC == "interp":
        eb = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # v's octave, at least 2**-6's
        step = ((eb - 3) << 23).to(tl.float32, bitcast=True)
        q = v / step  # exact (a power of two), |q| < 16
        v = ((q + 12582912.0) - 12582912.0) * step
    return v.to(tl.float8e4nv)


@triton.jit
def mx_act_split(a, MODE: tl.constexpr, DOT_PREC: tl.constexpr):
    """(hi, lo, scale) of an activation tile [BLOCK_M, 32] (one 32-block of k per row); scale [BLOCK_M]
    float32, a power of two per row; NaN for a row whose block holds a NaN or an Inf (non-finite values
    propagate). MODE 1 (e4m3): hi + lo = a / scale within about 2**-8 relative, both e4m3, the block's largest
    magnitude put in [128, 256) (within e4m3's 448). MODE 2 (fp16): hi = lo = a / scale in fp16, the largest
    magnitude put in [2**14, 2**15) (within fp16's 65504); exact for every element above 2**-28 of it."""
    af = a.to(tl.float32)
    mag = tl.abs(af)
    finite = mag < float("inf")  # (false for NaN)
    amax = tl.max(tl.where(finite, mag, 0.0), axis=1)
    nonfinite = tl.sum(tl.where(finite, 0, 1), axis=1) > 0
    b = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax's biased exponent
    if MODE == 2:
        b = tl.minimum(tl.maximum(b, 15), 254)
        scale = ((b - 14) << 23).to(tl.float32, bitcast=True)  # 2**(b - 141)
        hi = (af * ((268 - b) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)  # a / scale
        lo = hi
    else:
        b = tl.minimum(tl.maximum(b, 8), 254)
        scale = ((b - 7) << 23).to(tl.float32, bitcast=True)  # 2**(b - 134)
        v = af * ((261 - b) << 23).to(tl.float32, bitcast=True)[:, None]  # a / scale (exact)
        hi = to_e4m3(v, DOT_PREC)
        lo = to_e4m3(v - hi.to(tl.float32), DOT_PREC)
    return hi, lo, tl.where(nonfinite, float("nan"), scale)


@triton.jit
def mx_act_block(a_row, stride_ak, a_k0, kb, rmask, MODE: tl.constexpr, DOT_PREC: tl.constexpr):
    """Scale block kb of the A rows (k = 32 kb + [0, 32), at column a_k0 + k of A; a whole block, MXFP8's k
    being a multiple of 32), split for mx_dot: (hi, lo, scale). MODE 3: A is already fp16, scaled per row
    (`row_f16`): (the block, the block, an unused scale)."""
    kk = kb * 32 + tl.arange(0, 32)
    a = tl.load(a_row + (a_k0 + kk[None, :]) * stride_ak, mask=rmask[:, None], other=0.0)
    if MODE >= 3:
        out = a, a, rmask.to(tl.float32)
    else:
        out = mx_act_split(a, MODE, DOT_PREC)
    return out


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
    bits [8j, 8j + 8) (MX_DOT 4: the scales' rows contiguous and 4-byte aligned, kb0 a multiple of 4)."""
    return tl.load((s_ptr + kb0 + cols * ss_n).to(tl.pointer_type(tl.int32)), mask=cmask, other=0)


@triton.jit
def w_scale_pair(s_ptr, kb0, cols, cmask, ss_n):
    """`w_scale_word`'s words of blocks kb0 .. kb0 + 3 and kb0 + 4 .. kb0 + 7 by one 64-bit load per column
    (MX_DOT 5: the scales' rows 8-byte aligned, kb0 a multiple of 8), the low word first (little-endian)."""
    v = tl.load((s_ptr + kb0 + cols * ss_n).to(tl.pointer_type(tl.int64)), mask=cmask, other=0)
    return v.to(tl.int32), (v >> 32).to(tl.int32)


@triton.jit
def scale_step(s_ptr, k0, k_full, cols, cmask, ss_n, WORDS: tl.constexpr, WIDE: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """WORDS: the scale words (`w_scale_word`) of the K step at k0 (BLOCK_K 128 or 256), a pair (the second the
    first's for 128), zeros where k0 is past the whole steps (a loop loading a step ahead never reads past a
    row's blocks); WIDE (BLOCK_K 256): the pair by one 64-bit load (`w_scale_pair`); otherwise a pair of zeros,
    nothing loaded (a byte load per block then, in `group_scales`)."""
    if WORDS:
        ok = cmask & (k0 < k_full)
        if WIDE:
            w0, w1 = w_scale_pair(s_ptr, k0 // 32, cols, ok, ss_n)
        else:
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
def mx_dot(hi, lo, sa, w, sw, acc, MODE: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + (hi @ w + lo @ w) * sa[:, None] * sw[None, :]: one 32-block of k on the fp8 tensor cores, scaled
    and added to the float32 accumulator every 32 of k (which also bounds the sums kept in the fp8 MMA's own
    accumulator, narrower than float32 on Hopper). MODE 2: acc + (hi @ fp16(w)) * ..., on the fp16 tensor
    cores (`mx_act_split`); MODE 3: acc + (hi @ fp16(w)) * sw[None, :], hi the rows scaled by `row_f16`, their
    scales applied by the caller after the K loop."""
    if MODE >= 2:
        if DOT_PREC == "interp":
            p = tl.dot(hi.to(tl.float32), w.to(tl.float32))
        else:
            p = tl.dot(hi, w.to(tl.float16))
    elif DOT_PREC == "interp":
        wf = w.to(tl.float32)
        p = tl.dot(hi.to(tl.float32), wf)
        p = tl.dot(lo.to(tl.float32), wf, p)
    else:
        p = tl.dot(hi, w)
        p = tl.dot(lo, w, p)
    if MODE >= 3:
        acc = acc + p * sw[None, :]
    else:
        acc = acc + p * (sa[:, None] * sw[None, :])
    return acc


@triton.jit
def w_tile_t(w_ptr, kk, cols, cmask, s_n, s_k):
    """The e4m3 tile [BLOCK_N, 32] W[e][cols, kk] of one scale block as stored (k along the tile's rows)."""
    return tl.load(w_ptr + cols[:, None] * s_n + kk[None, :] * s_k, mask=cmask[:, None], other=0.0)


@triton.jit
def mx_dot_t(a_row, a_row_t, stride_ak, a_k0, lo_off, kb, rmask, w_ptr, cols, cmask, s_n, s_k, sw, acc_t,
             PAIR: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc_t + (fp16(W[e][cols, 32 kb + k]) @ A[rows, a_k0 + 32 kb + k]^T) * sw[:, None]: `mx_dot`'s MODE 3 block
    transposed (acc_t [BLOCK_N, BLOCK_M]), the weights on the MMA's 16-row side and A's few rows (BLOCK_M 8) on
    its 8-column side; a_row_t [1, BLOCK_M] the rows' starts. Against 16-row tiles, in the sm_90 SASS of the
    qwen3 decode configs: half the MMAs (m16n8k16: the 16-row tile's rows were 4 real routes in 16), half the
    float32 rescaling of the accumulator, no register copies of the A fragments (the activations' fragments,
    loaded by LDS.64 in the permuted k order of the fp8 operand, were moved into place for every MMA): the
    gate/up K step 471 -> 298 instructions a warp, 128 -> 72 registers; down 447 -> 270. Only in the fp16 loops
    on rows scaled once (modes 3 to 5). Measured on the H200 (docs/benchmarks.md, run 17; qwen3, CUDA graphs):
    T=64 (4 routes per expert on average) 0.2656 against 0.2717 ms for 16-row tiles; with the scale words
    loaded a K step ahead (the loop's plain loads are not pipelined by Triton, which stages the dots' operands
    only; cheap here with the registers freed) 0.2611. At 8 routes (T=128) 0.3180 against 0.2784: an expert
    past 8 routes has its weights read again, so the autotuner picks them at decode sizes only. The kernel is
    bound by L2 (ncu: L2 76.8% of peak, DRAM 56%, occupancy 15.6% by shared memory), not by issue.
    PAIR (MX_DOT 6 and 7, `MX_FP8_ROWS`): A's rows are `row_e4m3`'s two e4m3 terms (hi at column k, lo at lo_off + k),
    the block the e4m3 product W @ hi^T + W @ lo^T, the weights going to the dot as stored: at 16-row tiles of
    BLOCK_N >= 64 on 4 warps, Hopper's e4m3 wgmma (sm_90 SASS: QGMMA.64x16x32, no conversion instruction; at
    8-row tiles Triton converts both operands to fp16 for mma.sync); the activation tiles loaded by rows, k
    contiguous, and transposed in shared memory (16-byte copies, where a [32, BLOCK_M] load copies 4 bytes)."""
    kk = kb * 32 + tl.arange(0, 32)
    if PAIR:
        hi = tl.trans(tl.load(a_row + (a_k0 + kk[None, :]) * stride_ak, mask=rmask[:, None], other=0.0))
        lo = tl.trans(tl.load(a_row + (a_k0 + lo_off + kk[None, :]) * stride_ak, mask=rmask[:, None], other=0.0))
        w = w_tile_t(w_ptr, kk, cols, cmask, s_n, s_k)
        if DOT_PREC == "interp":
            wf = w.to(tl.float32)
            p = tl.dot(wf, hi.to(tl.float32))
            p = tl.dot(wf, lo.to(tl.float32), p)
        else:
            p = tl.dot(w, hi)
            p = tl.dot(w, lo, p)
    else:
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
    rows contiguous (MX_DOT 8 runs where the scale words of mode 4 may be read: `scale_words`). Triton stages
    this load with the tile's (cp.async in the sm_90 TTGIR), as it feeds the dot's operand."""
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
    transposed; MX_DOT 8, `MX_ONE_DOT`) as one fp16 dot: the weights scaled per column and 32-block by
    `step_factors` through a [BLOCK_N, BLOCK_K // 32, 32] view of the tile, the product by 2**(top - 127) in
    float32. What `mx_dot_t` computes for the step's blocks one by one, without splitting the step's loads
    and dots into 32-wide blocks: Triton 3.6 lays the tile's shared-memory load out for the views, so the
    scaled tile stays in the dot operand's registers (sm_90 TTGIR: no shared-memory round trip but the
    [BLOCK_N, BLOCK_K // 32] factors')."""
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
def _mx_block(acc, a_row, a_row_t, stride_ak, a_k0, lo_off, kb, rmask, w_ptr, sw, cols, cmask, s_n, s_k,
              MODE: tl.constexpr, TRANS: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + scale block kb of A[rows, a_k0 + k] @ W[e][cols, k]^T through `mx_dot`, sw the block's weight scale
    factors; TRANS: through `mx_dot_t` (acc transposed; a_row_t the rows' starts as a [1, BLOCK_M] tile; MODE 6, 7:
    A's rows e4m3 pairs, lo at lo_off)."""
    if TRANS:
        out = mx_dot_t(a_row, a_row_t, stride_ak, a_k0, lo_off, kb, rmask, w_ptr, cols, cmask, s_n, s_k, sw, acc,
                       MODE == 6 or MODE == 7, DOT_PREC)
    else:
        hi, lo, sa = mx_act_block(a_row, stride_ak, a_k0, kb, rmask, MODE, DOT_PREC)
        out = mx_dot(hi, lo, sa, w_tile_e4m3(w_ptr, kb, cols, cmask, s_n, s_k), sw, acc, MODE, DOT_PREC)
    return out


@triton.jit
def _gate_up_mx_block(acc_g, acc_u, a_row, a_row_t, stride_xh, lo_off, kb, rmask, wg, sg, wu, su, cols, cmask, g_n,
                      g_k, u_n, u_k, MODE: tl.constexpr, TRANS: tl.constexpr, DOT_PREC: tl.constexpr):
    """Scale block kb of the gate and up GEMMs (sg, su: the block's weight scale factors) through `_mx_block`;
    not TRANS, the activation block split once for both."""
    if TRANS:
        acc_g = _mx_block(acc_g, a_row, a_row_t, stride_xh, 0, lo_off, kb, rmask, wg, sg, cols, cmask, g_n, g_k, MODE,
                          TRANS, DOT_PREC)
        acc_u = _mx_block(acc_u, a_row, a_row_t, stride_xh, 0, lo_off, kb, rmask, wu, su, cols, cmask, u_n, u_k, MODE,
                          TRANS, DOT_PREC)
    else:
        hi, lo, sa = mx_act_block(a_row, stride_xh, 0, kb, rmask, MODE, DOT_PREC)
        bg = w_tile_e4m3(wg, kb, cols, cmask, g_n, g_k)
        bu = w_tile_e4m3(wu, kb, cols, cmask, u_n, u_k)
        acc_g = mx_dot(hi, lo, sa, bg, sg, acc_g, MODE, DOT_PREC)
        acc_u = mx_dot(hi, lo, sa, bu, su, acc_u, MODE, DOT_PREC)
    return acc_g, acc_u


@triton.jit
def _row_f16_kernel(a_ptr, stride_am, stride_ak, o_ptr, r_ptr, R, KA, BLOCK_R: tl.constexpr,
                    BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, PAIR: tl.constexpr, DOT_PREC: tl.constexpr):
    """o[r] = a[r] / r_s[r] in fp16 (o [R, KA] contiguous), r_s[r] float32 the power of two that puts the row's
    largest finite magnitude in [2**14, 2**15) (fp16's largest octave), NaN for a row holding a NaN or an
    Inf (non-finite values propagate, as `mx_act_split`'s blocks). ONE_PASS (BLOCK_K >= KA): each row loaded
    once, kept in registers between its maximum and its scaling; else two passes over BLOCK_K columns.
    PAIR (`row_e4m3`): o [R, 2 KA] e4m3, a[r] / r_s[r] = o[r, :KA] + o[r, KA:] (hi + lo, `_row_store`), the largest
    magnitude put in [128, 256)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    a_row = a_ptr + rows[:, None].to(tl.int64) * stride_am
    o_row = o_ptr + rows[:, None].to(tl.int64) * (2 * KA if PAIR else KA)
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    bad = tl.zeros((BLOCK_R,), dtype=tl.int32)
    if ONE_PASS:
        kk = tl.arange(0, BLOCK_K)
        m = rmask[:, None] & (kk < KA)[None, :]
        a = tl.load(a_row + kk[None, :] * stride_ak, mask=m, other=0.0).to(tl.float32)
        amax, bad = _row_amax(a, amax, bad)
        mul, r_s = _row_f16_scale(amax, bad, PAIR)
        _row_store(o_row, kk, KA, a * mul[:, None], m, PAIR, DOT_PREC)
    else:
        for k0 in range(0, KA, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_row + kk[None, :] * stride_ak, mask=rmask[:, None] & (kk < KA)[None, :], other=0.0)
            amax, bad = _row_amax(a.to(tl.float32), amax, bad)
        mul, r_s = _row_f16_scale(amax, bad, PAIR)
        for k0 in range(0, KA, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            m = rmask[:, None] & (kk < KA)[None, :]
            a = tl.load(a_row + kk[None, :] * stride_ak, mask=m, other=0.0)
            _row_store(o_row, kk, KA, a.to(tl.float32) * mul[:, None], m, PAIR, DOT_PREC)
    tl.store(r_ptr + rows, r_s, mask=rmask)


@triton.jit
def _row_store(o_row, kk, KA, v, m, PAIR: tl.constexpr, DOT_PREC: tl.constexpr):
    """Store the scaled rows v (float32, [BLOCK_R, BLOCK_K] at columns kk): fp16, or (PAIR) e4m3 hi at column k
    and e4m3 lo = v - hi at KA + k: within about 2**-8 of v for |v| >= 2**-6 (hi's 4 significant bits, then the
    remainder's, `mx_act_split`'s two terms), within 2**-10 below (e4m3's subnormals); |v| < 256 fits both."""
    if PAIR:
        hi = to_e4m3(v, DOT_PREC)
        tl.store(o_row + kk[None, :], hi, mask=m)
        tl.store(o_row + KA + kk[None, :], to_e4m3(v - hi.to(tl.float32), DOT_PREC), mask=m)
    else:
        tl.store(o_row + kk[None, :], v.to(tl.float16), mask=m)


@triton.jit
def _row_amax(a, amax, bad):
    """(running largest finite magnitude, running count of non-finite elements) per row of the float32 tile a."""
    mag = tl.abs(a)
    finite = mag < float("inf")  # (false for NaN)
    amax = tl.maximum(amax, tl.max(tl.where(finite, mag, 0.0), axis=1))
    return amax, bad + tl.sum(tl.where(finite, 0, 1), axis=1)


@triton.jit
def _row_f16_scale(amax, bad, PAIR: tl.constexpr):
    """(the factor 1 / r_s that puts amax in fp16's largest octave, or PAIR in [128, 256), r_s: a power of two,
    NaN where bad > 0)."""
    b = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax's biased exponent
    if PAIR:
        b = tl.minimum(tl.maximum(b, 8), 254)
        mul = ((261 - b) << 23).to(tl.float32, bitcast=True)  # 2**(134 - b)
        r_s = ((b - 7) << 23).to(tl.float32, bitcast=True)
    else:
        b = tl.minimum(tl.maximum(b, 15), 254)
        mul = ((268 - b) << 23).to(tl.float32, bitcast=True)  # 2**(141 - b)
        r_s = ((b - 14) << 23).to(tl.float32, bitcast=True)
    return mul, tl.where(bad > 0, float("nan"), r_s)


# rows of at most this many columns are scaled in one pass (`_row_f16_kernel`'s ONE_PASS), one row a program: the
# two-pass form (4 rows a program, 512 columns a step) took 0.005 ms a launch at qwen3 decode (x: 64 rows of
# 2048; h: 512 rows of 768; H200 run 17), latency of its serial steps for a few hundred KB
ROW_F16_ONE_PASS_MAX = 8192


def row_f16(a_RK: torch.Tensor, pair: bool = False):
    """(a16 [R, KA] fp16, r_s [R] float32) with a = a16 * r_s[:, None] (`_row_f16_kernel`): the activations of a
    fp16 K loop of MX_DOT 3; a row of at most ROW_F16_ONE_PASS_MAX columns read once, a longer one twice (the
    second time mostly from L2). pair: `row_e4m3`'s."""
    R, KA = a_RK.shape
    a16 = torch.empty(R, 2 * KA if pair else KA, dtype=torch.float8_e4m3fn if pair else torch.float16,
                      device=a_RK.device)
    r_s = torch.empty(R, dtype=torch.float32, device=a_RK.device)
    if R == 0:
        return a16, r_s
    if not _launch.at_least(KA, ROW_F16_ONE_PASS_MAX + 1, True):  # (a symbolic width: two passes, no guard)
        br, bk, one, warps = 1, _launch.next_pow2(KA), True, 4 if KA <= 4096 else 8
    else:
        br, bk, one, warps = 4, 32 if _launch.INTERPRET else 512, False, 4
    _launch.launch(_row_f16_kernel, (_launch.cdiv(R, br),), a_RK, a_RK.stride(0), a_RK.stride(1), a16, r_s, R, KA,
                   BLOCK_R=br, BLOCK_K=bk, ONE_PASS=one, PAIR=pair, DOT_PREC=_launch.dot_precision(a_RK.dtype),
                   num_warps=warps)
    return a16, r_s


def row_e4m3(a_RK: torch.Tensor):
    """(a8 [R, 2 KA] float8_e4m3fn, r_s [R] float32) with a = (a8[:, :KA] + a8[:, KA:]) * r_s[:, None] within about
    2**-8 relative (two e4m3 terms of the row scaled by one power of two into [128, 256): `_row_store`), NaN
    scales for rows holding a NaN or an Inf: the activations of the fp8 K loop (MX_DOT 6 and 7, `MX_FP8_ROWS`)."""
    return row_f16(a_RK, pair=True)


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
# through host-built TMA tensor descriptors where the layouts allow it (`tma_eligible`, `tma_weights`): the
# down GEMM measured 3-8% faster than with pointer loads on the H200 (benchmarks/tma_ab.py, run 9).
# MOK_TMA=0 in the environment turns them off (every tile by pointers).
TMA_KERNELS = os.environ.get("MOK_TMA", "1") != "0"
# ... at training and prefill sizes only: at decode (qwen3, 4 rows per expert) the CUDA graph measured 0.346 ms
# with descriptors against 0.334 without, and the eager call 0.99 against 0.62 ms (H200, session 9)
TMA_MIN_ROWS = 128


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


# the last: decode (a few rows per expert, the weights streamed), 0.2095 -> 0.2006 ms at qwen3-decode (H200,
# benchmarks/decode_ab.py, session 7)
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
    HAS_LIMIT: tl.constexpr, KEEP_CLIP: tl.constexpr, DOT_PREC: tl.constexpr, PERSISTENT: tl.constexpr,
    W_TABLE: tl.constexpr, MX_DOT: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The K loop and epilogue of one tile of expert `group`'s rows [row_start, row_end). PERSISTENT: the
    tile may be idle (no rows) or of the `-1` tail group: no K step runs, and the tail's g, u, h are zero.
    MX_DOT (1 fp8, 2 and 3 fp16): MXFP8 gate and up on the tensor cores (`mx_dot`), BLOCK_K // 32 scale blocks per
    K step; 3: x the fp16 rows of `row_f16`, xr_ptr their float32 scales.
    TMA: the weight tiles of the whole K steps through descriptors (`w_tma_tile`; not PERSISTENT), the tail
    step and the gathered x rows by pointers."""
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
    if PERSISTENT:
        k_end = tl.where((group < E) & (row_start < row_end), H, 0)
    else:
        k_end = H
    if MX_DOT:  # the whole K steps, BLOCK_K // 32 blocks each, then the tail's blocks one by one (no k masks)
        k_full = k_end - k_end % BLOCK_K
        TRANS: tl.constexpr = mx_trans(MX_DOT, BLOCK_M)
        G: tl.constexpr = mx_group(MX_DOT, BLOCK_K)
        ONE: tl.constexpr = mx_one(MX_DOT, TRANS)
        AHEAD: tl.constexpr = mx_ahead(MX_DOT, TRANS, BLOCK_K)
        WIDE: tl.constexpr = mx_wide(MX_DOT, BLOCK_K)
        BLK: tl.constexpr = mx_blk(MX_DOT)
        a_row_t = x_ptr + tok[None, :].to(tl.int64) * stride_xt
        if TRANS:
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        nxt_g = scale_step(gs, 0, k_full, cols, cmask, gs_n, AHEAD, WIDE, BLOCK_K)
        nxt_u = scale_step(us, 0, k_full, cols, cmask, us_n, AHEAD, WIDE, BLOCK_K)
        for k0 in range(0, k_full, BLOCK_K):
            if ONE:
                a_t = act_step_t(a_row_t, stride_xh, 0, k0, rmask, BLOCK_K)
                acc_g = mx_step_t(a_t, wg, k0, cols, cmask, g_n, g_k,
                                  step_scales(gs, k0, cols, cmask, gs_n, BLOCK_K), acc_g, DOT_PREC, BLOCK_K)
                acc_u = mx_step_t(a_t, wu, k0, cols, cmask, u_n, u_k,
                                  step_scales(us, k0, cols, cmask, us_n, BLOCK_K), acc_u, DOT_PREC, BLOCK_K)
            else:
                if AHEAD:
                    cur_g, cur_u = nxt_g, nxt_u
                    nxt_g = scale_step(gs, k0 + BLOCK_K, k_full, cols, cmask, gs_n, AHEAD, WIDE, BLOCK_K)
                    nxt_u = scale_step(us, k0 + BLOCK_K, k_full, cols, cmask, us_n, AHEAD, WIDE, BLOCK_K)
                else:
                    cur_g = scale_step(gs, k0, k_full, cols, cmask, gs_n, G == 4, WIDE, BLOCK_K)
                    cur_u = scale_step(us, k0, k_full, cols, cmask, us_n, G == 4, WIDE, BLOCK_K)
                for q in tl.static_range(BLOCK_K // (32 * G)):
                    kb0 = k0 // 32 + G * q
                    for j in tl.static_range(G):
                        acc_g, acc_u = _gate_up_mx_block(
                            acc_g, acc_u, a_row, a_row_t, stride_xh, H, kb0 + j, rmask,
                            wg, group_scales(cur_g, q, j, gs, kb0, cols, cmask, gs_n, gs_k, G == 4),
                            wu, group_scales(cur_u, q, j, us, kb0, cols, cmask, us_n, us_k, G == 4),
                            cols, cmask, g_n, g_k, u_n, u_k, BLK, TRANS, DOT_PREC)
        for kb in range(k_full // 32, k_end // 32):
            acc_g, acc_u = _gate_up_mx_block(acc_g, acc_u, a_row, a_row_t, stride_xh, H, kb, rmask,
                                             wg, w_block_scales(gs, kb, cols, cmask, gs_n, gs_k),
                                             wu, w_block_scales(us, kb, cols, cmask, us_n, us_k),
                                             cols, cmask, g_n, g_k, u_n, u_k, BLK, TRANS, DOT_PREC)
        if TRANS:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        if MX_DOT >= 3:  # x's row scales
            r_s = tl.load(xr_ptr + tok, mask=rmask, other=1.0)[:, None]
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
        for k0 in range(k_start, k_end, BLOCK_K):
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
    if PERSISTENT:  # the `-1` routes' slots: zero g, u (and h)
        g = tl.where(group < E, g, 0.0)
        u = tl.where(group < E, u, 0.0)
    tl.store(g_ptrs, g.to(gu_ptr.dtype.element_ty), mask=omask)
    tl.store(g_ptrs + I * stride_gn, u.to(gu_ptr.dtype.element_ty), mask=omask)
    if WRITE_H:
        h = swiglu(g, u, limit, HAS_LIMIT)
        tl.store(h_ptrs, to_out(h, h_ptr, DOT_PREC), mask=omask)


@triton.jit
def _gate_up_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H] (MX_DOT 3: fp16, `row_f16`)
    xr_ptr,  # MX_DOT 3: x's row scales [T] float32 (else unused)
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
    MX_DOT: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr, GROUPS_POW2: tl.constexpr,
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
                  pid_n, SINGLE, MX_G, MX_U, WRITE_H, HAS_LIMIT, KEEP_CLIP, DOT_PREC, False, W_TABLE, MX_DOT, TMA,
                  W_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)


# one jitted body (its name is the one Inductor's code and profiles show), autotuned over two config lists
_gate_up_body = _gate_up_kernel
_gate_up_kernel = _launch.autotune(_GATE_UP_CONFIGS, cfg(16, 16, 32, 1, 1), key=_GATE_UP_KEY,
                                   eager_pre_hook=tma_pre_hook((), ("g_desc", "u_desc")))(_gate_up_body)
# MX_DOT (decode sizes): row tiles of 16 (the fp8 tensor cores' mma.sync shape, not wgmma's 64: few rows per
# expert, and the per-block scaling is BLOCK_M x BLOCK_N float32 work per 32 k) and long K steps
# (the 8-row tiles: `mx_dot_t`; the eager autotuner's picks at qwen3 decode, gate/up and down, H200 run 17; the
# down GEMM's with one dot a K step, 8x32x128 of one warp, H100 run 20)
_MX_DOT_CONFIGS = [cfg(16, 64, 128, 4, 4), cfg(16, 128, 128, 4, 3), cfg(16, 64, 256, 4, 3), cfg(16, 32, 128, 2, 4),
                   cfg(16, 64, 64, 4, 6), cfg(32, 64, 128, 4, 4), cfg(64, 64, 128, 4, 3), cfg(128, 128, 64, 8, 3),
                   cfg(8, 32, 256, 2, 3), cfg(8, 64, 128, 4, 4), cfg(8, 32, 128, 1, 4)]
# compiled graphs (Inductor's default mode: one config) at up to MX_FEW_ROWS routes per expert on average: the
# eager picks at qwen3 decode T=64 (4 routes), 0.2638 ms with both fixed against 0.2708 for the best 16-row
# pair (H200 run 17); the 16-row first config otherwise, and where the row count is symbolic (no guard). With
# whole K steps as one dot (MX_DOT 8, on the 8-row tiles alone) eager autotuning picks the 8-row tiles at T=128
# (8 routes) too, 0.2576 ms against 0.3188 for the 16-row ones, and the down GEMM's 8x32x128 of one warp at
# both (H100 run 20)
MX_FEW_ROWS = 8
_gate_up_mx_dot_kernel = _launch.autotune(_MX_DOT_CONFIGS, cfg(16, 16, 32, 1, 1), key=_GATE_UP_KEY + ["MX_DOT"],
                                          few_rows=cfg(8, 32, 256, 2, 3))(_gate_up_body)
# MX_DOT 6 and 7 (`MX_FP8_ROWS`): 16-row tiles (Triton's e4m3 wgmma wants 16 columns of the transposed product, at
# 8 it converts to fp16 for mma.sync) of 64 or 128 weight columns on 4 or 8 warps (one or two warpgroups)
# (sm_90 shared memory of the gate/up kernel, compiled here: 82 KB at 16x64x128 with 4 stages, 41 KB with 2, 123 KB
# at 16x64x256 with 3)
_MX8_CONFIGS = [cfg(16, 64, 128, 4, 4), cfg(16, 64, 128, 4, 3), cfg(16, 64, 128, 4, 2), cfg(16, 64, 256, 4, 2),
                cfg(16, 64, 256, 4, 3), cfg(16, 128, 128, 4, 3), cfg(16, 128, 128, 8, 4), cfg(32, 64, 128, 4, 4),
                cfg(64, 64, 128, 4, 3)]
_gate_up_mx8_kernel = _launch.autotune(_MX8_CONFIGS, cfg(16, 16, 32, 1, 1), key=_GATE_UP_KEY + ["MX_DOT"],
                                       few_rows=_MX8_CONFIGS[0])(_gate_up_body)


def few_rows_per_expert(M, E: int) -> bool:
    """Whether a launch over M sorted rows of E experts has at most MX_FEW_ROWS rows per expert on average
    (False where M is symbolic and that is not statically known)."""
    return not _launch.at_least(M, MX_FEW_ROWS * max(E, 1) + 1, True)


@_launch.autotune(_GATE_UP_CONFIGS, cfg(16, 16, 32, 1, 1), key=_GATE_UP_KEY)
@triton.jit
def _gate_up_persistent_kernel(
    x_ptr, stride_xt, stride_xh, xr_ptr, routes_ptr, offsets_ptr,
    wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k, wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k,
    gu_ptr, stride_gm, stride_gn, h_ptr, stride_hm, stride_hi, g_desc, u_desc, w_rows,
    M, H, I, E, TOPK, limit, above, below,
    SINGLE: tl.constexpr, MX_G: tl.constexpr, MX_U: tl.constexpr, WRITE_H: tl.constexpr,
    HAS_LIMIT: tl.constexpr, KEEP_CLIP: tl.constexpr, DOT_PREC: tl.constexpr, W_TABLE: tl.constexpr,
    MX_DOT: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr, GROUPS_POW2: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """_gate_up_kernel's tiles (the same arguments; never TMA) looped over by a grid of about one program per SM, the
    tile loop flattened into the K loop (the next tile's loads can overlap this tile's epilogue)."""
    limit = tl.cast(limit, tl.float32)
    above = tl.cast(above, tl.float32)
    below = tl.cast(below, tl.float32)
    if SINGLE:
        num_m = tl.cdiv(M, BLOCK_M)
    else:
        num_m = tl.cdiv(M, BLOCK_M) + E + 1
    for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(I, BLOCK_N), tl.num_programs(0), flatten=True):
        pid_m, pid_n = _tile_ids(tile, M, E, I, SINGLE, BLOCK_M, BLOCK_N, GROUP_M)
        group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, SINGLE, True, BLOCK_M, GROUPS_POW2)
        _gate_up_tile(x_ptr, stride_xt, stride_xh, xr_ptr, routes_ptr, wg_ptr, g_e, g_n, g_k, gs_ptr, gs_e, gs_n, gs_k,
                      wu_ptr, u_e, u_n, u_k, us_ptr, us_e, us_n, us_k, gu_ptr, stride_gm, stride_gn, h_ptr,
                      stride_hm, stride_hi, None, None, 1, H, I, E, TOPK, limit, above, below, group, row_start,
                      row_end, pid_n, SINGLE, MX_G, MX_U, WRITE_H, HAS_LIMIT, KEEP_CLIP, DOT_PREC, True, W_TABLE,
                      MX_DOT, False, False, BLOCK_M, BLOCK_N, BLOCK_K)


# The gate/up GEMM as a persistent kernel (_gate_up_persistent_kernel): an A/B candidate, off until measured
# on the H200 (a plain persistent Triton GEMM beat the non-persistent one by 6-17% on the forward layouts,
# benchmarks/ceiling.py); PERSISTENT_PROGRAMS programs per SM.
PERSISTENT_GATE_UP = False
PERSISTENT_PROGRAMS = 1


def _num_sms(device) -> int:
    if device.type != "cuda":
        return 4  # (the interpreter: a few programs, each looping over several tiles)
    return torch.cuda.get_device_properties(device).multi_processor_count


# MXFP8 operands read in a K loop go to the fp8 tensor cores (mx_dot) when the activations are bf16/fp16 and
# this is on. Off: measured slower on the H200 (session 7, benchmarks/decode_ab.py --mxfp8): the qwen3 decode
# graph 0.403 ms against 0.362 for the dequantizing loop (gate/up 1.55 against 1.85 TB/s of weights; every
# program of a row tile splits the same activations again, I / BLOCK_N times over), and at prefill sizes
# (benchmarks/mx_ab.py) 0.13-0.17x bf16 mok (the per-block float32 scaling of the accumulator runs on the
# CUDA cores). The candidate next step: the activations split once (x per call, h in the gate/up epilogue).
MX_FP8_DOT = False
# The same per-32-block K loop on the fp16 tensor cores (MX_DOT 2: one exact fp16 activation term, the e4m3
# weights converted to fp16 as loaded), on where the routes are few per expert: at most MX_F16_DOT_MAX_ROWS per
# expert on average, decided without a guard (a symbolic row count that is not statically that small keeps the
# dequantizing loop). The dequantizing loop is bound by its conversions (e4m3 -> f16 -> f32, scale, -> bf16);
# this keeps only the first, one per two elements. Measured on the H200 (docs/benchmarks.md, run 14; qwen3,
# CUDA graphs, benchmarks/decode_ab.py --mxfp8 [--tokens]), ms against the dequantizing loop's: 4 routes per
# expert (decode, T=64) 0.3368 against 0.3596 (down 2.25 against 1.79 TB/s of weights, gate/up 1.91 against
# 1.85), 8 routes 0.3422 against 0.3604; but 16 routes 0.4486 against 0.3641, 64 routes 1.206 against 0.493:
# its 16-row tiles read each expert's weights again every 16 rows, where the dequantizing loop's 64-128-row
# tiles read them once or twice. Since run 16 (MX_DOT 4, rows scaled once, scales by words): 16 routes 0.3500
# against the dequantizing loop's 0.3658, 32 routes 0.4947 against 0.3695; so up to 16.
MX_F16_DOT = True
MX_F16_DOT_MAX_ROWS = 16
# Which fp16 loop that is: 2 the activations scaled per 32-block in every program (`mx_act_split`), or 3 (the
# default) scaled per row into fp16 once per call (`row_f16`: x before the gate/up GEMM, h before the down
# GEMM), the K loop then scaling each block's product by the weight scales only. Measured on the H200
# (docs/benchmarks.md, run 15; qwen3, CUDA graphs), ms: T=64 (4 routes per expert) 0.2901 against mode 2's
# 0.3337 (gate/up 2.36 against 1.93 TB/s of weights, down 2.67 against 2.26; the two row_f16 passes 0.010),
# T=256 (16 routes) 0.3795 against 0.4480: the per-program activation split was
# the larger part of mode 2's overhead.
MX_F16_MODE = 3


# MX_DOT 4: MX_DOT 3 with each column's scales of 4 blocks (128 of k) read by one 32-bit load where the scale
# rows allow (`scale_words`), not by a byte load per block: 4x fewer L2 requests for the scales, whose byte
# loads (L1 misses) were about as many sector requests as the weights' own. Measured on the H200
# (docs/benchmarks.md, run 16; qwen3, CUDA graphs): T=64 0.2646 against 0.2905 ms (the gate/up kernel under
# ncu 153 against 179 us, DRAM 56% against 48% of peak), T=256 0.3490 against 0.3794. The words loaded a K
# step ahead measured slower (0.3536 at T=256), as did the bytes a step ahead (0.2944 at T=64)
SCALE_WORDS = True


# MX_DOT 5: MX_DOT 4 with a K step's two words (BLOCK_K 256) read by one 64-bit load per column where the scale
# rows are 8-byte aligned (`scale_words(..., 8)`). The 8-row transposed tiles' gate/up loop (8x32x256) loads 8 words
# a warp per step, each request 8 sectors (a thread holds 2 columns, a quad shares them): 128 sector requests a
# program per step besides the weights' 512; 64 with the pairs. Expected at qwen3 decode T=64 from run 16's
# rate (the words cut the 16-row loop's scale loads from 32 to 8 a thread per K step of 128, each request 4 to 8
# sectors by the MMA layout, over 16 steps and 3072 programs: 9.4M to 18.9M requests for 26 us of the gate/up
# kernel): 64 x 8 steps x 3072 = 1.6M fewer, 2 to 4 us of the kernel's 150 (the sector counts are read from the
# layouts, not measured: mx_decode_suite.sh's ncu part counts them). Not yet measured: off
SCALE_WIDE = False


# The K loop by 32-blocks on the e4m3 tensor cores without converting the weights (MX_DOT 6 with scale words, 7
# with byte loads): the activation rows split once per call into two e4m3 terms of one power-of-two scale
# (`row_e4m3`: hi + lo within about 2**-8 of the row, bf16's precision: SPEC section 6's tolerance holds), each
# block W @ hi^T + W @ lo^T in one accumulator (`mx_dot_t`, 16-row tiles: Hopper's e4m3 wgmma, QGMMA.64x16x32 in
# the sm_90 SASS), scaled by the weight scales. Where the fp16 loop converts every e4m3 weight to fp16 (F2FP: a
# quarter of its K step's instructions at the 8-row decode tiles) and runs mma.sync, this reads the weights from
# shared memory into the MMA as stored. Measured on the H100 (docs/benchmarks.md, run 18; qwen3 decode T=64, CUDA
# graphs): 0.3116 against the fp16 loop's 0.3001 ms (gate/up 2.15 against 2.27 TB/s of weights), so the
# conversion is not what holds the fp16 loop back; an A/B candidate (decode_ab's `fp8 rows`), off
MX_FP8_ROWS = False


# MX_DOT 8: MX_DOT 4 with each whole K step of the 8-row transposed tiles as one fp16 dot (`mx_step_t`), the
# weights scaled per column and 32-block in fp16 through a 3-D view of the step's tile, not one dot and one
# float32 rescale per block. Why: the K-loop styles alone (benchmarks/mx_stream_ab.py, H200 run 19) stream
# the weights at 3.86 TB/s with one fp16 dot per step and no scales (f16one), 2.72 with the step's 32-blocks as
# separate loads and dots (f16nos), 2.64 as the package's loop: the loss is in splitting the step, and run 19's
# one-dot form with per-element factors (f16el, 1.34) lost it again to a shared-memory round trip of the scaled
# tile. With the factors applied through the [BLOCK_N, G, 32] view the sm_90 code (compiled on the CPU machine:
# benchmarks/sass_loop.py --mode 8, mx_stream_ab's f16v) loads the step's tile by 12 LDGSTS as f16one does and
# keeps it in registers. Expected: the gate/up and down GEMMs (0.147 and 0.070 of run 19's 0.2487 ms at qwen3
# decode T=64) at up to f16one's rate, about 0.18 ms, against issue 8's 0.202 ms for 1.6x. Measured (H100 run 20,
# docs/benchmarks.md; qwen3 decode, CUDA graphs, the same call): T=64 0.2574 ms against mode 4's 0.2974 and bf16
# MoK's 0.4419 (0.2511 with the down GEMM on 8x32x128 of 1 warp), T=128 0.2759 against 0.3195 (the 8-row tiles
# then the autotuner's pick over the 16-row ones); mx_stream_ab's f16v 2.63 TB/s against f16one's 2.74. On by
# default since session 21
MX_ONE_DOT = True


def scale_words(*ops, width: int = 4) -> bool:
    """Whether these MXFP8 operands' scales can be read by loads of `width` bytes (4: 32-bit words of 4 blocks,
    MX_DOT 4; 8: pairs of them, MX_DOT 5): plain tensors (not `ExpertTable`s) with contiguous rows, and the
    start, the expert and the row strides multiples of `width` bytes. Traced (torch.compile, no address), the
    start is the view's offset into its storage, the storage's own start taken as aligned: CUDA allocations
    are, and Inductor checks a compiled graph's inputs that it takes as aligned (an offset of a multiple of 16
    bytes) on each call, copying any that is not (`copy_misaligned_inputs`)."""
    for op in ops:
        s = op.scale
        if not isinstance(s, torch.Tensor) or s.stride(2) != 1:
            return False
        start = s.storage_offset() if _launch.without_pointers((s,)) else s.data_ptr()
        if not all(_launch.known_multiple(v, width) for v in (s.stride(1), s.stride(0), start)):
            return False
    return True


def mx_rows(a_RK, mx_dot: int, *ops):
    """The activations and mode a K loop by 32-blocks launches with: for MX_F16_MODE 3, a's rows scaled into
    fp16 (`row_f16`) and their scales, MX_DOT 4 where the operands' scales can be read by words (5 by pairs
    of words); with MX_FP8_ROWS, a's rows as e4m3 pairs (`row_e4m3`) and their scales, MX_DOT 6 with words, 7
    with byte loads; otherwise a as is, no scales, mx_dot."""
    if mx_dot != 3:
        return a_RK, None, mx_dot
    words = SCALE_WORDS and scale_words(*ops)
    if MX_FP8_ROWS:
        a8, r_s = row_e4m3(a_RK)
        return a8, r_s, 6 if words else 7
    a16, r_s = row_f16(a_RK)
    if words:
        return a16, r_s, 8 if MX_ONE_DOT else 5 if SCALE_WIDE and scale_words(*ops, width=8) else 4
    return a16, r_s, 3


def mx_kernel(mx_dot: int, plain, mx, mx8):
    """The autotuned kernel of a launch in mode mx_dot (after `mx_rows`): the plain loop's, the K loop by
    32-blocks' (`_MX_DOT_CONFIGS`), or its e4m3-pair form's (MX_DOT 6 and 7, `_MX8_CONFIGS`)."""
    return mx8 if mx_dot in (6, 7) else mx if mx_dot else plain


def use_mx_dot(act_dtype: torch.dtype, M, E: int, *ops) -> int:
    """How a GEMM of `act_dtype` activations over M sorted rows of E experts with these weight operands runs
    its K loop by 32-blocks on the tensor cores (`mx_dot`): 0 not (the dequantizing loop), 1 fp8, 2 or 3 fp16
    (MX_F16_MODE). Only with every operand MXFP8 (read in the K loop) and bf16/fp16 activations (float32's
    1e-4 needs the exact dequantized weights in a float32 dot)."""
    if not (act_dtype in (torch.bfloat16, torch.float16) and all(op is not None and op.quantized for op in ops)):
        return 0
    if MX_F16_DOT and not _launch.at_least(M, MX_F16_DOT_MAX_ROWS * max(E, 1) + 1, True):
        return MX_F16_MODE
    return 1 if MX_FP8_DOT else 0


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

    mx_dot = use_mx_dot(x_TH.dtype, M, E, gate, up)
    tma = None if PERSISTENT_GATE_UP or mx_dot or not tma_eligible(x_TH, M, E) else tma_weights((gate, up))
    h = h_out if h_out is not None else gu_out
    x_TH, xr, mx_dot = mx_rows(x_TH, mx_dot, gate, up)
    if PERSISTENT_GATE_UP:
        kernel, progs = _gate_up_persistent_kernel, _num_sms(x_TH.device) * PERSISTENT_PROGRAMS
        grid = (progs,)  # (programs past the last tile loop zero times; no size comparison, no guard)
    else:
        kernel = mx_kernel(mx_dot, _gate_up_kernel, _gate_up_mx_dot_kernel, _gate_up_mx8_kernel)
        grid = lambda meta: (tiles(meta),)  # noqa: E731
    keep_clip = limit is not None and gu_out.dtype in (torch.bfloat16, torch.float16)
    above, below = (float(v) for v in reference.clip_bounds(limit, gu_out.dtype)) if keep_clip else (0.0, 0.0)
    _launch.launch(
        kernel, grid,
        x_TH, x_TH.stride(0), x_TH.stride(1), xr, routes_N, offsets_E1,
        *w_args(gate), *w_args(up),
        gu_out, gu_out.stride(0), gu_out.stride(1), h, h.stride(0), h.stride(1),
        *((None, None, 1) if tma is None else (*tma[0], tma[1])),
        M, H, I, E, topk, 0.0 if limit is None else float(limit), above, below,
        SINGLE=single, MX_G=gate.quantized, MX_U=up.quantized, WRITE_H=h_out is not None,
        HAS_LIMIT=limit is not None, KEEP_CLIP=keep_clip, DOT_PREC=_launch.dot_precision(x_TH.dtype),
        MX_DOT=mx_dot, TMA=tma is not None, W_KMAJOR=tma is not None and tma[2],
        GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=GROUP_M, **w_meta(gate, up),
        few_rows=bool(mx_dot) and few_rows_per_expert(M, E),
    )
    return gu_out


# ---------------------------------------------------------------------------------------------
# Grouped row GEMM: out[dest(r), n] = sum_k A[r, k] W1[e][n, k] (+ sum_k A[r, KD + k] W2[e][n, k])


# 128 x 256 first: the eager autotuner's pick for both launches (the forward down GEMM and the dx GEMM) at
# every shape of shared/BENCH.md on the H200 (benchmarks/tuned_configs.py, session 9); compiled graphs run it
_GROUPED_ROWS_CONFIGS = [cfg(128, 256, 64, 8, 3), cfg(128, 128, 64, 8, 3), cfg(64, 128, 64, 4, 4),
                         cfg(128, 128, 64, 4, 4), cfg(64, 64, 128, 4, 3)]


@triton.jit
def _grouped_rows_k_loop(acc, a_row, a_row_t, stride_ak, a_k0, lo_off, k_start, rmask, w_ptr, s_ptr, s_n, s_k, ss_n,
                         ss_k, cols, cmask, KD, like_ptr, MX: tl.constexpr, MX_DOT: tl.constexpr, TRANS: tl.constexpr,
                         DOT_PREC: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A[rows, a_k0 + k] @ W[e][cols, k]^T over k in [k_start, KD) (w_ptr, s_ptr: expert e's starts);
    TRANS: acc and the sum transposed (`mx_dot_t`), a_row_t the rows' starts as a [1, BLOCK_M] tile; MX_DOT 6, 7:
    A's rows e4m3 pairs (`row_e4m3`), the lo terms lo_off columns after the hi ones."""
    if MX_DOT:  # the whole K steps, BLOCK_K // 32 blocks each, then the tail's blocks one by one (no k masks)
        k_full = KD - KD % BLOCK_K
        G: tl.constexpr = mx_group(MX_DOT, BLOCK_K)
        ONE: tl.constexpr = mx_one(MX_DOT, TRANS)
        AHEAD: tl.constexpr = mx_ahead(MX_DOT, TRANS, BLOCK_K)
        WIDE: tl.constexpr = mx_wide(MX_DOT, BLOCK_K)
        BLK: tl.constexpr = mx_blk(MX_DOT)
        nxt = scale_step(s_ptr, 0, k_full, cols, cmask, ss_n, AHEAD, WIDE, BLOCK_K)
        for k0 in range(0, k_full, BLOCK_K):
            if ONE:
                acc = mx_step_t(act_step_t(a_row_t, stride_ak, a_k0, k0, rmask, BLOCK_K), w_ptr, k0, cols, cmask,
                                s_n, s_k, step_scales(s_ptr, k0, cols, cmask, ss_n, BLOCK_K), acc, DOT_PREC,
                                BLOCK_K)
            else:
                if AHEAD:
                    cur = nxt
                    nxt = scale_step(s_ptr, k0 + BLOCK_K, k_full, cols, cmask, ss_n, AHEAD, WIDE, BLOCK_K)
                else:
                    cur = scale_step(s_ptr, k0, k_full, cols, cmask, ss_n, G == 4, WIDE, BLOCK_K)
                for q in tl.static_range(BLOCK_K // (32 * G)):
                    kb0 = k0 // 32 + G * q
                    for j in tl.static_range(G):
                        acc = _mx_block(acc, a_row, a_row_t, stride_ak, a_k0, lo_off, kb0 + j, rmask, w_ptr,
                                        group_scales(cur, q, j, s_ptr, kb0, cols, cmask, ss_n, ss_k, G == 4), cols,
                                        cmask, s_n, s_k, BLK, TRANS, DOT_PREC)
        for kb in range(k_full // 32, KD // 32):
            acc = _mx_block(acc, a_row, a_row_t, stride_ak, a_k0, lo_off, kb, rmask, w_ptr,
                            w_block_scales(s_ptr, kb, cols, cmask, ss_n, ss_k), cols, cmask, s_n, s_k, BLK, TRANS,
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
    a_ptr, stride_am, stride_ak,  # A [M, KD or 2*KD], sorted rows (MX_DOT 3: fp16, `row_f16`)
    ar_ptr,  # MX_DOT 3: A's row scales [M] float32 (else unused)
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    w1_ptr, s1_e, s1_n, s1_k, q1_ptr, q1_e, q1_n, q1_k,  # W1[e] (n, k) data and scales (MX1), [E, NCOL, KD]
    w2_ptr, s2_e, s2_n, s2_k, q2_ptr, q2_e, q2_n, q2_k,  # W2[e], multiplies A's columns [KD, 2 KD) (TWO)
    out_ptr, stride_om, stride_on,  # out [rows, NCOL]; row = route (SCATTER) or the sorted row
    a_desc, w1_desc, w2_desc, w_rows,  # TMA: host descriptors of A and of W1's, W2's 2-D views, R (`_tma_args`)
    M, NCOL, KD, E,
    SINGLE: tl.constexpr, SCATTER: tl.constexpr, TWO: tl.constexpr, MX1: tl.constexpr, MX2: tl.constexpr,
    DOT_PREC: tl.constexpr, W_TABLE: tl.constexpr, MX_DOT: tl.constexpr, TMA: tl.constexpr,
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
    TRANS: tl.constexpr = mx_trans(MX_DOT, BLOCK_M)
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
    lo_off = 2 * KD if TWO else KD  # (MX_DOT 6, 7: A's lo terms after its hi ones, `row_e4m3`)
    acc = _grouped_rows_k_loop(acc, a_row, a_row_t, stride_ak, 0, lo_off, k_start, rmask, w1, q1, s1_n, s1_k, q1_n,
                               q1_k, cols, cmask, KD, out_ptr, MX1, MX_DOT, TRANS, DOT_PREC, BLOCK_K)
    if TWO:
        w2, q2 = w_bases(w2_ptr, q2_ptr, e64, s2_e, q2_e, E, W_TABLE, MX2)
        if TMA:
            acc = _tma_k_loop(acc, a_desc, KD, row_start, w2_desc, group * w_rows, pid_n * BLOCK_N, k_start,
                              W_KMAJOR, DOT_PREC, BLOCK_K)
        acc = _grouped_rows_k_loop(acc, a_row, a_row_t, stride_ak, KD, lo_off, k_start, rmask, w2, q2, s2_n, s2_k,
                                   q2_n, q2_k, cols, cmask, KD, out_ptr, MX2, MX_DOT, TRANS, DOT_PREC, BLOCK_K)
    if TRANS:
        acc = tl.trans(acc)
    if MX_DOT >= 3:  # A's row scales
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
_grouped_rows_mx_dot_kernel = _launch.autotune(_MX_DOT_CONFIGS, cfg(16, 16, 32, 1, 1),
                                               key=_GROUPED_ROWS_KEY + ["MX_DOT"],
                                               few_rows=cfg(8, 32, 128, 1, 4))(_grouped_rows_body)
_grouped_rows_mx8_kernel = _launch.autotune(_MX8_CONFIGS, cfg(16, 16, 32, 1, 1), key=_GROUPED_ROWS_KEY + ["MX_DOT"],
                                            few_rows=_MX8_CONFIGS[0])(_grouped_rows_body)


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
    descriptors: TMA_KERNELS on, an eager launch (also under the interpreter) of 16-bit activations, at least
    TMA_MIN_ROWS rows per expert on average. AOTAutograd's tracing of `wrap_triton` does not carry descriptor
    arguments (torch 2.11-2.13), and Inductor takes no pre-hook to set their block shapes per config: traced
    launches load every tile by pointers."""
    if not TMA_KERNELS or act.element_size() != 2 or _launch.without_pointers((act,)):
        return False
    return rows >= TMA_MIN_ROWS * groups


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


def _tma_args(a_MK, w1, w2, two: bool, mx_dot: bool):
    """Kernel arguments (a_desc, w1_desc, w2_desc, R) and meta (TMA, W_KMAJOR) of a launch of the grouped row
    GEMM: host TMA descriptors for A and the weights where `tma_eligible`, A has contiguous rows with
    16-byte aligned strides, and `tma_weights` takes the weights; otherwise none (TMA=0: pointer loads)."""
    off = (None, None, None, 1), dict(TMA=False, W_KMAJOR=False)
    if mx_dot or not tma_eligible(a_MK, a_MK.shape[0], w1.data.shape[0]):
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
    mx_dot = use_mx_dot(a_MK.dtype, M, E, w1, w2)
    tma, tma_meta = _tma_args(a_MK, w1, w2, two, mx_dot)
    dot_prec = _launch.dot_precision(a_MK.dtype)
    a_MK, ar, mx_dot = mx_rows(a_MK, mx_dot, w1, w2)
    _launch.launch(
        mx_kernel(mx_dot, _grouped_rows_kernel, _grouped_rows_mx_dot_kernel, _grouped_rows_mx8_kernel), grid,
        a_MK, a_MK.stride(0), a_MK.stride(1), ar, routes_N, offsets_E1,
        *w_args(w1), *w_args(w2),
        out, out.stride(0), out.stride(1), *tma,
        M, NCOL, KD, E,
        SINGLE=single, SCATTER=scatter, TWO=two, MX1=w1.quantized, MX2=w2.quantized,
        DOT_PREC=dot_prec, MX_DOT=mx_dot, GROUPS_POW2=_launch.next_pow2(E + 1),
        GROUP_M=GROUP_M, **tma_meta, **w_meta(w1, w2), few_rows=bool(mx_dot) and few_rows_per_expert(M, E),
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
    over TOPK, where each row's load waited on its route's id (qwen3 decode, T=64: 0.0060 ms, H200 run 17)."""
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
    one and not the other: the two differed in the last bit on the H100, CUDA run of session 18), acc where not
    (an invalid route's row, never written, may hold NaN)."""
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
    [E, I, H], down as [E, H, I]. (Measured on the H200, session 3: a down GEMM applying the SwiGLU to g, u
    tiles in its K loop instead of reading h reached 219 TFLOP/s against 415: its A operand goes through
    registers; h costs 192 MiB of transient memory at the qwen3 shape.)"""
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
