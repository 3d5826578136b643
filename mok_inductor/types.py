"""The types the layers pass around: the schedule, forward and backward results, gradient destinations and
the routed GEMM operands (bf16 or MXFP8, 3-D or split per expert). The reference, the kernels, the ops and
the integrations all use these; none of them defines its own.

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per token,
N = T*K.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Activation:
    """The gated activation of an expert, one formula for every variant (docs/semantics.md):

        h = g' * sigmoid(alpha * g') * (u' + beta),   g' = min(g, L), u' = clamp(u, -L, L) (with a limit L)

    "swiglu" (alpha 1, beta 0) is silu(g') * u'; "gpt_oss" (alpha 1.702, beta 1) is GPT-OSS's
    `(up + 1) * gate * sigmoid(1.702 * gate)`. The reference and the kernels take alpha and beta as numbers, so a
    variant is a row of `ACTIVATIONS`, not a branch in the code."""

    name: str
    alpha: float
    beta: float


ACTIVATIONS = {a.name: a for a in (Activation("swiglu", 1.0, 0.0), Activation("gpt_oss", 1.702, 1.0))}
SWIGLU = ACTIVATIONS["swiglu"]


def activation(name) -> Activation:
    """The `Activation` named `name` (an `Activation` passes through; None is "swiglu")."""
    if name is None:
        return SWIGLU
    if isinstance(name, Activation):
        if ACTIVATIONS.get(name.name) != name:  # (the op takes a variant by name: other numbers would be dropped)
            known = ", ".join(map(str, ACTIVATIONS.values()))
            raise ValueError(f"activation: {name} is not a declared variant ({known}); pass one of them or its name")
        return ACTIVATIONS[name.name]  # (the declared object: code compares variants by identity)
    if not isinstance(name, str):
        raise TypeError(f"activation: expected one of {sorted(ACTIVATIONS)} (a str), got {type(name).__name__}")
    if name not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


class ForwardResult(NamedTuple):
    y_TH: torch.Tensor  # x.dtype
    gu_N2I: torch.Tensor  # [g | u] before the clamp, x.dtype, sorted slot order; rows of `-1` routes are zero
    gu_shared_T2Is: torch.Tensor  # the shared expert's [g | u], float32 (float64 for float64 x); [0, 0] without one


class GradBuffers(NamedTuple):
    """Destinations of the weight gradients. Routed entries: a 3-D tensor or a sequence of E 2-D
    tensors (views of a combined buffer are fine), or None when that gradient is not wanted; shared
    entries: 2-D tensors, or None when absent. `allocate` is the one place that builds them."""

    d_gate: Optional[Weight]  # [E, I, H]
    d_up: Optional[Weight]  # [E, I, H]
    d_down: Optional[Weight]  # [E, H, I]
    d_s_gate: Optional[torch.Tensor] = None  # [Is, H]
    d_s_up: Optional[torch.Tensor] = None  # [Is, H]
    d_s_down: Optional[torch.Tensor] = None  # [H, Is]
    d_s_out_gate: Optional[torch.Tensor] = None  # [1, H]
    # The one buffer [E, 2I, H] (or E x [2I, H]; shared: [2Is, H]) whose row halves d_gate and d_up are, when
    # they are: the Triton kernels then write it as one destination. Under torch.compile a kernel writing two
    # views of one buffer is not reinplaced: Inductor clones both views and scatters them back, three extra
    # copies of the gradient.
    d_gate_up: Optional[Weight] = None
    d_s_gate_up: Optional[torch.Tensor] = None
    # The routed biases' gradients (the "gpt_oss" variant's biases), when the biases are given: [E, 2, I] (gate
    # row, up row; a view of a [E, 2I] buffer or any strides) and [E, H].
    d_gate_up_bias: Optional[torch.Tensor] = None
    d_down_bias: Optional[torch.Tensor] = None

    @staticmethod
    def allocate(given: Optional["GradBuffers"], w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None,
                 s_out_gate=None, *, gate_up=None, s_gate_up=None, dtype: Optional[torch.dtype] = None,
                 out_gate_dtype: Optional[torch.dtype] = None, zero: bool = False,
                 preserve_layout: bool = False) -> "GradBuffers":
        """The gradient destinations: the entries of `given` that are set, fresh buffers for the others.

        A fresh buffer is contiguous, shaped like the weight it is the gradient of (`w_gate` ... `s_out_gate`:
        a 3-D tensor or a sequence of E 2-D tensors; None means no destination), in `dtype` (default: that
        weight's own; `out_gate_dtype` for the shared output gate), zero-filled when `zero` (the caller
        accumulates into the given ones). `gate_up` / `s_gate_up`: the combined FC1 whose row halves the gate
        and up weights are; when neither half is given, the two are allocated as one buffer like it and
        `d_gate_up` / `d_s_gate_up` is that buffer."""
        given = given if given is not None else GradBuffers(None, None, None)
        make = torch.zeros_like if zero else torch.empty_like

        def fresh(w, dt=dtype):
            if w is None:
                return None
            if isinstance(w, torch.Tensor):
                # a 4-D FC1 view [E, 2, I, H] (GPT-OSS's checkpoint layout) gets a gradient with its strides, so
                # autograd hands it to the parameter without a copy (a permutation of a dense tensor is dense,
                # and preserve_format keeps the strides of such a tensor)
                # (`preserve_layout`: every weight's; mok::moe_bwd's, so that a transposed view's gradient, e.g.
                # GPT-OSS's down_proj [E, I, H] read as [E, H, I], reaches the parameter without a copy)
                fmt = torch.preserve_format if w.dim() == 4 or preserve_layout else torch.contiguous_format
                return make(w, dtype=dt or w.dtype, memory_format=fmt)
            return tuple(make(p, dtype=dt or p.dtype, memory_format=torch.contiguous_format) for p in w)

        out = given._asdict()
        for combined, like, names in ((given.d_gate_up, gate_up, ("d_gate", "d_up", "d_gate_up")),
                                      (given.d_s_gate_up, s_gate_up, ("d_s_gate", "d_s_up", "d_s_gate_up"))):
            if combined is None and like is not None and out[names[0]] is None and out[names[1]] is None:
                buf = fresh(like)
                out[names[0]], out[names[1]] = split_gate_up(buf)
                out[names[2]] = buf
        likes = dict(d_gate=w_gate, d_up=w_up, d_down=w_down, d_s_gate=s_gate, d_s_up=s_up, d_s_down=s_down)
        for name, like in likes.items():
            if out[name] is None:
                out[name] = fresh(like)
        if out["d_s_out_gate"] is None:
            out["d_s_out_gate"] = fresh(s_out_gate, out_gate_dtype or dtype)
        return GradBuffers(**out)


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


def split_gate_up(payload):
    """The zero-copy gate and up row views of a combined FC1: [..., 2I, H] or [E, 2, I, H] (any strides; Hugging
    Face GPT-OSS's interleaved [E, H, 2I] is `w.view(E, H, I, 2).permute(0, 3, 2, 1)`) -> two [..., I, H]; a sequence of
    per-expert [2I, H] tensors -> two tuples; None -> (None, None). MXFP8 row-wise scales [..., 2I, H/32]
    split the same way."""
    if payload is None:
        return None, None
    if isinstance(payload, torch.Tensor) and payload.dim() == 4:  # [E, 2, I, H]: index 0 gate rows, 1 up rows
        return payload.select(1, 0), payload.select(1, 1)
    i = (payload if isinstance(payload, torch.Tensor) else payload[0]).shape[-2] // 2
    return narrow_payload(payload, -2, 0, i), narrow_payload(payload, -2, i, i)


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

    @staticmethod
    def of_weights(gate: Weight, up: Weight, down: Weight) -> "RoutedOperands":
        """The operands of float weights gate, up [E, I, H] and down [E, H, I] (3-D, or sequences of E 2-D
        tensors): the weights row-wise, their transposes column-wise (no copy)."""
        return RoutedOperands(Operand(gate, None), Operand(up, None), Operand(down, None),
                              Operand(transposed_payload(gate), None), Operand(transposed_payload(up), None),
                              Operand(transposed_payload(down), None))

    @property
    def quantized(self) -> bool:
        """Whether any operand is MXFP8."""
        return any(o is not None and o.quantized for o in self)


# ---------------------------------------------------------------------------------------------
# Numeric rules the reference and the kernels share


def clip_bounds(limit: float, dtype: torch.dtype):
    """(smallest `dtype` value > limit, largest `dtype` value <= limit) for bf16/fp16 and limit >= 0."""
    c = torch.tensor(limit, dtype=torch.float64).to(dtype)
    step = lambda v, d: (v.view(torch.int16) + d).view(dtype)
    below = c if c.double() <= limit else step(c, -1)
    above = c if c.double() > limit else step(c, 1)
    return above, below


def shared_saved_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the shared expert's saved g, u: float32 (float64 for float64 x). Its output gate's
    gradient sum_t <dy_t, s_t> x_t cancels over tokens, and h recomputed from bf16 g, u put it over the bf16
    tolerance at small T (the cost: T x 2Is float32, against the routed T*K x 2I in x.dtype)."""
    return torch.promote_types(dtype, torch.float32)
