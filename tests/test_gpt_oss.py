"""The "gpt_oss" variant of mok::moe (issue 38): GPT-OSS's gated activation and the routed biases, on the CPU
reference path, against the float64 oracle of `tests/oracle.py` (forward, every gradient, the forward-mode
tangent), in Hugging Face GPT-OSS's checkpoint layout (strided views, gradients back in the parameters'
layouts), through opcheck and torch.compile, and the argument errors.

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token.
"""

import pytest
import torch

import mok_inductor
from _helpers import DEV, TOLERANCE, rel_err, routing
from oracle import oracle_moe

NAMES = ("x", "router_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")


def _inputs(T=24, H=16, I=8, E=5, K=2, *, dtype=torch.float32, seed=0, kind="random", drop=0.2):
    """Fresh random inputs; weights scaled for O(1) pre-activations, biases O(0.5) so a limit of 1 clips some
    values of both g and u; router weights positive like softmax outputs."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return dict(
        x=randn(T, H),
        router_weights=(torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.1).float(),
        top_experts=routing(T, K, E, kind, generator=gen, drop=drop),
        gate_up_proj=randn(E, 2 * I, H, scale=H ** -0.5),
        down_proj=randn(E, H, I, scale=I ** -0.5),
        gate_up_bias=randn(E, 2 * I, scale=0.5),
        down_bias=randn(E, H, scale=0.5),
    )


def _leaves(inp, names):
    return {n: (t.detach().clone().requires_grad_(n in names) if t.is_floating_point() else t)
            for n, t in inp.items()}


def _mok(inp, activation, limit, with_bias=(True, True), **kw):
    return mok_inductor.moe(inp["x"], inp["router_weights"], inp["top_experts"], inp["gate_up_proj"],
                            inp["down_proj"], swiglu_limit=limit, activation=activation,
                            gate_up_bias=inp["gate_up_bias"] if with_bias[0] else None,
                            down_bias=inp["down_bias"] if with_bias[1] else None, **kw)


def _oracle_with_grads(inp, activation, limit, with_bias, dy):
    leaves = {n: (t.detach().double().requires_grad_(True) if t.is_floating_point() else t) for n, t in inp.items()}
    y = oracle_moe(leaves["x"], leaves["router_weights"], leaves["top_experts"], leaves["gate_up_proj"],
                   leaves["down_proj"], swiglu_limit=limit, activation=activation,
                   gate_up_bias=leaves["gate_up_bias"] if with_bias[0] else None,
                   down_bias=leaves["down_bias"] if with_bias[1] else None)
    if y.requires_grad:  # the oracle's output is a constant zero when no route exists (T = 0)
        y.backward(dy.double())
    # a leaf the oracle never used has no grad: its gradient is zero
    return y.detach(), {n: leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n])
                        for n in NAMES}


# (activation, swiglu_limit, (gate_up_bias?, down_bias?), dtype, routing kind): the GPT-OSS expert as the model
# has it (limit and both biases), without a limit or biases, one bias alone, and the SwiGLU with biases (the
# variant's two parameters are independent of its biases)
CASES = {
    "gpt_oss_fp32": ("gpt_oss", 1.0, (True, True), torch.float32, "random"),
    "gpt_oss_bf16": ("gpt_oss", 1.0, (True, True), torch.bfloat16, "random"),
    "gpt_oss_nolimit_nobias_fp32": ("gpt_oss", None, (False, False), torch.float32, "random"),
    "gpt_oss_down_bias_only_bf16": ("gpt_oss", 1.0, (False, True), torch.bfloat16, "low_half"),  # empty experts
    "swiglu_bias_fp32": ("swiglu", 0.8, (True, True), torch.float32, "repeat"),  # repeated experts in a token
}


@pytest.mark.parametrize("case", list(CASES))
def test_against_oracle(case):
    activation, limit, with_bias, dtype, kind = CASES[case]
    inp = _inputs(dtype=dtype, seed=len(case), kind=kind)
    gen = torch.Generator().manual_seed(len(case) + 100)
    dy = torch.randn(inp["x"].shape, generator=gen, dtype=torch.float64).to(dtype)
    leaves = _leaves(inp, NAMES)
    y = _mok(leaves, activation, limit, with_bias)
    y.backward(dy)
    y_ref, g_ref = _oracle_with_grads(inp, activation, limit, with_bias, dy)
    tol = TOLERANCE[dtype]
    assert y.dtype == dtype and rel_err(y, y_ref) <= tol, rel_err(y, y_ref)
    for n in NAMES:
        if n in ("gate_up_bias", "down_bias") and not with_bias[n == "down_bias"]:
            assert leaves[n].grad is None
            continue
        g = leaves[n].grad
        assert g.dtype == leaves[n].dtype and g.shape == leaves[n].shape, n
        assert rel_err(g, g_ref[n]) <= tol, f"d_{n}: {rel_err(g, g_ref[n]):.3e}"


def test_no_route_gives_zero_output_and_bias_gradients():
    # every route -1: no expert runs, so the down bias (added per route) must not appear in the output
    inp = _inputs(T=3, kind="none")
    leaves = _leaves(inp, NAMES)
    y = _mok(leaves, "gpt_oss", 1.0)
    y.backward(torch.randn(y.shape))
    assert torch.equal(y, torch.zeros_like(y))
    assert torch.equal(leaves["down_bias"].grad, torch.zeros_like(inp["down_bias"]))
    assert torch.equal(leaves["gate_up_bias"].grad, torch.zeros_like(inp["gate_up_bias"]))


def _hf_layout(inp):
    """GPT-OSS's checkpoint tensors holding the same values: gate_up [E, H, 2I] and its bias [E, 2I] with gate and
    up interleaved (gate at even columns), down [E, I, H]."""
    w1, b1, w2 = inp["gate_up_proj"], inp["gate_up_bias"], inp["down_proj"]
    E, two_i, H = w1.shape
    I = two_i // 2
    w_hf = torch.stack([w1[:, :I].transpose(1, 2), w1[:, I:].transpose(1, 2)], dim=-1).reshape(E, H, 2 * I)
    b_hf = torch.stack([b1[:, :I], b1[:, I:]], dim=-1).reshape(E, 2 * I).contiguous()
    return w_hf, b_hf, w2.transpose(1, 2).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_checkpoint_layout_views(dtype):
    """The 4-D FC1 view, the transposed down view and the [E, 2, I] bias view of GPT-OSS's parameters: the values
    of the oracle, and gradients that reach the parameters in their own (contiguous) layout as the op returns
    them: a hook sees each parameter's gradient before AccumulateGrad, which would copy one of another layout."""
    inp = _inputs(dtype=dtype, seed=7)
    E, two_i, H = inp["gate_up_proj"].shape
    I = two_i // 2
    w_hf, b_hf, d_hf = (t.requires_grad_(True) for t in _hf_layout(inp))
    x, rw = inp["x"].clone().requires_grad_(True), inp["router_weights"].clone().requires_grad_(True)
    arriving = {}
    for name, p in (("gate_up_proj", w_hf), ("gate_up_bias", b_hf), ("down_proj", d_hf)):
        p.register_hook(lambda g, name=name: arriving.__setitem__(name, g.is_contiguous()))
    y = mok_inductor.moe(x, rw, inp["top_experts"], w_hf.view(E, H, I, 2).permute(0, 3, 2, 1),
                         d_hf.transpose(1, 2), swiglu_limit=1.0, activation="gpt_oss",
                         gate_up_bias=b_hf.view(E, I, 2).transpose(1, 2), down_bias=inp["down_bias"])
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(dtype)
    y.backward(dy)
    assert arriving == {"gate_up_proj": True, "gate_up_bias": True, "down_proj": True}, arriving
    y_ref, g_ref = _oracle_with_grads(inp, "gpt_oss", 1.0, (True, True), dy)
    tol = TOLERANCE[dtype]
    assert rel_err(y, y_ref) <= tol
    w_ref, b_ref, d_ref = _hf_layout({"gate_up_proj": g_ref["gate_up_proj"], "gate_up_bias": g_ref["gate_up_bias"],
                                      "down_proj": g_ref["down_proj"]})
    for name, p, ref in (("gate_up_proj", w_hf, w_ref), ("gate_up_bias", b_hf, b_ref), ("down_proj", d_hf, d_ref),
                         ("x", x, g_ref["x"]), ("router_weights", rw, g_ref["router_weights"])):
        assert p.grad.stride() == p.stride(), f"d_{name}: strides {p.grad.stride()}, the parameter's {p.stride()}"
        assert rel_err(p.grad, ref) <= tol, f"d_{name}: {rel_err(p.grad, ref):.3e}"


