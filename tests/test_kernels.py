"""The Triton kernels (mok_inductor.kernels) against the reference and the float64 oracle.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
shapes are tiny; on CUDA the same tests run at the tiny shapes and a few at real sizes. Each shape's
comment names its edge case.

Shape legend: T tokens, H hidden, I intermediate, Is shared intermediate, E experts, K routes per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib

import pytest
import torch
import triton
import triton.language as tl

from _helpers import (DEV, TOLERANCE, assert_same_arithmetic, check_against_oracle, make_case, oracle_with_grads,
                      random_like, record_launches, rel_err)

import mok_inductor
from mok_inductor import kernels, ops, reference
from mok_inductor.kernels.common import swizzle
from mok_inductor.ops import split_gate_up
from mok_inductor.types import GradBuffers, Operand, RoutedOperands

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="needs CUDA or TRITON_INTERPRET=1")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def knobs():
    """knobs(**changes): `mok_inductor.options.override(**changes)` from the call until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(mok_inductor.options.override(**changes))


def _args(case):
    wg, wu = split_gate_up(case.gate_up_proj)
    sg = su = None
    if case.shared_gate_up_proj is not None:
        sg, su = split_gate_up(case.shared_gate_up_proj)
    return wg, wu, case.down_proj, sg, su, case.shared_down_proj, case.shared_output_gate


def _forward(backend, case, schedule, weights=None):
    """The forward through the one entry (`mok_inductor.ops.forward`) on `backend` ("triton": the kernels,
    "reference"); `weights`: routed (gate, up, down) in place of the case's (e.g. split per expert)."""
    wg, wu, wd, sg, su, sd, sog = _args(case)
    operands = RoutedOperands.of_weights(*(weights or (wg, wu, wd)))
    with mok_inductor.options.override(backend=backend):
        return ops.forward(case.x, case.router_weights, case.top_experts, schedule, operands, sg, su, sd, sog,
                           case.swiglu_limit)


def _backward(backend, case, schedule, fwd, dy, grads=None, accumulate=False, weights=None):
    """The backward through `mok_inductor.ops.backward` on `backend`, like `_forward`; `grads` None: fresh
    buffers in x.dtype."""
    wg, wu, wd, sg, su, sd, sog = _args(case)
    operands = RoutedOperands.of_weights(*(weights or (wg, wu, wd)))
    with mok_inductor.options.override(backend=backend):
        return ops.backward(dy, case.x, case.router_weights, case.top_experts, schedule, operands, fwd.gu_N2I, sg,
                            su, sd, sog, fwd.gu_shared_T2Is, case.swiglu_limit, grads=grads, accumulate=accumulate)


def _grads_by_name(case, bwd):
    g = bwd.grads
    out = {"x": bwd.dx_TH, "router_weights": bwd.d_router_weights_TK,
           "gate_up_proj": torch.cat([g.d_gate, g.d_up], dim=1), "down_proj": g.d_down}
    if case.shared_gate_up_proj is not None:
        out["shared_gate_up_proj"] = torch.cat([g.d_s_gate, g.d_s_up], dim=0)
        out["shared_down_proj"] = g.d_s_down
    if case.shared_output_gate is not None:
        out["shared_output_gate"] = g.d_s_out_gate
    return out


def _poisoned_grads(case, dtype=None):
    """Gradient destinations filled with NaN (every element must be written)."""
    wg, wu, wd, sg, su, sd, sog = _args(case)
    nan = lambda w: None if w is None else torch.full(w.shape, float("nan"), dtype=dtype or w.dtype, device=w.device)
    return GradBuffers(nan(wg), nan(wu), nan(wd), nan(sg), nan(su), nan(sd), nan(sog))


def _check_all(case, *, factor=2.0, seed=7, oracle_device="cpu"):
    """Kernels vs the float64 oracle: at the contract's tolerance, and within `factor` x the reference's own error
    (+ a small floor) for every output and gradient. Destinations are poisoned with NaN first."""
    dtype = case.x.dtype
    E = case.gate_up_proj.shape[0]
    sched = kernels.build_schedule(case.top_experts, E)
    ref_sched = reference.build_schedule(case.top_experts.cpu(), E)
    for a, b in zip(sched, ref_sched):
        assert torch.equal(a.cpu(), b)
    dy = random_like(case.x, seed)
    fwd = _forward("triton", case, sched)
    bwd = _backward("triton", case, sched, fwd, dy, grads=_poisoned_grads(case))
    ref_fwd = _forward("reference", case, sched)
    ref_bwd = _backward("reference", case, sched, ref_fwd, dy)
    y64, g64 = oracle_with_grads(case, dy, oracle_device)
    tol = TOLERANCE[dtype]
    floor = tol / 10

    def check(name, out, ref, exact):
        assert out.dtype == ref.dtype and out.shape == ref.shape, (name, out.dtype, ref.dtype, out.shape)
        err, ref_err = rel_err(out, exact), rel_err(ref, exact)
        assert err <= tol, f"{name}: error {err:.2e} vs float64 over the contract's {tol:.0e}"
        assert err <= factor * ref_err + floor, f"{name}: error {err:.2e} vs the reference's {ref_err:.2e}"

    check("y", fwd.y_TH, ref_fwd.y_TH, y64)
    # the saved gate/up pre-activations [g | u]: shapes and dtype as the reference's, close to them, and the
    # rows of the `-1` routes' slots (past offsets[E]) exactly zero
    for name, ours_gu, ref_gu in (("gu", fwd.gu_N2I, ref_fwd.gu_N2I), ("gu_shared", fwd.gu_shared_T2Is,
                                                                       ref_fwd.gu_shared_T2Is)):
        assert ours_gu.dtype == ref_gu.dtype and ours_gu.shape == ref_gu.shape, (name, ours_gu.shape, ref_gu.shape)
        assert not torch.isnan(ours_gu).any(), name
        if ref_gu.numel():
            assert rel_err(ours_gu, ref_gu.to(ours_gu.device)) <= 5 * tol, name
    n_valid = int(sched.expert_offsets_E1[-1])
    assert torch.count_nonzero(fwd.gu_N2I[n_valid:]) == 0
    ours, refs = _grads_by_name(case, bwd), _grads_by_name(case, ref_bwd)
    for n, g in g64.items():
        check(f"d_{n}", ours[n], refs[n].to(ours[n].dtype), g)
    return fwd, bwd


# ---------------------------------------------------------------------------------------------
# Schedule


@pytest.mark.parametrize("T,K,E,kind", [
    (37, 3, 5, "repeat"),  # -1 routes and repeated experts; T not a multiple of any chunk
    (1, 1, 1, "random"),  # T = 1, K = E = 1
    (16, 4, 4, "random"),  # K = E
    (20, 2, 7, "one"),  # one hot expert, all others empty
    (9, 3, 6, "none"),  # all routes -1
    (300, 8, 130, "repeat"),  # several chunks, E + 1 above a power of two
])
@pytest.mark.parametrize("fused", [True, False])
def test_schedule_bit_exact(monkeypatch, T, K, E, kind, fused):
    # fused: two launches (the scatter sums the counts itself: every case here is small enough); else three
    from mok_inductor.kernels import schedule

    launched = record_launches(monkeypatch)
    gen = torch.Generator().manual_seed(T * 31 + E)
    from _helpers import routing

    for index_dtype in (torch.int64, torch.int32):
        te = routing(T, K, E, kind, generator=gen, index_dtype=index_dtype).to(DEV)
        launched.clear()
        got = schedule.build_schedule(te, E, **({} if fused else {"fused_prefix_max_tile": 0}))
        assert (schedule._schedule_prefix_kernel in launched) != fused and len(launched) == (2 if fused else 3)
        want = reference.build_schedule(te.cpu(), E)
        for name, a, b in zip(("sorted_routes", "expert_offsets", "route_slots"), got, want):
            assert a.dtype == torch.int32 and a.device == te.device, name
            assert torch.equal(a.cpu(), b), name


