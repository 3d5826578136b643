"""The Triton kernels of the CUDA path: the same interface as `mok_inductor.reference`
(build_schedule, moe_forward, moe_backward), computed by the kernel families below.

    schedule.py  device schedule: per-chunk histogram -> int32 prefix sums -> stable scatter
    moe_fwd.py   gathered gate/up GEMM + clamped SwiGLU, grouped row GEMM, combine, row dot
    moe_bwd.py   fused down-dgrad + gate/up recompute + SwiGLU backward (+ d router weights),
                 grouped weight-gradient GEMM with the main-grad accumulating epilogue

Forward data flow: x --gate_up (gather fused)--> h [N, I] (saved) --grouped_rows (down)--> y per
route [N, H] --combine (router weights, shared expert, its gate; fp32 in k order)--> y [T, H].
Backward: bwd_act -> dgu [N, 2I], d router weights, rw * h; wgrad x3; grouped_rows (gate, up) -> dx per
route -> combine over k (+ shared dx, + the gate's logit gradient) -> dx [T, H].

Shapes only decide grids and allocations (worst-case tile counts; idle programs exit), there is no
host synchronisation, and every reduction has a fixed order (no float atomics): the ops are
capturable in CUDA graphs and bitwise deterministic.

Not covered yet (falls back to the reference, which synchronises): weights or gradient
destinations given as Python lists (split per-expert allocations).

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per
token, N = T*K.
"""

from __future__ import annotations

import os

try:
    import triton  # noqa: F401

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a dependency of torch on Linux
    _HAVE_TRITON = False

import torch

from .. import reference


def _available() -> bool:
    return _HAVE_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


AVAILABLE = _available()

if _HAVE_TRITON:
    from .moe_bwd import bwd_act, shared_backward, wgrad
    from .moe_fwd import combine, flat, gate_up, grouped_rows, nk_strides, shared_forward
    from .schedule import build_schedule
else:  # pragma: no cover
    build_schedule = reference.build_schedule


def _is_tensor3(w) -> bool:
    return isinstance(w, torch.Tensor) and w.dim() == 3


# ---------------------------------------------------------------------------------------------
# Forward


def moe_forward(x_TH, router_weights_TK, top_experts_TK, schedule, w_gate, w_up, w_down, s_gate=None,
                s_up=None, s_down=None, s_out_gate_1H=None, swiglu_limit=None) -> reference.ForwardResult:
    if not (_is_tensor3(w_gate) and _is_tensor3(w_up) and _is_tensor3(w_down)):
        return reference.moe_forward(x_TH, router_weights_TK, top_experts_TK, schedule, w_gate, w_up, w_down,
                                     s_gate, s_up, s_down, s_out_gate_1H, swiglu_limit)
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    N = T * K
    E, I, _ = w_gate.shape
    dev, dtype = x_TH.device, x_TH.dtype
    sorted_N, offsets_E1 = schedule.sorted_routes_N, schedule.expert_offsets_E1

    h_NI = torch.empty(N, I, dtype=dtype, device=dev)
    gate_up(x_TH, w_gate, w_up, h_NI, sorted_N, offsets_E1, K, swiglu_limit)
    y_NH = torch.empty(N, H, dtype=dtype, device=dev)  # route order; rows of `-1` routes unwritten
    grouped_rows(h_NI, w_down, y_NH, sorted_N, offsets_E1, w1_nk_strides=nk_strides(w_down, 1, 2), scatter=True)

    h_shared, s_TH, logit_T = shared_forward(x_TH, s_gate, s_up, s_down, s_out_gate_1H, sorted_N, offsets_E1,
                                             swiglu_limit)

    y_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine(y_NH, flat(top_experts_TK), y_TH, rw_N=flat(router_weights_TK.float()), s_TH=s_TH, logit_T=logit_T)
    return reference.ForwardResult(y_TH, h_NI, h_shared)


# ---------------------------------------------------------------------------------------------
# Backward


def _lists_in(grads) -> bool:
    return grads is not None and any(b is not None and not isinstance(b, torch.Tensor) for b in grads[:3])


def moe_backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule, w_gate, w_up, w_down, h_NI,
                 s_gate=None, s_up=None, s_down=None, s_out_gate_1H=None, h_shared_TIs=None, swiglu_limit=None,
                 *, grads=None, accumulate=False) -> reference.BackwardResult:
    if not (_is_tensor3(w_gate) and _is_tensor3(w_up) and _is_tensor3(w_down)) or _lists_in(grads):
        return reference.moe_backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule, w_gate, w_up,
                                      w_down, h_NI, s_gate, s_up, s_down, s_out_gate_1H, h_shared_TIs,
                                      swiglu_limit, grads=grads, accumulate=accumulate)
    T, H = x_TH.shape
    K = top_experts_TK.shape[1]
    E, I, _ = w_gate.shape
    dev, dtype = x_TH.device, x_TH.dtype
    if dy_TH.dtype != dtype:
        dy_TH = dy_TH.to(dtype)
    sorted_N, offsets_E1 = schedule.sorted_routes_N, schedule.expert_offsets_E1
    grads = reference.GradBuffers.allocate(grads, w_gate, w_up, w_down, s_gate, s_up, s_down, s_out_gate_1H)
    rw_N = flat(router_weights_TK.float())
    te_N = flat(top_experts_TK)

    # routed experts
    dgu_N2I, drw_N, hs_NI = bwd_act(x_TH, dy_TH, w_gate, w_up, w_down, h_NI, rw_N, sorted_N, offsets_E1, K,
                                    swiglu_limit)
    wgrad(dy_TH, hs_NI, grads.d_down, sorted_N, offsets_E1, K, a_gather=True, b_gather=False,
          accumulate=accumulate)
    wgrad(dgu_N2I[:, :I], x_TH, grads.d_gate, sorted_N, offsets_E1, K, a_gather=False, b_gather=True,
          accumulate=accumulate)
    wgrad(dgu_N2I[:, I:], x_TH, grads.d_up, sorted_N, offsets_E1, K, a_gather=False, b_gather=True,
          accumulate=accumulate)
    dx_NH = torch.empty(T * K, H, dtype=dtype, device=dev)  # route order
    grouped_rows(dgu_N2I, w_gate, dx_NH, sorted_N, offsets_E1, w1_nk_strides=nk_strides(w_gate, 2, 1), w2=w_up,
                 w2_nk_strides=nk_strides(w_up, 2, 1), scatter=True)

    # shared expert and its output gate
    dx_s, bias, d_logit = shared_backward(x_TH, dy_TH, s_gate, s_up, s_down, s_out_gate_1H, h_shared_TIs,
                                          swiglu_limit, sorted_N, offsets_E1, grads, accumulate)

    dx_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine(dx_NH, te_N, dx_TH, s_TH=dx_s, bias_H=bias, bscale_T=d_logit)
    return reference.BackwardResult(dx_TH, drw_N.view(T, K), grads)
