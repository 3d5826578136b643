"""The Triton kernels of the CUDA path, behind one entry: `build_schedule`, and `forward` and `backward` over the
routed weights as kernel operands (`mok_inductor.types.RoutedOperands`: bf16/fp16/fp32, or MXFP8 e4m3 data +
E8M0 scales, 3-D or split per expert; `RoutedOperands.of_weights` for float weights).

Forward:
    top_experts --build_schedule--> sorted routes, expert offsets (a stable counting sort on the device)
    x --gate_up (gather fused)--> gu [N, 2I] (saved), h [N, I] --grouped_rows (down)--> y per route [N, H]
      --combine (router weights, shared expert, its gate; fp32 in k order)--> y [T, H]
    (where the tables pick it, the gate/up stage is torch._grouped_mm over the gathered rows, then a pass
    computing h: `gate_up.GATE_UP_STAGE`)
Decode (`decode_forward`: eager calls of a few routes that need no gradient, `options.decode_max_routes`):
    x --gate/up per route (ids checked)--> h [N, I] --down per route--> y per route [N, H] --combine--> y [T, H]
Backward:
    dy --bwd_act (dy @ down, SwiGLU backward from the saved g, u)--> dgu [N, 2I], d router weights, rw * h
      --wgrad (down; gate and up as one GEMM)--> weight gradients (written or added into main grads)
    dgu --grouped_rows (gate, up)--> dx per route --combine over k (+ shared dx, + the gate's logit
      gradient)--> dx [T, H]
Backward computes 12·N·H·I FLOPs (no GEMM is recomputed); the price is the saved activations: [N, 2I] (g
and u) instead of h [N, I].

Families, one module each:

    common.py        launch plumbing (wrap_triton when traced), tile enumeration, swizzle
    configs.py       tile configs and stage picks: the tuned tables (tables/*.json), the fallback heuristic,
                     the opt-in search
    operands.py      weight operands: strides, split weights through address tables (`ExpertTable`), TMA
                     descriptors, MXFP8 dequantized once per call (`dequantized`)
    mx_loop.py       the MXFP8 K loops on the fp16 tensor cores (`MxLoop`), the activation rows in fp16
    schedule.py      the device schedule
    gate_up.py       the gathered gate/up GEMM, SwiGLU epilogue
    grouped_gemm.py  the grouped row GEMM (the down GEMM; the data gradients)
    combine.py       the combine over routes, the row dot of the shared output gate
    bias_grad.py     the routed biases' gradients (fixed-order sums over each expert's rows)
    bwd_act.py       the down data-gradient GEMM with the SwiGLU backward (fused or a second pass)
    wgrad.py         the grouped weight-gradient GEMM with the accumulating epilogue
    gemv.py          the decode forward: gate/up and down per route, no schedule

Shapes only decide grids, allocations and kernel choices (worst-case tile counts; idle programs exit; a
symbolic size decides without a guard, `common.at_least`), there is no host synchronisation, and every
reduction has a fixed order (no float atomics): the ops are capturable in CUDA graphs and bitwise
deterministic.

MXFP8 operands are read in the K loops at few routes per expert and dequantized once per call into a
transient x.dtype copy at many (`options.mx_dequantize_min_rows`). In the K loops, bf16/fp16 activations at
decode sizes (`options.mx_f16_dot_max_rows`) run on the fp16 tensor cores (`mx_loop.MxLoop`), the rest
dequantize each weight tile in registers. Split per-expert weights (sequences of E 2-D tensors, bf16 or MXFP8)
are read in place through a device table of the experts' addresses (`operands.ExpertTable`; stacked instead
while torch.compile traces, or when the experts differ in strides). Per-expert gradient destinations are
written through one float32 buffer.

Tile configs come from tables keyed on the problem and a power-of-two bucket of the row count
(`configs`); no kernel specialises on a row count, so a new token count compiles nothing. Tuning thresholds
and switches come from `mok_inductor.options.current()` when a launch is prepared.

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per token,
N = T*K.
"""

from __future__ import annotations

import torch

from .. import options
from ..types import (BackwardResult, ForwardResult, GradBuffers, Operand, RoutedOperands, shared_saved_dtype,
                     split_gate_up)

try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency of torch on Linux
    _HAVE_TRITON = False

AVAILABLE = _HAVE_TRITON and (torch.cuda.is_available() or options.INTERPRET)

