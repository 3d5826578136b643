"""torch.func transforms through `mok_inductor.moe` (docs/api.md, "Autocast and torch.func").

- torch.func.grad and torch.func.vjp give the gradients torch.autograd gives (every input), also over
  functional_call of parameters that require grad; backward with create_graph=True and a joint graph's trace
  (aot_export_module) record the backward op, and only a second derivative through it raises the project's
  NotImplementedError (hessian, jacfwd of jacrev, grad of grad, jvp of grad).
- torch.func.vmap over a leading batch of tokens (x, router_weights, top_experts; weights shared)
  works, through the vmap rule of mok::moe, and equals the call on the flattened batch; vmapping over
  a weight raises a ValueError naming it. vmap of grad gives per-sample gradients (each sample's autograd
  gradients); grad of vmap gives the flattened call's gradients.
- Forward mode (torch.func.jvp, jacfwd, torch.autograd.forward_ad) matches the float64 oracle's jvp, and
  jacfwd equals jacrev. Through MXFP8 weights the derivatives are their masters' (straight-through), in both
  modes.

Shape legend: B vmapped batch, T tokens, H hidden, I routed intermediate, Is shared intermediate,
E experts, K routes.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import mok_inductor
from _helpers import (DEV, DEVICES, TOLERANCE, MoeCase, make_case, moe_with_grads, random_like, rel_err, run_moe)
from oracle import oracle_moe

GRAD_ARGS = ("x", "router_weights", "gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj",
             "shared_output_gate")
WEIGHT_NAMES = GRAD_ARGS[2:]
SECOND_DERIVATIVE = r"^mok::moe does not support second derivatives"


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


def _moe(x, router_weights, top_experts, weights, swiglu_limit):
    """mok_inductor.moe with the weights given as a sequence in WEIGHT_NAMES order."""
    gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj, shared_output_gate = weights
    return mok_inductor.moe(x, router_weights, top_experts, gate_up_proj, down_proj,
                            shared_gate_up_proj=shared_gate_up_proj, shared_down_proj=shared_down_proj,
                            shared_output_gate=shared_output_gate, swiglu_limit=swiglu_limit)


class _Experts(torch.nn.Module):
    """The case's weights as parameters (requiring grad, as a model's do); forward(x, router_weights)."""

    def __init__(self, case):
        super().__init__()
        self.register_buffer("top_experts", case.top_experts)
        self.swiglu_limit = case.swiglu_limit
        for n in WEIGHT_NAMES:
            setattr(self, n, torch.nn.Parameter(getattr(case, n).detach().clone()))

    def forward(self, x, router_weights):
        return _moe(x, router_weights, self.top_experts, [getattr(self, n) for n in WEIGHT_NAMES], self.swiglu_limit)


def _full_case(seed, T=7, **kw):
    # H=16, I=8, Is=12, E=4, K=2 with -1 routes, a shared expert, its gate and a limit: every input is used
    return make_case(T=T, H=16, I=8, Is=12, E=4, K=2, shared=True, gate=True, limit=0.6, drop=0.2, seed=seed, **kw)


# ---------------------------------------------------------------------------------------------
# Parameters that require grad, create_graph, joint graphs: the backward is recorded where autograd records,
# and only a second derivative through it raises


@pytest.mark.parametrize("device", DEVICES)
def test_func_grad_and_vjp_over_functional_call(device):
    # torch.func.grad and vjp over functional_call(model, dict(model.named_parameters())): the parameters
    # require grad, so the backward runs where autograd records it; the gradients are autograd's
    case = _full_case(71, device=device)
    dy = random_like(case.x.detach(), 72)
    _, ref = moe_with_grads(case, dy)
    model = _Experts(case)
    params = dict(model.named_parameters())
    x, rw = case.x.detach(), case.router_weights.detach()

    def loss(p, x):
        return (torch.func.functional_call(model, p, (x, rw)) * dy).sum()

    grads, gx = torch.func.grad(loss, argnums=(0, 1))(params, x)
    _, vjp_fn = torch.func.vjp(lambda p, x: torch.func.functional_call(model, p, (x, rw)), params, x)
    vjp_grads, vjp_gx = vjp_fn(dy)
    for got in ({**grads, "x": gx}, {**vjp_grads, "x": vjp_gx}):
        for name, g in got.items():
            assert torch.equal(g, ref[name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_create_graph_records_the_backward(device):
    # backward with create_graph=True gives the first-order gradients (bitwise a plain backward's), recorded in
    # the graph; differentiating one of them again raises the project's error
    case = _full_case(73, device=device)
    dy = random_like(case.x.detach(), 74)
    _, ref = moe_with_grads(case, dy)
    c = case.detached()
    leaves = c.tensors()
    grads = torch.autograd.grad(run_moe(c), tuple(leaves.values()), dy, create_graph=True)
    for name, g in zip(leaves, grads):
        assert g.requires_grad and torch.equal(g.detach(), ref[name]), name
    with pytest.raises(NotImplementedError, match=SECOND_DERIVATIVE):
        torch.autograd.grad(grads[0].square().sum(), leaves["gate_up_proj"])


def test_aot_export_joint_graph():
    # aot_export_module(trace_joint=True) traces forward and backward into one graph (grad mode on while the
    # backward is traced, as under create_graph) that holds the ops and computes autograd's gradients
    from torch._functorch.aot_autograd import aot_export_module

    case = _full_case(75)
    dy = random_like(case.x.detach(), 76)
    _, ref = moe_with_grads(case, dy)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = _Experts(case)

        def forward(self, x, rw, dy):
            return ((self.experts(x, rw) * dy).sum(),)

    m = Loss()
    x, rw = case.x.detach(), case.router_weights.detach()
    gm, sig = aot_export_module(m, (x, rw, dy), trace_joint=True, output_loss_index=0)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {torch.ops.mok.moe_fwd.default, torch.ops.mok.moe_bwd.default} <= targets
    out = gm(*m.parameters(), *m.buffers(), x, rw, dy)
    names = list(sig.backward_signature.gradients_to_parameters.values())
    assert names == [f"experts.{n}" for n in WEIGHT_NAMES]
    for name, g in zip(WEIGHT_NAMES, out[1:]):
        assert torch.equal(g, ref[name]), name


# ---------------------------------------------------------------------------------------------
# vmap with grad: per-sample gradients, and grad of a vmap


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_per_sample_gradients(backend):
    # vmap(grad): B samples of T tokens, each with its own routing (-1 routes) and dy, the weights shared: every
    # per-sample gradient is autograd's on that sample alone (the ops' vmap rules run one call per sample: a
    # per-sample weight gradient is not a sum over the batch). reference: bitwise; triton (its kernels under the
    # interpreter, which is slow: B=2, T=2): within the float32 contract of the reference's
    B, T = (3, 3) if backend == "reference" else (2, 2)
    case = _full_case(77, T=B * T, device=DEV if backend == "triton" else "cpu")
    dy = random_like(case.x.detach(), 78)
    weights = [getattr(case, n).detach() for n in WEIGHT_NAMES]

    def loss(weights, x, rw, te, dy):
        return (_moe(x, rw, te, weights, case.swiglu_limit) * dy).sum()

    per_sample = [t.detach().view(B, T, -1) for t in (case.x, case.router_weights, case.top_experts, dy)]
    with mok_inductor.options.override(backend=backend):
        g_w, g_x = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0, 0, 0))(
            weights, *per_sample)
    tol = 0.0 if backend == "reference" else TOLERANCE[torch.float32]
    for b in range(B):
        one = MoeCase(*(t[b] for t in per_sample[:3]), *weights, swiglu_limit=case.swiglu_limit)
        with mok_inductor.options.override(backend="reference"):  # (on the CPU)
            _, ref = moe_with_grads(one.detached(device="cpu"), per_sample[3][b].cpu())
        for name, g in zip(GRAD_ARGS[:1] + WEIGHT_NAMES, [g_x] + list(g_w)):
            assert rel_err(g[b], ref[name]) <= tol, f"sample {b}: {name}"


def test_grad_of_vmap_equals_the_flattened_call():
    # grad(vmap): a vmap over a token batch (B=4 entries of T=3) inside a gradient is the call on the flattened
    # batch, with its gradients
    B, T = 4, 3
    case = _full_case(79, T=B * T)
    dy = random_like(case.x.detach(), 80)
    _, ref = moe_with_grads(case, dy)
    te = case.top_experts.view(B, T, -1)

    def loss(x, rw, *weights):
        y = torch.func.vmap(lambda x_TH, rw_TK, te_TK: _moe(x_TH, rw_TK, te_TK, weights, case.swiglu_limit))(
            x, rw, te)
        return (y.reshape(B * T, -1) * dy).sum()

    primals = _primals(case)
    grads = torch.func.grad(loss, argnums=tuple(range(len(GRAD_ARGS))))(
        primals[0].view(B, T, -1), primals[1].view(B, T, -1), *primals[2:])
    for name, g in zip(GRAD_ARGS, grads):
        # the same ops on the same flattened tokens, up to float32 rounding of the transforms' own ops around them
        assert rel_err(g.reshape(ref[name].shape), ref[name]) <= 1e-6, name


# ---------------------------------------------------------------------------------------------
# Forward mode: jvp, jacfwd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("which", ["all", "weights"])
def test_jvp_matches_the_float64_oracle(device, dtype, which):
    # torch.func.jvp with tangents for every input, or for the weights only: y and its tangent within the
    # contract's tolerance of the float64 oracle's jvp; forward AD on dual tensors (torch.autograd.forward_ad)
    # gives the same tangent
    case = _full_case(81, dtype=dtype, device=device)
    primals = _primals(case)
    tangents = tuple(random_like(p, 82 + i) for i, p in enumerate(primals))
    first = 0 if which == "all" else 2  # the tangents given: from x on, or from gate_up_proj on
    fixed = primals[:first]

    def f(*args):
        return _fn(case)(*fixed, *args)

    def oracle(*args):
        full = tuple(p.double() for p in fixed) + args
        return oracle_moe(full[0], full[1], case.top_experts, *full[2:], swiglu_limit=case.swiglu_limit)

    y, y_dot = torch.func.jvp(f, primals[first:], tangents[first:])
    y_ref, y_dot_ref = torch.func.jvp(oracle, tuple(p.double() for p in primals[first:]),
                                      tuple(t.double() for t in tangents[first:]))
    assert y.dtype == dtype and y_dot.dtype == dtype
    assert rel_err(y, y_ref) <= TOLERANCE[dtype], "y"
    assert rel_err(y_dot, y_dot_ref) <= TOLERANCE[dtype], "tangent"
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip(primals[first:], tangents[first:])]
        assert torch.equal(fwAD.unpack_dual(f(*duals)).tangent, y_dot)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_expert", [False, True], ids=["3d", "per_expert"])
def test_jvp_in_the_masters_of_mxfp8_weights(device, per_expert):
    # an MXFP8 weight's tangent is its master's (straight-through, as its gradient is): the jvp in the master
    # weights of quantize(master) equals the float64 oracle's jvp at the dequantized weights with the masters'
    # tangents (not a zero tangent); forward AD on dual masters gives the same
    from mok_inductor import mxfp8

    case = make_case(T=6, H=64, I=32, E=4, K=2, dtype=torch.bfloat16, device=device, limit=0.8, seed=91,
                     requires_grad=False)
    masters = (case.gate_up_proj, case.down_proj)
    tangents = (random_like(masters[0], 92), random_like(masters[1], 93))

    def quantized(w):
        return [mxfp8.quantize(w[e]) for e in range(w.shape[0])] if per_expert else mxfp8.quantize(w)

    def f(gate_up, down):
        return mok_inductor.moe(case.x, case.router_weights, case.top_experts, quantized(gate_up), quantized(down),
                                swiglu_limit=case.swiglu_limit)

    def oracle(gate_up, down):
        return oracle_moe(case.x.double(), case.router_weights.double(), case.top_experts, gate_up, down,
                          swiglu_limit=case.swiglu_limit)

    y, y_dot = torch.func.jvp(f, masters, tangents)
    dequantized = tuple(mxfp8.dequantize(mxfp8.quantize(w)).double() for w in masters)
    y_ref, y_dot_ref = torch.func.jvp(oracle, dequantized, tuple(t.double() for t in tangents))
    assert rel_err(y, y_ref) <= TOLERANCE[torch.bfloat16], "y"
    assert rel_err(y_dot, y_dot_ref) <= TOLERANCE[torch.bfloat16], "tangent"
    with fwAD.dual_level():
        duals = [fwAD.make_dual(m, t) for m, t in zip(masters, tangents)]
        assert torch.equal(fwAD.unpack_dual(f(*duals)).tangent, y_dot)


@pytest.mark.parametrize("device", DEVICES)
def test_func_grad_through_per_expert_mxfp8_masters(device):
    # torch.func.grad in the masters of per-expert MXFP8 weights (stacked for the op by an autograd.Function,
    # which functorch runs only in its setup_context form) equals autograd's gradient
    from mok_inductor import mxfp8

    case = make_case(T=6, H=64, I=32, E=4, K=2, dtype=torch.bfloat16, device=device, seed=95, requires_grad=False)
    dy = random_like(case.x, 96)

    def loss(gate_up):
        q = [mxfp8.quantize(gate_up[e]) for e in range(gate_up.shape[0])]
        y = mok_inductor.moe(case.x, case.router_weights, case.top_experts, q, case.down_proj)
        return (y.float() * dy.float()).sum()

    got = torch.func.grad(loss)(case.gate_up_proj)
    master = case.gate_up_proj.clone().requires_grad_(True)
    loss(master).backward()
    assert torch.equal(got, master.grad)
    assert got.abs().sum() > 0


def test_jacfwd_equals_jacrev_and_the_oracle():
    # T=3, H=8: the jacobians of y [T, H] in x [T, H] and the router weights [T, K], by forward mode (jvp vmapped
    # over the basis) and reverse mode (vjp vmapped over the cotangents), against the float64 oracle's
    case = make_case(T=3, H=8, I=4, Is=6, E=3, K=2, shared=True, gate=True, limit=0.6, drop=0.2, seed=85)
    weights = [getattr(case, n).detach() for n in WEIGHT_NAMES]
    x, rw = case.x.detach(), case.router_weights.detach()

    def f(x, rw):
        return _moe(x, rw, case.top_experts, weights, case.swiglu_limit)

    def oracle(x, rw):
        return oracle_moe(x, rw, case.top_experts, *(w.double() for w in weights), swiglu_limit=case.swiglu_limit)

    want = torch.func.jacrev(oracle, argnums=(0, 1))(x.double(), rw.double())
    for jac in (torch.func.jacfwd, torch.func.jacrev):
        got = jac(f, argnums=(0, 1))(x, rw)
        for name, g, w in zip(("x", "router_weights"), got, want):
            assert rel_err(g, w) <= TOLERANCE[torch.float32], f"{jac.__name__} d/d{name}"


def test_vmap_of_jvp():
    # vmap over jvp (B=2 entries of x with their tangents): each entry's jvp, with top_experts shared; with
    # top_experts batched too, the project's NotImplementedError (the tangent's loop reads the offsets on the host)
    case = _full_case(91, requires_grad=False)
    B = 2
    xs = torch.stack([case.x, random_like(case.x, 92)])
    dxs = torch.stack([random_like(case.x, 93 + b) for b in range(B)])
    weights = [getattr(case, n) for n in WEIGHT_NAMES]

    def jvp(x, dx, te):
        return torch.func.jvp(lambda x: _moe(x, case.router_weights, te, weights, case.swiglu_limit), (x,), (dx,))[1]

    got = torch.func.vmap(jvp, in_dims=(0, 0, None))(xs, dxs, case.top_experts)
    for b in range(B):
        assert rel_err(got[b], jvp(xs[b], dxs[b], case.top_experts)) <= 1e-6, b
    tes = torch.stack([case.top_experts, case.top_experts.flip(0)])
    with pytest.raises(NotImplementedError, match=r"^mok::moe: forward mode \(jvp, jacfwd\) under a torch.vmap that "
                                                  r"batches top_experts"):
        torch.func.vmap(jvp)(xs, dxs, tes)


# ---------------------------------------------------------------------------------------------
# What is not supported says so


@pytest.mark.parametrize("how", ["hessian", "jacfwd of jacrev", "grad of grad", "jvp of grad"])
def test_second_derivatives_raise_the_projects_error(how):
    case = make_case(T=3, H=8, I=4, E=3, K=2, seed=87, requires_grad=False)

    def loss(x):
        return mok_inductor.moe(x, case.router_weights, case.top_experts, case.gate_up_proj,
                                case.down_proj).square().sum()

    second = {
        "hessian": lambda: torch.func.hessian(loss)(case.x),
        "jacfwd of jacrev": lambda: torch.func.jacfwd(torch.func.jacrev(loss))(case.x),
        "grad of grad": lambda: torch.func.grad(lambda x: torch.func.grad(loss)(x).sum())(case.x),
        "jvp of grad": lambda: torch.func.jvp(torch.func.grad(loss), (case.x,), (random_like(case.x, 88),)),
    }[how]
    with pytest.raises(NotImplementedError, match=SECOND_DERIVATIVE):
        second()


def test_the_op_under_func_grad_says_what_to_call():
    # torch.ops.mok.moe called directly cannot apply its autograd under torch.func.grad (only mok_inductor.moe
    # does, from Python): it says so instead of failing inside PyTorch
    case = make_case(T=3, H=8, I=4, E=3, K=2, seed=89, requires_grad=False)

    def loss(x):
        return torch.ops.mok.moe(x, case.router_weights, case.top_experts, case.gate_up_proj, case.down_proj).sum()

    with pytest.raises(NotImplementedError, match=r"^torch.ops.mok.moe: under torch.func.grad/vjp/jvp .* call "
                                                  r"mok_inductor.moe"):
        torch.func.grad(loss)(case.x)
