"""The MoK computation in plain PyTorch: the CPU path, and the oracle for the Triton kernels.

This is the one reference implementation of the MoE layer (docs/semantics.md) in the package. The op
registration (`mok_inductor.ops`) calls it for CPU tensors; the kernel tests compare the Triton
kernels against it; the tests in `tests/` check it against an independent float64 loop.

Data flow (forward):

    top_experts_TK --schedule--> sorted_routes_N, expert_offsets_E1, route_slots_N
    x_TH[sorted_routes // K] --per-expert GEMMs--> gu_N2I = [g | u] (stored, x.dtype, before the clamp)
    gu_N2I --clamped SwiGLU--> h (x.dtype) --per-expert down GEMM--> y_NH (rounded to x.dtype)
    y_TH = s_TH * sigmoid(x @ w_gate^T) + sum_k rw_TK[:, k] * y[route_slots[t*K+k]]   (fp32, k order)

What backward gets from the forward: the gate/up pre-activations gu (so no GEMM is recomputed; h is
recomputed from gu elementwise). The router-weight gradient is <dy_t @ down[e], h_tk> = <dy_t, y_tk>,
without storing y_tk. The shared output gate's gradient uses the same identity on the shared expert:
<dy_t, s_t> = <dy_t @ down_s, h_s,t>.

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E experts,
K routes per token, N = T*K routes. Suffixes name the dims (`x_TH`, `gu_N2I`, `expert_offsets_E1` is [E+1]).

Weights are passed as separate gate, up and down operands, each a 3-D tensor or a sequence of E
2-D tensors (split per-expert allocations; `w[e]` works for both, so nothing is stacked). Combined
FC1 `[E, 2I, H]` is passed as two zero-copy row views.

Numerics: every GEMM accumulates in float32 (float64 inputs, used by the demo's and the tests' float64
runs, stay float64 throughout); the routed g and u are rounded to x.dtype (as stored; never across a clamp
bound, `round_keep_clip`), the shared expert's kept in float32 (`shared_saved_dtype`); the clamp and SwiGLU
run in float32 on those values, and h, y_tk and s_t are rounded to x.dtype between stages (as a bf16 kernel
stores them); the combine accumulates in float32 in k order and the result is rounded to x.dtype once.
"""

from __future__ import annotations

from typing import Optional

import torch

from .types import (SWIGLU, Activation, BackwardResult, ForwardResult, GradBuffers, Schedule, Weight, clip_bounds,
                    shared_saved_dtype)

def build_schedule(top_experts_TK: torch.Tensor, num_experts: int) -> Schedule:
    """Sort the routes of `top_experts_TK` by expert; `-1` routes go last. Values must be in [-1, E)."""
    flat_N = top_experts_TK.reshape(-1).to(torch.int64)
    n = flat_N.numel()
    key_N = torch.where(flat_N < 0, torch.full_like(flat_N, num_experts), flat_N)
    _, order_N = torch.sort(key_N, stable=True)
    counts = torch.bincount(key_N, minlength=num_experts + 1)[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_N.device)
    offsets[1:] = torch.cumsum(counts, 0)
    slots_N = torch.empty_like(order_N)
    slots_N[order_N] = torch.arange(n, device=flat_N.device)
    return Schedule(order_N.to(torch.int32), offsets.to(torch.int32), slots_N.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# The gated activation with the optional clamp (MoK / Megatron activation_func_clamp_value, GPT-OSS): gate
# clamped above, up clamped both ways, then h = g * sigmoid(alpha * g) * (u + beta) (`types.Activation`;
# SwiGLU is alpha 1, beta 0). Float32 in, float32 out.


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: Optional[float], act: Activation = SWIGLU) -> torch.Tensor:
    if limit is not None:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, min=-limit, max=limit)
    if act.beta != 0.0:
        u = u + act.beta
    if act.alpha == 1.0:  # F.silu: the SwiGLU's values exactly as before the variants existed
        return torch.nn.functional.silu(g) * u
    return g * torch.sigmoid(act.alpha * g) * u