if _HAVE_TRITON:
    from . import bias_grad, bwd_act, combine, common, gate_up, gemv, grouped_gemm, mx_loop, operands, wgrad  # noqa: F401
    from .common import flat
    from .operands import ExpertTable, dequantized, plain, plain_t
    from . import schedule as _schedule
    from .schedule import build_schedule  # noqa: F401

    # the kernel families' modules (their `_*_kernel` objects are the Triton kernels Inductor's code names)
    MODULES = (_schedule, operands, mx_loop, gate_up, grouped_gemm, combine, bwd_act, wgrad, bias_grad, gemv)


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
    traced = common.without_pointers(tensors)

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
    if not common.at_least(n_routes, options.current().mx_dequantize_min_rows * max(E, 1), symbolic):
        return ops
    return ops._replace(**{f: dequantized(getattr(ops, f), dtype) for f in fields if getattr(ops, f) is not None})


# ---------------------------------------------------------------------------------------------
# Forward


def expert_mlp(x_TH, gate, up, down, rows, gu_dtype, out, routes_N, offsets_E1, topk, limit, *, scatter,
               single=False, act=None, gate_up_bias=None, down_bias=None):
    """gu = [g | u] [rows, 2I] in gu_dtype (saved for backward) and out[dest(r)] = swiglu(g, u) @ down[e]^T for
    each sorted row r: the gate/up GEMM (which also writes h, freed on return) then the down GEMM. gate, up read as
    [E, I, H], down as [E, H, I]. (A down GEMM applying the SwiGLU to g, u tiles in its K loop instead of
    reading h ran at half the rate: its A operand goes through registers.) `act`: the gated activation
    (`types.Activation`, None: the SwiGLU); the optional biases [E, 2, I], [E, H] go into the GEMMs'
    accumulators. -> gu."""
    h = torch.empty(rows, gate.data.shape[1], dtype=out.dtype, device=out.device)
    gu = gate_up.gate_up(x_TH, gate, up, rows, gu_dtype, routes_N, offsets_E1, topk, limit, h_out=h, single=single,
                         act=act, bias_E2I=gate_up_bias)
    grouped_gemm.grouped_rows(h, down, out, routes_N, offsets_E1, scatter=scatter, single=single, bias_EN=down_bias)
    return gu


def shared_forward(x_TH, s_gate, s_up, s_down, s_out_gate_1H, sorted_N, offsets_E1, swiglu_limit, act=None):
    """The shared expert (always x.dtype weights) -> (gu_shared [T, 2Is] (empty without one), its output
    s_TH [T, H] or None, the output gate's logits [T] float32 or None): the combine's inputs."""
    T, H = x_TH.shape
    if s_gate is None:
        return x_TH.new_empty(0, 0, dtype=shared_saved_dtype(x_TH.dtype)), None, None
    dev, dtype = x_TH.device, x_TH.dtype
    s_TH = torch.empty(T, H, dtype=dtype, device=dev)
    gu_shared = expert_mlp(x_TH, plain(s_gate[None]), plain(s_up[None]), plain(s_down[None]), T,
                           shared_saved_dtype(dtype), s_TH, sorted_N, offsets_E1, 1, swiglu_limit, scatter=False,
                           single=True, act=act)
    logit_T = combine.rowdot(x_TH, s_out_gate_1H) if s_out_gate_1H is not None else None
    return gu_shared, s_TH, logit_T


def forward(x_TH, router_weights_TK, top_experts_TK, schedule, ops: RoutedOperands, s_gate=None, s_up=None,
            s_down=None, s_out_gate_1H=None, swiglu_limit=None, act=None, gate_up_bias=None,
            down_bias=None) -> ForwardResult:
    """The forward with the routed weights as kernel operands (`types.RoutedOperands`: bf16, or MXFP8
    row-wise data + scales read in the K loop, 3-D or split per expert); `act` the gated activation, the
    optional routed biases gate_up_bias [E, 2, I] and down_bias [E, H]."""
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    N = T * K
    fields = ("gate", "up", "down")
    ops = _kernel_operands(_dequantized_if_large(ops, N, x_TH.dtype, fields, symbolic=False), fields)
    dev, dtype = x_TH.device, x_TH.dtype
    sorted_N, offsets_E1 = schedule.sorted_routes_N, schedule.expert_offsets_E1

    y_NH = torch.empty(N, H, dtype=dtype, device=dev)  # route order; rows of `-1` routes unwritten
    gu_N2I = expert_mlp(x_TH, ops.gate, ops.up, ops.down, N, dtype, y_NH, sorted_N, offsets_E1, K, swiglu_limit,
                        scatter=True, act=act, gate_up_bias=gate_up_bias, down_bias=down_bias)  # saved for backward

    gu_shared, s_TH, logit_T = shared_forward(x_TH, s_gate, s_up, s_down, s_out_gate_1H, sorted_N, offsets_E1,
                                              swiglu_limit, act)

    y_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine.combine(y_NH, flat(top_experts_TK), y_TH, rw_N=flat(router_weights_TK), s_TH=s_TH, logit_T=logit_T)
    return ForwardResult(y_TH, gu_N2I, gu_shared)


