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
                    d_shared_down_proj, d_shared_output_gate, d_gate_up_bias, d_down_bias); an absent gradient
                    is [0]-shaped (no shared expert / gate / bias; an MXFP8 weight without a master). Weight and
                    bias gradients are allocated in their inputs' layouts (strides), so a strided view's (GPT-OSS's
                    checkpoint layout) reaches its parameter without a copy.

The gated-activation variant (docs/semantics.md) is three trailing arguments of moe, moe_fwd and moe_bwd:
`activation` ("swiglu" or "gpt_oss", `types.Activation`: the two numbers alpha, beta of the one formula the
reference and the kernels' epilogues compute), and the optional routed biases `gate_up_bias` ([E, 2I] or a
[E, 2, I] view) and `down_bias` [E, H], which the forward adds in the GEMMs' accumulators (the saved gu includes
the FC1 bias). The routed FC1 may also be a 4-D [E, 2, I, H] view of any strides (gate rows, up rows).

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
is a `torch.autograd.Function` with a separate setup_context at its Autograd key (so torch.func transforms
work; custom_op's generated Function does not support them): backward, a jvp (forward mode: the tangent of
y from the saved gu, `forward_jvp`) and a generated vmap rule. mok::moe_bwd's Autograd kernel records it
through a Function whose own backward and jvp raise: a second derivative is refused when it is taken, not
when create_graph=True or a torch.func transform merely records the backward. `call_moe` is the entry the
user API uses: the op, or under torch.func.grad/vjp/jvp the same composite body applied from Python.
mok::moe has a vmap rule (tokens batched into one call, weights shared); schedule, moe_fwd and moe_bwd
have per-entry vmap rules (what vmap of grad, jacrev and jacfwd reach). Autocast: mok::moe's Autocast
kernels cast x and the weights to the autocast dtype (the policy at `autocast_cast`) and the
implementations run with autocast off.

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

import contextlib
import functools
from typing import Optional

import torch
from torch import Tensor

from . import _checks, options, reference
from .types import (SWIGLU, Activation, BackwardResult, ForwardResult, GradBuffers, RoutedOperands, Schedule,
                    activation as _activation, shared_saved_dtype, split_gate_up, transposed_payload)

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
    if t.device.type == "cpu" and not options.INTERPRET:  # ("auto" returned above: only "triton" gets here)
        # (the compiled kernels would read CPU pointers, which Triton refuses with a message naming no argument)
        raise RuntimeError("options.backend='triton' with CPU tensors: the compiled Triton kernels take CUDA tensors; "
                           "CPU tensors run them only under Triton's interpreter (TRITON_INTERPRET=1, set before "
                           "triton is imported), or use backend 'auto' or 'reference' for the CPU implementation")
    return True


def path_name(t: Tensor) -> str:
    """A human-readable name of the implementation that runs for tensors like `t`."""
    return "triton" if use_triton(t) else "reference"


# ---------------------------------------------------------------------------------------------
# Autocast: one policy on every path (mok::moe's Autocast kernels; the Python path under torch.func; expert
# parallelism). Under torch.autocast for x's device type, x, every weight and the MXFP8 masters that are
# float32, float16 or bfloat16 are cast to the autocast dtype, as F.linear casts its input and weight (float64
# is left alone, as autocast leaves it); the router weights stay as given (the op reads them as float32) and
# MXFP8 data and scales are never cast. Gradients flow back through the casts, so a float32 weight gets a
# float32 gradient. The implementations then run with autocast off: they fix their own precisions
# (docs/semantics.md), the same on the reference, the Triton kernels and in compiled graphs.

_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
# mok::moe's arguments that autocast casts: x, the routed and shared weights, the output gate, the two masters
_AUTOCAST_ARGS = (0, 3, 4, 5, 6, 7, 15, 16, 18, 19)  # ... and the two routed biases


