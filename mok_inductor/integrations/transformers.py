"""The "mok" experts backend for Hugging Face transformers.

    import mok_inductor
    mok_inductor.enable()                    # registers "mok" in transformers' ExpertsInterface
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="mok")
    model.set_experts_implementation("mok")  # or switch an existing model

Data flow of one experts call (`mok_experts_forward(self, hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K])`, the signature of transformers' `ExpertsInterface`):

1. `experts_plan(self)` decides, from what the module computes, whether MoK can run it:
   - static checks of the `@use_experts_implementation` flags: `has_gate` (MoK is gated only),
     `has_bias` (`gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H], MoK's routed biases),
     `has_post_expert_norm`, `is_concatenated` (gate rows then up rows; interleaved ones, gate at even
     columns as GPT-OSS has them, are read through a zero-copy [E, 2, I, H] view);
   - a numerical probe of the module's own `_apply_gate` (whatever it is: the default
     `act_fn(gate) * up`, a custom clamp, a soft-cap, an fp32 upcast, GPT-OSS's `(up + 1) * gate *
     sigmoid(1.702 gate)`) on a float32 probe tensor, compared against each of MoK's activations
     ("swiglu", "gpt_oss") without a clamp and with each finite float attribute of the module whose
     name contains "limit" as `swiglu_limit`. It matches → supported (or "mapped" onto `swiglu_limit`);
     nothing matches → unsupported, with the reason.
   The plan is cached per module and computed eagerly even under torch.compile
   (`torch.compiler.assume_constant_result`: Dynamo runs it at trace time and bakes in the result,
   guarded on the module's identity), so the one-time warning is issued from eager code too.
2. Supported: `mok_inductor.moe(x, top_k_weights, top_k_index, gate_up_proj, down_proj,
   swiglu_limit=..., activation=..., gate_up_bias=..., down_bias=...)`. Transposed weights (`is_transposed`:
   [E, H, 2I] / [E, I, H]) and interleaved gate/up columns are passed as zero-copy views (GPT-OSS's
   checkpoint layout runs as it is stored; gradients come back in it); expert-parallel sentinels (ids >= E)
   become MoK's "no route" (-1).
3. Unsupported: transformers' own "grouped_mm" experts function, or, for weight dtypes grouped_mm
   cannot take (float64), the class's own eager forward; after a one-time warning that names the
   class, the reason, what runs instead and what the user can do, attributed to the user's line (the
   first frame outside mok_inductor, torch and transformers). Never a wrong result, never an error
   that eager would not raise.

Shared experts (Qwen2-MoE's gated `shared_expert`, DeepSeek-V3/GLM4-MoE's `shared_experts`) live
in the sparse MoE block, outside the experts function, and keep running there, as HF computes them.

Registration adds one name, "mok", to transformers' ExpertsInterface and changes nothing else in transformers.
It happens in exactly two ways: `mok_inductor.enable()` calls `register_if_installed()`, which registers when
transformers is installed (importing `transformers.integrations.moe`) and does nothing otherwise; `register()`
registers explicitly and raises ImportError without transformers. `import mok_inductor` never touches
transformers, and importing this module registers nothing: no import hook, nothing patched at import.
`discover_experts_classes()` lists every `@use_experts_implementation` class of the installed
transformers by parsing the modeling sources (used by the tests and the docs).

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token.
"""

from __future__ import annotations

import ast
import ctypes
import importlib
import importlib.util
import math
import os
import re
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from .._checks import FLOAT_DTYPES

BACKEND_NAME = "mok"
_HF_MOE_MODULE = "transformers.integrations.moe"

# ---------------------------------------------------------------------------------------------
# Registration: explicit (`register()`) or through `mok_inductor.enable()` (`register_if_installed()`)


def _experts_interface(moe_module):
    """transformers' ExpertsInterface, or None where this transformers has none (older than 5.x)."""
    return getattr(moe_module, "ExpertsInterface", None)


def is_registered() -> bool:
    """Whether "mok" names `mok_experts_forward` in transformers' ExpertsInterface (never imports transformers)."""
    moe_module = sys.modules.get(_HF_MOE_MODULE)
    interface = None if moe_module is None else _experts_interface(moe_module)
    return interface is not None and interface._global_mapping.get(BACKEND_NAME) is mok_experts_forward


