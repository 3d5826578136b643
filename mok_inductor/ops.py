"""The `mok::` operators: schemas, fake kernels and autograd formulas, side by side.

    mok::moe        the user-facing op (CompositeImplicitAutograd): validates, then
                    schedule -> moe_fwd. Its autograd and fake come from the two ops below,
                    so compiled graphs hold mok::schedule + mok::moe_fwd forward and
                    mok::moe_bwd backward.
    mok::schedule   top_experts [T, K] -> (sorted_routes [N], expert_offsets [E+1], route_slots [N]),
                    int32, deterministic (a stable sort of the flat route index). Not differentiable.
    mok::moe_fwd    -> (y [T, H], gu [N, 2I], gu_shared [T, 2Is] or [0, 0]). y is differentiable;
                    gu and gu_shared, the gate/up pre-activations [g | u] (before the clamp; gu in x.dtype
                    and sorted slot order, gu_shared in float32), are the saved activations (marked
                    non-differentiable).
    mok::moe_bwd    -> (dx, d_router_weights, d_gate_up_proj, d_down_proj, d_shared_gate_up_proj,
                    d_shared_down_proj, d_shared_output_gate); the shared gradients are [0]-shaped
                    when there is no shared expert / gate.

Registration: the ops are defined on one `torch.library.Library("mok", "DEF")` with explicit schemas;
the implementations sit at CompositeExplicitAutograd, fakes via `register_fake`, and moe_fwd's autograd
is a `torch.autograd.Function` with a separate setup_context at its Autograd key (so torch.func.grad
and vjp work; custom_op's generated Function does not support them). mok::moe_bwd's Autograd kernel
only refuses double backward with a clear error. `call_moe` is the entry the user API uses: the op,
or under torch.func.grad/vjp the same composite body applied from Python. mok::moe has a vmap rule
(tokens batched, weights shared).

What is saved for backward: x, router_weights, top_experts, the schedule, the weights, gu and
gu_shared. What is recomputed: no GEMM of the forward; h = swiglu(g, u) elementwise from gu in the
backward kernel, the shared output gate sigmoid(x @ w^T), and never y_tk or s_t (their inner products
with dy come from <dy @ down, h>). Memory: the saved routed activation is 2*N*I elements (N*I when h
was saved), plus 2*T*Is for the shared expert.

Implementations: CPU tensors run `mok_inductor.reference` (vectorised PyTorch, float32
accumulation). CUDA tensors run the Triton kernels of `mok_inductor.kernels` when that backend
provides them (see `_triton_backend`), otherwise the reference. `MOK_BACKEND=reference|triton|auto`
overrides the choice (`triton` on CPU tensors needs `TRITON_INTERPRET=1`). Under torch.compile, a
FunctionalTensorMode rule decomposes the ops into their Triton launches on CUDA (so Inductor emits the
kernels in its generated code, as `torch.library.triton_op` does) and keeps them opaque on the CPU,
where the compiled graph calls the reference.

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per
token, N = T*K.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensorMode

from . import _checks, reference

_lib = torch.library.Library("mok", "DEF")

# ---------------------------------------------------------------------------------------------
# Backend choice


def _triton_backend():
    """The Triton kernel module, or None when it cannot run here (no triton, or not provided yet)."""
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels if getattr(kernels, "AVAILABLE", False) else None


def use_triton(t: Tensor) -> bool:
    """Whether an op on tensors like `t` runs the Triton kernels."""
    choice = os.environ.get("MOK_BACKEND", "auto")
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"MOK_BACKEND: expected auto, reference or triton, got {choice!r}")
    if choice == "reference":
        return False
    if _triton_backend() is None:
        if choice == "triton":
            raise RuntimeError("MOK_BACKEND=triton, but the Triton kernels are not available (is triton installed?)")
        return False
    if choice == "triton":
        return True
    return t.device.type == "cuda"


def path_name(t: Tensor) -> str:
    """A human-readable name of the implementation that runs for tensors like `t`."""
    return "triton" if use_triton(t) else "reference"


def impl_module(t: Tensor):
    """The implementation for tensors like `t`: `mok_inductor.kernels` or `mok_inductor.reference`.
    Both expose build_schedule / moe_forward / moe_backward with the same signatures."""
    return _triton_backend() if use_triton(t) else reference


def _register_functional_rule(op_name: str, triton_fn) -> None:
    """Decompose `op` into `triton_fn` (its Triton launches) while AOTAutograd functionalizes CUDA
    tensors, so Inductor sees user-defined Triton kernels; leave it opaque otherwise."""

    def rule(mode, func, types, args, kwargs):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        if any(t not in (Tensor, FakeTensor, FunctionalTensor) for t in types):
            return NotImplemented
        first = args[0]
        if first.device.type == "cuda" and use_triton(first):
            with mode:
                return triton_fn(*args, **kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    torch.library.register_torch_dispatch(op_name, FunctionalTensorMode, rule, lib=_lib)


# ---------------------------------------------------------------------------------------------
# mok::schedule


def _schedule_impl(top_experts: Tensor, num_experts: int, impl=None):
    impl = impl or impl_module(top_experts)
    if impl is reference:
        if top_experts.device.type == "cpu":
            _checks.check_expert_ids_eager(top_experts, num_experts)
        else:
            _assert_expert_ids_on_device(top_experts, num_experts)
    # the Triton schedule checks the ids itself, on the device
    return tuple(impl.build_schedule(top_experts, num_experts))


def _assert_expert_ids_on_device(top_experts: Tensor, num_experts: int) -> None:
    ok = ((top_experts >= -1) & (top_experts < num_experts)).all()
    torch._assert_async(ok, f"top_experts: expected expert indices in [-1, {num_experts})")


_lib.define("schedule(Tensor top_experts, SymInt num_experts) -> (Tensor, Tensor, Tensor)")
_lib.impl("schedule", lambda top_experts, num_experts: _schedule_impl(top_experts, num_experts),
          "CompositeExplicitAutograd")


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


def fwd_output_shapes(x, top_experts, gate_up_proj, shared_gate_up_proj):
    """Shapes of (y, gu, gu_shared): the one shape function of the fake and the real kernels."""
    T, H = x.shape
    N = T * top_experts.shape[1]
    two_i = gate_up_proj.shape[1]
    gus = (T, shared_gate_up_proj.shape[0]) if shared_gate_up_proj is not None else (0, 0)
    return (T, H), (N, two_i), gus


def _fwd_fake_outputs(x, top_experts, gate_up_proj, shared_gate_up_proj):
    """Fake (y, gu, gu_shared) of the forward ops; gu_shared in `reference.shared_saved_dtype`."""
    y, g, gs = fwd_output_shapes(x, top_experts, gate_up_proj, shared_gate_up_proj)
    return x.new_empty(y), x.new_empty(g), x.new_empty(gs, dtype=reference.shared_saved_dtype(x.dtype))


def split_gate_up(w_E2IH: Tensor):
    """Zero-copy gate and up row views of a combined FC1 ([..., 2I, H] -> two [..., I, H])."""
    i = w_E2IH.shape[-2] // 2
    return w_E2IH.narrow(-2, 0, i), w_E2IH.narrow(-2, i, i)


def _moe_fwd_impl(
    impl, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
    shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit,
):
    w_gate, w_up = split_gate_up(gate_up_proj)
    s_gate = s_up = None
    if shared_gate_up_proj is not None:
        s_gate, s_up = split_gate_up(shared_gate_up_proj)
    out = impl.moe_forward(
        x, router_weights, top_experts, reference.Schedule(sorted_routes, expert_offsets, route_slots),
        w_gate, w_up, down_proj, s_gate, s_up, shared_down_proj, shared_output_gate, swiglu_limit,
    )
    return tuple(out)


def _moe_fwd_triton(*args):
    return _moe_fwd_impl(_triton_backend(), *args)


_lib.define(
    "moe_fwd(Tensor x, Tensor router_weights, Tensor top_experts, Tensor sorted_routes, Tensor expert_offsets, "
    "Tensor route_slots, Tensor gate_up_proj, Tensor down_proj, Tensor? shared_gate_up_proj, "
    "Tensor? shared_down_proj, Tensor? shared_output_gate, float? swiglu_limit) -> (Tensor, Tensor, Tensor)"
)
_lib.impl("moe_fwd", lambda *args: _moe_fwd_impl(impl_module(args[0]), *args), "CompositeExplicitAutograd")


@torch.library.register_fake("mok::moe_fwd", lib=_lib)
def _(x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
      shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit):
    return _fwd_fake_outputs(x, top_experts, gate_up_proj, shared_gate_up_proj)


class _MoeFwdFunction(torch.autograd.Function):
    """The autograd formula of mok::moe_fwd (registered at its Autograd key). A Function with a
    separate setup_context, so torch.func transforms (grad, vjp) work through it."""

    @staticmethod
    def forward(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.mok.moe_fwd(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
         shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit) = inputs
        _, gu, gu_shared = output
        ctx.mark_non_differentiable(gu, gu_shared)
        ctx.set_materialize_grads(False)
        ctx.swiglu_limit = swiglu_limit
        ctx.has_shared = shared_gate_up_proj is not None
        ctx.has_gate = shared_output_gate is not None
        ctx.save_for_backward(
            x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
            shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared,
        )

    @staticmethod
    def backward(ctx, dy, _dgu, _dgu_shared):
        (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
         shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared) = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dx, drw, dgu, dd, dsgu, dsd, dsg = torch.ops.mok.moe_bwd(
            dy, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj,
            down_proj, shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, ctx.swiglu_limit,
        )
        return (
            dx, drw, None, None, None, None, dgu, dd,
            dsgu if ctx.has_shared else None,
            dsd if ctx.has_shared else None,
            dsg if ctx.has_gate else None,
            None,
        )


_lib.impl("moe_fwd", _MoeFwdFunction.apply, "Autograd")


# ---------------------------------------------------------------------------------------------
# mok::moe_bwd


def bwd_output_shapes(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                      shared_output_gate):
    """Shapes of moe_bwd's outputs: the one shape function of the fake and the real kernels."""
    empty = (0,)
    return (
        tuple(x.shape),
        tuple(router_weights.shape),
        tuple(gate_up_proj.shape),
        tuple(down_proj.shape),
        tuple(shared_gate_up_proj.shape) if shared_gate_up_proj is not None else empty,
        tuple(shared_down_proj.shape) if shared_down_proj is not None else empty,
        tuple(shared_output_gate.shape) if shared_output_gate is not None else empty,
    )