def autocast_dtype(x: Tensor) -> Optional[torch.dtype]:
    """The autocast dtype in effect for x's device type, or None where autocast is off."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def autocast_cast(args: tuple, dtype: torch.dtype) -> tuple:
    """mok::moe's flat arguments with those autocast casts (`_AUTOCAST_ARGS`, when float32/16 or bfloat16)
    cast to `dtype`."""
    args = list(args)
    for i in _AUTOCAST_ARGS:
        if i < len(args) and isinstance(args[i], Tensor) and args[i].dtype in _AUTOCAST_ELIGIBLE:
            args[i] = args[i].to(dtype)
    return tuple(args)


def autocast_off(t: Tensor):
    """A context with autocast off for t's device type where it is on, else nothing (checking is cheap,
    entering torch.autocast is not, and decode calls are host-bound)."""
    device_type = t.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


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
            s_down=None, s_out_gate=None, swiglu_limit=None, act: Activation = SWIGLU, gate_up_bias=None,
            down_bias=None) -> ForwardResult:
    """The MoE forward on routed weights given as `operands` (bf16 or MXFP8, 3-D or split per expert; only
    the row-wise gate, up, down are read) and an optional shared expert (s_gate, s_up [Is, H], s_down
    [H, Is], s_out_gate [1, H]); `act` the gated activation, `gate_up_bias` [E, 2, I] and `down_bias` [E, H]
    the optional routed biases."""
    with autocast_off(x):
        if use_triton(x):
            return kernels_module().forward(x, router_weights, top_experts, sched, operands, s_gate, s_up, s_down,
                                            s_out_gate, swiglu_limit, act, gate_up_bias, down_bias)
        (wg, wu, wd), _ = _reference_weights(operands, x.dtype, backward=False)
        return reference.moe_forward(x, router_weights, top_experts, sched, wg, wu, wd, s_gate, s_up, s_down,
                                     s_out_gate, swiglu_limit, act, gate_up_bias, down_bias)


def backward(dy, x, router_weights, top_experts, sched: Schedule, operands: RoutedOperands, gu, s_gate=None,
             s_up=None, s_down=None, s_out_gate=None, gu_shared=None, swiglu_limit=None, act: Activation = SWIGLU,
             gate_up_bias=None, down_bias=None, *, grads: Optional[GradBuffers] = None,
             accumulate: bool = False) -> BackwardResult:
    """The MoE backward from the forward's saved `gu` / `gu_shared`. The data-gradient GEMMs read the
    column-wise operands (gate_t, up_t, down_t). Weight gradients go into `grads` (written, or ADDED when
    `accumulate`; a None routed entry: not wanted); None allocates them all in x.dtype. With routed biases
    (`gate_up_bias` [E, 2, I], `down_bias` [E, H]) their gradients go to `grads.d_gate_up_bias` / `d_down_bias`
    (allocated when None)."""
    if operands.gate_t is None or operands.down_t is None:
        which = "gate_up" if operands.gate_t is None else "down"
        raise ValueError(f"{which}: the backward needs the column-wise MXFP8 data (quantize with columnwise=True)")
    if grads is None:
        grads = GradBuffers.allocate(None, operands.gate.data, operands.up.data, operands.down.data, s_gate, s_up,
                                     s_down, s_out_gate, dtype=x.dtype)
    for name, bias in (("d_gate_up_bias", gate_up_bias), ("d_down_bias", down_bias)):
        if bias is not None and getattr(grads, name) is None:  # every path writes a given bias's gradient
            grads = grads._replace(**{name: torch.empty_like(bias, memory_format=torch.preserve_format)})
    with autocast_off(x):
        if use_triton(x):
            return kernels_module().backward(dy, x, router_weights, top_experts, sched, operands, gu, s_gate, s_up,
                                             s_down, s_out_gate, gu_shared, swiglu_limit, act, gate_up_bias,
                                             down_bias, grads=grads, accumulate=accumulate)
        (wg, wu, wd), dgrad = _reference_weights(operands, x.dtype, backward=True)
        return reference.moe_backward(dy, x, router_weights, top_experts, sched, wg, wu, wd, gu, s_gate, s_up,
                                      s_down, s_out_gate, gu_shared, swiglu_limit, act, gate_up_bias, down_bias,
                                      grads=grads, accumulate=accumulate, dgrad=dgrad)


# ---------------------------------------------------------------------------------------------
# The ops' arguments

# MXFP8 arguments of moe_fwd / moe_bwd, after the common ones (moe_fwd adds the two masters)
_MX_NAMES = ("gate_up_scale", "gate_up_t", "gate_up_scale_t", "down_scale", "down_t", "down_scale_t")
_MASTER_NAMES = ("gate_up_master", "down_master")
_MX_SCHEMA = ", ".join(f"Tensor? {n}=None" for n in _MX_NAMES)
_MASTER_SCHEMA = ", ".join(f"Tensor? {n}=None" for n in _MASTER_NAMES)


# The gated-activation variant's arguments, after the MXFP8 ones (moe, moe_fwd: after the masters; moe_bwd: after
# its two flags): the activation's name and the optional routed biases
_VARIANT_SCHEMA = 'str activation="swiglu", Tensor? gate_up_bias=None, Tensor? down_bias=None'


def _pad(mx, n=6):
    mx = tuple(mx)
    return mx + (None,) * (n - len(mx))


def _variant(rest):
    """(Activation, gate_up_bias, down_bias) of the op's trailing variant arguments (absent: the SwiGLU, none)."""
    name, gub, db = (tuple(rest) + (None, None, None))[:3]
    return _activation(name), gub, db


