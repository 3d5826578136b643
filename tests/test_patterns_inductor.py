"""Real Inductor compiles (about 20 s each on two CPU cores, so only a few): backend="mok" on a bf16
grouped_mm Qwen3-MoE block, `mok_inductor.enable()` on an fp32 Mixtral block (transformers::grouped_mm_fallback)
and on an fp32 GPT-OSS block (activation "gpt_oss", biases), and the compile-cache keying that `enable()`
installs (same sources and options -> FX-graph and AOTAutograd cache hits; a changed source file or changed
options -> misses)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import mok_inductor.lowering as lowering
import mok_inductor
from _pattern_models import build
from _helpers import rel_err
from mok_inductor.lowering import cache

pytestmark = pytest.mark.slow


def _block(name, impl, dtype):
    """The first sparse MoE block of a tiny real model (an Inductor compile of the whole model costs minutes on
    two busy cores; the block is where the rewrite happens, the model-level matrix runs in test_patterns.py)."""
    model, _ = build(name, impl, dtype, num_hidden_layers=1)
    return model.model.layers[0].mlp


def _block_step(block, x, dy):
    """Output and the gradients of <out, dy> w.r.t. x and every parameter."""
    x = x.detach().requires_grad_()
    out = block(x)
    params = [p for _, p in sorted(block.named_parameters())]
    grads = torch.autograd.grad(out, [x, *params], dy)
    return out.detach(), grads


def test_backend_mok_inductor_bf16_grouped_mm_training():
    import transformers  # noqa: F401  (pinned test dependency)
    block = _block("qwen3_moe", "grouped_mm", torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 32, generator=g).bfloat16()
    dy = torch.randn(2, 5, 32, generator=g).bfloat16()
    gold = copy.deepcopy(block).float()
    ref32, gref32 = _block_step(gold, x.float(), dy.float())
    ref, gref = _block_step(block, x, dy)
    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    c = torch.compile(block, backend="mok", fullgraph=True)
    (out, grads), codes = run_and_get_code(_block_step, c, x, dy)
    assert counters["mok_inductor"]["moe_replaced"] == 1
    joined = "\n".join(codes)
    # on the CPU the compiled forward and backward call MoK's ops (the reference path) ...
    assert "torch.ops.mok.moe_fwd.default" in joined and "torch.ops.mok.moe_bwd.default" in joined
    # ... and nothing of the replaced formulation is left
    assert "_grouped_mm" not in joined and "histc" not in joined
    assert rel_err(out, ref32) <= 2 * rel_err(ref, ref32) + 1e-3
    for a, b, gold_g in zip(grads, gref, gref32):
        assert rel_err(a, gold_g) <= 2 * rel_err(b, gold_g) + 1e-3


def test_enable_switch_fp32_fallback_training(tmp_path, monkeypatch):
    import transformers  # noqa: F401  (pinned test dependency)
    from torch._inductor import config

    # a cold cache: on torch 2.13 the pre-grad pass runs after the cache lookup, so a hit would not count
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))

    block = _block("mixtral", "grouped_mm", torch.float32)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 5, 32, generator=g)
    dy = torch.randn(2, 5, 32, generator=g)
    ref, gref = _block_step(block, x, dy)
    before = config.pre_grad_custom_pass
    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    with mok_inductor.enabled():
        assert lowering.patterns.is_enabled()
        (out, grads), codes = run_and_get_code(_block_step, torch.compile(block, fullgraph=True), x, dy)
    assert not lowering.patterns.is_enabled() and config.pre_grad_custom_pass is before
    assert counters["mok_inductor"]["moe_replaced"] == 1
    joined = "\n".join(codes)
    assert "torch.ops.mok.moe_bwd.default" in joined and "grouped_mm_fallback" not in joined
    assert rel_err(out, ref) <= 1e-4
    for a, b in zip(grads, gref):
        assert rel_err(a, b) <= 1e-4


def test_enable_switch_gpt_oss_fp32_training(tmp_path, monkeypatch):
    """`mok_inductor.enable()` and a plain Inductor compile of a GPT-OSS MoE block (grouped_mm backend, fp32:
    transformers::grouped_mm_fallback): one mok::moe(activation="gpt_oss") whose forward and backward are MoK's
    ops in the output code, nothing of the experts left; output and every gradient within 1e-4 of eager."""
    import transformers  # noqa: F401  (pinned test dependency)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # cold: the pass must run
    block = _block("gpt_oss", "grouped_mm", torch.float32)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 5, 32, generator=g)
    dy = torch.randn(2, 5, 32, generator=g)

    ref, gref = _gpt_oss_step(block, x, dy)
    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    with mok_inductor.enabled():
        (out, grads), codes = run_and_get_code(_gpt_oss_step, torch.compile(block, fullgraph=True), x, dy)
    assert counters["mok_inductor"]["moe_replaced"] == 1
    joined = "\n".join(codes)
    assert "torch.ops.mok.moe_fwd.default" in joined and "torch.ops.mok.moe_bwd.default" in joined
    assert "grouped_mm_fallback" not in joined and "histc" not in joined
    assert rel_err(out, ref) <= 1e-4
    for a, b in zip(grads, gref):
        assert rel_err(a, b) <= 1e-4


def _gpt_oss_step(block, x, dy):
    """`_block_step` for GptOssMLP, whose forward returns (output, router scores)."""
    x = x.detach().requires_grad_()
    out = block(x)[0]
    params = [p for _, p in sorted(block.named_parameters())]
    grads = torch.autograd.grad(out, [x, *params], dy)
    return out.detach(), grads


# ---------------------------------------------------------------------------------------------------
# cache keying


def _moe_inputs():
    # T=9 tokens, H=16, I=8, E=4, K=2: T not a multiple of E
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 16, generator=g)
    rw = torch.rand(9, 2, generator=g)
    te = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    gu = 0.3 * torch.randn(4, 16, 16, generator=g)
    d = 0.3 * torch.randn(4, 16, 8, generator=g)
    return x, rw, te, gu, d


def _f(x, rw, te, gu, d):
    return mok_inductor.moe(x, rw, te, gu, d) * 2.0  # mok::moe with no pattern pass involved


def _compile_once():
    torch._dynamo.reset()
    counters["inductor"].clear()
    counters["aot_autograd"].clear()
    args = _moe_inputs()
    out = torch.compile(_f, fullgraph=True)(*args)
    torch.testing.assert_close(out, _f(*args))
    return dict(counters["inductor"]), dict(counters["aot_autograd"])


def test_fingerprint_follows_version_options_and_every_source_byte(tmp_path):
    extra = tmp_path / "extra.py"
    extra.write_text("A = 1\n")
    files = cache.hashed_sources() + [extra]
    tables = tmp_path / "tables"  # the user's tile-config tables (none yet)
    with mok_inductor.options.override(tables_dir=str(tables)):
        base = cache.fingerprint(files)
        assert cache.fingerprint(files) == base
        assert cache.fingerprint(files, version="0.0.0+other") != base
        with mok_inductor.options.override(autotune=not mok_inductor.options.current().autotune):
            assert cache.fingerprint(files) != base
        assert cache.fingerprint(files) == base
        # a user table (traced launches take their configs from it), and an edit of it
        tables.mkdir()
        table = tables / "some-gpu.json"
        table.write_text('{"format": "mok-inductor/tile-configs/1", "families": {}}\n')
        with_table = cache.fingerprint(files)
        assert with_table != base
        table.write_text('{"format": "mok-inductor/tile-configs/1", "device": "some gpu", "families": {}}\n')
        assert cache.fingerprint(files) not in (base, with_table)
        table.unlink()
        assert cache.fingerprint(files) == base
        extra.write_text("A = 2\n")
        assert cache.fingerprint(files) != base
    sources = cache.hashed_sources()
    assert len(sources) == len(set(sources))
    assert any(p.name == "ops.py" and p.parent.name == "mok_inductor" for p in sources)
    assert any(p.name == "patterns.py" and p.parent.name == "lowering" for p in sources)


_LAYOUT_PROBE = """
import importlib.util, json, sys
site, layout = sys.argv[1], sys.argv[2]
sys.path.insert(0, site)
import mok_inductor
if layout == "editable":  # lowering/ beside mok_inductor/, mapped in as mok_inductor.lowering, as pip install -e does
    spec = importlib.util.spec_from_file_location("mok_inductor.lowering", site + "/lowering/__init__.py",
                                                  submodule_search_locations=[site + "/lowering"])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
