"""The main-grad bridge (mok_inductor.integrations.megatron.parameter_bridge) against Megatron-Core's own
DDP gradient hook, on the CPU.

- main_grad_buffer: the checks, their order, RuntimeError with the words Megatron users search for.
- the hook-only weight gradient: an alias of the weight (no allocation, checked with a dispatch mode
  that sees every tensor the backward creates), dropped by DDP's hook; no gradient at all for a
  parameter without DDP's flag; a clear error, before anything is added into the weights, when a
  flagged parameter's hook-only gradient was never dropped.
- _MoKAutograd over micro-batches with Megatron 0.16.1's `_make_backward_post_hook` installed the way
  DDP installs it.

Fresh random inputs; shapes small (T=12, H=32, I=16, E=3, K=2).
"""

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mok_inductor import functional as mf
from mok_inductor.integrations.megatron import parameter_bridge as pb
from mok_inductor.runtime import _MoKAutograd
from _helpers import MoeCase, oracle_with_grads, rel_err

# a pinned test dependency (requirements.txt): its absence must fail, not skip
import megatron.core.distributed.distributed_data_parallel as ddp_module  # noqa: E402

T, H, I, E, K = 12, 32, 16, 3, 2


def param(*shape, dtype=torch.bfloat16):
    return torch.nn.Parameter(torch.randn(*shape).to(dtype))


# ---------------------------------------------------------------------------------------------- main_grad checks


def _main_grad_case(case, p):
    if case == "missing":
        return
    p.main_grad = {
        "shape": lambda: torch.zeros(p.shape[1], p.shape[0]),
        "flat": lambda: torch.zeros(p.numel()),
        "not a tensor": lambda: [0.0] * p.numel(),
        "fp16": lambda: torch.zeros(p.shape, dtype=torch.float16),
        "fp64": lambda: torch.zeros(p.shape, dtype=torch.float64),
        "noncontiguous": lambda: torch.zeros(p.shape[1], p.shape[0]).t(),
        "zero_out_wgrad": lambda: torch.zeros(p.shape),
        "device": lambda: torch.zeros(p.shape, device="meta"),
    }[case]()
    p.zero_out_wgrad = case == "zero_out_wgrad"


@pytest.mark.parametrize("case,words", [
    ("missing", "requires DDP to assign param.main_grad"),
    ("shape", r"shape mismatch: param.main_grad is \[32, 8\], the parameter \[8, 32\]"),
    ("flat", "shape mismatch"),
    ("not a tensor", "shape mismatch: param.main_grad is list"),
    ("fp16", "FP32 or BF16 main_grad, got torch.float16"),
    ("fp64", "FP32 or BF16"),
    ("noncontiguous", r"contiguous main_grad; got strides \[1, 8\]"),
    ("zero_out_wgrad", "zero_out_wgrad"),
    ("device", "main_grad on the parameter device: main_grad is on meta"),
])
def test_main_grad_buffer_errors(case, words):
    p = param(8, 32)
    _main_grad_case(case, p)
    with pytest.raises(RuntimeError, match=words):
        pb.main_grad_buffer(p)