def _moe_bwd_impl(
    impl, dy, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
    shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, swiglu_limit,
):
    w_gate, w_up = split_gate_up(gate_up_proj)
    s_gate = s_up = None
    if shared_gate_up_proj is not None:
        s_gate, s_up = split_gate_up(shared_gate_up_proj)
    wdt = gate_up_proj.dtype
    d_gate_up = torch.empty(gate_up_proj.shape, dtype=wdt, device=x.device)
    d_down = torch.empty(down_proj.shape, dtype=wdt, device=x.device)
    # absent gradients are [0]-shaped, and distinct tensors (op outputs must not alias each other)
    d_sgu, d_sd, d_sg = x.new_empty(0), x.new_empty(0), x.new_empty(0)
    if shared_gate_up_proj is not None:
        d_sgu = torch.empty(shared_gate_up_proj.shape, dtype=wdt, device=x.device)
        d_sd = torch.empty(shared_down_proj.shape, dtype=wdt, device=x.device)
    if shared_output_gate is not None:
        d_sg = torch.empty(shared_output_gate.shape, dtype=shared_output_gate.dtype, device=x.device)
    d_gate, d_up = split_gate_up(d_gate_up)
    d_s_gate, d_s_up = split_gate_up(d_sgu) if shared_gate_up_proj is not None else (None, None)
    grads = reference.GradBuffers(
        d_gate, d_up, d_down, d_s_gate, d_s_up,
        d_sd if shared_gate_up_proj is not None else None,
        d_sg if shared_output_gate is not None else None,
        d_gate_up=d_gate_up, d_s_gate_up=d_sgu if shared_gate_up_proj is not None else None,
    )
    out = impl.moe_backward(
        dy, x, router_weights, top_experts, reference.Schedule(sorted_routes, expert_offsets, route_slots),
        w_gate, w_up, down_proj, gu, s_gate, s_up, shared_down_proj, shared_output_gate, gu_shared, swiglu_limit,
        grads=grads,
    )
    return out.dx_TH, out.d_router_weights_TK.to(router_weights.dtype), d_gate_up, d_down, d_sgu, d_sd, d_sg


