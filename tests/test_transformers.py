"""The "mok" experts backend for Hugging Face transformers (mok_inductor/integrations/transformers.py).

- registration: `import mok_inductor` leaves transformers alone, `mok_inductor.enable()` and `register()`
  register "mok", importing this module registers nothing;
- the family matrix, EAGER ONLY: every `@use_experts_implementation` class found in the installed
  transformers is built from its config class's defaults shrunk generically (no downloads, no
  hand-written configs); "mok" must equal "eager" in logits, every experts output and every
  parameter gradient (float32, rel 1e-4), and in the experts output and gradients in bfloat16
  against a float64 run of the module's own eager forward (rel 1e-2). Families MoK cannot compute
  must fall back (warning once) and still equal eager. Families that cannot be built cheaply are
  listed with the reason (printed and warned), never dropped silently;
- torch.compile(fullgraph=True) forward and backward for Qwen3-MoE and Qwen2-MoE;
- model.generate with "mok".
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import mok_inductor
from mok_inductor.integrations import transformers as hf
from _helpers import rel_err

import transformers  # a pinned test dependency (requirements.txt): its absence must fail, not skip
from transformers import PreTrainedModel  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 128  # input ids are drawn from [0, VOCAB - 8); special token ids are moved into the last 8


@pytest.fixture(autouse=True, scope="module")
def _registered():
    """Every test below picks experts_implementation="mok": register it, as a user does (or mok_inductor.enable())."""
    hf.register()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls on a shared 2-core machine: intra-op threads spin against other processes and
    run ~50x slower; one thread keeps this module fast. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Tiny models from config defaults, shrunk generically

_SET = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "kv_lora_rank": 16, "q_lora_rank": 16,
        "n_group": 1, "topk_group": 1, "decoder_sparse_step": 1, "moe_layer_freq": 1}
_AT_MOST = {"num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_shared_experts": 1, "num_shared_experts": 1,
            "first_k_dense_replace": 0}
_EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def shrink_config_kwargs(cfg_cls, defaults: dict, layer_pick: str) -> dict:
    """Overrides that make a config class's defaults tiny: hidden 32, 2 layers, <= 8 experts, top-2,
    intermediate sizes 16, vocab 128; per-layer lists cut to 2 entries (`layer_pick`: "ends" keeps the
    first and the last, so dense-first stacks keep a sparse layer; "head" keeps the first two).
    Sub-configs (text_config, ...) are shrunk the same way. Head dims are kept (rotary sections
    depend on them)."""
    out = {}
    layers = defaults.get("num_hidden_layers")
    for k, v in defaults.items():
        if isinstance(v, dict) and ("hidden_size" in v or "num_hidden_layers" in v):
            sub = getattr(cfg_cls, "sub_configs", {}).get(k)
            out[k] = {**v, **shrink_config_kwargs(sub, v, layer_pick)} if sub is not None else v
        elif isinstance(v, list) and layers and layers > 2 and len(v) == layers:
            out[k] = [v[0], v[-1]] if layer_pick == "ends" else v[:2]
        elif k == "per_layer_config" and isinstance(v, dict):
            out[k] = {i: c for i, c in v.items() if int(i) < 2}
        elif v is None and k in ("num_experts_per_tok", "moe_topk", "top_k_experts"):
            out[k] = 2
        elif v is None and (k in _EXPERT_COUNTS or "intermediate_size" in k):  # MoE off by default (e.g. gemma4)
            out[k] = 8 if k in _EXPERT_COUNTS else 16
        elif isinstance(v, bool) or not isinstance(v, int):
            continue
        elif k in _SET:
            out[k] = _SET[k]
        elif k in _AT_MOST:
            out[k] = min(v, _AT_MOST[k])
        elif "vocab_size" in k:
            out[k] = VOCAB
        elif k in _EXPERT_COUNTS:
            out[k] = min(v, 8)
        elif "intermediate_size" in k or k.endswith("_ffn_hidden_size"):
            out[k] = 16
        elif k == "num_key_value_heads":
            heads = defaults.get("num_attention_heads")
            out[k] = 4 if v == heads else (1 if v == 1 else 2)
        elif k.endswith("_token_id") and v >= VOCAB - 8:
            out[k] = VOCAB - 8 + sum(map(ord, k)) % 8
    return out


def _model_classes(mod):
    """PreTrainedModel classes defined in a modeling module, causal LMs first."""
    order = ("ForCausalLM", "ForConditionalGeneration", "TextModel", "Model")
    ranked = []
    for c in vars(mod).values():
        if isinstance(c, type) and issubclass(c, PreTrainedModel) and c.__module__ == mod.__name__:
            for i, suffix in enumerate(order):
                if c.__name__.endswith(suffix):
                    ranked.append((i, c.__name__, c))
                    break
    return [c for _, _, c in sorted(ranked)]


def build_tiny(info, max_params=6_000_000, max_probe_s=1.5):
    """(model, None) or (None, reason): the first model class of the family that builds tiny, contains
    the experts class and runs a forward pass on input ids."""
    mod = importlib.import_module(info.module)
    experts_cls = getattr(mod, info.class_name)
    errors = []
    for cls in _model_classes(mod):
        cfg_cls = getattr(cls, "config_class", None)
        if cfg_cls is None:
            continue
        for pick in ("ends", "head"):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cfg = cfg_cls(**shrink_config_kwargs(cfg_cls, cfg_cls().to_dict(), pick))
                    with torch.device("meta"):
                        meta = cls._from_config(cfg, experts_implementation="eager", dtype=torch.float32)
                    n = sum(p.numel() for p in meta.parameters())
                    if not any(isinstance(m, experts_cls) for m in meta.modules()):
                        errors.append(f"{cls.__name__}[{pick}]: no {info.class_name} in the shrunk model")
                        continue
                    if n > max_params:
                        errors.append(f"{cls.__name__}[{pick}]: {n / 1e6:.1f}M parameters after shrinking")
                        continue
                    torch.manual_seed(0)
                    model = cls._from_config(cfg, experts_implementation="eager", dtype=torch.float32).eval()
                    t0 = time.perf_counter()
                    model(input_ids=_ids(model, 1, 4), use_cache=False)
                    secs = time.perf_counter() - t0
                if secs > max_probe_s:  # e.g. linear-attention layers on transformers' pure-PyTorch fallback
                    return None, f"{cls.__name__}: a 4-token forward takes {secs:.1f} s on this CPU (too slow for CI)"
                return model, None
            except Exception as e:  # the reason is reported, not swallowed
                errors.append(f"{cls.__name__}[{pick}]: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return None, "; ".join(errors[:3]) or "no model class with a config class"


def _ids(model, batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 8, (batch, seq), generator=g)


def _experts_modules(model, info):
    cls = getattr(importlib.import_module(info.module), info.class_name)
    return [m for m in model.modules() if isinstance(m, cls)]


def _tighten_limits(experts):
    """Mapped (clamped) experts: lower the clamp so this tiny random model actually clips."""
    for m in experts:
        plan = hf.experts_plan(m)
        if plan.kind == "mapped":
            setattr(m, plan.limit_attr, 0.05)


def _run(model, impl, ids, out_proj_seed=1):
    """(logits, experts outputs, parameter grads) of one fwd+bwd with `impl`."""
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    captured = []
    hooks = [m.register_forward_hook(lambda mod, args, out: captured.append(out)) for m in model._mok_experts]
    try:
        out = model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    g = torch.Generator().manual_seed(out_proj_seed)
    dy = torch.randn(logits.shape, generator=g).to(logits.device)
    (logits * dy).sum().backward()  # a dense, non-stride-0 gradient
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return logits.detach(), [c.detach() for c in captured], grads


def _count_mok_calls(monkeypatch):
    calls = []
    real = hf._moe

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "_moe", counting)
    return calls


def _experts_check(module, dtype, device="cpu"):
    """Call one experts module directly with "mok" in `dtype` against its own eager forward in float64 on the
    same (dtype-rounded) inputs and weights: relative errors of [output, d_x, d_param for each parameter].
    Inputs are drawn on the CPU and moved to `device` (the module is copied there)."""
    import copy

    weight = module.gate_up_proj if module.has_gate else module.up_proj
    E = weight.shape[0]
    hidden = weight.shape[1] if module.is_transposed else weight.shape[2]
    T, K = 12, min(2, E)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, hidden, generator=g)
    top = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # distinct experts per token
    w = torch.rand(T, K, generator=g).softmax(-1)
    dy = torch.randn(T, hidden, generator=g)
    x, top, w, dy = (t.to(device) for t in (x, top, w, dy))

    def run(mod, impl, run_dtype):
        mod = mod.to(run_dtype)
        mod.config._experts_implementation = impl
        xx = x.to(dtype).to(run_dtype).requires_grad_()
        y = mod(xx, top, w.to(dtype).to(run_dtype))
        y.backward(dy.to(dtype).to(run_dtype))
        grads = [xx.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in mod.parameters()]
        for p in mod.parameters():
            p.grad = None
        return [y.detach()] + [t.detach() for t in grads]

    module = copy.deepcopy(module).to(device)
    plan = hf.experts_plan(module)
    if plan.kind == "mapped":  # clip about 5% of the pre-activations (rounding moves only a few across)
        fc1 = module.gate_up_proj.transpose(1, 2) if module.is_transposed else module.gate_up_proj
        setattr(module, plan.limit_attr, 2.0 * float(torch.einsum("th,eoh->teo", x, fc1.detach()).std()))
    keep = module.config._experts_implementation
    rounded = copy.deepcopy(module).to(dtype)  # the reference runs on the same rounded weights
    try:
        ref = run(rounded, "eager", torch.float64)
        got = run(module, "mok", dtype)
    finally:
        module.config._experts_implementation = keep
    return [rel_err(a, b) for a, b in zip(got, ref)]


def _experts_bf16_check(module):
    return _experts_check(module, torch.bfloat16)


def build_experts_only(info):
    """(experts module, None) or (None, reason): the experts class alone, from a shrunk config of its family
    (for families whose whole model cannot be built cheaply), with random weights at 1/sqrt(fan-in)."""
    from transformers import PreTrainedConfig

    mod = importlib.import_module(info.module)
    experts_cls = getattr(mod, info.class_name)
    try:
        cfg_mod = importlib.import_module(info.module.replace(".modeling_", ".configuration_"))
    except ImportError as e:
        return None, f"no configuration module ({e})"
    cfg_classes = [c for c in vars(cfg_mod).values()
                   if isinstance(c, type) and issubclass(c, PreTrainedConfig) and c.__module__ == cfg_mod.__name__]
    errors = []
    for c in sorted(cfg_classes, key=lambda c: ("Text" not in c.__name__, c.__name__)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = c(**shrink_config_kwargs(c, c().to_dict(), "ends"))
                torch.manual_seed(0)
                m = experts_cls(cfg)
            m.config._experts_implementation = "eager"
            g = torch.Generator().manual_seed(11)
            with torch.no_grad():
                for p in m.parameters():
                    fan_in = p.shape[1] if (m.is_transposed and p.dim() == 3) else p.shape[-1]
                    p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() < 3 else fan_in**-0.5))
            if sum(p.numel() for p in m.parameters()) > 2_000_000:
                errors.append(f"{c.__name__}: experts too large after shrinking")
                continue
            return m, None
        except Exception as e:
            errors.append(f"{c.__name__}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    return None, "; ".join(errors[:2]) or "no config class"


# ---------------------------------------------------------------------------------------------
# Registration


def test_registered_in_experts_interface():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    assert hf.is_registered()
    assert ExpertsInterface._global_mapping["mok"] is hf.mok_experts_forward
    assert "mok" in ALL_EXPERTS_FUNCTIONS
    for name in ("grouped_mm", "batched_mm"):  # the rest of the interface is untouched
        assert ExpertsInterface._global_mapping[name] is not hf.mok_experts_forward


# In a fresh process: the rule of the module docstring, step by step.
_REGISTRATION_SCRIPT = r"""
import sys
hooks = list(sys.meta_path)
import mok_inductor
assert "transformers" not in sys.modules, "import mok_inductor imported transformers"
assert sys.meta_path == hooks, "import mok_inductor changed sys.meta_path"
from mok_inductor.integrations import transformers as hf
assert "transformers" not in sys.modules, "importing the integration imported transformers"
assert sys.meta_path == hooks, "importing the integration changed sys.meta_path"
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import ExpertsInterface
assert "mok" not in ExpertsInterface._global_mapping and not hf.is_registered(), "registered without enable()"
cfg = Qwen3MoeConfig(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                     num_experts_per_tok=2, vocab_size=32)
try:
    Qwen3MoeForCausalLM._from_config(cfg, experts_implementation="mok")
    raise AssertionError("experts_implementation='mok' was accepted before enable()")
