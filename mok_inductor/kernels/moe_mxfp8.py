"""MXFP8 routed weights on the Triton path: the kernels of moe_fwd / moe_bwd with the weight operands given as
float8_e4m3fn data + uint8 E8M0 scales (one per 32 elements along the reduction dim, shared/SPEC.md
section 6; `moe_fwd.w_tile` dequantizes each tile in registers and the activation dtype's `tl.dot` runs).

The forward reads the row-wise gate, up and down; the backward only the column-wise (transposed) ones, for
the data gradients: it recomputes no GEMM (the forward saved g and u). The weight gradients need activations
and dy only, as in bf16. A plain float operand (a bf16 down_proj next to an MXFP8 gate_up_proj) runs the same
kernels with MX=False. `tl.dot_scaled` is not used: on Hopper Triton decomposes it into the same bf16 upcast,
and the interpreter rejects it. The shared expert stays bf16 (as in MoK). Split per-expert MXFP8 weights are
stacked once per call (a copy of the quantized bytes); the reference path reads them in place.
"""

from __future__ import annotations

from .. import reference
from ..mxfp8 import RoutedOperands
from . import backward, forward, stacked


def moe_forward(x_TH, router_weights_TK, top_experts_TK, schedule, ops: RoutedOperands, s_gate=None, s_up=None,
                s_down=None, s_out_gate_1H=None, swiglu_limit=None) -> reference.ForwardResult:
    """reference.moe_forward with the routed weights given as `ops` (mok_inductor.mxfp8.routed_operands)."""
    return forward(x_TH, router_weights_TK, top_experts_TK, schedule, stacked(ops), s_gate, s_up, s_down,
                   s_out_gate_1H, swiglu_limit)


def moe_backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule, ops: RoutedOperands, gu_N2I,
                 s_gate=None, s_up=None, s_down=None, s_out_gate_1H=None, gu_shared_T2Is=None, swiglu_limit=None,
                 *, grads: reference.GradBuffers, accumulate=False) -> reference.BackwardResult:
    """reference.moe_backward with the routed weights given as `ops` (column-wise operands required).
    `grads`: destinations; a None routed entry skips that weight gradient (no master weight)."""
    return backward(dy_TH, x_TH, router_weights_TK, top_experts_TK, schedule, stacked(ops), gu_N2I, s_gate, s_up,
                    s_down, s_out_gate_1H, gu_shared_T2Is, swiglu_limit, grads=grads, accumulate=accumulate)
