"""Megatron-Core integration.

    from mok_inductor.integrations.megatron import enable_mok_backend
    enable_mok_backend(model)   # every MoELayer runs router -> MoKMegakernel (shared + routed experts)

Modules:
    functional       the MoK functional ABI (MoKConfig, get_workspace, build_schedule, forward, backward);
                     also importable as `mok_inductor.functional`. Needs no megatron-core.
    runtime          the Megatron bridge (_MoKAutograd, _MoKWeightArguments, ...); also
                     `mok_inductor.runtime`. Needs no megatron-core.
    backend          MoKMegakernel(config, ep_group, routed_experts, shared_experts, num_local_experts):
                     parameter aliases, config checks, cached routed-weight views, checkpoint and
                     conversion hooks.
    weights          the routed-weight views the backend caches (high precision and Transformer Engine
                     MXFP8, split or single grouped; MoK's swizzled scale layout) and
                     prepare_shared_expert_config. Needs no megatron-core at import.
    layer            enable_mok_backend / disable_mok_backend: the opt-in swap of a MoELayer's experts path.
    parameter_bridge main_grad_buffer, finish_weight_gradient, dummy_weight_gradient (DDP's
                     grad_added_to_main_grad protocol).
    route_adapter    routing_map_to_mok_inputs: dense probs / routing_map [T, E] -> [T, K] inputs.

The names below are loaded on first use; those that need megatron-core (>= 0.16.1) raise an ImportError
saying so when it is missing.
"""

import importlib

_EXPORTS = {
    "MoKMegakernel": "backend",
    "check_megatron_config": "backend",
    "mok_config_from_backend_config": "backend",
    "prepare_shared_expert_config": "weights",
    "enable_mok_backend": "layer",
    "disable_mok_backend": "layer",
    "main_grad_buffer": "parameter_bridge",
    "finish_weight_gradient": "parameter_bridge",
    "dummy_weight_gradient": "parameter_bridge",
    "routing_map_to_mok_inputs": "route_adapter",
}
_NEEDS_MEGATRON = ("backend", "layer")


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module in _NEEDS_MEGATRON:
        try:
            import megatron.core  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"mok_inductor.integrations.megatron.{name} needs megatron-core (>= 0.16.1); install it with "
                "`pip install mok-inductor[megatron]`"
            ) from e
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = list(_EXPORTS)