def _moe_bwd_triton(*args):
    return _moe_bwd_impl(_triton_backend(), *args)


_lib.define(
    "moe_bwd(Tensor dy, Tensor x, Tensor router_weights, Tensor top_experts, Tensor sorted_routes, "
    "Tensor expert_offsets, Tensor route_slots, Tensor gate_up_proj, Tensor down_proj, Tensor? shared_gate_up_proj, "
    "Tensor? shared_down_proj, Tensor? shared_output_gate, Tensor gu, Tensor gu_shared, float? swiglu_limit) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.impl("moe_bwd", lambda *args: _moe_bwd_impl(impl_module(args[1]), *args), "CompositeExplicitAutograd")


def _no_double_backward(bwd_op: str, public_op: str):
    """The Autograd kernel of a backward op that is not differentiable: it says so when someone asks for a
    double backward, and otherwise runs the op below Autograd."""

    def kernel(*args):
        if (torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
                and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            raise RuntimeError(
                f"mok::{public_op} does not support double backward: its backward (mok::{bwd_op}) is not "
                "differentiable (call backward without create_graph=True)"
            )
        with torch._C._AutoDispatchBelowAutograd():
            return getattr(torch.ops.mok, bwd_op)(*args)

    return kernel


_lib.impl("moe_bwd", _no_double_backward("moe_bwd", "moe"), "Autograd")


@torch.library.register_fake("mok::moe_bwd", lib=_lib)
def _(dy, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
      shared_gate_up_proj, shared_down_proj, shared_output_gate, gu, gu_shared, swiglu_limit):
    shapes = bwd_output_shapes(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj,
                               shared_down_proj, shared_output_gate)
    dtypes = (x.dtype, router_weights.dtype, gate_up_proj.dtype, down_proj.dtype, gate_up_proj.dtype,
              down_proj.dtype, shared_output_gate.dtype if shared_output_gate is not None else x.dtype)
    return tuple(x.new_empty(s, dtype=d) for s, d in zip(shapes, dtypes))


# ---------------------------------------------------------------------------------------------
# mok::moe (user-facing, composite)

_lib.define(
    "moe(Tensor x, Tensor router_weights, Tensor top_experts, Tensor gate_up_proj, Tensor down_proj, "
    "Tensor? shared_gate_up_proj=None, Tensor? shared_down_proj=None, Tensor? shared_output_gate=None, "
    "float? swiglu_limit=None) -> Tensor"
)


def _moe_composite(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj=None,
                   shared_down_proj=None, shared_output_gate=None, swiglu_limit=None):
    _checks.check_moe_args(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj,
                           shared_down_proj, shared_output_gate, swiglu_limit)
    num_experts = gate_up_proj.shape[0]
    sorted_routes, expert_offsets, route_slots = torch.ops.mok.schedule(top_experts, num_experts)
    args = (x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gate_up_proj, down_proj,
            shared_gate_up_proj, shared_down_proj, shared_output_gate,
            None if swiglu_limit is None else float(swiglu_limit))
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

_register_functional_rule("mok::schedule", lambda te, e: _schedule_impl(te, e, _triton_backend()))
_register_functional_rule("mok::moe_fwd", _moe_fwd_triton)
_register_functional_rule("mok::moe_bwd", _moe_bwd_triton)


# ---------------------------------------------------------------------------------------------
# vmap over mok::moe: tokens are independent, so a batch of token sets with shared weights is one
# call on the flattened tokens. Batching the weights (a different expert set per batch entry) is not
# supported and says so.

_BATCHABLE = ("x", "router_weights", "top_experts")
_MOE_ARG_NAMES = ("x", "router_weights", "top_experts", "gate_up_proj", "down_proj", "shared_gate_up_proj",
                  "shared_down_proj", "shared_output_gate", "swiglu_limit")


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


# ---------------------------------------------------------------------------------------------
# MXFP8 routed weights (issue 8): mok::moe_mxfp8 (user-facing, composite), mok::moe_fwd_mxfp8,
# mok::moe_bwd_mxfp8.
#
# Each routed weight is four tensors, `W, W_scale, W_t, W_scale_t`: float8_e4m3fn data [E, M, K] with
# uint8 E8M0 scales [E, M, K/32] and the optional column-wise pair [E, K, M], [E, K, M/32]
# (mok_inductor.mxfp8); or, with W_scale None, a plain float weight in x.dtype (so gate_up and down may
# differ in kind). Weight gradients go to the `*_master` arguments (straight-through: the bf16 weight
# the MXFP8 one was quantized from; for a plain weight, the weight itself). The ops never read a
# master's values. Forward reads the row-wise data; backward the column-wise gate/up/down (dx, dy @ down
# -> d router weights and dh); it recomputes no gate/up GEMM (the forward saved gu). CPU tensors
# dequantize to x.dtype and run `mok_inductor.reference`; CUDA runs `mok_inductor.kernels.forward/backward`
# on the quantized operands.

from . import mxfp8 as _mx  # noqa: E402

_MX_FWD_W = ("Tensor gate_up, Tensor? gate_up_scale, Tensor? gate_up_t, Tensor? gate_up_scale_t, "
             "Tensor? gate_up_master, Tensor down, Tensor? down_scale, Tensor? down_t, Tensor? down_scale_t, "
             "Tensor? down_master")
_MX_BWD_W = ("Tensor gate_up, Tensor? gate_up_scale, Tensor? gate_up_t, Tensor? gate_up_scale_t, "
             "Tensor down, Tensor? down_scale, Tensor? down_t, Tensor? down_scale_t")


def _mxfp8_kernels():
    from . import kernels

    return kernels


def mxfp8_forward(x, router_weights, top_experts, schedule, operands, s_gate=None, s_up=None, s_down=None,
                  s_out_gate=None, swiglu_limit=None, *, triton_=None) -> reference.ForwardResult:
    """The forward with routed weights given as `mxfp8.RoutedOperands`: the Triton kernels, or the
    reference on the weights dequantized to x.dtype (`triton_`: force one; default `use_triton(x)`)."""
    if use_triton(x) if triton_ is None else triton_:
        return _mxfp8_kernels().forward(x, router_weights, top_experts, schedule, operands, s_gate, s_up, s_down,
                                        s_out_gate, swiglu_limit)
    (wg, wu, wd), _ = _mx.dequantized_weights(operands, x.dtype)
    return reference.moe_forward(x, router_weights, top_experts, schedule, wg, wu, wd, s_gate, s_up, s_down,
                                 s_out_gate, swiglu_limit)


def mxfp8_backward(dy, x, router_weights, top_experts, schedule, operands, gu_N2I, s_gate=None, s_up=None,
                   s_down=None, s_out_gate=None, gu_shared_T2Is=None, swiglu_limit=None, *, grads, accumulate=False,
                   triton_=None) -> reference.BackwardResult:
    """The backward with routed weights given as `mxfp8.RoutedOperands` (column-wise operands needed).
    `grads`: destinations; a None routed entry means that weight gradient is not wanted."""
    if operands.gate_t is None or operands.down_t is None:
        which = "gate_up" if operands.gate_t is None else "down"
        raise ValueError(f"{which}: the backward needs the column-wise MXFP8 data (quantize with columnwise=True)")
    if use_triton(x) if triton_ is None else triton_:
        return _mxfp8_kernels().backward(dy, x, router_weights, top_experts, schedule, operands, gu_N2I, s_gate,
                                         s_up, s_down, s_out_gate, gu_shared_T2Is, swiglu_limit, grads=grads,
                                         accumulate=accumulate)
    (wg, wu, wd), dgrad = _mx.dequantized_weights(operands, x.dtype)
    return reference.moe_backward(dy, x, router_weights, top_experts, schedule, wg, wu, wd, gu_N2I, s_gate, s_up,
                                  s_down, s_out_gate, gu_shared_T2Is, swiglu_limit, grads=grads,
                                  accumulate=accumulate, dgrad=dgrad)


def _mx_fwd_impl(use_tri, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots,
                 gu, gus, gut, gust, gum, d, ds, dt, dst, dm, shared_gate_up_proj, shared_down_proj,
                 shared_output_gate, swiglu_limit):
    operands = _mx.routed_operands((gu, gus, gut, gust), (d, ds, dt, dst))
    s_gate = s_up = None
    if shared_gate_up_proj is not None:
        s_gate, s_up = split_gate_up(shared_gate_up_proj)
    out = mxfp8_forward(x, router_weights, top_experts, reference.Schedule(sorted_routes, expert_offsets, route_slots),
                        operands, s_gate, s_up, shared_down_proj, shared_output_gate, swiglu_limit, triton_=use_tri)
    return tuple(out)


_lib.define(f"moe_fwd_mxfp8(Tensor x, Tensor router_weights, Tensor top_experts, Tensor sorted_routes, "
            f"Tensor expert_offsets, Tensor route_slots, {_MX_FWD_W}, Tensor? shared_gate_up_proj, "
            f"Tensor? shared_down_proj, Tensor? shared_output_gate, float? swiglu_limit) -> (Tensor, Tensor, Tensor)")
_lib.impl("moe_fwd_mxfp8", lambda *args: _mx_fwd_impl(use_triton(args[0]), *args), "CompositeExplicitAutograd")


@torch.library.register_fake("mok::moe_fwd_mxfp8", lib=_lib)
def _(x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gu, gus, gut, gust, gum, d, ds,
      dt, dst, dm, shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit):
    return _fwd_fake_outputs(x, top_experts, gu, shared_gate_up_proj)


class _MoeFwdMxfp8Function(torch.autograd.Function):
    """The autograd formula of mok::moe_fwd_mxfp8: the weight gradients go to the master arguments."""

    @staticmethod
    def forward(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.mok.moe_fwd_mxfp8(*args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x, rw, te, sr, eo, rs, gu, gus, gut, gust, gum, d, ds, dt, dst, dm, sgu, sd, sg, limit) = inputs
        _, gu_N2I, gu_shared_T2Is = output
        ctx.mark_non_differentiable(gu_N2I, gu_shared_T2Is)
        ctx.set_materialize_grads(False)
        ctx.swiglu_limit = limit
        ctx.has_shared = sgu is not None
        ctx.has_gate = sg is not None
        ctx.gate_up_grad = gum is not None
        ctx.down_grad = dm is not None
        ctx.save_for_backward(x, rw, te, sr, eo, rs, gu, gus, gut, gust, d, ds, dt, dst, sgu, sd, sg, gu_N2I,
                              gu_shared_T2Is)

    @staticmethod
    def backward(ctx, dy, _dgu, _dgu_shared):
        (x, rw, te, sr, eo, rs, gu, gus, gut, gust, d, ds, dt, dst, sgu, sd, sg, gu_N2I,
         gu_shared_T2Is) = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dx, drw, dgu, dd, dsgu, dsd, dsg = torch.ops.mok.moe_bwd_mxfp8(
            dy, x, rw, te, sr, eo, rs, gu, gus, gut, gust, d, ds, dt, dst, sgu, sd, sg, gu_N2I, gu_shared_T2Is,
            ctx.swiglu_limit, ctx.gate_up_grad, ctx.down_grad,
        )
        none4 = (None, None, None, None)
        return (
            dx, drw, None, None, None, None, *none4, dgu if ctx.gate_up_grad else None, *none4,
            dd if ctx.down_grad else None,
            dsgu if ctx.has_shared else None, dsd if ctx.has_shared else None, dsg if ctx.has_gate else None, None,
        )


_lib.impl("moe_fwd_mxfp8", _MoeFwdMxfp8Function.apply, "Autograd")


def _mx_bwd_impl(use_tri, dy, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots,
                 gu, gus, gut, gust, d, ds, dt, dst, shared_gate_up_proj, shared_down_proj, shared_output_gate,
                 gu_N2I, gu_shared_T2Is, swiglu_limit, gate_up_grad, down_grad):
    operands = _mx.routed_operands((gu, gus, gut, gust), (d, ds, dt, dst))
    s_gate = s_up = None
    if shared_gate_up_proj is not None:
        s_gate, s_up = split_gate_up(shared_gate_up_proj)
    wdt = x.dtype
    d_gate_up = torch.empty(gu.shape if gate_up_grad else (0,), dtype=wdt, device=x.device)
    d_down = torch.empty(d.shape if down_grad else (0,), dtype=wdt, device=x.device)
    d_sgu, d_sd, d_sg = x.new_empty(0), x.new_empty(0), x.new_empty(0)
    if shared_gate_up_proj is not None:
        d_sgu = torch.empty(shared_gate_up_proj.shape, dtype=wdt, device=x.device)
        d_sd = torch.empty(shared_down_proj.shape, dtype=wdt, device=x.device)
    if shared_output_gate is not None:
        d_sg = torch.empty(shared_output_gate.shape, dtype=shared_output_gate.dtype, device=x.device)
    d_gate, d_up = split_gate_up(d_gate_up) if gate_up_grad else (None, None)
    d_s_gate, d_s_up = split_gate_up(d_sgu) if shared_gate_up_proj is not None else (None, None)
    grads = reference.GradBuffers(
        d_gate, d_up, d_down if down_grad else None, d_s_gate, d_s_up,
        d_sd if shared_gate_up_proj is not None else None, d_sg if shared_output_gate is not None else None,
        d_gate_up=d_gate_up if gate_up_grad else None,
        d_s_gate_up=d_sgu if shared_gate_up_proj is not None else None,
    )
    out = mxfp8_backward(dy, x, router_weights, top_experts, reference.Schedule(sorted_routes, expert_offsets,
                         route_slots), operands, gu_N2I, s_gate, s_up, shared_down_proj, shared_output_gate,
                         gu_shared_T2Is, swiglu_limit, grads=grads, triton_=use_tri)
    return out.dx_TH, out.d_router_weights_TK.to(router_weights.dtype), d_gate_up, d_down, d_sgu, d_sd, d_sg


_lib.define(f"moe_bwd_mxfp8(Tensor dy, Tensor x, Tensor router_weights, Tensor top_experts, Tensor sorted_routes, "
            f"Tensor expert_offsets, Tensor route_slots, {_MX_BWD_W}, Tensor? shared_gate_up_proj, "
            f"Tensor? shared_down_proj, Tensor? shared_output_gate, Tensor gu, Tensor gu_shared, float? swiglu_limit, "
            f"bool gate_up_grad, bool down_grad) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_lib.impl("moe_bwd_mxfp8", lambda *args: _mx_bwd_impl(use_triton(args[1]), *args), "CompositeExplicitAutograd")


_lib.impl("moe_bwd_mxfp8", _no_double_backward("moe_bwd_mxfp8", "moe_mxfp8"), "Autograd")


@torch.library.register_fake("mok::moe_bwd_mxfp8", lib=_lib)
def _(dy, x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gu, gus, gut, gust, d, ds,
      dt, dst, shared_gate_up_proj, shared_down_proj, shared_output_gate, gu_N2I, gu_shared_T2Is, swiglu_limit,
      gate_up_grad, down_grad):
    empty = (0,)
    return (
        x.new_empty(x.shape), router_weights.new_empty(router_weights.shape),
        x.new_empty(gu.shape if gate_up_grad else empty), x.new_empty(d.shape if down_grad else empty),
        x.new_empty(shared_gate_up_proj.shape if shared_gate_up_proj is not None else empty),
        x.new_empty(shared_down_proj.shape if shared_down_proj is not None else empty),
        (shared_output_gate.new_empty(shared_output_gate.shape) if shared_output_gate is not None
         else x.new_empty(empty)),
    )


_lib.define(f"moe_mxfp8(Tensor x, Tensor router_weights, Tensor top_experts, {_MX_FWD_W}, "
            "Tensor? shared_gate_up_proj=None, Tensor? shared_down_proj=None, Tensor? shared_output_gate=None, "
            "float? swiglu_limit=None) -> Tensor")


def _logical(x, data, master):
    """A stand-in with the logical weight's shape, x's dtype and device, for the common checks."""
    if master is not None:
        return master
    if data.dtype == torch.float8_e4m3fn:
        return x.new_empty(()).expand(data.shape)
    return data


def _moe_mxfp8_composite(x, router_weights, top_experts, gu, gus, gut, gust, gum, d, ds, dt, dst, dm,
                         shared_gate_up_proj=None, shared_down_proj=None, shared_output_gate=None,
                         swiglu_limit=None):
    _checks.require_tensor("x", x)
    _checks.require_dtype("x", x, _checks.ACTIVATION_DTYPES)
    _mx.check_weight("gate_up_proj", gu, gus, gut, gust, gum, x.dtype, x.device, split_rows=True)
    _mx.check_weight("down_proj", d, ds, dt, dst, dm, x.dtype, x.device)
    _checks.check_moe_args(x, router_weights, top_experts, _logical(x, gu, gum), _logical(x, d, dm),
                           shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit)
    if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (x, router_weights, gum, dm, shared_gate_up_proj, shared_down_proj, shared_output_gate)):
        for name, scale, data_t in (("gate_up_proj", gus, gut), ("down_proj", ds, dt)):
            if scale is not None and data_t is None:
                raise ValueError(
                    f"{name}: the backward needs the column-wise MXFP8 data (quantize with columnwise=True), or run "
                    "under torch.no_grad()"
                )
    num_experts = gu.shape[0]
    sorted_routes, expert_offsets, route_slots = torch.ops.mok.schedule(top_experts, num_experts)
    y, _, _ = _MoeFwdMxfp8Function.apply(
        x, router_weights, top_experts, sorted_routes, expert_offsets, route_slots, gu, gus, gut, gust, gum, d, ds,
        dt, dst, dm, shared_gate_up_proj, shared_down_proj, shared_output_gate,
        None if swiglu_limit is None else float(swiglu_limit),
    )
    return y


def call_moe_mxfp8(*args):
    """Run mok::moe_mxfp8 (or, under torch.func.grad / vjp, its composite body from Python)."""
    if _under_functorch_autodiff():
        return _moe_mxfp8_composite(*args)
    return torch.ops.mok.moe_mxfp8(*args)


_lib.impl("moe_mxfp8", _moe_mxfp8_composite, "CompositeImplicitAutograd")
_register_functional_rule("mok::moe_fwd_mxfp8", lambda *args: _mx_fwd_impl(True, *args))
_register_functional_rule("mok::moe_bwd_mxfp8", lambda *args: _mx_bwd_impl(True, *args))