def _register_in(moe_module) -> None:
    # Marked here rather than with a decorator: torch.compiler.assume_constant_result imports torch._dynamo
    # (seconds), which importing this module should not cost. It marks the function object itself (idempotent),
    # so the global that mok_experts_forward calls is the marked one.
    torch.compiler.assume_constant_result(_experts_plan_at_trace_time)
    _experts_interface(moe_module).register(BACKEND_NAME, mok_experts_forward)


def register() -> None:
    """Register "mok" in transformers' ExpertsInterface now, importing `transformers.integrations.moe`.
    Idempotent. ImportError when transformers (>= 5.17) is not installed."""
    try:
        moe_module = importlib.import_module(_HF_MOE_MODULE)
    except ImportError as e:
        raise ImportError("the transformers integration needs `pip install transformers>=5.17`") from e
    if _experts_interface(moe_module) is None:
        raise ImportError(f"{_HF_MOE_MODULE} has no ExpertsInterface: the transformers integration needs "
                          "`pip install transformers>=5.17`")
    _register_in(moe_module)


def register_if_installed() -> bool:
    """Register "mok" when transformers (with an ExpertsInterface) is installed; returns whether it did.

    `mok_inductor.enable()` calls it. It imports `transformers.integrations.moe` (which imports transformers) when
    transformers is installed, and does nothing when it is not or when it predates ExpertsInterface. Idempotent."""
    if importlib.util.find_spec("transformers") is None:
        return False
    try:
        moe_module = importlib.import_module(_HF_MOE_MODULE)
    except ModuleNotFoundError as e:
        if e.name != _HF_MOE_MODULE:  # a broken install is an error, not "not installed"
            raise
        return False
    if _experts_interface(moe_module) is None:
        return False
    _register_in(moe_module)
    return True


# ---------------------------------------------------------------------------------------------
# What an experts module computes: the plan


@dataclass(frozen=True)
class ExpertsPlan:
    """How `mok_experts_forward` runs one experts module.

    supported: MoK computes exactly what the module computes.
    swiglu_limit: the clamp mapped onto MoK's `swiglu_limit` (None: plain SwiGLU).
    limit_attr: the module attribute the limit was read from.
    reason: why MoK cannot run it (when not supported).
    remedy: what the user can do so that MoK runs it ("" where MoK has no kernel for what it computes).
    fallback: what runs it instead: "grouped_mm" (transformers' experts function) or "eager" (the class's
        own forward, for weight dtypes grouped_mm cannot take).
    activation: MoK's gated activation that matched the module's gate ("swiglu" or "gpt_oss").
    """

    supported: bool
    swiglu_limit: Optional[float] = None
    limit_attr: Optional[str] = None
    reason: str = ""
    remedy: str = ""
    fallback: str = ""
    activation: str = "swiglu"

    @property
    def kind(self) -> str:
        if not self.supported:
            return "unsupported"
        return "mapped" if self.swiglu_limit is not None else "supported"


_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_WARNED: set = set()
_PROBE_ROWS = 48


def _limit_candidates(module) -> list:
    """(name, value) of the finite positive float attributes whose name says "limit"."""
    out = []
    for name, value in vars(module).items():
        if "limit" not in name.lower() or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        value = float(value)
        if value > 0.0 and math.isfinite(value):
            out.append((name, value))
    return out


_DTYPE_NAMES = ", ".join(str(d)[6:] for d in FLOAT_DTYPES[:-1]) + " or " + str(FLOAT_DTYPES[-1])[6:]  # no "torch."
_CAST_HINT = (f"cast the model to {_DTYPE_NAMES}, e.g. model.to(torch.float32) (or load it with "
              "dtype=torch.float32)")
# the dtypes transformers' "grouped_mm" experts function runs (torch's grouped_mm takes these and no other)
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


_SHAPES_HINT = "MoK needs gate_up_proj [E, 2I, H] and down_proj [E, H, I] (or both transposed, is_transposed=True)"


def _interleaved(module) -> bool:
    """Whether the module's gate/up columns alternate (gate at even, up at odd: GPT-OSS), not concatenated."""
    return not getattr(module, "is_concatenated", True)