def test_schedule_empty_tokens():
    te = torch.empty(0, 2, dtype=torch.int64, device=DEV)
    got = kernels.build_schedule(te, 3)
    assert got.sorted_routes_N.numel() == 0 and got.route_slots_N.numel() == 0
    assert torch.equal(got.expert_offsets_E1.cpu(), torch.zeros(4, dtype=torch.int32))


def test_schedule_rejects_bad_ids():
    """Ids outside [-1, E) are rejected: under the interpreter (CPU) at once, with the CPU path's ValueError and the
    value; on CUDA by a device-side assert, which poisons the CUDA context, so that case runs in its own process."""
    if DEV == "cpu":
        with pytest.raises(ValueError, match=r"\[-1, 3\) \(-1 means no route\), found -2$"):
            kernels.build_schedule(torch.tensor([[0, -2]]), 3)
        # two launches (the scatter folds the chunks' counts of bad ids): 128 routes a chunk, the bad id in the
        # second of 3 (2 filled, 1 empty)
        g = torch.Generator().manual_seed(5)
        te = torch.randint(-1, 120, (96, 2), generator=g)
        kernels.build_schedule(te, 120)
        te[70, 0] = 120
        with pytest.raises(ValueError, match=r"found 120$"):
            kernels.build_schedule(te, 120)
        # E = 255: 64 routes per chunk, 71 chunks, more than the 64 the prefix kernel folds per step; the bad
        # id sits in the last filled chunk, the rest pass
        g = torch.Generator().manual_seed(7)
        te = torch.randint(-1, 255, (2240, 2), generator=g)
        kernels.build_schedule(te, 255)
        te[-1, 1] = 255
        with pytest.raises(ValueError, match=r"found 255$"):
            kernels.build_schedule(te, 255)
        return
    import subprocess
    import sys

    code = ("import torch; from mok_inductor import kernels; "
            "kernels.build_schedule(torch.tensor([[0, 5]], device='cuda'), 3); torch.cuda.synchronize()")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode != 0, proc.stdout


_CLOSURE_PROBE = """
import builtins, dis, importlib.util, os, sys, tempfile
import triton
from mok_inductor import kernels
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as closure

problems, checked, seen = [], 0, set()
for module in kernels.MODULES:
    for name, obj in vars(module).items():
        fn = obj  # the launched kernels: *_kernel, and the tuned families' jitted functions
        while not isinstance(fn, triton.runtime.jit.JITFunction) and hasattr(fn, "fn"):
            fn = fn.fn
        if not ((name.endswith("_kernel") or isinstance(obj, kernels.configs.Family))
                and isinstance(fn, triton.runtime.jit.JITFunction)) or fn in seen:
            continue
        seen.add(fn)
        name = fn.__name__
        checked += 1
        path = os.path.join(tempfile.mkdtemp(), name + ".py")
        with open(path, "w") as f:
            f.write("import triton\\nimport triton.language as tl\\n" + closure(fn))
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        ns = vars(mod)
        for v in list(ns.values()):
            f = getattr(v, "fn", None)
            if getattr(f, "__globals__", None) is not ns:
                continue
            for ins in dis.Bytecode(f):
                if ins.opname == "LOAD_GLOBAL" and ins.argval not in ns and not hasattr(builtins, ins.argval):
                    problems.append(f"{name}: {f.__name__} loads {ins.argval}")
print(checked, problems)
body_names = {f.__name__ for f in seen}
sys.exit(1 if problems or not {"_bwd_act_body", "_wgrad_body", "_gate_up_kernel"} <= body_names else 0)
"""


def test_inductor_closure_of_every_kernel_defines_its_globals():
    """Inductor writes each user kernel into its generated code with the kernel's transitive closure (the jit and
    constexpr functions it calls, and their int/constexpr globals), not the kernel's module: a global the closure
    leaves out (an enum class, say) is a NameError in every compiled graph on CUDA, which no interpreter test
    sees. Built outside the interpreter (a subprocess), where the kernels are real JITFunctions."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _CLOSURE_PROBE], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# Forward and backward against the oracle


CASES = [
    # name, make_case kwargs
    ("basic_fp32", dict(T=13, H=40, I=24, E=5, K=2, dtype=torch.float32)),  # odd H, T not a tile multiple
    ("shared_gate_limit_bf16", dict(T=11, H=32, I=16, E=3, K=3, dtype=torch.bfloat16, shared=True, gate=True,
                                    limit=0.6, drop=0.3)),  # -1 routes, clamp clips, Is != I
    ("one_hot_expert_bf16", dict(T=17, H=32, I=16, E=4, K=2, dtype=torch.bfloat16, kind="repeat")),
    ("empty_experts_fp32", dict(T=10, H=16, I=16, E=5, K=2, dtype=torch.float32, kind="low_half")),
    ("t1_k_eq_e_fp32", dict(T=1, H=16, I=16, E=2, K=2, dtype=torch.float32)),  # T = 1, K = E
    ("all_dropped_bf16", dict(T=5, H=16, I=16, E=3, K=2, dtype=torch.bfloat16, kind="none", shared=True)),
]


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_forward_backward_vs_oracle(name, kw):
    # (a seed of the name's crc32: hash() of a str changes per process, so a failure would not reproduce)
    case = make_case(**kw, device=DEV, requires_grad=False, seed=zlib.crc32(name.encode()) % 1000)
    _check_all(case)


@pytest.mark.parametrize("name", ["basic_fp32", "shared_gate_limit_bf16", "empty_experts_fp32", "all_dropped_bf16"])
def test_two_pass_bwd_act_vs_oracle(name, monkeypatch):
    # the two-pass bwd_act (GEMM to float32, then the SwiGLU backward), forced at every size
    kw = dict(CASES)[name]
    case = make_case(**kw, device=DEV, requires_grad=False, seed=len(name) + 1)
    with mok_inductor.options.override(two_pass_min_rows=0):
        _check_all(case)


@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("H,I,aligned", [(80, 80, True), (36, 42, False)])
def test_tma_loads_equal_pointer_loads(H, I, aligned, two_pass, monkeypatch):
    # the TMA descriptor loads (options.tma: weights of gate/up, bwd_act, down and dx; the sorted A rows of
    # gate/up (x gathered once), down and dx) against pointer loads only: bitwise the same forward and backward,
    # the shared expert (one [1, n, k] group) and `-1` routes included; H = 80, I = 80 give whole K steps and a
    # tail both under the interpreter (BLOCK_K 32) and on CUDA (64, the default tiles); H = 36, I = 42 (72-, 84-,
    # 168-byte bf16 rows, not 16-byte aligned) must fall back to pointer loads in every launch, equally right

    # (tma_min_rows 0: tiny shapes; the size rule has its own test)
    knobs = dict(two_pass_min_rows=0 if two_pass else 1 << 30, tma_min_rows=0)
    case = make_case(T=19, H=H, I=I, E=4, K=2, dtype=torch.bfloat16, shared=True, gate=True, limit=0.6, drop=0.2,
                     Is=I + 4 if aligned else I, device=DEV, requires_grad=False, seed=H + two_pass)
    sched = kernels.build_schedule(case.top_experts, case.gate_up_proj.shape[0])
    dy = random_like(case.x, seed=3)
    tma_flags, real_launch = [], kernels.common.launch

    def spy(k, *a, **kw):
        if "TMA" in kw:
            tma_flags.append((k, kw["TMA"]))
        if kw.get("SORTED_X"):
            tma_flags.append(("sorted x", True))
        return real_launch(k, *a, **kw)

    monkeypatch.setattr(kernels.common, "launch", spy)
    runs = {}
    for tma in (True, False):
        tma_flags.clear()
        with mok_inductor.options.override(tma=tma, **knobs):
            fwd = _forward("triton", case, sched)
            bwd = _backward("triton", case, sched, fwd, dy)
        runs[tma] = (fwd.y_TH, *_grads_by_name(case, bwd).values())
        used = {k for k, on in tma_flags if on}
        if tma and aligned:  # every GEMM but the weight gradients; gate/up's x rows gathered once, then by TMA
            assert {kernels.gate_up.GATE_UP, kernels.grouped_gemm.GROUPED_ROWS, "sorted x"} <= used
            assert used & {kernels.bwd_act.BWD_ACT, kernels.bwd_act.BWD_GEMM}
        else:
            assert not used
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a, b)
    with mok_inductor.options.override(**knobs):
        _check_all(case)


def test_tma_only_with_many_rows_per_expert(monkeypatch):
    # descriptors at training sizes only (options.tma_min_rows rows per expert on average): at decode their
    # per-launch host cost and the TMA loads of a few rows measured slower; here 2 rows per expert get
    # pointer loads, and with the bound lowered to 2 the same launches get descriptors

    case = make_case(T=8, H=64, I=64, E=8, K=2, dtype=torch.bfloat16, device=DEV, requires_grad=False, seed=5)
    sched = kernels.build_schedule(case.top_experts, 8)
    flags, real_launch = [], kernels.common.launch
    monkeypatch.setattr(kernels.common, "launch", lambda k, *a, **kw: flags.append(kw.get("TMA")) or real_launch(k, *a, **kw))
    y = _forward("triton", case, sched).y_TH
    assert flags.count(True) == 0 and flags.count(False) == 2  # gate/up, down
    flags.clear()
    with mok_inductor.options.override(tma_min_rows=2):
        assert torch.equal(_forward("triton", case, sched).y_TH, y)
    assert flags.count(True) == 2


def _force_stage(monkeypatch, family, way):
    """`family`'s stage runs `way` wherever it may (the interpreter reads no tables: its pick is the fused way)."""
    real_pick = kernels.configs.pick
    tile = next(t for t in family.candidates if t.name == way)
    monkeypatch.setattr(kernels.configs, "pick", lambda fam, *a: tile if fam is family else real_pick(fam, *a))


