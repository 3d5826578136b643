"""Megatron-Core integration: the MoK backend for MCore MoE layers (shared/MEGATRON.md section 2).

    from mok_inductor.megatron import enable_mok_backend
    enable_mok_backend(model)   # every MoELayer runs router -> MoKMegakernel (shared + routed experts)

Modules:
    backend          MoKMegakernel(config, ep_group, routed_experts, shared_experts, num_local_experts),
                     the seed's backend: parameter aliases, config checks, checkpoint hooks.
    layer            enable_mok_backend / disable_mok_backend: the opt-in swap of a MoELayer's experts
                     path (megatron-core 0.16.1 has no `moe_megakernel_backend` flag).
    parameter_bridge main_grad_buffer, finish_weight_gradient, dummy_weight_gradient (DDP's
                     grad_added_to_main_grad protocol).
    route_adapter    routing_map_to_mok_inputs: dense probs / routing_map [T, E] -> [T, K] inputs.

megatron-core is an optional dependency, imported only inside this package.
"""

try:
    import megatron.core  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised by a test that hides megatron
    raise ImportError(
        "mok_inductor.megatron needs megatron-core (>= 0.16.1); install it with `pip install mok-inductor[megatron]`"
    ) from _exc

from .backend import MoKMegakernel, check_megatron_config, mok_config_from_backend_config
from .layer import disable_mok_backend, enable_mok_backend
from .parameter_bridge import dummy_weight_gradient, finish_weight_gradient, main_grad_buffer
from .route_adapter import routing_map_to_mok_inputs

__all__ = [
    "MoKMegakernel",
    "check_megatron_config",
    "mok_config_from_backend_config",
    "enable_mok_backend",
    "disable_mok_backend",
    "main_grad_buffer",
    "finish_weight_gradient",
    "dummy_weight_gradient",
    "routing_map_to_mok_inputs",
]
