"""Forward and every gradient of `mok_inductor.moe` against the float64 oracle (docs/semantics.md).

Each case compares the output and the gradients of x, router_weights and every routed and shared
weight with `tests/oracle.py` at the contract's tolerance (relative Frobenius error; float32 1e-4,
bfloat16 1e-2, float16 1e-2), checks that each gradient comes back in its input's dtype, and runs on
the CPU and, when present, on CUDA. A comment on each shape names the edge case it covers.

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E experts, K routes.
"""

import math

import pytest
import torch

import mok_inductor
from _helpers import (
    DEV,
    DEVICES,
    baseline_with_grads,
    TOLERANCE,
    assert_close_to_oracle,
    check_against_oracle,
    make_case,
    moe_with_grads,
    oracle_with_grads,
    random_like,
    rel_err,
    run_moe,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (shared expert, shared output gate, swiglu_limit)
CONFIGS = {
    "plain": (False, False, None),
    "limit": (False, False, 0.6),
    "shared": (True, False, None),
    "shared_gate": (True, True, None),
    "shared_gate_limit": (True, True, 0.6),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_oracle(device, dtype, config):
    shared, gate, limit = CONFIGS[config]
    # T=7, H=24, I=12, Is=16, E=5, K=2: a generic shape (prime E and T, Is != I), 20% of routes -1
    case = make_case(T=7, H=24, I=12, Is=16, E=5, K=2, dtype=dtype, device=device, shared=shared, gate=gate,
                     limit=limit, drop=0.2, seed=list(CONFIGS).index(config))
    check_against_oracle(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", ["plain", "shared_gate", "shared_gate_limit"])
def test_low_precision_error_within_factor_of_torch(device, dtype, config):
    # besides the contract's bound, a bf16/fp16 result is at most 2x as far from the float64 oracle as a
    # plain PyTorch implementation in the same dtype (tests/_helpers.lowp_torch_moe), forward and every
    # gradient. T=16, H=32, I=16, Is=24, E=5, K=2 with -1 routes: enough elements for stable error norms
    shared, gate, limit = CONFIGS[config]
    case = make_case(T=16, H=32, I=16, Is=24, E=5, K=2, dtype=dtype, device=device, shared=shared, gate=gate,
                     limit=limit, drop=0.2, seed=17 + list(CONFIGS).index(config))
    dy = random_like(case.x.detach(), 18)
    y, grads = moe_with_grads(case, dy)
    y_base, grads_base = baseline_with_grads(case, dy)
    y_ref, grads_ref = oracle_with_grads(case, dy)
    pairs = [("y", y, y_base, y_ref)] + [(n, grads[n], grads_base[n], grads_ref[n]) for n in grads]
    for name, got, base, ref in pairs:
        err, base_err = rel_err(got, ref), rel_err(base, ref)
        assert err <= 2 * base_err, f"{name}: error {err:.2e} exceeds 2x PyTorch {dtype}'s error {base_err:.2e}"


# name: (make_case kwargs, comment naming the edge case)
EDGE_CASES = {
    # T=0: no tokens at all
    "T0": dict(T=0, H=16, I=8, E=4, K=2),
    # T=0 with a shared expert and gate
    "T0_shared_gate": dict(T=0, H=16, I=8, E=4, K=2, shared=True, gate=True),
    # T=1: a single token (smaller than any tile)
    "T1": dict(T=1, H=16, I=8, E=4, K=2, shared=True, gate=True),
    # K=1: one route per token
    "K1": dict(T=9, H=16, I=8, E=4, K=1),
    # K=E: every token routed to every expert
    "KE": dict(T=5, H=16, I=8, E=4, K=4, shared=True),
    # E=1, K=1: a single expert
    "E1": dict(T=5, H=16, I=8, E=1, K=1),
    # all routes -1, no shared expert: the output is exactly zero
    "all_dropped": dict(T=6, H=16, I=8, E=4, K=2, kind="none"),
    # all routes -1 with a shared expert and gate: only the shared expert contributes
    "all_dropped_shared": dict(T=6, H=16, I=8, E=4, K=2, kind="none", shared=True, gate=True),
    # every token to one expert (expert E-1, K=2 routes each to it); the other experts are empty
    "one_hot_expert": dict(T=8, H=16, I=8, E=4, K=2, kind="one"),
    # empty experts: only the lower half of the experts get routes
    "empty_experts": dict(T=8, H=16, I=8, E=6, K=2, kind="low_half", limit=0.8),
    # the same expert repeated within a token, and -1 routes, drawn with replacement
    "repeated_experts": dict(T=10, H=16, I=8, E=3, K=3, kind="repeat", shared=True),
    # odd H and I, prime E, Is != I
    "odd_sizes": dict(T=11, H=13, I=7, Is=5, E=7, K=3, shared=True, gate=True),
    # int32 expert ids
    "int32_ids": dict(T=6, H=16, I=8, E=4, K=2, index_dtype=torch.int32, drop=0.3),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases(device, dtype, name):
    case = make_case(dtype=dtype, device=device, seed=len(name), **EDGE_CASES[name])
    y, grads, _, _ = check_against_oracle(case)
    te = case.top_experts.cpu()
    if name == "all_dropped":
        assert torch.count_nonzero(y) == 0
    if te.numel():
        # a `-1` route contributes nothing and gets exactly zero router-weight gradient
        assert torch.count_nonzero(grads["router_weights"].cpu()[te < 0]) == 0
    # an expert without routes has exactly zero weight gradients
    E = case.gate_up_proj.shape[0]
    for e in range(E):
        if not (te == e).any():
            assert torch.count_nonzero(grads["gate_up_proj"][e]) == 0, f"expert {e} is empty"
            assert torch.count_nonzero(grads["down_proj"][e]) == 0, f"expert {e} is empty"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_leading_dims_flattened(device, dtype):
    # x [2, 3, H], router weights / ids [2, 3, K]: two leading dims, flattened into T=6 tokens
    case = make_case(T=6, H=16, I=8, E=4, K=2, dtype=dtype, device=device, shared=True, gate=True, lead=(2, 3),
                     drop=0.2)
    y, grads, _, _ = check_against_oracle(case)
    assert y.shape == (2, 3, 16)
    assert grads["x"].shape == (2, 3, 16) and grads["router_weights"].shape == (2, 3, 2)
    # the same as the call on the flattened tensors, bitwise
    flat = case.detached()
    flat.x = flat.x.detach().reshape(6, 16).requires_grad_()
    flat.router_weights = flat.router_weights.detach().reshape(6, 2).requires_grad_()
    flat.top_experts = flat.top_experts.reshape(6, 2)
    dy = random_like(y, 5)
    y_lead, g_lead = moe_with_grads(case, dy)
    y_flat, g_flat = moe_with_grads(flat, dy.reshape(6, 16))
    assert torch.equal(y_lead.reshape(6, 16), y_flat)
    assert torch.equal(g_lead["x"].reshape(6, 16), g_flat["x"])
    assert torch.equal(g_lead["router_weights"].reshape(6, 2), g_flat["router_weights"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rw_dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_router_weights_other_dtypes(device, x_dtype, rw_dtype):
    # router weights in another float dtype: upcast, and the gradient comes back in their own dtype
    case = make_case(T=6, H=16, I=8, E=4, K=2, dtype=x_dtype, device=device, rw_dtype=rw_dtype, shared=True,
                     drop=0.2)
    _, grads, _, _ = check_against_oracle(case)
    assert grads["router_weights"].dtype == rw_dtype


@pytest.mark.parametrize("device", DEVICES)
def test_router_weights_upcast_not_rounded(device):
    # bf16 router weights with fp32 x: the result equals the call with the same values given in fp32
    case = make_case(T=6, H=16, I=8, E=4, K=2, device=device, rw_dtype=torch.bfloat16)
    up = case.detached()
    up.router_weights = up.router_weights.detach().float().requires_grad_()
    dy = random_like(case.x.detach(), 3)
    y_bf, g_bf = moe_with_grads(case, dy)
    y_up, g_up = moe_with_grads(up, dy)
    assert torch.equal(y_bf, y_up)
    assert torch.equal(g_bf["router_weights"], g_up["router_weights"].to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_inputs(device, dtype):
    # non-contiguous x (a column slice) and weights given as transposed views of [E, H, 2I] / [E, I, H]
    base = make_case(T=6, H=16, I=8, E=4, K=2, dtype=dtype, device=device, shared=True, gate=True, drop=0.2)
    case = base.detached()
    wide = torch.cat([case.x.detach(), random_like(case.x.detach(), 9)], dim=1)
    case.x = wide[:, :16].requires_grad_()
    case.gate_up_proj = case.gate_up_proj.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    case.down_proj = case.down_proj.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not case.x.is_contiguous() and not case.gate_up_proj.is_contiguous()
    check_against_oracle(case)


@pytest.mark.parametrize("device", DEVICES)
def test_limit_clips(device):
    # the clamp really clips at this limit: the results with and without it differ well beyond tolerance,
    # so the limit cases of test_matches_oracle test the clamp and its zero gradient where it clipped
    case = make_case(T=7, H=24, I=12, E=5, K=2, device=device, shared=True, limit=0.6)
    no_limit = case.detached()
    no_limit.swiglu_limit = None
    dy = random_like(case.x.detach(), 4)
    y_l, g_l = moe_with_grads(case, dy)
    y_n, g_n = moe_with_grads(no_limit, dy)
    assert rel_err(y_l, y_n) > 100 * TOLERANCE[torch.float32]
    for name in g_l:
        assert rel_err(g_l[name], g_n[name]) > 100 * TOLERANCE[torch.float32], name


def test_oracle_comparison_catches_a_wrong_gradient():
    # the comparison the tests rely on fails for a gradient off by 0.1% (ten times the fp32 tolerance),
    # and for a gradient missing one expert's contribution
    case = make_case(T=7, H=24, I=12, E=5, K=2, shared=True, gate=True)
    dy = random_like(case.x.detach(), 6)
    _, grads = moe_with_grads(case, dy)
    _, grads_ref = oracle_with_grads(case, dy)
    for name, g in grads.items():
        assert_close_to_oracle(name, g, grads_ref[name], torch.float32)
        with pytest.raises(AssertionError, match="relative error"):
            assert_close_to_oracle(name, g * 1.001, grads_ref[name], torch.float32)
    wrong = grads["gate_up_proj"].clone()
    wrong[int(case.top_experts[0, 0])] = 0
    with pytest.raises(AssertionError, match="relative error"):
        assert_close_to_oracle("gate_up_proj", wrong, grads_ref["gate_up_proj"], torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# NaN / Inf propagation (docs/semantics.md, the contract): a non-finite input reaches every output it touches and
# no other.


def _rows_of_expert(te, e):
    return (te == e).any(dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_nonfinite_token_propagates(device, dtype, bad):
    # T=6, E=4, K=2, no -1 routes: a NaN/Inf in token 2 of x makes row 2 of y non-finite, others finite
    case = make_case(T=6, H=16, I=8, E=4, K=2, dtype=dtype, device=device, seed=11, requires_grad=False)
    case.x[2, 3] = bad
    y = run_moe(case)
    assert not torch.isfinite(y[2]).any(), "the non-finite input did not reach its token's output"
    keep = torch.ones(6, dtype=torch.bool)
    keep[2] = False
    assert torch.isfinite(y[keep.to(y.device)]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("limit", [None, 0.6])
def test_nan_in_expert_weight_propagates(device, dtype, limit):
    # a NaN in expert 1's FC1 (or FC2) reaches exactly the tokens routed to expert 1 (also through the clamp)
    for which in ("gate_up_proj", "down_proj"):
        case = make_case(T=8, H=16, I=8, E=4, K=2, dtype=dtype, device=device, seed=12, limit=limit,
                         requires_grad=False)
        getattr(case, which)[1, 0, 0] = math.nan
        y = run_moe(case).cpu()
        rows = _rows_of_expert(case.top_experts.cpu(), 1)
        assert rows.any() and not rows.all()
        if which == "gate_up_proj":
            assert torch.isnan(y[rows]).all(), which
        else:  # down row 0 feeds output column 0 only
            assert torch.isnan(y[rows, 0]).all(), which
            assert torch.isfinite(y[rows, 1:]).all(), which
        assert torch.isfinite(y[~rows]).all(), which


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_unrouted_places_stays_out(device):
    # a NaN in the weights of an empty expert, or in the router weight of a -1 route, touches no output
    case = make_case(T=8, H=16, I=8, E=6, K=2, kind="low_half", device=device, seed=13, requires_grad=False)
    case.gate_up_proj[5] = math.nan  # expert 5 gets no route ("low_half" routing)
    case.down_proj[5] = math.nan
    case.top_experts[0, 1] = -1
    case.router_weights[0, 1] = math.nan
    assert torch.isfinite(run_moe(case)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nan_in_router_weight_and_shared_propagates(device, dtype):
    # a NaN router weight on a valid route reaches its token only
    case = make_case(T=6, H=16, I=8, E=4, K=2, dtype=dtype, device=device, shared=True, gate=True, seed=14,
                     requires_grad=False)
    rw = case.router_weights.clone()
    case.router_weights[3, 1] = math.nan
    y = run_moe(case).cpu()
    assert torch.isnan(y[3]).all()
    assert torch.isfinite(torch.cat([y[:3], y[4:]])).all()
    # a NaN in the shared expert or in its output gate reaches every token
    case.router_weights = rw
    for which in ("shared_gate_up_proj", "shared_down_proj", "shared_output_gate"):
        c = case.detached(requires_grad=False)
        getattr(c, which)[0, 0] = math.nan
        y = run_moe(c).cpu()
        col = y[:, 0] if which == "shared_down_proj" else y
        assert torch.isnan(col).all(), which


@pytest.mark.parametrize("device", DEVICES)
def test_nan_gradient_propagates(device):
    # a NaN in the upstream gradient of token 2 reaches dx[2], d_router_weights[2] and the weight gradients
    # of token 2's experts, and no other expert's weight gradient
    case = make_case(T=8, H=16, I=8, E=4, K=1, device=device, seed=15)
    dy = random_like(case.x.detach(), 7)
    dy[2, 0] = math.nan
    _, grads = moe_with_grads(case, dy)
    e = int(case.top_experts[2, 0])
    assert torch.isnan(grads["x"][2]).any() and torch.isnan(grads["router_weights"][2]).all()
    assert torch.isnan(grads["down_proj"][e]).any() and torch.isnan(grads["gate_up_proj"][e]).any()
    others = [i for i in range(4) if i != e]
    assert torch.isfinite(grads["gate_up_proj"][others]).all()
    rows = torch.arange(8) != 2
    assert torch.isfinite(grads["x"][rows.to(grads["x"].device)]).all()


# ---------------------------------------------------------------------------------------------
# The checks above fail when the implementation breaks: break the CPU implementation on purpose
# (monkeypatched for one test) and see the oracle comparison catch it.


@pytest.mark.parametrize("breakage", ["clamp_gradient", "combine_order", "router_weight_grad"])
def test_broken_implementation_is_caught(monkeypatch, breakage):
    from mok_inductor import reference

    case = make_case(T=7, H=24, I=12, E=5, K=2, shared=True, gate=True, limit=0.6, drop=0.2, seed=7)
    if breakage == "clamp_gradient":
        original = reference.swiglu_backward

        def no_mask(dh, g, u, limit, act=reference.SWIGLU):
            if limit is None:
                return original(dh, g, u, limit, act)
            gc, uc = torch.clamp(g, max=limit), torch.clamp(u, min=-limit, max=limit)
            sig = torch.sigmoid(gc)
            return dh * uc * sig * (1 + gc * (1 - sig)), dh * gc * sig  # gradient passed where it clipped

        monkeypatch.setattr(reference, "swiglu_backward", no_mask)
    elif breakage == "combine_order":
        original = reference.moe_forward

        def swapped(x, rw, te, *args, **kwargs):
            return original(x, rw.flip(1), te, *args, **kwargs)  # router weights applied to the wrong routes

        monkeypatch.setattr(reference, "moe_forward", swapped)
    else:
        original = reference.moe_backward

        def scaled(*args, **kwargs):
            out = original(*args, **kwargs)
            return out._replace(d_router_weights_TK=out.d_router_weights_TK * 1.01)

        monkeypatch.setattr(reference, "moe_backward", scaled)
    with pytest.raises(AssertionError, match="relative error"):
        check_against_oracle(case)


@pytest.mark.parametrize("device,backend", [("cpu", "reference"), (DEV, "triton"),
                                            pytest.param("cuda", "auto", marks=DEVICES[1].marks)])
def test_inference_runs_the_forward_op_alone(device, backend, monkeypatch):
    """Without autograd (no input requiring grad, torch.no_grad, torch.inference_mode) the composite calls
    the forward op directly instead of through its autograd.Function (the Function's per-call cost is a
    third of mok's Python time at decode); the output is bitwise
    that of the call recording autograd, which still goes through the Function. backend "triton": the Triton
    kernels on DEV (the CPU: under the interpreter)."""
    from mok_inductor import ops

    with mok_inductor.options.override(backend=backend):
        case = make_case(T=9, H=32, I=16, E=5, K=2, dtype=torch.bfloat16, device=device, shared=True, gate=True,
                         limit=0.6, drop=0.2, seed=361)
        applied = []
        real_apply = ops._MoeFwdFunction.apply
        monkeypatch.setattr(ops._MoeFwdFunction, "apply", lambda *a: applied.append(1) or real_apply(*a))
        y_grad = run_moe(case)
        assert applied == [1] and y_grad.requires_grad
        plain = case.detached(requires_grad=False)
        for mode in ("no input requires grad", "no_grad", "inference_mode"):
            ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
            with ctx() if ctx else torch.enable_grad():
                y = run_moe(case if ctx else plain)
            assert not y.requires_grad, mode
            assert torch.equal(y, y_grad.detach()), mode
        assert applied == [1]
