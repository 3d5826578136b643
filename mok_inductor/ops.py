"""The `mok::` operators and the one entry into the implementations.

Ops (schemas, fakes and the autograd formula side by side below):

    mok::moe        the user-facing op (CompositeImplicitAutograd): validates, then schedule -> moe_fwd.
                    Its autograd and fake come from the two ops below, so compiled graphs hold
                    mok::schedule + mok::moe_fwd forward and mok::moe_bwd backward.
    mok::schedule   top_experts [T, K] -> (sorted_routes [N], expert_offsets [E+1], route_slots [N]),
                    int32, deterministic (a stable sort of the flat route index). Not differentiable.
    mok::moe_fwd    -> (y [T, H], gu [N, 2I], gu_shared [T, 2Is] or [0, 0]). y is differentiable;
                    gu and gu_shared, the gate/up pre-activations [g | u] (before the clamp; gu in x.dtype
                    and sorted slot order, gu_shared in float32), are the saved activations (marked
                    non-differentiable).
    mok::moe_bwd    -> (dx, d_router_weights, d_gate_up_proj, d_down_proj, d_shared_gate_up_proj,
                    d_shared_down_proj, d_shared_output_gate); an absent gradient is [0]-shaped (no shared
                    expert / gate; an MXFP8 weight without a master).

MXFP8 routed weights are the same ops with optional arguments (`mok_inductor.mxfp8`): `gate_up_proj` /
`down_proj` then hold float8_e4m3fn data [E, M, K] and `*_scale` its uint8 E8M0 scales [E, M, K/32]
(the row-wise pair the forward reads); `*_t` / `*_scale_t` the column-wise pair [E, K, M], [E, K, M/32]
(the backward's data-gradient GEMMs read it); `*_master` the tensor that receives the weight gradient
(straight-through: the weight the MXFP8 one was quantized from; without a master no weight gradient is
computed). The ops never read a master's values. gate_up and down may differ in kind (one MXFP8, one
plain); a plain weight receives its own gradient.

What is saved for backward: x, router_weights, top_experts, the schedule, the weights (MXFP8: data and
scales of both layouts), gu and gu_shared. What is recomputed: no GEMM of the forward; h = swiglu(g, u)
elementwise from gu in the backward kernel, the shared output gate sigmoid(x @ w^T), and never y_tk or s_t
(their inner products with dy come from <dy @ down, h>). Memory: the saved routed activation is 2*N*I
elements (N*I if h were saved), plus 2*T*Is for the shared expert.

Registration: the ops are defined on one `torch.library.Library("mok", "DEF")` with explicit schemas;
the implementations sit at CompositeExplicitAutograd, fakes via `register_fake`, and moe_fwd's autograd
is a `torch.autograd.Function` with a separate setup_context at its Autograd key (so torch.func.grad
and vjp work; custom_op's generated Function does not support them). mok::moe_bwd's Autograd kernel
only refuses double backward with a clear error. `call_moe` is the entry the user API uses: the op,
or under torch.func.grad/vjp the same composite body applied from Python. mok::moe has a vmap rule
(tokens batched, weights shared).

Implementations: `forward` / `backward` / `schedule` below are the one entry into them, used by the ops,
the MoK functional ABI and expert parallelism alike. They run the Triton kernels of `mok_inductor.kernels`
or the PyTorch reference (`mok_inductor.reference`, on MXFP8 weights dequantized to x.dtype), as
`use_triton` decides from `mok_inductor.options.current().backend` and the device. Under torch.compile the
ops stay opaque (the compiled graph calls them) unless `mok_inductor.enable()` installed the
decomposition into their Triton launches (`mok_inductor.lowering.decompose`).

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per
token, N = T*K.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import _checks, options, reference
from .types import (BackwardResult, ForwardResult, GradBuffers, RoutedOperands, Schedule, shared_saved_dtype,
                    split_gate_up, transposed_payload)

_lib = torch.library.Library("mok", "DEF")

# ---------------------------------------------------------------------------------------------
# Backend choice


@functools.lru_cache(maxsize=None)
def kernels_module():
    """The Triton kernel module, or None when it cannot run here (no triton; no CUDA and no interpreter). Fixed
    for the process (CUDA and the interpreter are known at import), so decided once: it is on every call's path."""
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels if getattr(kernels, "AVAILABLE", False) else None