def swiglu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, limit: Optional[float],
                    act: Activation = SWIGLU):
    """Gradients of the gated activation w.r.t. g and u (pre-clamp). The clamp passes no gradient where it
    clipped; a NaN is not "clipped", so it propagates. With s = sigmoid(alpha g'):
    dh/dg' = (u' + beta) s (1 + alpha g' (1 - s)),  dh/du' = g' s."""
    if limit is not None:
        gc = torch.clamp(g, max=limit)
        uc = torch.clamp(u, min=-limit, max=limit)
    else:
        gc, uc = g, u
    if act.beta != 0.0:
        uc = uc + act.beta
    sig = torch.sigmoid(gc if act.alpha == 1.0 else act.alpha * gc)
    silu = gc * sig
    dsilu = sig * (1.0 + (gc if act.alpha == 1.0 else act.alpha * gc) * (1.0 - sig))
    dg = dh * uc * dsilu
    du = dh * silu
    if limit is not None:
        dg = torch.where(g > limit, torch.zeros_like(dg), dg)
        du = torch.where(u.abs() > limit, torch.zeros_like(du), du)
    return dg, du


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 activations; float64 stays float64 (the oracle and gradcheck runs)."""
    return torch.promote_types(x.dtype, torch.float32)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated in float32 (or float64 for float64 operands)."""
    acc = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return a.to(acc) @ b.to(acc)


def _offsets_list(schedule: Schedule) -> list[int]:
    return schedule.expert_offsets_E1.tolist()


# ---------------------------------------------------------------------------------------------
# Forward


def round_keep_clip(g32, u32, dtype, limit):
    """g, u rounded to `dtype` (bf16/fp16), but never across a clamp bound: a value the clamp clips in float32
    stays clipped once stored, and one it passes stays passed. Plain rounding would move the clamp's
    gradient mask (decided on the stored values in backward) for values within one step of the bound."""
    g, u = g32.to(dtype), u32.to(dtype)
    if limit is None or dtype not in (torch.bfloat16, torch.float16):
        return g, u
    above, below = clip_bounds(limit, dtype)
    g = torch.where(g32 > limit, torch.maximum(g, above), torch.minimum(g, below))
    u = torch.where(u32 > limit, torch.maximum(u, above), torch.minimum(u, below))
    u = torch.where(u32 < -limit, torch.minimum(u, -above), torch.maximum(u, -below))
    return g, u


def gate_up_outputs(x, w_gate, w_up, limit, gu_dtype=None, act: Activation = SWIGLU, bias_2I=None):
    """(gu = [x @ gate^T + b_g | x @ up^T + b_u] rounded to gu_dtype (default x.dtype; `round_keep_clip`),
    h = the activation of the rounded values in x.dtype). `bias_2I`: optional [2, I] (gate row, up row), added
    to the float32 accumulators, before the rounding and the clamp."""
    g32, u32 = _mm(x, w_gate.t()), _mm(x, w_up.t())
    if bias_2I is not None:
        g32 = g32 + bias_2I[0].to(g32.dtype)
        u32 = u32 + bias_2I[1].to(u32.dtype)
    g, u = round_keep_clip(g32, u32, gu_dtype or x.dtype, limit)
    gu = torch.cat([g, u], dim=-1)
    return gu, swiglu_of(gu, limit, act).to(x.dtype)


def swiglu_of(gu: torch.Tensor, limit: Optional[float], act: Activation = SWIGLU) -> torch.Tensor:
    """The activation of a stored [.., 2I] gate/up tensor, in the accumulation dtype."""
    g, u = gu.to(_acc_dtype(gu)).chunk(2, dim=-1)
    return swiglu(g, u, limit, act)


