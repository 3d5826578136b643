"""The MoK functional ABI (mok_inductor.functional) against the float64 oracle.

Shapes are tiny (T=24, H=32, I=16, Is=24 so the shared size differs, E=5 prime, K=2); every case
uses fresh random inputs. Layouts: dense separate gate/up, combined FC1 passed twice (aliasing),
per-expert lists (split), SplitRoutedWeight in the project's form (per-expert sequences) and in MoK's (a
representative tensor and a storage table from make_routed_weight_storage_table_bf16). Gradient
destinations: fresh, main_grads (added in place, returned by identity), split storage tables (sequences,
or built by make_routed_d_weight_storage_table), the gate's main-grad. MXFP8 and MoK's swizzled scales:
tests/test_mxfp8.py and tests/test_megatron_formats.py.
"""


import pytest
import torch
import torch.distributed as dist

import mok_inductor
from mok_inductor import functional as mf
from mok_inductor import reference
from _helpers import (DEV, DEVICES, TOLERANCE, MoeCase, init_gloo, make_case, oracle_with_grads, random_like,
                      rel_err)

T, H, I, IS, E, K = 24, 32, 16, 24, 5, 2


@pytest.fixture(scope="module")
def gloo_group():
    """A one-rank gloo process group on a free port, destroyed at the end of the module."""
    owned = not dist.is_initialized()
    if owned:
        init_gloo()
    yield dist.group.WORLD
    if owned:
        dist.destroy_process_group()


def make_problem(device, dtype, *, T=T, gated=True, shared=True, limit=None, minus_one=True):
    """One call's arguments by the ABI's short names (x, rw, te, gate_up, down, sgu, sd, sog, limit, dy), drawn by
    `make_case` from a fresh seed; with `minus_one`, a "no route" and a token with no routes at all."""
    seed = torch.randint(0, 2**31, ()).item()
    c = make_case(T, H, I, E, K, dtype=dtype, device=device, shared=shared, gate=shared and gated, limit=limit,
                  Is=IS, index_dtype=torch.int32, seed=seed, requires_grad=False)
    te = c.top_experts
    if minus_one and T > 2:
        te[1, 1] = -1
        te[2, :] = -1
    return dict(x=c.x, rw=c.router_weights, te=te, gate_up=c.gate_up_proj, down=c.down_proj,
                sgu=c.shared_gate_up_proj, sd=c.shared_down_proj, sog=c.shared_output_gate, limit=limit,
                dy=random_like(c.x, seed + 1))


def oracle(p):
    """Float64 forward and gradients of every input, by the ABI's short names."""
    case = MoeCase(p["x"], p["rw"], p["te"], p["gate_up"], p["down"], p["sgu"], p["sd"], p["sog"], p["limit"])
    y, g = oracle_with_grads(case, p["dy"])
    short = dict(x="x", router_weights="rw", gate_up_proj="gate_up", down_proj="down", shared_gate_up_proj="sgu",
                 shared_down_proj="sd", shared_output_gate="sog")
    return y, {short[n]: t for n, t in g.items()}


def routed_args(p, layout):
    """(routed_gate, routed_up, routed_down) in one of the accepted layouts (zero-copy where possible)."""
    gu, d = p["gate_up"], p["down"]
    if layout == "combined":
        return gu, gu, d
    if layout == "separate":
        return gu[:, :I], gu[:, I:], d
    if layout == "split_combined":
        fc1 = [gu[e].clone() for e in range(E)]  # per-expert allocations, as Megatron holds them
        return fc1, fc1, [d[e].clone() for e in range(E)]
    if layout == "split_separate":
        return [gu[e, :I] for e in range(E)], [gu[e, I:] for e in range(E)], tuple(d[e] for e in range(E))
    if layout == "descriptor":
        fc1 = mf.SplitRoutedWeight(tuple(gu[e].clone() for e in range(E)))
        return fc1, fc1, mf.SplitRoutedWeight(tuple(d[e].clone() for e in range(E)))
    if layout == "mok_form":  # MoK's: one representative expert and the table of all E
        fc1s, fc2s = [gu[e].clone() for e in range(E)], [d[e].clone() for e in range(E)]
        fc1 = mf.SplitRoutedWeight(data=fc1s[0], storage_table=mf.make_routed_weight_storage_table_bf16(fc1s))
        return fc1, fc1, mf.SplitRoutedWeight(data=fc2s[0], storage_table=mf.make_routed_weight_storage_table_bf16(fc2s))
    raise AssertionError(layout)