except (ValueError, KeyError):
    pass
mok_inductor.enable()
assert ExpertsInterface._global_mapping["mok"] is hf.mok_experts_forward and hf.is_registered()
m = Qwen3MoeForCausalLM._from_config(cfg, experts_implementation="mok")
assert m.config._experts_implementation == "mok"
print("OK")
"""


def test_registration_rule_in_a_fresh_process():
    """`import mok_inductor` neither imports transformers nor touches sys.meta_path, importing the integration
    registers nothing, and `mok_inductor.enable()` makes experts_implementation="mok" available."""
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", _REGISTRATION_SCRIPT], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_register_is_idempotent_and_explicit(monkeypatch):
    """register() and register_if_installed() (what enable() calls) register the one name, and again is a no-op."""
    from transformers.integrations.moe import ExpertsInterface

    monkeypatch.delitem(ExpertsInterface._global_mapping, "mok")  # restored by monkeypatch afterwards
    assert not hf.is_registered()
    before = dict(ExpertsInterface._global_mapping)
    assert hf.register_if_installed()
    assert hf.is_registered() and ExpertsInterface._global_mapping["mok"] is hf.mok_experts_forward
    hf.register()
    assert hf.register_if_installed()
    assert dict(ExpertsInterface._global_mapping) == {**before, "mok": hf.mok_experts_forward}


def test_register_if_installed_without_transformers(monkeypatch):
    """Without transformers installed, enable()'s registration step does nothing and says so; register() raises
    an ImportError telling what to install."""
    for name in [n for n in sys.modules if n == "transformers" or n.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, name)  # every one restored by monkeypatch afterwards
    # None in sys.modules: find_spec("transformers") is None and `import transformers...` raises ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert hf.register_if_installed() is False
    assert not hf.is_registered()
    with pytest.raises(ImportError, match="pip install transformers"):
        hf.register()


def test_unknown_name_still_rejected():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, vocab_size=32)
    m = Qwen3MoeForCausalLM._from_config(cfg, experts_implementation="mok")
    with pytest.raises(ValueError, match="not supported"):
        m.set_experts_implementation("mok-typo")


# ---------------------------------------------------------------------------------------------
# The family matrix (eager only)

_DISCOVERED = hf.discover_experts_classes()


def test_discovery_finds_the_decorated_classes():
    # cross-check the text scan against the imported classes: each is really decorated
    assert _DISCOVERED, "no @use_experts_implementation class found in the installed transformers"
    for info in _DISCOVERED:
        cls = getattr(importlib.import_module(info.module), info.class_name)
        assert "_apply_gate" in dir(cls), f"{info.class_name}: not wrapped by @use_experts_implementation"
        assert cls.forward.__wrapped__ is not None
    # the decorator arguments are read: at least one family with each non-default flag exists in 5.17+
    flags = {k for info in _DISCOVERED for k in info.decorator_args}
    assert {"has_bias", "is_transposed", "has_gate"} <= flags


def test_family_matrix_fp32_and_bf16(monkeypatch, capsys):
    """Every discovered experts class: mok == eager (fp32 logits, experts outputs and all grads at 1e-4;
    bf16 experts call against float64 eager at 1e-2), or a declared fallback that also equals eager."""
    hf._WARNED.clear()
    calls = _count_mok_calls(monkeypatch)
    rows, failures, unbuilt = [], [], []
    for info in _DISCOVERED:
        name = f"{info.model_type}/{info.class_name}"
        t0 = time.perf_counter()
        model, why = build_tiny(info)
        if model is None:
            row, problem, why2 = _experts_only_row(info, name, why, calls)
            if row is None:
                unbuilt.append((name, f"{why} | experts alone: {why2}"))
            else:
                rows.append(row + (time.perf_counter() - t0,))
                if problem:
                    failures.append(problem)
            continue
        experts = _experts_modules(model, info)
        model._mok_experts = experts
        _tighten_limits(experts)
        plans = {hf.experts_plan(m) for m in experts}
        plan = next(iter(plans))
        ids = _ids(model, 2, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ref = _run(model, "eager", ids)
            n_before = len(calls)
            hf._PLANS.clear()  # re-plan so the one-time warning (if any) is issued inside this block
            hf._WARNED.clear()
            got = _run(model, "mok", ids)
        mok_calls = len(calls) - n_before
        fell_back = [w for w in caught if info.class_name in str(w.message) and "falls back" in str(w.message)]
        errs = {"logits": rel_err(got[0], ref[0])}
        errs["experts_out"] = max((rel_err(a, b) for a, b in zip(got[1], ref[1])), default=0.0)
        # a gradient that is only rounding noise (e.g. a router that receives none) is not compared relatively
        floor = 1e-6 * max(float(g.norm()) for g in ref[2].values())
        errs["grads"] = max(rel_err(got[2][n], g, floor) for n, g in ref[2].items())
        problems = [f"{k} rel err {v:.2e}" for k, v in errs.items() if not v <= 1e-4]
        if len(got[1]) == 0:
            problems.append("no experts call ran")
        if plan.supported:
            if mok_calls == 0 or fell_back:
                problems.append(f"supported but mok ran {mok_calls} times / warned {len(fell_back)}")
            bf = _experts_bf16_check(experts[0])
            errs["bf16"] = max(bf)
            if not max(bf) <= 1e-2:
                problems.append(f"bf16 experts rel errs {['%.1e' % e for e in bf]}")
        else:
            if mok_calls != 0 or len(fell_back) != 1:
                problems.append(f"unsupported but mok ran {mok_calls} times / warned {len(fell_back)} times")
        if plan.kind == "mapped":
            clipped = _clip_fraction(model, experts, ids, plan)
            if not clipped > 0.0:
                problems.append("the mapped clamp never clipped in this test")
        rows.append((name, plan.kind, plan.reason or (f"swiglu_limit <- {plan.limit_attr}" if plan.limit_attr else ""),
                     errs, time.perf_counter() - t0))
        if problems:
            failures.append(f"{name} ({plan.kind}): " + "; ".join(problems))
        del model

    with capsys.disabled():
        print("\n[transformers matrix] family/class | kind | note | max rel errs")
        for name, kind, note, errs, secs in rows:
            e = " ".join(f"{k}={v:.1e}" for k, v in errs.items())
            print(f"  {name:55s} {kind:11s} {secs:5.1f}s {e}  {note}")
        for name, why in unbuilt:
            print(f"  {name:55s} NOT BUILT   {why}")
    for name, why in unbuilt:
        warnings.warn(f"transformers matrix: {name} not instantiated cheaply: {why}")
    assert not failures, "\n".join(failures)
    assert rows, "no family could be built"
    kinds = {row[1] for row in rows}
    # the matrix exercises all three outcomes (plain SwiGLU, a mapped clamp, a fallback)
    assert {"supported", "mapped", "unsupported"} <= kinds, kinds


def _experts_only_row(info, name, why_model, calls):
    """Matrix row for a family whose model is not built: its experts module alone, fp32 and bf16."""
    m, why = build_experts_only(info)
    if m is None:
        return None, None, why
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf._PLANS.clear()
        hf._WARNED.clear()
        plan = hf.experts_plan(m)
        n_before = len(calls)
        fp32 = _experts_check(m, torch.float32)
        mok_calls = len(calls) - n_before
        bf16 = _experts_check(m, torch.bfloat16) if plan.supported else None
    warned = [w for w in caught if info.class_name in str(w.message) and "falls back" in str(w.message)]
    errs = {"experts_fp32": max(fp32)}
    problems = [] if max(fp32) <= 1e-4 else [f"experts fp32 rel errs {['%.1e' % e for e in fp32]}"]
    if bf16 is not None:
        errs["bf16"] = max(bf16)
        if not max(bf16) <= 1e-2:
            problems.append(f"bf16 experts rel errs {['%.1e' % e for e in bf16]}")
    if plan.supported and mok_calls == 0:
        problems.append("supported but mok never ran")
    if not plan.supported and (mok_calls != 0 or len(warned) != 1):
        problems.append(f"unsupported but mok ran {mok_calls} times / warned {len(warned)} times")
    note = plan.reason or (f"swiglu_limit <- {plan.limit_attr}" if plan.limit_attr else "")
    note = f"experts module only (model not built: {why_model[:90]}...) {note}"
    problem = f"{name} ({plan.kind}, experts only): " + "; ".join(problems) if problems else None
    return (name, plan.kind, note, errs), problem, None


def _clip_fraction(model, experts, ids, plan):
    """Fraction of gate/up pre-activations beyond the clamp in the experts of a mapped family."""
    seen = []

    def pre(mod, args):
        x = args[0]
        w = mod.gate_up_proj.transpose(1, 2) if mod.is_transposed else mod.gate_up_proj
        pre_act = torch.einsum("th,eoh->teo", x.float(), w.float())
        seen.append(float((pre_act.abs() > getattr(mod, plan.limit_attr)).float().mean()))

    hooks = [m.register_forward_pre_hook(pre) for m in experts]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return max(seen, default=0.0)


def test_plan_classifies_by_what_the_experts_compute():
    """Declared variants, on real experts modules: plain SwiGLU, a clamp mapped onto swiglu_limit (GPT-OSS: its
    activation and biases too), and what must fall back (no gate, non-SiLU activations, soft-caps, post-expert
    norms)."""
    by_type = {}
    for info in _DISCOVERED:
        by_type.setdefault(info.model_type, []).append(info)
    expect = {"qwen3_moe": "supported", "mixtral": "supported", "deepseek_v4": "mapped", "hy_v4": "mapped",
              "gpt_oss": "mapped", "nemotron_h": "unsupported", "inkling2": "unsupported"}
    for model_type, kind in expect.items():
        if model_type not in by_type:  # an older transformers without this family
            continue
        for info in by_type[model_type]:
            # the plan needs the model built; build_tiny's CI speed budget (one probe forward) does not apply
            model, why = build_tiny(info, max_probe_s=60.0)
            assert model is not None, f"{model_type}: {why}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = hf.experts_plan(_experts_modules(model, info)[0])
            assert plan.kind == kind, (model_type, plan)


def test_gelu_gate_falls_back():
    """A GeGLU experts module (Gemma 4 style: the default gate with act_fn=gelu) is declared unsupported."""
    from transformers.activations import ACT2FN

    info = next(i for i in _DISCOVERED if i.model_type == "qwen3_moe")
    model, why = build_tiny(info)
    assert model is not None, why
    m = _experts_modules(model, info)[0]
    m.act_fn = ACT2FN["gelu_pytorch_tanh"]
    with pytest.warns(UserWarning, match="falls back"):
        hf._WARNED.clear()
        plan = hf.experts_plan(m)
    assert plan.kind == "unsupported" and "GELU" in plan.reason


def test_expert_parallel_sentinels_are_no_routes():
    info = next(i for i in _DISCOVERED if i.model_type == "qwen3_moe")
    model, why = build_tiny(info)
    assert model is not None, why
    m = _experts_modules(model, info)[0]
    E, H = m.gate_up_proj.shape[0], m.gate_up_proj.shape[2]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, H, generator=g)
    top = torch.randint(0, E, (6, 2), generator=g)
    top[::2, 1] = E  # routes owned by another rank
    w = torch.rand(6, 2, generator=g)
    w[::2, 1] = 0.0  # EP zeroes their weights
    m._is_expert_parallel = True
    got = hf.mok_experts_forward(m, x, top, w)
    kept = top.clone()
    kept[::2, 1] = 0
    w_kept = w.clone()
    m._is_expert_parallel = False
    ref = hf.mok_experts_forward(m, x, kept, w_kept)  # weight 0 on the stand-in route: same result
    assert rel_err(got, ref) <= 1e-6


# ---------------------------------------------------------------------------------------------
# Fallbacks: what runs what MoK cannot, where the warning points, what it says


def _tiny_qwen3_moe(dtype=torch.float32, seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                         vocab_size=32, head_dim=8)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM._from_config(cfg, experts_implementation="mok").to(dtype)


def _fallback_warnings(caught):
    return [w for w in caught if "falls back" in str(w.message)]


def test_float64_experts_fall_back_to_eager_and_match_it(monkeypatch):
    """grouped_mm raises on float64 ("Expected mat_a to be Float32, BFloat16 or Float16"): a float64 model with
    "mok" runs the class's own eager forward instead, forward and backward equal to "eager", one warning that
    names the test's line; grouped_mm never runs."""
    import transformers.integrations.moe as hf_moe

    def no_grouped_mm(*args, **kwargs):
        raise AssertionError("grouped_mm ran on float64 experts")

    monkeypatch.setattr(hf_moe, "grouped_mm_experts_forward", no_grouped_mm)
    model = _tiny_qwen3_moe(torch.float64, seed=int(torch.randint(0, 2**31, ())))
    ids = torch.randint(0, 32, (2, 7))
    hf._PLANS.clear()
    hf._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(ids).logits; line = sys._getframe().f_lineno  # noqa: E702 - the warning must name this line
        got.square().mean().backward()
    fell_back = _fallback_warnings(caught)
    assert len(fell_back) == 1, [str(w.message) for w in caught]  # once per class and reason, not per layer
    assert os.path.abspath(fell_back[0].filename) == os.path.abspath(__file__) and fell_back[0].lineno == line
    msg = str(fell_back[0].message)
    assert 'Qwen3MoeExperts falls back to "eager"' in msg and "float64" in msg and "model.to(torch.float32)" in msg
    experts = [m for m in model.modules() if hasattr(m, "down_proj") and hasattr(m, "has_bias")]
    assert all(hf.experts_plan(m).fallback == "eager" for m in experts)
    got_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_experts_implementation("eager")
    ref = model(ids).logits
    ref.square().mean().backward()
    assert ref.dtype == torch.float64
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for g, p in zip(got_grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
    # cast to a dtype MoK takes, the same module is planned again and runs on MoK
    model.float().set_experts_implementation("mok")
    assert all(hf.experts_plan(m).supported for m in experts)


def test_unsupported_gate_picks_the_fallback_by_dtype():
    """An unsupported gate (GeGLU) runs on grouped_mm where grouped_mm takes the dtype and on eager where it
    does not; in float64 the model's output equals eager's."""
    from transformers.activations import ACT2FN

    for dtype, fallback in ((torch.float32, "grouped_mm"), (torch.float64, "eager")):
        model = _tiny_qwen3_moe(dtype, seed=int(torch.randint(0, 2**31, ())))
        experts = [m for m in model.modules() if hasattr(m, "down_proj") and hasattr(m, "has_bias")]
        for m in experts:
            m.act_fn = ACT2FN["gelu_pytorch_tanh"]
        ids = torch.randint(0, 32, (2, 6))
        hf._WARNED.clear()
        with pytest.warns(UserWarning, match=f'falls back to "{fallback}"'):
            got = model(ids).logits
        assert all(hf.experts_plan(m).fallback == fallback for m in experts)
        model.set_experts_implementation("eager")
        tol = 0 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(got, model(ids).logits, rtol=tol, atol=tol)


def test_fallback_warning_names_the_callers_line_when_compiled():
    """The plan of a compiled first call is made while Dynamo traces: its warning still names the user's line
    (the compiled call), not a frame of mok_inductor, torch or transformers. Compiled, float64 experts run
    transformers' grouped_mm (its compiled path takes float64), so the graph stays whole (fullgraph=True)."""
    model = _tiny_qwen3_moe(torch.float64, seed=int(torch.randint(0, 2**31, ())))
    ids = torch.randint(0, 32, (1, 5))
    torch._dynamo.reset()
    hf._PLANS.clear()
    hf._WARNED.clear()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(ids).logits; line = sys._getframe().f_lineno  # noqa: E702
    fell_back = _fallback_warnings(caught)
    assert len(fell_back) == 1, [str(w.message) for w in caught]
    assert os.path.abspath(fell_back[0].filename) == os.path.abspath(__file__) and fell_back[0].lineno == line
    model.set_experts_implementation("eager")
    torch.testing.assert_close(got, model(ids).logits, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_fallback_messages_say_what_happened_and_what_to_do():
    """Each reason comes with what runs instead and what the user can do (or that MoK has no kernel for it)."""
    cases = {
        "float64": _experts_case(torch.float64, torch.float64),
        "mixed": _experts_case(torch.float32, torch.bfloat16),
        "quantized": _experts_case(None, None),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = {name: hf.experts_plan(case) for name, case in cases.items()}
    assert plans["float64"].fallback == "eager" and plans["mixed"].fallback == "grouped_mm"
    msg = hf.fallback_message("MyExperts", plans["float64"])
    assert msg.startswith('experts_implementation="mok": MyExperts falls back to "eager": MoK cannot run it because '
                          "its expert weights are float64 and MoK computes in float32, bfloat16 or float16")
    assert ("so the class's own eager forward (under torch.compile: transformers' grouped_mm, which takes this dtype "
            "only there) runs it instead.") in msg
    assert "To use MoK: cast the model to float32, bfloat16 or float16, e.g. model.to(torch.float32)" in msg
    assert msg.endswith('To silence this warning, set experts_implementation="eager" for this model.')
    msg = hf.fallback_message("MyExperts", plans["mixed"])
    assert "gate_up_proj is float32 but down_proj is bfloat16" in msg and "cast both to one dtype" in msg
    assert 'transformers\' "grouped_mm" experts function runs it instead' in msg
    assert "dequantize the experts" in hf.fallback_message("MyExperts", plans["quantized"])
    no_kernel = hf.ExpertsPlan(False, reason="its gate is not SwiGLU", fallback="grouped_mm")
    msg = hf.fallback_message("MyExperts", no_kernel)
    assert "MoK has no kernel for what these experts compute" in msg and "To use MoK" not in msg
    assert "(MoK takes one float dtype)" not in "".join(hf.fallback_message("M", p) for p in plans.values())


def _experts_case(gate_up_dtype, down_dtype):
    """A minimal @use_experts_implementation module: weights of the given dtypes (None: no float weights, as
    quantized storage has)."""
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class MyExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.act_fn = torch.nn.SiLU()
            if gate_up_dtype is not None:
                self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 4, dtype=gate_up_dtype))
                self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 4, dtype=down_dtype))
            else:
                self.down_proj = torch.nn.Parameter(torch.randint(-8, 8, (2, 4, 4), dtype=torch.int8),
                                                    requires_grad=False)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError  # only planned here, never run

    return MyExperts(None)


