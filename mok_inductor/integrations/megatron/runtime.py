"""The MoK functional runtime and its autograd bridge from Megatron-Core parameters (the seed's module).

Megatron-Core's `megakernel/mok/runtime.py` adapts MCore-owned parameters to MoK's functional ABI;
this module is that bridge, with the seed's names:

    _MoKWeightArguments   non-owning references in MoK's (shared_gate, shared_up, shared_down,
                          routed_gate, routed_up, routed_down) order; `from_combined` splits only the
                          shared FC1 into zero-copy row views and keeps the routed views as given.
    _gate_up_weight_arguments     (shared_fc1, routed_fc1, I) -> (shared gate rows, shared up rows,
                          routed_fc1, routed_fc1): the routed payload is passed twice, so the op
                          applies the gate/up row offsets itself (zero-copy, storage metadata kept).
    _gate_up_main_grad_arguments  canonical (sh_fc1, r_fc1, sh_fc2, r_fc2) main-grads -> MoK's six
                          buffers; storage tables (fc1, fc2) -> (fc1, fc1, fc2).
    _MoKAutograd          forward(ctx, module, x, router_weights, top_experts,
                          shared_output_gate_weight, *parameters) -> output; backward returns a
                          gradient for every autograd input.
    functional_module / set_functional   which functional ABI module the bridge calls (below).

Which functional. `_MoKAutograd.forward` looks the functional module up when it runs, not when this
file is imported: a module given to `set_functional`, else `mok.functional` when it has been imported
(Mixture-of-Kittens itself, or a test's stand-in in `sys.modules`), else mok-inductor's own
(`mok_inductor.functional`). Importing `mok.functional` before the first forward therefore switches
the bridge to MoK; nothing here imports MoK by itself. The backward calls the module its forward used.

The `module` is a `mok_inductor.integrations.megatron.MoKMegakernel` (duck-typed here, so this file
imports no Megatron). It provides `mok_config`, `ep_group`, `num_local_experts`, `swiglu_limit`,
`autograd_routed_parameters` (the routed FC1 then FC2 parameters), `quantized_routed_weights()` (the
routed (fc1, fc2) operands; `routed_weight_views()` is used when it is absent), `main_grad_arguments()`,
and optionally `shared_intermediate_size` (else `intermediate_size`), `fuse_wgrad_accumulation`
(default True), `use_mxfp8_weights` and `native_single_grouped_weights` (default False), and, for
gradient_accumulation_fusion=False, `fresh_grad_arguments()`.

Routed operands. With MXFP8 single-grouped weights (`use_mxfp8_weights` and
`native_single_grouped_weights`) each routed operand is a (row_data, row_scale, col_data, col_scale[,
True]) tuple: the forward gets the row-wise `(data, scale)` pair of FC1 and FC2, the backward all of
FC1 (gate/up dgrad and wgrad) and FC2's column-wise part `[2:]`. Every other form (dense or strided
tensors, per-expert sequences, split descriptors) is passed unchanged to both.

The backward runs on the forward's weights: the forward keeps its routed operands
(`ctx.routed_weight_views`) and the shared weights, with every Parameter among them replaced by a
detached alias of the storage it read, so a `param.data = ...` between forward and backward does not
reach the backward. The output gate goes to MoK as its Parameter (what MoK's ABI expects) while that
still holds the forward's storage, else as the forward's alias.

Weight gradients. With gradient-accumulation fusion (`module.fuse_wgrad_accumulation`), the op ADDS
them into each parameter's `main_grad` (checked by `parameter_bridge.main_grad_buffer` before anything
is written) and backward returns `parameter_bridge.finish_weight_gradient`'s hook-only gradient (an
alias of the weight, which Megatron DDP's hook drops; None without DDP). Without it, the op writes
fresh parameter-shaped gradients (through the same views as the weights) and backward returns those as
ordinary gradients. A MoK version whose backward returns 8 results (before the shared output gate) is
fine for ungated layers on both paths.
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import torch

from ...types import split_gate_up
from . import functional as _project_functional
from .parameter_bridge import finish_weight_gradient, main_grad_buffer

_functional_override = None


def set_functional(module) -> None:
    """Make `_MoKAutograd` call `module` (any object with MoK's functional ABI: `get_workspace`,
    `build_schedule`, `forward`, `backward`) from the next forward on; None restores the default lookup."""
    global _functional_override
    _functional_override = module


def functional_module():
    """The functional ABI module a forward starting now calls: `set_functional`'s, else an imported
    `mok.functional`, else mok-inductor's own."""
    if _functional_override is not None:
        return _functional_override
    loaded = sys.modules.get("mok.functional")
    return loaded if loaded is not None else _project_functional


