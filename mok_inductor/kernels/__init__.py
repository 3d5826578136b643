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
    from .moe_bwd import bwd_act, wgrad
    from .moe_fwd import combine, gate_up, grouped_rows, rowdot
    from .schedule import build_schedule
else:  # pragma: no cover
    build_schedule = reference.build_schedule


def _is_tensor3(w) -> bool:
    return isinstance(w, torch.Tensor) and w.dim() == 3


def _nk(w, n_dim: int, k_dim: int):
    """(stride_e, stride_n, stride_k) of a 3-D weight read as [E, n, k]."""
    return (w.stride(0), w.stride(n_dim), w.stride(k_dim))


def _flat_route_weights(router_weights_TK):
    rw = router_weights_TK.float().reshape(-1)
    return rw if rw.is_contiguous() else rw.contiguous()


def _flat_experts(top_experts_TK):
    te = top_experts_TK.reshape(-1)
    return te if te.is_contiguous() else te.contiguous()


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
    grouped_rows(h_NI, w_down, y_NH, sorted_N, offsets_E1, w1_nk_strides=_nk(w_down, 1, 2), scatter=True)

    s_TH = logit_T = None
    if s_gate is not None:
        h_shared = torch.empty(T, s_gate.shape[0], dtype=dtype, device=dev)
        gate_up(x_TH, s_gate[None], s_up[None], h_shared, sorted_N, offsets_E1, 1, swiglu_limit, single=True)
        s_TH = torch.empty(T, H, dtype=dtype, device=dev)
        sd = s_down[None]
        grouped_rows(h_shared, sd, s_TH, sorted_N, offsets_E1, w1_nk_strides=_nk(sd, 1, 2), scatter=False,
                     single=True)
        if s_out_gate_1H is not None:
            logit_T = rowdot(x_TH, s_out_gate_1H)
    else:
        h_shared = x_TH.new_empty(0, 0)

    y_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine(y_NH, _flat_experts(top_experts_TK), y_TH, rw_N=_flat_route_weights(router_weights_TK),
            s_TH=s_TH, logit_T=logit_T)
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
    rw_N = _flat_route_weights(router_weights_TK)
    te_N = _flat_experts(top_experts_TK)

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
    grouped_rows(dgu_N2I, w_gate, dx_NH, sorted_N, offsets_E1, w1_nk_strides=_nk(w_gate, 2, 1), w2=w_up,
                 w2_nk_strides=_nk(w_up, 2, 1), scatter=True)

    # shared expert and its output gate
    dx_s = bias = d_logit = None
    if s_gate is not None:
        gate_T = None
        if s_out_gate_1H is not None:
            gate_T = torch.sigmoid(rowdot(x_TH, s_out_gate_1H))
        sg, su, sd = s_gate[None], s_up[None], s_down[None]
        dgu_s, dgate_T, hs_s = bwd_act(x_TH, dy_TH, sg, su, sd, h_shared_TIs, gate_T, sorted_N, offsets_E1, 1,
                                       swiglu_limit, single=True)
        wgrad(dy_TH, hs_s, grads.d_s_down[None], sorted_N, offsets_E1, 1, a_gather=True, b_gather=False,
              accumulate=accumulate, single=True, n_rows=T)
        Is = s_gate.shape[0]
        wgrad(dgu_s[:, :Is], x_TH, grads.d_s_gate[None], sorted_N, offsets_E1, 1, a_gather=False,
              b_gather=True, accumulate=accumulate, single=True, n_rows=T)
        wgrad(dgu_s[:, Is:], x_TH, grads.d_s_up[None], sorted_N, offsets_E1, 1, a_gather=False,
              b_gather=True, accumulate=accumulate, single=True, n_rows=T)
        dx_s = torch.empty(T, H, dtype=dtype, device=dev)
        grouped_rows(dgu_s, sg, dx_s, sorted_N, offsets_E1, w1_nk_strides=_nk(sg, 2, 1), w2=su,
                     w2_nk_strides=_nk(su, 2, 1), scatter=False, single=True)
        if s_out_gate_1H is not None:
            d_logit = dgate_T * gate_T * (1.0 - gate_T)
            d_w = d_logit[None, :] @ x_TH.float()  # [1, H] float32, a fixed-order GEMV
            if accumulate:
                grads.d_s_out_gate.add_(d_w)
            else:
                grads.d_s_out_gate.copy_(d_w)
            bias = s_out_gate_1H.reshape(-1)

    dx_TH = torch.empty(T, H, dtype=dtype, device=dev)
    combine(dx_NH, te_N, dx_TH, s_TH=dx_s, bias_H=bias, bscale_T=d_logit)
    return reference.BackwardResult(dx_TH, drw_N.view(T, K), grads)
