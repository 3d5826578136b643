"""The combine over each token's routes, and a row dot (the shared output gate's logits).

    y_NH (per route), router weights, shared s_TH, sigmoid(x @ w_gate^T) --_combine_kernel--> y_TH
        (float32 sums in k order: deterministic; the `-1` routes' unwritten rows are never read into the sum)
    the backward's dx per route, the shared expert's dx and the gate's logit gradient --_combine_kernel--> dx_TH
    x_TH, w_1H --_rowdot_kernel--> <x[t], w> in float32

Shape legend: T tokens, H hidden, K routes per token (TOPK), N = T*K routes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from . import common
from .common import to_out


@triton.jit(do_not_specialize=["T"])  # (a new token count compiles nothing)
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


def combine(y_NH, te_N, out_TH, *, rw_N=None, s_TH=None, logit_T=None, bias_H=None, bscale_T=None,
            unroll_max: int = COMBINE_UNROLL_MAX):
    """out[t] = the sum of y's rows of token t's valid routes (y [T*K, H]: every route's row, those of `-1` routes
    unwritten), weighted by rw, plus s (gated by sigmoid(logit)) and bias * bscale: `_combine_kernel`, its route
    loop unrolled for a constant K up to `unroll_max`."""
    T, H = out_TH.shape
    if T == 0 or H == 0:
        return out_TH
    topk = te_N.numel() // T
    topk_c = int(topk) if is_concrete_int(topk) and int(topk) <= unroll_max else 0
    block_h = min(1024, common.next_pow2(H)) if not common.INTERPRET else min(64, common.next_pow2(H))
    dummy = y_NH  # (absent inputs: a read-only input in their place, never the output, `common.launch`)
    common.launch(
        _combine_kernel, (T * common.cdiv(H, block_h),),
        y_NH, y_NH.stride(0), y_NH.stride(1), te_N,
        rw_N if rw_N is not None else dummy,
        s_TH if s_TH is not None else dummy, *(s_TH.stride() if s_TH is not None else (0, 0)),
        logit_T if logit_T is not None else dummy,
        bias_H if bias_H is not None else dummy, bscale_T if bscale_T is not None else dummy,
        out_TH, out_TH.stride(0), out_TH.stride(1),
        T, H, topk,
        HAS_RW=rw_N is not None, HAS_S=s_TH is not None, S_SIGMOID=logit_T is not None,
        HAS_BIAS=bias_H is not None, DOT_PREC=common.dot_precision(out_TH.dtype), BLOCK_H=block_h,
        TOPK_C=topk_c, num_warps=4,
    )
    return out_TH


@triton.jit(do_not_specialize=["T"])
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
    bt, bh = (16, 64) if common.INTERPRET else (32, 256)
    common.launch(_rowdot_kernel, (common.cdiv(T, bt),), x_TH, x_TH.stride(0), x_TH.stride(1),
                   w, w.stride(0), out, T, H, BLOCK_T=bt, BLOCK_H=bh)
    return out