class _MoKWeightArguments(NamedTuple):
    """Non-owning references in MoK's forward/backward ABI order. Routed entries may be tensors,
    per-expert sequences or split descriptors; nothing is copied, registered or cached."""

    shared_gate: Optional[torch.Tensor]
    shared_up: Optional[torch.Tensor]
    shared_down: Optional[torch.Tensor]
    routed_gate: object
    routed_up: object
    routed_down: object

    @classmethod
    def from_combined(cls, shared_fc1, shared_fc2, routed_fc1, routed_fc2, intermediate_size):
        """Split only the shared FC1 ([2I, H] -> two row views) and keep the caller's routed views."""
        sh_gate, sh_up, r_gate, r_up = _gate_up_weight_arguments(shared_fc1, routed_fc1, intermediate_size)
        return cls(sh_gate, sh_up, shared_fc2, r_gate, r_up, routed_fc2)


def _gate_up_weight_arguments(shared_fc1, routed_fc1, intermediate_size: int):
    """Adapt combined FC1 weights to MoK's gate/up API: shared FC1 [2I, H] becomes two zero-copy row
    views; the routed FC1 payload is passed twice (gate and up alias), so the op applies the gate/up
    row offsets itself. A missing shared expert (None) gives None views. RuntimeError when the shared
    FC1 is not [2I, H]."""
    if shared_fc1 is None:
        return None, None, routed_fc1, routed_fc1
    i = int(intermediate_size)
    if not isinstance(shared_fc1, torch.Tensor) or shared_fc1.dim() != 2 or shared_fc1.shape[0] != 2 * i:
        shape = list(shared_fc1.shape) if isinstance(shared_fc1, torch.Tensor) else type(shared_fc1).__name__
        raise RuntimeError(
            f"MOK shared FC1 shape mismatch: expected [2*{i}, hidden_size] (gate rows then up rows), got {shape}"
        )
    return (*split_gate_up(shared_fc1), routed_fc1, routed_fc1)


def _gate_up_main_grad_arguments(main_grads, main_grad_storage_tables, intermediate_size: int):
    """Adapt canonical (shared_fc1, routed_fc1, shared_fc2, routed_fc2) main-grad buffers to MoK's
    six-buffer order (shared_gate, routed_gate, shared_up, routed_up, shared_down, routed_down), and
    storage tables (fc1_table, fc2_table) to (fc1_table, fc1_table, fc2_table). The shared FC1 buffer
    is split as `_gate_up_weight_arguments` splits the weight (same RuntimeError)."""
    sh_fc1, r_fc1, sh_fc2, r_fc2 = main_grads
    sh_gate, sh_up, r_gate, r_up = _gate_up_weight_arguments(sh_fc1, r_fc1, intermediate_size)
    tables = None
    if main_grad_storage_tables is not None:
        fc1_table, fc2_table = main_grad_storage_tables
        tables = (fc1_table, fc1_table, fc2_table)
    return (sh_gate, r_gate, sh_up, r_up, sh_fc2, r_fc2), tables


# ---------------------------------------------------------------------------------------------- operands


