"""The decode forward: a few routes, no schedule, three launches (with a shared expert, its own besides).

    x_TH, top_experts --_gemv_gate_up_kernel (one program per route and column block)--> h_NI = act(g, u)
        per route, in route order (the `-1` routes' rows unwritten), and the ids' check flag
    h_NI, top_experts --_gemv_down_kernel (one program per route and column block)--> y_NH per route
    y_NH, router weights, shared s_TH, its gate's logits --combine._combine_kernel (k order)--> y_TH

At a few routes per call (generate's decode steps), the grouped path's counting sort and its tile search over
the experts cost more host time (five launches and two custom ops) than the GPU spends on the weights; here
each route's program reads its expert's rows directly, the route's row as row 0 of a 16-row tensor-core tile
(the other rows zero): the weight loads pipeline as a GEMM's, and no float is reduced across lanes (lanes of a
butterfly reduction hold differently rounded copies of one sum and race writing it). The arithmetic is the
grouped path's: float32 accumulation, g and u rounded to x.dtype (without crossing a clamp bound) before the
activation, h rounded, each route's output rounded to x.dtype, the combine's float32 sum in k order
(docs/semantics.md). No host synchronisation; bad expert ids are flagged on the device as the schedule does.
Weights: plain 3-D (or GPT-OSS's interleaved gate/up) tensors of x.dtype; MXFP8 and split weights take the
grouped path.

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token (TOPK), N = T*K routes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import combine, common
from .common import mma, round_gu, swiglu, to_out
from .operands import interleaved

# the rows of the tensor-core tiles (the smallest a dot takes): row 0 is the route's, the others zero
ROWS: tl.constexpr = tl.constexpr(16)


@triton.jit(do_not_specialize=["N"])  # (a new token count compiles nothing)
def _gemv_gate_up_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H]
    te_ptr,  # top_experts [N] (flat, int32 or int64)
    ok_ptr,  # int32 [1] out (program (0, 0)): 1 if every id is in [-1, E), else 0
    wg_ptr, g_e, g_n, g_k,  # gate read as [E, I, H] (INTERLEAVED: gate and up as one [E, 2I, H])
    wu_ptr, u_e, u_n, u_k,  # up read as [E, I, H]
    h_ptr, stride_hr, stride_hi,  # h [N, I] out
    bias_ptr, b_e, b_c, b_i,  # FC1 bias read as [E, 2, I] (HAS_BIAS)
    N, H, I, E, TOPK,
    limit, above, below, alpha, beta,  # the clamp, its rounding bounds (KEEP_CLIP), the activation
    HAS_BIAS: tl.constexpr, HAS_LIMIT: tl.constexpr, KEEP_CLIP: tl.constexpr, INTERLEAVED: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHECK_BLOCK: tl.constexpr,
):
    """Route r's x row as row 0 of a [ROWS, BLOCK_K] tile (the other rows zero) times the expert's weight tiles on
    the tensor cores: the loads pipeline as a GEMM's do, and every output element is one thread's (a reduction
    across lanes would leave lanes holding differently rounded copies of one sum). Row 0 is stored."""
    limit = tl.cast(limit, tl.float32)
    above = tl.cast(above, tl.float32)
    below = tl.cast(below, tl.float32)
    alpha = tl.cast(alpha, tl.float32)
    beta = tl.cast(beta, tl.float32)
    r = tl.program_id(0)  # (routes along the grid's first dim: up to 2^31 - 1 of them)
    pid_n = tl.program_id(1)
    if (pid_n == 0) & (r == 0):  # the ids' check (what the schedule's prefix kernel folds for the grouped path)
        nbad = tl.zeros((CHECK_BLOCK,), dtype=tl.int32)
        for r0 in range(0, N, CHECK_BLOCK):
            rr = r0 + tl.arange(0, CHECK_BLOCK)
            ids = tl.load(te_ptr + rr, mask=rr < N, other=0).to(tl.int32)
            nbad += ((ids < -1) | (ids >= E)).to(tl.int32)
        tl.store(ok_ptr, (tl.sum(nbad, axis=0) == 0).to(tl.int32))
    e = tl.load(te_ptr + r).to(tl.int32)
    if (e < 0) | (e >= E):  # no route (or a bad id, flagged above): the down kernel never reads this row
        return
    e64 = e.to(tl.int64)
    rows = tl.arange(0, ROWS)
    first = rows == 0
    x_row = x_ptr + (r // TOPK).to(tl.int64) * stride_xt
    ks = tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    if INTERLEAVED:  # one [BLOCK_K, 2 BLOCK_N] tile along the weight's contiguous dim, columns alternating g and u
        cols2 = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        w_cols = wg_ptr + e64 * g_e + cols2[None, :] * g_n
        acc = tl.zeros((ROWS, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            kmask = kk < H
            a = tl.load(x_row + kk[None, :] * stride_xh + rows[:, None] * 0, mask=first[:, None] & kmask[None, :],
                        other=0.0)
            w = tl.load(w_cols + kk[:, None] * g_k, mask=kmask[:, None] & (cols2 < 2 * I)[None, :], other=0.0)
            acc = mma(a, w, acc, DOT_PREC)
        acc_g, acc_u = tl.split(tl.reshape(acc, (ROWS, BLOCK_N, 2)))
    else:
        g_cols = wg_ptr + e64 * g_e + cols[None, :] * g_n
        u_cols = wu_ptr + e64 * u_e + cols[None, :] * u_n
        acc_g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + ks
            kmask = kk < H
            wmask = kmask[:, None] & cmask[None, :]
            a = tl.load(x_row + kk[None, :] * stride_xh + rows[:, None] * 0, mask=first[:, None] & kmask[None, :],
                        other=0.0)
            acc_g = mma(a, tl.load(g_cols + kk[:, None] * g_k, mask=wmask, other=0.0), acc_g, DOT_PREC)
            acc_u = mma(a, tl.load(u_cols + kk[:, None] * u_k, mask=wmask, other=0.0), acc_u, DOT_PREC)
    if HAS_BIAS:  # before the rounding and the clamp, as the grouped path adds it
        b_ptrs = bias_ptr + e64 * b_e + cols * b_i
        acc_g += tl.load(b_ptrs, mask=cmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + b_c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    g, u = round_gu(acc_g, acc_u, h_ptr, limit, above, below, KEEP_CLIP, DOT_PREC)
    h = swiglu(g, u, limit, alpha, beta, HAS_LIMIT)
    h_ptrs = h_ptr + r.to(tl.int64) * stride_hr + cols[None, :] * stride_hi + rows[:, None] * 0
    tl.store(h_ptrs, to_out(h, h_ptr, DOT_PREC), mask=first[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["N"])
def _gemv_down_kernel(
    h_ptr, stride_hr, stride_hi,  # h [N, I] (rows of `-1` routes unwritten)
    te_ptr,  # top_experts [N]
    wd_ptr, d_e, d_n, d_k,  # down read as [E, H, I]
    bias_ptr, db_e, db_h,  # FC2 bias [E, H] (HAS_BIAS)
    y_ptr, stride_yr, stride_yh,  # y [N, H] out, per route (rows of `-1` routes unwritten)
    N, H, I, E,
    HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[r, cols] = round(h_r @ down[e]^T (+ b[e])) for route r (expert e), h_r as row 0 of a tile as in
    `_gemv_gate_up_kernel`; every route's program runs at once (the combine then sums each token's routes in k
    order: `combine._combine_kernel`)."""
    r = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(te_ptr + r).to(tl.int32)
    if (e < 0) | (e >= E):
        return
    e64 = e.to(tl.int64)
    rows = tl.arange(0, ROWS)
    first = rows == 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < H
    ks = tl.arange(0, BLOCK_K)
    w_cols = wd_ptr + e64 * d_e + cols[None, :] * d_n
    h_row = h_ptr + r.to(tl.int64) * stride_hr
    y = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + ks
        kmask = kk < I
        a = tl.load(h_row + kk[None, :] * stride_hi + rows[:, None] * 0, mask=first[:, None] & kmask[None, :],
                    other=0.0)
        w = tl.load(w_cols + kk[:, None] * d_k, mask=kmask[:, None] & cmask[None, :], other=0.0)
        y = mma(a, w, y, DOT_PREC)
    if HAS_BIAS:
        y += tl.load(bias_ptr + e64 * db_e + cols * db_h, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + r.to(tl.int64) * stride_yr + cols[None, :] * stride_yh + rows[:, None] * 0
    tl.store(y_ptrs, to_out(y, y_ptr, DOT_PREC), mask=first[:, None] & cmask[None, :])


def _blocks(cols: int, programs_per_col_block: int) -> tuple:
    """(BLOCK_N, BLOCK_K): the widest column block of 64, 32, 16 that still gives about two programs per SM
    (264; decode streams the weights through few programs), K steps of 128; the interpreter: small tiles."""
    if common.INTERPRET:
        return 16, 32
    for block_n in (64, 32):
        if programs_per_col_block * common.cdiv(cols, block_n) >= 264:
            return block_n, 128
    return 16, 128


def gemv_routes(x_TH, te_N, rw_N, gate, up, down, out_TH, limit, *, act=None, gate_up_bias=None, down_bias=None,
                s_TH=None, logit_T=None):
    """out_TH = the routed experts' sum (+ the shared expert's s_TH, gated by sigmoid(logit_T)) of T tokens
    with K = N / T routes each: gate, up read as [E, I, H], down as [E, H, I] (plain tensors, x.dtype); the
    optional biases [E, 2, I], [E, H]; at least one route. Returns the ids' check flag (int32 [1]) for
    `common.assert_expert_ids`."""
    T, H = x_TH.shape
    N = te_N.numel()
    E, I, _ = gate.shape
    ok = torch.empty(1, dtype=torch.int32, device=x_TH.device)
    topk = N // T
    h = x_TH.new_empty(N, I)
    both = interleaved(gate, up, 1)  # [E, 2I, H] (GPT-OSS's layout)
    wg, wu = (both, both) if both is not None else (gate, up)
    lim, above, below, keep_clip = common.clamp_args(limit, x_TH.dtype)
    prec = common.dot_precision(x_TH.dtype)
    bn, bk = _blocks(I, N)
    common.launch(
        _gemv_gate_up_kernel, (N, common.cdiv(I, bn)),
        x_TH, x_TH.stride(0), x_TH.stride(1), te_N, ok,
        wg, *wg.stride(), wu, *wu.stride(), h, h.stride(0), h.stride(1),
        *((x_TH, 0, 0, 0) if gate_up_bias is None else (gate_up_bias, *gate_up_bias.stride())),
        N, H, I, E, topk, lim, above, below,
        1.0 if act is None else act.alpha, 0.0 if act is None else act.beta,
        HAS_BIAS=gate_up_bias is not None, HAS_LIMIT=limit is not None, KEEP_CLIP=keep_clip,
        INTERLEAVED=both is not None, DOT_PREC=prec, BLOCK_N=bn, BLOCK_K=bk, CHECK_BLOCK=64, num_warps=4,
        num_stages=3,
    )
    bn, bk = _blocks(H, N)
    y_NH = x_TH.new_empty(N, H)
    common.launch(
        _gemv_down_kernel, (N, common.cdiv(H, bn)),
        h, h.stride(0), h.stride(1), te_N, down, *down.stride(),
        *((x_TH, 0, 0) if down_bias is None else (down_bias, *down_bias.stride())),
        y_NH, y_NH.stride(0), y_NH.stride(1), N, H, I, E,
        HAS_BIAS=down_bias is not None, DOT_PREC=prec, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3,
    )
    combine.combine(y_NH, te_N, out_TH, rw_N=rw_N, s_TH=s_TH, logit_T=logit_T)
    return ok
