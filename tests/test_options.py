"""mok_inductor.options: the one frozen Options object, its overrides and the backend choice it drives.

The Triton kernels run on CPU tensors under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without
CUDA), so backend "triton" and "reference" are both checked here on the CPU; with CUDA, the kernels' calls take
CUDA tensors (DEV).
"""

import dataclasses
import subprocess
import sys

import pytest
import torch

import mok_inductor
from mok_inductor import options
from _helpers import DEV, TOLERANCE, make_case, rel_err



def _case():
    return make_case(T=6, H=32, I=16, E=3, K=2, dtype=torch.bfloat16, shared=True, gate=True, limit=0.8, drop=0.2,
                     seed=7, requires_grad=False)


@pytest.fixture
def spies(monkeypatch):
    """Counts of the calls into the kernels' and the reference's forward and backward (the kernels' forward: the
    grouped one or, for a few routes without gradient, the decode one)."""
    from mok_inductor import kernels, reference

    calls = {"triton": 0, "reference": 0, "triton bwd": 0, "reference bwd": 0}
    for mod, name, key in ((kernels, "forward", "triton"), (kernels, "decode_forward", "triton"),
                           (reference, "moe_forward", "reference"),
                           (kernels, "backward", "triton bwd"), (reference, "moe_backward", "reference bwd")):
        def counted(*args, _real=getattr(mod, name), _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    return calls


def test_backend_reference_and_triton_on_cpu(spies):
    c = _case()
    x = c.x
    assert mok_inductor.path_name(x) == "reference"  # "auto": the reference for CPU tensors
    t = c.detached(requires_grad=False, device=DEV)  # (the kernels take CPU tensors only under the interpreter)
    with mok_inductor.options.override(backend="triton"):
        assert mok_inductor.path_name(t.x) == "triton"
        y_tri = mok_inductor.moe(*t.args(), **t.kwargs())
    assert spies == {"triton": 1, "reference": 0, "triton bwd": 0, "reference bwd": 0}
    with mok_inductor.options.override(backend="reference"):
        y_ref = mok_inductor.moe(*c.args(), **c.kwargs())
    assert spies == {"triton": 1, "reference": 1, "triton bwd": 0, "reference bwd": 0}
    assert rel_err(y_tri, y_ref) <= TOLERANCE[torch.bfloat16]


def test_per_call_options(spies):
    c = _case()
    t = c.detached(requires_grad=False, device=DEV)  # (the kernels take CPU tensors only under the interpreter)
    before = options.current()
    y_tri = mok_inductor.moe(*t.args(), **t.kwargs(), options={"backend": "triton"})
    assert spies["triton"] == 1 and spies["reference"] == 0 and options.current() is before
    y_ref = mok_inductor.moe(*c.args(), **c.kwargs(), options=mok_inductor.Options(backend="reference"))
    assert spies["triton"] == 1 and spies["reference"] == 1 and options.current() is before
    assert rel_err(y_tri, y_ref) <= TOLERANCE[torch.bfloat16]
    # the per-call options win over an enclosing override, for that call only
    with options.override(backend="triton"):
        mok_inductor.moe(*c.args(), **c.kwargs(), options={"backend": "reference"})
        assert options.current().backend == "triton"
    assert spies["triton"] == 1 and spies["reference"] == 2


def test_per_call_options_reach_the_backward(spies):
    """The backward runs later, outside the call: it must run with the options its forward ran with."""
    c = make_case(T=6, H=32, I=16, E=3, K=2, dtype=torch.bfloat16, shared=True, gate=True, limit=0.8, drop=0.2,
                  seed=7, device=DEV)
    for backend, other in (("triton", "reference"), ("reference", "triton")):
        with options.override(backend=other):  # what is in effect when backward() runs
            y = mok_inductor.moe(*c.args(), **c.kwargs(), options={"backend": backend})
            before = dict(spies)
            y.sum().backward()
        assert spies[f"{backend} bwd"] == before[f"{backend} bwd"] + 1
        assert spies[f"{other} bwd"] == before[f"{other} bwd"]


def test_per_call_options_are_refused_under_torch_compile():
    c = _case()

    def f(x):
        return mok_inductor.moe(x, *c.args()[1:], **c.kwargs(), options={"backend": "reference"})

    torch._dynamo.reset()
    with pytest.raises(Exception, match="options: a per-call options= cannot be traced by torch.compile.*"
                                        "mok_inductor.options.override"):
        torch.compile(f, backend="eager", fullgraph=True)(c.x)


def test_a_compiled_call_recompiles_under_other_options():
    # the options decide what a compiled graph holds (kernels, tile configs, the decomposition): a compiled
    # mok_inductor.moe is guarded on them, so an override around the compiled function, or a new default,
    # traces again, and equal options (another object) reuse the graph
    c = _case()
    traces = []

    def backend(gm, example_inputs):
        traces.append(options.current())
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda x: mok_inductor.moe(x, *c.args()[1:], **c.kwargs()), backend=backend, fullgraph=True)
    old = options.current()
    try:
        y = f(c.x)
        f(c.x)
        with options.override(tma=not old.tma):
            f(c.x)
        with options.override(backend="reference", tma_min_rows=old.tma_min_rows + 1):
            f(c.x)
        f(c.x)
        options.set_default(old.replace())  # equal values, another object
        f(c.x)
        options.set_default(two_pass_min_rows=old.two_pass_min_rows + 1)
        torch.testing.assert_close(f(c.x), y, rtol=0, atol=0)
    finally:
        options.set_default(old)
        torch._dynamo.reset()
    assert [t.tma for t in traces] == [old.tma, not old.tma, old.tma, old.tma]
    assert traces[2].tma_min_rows == old.tma_min_rows + 1 and traces[3].two_pass_min_rows == old.two_pass_min_rows + 1


