"""torch.autocast through `mok_inductor.moe`: one policy on every path (docs/api.md, "Autocast and torch.func").

Under `torch.autocast(device, dtype=D)`, x and every float32/float16/bfloat16 weight are cast to D, as
F.linear casts its input and weight; the router weights stay as given (read as float32); MXFP8 data and
scales are never cast; the op then runs with autocast off. So every path computes the op on the cast inputs:
the reference (CPU), the Triton kernels (on CPU tensors under the interpreter), compiled graphs. Each test
compares against the same call made outside autocast on explicitly cast inputs (bitwise: it is the same
computation) and against the float64 oracle of the cast values (the contract's tolerance), and checks that
gradients flow back through the casts into each input's own dtype.

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E experts, K routes.
"""

import dataclasses

import pytest
import torch

import mok_inductor
from _helpers import TOLERANCE, make_case, oracle_with_grads, random_like, rel_err

CAST_NAMES = ("x", "gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj", "shared_output_gate")


def _case(device="cpu", seed=0, small=False):
    # T=9, H=32, I=16, Is=12, E=5, K=2 (small, for the Triton interpreter: T=6, H=16, I=8, E=3) with -1 routes,
    # a shared expert, its gate and a limit: every input is cast (or, the router weights, not); float32 leaves,
    # as an AMP model's parameters are
    sizes = dict(T=6, H=16, I=8, E=3) if small else dict(T=9, H=32, I=16, E=5)
    return make_case(**sizes, Is=12, K=2, device=device, shared=True, gate=True, limit=0.6, drop=0.2, seed=seed)


def _call(c, **kw):
    return mok_inductor.moe(*c.args(), **c.kwargs(), **kw)


def _grads(c, y, dy):
    y.backward(dy)
    return {n: t.grad for n, t in c.tensors().items()}


def _explicit(case, dtype, dy):
    """(y, grads): the call outside autocast on x and the weights cast to `dtype` by hand (the router weights
    not), gradients taken at the float32 leaves."""
    c = case.detached()
    y = _call(dataclasses.replace(c, **{n: getattr(c, n).to(dtype) for n in CAST_NAMES}))
    return y.detach(), _grads(c, y, dy)


def _under_autocast(case, dtype, dy, fn=_call, backward_inside=False):
    c = case.detached()
    device_type = c.x.device.type
    with torch.autocast(device_type, dtype=dtype):
        y = fn(c)
        if backward_inside:
            return y.detach(), _grads(c, y, dy)
    return y.detach(), _grads(c, y, dy)


def _check_oracle(case, dtype, y, grads, dy):
    """y and every gradient within the contract's `dtype` tolerance of the float64 oracle on the cast values."""
    c = case.detached(requires_grad=False)
    y_ref, g_ref = oracle_with_grads(dataclasses.replace(c, **{n: getattr(c, n).to(dtype) for n in CAST_NAMES}), dy)
    assert rel_err(y, y_ref) <= TOLERANCE[dtype], "y"
    for n, g in grads.items():
        assert rel_err(g, g_ref[n]) <= TOLERANCE[dtype], f"d_{n}"


@pytest.mark.parametrize("backend, dtype", [("reference", torch.bfloat16), ("reference", torch.float16),
                                            ("triton", torch.bfloat16)], ids=str)
def test_autocast_casts_inputs_and_weights(backend, dtype):
    # the reference and the Triton kernels (interpreter) compute the op on the cast inputs: bitwise the explicit
    # cast call, whose output dtype is the autocast dtype (as F.linear's), with float32 gradients for the float32
    # leaves, within the contract of the oracle; backward inside the autocast block changes nothing (the ops
    # run with autocast off). The Triton interpreter is slow: there, only the backward inside autocast
    triton = backend == "triton"
    # (the kernels take CPU tensors only under the interpreter: on a machine with CUDA they run there)
    case = _case(device="cuda" if triton and torch.cuda.is_available() else "cpu", seed=3, small=triton)
    dy = random_like(case.x.detach(), 1).to(dtype)
    with mok_inductor.options.override(backend=backend):
        y_want, g_want = _explicit(case, dtype, dy)
        for inside in (True,) if triton else (False, True):
            y, grads = _under_autocast(case, dtype, dy, backward_inside=inside)
            assert y.dtype == dtype
            assert torch.equal(y, y_want), f"y (backward inside autocast: {inside})"
            for n, g in grads.items():
                assert g.dtype == case.tensors()[n].dtype, n
                assert torch.equal(g, g_want[n]), f"d_{n} (backward inside autocast: {inside})"
    _check_oracle(case, dtype, y, grads, dy)


def test_amp_model_with_float32_experts():
    # the usual AMP setup: bf16 activations from an autocast Linear, float32 router (softmax: float32 under
    # autocast) and float32 expert weights. It runs (no dtype error), returns bf16, and the gradients reach the
    # float32 expert weights and the Linear's weight in float32, as the same model with explicit casts gives
    torch.manual_seed(11)
    T, H, E, K = 8, 32, 4, 2
    proj, router = torch.nn.Linear(H, H), torch.nn.Linear(H, E)
    case = make_case(T=T, H=H, I=16, E=E, K=K, shared=True, seed=12)
    experts = {n: torch.nn.Parameter(getattr(case, n).detach().clone())
               for n in ("gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj")}
    inp = torch.randn(T, H)
    dy = torch.randn(T, H).bfloat16()

    def linear(layer, autocast):  # what autocast makes of it: F.linear on bf16 casts
        if autocast:
            return layer(inp)
        return torch.nn.functional.linear(inp.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16())

    def model(autocast):
        h = linear(proj, autocast)
        rw, te = torch.softmax(linear(router, autocast).float(), -1).topk(K, dim=-1)
        w = experts if autocast else {n: p.bfloat16() for n, p in experts.items()}
        return mok_inductor.moe(h, rw, te, w["gate_up_proj"], w["down_proj"],
                                shared_gate_up_proj=w["shared_gate_up_proj"], shared_down_proj=w["shared_down_proj"])

    results = []
    for autocast in (True, False):
        params = [proj.weight, *experts.values()]
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(autocast)
        y.backward(dy)
        assert y.dtype == torch.bfloat16
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
        results.append((y.detach(), [p.grad.clone() for p in params]))
    (y_amp, g_amp), (y_cast, g_cast) = results
    assert torch.equal(y_amp, y_cast)
    for a, b in zip(g_amp, g_cast):
        assert torch.equal(a, b)


