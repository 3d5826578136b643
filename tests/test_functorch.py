"""torch.func transforms through `mok_inductor.moe`.

- torch.func.grad and torch.func.vjp give the gradients torch.autograd gives (every input).
- torch.func.vmap over a leading batch of tokens (x, router_weights, top_experts; weights shared)
  works, through the vmap rule of mok::moe, and equals the call on the flattened batch; vmapping over
  a weight raises a ValueError naming it.

Shape legend: B vmapped batch, T tokens, H hidden, I routed intermediate, Is shared intermediate,
E experts, K routes.
"""

import pytest
import torch

import mok_inductor
from _helpers import DEVICES, make_case, moe_with_grads, random_like, rel_err

GRAD_ARGS = ("x", "router_weights", "gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj",
             "shared_output_gate")


def _fn(case):
    """f(x, router_weights, gate_up_proj, down_proj, shared...) -> y, top_experts and limit fixed."""
    def f(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj, shared_output_gate):
        return mok_inductor.moe(x, router_weights, case.top_experts, gate_up_proj, down_proj,
                                shared_gate_up_proj=shared_gate_up_proj, shared_down_proj=shared_down_proj,
                                shared_output_gate=shared_output_gate, swiglu_limit=case.swiglu_limit)
    return f


def _primals(case):
    return tuple(getattr(case, n).detach() for n in GRAD_ARGS if getattr(case, n) is not None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_func_grad_equals_autograd(device, dtype):
    # T=7, H=16, I=8, Is=12, E=4, K=2, shared expert, gate and limit, -1 routes: every gradient is exercised
    case = make_case(T=7, H=16, I=8, Is=12, E=4, K=2, dtype=dtype, device=device, shared=True, gate=True,
                     limit=0.6, drop=0.2, seed=61)
    dy = random_like(case.x.detach(), 62)
    _, ref = moe_with_grads(case, dy)
    f = _fn(case)

    def loss(*args):
        return (f(*args).float() * dy.float()).sum()

    grads = torch.func.grad(loss, argnums=tuple(range(len(GRAD_ARGS))))(*_primals(case))
    for name, g in zip(GRAD_ARGS, grads):
        assert g.dtype == ref[name].dtype and g.shape == ref[name].shape, name
        assert rel_err(g, ref[name]) <= 1e-6, f"torch.func.grad d_{name} differs from autograd"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rw_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_func_vjp_equals_autograd(device, rw_dtype):
    # T=6, E=4, K=2 with a shared expert, no gate; bf16 router weights get their vjp in bf16
    case = make_case(T=6, H=16, I=8, Is=12, E=4, K=2, device=device, shared=True, rw_dtype=rw_dtype, drop=0.2,
                     seed=63)
    dy = random_like(case.x.detach(), 64)
    y_ref, ref = moe_with_grads(case, dy)
    f = _fn(case)

    def g(*args):
        return f(*args, None)  # no output gate

    y, vjp_fn = torch.func.vjp(g, *_primals(case))
    assert torch.equal(y, y_ref)
    cotangents = vjp_fn(dy)
    for name, ct in zip(GRAD_ARGS[:6], cotangents):
        assert ct.dtype == ref[name].dtype, name
        assert rel_err(ct, ref[name]) <= 1e-6, f"torch.func.vjp d_{name} differs from autograd"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_dim", [0, 1])
def test_vmap_over_token_batch(device, in_dim):
    # B=3 batches of T=5 tokens (batch dim 0 or 1), weights shared: equals the call on [B*T] tokens
    B, T, H, K = 3, 5, 16, 2
    case = make_case(T=B * T, H=H, I=8, Is=12, E=4, K=K, device=device, shared=True, gate=True, limit=0.6,
                     drop=0.2, seed=65, requires_grad=False)
    y_flat = mok_inductor.moe(*case.args(), **case.kwargs()).view(B, T, H)
    x, rw, te = (t.view(B, T, -1) for t in (case.x, case.router_weights, case.top_experts))
    if in_dim == 1:
        x, rw, te = (t.transpose(0, 1) for t in (x, rw, te))

    def per_batch(x_TH, rw_TK, te_TK):
        return mok_inductor.moe(x_TH, rw_TK, te_TK, case.gate_up_proj, case.down_proj, **case.kwargs())

    y = torch.vmap(per_batch, in_dims=in_dim, out_dims=in_dim)(x, rw, te)
    if in_dim == 1:
        y = y.transpose(0, 1)
    assert y.shape == (B, T, H)
    assert torch.equal(y, y_flat)


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_with_unbatched_routing(device):
    # the same top_experts for every batch entry (in_dims None): each entry routes as the shared ids say
    B, T, H, K = 2, 4, 16, 2
    case = make_case(T=T, H=H, I=8, E=4, K=K, device=device, seed=66, requires_grad=False)
    xs = torch.stack([case.x, random_like(case.x, 67)])
    rws = torch.stack([case.router_weights, case.router_weights.flip(0)])

    def per_batch(x_TH, rw_TK):
        return mok_inductor.moe(x_TH, rw_TK, case.top_experts, case.gate_up_proj, case.down_proj)

    y = torch.vmap(per_batch)(xs, rws)
    for b in range(B):
        # the batch is one call on B*T tokens: the GEMMs see more rows than a per-entry call, so the bits
        # may differ by float32 rounding (BLAS blocking), not more
        assert rel_err(y[b], per_batch(xs[b], rws[b])) <= 1e-6


@pytest.mark.parametrize("name", ["gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj",
                                  "shared_output_gate"])
def test_vmap_over_weights_raises(name):
    # a different weight set per batch entry is not supported, and the error names the batched weight
    case = make_case(T=4, H=16, I=8, Is=12, E=4, K=2, shared=True, gate=True, seed=68, requires_grad=False)
    batched = torch.stack([getattr(case, name), getattr(case, name)])
    args = dict(case.kwargs(), gate_up_proj=case.gate_up_proj, down_proj=case.down_proj)

    def per_weight(w):
        kw = dict(args, **{name: w})
        return mok_inductor.moe(case.x, case.router_weights, case.top_experts, kw.pop("gate_up_proj"),
                                kw.pop("down_proj"), **kw)

    with pytest.raises(ValueError, match=rf"^{name}: torch.vmap over mok::moe batches only x, router_weights and "
                                         r"top_experts"):
        torch.vmap(per_weight)(batched)