def _shared_forward(x_TH, s_gate, s_up, s_down, limit, act):
    gu, h = gate_up_outputs(x_TH, s_gate, s_up, limit, gu_dtype=shared_saved_dtype(x_TH.dtype), act=act)
    s = _mm(h, s_down.t()).to(x_TH.dtype)
    return gu, s


def moe_forward(
    x_TH: torch.Tensor,
    router_weights_TK: torch.Tensor,
    top_experts_TK: torch.Tensor,
    schedule: Schedule,
    w_gate: Weight,  # [E, I, H] or E x [I, H]
    w_up: Weight,  # [E, I, H] or E x [I, H]
    w_down: Weight,  # [E, H, I] or E x [H, I]
    s_gate: Optional[torch.Tensor] = None,  # [Is, H]
    s_up: Optional[torch.Tensor] = None,  # [Is, H]
    s_down: Optional[torch.Tensor] = None,  # [H, Is]
    s_out_gate_1H: Optional[torch.Tensor] = None,  # [1, H]
    swiglu_limit: Optional[float] = None,
    act: Activation = SWIGLU,
    gate_up_bias_E2I: Optional[torch.Tensor] = None,  # [E, 2, I] (gate row, up row; any strides)
    down_bias_EH: Optional[torch.Tensor] = None,  # [E, H]
) -> ForwardResult:
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    N = T * K
    E = len(w_gate)
    dtype = x_TH.dtype
    I = w_down[0].shape[-1] if E > 0 else 0
    offsets = _offsets_list(schedule)
    n_valid = offsets[E]

    tokens_N = schedule.sorted_routes_N.to(torch.int64) // max(K, 1)
    xs = x_TH[tokens_N[:n_valid]]
    gu_N2I = torch.zeros(N, 2 * I, dtype=dtype, device=x_TH.device)
    acc = _acc_dtype(x_TH)
    y_NH = torch.zeros(N, H, dtype=acc, device=x_TH.device)
    for e in range(E):
        a, b = offsets[e], offsets[e + 1]
        if a == b:
            continue
        bias = None if gate_up_bias_E2I is None else gate_up_bias_E2I[e]
        gu_N2I[a:b], h = gate_up_outputs(xs[a:b], w_gate[e], w_up[e], swiglu_limit, act=act, bias_2I=bias)
        y = _mm(h, w_down[e].t())
        if down_bias_EH is not None:  # in the down GEMM's accumulator, before the routing weight
            y = y + down_bias_EH[e].to(y.dtype)
        y_NH[a:b] = y.to(dtype).to(acc)

    acc_TH = torch.zeros(T, H, dtype=acc, device=x_TH.device)
    if s_gate is not None:
        gu_shared, s_TH = _shared_forward(x_TH, s_gate, s_up, s_down, swiglu_limit, act)
        if s_out_gate_1H is not None:
            acc_TH = s_TH.to(acc) * torch.sigmoid(_mm(x_TH, s_out_gate_1H.t()))
        else:
            acc_TH = s_TH.to(acc)
    else:
        gu_shared = x_TH.new_empty(0, 0, dtype=shared_saved_dtype(x_TH.dtype))

    valid_TK = top_experts_TK >= 0
    rw_TK = router_weights_TK.to(acc)
    y_TKH = y_NH[schedule.route_slots_N.to(torch.int64)].view(T, K, H)
    for k in range(K):
        contrib = rw_TK[:, k, None] * y_TKH[:, k]
        acc_TH = acc_TH + torch.where(valid_TK[:, k, None], contrib, torch.zeros_like(contrib))
    return ForwardResult(acc_TH.to(dtype), gu_N2I, gu_shared)


# ---------------------------------------------------------------------------------------------
# Backward