def test_forward_mode_tangent():
    """torch.func.jvp with tangents of x, the weights and both biases against the oracle's float64 jvp."""
    inp = _inputs(T=12, seed=11)
    gen = torch.Generator().manual_seed(12)
    names = ("x", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
    tangents = tuple(torch.randn(inp[n].shape, generator=gen) for n in names)

    def f(oracle):
        def run(*ts):
            kw = dict(inp, **dict(zip(names, ts)))
            if oracle:
                return oracle_moe(kw["x"], kw["router_weights"].double(), kw["top_experts"], kw["gate_up_proj"],
                                  kw["down_proj"], swiglu_limit=1.0, activation="gpt_oss",
                                  gate_up_bias=kw["gate_up_bias"], down_bias=kw["down_bias"])
            return _mok(kw, "gpt_oss", 1.0)
        return run

    _, t = torch.func.jvp(f(False), tuple(inp[n] for n in names), tangents)
    _, t_ref = torch.func.jvp(f(True), tuple(inp[n].double() for n in names), tuple(v.double() for v in tangents))
    assert rel_err(t, t_ref) <= TOLERANCE[torch.float32]


def _op_args(inp, limit=1.0):
    return (inp["x"], inp["router_weights"], inp["top_experts"], inp["gate_up_proj"], inp["down_proj"], None, None,
            None, limit) + (None,) * 8 + ("gpt_oss", inp["gate_up_bias"], inp["down_bias"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    inp = _leaves(_inputs(T=5, H=8, I=4, E=3, dtype=dtype, seed=3), NAMES)
    torch.library.opcheck(torch.ops.mok.moe.default, _op_args(inp))
    d = {k: v.detach() for k, v in inp.items()}
    sched = torch.ops.mok.schedule(d["top_experts"], 3)
    fwd = (d["x"], d["router_weights"], d["top_experts"], *sched, d["gate_up_proj"], d["down_proj"], None, None,
           None, 1.0) + (None,) * 8 + ("gpt_oss", d["gate_up_bias"], d["down_bias"])
    torch.library.opcheck(torch.ops.mok.moe_fwd.default, fwd)
    y, gu, gus = torch.ops.mok.moe_fwd(*fwd)
    bwd = (torch.randn_like(y), *fwd[:11], gu, gus, 1.0) + (None,) * 6 + (True, True, "gpt_oss", d["gate_up_bias"],
                                                                          d["down_bias"])
    torch.library.opcheck(torch.ops.mok.moe_bwd.default, bwd)


def test_torch_compile_matches_eager():
    inp = _inputs(seed=5)
    dy = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(6))
    outs = []
    for fn in (_mok, torch.compile(_mok, backend="aot_eager", fullgraph=True)):
        leaves = _leaves(inp, NAMES)
        y = fn(leaves, "gpt_oss", 1.0)
        y.backward(dy)
        outs.append((y.detach(), *(leaves[n].grad for n in NAMES)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_errors():
    inp = _inputs(T=4, seed=9)
    with pytest.raises(ValueError, match="activation: expected one of"):
        _mok(inp, "gelu", None)
    with pytest.raises(ValueError, match="gate_up_bias: expected shape"):
        _mok(dict(inp, gate_up_bias=inp["gate_up_bias"][:, :-1]), "gpt_oss", None)
    with pytest.raises(ValueError, match="down_bias: expected shape"):
        _mok(dict(inp, down_bias=inp["down_bias"][:-1]), "gpt_oss", None)
    with pytest.raises(TypeError, match="down_bias: expected dtype"):
        _mok(dict(inp, down_bias=inp["down_bias"].double()), "gpt_oss", None)
    H, I = inp["x"].shape[1], inp["down_proj"].shape[2]
    with pytest.raises(ValueError, match="gate_up_bias: routed biases are not supported with a shared expert"):
        _mok(inp, "gpt_oss", None, shared_gate_up_proj=torch.randn(2 * I, H), shared_down_proj=torch.randn(H, I))


# The Triton kernels (under the interpreter on CPU: tiny shapes), through the same op: the activation's alpha and
# beta in the gate/up epilogue and the backward's, the biases in the GEMMs' accumulators, the bias gradients'
# per-expert row sums and the router weight's bias term.
# (activation, limit, biases, dtype, routing kind, HF checkpoint views?, options)
TRITON_CASES = {
    "gpt_oss_bf16_hf_views": ("gpt_oss", 1.0, (True, True), torch.bfloat16, "random", True, {}),
    # the backward's two-pass variant (a plain GEMM, then the activation's backward in a second kernel)
    "gpt_oss_fp32_empty_experts_two_pass": ("gpt_oss", 1.0, (True, True), torch.float32, "low_half", False,
                                            {"two_pass_min_rows": 1}),
    "swiglu_down_bias_fp32": ("swiglu", None, (False, True), torch.float32, "repeat", False, {}),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_kernels_against_oracle(case):
    from mok_inductor import kernels

    if not kernels.AVAILABLE:  # tests/conftest.py sets TRITON_INTERPRET=1 without CUDA, so this never skips in CI
        pytest.fail("the Triton kernels are not available (no CUDA and no TRITON_INTERPRET=1)")
    activation, limit, with_bias, dtype, kind, hf, opts = TRITON_CASES[case]
    # T=7 < a tile, H=16, I=8, E=4 (prime-free but with an empty expert in "low_half"), K=2
    inp = _inputs(T=7, H=16, I=8, E=4, K=2, dtype=dtype, seed=len(case), kind=kind)
    dy = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    leaves = _leaves({n: t.to(DEV) for n, t in inp.items()}, NAMES)
    call = dict(leaves)
    arriving = {}
    if hf:  # GPT-OSS's layouts: strided views (pointer loads, strided gradient destinations)
        w_hf, b_hf, d_hf = (t.detach().to(DEV).requires_grad_(True) for t in _hf_layout(inp))
        for p in (w_hf, b_hf, d_hf):  # each gradient as it arrives, before AccumulateGrad (which would copy)
            p.register_hook(lambda g, p=p: arriving.__setitem__(id(p), g.is_contiguous()))
        E, two_i, H = inp["gate_up_proj"].shape
        I = two_i // 2
        call.update(gate_up_proj=w_hf.view(E, H, I, 2).permute(0, 3, 2, 1), down_proj=d_hf.transpose(1, 2),
                    gate_up_bias=b_hf.view(E, I, 2).transpose(1, 2))
    with mok_inductor.options.override(backend="triton", **opts):
        y = _mok(call, activation, limit, with_bias)
        y.backward(dy.to(DEV))
    y_ref, g_ref = _oracle_with_grads(inp, activation, limit, with_bias, dy)
    tol = TOLERANCE[dtype]
    assert rel_err(y, y_ref) <= tol, rel_err(y, y_ref)
    grads = {n: leaves[n].grad for n in NAMES}
    if hf:
        assert list(arriving.values()) == [True] * 3, arriving
        grads["gate_up_proj"], grads["gate_up_bias"], grads["down_proj"] = w_hf.grad, b_hf.grad, d_hf.grad
        g_ref = dict(g_ref)
        g_ref["gate_up_proj"], g_ref["gate_up_bias"], g_ref["down_proj"] = _hf_layout(
            {"gate_up_proj": g_ref["gate_up_proj"], "gate_up_bias": g_ref["gate_up_bias"],
             "down_proj": g_ref["down_proj"]})
    for n in NAMES:
        if n in ("gate_up_bias", "down_bias") and not with_bias[n == "down_bias"]:
            continue
        assert rel_err(grads[n], g_ref[n]) <= tol, f"d_{n}: {rel_err(grads[n], g_ref[n]):.3e}"


@pytest.mark.parametrize("hf", [False, True], ids=["contiguous", "hf_views"])
def test_decode_forward_against_oracle(hf, monkeypatch, poisoned_empty):
    """The decode forward (a call without gradient of a few routes: `kernels.gemv`) with the GPT-OSS activation,
    its clamp and both biases, in the contiguous layouts and in GPT-OSS's checkpoint views (gate and up
    interleaved, read as one tile): against the oracle and against the grouped path."""
    from mok_inductor import kernels
    from _helpers import assert_same_arithmetic, record_launches

    if not kernels.AVAILABLE:
        pytest.fail("the Triton kernels are not available (no CUDA and no TRITON_INTERPRET=1)")
    # T=3, K=4: 12 routes, H=24 (a K-step tail), I=12, E=12; -1 routes (the down bias is not added for them) and
    # an expert repeated within a token
    inp = _inputs(T=3, H=24, I=12, E=12, K=4, dtype=torch.bfloat16, seed=31)
    inp["top_experts"] = torch.tensor([[0, 10, -1, 0], [5, -1, 11, 6], [4, 5, 4, -1]])
    call = {n: t.to(DEV) for n, t in inp.items()}
    if hf:
        w_hf, b_hf, d_hf = (t.to(DEV) for t in _hf_layout(inp))
        E, two_i, H = inp["gate_up_proj"].shape
        I = two_i // 2
        call.update(gate_up_proj=w_hf.view(E, H, I, 2).permute(0, 3, 2, 1), down_proj=d_hf.transpose(1, 2),
                    gate_up_bias=b_hf.view(E, I, 2).transpose(1, 2))
    launched = record_launches(monkeypatch)
    with torch.no_grad(), mok_inductor.options.override(backend="triton"):
        y = _mok(call, "gpt_oss", 1.0)
        assert kernels.gemv._gemv_gate_up_kernel in launched and kernels.gate_up.GATE_UP not in launched
        with mok_inductor.options.override(decode_max_routes=0):
            y_grouped = _mok(call, "gpt_oss", 1.0)
    y_ref, _ = _oracle_with_grads(inp, "gpt_oss", 1.0, (True, True), torch.zeros(inp["x"].shape))
    tol = TOLERANCE[torch.bfloat16]
    assert rel_err(y, y_ref) <= tol, rel_err(y, y_ref)
    assert_same_arithmetic(y, y_grouped)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mxfp8_weights_with_biases(backend):
    """MXFP8 routed weights with the GPT-OSS variant: the biases are separate x.dtype tensors, so the forward and
    every gradient (the weights' to their masters, straight-through) equal the computation on the row-wise
    dequantized weights (the forward's; the data gradients read the column-wise pair, within bf16 rounding)."""
    from mok_inductor import kernels, mxfp8

    if backend == "triton" and not kernels.AVAILABLE:
        pytest.fail("the Triton kernels are not available (no CUDA and no TRITON_INTERPRET=1)")
    # H=32, I=32 (MXFP8 blocks of 32 along both dims), T=6 < a tile, E=3, K=2
    inp = _inputs(T=6, H=32, I=32, E=3, K=2, dtype=torch.bfloat16, seed=21)
    dev = DEV if backend == "triton" else "cpu"
    masters = {n: inp[n].to(dev).clone().requires_grad_(True) for n in ("gate_up_proj", "down_proj")}
    q = {n: mxfp8.quantize(masters[n]) for n in masters}
    deq = {n: mxfp8.dequantize(q[n], layout="row").cpu() for n in q}
    dy = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(22)).to(torch.bfloat16)
    leaves = _leaves({n: t.to(dev) for n, t in inp.items()}, NAMES)
    with mok_inductor.options.override(backend=backend):
        y = _mok(dict(leaves, **q), "gpt_oss", 1.0)
        y.backward(dy.to(dev))
    y_ref, g_ref = _oracle_with_grads(dict(inp, **deq), "gpt_oss", 1.0, (True, True), dy)
    tol = TOLERANCE[torch.bfloat16]
    assert rel_err(y, y_ref) <= tol, rel_err(y, y_ref)
    got = {**{n: leaves[n].grad for n in NAMES}, **{n: masters[n].grad for n in masters}}
    for n in NAMES:
        assert rel_err(got[n], g_ref[n]) <= tol, f"d_{n}: {rel_err(got[n], g_ref[n]):.3e}"


def test_autocast_casts_the_biases():
    """Under torch.autocast the biases are cast with x and the weights (mok::moe's autocast policy): the result
    and the gradients equal the call on the cast inputs, the gradients coming back in float32 through the casts."""
    inp = _inputs(T=8, seed=31)
    dy = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(32)).to(torch.bfloat16)
    leaves = _leaves(inp, NAMES)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _mok(leaves, "gpt_oss", 1.0)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    cast = _leaves({n: (t.to(torch.bfloat16) if n != "router_weights" and t.is_floating_point() else t)
                    for n, t in inp.items()}, NAMES)
    y_cast = _mok(cast, "gpt_oss", 1.0)
    y_cast.backward(dy)
    torch.testing.assert_close(y, y_cast, rtol=0, atol=0)
    for n in NAMES:
        assert leaves[n].grad.dtype == inp[n].dtype, n
        torch.testing.assert_close(leaves[n].grad, cast[n].grad.to(inp[n].dtype), rtol=0, atol=0)


def test_interleaved_weights_load_by_pointers():
    """GPT-OSS's interleaved gate/up rows have inner stride 2 along I and 2I along H (no unit stride): no TMA
    descriptor is built for them (TMA needs a unit inner stride), the launches load them by pointers."""
    from mok_inductor import kernels
    from mok_inductor.kernels import operands
    from mok_inductor.types import Operand, split_gate_up

    if not kernels.AVAILABLE:
        pytest.fail("the Triton kernels are not available (no CUDA and no TRITON_INTERPRET=1)")
    E, H, I = 3, 64, 32
    w_hf = torch.randn(E, H, 2 * I, dtype=torch.bfloat16)
    gate, up = split_gate_up(w_hf.view(E, H, I, 2).permute(0, 3, 2, 1))
    assert gate.stride() == (H * 2 * I, 2, 2 * I)
    assert operands.tma_weights((Operand(gate, None), Operand(up, None))) is None


# T=0 (an empty call: zero weight and bias gradients), T=1 with K=1, K=E with every expert on every token
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("T,K", [(0, 2), (1, 1), (3, 4)])
def test_edge_cases_against_oracle(backend, T, K):
    inp = _inputs(T=T, E=4, K=K, seed=40 + T + K, drop=0.0)
    dy = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(41))
    dev = DEV if backend == "triton" else "cpu"
    leaves = _leaves({n: t.to(dev) for n, t in inp.items()}, NAMES)
    with mok_inductor.options.override(backend=backend):
        y = _mok(leaves, "gpt_oss", 1.0)
        y.backward(dy.to(dev))
    y_ref, g_ref = _oracle_with_grads(inp, "gpt_oss", 1.0, (True, True), dy)
    assert y.shape == y_ref.shape and rel_err(y, y_ref) <= TOLERANCE[torch.float32]
    for n in NAMES:
        assert rel_err(leaves[n].grad, g_ref[n]) <= TOLERANCE[torch.float32], n


# On CUDA the same op at shapes that reach every kernel variant: decode (pointer loads, a few rows per expert),
# TMA loads (rows per expert >= tma_min_rows), the two-pass backward (>= two_pass_min_rows), each in GPT-OSS's
# checkpoint layout (strided FC1 view: the interleaved gate/up columns) and contiguous, and MXFP8 weights.
# (T, H, I, E, K, HF views?, MXFP8?)
CUDA_CASES = {
    "decode_hf_views": (5, 256, 128, 8, 4, True, False),
    "tma_contiguous": (768, 256, 192, 4, 2, False, False),
    "tma_hf_views": (768, 256, 192, 4, 2, True, False),
    "two_pass_hf_views": (1536, 128, 128, 4, 2, True, False),
    "mxfp8_mid": (384, 256, 128, 4, 2, False, True),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_kernels_against_oracle(case):
    """The GPT-OSS variant through the CUDA kernels, bf16, against the float64 oracle on the CPU: the output and
    every gradient (biases included) within SPEC's bf16 bound."""
    from mok_inductor import mxfp8

    T, H, I, E, K, hf, mx = CUDA_CASES[case]
    inp = _inputs(T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, seed=T + H, kind="random")
    dy = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref_inp = dict(inp)
    cuda = {n: t.cuda() for n, t in inp.items()}
    if mx:
        masters = {n: cuda[n].clone().requires_grad_(True) for n in ("gate_up_proj", "down_proj")}
        q = {n: mxfp8.quantize(masters[n]) for n in masters}
        ref_inp.update({n: mxfp8.dequantize(q[n], layout="row").cpu() for n in q})
    leaves = _leaves(cuda, NAMES)
    call = dict(leaves)
    if mx:
        call.update(q)
    params = {}
    if hf:
        w_hf, b_hf, d_hf = (t.detach().cuda().requires_grad_(True) for t in _hf_layout(inp))
        params = {"gate_up_proj": w_hf, "gate_up_bias": b_hf, "down_proj": d_hf}
        call.update(gate_up_proj=w_hf.view(E, H, I, 2).permute(0, 3, 2, 1), down_proj=d_hf.transpose(1, 2),
                    gate_up_bias=b_hf.view(E, I, 2).transpose(1, 2))
    with mok_inductor.options.override(backend="triton"):
        y = _mok(call, "gpt_oss", 1.0)
        y.backward(dy.to(y.dtype).cuda())
    torch.cuda.synchronize()
    y_ref, g_ref = _oracle_with_grads(ref_inp, "gpt_oss", 1.0, (True, True), dy.bfloat16())
    tol = TOLERANCE[torch.bfloat16]
    assert rel_err(y, y_ref) <= tol, rel_err(y, y_ref)
    grads = {n: leaves[n].grad for n in NAMES}
    if mx:
        grads.update({n: masters[n].grad for n in masters})
    if hf:
        grads.update({n: params[n].grad for n in params})
        g_ref = dict(g_ref)
        g_ref["gate_up_proj"], g_ref["gate_up_bias"], g_ref["down_proj"] = _hf_layout(
            {"gate_up_proj": g_ref["gate_up_proj"], "gate_up_bias": g_ref["gate_up_bias"],
             "down_proj": g_ref["down_proj"]})
    bad = {n: f"{rel_err(grads[n].cpu(), g_ref[n]):.2e}" for n in NAMES
           if not rel_err(grads[n].cpu(), g_ref[n]) <= tol}
    assert not bad, bad


@pytest.mark.parametrize("tma, two_pass", [(False, False), (True, False), (False, True)],
                         ids=["pointers", "tma", "two_pass"])
def test_interleaved_weight_read_whole(tma, two_pass, monkeypatch):
    """GPT-OSS's checkpoint layout through the Triton kernels (the interpreter on CPU): the gate/up GEMM loads
    gate and up as one tile of the interleaved weight (INTERLEAVED, through TMA descriptors at tma_min_rows 0),
    the backward writes dgu interleaved and runs the data gradient and the weight gradient on the whole weight
    ([E, H, 2I] and [E, 2I, H], unit stride along 2I); the output and every gradient equal the oracle's.
    H = 64 gives two whole K steps of the interpreter's BLOCK_K 32 (the TMA loop runs), I = 16. The SwiGLU
    backward (fused in the GEMM's epilogue, or its second pass) stores dg and du as one interleaved tile."""
    from mok_inductor import kernels, ops
    from mok_inductor.kernels import bwd_act, grouped_gemm

    if not kernels.AVAILABLE:
        pytest.fail("the Triton kernels are not available (no CUDA and no TRITON_INTERPRET=1)")
    inp = _inputs(T=9, H=64, I=16, E=3, K=2, dtype=torch.bfloat16, seed=41 + tma)
    dy = torch.randn(inp["x"].shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).bfloat16()
    seen = {"INTERLEAVED": [], "TMA": [], "interleave": [], "dx_weight_strides": [], "INTERLEAVE": []}
    real_launch, real_bwd_act, real_rows = kernels.common.launch, bwd_act.bwd_act, grouped_gemm.grouped_rows

    def launch(k, *a, **kw):
        if "INTERLEAVED" in kw:
            seen["INTERLEAVED"].append(kw["INTERLEAVED"])
            seen["TMA"].append(kw["TMA"])
        if "INTERLEAVE" in kw:  # (the bwd_act launches: the GEMM, and the two-pass variant's second pass)
            seen["INTERLEAVE"].append((kw.get("STORE_ACC", False), kw["INTERLEAVE"]))
        return real_launch(k, *a, **kw)

    def spy_bwd_act(*a, **kw):
        seen["interleave"].append(kw.get("interleave"))
        return real_bwd_act(*a, **kw)

    def spy_rows(a, w1, *rest, **kw):
        if kw.get("w2") is None and w1.data.shape[-1] == 2 * 16:  # the data gradient's [E, H, 2I] operand
            seen["dx_weight_strides"].append(w1.data.stride())
        return real_rows(a, w1, *rest, **kw)

    monkeypatch.setattr(kernels.common, "launch", launch)
    monkeypatch.setattr(bwd_act, "bwd_act", spy_bwd_act)
    monkeypatch.setattr(grouped_gemm, "grouped_rows", spy_rows)
    w_hf, b_hf, d_hf = (t.detach().to(DEV).requires_grad_(True) for t in _hf_layout(inp))
    x = inp["x"].to(DEV).clone().requires_grad_(True)
    rw = inp["router_weights"].to(DEV).clone().requires_grad_(True)
    db = inp["down_bias"].to(DEV).clone().requires_grad_(True)
    E, H, two_i = w_hf.shape
    I = two_i // 2
    with mok_inductor.options.override(backend="triton", tma_min_rows=0 if tma else 1 << 30,
                                       two_pass_min_rows=1 if two_pass else 1 << 30):
        assert ops.use_triton(x)
        y = mok_inductor.moe(x, rw, inp["top_experts"].to(DEV), w_hf.view(E, H, I, 2).permute(0, 3, 2, 1),
                             d_hf.transpose(1, 2), swiglu_limit=1.0, activation="gpt_oss",
                             gate_up_bias=b_hf.view(E, I, 2).transpose(1, 2), down_bias=db)
        y.backward(dy.to(DEV))
    assert seen["INTERLEAVED"] == [True] and seen["TMA"] == [tma], seen
    assert seen["interleave"] == [True] and seen["dx_weight_strides"] == [(H * two_i, two_i, 1)], seen
    assert seen["INTERLEAVE"] == ([(True, True), (False, True)] if two_pass else [(False, True)]), seen
    y_ref, g_ref = _oracle_with_grads(inp, "gpt_oss", 1.0, (True, True), dy)
    g_ref = dict(g_ref)
    g_ref["gate_up_proj"], g_ref["gate_up_bias"], g_ref["down_proj"] = _hf_layout(
        {"gate_up_proj": g_ref["gate_up_proj"], "gate_up_bias": g_ref["gate_up_bias"], "down_proj": g_ref["down_proj"]})
    got = {"x": x.grad, "router_weights": rw.grad, "gate_up_proj": w_hf.grad, "down_proj": d_hf.grad,
           "gate_up_bias": b_hf.grad, "down_bias": db.grad}
    tol = TOLERANCE[torch.bfloat16]
    assert rel_err(y, y_ref) <= tol, rel_err(y, y_ref)
    bad = {n: f"{rel_err(got[n], g_ref[n]):.2e}" for n in NAMES if not rel_err(got[n], g_ref[n]) <= tol}
    assert not bad, bad


def test_interleaved_weight_into_separate_gradient_buffers():
    """Interleaved gate/up weights with weight-gradient destinations of another layout (separate [E, I, H]
    buffers, as a caller of the functional backward may give): the interleaved dgu is put back in [dg | du]
    order for them, and they equal the gradients the contiguous weights give."""
    from mok_inductor import kernels, ops
    from mok_inductor.types import GradBuffers, RoutedOperands, Schedule, activation, split_gate_up

    if not kernels.AVAILABLE:
        pytest.fail("the Triton kernels are not available (no CUDA and no TRITON_INTERPRET=1)")
    inp = {n: t.to(DEV) for n, t in _inputs(T=7, H=16, I=8, E=3, K=2, dtype=torch.float32, seed=43).items()}
    w_hf, _, _ = _hf_layout(inp)
    E, H, two_i = w_hf.shape
    I = two_i // 2
    x, rw, te = inp["x"], inp["router_weights"], inp["top_experts"]
    sched = Schedule(*torch.ops.mok.schedule(te.int(), E))
    act = activation("gpt_oss")
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(DEV)
    results = []
    with mok_inductor.options.override(backend="triton"):
        for fc1 in (inp["gate_up_proj"], w_hf.view(E, H, I, 2).permute(0, 3, 2, 1)):
            gate, up = split_gate_up(fc1)
            operands = RoutedOperands.of_weights(gate, up, inp["down_proj"])
            fwd = ops.forward(x, rw, te, sched, operands, swiglu_limit=1.0, act=act)
            grads = GradBuffers(torch.full((E, I, H), float("nan"), device=DEV),
                                torch.full((E, I, H), float("nan"), device=DEV),
                                torch.full((E, H, I), float("nan"), device=DEV))
            bwd = ops.backward(dy, x, rw, te, sched, operands, fwd.gu_N2I, swiglu_limit=1.0, act=act, grads=grads)
            results.append((fwd.y_TH, bwd.dx_TH, grads.d_gate, grads.d_up, grads.d_down))
    for a, b in zip(*results):
        assert rel_err(a, b) <= 1e-6, rel_err(a, b)


def test_interleaved_pair_is_a_view_of_the_4d_buffer():
    """operands.interleaved_pair: the [E, 2I, H] view of a gradient buffer laid out as GPT-OSS's FC1 ([E, 2, I, H]
    permuted from [E, H, I, 2]) is the same tensor `interleaved` builds from its halves, reached by view ops (a
    write through it lands in the buffer's halves); a buffer of another layout gives None."""
    from mok_inductor.kernels import operands

    E, H, I = 3, 5, 4
    base = torch.randn(E, H, I, 2, generator=torch.Generator().manual_seed(3))
    pair = base.permute(0, 3, 2, 1)  # [E, 2, I, H], halves interleaved along I
    got = operands.interleaved_pair(pair.transpose(2, 3), 2)  # halves [E, H, I] interleaved along their dim 2
    want = operands.interleaved(pair[:, 0].transpose(1, 2), pair[:, 1].transpose(1, 2), 2)
    assert got is not None and want is not None and got.shape == want.shape == (E, H, 2 * I)
    assert got.stride() == want.stride() and torch.equal(got, want)
    both = operands.interleaved_pair(pair, 1)  # halves [E, I, H] interleaved along I: [E, 2I, H]
    assert both is not None and both.shape == (E, 2 * I, H) and both._base is not None
    both.copy_(torch.arange(both.numel(), dtype=both.dtype).view(both.shape))
    assert torch.equal(pair[:, 0], both[:, 0::2]) and torch.equal(pair[:, 1], both[:, 1::2])
    assert operands.interleaved_pair(torch.randn(E, 2, I, H), 1) is None  # [gate | up] blocks, not interleaved
    assert operands.interleaved_pair(torch.randn(E, 3, I, H), 1) is None