def shared_args(p):
    if p["sgu"] is None:
        return None, None, None
    return p["sgu"][:IS], p["sgu"][IS:], p["sd"]


def setup(p, cfg=None):
    cfg = cfg or mf.MoKConfig()
    x = p["x"]
    ws = mf.get_workspace(cfg, None, device=x.device, num_local_tokens=x.shape[0], hidden_size=H, topk=K)
    sch = mf.build_schedule(ws, cfg, p["te"], num_local_experts=E)
    return cfg, ws, sch


def run(p, layout="combined", **bwd_kwargs):
    cfg, ws, sch = setup(p)
    routed = routed_args(p, layout)
    shared = shared_args(p)
    gate_kw = {} if p["sog"] is None else {"shared_output_gate_weight": p["sog"]}
    y, fctx = mf.forward(cfg, ws, sch, p["x"], p["rw"], *shared, *routed, swiglu_limit=p["limit"], **gate_kw)
    out = mf.backward(cfg, ws, sch, fctx, p["dy"], p["x"], p["rw"], *shared, *routed, swiglu_limit=p["limit"],
                      **gate_kw, **bwd_kwargs)
    return y, out, routed


def stack(obj):
    """A weight gradient in any layout -> one [E, rows, cols] tensor."""
    if isinstance(obj, (list, tuple)):
        return torch.stack([t.float() for t in obj])
    return obj.float()


# ---------------------------------------------------------------------------------------------- config


def test_config_defaults_are_moks():
    c = mf.MoKConfig()
    assert (c.fwd_num_comm_sms, c.bwd_num_comm_sms, c.minibatch_size, c.macrobatch_size,
            c.schedule_capacity_multiplier, c.all_gather_top_experts_chunk_bytes) == (40, 28, 4096, 131072, 0.5, 2048)
    with pytest.raises(Exception):  # frozen
        c.minibatch_size = 512
    assert not hasattr(c, "__dict__")  # slots


@pytest.mark.parametrize("field,value,exc", [
    ("fwd_num_comm_sms", 3, ValueError),  # odd
    ("bwd_num_comm_sms", 0, ValueError),
    ("minibatch_size", 1000, ValueError),  # not a multiple of 256
    ("macrobatch_size", 4096 * 3 + 256, ValueError),  # not a multiple of minibatch
    ("schedule_capacity_multiplier", 0.0, ValueError),
    ("all_gather_top_experts_chunk_bytes", 24, ValueError),
    ("minibatch_size", 4096.0, TypeError),
    ("fwd_num_comm_sms", True, TypeError),
])
def test_config_validation_names_the_field(field, value, exc):
    with pytest.raises(exc, match=field):
        mf.MoKConfig(**{field: value})


# ---------------------------------------------------------------------------------------------- workspace


def test_workspace_is_cached_per_shape(gloo_group):
    cfg = mf.MoKConfig()
    a = mf.get_workspace(cfg, None, device="cpu", num_local_tokens=8, hidden_size=H, topk=K)
    b = mf.get_workspace(cfg, None, device=torch.device("cpu"), num_local_tokens=8, hidden_size=H, topk=K)
    c = mf.get_workspace(cfg, None, device="cpu", num_local_tokens=16, hidden_size=H, topk=K)
    assert a is b and a is not c
    # a process group of size 1 is one device
    assert mf.get_workspace(cfg, gloo_group, device="cpu", num_local_tokens=8, hidden_size=H, topk=K) is a
    with pytest.raises(TypeError, match="config"):
        mf.get_workspace({}, None, device="cpu", num_local_tokens=8, hidden_size=H, topk=K)
    with pytest.raises(ValueError, match="num_local_tokens"):
        mf.get_workspace(cfg, None, device="cpu", num_local_tokens=-1, hidden_size=H, topk=K)
    for bad in ("hidden_size", "topk"):
        with pytest.raises(ValueError, match=bad):
            mf.get_workspace(cfg, None, device="cpu", **{"num_local_tokens": 8, "hidden_size": H, "topk": K, bad: 0})
    with pytest.raises(ValueError, match="int32 schedule"):  # T*K routes past int32, before any allocation
        mf.get_workspace(cfg, None, device="cpu", num_local_tokens=2 ** 29, hidden_size=H, topk=8)