# ---------------------------------------------------------------------------------------------
# CUDA helpers (the CUDA tests are at the end of the module)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def triton_only(monkeypatch):
    """The CUDA path runs the Triton kernels and never the reference: counts the calls of
    mok_inductor.kernels' build_schedule / forward / backward / decode_forward, and makes every call of
    mok_inductor.reference's build_schedule / moe_forward / moe_backward fail the test."""
    from mok_inductor import kernels, ops, reference

    assert ops.use_triton(torch.empty(1, device="cuda")), "use_triton is False for CUDA tensors (options.backend?)"
    assert ops.kernels_module() is kernels
    calls = {"schedule": 0, "forward": 0, "backward": 0, "decode": 0}
    for kname, rname, key in (("build_schedule", "build_schedule", "schedule"), ("forward", "moe_forward", "forward"),
                              ("backward", "moe_backward", "backward"), ("decode_forward", "moe_forward", "decode")):
        def counted(*args, _real=getattr(kernels, kname), _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        def refused(*args, _name=rname, **kwargs):
            raise AssertionError(f"mok_inductor.reference.{_name} ran on the CUDA path")

        monkeypatch.setattr(kernels, kname, counted)
        monkeypatch.setattr(reference, rname, refused)
    return calls


# ---------------------------------------------------------------------------------------------
# torch.compile (fullgraph) forward and backward; generate


def _tiny_qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                         vocab_size=VOCAB, shared_expert_intermediate_size=24)
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM._from_config(cfg, experts_implementation="mok")