def use_triton(t: Tensor) -> bool:
    """Whether an op on tensors like `t` runs the Triton kernels (`options.current().backend`)."""
    choice = options.current().backend
    if choice == "reference" or (choice == "auto" and t.device.type != "cuda"):
        return False
    if kernels_module() is None:
        if choice == "triton":
            raise RuntimeError("options.backend='triton', but the Triton kernels are not available here (is triton "
                               "installed? CPU tensors need TRITON_INTERPRET=1)")
        return False
    return True


def path_name(t: Tensor) -> str:
    """A human-readable name of the implementation that runs for tensors like `t`."""
    return "triton" if use_triton(t) else "reference"


# ---------------------------------------------------------------------------------------------
# The one entry into the implementations


def _reference_weights(operands: RoutedOperands, dtype: torch.dtype, backward: bool):
    """(gate, up, down) for the reference in their usual orientation, MXFP8 dequantized to `dtype`, and, for
    backward, the data-gradient GEMMs' weights when they differ from those (MXFP8 column-wise), else None."""
    fwd = tuple(o.dequantized(dtype) for o in operands[:3])
    if not backward or not any(o.quantized for o in operands[3:]):
        return fwd, None
    return fwd, tuple(transposed_payload(o.dequantized(dtype)) for o in operands[3:])


def schedule(top_experts: Tensor, num_experts: int) -> Schedule:
    """The expert schedule of `top_experts` [T, K] (ids in [-1, E); checked: eagerly on the CPU, by a
    device-side assert on CUDA)."""
    if use_triton(top_experts):  # the Triton schedule checks the ids itself, on the device
        return Schedule(*kernels_module().build_schedule(top_experts, num_experts))
    if top_experts.device.type == "cpu":
        _checks.check_expert_ids_eager(top_experts, num_experts)
    else:
        ok = ((top_experts >= -1) & (top_experts < num_experts)).all()
        torch._assert_async(ok, _checks.expert_ids_message(num_experts))
    return Schedule(*reference.build_schedule(top_experts, num_experts))


def forward(x, router_weights, top_experts, sched: Schedule, operands: RoutedOperands, s_gate=None, s_up=None,
            s_down=None, s_out_gate=None, swiglu_limit=None) -> ForwardResult:
    """The MoE forward on routed weights given as `operands` (bf16 or MXFP8, 3-D or split per expert; only
    the row-wise gate, up, down are read) and an optional shared expert (s_gate, s_up [Is, H], s_down
    [H, Is], s_out_gate [1, H])."""
    if use_triton(x):
        return kernels_module().forward(x, router_weights, top_experts, sched, operands, s_gate, s_up, s_down,
                                        s_out_gate, swiglu_limit)
    (wg, wu, wd), _ = _reference_weights(operands, x.dtype, backward=False)
    return reference.moe_forward(x, router_weights, top_experts, sched, wg, wu, wd, s_gate, s_up, s_down,
                                 s_out_gate, swiglu_limit)


def backward(dy, x, router_weights, top_experts, sched: Schedule, operands: RoutedOperands, gu, s_gate=None,
             s_up=None, s_down=None, s_out_gate=None, gu_shared=None, swiglu_limit=None, *,
             grads: Optional[GradBuffers] = None, accumulate: bool = False) -> BackwardResult:
    """The MoE backward from the forward's saved `gu` / `gu_shared`. The data-gradient GEMMs read the
    column-wise operands (gate_t, up_t, down_t). Weight gradients go into `grads` (written, or ADDED when
    `accumulate`; a None routed entry: not wanted); None allocates them all in x.dtype."""
    if operands.gate_t is None or operands.down_t is None:
        which = "gate_up" if operands.gate_t is None else "down"
        raise ValueError(f"{which}: the backward needs the column-wise MXFP8 data (quantize with columnwise=True)")
    if grads is None:
        grads = GradBuffers.allocate(None, operands.gate.data, operands.up.data, operands.down.data, s_gate, s_up,
                                     s_down, s_out_gate, dtype=x.dtype)
    if use_triton(x):
        return kernels_module().backward(dy, x, router_weights, top_experts, sched, operands, gu, s_gate, s_up,
                                         s_down, s_out_gate, gu_shared, swiglu_limit, grads=grads,
                                         accumulate=accumulate)
    (wg, wu, wd), dgrad = _reference_weights(operands, x.dtype, backward=True)
    return reference.moe_backward(dy, x, router_weights, top_experts, sched, wg, wu, wd, gu, s_gate, s_up, s_down,
                                  s_out_gate, gu_shared, swiglu_limit, grads=grads, accumulate=accumulate,
                                  dgrad=dgrad)