def test_expert_parallel_workspace_records_its_group(monkeypatch, gloo_group):
    """A group of more than one rank is recorded (the EP path itself: tests/test_distributed.py)."""
    monkeypatch.setattr(mf.distributed, "group_size", lambda group: 4)
    ws = mf.get_workspace(mf.MoKConfig(), gloo_group, device="cpu", num_local_tokens=8, hidden_size=H, topk=K)
    assert ws.group is gloo_group and ws.ep_size == 4



def test_ep_workspace_cache_is_per_group_object(monkeypatch):
    """The cache of expert-parallel workspaces goes with its group: once the group is freed, its workspaces
    are too (no group made later, even at the freed one's address, can be handed one of them), and while it
    lives the group is never kept alive by them. Plain objects stand in for process groups here (their
    size patched to 2); the gloo ranks' version of the check, with real groups, is test_distributed's."""
    import gc
    import weakref

    class Group:  # a weak-referenceable stand-in, as ProcessGroup is
        pass

    monkeypatch.setattr(mf.distributed, "group_size", lambda group: 2)
    cfg = mf.MoKConfig()
    shape = dict(device="cpu", num_local_tokens=8, hidden_size=H, topk=K)
    group, other = Group(), Group()
    ws = mf.get_workspace(cfg, group, **shape)
    assert mf.get_workspace(cfg, group, **shape) is ws and ws.group is group
    ws_other = mf.get_workspace(cfg, other, **shape)
    assert ws_other is not ws and ws_other.group is other
    group_alive, ws_alive = weakref.ref(group), weakref.ref(ws)
    del group
    gc.collect()
    assert group_alive() is None, "the workspace cache kept its group alive"
    with pytest.raises(RuntimeError, match="^workspace: its expert-parallel process group no longer exists"):
        ws.group
    del ws
    gc.collect()
    assert ws_alive() is None, "the cache kept a freed group's workspace"
    assert mf.get_workspace(cfg, other, **shape) is ws_other  # the living group's entry stays
    new = Group()
    ws_new = mf.get_workspace(cfg, new, **shape)
    assert ws_new is not ws_other and ws_new.group is new


# ---------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", [1, 4, 256])
def test_schedule_matches_reference_bit_exactly(device, padding):
    p = make_problem(device, torch.float32)
    cfg, ws, _ = setup(p)
    sch = mf.build_schedule(ws, cfg, p["te"], num_local_experts=E, expert_padding=padding)
    ref = reference.build_schedule(p["te"].cpu(), E)
    assert torch.equal(sch.sorted_routes.cpu(), ref.sorted_routes_N)
    assert torch.equal(sch.expert_offsets.cpu(), ref.expert_offsets_E1)
    assert torch.equal(sch.route_slots.cpu(), ref.route_slots_N)
    te = p["te"].cpu().long()
    counts = torch.bincount(te[te >= 0], minlength=E)
    assert torch.equal(sch.tokens_per_expert.cpu().long(), counts)
    padded = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum((counts + padding - 1) // padding * padding, 0)])
    assert torch.equal(sch.padded_expert_offsets.cpu().long(), padded)
    assert sch.sorted_routes.dtype == torch.int32 and sch.sorted_routes.device == p["x"].device


def test_schedule_rejects_bad_ids_and_shapes():
    p = make_problem("cpu", torch.float32)
    cfg, ws, _ = setup(p)
    bad = p["te"].clone()
    bad[0, 0] = E
    with pytest.raises(ValueError, match="top_experts"):
        mf.build_schedule(ws, cfg, bad, num_local_experts=E)
    with pytest.raises(ValueError, match="top_experts"):
        mf.build_schedule(ws, cfg, p["te"][:-1], num_local_experts=E)
    with pytest.raises(TypeError, match="top_experts"):
        mf.build_schedule(ws, cfg, p["te"].float(), num_local_experts=E)
    with pytest.raises(ValueError, match="num_local_experts"):
        mf.build_schedule(ws, cfg, p["te"], num_local_experts=0)


# ---------------------------------------------------------------------------------------------- numerics


def check_against_oracle(p, y, out, tol):
    ref_y, g = oracle(p)
    assert rel_err(y, ref_y) <= tol
    d_x, d_rw, d_rg, d_ru, d_rd, d_sg, d_su, d_sd, d_gate = out
    assert d_x.dtype == p["x"].dtype and d_rw.dtype == torch.float32
    assert rel_err(d_x, g["x"]) <= tol
    routed = bool((p["te"] >= 0).any())
    if routed:
        assert rel_err(d_rw, g["rw"]) <= tol
    else:  # no valid route: the oracle never touched the router weights
        assert torch.count_nonzero(d_rw) == 0
    dgu = g["gate_up"]
    got_gate, got_up = stack(d_rg), stack(d_ru)
    if got_gate.shape[1] == 2 * I:  # the combined gradient, returned in both slots
        assert d_rg is d_ru
        got_gate, got_up = got_gate[:, :I], got_gate[:, I:]
    if routed:
        assert rel_err(got_gate, dgu[:, :I]) <= tol
        assert rel_err(got_up, dgu[:, I:]) <= tol
        assert rel_err(stack(d_rd), g["down"]) <= tol
    else:
        assert all(torch.count_nonzero(t) == 0 for t in (got_gate, got_up, stack(d_rd)))
    if p["sgu"] is not None:
        assert rel_err(d_sg, g["sgu"][:IS]) <= tol and rel_err(d_su, g["sgu"][IS:]) <= tol
        assert rel_err(d_sd, g["sd"]) <= tol
    else:
        assert d_sg is None and d_su is None and d_sd is None
    if p["sog"] is not None:
        assert d_gate.dtype == torch.float32 and tuple(d_gate.shape) == (1, H)
        assert rel_err(d_gate, g["sog"]) <= tol
    else:
        assert d_gate is None  # MoK's nine-item contract: the ungated call


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["combined", "separate", "split_combined", "split_separate", "descriptor",
                                    "mok_form"])
