"""The seed's runtime bridge (mok_inductor.runtime) without Megatron: the argument adapters and
_MoKAutograd driven by a small stand-in module that owns one combined [E, 2I, H] FC1, an [E, H, I] FC2
and a (gated) shared expert, with gradient-accumulation fusion on (main_grad) and off (.grad).

Also: the functional module looked up when the op runs (MoK, or a stand-in, swapped in through
`sys.modules["mok.functional"]` or `set_functional`); the backward on the forward's weights after a
`param.data = ...`; MoK's older 8-result backward; the MXFP8 single-grouped operand slicing.

Shapes: T=20, H=32, I=16, Is=16, E=3 (prime), K=2 (I=32 for MXFP8, whose blocks are 32 long), fresh
random inputs, clamp active.
"""

import sys
import types

import pytest
import torch

from mok_inductor import functional as mf
from mok_inductor import mxfp8
from mok_inductor import runtime
from mok_inductor.runtime import (
    _gate_up_main_grad_arguments,
    _gate_up_weight_arguments,
    _MoKAutograd,
    _MoKWeightArguments,
)
from mok_inductor.integrations.megatron.parameter_bridge import main_grad_buffer
from _helpers import DEVICES, TOLERANCE, MoeCase, ddp_like, oracle_with_grads, rel_err

T, H, I, E, K = 20, 32, 16, 3, 2
LIMIT = 1.5


class StandIn(torch.nn.Module):
    """The duck-typed interface _MoKAutograd uses (MoKMegakernel's, reduced to a single grouped layout)."""

    def __init__(self, device, dtype, fused, gated=True, i=I):
        super().__init__()
        p = lambda *s: torch.nn.Parameter((torch.randn(*s) * 0.3).to(device, dtype))  # noqa: E731
        self.fc1, self.fc2 = p(E, 2 * i, H), p(E, H, i)
        self.sh1, self.sh2 = p(2 * i, H), p(H, i)
        self.gate = p(1, H) if gated else None
        self.mok_config = mf.MoKConfig()
        self.ep_group = None
        self.num_local_experts = E
        self.swiglu_limit = LIMIT
        self.shared_intermediate_size = i
        self.fuse_wgrad_accumulation = fused
        self.autograd_routed_parameters = (self.fc1, self.fc2)

    def autograd_parameters(self):
        return (self.fc1, self.fc2, self.sh1, self.sh2)

    def weights(self):
        """Every parameter, in the oracle's order (fc1, fc2, sh1, sh2, gate)."""
        return tuple(q for q in (*self.autograd_parameters(), self.gate) if q is not None)

    def quantized_routed_weights(self):
        return self.fc1, self.fc2

    def main_grad_arguments(self):
        return tuple(main_grad_buffer(q) for q in (self.sh1, self.fc1, self.sh2, self.fc2)), None

    def fresh_grad_arguments(self):
        grads = tuple(torch.zeros_like(p) for p in self.autograd_parameters())
        return (grads[2], grads[0], grads[3], grads[1]), None, grads

    def forward(self, x, rw, te):
        return _MoKAutograd.apply(self, x, rw, te, self.gate, *self.autograd_parameters())


def routing(device):
    te = torch.randn(T, E).topk(K, dim=1).indices.to(torch.int32)
    te[0, 1] = -1
    rw = torch.softmax(torch.randn(T, K), -1)
    return rw.to(device).requires_grad_(), te.to(device)


def oracle_grads(m, x, rw, te, dy, weights=None):
    """The float64 oracle's y and gradients of (x, rw, fc1, fc2, sh1, sh2[, gate]), on `weights` (default:
    the module's current ones)."""
    fc1, fc2, sh1, sh2, *gate = weights if weights is not None else m.weights()
    case = MoeCase(x, rw, te, fc1, fc2, sh1, sh2, gate[0] if gate else None, LIMIT)
    y, g = oracle_with_grads(case, dy)
    names = ["x", "router_weights", "gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj"]
    return y, [g[n] for n in names + (["shared_output_gate"] if gate else [])]


class Recorder(types.ModuleType):
    """A functional module that calls mok-inductor's own and records each call's name and arguments."""

    def __init__(self, name="mok.functional"):
        super().__init__(name)
        self.calls = []
        for fn in ("get_workspace", "build_schedule", "forward", "backward"):
            setattr(self, fn, self._recording(fn, getattr(mf, fn)))

    def _recording(self, fn, real):
        def call(*args, **kwargs):
            self.calls.append((fn, args, kwargs))
            return real(*args, **kwargs)

        return call

    def names(self):
        return [c[0] for c in self.calls]


# ---------------------------------------------------------------------------------------------- adapters