def test_override_nesting_and_restore():
    base = options.current()
    flip = not base.autotune  # (a change from the default)
    with options.override(autotune=flip) as outer:
        assert options.current() is outer and outer.autotune is flip and outer.tma == base.tma
        with options.override({"tma": not base.tma}) as inner:
            assert options.current() is inner
            assert (inner.autotune, inner.tma) == (flip, not base.tma)  # the inner block keeps the outer change
        assert options.current() is outer
        with pytest.raises(RuntimeError, match="boom"):
            with options.override(backend="reference"):
                raise RuntimeError("boom")
        assert options.current() is outer  # restored on an exception too
        with options.override(mok_inductor.Options(tma_min_rows=7)) as whole:
            assert whole == mok_inductor.Options(tma_min_rows=7)  # an Options replaces, it does not merge
    assert options.current() is base


def test_set_default():
    old = options.current()
    try:
        new = options.set_default(two_pass_min_rows=512)
        assert options.current() is new and new.two_pass_min_rows == 512
        with options.override(two_pass_min_rows=8):
            assert options.current().two_pass_min_rows == 8
        assert options.current().two_pass_min_rows == 512
    finally:
        options.set_default(old)
    assert options.current() == old


def test_unknown_and_bad_values_are_rejected():
    with pytest.raises(ValueError, match="^options: unknown option.* not_a_knob"):
        with options.override(not_a_knob=1):
            pass
    with pytest.raises(ValueError, match="^options.backend: expected one of auto, reference, triton, got 'cuda'"):
        mok_inductor.Options(backend="cuda")
    with pytest.raises(TypeError, match="^options.autotune: expected a bool"):
        mok_inductor.Options(autotune=1)
    with pytest.raises(ValueError, match="^options.tma_min_rows: expected a non-negative int"):
        mok_inductor.Options(tma_min_rows=-1)
    with pytest.raises(TypeError, match="^options.tables_dir: expected a path or None"):
        mok_inductor.Options(tables_dir=1)
    c = _case()
    with pytest.raises(ValueError, match="^options: unknown option"):
        mok_inductor.moe(*c.args(), **c.kwargs(), options={"bakcend": "reference"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.current().backend = "reference"


def test_from_env():
    assert options.from_env({}) == mok_inductor.Options()
    got = options.from_env({"MOK_BACKEND": "reference", "MOK_AUTOTUNE": "1", "MOK_TMA": "off",
                            "MOK_PATTERNS_LOG": "1", "MOK_TABLES_DIR": "/tmp/mok tables", "UNRELATED": "x"})
    assert got == mok_inductor.Options(backend="reference", autotune=True, tma=False, log_patterns=True,
                                       tables_dir="/tmp/mok tables")
    assert options.from_env({"MOK_AUTOTUNE": "0"}).autotune is False
    with pytest.raises(ValueError, match=r"options.backend: .*got 'gpu' \(from the environment: MOK_BACKEND='gpu'\)"):
        options.from_env({"MOK_BACKEND": "gpu"})


@pytest.mark.parametrize("raw, want", [("1", True), ("TRUE", True), (" yes ", True), ("On", True), ("y", True),
                                       ("0", False), ("FALSE", False), ("No", False), ("OFF", False), ("n", False),
                                       ("", False)])
def test_env_switches_read_in_any_case(raw, want):
    got = options.from_env({"MOK_AUTOTUNE": raw, "MOK_TMA": raw})
    assert got.autotune is want and got.tma is want


def test_env_switch_with_another_value_is_an_error():
    # not silently "on" (MOK_TMA=disabled used to turn TMA on)
    with pytest.raises(ValueError, match=r"^MOK_TMA='disabled': expected 1/true/yes/on or 0/false/no/off"):
        options.from_env({"MOK_TMA": "disabled"})


def test_the_environment_is_read_once(monkeypatch):
    # a variable set after import changes nothing; one set before import is the process default
    monkeypatch.setenv("MOK_BACKEND", "triton")
    assert mok_inductor.path_name(torch.zeros(1)) == "reference"
    code = "import torch, mok_inductor; print(mok_inductor.options.current().backend, " \
           f"mok_inductor.path_name(torch.zeros(1, device='{DEV}')))"  # (CPU: the child inherits TRITON_INTERPRET)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["triton", "triton"]


def test_tile_config_options(tmp_path):
    # the tables by default (autotune off: a search writes the user's table, so it is opted into); the user's
    # table folder: tables_dir (a path-like becomes its string), else the cache folder of the environment
    from pathlib import Path

    from mok_inductor.kernels import configs

    assert mok_inductor.Options().autotune is False and mok_inductor.Options().tables_dir is None
    assert mok_inductor.Options(tables_dir=tmp_path).tables_dir == str(tmp_path)
    assert options.default_tables_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "mok_inductor" / "tables"
    assert options.default_tables_dir({}) == Path.home() / ".cache" / "mok_inductor" / "tables"
    assert configs.user_dir(mok_inductor.Options(tables_dir=str(tmp_path / "t"))) == tmp_path / "t"
    assert configs.user_dir(mok_inductor.Options()) == options.DEFAULT_TABLES_DIR
    with options.override(tables_dir=str(tmp_path)):
        assert configs.user_dir() == tmp_path
