"""The types the layers pass around: the schedule, forward and backward results, gradient destinations and
the routed GEMM operands (bf16 or MXFP8, 3-D or split per expert). The reference, the kernels, the ops and
the integrations all use these; none of them defines its own.

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per token,
N = T*K.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch

Weight = Union[torch.Tensor, Sequence[torch.Tensor]]
Payload = Union[torch.Tensor, Sequence[torch.Tensor]]


class Schedule(NamedTuple):
    """Routes sorted by expert. Deterministic: a stable sort of the flat route index t*K+k.

    sorted_routes_N: int32 [N], the flat route index held by each sorted slot; valid routes first
        (ascending expert, then ascending route index), then the `-1` routes in route order.
    expert_offsets_E1: int32 [E+1], expert e owns slots [offsets[e], offsets[e+1]); offsets[E] is the
        number of valid routes.
    route_slots_N: int32 [N], the inverse permutation: the sorted slot of route t*K+k.
    """

    sorted_routes_N: torch.Tensor
    expert_offsets_E1: torch.Tensor
    route_slots_N: torch.Tensor


class ForwardResult(NamedTuple):
    y_TH: torch.Tensor  # x.dtype
    gu_N2I: torch.Tensor  # [g | u] before the clamp, x.dtype, sorted slot order; rows of `-1` routes are zero
    gu_shared_T2Is: torch.Tensor  # the shared expert's [g | u], float32 (float64 for float64 x); [0, 0] without one


class GradBuffers(NamedTuple):
    """Destinations of the weight gradients. Routed entries: a 3-D tensor or a sequence of E 2-D
    tensors (views of a combined buffer are fine); shared entries: 2-D tensors or None when absent."""

    d_gate: Weight  # [E, I, H]
    d_up: Weight  # [E, I, H]
    d_down: Weight  # [E, H, I]
    d_s_gate: Optional[torch.Tensor] = None  # [Is, H]
    d_s_up: Optional[torch.Tensor] = None  # [Is, H]
    d_s_down: Optional[torch.Tensor] = None  # [H, Is]
    d_s_out_gate: Optional[torch.Tensor] = None  # [1, H]
    # The one buffer [E, 2I, H] (shared: [2Is, H]) whose row halves d_gate and d_up are, when they are: the
    # Triton kernels then write it as one destination. (Under torch.compile a kernel writing two views of
    # one buffer is not reinplaced: Inductor clones both views and scatters them back, three extra copies
    # of the gradient; found by tracing the backward's graph through Inductor's reinplacing pass.)
    d_gate_up: Optional[torch.Tensor] = None
    d_s_gate_up: Optional[torch.Tensor] = None

    @staticmethod
    def allocate(grads, w_gate, w_up, w_down, s_gate, s_up, s_down, s_out_gate) -> "GradBuffers":
        """Fill the None entries of `grads` (or all, when `grads` is None) with fresh tensors shaped
        and typed like the weights they are the gradients of."""
        given = grads if grads is not None else GradBuffers(None, None, None)

        def fresh(w):
            if w is None:
                return None
            if isinstance(w, torch.Tensor):
                return torch.empty_like(w, memory_format=torch.contiguous_format)
            return [torch.empty_like(p, memory_format=torch.contiguous_format) for p in w]

        weights = (w_gate, w_up, w_down, s_gate, s_up, s_down, s_out_gate)
        return given._replace(**{f: fresh(w) for f, b, w in zip(GradBuffers._fields, given, weights) if b is None})


class BackwardResult(NamedTuple):
    dx_TH: torch.Tensor  # x.dtype
    d_router_weights_TK: torch.Tensor  # float32
    grads: GradBuffers  # the weight gradients, as written into the destinations


class Operand(NamedTuple):
    """One routed GEMM operand read as [E, n, k], k the reduction dim: float8_e4m3fn `data` [E, n, k] and
    uint8 E8M0 `scale` [E, n, k/32] (blocks along k), or a plain float weight in `data` with `scale`
    None. Each is a 3-D tensor (strided views are fine) or a sequence of E 2-D tensors (split per-expert
    allocations)."""

    data: Payload
    scale: Optional[Payload]

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def dequantized(self, dtype: torch.dtype) -> Payload:
        """The operand as [E, n, k] (or E x [n, k]) in `dtype`."""
        from .mxfp8 import _dequantize_lastdim as dequantize_lastdim

        if self.scale is None:
            return self.data
        if isinstance(self.data, torch.Tensor):
            return dequantize_lastdim(self.data, self.scale, dtype)
        return [dequantize_lastdim(d, s, dtype) for d, s in zip(self.data, self.scale)]

    def stacked(self) -> "Operand":
        """3-D tensors (a split operand is stacked: one copy of the quantized bytes)."""
        def stack(p):
            return p if p is None or isinstance(p, torch.Tensor) else torch.stack(list(p))

        return Operand(stack(self.data), stack(self.scale))


def narrow_payload(p, dim: int, start: int, length: int):
    if p is None or isinstance(p, torch.Tensor):
        return None if p is None else p.narrow(dim, start, length)
    return tuple(t.narrow(dim, start, length) for t in p)


def transposed_payload(p):
    if p is None or isinstance(p, torch.Tensor):
        return None if p is None else p.transpose(-2, -1)
    return tuple(t.transpose(-2, -1) for t in p)


class RoutedOperands(NamedTuple):
    """The routed experts' GEMM operands. Forward (row-wise): gate, up [E, I, H]; down [E, H, I].
    Data gradient (column-wise, the transposed weights): gate_t, up_t [E, H, I]; down_t [E, I, H]; None
    when the MXFP8 weight carries no column-wise data (forward only)."""

    gate: Operand
    up: Operand
    down: Operand
    gate_t: Optional[Operand]
    up_t: Optional[Operand]
    down_t: Optional[Operand]