def _weights(module):
    """(gate_up [E, 2I, H] (interleaved gate/up: the [E, 2, I, H] view), down [E, H, I], "", "") as MoK takes
    them (views, never copies), or (None, None, reason, remedy)."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return (None, None, "the experts have no gate_up_proj/down_proj tensors (quantized or custom storage)",
                "dequantize the experts (or load the model without quantization) to run them with MoK")
    if gate_up.dim() != 3 or down.dim() != 3:
        return (None, None, f"expected 3-D expert weights, got gate_up_proj {list(gate_up.shape)}, "
                f"down_proj {list(down.shape)}", _SHAPES_HINT)
    if getattr(module, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    E, two_i, H = gate_up.shape
    if two_i % 2 != 0 or tuple(down.shape) != (E, H, two_i // 2):
        return (None, None, f"expert weight shapes gate_up {list(gate_up.shape)} / down {list(down.shape)} "
                "do not pair up", _SHAPES_HINT)
    if gate_up.dtype not in FLOAT_DTYPES:
        return (None, None, f"its expert weights are {_dtype_name(gate_up.dtype)} and MoK computes in "
                f"{_DTYPE_NAMES}", _CAST_HINT)
    if down.dtype != gate_up.dtype:
        return (None, None, f"gate_up_proj is {_dtype_name(gate_up.dtype)} but down_proj is "
                f"{_dtype_name(down.dtype)}, and MoK takes one dtype for both",
                "cast both to one dtype, e.g. model.to(torch.bfloat16)")
    if _interleaved(module):  # rows 2i (gate) and 2i+1 (up) -> [E, 2, I, H]: a view of any strides
        gate_up = gate_up.unflatten(1, (two_i // 2, 2)).permute(0, 2, 1, 3)
    return gate_up, down, "", ""


def _biases(module, E: int, I: int, H: int, dtype):
    """(gate_up_bias [E, 2I] (interleaved: the [E, 2, I] view), down_bias [E, H], "") of a `has_bias` module, or
    (None, None, reason)."""
    b1 = getattr(module, "gate_up_proj_bias", None)
    b2 = getattr(module, "down_proj_bias", None)
    if not isinstance(b1, torch.Tensor) or not isinstance(b2, torch.Tensor):
        return None, None, "its biases are not gate_up_proj_bias/down_proj_bias tensors"
    if tuple(b1.shape) != (E, 2 * I) or tuple(b2.shape) != (E, H):
        return None, None, (f"its biases gate_up_proj_bias {list(b1.shape)} / down_proj_bias {list(b2.shape)} are "
                            f"not [E, 2I] = [{E}, {2 * I}] / [E, H] = [{E}, {H}]")
    if b1.dtype != dtype or b2.dtype != dtype:
        return None, None, (f"its biases are {_dtype_name(b1.dtype)}/{_dtype_name(b2.dtype)} and its weights "
                            f"{_dtype_name(dtype)}, and MoK takes one dtype for all")
    if _interleaved(module):
        b1 = b1.unflatten(1, (I, 2)).transpose(1, 2)
    return b1, b2, ""


def _probe_gate(module, two_i: int, device) -> ExpertsPlan:
    """Run the module's own `_apply_gate` on a probe and match it against MoK's activations (optionally
    clamped): the SwiGLU, then GPT-OSS's."""
    i = two_i // 2
    candidates = [(None, None)] + _limit_candidates(module)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    rows = [torch.randn(_PROBE_ROWS, two_i, generator=gen) * 3.0]
    for _, limit in candidates[1:]:  # rows that cross every candidate clamp, both ways
        rows.append(torch.randn(_PROBE_ROWS, two_i, generator=gen) * (2.0 * limit))
    probe = torch.cat(rows).to(device)
    try:
        with torch.no_grad():
            got = type(module)._apply_gate(module, probe)
    except Exception as e:  # a gate we cannot even call on [S, 2I]
        return ExpertsPlan(False, reason=f"its _apply_gate failed on a [S, 2I] probe ({type(e).__name__}: {e})")
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (probe.shape[0], i):
        return ExpertsPlan(False, reason="its _apply_gate does not map [S, 2I] to [S, I]")
    got = got.double().cpu()
    p = probe.double().cpu()
    g, u = (p[:, 0::2], p[:, 1::2]) if _interleaved(module) else p.split(i, dim=-1)
    # MoK's activations (`mok_inductor.types.ACTIVATIONS`), written out: h = g * sigmoid(alpha g) * (u + beta)
    activations = (("swiglu", 1.0, 0.0), ("gpt_oss", 1.702, 1.0))
    for act, alpha, beta in activations:
        for name, limit in candidates:
            gg, uu = (g, u) if limit is None else (g.clamp(max=limit), u.clamp(-limit, limit))
            want = gg * torch.sigmoid(alpha * gg) * (uu + beta)
            err = (got - want).norm() / want.norm().clamp_min(1e-30)
            if bool(err <= 1e-5):  # float32 rounding of the module's own arithmetic
                name = _limit_read(module, name, limit, candidates, probe, got)
                return ExpertsPlan(True, swiglu_limit=limit, limit_attr=name, activation=act)
    alpha = getattr(module, "alpha", None)
    if isinstance(alpha, float) and alpha != 1.702:
        return ExpertsPlan(False, reason=f"its gate is GPT-OSS-like with alpha = {alpha}, and MoK's \"gpt_oss\" "
                                         "activation has GPT-OSS's alpha = 1.702")
    act = getattr(module, "act_fn", None)
    act_name = type(act).__name__ if act is not None else "none"
    gate_fn = getattr(type(module), "_apply_gate", None)
    custom = "default _apply_gate" if getattr(gate_fn, "__name__", "") == "_default_apply_gate" else "custom _apply_gate"
    return ExpertsPlan(
        False,
        reason=f"its gate ({custom}, act_fn={act_name}) is not SwiGLU (silu(gate) * up) or GPT-OSS's ((up + 1) * gate * "
               "sigmoid(1.702 gate)), optionally clamped",
    )


