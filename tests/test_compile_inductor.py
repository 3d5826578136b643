"""The MoK op inside Inductor-compiled graphs, with `mok_inductor.enable()` in effect (what compiled graphs need:
the decomposition into our Triton launches, the cache key and its torch 2.11 fix-up).

CPU (CI): the compiled forward and backward graphs call the CPU implementation (the mok:: ops appear in the
generated code as calls) and equal eager bitwise.
CUDA (skipped without CUDA): at a size eager runs without TMA loads, the Triton kernels of mok_inductor.kernels
appear in Inductor's generated code (no opaque fallback; larger calls stay opaque, a rule tested here on CPU),
no graph break, no recompilation over three token counts (dynamic shapes: the ops stay
opaque, their implementation picks each token count's tile configs at run time), CUDA-graph replay
(mode="reduce-overhead") equals eager over 100 replays with fresh inputs in every dtype with the shared
expert, stride-0 incoming gradients, and max-autotune.
"""

import inspect

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import mok_inductor
from _helpers import make_case, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True, scope="module")
def _enabled():
    with mok_inductor.enabled():
        yield


def make_inputs(T, H=64, I=32, Is=48, E=6, K=2, dtype=torch.float32, device="cpu", shared=True, seed=0):
    """moe's keyword arguments, drawn by `make_case` (int32 routes, a missing one when T > 2)."""
    c = make_case(T, H, I, E, K, dtype=dtype, device=device, shared=shared, gate=shared, Is=Is,
                  index_dtype=torch.int32, seed=seed, requires_grad=False)
    if T > 2:
        c.top_experts[1, 0] = -1
    return dict(c.tensors(), top_experts=c.top_experts)


DIFF = ("x", "router_weights", "gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj",
        "shared_output_gate")


def layer(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj=None, shared_down_proj=None,
          shared_output_gate=None):
    return mok_inductor.moe(x, router_weights, top_experts, gate_up_proj, down_proj,
                            shared_gate_up_proj=shared_gate_up_proj, shared_down_proj=shared_down_proj,
                            shared_output_gate=shared_output_gate, swiglu_limit=3.0)


def fwd_bwd(fn, inputs, dy, *, sum_loss=False):
    leaves = {k: (v.detach().clone().requires_grad_() if k in DIFF else v) for k, v in inputs.items()}
    y = fn(**leaves)
    (y.sum() if sum_loss else (y * dy).sum()).backward()
    return [y.detach()] + [leaves[k].grad for k in DIFF if k in leaves]


def assert_same(got, want):
    """Compiled vs eager on CUDA: the same kernels, but under max-autotune Inductor benchmarks every candidate
    tile config, so a different one (another fp32 summation order) may win, and Inductor compiles the small torch
    reductions around the kernels (the sum over the partial router-weight gradients, the output gate's GEMV)
    with its own summation order. Equal up to that: 1e-5 in a float32 case; 4e-3 in a bfloat16/float16 case,
    float32 outputs included (the router-weight gradient sums bfloat16 products)."""
    case_dtype = got[0].dtype  # y is in the dtype of x
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        err = rel_err(a, b)
        assert err <= (1e-5 if case_dtype == torch.float32 else 4e-3), err