# ---------------------------------------------------------------------------------------------
# The ops' arguments

# MXFP8 arguments of moe_fwd / moe_bwd, after the common ones (moe_fwd adds the two masters)
_MX_NAMES = ("gate_up_scale", "gate_up_t", "gate_up_scale_t", "down_scale", "down_t", "down_scale_t")
_MASTER_NAMES = ("gate_up_master", "down_master")
_MX_SCHEMA = ", ".join(f"Tensor? {n}=None" for n in _MX_NAMES)
_MASTER_SCHEMA = ", ".join(f"Tensor? {n}=None" for n in _MASTER_NAMES)


def _pad(mx, n=6):
    mx = tuple(mx)
    return mx + (None,) * (n - len(mx))


def routed_operands(gate_up_proj, down_proj, mx=(), *, columnwise: bool = True) -> RoutedOperands:
    """The operands of the ops' routed arguments: the combined FC1 [E, 2I, H] and down [E, H, I], plain
    or (with the MXFP8 arguments `mx`, in `_MX_NAMES` order) MXFP8; without `columnwise`, only the
    forward's row-wise ones (the others None)."""
    from . import mxfp8

    gus, gut, gust, ds, dt, dst = _pad(mx)
    return mxfp8.routed_operands((gate_up_proj, gus, gut, gust), (down_proj, ds, dt, dst), columnwise=columnwise)


# ---------------------------------------------------------------------------------------------
# mok::schedule

_lib.define("schedule(Tensor top_experts, SymInt num_experts) -> (Tensor, Tensor, Tensor)")


def schedule_impl(top_experts, num_experts):
    return tuple(schedule(top_experts, num_experts))