def _limit_read(module, name, limit, candidates, probe, got):
    """Of the limit attributes holding the matched value (MiniMax-M3-VL has `limit` and `swiglu_limit`, equal), the
    one the gate reads: the first whose change changes the gate's output (the plan reads it on every call)."""
    same = [n for n, v in candidates if n is not None and v == limit]
    if len(same) < 2:
        return name
    for n in same:
        old = getattr(module, n)
        try:
            object.__setattr__(module, n, limit * 0.5)
            with torch.no_grad():
                changed = not torch.equal(type(module)._apply_gate(module, probe).double().cpu(), got)
        except Exception:  # noqa: BLE001 - a gate that rejects the change does not read it as a limit
            changed = False
        finally:
            object.__setattr__(module, n, old)
        if changed:
            return n
    return name


def _weight_dtype(module) -> Optional[torch.dtype]:
    """The floating dtype of the experts' weights, None where they have none (quantized storage)."""
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        w = getattr(module, name, None)
        if isinstance(w, torch.Tensor) and w.is_floating_point():
            return w.dtype
    return None


def _fallback_for(module) -> str:
    """What runs the experts MoK cannot: transformers' "grouped_mm", or the class's own eager forward where
    the weights have a float dtype grouped_mm raises on (float64), so the model runs wherever eager runs."""
    dtype = _weight_dtype(module)
    if dtype is not None and dtype not in _GROUPED_MM_DTYPES and _eager_forward(module) is not None:
        return "eager"
    return "grouped_mm"


def _signature(module) -> tuple:
    return (
        getattr(module, "has_gate", True), getattr(module, "has_bias", False),
        getattr(module, "has_post_expert_norm", False), getattr(module, "is_concatenated", True),
        getattr(module, "is_transposed", False), id(getattr(module, "act_fn", None)),
        tuple(_limit_candidates(module)), getattr(module, "alpha", None),  # (GPT-OSS's gate reads its alpha)
        tuple(getattr(getattr(module, n, None), "dtype", None) for n in ("gate_up_proj", "up_proj", "down_proj")),
    )


def _compute_plan(module) -> ExpertsPlan:
    plan = _compute_support(module)
    if plan.supported:
        return plan
    return ExpertsPlan(False, reason=plan.reason, remedy=plan.remedy, fallback=_fallback_for(module))