def bias_E2I(gate_up_bias):
    """The routed FC1 bias as [E, 2, I] (gate row, up row): a [E, 2I] bias (gate columns then up columns) as
    a view, a [E, 2, I] one (any strides; Hugging Face GPT-OSS's interleaved [E, 2I] bias is
    `b.view(E, I, 2).transpose(1, 2)`) as it is; None stays None."""
    if gate_up_bias is None or gate_up_bias.dim() == 3:
        return gate_up_bias
    return gate_up_bias.unflatten(1, (2, gate_up_bias.shape[1] // 2))


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
    f"Tensor? shared_down_proj, Tensor? shared_output_gate, float? swiglu_limit, {_MX_SCHEMA}, {_MASTER_SCHEMA}, "
    f"{_VARIANT_SCHEMA}) -> (Tensor, Tensor, Tensor)"
)


def fwd_output_shapes(x, top_experts, gate_up_proj, shared_gate_up_proj):
    """Shapes of (y, gu, gu_shared): the one shape function of the fake and the real kernels."""
    T, H = x.shape
    N = T * top_experts.shape[1]
    two_i = 2 * gate_up_proj.shape[2] if gate_up_proj.dim() == 4 else gate_up_proj.shape[1]  # [E, 2, I, H]
    gus = (T, shared_gate_up_proj.shape[0]) if shared_gate_up_proj is not None else (0, 0)
    return (T, H), (N, two_i), gus


def moe_fwd_impl(x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
                 shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit, *mx_and_masters):
    s_gate, s_up = split_gate_up(shared_gate_up_proj)
    act, gub, db = _variant(mx_and_masters[8:])
    out = forward(x, router_weights, top_experts, Schedule(sorted_routes, expert_offsets, route_slots),
                  routed_operands(gate_up_proj, down_proj, mx_and_masters[:6], columnwise=False), s_gate, s_up,
                  shared_down_proj, shared_output_gate, swiglu_limit, act, bias_E2I(gub), db)
    return tuple(out)


_lib.impl("moe_fwd", moe_fwd_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("mok::moe_fwd", lib=_lib)
def _(x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
      shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit, *mx_and_masters):
    y, g, gs = fwd_output_shapes(x, top_experts, gate_up_proj, shared_gate_up_proj)
    return x.new_empty(y), x.new_empty(g), x.new_empty(gs, dtype=shared_saved_dtype(x.dtype))


class _MoeFwdFunction(torch.autograd.Function):
    """The autograd formula of mok::moe_fwd (registered at its Autograd key). A Function with a separate
    setup_context, so torch.func transforms work through it: grad/vjp (backward), jvp/jacfwd (jvp, below),
    vmap (generated from the forward: the ops' vmap rules, bottom of this file). The weight gradient of an
    MXFP8 weight goes to its master argument; of a plain weight, to the weight."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.mok.moe_fwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
         shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit, *rest) = inputs
        mx, (gate_up_master, down_master) = _pad(rest[:6]), _pad(rest[6:8], 2)
        act, gate_up_bias, down_bias = _variant(rest[8:])
        ctx.act = act
        ctx.has_gate_up_bias, ctx.has_down_bias = gate_up_bias is not None, down_bias is not None
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
        saved = (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
                 shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, gate_up_bias, down_bias,
                 *mx)
        ctx.save_for_backward(*saved)
        ctx.save_for_forward(*saved)

    @staticmethod
    def backward(ctx, dy, _dgu, _dgu_shared):
        (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
         shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, gate_up_bias, down_bias,
         *mx) = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        quantized = ctx.gate_up_mx or ctx.down_mx
        variant = ctx.act is not SWIGLU or gate_up_bias is not None or down_bias is not None
        extra = (*mx, ctx.gate_up_grad, ctx.down_grad) if quantized or variant else ()
        if variant:
            extra += (ctx.act.name, gate_up_bias, down_bias)
        with options.override(ctx.options):
            dx, drw, dgu, dd, dsgu, dsd, dsg, dgub, ddb = _call_bwd(
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
        grads += [None, dgub if ctx.has_gate_up_bias else None, ddb if ctx.has_down_bias else None]
        return tuple(grads[:ctx.num_inputs])

    @staticmethod
    def jvp(ctx, *tangents):
        """Forward-mode AD (torch.func.jvp, jacfwd): the tangent of y; gu and gu_shared have none."""
        (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
         shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, gate_up_bias, down_bias,
         *mx) = ctx.saved_tensors
        t = _pad(tangents, 23)
        # the tangent of an MXFP8 weight is its master's (straight-through, as its gradient is)
        d_gate_up = t[18] if ctx.gate_up_mx else t[6]
        d_down = t[19] if ctx.down_mx else t[7]
        operands = routed_operands(gate_up_proj, down_proj, mx, columnwise=False)
        with autocast_off(x):
            dy = forward_jvp(x, router_weights, top_experts, Schedule(sorted_routes, expert_offsets, route_slots),
                             operands, shared_gate_up_proj, shared_down_proj, shared_output_gate, ctx.swiglu_limit,
                             gu, gu_shared, t[0], t[1], d_gate_up, d_down, t[8], t[9], t[10], act=ctx.act,
                             gate_up_bias=bias_E2I(gate_up_bias), down_bias=down_bias,
                             d_gate_up_bias=bias_E2I(t[21]), d_down_bias=t[22])
        return dy, None, None


_lib.impl("moe_fwd", _MoeFwdFunction.apply, "Autograd")


def _call_bwd(*args):
    """mok::moe_bwd with autograd: the op, or under torch.func.grad/vjp/jvp its Function applied from Python
    (a Function applied from inside a dispatcher kernel cannot see the transform)."""
    if _under_functorch_autodiff():
        return _MoeBwdFunction.apply(*args)
    return torch.ops.mok.moe_bwd(*args)


def _terms(*terms):
    """The sum of the terms that are not None (a tangent that is absent contributes nothing), or None."""
    present = [t for t in terms if t is not None]
    return None if not present else functools.reduce(torch.add, present)


def _swiglu_jvp(g, u, dg, du, limit, act=SWIGLU):
    """(h, dh): the clamped gated activation of float32 g, u and its tangent for tangents dg, du (None: zero).
    The partial derivatives are the reference's activation backward of dh = 1 (the clamp's masks included)."""
    h = reference.swiglu(g, u, limit, act)
    if dg is None and du is None:
        return h, None
    h_g, h_u = reference.swiglu_backward(torch.ones_like(g), g, u, limit, act)
    return h, _terms(None if dg is None else h_g * dg, None if du is None else h_u * du)


def forward_jvp(x, router_weights, top_experts, sched: Schedule, operands: RoutedOperands, s_gate_up, s_down,
                s_out_gate, swiglu_limit, gu, gu_shared, dx, d_router_weights, d_gate_up, d_down, d_s_gate_up,
                d_s_down, d_s_out_gate, *, act: Activation = SWIGLU, gate_up_bias=None, down_bias=None,
                d_gate_up_bias=None, d_down_bias=None) -> Tensor:
    """The tangent of moe_fwd's y for tangents of its inputs (`d_*`, each None when absent), at the point of
    the forward that saved `gu`, `gu_shared`: docs/semantics.md's forward differentiated term by term, in
    float32, from PyTorch ops (the GEMMs per expert; the schedule's offsets are read on the host). Every
    tangent enters linearly, and nothing is written in place, so torch.vmap batches it (jacfwd)."""
    dtype = x.dtype
    acc = torch.promote_types(dtype, torch.float32)

    def mm(a, b):
        return a.to(acc) @ b.to(acc)

    T, H = x.shape
    K = top_experts.shape[1]
    N = T * K
    (wg, wu, wd), _ = _reference_weights(operands, dtype, backward=False)
    E = len(wg)
    I = wd[0].shape[-1] if E > 0 else 0
    dg_w, du_w = split_gate_up(d_gate_up)
    try:
        offsets = sched.expert_offsets_E1.tolist()
    except RuntimeError as e:  # a tensor batched by torch.vmap (routing per entry) has no one value to read
        raise NotImplementedError(
            "mok::moe: forward mode (jvp, jacfwd) under a torch.vmap that batches top_experts is not supported (the "
            "tangent's per-expert loop reads the expert offsets on the host); a vmap over x and router_weights "
            "with shared top_experts works, or call jvp once per entry"
        ) from e
    tokens_N = sched.sorted_routes_N.to(torch.int64) // max(K, 1)
    y_rows, dy_rows = [], []  # per expert, in sorted slot order: y_tk as the forward rounded it, and its tangent
    for e in range(E):
        a, b = offsets[e], offsets[e + 1]
        if a == b:
            continue
        xe = x[tokens_N[a:b]]
        dxe = None if dx is None else dx[tokens_N[a:b]]
        g, u = gu[a:b].to(acc).chunk(2, dim=-1)
        dgb, dub = (None, None) if d_gate_up_bias is None else (d_gate_up_bias[e, 0].to(acc), d_gate_up_bias[e, 1].to(acc))
        dg = _terms(None if dxe is None else mm(dxe, wg[e].t()), None if dg_w is None else mm(xe, dg_w[e].t()), dgb)
        du = _terms(None if dxe is None else mm(dxe, wu[e].t()), None if du_w is None else mm(xe, du_w[e].t()), dub)
        if dg is not None and du is None:  # a bias tangent alone broadcasts over the rows
            du = torch.zeros_like(g)
        if du is not None and dg is None:
            dg = torch.zeros_like(g)
        h, dh = _swiglu_jvp(g, u, None if dg is None else dg.expand_as(g), None if du is None else du.expand_as(u),
                            swiglu_limit, act)
        h = h.to(dtype)
        y = mm(h, wd[e].t())
        if down_bias is not None:
            y = y + down_bias[e].to(acc)
        y_rows.append(y.to(dtype).to(acc))
        dy_e = _terms(None if dh is None else mm(dh, wd[e].t()), None if d_down is None else mm(h, d_down[e].t()),
                      None if d_down_bias is None else d_down_bias[e].to(acc).expand(b - a, H))
        dy_rows.append(dy_e if dy_e is not None else x.new_zeros(b - a, H, dtype=acc))
    pad = x.new_zeros(N - (offsets[E] if E > 0 else 0), H, dtype=acc)
    slots_TK = sched.route_slots_N.to(torch.int64).view(T, K)

    def by_route(rows):  # [T, K, H] from rows in sorted slot order (the `-1` routes' slots are zeros)
        return torch.cat(rows + [pad])[slots_TK]

    valid_TK1 = (top_experts >= 0).unsqueeze(-1)
    terms = []
    if any(t is not None for t in (dx, d_gate_up, d_down, d_gate_up_bias, d_down_bias)):
        terms.append(router_weights.to(acc).unsqueeze(-1) * by_route(dy_rows))
    if d_router_weights is not None:
        terms.append(d_router_weights.to(acc).unsqueeze(-1) * by_route(y_rows))
    routed = _terms(*terms)
    dy = None if routed is None else torch.where(valid_TK1, routed, torch.zeros_like(routed)).sum(1)
    if s_gate_up is not None:
        i_s = s_gate_up.shape[0] // 2
        gs, us = gu_shared.to(acc).chunk(2, dim=-1)
        d_sg, d_su = (None, None) if d_s_gate_up is None else (d_s_gate_up[:i_s], d_s_gate_up[i_s:])
        dgs = _terms(None if dx is None else mm(dx, s_gate_up[:i_s].t()), None if d_sg is None else mm(x, d_sg.t()))
        dus = _terms(None if dx is None else mm(dx, s_gate_up[i_s:].t()), None if d_su is None else mm(x, d_su.t()))
        hs, dhs = _swiglu_jvp(gs, us, dgs, dus, swiglu_limit, act)
        hs = hs.to(dtype)
        ds = _terms(None if dhs is None else mm(dhs, s_down.t()), None if d_s_down is None else mm(hs, d_s_down.t()))
        if s_out_gate is not None:
            gate_T1 = torch.sigmoid(mm(x, s_out_gate.t()))
            dz = _terms(None if dx is None else mm(dx, s_out_gate.t()),
                        None if d_s_out_gate is None else mm(x, d_s_out_gate.t()))
            s = mm(hs, s_down.t()).to(dtype).to(acc)
            ds = _terms(None if ds is None else gate_T1 * ds, None if dz is None else dz * gate_T1 * (1 - gate_T1) * s)
        dy = _terms(dy, ds)
    return (dy if dy is not None else x.new_zeros(T, H, dtype=acc)).to(dtype)


# ---------------------------------------------------------------------------------------------
# mok::moe_bwd

_lib.define(
    "moe_bwd(Tensor dy, Tensor x, Tensor router_weights, Tensor top_experts, Tensor sorted_routes, "
    "Tensor expert_offsets, Tensor route_slots, Tensor gate_up_proj, Tensor down_proj, Tensor? shared_gate_up_proj, "
    "Tensor? shared_down_proj, Tensor? shared_output_gate, Tensor gu, Tensor gu_shared, float? swiglu_limit, "
    f"{_MX_SCHEMA}, bool gate_up_grad=True, bool down_grad=True, {_VARIANT_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def bwd_output_shapes(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                      shared_output_gate, gate_up_grad=True, down_grad=True, gate_up_bias=None, down_bias=None):
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
        tuple(gate_up_bias.shape) if gate_up_bias is not None else empty,
        tuple(down_bias.shape) if down_bias is not None else empty,
    )


def _bwd_args(args):
    """(the 15 common arguments, the six MXFP8 ones, gate_up_grad, down_grad, (Activation, gate_up_bias,
    down_bias)) of moe_bwd."""
    common, rest = args[:15], args[15:]
    mx = _pad(rest[:6])
    flags = tuple(rest[6:8]) + (True, True)[len(rest[6:8]):]
    return common, mx, flags[0], flags[1], _variant(rest[8:])


def moe_bwd_impl(*args):
    common, mx, gate_up_grad, down_grad, (act, gate_up_bias, down_bias) = _bwd_args(args)
    (dy, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
     shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, swiglu_limit) = common
    s_gate, s_up = split_gate_up(shared_gate_up_proj)
    grads = GradBuffers.allocate(None, None, None, down_proj if down_grad else None, s_gate, s_up, shared_down_proj,
                                 shared_output_gate, gate_up=gate_up_proj if gate_up_grad else None,
                                 s_gate_up=shared_gate_up_proj, dtype=x.dtype,
                                 out_gate_dtype=None if shared_output_gate is None else shared_output_gate.dtype,
                                 preserve_layout=True)
    # the bias gradients in the biases' own layouts (a strided view's gradient reaches its base without a copy)
    d_gub = None if gate_up_bias is None else torch.empty_like(gate_up_bias, memory_format=torch.preserve_format)
    d_db = None if down_bias is None else torch.empty_like(down_bias, memory_format=torch.preserve_format)
    grads = grads._replace(d_gate_up_bias=bias_E2I(d_gub), d_down_bias=d_db)
    out = backward(dy, x, router_weights, top_experts, Schedule(sorted_routes, expert_offsets, route_slots),
                   routed_operands(gate_up_proj, down_proj, mx), gu, s_gate, s_up, shared_down_proj,
                   shared_output_gate, gu_shared, swiglu_limit, act, bias_E2I(gate_up_bias), down_bias, grads=grads)
    # absent gradients are [0]-shaped, and distinct tensors (op outputs must not alias each other)
    def given(t):
        return t if t is not None else x.new_empty(0)

    return (out.dx_TH, out.d_router_weights_TK.to(router_weights.dtype), given(grads.d_gate_up),
            given(grads.d_down), given(grads.d_s_gate_up), given(grads.d_s_down), given(grads.d_s_out_gate),
            given(d_gub), given(d_db))


_lib.impl("moe_bwd", moe_bwd_impl, "CompositeExplicitAutograd")


SECOND_DERIVATIVE_MESSAGE = (
    "mok::moe does not support second derivatives (a double backward, torch.func.hessian, a jvp or jacfwd of a "
    "gradient): its backward (mok::moe_bwd) is not differentiable. First derivatives work in every form: "
    "create_graph=True, torch.func.grad/vjp/jacrev/jvp/jacfwd, and vmap of them"
)


class _MoeBwdFunction(torch.autograd.Function):
    """mok::moe_bwd's autograd: the op is not differentiable, so this Function's backward and jvp raise. It is
    recorded like any op (create_graph=True, torch.func.grad/vjp over parameters that require grad, a joint
    graph's trace) and raises only when a second derivative is actually taken through it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.mok.moe_bwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(SECOND_DERIVATIVE_MESSAGE)

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(SECOND_DERIVATIVE_MESSAGE)


def _moe_bwd_autograd(*args):
    """moe_bwd's Autograd kernel: below autograd when nothing is recorded (a plain backward, the hot path),
    else through `_MoeBwdFunction`, which records the op and refuses only its own derivative."""
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return _MoeBwdFunction.apply(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.mok.moe_bwd(*args)


_lib.impl("moe_bwd", _moe_bwd_autograd, "Autograd")


@torch.library.register_fake("mok::moe_bwd", lib=_lib)
def _(*args):
    common, _mx, gate_up_grad, down_grad, (_act, gate_up_bias, down_bias) = _bwd_args(args)
    (dy, x, router_weights, _te, _sr, _eo, _rs, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
     shared_output_gate, _gu, _gus, _limit) = common
    shapes = bwd_output_shapes(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                               shared_output_gate, gate_up_grad, down_grad, gate_up_bias, down_bias)
    dtypes = (x.dtype, router_weights.dtype) + (x.dtype,) * 4 + (
        shared_output_gate.dtype if shared_output_gate is not None else x.dtype,) + (x.dtype,) * 2
    outs = [x.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
    # the real kernel allocates gradients in their tensors' layouts (`GradBuffers.allocate(preserve_layout=True)`):
    # the fake says so
    likes = (None, None, gate_up_proj if gate_up_grad else None, down_proj if down_grad else None, shared_gate_up_proj,
             shared_down_proj, shared_output_gate, gate_up_bias, down_bias)
    for i, like in enumerate(likes):
        if like is not None:
            outs[i] = torch.empty_like(like, dtype=dtypes[i], memory_format=torch.preserve_format)
    return tuple(outs)


# ---------------------------------------------------------------------------------------------
# mok::moe (user-facing, composite)

_lib.define(
    "moe(Tensor x, Tensor router_weights, Tensor top_experts, Tensor gate_up_proj, Tensor down_proj, "
    "Tensor? shared_gate_up_proj=None, Tensor? shared_down_proj=None, Tensor? shared_output_gate=None, "
    f"float? swiglu_limit=None, {_MX_SCHEMA}, {_MASTER_SCHEMA}, {_VARIANT_SCHEMA}) -> Tensor"
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
    act, gate_up_bias, down_bias = _variant(mx_and_masters[8:])
    quantized = any(t is not None for t in mx + masters)
    gu_w, d_w = gate_up_proj, down_proj
    if quantized:
        gu_w, d_w = _check_mxfp8(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                                 shared_output_gate, mx, masters)
    _checks.check_moe_args(x, router_weights, top_experts, gu_w, d_w, shared_gate_up_proj, shared_down_proj,
                           shared_output_gate, swiglu_limit)
    _checks.check_variant(x, gu_w, d_w, shared_gate_up_proj, gate_up_bias, down_bias)
    if not quantized and _decode_eligible(x, top_experts, gate_up_proj, (
            x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj, shared_output_gate,
            gate_up_bias, down_bias)):
        s_gate, s_up = split_gate_up(shared_gate_up_proj)
        with autocast_off(x):
            return kernels_module().decode_forward(
                x, router_weights, top_experts, gate_up_proj, down_proj, s_gate, s_up, shared_down_proj,
                shared_output_gate, None if swiglu_limit is None else float(swiglu_limit), act, bias_E2I(gate_up_bias),
                down_bias)
    sorted_routes, expert_offsets, route_slots = torch.ops.mok.schedule(top_experts, gate_up_proj.shape[0])
    args = (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
            shared_gate_up_proj, shared_down_proj, shared_output_gate,
            None if swiglu_limit is None else float(swiglu_limit))
    if quantized:
        args += mx + masters
    if act is not SWIGLU or gate_up_bias is not None or down_bias is not None:
        args = args + (None,) * (20 - len(args)) + (act.name, gate_up_bias, down_bias)
    if _needs_autograd(args):
        y, _, _ = _MoeFwdFunction.apply(*args)
    else:  # inference: the forward op alone, without the Function's per-call cost (host-bound decode)
        with torch._C._AutoDispatchBelowAutograd():
            y, _, _ = torch.ops.mok.moe_fwd(*args)
    return y


def _decode_eligible(x, top_experts, gate_up_proj, tensors) -> bool:
    """Whether a call runs the decode forward (`kernels.decode_forward`): an eager call on the Triton kernels
    that needs no gradient, of at least one and at most `options.decode_max_routes` routes and no more routes than
    experts (each route reads its expert's weights: repeats would read them again), with plain weights
    (the caller rules out MXFP8; split weights were stacked by then) and I > 0. Never while tracing (compiled
    graphs and exports keep the ops whole)."""
    if torch.compiler.is_compiling():
        return False
    n = top_experts.numel()
    if not 0 < n <= min(options.current().decode_max_routes, gate_up_proj.shape[0]) or gate_up_proj.shape[-2] == 0:
        return False
    return use_triton(x) and not _needs_autograd(tensors) and not kernels_module().common.traced((x,))


def _needs_autograd(args) -> bool:
    """Whether the forward must run through its autograd.Function: grad mode on and an input requiring grad,
    a forward-mode AD level open (torch.autograd.forward_ad: a dual input's tangent would be dropped below
    autograd), or a functorch transform (vmap, grad, ...) or torch.compile tracing, which handle the Function
    themselves."""
    if (torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling()
            or torch.autograd.forward_ad._current_level >= 0):
        return True
    return torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


def _under_functorch_autodiff() -> bool:
    """Whether a torch.func grad/vjp/jvp transform is active, innermost or under a vmap inside it. Autograd
    Functions must then be applied from Python: applied from inside a dispatcher kernel, they would not
    see the transform."""
    # (the cheap check first: every eager call asks, and decode calls are host-bound)
    if not torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return False
    stack = torch._C._functorch.get_interpreter_stack()
    autodiff = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)
    return bool(stack) and any(i.key() in autodiff for i in stack)


def call_moe(*args):
    """Run mok::moe on flattened arguments: through the op (what Dynamo records and vmap batches; its
    Autocast kernels apply the autocast policy), or, under torch.func.grad / vjp / jvp (a vmap inside them
    included: mok::moe's vmap rule would run at the vmap's level, where a Function cannot be applied), through
    the same composite body called from Python, after the same autocast policy."""
    if _under_functorch_autodiff():
        dtype = autocast_dtype(args[0])
        return _moe_composite(*(args if dtype is None else autocast_cast(args, dtype)))
    return torch.ops.mok.moe(*args)


def _moe_kernel(*args):
    """mok::moe's CompositeImplicitAutograd kernel: the composite body, except under torch.func.grad/vjp/jvp,
    where an op's kernel cannot apply the autograd Function (`call_moe` applies it from Python)."""
    if _under_functorch_autodiff():
        raise NotImplementedError(
            "torch.ops.mok.moe: under torch.func.grad/vjp/jvp (and the transforms built on them) call "
            "mok_inductor.moe, which applies the op's autograd from Python; the op called directly cannot be "
            "differentiated by torch.func"
        )
    return _moe_composite(*args)


_lib.impl("moe", _moe_kernel, "CompositeImplicitAutograd")


def _moe_autocast(*args):
    """mok::moe's Autocast kernel (the policy above `autocast_cast`): cast, then call the op with autocast
    off. The casts are ordinary ops below it, so autograd differentiates them and compiled graphs hold them."""
    device_type = args[0].device.type
    dtype = torch.get_autocast_dtype(device_type)
    with torch.autocast(device_type, enabled=False):
        return torch.ops.mok.moe(*autocast_cast(args, dtype))


_lib.impl("moe", _moe_autocast, "AutocastCPU")
_lib.impl("moe", _moe_autocast, "AutocastCUDA")


# ---------------------------------------------------------------------------------------------
# vmap. Over mok::moe: tokens are independent, so a batch of token sets with shared weights is one call on
# the flattened tokens. Batching the weights (a different expert set per batch entry) is not supported and
# says so. Over mok::schedule, mok::moe_fwd and mok::moe_bwd (what torch.func reaches through the
# Functions: vmap of grad for per-sample gradients, jacrev, jacfwd): one call per batch entry, since a
# per-sample weight gradient is not a sum over the batch, and each entry has its own schedule.


_BATCHABLE = ("x", "router_weights", "top_experts")
_MOE_ARG_NAMES = ("x", "router_weights", "top_experts", "gate_up_proj", "down_proj", "shared_gate_up_proj",
                  "shared_down_proj", "shared_output_gate", "swiglu_limit") + _MX_NAMES + _MASTER_NAMES + (
                      "activation", "gate_up_bias", "down_bias")


def _moe_vmap(info, in_dims, *args):
    for name, dim in zip(_MOE_ARG_NAMES, in_dims):
        if dim is not None and name not in _BATCHABLE:
            raise ValueError(
                f"{name}: torch.vmap over mok::moe batches only x, router_weights and top_experts (the tokens); "
                f"got a batched {name}. Call mok_inductor.moe once per weight set instead."
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


def _vmap_per_entry(call):
    """A vmap rule that runs the op `call` once per batch entry (contiguous, as the kernels take their
    operands) and stacks each output along dim 0."""
    def rule(info, in_dims, *args):
        outs = [call(*(a if d is None else a.select(d, b).contiguous() for a, d in zip(args, in_dims)))
                for b in range(info.batch_size)]
        return tuple(torch.stack(o) for o in zip(*outs)), (0,) * len(outs[0])
    return rule


torch.library.register_vmap("mok::moe", _moe_vmap)
torch.library.register_vmap("mok::schedule", _vmap_per_entry(torch.ops.mok.schedule))
torch.library.register_vmap("mok::moe_fwd", _vmap_per_entry(torch.ops.mok.moe_fwd))
torch.library.register_vmap("mok::moe_bwd", _vmap_per_entry(torch.ops.mok.moe_bwd))
