"""The MXFP8 K loops on the fp16 tensor cores (decode sizes): the loop's plan (`MxLoop` and the constexpr
functions of a tile config), its device functions by 32-blocks and by whole K steps, the activation rows
scaled into fp16 once per call (`row_f16`), and the host choice of the loop for a launch (`use_mx_loop`,
`mx_rows`). The gate/up and grouped row GEMMs run these loops in their MX_LOOP branch.

    a [rows, k] --row_f16--> a16 [rows, k] fp16, r_s [rows] (a = a16 * r_s)
    per K step: W's e4m3 tile -> fp16, times its blocks' scale factors (bytes, or words of 4 blocks), one fp16
        dot per 32-block (`mx_dot`, `mx_dot_t` on 8-row tiles) or per step (`mx_step_t`), float32 accumulation;
        r_s applied after the loop

Shape legend: BLOCK_M rows (8 or 16 at decode), BLOCK_N weight columns, BLOCK_K a K step (a multiple of 32),
G blocks per scale load, KA the activation rows' width.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from .. import options
from . import common
from .common import cfg, e8m0_factor
from .operands import scale_words


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


# What the constexpr functions below compare MX_LOOP with: plain ints, because Inductor copies the int globals of
# a user kernel's closure into its generated code, but not an enum class (nor prints a member as code).
_DEQUANTIZE = int(MxLoop.DEQUANTIZE)
_F16_WORDS = int(MxLoop.F16_WORDS)


# The K loop's plan, computed once here for both MXFP8 kernels (`_gate_up_tile`, `_grouped_rows_k_loop`) from the
# kernel's constexprs
@triton.constexpr_function
def mx_trans(mx_loop, block_m):
    """Whether the tile computes its blocks transposed (`mx_dot_t`): the 8-row tiles of the fp16 loops."""
    return mx_loop != _DEQUANTIZE and block_m < 16


@triton.constexpr_function
def mx_group(mx_loop, block_k):
    """The blocks one scale load gives: 4 where the scales are read by words and a K step holds whole words
    (BLOCK_K 128 or 256), else 1."""
    return 4 if mx_loop == _F16_WORDS and block_k in (128, 256) else 1


@triton.constexpr_function
def mx_one(mx_loop, trans):
    """Whether each whole K step is one dot (`mx_step_t`): the transposed tiles with scale words."""
    return mx_loop == _F16_WORDS and trans


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


# The fp16 K loops (decode sizes): row tiles of 16 (mma.sync's shape, not wgmma's 64: few rows per expert, and the
# per-block scaling is BLOCK_M x BLOCK_N float32 work per 32 of k), long K steps, and the 8-row transposed tiles
# (`mx_dot_t`) that the eager autotuner picks at decode sizes, the down GEMM's with one dot a K step on one warp
_MX_F16_CONFIGS = [cfg(16, 64, 128, 4, 4), cfg(16, 128, 128, 4, 3), cfg(16, 64, 256, 4, 3), cfg(16, 32, 128, 2, 4),
                   cfg(16, 64, 64, 4, 6), cfg(32, 64, 128, 4, 4), cfg(64, 64, 128, 4, 3), cfg(128, 128, 64, 8, 3),
                   cfg(8, 32, 256, 2, 3), cfg(8, 64, 128, 4, 4), cfg(8, 32, 128, 1, 4)]
# without a table, at up to `options.mx_few_rows` routes per expert: the 8-row picks of a search at decode
MX_F16_SMALL_GATE_UP = cfg(8, 32, 256, 2, 3)
MX_F16_SMALL_DOWN = cfg(8, 32, 128, 1, 4)


def use_mx_loop(act_dtype: torch.dtype, M, E: int, *ops) -> MxLoop:
    """The K loop of a GEMM of `act_dtype` activations over M sorted rows of E experts with these weight
    operands: `MxLoop.F16` (`mx_rows` may refine it) with every operand MXFP8 and bf16/fp16 activations at most
    `options.mx_f16_dot_max_rows` routes per expert on average, decided without a guard (a symbolic row count
    not statically that small keeps the dequantizing loop, whose 64-128-row tiles read each expert's weights
    once or twice where the fp16 loop's 8- and 16-row tiles read them again every few rows); float32
    activations (SPEC's 1e-4) always dequantize."""
    if not (act_dtype in (torch.bfloat16, torch.float16) and all(op is not None and op.quantized for op in ops)):
        return MxLoop.DEQUANTIZE
    if not common.at_least(M, options.current().mx_f16_dot_max_rows * max(E, 1) + 1, True):
        return MxLoop.F16
    return MxLoop.DEQUANTIZE


def mx_rows(a_RK, mx_loop: MxLoop, *ops):
    """(activations, their row scales or None, loop) of a launch: for the fp16 loops, a's rows scaled into fp16
    (`row_f16`), F16_WORDS where the operands' scales can be read by words; otherwise a as is."""
    if mx_loop == MxLoop.DEQUANTIZE:
        return a_RK, None, mx_loop
    a16, r_s = row_f16(a_RK)
    return a16, r_s, MxLoop.F16_WORDS if scale_words(*ops) else MxLoop.F16


@triton.jit(do_not_specialize=["R"])
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
    if not common.at_least(KA, one_pass_max + 1, True):  # (a symbolic width: two passes, no guard)
        br, bk, one, warps = 1, common.next_pow2(KA), True, 4 if KA <= 4096 else 8
    else:
        br, bk, one, warps = 4, 32 if common.INTERPRET else 512, False, 4
    common.launch(_row_f16_kernel, (common.cdiv(R, br),), a_RK, a_RK.stride(0), a_RK.stride(1), a16, r_s, R, KA,
                   BLOCK_R=br, BLOCK_K=bk, ONE_PASS=one, num_warps=warps)
    return a16, r_s