def _compute_support(module) -> ExpertsPlan:
    if not getattr(module, "has_gate", True):
        act = getattr(module, "act_fn", None)
        return ExpertsPlan(False, reason=f"its experts are ungated, act_fn(up) (act_fn={type(act).__name__}), and MoK "
                                         "computes gated SwiGLU only")
    if getattr(module, "has_post_expert_norm", False):
        return ExpertsPlan(False, reason="it applies a norm to each expert's output before the routing weights, "
                                         "which MoK does not")
    gate_up, down, why, remedy = _weights(module)
    if gate_up is None:
        return ExpertsPlan(False, reason=why, remedy=remedy)
    E, H, I = down.shape
    if getattr(module, "has_bias", False):
        _, _, why = _biases(module, E, I, H, down.dtype)
        if why:
            return ExpertsPlan(False, reason=why)
    return _probe_gate(module, 2 * I, gate_up.device)


def experts_plan(module) -> ExpertsPlan:
    """The (cached) plan of `module`; warns once per experts class and reason when it falls back.

    Under torch.compile Dynamo runs this eagerly at trace time and bakes the result in."""
    sig = _signature(module)
    cached = _PLANS.get(module)
    if cached is not None and cached[0] == sig:
        return cached[1]
    plan = _compute_plan(module)
    _PLANS[module] = (sig, plan)
    if not plan.supported:
        key = (type(module).__qualname__, plan.reason, plan.fallback)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(fallback_message(type(module).__qualname__, plan), stacklevel=_user_stacklevel())
    return plan


def fallback_message(class_name: str, plan: ExpertsPlan) -> str:
    """The one-time warning of an unsupported plan: what happened, what runs instead, what the user can do."""
    runs = ('transformers\' "grouped_mm" experts function' if plan.fallback == "grouped_mm"
            else "the class's own eager forward (under torch.compile: transformers' grouped_mm, which takes this "
                 "dtype only there)")
    todo = (f"To use MoK: {plan.remedy}." if plan.remedy
            else "MoK has no kernel for what these experts compute; the fallback computes what eager computes.")
    return (f'experts_implementation="mok": {class_name} falls back to "{plan.fallback}": MoK cannot run it because '
            f"{plan.reason}, so {runs} runs it instead. {todo} To silence this warning, set "
            f'experts_implementation="{plan.fallback}" for this model.')


# Frames in these packages are the call path from the user's `model(...)` down to the experts function.
_LIBRARY_PACKAGES = ("mok_inductor", "torch", "transformers", "accelerate", "peft")


def _user_stacklevel() -> int:
    """The warnings.warn stacklevel (for a call made in the caller of this function) that names the first frame
    outside the library packages: the user's `model(...)`, `generate(...)` or `prepare(model)` line, wherever in
    transformers' / torch's / Dynamo's stack the plan was made. The outermost frame where every frame is library."""
    roots = []
    for name in _LIBRARY_PACKAGES:
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        if path:
            roots.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    roots = tuple(roots)
    frame = sys._getframe(2)  # the caller of the function that warns (level 2 of its warnings.warn)
    level = 2
    while frame is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(roots):
            return level
        if frame.f_back is None:
            return level
        frame = frame.f_back
        level += 1
    return level


def _experts_plan_at_trace_time(module_id: int) -> ExpertsPlan:
    """experts_plan for Dynamo: marked `assume_constant_result` at registration, so Dynamo runs it at trace
    time and bakes the plan in. It takes `id(module)`, not the module: torch 2.11's Dynamo cannot fold the
    call with a module argument (it is not a constant), but it folds `id(module)` (guarded on the module's
    identity) on every version from 2.11 to 2.13. The module is alive while it is traced, so its id names it."""
    return experts_plan(ctypes.cast(module_id, ctypes.py_object).value)