def test_weight_arguments_are_zero_copy_views():
    sh1, sh2 = torch.randn(2 * I, H), torch.randn(H, I)
    fc1, fc2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    w = _MoKWeightArguments.from_combined(sh1, sh2, fc1, fc2, I)
    assert w._fields == ("shared_gate", "shared_up", "shared_down", "routed_gate", "routed_up", "routed_down")
    assert w.shared_gate.data_ptr() == sh1.data_ptr()
    assert w.shared_up.data_ptr() == sh1.data_ptr() + I * H * sh1.element_size()
    assert torch.equal(w.shared_gate, sh1[:I]) and torch.equal(w.shared_up, sh1[I:])
    assert w.shared_down is sh2 and w.routed_gate is fc1 and w.routed_up is fc1 and w.routed_down is fc2
    split = [torch.randn(2 * I, H) for _ in range(E)]  # per-expert payloads are passed through untouched
    assert _gate_up_weight_arguments(sh1, split, I)[2] is split
    assert _gate_up_weight_arguments(None, fc1, I) == (None, None, fc1, fc1)  # no shared expert
    for bad in (sh1[:-1], sh1[0], torch.randn(2 * I + 2, H)):  # upstream's type: RuntimeError
        with pytest.raises(RuntimeError, match=r"MOK shared FC1 shape mismatch: expected \[2\*16, hidden_size\]"):
            _gate_up_weight_arguments(bad, fc1, I)


def test_main_grad_arguments_order_and_tables():
    sh1, r1, sh2, r2 = torch.zeros(2 * I, H), torch.zeros(E, 2 * I, H), torch.zeros(H, I), torch.zeros(E, H, I)
    six, tables = _gate_up_main_grad_arguments((sh1, r1, sh2, r2), None, I)
    assert tables is None
    assert six[1] is r1 and six[3] is r1 and six[4] is sh2 and six[5] is r2
    assert six[0].data_ptr() == sh1.data_ptr() and six[2].data_ptr() == sh1[I:].data_ptr()
    t1, t2 = [torch.zeros(2 * I, H)] * E, [torch.zeros(H, I)] * E
    _, tables = _gate_up_main_grad_arguments((sh1, t1[0], sh2, t2[0]), (t1, t2), I)
    assert tables[0] is t1 and tables[1] is t1 and tables[2] is t2
    with pytest.raises(RuntimeError, match="MOK shared FC1 shape mismatch"):
        _gate_up_main_grad_arguments((sh1[:3], r1, sh2, r2), None, I)


# ---------------------------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autograd_without_fusion_gives_ordinary_grads(device, dtype):
    m = StandIn(device, dtype, fused=False)
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    rw, te = routing(device)
    dy = torch.randn(T, H, device=device, dtype=dtype)
    y = m(x, rw, te)
    y.backward(dy)
    ref_y, g = oracle_grads(m, x, rw, te, dy)
    tol = TOLERANCE[dtype]
    assert rel_err(y, ref_y) <= tol
    for got, want in zip((x.grad, rw.grad, m.fc1.grad, m.fc2.grad, m.sh1.grad, m.sh2.grad, m.gate.grad), g):
        assert got.dtype == (torch.float32 if got is rw.grad else dtype)
        assert rel_err(got, want) <= tol
    assert not hasattr(m.fc1, "grad_added_to_main_grad")


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_with_fusion_accumulates_main_grad_over_micro_batches(device):
    m = StandIn(device, torch.bfloat16, fused=True)
    ddp_like(m.weights())
    params = m.weights()
    initial = [q.detach().clone() for q in params]
    want = [torch.zeros(q.shape, dtype=torch.float64) for q in params]
    for _ in range(2):  # two micro-batches
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16, requires_grad=True)
        rw, te = routing(device)
        dy = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        m(x, rw, te).backward(dy)
        _, g = oracle_grads(m, x, rw, te, dy)
        want = [w + gi for w, gi in zip(want, g[2:])]
        assert rel_err(x.grad, g[0]) <= 1e-2 and rel_err(rw.grad, g[1]) <= 1e-2
        for q in params:
            assert q.grad_added_to_main_grad is True
            assert q.grad is None  # the hook dropped the hook-only alias
            q.grad_added_to_main_grad = False  # what DDP's zero_grad_buffer does between iterations
    for q, w, w0 in zip(params, want, initial):
        assert rel_err(q.main_grad, w) <= 1e-2
        assert torch.equal(q, w0)  # nothing was added into the weights


