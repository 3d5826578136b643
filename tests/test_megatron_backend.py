"""The MoK backend as Megatron's own MoK integration builds and drives it (CPU, megatron-core 0.16.1).

Megatron's backend factory passes a config that has only the fields its MoK backend reads (no
num_moe_experts, no SwiGLU fields), an opaque expert-parallel group and MCore modules whose linear layers
hold the expert weights (`linear_fc1.weight{e}` split, or `linear_fc1.weight` [E, 2I, H] single grouped).
These tests build the backend that way (`namespace_config`, `split_experts`, `single_experts`,
`shared_expert`) and check: the constructor's config handling, the shared-weight checks, the routed
parameter members and the cached routed-weight views (`quantized_routed_weights`), the main-grad
arguments and their split tables, conversion (`_apply`, swap_tensors included) and checkpoint hooks, a
forward/backward against the float64 oracle, and `weights` (MoK's MXFP8 scale layout, Transformer
Engine storage views, the per-expert and single grouped views for this project's functional and for a
stand-in of Mixture-of-Kittens').

Shapes: T=10, H=32, I=16, E=4, K=2 (MXFP8 views: M, K multiples of 128).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import types
import warnings
from types import SimpleNamespace

import pytest
import torch

import megatron.core  # noqa: F401  (a pinned test dependency: its absence must fail, not skip)
from megatron.core import fp8_utils

from mok_inductor import mxfp8
from mok_inductor.integrations.megatron import backend as mb
from mok_inductor.integrations.megatron import functional as mf
from mok_inductor.integrations.megatron import runtime as mr
from mok_inductor.integrations.megatron import weights as mw
from _helpers import TOLERANCE, ddp_like, rel_err
from oracle import oracle_moe

T, H, I, E, K = 10, 32, 16, 4, 2


# ---------------------------------------------------------------------------------------------- builders


def namespace_config(**overrides):
    """The fields Megatron's MoK backend reads, and nothing else."""
    fields = dict(
        gradient_accumulation_fusion=True, moe_mlp_glu_interleave_size=None, moe_shared_expert_glu_interleave_size=None,
        moe_pad_expert_input_to_capacity=False, moe_shared_expert_gate=True, hidden_size=H, moe_ffn_hidden_size=I,
        moe_shared_expert_intermediate_size=I, moe_router_topk=K, activation_func_clamp_value=None, fp8=None,
        fp8_recipe="mxfp8", fp8_param=False, moe_single_grouped_weight=False, moe_megakernel_backend_config=None,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _param(gen, *shape, dtype=torch.bfloat16, scale=None):
    scale = shape[-1] ** -0.5 if scale is None else scale
    return torch.nn.Parameter((torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype))


def split_experts(gen, dtype=torch.bfloat16, flag=True):
    """TEGroupedMLP's layout: linear_fc{1,2}.weight{e}."""
    experts = torch.nn.Module()
    experts.linear_fc1, experts.linear_fc2 = torch.nn.Module(), torch.nn.Module()
    for lin, shape in ((experts.linear_fc1, (2 * I, H)), (experts.linear_fc2, (H, I))):
        if flag:
            lin.single_grouped_weight = False
        for e in range(E):
            lin.register_parameter(f"weight{e}", _param(gen, *shape, dtype=dtype))
    return experts


def single_experts(gen, dtype=torch.bfloat16, flag=True):
    """Single grouped weights: linear_fc1.weight [E, 2I, H], linear_fc2.weight [E, H, I]."""
    experts = torch.nn.Module()
    experts.linear_fc1, experts.linear_fc2 = torch.nn.Module(), torch.nn.Module()
    for lin, shape in ((experts.linear_fc1, (E, 2 * I, H)), (experts.linear_fc2, (E, H, I))):
        if flag:
            lin.single_grouped_weight = True
        lin.register_parameter("weight", _param(gen, *shape, dtype=dtype))
    return experts


def shared_expert(gen, dtype=torch.bfloat16, gated=True, Is=I):
    shared = torch.nn.Module()
    shared.linear_fc1, shared.linear_fc2 = torch.nn.Module(), torch.nn.Module()
    shared.linear_fc1.register_parameter("weight", _param(gen, 2 * Is, H, dtype=dtype))
    shared.linear_fc2.register_parameter("weight", _param(gen, H, Is, dtype=dtype))
    shared.register_parameter("gate_weight", _param(gen, 1, H, dtype=dtype) if gated else None)
    return shared


def build(layout="split", *, dtype=torch.bfloat16, gated=True, seed=0, ep_group=None, config=None, Is=I, **overrides):
    """(backend, parent module holding experts / shared_experts / the backend, in Megatron's order)."""
    gen = torch.Generator().manual_seed(seed)
    experts = (split_experts if layout == "split" else single_experts)(gen, dtype)
    shared = shared_expert(gen, dtype, gated, Is=Is)
    if config is None:
        fields = dict(moe_single_grouped_weight=layout == "single", moe_shared_expert_gate=gated,
                      moe_shared_expert_intermediate_size=Is)
        fields.update(overrides)
        config = namespace_config(**fields)
    backend = mb.MoKMegakernel(config, ep_group, experts, shared, E)
    parent = torch.nn.Module()
    parent.experts, parent.shared_experts, parent.megakernel_experts = experts, shared, backend
    return backend, parent


def routed_owner_params(parent, layout):
    lin1, lin2 = parent.experts.linear_fc1, parent.experts.linear_fc2
    if layout == "single":
        return (lin1.weight,), (lin2.weight,)
    return tuple(getattr(lin1, f"weight{e}") for e in range(E)), tuple(getattr(lin2, f"weight{e}") for e in range(E))


@pytest.fixture
def mxfp8_available(monkeypatch):
    """Transformer Engine's post-all-gather processing, which MXFP8 parameters need, as present."""
    monkeypatch.setattr(fp8_utils, "te_post_all_gather_processing", object())


@pytest.fixture
def stand_in_mok(monkeypatch):
    """A stand-in of Mixture-of-Kittens in sys.modules (`mok`, `mok.functional`, `mok.ops`): its own MoKConfig
    and SplitRoutedWeight, and table builders that record what they were given."""
    calls = []

    @dataclasses.dataclass
    class MoKConfig:
        fwd_num_comm_sms: int = 40
        minibatch_size: int = 4096

    @dataclasses.dataclass(frozen=True)
    class SplitRoutedWeight:
        data: object
        storage_table: object
        scale: object = None
        scale_storage_table: object = None
        scale_tensors: object = None
        transposed_data: object = None
        transposed_scale: object = None
        transposed_storage_table: object = None
        transposed_scale_storage_table: object = None
        transposed_scale_tensors: object = None
        native_columnwise: bool = False

    def builder(name):
        def make(tensors):
            table = SimpleNamespace(kind=name, tensors=list(tensors))
            calls.append(table)
            return table
        return make

    package = types.ModuleType("mok")
    functional = types.ModuleType("mok.functional")
    functional.MoKConfig, functional.SplitRoutedWeight = MoKConfig, SplitRoutedWeight
    ops = types.ModuleType("mok.ops")
    for name in ("make_routed_weight_storage_table_bf16", "make_routed_weight_storage_table_mxfp8",
                 "make_routed_scale_storage_table", "make_routed_d_weight_storage_table"):
        setattr(ops, name, builder(name))
    package.functional, package.ops = functional, ops
    monkeypatch.setitem(sys.modules, "mok", package)
    monkeypatch.setitem(sys.modules, "mok.functional", functional)
    monkeypatch.setitem(sys.modules, "mok.ops", ops)
    return SimpleNamespace(functional=functional, ops=ops, calls=calls)


# ---------------------------------------------------------------------------------------------- constructor


@pytest.mark.parametrize("layout", ["split", "single"])
@pytest.mark.parametrize("gated", [True, False])
def test_builds_from_the_fields_megatron_passes(layout, gated):
    group = object()  # an opaque handle: kept, never sized
    backend, parent = build(layout, gated=gated, ep_group=group)
    fc1, fc2 = routed_owner_params(parent, layout)
    assert backend.ep_group is group and backend.ep_size == 1
    assert backend.native_single_grouped_weights is (layout == "single") and not backend.use_mxfp8_weights
    assert backend.mok_config == mf.MoKConfig()
    assert len(backend.routed_fc1_parameters) == len(fc1) and len(backend.routed_fc2_parameters) == len(fc2)
    assert all(a is b for a, b in zip(backend.routed_fc1_parameters + backend.routed_fc2_parameters, fc1 + fc2))
    assert backend.autograd_routed_parameters == backend.routed_fc1_parameters + backend.routed_fc2_parameters
    shared = parent.shared_experts
    assert backend.shared_fc1_weight is shared.linear_fc1.weight
    assert backend.shared_fc2_weight is shared.linear_fc2.weight
    own = dict(backend.named_parameters(recurse=False))
    if gated:
        assert own["shared_output_gate_weight"] is shared.gate_weight
    else:
        assert backend.shared_output_gate_weight is None and "shared_output_gate_weight" not in own
    # every weight once, under its owner's name; the backend saves nothing
    names = {n for n, _ in parent.named_parameters()}
    assert not any(n.startswith("megakernel_experts.") for n in names)
    assert not any(k.startswith("megakernel_experts.") for k in parent.state_dict())


def test_ep_size_of_an_opaque_group_comes_from_the_config():
    backend, _ = build(ep_group=object(), expert_model_parallel_size=2)
    assert backend.ep_size == 2
    sized = SimpleNamespace(size=lambda: 2)  # a group that can say its size must agree with the config
    with pytest.raises(ValueError, match="expert_model_parallel_size=1, but the expert-parallel group"):
        build(ep_group=sized)
    backend, _ = build(ep_group=sized, expert_model_parallel_size=2)
    assert backend.ep_group is sized and backend.ep_size == 2


@pytest.mark.parametrize("change,match", [
    (dict(num_moe_experts=None), "num_moe_experts must be set"),
    (dict(gated_linear_unit=False), "SwiGLU"),
    (dict(moe_mlp_glu_interleave_size=32), "non-interleaved routed FC1"),
    (dict(moe_shared_expert_glu_interleave_size=32), "non-interleaved shared FC1"),
    (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity"),
    (dict(moe_router_topk=0), "moe_router_topk"),
    (dict(num_moe_experts=E, moe_router_topk=E + 1), "moe_router_topk"),
    (dict(fp8="e4m3", fp8_param=True, fp8_recipe="delayed"), "MXFP8 only"),
    (dict(fp8="hybrid", fp8_param=True, gradient_accumulation_fusion=False), "gradient_accumulation_fusion=True"),
    (dict(moe_single_grouped_weight=True), "moe_single_grouped_weight"),
])
def test_config_settings_it_cannot_honour(change, match, mxfp8_available):
    with pytest.raises(ValueError, match=match):
        build(**change)


def test_layout_flags_of_the_linear_modules_must_agree():
    gen = torch.Generator().manual_seed(1)
    experts = split_experts(gen)
    experts.linear_fc2.single_grouped_weight = True
    with pytest.raises(ValueError, match="linear_fc2.single_grouped_weight"):
        mb.MoKMegakernel(namespace_config(), None, experts, shared_expert(gen), E)
    # modules without the flag (megatron-core 0.16.1's) are taken by their layout
    backend = mb.MoKMegakernel(namespace_config(moe_single_grouped_weight=None), None,
                               single_experts(gen, flag=False), shared_expert(gen), E)
    assert backend.native_single_grouped_weights


def test_fp8_execution_without_fp8_parameters_keeps_high_precision_weights():
    backend, _ = build(fp8="hybrid", fp8_recipe="delayed", fp8_param=False)
    assert not backend.use_mxfp8_weights and backend.weight_dtype == torch.bfloat16


@pytest.mark.parametrize("layout", ["split", "single"])
def test_mxfp8_parameters_are_accepted_with_bf16_shared_weights(layout, mxfp8_available):
    backend, parent = build(layout, fp8="hybrid", fp8_param=True)
    assert backend.use_mxfp8_weights and backend.weight_dtype == torch.bfloat16
    assert backend.shared_output_gate_weight is parent.shared_experts.gate_weight


def test_mxfp8_parameters_need_te_post_all_gather_processing(monkeypatch):
    monkeypatch.setattr(fp8_utils, "te_post_all_gather_processing", None)
    with pytest.raises(RuntimeError, match="post_all_gather_processing support"):
        build(fp8="hybrid", fp8_param=True)


def test_float8_routed_weights_need_the_mxfp8_config(monkeypatch):
    monkeypatch.setattr(fp8_utils, "is_float8tensor", lambda t: t.dim() == 2 and t.shape == (2 * I, H))
    with pytest.raises(ValueError, match="routed weights are FP8 tensors"):
        build()


def test_backend_config_takes_plain_and_prefixed_field_names():
    gen = torch.Generator().manual_seed(2)
    sms = 2 * int(torch.randint(1, 40, (), generator=gen))
    minibatch = 256 * int(torch.randint(1, 8, (), generator=gen))
    plain = mb.mok_config_from_backend_config({"fwd_num_comm_sms": sms, "minibatch_size": minibatch})
    prefixed = mb.mok_config_from_backend_config({"mok_fwd_num_comm_sms": sms, "mok_minibatch_size": minibatch})
    mixed = mb.mok_config_from_backend_config({"fwd_num_comm_sms": sms, "mok_minibatch_size": minibatch})
    assert plain == prefixed == mixed == mf.MoKConfig(fwd_num_comm_sms=sms, minibatch_size=minibatch)
    assert mb.mok_config_from_backend_config(None) == mf.MoKConfig()
    backend, _ = build(moe_megakernel_backend_config={"fwd_num_comm_sms": sms})
    assert backend.mok_config == mf.MoKConfig(fwd_num_comm_sms=sms)
    for bad in ({"not_a_field": 1}, {"fwd_num_comm_sms": 40, "mok_fwd_num_comm_sms": 40}, {"minibatch_size": 100},
                {"fwd_num_comm_sms": "40"}):
        with pytest.raises(ValueError, match="Invalid MOK option in moe_megakernel_backend_config"):
            mb.mok_config_from_backend_config(bad)
    with pytest.raises(TypeError, match="expected a dict"):
        mb.mok_config_from_backend_config([("fwd_num_comm_sms", 40)])


def test_backend_config_is_the_loaded_mok_functionals(stand_in_mok):
    backend, _ = build(moe_megakernel_backend_config={"mok_fwd_num_comm_sms": 12, "minibatch_size": 512})
    assert type(backend.mok_config) is stand_in_mok.functional.MoKConfig
    assert (backend.mok_config.fwd_num_comm_sms, backend.mok_config.minibatch_size) == (12, 512)
    with pytest.raises(ValueError, match="Invalid MOK option"):
        mb.mok_config_from_backend_config({"schedule_capacity_multiplier": 0.5})  # not a field of this MoKConfig
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(TypeError, match="mok_config"):  # this project's MoKConfig, while MoK's functional runs
        mb.MoKMegakernel(namespace_config(), None, split_experts(gen), shared_expert(gen), E, mok_config=mf.MoKConfig())


# ---------------------------------------------------------------------------------------------- shared weights


def _bare_backend(**attrs):
    """A backend assembled without its constructor, as Megatron's own tests assemble one."""
    module = mb.MoKMegakernel.__new__(mb.MoKMegakernel)
    torch.nn.Module.__init__(module)
    module.intermediate_size, module.hidden_size = I, H
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shared_weights_have_the_routed_weights_precision(dtype):
    backend, parent = build(dtype=dtype)
    assert backend.weight_dtype == dtype and backend.shared_fc1_weight.dtype == dtype
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    name = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16"}[dtype]
    with pytest.raises(RuntimeError, match=f"native {name} parameters"):
        backend._register_shared_weights(shared_expert(torch.Generator().manual_seed(3), other))


def test_register_shared_weights_of_an_assembled_backend_wants_bf16():
    module = _bare_backend()
    gen = torch.Generator().manual_seed(4)
    with pytest.raises(RuntimeError, match="native BF16"):
        module._register_shared_weights(shared_expert(gen, torch.float32, gated=False))
    Is = I + 8  # the shared expert's size may differ from the routed experts'
    shared = shared_expert(gen, gated=True, Is=Is)
    module._register_shared_weights(shared, use_output_gate=True)
    assert module.shared_fc1_weight is shared.linear_fc1.weight and module.shared_fc2_weight is shared.linear_fc2.weight
    assert module.shared_output_gate_weight is shared.gate_weight and module.shared_intermediate_size == Is
    module._register_shared_weights(shared, use_output_gate=False)  # the gate is not used, and not aliased
    assert module.shared_output_gate_weight is None
    module._register_shared_weights(None)
    assert module.shared_fc1_weight is None and module.shared_intermediate_size == 0


@pytest.mark.parametrize("bad", ["missing", "not_parameter", "dtype", "shape", "noncontiguous"])
def test_shared_output_gate_must_be_a_native_bf16_parameter(bad):
    backend, parent = build()
    shared = parent.shared_experts
    gate = {
        "missing": None,
        "not_parameter": torch.zeros(1, H, dtype=torch.bfloat16),
        "dtype": torch.nn.Parameter(torch.zeros(1, H)),
        "shape": torch.nn.Parameter(torch.zeros(H, dtype=torch.bfloat16)),
        "noncontiguous": torch.nn.Parameter(torch.zeros(1, 2 * H, dtype=torch.bfloat16)[:, ::2]),
    }[bad]
    del shared.gate_weight
    shared.gate_weight = gate
    with pytest.raises(RuntimeError, match=r"native contiguous BF16 Parameter with shape \[1, H\]"):
        backend._register_shared_weights(shared, use_output_gate=True)


@pytest.mark.parametrize("bad,match", [
    ("not_parameter", "MCore-owned Parameters"),
    ("shape", "shapes"),
    ("noncontiguous", "contiguous"),
    ("float8", "native BF16"),
])
def test_shared_fc_checks(bad, match, monkeypatch):
    backend, parent = build()
    shared = parent.shared_experts
    w = shared.linear_fc2.weight
    if bad == "not_parameter":
        del shared.linear_fc2.weight
        shared.linear_fc2.weight = w.detach().clone()
    elif bad == "shape":
        shared.linear_fc2.weight = torch.nn.Parameter(w.detach()[:, :-1].clone())
    elif bad == "noncontiguous":
        shared.linear_fc2.weight = torch.nn.Parameter(torch.empty(I, H, dtype=w.dtype).t())
    else:
        monkeypatch.setattr(fp8_utils, "is_float8tensor", lambda t: t is shared.linear_fc1.weight)
    with pytest.raises(RuntimeError, match=match):
        backend._register_shared_weights(shared)


# ---------------------------------------------------------------------------------------------- routed views


def test_routed_parameter_members_follow_the_registered_aliases():
    backend, _ = build()
    replacement = torch.nn.Parameter(torch.randn(2 * I, H, dtype=torch.bfloat16))
    backend.register_parameter("routed_fc1_weight2", replacement)
    assert backend.routed_fc1_parameters[2] is replacement
    assert backend.autograd_routed_parameters[2] is replacement
    assert len(backend.autograd_parameters()) == 2 * E + 2


@pytest.mark.parametrize("layout", ["split", "single"])
def test_routed_views_are_the_parameters_and_cached(layout):
    backend, parent = build(layout)
    fc1, fc2 = routed_owner_params(parent, layout)
    views = backend.quantized_routed_weights()
    if layout == "split":
        assert all(v is p for v, p in zip(views[0], fc1)) and all(v is p for v, p in zip(views[1], fc2))
    else:
        assert views[0] is fc1[0] and views[1] is fc2[0]
    assert not backend.is_first_microbatch
    backend.is_first_microbatch = True  # high precision: nothing to refresh per iteration
    assert backend.quantized_routed_weights() is views and backend.routed_weight_views() is views
    # new storage behind a parameter (e.g. an optimizer's `param.data = ...`): rebuilt
    with torch.no_grad():
        fc2[-1].data = fc2[-1].data + 1
    rebuilt = backend.quantized_routed_weights()
    assert rebuilt is not views
    assert (rebuilt[1][-1] if layout == "split" else rebuilt[1]).data_ptr() == fc2[-1].data_ptr()
    backend.invalidate_caches()
    assert backend.quantized_routed_weights() is not rebuilt


@pytest.mark.parametrize("layout", ["split", "single"])
def test_mxfp8_views_refresh_in_place_once_per_iteration(layout, mxfp8_available, monkeypatch):
    backend, parent = build(layout, fp8="hybrid", fp8_param=True)
    built = []

    def fake_view(*args, use_mxfp8, cached_view=None, **kwargs):
        assert use_mxfp8
        built.append(cached_view)
        return cached_view if cached_view is not None else object()

    name = "_native_single_grouped_weight_view" if layout == "single" else "_native_split_weight_view"
    monkeypatch.setattr(mb, name, fake_view)
    first = backend.quantized_routed_weights()
    assert built == [None, None]
    assert backend.quantized_routed_weights() is first and len(built) == 2  # later micro-batches reuse
    backend.is_first_microbatch = True  # the next optimizer iteration: refreshed into the same views
    again = backend.quantized_routed_weights()
    assert built[2:] == [first[0], first[1]] and again == first
    fc1, _ = routed_owner_params(parent, layout)
    fc1[0].data = fc1[0].data.clone()  # other storage: a new view, not a refresh of the old one
    backend.quantized_routed_weights()
    assert built[4:] == [None, None]


# ---------------------------------------------------------------------------------------------- main grads


def _give_main_grads(module, dtype=torch.float32):
    for p in module.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=dtype)


def test_split_main_grad_tables_are_cached_per_buffer_set():
    backend, parent = build()
    _give_main_grads(parent)
    fc1, fc2 = routed_owner_params(parent, "split")
    canonical, tables = backend.main_grad_arguments()
    shared = parent.shared_experts
    assert canonical[0] is shared.linear_fc1.weight.main_grad and canonical[2] is shared.linear_fc2.weight.main_grad
    assert canonical[1] is fc1[0].main_grad and canonical[3] is fc2[0].main_grad
    assert [t is p.main_grad for t, p in zip(tables[0], fc1)] == [True] * E
    assert [t is p.main_grad for t, p in zip(tables[1], fc2)] == [True] * E
    assert backend.main_grad_arguments()[1] is tables
    fc2[1].main_grad = torch.zeros_like(fc2[1].main_grad)  # a new buffer: new tables
    _, again = backend.main_grad_arguments()
    assert again is not tables and again[1][1] is fc2[1].main_grad
    backend.invalidate_caches()
    assert backend._split_main_grad_descriptor_cache is None


def test_split_main_grad_tables_come_from_mok_ops_when_mok_runs(stand_in_mok):
    backend, parent = build()
    _give_main_grads(parent)
    fc1, fc2 = routed_owner_params(parent, "split")
    _, tables = backend.main_grad_arguments()
    assert [t.kind for t in tables] == ["make_routed_d_weight_storage_table"] * 2
    assert all(a is p.main_grad for a, p in zip(tables[0].tensors, fc1))
    assert all(a is p.main_grad for a, p in zip(tables[1].tensors, fc2))


def test_single_grouped_main_grads_have_no_tables():
    backend, parent = build("single")
    _give_main_grads(parent, torch.bfloat16)
    fc1, fc2 = routed_owner_params(parent, "single")
    canonical, tables = backend.main_grad_arguments()
    assert tables is None and canonical[1] is fc1[0].main_grad and canonical[3] is fc2[0].main_grad


def test_main_grads_are_checked_before_any_is_handed_out():
    backend, parent = build()
    _give_main_grads(parent)
    del backend.routed_fc2_weight3.main_grad
    with pytest.raises(RuntimeError, match="main_grad"):
        backend.main_grad_arguments()


def test_finish_routed_weight_gradients_marks_each_routed_parameter():
    backend, parent = build()
    for p in parent.parameters():
        p.grad_added_to_main_grad = False
    grads = backend.finish_routed_weight_gradients()
    assert len(grads) == 2 * E
    assert all(p.grad_added_to_main_grad for p in backend.autograd_routed_parameters)
    assert not backend.shared_fc1_weight.grad_added_to_main_grad


# ---------------------------------------------------------------------------------------------- conversion


def _stamp(module, routed_ids):
    """Megatron / TE style attributes on every alias; returns {name: (param, attributes)}."""

    def high_precision(param):
        return param._high_precision_init_val

    foreign = SimpleNamespace(value=object())
    stamped = {}
    for name, p in module.named_parameters(recurse=False):
        p.allreduce = id(p) not in routed_ids
        p.partition_dim, p.marker = 0, object()
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p._high_precision_init_val = torch.randn(p.shape)
        p.get_high_precision_init_val = types.MethodType(high_precision, p)
        p.foreign = types.MethodType(lambda owner: owner.value, foreign)
        stamped[name] = (p, dict(p.__dict__))
    return stamped


def _check_stamps(module, stamped, same_objects=True):
    for name, (old, attrs) in stamped.items():
        new = module.get_parameter(name)
        assert (new is old) == same_objects, name
        for key, value in attrs.items():
            got = getattr(new, key)
            if key == "get_high_precision_init_val":
                assert got.__self__ is new and got.__func__ is value.__func__
                assert got() is attrs["_high_precision_init_val"]
            else:
                assert got is value, (name, key)


@pytest.mark.parametrize("layout", ["split", "single"])
def test_swap_conversion_keeps_what_megatron_attached(layout, monkeypatch):
    backend, _ = build(layout)
    routed_ids = {id(p) for p in backend.autograd_routed_parameters}
    stamped = _stamp(backend, routed_ids)
    backend.quantized_routed_weights()
    backend._split_main_grad_descriptor_cache = ((), ())
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    swaps = []
    real_swap = torch.utils.swap_tensors
    monkeypatch.setattr(torch.utils, "swap_tensors", lambda a, b: (swaps.append(id(a)), real_swap(a, b)))
    assert backend.float() is backend
    assert sorted(swaps) == sorted(id(p) for p, _ in stamped.values())  # the swap path really ran
    assert all(p.dtype == torch.float32 for p in backend.parameters())
    _check_stamps(backend, stamped)
    assert backend._routed_weight_view_cache is None and backend._split_main_grad_descriptor_cache is None
    assert backend.is_first_microbatch


def test_conversion_leaves_attributes_the_converted_parameter_has(monkeypatch):
    backend, _ = build()
    stamped = _stamp(backend, set())
    replacements = {}
    for name, (p, _) in stamped.items():
        q = torch.nn.Parameter(p.detach().double())
        q.allreduce, q.marker = "converted", None  # its own values, a falsy one included
        replacements[name] = q

    def convert_by_replacing(self, fn, recurse=True):
        for name in list(self._parameters):
            if self._parameters[name] is not None:
                self._parameters[name] = replacements[name]
        return self

    monkeypatch.setattr(torch.nn.Module, "_apply", convert_by_replacing)
    backend._apply(lambda t: t.double())
    for name, (old, attrs) in stamped.items():
        new = backend.get_parameter(name)
        assert new is replacements[name]
        assert new.allreduce == "converted" and new.marker is None
        assert new.partition_dim == 0 and new.main_grad is attrs["main_grad"]
        assert new.get_high_precision_init_val.__self__ is new


def test_overwrite_conversion_follows_owners_and_keeps_attributes(monkeypatch):
    backend, parent = build()
    stamped = _stamp(backend, {id(p) for p in backend.autograd_routed_parameters})
    monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
    parent.double()  # owners first (new Parameter objects), then the backend
    fc1, fc2 = routed_owner_params(parent, "split")
    shared = parent.shared_experts
    assert all(a is b for a, b in zip(backend.routed_fc1_parameters, fc1))
    assert all(a is b for a, b in zip(backend.routed_fc2_parameters, fc2))
    assert backend.shared_fc1_weight is shared.linear_fc1.weight
    assert backend.shared_output_gate_weight is shared.gate_weight
    assert all(p.dtype == torch.float64 for p in parent.parameters())
    _check_stamps(backend, stamped, same_objects=False)


def test_converting_the_backend_alone_keeps_its_converted_parameters(monkeypatch):
    backend, parent = build()
    old = dict(backend.named_parameters(recurse=False))
    monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
    backend._apply(lambda t: t.float(), recurse=False)
    for name, p in backend.named_parameters(recurse=False):
        assert p is not old[name] and p.dtype == torch.float32  # not re-bound to the owner's unconverted one
    assert parent.experts.linear_fc1.weight0 is old["routed_fc1_weight0"]


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("layout", ["split", "single"])
def test_load_state_dict_reaches_the_owners_and_drops_derived_state(layout):
    backend, parent = build(layout)
    keys = set(parent.state_dict())
    assert backend.sharded_state_dict(prefix="megakernel_experts.") == {}
    gen = torch.Generator().manual_seed(7)
    fresh = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in parent.state_dict().items()}
    backend.quantized_routed_weights()
    parent.load_state_dict(fresh)  # strict: the backend adds no keys and expects none
    assert set(parent.state_dict()) == keys
    assert backend._routed_weight_view_cache is None and backend.is_first_microbatch
    fc1, _ = routed_owner_params(parent, layout)
    assert torch.equal(backend.routed_fc1_parameters[0], fc1[0]) and backend.routed_fc1_parameters[0] is fc1[0]
    again = {k: v + 1 for k, v in fresh.items()}
    parent.load_state_dict(again, assign=True)  # new Parameter objects in the owners: the aliases follow
    fc1, fc2 = routed_owner_params(parent, layout)
    assert all(a is b for a, b in zip(backend.autograd_routed_parameters, fc1 + fc2))
    assert backend.shared_output_gate_weight is parent.shared_experts.gate_weight
    assert torch.equal(backend.shared_fc2_weight, again["shared_experts.linear_fc2.weight"])