def test_forward_backward_match_oracle(device, dtype, layout):
    p = make_problem(device, dtype, limit=1.5)  # the clamp is active at these scales
    y, out, _ = run(p, layout)
    assert len(out) == 9
    check_against_oracle(p, y, out, TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gated,shared,dtype", [(False, True, torch.float32), (False, False, torch.float32),
                                                (True, True, torch.float16)])
def test_ungated_no_shared_expert_and_fp16(device, gated, shared, dtype):
    p = make_problem(device, dtype, gated=gated, shared=shared, limit=1.5)
    y, out, _ = run(p, "combined")
    check_against_oracle(p, y, out, TOLERANCE[dtype])


@pytest.mark.parametrize("t", [1, 0])
def test_tiny_token_counts(t):
    p = make_problem("cpu", torch.float32, T=t)
    y, out, _ = run(p, "combined")
    assert y.shape == (t, H) and out[0].shape == (t, H) and out[1].shape == (t, K)
    if t:
        check_against_oracle(p, y, out, TOLERANCE[torch.float32])


def test_all_routes_minus_one_leave_the_shared_expert():
    p = make_problem("cpu", torch.float32)
    p["te"] = torch.full_like(p["te"], -1)
    y, out, _ = run(p, "combined")
    check_against_oracle(p, y, out, TOLERANCE[torch.float32])
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(stack(out[2])) == 0


# ---------------------------------------------------------------------------------------------- main grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mg_dtype", [torch.float32, torch.bfloat16])
def test_main_grads_are_added_in_place_combined(device, mg_dtype):
    p = make_problem(device, torch.bfloat16, limit=1.5)
    fresh_y, fresh, _ = run(p, "combined")
    dev = p["x"].device
    sh_fc1 = torch.randn(2 * IS, H, device=dev).to(mg_dtype)  # canonical buffers with prior content
    r_fc1 = torch.randn(E, 2 * I, H, device=dev).to(mg_dtype)
    sh_fc2 = torch.randn(H, IS, device=dev).to(mg_dtype)
    r_fc2 = torch.randn(E, H, I, device=dev).to(mg_dtype)
    gate_mg = torch.randn(1, H, device=dev).to(mg_dtype)
    before = [t.clone() for t in (sh_fc1, r_fc1, sh_fc2, r_fc2, gate_mg)]
    main_grads = (sh_fc1[:IS], r_fc1, sh_fc1[IS:], r_fc1, sh_fc2, r_fc2)
    _, out, _ = run(p, "combined", main_grads=main_grads, shared_output_gate_main_grad=gate_mg)
    # the returned weight gradients ARE the buffers: main[1], main[3], main[5], main[0], main[2], main[4], gate
    for got, want in zip(out[2:], (main_grads[1], main_grads[3], main_grads[5], main_grads[0], main_grads[2],
                                   main_grads[4], gate_mg)):
        assert got is want
    tol = 2e-2 if mg_dtype == torch.bfloat16 else 1e-2
    added = [t.float() - b.float() for t, b in zip((sh_fc1, r_fc1, sh_fc2, r_fc2, gate_mg), before)]
    fresh_sh_fc1 = torch.cat([fresh[5].float(), fresh[6].float()])
    for a, f in zip(added, (fresh_sh_fc1, fresh[2], fresh[7], fresh[4], fresh[8])):
        assert rel_err(a, f) <= tol
    assert torch.equal(out[0], fresh[0]) and torch.equal(out[1], fresh[1])  # dx, d_rw untouched by main grads


