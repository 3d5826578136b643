"""The Triton kernels of the CUDA path: the same interface as `mok_inductor.reference`
(build_schedule, moe_forward, moe_backward), computed by the kernel families below.

    schedule.py  device schedule: per-chunk histogram -> int32 prefix sums -> stable scatter
    moe_fwd.py   gathered gate/up GEMM (writes the saved [g | u] and h), grouped row GEMM (the down
                 GEMM; the data gradients), combine, row dot
    moe_bwd.py   down-dgrad GEMM with the SwiGLU backward (+ d router weights) in its epilogue or in a
                 second pass, grouped weight-gradient GEMM (gate and up as one GEMM) with the main-grad
                 accumulating epilogue

Forward data flow: x --gate_up (gather fused)--> gu [N, 2I] (saved), h [N, I] --grouped_rows (down)--> y per
route [N, H] --combine (router weights, shared expert, its gate; fp32 in k order)--> y [T, H].
Backward: bwd_act (dy @ down, SwiGLU backward from the saved g, u) -> dgu [N, 2I], d router weights, rw * h;
wgrad (down; gate and up in one launch); grouped_rows (gate, up) -> dx per route -> combine over k (+ shared
dx, + the gate's logit gradient) -> dx [T, H]. Backward computes 12·N·H·I FLOPs (no GEMM is recomputed);
the price is the saved activations: [N, 2I] (g and u) instead of h [N, I].

Shapes only decide grids, allocations and kernel choices (worst-case tile counts; idle programs exit; a
symbolic size decides without a guard, `_launch.at_least`), there is no
host synchronisation, and every reduction has a fixed order (no float atomics): the ops are
capturable in CUDA graphs and bitwise deterministic.

MXFP8 operands are read in the K loops (e4m3 + scales, dequantized in registers) at small rows per expert,
and dequantized once per call into a transient x.dtype copy at large ones (MX_DEQUANTIZE_MIN_ROWS). A K loop
on the fp8 tensor cores (bf16/fp16 activations split into two e4m3 terms, `moe_fwd.MX_FP8_DOT`) is an A/B
candidate, off: slower on the H200 (docs/benchmarks.md, run 9). The same loop on the fp16 tensor cores (one
exact fp16 activation term, `moe_fwd.MX_F16_DOT`) runs at decode sizes (at most `moe_fwd.MX_F16_DOT_MAX_ROWS`
routes per expert on average), on activation rows scaled into fp16 once per call (`moe_fwd.row_f16`,
`MX_F16_MODE` 3), the weight scales read by 32-bit words of 4 blocks where their rows allow
(`moe_fwd.SCALE_WORDS`): 1.24x bf16 at qwen3 decode (run 16), and slower than the dequantizing loop above
(run 14). Its form on the e4m3 tensor cores without weight conversion (activation rows split once into two
e4m3 terms, `moe_fwd.MX_FP8_ROWS`) is an A/B candidate, off: 4% slower (run 18). On its 8-row tiles each whole K
step is one dot on weights scaled per column and block through a 3-D view (`moe_fwd.MX_ONE_DOT`, MX_DOT 8, on):
1.68x bf16 at qwen3 decode on the H200 (run 21), where the loop by 32-blocks was 1.30x (1.73x and 1.45x on the H100,
run 20).

Split per-expert weights (sequences of E 2-D tensors, bf16 or MXFP8) are read in place through a device
table of the experts' addresses (`moe_fwd.ExpertTable`; stacked instead while torch.compile traces, or when
the experts differ in strides). Per-expert gradient destinations are written through one float32 buffer.

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per token,
N = T*K.
"""

from __future__ import annotations

import os

try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency of torch on Linux
    _HAVE_TRITON = False

import torch

from .. import options, reference


def _available() -> bool:
    return _HAVE_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


AVAILABLE = _available()

from ..types import Operand, RoutedOperands

if _HAVE_TRITON:
    from . import _launch
    from .moe_bwd import bwd_act, expert_backward, shared_backward, wgrad
    from .moe_fwd import (ExpertTable, combine, dequantized, expert_mlp, flat, gate_up, grouped_rows, plain, plain_t,
                          shared_forward)
    from .schedule import build_schedule