def decode_forward(x_TH, router_weights_TK, top_experts_TK, gate_up, down, s_gate=None, s_up=None, s_down=None,
                   s_out_gate_1H=None, swiglu_limit=None, act=None, gate_up_bias=None, down_bias=None):
    """y [T, H] of a call that saves nothing for backward, without the schedule (`gemv`): gate_up [E, 2I, H] or
    [E, 2, I, H] and down [E, H, I] plain tensors of x.dtype, gate_up_bias [E, 2, I], the shared expert as in
    `forward`. At least one route and I > 0."""
    T, H = x_TH.shape
    gate, up = split_gate_up(gate_up)
    te_N = flat(top_experts_TK)
    s_TH = logit_T = None
    if s_gate is not None:  # (the shared expert's launches read no schedule: any int32 tensor in its place)
        none = torch.empty(0, dtype=torch.int32, device=x_TH.device)
        _, s_TH, logit_T = shared_forward(x_TH, s_gate, s_up, s_down, s_out_gate_1H, none, none, swiglu_limit, act)
    y_TH = torch.empty(T, H, dtype=x_TH.dtype, device=x_TH.device)
    ok = gemv.gemv_routes(x_TH, te_N, flat(router_weights_TK), gate, up, down, y_TH, swiglu_limit, act=act,
                          gate_up_bias=gate_up_bias, down_bias=down_bias, s_TH=s_TH, logit_T=logit_T)
    common.assert_expert_ids(ok, top_experts_TK, gate.shape[0])
    return y_TH


# ---------------------------------------------------------------------------------------------
# Backward