def test_combined_shared_fc1_takes_its_main_grads_as_row_halves():
    # one [2Is, H] shared FC1 passed as shared_gate and shared_up: its gradient is added into the row halves of
    # one buffer (main_grads[0] and [2]); one half passed twice is an error raised before any buffer is written
    p = make_problem("cpu", torch.float32)
    cfg, ws, sch = setup(p)
    routed = routed_args(p, "combined")
    shared = (p["sgu"], p["sgu"], p["sd"])
    gate_kw = {} if p["sog"] is None else {"shared_output_gate_weight": p["sog"]}
    y, fctx = mf.forward(cfg, ws, sch, p["x"], p["rw"], *shared, *routed, swiglu_limit=p["limit"], **gate_kw)
    bwd = lambda **kw: mf.backward(cfg, ws, sch, fctx, p["dy"], p["x"], p["rw"], *shared, *routed,  # noqa: E731
                                   swiglu_limit=p["limit"], **gate_kw, **kw)
    fresh = bwd()
    assert fresh[5] is fresh[6] and fresh[5].shape == (2 * IS, H)  # one combined gradient in both slots
    sh_fc1, r_fc1 = torch.randn(2 * IS, H), torch.randn(E, 2 * I, H)
    sh_fc2, r_fc2 = torch.randn(H, IS), torch.randn(E, H, I)
    kept = [t.clone() for t in (sh_fc1, r_fc1, sh_fc2, r_fc2)]
    half = sh_fc1[:IS]
    with pytest.raises(ValueError, match=r"^main_grads\[0\]: pass the shared gate and up main-grads as row views, "
                                         r"not one buffer twice$"):
        bwd(main_grads=(half, r_fc1, half, r_fc1, sh_fc2, r_fc2))
    assert all(torch.equal(t, k) for t, k in zip((sh_fc1, r_fc1, sh_fc2, r_fc2), kept))
    bwd(main_grads=(sh_fc1[:IS], r_fc1, sh_fc1[IS:], r_fc1, sh_fc2, r_fc2))
    assert rel_err(sh_fc1 - kept[0], fresh[5]) <= TOLERANCE[torch.float32]
    assert rel_err(sh_fc2 - kept[2], fresh[7]) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["sequences", "mok_form"])
def test_split_main_grads_with_storage_tables(device, form):
    p = make_problem(device, torch.bfloat16, limit=1.5)
    _, fresh, _ = run(p, "combined")
    dev = p["x"].device
    fc1_mg = [torch.randn(2 * I, H, device=dev) for _ in range(E)]  # per-expert fp32 main_grads
    fc2_mg = [torch.randn(H, I, device=dev) for _ in range(E)]
    before1, before2 = [t.clone() for t in fc1_mg], [t.clone() for t in fc2_mg]
    main_grads = (None, fc1_mg[0], None, fc1_mg[0], None, fc2_mg[0])  # representatives
    if form == "sequences":
        tables, layout = (fc1_mg, fc1_mg, fc2_mg), "split_combined"
    else:  # as Megatron's MoK bridge passes them: built tables, the FC1 one as gate and up
        t1, t2 = mf.make_routed_d_weight_storage_table(fc1_mg), mf.make_routed_d_weight_storage_table(fc2_mg)
        tables, layout = (t1, t1, t2), "mok_form"
    _, out, _ = run(p, layout, main_grads=main_grads, main_grad_storage_tables=tables)
    assert out[2] is fc1_mg[0] and out[3] is fc1_mg[0] and out[4] is fc2_mg[0]
    for e in range(E):
        assert rel_err(fc1_mg[e] - before1[e], fresh[2][e]) <= 1e-2
        assert rel_err(fc2_mg[e] - before2[e], fresh[4][e]) <= 1e-2