def test_parameter_count_mismatch():
    m = StandIn("cpu", torch.float32, fused=False)
    rw, te = routing("cpu")
    with pytest.raises(RuntimeError, match="MOK autograd parameter count mismatch"):
        _MoKAutograd.apply(m, torch.randn(T, H), rw, te, m.gate, m.fc1, m.fc2, m.sh1)


def test_backward_drops_its_references():
    m = StandIn("cpu", torch.float32, fused=False)
    rw, te = routing("cpu")
    x = torch.randn(T, H, requires_grad=True)
    y = m(x, rw, te)
    node = y.grad_fn
    assert node.module is m and node.forward_context is not None and node.routed_weight_views is not None
    y.sum().backward()
    for name in ("module", "functional", "workspace", "schedule", "forward_context", "routed_weight_views",
                 "shared_weight_views", "gate_weight_view"):
        assert getattr(node, name) is None, name


def test_routed_weight_views_is_used_without_quantized_routed_weights():
    class Older(StandIn):  # a backend with only the project's older member
        quantized_routed_weights = None

        def routed_weight_views(self):
            return self.fc1, self.fc2

    m = Older("cpu", torch.float32, fused=False)
    x = torch.randn(T, H, requires_grad=True)
    rw, te = routing("cpu")
    y = m(x, rw, te)
    assert rel_err(y, oracle_grads(m, x, rw, te, torch.randn(T, H))[0]) <= TOLERANCE[torch.float32]


# ---------------------------------------------------------------------------------------------- which functional


def test_functional_is_looked_up_when_the_op_runs(monkeypatch):
    assert runtime.functional_module() is mf  # nothing else installed: mok-inductor's own
    m = StandIn("cpu", torch.float32, fused=False)
    x = torch.randn(T, H, requires_grad=True)
    rw, te = routing("cpu")
    dy = torch.randn(T, H)
    ref_y = m(x, rw, te)
    ref_y.backward(dy)
    ref_dx = x.grad.clone()
    x.grad = None

    mok = Recorder()  # installed after the runtime was imported: still used
    monkeypatch.setitem(sys.modules, "mok.functional", mok)
    assert runtime.functional_module() is mok
    y = m(x, rw, te)
    assert mok.names() == ["get_workspace", "build_schedule", "forward"]
    monkeypatch.delitem(sys.modules, "mok.functional")  # gone before the backward: the forward's module is kept
    y.backward(dy)
    assert mok.names() == ["get_workspace", "build_schedule", "forward", "backward"]
    assert y.grad_fn.functional is None  # dropped after the backward
    assert torch.equal(y, ref_y) and torch.equal(x.grad, ref_dx)
    assert runtime.functional_module() is mf


def test_set_functional_overrides_the_lookup(monkeypatch):
    pinned, loaded = Recorder("pinned"), Recorder()
    monkeypatch.setitem(sys.modules, "mok.functional", loaded)
    runtime.set_functional(pinned)
    try:
        assert runtime.functional_module() is pinned
        m = StandIn("cpu", torch.float32, fused=False)
        rw, te = routing("cpu")
        m(torch.randn(T, H, requires_grad=True), rw, te).sum().backward()
        assert pinned.names() == ["get_workspace", "build_schedule", "forward", "backward"]
        assert loaded.calls == []
    finally:
        runtime.set_functional(None)
    assert runtime.functional_module() is loaded


# ---------------------------------------------------------------------------------------------- forward's weights


def _cpu_layer(fused, **kw):
    """A float32 CPU stand-in layer (under Megatron DDP's protocol when fused) and fresh inputs: m, x, rw, te, dy."""
    m = StandIn("cpu", torch.float32, fused=fused, **kw)
    if fused:
        ddp_like(m.weights())
    rw, te = routing("cpu")
    return m, torch.randn(T, H, requires_grad=True), rw, te, torch.randn(T, H)


@pytest.mark.parametrize("fused", [False, True])
def test_backward_runs_on_the_forward_weights_after_a_storage_swap(fused):
    """A distributed optimizer (or a re-quantization) may rebind `param.data` between a micro-batch's
    forward and its backward: the backward must differentiate the forward's computation."""
    m, x, rw, te, dy = _cpu_layer(fused)
    y = m(x, rw, te)
    forward_weights = [q.detach().clone() for q in m.weights()]
    for q in m.weights():
        q.data = torch.randn_like(q) * 0.3  # new storage; the forward's is still referenced by its aliases
    y.backward(dy)
    _, want = oracle_grads(m, x, rw, te, dy, forward_weights)
    _, after = oracle_grads(m, x, rw, te, dy)
    tol = TOLERANCE[torch.float32]
    assert rel_err(x.grad, want[0]) <= tol and rel_err(rw.grad, want[1]) <= tol
    assert rel_err(x.grad, after[0]) > 100 * tol  # the swap changes the answer: the test can tell
    for q, g in zip(m.weights(), want[2:]):
        assert rel_err(q.main_grad if fused else q.grad, g) <= tol