def test_cpu_compiled_graph_calls_cpu_implementation():
    torch._dynamo.reset()
    inputs = make_inputs(T=11)
    dy = torch.randn(11, 64)
    compiled = torch.compile(layer, fullgraph=True)
    got, codes = run_and_get_code(lambda: fwd_bwd(compiled, inputs, dy))
    code = "\n".join(codes)
    assert "torch.ops.mok.moe_fwd.default" in code and "torch.ops.mok.moe_bwd.default" in code
    want = fwd_bwd(layer, inputs, dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_cpu_dynamic_token_count_traces_once(backend):
    """torch.compile(dynamic=True) traces the layer once for every token count: no recompilation, and no
    restarted trace (a float global read by the argument checks, FLOAT32_MAX, became a symbol under dynamic=True
    and made Dynamo restart the first trace, counted as a second frame)."""
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for T in (37, 129):
        inputs = make_inputs(T=T, seed=T)
        dy = torch.randn(T, 64)
        got = fwd_bwd(compiled, inputs, dy)
        for a, b in zip(got, fwd_bwd(layer, inputs, dy)):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


def triton_kernel_names():
    """Names of every @triton.jit kernel defined in mok_inductor.kernels (found, not listed by hand)."""
    import pkgutil

    import triton

    import mok_inductor.kernels as kernels

    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = __import__(f"mok_inductor.kernels.{info.name}", fromlist=["_"])
        for name, obj in inspect.getmembers(module):
            fn = getattr(obj, "fn", obj)  # a tuned kernel family (configs.Family) holds the JITFunction
            if isinstance(fn, triton.runtime.jit.JITFunction):
                names.add(fn.__name__)
    return names


def _uses_tma(name, T, *, shared=True, dtype=torch.bfloat16, E=6, K=2):
    """decompose's TMA rule for a call of make_inputs' sizes (the op's arguments only where the rule reads them)."""
    from mok_inductor.lowering import decompose

    args = [None] * 12
    i = decompose._X[name]
    args[i] = torch.empty(T, 64, dtype=dtype, device="meta")
    args[i + 2] = torch.empty(T, K, dtype=torch.int32, device="meta")
    args[i + 4] = torch.empty(E + 1, dtype=torch.int32, device="meta")
    args[i + 8] = torch.empty(96, 64, dtype=dtype, device="meta") if shared else None
    return decompose._eager_uses_tma(name, args)


@pytest.mark.parametrize("name", ["moe_fwd", "moe_bwd"])
def test_calls_that_eager_runs_through_tma_stay_opaque(name):
    """Which static calls the compiled graph inlines (the CUDA tests below rely on it): with the default 128 rows
    per expert, 100 tokens inline with or without the shared expert; 300 tokens with the shared expert (its 300
    rows) stay opaque, without it (600 routed rows over 6 experts) they inline; float32 never uses TMA."""
    assert mok_inductor.options.current().tma_min_rows == 128
    assert not _uses_tma(name, 100) and not _uses_tma(name, 100, shared=False)
    assert _uses_tma(name, 300) and not _uses_tma(name, 300, shared=False)
    assert _uses_tma(name, 384, shared=False) and not _uses_tma(name, 383, shared=False)  # 6 x 128 routes
    assert not _uses_tma(name, 300, dtype=torch.float32)
    with mok_inductor.options.override(tma=False):
        assert not _uses_tma(name, 300)


@needs_cuda
def test_cuda_triton_kernels_in_generated_code_no_fallback():
    """A call eager runs without TMA (100 tokens: `test_calls_that_eager_runs_through_tma_stay_opaque`): its
    launches are in Inductor's code."""
    torch._dynamo.reset()
    inputs = make_inputs(T=100, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    got, codes = run_and_get_code(lambda: fwd_bwd(compiled, inputs, dy))
    assert len(codes) >= 2, "expected a forward and a backward module"
    names = triton_kernel_names()
    fwd_code, bwd_code = codes[0], codes[-1]
    assert {n for n in names if n in fwd_code}, f"no mok Triton kernel in the forward code; kernels: {sorted(names)}"
    assert {n for n in names if n in bwd_code}, f"no mok Triton kernel in the backward code; kernels: {sorted(names)}"
    for op in ("torch.ops.mok.moe_fwd", "torch.ops.mok.moe_bwd", "torch.ops.mok.schedule"):
        assert op not in "\n".join(codes), f"{op} ran as an opaque fallback"
    assert_same(got, fwd_bwd(layer, inputs, dy))


@needs_cuda
def test_cuda_no_graph_break_and_no_recompile_across_T():
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(layer)(**make_inputs(T=64, dtype=torch.bfloat16, device="cuda"))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    code = ""
    for T in (37, 129, 517):
        inputs = make_inputs(T=T, dtype=torch.bfloat16, device="cuda", seed=T)
        dy = torch.randn(T, 64, device="cuda", dtype=torch.bfloat16)
        if T == 37:  # (run_and_get_code resets dynamo first: the first call only, where the compile happens)
            got, codes = run_and_get_code(lambda: fwd_bwd(compiled, inputs, dy))
            code = "\n".join(codes)
        else:
            got = fwd_bwd(compiled, inputs, dy)
        assert_same(got, fwd_bwd(layer, inputs, dy))
    assert counter.frame_count == 1
    # a symbolic token count keeps the ops opaque (each call picks its row bucket's tile configs)
    assert "torch.ops.mok.moe_fwd" in code and "torch.ops.mok.moe_bwd" in code


@needs_cuda
def test_cuda_override_around_an_inlined_compiled_graph_takes_effect(monkeypatch):
    """A graph compiled with the Triton launches inlined (100 tokens, no TMA), then called under
    override(backend="reference"): it compiles again, the op stays opaque and the reference runs (the first
    graph's inlined kernels would have ignored the override); back under the default the first graph serves."""
    from mok_inductor import ops, options, reference

    torch._dynamo.reset()
    inputs = make_inputs(T=100, dtype=torch.bfloat16, device="cuda")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    want = layer(**inputs)
    torch.testing.assert_close(compiled(**inputs), want, rtol=0, atol=0)
    ran = []
    real = reference.moe_forward
    monkeypatch.setattr(reference, "moe_forward", lambda *a, **k: ran.append(1) or real(*a, **k))
    with options.override(backend="reference"):
        got = compiled(**inputs)
    assert counter.frame_count == 2 and ran, "the override did not reach the compiled call"
    assert rel_err(got, want) <= 1e-2
    ran.clear()
    compiled(**inputs)
    assert counter.frame_count == 2 and not ran


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_graphs_replay_equals_eager(dtype):
    torch._dynamo.reset()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for step in range(100):
        inputs = make_inputs(T=96, dtype=dtype, device="cuda", seed=step)
        dy = torch.randn(96, 64, device="cuda", dtype=dtype)
        assert_same(fwd_bwd(compiled, inputs, dy), fwd_bwd(layer, inputs, dy))


@needs_cuda
def test_cuda_stride0_gradient_and_max_autotune():
    torch._dynamo.reset()
    inputs = make_inputs(T=200, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(layer, fullgraph=True, mode="max-autotune-no-cudagraphs")
    got = fwd_bwd(compiled, inputs, None, sum_loss=True)  # y.sum(): the incoming gradient is expanded, stride 0
    assert_same(got, fwd_bwd(layer, inputs, None, sum_loss=True))


@needs_cuda
@pytest.mark.parametrize("offset", [0, 4])
def test_cuda_mxfp8_decode_graphs_replay_equals_eager(offset):
    # MXFP8 routed weights at decode sizes (4 routes per expert): traced, the K loops read the scales by words on
    # the tables' tiles (the 8-row ones without a table: what tests/test_compile_reinplace.py checks of the traced
    # graph); replayed in CUDA graphs with fresh inputs, equal to eager. offset 4: the gate/up scales a view 4
    # bytes into its storage (words still, Inductor does not take it as 16-byte aligned)
    from mok_inductor import mxfp8

    torch._dynamo.reset()
    T, H, I, E, K = 32, 512, 256, 16, 2
    g = torch.Generator().manual_seed(offset)
    gq = mxfp8.quantize((torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16().cuda())
    dq = mxfp8.quantize((torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16().cuda())
    if offset:
        buf = torch.empty(gq.scale.numel() + offset, dtype=torch.uint8, device="cuda")
        buf[offset:] = gq.scale.reshape(-1)
        gq = gq._replace(scale=buf[offset:].view(gq.scale.shape))

    def f(x, rw, te):
        return mok_inductor.moe(x, rw, te, gq, dq)

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for step in range(20):
        gs = torch.Generator().manual_seed(100 + step)
        x = torch.randn(T, H, generator=gs).bfloat16().cuda()
        rw, te = torch.topk(torch.randn(T, E, generator=gs).softmax(-1), K)
        with torch.no_grad():
            got = compiled(x, rw.cuda(), te.int().cuda()).clone()
            assert_same([got], [f(x, rw.cuda(), te.int().cuda())])


def test_dynamic_shape_fixup_strips_only_our_symbolic_launches():
    """torch 2.11 asserts while decomposing functional Triton nodes that carry `eager_input_vals` under symbolic
    shapes (lowering/compat.py): the fix-up drops that entry from OUR kernels' symbolic nodes only."""
    import triton
    import triton.language as tl
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mok_inductor.kernels import combine
    from mok_inductor.lowering import compat

    @triton.jit
    def foreign_kernel(x_ptr, n, BLOCK: tl.constexpr):
        pass

    env = ShapeEnv()
    sym = env.create_unbacked_symint()
    hop = torch.ops.higher_order.triton_kernel_wrapper_functional
    g = torch.fx.Graph()
    nodes = {}
    for name, kernel, vals in (("ours_symbolic", combine._combine_kernel, ((), {"n": sym})),
                               ("ours_static", combine._combine_kernel, ((), {"n": 7})),
                               ("foreign_symbolic", foreign_kernel, ((), {"n": sym}))):
        node = g.call_function(hop, (), {"kernel_idx": kernel_side_table.add_kernel(kernel), "kwargs": {}})
        node.meta["eager_input_vals"] = vals
        nodes[name] = node
    assert compat.strip_eager_input_vals(g, force=True) == 1
    assert "eager_input_vals" not in nodes["ours_symbolic"].meta
    assert "eager_input_vals" in nodes["ours_static"].meta and "eager_input_vals" in nodes["foreign_symbolic"].meta
