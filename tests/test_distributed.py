"""Expert parallelism (mok_inductor.distributed) on real gloo process groups, against one process.

Each test spawns one process group (world sizes 2 and 4) and runs several cases inside it, to keep
the spawn cost down. In every case every rank builds the SAME global problem from a shared seed
(all ranks' tokens and all E experts), runs its own share through the EP path (its tokens, its
E_local = E / W experts), and checks forward and every gradient against the float64 oracle
computing all experts over all ranks' tokens in one process: the output, d x and d router weights
rows of this rank, the local experts' slice of the weight gradients, and the shared expert's
gradients summed over the ranks (a data-parallel all-reduce). Cases: balanced random routing, every
token to rank 0's experts, a rank with T = 0, `-1` routes (and a token with none), the shared expert
with its output gate, swiglu_limit, bf16, K = 1; GPT-OSS's experts (its activation, both routed
biases, an expert no route reaches; the reference and the Triton kernels (under the interpreter, so without
CUDA only); its checkpoint layout's views; autocast), also against the one-device call holding every expert;
the functional ABI with a group (fresh gradients and main_grads accumulation, dense and split layouts); errors
raised on every rank; determinism.

Shapes: T in [0, 16] per rank, H=32, I=16, Is=24, E=8, K=2 (K=1 once). Tolerances: docs/semantics.md, "The
contract" (`_helpers.TOLERANCE`).
"""

import datetime
import functools
import gc
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported before any worker's init_process_group (a spawned worker imports this module first), as a user's
# program imports it: `import mok_inductor` imports torch.distributed.nn.functional, whose collectives bind the
# world group as a default argument when first imported, so that the first EP call (which imports
# torch._dynamo, and with it that module) cannot keep the group, and its gloo threads, alive past
# destroy_process_group (see _worker's check).
import mok_inductor  # noqa: E402,F401
from _helpers import (  # noqa: E402
    TOLERANCE, MoeCase, assert_close_to_oracle, gloo_threads, make_case, moe_with_grads, oracle_with_grads,
    random_like, rel_err, routing,
)
from oracle import oracle_moe  # noqa: E402
from test_gpt_oss import _hf_layout, _inputs as gpt_oss_inputs  # noqa: E402

H, I, IS, E = 32, 16, 24, 8
SHARED_NAMES = ("shared_gate_up_proj", "shared_down_proj", "shared_output_gate")


# ---------------------------------------------------------------------------------------------- spawning


_DEVICE = "cpu"  # the device of the spawned workers' tensors (cuda: an NCCL group)


def _worker(rank, world, init_file, seed, suite, device):
    global _DEVICE
    _DEVICE = device
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for fn in SUITES[suite]:
            try:
                fn(rank, world, seed)
            except Exception as exc:
                raise AssertionError(f"rank {rank}/{world}, {fn.__name__}: {exc}\n{traceback.format_exc()}") from exc
            seed += 1000
    finally:
        gc.collect()  # the cases' reference cycles (pytest.raises tracebacks) hold the group too
        dist.destroy_process_group()
    # Nothing may keep the group alive past destroy_process_group: its gloo threads would outlive the
    # interpreter, and one of them freeing a finished collective's tensors during interpreter shutdown
    # aborts the process (SIGABRT), at random. (A cached workspace held its group once.)
    gc.collect()
    left = gloo_threads()
    assert not left, f"rank {rank}: gloo threads alive after destroy_process_group: {left}"


def _spawn(world, suite, tmp_path, device="cpu"):
    seed = int(torch.randint(0, 2**30, ()))  # fresh inputs every run; the ranks share it
    mp.spawn(_worker, args=(world, str(tmp_path / "pg_init"), seed, suite, device), nprocs=world, join=True)


# ---------------------------------------------------------------------------------------------- problems