def _train_text_example():
    if "train_text" not in sys.modules:
        path = os.path.join(REPO, "examples", "train_text.py")
        spec = importlib.util.spec_from_file_location("train_text", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["train_text"] = mod  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(mod)
    return sys.modules["train_text"]


def _model_and_loss(kind):
    """A one-layer model of the training example's tiny preset (or a Qwen2-MoE of that size), its loss function
    (forward + causal-LM loss, what the example compiles) and a batch of random token ids."""
    ex = _train_text_example()
    if kind == "qwen3_moe":
        sizes = dict(ex.PRESETS["tiny"].model, num_hidden_layers=1)
        model = ex.build_model(sizes, torch.float32, "cpu", seed=0, seq=32)
    elif kind == "gpt_oss":  # its activation, the expert biases, the interleaved checkpoint-layout weights
        model = _tiny_gpt_oss(seed=6)
    else:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                             vocab_size=VOCAB, shared_expert_intermediate_size=24)
        torch.manual_seed(0)
        model = Qwen2MoeForCausalLM._from_config(cfg, experts_implementation="eager")
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(5))
    return model.train(), ex.make_loss_fn(model), ids


def _eager_loss_and_grads(model, loss_fn, ids):
    """The loss and every parameter's gradient of one eager HF step ("eager" experts), gradients then cleared."""
    model.set_experts_implementation("eager")
    loss = loss_fn(ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _graph_capturing_backend(codes):
    """torch.compile backend: AOTAutograd (forward and backward graphs), run eagerly, code kept."""
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        codes.append(gm.code)
        return gm.forward

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


@pytest.mark.parametrize(
    "kind,backend",
    [
        pytest.param("qwen3_moe", "inductor", marks=pytest.mark.slow),  # what examples/train_text.py compiles
        ("qwen2_moe", "aot_autograd"),  # shared expert + gate around the experts; Dynamo + AOT, no codegen (CPU time)
        ("gpt_oss", "aot_autograd"),  # the expert biases' gradients included
    ],
)
def test_compiled_fullgraph_forward_backward(kind, backend):
    """torch.compile(fullgraph=True) of forward + loss, and its compiled backward, with "mok": the
    compiled forward/backward call mok::moe_fwd / mok::moe_bwd, and the loss and every gradient equal eager HF."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model, loss_fn, ids = _model_and_loss(kind)
    ref_loss, ref_grads = _eager_loss_and_grads(model, loss_fn, ids)

    model.set_experts_implementation("mok")
    codes = []
    if backend == "inductor":
        compiled = torch.compile(loss_fn, fullgraph=True)
    else:
        compiled = torch.compile(loss_fn, fullgraph=True, backend=_graph_capturing_backend(codes))

    def step(input_ids):
        loss = compiled(input_ids)
        loss.backward()
        return loss.detach()

    with mok_inductor.enabled():  # what a process compiling "mok" models installs (the cache key above all)
        if backend == "inductor":
            loss, codes = run_and_get_code(step, ids)
        else:
            loss = step(ids)
    assert any("mok.moe_fwd" in c for c in codes), "the compiled forward does not call mok::moe_fwd"
    assert any("mok.moe_bwd" in c for c in codes), "the compiled backward does not call mok::moe_bwd"
    assert rel_err(loss, ref_loss) <= 1e-4
    params = dict(model.named_parameters())
    assert any("experts" in n for n in ref_grads)
    for n, g in ref_grads.items():
        assert params[n].grad is not None, n
        assert rel_err(params[n].grad, g) <= 1e-4, (n, rel_err(params[n].grad, g))
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["gpt_oss", "qwen3_moe"])
def test_compiled_dynamic_first_call_survives_a_restarted_trace(kind):
    """torch.compile(dynamic=True) of a model whose experts plans are first decided while Dynamo traces (no
    prepare()): Dynamo restarts the analysis of the frame (here to specialise floats it had made symbolic, such
    as GPT-OSS's limit), and the restarted trace must take the path of the first attempt. It did not when the
    traced code took the plan stored by the first attempt (SpeculationLogDivergence). Loss and gradients equal
    eager mok at two sequence lengths."""
    model, loss_fn, ids = _model_and_loss(kind)
    model.set_experts_implementation("mok")
    hf._PLANS.clear()
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="aot_eager", dynamic=True)
    for length in (16, 24):
        batch = ids[:, :length]
        loss = compiled(batch)
        loss.backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        want_loss = loss_fn(batch)
        want_loss.backward()
        assert rel_err(loss.detach(), want_loss.detach()) <= 1e-5
        for n, p in model.named_parameters():
            if p.grad is not None:
                assert rel_err(got[n], p.grad) <= 1e-4, n
        model.zero_grad(set_to_none=True)
    torch._dynamo.reset()


def test_compiled_fallback_is_fullgraph_and_warns():
    """An unsupported experts module (Qwen3-MoE's with a GELU gate, as Gemma 4 has) under
    torch.compile(fullgraph=True) with "mok": the plan is made eagerly at trace time (one warning), the graph
    holds transformers' grouped_mm path and no mok op, and the result equals eager."""
    from transformers.activations import ACT2FN

    info = next(i for i in _DISCOVERED if i.model_type == "qwen3_moe")
    model, why = build_tiny(info)
    assert model is not None, why
    for m in _experts_modules(model, info):
        m.act_fn = ACT2FN["gelu_pytorch_tanh"]
    ids = _ids(model, 2, 8, seed=4)
    model.set_experts_implementation("eager")
    ref = model(input_ids=ids, use_cache=False).logits
    # transformers' own "grouped_mm" path, what the fallback runs: in float32 on the CPU it is transformers'
    # grouped_mm_fallback op, whose backward formula transformers 5.17 + torch 2.11 cannot compile
    # (a data-dependent guard). Where it cannot, the fallback must fail the same way, not differently.
    torch._dynamo.reset()
    model.set_experts_implementation("grouped_mm")
    try:
        torch.compile(model, fullgraph=True, backend=_graph_capturing_backend([]))(input_ids=ids, use_cache=False)
        theirs = None
    except Exception as e:  # noqa: BLE001 - recorded and compared below
        theirs = e
    torch._dynamo.reset()
    hf._PLANS.clear()
    hf._WARNED.clear()
    model.set_experts_implementation("mok")
    codes = []
    compiled = torch.compile(model, fullgraph=True, backend=_graph_capturing_backend(codes))
    if theirs is not None:
        with pytest.warns(UserWarning, match="Qwen3MoeExperts falls back"), pytest.raises(type(theirs)):
            compiled(input_ids=ids, use_cache=False)
        torch._dynamo.reset()
        return
    with pytest.warns(UserWarning, match="Qwen3MoeExperts falls back"):
        got = compiled(input_ids=ids, use_cache=False).logits
    assert codes and not any("mok.moe" in c for c in codes)
    assert any("grouped_mm" in c for c in codes)
    assert rel_err(got, ref) <= 1e-4
    torch._dynamo.reset()


def _tiny_gpt_oss(seed=0):
    """A tiny GPT-OSS (sliding and full attention layers, 4 experts, top-2) with random biases: the model's init
    leaves the expert biases zero, a checkpoint's are not."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            ex = layer.mlp.experts
            for b in (ex.gate_up_proj_bias, ex.down_proj_bias):
                b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    return model


def test_gpt_oss_experts_run_natively(monkeypatch):
    """GptOssExperts (interleaved, transposed gate_up_proj [E, H, 2I] with its bias, down_proj [E, I, H] with its
    bias, clamp 7, alpha 1.702) runs on mok in its checkpoint layout, no fallback: output, d x and every
    parameter's gradient against the module's own eager forward in float64, float32 within 1e-4 and bfloat16
    within 1e-2 (the clamp set to clip about 5% of the pre-activations, `_experts_check`)."""
    calls = _count_mok_calls(monkeypatch)
    model = _tiny_gpt_oss()
    ex = model.model.layers[0].mlp.experts
    hf._PLANS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        plan = hf.experts_plan(ex)
    assert plan.supported and plan.activation == "gpt_oss" and plan.limit_attr == "limit", plan
    fp32 = _experts_check(ex, torch.float32)
    assert calls, "mok never ran"
    bf16 = _experts_check(ex, torch.bfloat16)
    assert max(fp32) <= 1e-4, fp32
    assert max(bf16) <= 1e-2, bf16


def test_gpt_oss_alpha_changed_after_the_first_call_is_seen():
    """The cached plan is keyed on what the gate reads: a GptOssExperts whose alpha is changed after a first mok
    call is probed again (MoK's "gpt_oss" is alpha 1.702: it falls back) and equals its own eager forward, not
    the stale plan's 1.702."""
    model = _tiny_gpt_oss(seed=2)
    ex = model.model.layers[0].mlp.experts
    hf._PLANS.clear()
    hf._WARNED.clear()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, ex.gate_up_proj.shape[1], generator=g)
    idx = torch.randint(0, ex.num_experts, (6, 2), generator=g)
    w = torch.rand(6, 2, generator=g)
    assert hf.experts_plan(ex).activation == "gpt_oss"
    hf.mok_experts_forward(ex, x, idx, w)
    ex.alpha = 1.0
    with pytest.warns(UserWarning, match="alpha = 1.0"):
        got = hf.mok_experts_forward(ex, x, idx, w)
    assert not hf.experts_plan(ex).supported
    model.set_experts_implementation("eager")
    torch.testing.assert_close(got, ex(x, idx, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_generate_with_mok_matches_eager(device, family, request):
    """Greedy generate (prefill + decode through "mok"; GPT-OSS: its activation, biases and interleaved weights):
    the tokens equal eager's. On CUDA the Triton kernels serve every step and the reference never runs."""
    calls = request.getfixturevalue("triton_only") if device == "cuda" else None
    model = (_tiny_qwen2_moe() if family == "qwen2_moe" else _tiny_gpt_oss(seed=3)).eval().to(device)
    ids = _ids(model, 2, 5, seed=9).to(device)
    outs = {}
    for impl in ("eager", "mok"):
        model.set_experts_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert outs["mok"].shape == (2, 11)
    assert torch.equal(outs["mok"], outs["eager"])
    if calls is not None:  # prefill (grouped kernels) and 5 decode steps (2 tokens x 2 routes: the decode forward)
        assert calls["forward"] >= 2 and calls["decode"] >= 2 * 5 and calls["backward"] == 0, calls


def test_prepare_stores_plans_that_compiled_code_reads(monkeypatch):
    """prepare() decides every experts module's plan eagerly; a traced call then gets it from the cache and never
    runs the probe."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                         vocab_size=32, head_dim=8)
    model = Qwen3MoeForCausalLM._from_config(cfg, experts_implementation="mok")
    assert hf.prepare(model) == 2
    experts = [m for m in model.modules() if hasattr(m, "down_proj") and hasattr(m, "has_bias")]
    assert all(hf._PLANS[m][1].supported for m in experts)

    def no_probe(module):
        raise AssertionError("the plan was recomputed while tracing")

    monkeypatch.setattr(hf, "_compute_plan", no_probe)
    torch._dynamo.reset()
    ids = torch.randint(0, 32, (1, 5))
    got = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
    torch.testing.assert_close(got, model(ids).logits, rtol=0, atol=0)


def test_shard_experts_refuses_a_model_not_on_mok_and_a_second_call():
    """shard_experts on a model whose experts run another implementation would shard weights that nothing sends
    tokens for (its forward then failed deep inside transformers), and a second call would shard the shards: both
    are errors naming the module (a one-rank gloo group)."""
    import torch.distributed as dist
    from _helpers import init_gloo

    owned = not dist.is_initialized()
    if owned:
        init_gloo()
    try:
        model = _tiny_qwen3_moe()
        model.set_experts_implementation("eager")
        with pytest.raises(ValueError, match=r'^model\.layers\.0\.mlp\.experts: its experts run '
                                             r'experts_implementation="eager"; shard_experts needs "mok"'):
            hf.shard_experts(model, dist.group.WORLD)
        model.set_experts_implementation("mok")
        assert len(hf.shard_experts(model, dist.group.WORLD)) == 4
        with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.experts: its experts are sharded already"):
            hf.shard_experts(model, dist.group.WORLD)
    finally:
        model = None  # (the sharded experts hold the group: freed before it is destroyed)
        import gc

        gc.collect()
        if owned:
            dist.destroy_process_group()


@pytest.mark.parametrize("strict", [False, True])
def test_export_without_prepare_decides_the_plan_and_holds_the_op(strict):
    """torch.export of a fresh "mok" model (no eager call, no prepare()): the plan is decided outside the trace
    (non-strict export traces with a mode Dynamo's folding does not cover: the probe's comparison would be a
    data-dependent branch), the program holds a mok::moe per layer and equals eager at another length."""
    model = _tiny_qwen3_moe(seed=3).eval()
    for m in model.modules():  # experts that matter next to the residual stream
        if hasattr(m, "down_proj") and hasattr(m, "has_bias"):
            m.down_proj.data.mul_(20)
    assert not any(m in hf._PLANS for m in model.modules())

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 32, (1, 8), generator=gen)
    seq = torch.export.Dim("seq", min=2, max=64)
    ep = torch.export.export(Logits(model), (ids,), dynamic_shapes=({1: seq},), strict=strict)
    assert sum(n.target is torch.ops.mok.moe.default for n in ep.graph.nodes) == 2
    other = torch.randint(0, 32, (1, 13), generator=gen)
    torch.testing.assert_close(ep.module()(other), Logits(model)(other), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without CUDA): the Triton kernels, eagerly and under Inductor

# a representative subset of the matrix, as far as the installed transformers has it: plain SwiGLU (Qwen3-MoE,
# Mixtral, OLMoE), a gated shared expert around the experts (Qwen2-MoE), ungated shared experts and a grouped
# router (DeepSeek-V3), and the first family whose clamped SwiGLU maps onto swiglu_limit
_HAVE = {info.model_type for info in _DISCOVERED}
_CUDA_FAMILIES = [t for t in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
                  if t in _HAVE]
_CUDA_FAMILIES += [t for t in ("deepseek_v4", "hy_v4") if t in _HAVE][:1]


def _bf16_errors(got, ref, gold):
    """bf16 "mok" (`got`) and bf16 "eager" (`ref`) against an fp32 run on the same bf16-rounded weights (`gold`),
    each a `_run` triple: {name: (mok's error, eager's own error)}. Gradients below 1e-3 of the largest one
    (rounding noise, e.g. a router that receives none) are measured against that floor, not relatively."""
    out = {"logits": (rel_err(got[0], gold[0]), rel_err(ref[0], gold[0]))}
    for i, (a, r, b) in enumerate(zip(got[1], ref[1], gold[1])):
        out[f"experts_out[{i}]"] = (rel_err(a, b), rel_err(r, b))
    floor = 1e-3 * max(float(g.norm()) for g in gold[2].values())
    for n, b in gold[2].items():
        out[n] = (rel_err(got[2][n], b, floor), rel_err(ref[2][n], b, floor))
    return out


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("model_type", _CUDA_FAMILIES)
def test_cuda_eager_family(model_type, dtype, triton_only):
    """One family of the matrix on CUDA, through the Triton kernels (the reference never runs). float32: "mok"
    equals "eager" in logits, every experts output and every parameter gradient at 1e-4 (the CPU matrix's
    rule), and a direct experts call against float64 eager at 1e-4. bfloat16: the direct experts call against
    float64 eager at 1e-2 (the CPU matrix's rule); logits, experts outputs and gradients of the whole model
    against an fp32 copy on the same rounded weights within 2x bf16 eager's own error + 1e-3."""
    import copy

    info = next(i for i in _DISCOVERED if i.model_type == model_type)
    model, why = build_tiny(info, max_probe_s=60.0)
    assert model is not None, f"{model_type}: {why}"
    model = model.to("cuda")
    experts = _experts_modules(model, info)
    _tighten_limits(experts)
    plan = hf.experts_plan(experts[0])
    assert plan.supported, (model_type, plan)
    ids = _ids(model, 2, 8).cuda()

    direct = _experts_check(experts[0], dtype, device="cuda")
    assert max(direct) <= (1e-4 if dtype == torch.float32 else 1e-2), ["%.1e" % e for e in direct]
    n_fwd, n_bwd = triton_only["forward"], triton_only["backward"]
    assert n_fwd >= 1 and triton_only["backward"] >= 1 and triton_only["schedule"] >= 1, triton_only

    if dtype == torch.float32:
        model._mok_experts = experts
        ref = _run(model, "eager", ids)
        got = _run(model, "mok", ids)
        errs = {"logits": rel_err(got[0], ref[0])}
        for i, (a, b) in enumerate(zip(got[1], ref[1])):
            errs[f"experts_out[{i}]"] = rel_err(a, b)
        floor = 1e-6 * max(float(g.norm()) for g in ref[2].values())
        for n, g in ref[2].items():
            errs[n] = rel_err(got[2][n], g, floor)
        bad = {k: f"{v:.1e}" for k, v in errs.items() if not v <= 1e-4}
    else:
        gold = copy.deepcopy(model.to(torch.bfloat16)).float()  # the bf16-rounded weights, in fp32
        gold._mok_experts = _experts_modules(gold, info)
        model._mok_experts = experts
        ref32 = _run(gold, "eager", ids)
        ref = _run(model, "eager", ids)
        got = _run(model, "mok", ids)
        assert got[0].dtype == torch.bfloat16
        errs = _bf16_errors(got, ref, ref32)
        bad = {k: f"{a:.1e} (eager {b:.1e})" for k, (a, b) in errs.items() if not a <= 2 * b + 1e-3}
    assert len(got[1]) == len(ref[1]) >= len(experts), "not every experts module ran"
    assert triton_only["forward"] - n_fwd >= len(experts) <= triton_only["backward"] - n_bwd, triton_only
    assert any(".experts." in n for n in ref[2]), "no experts parameter has a gradient"
    assert not bad, bad
    if plan.kind == "mapped":
        assert _clip_fraction(model, experts, ids, plan) > 0.0, "the mapped clamp never clipped in this test"


@needs_cuda
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_cuda_compiled_fullgraph_forward_backward(kind, triton_only):
    """torch.compile(fullgraph=True) with Inductor of forward + loss and its backward, "mok", bf16 on CUDA: the
    output code launches our Triton kernels in the forward and in the backward, with no opaque
    torch.ops.mok.* fallback; the loss and every gradient are within 2x bf16 eager HF's own error + 1e-3 of an
    fp32 eager run on the same rounded weights."""
    import copy

    from torch._inductor.utils import run_and_get_code

    from mok_inductor import kernels

    torch._dynamo.reset()
    model, _, ids = _model_and_loss(kind)
    model = model.to("cuda", torch.bfloat16)
    ids = ids.cuda()
    loss_fn = _train_text_example().make_loss_fn(model)
    gold = copy.deepcopy(model).float()
    gold_loss_fn = _train_text_example().make_loss_fn(gold)

    loss32, grads32 = _eager_loss_and_grads(gold, gold_loss_fn, ids)
    ref_loss, ref_grads = _eager_loss_and_grads(model, loss_fn, ids)

    model.set_experts_implementation("mok")
    compiled = torch.compile(loss_fn, fullgraph=True)

    def step(input_ids):
        loss = compiled(input_ids)
        loss.backward()
        return loss.detach()

    with mok_inductor.enabled():  # what a process compiling "mok" models installs
        loss, codes = run_and_get_code(step, ids)
    names = {n for m in kernels.MODULES for n in dir(m) if n.endswith("_kernel")}
    assert len(codes) >= 2, "expected a forward and a backward module"
    assert {n for n in names if n in codes[0]}, f"no mok Triton kernel in the forward code ({sorted(names)})"
    assert {n for n in names if n in codes[-1]}, f"no mok Triton kernel in the backward code ({sorted(names)})"
    joined = "\n".join(codes)
    for op in ("torch.ops.mok.moe_fwd", "torch.ops.mok.moe_bwd", "torch.ops.mok.schedule"):
        assert op not in joined, f"{op} ran as an opaque fallback"

    assert rel_err(loss, loss32) <= 2 * rel_err(ref_loss, loss32) + 1e-3, (float(loss), float(ref_loss), float(loss32))
    params = dict(model.named_parameters())
    assert any(".experts." in n for n in grads32)
    floor = 1e-3 * max(float(g.norm()) for g in grads32.values())
    bad = []  # every parameter out of tolerance, not only the first: where they sit says which kernel erred
    for n, g32 in grads32.items():
        assert params[n].grad is not None, n
        got = rel_err(params[n].grad, g32, floor)
        own = rel_err(ref_grads[n], g32, floor)
        if not got <= 2 * own + 1e-3:
            bad.append((n, got, own))
    assert not bad, bad
    torch._dynamo.reset()