def test_gate_up_stage_by_grouped_mm_vs_oracle(monkeypatch):
    # the gate/up stage as torch._grouped_mm over the sorted rows and the activation pass, where a table picks it:
    # forward and backward against the oracle, the `-1` routes' saved rows zero (the GEMM leaves them unwritten);
    # bitwise the fused kernel's g, u, h and y on CPU (the same float32 sums, rounded once; h rounded to nearest),
    # the SwiGLU and GPT-OSS's activation (its alpha and beta), the transposed weight layout too; the shared
    # expert keeps the fused kernel
    from mok_inductor.types import ACTIVATIONS

    stage = kernels.gate_up.GATE_UP_STAGE
    ran, real = [], kernels.gate_up._gate_up_grouped_mm

    def spy(*a):
        ran.append(a[0].shape[0])
        return real(*a)

    monkeypatch.setattr(kernels.gate_up, "_gate_up_grouped_mm", spy)
    case = make_case(T=19, H=32, I=24, E=4, K=2, dtype=torch.bfloat16, shared=True, gate=True, drop=0.2, device=DEV,
                     requires_grad=False, seed=41)
    sched = kernels.build_schedule(case.top_experts, 4)
    wg, wu, wd, sg, su, sd, sog = _args(case)
    w_t = case.gate_up_proj.transpose(1, 2).contiguous().transpose(1, 2)  # [E, H, 2I] stored

    def one_way(way, act, weights):  # -> the saved gu, the routed h, y
        h_seen, real_rows = [], kernels.grouped_gemm.grouped_rows

        def rows_gemm(h, *a, **kw):  # (its first call: the routed experts' down GEMM, whose A is h)
            h_seen.append(h.clone())
            return real_rows(h, *a, **kw)

        with monkeypatch.context() as m:
            _force_stage(m, stage, way)
            m.setattr(kernels.grouped_gemm, "grouped_rows", rows_gemm)
            with mok_inductor.options.override(backend="triton"):
                fwd = ops.forward(case.x, case.router_weights, case.top_experts, sched,
                                  RoutedOperands.of_weights(*weights), sg, su, sd, sog, None, act)
        return fwd.gu_N2I, h_seen[0], fwd.y_TH

    for act in (ACTIVATIONS["swiglu"], ACTIVATIONS["gpt_oss"]):
        for weights in ((wg, wu, wd), (w_t[:, :24], w_t[:, 24:], wd)):
            ran.clear()
            fused, by_gmm = one_way("fused", act, weights), one_way("grouped_mm", act, weights)
            assert ran == [19]  # the routed experts, not the shared one
            for a, b in zip(fused, by_gmm):
                assert torch.equal(a, b)
            n_valid = int(sched.expert_offsets_E1[-1])
            assert 0 < n_valid < 38 and torch.count_nonzero(by_gmm[0][n_valid:]) == 0
            assert torch.count_nonzero(by_gmm[1][n_valid:]) == 0 and torch.count_nonzero(by_gmm[1][:n_valid]) > 0
    _force_stage(monkeypatch, stage, "grouped_mm")
    ran.clear()
    _check_all(case)
    assert ran