def test_load_state_dict_of_an_assembled_backend():
    gen = torch.Generator().manual_seed(8)
    experts, shared = split_experts(gen), shared_expert(gen)
    module = _bare_backend(num_local_experts=E, _routed_fc1_parameter_names=("routed_fc1_weight0",),
                           _routed_fc2_parameter_names=("routed_fc2_weight0",))
    module.register_parameter("routed_fc1_weight0", experts.linear_fc1.weight0)
    module.register_parameter("routed_fc2_weight0", experts.linear_fc2.weight0)
    module._register_shared_weights(shared, use_output_gate=True)
    module._routed_weight_view_cache, module._split_main_grad_descriptor_cache = object(), object()
    module.is_first_microbatch = False
    parent = torch.nn.Module()
    parent.experts, parent.shared_experts, parent.megakernel_experts = experts, shared, module
    state = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in parent.state_dict().items()}
    parent.load_state_dict(state)
    assert torch.equal(module.routed_fc1_weight0, state["experts.linear_fc1.weight0"])
    assert module._routed_weight_view_cache is None and module._split_main_grad_descriptor_cache is None
    assert module.is_first_microbatch


# ---------------------------------------------------------------------------------------------- numerics


def _routing(gen):
    logits = torch.randn(T, E, generator=gen)
    top = logits.topk(K, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(logits, dim=1) * routing_map
    return probs, routing_map


@pytest.mark.parametrize("layout", ["split", "single"])
@pytest.mark.parametrize("fused", [True, False])
def test_forward_and_backward_on_a_megatron_built_backend(layout, fused):
    backend, parent = build(layout, dtype=torch.float32, seed=11, gradient_accumulation_fusion=fused,
                            activation_func_clamp_value=3.0)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(T, 1, H, generator=gen).requires_grad_()
    dy = torch.randn(T, 1, H, generator=gen)
    probs, routing_map = _routing(gen)
    if fused:
        ddp_like(parent.parameters())
    out = backend(x, probs, routing_map)
    out.backward(dy)

    fc1, fc2 = routed_owner_params(parent, layout)
    w1 = (torch.stack(fc1) if layout == "split" else fc1[0]).detach().double().requires_grad_()
    w2 = (torch.stack(fc2) if layout == "split" else fc2[0]).detach().double().requires_grad_()
    sh = parent.shared_experts
    s1, s2, g = (t.detach().double().requires_grad_() for t in (sh.linear_fc1.weight, sh.linear_fc2.weight,
                                                                 sh.gate_weight))
    x64 = x.detach().double().reshape(T, H).requires_grad_()
    rw, te = mb.routing_map_to_mok_inputs(probs, routing_map, K)
    ref = oracle_moe(x64, rw.double(), te.long(), w1, w2, s1, s2, g, 3.0)
    ref.backward(dy.double().reshape(T, H))
    tol = TOLERANCE[torch.float32]
    assert rel_err(out.reshape(T, H), ref) <= tol
    assert rel_err(x.grad.reshape(T, H), x64.grad) <= tol

    def grad(p):
        return p.main_grad if fused else p.grad

    got1 = torch.stack([grad(p) for p in fc1]) if layout == "split" else grad(fc1[0])
    got2 = torch.stack([grad(p) for p in fc2]) if layout == "split" else grad(fc2[0])
    for name, got, want in (("fc1", got1, w1.grad), ("fc2", got2, w2.grad),
                            ("shared fc1", grad(sh.linear_fc1.weight), s1.grad),
                            ("shared fc2", grad(sh.linear_fc2.weight), s2.grad),
                            ("gate", grad(sh.gate_weight), g.grad)):
        assert rel_err(got, want) <= tol, name
    if fused:
        assert all(p.grad is None for p in parent.parameters())


# ---------------------------------------------------------------------------------------------- weights: scales


def _logical(swizzled, rows, columns):
    """Swizzled scales back in the logical [E, rows, columns/32] layout (`mxfp8.unswizzle_scale`)."""
    E_ = swizzled.shape[0] * 128 // rows
    return mxfp8.unswizzle_scale(swizzled, (E_, rows, columns // 32))


def _logical_scales(gen, E_, M, Kc):
    return torch.randint(0, 256, (E_, M, Kc // 32), generator=gen, dtype=torch.uint8)


@pytest.mark.parametrize("E_,M,Kc", [(1, 128, 128), (2, 256, 384)])
def test_swizzled_scale_layout(E_, M, Kc):
    gen = torch.Generator().manual_seed(E_ * M + Kc)
    logical = _logical_scales(gen, E_, M, Kc)
    swz = mw._swizzle_mxfp8_scale(logical, rows=M, columns=Kc)
    assert swz.shape == (E_ * M // 128, Kc // 128, 32, 16) and swz.is_contiguous()
    for _ in range(64):  # the layout formula, element by element at random positions
        e, mb_, kb, lane, g, c = (int(torch.randint(0, n, (), generator=gen))
                                  for n in (E_, M // 128, Kc // 128, 32, 4, 4))
        assert swz[e * M // 128 + mb_, kb, lane, 4 * g + c] == logical[e, 128 * mb_ + 32 * g + lane, 4 * kb + c]
    assert torch.equal(_logical(swz, M, Kc), logical)
    out = torch.empty_like(swz)
    address = out.data_ptr()
    assert mw._swizzle_mxfp8_scale(logical, rows=M, columns=Kc, out=out) is out and out.data_ptr() == address
    assert torch.equal(out, swz)


def test_swizzled_scale_errors():
    logical = torch.zeros(1, 128, 4, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="divisible by 128"):
        mw._swizzle_mxfp8_scale(logical, rows=96, columns=128)
    with pytest.raises(RuntimeError, match=r"logical uint8 MXFP8 scales shaped \[E, M, K/32\]"):
        mw._swizzle_mxfp8_scale(logical.float(), rows=128, columns=128)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        mw._swizzle_mxfp8_scale(logical, rows=128, columns=256)
    for out in (torch.empty(1, 1, 32, 16), torch.empty(1, 1, 16, 32, dtype=torch.uint8),
                torch.empty(1, 1, 16, 32, dtype=torch.uint8).transpose(2, 3)):
        with pytest.raises(RuntimeError, match="scale refresh"):
            mw._swizzle_mxfp8_scale(logical, rows=128, columns=128, out=out)


def test_parameter_storage_attr_reads_public_private_and_data_fields():
    a, b = torch.ones(1), torch.zeros(1)
    assert mw._parameter_storage_attr(SimpleNamespace(rowwise_data=a), "rowwise_data") is a
    assert mw._parameter_storage_attr(SimpleNamespace(_rowwise_data=b), "rowwise_data") is b
    assert mw._parameter_storage_attr(SimpleNamespace(data=SimpleNamespace(_rowwise_data=b)), "rowwise_data") is b
    assert mw._parameter_storage_attr(SimpleNamespace(rowwise_data=None, _rowwise_data=a), "rowwise_data") is a
    assert mw._parameter_storage_attr(SimpleNamespace(data=SimpleNamespace()), "_rowwise_scale_inv") is None
    assert mw._parameter_storage_attr(torch.nn.Parameter(torch.zeros(2)), "rowwise_data") is None


def test_storage_view_is_zero_copy():
    raw = torch.randint(0, 256, (6, 8), dtype=torch.uint8)
    view = mw._storage_view(raw, (2, 3, 8), dtype=torch.float8_e4m3fn, name="test")
    assert view.dtype == torch.float8_e4m3fn and view.shape == (2, 3, 8) and view.data_ptr() == raw.data_ptr()
    with pytest.raises(RuntimeError, match="elements"):
        mw._storage_view(raw, (2, 3, 7), dtype=torch.uint8, name="test")
    with pytest.raises(RuntimeError, match="contiguous"):
        mw._storage_view(raw.t(), (48,), dtype=torch.uint8, name="test")
    with pytest.raises(RuntimeError, match="dtype"):
        mw._storage_view(raw.float(), (48,), dtype=torch.bfloat16, name="test")


def test_single_grouped_scale_view_needs_expert_major_packing(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    backing = torch.randint(0, 256, (3, 4, 2), generator=gen, dtype=torch.uint8)
    members = [SimpleNamespace(_rowwise_scale_inv=backing[e]) for e in range(3)]
    monkeypatch.setattr(fp8_utils, "get_grouped_quantized_members", lambda param: members, raising=False)
    view = mw._single_grouped_mxfp8_scale_view(object(), "_rowwise_scale_inv", (3, 4, 2), name="t")
    assert view.data_ptr() == backing.data_ptr() and torch.equal(view, backing)
    members.reverse()  # every expert present, but not in expert order
    with pytest.raises(RuntimeError, match="not packed expert-major"):
        mw._single_grouped_mxfp8_scale_view(object(), "_rowwise_scale_inv", (3, 4, 2), name="t")
    with pytest.raises(RuntimeError, match="expected 4 grouped members"):
        mw._single_grouped_mxfp8_scale_view(object(), "_rowwise_scale_inv", (4, 4, 2), name="t")
    monkeypatch.delattr(fp8_utils, "get_grouped_quantized_members")
    with pytest.raises(RuntimeError, match="get_grouped_quantized_members"):
        mw._single_grouped_mxfp8_scale_view(object(), "_rowwise_scale_inv", (3, 4, 2), name="t")


# ---------------------------------------------------------------------------------------------- weights: views


class _TEGroupedMXFP8:
    """What the view builder reads of a TE single grouped MXFP8 parameter: payloads and per-expert scale
    members packed in one storage."""

    def __init__(self, gen, E_, M, Kc):
        self.shape = torch.Size((E_, M, Kc))
        self.rowwise_data = torch.randint(0, 256, (E_, M, Kc), generator=gen, dtype=torch.uint8)
        self._columnwise_data = torch.randint(0, 256, (E_, M, Kc), generator=gen, dtype=torch.uint8)
        self.row_scales = torch.randint(0, 256, (E_, M, Kc // 32), generator=gen, dtype=torch.uint8)
        self.col_scales = torch.randint(0, 256, (E_, M // 32, Kc), generator=gen, dtype=torch.uint8)
        self.members = [SimpleNamespace(_rowwise_scale_inv=self.row_scales[e], _columnwise_scale_inv=self.col_scales[e])
                        for e in range(E_)]


def test_single_grouped_mxfp8_view_and_refresh(monkeypatch):
    gen = torch.Generator().manual_seed(10)
    E_, M, Kc = 2, 256, 128
    w = _TEGroupedMXFP8(gen, E_, M, Kc)
    monkeypatch.setattr(fp8_utils, "is_grouped_mxfp8tensor", lambda p: p is w, raising=False)
    monkeypatch.setattr(fp8_utils, "get_grouped_quantized_members", lambda p: w.members, raising=False)
    view = mw._native_single_grouped_weight_view(w, num_experts=E_, rows=M, columns=Kc, use_mxfp8=True)
    row, row_scale, col, col_scale, native = view
    assert native is True and row.dtype == col.dtype == torch.float8_e4m3fn
    assert row.data_ptr() == w.rowwise_data.data_ptr() and col.data_ptr() == w._columnwise_data.data_ptr()
    assert torch.equal(_logical(row_scale, M, Kc), w.row_scales)
    # column-wise: MoK's dgrad scales of the [K, M] operand, from TE's [E, M/32, K]
    assert torch.equal(_logical(col_scale, Kc, M), w.col_scales.transpose(1, 2))
    w.row_scales.copy_(torch.randint(0, 256, w.row_scales.shape, generator=gen, dtype=torch.uint8))
    w.col_scales.copy_(torch.randint(0, 256, w.col_scales.shape, generator=gen, dtype=torch.uint8))
    addresses = (row_scale.data_ptr(), col_scale.data_ptr())
    again = mw._native_single_grouped_weight_view(w, num_experts=E_, rows=M, columns=Kc, use_mxfp8=True,
                                                  cached_view=view)
    assert again[1] is row_scale and again[3] is col_scale and (row_scale.data_ptr(), col_scale.data_ptr()) == addresses
    assert torch.equal(_logical(row_scale, M, Kc), w.row_scales)
    assert torch.equal(_logical(col_scale, Kc, M), w.col_scales.transpose(1, 2))
    monkeypatch.setattr(fp8_utils, "is_grouped_mxfp8tensor", lambda p: False)
    with pytest.raises(RuntimeError, match="grouped MXFP8 parameters"):
        mw._native_single_grouped_weight_view(w, num_experts=E_, rows=M, columns=Kc, use_mxfp8=True)


def test_single_grouped_high_precision_view():
    gen = torch.Generator().manual_seed(13)
    p = _param(gen, E, 2 * I, H)
    assert mw._native_single_grouped_weight_view(p, num_experts=E, rows=2 * I, columns=H, use_mxfp8=False) is p
    with pytest.raises(RuntimeError, match="single-grouped weight shape"):
        mw._native_single_grouped_weight_view(p, num_experts=E, rows=I, columns=H, use_mxfp8=False)
    backing = torch.randn(E * 2 * I * H, generator=gen).to(torch.bfloat16)  # a TE GroupedTensor's payload
    wrapped = SimpleNamespace(shape=p.shape, dtype=torch.bfloat16, rowwise_data=backing)
    view = mw._native_single_grouped_weight_view(wrapped, num_experts=E, rows=2 * I, columns=H, use_mxfp8=False)
    assert view.shape == (E, 2 * I, H) and view.data_ptr() == backing.data_ptr()


class _TEMXFP8:
    """What the view builder reads of a TE per-expert MXFP8 parameter (private field names, on .data)."""

    def __init__(self, gen, M, Kc):
        self.shape = torch.Size((M, Kc))
        self.data = SimpleNamespace(
            _rowwise_data=torch.randint(0, 256, (M, Kc), generator=gen, dtype=torch.uint8),
            _columnwise_data=torch.randint(0, 256, (M, Kc), generator=gen, dtype=torch.uint8),
            _rowwise_scale_inv=torch.randint(0, 256, (M, Kc // 32), generator=gen, dtype=torch.uint8),
            _columnwise_scale_inv=torch.randint(0, 256, (M // 32, Kc), generator=gen, dtype=torch.uint8))


def test_split_views_for_this_projects_functional(monkeypatch):
    gen = torch.Generator().manual_seed(14)
    params = [_param(gen, 2 * I, H) for _ in range(E)]
    views = mw._native_split_weight_view(params, rows=2 * I, columns=H, use_mxfp8=False)
    assert isinstance(views, tuple) and all(v is p for v, p in zip(views, params))
    with pytest.raises(RuntimeError, match="never refreshed"):
        mw._native_split_weight_view(params, rows=2 * I, columns=H, use_mxfp8=False, cached_view=views)
    with pytest.raises(RuntimeError, match="shape"):
        mw._native_split_weight_view(params, rows=I, columns=H, use_mxfp8=False)
    with pytest.raises(RuntimeError, match="empty"):
        mw._native_split_weight_view([], rows=2 * I, columns=H, use_mxfp8=False)

    M, Kc = 256, 128
    experts = [_TEMXFP8(gen, M, Kc) for _ in range(3)]
    monkeypatch.setattr(fp8_utils, "is_mxfp8tensor", lambda p: isinstance(p, _TEMXFP8))
    w = mw._native_split_weight_view(experts, rows=M, columns=Kc, use_mxfp8=True)
    assert isinstance(w, mf.SplitRoutedWeight) and w.native_columnwise
    for e, q in enumerate(experts):  # TE's own storage, in TE's layouts
        assert w.data[e].data_ptr() == q.data._rowwise_data.data_ptr() and w.data[e].dtype == torch.float8_e4m3fn
        assert w.transposed_data[e].data_ptr() == q.data._columnwise_data.data_ptr()
        assert w.scale[e] is q.data._rowwise_scale_inv and w.transposed_scale[e] is q.data._columnwise_scale_inv
    with pytest.raises(RuntimeError, match="native Transformer Engine MXFP8"):
        mw._native_split_weight_view(experts + [torch.nn.Parameter(torch.zeros(M, Kc))], rows=M, columns=Kc,
                                     use_mxfp8=True)


def test_split_views_for_mixture_of_kittens(stand_in_mok, monkeypatch):
    gen = torch.Generator().manual_seed(15)
    params = [_param(gen, 2 * I, H) for _ in range(E)]
    w = mw._native_split_weight_view(params, rows=2 * I, columns=H, use_mxfp8=False)
    assert isinstance(w, stand_in_mok.functional.SplitRoutedWeight)
    assert w.storage_table.kind == "make_routed_weight_storage_table_bf16"
    assert [t.data_ptr() for t in w.storage_table.tensors] == [p.data_ptr() for p in params]
    assert w.data.data_ptr() == params[0].data_ptr()

    M, Kc = 128, 256
    experts = [_TEMXFP8(gen, M, Kc) for _ in range(2)]
    monkeypatch.setattr(fp8_utils, "is_mxfp8tensor", lambda p: isinstance(p, _TEMXFP8))
    w = mw._native_split_weight_view(experts, rows=M, columns=Kc, use_mxfp8=True)
    assert w.native_columnwise and w.scale is w.scale_tensors[0]
    assert all(a is b for a, b in zip(w.scale_storage_table.tensors, w.scale_tensors))
    assert all(a is b for a, b in zip(w.transposed_scale_storage_table.tensors, w.transposed_scale_tensors))
    assert w.transposed_storage_table.kind == "make_routed_weight_storage_table_mxfp8"

    def check_scales():
        for q, r, c in zip(experts, w.scale_tensors, w.transposed_scale_tensors):
            assert torch.equal(_logical(r, M, Kc)[0], q.data._rowwise_scale_inv)
            assert torch.equal(_logical(c, Kc, M)[0], q.data._columnwise_scale_inv.t())

    check_scales()
    for q in experts:  # the next iteration's weights: new scale values in TE's storage
        q.data._rowwise_scale_inv.copy_(torch.randint(0, 256, (M, Kc // 32), generator=gen, dtype=torch.uint8))
        q.data._columnwise_scale_inv.copy_(torch.randint(0, 256, (M // 32, Kc), generator=gen, dtype=torch.uint8))
    addresses = [t.data_ptr() for t in w.scale_tensors + w.transposed_scale_tensors]
    tables = len(stand_in_mok.calls)
    assert mw._native_split_weight_view(experts, rows=M, columns=Kc, use_mxfp8=True, cached_view=w) is w
    assert [t.data_ptr() for t in w.scale_tensors + w.transposed_scale_tensors] == addresses
    assert len(stand_in_mok.calls) == tables  # the descriptor tables are kept
    check_scales()


def test_prepare_shared_expert_config(monkeypatch):
    monkeypatch.setattr(mw, "_shared_config_warned", False)
    plain = SimpleNamespace(fp8="hybrid", fp8_param=False)
    assert mw.prepare_shared_expert_config(plain) is plain
    cfg = SimpleNamespace(fp8="hybrid", fp8_param=True, fp8_recipe="mxfp8", hidden_size=H)
    with pytest.warns(UserWarning, match="shared expert in BF16"):
        shared = mw.prepare_shared_expert_config(cfg)
    assert shared is not cfg and (shared.fp8, shared.fp8_param) == (None, False)
    assert (cfg.fp8, cfg.fp8_param, shared.hidden_size, shared.fp8_recipe) == ("hybrid", True, H, "mxfp8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mw.prepare_shared_expert_config(copy.copy(cfg))  # warns once per process


def test_views_follow_the_bridges_functional_choice(stand_in_mok, monkeypatch):
    assert mw.mok_functional() is stand_in_mok.functional and not mw.uses_project_functional()
    mr.set_functional(mf)
    try:
        assert mw.mok_functional() is mf and mw.uses_project_functional()
    finally:
        mr.set_functional(None)
    assert mw.mok_functional() is stand_in_mok.functional
    monkeypatch.delattr(mr, "functional_module")  # a bridge without the lookup: the same rule
    assert mw.mok_functional() is stand_in_mok.functional
    monkeypatch.delitem(sys.modules, "mok.functional")
    assert mw.mok_functional() is mf
