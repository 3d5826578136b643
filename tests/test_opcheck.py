"""torch.library.opcheck on every op of the `mok` namespace, and torch.autograd.gradcheck.

opcheck runs its default checks (schema, autograd registration, fake tensor, AOT dispatch with
dynamic shapes) on mok::moe, mok::schedule, mok::moe_fwd and mok::moe_bwd, over schema variants:
shared expert or not, shared output gate or not, swiglu_limit or not, float32 and bfloat16.

The MXFP8 form of the same ops (scales, column-wise data and masters as optional arguments) is checked
below too.

gradcheck: the op accepts float32, bfloat16 and float16 activations only (docs/api.md; float64 is rejected with a
TypeError), so the finite-difference check runs in float32 with eps=1e-3 and a matching tolerance,
at tiny shapes, through `mok_inductor.moe`; and in float64 on the exact forward/backward pair the CPU ops
run (ops.moe_fwd_impl / moe_bwd_impl on the reference backend, which computes in float64 for float64 inputs),
at gradcheck's default tolerances. For the clamped SwiGLU the limit is chosen away from every
pre-activation, so no finite difference straddles the clamp's kink.

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E experts, K routes.
"""

import pytest
import torch

import mok_inductor
from _helpers import DEVICES, make_case, moe_with_grads, random_like

# id: (dtype, shared, gate, limit)
VARIANTS = {
    "fp32": (torch.float32, False, False, None),
    "fp32_limit": (torch.float32, False, False, 0.7),
    "fp32_shared": (torch.float32, True, False, None),
    "fp32_shared_gate_limit": (torch.float32, True, True, 0.7),
    "bf16_shared_gate": (torch.bfloat16, True, True, None),
    "bf16_limit": (torch.bfloat16, False, False, 0.7),
}


def _case(variant, device, requires_grad=True):
    dtype, shared, gate, limit = VARIANTS[variant]
    # T=5, H=8, I=4, Is=6, E=3, K=2 with 20% -1 routes: small, Is != I
    return make_case(T=5, H=8, I=4, Is=6, E=3, K=2, dtype=dtype, device=device, shared=shared, gate=gate,
                     limit=limit, drop=0.2, seed=len(variant), requires_grad=requires_grad)


def _fwd_args(c):
    sched = torch.ops.mok.schedule(c.top_experts, c.gate_up_proj.shape[0])
    return (c.x, c.router_weights, c.top_experts, *sched, c.gate_up_proj, c.down_proj, c.shared_gate_up_proj,
            c.shared_down_proj, c.shared_output_gate, c.swiglu_limit)


def _check_saved_shapes(c, gu, gu_shared):
    # the saved activations are the gate/up pre-activations: [N, 2I] in x.dtype and [T, 2Is] (or [0, 0]) in
    # float32 (float64 for float64 x)
    T, K = c.top_experts.shape
    two_is = c.shared_gate_up_proj.shape[0] if c.shared_gate_up_proj is not None else None
    assert gu.shape == (T * K, c.gate_up_proj.shape[1]) and gu.dtype == c.x.dtype
    assert gu_shared.shape == ((T, two_is) if two_is is not None else (0, 0)) \
        and gu_shared.dtype == torch.promote_types(c.x.dtype, torch.float32)


def _bwd_args(c):
    fa = _fwd_args(c)
    with torch.no_grad():
        y, gu, gu_shared = torch.ops.mok.moe_fwd(*fa)
    _check_saved_shapes(c, gu, gu_shared)
    dy = random_like(y, 1)
    return (dy,) + fa[:-1] + (gu, gu_shared, c.swiglu_limit)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_opcheck_moe(device, variant):
    c = _case(variant, device)
    torch.library.opcheck(torch.ops.mok.moe.default, c.op_args())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_opcheck_moe_fwd(device, variant):
    c = _case(variant, device)
    torch.library.opcheck(torch.ops.mok.moe_fwd.default, _fwd_args(c))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_opcheck_moe_bwd(device, variant):
    # as in a backward graph: the inputs do not require grad (double backward is tested below)
    c = _case(variant, device, requires_grad=False)
    torch.library.opcheck(torch.ops.mok.moe_bwd.default, _bwd_args(c))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("kind", ["random", "none", "one"])
