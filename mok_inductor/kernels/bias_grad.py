"""The routed biases' gradients: a sum over each expert's sorted rows, in a fixed order (no atomics).

    dgu [M, 2I] (sorted rows) --_bias_grad_kernel--> d gate_up_bias [E, 2, I]  (sum of expert e's rows)
    dy [T, H], router weights --_bias_grad_kernel (GATHER: row r reads rw[route] * dy[route // K], rounded to
        dy.dtype, as the down weight gradient's operand is)--> d down_bias [E, H]

One program per (expert, column block) loops over the expert's rows in BLOCK_M steps and sums in float32;
the destination is written once (or added into, ACCUMULATE). An expert without rows gets zeros.

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token (TOPK), M = T*K sorted rows,
C columns of the bias (2I or H).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common

_BLOCK = (16, 32) if common.INTERPRET else (32, 128)  # (rows per step, columns per program)


@triton.jit
def _bias_grad_kernel(
    src_ptr, stride_sm, stride_sc,  # [M, C] sorted rows, or (GATHER) dy [T, C] read at the route's token
    routes_ptr, offsets_ptr,  # sorted_routes [M] int32, expert_offsets [E+1] int32
    scale_ptr,  # float32 [T*K] router weight per route (GATHER)
    out_ptr, stride_oe, stride_oh, stride_oc,  # out read as [E, C // HALF, HALF] (a [E, 2, I] bias: HALF = I)
    C, HALF, TOPK,
    GATHER: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    row_start = tl.load(offsets_ptr + e)
    row_end = tl.load(offsets_ptr + e + 1)
    total = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        if GATHER:
            route = tl.load(routes_ptr + rows, mask=rmask, other=0)
            src = src_ptr + (route // TOPK)[:, None].to(tl.int64) * stride_sm + cols[None, :] * stride_sc
            v = tl.load(src, mask=mask, other=0.0)
            w = tl.load(scale_ptr + route, mask=rmask, other=0.0)
            # rounded as the down weight gradient's operand (rw * dy in dy's dtype) is
            v = (v.to(tl.float32) * w[:, None]).to(src_ptr.dtype.element_ty)
        else:
            v = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_sm + cols[None, :] * stride_sc, mask=mask,
                        other=0.0)
        total += tl.sum(v.to(tl.float32), axis=0)
    o_ptrs = out_ptr + e.to(tl.int64) * stride_oe + (cols // HALF) * stride_oh + (cols % HALF) * stride_oc
    if ACCUMULATE:
        total += tl.load(o_ptrs, mask=cmask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=cmask)


def bias_grad(out, src, routes_N, offsets_E1, *, topk=1, scale_N=None, accumulate=False):
    """out[e] = sum over expert e's sorted rows r of src[r] (scale_N given: of scale_N[route] * src[route // topk],
    src then dy [T, C]). out: [E, C] or [E, 2, C/2] (any strides); src's columns are out[e]'s in order."""
    E = out.shape[0]
    if E == 0:
        return out
    C = src.shape[1]
    half = out.shape[-1]
    s_e, s_h, s_c = (out.stride(0), 0, out.stride(1)) if out.dim() == 2 else out.stride()
    bm, bc = _BLOCK
    gather = scale_N is not None
    common.launch(
        _bias_grad_kernel, (E, common.cdiv(C, bc)),
        src, src.stride(0), src.stride(1), routes_N, offsets_E1, scale_N if gather else src,
        out, s_e, s_h, s_c, C, half, topk,
        GATHER=gather, ACCUMULATE=accumulate, BLOCK_M=bm, BLOCK_C=bc, num_warps=4,
    )
    return out
