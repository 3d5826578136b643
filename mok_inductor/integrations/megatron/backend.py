"""MoKMegakernel: the MoK backend of an MCore MoE layer (the seed's `MegakernelBackend` signature).

    backend = MoKMegakernel(config, ep_group, routed_experts, shared_experts, num_local_experts)
    output = backend(hidden_states, probs, routing_map)      # [S, B, H] (or [T, H]) -> same shape

It runs the shared expert (with its optional sigmoid output gate) and the routed experts of one MoE
layer in one `mok_inductor.functional` forward/backward, through `mok_inductor.runtime._MoKAutograd`.
With an expert-parallel group of more than one rank (`expert_model_parallel_size > 1`), that
functional call is expert-parallel over the group (docs/distributed.md): each rank routes its own
tokens over all experts, holds its `num_local_experts`, and the tokens travel to their experts' ranks
and back through torch.distributed; the shared expert runs locally.

Parameters are ALIASES: the backend registers the very Parameter objects of the Megatron modules
(routed `routed_fc1_weight{e}` / `routed_fc2_weight{e}` for per-expert layouts, `routed_fc1_weight` /
`routed_fc2_weight` for grouped ones, and `shared_fc1_weight`, `shared_fc2_weight`,
`shared_output_gate_weight`), so DDP's per-module hooks see them, nothing is copied, and
`named_parameters()` (which drops duplicates) still lists each weight once under its canonical name.
The checkpoint hooks emit no state-dict entries (`state_dict`, `sharded_state_dict`); loading a
checkpoint or converting the module (`.to()`, `.cuda()`) re-binds the aliases and drops cached views.

Routed layouts (E local experts, I = moe_ffn_hidden_size, H = hidden_size):
    SequentialMLP   local_experts[e].linear_fc{1,2}.weight [2I, H] / [H, I]   -> split, used in place
    TE GroupedLinear linear_fc{1,2}.weight{e} [2I, H] / [H, I]                 -> split, used in place
    single grouped  linear_fc{1,2}.weight [E, 2I, H] / [E, H, I]               -> dense
    GroupedMLP      weight1 [H, E*2I] (viewed [E, H, 2I]), weight2 [E*I, H]    -> strided views
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from ..._checks import FLOAT_DTYPES
from . import functional
from .runtime import _MoKAutograd
from .parameter_bridge import finish_weight_gradient, main_grad_buffer
from .route_adapter import routing_map_to_mok_inputs

_MOK_CONFIG_FIELDS = tuple(f.name for f in functional.MoKConfig.__dataclass_fields__.values())


def mok_config_from_backend_config(entries: Optional[dict]) -> functional.MoKConfig:
    """A MoKConfig from Megatron's `moe_megakernel_backend_config` dict: `mok_`-prefixed MoKConfig
    fields (e.g. {"mok_fwd_num_comm_sms": 40}); any other key raises ValueError."""
    if entries is None:
        return functional.MoKConfig()
    if not isinstance(entries, dict):
        raise TypeError(f"moe_megakernel_backend_config: expected a dict, got {type(entries).__name__}")
    bad = sorted(k for k in entries if not (isinstance(k, str) and k.startswith("mok_")
                                            and k[4:] in _MOK_CONFIG_FIELDS))
    if bad:
        raise ValueError(
            f"Unsupported MOK entries in moe_megakernel_backend_config: {bad}; expected mok_-prefixed "
            f"MoKConfig fields: {['mok_' + f for f in _MOK_CONFIG_FIELDS]}"
        )
    return functional.MoKConfig(**{k[4:]: v for k, v in entries.items()})


def _scopes(value) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(getattr(s, "name", s)) for s in value]
    return [str(getattr(value, "name", value))]


def check_megatron_config(config) -> None:
    """Raise ValueError for TransformerConfig settings the MoK backend cannot honour; names the setting
    and what to change. Expert parallelism (expert_model_parallel_size > 1) is supported."""

    def need(cond, msg):
        if not cond:
            raise ValueError(f"MoK backend: {msg}")

    need(getattr(config, "num_moe_experts", None), "num_moe_experts must be set (an MoE layer)")
    need(getattr(config, "gated_linear_unit", False) and getattr(config, "activation_func", None) is F.silu,
         "requires SwiGLU experts: gated_linear_unit=True with activation_func=torch.nn.functional.silu")
    need(not getattr(config, "add_bias_linear", False), "expert biases are not supported; set add_bias_linear=False")
    need(getattr(config, "glu_linear_offset", 0.0) == 0.0, "glu_linear_offset must be 0.0 (MoK's SwiGLU has no offset)")
    need(not getattr(config, "moe_apply_probs_on_input", False),
         "moe_apply_probs_on_input is not supported (MoK applies the router weights after the experts)")
    need(not getattr(config, "moe_pad_expert_input_to_capacity", False),
         "moe_pad_expert_input_to_capacity is not supported")
    need(getattr(config, "moe_latent_size", None) is None, "moe_latent_size (latent MoE projections) is not supported")
    need(not getattr(config, "moe_shared_expert_overlap", False),
         "moe_shared_expert_overlap is not supported (MoK computes the shared expert in the same op)")
    need(not getattr(config, "overlap_moe_expert_parallel_comm", False),
         "overlap_moe_expert_parallel_comm is not supported")
    need(not getattr(config, "delay_wgrad_compute", False), "delay_wgrad_compute is not supported")
    need(not getattr(config, "log_moe_overload_factor", False), "log_moe_overload_factor is not supported")
    if getattr(config, "recompute_granularity", None) == "selective":
        bad = sorted(set(getattr(config, "recompute_modules", None) or []) & {"moe", "shared_experts", "moe_act"})
        need(not bad, f"selective recompute of {bad} is not supported with the MoK backend")
    partial = [s for s in _scopes(getattr(config, "cuda_graph_scope", None)) if s in ("moe_router", "moe_preprocess")]
    need(not partial, f"partial MoE CUDA graphs (cuda_graph_scope {partial}) are not supported")
    need(getattr(config, "fp8", None) is None,
         "fp8 (MXFP8 routed weights included) is not supported; train in bf16, fp16 or fp32")
    need(getattr(config, "fp4", None) is None, "fp4 is not supported")
    need(getattr(config, "params_dtype", torch.float32) in FLOAT_DTYPES,
         f"params_dtype must be bfloat16, float16 or float32, got {getattr(config, 'params_dtype', None)}")
    need(getattr(config, "tensor_model_parallel_size", 1) == 1,
         "tensor parallelism is not supported (the shared expert would be sharded); set tensor_model_parallel_size=1")
    need((getattr(config, "expert_tensor_parallel_size", None) or 1) == 1,
         "expert tensor parallelism is not supported; set expert_tensor_parallel_size=1")
    need(not getattr(config, "sequence_parallel", False), "sequence_parallel is not supported")
    k = getattr(config, "moe_router_topk", None)
    need(isinstance(k, int) and 1 <= k <= config.num_moe_experts,
         f"moe_router_topk must be in [1, num_moe_experts], got {k}")
    need(getattr(config, "moe_ffn_hidden_size", None), "moe_ffn_hidden_size must be set")


def _group_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    if hasattr(group, "size"):
        return group.size()
    return dist.get_world_size(group)


class MoKMegakernel(MegatronModule):
    """The MoK backend for one MCore MoE layer; see the module docstring.

    Args:
        config: the layer's TransformerConfig (checked by `check_megatron_config`).
        ep_group: the expert-parallel process group, or None. With more than one rank the layer is
            expert-parallel over it (mok_inductor.distributed): the router's probs / routing_map cover
            all num_local_experts * ep_size experts, this rank holds experts
            [rank * num_local_experts, (rank + 1) * num_local_experts), and tokens travel to their experts'
            ranks and back inside the functional forward / backward.
        routed_experts: the layer's experts module (SequentialMLP, GroupedMLP, TEGroupedMLP-like).
        shared_experts: the layer's SharedExpertMLP (with or without its gate), or None.
        num_local_experts: experts on this rank.
        mok_config: a functional.MoKConfig, or a dict of `mok_`-prefixed entries; by default read from
            `config.moe_megakernel_backend_config` when that field exists.
    """

    def __init__(self, config, ep_group, routed_experts, shared_experts, num_local_experts: int, *,
                 mok_config=None):
        super().__init__(config=config)
        check_megatron_config(config)
        if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts < 1:
            raise ValueError(f"num_local_experts: expected a positive int, got {num_local_experts}")
        if routed_experts is None:
            raise ValueError("routed_experts: the MoK backend needs the layer's routed experts module")
        self.ep_size = _group_size(ep_group)
        ep_config = getattr(config, "expert_model_parallel_size", 1) or 1
        if ep_config != self.ep_size:
            raise ValueError(
                f"MoK backend: expert_model_parallel_size={ep_config}, but the expert-parallel group (ep_group) has "
                f"{self.ep_size} rank(s)"
            )
        num_experts = getattr(config, "num_moe_experts", None)
        if num_experts is not None and num_experts != num_local_experts * self.ep_size:
            raise ValueError(
                f"num_local_experts: {num_local_experts} local experts on each of {self.ep_size} expert-parallel "
                f"ranks do not make num_moe_experts={num_experts}"
            )
        self.ep_group = ep_group if self.ep_size > 1 else None  # functional.get_workspace's group
        self.num_local_experts = num_local_experts
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_ffn_hidden_size
        self.topk = config.moe_router_topk
        self.swiglu_limit = getattr(config, "activation_func_clamp_value", None)
        self.fuse_wgrad_accumulation = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.use_mxfp8_weights = False  # a member of the megakernel backend interface; fp8 is refused above
        if mok_config is None:
            mok_config = getattr(config, "moe_megakernel_backend_config", None)
        if isinstance(mok_config, functional.MoKConfig):
            self.mok_config = mok_config
        else:
            self.mok_config = mok_config_from_backend_config(mok_config)
        self.is_first_microbatch = True
        # the source modules, held in a tuple so that they are not registered as children (no
        # duplicate state-dict entries); the aliases are re-read from them on load and _apply
        self._sources = (routed_experts, shared_experts)
        self._routed_weight_view_cache = None
        self._layout = self._detect_layout(routed_experts)
        self._bind_parameters()

    # ------------------------------------------------------------------ parameters

    def _detect_layout(self, experts) -> str:
        if hasattr(experts, "local_experts"):
            return "sequential"
        if hasattr(experts, "weight1") and hasattr(experts, "weight2"):
            return "grouped_mlp"
        fc1 = getattr(experts, "linear_fc1", None)
        if fc1 is not None and hasattr(fc1, "weight0"):
            return "te_grouped"
        if fc1 is not None and isinstance(getattr(fc1, "weight", None), torch.Tensor) and fc1.weight.dim() == 3:
            return "single"
        raise ValueError(
            f"routed_experts: unsupported experts module {type(experts).__name__}; expected SequentialMLP "
            "(local_experts), GroupedMLP (weight1/weight2), per-expert linear_fc1.weight{e} or a single grouped "
            "linear_fc1.weight [E, 2I, H]"
        )

    def _routed_parameters(self):
        experts = self._sources[0]
        E = self.num_local_experts
        if self._layout == "sequential":
            if len(experts.local_experts) != E:
                raise ValueError(f"routed_experts: has {len(experts.local_experts)} local experts, expected {E}")
            for e, m in enumerate(experts.local_experts):
                for lin in ("linear_fc1", "linear_fc2"):
                    if getattr(getattr(m, lin), "bias", None) is not None:
                        raise ValueError(f"routed_experts.local_experts[{e}].{lin}: biases are not supported")
            fc1 = tuple(m.linear_fc1.weight for m in experts.local_experts)
            fc2 = tuple(m.linear_fc2.weight for m in experts.local_experts)
        elif self._layout == "te_grouped":
            fc1 = tuple(getattr(experts.linear_fc1, f"weight{e}") for e in range(E))
            fc2 = tuple(getattr(experts.linear_fc2, f"weight{e}") for e in range(E))
        elif self._layout == "grouped_mlp":
            fc1, fc2 = (experts.weight1,), (experts.weight2,)
        else:
            fc1, fc2 = (experts.linear_fc1.weight,), (experts.linear_fc2.weight,)
        return fc1, fc2

    def _routed_views_of(self, fc1, fc2):
        """Map parameter-shaped tensors (the weights, their main_grads or fresh gradients) to the
        functional ABI's routed operands: per-expert tuples, or [E, 2I, H] / [E, H, I] views."""
        E, I, H = self.num_local_experts, self.intermediate_size, self.hidden_size
        if self._layout in ("sequential", "te_grouped"):
            return tuple(fc1), tuple(fc2)
        if self._layout == "grouped_mlp":
            return fc1[0].view(E, H, 2 * I).transpose(1, 2), fc2[0].view(E, I, H).transpose(1, 2)
        return fc1[0], fc2[0]

    def _check_routed_shapes(self, fc1, fc2) -> None:
        E, I, H = self.num_local_experts, self.intermediate_size, self.hidden_size
        if self._layout in ("sequential", "te_grouped"):
            expect1, expect2 = [(2 * I, H)] * E, [(H, I)] * E
        elif self._layout == "grouped_mlp":
            expect1, expect2 = [(H, E * 2 * I)], [(E * I, H)]
        else:
            expect1, expect2 = [(E, 2 * I, H)], [(E, H, I)]
        for name, params, expect in (("routed FC1", fc1, expect1), ("routed FC2", fc2, expect2)):
            for j, (p, shape) in enumerate(zip(params, expect)):
                if tuple(p.shape) != shape:
                    raise ValueError(
                        f"MoK backend: {name} weight {j} has shape {list(p.shape)}, expected {list(shape)} "
                        f"(E={E}, I=moe_ffn_hidden_size={I}, H={H}; expert tensor parallelism is not supported)"
                    )
                if p.dtype not in FLOAT_DTYPES:
                    raise ValueError(f"MoK backend: {name} weight {j} has dtype {p.dtype}; expected bf16/fp16/fp32")

    def _bind_parameters(self) -> None:
        fc1, fc2 = self._routed_parameters()
        self._check_routed_shapes(fc1, fc2)
        dtype = fc1[0].dtype
        if self._layout in ("sequential", "te_grouped"):
            names1 = tuple(f"routed_fc1_weight{e}" for e in range(len(fc1)))
            names2 = tuple(f"routed_fc2_weight{e}" for e in range(len(fc2)))
        else:
            names1, names2 = ("routed_fc1_weight",), ("routed_fc2_weight",)
        for name, p in zip(names1 + names2, fc1 + fc2):
            self.register_parameter(name, p)
        self._routed_fc1_parameter_names, self._routed_fc2_parameter_names = names1, names2
        self.routed_fc1_parameters, self.routed_fc2_parameters = tuple(fc1), tuple(fc2)
        self.autograd_routed_parameters = tuple(fc1) + tuple(fc2)

        shared = self._sources[1]
        sh1 = sh2 = gate = None
        self.shared_intermediate_size = 0
        if shared is not None:
            sh1, sh2 = shared.linear_fc1.weight, shared.linear_fc2.weight
            for lin in ("linear_fc1", "linear_fc2"):
                if getattr(getattr(shared, lin), "bias", None) is not None:
                    raise RuntimeError(f"MoK backend: shared_experts.{lin} has a bias; biases are not supported")
            H = self.hidden_size
            if sh1.dim() != 2 or sh1.shape[1] != H or sh1.shape[0] % 2 != 0:
                raise RuntimeError(f"MoK backend: shared FC1 weight must be [2*Is, {H}], got {list(sh1.shape)}")
            Is = sh1.shape[0] // 2
            if tuple(sh2.shape) != (H, Is):
                raise RuntimeError(f"MoK backend: shared FC2 weight must be [{H}, {Is}], got {list(sh2.shape)}")
            if sh1.dtype != dtype or sh2.dtype != dtype:
                raise RuntimeError(f"MoK backend: shared expert weights must have the routed weights' dtype {dtype}")
            if not (sh1.is_contiguous() and sh2.is_contiguous()):
                raise RuntimeError("MoK backend: shared expert weights must be contiguous")
            self.shared_intermediate_size = Is
            if getattr(shared, "use_shared_expert_gate", False):
                gate = shared.gate_weight
                if not (isinstance(gate, torch.nn.Parameter) and tuple(gate.shape) == (1, H) and gate.is_contiguous()
                        and gate.dtype == dtype):
                    raise RuntimeError(
                        f"MoK backend: the shared expert gate must be a native contiguous {dtype} Parameter with shape "
                        f"[1, {H}]"
                    )
        self.register_parameter("shared_fc1_weight", sh1)
        self.register_parameter("shared_fc2_weight", sh2)
        self.register_parameter("shared_output_gate_weight", gate)

    def autograd_parameters(self) -> tuple:
        """The parameters `_MoKAutograd` takes after the gate slot: routed FC1s, routed FC2s, shared FC1,
        shared FC2 (None without a shared expert)."""
        return self.autograd_routed_parameters + (self.shared_fc1_weight, self.shared_fc2_weight)

    def invalidate_caches(self) -> None:
        self._routed_weight_view_cache = None

    def routed_weight_views(self):
        """Cached (fc1_view, fc2_view) of the routed weights in the functional ABI's layout. The cache is
        keyed on the parameters' storage, so a `param.data = ...` (e.g. by a distributed optimizer)
        rebuilds it."""
        params = self.autograd_routed_parameters
        key = tuple((p.data_ptr(), p.dtype, p.device, tuple(p.shape), tuple(p.stride())) for p in params)
        cache = self._routed_weight_view_cache
        if cache is None or cache[0] != key:
            views = self._routed_views_of(self.routed_fc1_parameters, self.routed_fc2_parameters)
            cache = self._routed_weight_view_cache = (key, views)
        return cache[1]

    # ------------------------------------------------------------------ gradient destinations

    def _canonical(self, sh1, sh2, fc1, fc2):
        """(shared_fc1, routed_fc1, shared_fc2, routed_fc2) buffers and the split storage tables."""
        v1, v2 = self._routed_views_of(fc1, fc2)
        if self._layout in ("sequential", "te_grouped"):
            return (sh1, v1[0], sh2, v2[0]), (v1, v2)
        return (sh1, v1, sh2, v2), None

    def main_grad_arguments(self):
        """((shared_fc1.main_grad, routed FC1 main-grad, shared_fc2.main_grad, routed FC2 main-grad),
        None or (fc1_table, fc2_table)); every main_grad is checked before MoK writes into any."""
        sh1 = main_grad_buffer(self.shared_fc1_weight) if self.shared_fc1_weight is not None else None
        sh2 = main_grad_buffer(self.shared_fc2_weight) if self.shared_fc2_weight is not None else None
        fc1 = tuple(main_grad_buffer(p) for p in self.routed_fc1_parameters)
        fc2 = tuple(main_grad_buffer(p) for p in self.routed_fc2_parameters)
        return self._canonical(sh1, sh2, fc1, fc2)

    def gate_main_grad(self):
        return main_grad_buffer(self.shared_output_gate_weight)

    def fresh_grad_arguments(self):
        """Like main_grad_arguments, over fresh zero gradients shaped like the parameters (for
        gradient_accumulation_fusion=False); also returns those gradients in autograd order."""
        grads = tuple(torch.zeros_like(p) if p is not None else None for p in self.autograd_parameters())
        n1 = len(self.routed_fc1_parameters)
        n = len(self.autograd_routed_parameters)
        canonical, tables = self._canonical(grads[n], grads[n + 1], grads[:n1], grads[n1:n])
        return canonical, tables, grads

    def finish_weight_gradients(self, parameters):
        """`finish_weight_gradient(p)` for each parameter (None stays None)."""
        return tuple(finish_weight_gradient(p) if p is not None else None for p in parameters)

    def finish_routed_weight_gradients(self):
        return self.finish_weight_gradients(self.autograd_routed_parameters)

    # ------------------------------------------------------------------ forward

    def forward(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """hidden_states [..., H]; probs and routing_map [T, E] from the router (T = tokens of
        hidden_states). Returns the MoE output (shared + routed) in hidden_states' shape and dtype."""
        H = self.hidden_size
        if hidden_states.shape[-1] != H:
            raise ValueError(
                f"hidden_states: expected last dim {H} (hidden_size), got shape {list(hidden_states.shape)}"
            )
        x = hidden_states.reshape(-1, H).contiguous()  # MoK's x is a contiguous [T, H]
        T = x.shape[0]
        num_experts = self.num_local_experts * self.ep_size
        if probs.dim() != 2 or probs.shape[0] != T or probs.shape[1] != num_experts:
            raise ValueError(
                f"probs: expected shape [{T}, {num_experts}] (tokens of hidden_states, all experts of the "
                f"expert-parallel group), got {list(probs.shape)}"
            )
        router_weights, top_experts = routing_map_to_mok_inputs(probs, routing_map, self.topk)
        out = _MoKAutograd.apply(self, x, router_weights, top_experts, self.shared_output_gate_weight,
                                 *self.autograd_parameters())
        return out.view(hidden_states.shape)

    # ------------------------------------------------------------------ checkpoint and conversion hooks

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Nothing: every parameter here is an alias of a canonical `experts.*` / `shared_experts.*` one."""
        return {}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return  # aliases only: the canonical modules save them

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The canonical modules (loaded before this child) may have replaced their Parameters
        # (load_state_dict(assign=True)): re-bind the aliases and drop every cached view.
        self._bind_parameters()
        self.invalidate_caches()
        self.is_first_microbatch = True

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        # under torch.__future__.set_overwrite_module_params_on_conversion(True) the conversion made new
        # Parameter objects here and in the canonical modules: restore the alias identity
        self._bind_parameters()
        self.invalidate_caches()
        return result

    def extra_repr(self) -> str:
        return (f"layout={self._layout}, num_local_experts={self.num_local_experts}, ep_size={self.ep_size}, "
                f"hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, "
                f"shared_intermediate_size={self.shared_intermediate_size}, "
                f"topk={self.topk}, gated={self.shared_output_gate_weight is not None}, "
                f"swiglu_limit={self.swiglu_limit}, fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}")