def test_gate_up_stage_keeps_the_fused_kernel_where_grouped_mm_would_differ(monkeypatch):
    # the conditions under which torch._grouped_mm computes what the fused kernel does, each broken alone
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from mok_inductor import mxfp8

    G = kernels.gate_up
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(4, 64, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(10, 32, generator=gen).to(torch.bfloat16)
    h = torch.empty(10, 32, dtype=torch.bfloat16)
    bf = torch.bfloat16

    def halves(t):
        return Operand(t[:, :32], None), Operand(t[:, 32:], None)

    assert G._same_by_grouped_mm(x, 10, bf, h, False, None, None) and G._grouped_mm_weight(x, *halves(w)) is not None
    call_breaks = [dict(single=True), dict(limit=0.5), dict(bias=torch.zeros(4, 2, 32)), dict(h=None),
                   dict(gu_dtype=torch.float32), dict(x=x.float()), dict(h=h.float()), dict(h=h.t().contiguous().t()),
                   dict(rows=ShapeEnv().create_unbacked_symint())]
    for kw in call_breaks:
        args = {**dict(x=x, rows=10, gu_dtype=bf, h=h, single=False, limit=None, bias=None), **kw}
        assert not G._same_by_grouped_mm(args["x"], args["rows"], args["gu_dtype"], args["h"], args["single"],
                                         args["limit"], args["bias"]), kw
    monkeypatch.setattr(kernels.common, "traced", lambda args: True)
    assert not G._same_by_grouped_mm(x, 10, bf, h, False, None, None)  # a traced call
    monkeypatch.undo()
    odd = torch.empty(w.numel() + 1, dtype=bf)[1:].view(w.shape)
    odd.copy_(w)
    interleaved = w.view(4, 32, 2, 32)
    q = mxfp8.quantize(w)
    weight_breaks = {
        "separate tensors": (Operand(w[:, :32].clone(), None), Operand(w[:, 32:].clone(), None)),
        "float16": halves(w.half()),
        "misaligned address": halves(odd),
        "H not a multiple of 8": halves(torch.randn(4, 64, 36).to(bf)),
        "interleaved gate/up (GPT-OSS's layout)": (Operand(interleaved[:, :, 0], None),
                                                   Operand(interleaved[:, :, 1], None)),
        "MXFP8": (Operand(q.data[:, :32], q.scale[:, :32]), Operand(q.data[:, 32:], q.scale[:, 32:])),
    }
    for name, (g, u) in weight_breaks.items():
        assert G._grouped_mm_weight(x, g, u) is None, name


@pytest.mark.parametrize("limit", [None, 0.5])
def test_two_pass_bwd_act_equals_fused(limit, monkeypatch):
    # the two-pass variant against the fused kernel, same roundings: dg, du and scale * h bitwise equal; d scale
    # summed in another fixed order
    case = make_case(T=21, H=32, I=44, E=3, K=2, dtype=torch.bfloat16, limit=limit, drop=0.2, device=DEV,
                     requires_grad=False, seed=5)
    E = case.gate_up_proj.shape[0]
    sched = kernels.build_schedule(case.top_experts, E)
    fwd = _forward("triton", case, sched)
    dy = random_like(case.x, 11)
    rw = case.router_weights.float().reshape(-1)
    down_t = kernels.plain_t(case.down_proj)

    launched = record_launches(monkeypatch)
    outs = [kernels.bwd_act.bwd_act(dy, down_t, fwd.gu_N2I, rw, sched.sorted_routes_N, sched.expert_offsets_E1, 2,
                                    limit, two_pass=two) for two in (False, True)]
    assert launched[0] is kernels.bwd_act.BWD_ACT and launched[1] is kernels.bwd_act.BWD_GEMM
    n_valid = int(sched.expert_offsets_E1[-1])
    (dgu0, ds0, hs0), (dgu1, ds1, hs1) = outs
    assert torch.equal(dgu0[:n_valid], dgu1[:n_valid]) and torch.equal(hs0[:n_valid], hs1[:n_valid])
    assert rel_err(ds1, ds0) <= 1e-5
    dropped = (case.top_experts.reshape(-1) < 0).cpu()
    assert dropped.any() and torch.count_nonzero(ds1.cpu()[dropped]) == 0


@pytest.mark.parametrize("kinds", [("tensor", "tensor"), ("list", "list"), ("tensor", "list"), ("none", "list"),
                                   ("tensor", "none"), ("tensor", "bf16"), ("bf16list", "bf16list")])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("I", [16, 12])
def test_wgrad_into_destination_kinds(kinds, accumulate, I, monkeypatch):
    # dst (+)= A_e^T @ x[tok] per expert, for each kind of destination pair (3-D, per-expert list, bf16, a
    # bf16 per-expert list, not wanted). Two destinations of one kind and dtype are one GEMM over both halves
    # of A: at I = 12 a row tile straddles the halves. Several row steps per expert (the gather index is
    # loaded one step ahead).

    real_wgrad = kernels.wgrad.wgrad
    T, H, E, K = 41, 24, 3, 2
    gen = torch.Generator().manual_seed(1)
    te = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(DEV)
    sched = kernels.build_schedule(te, E)
    x = torch.randn(T, H, generator=gen).to(DEV)
    dgu = torch.randn(T * K, 2 * I, generator=gen).to(DEV)
    starts = [torch.randn(E, I, H, generator=gen).to(DEV) for _ in range(2)]
    routes = sched.sorted_routes_N.cpu()
    offs = sched.expert_offsets_E1.cpu()

    def want(j):
        out = starts[j].double().cpu().clone() if accumulate else torch.zeros(E, I, H, dtype=torch.float64)
        a = dgu[:, j * I:(j + 1) * I].double().cpu()
        for e in range(E):
            rows = torch.arange(int(offs[e]), int(offs[e + 1]))
            out[e] += a[rows].T @ x.double().cpu()[routes[rows] // K]
        return out

    dsts = []
    for j, kind in enumerate(kinds):
        start = starts[j].clone()
        dsts.append(None if kind == "none" else start if kind == "tensor" else start.bfloat16() if kind == "bf16"
                    else list(start.bfloat16()) if kind == "bf16list" else list(start))
    launches = []
    monkeypatch.setattr(kernels.wgrad, "wgrad", lambda *a, **kw: launches.append(kw) or real_wgrad(*a, **kw))
    kernels.wgrad.wgrad_into(tuple(dsts), dgu, x, sched.sorted_routes_N, sched.expert_offsets_E1, K,
                       a_gather=False, b_gather=True, accumulate=accumulate)
    for j, d in enumerate(dsts):
        if d is not None:
            got = d if isinstance(d, torch.Tensor) else torch.stack(d)
            assert rel_err(got, want(j)) <= TOLERANCE[torch.bfloat16 if "bf16" in kinds[j] else torch.float32]
    one_gemm = kinds in (("tensor", "tensor"), ("list", "list"), ("bf16list", "bf16list"))
    n_launches = 1 if one_gemm or "none" in kinds else 2
    assert [kw["dst2_EMN"] is not None for kw in launches] == [one_gemm] * n_launches


def test_wgrad_int64_offsets_equal_int32(monkeypatch):
    # OFF32 (int32 element offsets, chosen when every operand offset fits) against the int64 path, which the
    # small shapes here would not take by themselves: bitwise equal, both gather sides

    T, H, I, E, K = 37, 24, 12, 3, 2
    gen = torch.Generator().manual_seed(4)
    te = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(DEV)
    sched = kernels.build_schedule(te, E)
    x = torch.randn(T, H, generator=gen).to(DEV)
    dgu = torch.randn(T * K, 2 * I, generator=gen).to(DEV)
    outs = []
    for big in (False, True):
        if big:
            monkeypatch.setattr(kernels.wgrad, "_span", lambda t: 2 ** 31)
        d_g, d_u = torch.full((E, I, H), float("nan"), device=DEV), torch.full((E, I, H), float("nan"), device=DEV)
        d_d = torch.full((E, H, I), float("nan"), device=DEV)
        kw = dict(routes_N=sched.sorted_routes_N, offsets_E1=sched.expert_offsets_E1, topk=K)
        kernels.wgrad.wgrad(dgu, x, d_g, a_gather=False, b_gather=True, dst2_EMN=d_u, **kw)
        kernels.wgrad.wgrad(x, dgu[:, :I], d_d, a_gather=True, b_gather=False, **kw)
        outs.append((d_g, d_u, d_d))
    for a, b in zip(*outs):
        assert not a.isnan().any() and torch.equal(a, b)


def test_one_expert_gets_everything_bf16():
    # every route to expert E-1: one hot expert, the others empty (their weight grads must be zero)
    case = make_case(T=19, H=32, I=16, E=3, K=1, dtype=torch.bfloat16, kind="one", device=DEV, requires_grad=False)
    _, bwd = _check_all(case)
    assert torch.count_nonzero(bwd.grads.d_down[:2]) == 0 and torch.count_nonzero(bwd.grads.d_gate[:2]) == 0


@pytest.mark.parametrize("buf_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_into_main_grads(buf_dtype):
    # Megatron main_grad fusion: weight gradients are ADDED into float32 / bfloat16 buffers
    case = make_case(T=9, H=16, I=16, E=3, K=2, dtype=torch.bfloat16, shared=True, gate=True, device=DEV,
                     requires_grad=False)
    E = case.gate_up_proj.shape[0]
    sched = kernels.build_schedule(case.top_experts, E)
    dy = random_like(case.x, 3)
    fwd = _forward("triton", case, sched)
    base = _poisoned_grads(case, buf_dtype)
    base = GradBuffers(*(None if b is None else random_like(b, i) for i, b in enumerate(base)))
    if base.d_s_out_gate is not None:
        base = base._replace(d_s_out_gate=base.d_s_out_gate.float())
    start = GradBuffers(*(None if b is None else b.clone() for b in base))
    out = _backward("triton", case, sched, fwd, dy, grads=base, accumulate=True)
    fresh = _backward("reference", case, sched, _forward("reference", case, sched), dy)
    tol = TOLERANCE[torch.bfloat16]
    for name, got, b0, g in zip(out.grads._fields, out.grads, start, fresh.grads):
        if got is None:
            continue
        assert got.dtype == b0.dtype
        want = b0.double() + g.double()
        assert rel_err(got, want) <= tol, name
    assert out.grads.d_down is base.d_down  # written in place


def _split(w, contiguous=True):
    """A 3-D weight as E separate 2-D allocations (fresh storage each, as Megatron's per-expert params)."""
    return [t.clone() if contiguous else t.t().contiguous().t() for t in w.unbind(0)]


@pytest.mark.parametrize("name", ["basic_fp32", "shared_gate_limit_bf16", "empty_experts_fp32", "all_dropped_bf16"])
@pytest.mark.parametrize("combined", [False, True])
def test_split_per_expert_weights_read_in_place(name, combined, monkeypatch):
    # split per-expert weights (sequences of E 2-D tensors; combined: each expert's [2I, H] FC1 with gate and
    # up as row views of it) run on the kernels through address tables: bitwise the 3-D weights' outputs and
    # gradients (the same tiles in the same order), written into per-expert gradient lists (poisoned first);
    # nothing falls back to the reference or stacks the weights

    case = make_case(**dict(CASES)[name], device=DEV, requires_grad=False, seed=11 + combined)
    wg, wu, wd, sg, su, sd, sog = _args(case)
    E, I = wg.shape[0], wg.shape[1]
    if combined:
        fc1 = _split(case.gate_up_proj)
        lg, lu = [t[:I] for t in fc1], [t[I:] for t in fc1]
    else:
        lg, lu = _split(wg), _split(wu)
    ld = _split(wd)
    monkeypatch.setattr(reference, "moe_forward", None)  # the reference must not run
    monkeypatch.setattr(reference, "moe_backward", None)
    monkeypatch.setattr(torch, "stack", None)  # nor a copy of the weights
    tables, real_table = [], kernels.operands.address_table
    monkeypatch.setattr(kernels.operands, "address_table", lambda p, d: tables.append(p) or real_table(p, d))
    sched = kernels.build_schedule(case.top_experts, E)
    dy = random_like(case.x, 5)
    fwd3 = _forward("triton", case, sched)
    fwdl = _forward("triton", case, sched, weights=(lg, lu, ld))
    assert {tuple(t.data_ptr() for t in w) for w in (lg, lu, ld)} <= set(tables)
    for a, b in zip(fwdl, fwd3):
        assert torch.equal(a, b)
    g3 = _poisoned_grads(case)
    gl = _poisoned_grads(case)  # the routed destinations as per-expert lists
    gl = gl._replace(**{f: [t.clone() for t in getattr(gl, f)] for f in ("d_gate", "d_up", "d_down")})
    b3 = _backward("triton", case, sched, fwd3, dy, grads=g3)
    bl = _backward("triton", case, sched, fwdl, dy, grads=gl, weights=(lg, lu, ld))
    assert torch.equal(bl.dx_TH, b3.dx_TH) and torch.equal(bl.d_router_weights_TK, b3.d_router_weights_TK)
    for got, want in zip(bl.grads, b3.grads):
        if want is not None:
            assert torch.equal(torch.cat([t[None] for t in got]) if isinstance(got, list) else got, want)
    monkeypatch.undo()
    _check_all(case)  # (the 3-D path itself against the oracle)


def test_split_weights_of_mixed_strides_are_stacked(monkeypatch):
    # experts that differ in strides cannot share one table: they are stacked (one copy), same results
    from mok_inductor.kernels.operands import ExpertTable

    case = make_case(T=9, H=32, I=16, E=3, K=2, dtype=torch.float32, device=DEV, requires_grad=False, seed=3)
    wg, wu, wd, *_ = _args(case)
    mixed = _split(wd)
    mixed[1] = _split(wd[1:2], contiguous=False)[0]  # column-major
    assert ExpertTable.of(mixed) is None and ExpertTable.of(_split(wd)) is not None
    assert ExpertTable.of([wd[0], wd[1][:, :8]]) is None  # shapes differ
    sched = kernels.build_schedule(case.top_experts, 3)
    y3 = _forward("triton", case, sched).y_TH
    stacked, real_stack = [], torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacked.append(len(ts)) or real_stack(ts, *a, **k))
    yl = _forward("triton", case, sched, weights=(_split(wg), _split(wu), mixed)).y_TH
    assert stacked == [3]  # the down weight only; gate and up through tables
    assert torch.equal(yl, y3)


@pytest.mark.parametrize("dequantize", [False, True])
def test_split_mxfp8_weights_through_tables(dequantize, monkeypatch, knobs):
    # split MXFP8 data and scales (kernels.forward/backward's operands) through address tables: bitwise the
    # 3-D operands' forward and backward; dequantize: the large-rows path, whose transient 3-D copy is read
    # through a table computed on the device, so repeated calls add nothing to the table cache
    from mok_inductor import mxfp8

    if dequantize:
        knobs(mx_dequantize_min_rows=0)
    case = make_case(T=12, H=64, I=32, E=3, K=2, dtype=torch.bfloat16, device=DEV, requires_grad=False, seed=5)
    qg, qd = mxfp8.quantize(case.gate_up_proj), mxfp8.quantize(case.down_proj)
    ops3 = mxfp8.routed_operands(tuple(qg[:4]), tuple(qd[:4]))
    split = lambda p: None if p is None else [t.clone() for t in p.unbind(0)]  # noqa: E731
    opsl = mxfp8.routed_operands(tuple(split(p) for p in qg[:4]), tuple(split(p) for p in qd[:4]))
    plain_down = [t.clone() for t in case.down_proj.unbind(0)]
    sched = kernels.build_schedule(case.top_experts, 3)
    args = (case.x, case.router_weights, case.top_experts, sched)
    f3, fl = kernels.forward(*args, ops3), kernels.forward(*args, opsl)
    assert torch.equal(f3.y_TH, fl.y_TH) and torch.equal(f3.gu_N2I, fl.gu_N2I)
    dy = random_like(case.x, 3)

    def grads():
        return GradBuffers(*(torch.zeros(3, *s_, dtype=torch.bfloat16, device=DEV)
                                       for s_ in ((32, 64), (32, 64), (64, 32))))

    b3 = kernels.backward(dy, *args[:3], sched, ops3, f3.gu_N2I, grads=grads())
    bl = kernels.backward(dy, *args[:3], sched, opsl, fl.gu_N2I, grads=grads())
    assert torch.equal(b3.dx_TH, bl.dx_TH) and torch.equal(b3.d_router_weights_TK, bl.d_router_weights_TK)
    mixed = opsl._replace(down=Operand(tuple(plain_down), None))  # MXFP8 gate/up, a plain split down
    kernels.forward(*args, mixed)
    n = len(kernels.operands._TABLES)
    for _ in range(3):
        kernels.forward(*args, mixed)
    assert len(kernels.operands._TABLES) == n


@pytest.mark.parametrize("misaligned", [False, True])
def test_address_tables(misaligned, monkeypatch):
    # the same weights (also their transposed views, which the backward reads) reuse one device table; a 3-D
    # weight's table is computed on the device (not cached); the kernels are told the addresses are 16-byte
    # aligned only when every one is (W_TABLE 2, else 1), with the same results either way
    from mok_inductor.kernels.operands import ExpertTable

    ws = [torch.randn(4, 8, device=DEV) for _ in range(3)]
    a = ExpertTable.of(ws)
    assert ExpertTable.of([w.t() for w in ws]).table is a.table and a.table.dtype == torch.int64
    assert a.table.cpu().tolist() == [w.data_ptr() for w in ws] and a.aligned
    assert a.shape == (3, 4, 8) and a.t().shape == (3, 8, 4) and a.t().stride() == (0, 1, 8)
    assert ExpertTable.of([w.clone() for w in ws]).table is not a.table
    w3 = torch.randn(3, 4, 8, device=DEV)
    n = len(kernels.operands._TABLES)
    t3 = ExpertTable.of(w3)
    assert t3.table.cpu().tolist() == [w3[e].data_ptr() for e in range(3)] and len(kernels.operands._TABLES) == n

    case = make_case(T=9, H=32, I=16, E=3, K=2, dtype=torch.bfloat16, device=DEV, requires_grad=False, seed=6)
    wg, wu, wd, *_ = _args(case)
    if misaligned:  # expert 1 of each weight one element (2 bytes) past a 16-byte boundary
        def split(w):
            out = _split(w)
            buf = torch.empty(w[1].numel() + 1, dtype=w.dtype, device=w.device)
            out[1] = buf[1:].view_as(w[1]).copy_(w[1])
            return out
    else:
        split = _split
    flags, real_launch = [], kernels.common.launch
    monkeypatch.setattr(kernels.common, "launch", lambda k, g, *a, **kw: flags.append(kw.get("W_TABLE")) or
                        real_launch(k, g, *a, **kw))
    sched = kernels.build_schedule(case.top_experts, 3)
    yl = _forward("triton", case, sched, weights=(split(wg), split(wu), split(wd))).y_TH
    assert set(f for f in flags if f is not None) == {1 if misaligned else 2}
    assert torch.equal(yl, _forward("triton", case, sched).y_TH)


def test_strided_and_expanded_inputs():
    # gate/up as row views of one [E, 2I, H] tensor (zero-copy), dy of .sum() (stride 0)
    case = make_case(T=7, H=16, I=16, E=3, K=2, dtype=torch.float32, device=DEV, requires_grad=False)
    E = case.gate_up_proj.shape[0]
    sched = kernels.build_schedule(case.top_experts, E)
    dy = torch.ones(1, 1, device=DEV).expand(*case.x.shape)
    fwd = _forward("triton", case, sched)
    got = _backward("triton", case, sched, fwd, dy)
    want = _backward("reference", case, sched, _forward("reference", case, sched), dy.contiguous())
    assert rel_err(got.dx_TH, want.dx_TH) <= TOLERANCE[torch.float32]
    assert rel_err(got.grads.d_gate, want.grads.d_gate) <= TOLERANCE[torch.float32]


def test_bitwise_deterministic():
    case = make_case(T=23, H=32, I=16, E=4, K=2, dtype=torch.bfloat16, shared=True, gate=True, limit=1.0,
                     kind="repeat", device=DEV, requires_grad=False)
    E = case.gate_up_proj.shape[0]
    dy = random_like(case.x, 1)
    runs = 10 if DEV == "cuda" else 3  # the interpreter is slow; the GPU run does the full 10
    first = None
    for _ in range(runs):
        sched = kernels.build_schedule(case.top_experts, E)
        fwd = _forward("triton", case, sched)
        bwd = _backward("triton", case, sched, fwd, dy)
        outs = [*sched, fwd.y_TH, fwd.gu_N2I, fwd.gu_shared_T2Is, bwd.dx_TH, bwd.d_router_weights_TK,
                *(g for g in bwd.grads if g is not None)]
        if first is None:
            first = [o.clone() for o in outs]
        else:
            for a, b in zip(first, outs):
                assert torch.equal(a, b)


def test_whole_op_with_triton_backend(monkeypatch):
    # mok_inductor.moe end to end through the mok:: ops with options.backend="triton": the kernels run (under
    # the interpreter on CPU), the reference does not
    monkeypatch.setattr(reference, "moe_forward", None)
    monkeypatch.setattr(reference, "moe_backward", None)
    launched = record_launches(monkeypatch)
    case = make_case(T=9, H=16, I=16, E=3, K=2, dtype=torch.float32, shared=True, gate=True, device=DEV)
    with mok_inductor.options.override(backend="triton"):
        check_against_oracle(case)
    assert kernels.gate_up.GATE_UP in launched and kernels.combine._combine_kernel in launched


# ---------------------------------------------------------------------------------------------
# The decode forward (kernels.gemv): eager calls of a few routes that need no gradient


DECODE_CASES = [
    ("t1_fp32", dict(T=1, H=40, I=24, E=5, K=2, dtype=torch.float32)),  # one token, odd H (a K step's tail)
    ("drop_limit_bf16", dict(T=3, H=32, I=20, E=12, K=4, dtype=torch.bfloat16, limit=0.6, drop=0.3)),  # -1 routes,
    # the clamp clips, I not a column-block multiple
    ("shared_gate_fp32", dict(T=2, H=32, I=16, E=6, K=3, dtype=torch.float32, shared=True, gate=True, limit=0.7)),
    ("shared_repeat_bf16", dict(T=2, H=16, I=16, E=4, K=2, dtype=torch.bfloat16, shared=True, kind="repeat")),
    ("all_dropped_shared_fp32", dict(T=4, H=16, I=16, E=8, K=2, dtype=torch.float32, kind="none", shared=True)),
    ("sixteen_routes_bf16", dict(T=8, H=24, I=8, E=16, K=2, dtype=torch.bfloat16)),  # decode_max_routes routes, E
]


@pytest.mark.parametrize("name,kw", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_forward_vs_oracle(name, kw, monkeypatch, poisoned_empty):
    # a call without gradient of at most decode_max_routes routes runs the two per-route kernels and the combine
    # (and the shared expert's), no schedule and no grouped GEMM; its output against the float64 oracle and the grouped
    # path's (the same arithmetic: close, within the contract's tolerance of each other)
    case = make_case(**kw, device=DEV, requires_grad=False, seed=len(name))
    launched = record_launches(monkeypatch)
    with torch.no_grad(), mok_inductor.options.override(backend="triton"):
        y = mok_inductor.moe(*case.args(), **case.kwargs())
        assert launched[-3:] == [kernels.gemv._gemv_gate_up_kernel, kernels.gemv._gemv_down_kernel,
                                 kernels.combine._combine_kernel], launched
        assert kernels.schedule._schedule_count_kernel not in launched
        # (the shared expert, when there is one, runs the grouped kernels as one group of T rows)
        grouped = [k for k in launched if k in (kernels.gate_up.GATE_UP, kernels.grouped_gemm.GROUPED_ROWS)]
        assert len(grouped) == (2 if case.shared_gate_up_proj is not None else 0), launched
        del launched[:]
        with mok_inductor.options.override(decode_max_routes=0):
            y_grouped = mok_inductor.moe(*case.args(), **case.kwargs())
        assert kernels.schedule._schedule_count_kernel in launched
    y64, _ = oracle_with_grads(case, random_like(case.x, 1))
    tol = TOLERANCE[case.x.dtype]
    assert y.dtype == case.x.dtype and y.shape == case.x.shape and not torch.isnan(y).any()
    assert rel_err(y, y64) <= tol, rel_err(y, y64)
    assert_same_arithmetic(y, y_grouped)


def test_decode_forward_only_without_gradient(monkeypatch):
    # the decode forward saves nothing: with an input that requires grad (grad mode on) the grouped path runs,
    # and so it does past decode_max_routes, and with more routes than experts
    launched = record_launches(monkeypatch)
    case = make_case(T=2, H=16, I=8, E=5, K=2, device=DEV, requires_grad=True, seed=4)
    with mok_inductor.options.override(backend="triton"):
        mok_inductor.moe(*case.args(), **case.kwargs()).sum().backward()
        assert kernels.gemv._gemv_gate_up_kernel not in launched and kernels.gate_up.GATE_UP in launched
        del launched[:]
        with torch.no_grad(), mok_inductor.options.override(decode_max_routes=3):
            mok_inductor.moe(*case.args(), **case.kwargs())
        assert kernels.gemv._gemv_gate_up_kernel not in launched and kernels.gate_up.GATE_UP in launched
        del launched[:]
        few = make_case(T=2, H=16, I=8, E=3, K=2, device=DEV, requires_grad=False, seed=6)  # 4 routes, 3 experts
        with torch.no_grad():
            mok_inductor.moe(*few.args(), **few.kwargs())
        assert kernels.gemv._gemv_gate_up_kernel not in launched and kernels.gate_up.GATE_UP in launched


def test_decode_forward_under_inference_mode_and_where_it_does_not_run(monkeypatch):
    # inference_mode takes the decode forward as no_grad does (same output); MXFP8 routed weights and a call
    # traced by torch.compile's AOTAutograd (Inductor's front end; "aot_eager" runs the traced graph as is) keep
    # the grouped kernels
    from mok_inductor import mxfp8

    launched = record_launches(monkeypatch)
    case = make_case(T=2, H=32, I=32, E=4, K=2, dtype=torch.bfloat16, device=DEV, requires_grad=False, seed=21)
    with mok_inductor.options.override(backend="triton"):
        with torch.no_grad():
            y = mok_inductor.moe(*case.args(), **case.kwargs())
        del launched[:]
        with torch.inference_mode():
            assert torch.equal(mok_inductor.moe(*case.args(), **case.kwargs()), y)
        assert kernels.gemv._gemv_gate_up_kernel in launched
        del launched[:]
        with torch.no_grad():
            mok_inductor.moe(case.x, case.router_weights, case.top_experts, mxfp8.quantize(case.gate_up_proj),
                             mxfp8.quantize(case.down_proj))
        assert kernels.gemv._gemv_gate_up_kernel not in launched and kernels.gate_up.GATE_UP_MX in launched
        del launched[:]
        torch._dynamo.reset()
        compiled = torch.compile(lambda *a: mok_inductor.moe(*a), backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            compiled(case.x, case.router_weights, case.top_experts, case.gate_up_proj, case.down_proj)
        assert kernels.gemv._gemv_gate_up_kernel not in launched and kernels.gate_up.GATE_UP in launched


def test_decode_forward_under_autocast(monkeypatch):
    # float32 inputs and weights under torch.autocast(bfloat16): the decode forward runs on the cast values as the
    # grouped path does (bf16 output, the same arithmetic), and the explicit bf16 call gives the same output
    launched = record_launches(monkeypatch)
    case = make_case(T=2, H=32, I=16, E=5, K=2, dtype=torch.float32, device=DEV, requires_grad=False, seed=27,
                     shared=True, gate=True)
    dev_type = torch.device(DEV).type
    with torch.no_grad(), mok_inductor.options.override(backend="triton"):
        with torch.autocast(dev_type, dtype=torch.bfloat16):
            y = mok_inductor.moe(*case.args(), **case.kwargs())
            assert kernels.gemv._gemv_gate_up_kernel in launched
            with mok_inductor.options.override(decode_max_routes=0):
                y_grouped = mok_inductor.moe(*case.args(), **case.kwargs())
        cast = dataclasses.replace(case, **{n: getattr(case, n).to(torch.bfloat16) for n in (
            "x", "gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj", "shared_output_gate")})
        y_cast = mok_inductor.moe(*cast.args(), **cast.kwargs())
    assert y.dtype == torch.bfloat16
    assert_same_arithmetic(y, y_grouped)
    assert torch.equal(y, y_cast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_forward_propagates_nan_where_it_is_routed_only(dtype):
    # T=2, K=2, E=6 (4 routes: the decode forward): a NaN in x reaches its token only; a NaN in the gate/up or
    # down weight of an expert only token 0 routes to reaches token 0 only (down row 0: output column 0); a NaN in
    # an unrouted expert's weights or in a -1 route's router weight reaches nothing
    def case():
        c = make_case(T=2, H=16, I=16, E=6, K=2, dtype=dtype, device=DEV, requires_grad=False, seed=23)
        c.top_experts = torch.tensor([[0, 1], [2, -1]], device=DEV)
        return c

    def run(c):
        with torch.no_grad(), mok_inductor.options.override(backend="triton"):
            return mok_inductor.moe(*c.args(), **c.kwargs()).cpu()

    c = case()
    c.x[1, 3] = float("nan")
    y = run(c)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
    c = case()
    c.gate_up_proj[1, 0, 0] = float("nan")
    y = run(c)
    assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()
    c = case()
    c.down_proj[0, 0, 0] = float("nan")
    y = run(c)
    assert torch.isnan(y[0, 0]) and torch.isfinite(y[0, 1:]).all() and torch.isfinite(y[1]).all()
    c = case()
    c.gate_up_proj[5] = float("nan")
    c.down_proj[4] = float("nan")
    c.router_weights[1, 1] = float("nan")
    assert torch.isfinite(run(c)).all()


def test_decode_forward_checks_expert_ids():
    # an id outside [-1, E) fails the call with the schedule's message, from the gate/up kernel's flag
    # (torch._assert_async: on CUDA a device-side assert, which ends the process's CUDA context, so the calls run
    # in a child process; under the interpreter it raises at once)
    import subprocess
    import sys

    for bad in (4, -2):
        code = ("import sys, torch, mok_inductor\n"
                "from mok_inductor import kernels\n"
                "def no_schedule(*a, **k):\n"
                "    raise AssertionError('the schedule ran: not the decode forward')\n"
                "kernels.build_schedule = kernels.schedule.build_schedule = no_schedule\n"
                "real = kernels.gemv.gemv_routes\n"
                "def spy(*a, **k):\n"
                "    print('decode forward ran', file=sys.stderr, flush=True)\n"
                "    return real(*a, **k)\n"
                "kernels.gemv.gemv_routes = spy\n"
                f"x = torch.randn(2, 16, device='{DEV}')\n"
                f"te = torch.tensor([[0, 2], [{bad}, 1]], device='{DEV}')\n"
                f"w = torch.rand(2, 2, device='{DEV}')\n"
                f"gu, d = torch.randn(4, 16, 16, device='{DEV}'), torch.randn(4, 16, 8, device='{DEV}')\n"
                "assert mok_inductor.options.current().decode_max_routes >= 4\n"
                "with torch.no_grad(), mok_inductor.options.override(backend='triton'):\n"
                "    y = mok_inductor.moe(x, w, te, gu, d)\n"
                "print(float(y.sum()))\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0, proc.stdout
        assert "decode forward ran" in proc.stderr and "the schedule ran" not in proc.stderr, proc.stderr[-2000:]
        assert "top_experts: expected expert indices in [-1, 4)" in proc.stderr, proc.stderr[-2000:]
        if DEV == "cpu":  # the interpreter's flag is read at once: the contract's ValueError with the value
            assert f"ValueError: top_experts: expected expert indices in [-1, 4) (-1 means no route), found {bad}" \
                in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Real sizes (CUDA only)


@needs_cuda
@pytest.mark.parametrize("T,H,I,E,K,kind", [
    (2048, 2048, 768, 128, 8, "random"),  # the qwen3-30b-a3b expert shape, fewer tokens
    (1000, 1024, 512, 16, 4, "repeat"),  # -1 routes, uneven experts
    (64, 2048, 768, 128, 8, "random"),  # decode: most experts get 0-5 rows
])
def test_real_sizes_cuda(T, H, I, E, K, kind):
    # the float64 oracle runs on the GPU here (float64 there too, only the summation order differs): on the
    # CPU, at the qwen3 shape (about 0.5 TFLOP of float64 with its backward) it would take minutes
    case = make_case(T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, kind=kind, shared=True, gate=True,
                     device="cpu", requires_grad=False, seed=5).detached(requires_grad=False, device="cuda")
    _check_all(case, oracle_device="cuda")


@needs_cuda
def test_cuda_graph_capture():
    case = make_case(T=256, H=256, I=128, E=8, K=2, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    E = case.gate_up_proj.shape[0]
    dy = random_like(case.x, 2)

    def step():
        sched = kernels.build_schedule(case.top_experts, E)
        fwd = _forward("triton", case, sched)
        return fwd.y_TH, _backward("triton", case, sched, fwd, dy).dx_TH

    eager = step()  # warm-up (autotuning) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


@needs_cuda
def test_cuda_graph_capture_split_weights():
    # split per-expert weights in a CUDA graph: their address tables are uploaded by the warm-up call and
    # reused in the capture (replay equals eager); a first call under capture raises, saying to warm up
    case = make_case(T=256, H=256, I=128, E=8, K=2, dtype=torch.bfloat16, device="cuda", requires_grad=False)
    wg, wu, wd, *_ = _args(case)
    lg, lu, ld = _split(wg), _split(wu), _split(wd)
    dy = random_like(case.x, 2)
    E = wg.shape[0]

    def step(g_, u_, d_):
        sched = kernels.build_schedule(case.top_experts, E)
        fwd = _forward("triton", case, sched, weights=(g_, u_, d_))
        bwd = _backward("triton", case, sched, fwd, dy, weights=(g_, u_, d_))
        return fwd.y_TH, bwd.dx_TH

    eager = step(lg, lu, ld)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(lg, lu, ld)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    fresh = [_split(w) for w in (wg, wu, wd)]  # new addresses: no table yet
    with pytest.raises(RuntimeError, match="^split per-expert weights: their first call is under CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            step(*fresh)


@needs_cuda
def test_compiled_cuda_emits_user_kernels():
    # with mok_inductor.enable(), the ops decompose into wrap_triton launches under torch.compile: Inductor emits
    # our kernels
    import mok_inductor
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    case = make_case(T=64, H=128, I=64, E=4, K=2, dtype=torch.bfloat16, shared=True, gate=True, device="cuda")
    f = torch.compile(mok_inductor.moe, fullgraph=True)
    c = case.detached()
    with mok_inductor.enabled():
        y, codes = run_and_get_code(lambda: f(*c.args(), **c.kwargs()))
    code = "\n".join(codes)
    assert "_gate_up_kernel" in code and "_combine_kernel" in code
    e = case.detached()
    y_eager = mok_inductor.moe(*e.args(), **e.kwargs())
    assert rel_err(y, y_eager) <= TOLERANCE[torch.bfloat16]
    dy = random_like(y_eager.detach(), 4)
    y.backward(dy)
    y_eager.backward(dy)
    for n, t in c.tensors().items():
        assert rel_err(t.grad, e.tensors()[n].grad) <= TOLERANCE[torch.bfloat16], n


@triton.jit
def _swizzle_ids_kernel(out_ptr, num_m, num_n):
    pid = tl.program_id(0)
    pm, pn = swizzle(pid, num_m, num_n, 8)
    tl.store(out_ptr + 2 * pid, pm)
    tl.store(out_ptr + 2 * pid + 1, pn)


@pytest.mark.parametrize("num_m,num_n", [(1, 1), (3, 5), (8, 2), (9, 3), (20, 4), (17, 1)])
def test_swizzle_covers_every_tile_once(num_m, num_n):
    # kernels.common.swizzle, the L2 tile order of the grouped GEMMs and the wgrad: a bijection of the tile ids
    # onto the num_m x num_n grid, also with more row tiles than one group of 8 and a partial last group
    out = torch.full((num_m * num_n, 2), -1, dtype=torch.int32, device=DEV)
    _swizzle_ids_kernel[(num_m * num_n,)](out, num_m, num_n)
    got = sorted(map(tuple, out.cpu().tolist()))
    assert got == [(m, n) for m in range(num_m) for n in range(num_n)]


# ---------------------------------------------------------------------------------------------
# Combine


@pytest.mark.parametrize("shared", [False, True])
def test_combine_unrolled_equals_the_route_loop(monkeypatch, shared):
    # kernels.combine.combine: the route loop unrolled (K a constant, every route's row loaded, valid or not) gives bit for
    # bit the loop over K whose loads wait on each route's id; both the float64 sum within float32 rounding. The
    # rows of -1 routes hold NaN (never written in the forward): they must not reach the output

    g = torch.Generator().manual_seed(23)
    T, K, H = 13, 3, 200
    y = torch.randn(T * K, H, generator=g)
    te = torch.randint(0, 4, (T * K,), generator=g)
    te[torch.randperm(T * K, generator=g)[:7]] = -1
    y[te < 0] = float("nan")
    rw = torch.rand(T * K, generator=g) + 0.1
    s = torch.randn(T, H, generator=g) if shared else None
    logit = torch.randn(T, generator=g) if shared else None

    def run(unroll):
        launched, real = [], kernels.common.launch
        monkeypatch.setattr(kernels.common, "launch", lambda k, *a, **kw: launched.append(kw.get("TOPK_C")) or real(k, *a, **kw))
        out = torch.full((T, H), float("nan"), device=DEV)
        kernels.combine.combine(y.to(DEV), te.to(DEV), out, rw_N=rw.to(DEV), s_TH=None if s is None else s.to(DEV),
                        logit_T=None if logit is None else logit.to(DEV), unroll_max=16 if unroll else 0)
        assert launched == [K if unroll else 0]
        return out.cpu()

    unrolled, looped = run(True), run(False)
    assert torch.equal(unrolled, looped)
    w = torch.where(te >= 0, rw.double(), 0.0)
    want = (torch.nan_to_num(y.double(), nan=0.0) * w[:, None]).view(T, K, H).sum(1)
    if shared:
        want += s.double() * torch.sigmoid(logit.double())[:, None]
    assert rel_err(unrolled, want) <= 1e-6