# ---------------------------------------------------------------------------------------------- MoK's older ABI


def legacy_functional():
    """MoK before the shared output gate: forward/backward take no gate keywords, backward returns 8 results."""
    mok = Recorder()
    forward, backward = mok.forward, mok.backward
    mok.forward = lambda *a, swiglu_limit: forward(*a, swiglu_limit=swiglu_limit)
    mok.backward = lambda *a, swiglu_limit, main_grads, main_grad_storage_tables: tuple(backward(
        *a, swiglu_limit=swiglu_limit, main_grads=main_grads, main_grad_storage_tables=main_grad_storage_tables))[:8]
    return mok


@pytest.mark.parametrize("fused", [False, True])
def test_eight_result_backward_for_an_ungated_layer(monkeypatch, fused):
    monkeypatch.setitem(sys.modules, "mok.functional", legacy_functional())
    m, x, rw, te, dy = _cpu_layer(fused, gated=False)
    y = m(x, rw, te)
    y.backward(dy)
    ref_y, g = oracle_grads(m, x, rw, te, dy)
    tol = TOLERANCE[torch.float32]
    assert rel_err(y, ref_y) <= tol
    assert rel_err(x.grad, g[0]) <= tol and rel_err(rw.grad, g[1]) <= tol
    for q, want in zip(m.weights(), g[2:]):
        assert rel_err(q.main_grad if fused else q.grad, want) <= tol


def test_eight_result_backward_for_a_gated_unfused_layer_is_a_clear_error(monkeypatch):
    mok = Recorder()
    backward = mok.backward
    mok.backward = lambda *a, **kw: tuple(backward(*a, **kw))[:8]  # takes the gate, returns no gate gradient
    monkeypatch.setitem(sys.modules, "mok.functional", mok)
    m = StandIn("cpu", torch.float32, fused=False)
    rw, te = routing("cpu")
    y = m(torch.randn(T, H, requires_grad=True), rw, te)
    with pytest.raises(RuntimeError, match=r"returned 8 results, without the shared output gate's gradient"):
        y.sum().backward()


# ---------------------------------------------------------------------------------------------- MXFP8 operands


def spy_functional(T_, H_):
    """A stand-in MoK that records the routed operands and returns well-shaped results."""
    mok = types.ModuleType("mok.functional")
    mok.calls = []
    mok.get_workspace = lambda *a, **k: object()
    mok.build_schedule = lambda *a, **k: object()

    def forward(*args, **kwargs):
        mok.calls.append(("forward", args[8:11]))
        return torch.zeros(T_, H_), object()

    def backward(*args, **kwargs):
        mok.calls.append(("backward", args[10:13]))
        return (torch.zeros(T_, H_), torch.zeros(T_, K), *kwargs["main_grads"],
                kwargs.get("shared_output_gate_main_grad"))

    mok.forward, mok.backward = forward, backward
    return mok


class Mxfp8StandIn(StandIn):
    def __init__(self, views, *, mxfp8_weights, single_grouped):
        super().__init__("cpu", torch.bfloat16, fused=True)
        self.views = views
        self.use_mxfp8_weights = mxfp8_weights
        self.native_single_grouped_weights = single_grouped

    def quantized_routed_weights(self):
        return self.views


@pytest.mark.parametrize("n", [4, 5])
def test_mxfp8_single_grouped_operands_are_sliced(monkeypatch, n):
    mok = spy_functional(T, H)
    monkeypatch.setitem(sys.modules, "mok.functional", mok)
    fc1 = tuple(object() for _ in range(4)) + ((True,) if n == 5 else ())
    fc2 = tuple(object() for _ in range(4)) + ((True,) if n == 5 else ())
    m = Mxfp8StandIn((fc1, fc2), mxfp8_weights=True, single_grouped=True)
    ddp_like(m.weights())
    rw, te = routing("cpu")
    m(torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True), rw, te).sum().backward()
    (_, fwd), (_, bwd) = mok.calls
    assert fwd[0] is fwd[1] and fwd[0] == fc1[:2] and fwd[2] == fc2[:2]  # row-wise pairs
    assert bwd[0] is bwd[1] is fc1 and bwd[2] == fc2[2:]  # all of FC1; FC2's column-wise part