from mok_inductor.lowering import cache
names = cache._sources_with_names()
print(json.dumps({"file": mok_inductor.__file__, "lowering": sys.modules["mok_inductor.lowering"].__file__,
                  "names": [names[p] for p in cache.hashed_sources()], "fingerprint": cache.fingerprint()}))
"""


def _probe_layout(site, layout):
    """The key's view of the packages copied under `site`, in a fresh process started there (not in the
    checkout, whose folders `python -c` would import first)."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _LAYOUT_PROBE, str(site), layout], capture_output=True, text=True,
                       timeout=300, cwd=site)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fingerprint_same_in_editable_and_wheel_layouts(tmp_path):
    """`pip install -e .` maps the repository's lowering/ in as mok_inductor.lowering; a wheel installs it as
    mok_inductor/lowering/. The key finds the sources from the packages' `__path__`, counts each file once and
    names it by package, so one snapshot of the sources gives one key in both layouts."""
    import shutil
    from pathlib import Path

    import mok_inductor.lowering

    skip = shutil.ignore_patterns("__pycache__")
    editable, wheel = tmp_path / "editable", tmp_path / "wheel"
    shutil.copytree(Path(mok_inductor.__file__).parent, editable / "mok_inductor", ignore=skip)
    shutil.copytree(Path(mok_inductor.lowering.__file__).parent, editable / "lowering", ignore=skip)
    shutil.copytree(editable / "mok_inductor", wheel / "mok_inductor")
    shutil.copytree(editable / "lowering", wheel / "mok_inductor" / "lowering")

    e, w = _probe_layout(editable, "editable"), _probe_layout(wheel, "wheel")
    assert Path(e["lowering"]).parent == editable / "lowering"
    assert Path(w["file"]).parent == wheel / "mok_inductor"
    assert Path(w["lowering"]).parent == wheel / "mok_inductor" / "lowering"
    n_files = sum(1 for p in editable.rglob("*") if p.suffix in cache.SOURCE_SUFFIXES)
    assert len(w["names"]) == len(set(w["names"])) == n_files
    assert w["names"] == e["names"]
    assert "mok_inductor.lowering/patterns.py" in w["names"] and "mok_inductor/ops.py" in w["names"]
    assert w["fingerprint"] == e["fingerprint"]
    (wheel / "mok_inductor" / "lowering" / "patterns.py").write_text("# edited\n", encoding="utf-8")
    assert _probe_layout(wheel, "wheel")["fingerprint"] != e["fingerprint"]