def test_opcheck_schedule(device, index_dtype, kind):
    # random routes with -1s; all routes -1; every route to one expert
    te = make_case(T=6, E=4, K=2, kind=kind, drop=0.3, index_dtype=index_dtype, device=device).top_experts
    torch.library.opcheck(torch.ops.mok.schedule.default, (te, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_empty_tokens(device):
    # T=0: every op accepts an empty batch
    c = make_case(T=0, H=8, I=4, Is=6, E=3, K=2, shared=True, gate=True, device=device)
    torch.library.opcheck(torch.ops.mok.moe.default, c.op_args())
    torch.library.opcheck(torch.ops.mok.schedule.default, (c.top_experts, 3))
    torch.library.opcheck(torch.ops.mok.moe_fwd.default, _fwd_args(c))
    torch.library.opcheck(torch.ops.mok.moe_bwd.default, _bwd_args(c.detached(requires_grad=False)))


def test_every_mok_op_is_checked():
    # the ops of the namespace are exactly those this file checks: a new op must get an opcheck here
    import mok_inductor.ops  # noqa: F401

    # from the dispatcher's registry: dir(torch.ops.mok) lists only the ops already looked up
    ops = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("mok::")}
    assert ops == {"moe", "schedule", "moe_fwd", "moe_bwd"}, sorted(ops)


def test_double_backward_is_clear():
    # differentiating the backward (create_graph=True) either works and gives the first-order gradients,
    # or raises an error that says double backward is not supported; it never fails obscurely
    c = make_case(T=5, H=8, I=4, E=3, K=2, shared=True)
    dy = random_like(c.x.detach(), 2)
    _, ref = moe_with_grads(c, dy)
    y = mok_inductor.moe(*c.args(), **c.kwargs())
    try:
        gx, = torch.autograd.grad(y, c.x, dy, create_graph=True)
    except (RuntimeError, NotImplementedError) as e:
        assert "backward" in str(e) and ("double" in str(e) or "twice" in str(e) or "create_graph" in str(e)), e
    else:
        assert torch.equal(gx.detach(), ref["x"])


# ---------------------------------------------------------------------------------------------
# gradcheck


def _limit_away_from_preactivations(c, lo=0.3, hi=1.5):
    """A swiglu_limit in [lo, hi] as far as possible from every gate value and |up| value it clamps,
    with its distance to the nearest one."""
    x = c.x.detach().double()
    w1 = c.gate_up_proj.detach().double()
    I = w1.shape[1] // 2
    vals = []
    for t in range(x.shape[0]):
        for e in c.top_experts[t].tolist():
            if e >= 0:
                vals += [w1[e, :I] @ x[t], (w1[e, I:] @ x[t]).abs()]
    if c.shared_gate_up_proj is not None:
        s1 = c.shared_gate_up_proj.detach().double()
        i_s = s1.shape[0] // 2
        vals += [x @ s1[:i_s].T, (x @ s1[i_s:].T).abs()]
    v = torch.cat([a.reshape(-1) for a in vals])
    cand = torch.linspace(lo, hi, 241, dtype=torch.float64)
    dist = (cand[:, None] - v[None, :]).abs().min(dim=1).values
    best = int(dist.argmax())
    return float(cand[best]), float(dist[best]), v


@pytest.mark.filterwarnings("ignore:Input #.* requires gradient and is not a double precision")
@pytest.mark.parametrize("config", ["plain", "shared_gate", "shared_gate_limit", "dropped_repeat"])
def test_gradcheck_float32(config):
    # CPU only: float32 finite differences need a forward accurate to ~1e-7, and the contract lets a float32 kernel
    # be off by 1e-4 (e.g. TF32 GEMMs); on CUDA the gradients are checked against the float64 oracle instead
    device = "cpu"
    # T=3, H=4, I=2, Is=3, E=3, K=2: tiny, so the numerical Jacobian is cheap; "dropped_repeat" has -1
    # routes and repeated experts within a token
    shared = config.startswith("shared")
    c = make_case(T=3, H=4, I=2, Is=3, E=3, K=2, shared=shared, gate=shared, device=device, seed=21,
                  kind="repeat" if config == "dropped_repeat" else "random")
    if config == "dropped_repeat":
        c.top_experts[0] = torch.tensor([1, 1])
        c.top_experts[1, 0] = -1
    limit = None
    if config.endswith("limit"):
        limit, margin, v = _limit_away_from_preactivations(c)
        assert margin > 0.02, "no limit far enough from the pre-activations for finite differences"
        assert (v > limit).any() and (v < limit).any(), "the limit must clip some values and not others"
    names = list(c.tensors())

    def f(*ts):
        d = dict(zip(names, ts))
        return mok_inductor.moe(d["x"], d["router_weights"], c.top_experts, d["gate_up_proj"], d["down_proj"],
                                shared_gate_up_proj=d.get("shared_gate_up_proj"),
                                shared_down_proj=d.get("shared_down_proj"),
                                shared_output_gate=d.get("shared_output_gate"), swiglu_limit=limit)

    assert torch.autograd.gradcheck(f, tuple(c.tensors().values()), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_gradcheck_float64_is_rejected():
    # float64 is not an accepted activation dtype (docs/api.md), hence the float32 gradcheck above;
    # this pins that decision so a change to it is deliberate
    c = make_case(T=3, H=4, I=2, E=3, K=2, dtype=torch.float64)
    with pytest.raises(TypeError, match="^x: expected dtype float32 or bfloat16 or float16, got float64"):
        mok_inductor.moe(*c.args(), **c.kwargs())


class _ImplPair(torch.autograd.Function):
    """The exact forward/backward pair mok::moe_fwd / mok::moe_bwd run on the reference backend
    (ops.moe_fwd_impl / ops.moe_bwd_impl), bypassing only the dtype check of the user API, so
    torch.autograd.gradcheck can check the hand-written backward in float64."""

    @staticmethod
    def forward(ctx, top_experts, limit, x, rw, gate_up, down, s_gate_up, s_down, s_gate):
        from mok_inductor import ops

        with mok_inductor.options.override(backend="reference"):
            sched = tuple(ops.schedule(top_experts, gate_up.shape[0]))
            y, gu, gus = ops.moe_fwd_impl(x, rw, top_experts, *sched, gate_up, down, s_gate_up, s_down, s_gate, limit)
        ctx.save_for_backward(x, rw, top_experts, *sched, gate_up, down, s_gate_up, s_down, s_gate, gu, gus)
        ctx.limit = limit
        return y

    @staticmethod
    def backward(ctx, dy):
        from mok_inductor import ops

        x, rw, te, s0, s1, s2, gate_up, down, s_gate_up, s_down, s_gate, gu, gus = ctx.saved_tensors
        with mok_inductor.options.override(backend="reference"):
            dx, drw, dgu, dd, dsgu, dsd, dsg, _, _ = ops.moe_bwd_impl(dy, x, rw, te, s0, s1, s2, gate_up, down, s_gate_up,
                                                                s_down, s_gate, gu, gus, ctx.limit)
        return None, None, dx, drw, dgu, dd, dsgu, dsd, dsg


@pytest.mark.parametrize("config", ["shared_gate", "shared_gate_limit", "dropped_repeat"])
def test_gradcheck_float64_of_the_cpu_implementation(config):
    # T=4, H=5, I=3, Is=2, E=3, K=2 in float64: central differences to ~1e-10, so gradcheck's default
    # tolerances apply to every input, the shared expert and gate included
    c = make_case(T=4, H=5, I=3, Is=2, E=3, K=2, shared=True, gate=True, dtype=torch.float32, seed=5,
                  kind="repeat" if config == "dropped_repeat" else "random")
    if config == "dropped_repeat":
        c.top_experts[0] = torch.tensor([2, 2])
        c.top_experts[1, 1] = -1
    t = {k: v.detach().double().requires_grad_() for k, v in c.tensors().items()}
    limit = None
    if config.endswith("limit"):
        limit, margin, v = _limit_away_from_preactivations(c, lo=0.05, hi=0.6)
        assert margin > 1e-3 and (v > limit).any() and (v < limit).any(), "the limit must clip some values"
    args = (t["x"], t["router_weights"], t["gate_up_proj"], t["down_proj"], t["shared_gate_up_proj"],
            t["shared_down_proj"], t["shared_output_gate"])
    assert torch.autograd.gradcheck(lambda *a: _ImplPair.apply(c.top_experts, limit, *a), args)


# ---------------------------------------------------------------------------------------------
# The MXFP8 form of the ops: MXFP8 gate_up, and down either MXFP8 or a plain bf16 weight (which receives its
# own gradient); masters receive the MXFP8 weights' gradients.

_MX_ORDER = ("scale", "data_t", "scale_t")


def _mx_case(device, down_mx, shared, requires_grad=True):
    """(case, routed weights (gate_up, down), the six MXFP8 arguments, the two masters) of the ops."""
    from mok_inductor import mxfp8

    c = make_case(T=5, H=32, I=32, Is=6, E=3, K=2, dtype=torch.bfloat16, device=device, shared=shared,
                  gate=shared, limit=0.7 if shared else None, drop=0.2, seed=3, requires_grad=requires_grad)
    q1 = mxfp8.quantize(c.gate_up_proj)
    weights = [q1.data]
    mx = [q1.scale, q1.data_t, q1.scale_t]
    masters = [c.gate_up_proj if requires_grad else None]
    if down_mx:
        q2 = mxfp8.quantize(c.down_proj)
        weights.append(q2.data)
        mx += [q2.scale, q2.data_t, q2.scale_t]
        masters.append(c.down_proj if requires_grad else None)
    else:
        weights.append(c.down_proj)
        mx += [None, None, None]
        masters.append(None)
    return c, tuple(weights), tuple(mx), tuple(masters)


# opcheck's test_schema compares inputs before and after with torch.allclose, which float8 tensors do not
# implement on the CPU: the other three checks run through opcheck, and "no input is mutated" is checked
# bitwise here instead.
_MX_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck_mx(op, args):
    before = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(op, args, test_utils=_MX_UTILS)
    op(*args)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.detach().view(torch.uint8), b.view(torch.uint8)), f"{op}: an input was mutated"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("down_mx,shared", [(True, False), (False, True)], ids=["mx-mx", "mx-bf16-shared"])
def test_opcheck_mxfp8_form(device, down_mx, shared):
    c, w, mx, masters = _mx_case(device, down_mx, shared)
    tail = (c.shared_gate_up_proj, c.shared_down_proj, c.shared_output_gate, c.swiglu_limit)
    _opcheck_mx(torch.ops.mok.moe.default, (c.x, c.router_weights, c.top_experts, *w, *tail, *mx, *masters))
    sched = torch.ops.mok.schedule(c.top_experts, 3)
    _opcheck_mx(torch.ops.mok.moe_fwd.default, (c.x, c.router_weights, c.top_experts, *sched, *w, *tail, *mx,
                                                *masters))
    c, w, mx, masters = _mx_case(device, down_mx, shared, requires_grad=False)
    tail = (c.shared_gate_up_proj, c.shared_down_proj, c.shared_output_gate, c.swiglu_limit)
    y, saved, saved_shared = torch.ops.mok.moe_fwd(c.x, c.router_weights, c.top_experts, *sched, *w, *tail, *mx)
    _check_saved_shapes(c, saved, saved_shared)
    bwd_args = (random_like(y, 1), c.x, c.router_weights, c.top_experts, *sched, *w, *tail[:3], saved, saved_shared,
                c.swiglu_limit, *mx)
    for wgrads in ((True, True), (False, True)):
        _opcheck_mx(torch.ops.mok.moe_bwd.default, bwd_args + wgrads)
        out = torch.ops.mok.moe_bwd(*bwd_args, *wgrads)
        assert out[2].shape == (c.gate_up_proj.shape if wgrads[0] else (0,))


def test_mxfp8_gradients_go_to_the_masters():
    # the op's autograd: an MXFP8 weight's gradient arrives at its master, equal to the weight gradient of the
    # same call on the row-wise dequantized weight (computed from the forward's activations and dy); a plain
    # down_proj receives its own
    from mok_inductor import mxfp8

    c, w, mx, (gum, _) = _mx_case("cpu", down_mx=False, shared=True)
    tail = (c.shared_gate_up_proj, c.shared_down_proj, c.shared_output_gate, c.swiglu_limit)
    y = torch.ops.mok.moe(c.x, c.router_weights, c.top_experts, *w, *tail, *mx, gum, None)
    dy = random_like(y.detach(), 4)
    got = torch.autograd.grad(y, (gum, c.down_proj), dy)
    deq = mxfp8.dequantize(mxfp8.quantize(c.gate_up_proj.detach())).requires_grad_(True)
    y2 = torch.ops.mok.moe(c.x, c.router_weights, c.top_experts, deq, c.down_proj, *tail)
    want = torch.autograd.grad(y2, (deq, c.down_proj), dy)
    for name, a, b in zip(("gate_up master", "down_proj"), got, want):
        assert torch.equal(a, b), name


def test_master_of_a_plain_weight_is_rejected():
    c, w, mx, _ = _mx_case("cpu", down_mx=False, shared=False)
    with pytest.raises(ValueError, match="^down_proj: a master weight is for an MXFP8 weight"):
        torch.ops.mok.moe(c.x, c.router_weights, c.top_experts, *w, None, None, None, None, *mx, None,
                          c.down_proj)