def _problem(world, seed, *, T=None, K=2, kind="random", dtype=torch.float32, shared=True, gate=True, limit=None):
    """The global problem, identical on every rank: all ranks' tokens (rank r's are the T[r] rows after
    the earlier ranks') through all E experts, as one `make_case` case, and dy. kind: random; rank0
    (every route of every token to rank 0's experts); drop (30% of the routes -1, and each rank's first
    token with no route at all)."""
    g = torch.Generator().manual_seed(seed)
    T = T if T is not None else [int(t) for t in torch.randint(8, 17, (world,), generator=g)]
    case = make_case(T=sum(T), H=H, I=I, E=E, K=K, Is=IS, dtype=dtype, shared=shared, gate=shared and gate,
                     limit=limit, drop=0.3 if kind == "drop" else 0.0, seed=seed + 1, requires_grad=False)
    if kind == "rank0":
        case.top_experts = routing(sum(T), K, E // world, generator=g)
    if kind == "drop":
        case.top_experts[[sum(T[:r]) for r in range(world) if T[r]]] = -1
    return dict(case=case, dy=random_like(case.x, seed + 2), T=T, El=E // world)


def _rows(p, rank):
    start = sum(p["T"][:rank])
    return slice(start, start + p["T"][rank])


def _local(p, rank):
    return slice(rank * p["El"], (rank + 1) * p["El"])


def _rank_case(p, rank):
    """(this rank's case, its rows of dy): its tokens, its E / W local experts, the whole shared expert.
    Odd ranks pass int32 expert indices, even ranks int64 (the exchanges carry both)."""
    c, rows, loc = p["case"], _rows(p, rank), _local(p, rank)
    te = c.top_experts[rows].to(torch.int32 if rank % 2 else torch.int64)
    mine = MoeCase(c.x[rows], c.router_weights[rows], te, c.gate_up_proj[loc], c.down_proj[loc],
                   c.shared_gate_up_proj, c.shared_down_proj, c.shared_output_gate, c.swiglu_limit)
    return mine, p["dy"][rows]


def _sum_over_ranks(t):
    t = t.detach().double().clone()
    dist.all_reduce(t)
    return t


# ---------------------------------------------------------------------------------------------- the user API


def _run_api(p, rank):
    """(y, {name: grad}) of this rank's share through mok_inductor.moe over the world group."""
    return moe_with_grads(*_rank_case(p, rank), fn=functools.partial(mok_inductor.moe, group=dist.group.WORLD))


def _check_api_case(rank, world, seed, **kw):
    p = _problem(world, seed, **kw)
    y, grads = _run_api(p, rank)
    y_ref, g_ref = oracle_with_grads(p["case"], p["dy"])
    dt = p["case"].x.dtype
    rows, loc = _rows(p, rank), _local(p, rank)
    assert y.dtype == dt and y.shape == (p["T"][rank], H)
    assert_close_to_oracle("y", y, y_ref[rows], dt)
    assert_close_to_oracle("d x", grads["x"], g_ref["x"][rows], dt)
    assert grads["router_weights"].dtype == torch.float32
    assert_close_to_oracle("d router_weights", grads["router_weights"], g_ref["router_weights"][rows], dt)
    assert torch.all(grads["router_weights"][p["case"].top_experts[rows] < 0] == 0), \
        "a -1 route got a router-weight gradient"
    for n in ("gate_up_proj", "down_proj"):
        assert_close_to_oracle(f"d {n} (local experts)", grads[n], g_ref[n][loc], dt)
    for n in SHARED_NAMES:
        if n in grads:
            # each rank's shared gradient covers its own tokens; data parallelism sums them
            assert_close_to_oracle(f"d {n} (summed over ranks)", _sum_over_ranks(grads[n]), g_ref[n], dt)
    return p, y, grads


def case_balanced(rank, world, seed):
    _check_api_case(rank, world, seed, limit=None)


def case_balanced_limit(rank, world, seed):
    _check_api_case(rank, world, seed, limit=1.0)


def case_all_to_rank0(rank, world, seed):
    _check_api_case(rank, world, seed, kind="rank0")


def case_empty_rank(rank, world, seed):
    T = [11, 0] + [7, 16][: world - 2]
    _check_api_case(rank, world, seed, T=T, kind="drop")


def case_minus_one_routes(rank, world, seed):
    _check_api_case(rank, world, seed, kind="drop", shared=True, gate=False, limit=0.8)


def case_no_shared_k1(rank, world, seed):
    _check_api_case(rank, world, seed, K=1, shared=False)


def case_bf16(rank, world, seed):
    _check_api_case(rank, world, seed, dtype=torch.bfloat16, limit=1.0)


def case_all_tokens_empty(rank, world, seed):
    """No rank has a token (every collective moves nothing); output and gradients are empty."""
    p, y, grads = _check_api_case(rank, world, seed, T=[0] * world)
    assert grads["gate_up_proj"].abs().sum() == 0 and grads["down_proj"].abs().sum() == 0


def case_matches_one_device_and_is_deterministic(rank, world, seed):
    """The EP result equals the one-device megakernel on the concatenated tokens (fp32, tight), and
    two EP runs are bitwise identical."""
    p = _problem(world, seed, limit=1.5)
    y1, g1 = _run_api(p, rank)
    y2, g2 = _run_api(p, rank)
    assert torch.equal(y1, y2), "two EP runs differ"
    for k in g1:
        assert torch.equal(g1[k], g2[k]), f"two EP runs differ in d {k}"
    y, g = moe_with_grads(p["case"], p["dy"])
    rows, loc = _rows(p, rank), _local(p, rank)
    assert rel_err(y1, y[rows]) <= 1e-6
    assert rel_err(g1["x"], g["x"][rows]) <= 1e-6
    assert rel_err(g1["gate_up_proj"], g["gate_up_proj"][loc]) <= 1e-6


def case_errors_on_every_rank(rank, world, seed):
    """A bad expert id on one rank raises ValueError on every rank (nobody is left in a collective);
    so does a rank holding a different number of local experts, or computing another activation, clamp or
    set of biases. The group stays usable."""
    p = _problem(world, seed)
    mine, _ = _rank_case(p, rank)
    te = mine.top_experts.clone()
    if rank == 1:
        te[0, 0] = E  # out of [-1, E)
    with pytest.raises(ValueError) as info:
        mok_inductor.moe(mine.x, mine.router_weights, te, mine.gate_up_proj, mine.down_proj, group=dist.group.WORLD)
    msg = str(info.value)
    if rank == 1:
        assert msg == f"top_experts: expected global expert indices in [-1, {E}) (-1 means no route; E = " \
                      f"{p['El']} local experts x {world} ranks), found {E}", msg
    else:
        assert msg == f"top_experts: rank 1 of the expert-parallel group passed expert indices outside [-1, {E})", msg

    gu, dn = mine.gate_up_proj, mine.down_proj
    if rank == 0:
        gu, dn = torch.cat([gu, gu]), torch.cat([dn, dn])  # twice the local experts
    with pytest.raises(ValueError, match="^group: the ranks disagree on"):
        mok_inductor.moe(mine.x, mine.router_weights, mine.top_experts.clamp(max=p["El"] - 1), gu, dn,
                         group=dist.group.WORLD)
    # ids valid on the rank with more experts but out of the others' range: every rank names the disagreement
    # (not the ids, which only look out of range because the expert counts differ)
    te = mine.top_experts.clone()
    if rank == 0:
        te[0, 0] = E  # < 2E: in range for rank 0's doubled experts
    with pytest.raises(ValueError, match="^group: the ranks disagree on"):
        mok_inductor.moe(mine.x, mine.router_weights, te, gu, dn, group=dist.group.WORLD)
    # what the experts compute must agree too: the activation, the clamp, the biases' presence
    for kw in (dict(activation="gpt_oss" if rank == 0 else "swiglu"), dict(swiglu_limit=7.0 if rank else 6.0),
               dict(down_bias=torch.zeros(p["El"], H) if rank == world - 1 else None)):
        with pytest.raises(ValueError, match="^group: the ranks disagree on what the experts compute") as info:
            mok_inductor.moe(mine.x, mine.router_weights, mine.top_experts, mine.gate_up_proj, mine.down_proj,
                             group=dist.group.WORLD, **kw)
        assert "rank " in str(info.value) and "activation=" in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="^top_experts: expected shape"):
        mok_inductor.moe(mine.x, mine.router_weights, mine.top_experts[:, :1], mine.gate_up_proj, mine.down_proj,
                         group=dist.group.WORLD)  # a local shape error: raised before any collective, on every rank
    from mok_inductor import mxfp8

    mx_gate_up = mxfp8.quantize(mine.gate_up_proj, columnwise=False)  # [El, 2I=32, H=32]: row-wise blocks of 32
    with pytest.raises(TypeError, match="^gate_up_proj/down_proj: MXFP8 routed weights are not supported with expert "
                                        "parallelism"):
        mok_inductor.moe(mine.x, mine.router_weights, mine.top_experts, mx_gate_up, mine.down_proj,
                         group=dist.group.WORLD)
    with pytest.raises(ValueError, match="^down_bias: routed biases are not supported with a shared expert"):
        mok_inductor.moe(mine.x, mine.router_weights, mine.top_experts, mine.gate_up_proj, mine.down_proj,
                         shared_gate_up_proj=mine.shared_gate_up_proj, shared_down_proj=mine.shared_down_proj,
                         activation="gpt_oss", down_bias=torch.zeros(p["El"], H), group=dist.group.WORLD)
    case_balanced(rank, world, seed + 1)  # the group still works


# ---------------------------------------------------------------------------------------------- GPT-OSS's experts


PER_EXPERT = ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias")  # each rank passes its experts' rows
EMPTY_EXPERT = 5  # no route reaches it (rank 1's of 2, rank 2's of 4): zero weight and bias gradients there


def _gpt_oss_problem(world, seed, *, T=None, dtype=torch.float32, activation="gpt_oss", limit=1.0, shared=False):
    """The global problem with GPT-OSS-style experts, identical on every rank: test_gpt_oss's inputs (biases of
    O(0.5), so a limit of 1 clips g and u) over all ranks' tokens and all E experts, 30% of the routes -1, each
    rank's first token with none, expert EMPTY_EXPERT with none. `shared`: a shared expert with its output gate
    in place of the biases (the two do not combine; the activation applies to it too)."""
    g = torch.Generator().manual_seed(seed)
    T = T if T is not None else [int(t) for t in torch.randint(4, 9, (world,), generator=g)]
    inp = gpt_oss_inputs(T=sum(T), H=H, I=I, E=E, K=2, dtype=dtype, seed=seed + 1, drop=0.3)
    te = inp["top_experts"]
    te[te == EMPTY_EXPERT] = -1
    te[[sum(T[:r]) for r in range(world) if T[r]]] = -1
    if shared:
        del inp["gate_up_bias"], inp["down_bias"]

        def randn(*shape):
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * shape[-1] ** -0.5).to(dtype)

        inp.update(shared_gate_up_proj=randn(2 * IS, H), shared_down_proj=randn(H, IS), shared_output_gate=randn(1, H))
    return dict(inp=inp, dy=random_like(inp["x"], seed + 2), T=T, El=E // world, activation=activation,
                limit=limit)