@pytest.mark.parametrize("mxfp8_weights,single_grouped", [(True, False), (False, True), (False, False)])
def test_other_routed_operands_are_passed_whole(monkeypatch, mxfp8_weights, single_grouped):
    mok = spy_functional(T, H)
    monkeypatch.setitem(sys.modules, "mok.functional", mok)
    fc1, fc2 = object(), object()  # e.g. split descriptors
    m = Mxfp8StandIn((fc1, fc2), mxfp8_weights=mxfp8_weights, single_grouped=single_grouped)
    ddp_like(m.weights())
    rw, te = routing("cpu")
    m(torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True), rw, te).sum().backward()
    (_, fwd), (_, bwd) = mok.calls
    assert fwd == (fc1, fc1, fc2) and bwd == (fc1, fc1, fc2)
    assert all(a is b for a, b in zip(fwd + bwd, (fc1, fc1, fc2) * 2))


@pytest.mark.parametrize("views", [(object(), object()), ((1, 2, 3), (1, 2, 3)), ((1, 2, 3, 4, False),) * 2])
def test_mxfp8_single_grouped_operand_of_another_form_is_a_clear_error(monkeypatch, views):
    monkeypatch.setitem(sys.modules, "mok.functional", spy_functional(T, H))
    m = Mxfp8StandIn(views, mxfp8_weights=True, single_grouped=True)
    rw, te = routing("cpu")
    with pytest.raises(RuntimeError, match=r"MOK MXFP8 single-grouped FC1: expected the quantized tuple"):
        m(torch.randn(T, H, dtype=torch.bfloat16), rw, te)


@pytest.mark.parametrize("form", ["native", "mxfp8weight"])
def test_mxfp8_single_grouped_through_the_bridge_equals_the_functional(form):
    """Real MXFP8 operands: the bridge's forward/backward (sliced tuples) give exactly what direct calls of
    the functional with the row-wise pairs and the column-wise parts give."""
    m = Mxfp8StandIn(None, mxfp8_weights=True, single_grouped=True)
    big = StandIn("cpu", torch.bfloat16, fused=True, i=32)  # MXFP8 blocks are 32 long: I = 32
    m.fc1, m.fc2, m.sh1, m.sh2, m.gate = big.fc1, big.fc2, big.sh1, big.sh2, big.gate
    m.autograd_routed_parameters, m.shared_intermediate_size = (m.fc1, m.fc2), 32
    q1, q2 = mxfp8.quantize(m.fc1.detach()), mxfp8.quantize(m.fc2.detach())
    if form == "native":  # Transformer Engine's column-wise storage: [E, M, K] data, [E, M/32, K] scales
        tup = lambda q: (q.data, q.scale, q.data_t.transpose(1, 2).contiguous(),  # noqa: E731
                         q.scale_t.transpose(1, 2).contiguous(), True)
        m.views = (tup(q1), tup(q2))
    else:
        m.views = (q1, q2)
    ddp_like(m.weights())
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    rw, te = routing("cpu")
    dy = torch.randn(T, H, dtype=torch.bfloat16)
    y = m(x, rw, te)
    y.backward(dy)

    cfg = mf.MoKConfig()
    ws = mf.get_workspace(cfg, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K)
    sch = mf.build_schedule(ws, cfg, te, num_local_experts=E)
    shared = (m.sh1[:32].detach(), m.sh1[32:].detach(), m.sh2.detach())
    gate = m.gate.detach()
    fc1_fwd = (q1.data, q1.scale)  # one object as gate and up: a combined FC1
    ref_y, fctx = mf.forward(cfg, ws, sch, x.detach(), rw.detach(), *shared, fc1_fwd, fc1_fwd,
                             (q2.data, q2.scale), swiglu_limit=LIMIT, shared_output_gate_weight=gate)
    fc1_bwd, fc2_bwd = (q1.data, q1.scale, q1.data_t, q1.scale_t), (q2.data_t, q2.scale_t)
    mg = [torch.zeros(q.shape, dtype=torch.float32) for q in (m.sh1, m.fc1, m.sh2, m.fc2, m.gate)]
    six = (mg[0][:32], mg[1], mg[0][32:], mg[1], mg[2], mg[3])
    out = mf.backward(cfg, ws, sch, fctx, dy, x.detach(), rw.detach(), *shared, fc1_bwd, fc1_bwd, fc2_bwd,
                      swiglu_limit=LIMIT, main_grads=six, shared_output_gate_main_grad=mg[4],
                      shared_output_gate_weight=gate)
    assert torch.equal(y, ref_y) and torch.equal(x.grad, out[0]) and torch.equal(rw.grad, out[1])
    for q, want in zip((m.sh1, m.fc1, m.sh2, m.fc2, m.gate), mg):
        assert torch.equal(q.main_grad, want)
        assert q.grad is None