def test_main_grad_buffer_check_order():
    """present, shape, dtype, contiguous, zero_out_wgrad, device: the first failing check is reported."""
    p = param(8, 32)
    p.main_grad = torch.zeros(32, 8, dtype=torch.float16, device="meta").t()  # everything wrong but shape...
    p.zero_out_wgrad = True
    with pytest.raises(RuntimeError, match="FP32 or BF16"):
        pb.main_grad_buffer(p)
    p.main_grad = p.main_grad.float()
    with pytest.raises(RuntimeError, match="contiguous main_grad"):
        pb.main_grad_buffer(p)
    p.main_grad = p.main_grad.contiguous()
    with pytest.raises(RuntimeError, match="zero_out_wgrad"):
        pb.main_grad_buffer(p)
    p.zero_out_wgrad = False
    with pytest.raises(RuntimeError, match="parameter device"):
        pb.main_grad_buffer(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_main_grad_buffer_returns_the_buffer_itself(dtype):
    p = param(8, 32)
    p.main_grad = torch.randn(8, 32).to(dtype)
    before = p.main_grad.clone()
    assert pb.main_grad_buffer(p) is p.main_grad
    assert torch.equal(p.main_grad, before)


# ---------------------------------------------------------------------------------------------- hook-only gradient


class Allocations(TorchDispatchMode):
    """Every tensor an op creates whose storage is none of its inputs' storage, as (op, shape)."""

    def __init__(self):
        super().__init__()
        self.fresh = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.fresh.append((str(func), tuple(t.shape)))
        return out


def megatron_ddp_hook(p, overlap_grad_reduce=True):
    """Megatron-Core 0.16.1's own backward post-hook for `p` (DistributedDataParallel._make_backward_post_hook
    on a stand-in of the DDP object), installed on p's gradient accumulator as DDP installs it. Returns the
    list the bucket group appends p to when the hook reports its gradient ready."""
    ready = []
    bucket_group = types.SimpleNamespace(register_grad_ready=lambda q, force: ready.append(q))
    ddp = types.SimpleNamespace(param_to_bucket_group={p: bucket_group}, force_all_reduce=False,
                                ddp_config=types.SimpleNamespace(overlap_grad_reduce=overlap_grad_reduce))
    p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    p.grad_added_to_main_grad = False
    grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
    grad_acc.register_hook(ddp_module.DistributedDataParallel._make_backward_post_hook(ddp, p))
    p._test_grad_acc = grad_acc  # DDP keeps the accumulator alive (self.grad_accs)
    return ready


class AddsIntoMainGrad(torch.autograd.Function):
    """A fused-wgrad op in miniature: y = x @ w.T; the weight gradient is added into w.main_grad and the
    backward returns `dummy(w)`."""

    @staticmethod
    def forward(ctx, x, w, dummy):
        ctx.save_for_backward(x, w)
        ctx.dummy = dummy
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        w.main_grad.addmm_(dy.t().float(), x.float())  # in place: no weight-sized temporary
        return dy @ w, ctx.dummy(w), None


def stride0_dummy(p):  # the project's former hook-only gradient, as a control for the allocation counter
    p.grad_added_to_main_grad = True
    return torch.zeros((), dtype=p.dtype).expand(p.shape)


@pytest.mark.parametrize("dummy,allocates", [(pb.finish_weight_gradient, False), (stride0_dummy, True)])
def test_hook_only_gradient_allocates_nothing(dummy, allocates):
    w = param(48, 40)  # a shape no other tensor here has
    ready = megatron_ddp_hook(w)
    w0 = w.detach().clone()
    x = torch.randn(5, 40, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(5, 48, dtype=torch.bfloat16)
    want = torch.zeros(w.shape, dtype=torch.float32)
    for _ in range(2):  # two micro-batches
        y = AddsIntoMainGrad.apply(x, w, dummy)
        with Allocations() as seen:
            y.backward(dy)
        weight_sized = [f for f in seen.fresh if f[1] == tuple(w.shape)]
        assert bool(weight_sized) is allocates, weight_sized  # the control shows the counter sees them
        want.addmm_(dy.t().float(), x.detach().float())
        assert w.grad is None and w.grad_added_to_main_grad is True
        w.grad_added_to_main_grad = False  # DDP's zero_grad_buffer
    assert ready == [w, w]  # DDP's hook ran (overlap_grad_reduce: the bucket was told)
    assert torch.equal(w.main_grad, want)  # not doubled: the hook skipped its add
    assert torch.equal(w, w0)


def test_hook_only_gradient_is_the_weight_alias():
    w = param(8, 32)
    w.grad_added_to_main_grad = False
    g = pb.finish_weight_gradient(w)
    assert g.data_ptr() == w.data_ptr() and g.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    assert g.shape == w.shape and g.dtype == w.dtype and g.stride() == w.stride()
    assert not g.requires_grad and g.grad_fn is None
    assert w.grad_added_to_main_grad is True
    assert pb.dummy_weight_gradient(w).data_ptr() == w.data_ptr()


def test_without_ddp_flag_no_gradient_is_returned():
    w = param(8, 32)
    assert pb.finish_weight_gradient(w) is None
    assert not hasattr(w, "grad_added_to_main_grad")  # not set: a later call must not take it for DDP's


def test_without_ddp_two_backwards_leave_weights_and_grad_alone():
    """main_grad assigned by hand, no DDP: the weight gets no .grad (nothing allocated, nothing aliased)
    and the weights never change, however many backwards run."""
    w = param(48, 40)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    w0 = w.detach().clone()
    x = torch.randn(5, 40, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        y = AddsIntoMainGrad.apply(x, w, pb.finish_weight_gradient)
        with Allocations() as seen:
            y.sum().backward()
        assert not [f for f in seen.fresh if f[1] == tuple(w.shape)]
        assert w.grad is None
    assert torch.equal(w, w0)
    once = torch.zeros(w.shape).addmm_(torch.ones(48, 5), x.detach().float())
    assert torch.allclose(w.main_grad, 3 * once)


def test_flag_without_a_hook_that_drops_grad_is_a_clear_error():
    """A parameter that claims DDP's protocol (the flag) but whose .grad nobody drops: the second backward
    stops before autograd could add into the weight-aliasing .grad."""
    w = param(8, 32)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    w0 = w.detach().clone()
    x = torch.randn(5, 32, dtype=torch.bfloat16, requires_grad=True)
    AddsIntoMainGrad.apply(x, w, pb.finish_weight_gradient).sum().backward()
    assert w.grad.data_ptr() == w.data_ptr()  # the alias autograd kept; DDP's hook would have dropped it
    w.grad_added_to_main_grad = False
    with pytest.raises(RuntimeError, match=r"param.grad .* still set from an earlier backward and aliases the weight"):
        AddsIntoMainGrad.apply(x, w, pb.finish_weight_gradient).sum().backward()
    assert torch.equal(w, w0)


# ---------------------------------------------------------------------------------------------- the runtime with DDP


class StandIn(torch.nn.Module):
    """The duck-typed backend _MoKAutograd calls: one single-grouped FC1/FC2, a gated shared expert, fused."""

    def __init__(self):
        super().__init__()
        p = lambda *s: torch.nn.Parameter(torch.randn(*s).bfloat16() * 0.3)  # noqa: E731
        self.fc1, self.fc2, self.sh1, self.sh2, self.gate = p(E, 2 * I, H), p(E, H, I), p(2 * I, H), p(H, I), p(1, H)
        self.autograd_routed_parameters = (self.fc1, self.fc2)
        self.mok_config, self.ep_group, self.num_local_experts = mf.MoKConfig(), None, E
        self.swiglu_limit, self.shared_intermediate_size, self.fuse_wgrad_accumulation = None, I, True

    def quantized_routed_weights(self):
        return self.fc1, self.fc2

    def main_grad_arguments(self):
        return tuple(pb.main_grad_buffer(q) for q in (self.sh1, self.fc1, self.sh2, self.fc2)), None

    def forward(self, x, rw, te):
        return _MoKAutograd.apply(self, x, rw, te, self.gate, self.fc1, self.fc2, self.sh1, self.sh2)


def test_runtime_with_megatron_ddp_hook_over_micro_batches():
    m = StandIn()
    params = (m.fc1, m.fc2, m.sh1, m.sh2, m.gate)
    ready = [megatron_ddp_hook(q) for q in params]
    initial = [q.detach().clone() for q in params]
    want = [torch.zeros(q.shape, dtype=torch.float64) for q in params]
    for step in range(2):
        x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
        rw = torch.softmax(torch.randn(T, K), -1).requires_grad_()
        te = torch.randn(T, E).topk(K, dim=1).indices.to(torch.int32)
        dy = torch.randn(T, H, dtype=torch.bfloat16)
        m(x, rw, te).backward(dy)
        _, g = oracle_with_grads(MoeCase(x, rw, te, *params), dy)
        want = [w + g[n] for w, n in zip(want, ("gate_up_proj", "down_proj", "shared_gate_up_proj",
                                                  "shared_down_proj", "shared_output_gate"))]
        for q, r in zip(params, ready):
            assert q.grad is None and q.grad_added_to_main_grad is True and r == [q] * (step + 1)
            q.grad_added_to_main_grad = False
    for q, w, w0 in zip(params, want, initial):
        assert rel_err(q.main_grad, w) <= 1e-2
        assert torch.equal(q, w0)