def _gpt_oss_moe(p, rows, loc, *, group=None, hf=False):
    """(y, {name: gradient}) of mok_inductor.moe on the tokens `rows` and the experts `loc` of problem `p`
    (fresh leaves; the backward of <y, dy[rows]>). `hf`: the routed weights and the FC1 bias passed as views
    of GPT-OSS's checkpoint tensors (`_hf_layout`), whose gradients come back in that layout, each checked to
    arrive in its parameter's strides (before AccumulateGrad, which would copy one of another layout)."""
    inp = p["inp"]
    leaves = {n: (t[loc] if n in PER_EXPERT else t if n in SHARED_NAMES else t[rows]).detach().clone()
              for n, t in inp.items() if n != "top_experts"}
    if hf:
        leaves["gate_up_proj"], leaves["gate_up_bias"], leaves["down_proj"] = _hf_layout(leaves)
    for t in leaves.values():
        t.requires_grad_(True)
    call = dict(leaves)
    arriving = {}
    if hf:
        El = leaves["down_bias"].shape[0]
        call.update(gate_up_proj=leaves["gate_up_proj"].view(El, H, I, 2).permute(0, 3, 2, 1),
                    gate_up_bias=leaves["gate_up_bias"].view(El, I, 2).transpose(1, 2),
                    down_proj=leaves["down_proj"].transpose(1, 2))
        for n in ("gate_up_proj", "gate_up_bias", "down_proj"):
            leaves[n].register_hook(lambda g, n=n: arriving.__setitem__(n, g.stride() == leaves[n].stride()))
    y = mok_inductor.moe(call.pop("x"), call.pop("router_weights"), inp["top_experts"][rows],
                         call.pop("gate_up_proj"), call.pop("down_proj"), swiglu_limit=p["limit"],
                         activation=p["activation"], group=group, **call)
    y.backward(p["dy"][rows])
    if hf:
        assert arriving == dict.fromkeys(("gate_up_proj", "gate_up_bias", "down_proj"), True), arriving
    return y.detach(), {n: t.grad for n, t in leaves.items()}


