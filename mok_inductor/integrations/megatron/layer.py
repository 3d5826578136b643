"""Opt-in switch of MCore MoE layers to the MoK backend.

megatron-core 0.16.1 has no `moe_megakernel_backend` flag, so this module provides the switch:

    from mok_inductor.integrations.megatron import enable_mok_backend
    layers = enable_mok_backend(model)         # before wrapping the model in DDP

For every `MoELayer` in `model` it adds a child `megakernel_experts = MoKMegakernel(...)` built from
the layer's config, experts and shared experts, and replaces the layer's forward (an instance
attribute; the class is untouched) with: router -> `megakernel_experts(hidden_states, probs,
routing_map)` -> `(output, None)`. The token dispatcher and the separate shared-expert call are
skipped: MoK computes the shared expert (and its gate) and the routed experts in one op. Idempotent;
`disable_mok_backend(model)` restores the original path.
"""

from __future__ import annotations

import types
from typing import List, Optional

import torch

from .backend import MoKMegakernel


def _mok_moe_layer_forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                           padding_mask: Optional[torch.Tensor] = None):
    """MoELayer.forward with the MoK backend: route, then the fused shared + routed experts."""
    if intermediate_tensors is not None:
        raise NotImplementedError(
            "MoK backend: partial MoE execution (intermediate_tensors) is not supported; MoK runs the whole layer"
        )
    if padding_mask is not None:
        padding_mask = padding_mask.transpose(0, 1).bool()  # [B, S] -> [S, B], as MoELayer.forward does
    probs, routing_map = self.route(hidden_states, padding_mask)
    output = self.megakernel_experts(hidden_states, probs, routing_map)
    return output, None


def _moe_layer_class():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer


def enable_mok_backend(model: torch.nn.Module, *, mok_config=None, config=None) -> List[torch.nn.Module]:
    """Switch every MoELayer in `model` (which may be a MoELayer itself) to the MoK backend.

    Args:
        model: a module tree holding megatron.core MoELayer instances.
        mok_config: a MoKConfig of the functional in use, or a dict of its fields (plain or `mok_`-prefixed);
            by default each config's `moe_megakernel_backend_config`.
        config: a TransformerConfig to build the backends from instead of each layer's own (e.g. a copy
            with another gradient_accumulation_fusion).

    Returns the layers switched (already-switched layers included). Raises ValueError /
    NotImplementedError from the configuration checks before changing any layer.
    """
    moe_layer = _moe_layer_class()
    layers = [m for m in model.modules() if isinstance(m, moe_layer)]
    if not layers:
        raise ValueError("model: contains no megatron.core MoELayer to switch to the MoK backend")
    backends = []
    for layer in layers:  # build every backend first, so a bad config changes nothing
        if getattr(layer, "megakernel_experts", None) is not None:
            backends.append(None)
            continue
        if getattr(layer, "moe_layer_recompute", False) or getattr(layer, "shared_experts_recompute", False):
            raise ValueError("MoK backend: MoE / shared-expert recompute is not supported")
        shared = layer.shared_experts if getattr(layer, "use_shared_expert", False) else None
        backends.append(MoKMegakernel(config if config is not None else layer.config, layer.ep_group,
                                      layer.experts, shared, layer.num_local_experts, mok_config=mok_config))
    for layer, backend in zip(layers, backends):
        if backend is None:
            continue
        layer.megakernel_experts = backend
        layer.forward = types.MethodType(_mok_moe_layer_forward, layer)
    return layers


def disable_mok_backend(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Undo `enable_mok_backend`: drop each layer's `megakernel_experts` and its forward override."""
    moe_layer = _moe_layer_class()
    restored = []
    for layer in [m for m in model.modules() if isinstance(m, moe_layer)]:
        if getattr(layer, "megakernel_experts", None) is None:
            continue
        del layer.megakernel_experts
        layer.__dict__.pop("forward", None)
        restored.append(layer)
    return restored
