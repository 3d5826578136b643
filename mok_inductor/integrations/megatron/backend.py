"""MoKMegakernel: the MoK backend of an MCore MoE layer (the signature of MCore's megakernel backends).

    backend = MoKMegakernel(config, ep_group, routed_experts, shared_experts, num_local_experts)
    output = backend(hidden_states, probs, routing_map)      # [S, B, H] (or [T, H]) -> same shape

It runs the shared expert (with its optional sigmoid output gate) and the routed experts of one MoE
layer in one functional forward/backward, through `runtime._MoKAutograd`: mok-inductor's
`mok_inductor.functional`, or Mixture-of-Kittens' `mok.functional` when that is loaded (the bridge's
rule, `runtime.functional_module`). With an expert-parallel group of more than one rank
(`expert_model_parallel_size > 1`), that call is expert-parallel over the group (docs/distributed.md):
each rank routes its own tokens over all experts, holds its `num_local_experts`, and the tokens travel
to their experts' ranks and back through torch.distributed; the shared expert runs locally.

Config. The constructor reads the fields Megatron's MoK backend reads (`hidden_size`,
`moe_ffn_hidden_size`, `moe_router_topk`, `gradient_accumulation_fusion`, `activation_func_clamp_value`,
`moe_shared_expert_gate`, `fp8` / `fp8_recipe` / `fp8_param`, `moe_single_grouped_weight`,
`moe_megakernel_backend_config`, ...) and checks every other TransformerConfig setting it cannot honour
only when the config has it (`check_megatron_config`), so a full TransformerConfig and a namespace with
just those fields both work. `moe_megakernel_backend_config` holds MoKConfig fields, by name
(`{"fwd_num_comm_sms": 40}`) or `mok_`-prefixed (`{"mok_fwd_num_comm_sms": 40}`). `ep_group` is kept as
given; its size is read when it has one (a process group), else taken from `expert_model_parallel_size`.

Parameters are ALIASES: the backend registers the very Parameter objects of the Megatron modules
(routed `routed_fc1_weight{e}` / `routed_fc2_weight{e}` for per-expert layouts, `routed_fc1_weight` /
`routed_fc2_weight` for grouped ones, and `shared_fc1_weight`, `shared_fc2_weight`,
`shared_output_gate_weight`, the last None when ungated), so DDP's per-module hooks see them, nothing
is copied, and `named_parameters()` (which drops duplicates) still lists each weight once under its
canonical name. The checkpoint hooks emit no state-dict entries (`state_dict`, `sharded_state_dict`).
Loading a checkpoint and converting the module (`.to()`, `.cuda()`, `.bfloat16()`) drop every cached
view and set `is_first_microbatch`; a conversion also keeps the attributes Megatron and Transformer
Engine attach to the parameters (`allreduce`, `partition_dim`, `main_grad`, bound methods, ...) when it
replaces or swaps them (`torch.utils.swap_tensors`), and an alias follows its owner module only where
the owner installed a new Parameter object (`load_state_dict(assign=True)`, or a conversion under
`torch.__future__.set_overwrite_module_params_on_conversion(True)`).

Routed layouts (E local experts, I = moe_ffn_hidden_size, H = hidden_size):
    SequentialMLP   local_experts[e].linear_fc{1,2}.weight [2I, H] / [H, I]   -> split, used in place
    TE GroupedLinear linear_fc{1,2}.weight{e} [2I, H] / [H, I]                 -> split, used in place
    single grouped  linear_fc{1,2}.weight [E, 2I, H] / [E, H, I]               -> dense
    GroupedMLP      weight1 [H, E*2I] (viewed [E, H, 2I]), weight2 [E*I, H]    -> strided views
Weights: bf16, fp16 or fp32 (the shared expert's the routed experts' dtype), or Transformer Engine MXFP8
parameters (`fp8_recipe="mxfp8"`, `fp8_param=True`; split or single grouped, with a BF16 shared expert,
`weights.prepare_shared_expert_config`), whose views `weights` builds and refreshes once per optimizer
iteration (`is_first_microbatch`).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from ..._checks import FLOAT_DTYPES
from .parameter_bridge import finish_weight_gradient, main_grad_buffer
from .route_adapter import routing_map_to_mok_inputs
from .runtime import _MoKAutograd
from .weights import (
    _native_single_grouped_weight_view,
    _native_split_weight_view,
    mok_functional,
    split_main_grad_tables,
    uses_project_functional,
)

_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}


def mok_config_from_backend_config(entries: Optional[Mapping], functional=None):
    """The MoKConfig of `functional` (default: the functional the bridge calls now) from Megatron's
    `moe_megakernel_backend_config`: MoKConfig fields by name or `mok_`-prefixed
    ({"fwd_num_comm_sms": 40} or {"mok_fwd_num_comm_sms": 40}). ValueError ("Invalid MOK option in
    moe_megakernel_backend_config") for a key that is not a field, one given twice, or a value MoKConfig
    refuses."""
    make = (mok_functional() if functional is None else functional).MoKConfig
    if entries is None:
        entries = {}
    if not isinstance(entries, Mapping):
        raise TypeError(f"moe_megakernel_backend_config: expected a dict, got {type(entries).__name__}")
    kwargs, named = {}, {}
    for key, value in entries.items():
        if not isinstance(key, str):
            raise ValueError(f"Invalid MOK option in moe_megakernel_backend_config: {key!r} is not a field name")
        field = key[4:] if key.startswith("mok_") else key
        if field in kwargs:
            raise ValueError(f"Invalid MOK option in moe_megakernel_backend_config: {named[field]!r} and {key!r} "
                             f"both set MoKConfig.{field}")
        kwargs[field], named[field] = value, key
    fields = getattr(make, "__dataclass_fields__", None)
    if fields is not None:
        bad = sorted(named[f] for f in kwargs if f not in fields)
        if bad:
            raise ValueError(f"Invalid MOK option in moe_megakernel_backend_config: {bad}; MoKConfig fields (plain "
                             f"or mok_-prefixed): {sorted(fields)}")
    try:
        return make(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Invalid MOK option in moe_megakernel_backend_config: {e}") from e


def mxfp8_weights(config) -> bool:
    """Whether `config` asks for MXFP8 parameters (fp8 set, fp8_recipe "mxfp8", fp8_param)."""
    return bool(getattr(config, "fp8", None) is not None and getattr(config, "fp8_recipe", None) == "mxfp8"
                and getattr(config, "fp8_param", False))


def _scopes(value) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(getattr(s, "name", s)) for s in value]
    return [str(getattr(value, "name", value))]


_ABSENT = object()


def check_megatron_config(config) -> None:
    """Raise ValueError for TransformerConfig settings the MoK backend cannot honour; names the setting
    and what to change. A setting the config does not have is not checked (a namespace with only the
    fields the backend reads passes). Expert parallelism (expert_model_parallel_size > 1) is supported;
    FP8 execution of other layers (fp8 without fp8_param) is allowed, the experts then run at the
    parameters' precision."""

    def need(cond, msg):
        if not cond:
            raise ValueError(f"MoK backend: {msg}")

    def has(name):
        return getattr(config, name, _ABSENT) is not _ABSENT

    if has("num_moe_experts"):
        need(config.num_moe_experts, "num_moe_experts must be set (an MoE layer)")
    need(getattr(config, "gated_linear_unit", True) and getattr(config, "activation_func", F.silu) is F.silu,
         "requires SwiGLU experts: gated_linear_unit=True with activation_func=torch.nn.functional.silu")
    need(getattr(config, "moe_mlp_glu_interleave_size", None) is None,
         "requires non-interleaved routed FC1 weights (gate rows, then up rows); set moe_mlp_glu_interleave_size=None")
    need(getattr(config, "moe_shared_expert_glu_interleave_size", None) is None,
         "requires non-interleaved shared FC1 weights; set moe_shared_expert_glu_interleave_size=None")
    need(not getattr(config, "add_bias_linear", False), "expert biases are not supported; set add_bias_linear=False")
    need(getattr(config, "glu_linear_offset", 0.0) == 0.0, "glu_linear_offset must be 0.0 (MoK's SwiGLU has no offset)")
    need(not getattr(config, "moe_apply_probs_on_input", False),
         "moe_apply_probs_on_input is not supported (MoK applies the router weights after the experts)")
    need(not getattr(config, "moe_pad_expert_input_to_capacity", False),
         "moe_pad_expert_input_to_capacity is not supported (MoK takes at most moe_router_topk routes per token)")
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
    if getattr(config, "fp8", None) is not None and getattr(config, "fp8_param", False):
        need(getattr(config, "fp8_recipe", None) == "mxfp8",
             f"FP8 parameters (fp8_param=True) are supported as MXFP8 only (fp8_recipe='mxfp8'), got "
             f"fp8_recipe={getattr(config, 'fp8_recipe', None)!r}")
        need(getattr(config, "gradient_accumulation_fusion", False),
             "MXFP8 parameters need gradient_accumulation_fusion=True (the weight gradients go to main_grad)")
    need(getattr(config, "fp4", None) is None, "fp4 is not supported")
    need(getattr(config, "params_dtype", torch.float32) in FLOAT_DTYPES,
         f"params_dtype must be bfloat16, float16 or float32, got {getattr(config, 'params_dtype', None)}")
    need(getattr(config, "tensor_model_parallel_size", 1) == 1,
         "tensor parallelism is not supported (the shared expert would be sharded); set tensor_model_parallel_size=1")
    need((getattr(config, "expert_tensor_parallel_size", None) or 1) == 1,
         "expert tensor parallelism is not supported; set expert_tensor_parallel_size=1")
    need(not getattr(config, "sequence_parallel", False), "sequence_parallel is not supported")
    k = getattr(config, "moe_router_topk", None)
    num_experts = getattr(config, "num_moe_experts", None)
    need(isinstance(k, int) and k >= 1 and (num_experts is None or k <= num_experts),
         f"moe_router_topk must be in [1, num_moe_experts], got {k}")
    need(getattr(config, "hidden_size", None), "hidden_size must be set")
    need(getattr(config, "moe_ffn_hidden_size", None), "moe_ffn_hidden_size must be set")


def _group_size(group) -> Optional[int]:
    """The number of ranks of `group` (None: one), or None when `group` cannot say (an opaque handle)."""
    if group is None:
        return 1
    size = getattr(group, "size", None)
    return int(size()) if callable(size) else None


def _storage_key(params) -> tuple:
    """What identifies the storage the routed views were built over: a plain tensor's address, layout and
    dtype (a `param.data = ...` changes it), anything else's identity (wrapper subclasses such as TE's
    MXFP8 tensors have no one address; their views are refreshed every iteration instead)."""
    key = []
    for p in params:
        if type(p) in (torch.Tensor, torch.nn.Parameter):
            key.append((p.data_ptr(), p.dtype, p.device, tuple(p.shape), tuple(p.stride())))
        else:
            key.append(id(p))
    return tuple(key)


class MoKMegakernel(MegatronModule):
    """The MoK backend for one MCore MoE layer; see the module docstring.

    Args:
        config: the layer's TransformerConfig, or any object with the fields the backend reads
            (checked by `check_megatron_config`).
        ep_group: the expert-parallel process group, or None; kept as given. With more than one rank the
            layer is expert-parallel over it (mok_inductor.distributed): the router's probs /
            routing_map cover all num_local_experts * ep_size experts, this rank holds experts
            [rank * num_local_experts, (rank + 1) * num_local_experts), and tokens travel to their
            experts' ranks and back inside the functional forward / backward.
        routed_experts: the layer's experts module (SequentialMLP, GroupedMLP, TEGroupedMLP-like).
        shared_experts: the layer's SharedExpertMLP (with or without its gate), or None.
        num_local_experts: experts on this rank.
        mok_config: a MoKConfig of the functional in use, or a dict of its fields (plain or
            `mok_`-prefixed); by default `config.moe_megakernel_backend_config`.

    Members the bridge (`runtime._MoKAutograd`, also Megatron's own MoK runtime) uses: `mok_config`,
    `ep_group`, `num_local_experts`, `hidden_size`, `intermediate_size`, `shared_intermediate_size`,
    `topk`, `swiglu_limit`, `fuse_wgrad_accumulation`, `use_mxfp8_weights`,
    `native_single_grouped_weights`, `routed_fc1_parameters` / `routed_fc2_parameters` /
    `autograd_routed_parameters`, `quantized_routed_weights()`, `main_grad_arguments()`,
    `fresh_grad_arguments()`, `finish_routed_weight_gradients()`.
    """

    # Defaults for a module assembled without the constructor (Megatron's tests build one with __new__
    # and set only what they exercise): high-precision BF16 weights, no owner modules known.
    weight_dtype = torch.bfloat16
    use_mxfp8_weights = False
    native_single_grouped_weights = False
    is_first_microbatch = True
    shared_intermediate_size = None
    _layout = None
    _routed_fc1_parameter_names = None
    _routed_fc2_parameter_names = None
    _routed_weight_view_cache = None
    _routed_weight_view_key = None
    _split_main_grad_descriptor_cache = None
    _alias_owners = ()  # (alias name, owner module, the owner's parameter name)

    def __init__(self, config, ep_group, routed_experts, shared_experts, num_local_experts: int, *,
                 mok_config=None):
        super().__init__(config=config)
        check_megatron_config(config)
        if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts < 1:
            raise ValueError(f"num_local_experts: expected a positive int, got {num_local_experts}")
        if routed_experts is None:
            raise ValueError("routed_experts: the MoK backend needs the layer's routed experts module")
        ep_config = getattr(config, "expert_model_parallel_size", None) or 1
        measured = _group_size(ep_group)
        if measured is not None and measured != ep_config:
            raise ValueError(
                f"MoK backend: expert_model_parallel_size={ep_config}, but the expert-parallel group (ep_group) has "
                f"{measured} rank(s)"
            )
        self.ep_group = ep_group  # passed to functional.get_workspace as given
        self.ep_size = measured if measured is not None else ep_config
        num_experts = getattr(config, "num_moe_experts", None)
        if num_experts is not None and num_experts != num_local_experts * self.ep_size:
            raise ValueError(
                f"num_local_experts: {num_local_experts} local experts on each of {self.ep_size} expert-parallel "
                f"ranks do not make num_moe_experts={num_experts}"
            )
        self.num_local_experts = num_local_experts
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_ffn_hidden_size
        self.topk = config.moe_router_topk
        self.swiglu_limit = getattr(config, "activation_func_clamp_value", None)
        self.fuse_wgrad_accumulation = bool(getattr(config, "gradient_accumulation_fusion", False))
        self.use_mxfp8_weights = mxfp8_weights(config)
        if self.use_mxfp8_weights:
            from megatron.core import fp8_utils

            if getattr(fp8_utils, "te_post_all_gather_processing", None) is None:
                raise RuntimeError(
                    "MoK MXFP8 parameters need Transformer Engine with post_all_gather_processing support "
                    "(megatron.core.fp8_utils.te_post_all_gather_processing; Transformer Engine >= 2.10): MoK "
                    "skips TE's expert forward, which older releases rely on to refresh the column-wise weights "
                    "after the parameter all-gather"
                )
        if mok_config is None:
            mok_config = getattr(config, "moe_megakernel_backend_config", None)
        if mok_config is None or isinstance(mok_config, Mapping):
            self.mok_config = mok_config_from_backend_config(mok_config)
        else:
            make = mok_functional().MoKConfig
            if isinstance(make, type) and not isinstance(mok_config, make):
                raise TypeError(f"mok_config: expected a {make.__module__}.MoKConfig or a dict of its fields, "
                                f"got {type(mok_config).__name__}")
            self.mok_config = mok_config
        # MegatronModule.set_is_first_microbatch sets this once per optimizer iteration (with fp8): the
        # MXFP8 views are refreshed then, as TE refreshes its weight caches
        self.is_first_microbatch = True
        self._routed_weight_view_cache = None
        self._routed_weight_view_key = None
        self._split_main_grad_descriptor_cache = None
        self._alias_owners = ()
        self._layout = self._detect_layout(routed_experts)
        self.native_single_grouped_weights = self._layout == "single"
        self._check_layout_flags(config, routed_experts)
        self._register_routed_weights(routed_experts)
        gate = getattr(config, "moe_shared_expert_gate", None)
        if gate is None:
            gate = getattr(shared_experts, "use_shared_expert_gate", False)
        self._register_shared_weights(shared_experts, use_output_gate=bool(gate))

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

    def _check_layout_flags(self, config, experts) -> None:
        """The layout found must agree with what the config and the linear modules say about it."""
        single = self.native_single_grouped_weights
        flags = {}
        if getattr(config, "moe_single_grouped_weight", None) is not None:
            flags["config.moe_single_grouped_weight"] = bool(config.moe_single_grouped_weight)
        for lin in ("linear_fc1", "linear_fc2"):
            module = getattr(experts, lin, None)
            if module is not None and getattr(module, "single_grouped_weight", None) is not None:
                flags[f"routed_experts.{lin}.single_grouped_weight"] = bool(module.single_grouped_weight)
        wrong = sorted(name for name, value in flags.items() if value != single)
        if wrong:
            raise ValueError(
                f"MoK backend: the routed weights are {'single grouped' if single else 'not single grouped'} "
                f"({self._layout} layout), but {', '.join(wrong)} say{'s' if len(wrong) == 1 else ''} otherwise"
            )
        if self.use_mxfp8_weights and self._layout == "grouped_mlp":
            raise ValueError("MoK backend: MXFP8 parameters are supported for per-expert or single grouped routed "
                             "weights, not the legacy GroupedMLP")

    def _routed_owners(self, experts):
        """[(alias, owner module, the owner's parameter name)] for routed FC1, then FC2."""
        E = self.num_local_experts
        if self._layout == "sequential":
            if len(experts.local_experts) != E:
                raise ValueError(f"routed_experts: has {len(experts.local_experts)} local experts, expected {E}")
            for e, m in enumerate(experts.local_experts):
                for lin in ("linear_fc1", "linear_fc2"):
                    if getattr(getattr(m, lin), "bias", None) is not None:
                        raise ValueError(f"routed_experts.local_experts[{e}].{lin}: biases are not supported")
            return ([(f"routed_fc1_weight{e}", m.linear_fc1, "weight") for e, m in enumerate(experts.local_experts)],
                    [(f"routed_fc2_weight{e}", m.linear_fc2, "weight") for e, m in enumerate(experts.local_experts)])
        if self._layout == "te_grouped":
            return ([(f"routed_fc1_weight{e}", experts.linear_fc1, f"weight{e}") for e in range(E)],
                    [(f"routed_fc2_weight{e}", experts.linear_fc2, f"weight{e}") for e in range(E)])
        if self._layout == "grouped_mlp":
            return [("routed_fc1_weight", experts, "weight1")], [("routed_fc2_weight", experts, "weight2")]
        return ([("routed_fc1_weight", experts.linear_fc1, "weight")],
                [("routed_fc2_weight", experts.linear_fc2, "weight")])

    def _check_routed_shapes(self, fc1, fc2) -> None:
        E, I, H = self.num_local_experts, self.intermediate_size, self.hidden_size
        if self._layout in ("sequential", "te_grouped"):
            expect1, expect2 = [(2 * I, H)] * E, [(H, I)] * E
        elif self._layout == "grouped_mlp":
            expect1, expect2 = [(H, E * 2 * I)], [(E * I, H)]
        else:
            expect1, expect2 = [(E, 2 * I, H)], [(E, H, I)]
        for name, params, expect in (("routed FC1", fc1, expect1), ("routed FC2", fc2, expect2)):
            if len(params) != len(expect):
                raise ValueError(f"MoK backend: {name}: {len(params)} parameters, expected {len(expect)}")
            for j, (p, shape) in enumerate(zip(params, expect)):
                if not isinstance(p, torch.nn.Parameter):
                    raise ValueError(f"MoK backend: {name} weight {j} is a {type(p).__name__}, expected a Parameter")
                if tuple(p.shape) != shape:
                    raise ValueError(
                        f"MoK backend: {name} weight {j} has shape {list(p.shape)}, expected {list(shape)} "
                        f"(E={E}, I=moe_ffn_hidden_size={I}, H={H}; expert tensor parallelism is not supported)"
                    )
                if p.dtype not in FLOAT_DTYPES:
                    raise ValueError(f"MoK backend: {name} weight {j} has dtype {p.dtype}; expected bf16/fp16/fp32")
        dtypes = {p.dtype for p in (*fc1, *fc2)}
        if len(dtypes) != 1:
            raise ValueError(f"MoK backend: the routed weights mix dtypes {sorted(map(str, dtypes))}")

    def _register_routed_weights(self, experts) -> None:
        from megatron.core.fp8_utils import is_float8tensor

        owners1, owners2 = self._routed_owners(experts)
        fc1 = tuple(getattr(owner, attr) for _, owner, attr in owners1)
        fc2 = tuple(getattr(owner, attr) for _, owner, attr in owners2)
        self._check_routed_shapes(fc1, fc2)
        if not self.use_mxfp8_weights and any(is_float8tensor(p) for p in fc1 + fc2):
            raise ValueError("MoK backend: the routed weights are FP8 tensors, but the config does not ask for MXFP8 "
                             "parameters (fp8_recipe='mxfp8', fp8_param=True)")
        # the dtype every weight MoK reads in high precision has (MXFP8: the shared expert's, BF16)
        self.weight_dtype = torch.bfloat16 if self.use_mxfp8_weights else fc1[0].dtype
        for (name, _, _), p in zip(owners1 + owners2, fc1 + fc2):
            self.register_parameter(name, p)
        self._routed_fc1_parameter_names = tuple(name for name, _, _ in owners1)
        self._routed_fc2_parameter_names = tuple(name for name, _, _ in owners2)
        self._alias_owners = tuple(owners1 + owners2)

    @torch.no_grad()
    def _register_shared_weights(self, shared, *, use_output_gate: bool = False) -> None:
        """Check and alias the shared expert's FC1 [2Is, H], FC2 [H, Is] and (`use_output_gate`) output gate
        [1, H]: native (not FP8) contiguous Parameters of `weight_dtype` (BF16 unless the constructor found
        other routed weights). RuntimeError otherwise. `shared` None: no shared expert (all three None)."""
        from megatron.core.fp8_utils import is_float8tensor

        sh1 = sh2 = gate = None
        size = 0
        if shared is not None:
            for lin in ("linear_fc1", "linear_fc2"):
                if getattr(getattr(shared, lin), "bias", None) is not None:
                    raise RuntimeError(f"MoK backend: shared_experts.{lin} has a bias; biases are not supported")
            sh1, sh2 = shared.linear_fc1.weight, shared.linear_fc2.weight
            H, dtype = self.hidden_size, self.weight_dtype
            kind = _DTYPE_NAMES.get(dtype, str(dtype))
            if not isinstance(sh1, torch.nn.Parameter) or not isinstance(sh2, torch.nn.Parameter):
                raise RuntimeError("MoK shared FC1 and FC2 must be MCore-owned Parameters, got "
                                   f"{type(sh1).__name__} and {type(sh2).__name__}")
            if sh1.dim() != 2 or sh1.shape[1] != H or sh1.shape[0] % 2 or tuple(sh2.shape) != (H, sh1.shape[0] // 2):
                raise RuntimeError(
                    f"MoK requires native combined shared FC1/FC2 shapes [2*Is, {H}] and [{H}, Is], got "
                    f"{list(sh1.shape)} and {list(sh2.shape)}"
                )
            if is_float8tensor(sh1) or is_float8tensor(sh2) or sh1.dtype != dtype or sh2.dtype != dtype:
                raise RuntimeError(
                    f"MoK shared FC1 and FC2 must be constructed as native {kind} parameters (the routed weights' "
                    f"precision; FP8 shared weights are not supported, see weights.prepare_shared_expert_config), "
                    f"got {sh1.dtype} and {sh2.dtype}"
                )
            if not (sh1.is_contiguous() and sh2.is_contiguous()):
                raise RuntimeError("MoK shared FC1 and FC2 parameters must be contiguous")
            size = sh1.shape[0] // 2
            if use_output_gate:
                gate = getattr(shared, "gate_weight", None)
                if not (isinstance(gate, torch.nn.Parameter) and not is_float8tensor(gate) and gate.dtype == dtype
                        and tuple(gate.shape) == (1, H) and gate.is_contiguous()):
                    got = (f"{gate.dtype} {list(gate.shape)}, contiguous={gate.is_contiguous()}"
                           if isinstance(gate, torch.Tensor) else type(gate).__name__)
                    raise RuntimeError(
                        f"MoK shared output gate must be a native contiguous {kind} Parameter with shape [1, H] "
                        f"(H={H}), got {got}"
                    )
        # aliases, not owners: the shared_experts module keeps the checkpoint entries. The gate is
        # registered (None when ungated) so DDP's forward pre-hook also waits for its param gather.
        self.register_parameter("shared_fc1_weight", sh1)
        self.register_parameter("shared_fc2_weight", sh2)
        self.register_parameter("shared_output_gate_weight", gate)
        self.shared_intermediate_size = size
        owners = [o for o in self._alias_owners if not o[0].startswith("shared_")]
        if shared is not None:
            owners += [("shared_fc1_weight", shared.linear_fc1, "weight"),
                       ("shared_fc2_weight", shared.linear_fc2, "weight")]
            if gate is not None:
                owners.append(("shared_output_gate_weight", shared, "gate_weight"))
        self._alias_owners = tuple(owners)

    def _routed_names(self, which: int) -> tuple:
        names = getattr(self, f"_routed_fc{which}_parameter_names")
        return (f"routed_fc{which}_weight",) if names is None or self.native_single_grouped_weights else names

    @property
    def routed_fc1_parameters(self) -> tuple:
        """The MCore-owned routed FC1 parameters (E per-expert ones, or one grouped)."""
        return tuple(getattr(self, name) for name in self._routed_names(1))

    @property
    def routed_fc2_parameters(self) -> tuple:
        """The MCore-owned routed FC2 parameters."""
        return tuple(getattr(self, name) for name in self._routed_names(2))

    @property
    def autograd_routed_parameters(self) -> tuple:
        """The routed FC1 then FC2 parameters, as `_MoKAutograd` takes them."""
        return self.routed_fc1_parameters + self.routed_fc2_parameters

    def autograd_parameters(self) -> tuple:
        """The parameters `_MoKAutograd` takes after the gate slot: routed FC1s, routed FC2s, shared FC1,
        shared FC2 (None without a shared expert)."""
        return self.autograd_routed_parameters + (self.shared_fc1_weight, self.shared_fc2_weight)

    def _routed_kind(self) -> str:
        """"split" (per-expert parameters), "single" ([E, M, K] parameters) or "grouped_mlp"."""
        if self._layout is None:
            return "single" if self.native_single_grouped_weights else "split"
        return "split" if self._layout in ("sequential", "te_grouped") else self._layout

    def _grouped_mlp_views(self, fc1: torch.Tensor, fc2: torch.Tensor):
        """GroupedMLP's weight1 [H, E*2I] / weight2 [E*I, H] (or tensors shaped like them) as [E, 2I, H] /
        [E, H, I] strided views."""
        E, I, H = self.num_local_experts, self.intermediate_size, self.hidden_size
        return fc1.view(E, H, 2 * I).transpose(1, 2), fc2.view(E, I, H).transpose(1, 2)

    # ------------------------------------------------------------------ derived state

    def invalidate_caches(self) -> None:
        """Drop everything derived from the weights (routed views, split main-grad tables) and treat the
        next forward as the first of an iteration."""
        self._routed_weight_view_cache = None
        self._routed_weight_view_key = None
        self._split_main_grad_descriptor_cache = None
        self.is_first_microbatch = True

    @torch.no_grad()
    def quantized_routed_weights(self):
        """(fc1_view, fc2_view): the routed weights in the functional ABI's forms (`weights`), cached.

        Rebuilt when there is no cache or the parameters' storage changed (`param.data = ...`); MXFP8
        views are also refreshed in place on the first micro-batch of each iteration
        (`is_first_microbatch`), keeping their addresses. Clears `is_first_microbatch`."""
        fc1, fc2 = self.routed_fc1_parameters, self.routed_fc2_parameters
        key = _storage_key(fc1 + fc2)
        cache = self._routed_weight_view_cache
        fresh = cache is None or key != self._routed_weight_view_key
        if fresh or (self.use_mxfp8_weights and self.is_first_microbatch):
            old1, old2 = (None, None) if fresh else cache
            I, H, mx = self.intermediate_size, self.hidden_size, self.use_mxfp8_weights
            kind = self._routed_kind()
            if kind == "single":
                E = self.num_local_experts
                views = (_native_single_grouped_weight_view(fc1[0], num_experts=E, rows=2 * I, columns=H,
                                                            use_mxfp8=mx, cached_view=old1),
                         _native_single_grouped_weight_view(fc2[0], num_experts=E, rows=H, columns=I,
                                                            use_mxfp8=mx, cached_view=old2))
            elif kind == "grouped_mlp":
                views = self._grouped_mlp_views(fc1[0], fc2[0])
            else:
                views = (_native_split_weight_view(fc1, rows=2 * I, columns=H, use_mxfp8=mx, cached_view=old1),
                         _native_split_weight_view(fc2, rows=H, columns=I, use_mxfp8=mx, cached_view=old2))
            self._routed_weight_view_cache = views
            self._routed_weight_view_key = key
        self.is_first_microbatch = False
        return self._routed_weight_view_cache

    routed_weight_views = quantized_routed_weights  # the name the bridge used before

    # ------------------------------------------------------------------ gradient destinations

    def main_grad_arguments(self):
        """((shared_fc1.main_grad, routed FC1 main-grad, shared_fc2.main_grad, routed FC2 main-grad),
        None or (fc1_table, fc2_table)). Every main_grad is checked (`main_grad_buffer`, RuntimeError)
        before MoK writes into any. Split weights: the routed entries are expert 0's buffers and the tables
        cover all E (`weights.split_main_grad_tables`), cached while the buffers stay the same."""
        sh1 = main_grad_buffer(self.shared_fc1_weight) if self.shared_fc1_weight is not None else None
        sh2 = main_grad_buffer(self.shared_fc2_weight) if self.shared_fc2_weight is not None else None
        fc1 = tuple(main_grad_buffer(p) for p in self.routed_fc1_parameters)
        fc2 = tuple(main_grad_buffer(p) for p in self.routed_fc2_parameters)
        kind = self._routed_kind()
        if kind == "split":
            key = (uses_project_functional(),) + tuple((g.data_ptr(), g.dtype, tuple(g.shape)) for g in fc1 + fc2)
            cache = self._split_main_grad_descriptor_cache
            if cache is None or cache[0] != key:
                cache = self._split_main_grad_descriptor_cache = (key, split_main_grad_tables(fc1, fc2))
            return (sh1, fc1[0], sh2, fc2[0]), cache[1]
        v1, v2 = self._grouped_mlp_views(fc1[0], fc2[0]) if kind == "grouped_mlp" else (fc1[0], fc2[0])
        return (sh1, v1, sh2, v2), None

    def fresh_grad_arguments(self):
        """Like main_grad_arguments, over fresh zero gradients shaped like the parameters (for
        gradient_accumulation_fusion=False); also returns those gradients in autograd order."""
        grads = tuple(torch.zeros_like(p) if p is not None else None for p in self.autograd_parameters())
        n1, n = len(self.routed_fc1_parameters), len(self.autograd_routed_parameters)
        fc1, fc2, sh1, sh2 = grads[:n1], grads[n1:n], grads[n], grads[n + 1]
        kind = self._routed_kind()
        if kind == "split":
            return (sh1, fc1[0], sh2, fc2[0]), split_main_grad_tables(fc1, fc2), grads
        v1, v2 = self._grouped_mlp_views(fc1[0], fc2[0]) if kind == "grouped_mlp" else (fc1[0], fc2[0])
        return (sh1, v1, sh2, v2), None, grads

    def finish_routed_weight_gradients(self) -> tuple:
        """`parameter_bridge.finish_weight_gradient` of each routed parameter, in autograd order."""
        return tuple(finish_weight_gradient(p) for p in self.autograd_routed_parameters)

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
                                 *self.autograd_routed_parameters, self.shared_fc1_weight, self.shared_fc2_weight)
        return out.view(hidden_states.shape)

    # ------------------------------------------------------------------ checkpoint and conversion hooks

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Nothing: every parameter here is an alias of a canonical `experts.*` / `shared_experts.*` one."""
        return {}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        return  # aliases only: the canonical modules save them

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Nothing to load (no entries of its own). The owner modules load before this child (it is
        # registered after them); with load_state_dict(assign=True) they install new Parameter objects,
        # which the aliases follow.
        for alias, owner, attr in self._alias_owners:
            current = getattr(owner, attr, None)
            if isinstance(current, torch.nn.Parameter) and current is not self._parameters.get(alias):
                self._parameters[alias] = current
        self.invalidate_caches()

    def _apply(self, *args, **kwargs):
        """Module._apply (`.to()`, `.cuda()`, `.float()`), keeping what others attached to the parameters.

        Converting a parameter may swap its contents with a new tensor (`torch.utils.swap_tensors`, used
        for wrapper subclasses such as TE's MXFP8 tensors or when swap conversion is on), which exchanges
        the object's `__dict__`, or install a new Parameter object: Megatron's `allreduce`,
        `tensor_model_parallel`, `partition_dim`, DDP's `main_grad`, TE's `_high_precision_init_val` and
        its bound `get_high_precision_init_val` would be lost, and DDP would then reduce expert weights
        across the expert-parallel ranks. Each attribute the converted parameter lacks is restored (an
        attribute it has is left alone); a method bound to the old parameter is bound to the new one."""
        before = {name: (p, dict(p.__dict__)) for name, p in self._parameters.items() if p is not None}
        result = super()._apply(*args, **kwargs)
        # An owner converted before this module under overwrite-on-conversion holds a new Parameter
        # object: follow it (this module's own conversion made a second, unowned copy). Otherwise keep
        # what the conversion installed here.
        for alias, owner, attr in self._alias_owners:
            current = getattr(owner, attr, None)
            if (isinstance(current, torch.nn.Parameter) and alias in before and current is not before[alias][0]
                    and self._parameters.get(alias) is not None):
                self._parameters[alias] = current
        for name, (old, attrs) in before.items():
            new = self._parameters.get(name)
            if new is None:
                continue
            for key, value in attrs.items():
                if key in new.__dict__:
                    continue
                if isinstance(value, types.MethodType) and value.__self__ is old:
                    value = types.MethodType(value.__func__, new)
                setattr(new, key, value)
        self.invalidate_caches()
        return result

    def extra_repr(self) -> str:
        # getattr: a module assembled without the constructor has only some of these
        names = ("num_local_experts", "ep_size", "hidden_size", "intermediate_size", "shared_intermediate_size",
                 "topk", "use_mxfp8_weights", "swiglu_limit", "fuse_wgrad_accumulation")
        fields = [f"layout={self._layout or self._routed_kind()}"]
        fields += [f"{n}={getattr(self, n)}" for n in names if n in self.__dict__ or hasattr(type(self), n)]
        fields.append(f"gated={self._parameters.get('shared_output_gate_weight') is not None}")
        return ", ".join(fields)