def _gpt_oss_oracle(p):
    """(y, {name: gradient}) of the float64 oracle over all ranks' tokens and all experts."""
    inp = p["inp"]
    leaves = {n: t.detach().double().requires_grad_(True) for n, t in inp.items() if n != "top_experts"}
    y = oracle_moe(leaves["x"], leaves["router_weights"], inp["top_experts"], leaves["gate_up_proj"],
                   leaves["down_proj"], *(leaves.get(n) for n in SHARED_NAMES), swiglu_limit=p["limit"],
                   activation=p["activation"], gate_up_bias=leaves.get("gate_up_bias"),
                   down_bias=leaves.get("down_bias"))
    y.backward(p["dy"].double())
    return y.detach(), {n: t.grad for n, t in leaves.items()}


def _check_gpt_oss_case(rank, world, seed, *, backend="reference", hf=False, repeat=False, **kw):
    """This rank's EP output and gradients (shared ones summed over the ranks) against the float64 oracle at
    the contract's bound, and against the one-device call holding every expert on all ranks' tokens (the same
    backend; 1e-6 in float32, where the two differ only in the order of their sums: the combine over ranks,
    the bias gradients' row sums, the shared expert's sum over ranks); the expert no route reaches gets
    exactly zero gradients; `repeat`: a second EP run is bitwise identical."""
    p = _gpt_oss_problem(world, seed, **kw)
    rows, loc = _rows(p, rank), _local(p, rank)
    with mok_inductor.options.override(backend=backend):
        y, grads = _gpt_oss_moe(p, rows, loc, group=dist.group.WORLD, hf=hf)
        if repeat:
            y2, grads2 = _gpt_oss_moe(p, rows, loc, group=dist.group.WORLD, hf=hf)
            assert torch.equal(y, y2), "two EP runs differ"
            for n in grads:
                assert torch.equal(grads[n], grads2[n]), f"two EP runs differ in d {n}"
        y_one, g_one = _gpt_oss_moe(p, slice(None), slice(None), hf=hf)
    y_ref, g_ref = _gpt_oss_oracle(p)
    if hf:  # the oracle's gradients in the checkpoint layout, as the EP call returns them
        g_ref["gate_up_proj"], g_ref["gate_up_bias"], g_ref["down_proj"] = _hf_layout(g_ref)
    dt = p["inp"]["x"].dtype
    one_tol = 1e-6 if dt == torch.float32 else TOLERANCE[dt]
    for n, got, ref, one in [("y", y, y_ref, y_one)] + [(n, grads[n], g_ref[n], g_one[n]) for n in grads]:
        assert got.dtype == (torch.float32 if n == "router_weights" else dt), n
        if n in SHARED_NAMES:  # each rank's shared gradient covers its own tokens; data parallelism sums them
            got = _sum_over_ranks(got)
        else:
            ref, one = (ref[loc], one[loc]) if n in PER_EXPERT else (ref[rows], one[rows])
        assert_close_to_oracle(f"{'' if n == 'y' else 'd '}{n}", got, ref, dt)
        err = rel_err(got, one)
        assert err <= one_tol, f"d {n}: relative error {err:.3e} vs the one-device call exceeds {one_tol:.0e}"
    if loc.start <= EMPTY_EXPERT < loc.stop:
        for n in PER_EXPERT:
            if n in grads:
                assert not grads[n][EMPTY_EXPERT - loc.start].any(), f"d {n}: nonzero for an expert with no route"


def case_gpt_oss(rank, world, seed):
    _check_gpt_oss_case(rank, world, seed, repeat=True)


def case_gpt_oss_bf16_hf_views(rank, world, seed):
    _check_gpt_oss_case(rank, world, seed, dtype=torch.bfloat16, hf=True)


def case_swiglu_biases_empty_rank(rank, world, seed):
    # SwiGLU with both biases (the variant's biases do not depend on its activation); rank 1 has no token
    _check_gpt_oss_case(rank, world, seed, activation="swiglu", limit=0.8, T=[6, 0] + [5, 3][:world - 2])


def case_gpt_oss_shared_expert(rank, world, seed):
    # no biases: the activation applies to the shared expert too, as on one device
    _check_gpt_oss_case(rank, world, seed, shared=True)