@pytest.mark.parametrize("layout", ["split_combined", "split_separate", "descriptor", "mok_form"])
def test_split_layouts_run_on_the_kernels(layout, monkeypatch):
    """Split per-expert weights and main-grad storage tables on the Triton kernels (the interpreter on CPU,
    tests/conftest.py): the reference implementation is not called, and the results match the oracle."""
    from mok_inductor import reference

    monkeypatch.setattr(reference, "moe_forward", None)
    monkeypatch.setattr(reference, "moe_backward", None)
    p = make_problem(DEV, torch.bfloat16, limit=1.5)
    with mok_inductor.options.override(backend="triton"):
        y, out, _ = run(p, layout)
        check_against_oracle(p, y, out, TOLERANCE[torch.bfloat16])
        if layout == "split_combined":
            fc1_mg = [torch.randn(2 * I, H, device=DEV) for _ in range(E)]
            fc2_mg = [torch.randn(H, I, device=DEV) for _ in range(E)]
            before1, before2 = [t.clone() for t in fc1_mg], [t.clone() for t in fc2_mg]
            run(p, layout, main_grads=(None, fc1_mg[0], None, fc1_mg[0], None, fc2_mg[0]),
                main_grad_storage_tables=(fc1_mg, fc1_mg, fc2_mg))
            for e in range(E):
                assert rel_err(fc1_mg[e] - before1[e], out[2][e]) <= 1e-2
                assert rel_err(fc2_mg[e] - before2[e], out[4][e]) <= 1e-2


def test_rejected_call_writes_nothing():
    p = make_problem("cpu", torch.bfloat16)
    r_fc1 = torch.randn(E, 2 * I, H)
    sh_fc1 = torch.randn(2 * IS, H)
    good = (sh_fc1[:IS], r_fc1, sh_fc1[IS:], r_fc1, torch.randn(H, IS), torch.randn(E, H, I))
    snapshot = [t.clone() for t in (r_fc1, sh_fc1, good[4], good[5])]
    bad_last = good[:5] + (torch.randn(E, H, I, dtype=torch.float16),)
    with pytest.raises(TypeError, match=r"main_grads\[5\]"):
        run(p, "combined", main_grads=bad_last)
    with pytest.raises(ValueError, match="shared_output_gate_main_grad"):
        run(p, "combined", main_grads=good, shared_output_gate_main_grad=torch.zeros(2, H))
    with pytest.raises(ValueError, match=r"main_grads\[1\]"):
        run(p, "combined", main_grads=(good[0], torch.zeros(E, 2 * I, H + 1)) + good[2:3] +
            (torch.zeros(E, 2 * I, H + 1),) + good[4:])
    for t, s in zip((r_fc1, sh_fc1, good[4], good[5]), snapshot):
        assert torch.equal(t, s)


# ---------------------------------------------------------------------------------------------- bad input


def test_mxfp8_where_it_is_not_accepted_is_a_clear_error():
    # MXFP8 tuples themselves are tested in tests/test_mxfp8.py; a mix with bf16, a bare float8 tensor and
    # an MXFP8 shared expert (bf16 only, as in MoK) are errors naming the argument
    p = make_problem("cpu", torch.bfloat16)
    cfg, ws, sch = setup(p)
    data = p["gate_up"].to(torch.float8_e4m3fn)
    scale = torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"^routed_down: expected an MXFP8 weight \(a \(data, scale\) tuple or a SplitRoutedWeight with scales\), as the other routed weights$"):
        fc1 = (data, scale)
        mf.forward(cfg, ws, sch, p["x"], p["rw"], *shared_args(p), fc1, fc1, p["down"])
    with pytest.raises(TypeError, match="routed_down: MXFP8"):
        mf.forward(cfg, ws, sch, p["x"], p["rw"], *shared_args(p), p["gate_up"], p["gate_up"],
                   p["down"].to(torch.float8_e4m3fn))
    sg, su, sd = shared_args(p)
    with pytest.raises(TypeError, match="shared_gate: MXFP8"):
        mf.forward(cfg, ws, sch, p["x"], p["rw"], sg.to(torch.float8_e4m3fn), su, sd, p["gate_up"], p["gate_up"],
                   p["down"])