def _store(dst: torch.Tensor, value_fp32: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        dst.add_(value_fp32)  # one rounding into dst.dtype
    else:
        dst.copy_(value_fp32)


def moe_backward(
    dy_TH: torch.Tensor,
    x_TH: torch.Tensor,
    router_weights_TK: torch.Tensor,
    top_experts_TK: torch.Tensor,
    schedule: Schedule,
    w_gate: Weight,
    w_up: Weight,
    w_down: Weight,
    gu_N2I: torch.Tensor,
    s_gate: Optional[torch.Tensor] = None,
    s_up: Optional[torch.Tensor] = None,
    s_down: Optional[torch.Tensor] = None,
    s_out_gate_1H: Optional[torch.Tensor] = None,
    gu_shared_T2Is: Optional[torch.Tensor] = None,
    swiglu_limit: Optional[float] = None,
    act: Activation = SWIGLU,
    gate_up_bias_E2I: Optional[torch.Tensor] = None,
    down_bias_EH: Optional[torch.Tensor] = None,
    *,
    grads: Optional["GradBuffers"] = None,
    accumulate: bool = False,
    dgrad: Optional[tuple] = None,
) -> BackwardResult:
    """Gradients of every input. `gu_N2I`, `gu_shared_T2Is` are the saved gate/up pre-activations; h is
    recomputed from them (elementwise). dx comes back in x.dtype, d_router_weights in float32.

    Weight gradients go into `grads` (each entry a 3-D tensor or a sequence of E 2-D tensors, any
    float dtype; None entries are allocated in the weight's dtype): written, or ADDED when
    `accumulate` (Megatron's main_grad accumulation). They are computed in float32 and rounded once.

    Bias gradients (when the biases are given) go to `grads.d_gate_up_bias` [E, 2, I] and `grads.d_down_bias`
    [E, H] (allocated in the bias's dtype when None): d b_down[e] = sum over e's routes of w dy_t,
    d b_gu[e] = the sums of dg and du over them, each a fixed-order float32 sum. The router weight's gradient
    gains <dy_t, b_down[e]> (y_tk includes the bias).

    `dgrad`: optional routed (gate, up, down) weights for the data-gradient GEMMs (dy @ down, dg @ gate,
    du @ up) when they differ from the forward's: MXFP8's column-wise operands, dequantized
    (`mok_inductor.mxfp8`).
    """
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    N = T * K
    E = len(w_gate)
    dtype = x_TH.dtype
    offsets = _offsets_list(schedule)
    n_valid = offsets[E]
    acc = _acc_dtype(x_TH)
    dyf = dy_TH.to(acc)

    sorted_N = schedule.sorted_routes_N.to(torch.int64)
    tokens_N = sorted_N // max(K, 1)
    rw_N = router_weights_TK.to(acc).reshape(-1)[sorted_N]
    xs = x_TH[tokens_N[:n_valid]]
    dys = dyf[tokens_N[:n_valid]]

    grads = GradBuffers.allocate(
        grads, w_gate, w_up, w_down, s_gate, s_up, s_down, s_out_gate_1H
    )
    if gate_up_bias_E2I is not None and grads.d_gate_up_bias is None:
        grads = grads._replace(d_gate_up_bias=torch.empty_like(gate_up_bias_E2I))
    if down_bias_EH is not None and grads.d_down_bias is None:
        grads = grads._replace(d_down_bias=torch.empty_like(down_bias_EH))
    bias_grads = [b for b in (grads.d_gate_up_bias, grads.d_down_bias) if b is not None]
    dx_N = torch.zeros(N, H, dtype=acc, device=x_TH.device)
    drw_N = torch.zeros(N, dtype=acc, device=x_TH.device)
    for e in range(E):
        a, b = offsets[e], offsets[e + 1]
        wg, wu, wd = w_gate[e], w_up[e], w_down[e]
        dg_w, du_w, dd_w = (wg, wu, wd) if dgrad is None else (dgrad[0][e], dgrad[1][e], dgrad[2][e])
        if a == b:
            if not accumulate:  # an expert with no routes has zero weight gradients
                for buf in (grads.d_gate[e], grads.d_up[e], grads.d_down[e], *(b[e] for b in bias_grads)):
                    buf.zero_()
            continue
        xe, dye, gue = xs[a:b], dys[a:b], gu_N2I[a:b]
        he32 = swiglu_of(gue, swiglu_limit, act)  # h recomputed from the saved g, u (float32: the dot below)
        he = he32.to(dtype)  # the forward's h, as the down GEMM read it
        q = _mm(dye, dd_w)  # dy_t @ down[e]: [rows, I]
        drw_N[a:b] = (q * he32).sum(-1)
        if down_bias_EH is not None:  # <dy_t, y_tk> with y_tk = D h + b: the bias's share
            drw_N[a:b] += dye @ down_bias_EH[e].to(acc)
        dye_w = (dye * rw_N[a:b, None]).to(dtype)  # the down GEMM's scaled input, as a kernel stores it
        dh = _mm(dye_w, dd_w)
        g, u = gue.to(acc).chunk(2, dim=-1)
        dg, du = swiglu_backward(dh, g, u, swiglu_limit, act)
        dg, du = dg.to(dtype), du.to(dtype)
        if grads.d_down_bias is not None:
            _store(grads.d_down_bias[e], dye_w.to(acc).sum(0), accumulate)
        if grads.d_gate_up_bias is not None:
            _store(grads.d_gate_up_bias[e], torch.stack([dg.to(acc).sum(0), du.to(acc).sum(0)]), accumulate)
        _store(grads.d_down[e], _mm(dye_w.t(), he), accumulate)
        _store(grads.d_gate[e], _mm(dg.t(), xe), accumulate)
        _store(grads.d_up[e], _mm(du.t(), xe), accumulate)
        dx_N[a:b] = _mm(dg, dg_w) + _mm(du, du_w)

    valid_TK = top_experts_TK >= 0
    slots_TK = schedule.route_slots_N.to(torch.int64).view(T, K)
    dx_TKH = dx_N[slots_TK]
    dx_TH = torch.zeros(T, H, dtype=acc, device=x_TH.device)
    for k in range(K):
        dx_TH = dx_TH + torch.where(valid_TK[:, k, None], dx_TKH[:, k], torch.zeros_like(dx_TKH[:, k]))
    drw_TK = torch.where(valid_TK, drw_N[slots_TK], torch.zeros_like(drw_N[slots_TK]))

    if s_gate is not None:
        hs = swiglu_of(gu_shared_T2Is, swiglu_limit, act)
        h_s = hs.to(dtype)
        q = _mm(dy_TH, s_down)  # [T, Is]
        if s_out_gate_1H is not None:
            gate_T1 = torch.sigmoid(_mm(x_TH, s_out_gate_1H.t()))
            d_gate_T1 = (q * hs).sum(-1, keepdim=True)  # <dy_t, s_t>
            d_logit_T1 = d_gate_T1 * gate_T1 * (1.0 - gate_T1)
            _store(grads.d_s_out_gate, d_logit_T1.t() @ x_TH.to(acc), accumulate)
            dx_TH = dx_TH + d_logit_T1 * s_out_gate_1H.to(acc)
            dy_s = (dyf * gate_T1).to(dtype)
        else:
            dy_s = dy_TH.to(dtype)
        dh = _mm(dy_s, s_down)
        g, u = gu_shared_T2Is.to(acc).chunk(2, dim=-1)
        dg, du = swiglu_backward(dh, g, u, swiglu_limit, act)
        dg, du = dg.to(dtype), du.to(dtype)
        _store(grads.d_s_down, _mm(dy_s.t(), h_s), accumulate)
        _store(grads.d_s_gate, _mm(dg.t(), x_TH), accumulate)
        _store(grads.d_s_up, _mm(du.t(), x_TH), accumulate)
        dx_TH = dx_TH + _mm(dg, s_gate) + _mm(du, s_up)

    return BackwardResult(dx_TH.to(dtype), drw_TK, grads)