def _experts_plan_outside_the_trace(module) -> ExpertsPlan:
    """experts_plan under a tracer other than Dynamo (torch.export's default non-strict mode): the
    probe runs on real tensors with the tracer's modes set aside (traced, its comparison would be a
    data-dependent branch the tracer cannot take), and nothing of it enters the traced graph."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return experts_plan(module)


def prepare(model: torch.nn.Module) -> int:
    """Decide, eagerly, the plan of every experts module of `model` (returns how many). A traced call then
    gets the cached plan and never runs the probe while tracing. Optional: a compiled first call decides the
    plan at trace time anyway (`_experts_plan_at_trace_time`), and so does torch.export, strict or not
    (`_experts_plan_outside_the_trace`)."""
    n = 0
    for module in model.modules():
        if hasattr(module, "down_proj") and hasattr(module, "has_bias"):
            experts_plan(module)
            n += 1
    return n


# ---------------------------------------------------------------------------------------------
# The experts function


def _moe(*args, **kwargs):
    from .. import api

    return api.moe(*args, **kwargs)


def _eager_forward(module):
    """The class's own forward, which `@use_experts_implementation` wraps (functools.wraps keeps it as
    `__wrapped__`); None where the class has none."""
    for klass in type(module).__mro__:
        fn = klass.__dict__.get("forward")
        if fn is not None:
            return getattr(fn, "__wrapped__", None)
    return None


def _fallback(module, plan, hidden_states, top_k_index, top_k_weights):
    # Compiled, transformers' grouped_mm routes every dtype but bfloat16 to its own loop-of-mm op, which takes
    # float64 and keeps the graph whole (the eager forward's data-dependent loop would break it): eager only
    # where grouped_mm would raise, outside torch.compile.
    if plan.fallback == "eager" and not torch.compiler.is_compiling():
        return _eager_forward(module)(module, hidden_states, top_k_index, top_k_weights)
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)


def mok_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts function signature: hidden_states [T, H], top_k_index [T, K] expert ids,
    top_k_weights [T, K] routing weights -> [T, H] in hidden_states.dtype."""
    if torch.compiler.is_dynamo_compiling():
        # Always the folded call, never "the stored plan if any": Dynamo may restart a trace (a graph break, a
        # float it made symbolic), and the first attempt's call stores the plan, so a branch on it would take
        # another path in the restarted trace (SpeculationLogDivergence). A stored plan is what it returns.
        plan = _experts_plan_at_trace_time(id(self))
    elif torch.compiler.is_compiling():
        plan = _experts_plan_outside_the_trace(self)
    else:
        plan = experts_plan(self)
    group = getattr(self, _EP_GROUP_ATTR, None)
    if not plan.supported:
        if group is not None:
            raise RuntimeError(f"{type(self).__qualname__}: its experts were sharded by shard_experts, but MoK cannot "
                               f"run them: {plan.reason}")
        return _fallback(self, plan, hidden_states, top_k_index, top_k_weights)
    gate_up_E2IH, down_EHI, _, _ = _weights(self)  # (interleaved gate/up: [E, 2, I, H])
    num_experts, H, I = down_EHI.shape
    # the variant: GPT-OSS's activation and biases (views of the parameters, as the weights are)
    variant = dict(activation=plan.activation)
    if getattr(self, "has_bias", False):
        variant["gate_up_bias"], variant["down_bias"], _ = _biases(self, num_experts, I, H, down_EHI.dtype)
    top_TK = top_k_index
    if group is not None:  # shard_experts: this rank's tokens, global ids, local experts
        x_TH = hidden_states.to(gate_up_E2IH.dtype)
        limit = None if plan.limit_attr is None else float(getattr(self, plan.limit_attr))
        return _moe(x_TH, top_k_weights, top_TK, gate_up_E2IH, down_EHI, swiglu_limit=limit, group=group,
                    **variant).to(hidden_states.dtype)
    if getattr(self, "_is_expert_parallel", False):
        # EP marks routes to other ranks' experts with ids >= E: MoK's "no route"
        top_TK = torch.where(top_TK >= num_experts, torch.full_like(top_TK, -1), top_TK)
    x_TH = hidden_states.to(gate_up_E2IH.dtype)
    limit = None if plan.limit_attr is None else float(getattr(self, plan.limit_attr))
    y_TH = _moe(x_TH, top_k_weights, top_TK, gate_up_E2IH, down_EHI, swiglu_limit=limit, **variant)
    return y_TH.to(hidden_states.dtype)


_EP_GROUP_ATTR = "_mok_ep_group"