_lib.impl("schedule", schedule_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("mok::schedule", lib=_lib)
def _(top_experts, num_experts):
    n = top_experts.numel()
    return (
        top_experts.new_empty(n, dtype=torch.int32),
        top_experts.new_empty(num_experts + 1, dtype=torch.int32),
        top_experts.new_empty(n, dtype=torch.int32),
    )


# ---------------------------------------------------------------------------------------------
# mok::moe_fwd

_lib.define(
    "moe_fwd(Tensor x, Tensor router_weights, Tensor top_experts, Tensor sorted_routes, Tensor expert_offsets, "
    "Tensor route_slots, Tensor gate_up_proj, Tensor down_proj, Tensor? shared_gate_up_proj, "
    f"Tensor? shared_down_proj, Tensor? shared_output_gate, float? swiglu_limit, {_MX_SCHEMA}, {_MASTER_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor)"
)


def fwd_output_shapes(x, top_experts, gate_up_proj, shared_gate_up_proj):
    """Shapes of (y, gu, gu_shared): the one shape function of the fake and the real kernels."""
    T, H = x.shape
    N = T * top_experts.shape[1]
    two_i = gate_up_proj.shape[1]
    gus = (T, shared_gate_up_proj.shape[0]) if shared_gate_up_proj is not None else (0, 0)
    return (T, H), (N, two_i), gus


def moe_fwd_impl(x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
                 shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit, *mx_and_masters):
    s_gate, s_up = split_gate_up(shared_gate_up_proj)
    out = forward(x, router_weights, top_experts, Schedule(sorted_routes, expert_offsets, route_slots),
                  routed_operands(gate_up_proj, down_proj, mx_and_masters[:6], columnwise=False), s_gate, s_up,
                  shared_down_proj, shared_output_gate, swiglu_limit)
    return tuple(out)


_lib.impl("moe_fwd", moe_fwd_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("mok::moe_fwd", lib=_lib)
def _(x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
      shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit, *mx_and_masters):
    y, g, gs = fwd_output_shapes(x, top_experts, gate_up_proj, shared_gate_up_proj)
    return x.new_empty(y), x.new_empty(g), x.new_empty(gs, dtype=shared_saved_dtype(x.dtype))


class _MoeFwdFunction(torch.autograd.Function):
    """The autograd formula of mok::moe_fwd (registered at its Autograd key). A Function with a separate
    setup_context, so torch.func transforms (grad, vjp) work through it. The weight gradient of an MXFP8
    weight goes to its master argument; of a plain weight, to the weight."""

    @staticmethod
    def forward(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.mok.moe_fwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
         shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit, *rest) = inputs
        mx, (gate_up_master, down_master) = _pad(rest[:6]), _pad(rest[6:8], 2)
        _, gu, gu_shared = output
        ctx.mark_non_differentiable(gu, gu_shared)
        ctx.set_materialize_grads(False)
        ctx.swiglu_limit = swiglu_limit
        ctx.options = options.current()  # the backward runs as its forward did (a per-call `options=` included)
        ctx.num_inputs = len(inputs)
        ctx.has_shared = shared_gate_up_proj is not None
        ctx.has_gate = shared_output_gate is not None
        ctx.gate_up_mx = mx[0] is not None
        ctx.down_mx = mx[3] is not None
        # an MXFP8 weight's gradient is computed only for a master to receive it
        ctx.gate_up_grad = not ctx.gate_up_mx or gate_up_master is not None
        ctx.down_grad = not ctx.down_mx or down_master is not None
        ctx.save_for_backward(
            x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
            shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, *mx,
        )

    @staticmethod
    def backward(ctx, dy, _dgu, _dgu_shared):
        (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
         shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, *mx) = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        quantized = ctx.gate_up_mx or ctx.down_mx
        extra = (*mx, ctx.gate_up_grad, ctx.down_grad) if quantized else ()
        with options.override(ctx.options):
            dx, drw, dgu, dd, dsgu, dsd, dsg = torch.ops.mok.moe_bwd(
                dy, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj,
                down_proj, shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared,
                ctx.swiglu_limit, *extra,
            )
        grads = [
            dx, drw, None, None, None, None,
            None if ctx.gate_up_mx else dgu,
            None if ctx.down_mx else dd,
            dsgu if ctx.has_shared else None,
            dsd if ctx.has_shared else None,
            dsg if ctx.has_gate else None,
            None,
        ]
        grads += [None] * 6 + [dgu if ctx.gate_up_mx and ctx.gate_up_grad else None,
                               dd if ctx.down_mx and ctx.down_grad else None]
        return tuple(grads[:ctx.num_inputs])


_lib.impl("moe_fwd", _MoeFwdFunction.apply, "Autograd")


# ---------------------------------------------------------------------------------------------
# mok::moe_bwd

_lib.define(
    "moe_bwd(Tensor dy, Tensor x, Tensor router_weights, Tensor top_experts, Tensor sorted_routes, "
    "Tensor expert_offsets, Tensor route_slots, Tensor gate_up_proj, Tensor down_proj, Tensor? shared_gate_up_proj, "
    "Tensor? shared_down_proj, Tensor? shared_output_gate, Tensor gu, Tensor gu_shared, float? swiglu_limit, "
    f"{_MX_SCHEMA}, bool gate_up_grad=True, bool down_grad=True) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def bwd_output_shapes(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                      shared_output_gate, gate_up_grad=True, down_grad=True):
    """Shapes of moe_bwd's outputs: the one shape function of the fake and the real kernels."""
    empty = (0,)
    return (
        tuple(x.shape),
        tuple(router_weights.shape),
        tuple(gate_up_proj.shape) if gate_up_grad else empty,
        tuple(down_proj.shape) if down_grad else empty,
        tuple(shared_gate_up_proj.shape) if shared_gate_up_proj is not None else empty,
        tuple(shared_down_proj.shape) if shared_down_proj is not None else empty,
        tuple(shared_output_gate.shape) if shared_output_gate is not None else empty,
    )


def _bwd_args(args):
    """(the 15 common arguments, the six MXFP8 ones, gate_up_grad, down_grad) of moe_bwd."""
    common, rest = args[:15], args[15:]
    mx = _pad(rest[:6])
    flags = tuple(rest[6:8]) + (True, True)[len(rest[6:8]):]
    return common, mx, flags[0], flags[1]


def moe_bwd_impl(*args):
    common, mx, gate_up_grad, down_grad = _bwd_args(args)
    (dy, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
     shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, swiglu_limit) = common
    s_gate, s_up = split_gate_up(shared_gate_up_proj)
    grads = GradBuffers.allocate(None, None, None, down_proj if down_grad else None, s_gate, s_up, shared_down_proj,
                                 shared_output_gate, gate_up=gate_up_proj if gate_up_grad else None,
                                 s_gate_up=shared_gate_up_proj, dtype=x.dtype,
                                 out_gate_dtype=None if shared_output_gate is None else shared_output_gate.dtype)
    out = backward(dy, x, router_weights, top_experts, Schedule(sorted_routes, expert_offsets, route_slots),
                   routed_operands(gate_up_proj, down_proj, mx), gu, s_gate, s_up, shared_down_proj,
                   shared_output_gate, gu_shared, swiglu_limit, grads=grads)
    # absent gradients are [0]-shaped, and distinct tensors (op outputs must not alias each other)
    def given(t):
        return t if t is not None else x.new_empty(0)

    return (out.dx_TH, out.d_router_weights_TK.to(router_weights.dtype), given(grads.d_gate_up),
            given(grads.d_down), given(grads.d_s_gate_up), given(grads.d_s_down), given(grads.d_s_out_gate))


_lib.impl("moe_bwd", moe_bwd_impl, "CompositeExplicitAutograd")


def _no_double_backward(*args):
    """moe_bwd's Autograd kernel: it is not differentiable, and says so when a double backward is asked for."""
    if (torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
            and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
        raise RuntimeError(
            "mok::moe does not support double backward: its backward (mok::moe_bwd) is not differentiable "
            "(call backward without create_graph=True)"
        )
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.mok.moe_bwd(*args)


_lib.impl("moe_bwd", _no_double_backward, "Autograd")


@torch.library.register_fake("mok::moe_bwd", lib=_lib)
def _(*args):
    common, _mx, gate_up_grad, down_grad = _bwd_args(args)
    (dy, x, router_weights, _te, _sr, _eo, _rs, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
     shared_output_gate, _gu, _gus, _limit) = common
    shapes = bwd_output_shapes(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                               shared_output_gate, gate_up_grad, down_grad)
    dtypes = (x.dtype, router_weights.dtype) + (x.dtype,) * 4 + (
        shared_output_gate.dtype if shared_output_gate is not None else x.dtype,)
    return tuple(x.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes))


# ---------------------------------------------------------------------------------------------
# mok::moe (user-facing, composite)

_lib.define(
    "moe(Tensor x, Tensor router_weights, Tensor top_experts, Tensor gate_up_proj, Tensor down_proj, "
    "Tensor? shared_gate_up_proj=None, Tensor? shared_down_proj=None, Tensor? shared_output_gate=None, "
    f"float? swiglu_limit=None, {_MX_SCHEMA}, {_MASTER_SCHEMA}) -> Tensor"
)


def _logical(x, data, master):
    """A stand-in with the logical weight's shape, x's dtype and device, for the common checks."""
    if master is not None:
        return master
    if data.dtype == torch.float8_e4m3fn:
        return x.new_empty(()).expand(data.shape)
    return data


def _check_mxfp8(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                 shared_output_gate, mx, masters):
    """The checks of the MXFP8 form: each routed weight's data, scales and master; the common checks on
    stand-ins of the logical weights; the column-wise data when a backward will run."""
    from . import mxfp8

    gus, gut, gust, ds, dt, dst = mx
    gum, dm = masters
    _checks.require_tensor("x", x)
    _checks.require_dtype("x", x, _checks.FLOAT_DTYPES)
    for name, data, scale, master in (("gate_up_proj", gate_up_proj, gus, gum), ("down_proj", down_proj, ds, dm)):
        if scale is None and master is not None:
            raise ValueError(f"{name}: a master weight is for an MXFP8 weight (with scales); a plain weight receives "
                             "its own gradient")
    mxfp8.check_weight("gate_up_proj", gate_up_proj, gus, gut, gust, gum, x.dtype, x.device, split_rows=True)
    mxfp8.check_weight("down_proj", down_proj, ds, dt, dst, dm, x.dtype, x.device)
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (x, router_weights, gate_up_proj, down_proj, gum, dm, shared_gate_up_proj, shared_down_proj,
                      shared_output_gate)):
        for name, scale, data_t in (("gate_up_proj", gus, gut), ("down_proj", ds, dt)):
            if scale is not None and data_t is None:
                raise ValueError(
                    f"{name}: the backward needs the column-wise MXFP8 data (quantize with columnwise=True), or run "
                    "under torch.no_grad()"
                )
    return _logical(x, gate_up_proj, gum), _logical(x, down_proj, dm)


def _moe_composite(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj=None,
                   shared_down_proj=None, shared_output_gate=None, swiglu_limit=None, *mx_and_masters):
    mx, masters = _pad(mx_and_masters[:6]), _pad(mx_and_masters[6:8], 2)
    quantized = any(t is not None for t in mx + masters)
    gu_w, d_w = gate_up_proj, down_proj
    if quantized:
        gu_w, d_w = _check_mxfp8(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                                 shared_output_gate, mx, masters)
    _checks.check_moe_args(x, router_weights, top_experts, gu_w, d_w, shared_gate_up_proj, shared_down_proj,
                           shared_output_gate, swiglu_limit)
    sorted_routes, expert_offsets, route_slots = torch.ops.mok.schedule(top_experts, gate_up_proj.shape[0])
    args = (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
            shared_gate_up_proj, shared_down_proj, shared_output_gate,
            None if swiglu_limit is None else float(swiglu_limit))
    if quantized:
        args += mx + masters
    if _needs_autograd(args):
        y, _, _ = _MoeFwdFunction.apply(*args)
    else:  # inference: the forward op alone, without the Function's per-call cost (host-bound decode)
        with torch._C._AutoDispatchBelowAutograd():
            y, _, _ = torch.ops.mok.moe_fwd(*args)
    return y


def _needs_autograd(args) -> bool:
    """Whether the forward must run through its autograd.Function: grad mode on and an input requiring grad,
    or a functorch transform (vmap, grad, ...) or torch.compile tracing, which handle the Function themselves."""
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


def _under_functorch_autodiff() -> bool:
    """Whether the innermost torch.func transform is grad/vjp/jvp. Autograd Functions must then be
    applied from Python rather than from inside a dispatcher kernel."""
    if torch.compiler.is_compiling():
        return False
    functorch = torch._C._functorch
    peek = getattr(functorch, "peek_interpreter_stack", None)
    top = peek() if peek is not None else None
    return top is not None and top.key() in (functorch.TransformType.Grad, functorch.TransformType.Jvp)


def call_moe(*args):
    """Run mok::moe on flattened arguments: through the op (what Dynamo records and vmap batches),
    or, under torch.func.grad / vjp, through the same composite body called from Python."""
    if _under_functorch_autodiff():
        return _moe_composite(*args)
    return torch.ops.mok.moe(*args)


_lib.impl("moe", _moe_composite, "CompositeImplicitAutograd")


# ---------------------------------------------------------------------------------------------
# vmap over mok::moe: tokens are independent, so a batch of token sets with shared weights is one
# call on the flattened tokens. Batching the weights (a different expert set per batch entry) is not
# supported and says so.

_BATCHABLE = ("x", "router_weights", "top_experts")
_MOE_ARG_NAMES = ("x", "router_weights", "top_experts", "gate_up_proj", "down_proj", "shared_gate_up_proj",
                  "shared_down_proj", "shared_output_gate", "swiglu_limit") + _MX_NAMES + _MASTER_NAMES


def _moe_vmap(info, in_dims, *args):
    for name, dim in zip(_MOE_ARG_NAMES, in_dims):
        if dim is not None and name not in _BATCHABLE:
            raise ValueError(
                f"{name}: torch.vmap over mok::moe batches only x, router_weights and top_experts (the tokens); "
                f"got a batched {name}. Call mok_inductor.moe once per weight set instead."
            )
    if _under_functorch_autodiff():
        raise NotImplementedError(
            "mok::moe: torch.func.grad/vjp of a torch.vmap over mok_inductor.moe is not supported; vmap is "
            "supported on its own, and grad/vjp on their own (or flatten the batch into the token dim)"
        )
    batch = info.batch_size
    x, rw, te = (
        (a.movedim(d, 0) if d is not None else a.unsqueeze(0).expand(batch, *a.shape))
        for a, d in zip(args[:3], in_dims[:3])
    )
    B, T, H = x.shape
    K = rw.shape[-1]
    y = call_moe(x.reshape(B * T, H), rw.reshape(B * T, K), te.reshape(B * T, K), *args[3:])
    return y.view(B, T, H), 0


torch.library.register_vmap("mok::moe", _moe_vmap)