def expert_backward(x_TH, dy_TH, gate_t, up_t, down_t, gu_M2I, scale, routes_N, offsets_E1, topk, limit,
                    d_weights, dx_out, accumulate, *, scatter, single=False, d_gate_up=None, act=None,
                    d_biases=(None, None)):
    """Weight gradients (d_gate, d_up, d_down) = `d_weights` (written or ADDED; None entries skipped) and
    dx_out[dest(r)] = dg @ gate[e] + du @ up[e] of the expert MLPs whose forward saved `gu_M2I`. gate_t, up_t
    read as [E, H, I], down_t as [E, I, H] (the transposed weights). `d_gate_up`: the [E, 2I, H] buffer whose
    row halves d_gate and d_up are, written as one destination (GradBuffers.d_gate_up). `d_biases`: the routed
    biases' gradient destinations ([E, 2, I], [E, H]; None: no bias), sums over each expert's rows. Returns
    d scale [routes] float32 (without the down bias's share <dy_t, b_e>)."""
    n_rows = x_TH.shape[0] if single else None
    # gate and up interleaved in one weight (GPT-OSS's layout): dgu's columns alternate dg and du, and the data
    # and weight gradients read dgu and that weight as one operand along its contiguous dim (each half alone is a
    # stride-2 view no load order coalesces)
    both_t = operands.interleaved(gate_t, up_t, 2)  # [E, H, 2I]
    dgu, dscale, hs = bwd_act.bwd_act(dy_TH, down_t, gu_M2I, scale, routes_N, offsets_E1, topk, limit, single=single,
                                      act=act, interleave=both_t is not None)
    d_gub, d_db = d_biases
    if d_gub is not None:  # sum over e's rows of dgu (as rounded for the weight gradient's GEMM)
        # (interleaved: dgu's column 2i + h is [E, 2, I]'s (h, i), so the sums go to its [E, I, 2] view)
        bias_grad.bias_grad(d_gub.transpose(1, 2) if both_t is not None else d_gub, dgu, routes_N, offsets_E1,
                            accumulate=accumulate)
    if d_db is not None:  # sum over e's routes of rw * dy at the route's token
        bias_grad.bias_grad(d_db, dy_TH, routes_N, offsets_E1, topk=topk, scale_N=scale, accumulate=accumulate)
    d_gate, d_up, d_down = d_weights
    tokens_N = None if single else routes_N // topk  # the wgrads' gather index, once for both
    kw = dict(accumulate=accumulate, single=single, n_rows=n_rows, tokens_N=tokens_N)
    wgrad.wgrad_into((d_down,), dy_TH, hs, routes_N, offsets_E1, topk, a_gather=True, b_gather=False, **kw)
    # d_gate and d_up as one GEMM over dgu = [dg | du]: both read the gathered x tile; into their common buffer
    # when there is one (dgu^T @ x is its [2I, H] rows in order)
    # (a 4-D [E, 2, I, H] buffer's halves are not [2I, H] rows in order: the two views then)
    four_d = isinstance(d_gate_up, torch.Tensor) and d_gate_up.dim() == 4
    pair = (d_gate_up,) if d_gate_up is not None and not four_d else (d_gate, d_up)
    wgrad_a, w1, w2 = dgu, gate_t, up_t
    if both_t is not None:  # dgu interleaved; dx reads the whole [E, H, 2I] weight
        w1, w2 = Operand(both_t, None), None
        # [E, 2I, H], from the 4-D buffer by view ops when there is one (compiled, the wgrad writes through it)
        d_both = operands.interleaved_pair(d_gate_up, 1) if four_d else None
        if d_both is None and d_gate is not None and d_up is not None:
            d_both = operands.interleaved(d_gate, d_up, 1)
        if d_both is not None:  # dgu^T @ x is the interleaved weight's gradient, rows in order
            pair = (d_both,)
        elif d_gate is not None or d_up is not None:  # destinations of another layout: [dg | du] for them
            M, two_i = dgu.shape
            wgrad_a = dgu.view(M, two_i // 2, 2).transpose(1, 2).reshape(M, two_i)
    wgrad.wgrad_into(pair, wgrad_a, x_TH, routes_N, offsets_E1, topk, a_gather=False, b_gather=True, **kw)
    grouped_gemm.grouped_rows(dgu, w1, dx_out, routes_N, offsets_E1, w2=w2, scatter=scatter, single=single)
    return dscale


def shared_backward(x_TH, dy_TH, s_gate, s_up, s_down, s_out_gate_1H, gu_shared_T2Is, swiglu_limit, sorted_N,
                    offsets_E1, grads, accumulate, act=None):
    """Weight gradients of the shared expert and its output gate into `grads` (written or ADDED), and the
    combine's inputs for dx: (dx_s [T, H] or None, bias [H] or None, bias scale [T] or None)."""
    if s_gate is None:
        return None, None, None
    T, H = x_TH.shape
    gate_T = torch.sigmoid(combine.rowdot(x_TH, s_out_gate_1H)) if s_out_gate_1H is not None else None
    dx_s = torch.empty(T, H, dtype=x_TH.dtype, device=x_TH.device)
    d_weights = (grads.d_s_gate[None], grads.d_s_up[None], grads.d_s_down[None])
    dgate_T = expert_backward(x_TH, dy_TH, plain_t(s_gate[None]), plain_t(s_up[None]), plain_t(s_down[None]),
                              gu_shared_T2Is, gate_T, sorted_N, offsets_E1, 1, swiglu_limit, d_weights, dx_s,
                              accumulate, scatter=False, single=True, act=act,
                              d_gate_up=None if grads.d_s_gate_up is None else grads.d_s_gate_up[None])
    if s_out_gate_1H is None:
        return dx_s, None, None
    d_logit = dgate_T * gate_T * (1.0 - gate_T)
    d_w = d_logit[None, :] @ x_TH.float()  # [1, H] float32, a fixed-order GEMV
    if accumulate:
        grads.d_s_out_gate.add_(d_w)
    else:
        grads.d_s_out_gate.copy_(d_w)
    return dx_s, s_out_gate_1H.reshape(-1), d_logit


def backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule, ops: RoutedOperands, gu_N2I, s_gate=None,
             s_up=None, s_down=None, s_out_gate_1H=None, gu_shared_T2Is=None, swiglu_limit=None, act=None,
             gate_up_bias=None, down_bias=None, *, grads: GradBuffers, accumulate=False) -> BackwardResult:
    """The backward with the routed weights as kernel operands (the column-wise gate_t, up_t, down_t are
    read). `grads`: destinations (3-D, per-expert lists, or None for a routed gradient not wanted; the biases'
    in d_gate_up_bias, d_down_bias when the biases are given)."""
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
                            accumulate, scatter=True, d_gate_up=grads.d_gate_up, act=act,
                            d_biases=(grads.d_gate_up_bias if gate_up_bias is not None else None,
                                      grads.d_down_bias if down_bias is not None else None))
    if down_bias is not None:  # y_tk = D h + b: d w[t, k] gains <dy_t, b_e>, one [T, E] GEMM gathered per route
        te_TK = top_experts_TK.long()
        dot_TK = (dy_TH.float() @ down_bias.float().t()).gather(1, te_TK.clamp(min=0))
        drw_N = drw_N + torch.where(te_TK >= 0, dot_TK, torch.zeros_like(dot_TK)).reshape(-1)
    dx_s, bias, d_logit = shared_backward(x_TH, dy_TH, s_gate, s_up, s_down, s_out_gate_1H, gu_shared_T2Is,
                                          swiglu_limit, sorted_N, offsets_E1, grads, accumulate, act)

    dx_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine.combine(dx_NH, flat(top_experts_TK), dx_TH, s_TH=dx_s, bias_H=bias, bscale_T=d_logit)
    return BackwardResult(dx_TH, drw_N.view(T, K), grads)
