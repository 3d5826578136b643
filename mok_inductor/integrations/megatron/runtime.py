"""The MoK functional runtime and its autograd bridge from Megatron-Core parameters (the seed's module).

Megatron-Core's `megakernel/mok/runtime.py` adapts MCore-owned parameters to MoK's functional ABI;
this module is that bridge over `mok_inductor.functional`, with the seed's names:

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

The `module` is a `mok_inductor.integrations.megatron.MoKMegakernel` (duck-typed here, so this file imports no
Megatron): it provides `mok_config`, `ep_group`, `num_local_experts`, `swiglu_limit`,
`shared_intermediate_size`, `fuse_wgrad_accumulation`, `autograd_parameters()`,
`routed_weight_views()`, `main_grad_arguments()`, `fresh_grad_arguments()` and
`finish_weight_gradients(parameters)`.

Weight gradients. With gradient-accumulation fusion (`module.fuse_wgrad_accumulation`), the op ADDS
them into each parameter's `main_grad` and backward returns hook-only dummies after setting
`grad_added_to_main_grad` (Megatron DDP's protocol: its grad hook then skips the add). Without it,
the op writes fresh parameter-shaped gradients (through the same views as the weights) and backward
returns those as ordinary gradients.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ...types import split_gate_up
from . import functional


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
    row offsets itself. A missing shared expert (None) gives None views."""
    if shared_fc1 is None:
        return None, None, routed_fc1, routed_fc1
    i = int(intermediate_size)
    if not isinstance(shared_fc1, torch.Tensor) or shared_fc1.dim() != 2 or shared_fc1.shape[0] != 2 * i:
        shape = list(shared_fc1.shape) if isinstance(shared_fc1, torch.Tensor) else type(shared_fc1).__name__
        raise ValueError(f"MOK shared FC1 shape mismatch: expected [2*{i}, H], got {shape}")
    return (*split_gate_up(shared_fc1), routed_fc1, routed_fc1)


def _gate_up_main_grad_arguments(main_grads, main_grad_storage_tables, intermediate_size: int):
    """Adapt canonical (shared_fc1, routed_fc1, shared_fc2, routed_fc2) main-grad buffers to MoK's
    six-buffer order (shared_gate, routed_gate, shared_up, routed_up, shared_down, routed_down), and
    storage tables (fc1_table, fc2_table) to (fc1_table, fc1_table, fc2_table)."""
    sh_fc1, r_fc1, sh_fc2, r_fc2 = main_grads
    if sh_fc1 is None:
        sh_gate = sh_up = None
    else:
        i = int(intermediate_size)
        if sh_fc1.dim() != 2 or sh_fc1.shape[0] != 2 * i:
            raise ValueError(f"MOK shared FC1 main_grad shape mismatch: expected [2*{i}, H], got {list(sh_fc1.shape)}")
        sh_gate, sh_up = split_gate_up(sh_fc1)
    tables = None
    if main_grad_storage_tables is not None:
        fc1_table, fc2_table = main_grad_storage_tables
        tables = (fc1_table, fc1_table, fc2_table)
    return (sh_gate, r_fc1, sh_up, r_fc1, sh_fc2, r_fc2), tables


class _MoKAutograd(torch.autograd.Function):
    """Autograd bridge from MCore parameters to MoK's functional API.

    Inputs: module, x [T, H], router_weights fp32 [T, K], top_experts int32 [T, K] (-1 = no route),
    shared_output_gate_weight [1, H] or None (fixed slot 4), then `module.autograd_parameters()`:
    the routed FC1 parameters, the routed FC2 parameters, shared FC1 [2Is, H] and shared FC2 [H, Is]
    (None when there is no shared expert).
    """

    @staticmethod
    def forward(ctx, module, x, router_weights, top_experts, shared_output_gate_weight, *parameters):
        expected = len(module.autograd_parameters())
        if len(parameters) != expected:
            raise RuntimeError(f"MOK autograd parameter count mismatch: expected {expected}, got {len(parameters)}")
        cfg = module.mok_config
        T, H = x.shape
        ws = functional.get_workspace(cfg, module.ep_group, device=x.device, num_local_tokens=T, hidden_size=H,
                                      topk=top_experts.shape[1])
        schedule = functional.build_schedule(ws, cfg, top_experts, num_local_experts=module.num_local_experts)
        fc1, fc2 = module.routed_weight_views()
        weights = _MoKWeightArguments.from_combined(parameters[-2], parameters[-1], fc1, fc2,
                                                    module.shared_intermediate_size)
        kwargs = {}
        if shared_output_gate_weight is not None:  # the kwarg only when gated: the ungated call is MoK's legacy one
            kwargs["shared_output_gate_weight"] = shared_output_gate_weight
        output, forward_context = functional.forward(cfg, ws, schedule, x, router_weights, *weights,
                                                     swiglu_limit=module.swiglu_limit, **kwargs)
        ctx.module = module
        ctx.workspace = ws
        ctx.schedule = schedule
        ctx.forward_context = forward_context
        ctx.gated = shared_output_gate_weight is not None
        ctx.save_for_backward(x, router_weights, shared_output_gate_weight, *parameters)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        module = ctx.module
        x, router_weights, gate_weight, *parameters = ctx.saved_tensors
        fc1, fc2 = module.routed_weight_views()
        weights = _MoKWeightArguments.from_combined(parameters[-2], parameters[-1], fc1, fc2,
                                                    module.shared_intermediate_size)
        fused = module.fuse_wgrad_accumulation
        if fused:
            # checks every main_grad (RuntimeError) before the op writes into any of them
            canonical, tables = module.main_grad_arguments()
            gate_main_grad = module.gate_main_grad() if gate_weight is not None else None
        else:
            canonical, tables, param_grads = module.fresh_grad_arguments()
            gate_main_grad = None
        main_grads, main_grad_tables = _gate_up_main_grad_arguments(canonical, tables,
                                                                    module.shared_intermediate_size)
        kwargs = {}
        if gate_weight is not None:
            kwargs["shared_output_gate_weight"] = gate_weight
            kwargs["shared_output_gate_main_grad"] = gate_main_grad
        results = functional.backward(
            module.mok_config, ctx.workspace, ctx.schedule, ctx.forward_context, grad_output.contiguous(), x,
            router_weights, *weights, swiglu_limit=module.swiglu_limit, main_grads=main_grads,
            main_grad_storage_tables=main_grad_tables, **kwargs,
        )
        d_x, d_router_weights = results[0], results[1]
        if fused:
            param_grads = module.finish_weight_gradients(parameters)
            d_gate = module.finish_weight_gradients((gate_weight,))[0] if gate_weight is not None else None
        else:
            d_gate = results[8]
        if d_router_weights.dtype != router_weights.dtype:
            d_router_weights = d_router_weights.to(router_weights.dtype)
        ctx.module = ctx.workspace = ctx.schedule = ctx.forward_context = None
        return (None, d_x, d_router_weights, None, d_gate, *param_grads)