def _pinned(operand):
    """`operand` as the forward reads it, for the backward: Parameters become detached aliases of their
    current storage (a later `param.data = ...` rebinds the Parameter, not the alias); tuples, lists and
    NamedTuples are rebuilt around such aliases (returned as given when they hold no Parameter, so opaque
    operands keep their identity); anything else (a view, which keeps its storage anyway, a descriptor,
    a handle) is kept as given. Only Parameters are detached because only their storage gets rebound,
    and a detach costs about a microsecond per expert weight."""
    if isinstance(operand, torch.nn.Parameter):
        return operand.detach()
    if isinstance(operand, (tuple, list)):
        items = [_pinned(v) for v in operand]
        if all(a is b for a, b in zip(items, operand)):
            return operand
        if hasattr(operand, "_make"):  # a NamedTuple (SplitRoutedWeight, MXFP8Weight, ...)
            return type(operand)._make(items)
        return type(operand)(items)
    return operand


def _single_grouped_mxfp8(module) -> bool:
    return bool(getattr(module, "use_mxfp8_weights", False)) and bool(
        getattr(module, "native_single_grouped_weights", False))


def _mxfp8_tuple(name: str, view) -> tuple:
    """A single-grouped MXFP8 routed operand as (row_data, row_scale, col_data, col_scale[, True])."""
    from ... import mxfp8

    if isinstance(view, mxfp8.MXFP8Weight):  # mok-inductor's own quantized weight: its four payload fields
        return tuple(view[:4])
    if not isinstance(view, tuple) or len(view) not in (4, 5) or (len(view) == 5 and view[4] is not True):
        got = f"a {len(view)}-tuple" if isinstance(view, tuple) else type(view).__name__
        raise RuntimeError(
            f"MOK MXFP8 single-grouped {name}: expected the quantized tuple (row_data, row_scale, col_data, "
            f"col_scale) or (..., True) for Transformer Engine's native column-wise layout, got {got}"
        )
    return view


def _forward_routed_operands(module, fc1, fc2):
    if _single_grouped_mxfp8(module):  # the forward reads the row-wise (data, scale) pairs
        return _mxfp8_tuple("FC1", fc1)[:2], _mxfp8_tuple("FC2", fc2)[:2]
    return fc1, fc2


def _backward_routed_operands(module, fc1, fc2):
    if _single_grouped_mxfp8(module):  # all of FC1 (dgrad and wgrad), FC2's column-wise part (dgrad)
        return _mxfp8_tuple("FC1", fc1), _mxfp8_tuple("FC2", fc2)[2:]
    return fc1, fc2


def _shared_intermediate_size(module) -> int:
    size = getattr(module, "shared_intermediate_size", None)
    return module.intermediate_size if size is None else size


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