def case_gpt_oss_autocast(rank, world, seed):
    """Under torch.autocast the EP call casts x, the weights and the biases as mok::moe does: the result and the
    gradients equal the call on bf16 inputs, the gradients coming back in float32 through the casts."""
    p = _gpt_oss_problem(world, seed)
    rows, loc = _rows(p, rank), _local(p, rank)
    bf16 = dict(p, inp={n: t.bfloat16() if n not in ("top_experts", "router_weights") else t
                        for n, t in p["inp"].items()}, dy=p["dy"].bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, grads = _gpt_oss_moe(dict(p, dy=bf16["dy"]), rows, loc, group=dist.group.WORLD)
    y_cast, g_cast = _gpt_oss_moe(bf16, rows, loc, group=dist.group.WORLD)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_cast)
    for n, g in grads.items():
        assert g.dtype == torch.float32 and torch.equal(g, g_cast[n].float()), n


def case_gpt_oss_triton(rank, world, seed):
    # the Triton kernels (under the interpreter on the gloo ranks' CPU tensors): T < a tile on each rank
    _check_gpt_oss_case(rank, world, seed, backend="triton", T=[5, 3] + [4, 2][:world - 2])


# ---------------------------------------------------------------------------------------------- the functional ABI


def _functional_case(rank, world, seed, *, layout, main_grads, dtype=torch.float32):
    from mok_inductor import functional as mf

    p = _problem(world, seed, dtype=dtype, limit=1.0, kind="drop")
    mine, dy = _rank_case(p, rank)
    loc = _local(p, rank)
    T, K, El = p["T"][rank], mine.top_experts.shape[1], p["El"]
    cfg = mf.MoKConfig()
    ws = mf.get_workspace(cfg, dist.group.WORLD, device="cpu", num_local_tokens=T, hidden_size=H, topk=K)
    assert ws.group is dist.group.WORLD and ws.ep_size == world
    sch = mf.build_schedule(ws, cfg, mine.top_experts, num_local_experts=El)
    gu, dn = mine.gate_up_proj.clone(), mine.down_proj.clone()
    if layout == "split":
        rg = ru = mf.SplitRoutedWeight(tuple(gu.unbind(0)))
        rd = list(dn.unbind(0))
    else:
        rg, ru, rd = gu, gu, dn
    sgu, sd, sog = mine.shared_gate_up_proj, mine.shared_down_proj, mine.shared_output_gate
    s_gate, s_up = sgu[:IS], sgu[IS:]
    y, fctx = mf.forward(cfg, ws, sch, mine.x, mine.router_weights, s_gate, s_up, sd, rg, ru, rd, swiglu_limit=1.0,
                         shared_output_gate_weight=sog)
    kw = {}
    g = torch.Generator().manual_seed(seed + rank)
    if main_grads:
        mg_gu = torch.randn(El, 2 * I, H, generator=g)  # poisoned: the gradients are ADDED
        mg_dn = torch.randn(El, H, I, generator=g)
        mg_sgu, mg_sd = torch.randn(2 * IS, H, generator=g), torch.randn(H, IS, generator=g)
        mg_sog = torch.randn(1, H, generator=g)
        before = [t.clone() for t in (mg_gu, mg_dn, mg_sgu, mg_sd, mg_sog)]
        kw = dict(main_grads=(mg_sgu[:IS], mg_gu, mg_sgu[IS:], mg_gu, mg_sd, mg_dn),
                  shared_output_gate_main_grad=mg_sog)
    out = mf.backward(cfg, ws, sch, fctx, dy, mine.x, mine.router_weights, s_gate, s_up, sd, rg, ru, rd,
                      swiglu_limit=1.0, shared_output_gate_weight=sog, **kw)
    d_x, d_rw, d_rg, d_ru, d_rd, d_sg, d_su, d_sd, d_sog = out
    y_ref, g_ref = oracle_with_grads(p["case"], p["dy"])
    rows = _rows(p, rank)
    check = functools.partial(assert_close_to_oracle, dtype=dtype)
    check("y", y, y_ref[rows])
    check("d x", d_x, g_ref["x"][rows])
    check("d router_weights", d_rw, g_ref["router_weights"][rows])
    if main_grads:
        assert d_rg is mg_gu and d_ru is mg_gu and d_rd is mg_dn and d_sog is mg_sog
        check("main_grad gate_up", mg_gu - before[0], g_ref["gate_up_proj"][loc])
        check("main_grad down", mg_dn - before[1], g_ref["down_proj"][loc])
        check("main_grad shared fc1", _sum_over_ranks(mg_sgu - before[2]), g_ref["shared_gate_up_proj"])
        check("main_grad shared fc2", _sum_over_ranks(mg_sd - before[3]), g_ref["shared_down_proj"])
        check("main_grad shared gate", _sum_over_ranks(mg_sog - before[4]), g_ref["shared_output_gate"])
    else:
        d_gu = torch.stack(list(d_rg.data if isinstance(d_rg, mf.SplitRoutedWeight) else d_rg))
        check("d routed fc1", d_gu, g_ref["gate_up_proj"][loc])
        check("d routed down", torch.stack(list(d_rd)), g_ref["down_proj"][loc])
        check("d shared fc1", _sum_over_ranks(torch.cat([d_sg, d_su])), g_ref["shared_gate_up_proj"])
        check("d shared gate", _sum_over_ranks(d_sog), g_ref["shared_output_gate"])