def shard_experts(model: torch.nn.Module, group) -> list:
    """Expert parallelism for a "mok" model (docs/distributed.md): keep only this rank's experts.

    For every experts module of `model` (E experts, E divisible by the group's size W), rank r keeps
    experts [r*E/W, (r+1)*E/W) of gate_up_proj / down_proj (and their biases, GPT-OSS's) as new Parameters
    and records `group`; the
    "mok" experts function then sends each token to the ranks owning its experts
    (`mok_inductor.moe(..., group=group)`). Every rank runs the model on its own tokens. Call it on
    every rank, on identical models (same weights), before building the optimizer. Returns the names
    of the sharded parameters (they differ per rank: keep them out of data-parallel gradient averaging).
    """
    import torch.distributed as dist

    W, r = dist.get_world_size(group), dist.get_rank(group)
    names = []
    for mname, module in model.named_modules():
        if not (hasattr(module, "down_proj") and hasattr(module, "has_bias")):
            continue
        where = mname or "model"
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if impl is not None and impl != "mok":  # (only the "mok" experts function sends tokens to other ranks)
            raise ValueError(f'{where}: its experts run experts_implementation="{impl}"; shard_experts needs "mok" '
                             '(model.set_experts_implementation("mok") first)')
        if getattr(module, _EP_GROUP_ATTR, None) is not None:
            raise ValueError(f"{where}: its experts are sharded already (shard_experts was called on this model)")
        plan = experts_plan(module)
        if not plan.supported:
            raise ValueError(f"{where}: MoK cannot run these experts ({plan.reason}), so they cannot be sharded")
        E = module.gate_up_proj.shape[0]
        if E % W != 0:
            raise ValueError(f"{where}: {E} experts do not split over {W} ranks")
        el = E // W
        # the experts' biases (GPT-OSS) are per expert like the weights: sharded the same way
        pnames = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias")
                                                  if getattr(module, "has_bias", False) else ())
        for pname in pnames:
            old = getattr(module, pname)
            new = torch.nn.Parameter(old.detach()[r * el:(r + 1) * el].clone(), requires_grad=old.requires_grad)
            setattr(module, pname, new)
            names.append(f"{mname}.{pname}" if mname else pname)
        if hasattr(module, "num_experts"):
            module.num_experts = el
        object.__setattr__(module, _EP_GROUP_ATTR, group)
    if not names:
        raise ValueError("model: contains no transformers experts module to shard")
    return names


# ---------------------------------------------------------------------------------------------
# Discovery: every @use_experts_implementation class of the installed transformers


@dataclass(frozen=True)
class ExpertsClassInfo:
    """One `@use_experts_implementation` class found in the installed transformers sources."""

    model_type: str  # the models/<dir> name
    module: str  # e.g. transformers.models.qwen3_moe.modeling_qwen3_moe
    class_name: str
    decorator_args: dict = field(default_factory=dict, hash=False)  # non-default decorator keywords
    custom_apply_gate: bool = False


_DECORATED_CLASS_RE = re.compile(r"^@use_experts_implementation(\((?P<args>[^)]*)\))?\s*\nclass (?P<name>\w+)", re.M)


def _decorator_args(text: Optional[str]) -> dict:
    if not text or not text.strip():
        return {}
    call = ast.parse(f"f({text})", mode="eval").body
    args = {}
    for kw in call.keywords:
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            args[kw.arg] = ast.unparse(kw.value)
    return args


def discover_experts_classes() -> list:
    """Scan `transformers/models/*/modeling_*.py` (text only, nothing imported) for classes decorated with
    `@use_experts_implementation`; returns ExpertsClassInfo sorted by (model_type, class_name)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return []
    models_dir = os.path.join(list(spec.submodule_search_locations)[0], "models")
    found = []
    for model_type in sorted(os.listdir(models_dir)):
        folder = os.path.join(models_dir, model_type)
        if not os.path.isdir(folder):
            continue
        for fname in sorted(os.listdir(folder)):
            if not (fname.startswith("modeling_") and fname.endswith(".py")):
                continue
            with open(os.path.join(folder, fname), encoding="utf-8") as f:
                src = f.read()
            for m in _DECORATED_CLASS_RE.finditer(src):
                start = src.index("\n", m.end()) + 1
                nxt = re.search(r"^\S", src[start:], re.M)  # the class body ends at the next top-level line
                body = src[start: start + nxt.start()] if nxt else src[start:]
                custom = re.search(r"^    def _apply_gate\(", body, re.M) is not None
                found.append(ExpertsClassInfo(
                    model_type, f"transformers.models.{model_type}.{fname[:-3]}", m.group("name"),
                    _decorator_args(m.group("args")), custom,
                ))
    return sorted(found, key=lambda c: (c.model_type, c.class_name))


__all__ = [
    "BACKEND_NAME", "ExpertsPlan", "ExpertsClassInfo", "discover_experts_classes", "experts_plan", "fallback_message",
    "is_registered", "mok_experts_forward", "prepare", "register", "register_if_installed",
]