class _MoKAutograd(torch.autograd.Function):
    """Autograd bridge from MCore parameters to MoK's functional API.

    Inputs: module, x [T, H], router_weights fp32 [T, K], top_experts int32 [T, K] (-1 = no route),
    shared_output_gate_weight [1, H] or None (fixed slot 4), then the routed FC1 parameters, the routed
    FC2 parameters (`module.autograd_routed_parameters`), shared FC1 [2Is, H] and shared FC2 [H, Is]
    (None when there is no shared expert).
    """

    @staticmethod
    def forward(ctx, module, x, router_weights, top_experts, shared_output_gate_weight, *parameters):
        expected = len(module.autograd_routed_parameters) + 2
        if len(parameters) != expected:
            raise RuntimeError(
                f"MOK autograd parameter count mismatch: expected {expected} (routed FC1 and FC2 parameters, "
                f"shared FC1, shared FC2), got {len(parameters)}"
            )
        functional = functional_module()
        cfg = module.mok_config
        T, H = x.shape
        ws = functional.get_workspace(cfg, module.ep_group, device=x.device, num_local_tokens=T, hidden_size=H,
                                      topk=top_experts.shape[1])
        schedule = functional.build_schedule(ws, cfg, top_experts, num_local_experts=module.num_local_experts)
        prepare = getattr(module, "quantized_routed_weights", None) or module.routed_weight_views
        fc1, fc2 = _pinned(tuple(prepare()))
        shared_fc1, shared_fc2 = _pinned(parameters[-2]), _pinned(parameters[-1])
        fwd_fc1, fwd_fc2 = _forward_routed_operands(module, fc1, fc2)
        weights = _MoKWeightArguments.from_combined(shared_fc1, shared_fc2, fwd_fc1, fwd_fc2,
                                                    _shared_intermediate_size(module))
        kwargs = {}
        if shared_output_gate_weight is not None:  # the kwarg only when gated: the ungated call is MoK's legacy one
            kwargs["shared_output_gate_weight"] = shared_output_gate_weight
        output, forward_context = functional.forward(cfg, ws, schedule, x, router_weights, *weights,
                                                     swiglu_limit=module.swiglu_limit, **kwargs)
        ctx.module = module
        ctx.functional = functional
        ctx.workspace = ws
        ctx.schedule = schedule
        ctx.forward_context = forward_context
        ctx.routed_weight_views = (fc1, fc2)
        ctx.shared_weight_views = (shared_fc1, shared_fc2)
        ctx.gate_weight_view = _pinned(shared_output_gate_weight)
        ctx.save_for_backward(x, router_weights, shared_output_gate_weight, *parameters)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        module = ctx.module
        x, router_weights, gate_weight, *parameters = ctx.saved_tensors
        fused = getattr(module, "fuse_wgrad_accumulation", True)
        size = _shared_intermediate_size(module)
        # gradient destinations first: every main_grad is checked (RuntimeError) before the op writes into any
        if fused:
            canonical, tables = module.main_grad_arguments()
            gate_main_grad = main_grad_buffer(gate_weight) if gate_weight is not None else None
        else:
            canonical, tables, param_grads = module.fresh_grad_arguments()
            gate_main_grad = None
        main_grads, main_grad_tables = _gate_up_main_grad_arguments(canonical, tables, size)

        # the forward's operands (a hand-built ctx may carry only the routed views)
        fc1, fc2 = _backward_routed_operands(module, *ctx.routed_weight_views)
        shared = getattr(ctx, "shared_weight_views", None) or (parameters[-2], parameters[-1])
        weights = _MoKWeightArguments.from_combined(shared[0], shared[1], fc1, fc2, size)
        kwargs = {}
        if gate_weight is not None:
            kept = getattr(ctx, "gate_weight_view", None)
            # the Parameter itself while it still holds the forward's storage, else the forward's alias
            kwargs["shared_output_gate_weight"] = (
                gate_weight if kept is None or _same_storage(gate_weight, kept) else kept)
            kwargs["shared_output_gate_main_grad"] = gate_main_grad
        functional = getattr(ctx, "functional", None) or functional_module()
        results = functional.backward(
            module.mok_config, ctx.workspace, ctx.schedule, ctx.forward_context, grad_output.contiguous(), x,
            router_weights, *weights, swiglu_limit=module.swiglu_limit, main_grads=main_grads,
            main_grad_storage_tables=main_grad_tables, **kwargs,
        )
        d_x, d_router_weights = results[0], results[1]
        if fused:
            param_grads = tuple(finish_weight_gradient(p) if p is not None else None for p in parameters)
            d_gate = finish_weight_gradient(gate_weight) if gate_weight is not None else None
        elif gate_weight is None:
            d_gate = None  # MoK's 8-result backward (before the output gate) is fine here
        elif len(results) > 8:
            d_gate = results[8]
        else:
            raise RuntimeError(
                f"MOK functional.backward returned {len(results)} results, without the shared output gate's "
                "gradient (result 8): this functional predates the gate; use gradient_accumulation_fusion=True "
                "(the gate's gradient then goes into its main_grad) or a newer MoK"
            )
        if d_router_weights.dtype != router_weights.dtype:
            d_router_weights = d_router_weights.to(router_weights.dtype)
        ctx.module = ctx.functional = ctx.workspace = ctx.schedule = ctx.forward_context = None
        ctx.routed_weight_views = ctx.shared_weight_views = ctx.gate_weight_view = None
        return (None, d_x, d_router_weights, None, d_gate, *param_grads)