else:  # pragma: no cover
    build_schedule = reference.build_schedule


def _plain_operands(w_gate, w_up, w_down, *, transposed: bool) -> RoutedOperands:
    """bf16 (float) weights, 3-D or sequences of E 2-D tensors, as kernel operands: the row-wise ones (the
    forward's) or the transposed ones (the backward's), the others None."""
    if transposed:
        return RoutedOperands(None, None, None, plain_t(w_gate), plain_t(w_up), plain_t(w_down))
    return RoutedOperands(plain(w_gate), plain(w_up), plain(w_down), None, None, None)


def _num_experts(op) -> int:
    return op.data.shape[0] if isinstance(op.data, (torch.Tensor, ExpertTable)) else len(op.data)


def _kernel_operands(ops: RoutedOperands, fields) -> RoutedOperands:
    """The operands `fields` as the kernels read them (the others None): all 3-D tensors, or, when any
    is split per expert, all `ExpertTable`s (no copy; a 3-D one's table is computed on the device). Split
    payloads that cannot be tables (traced: no data pointers; experts of different shapes or strides) are
    stacked first (one copy)."""
    ops = RoutedOperands(*(getattr(ops, f) if f in fields else None for f in RoutedOperands._fields))
    payloads = [p for o in ops if o is not None for p in (o.data, o.scale) if p is not None]
    if all(isinstance(p, torch.Tensor) for p in payloads):
        return ops
    tensors = [t for p in payloads if not isinstance(p, ExpertTable)
               for t in ((p,) if isinstance(p, torch.Tensor) else p)]
    traced = _launch.without_pointers(tensors)

    def split(p):  # sequences -> ExpertTable, or stacked
        if p is None or isinstance(p, (torch.Tensor, ExpertTable)):
            return p
        table = None if traced else ExpertTable.of(p)
        return table if table is not None else torch.stack(list(p))

    ops = RoutedOperands(*(None if o is None else Operand(split(o.data), split(o.scale)) for o in ops))
    if not any(isinstance(p, ExpertTable) for o in ops if o is not None for p in (o.data, o.scale)):
        return ops

    def table(p):
        return p if p is None or isinstance(p, ExpertTable) else ExpertTable.of(p)

    return RoutedOperands(*(None if o is None else Operand(table(o.data), table(o.scale)) for o in ops))


def _dequantized_if_large(ops: RoutedOperands, n_routes, dtype, fields, *, symbolic: bool) -> RoutedOperands:
    """MXFP8 operands dequantized once per call (a transient x.dtype copy of the weights; `dequantized`) at
    `options.mx_dequantize_min_rows` routes per expert and more, read in the GEMMs' K loops below it (decode:
    the weight bytes are the cost). `symbolic`: the choice when n_routes is a symbolic size (torch.compile,
    dynamic shapes), where the forward keeps the K-loop reads (decode, no transient copy) and the backward
    dequantizes (training)."""
    E = _num_experts(next(getattr(ops, f) for f in fields if getattr(ops, f) is not None))
    if not any(getattr(ops, f) is not None and getattr(ops, f).quantized for f in fields):
        return ops
    if not _launch.at_least(n_routes, options.current().mx_dequantize_min_rows * max(E, 1), symbolic):
        return ops
    return ops._replace(**{f: dequantized(getattr(ops, f), dtype) for f in fields if getattr(ops, f) is not None})


# ---------------------------------------------------------------------------------------------
# Forward


def moe_forward(x_TH, router_weights_TK, top_experts_TK, schedule, w_gate, w_up, w_down, s_gate=None,
                s_up=None, s_down=None, s_out_gate_1H=None, swiglu_limit=None) -> reference.ForwardResult:
    return forward(x_TH, router_weights_TK, top_experts_TK, schedule,
                   _plain_operands(w_gate, w_up, w_down, transposed=False),
                   s_gate, s_up, s_down, s_out_gate_1H, swiglu_limit)