def test_compile_caches_key_on_package_sources_and_options(tmp_path, monkeypatch):
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    with inductor_config.patch(fx_graph_cache=True, force_disable_caches=False), \
            torch._functorch.config.patch(enable_autograd_cache=True), mok_inductor.enabled():
        _check_hit_then_miss(tmp_path, monkeypatch)
    assert cache.installed() is None


def _assert_miss(ind, aot):
    assert ind.get("fxgraph_cache_hit", 0) == 0 and ind.get("fxgraph_cache_miss", 0) >= 1, ind
    assert aot.get("autograd_cache_hit", 0) == 0 and aot.get("autograd_cache_miss", 0) >= 1, aot


def _assert_hit(ind, aot):
    assert ind.get("fxgraph_cache_hit", 0) >= 1 and ind.get("fxgraph_cache_miss", 0) == 0, ind
    assert aot.get("autograd_cache_hit", 0) >= 1 and aot.get("autograd_cache_miss", 0) == 0, aot


def _check_hit_then_miss(tmp_path, monkeypatch):
    assert cache.installed() is not None

    _assert_miss(*_compile_once())
    _assert_hit(*_compile_once())  # same sources and options: both caches answer

    # changed options (the traced graph may differ: other kernels, configs, loads; a search's table in tmp_path)
    with mok_inductor.options.override(autotune=not mok_inductor.options.current().autotune,
                                       tables_dir=str(tmp_path / "tables")):
        _assert_miss(*_compile_once())
    _assert_hit(*_compile_once())  # the options as before: the first entry answers again

    # a changed source file in the hashed set (as an edited fake or backward would be)
    edited = tmp_path / "edited_ops.py"
    edited.write_text("# a new kernel version\n")
    sources = cache.hashed_sources()
    monkeypatch.setattr(cache, "hashed_sources", lambda: sources + [edited])
    _assert_miss(*_compile_once())