def test_bad_arguments_name_themselves():
    p = make_problem("cpu", torch.bfloat16, limit=2.0)
    cfg, ws, sch = setup(p)
    sh = shared_args(p)
    gu, d = p["gate_up"], p["down"]
    fwd = lambda *a, **k: mf.forward(cfg, ws, sch, *a, **k)  # noqa: E731
    with pytest.raises(ValueError, match="^x:"):
        fwd(p["x"][:-1], p["rw"], *sh, gu, gu, d)
    with pytest.raises(ValueError, match="^routed_down"):
        fwd(p["x"], p["rw"], *sh, gu, gu, d[:, :, :-1])
    with pytest.raises(TypeError, match="^routed_gate"):
        fwd(p["x"], p["rw"], *sh, gu.float(), gu.float(), d)
    with pytest.raises(ValueError, match="^shared_down"):
        fwd(p["x"], p["rw"], sh[0], sh[1], None, gu, gu, d)
    with pytest.raises(ValueError, match="^shared_output_gate_weight"):
        fwd(p["x"], p["rw"], *sh, gu, gu, d, shared_output_gate_weight=p["sog"][:, :-1])
    with pytest.raises(ValueError, match="^routed_gate"):  # E disagrees with the schedule
        fewer = gu[:-1]
        fwd(p["x"], p["rw"], *sh, fewer, fewer, d[:-1])
    with pytest.raises(ValueError, match="swiglu_limit"):
        fwd(p["x"], p["rw"], *sh, gu, gu, d, swiglu_limit=-1.0)
    y, fctx = fwd(p["x"], p["rw"], *sh, gu, gu, d, swiglu_limit=2.0, shared_output_gate_weight=p["sog"])
    bwd = lambda **k: mf.backward(cfg, ws, sch, fctx, p["dy"], p["x"], p["rw"], *sh, gu, gu, d, **k)  # noqa: E731
    with pytest.raises(ValueError, match="^shared_output_gate_weight"):  # the context is gated
        bwd(swiglu_limit=2.0)
    with pytest.raises(ValueError, match="^swiglu_limit"):
        bwd(swiglu_limit=3.0, shared_output_gate_weight=p["sog"])
    with pytest.raises(TypeError, match="^forward_context"):
        mf.backward(cfg, ws, sch, object(), p["dy"], p["x"], p["rw"], *sh, gu, gu, d)
    with pytest.raises(ValueError, match="^main_grads"):
        bwd(swiglu_limit=2.0, shared_output_gate_weight=p["sog"], main_grads=(None,) * 5)
    with pytest.raises(ValueError, match="^main_grad_storage_tables"):
        bwd(swiglu_limit=2.0, shared_output_gate_weight=p["sog"], main_grad_storage_tables=([], [], []))


def test_several_live_contexts_over_one_workspace():
    """MoK's rule: contexts are independent; the workspace is shared scratch."""
    p1, p2 = make_problem("cpu", torch.float32), make_problem("cpu", torch.float32)
    p2["te"], p2["rw"] = p1["te"], p1["rw"]
    cfg, ws, sch = setup(p1)
    sh1, sh2 = shared_args(p1), shared_args(p2)
    y1, c1 = mf.forward(cfg, ws, sch, p1["x"], p1["rw"], *sh1, p1["gate_up"], p1["gate_up"], p1["down"],
                        shared_output_gate_weight=p1["sog"])
    y2, c2 = mf.forward(cfg, ws, sch, p2["x"], p2["rw"], *sh2, p2["gate_up"], p2["gate_up"], p2["down"],
                        shared_output_gate_weight=p2["sog"])
    o1 = mf.backward(cfg, ws, sch, c1, p1["dy"], p1["x"], p1["rw"], *sh1, p1["gate_up"], p1["gate_up"], p1["down"],
                     shared_output_gate_weight=p1["sog"])
    check_against_oracle(p1, y1, o1, TOLERANCE[torch.float32])