def forward(x_TH, router_weights_TK, top_experts_TK, schedule, ops: RoutedOperands, s_gate=None, s_up=None,
            s_down=None, s_out_gate_1H=None, swiglu_limit=None) -> reference.ForwardResult:
    """The forward with the routed weights as kernel operands (`mxfp8.RoutedOperands`: bf16, or MXFP8
    row-wise data + scales read in the K loop, 3-D or split per expert)."""
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    N = T * K
    fields = ("gate", "up", "down")
    ops = _kernel_operands(_dequantized_if_large(ops, N, x_TH.dtype, fields, symbolic=False), fields)
    I = ops.gate.data.shape[1]
    dev, dtype = x_TH.device, x_TH.dtype
    sorted_N, offsets_E1 = schedule.sorted_routes_N, schedule.expert_offsets_E1

    gu_N2I = torch.empty(N, 2 * I, dtype=dtype, device=dev)  # saved for backward
    y_NH = torch.empty(N, H, dtype=dtype, device=dev)  # route order; rows of `-1` routes unwritten
    expert_mlp(x_TH, ops.gate, ops.up, ops.down, gu_N2I, y_NH, sorted_N, offsets_E1, K, swiglu_limit, scatter=True)

    gu_shared, s_TH, logit_T = shared_forward(x_TH, s_gate, s_up, s_down, s_out_gate_1H, sorted_N, offsets_E1,
                                              swiglu_limit)

    y_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine(y_NH, flat(top_experts_TK), y_TH, rw_N=flat(router_weights_TK), s_TH=s_TH, logit_T=logit_T)
    return reference.ForwardResult(y_TH, gu_N2I, gu_shared)


# ---------------------------------------------------------------------------------------------
# Backward


def moe_backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule, w_gate, w_up, w_down, gu_N2I,
                 s_gate=None, s_up=None, s_down=None, s_out_gate_1H=None, gu_shared_T2Is=None, swiglu_limit=None,
                 *, grads=None, accumulate=False) -> reference.BackwardResult:
    grads = reference.GradBuffers.allocate(grads, w_gate, w_up, w_down, s_gate, s_up, s_down, s_out_gate_1H)
    return backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule,
                    _plain_operands(w_gate, w_up, w_down, transposed=True),
                    gu_N2I, s_gate, s_up, s_down, s_out_gate_1H, gu_shared_T2Is, swiglu_limit, grads=grads,
                    accumulate=accumulate)


def backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule, ops: RoutedOperands, gu_N2I, s_gate=None,
             s_up=None, s_down=None, s_out_gate_1H=None, gu_shared_T2Is=None, swiglu_limit=None, *,
             grads: reference.GradBuffers, accumulate=False) -> reference.BackwardResult:
    """The backward with the routed weights as kernel operands (the column-wise gate_t, up_t, down_t are
    read). `grads`: destinations (3-D, per-expert lists, or None for a routed gradient not wanted)."""
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    dev, dtype = x_TH.device, x_TH.dtype
    fields = ("gate_t", "up_t", "down_t")
    ops = _kernel_operands(_dequantized_if_large(ops, T * K, dtype, fields, symbolic=True), fields)
    if dy_TH.dtype != dtype:
        dy_TH = dy_TH.to(dtype)
    sorted_N, offsets_E1 = schedule.sorted_routes_N, schedule.expert_offsets_E1

    dx_NH = torch.empty(T * K, H, dtype=dtype, device=dev)  # route order
    drw_N = expert_backward(x_TH, dy_TH, ops.gate_t, ops.up_t, ops.down_t, gu_N2I, flat(router_weights_TK.float()),
                            sorted_N, offsets_E1, K, swiglu_limit, (grads.d_gate, grads.d_up, grads.d_down), dx_NH,
                            accumulate, scatter=True, d_gate_up=grads.d_gate_up)
    dx_s, bias, d_logit = shared_backward(x_TH, dy_TH, s_gate, s_up, s_down, s_out_gate_1H, gu_shared_T2Is,
                                          swiglu_limit, sorted_N, offsets_E1, grads, accumulate)

    dx_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine(dx_NH, flat(top_experts_TK), dx_TH, s_TH=dx_s, bias_H=bias, bscale_T=d_logit)
    return reference.BackwardResult(dx_TH, drw_N.view(T, K), grads)