def test_mxfp8_weights_are_not_cast():
    # an MXFP8 routed weight keeps its float8 data and scales; its float32 master is cast with x (the master
    # has x's dtype), and its gradient comes back in float32, as with explicit casts outside autocast
    from mok_inductor import mxfp8

    # H=32, I=32: the MXFP8 blocks; E=3, K=2, T=5 with -1 routes
    case = make_case(T=5, H=32, I=32, E=3, K=2, drop=0.2, seed=13)
    dy = random_like(case.x.detach(), 14).bfloat16()
    q = mxfp8.quantize(case.gate_up_proj.detach())  # master given per call below
    got = []
    for autocast in (True, False):
        master = case.gate_up_proj.detach().clone().requires_grad_(True)
        x = case.x.detach().clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            cast = (lambda t: t) if autocast else (lambda t: t.bfloat16())
            y = mok_inductor.moe(cast(x), case.router_weights, case.top_experts, mxfp8.with_master(q, cast(master)),
                                 cast(case.down_proj))
        y.backward(dy)
        assert y.dtype == torch.bfloat16 and master.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
        got.append((y.detach(), master.grad, x.grad))
    for a, b in zip(*got):
        assert torch.equal(a, b)


def _compiled_vs_eager(device, backend, where, dtype=torch.bfloat16, tol=0.0):
    """Forward and gradients of the autocast call compiled with `backend`, the autocast context outside the
    compiled function or inside it, against eager under autocast: bitwise (`tol` 0), or within `tol`."""
    case = _case(device=device, seed=21)
    dy = random_like(case.x.detach(), 22).to(dtype)
    y_want, g_want = _under_autocast(case, dtype, dy)

    def outside(x, rw, te, w1, w2, s1, s2, sg):
        return mok_inductor.moe(x, rw, te, w1, w2, shared_gate_up_proj=s1, shared_down_proj=s2,
                                shared_output_gate=sg, swiglu_limit=0.6)

    def inside(*args):
        with torch.autocast(args[0].device.type, dtype=dtype):
            return outside(*args)

    torch._dynamo.reset()
    fn = torch.compile(inside if where == "inside" else outside, backend=backend, fullgraph=True)

    def call(c):
        return fn(c.x, c.router_weights, c.top_experts, c.gate_up_proj, c.down_proj, c.shared_gate_up_proj,
                  c.shared_down_proj, c.shared_output_gate)

    if where == "inside":
        c = case.detached()
        y = call(c)
        y, grads = y.detach(), _grads(c, y, dy)
    else:
        y, grads = _under_autocast(case, dtype, dy, fn=call)
    torch._dynamo.reset()
    assert y.dtype == dtype
    for name, got, want in [("y", y, y_want)] + [(f"d_{n}", g, g_want[n]) for n, g in grads.items()]:
        assert got.dtype == want.dtype, name
        assert (torch.equal(got, want) if tol == 0 else rel_err(got, want) <= tol), name
    return case, dy, y, grads


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_equals_eager_under_autocast(backend, where):
    # Dynamo records the autocast region; AOTAutograd runs the op's Autocast kernel while tracing, so the
    # graph holds the casts; the ops the graph calls run with autocast off even under the caller's autocast
    _compiled_vs_eager("cpu", backend, where)


@pytest.mark.slow
def test_inductor_equals_eager_under_autocast():
    # the same with Inductor's generated code around the ops (one graph, forward and backward)
    _compiled_vs_eager("cpu", "inductor", "outside")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_cuda(dtype):
    # on CUDA the Triton kernels under autocast("cuda") compute the op on the cast inputs: bitwise the explicit
    # cast call, within the contract of the oracle, float32 gradients for the float32 leaves
    case = _case(device="cuda", seed=31)
    dy = random_like(case.x.detach(), 32).to(dtype)
    y_want, g_want = _explicit(case, dtype, dy)
    y, grads = _under_autocast(case, dtype, dy)
    assert y.dtype == dtype and torch.equal(y, y_want)
    for n, g in grads.items():
        assert g.dtype == torch.float32 and torch.equal(g, g_want[n]), f"d_{n}"
    _check_oracle(case.detached(device="cpu"), dtype, y, grads, dy.cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_autocast_cuda_compiled(where):
    # Inductor with mok_inductor's decomposition into its Triton launches equals eager under autocast, up to
    # the summation order of the small torch reductions Inductor compiles itself (tests/test_compile_inductor.py:
    # 4e-3 for a bfloat16 case), and the oracle's contract
    with mok_inductor.enabled():
        case, dy, y, grads = _compiled_vs_eager("cuda", "inductor", where, tol=4e-3)
    _check_oracle(case.detached(device="cpu"), torch.bfloat16, y, grads, dy.cpu())
