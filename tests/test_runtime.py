"""The seed's runtime bridge (mok_inductor.runtime) without Megatron: the argument adapters and
_MoKAutograd driven by a small stand-in module that owns one combined [E, 2I, H] FC1, an [E, H, I] FC2
and a gated shared expert, with gradient-accumulation fusion on (main_grad) and off (.grad).

Shapes: T=20, H=32, I=16, Is=16, E=3 (prime), K=2, fresh random inputs, clamp active.
"""

import pytest
import torch

from mok_inductor import functional as mf
from mok_inductor.runtime import (
    _gate_up_main_grad_arguments,
    _gate_up_weight_arguments,
    _MoKAutograd,
    _MoKWeightArguments,
)
from _helpers import DEVICES, TOLERANCE, MoeCase, oracle_with_grads, rel_err

T, H, I, E, K = 20, 32, 16, 3, 2
LIMIT = 1.5


class StandIn(torch.nn.Module):
    """The duck-typed interface _MoKAutograd uses (MoKMegakernel's, reduced to a single grouped layout)."""

    def __init__(self, device, dtype, fused):
        super().__init__()
        p = lambda *s: torch.nn.Parameter((torch.randn(*s) * 0.3).to(device, dtype))  # noqa: E731
        self.fc1, self.fc2 = p(E, 2 * I, H), p(E, H, I)
        self.sh1, self.sh2, self.gate = p(2 * I, H), p(H, I), p(1, H)
        self.mok_config = mf.MoKConfig()
        self.ep_group = None
        self.num_local_experts = E
        self.swiglu_limit = LIMIT
        self.shared_intermediate_size = I
        self.fuse_wgrad_accumulation = fused

    def autograd_parameters(self):
        return (self.fc1, self.fc2, self.sh1, self.sh2)

    def routed_weight_views(self):
        return self.fc1, self.fc2

    def main_grad_arguments(self):
        return (self.sh1.main_grad, self.fc1.main_grad, self.sh2.main_grad, self.fc2.main_grad), None

    def gate_main_grad(self):
        return self.gate.main_grad

    def fresh_grad_arguments(self):
        grads = tuple(torch.zeros_like(p) for p in self.autograd_parameters())
        return (grads[2], grads[0], grads[3], grads[1]), None, grads

    def finish_weight_gradients(self, params):
        out = []
        for q in params:
            q.grad_added_to_main_grad = True
            out.append(torch.zeros((), dtype=q.dtype, device=q.device).expand(q.shape))
        return tuple(out)

    def forward(self, x, rw, te):
        return _MoKAutograd.apply(self, x, rw, te, self.gate, *self.autograd_parameters())


def routing(device):
    te = torch.randn(T, E).topk(K, dim=1).indices.to(torch.int32)
    te[0, 1] = -1
    rw = torch.softmax(torch.randn(T, K), -1)
    return rw.to(device).requires_grad_(), te.to(device)


def oracle_grads(m, x, rw, te, dy):
    """The float64 oracle's y and gradients of (x, rw, fc1, fc2, sh1, sh2, gate)."""
    y, g = oracle_with_grads(MoeCase(x, rw, te, m.fc1, m.fc2, m.sh1, m.sh2, m.gate, LIMIT), dy)
    return y, [g[n] for n in ("x", "router_weights", "gate_up_proj", "down_proj", "shared_gate_up_proj",
                              "shared_down_proj", "shared_output_gate")]


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
    with pytest.raises(ValueError, match="MOK shared FC1 shape mismatch"):
        _gate_up_weight_arguments(sh1[:-1], fc1, I)


def test_main_grad_arguments_order_and_tables():
    sh1, r1, sh2, r2 = torch.zeros(2 * I, H), torch.zeros(E, 2 * I, H), torch.zeros(H, I), torch.zeros(E, H, I)
    six, tables = _gate_up_main_grad_arguments((sh1, r1, sh2, r2), None, I)
    assert tables is None
    assert six[1] is r1 and six[3] is r1 and six[4] is sh2 and six[5] is r2
    assert six[0].data_ptr() == sh1.data_ptr() and six[2].data_ptr() == sh1[I:].data_ptr()
    t1, t2 = [torch.zeros(2 * I, H)] * E, [torch.zeros(H, I)] * E
    _, tables = _gate_up_main_grad_arguments((sh1, t1[0], sh2, t2[0]), (t1, t2), I)
    assert tables[0] is t1 and tables[1] is t1 and tables[2] is t2
    with pytest.raises(ValueError, match="shape mismatch"):
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
    params = (m.fc1, m.fc2, m.sh1, m.sh2, m.gate)
    for q in params:
        q.main_grad = torch.zeros(q.shape, device=device, dtype=torch.float32)
        q.grad_added_to_main_grad = False
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
            assert torch.count_nonzero(q.grad) == 0  # the hook-only dummy never carries the gradient
            q.grad = None  # what DDP's hook does
    for q, w in zip(params, want):
        assert rel_err(q.main_grad, w) <= 1e-2


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
    assert node.module is m and node.forward_context is not None
    y.sum().backward()
    assert node.module is None and node.workspace is None and node.schedule is None and node.forward_context is None