def case_router_weight_dtypes_may_differ_between_ranks(rank, world, seed):
    """Router weights are read as float32 on every rank (as the one-device call reads them): rank 0 passing
    float64 beside the others' float32 gives the all-float32 result, bitwise (the exchange used to carry each
    rank's own dtype, and rows of two sizes aborted the group), and its gradient in float64."""
    p = _problem(world, seed)
    mine, dy = _rank_case(p, rank)
    args = (mine.gate_up_proj, mine.down_proj)
    want = mok_inductor.moe(mine.x, mine.router_weights, mine.top_experts, *args, group=dist.group.WORLD)
    rw = (mine.router_weights.double() if rank == 0 else mine.router_weights).clone().requires_grad_(True)
    got = mok_inductor.moe(mine.x, rw, mine.top_experts, *args, group=dist.group.WORLD)
    assert torch.equal(got, want)
    got.backward(dy)
    assert rw.grad.dtype == rw.dtype and torch.isfinite(rw.grad).all()


def case_workspace_does_not_keep_its_group(rank, world, seed):
    """A cached EP workspace holds its group weakly: after destroy_process_group(group) the group is
    freed (its gloo threads with it) and the workspace says so; while the group lives, get_workspace
    returns the same workspace, and one of another group is another workspace.

    Both groups are made before either is destroyed: a gloo group connected right after another one's
    teardown can lose its handshake to the old connections' closing ("Connection closed by peer", seen
    in CI even behind a barrier). That a freed group's workspaces go with it (so no later group can be
    handed one) is test_functional's test_ep_workspace_cache_is_per_group_object."""
    import weakref

    from mok_inductor import functional as mf

    cfg = mf.MoKConfig()
    group = dist.new_group(list(range(world)))
    group2 = dist.new_group(list(range(world)))
    ws = mf.get_workspace(cfg, group, device="cpu", num_local_tokens=6, hidden_size=H, topk=2)
    assert ws.group is group and ws.ep_size == world
    assert mf.get_workspace(cfg, group, device="cpu", num_local_tokens=6, hidden_size=H, topk=2) is ws
    ws2 = mf.get_workspace(cfg, group2, device="cpu", num_local_tokens=6, hidden_size=H, topk=2)
    assert ws2 is not ws and ws2.group is group2
    te = torch.randint(0, E, (6, 2), generator=torch.Generator().manual_seed(seed + rank))
    mf.build_schedule(ws, cfg, te, num_local_experts=E // world)  # collective over the group
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert alive() is None, "a workspace kept its destroyed process group alive"
    with pytest.raises(RuntimeError, match="^workspace: its expert-parallel process group no longer exists"):
        ws.group
    # the other group's workspace still works: a schedule over it
    mf.build_schedule(ws2, cfg, te, num_local_experts=E // world)
    alive2 = weakref.ref(group2)
    dist.destroy_process_group(group2)
    del group2
    gc.collect()
    assert alive2() is None, "a workspace kept its destroyed process group alive"


def case_functional_dense(rank, world, seed):
    _functional_case(rank, world, seed, layout="dense", main_grads=False)


def case_functional_main_grads(rank, world, seed):
    _functional_case(rank, world, seed, layout="dense", main_grads=True)


def case_functional_split(rank, world, seed):
    _functional_case(rank, world, seed, layout="split", main_grads=False)


# ---------------------------------------------------------------------------------------------- Megatron


def case_megatron_ep(rank, world, seed):
    """An MCore MoELayer with expert_model_parallel_size = W on the MoK backend: the backend's
    output and gradients (to hidden states, probs, local expert and shared weights) against the
    float64 oracle over all ranks' tokens and all experts; then the whole layer (router included) runs."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import router as router_mod
    from mok_inductor.integrations import megatron as mkm
    from mok_inductor.integrations.megatron.route_adapter import routing_map_to_mok_inputs
    import test_megatron as tm
    from _helpers import destroy_model_parallel

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    original_gating = router_mod.Router.gating
    router_mod.Router.gating = lambda self, inp: F.linear(inp.float(), self.weight.float())  # as test_megatron
    try:
        torch.manual_seed(seed)
        cfg = tm.make_config(torch.float32, expert_model_parallel_size=world)
        layer = tm.build_layer(cfg)
        El = layer.num_local_experts
        assert El * world == tm.E
        for name, prm in layer.named_parameters():  # replicated parameters are equal on every rank
            if not name.startswith("experts."):
                dist.broadcast(prm.data, 0)
        mkm.enable_mok_backend(layer)
        backend = layer.megakernel_experts
        assert backend.ep_size == world and backend.ep_group is not None

        g = torch.Generator().manual_seed(seed + 1 + rank)
        x = torch.randn(tm.S, tm.B, tm.H, generator=g)
        dy = torch.randn(tm.S, tm.B, tm.H, generator=g)
        with torch.no_grad():
            probs, routing_map = layer.route(x)
        xl = x.clone().requires_grad_()
        pl = probs.detach().clone().requires_grad_()
        out = backend(xl, pl, routing_map)
        out.backward(dy)

        def gather(t):
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts)

        T = tm.S * tm.B
        xs, ps, ms, dys = (gather(t.reshape(T, -1)) for t in (x, probs.detach(), routing_map.to(torch.uint8), dy))
        experts = layer.experts.local_experts
        fc1 = gather(torch.stack([m.linear_fc1.weight.detach() for m in experts]))
        fc2 = gather(torch.stack([m.linear_fc2.weight.detach() for m in experts]))
        sh = layer.shared_experts
        rw, te = routing_map_to_mok_inputs(ps, ms.bool(), tm.K, index_dtype=torch.int64)
        case = MoeCase(xs, rw, te, fc1, fc2, sh.linear_fc1.weight.detach(), sh.linear_fc2.weight.detach(),
                       sh.gate_weight.detach(), cfg.activation_func_clamp_value)
        y_ref, g_ref = oracle_with_grads(case, dys)
        # d probs: each route's router-weight gradient lands on its expert's column (a -1 route on none)
        d_probs = torch.zeros(ps.shape, dtype=torch.float64).scatter_add_(
            1, te.clamp(min=0), torch.where(te >= 0, g_ref["router_weights"], torch.zeros((), dtype=torch.float64)))
        rows = slice(rank * T, (rank + 1) * T)
        loc = slice(rank * El, (rank + 1) * El)
        check = functools.partial(assert_close_to_oracle, dtype=torch.float32)
        check("megatron y", out.reshape(T, -1), y_ref[rows])
        check("megatron d hidden_states", xl.grad.reshape(T, -1), g_ref["x"][rows])
        check("megatron d probs", pl.grad, d_probs[rows])
        check("megatron d local fc1", torch.stack([m.linear_fc1.weight.grad for m in experts]),
              g_ref["gate_up_proj"][loc])
        check("megatron d local fc2", torch.stack([m.linear_fc2.weight.grad for m in experts]), g_ref["down_proj"][loc])
        check("megatron d shared fc1", _sum_over_ranks(sh.linear_fc1.weight.grad), g_ref["shared_gate_up_proj"])
        check("megatron d shared gate", _sum_over_ranks(sh.gate_weight.grad), g_ref["shared_output_gate"])

        # the whole layer: router -> MoK EP -> output, and its backward
        layer.zero_grad(set_to_none=True)
        xl2 = x.clone().requires_grad_()
        out2, bias = layer(xl2)
        assert bias is None
        assert torch.equal(out2, out.detach())
        out2.backward(dy)
        assert xl2.grad is not None and layer.router.weight.grad is not None
    finally:
        router_mod.Router.gating = original_gating
        destroy_model_parallel(parallel_state)


# ---------------------------------------------------------------------------------------------- transformers


def case_transformers_shard_experts(rank, world, seed):
    """A tiny Qwen2-MoE on "mok" with its experts sharded over the group (shard_experts): each rank's
    logits equal the unsharded model's (eager experts) on that rank's sequences, and the gradients,
    summed over the ranks for replicated parameters, equal the unsharded model's over all ranks'
    sequences (the local experts' slice for the sharded ones)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    from mok_inductor.integrations import transformers as hf

    hf.register()  # experts_implementation="mok" below
    cfg = Qwen2MoeConfig(hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                         vocab_size=64, shared_expert_intermediate_size=24)
    torch.manual_seed(seed)  # identical models on every rank
    ref = Qwen2MoeForCausalLM._from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    model = Qwen2MoeForCausalLM._from_config(cfg, experts_implementation="mok", dtype=torch.float32)
    model.load_state_dict(ref.state_dict())
    sharded = hf.shard_experts(model, dist.group.WORLD)
    assert len(sharded) == 2 * cfg.num_hidden_layers
    _check_sharded(model, ref, sharded, cfg.num_experts // world, cfg.vocab_size, rank, world, seed)


def case_transformers_shard_gpt_oss(rank, world, seed):
    """The same for a tiny GPT-OSS (activation "gpt_oss", biases, interleaved gate/up in its checkpoint layout):
    shard_experts keeps each rank's rows of the weights and of both biases, and the sharded model equals the
    unsharded eager one in logits and every gradient (the biases' included)."""
    from _pattern_models import VOCAB, build
    from mok_inductor.integrations import transformers as hf

    hf.register()
    ref, _ = build("gpt_oss", "eager", torch.float32, seed=seed)
    model, _ = build("gpt_oss", "mok", torch.float32, seed=seed)
    torch.manual_seed(seed)  # identical random weights (biases and router included) on every rank
    with torch.no_grad():
        for prm in ref.parameters():
            prm.normal_(0.0, 0.3)
    model.load_state_dict(ref.state_dict())
    sharded = hf.shard_experts(model, dist.group.WORLD)
    assert sorted(n.rsplit(".", 1)[1] for n in sharded) == ["down_proj", "down_proj_bias", "gate_up_proj",
                                                            "gate_up_proj_bias"], sharded
    _check_sharded(model, ref, sharded, 4 // world, VOCAB, rank, world, seed)  # (4 experts)


def _check_sharded(model, ref, sharded, El, vocab, rank, world, seed):
    """Rank `rank`'s logits and gradients of the sharded `model` against the unsharded `ref` run on every rank's
    sequences (sharded parameters: this rank's rows of ref's gradient; replicated ones: summed over the ranks)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (world, 2, 7), generator=g)  # rank r's batch: ids[r]
    proj = torch.randn(world, 2, 7, vocab, generator=g)

    def check(name, out, want):
        err, tol = rel_err(out, want), TOLERANCE[torch.float32]
        assert err <= tol, f"{name}: relative error {err:.3e} vs the unsharded model exceeds {tol:.1e}"

    logits = model(input_ids=ids[rank]).logits
    (logits * proj[rank]).sum().backward()
    logits_ref = ref(input_ids=ids.reshape(world * 2, 7)).logits
    (logits_ref * proj.reshape(world * 2, 7, vocab)).sum().backward()
    check("transformers logits", logits, logits_ref[2 * rank:2 * rank + 2])
    ref_params = dict(ref.named_parameters())
    for name, prm in model.named_parameters():
        want = ref_params[name].grad
        if name in sharded:
            check(f"d {name}", prm.grad, want[rank * El:(rank + 1) * El])
        elif want is not None and want.abs().sum() > 0:
            check(f"d {name} (summed over ranks)", _sum_over_ranks(prm.grad), want)


# ---------------------------------------------------------------------------------------------- one rank, EP code path


def case_ep_code_path_on_one_rank(rank, world, seed):
    """mok_inductor.distributed.moe on a group of ONE rank (moe(group=...) would take the one-device
    path): the plan, the exchanges (gloo on CPU, NCCL on CUDA) and the local megakernel of the EP path
    against the float64 oracle, balanced and with -1 routes; and T = 0."""
    from mok_inductor import distributed

    for j, kw in enumerate([dict(limit=1.0), dict(kind="drop", gate=False), dict(T=[0]), dict(dtype=torch.bfloat16)]):
        p = _problem(world, seed + j, **kw)
        mine, dy = _rank_case(p, 0)
        y, grads = moe_with_grads(mine.detached(device=_DEVICE), dy.to(_DEVICE),
                                  fn=functools.partial(distributed.moe, group=dist.group.WORLD))
        y_ref, g_ref = oracle_with_grads(p["case"], p["dy"])
        dt = mine.x.dtype
        assert_close_to_oracle("y", y, y_ref, dt)
        for n, g in grads.items():
            assert_close_to_oracle(f"d {n}", g, g_ref[n], dt)


SUITES = {
    "api2": [case_balanced, case_all_to_rank0, case_empty_rank, case_minus_one_routes, case_no_shared_k1, case_bf16,
             case_all_tokens_empty, case_matches_one_device_and_is_deterministic, case_errors_on_every_rank,
             case_gpt_oss, case_gpt_oss_bf16_hf_views, case_swiglu_biases_empty_rank, case_gpt_oss_shared_expert,
             case_gpt_oss_autocast, case_functional_dense, case_functional_main_grads, case_functional_split,
             case_router_weight_dtypes_may_differ_between_ranks, case_workspace_does_not_keep_its_group],
    "api4": [case_balanced_limit, case_all_to_rank0, case_empty_rank, case_minus_one_routes, case_bf16,
             case_matches_one_device_and_is_deterministic, case_errors_on_every_rank, case_gpt_oss,
             case_swiglu_biases_empty_rank, case_functional_main_grads, case_functional_split],
    "triton2": [case_gpt_oss_triton],
    "one_rank": [case_ep_code_path_on_one_rank],
    "integrations2": [case_megatron_ep, case_transformers_shard_experts, case_transformers_shard_gpt_oss],
}


def test_group_without_torch_distributed_is_a_value_error(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    c = make_case(T=4, H=8, I=4, E=2, K=2, requires_grad=False)
    with pytest.raises(ValueError, match="^group: a process group was given but torch.distributed is not initialized$"):
        mok_inductor.moe(*c.args(), group=object())


@pytest.mark.parametrize("world,suite", [(2, "api2"), (4, "api4")])
def test_expert_parallel_against_one_process(world, suite, tmp_path):
    _spawn(world, suite, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only: the gloo ranks' CPU tensors reach the "
                    "Triton kernels only under Triton's interpreter (TRITON_INTERPRET=1, set where CUDA is absent)")
def test_expert_parallel_triton_kernels_under_the_interpreter(tmp_path):
    _spawn(2, "triton2", tmp_path)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_ep_code_path_on_one_rank(device, tmp_path):
    """The EP code path on one rank: gloo on CPU, NCCL on CUDA (one GPU is enough)."""
    _spawn(1, "one_rank", tmp_path, device)


def test_megatron_backend_and_transformers_experts_over_a_group(tmp_path):
    _spawn(2, "integrations2", tmp_path)


def test_ep_benchmark_script_on_gloo(tmp_path):
    """benchmarks/bench_ep.py (the expert-parallel benchmark) on 2 gloo ranks at its tiny shape: it exits 0
    only when EP equals one rank computing every expert (forward and gradients, bf16 at 1e-2), and writes
    both contenders' times for group sizes 1 and 2."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(root, "benchmarks", "bench_ep.py"), "--tiny", "--iters", "2", "--warmup", "1",
           "--profile-iters", "1", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.load(open(tmp_path / "bench_ep.json"))
    assert res["meta"]["backend"] == "gloo" and [r["ranks"] for r in res["results"]] == [1, 2]
    two = res["results"][1]
    assert two["correct"] is True and set(two["max_rel_err"]) >= {"y", "dx", "d_router_weights", "d_gate_up",
                                                                  "d_down", "baseline_y"}
    assert max(two["max_rel_err"].values()) <= 1e-2
    for r in res["results"]:
        for c in ("mok", "baseline"):
            assert r[c]["fwd_ms"] > 0 and r[c]["fwd_bwd_ms"] > 0 and 0 <= r[c]["comm_share"]
