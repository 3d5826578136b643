"""The pattern pass on hand-built blocks: near misses that must stay untouched (with the reason logged), the
torchtitan-style block, and the pinned rewritten graph of one canonical block per formulation.

Experts modules here are small classes decorated with transformers' own `use_experts_implementation`, so
they run HF's real "grouped_mm" / "batched_mm" functions; the decorator flags (`has_bias`, `is_transposed`),
the activation and `_apply_gate` make the near misses.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import mok_inductor.lowering as lowering
import mok_inductor
from mok_inductor.lowering import patterns
from _helpers import rel_err
from _pattern_models import traces_sentinel_handling
from oracle import oracle_moe

import transformers  # a pinned test dependency (requirements.txt): its absence must fail, not skip
from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

# T tokens, H hidden, I intermediate, E experts, K routes: T not a multiple of E, one expert likely empty
T, H, I, E, K = 7, 16, 8, 4, 2


class _Config:
    def __init__(self, impl):
        self._experts_implementation = impl


def make_experts(impl: str, dtype=torch.bfloat16, act: str = "silu", swap_halves: bool = False,
                 clamp=None, **flags):
    """An HF-style experts module ([E, 2I, H] gate_up_proj, [E, H, I] down_proj unless is_transposed)."""

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            tr = flags.get("is_transposed", False)
            self.num_experts = E
            self.gate_up_proj = nn.Parameter(0.3 * torch.randn((E, H, 2 * I) if tr else (E, 2 * I, H), generator=g))
            self.down_proj = nn.Parameter(0.3 * torch.randn((E, I, H) if tr else (E, H, I), generator=g))
            if flags.get("has_bias", False):
                self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * I, generator=g))
                self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g))
            self.act_fn = ACT2FN[act]

        if swap_halves:
            def _apply_gate(self, gate_up):
                up, gate = gate_up.chunk(2, dim=-1)
                return self.act_fn(gate) * up
        elif clamp is not None:  # (gate max, up min, up max), as the clamped-SwiGLU models write it
            def _apply_gate(self, gate_up):
                gate, up = gate_up.chunk(2, dim=-1)
                gmax, umin, umax = clamp
                return self.act_fn(gate.clamp(max=gmax)) * up.clamp(min=umin, max=umax)

        def forward(self, hidden_states, top_k_index, top_k_weights):  # replaced by the decorator
            raise NotImplementedError

    Experts = use_experts_implementation(Experts, **flags)
    return Experts(_Config(impl)).to(dtype)


def routing_inputs(dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    w, idx = torch.topk(logits.softmax(-1), K, dim=-1)
    return x, idx, w.to(dtype)


def rewritten(fn, *args, dynamic=False):
    """Dynamo-capture fn, run the pass, return (graph module, records, output of the rewritten graph)."""
    got = {}

    def capture(gm, example_inputs):
        got["records"] = patterns.rewrite(gm.graph)
        gm.recompile()
        got["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    out = torch.compile(fn, backend=capture, fullgraph=True, dynamic=dynamic)(*args)
    return got["gm"], got["records"], out


@contextlib.contextmanager
def pattern_log(monkeypatch):
    """Turn the "mok_patterns" artifact on as a user would (`torch._logging.set_logs`); yield the list of the
    messages it logs. Its once-per-process memory is cleared first, so earlier tests hide nothing."""
    monkeypatch.delenv("TORCH_LOGS", raising=False)  # (set_logs does nothing while TORCH_LOGS is set)
    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect()
    patterns._say.cache_clear()
    torch._logging.set_logs(modules={patterns.ARTIFACT: True})
    patterns._log.addHandler(handler)
    try:
        yield messages
    finally:
        patterns._log.removeHandler(handler)
        torch._logging.set_logs()
        patterns._say.cache_clear()


def graph_text(gm) -> str:
    """The rewritten graph's code without the signature, placeholder aliases and `= None` frees."""
    lines = []
    for line in gm.code.strip().splitlines()[1:]:
        line = re.sub(r";\s+[\w =]+ = None$", "", line.strip())
        if not line or re.fullmatch(r"(\w+) = [A-Z]\w*", line):
            continue
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# near misses: never replaced, reason logged

NEAR_MISSES = {
    # name: (factory kwargs, expected reason fragment)
    "gelu": (dict(act="gelu"), "activation gelu"),
    "bias": (dict(has_bias=True), "modified in place"),
    "swapped": (dict(swap_halves=True), "swapped"),
    "transposed": (dict(is_transposed=True), "transposed"),
    "clamp": (dict(clamp=(0.5, -0.25, 0.25)), "swiglu_limit"),  # up limit differs from the gate limit
}


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_miss_is_left_alone(case, impl, monkeypatch):
    kwargs, reason = NEAR_MISSES[case]
    experts = make_experts(impl, **kwargs)
    x, idx, w = routing_inputs(torch.bfloat16)
    ref = experts(x, idx, w)
    with pattern_log(monkeypatch) as messages:
        gm, records, out = rewritten(experts, x, idx, w)
    assert counters["mok_inductor"]["moe_replaced"] == 0
    assert not any(r.replaced for r in records)
    assert any(reason in r.detail for r in records), [str(r) for r in records]
    assert any(reason in m for m in messages), messages
    assert "mok.moe" not in gm.code
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_log_patterns_option_prints_each_decision(capsys):
    """options.log_patterns prints every match and rejection to stderr, with the user's source line; off, the
    pass prints nothing."""
    x, idx, w = routing_inputs(torch.bfloat16)
    patterns._say.cache_clear()
    for log in (False, True):
        with mok_inductor.options.override(log_patterns=log):
            rewritten(make_experts("grouped_mm", act="gelu"), x, idx, w)
            rewritten(make_experts("grouped_mm"), x, idx, w)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("[mok_patterns] ")]
        if log:
            assert any("rejected" in ln and "activation gelu" in ln for ln in lines), err
            assert any(ln.startswith("[mok_patterns] replaced hf_grouped_mm") for ln in lines), err
            assert all(re.search(r" \(\w+\.py:\d+ in \w+\): ", ln) for ln in lines), err  # where, in the user's code
        else:
            assert lines == [], err
    patterns._say.cache_clear()


def test_rejection_is_logged_once_through_the_artifact(monkeypatch, capsys):
    """A rejected block says why through the "mok_patterns" artifact once per process, however often it is
    compiled; the option adds no second copy while the artifact is on; with both off nothing is printed."""
    experts = make_experts("grouped_mm", act="gelu")
    x, idx, w = routing_inputs(torch.bfloat16)
    with pattern_log(monkeypatch) as messages:
        with mok_inductor.options.override(log_patterns=True):
            for _ in range(3):  # rewritten() resets Dynamo: three compiles of the same code
                rewritten(experts, x, idx, w)
        err = capsys.readouterr().err
    rejected = [m for m in messages if m.startswith("rejected") and "activation gelu" in m]
    assert len(rejected) == 1, messages
    assert "[mok_patterns] " not in err, err  # the artifact showed it: no stderr copy from the option
    assert "activation gelu" in err, err  # torch's own handler printed the artifact's line
    patterns._say.cache_clear()
    rewritten(experts, x, idx, w)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_canonical_twin_of_the_near_misses_is_replaced(impl):
    """The same harness with the default flags is replaced, so the near-miss tests can fail."""
    experts = make_experts(impl)
    x, idx, w = routing_inputs(torch.bfloat16)
    gm, records, out = rewritten(experts, x, idx, w)
    assert counters["mok_inductor"]["moe_replaced"] == 1
    gold = oracle_moe(x, w, idx, experts.gate_up_proj, experts.down_proj)
    assert rel_err(out, gold) <= 1e-2


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_clamped_swiglu_becomes_swiglu_limit(impl):
    """silu(gate.clamp(max=L)) * up.clamp(-L, L) is MoK's swiglu_limit (docs/semantics.md); L small so it clips."""
    limit = 0.3
    experts = make_experts(impl, dtype=torch.float32, clamp=(limit, -limit, limit))
    x, idx, w = routing_inputs(torch.float32)
    gm, records, out = rewritten(experts, x, idx, w)
    (moe,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.moe.default]
    assert moe.args[8] == limit
    gold = oracle_moe(x, w, idx, experts.gate_up_proj, experts.down_proj, swiglu_limit=limit)
    unclamped = oracle_moe(x, w, idx, experts.gate_up_proj, experts.down_proj)
    assert rel_err(unclamped, gold) > 1e-2  # the clamp is active
    assert rel_err(out, gold) <= 1e-4


# ---------------------------------------------------------------------------------------------------
# expert-parallel sentinel ids (>= E): transformers' masks and clamps, MoK's -1 route


def _with_sentinels(idx, seed=13):
    """idx with about a third of its routes replaced by the sentinel id E (both routes of a token may be)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.where(torch.rand(idx.shape, generator=g) < 0.35, torch.full_like(idx, E), idx)
    assert (out == E).any() and (out < E).any()
    return out


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_sentinel_ids_match_eager_and_the_oracle(impl):
    """Routes with id >= E under the expert-parallel handling (always on in transformers 5.17, behind
    `_is_expert_parallel` in 5.23): forward and every gradient equal HF eager, and the oracle with those
    routes dropped (grouped_mm masks them) or clamped to expert E-1 (5.17's batched_mm only clamps)."""
    experts = make_experts(impl, dtype=torch.float32)
    experts._is_expert_parallel = True
    x, idx, w = routing_inputs(torch.float32)
    idx = _with_sentinels(idx)
    params = [experts.gate_up_proj, experts.down_proj]
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(14))

    def step(fn):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xg, idx, wg)
        return out.detach(), torch.autograd.grad(out, [xg, wg, *params], dy)

    ref, gref = step(experts)
    _, records, _ = rewritten(experts, x, idx, w)
    assert counters["mok_inductor"]["moe_replaced"] == 1, [str(r) for r in records]
    torch._dynamo.reset()
    out, g = step(torch.compile(experts, backend="mok", options={"mok_inner": "aot_eager"}, fullgraph=True))
    assert counters["mok_inductor"]["moe_replaced"] == 2
    clamp_only = impl == "batched_mm" and SENTINELS_ALWAYS["batched_mm"]
    assert any(("clamp(0, E-1)" if clamp_only else "ids >= E -> -1") in r.detail for r in records if r.replaced)
    gold = oracle_moe(x, w, idx.clamp(0, E - 1) if clamp_only else idx, *params)
    assert rel_err(out, gold) <= 1e-5
    assert rel_err(ref, gold) <= 1e-5
    for a, b in zip(g, gref):
        assert rel_err(a, b) <= 1e-5
    if not clamp_only:  # a dropped route gets no router-weight gradient
        assert torch.all(g[1][idx == E] == 0) and torch.all(gref[1][idx == E] == 0)


def _sentinel_block(x, top_k_index, top_k_weights, gate_up, down, variant=""):
    """A grouped_mm block with transformers' sentinel handling written out by hand; `variant` breaks one part."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    ids, perm = torch.sort(flat)
    xs = x[perm // k]
    sw = top_k_weights.reshape(-1)[perm]
    offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
    if variant == "clamp_first":
        ids.clamp_(max=E - 1)
    src = flat if variant == "unsorted_mask" else ids
    mask = (src >= (E - 1 if variant == "bound" else E)).unsqueeze(-1)
    if variant != "clamp_first":
        ids.clamp_(max=E - 2 if variant == "clamp_bound" else E - 1)
    xs.masked_fill_(mask, 0.0)
    h = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)
    if variant != "partial":
        h = h.masked_fill(mask, 0.0)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)
    y = y.masked_fill(mask, 1.0 if variant == "fill" else 0.0) * sw.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0])
    return y[inv].view(-1, k, y.shape[-1]).sum(dim=1)


SENTINEL_NEAR_MISSES = {
    "bound": "not ids >= E",  # the mask is ids >= E-1: it drops expert E-1's routes too
    "fill": "not 0",  # the down output is filled with 1
    "partial": "partial sentinel masks",  # no mask on the first GEMM output
    "unsorted_mask": "not computed from the sorted expert ids",  # mask rows in route order, GEMM rows sorted
    "clamp_first": "after their in-place clamp",  # the mask sees the clamped ids: it is all False
    "clamp_bound": "not to max=E-1",
}


@pytest.mark.parametrize("variant", ["", *sorted(SENTINEL_NEAR_MISSES)])
def test_sentinel_masks_canonical_and_near_misses(variant, monkeypatch):
    g = torch.Generator().manual_seed(15)
    gate_up = (0.3 * torch.randn(E, 2 * I, H, generator=g)).bfloat16()
    down = (0.3 * torch.randn(E, H, I, generator=g)).bfloat16()
    x, idx, w = routing_inputs(torch.bfloat16)
    if variant not in ("clamp_first", "unsorted_mask"):  # these two leak rows the GEMMs never wrote (garbage)
        idx = _with_sentinels(idx)

    def f(x, idx, w, gate_up, down):
        return _sentinel_block(x, idx, w, gate_up, down, variant)

    with pattern_log(monkeypatch) as messages:
        gm, records, out = rewritten(f, x, idx, w, gate_up, down)
    if not variant:
        assert counters["mok_inductor"]["moe_replaced"] == 1, [str(r) for r in records]
        gold = oracle_moe(x, w, idx, gate_up, down)
        assert rel_err(out, gold) <= 1e-2
        return
    reason = SENTINEL_NEAR_MISSES[variant]
    assert counters["mok_inductor"]["moe_replaced"] == 0
    assert any(reason in r.detail for r in records), [str(r) for r in records]
    assert any(reason in m for m in messages), messages
    assert "mok.moe" not in gm.code
    torch.testing.assert_close(out, f(x, idx, w, gate_up, down), rtol=0, atol=0)


def test_grouped_mm_outside_a_moe_block_is_left_alone(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(12, H, generator=g).bfloat16()
    w = torch.randn(E, 2 * I, H, generator=g).bfloat16()
    offs = torch.tensor([3, 5, 9, 12], dtype=torch.int32)

    def f(x, w, offs):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).sum(0)

    with pattern_log(monkeypatch) as messages:
        gm, records, out = rewritten(f, x, w, offs)
    assert counters["mok_inductor"]["moe_replaced"] == 0
    assert any("not a cumsum" in r.detail for r in records), [str(r) for r in records]
    assert any("not a cumsum" in m for m in messages), messages
    torch.testing.assert_close(out, f(x, w, offs))


# ---------------------------------------------------------------------------------------------------
# torchtitan-style block


class TitanMoE(nn.Module):
    """torchtitan's TokenReorderer + GroupedExperts shape: separate w1 (gate) / w3 (up) [E, I, H], w2 [E, H, I]."""

    def __init__(self, counts: str = "histc", score_before_experts: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.router = nn.Parameter(torch.randn(E, H, generator=g))
        self.w1 = nn.Parameter(0.3 * torch.randn(E, I, H, generator=g))
        self.w3 = nn.Parameter(0.3 * torch.randn(E, I, H, generator=g))
        self.w2 = nn.Parameter(0.3 * torch.randn(E, H, I, generator=g))
        self.counts, self.score_before_experts = counts, score_before_experts

    def forward(self, x):
        scores = F.linear(x.float(), self.router.float()).softmax(dim=-1)  # [T, E]
        ids = torch.topk(scores, K, dim=1).indices
        top = scores.gather(1, ids).to(x.dtype)  # [T, K] from [T, E] scores
        flat = ids.view(-1)
        if self.counts == "histc":
            counts = torch.histc(flat.float(), bins=E, min=0, max=E)
        else:
            counts = torch.bincount(flat, minlength=E)
        perm = torch.argsort(flat, stable=True)
        sw = top.view(-1)[perm]
        tok = perm // K
        xs = torch.gather(x, 0, tok.reshape(-1, 1).expand(-1, x.shape[1]))
        if self.score_before_experts:
            xs = (xs * sw.reshape(-1, 1)).to(x.dtype)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(xs, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xs, self.w3.transpose(-2, -1), offs=offs)
        y = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs).type_as(x)
        if not self.score_before_experts:
            y = y * sw.reshape(-1, 1)
        out = torch.zeros_like(x).scatter_add(0, tok.reshape(-1, 1).expand(-1, x.shape[1]), y)
        return out, ids, top


@pytest.mark.parametrize("counts", ["histc", "bincount"])
def test_titan_block_forward_and_backward(counts):
    block = TitanMoE(counts).bfloat16()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).bfloat16().requires_grad_()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        counters["mok_inductor"].clear()
        c = torch.compile(block, backend="mok", options={"mok_inner": "aot_eager"}, fullgraph=True)
        out, ids, top = c(x)
    assert counters["mok_inductor"]["moe_replaced"] == 1
    gate_up = torch.cat([block.w1, block.w3], dim=1)
    gold = oracle_moe(x.detach(), top.detach(), ids, gate_up.detach(), block.w2.detach())
    assert rel_err(out, gold) <= 1e-2
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = torch.autograd.grad(out, [x, block.w1, block.w2], dy)
    ref_out = block(x)[0]
    want = torch.autograd.grad(ref_out, [x, block.w1, block.w2], dy)
    x64 = x.detach().double().requires_grad_()
    w1, w3, w2 = (p.detach().double().requires_grad_() for p in (block.w1, block.w3, block.w2))
    g64 = torch.autograd.grad(oracle_moe(x64, top.detach(), ids, torch.cat([w1, w3], 1), w2), [x64, w1, w2], dy.double())
    for a, b, gold_g in zip(got, want, g64):
        err = rel_err(a, gold_g)
        ref_err = rel_err(b, gold_g)
        assert err <= 2 * ref_err + 1e-3, (err, ref_err)


def test_titan_scores_before_experts_is_left_alone():
    block = TitanMoE(score_before_experts=True).bfloat16()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).bfloat16()
    gm, records, out = rewritten(block, x)
    assert counters["mok_inductor"]["moe_replaced"] == 0
    assert any("score before experts" in r.detail for r in records), [str(r) for r in records]
    torch.testing.assert_close(out[0], block(x)[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# pinned rewritten graphs, one canonical block per formulation


# transformers 5.17 traces the expert-parallel sentinel handling of each experts backend unconditionally,
# 5.23 only under `_is_expert_parallel`: the graphs below are pinned for both (the branch taken depends on the
# installed transformers; CI runs 5.23, the 5.17 branch is checked in the torch 2.11 + transformers 5.17 env)
SENTINELS_ALWAYS = {impl: traces_sentinel_handling(impl) for impl in ("grouped_mm", "batched_mm")}


class TestRewrittenGraphs(expecttest.TestCase):
    def _experts_graph(self, impl, dtype, expert_parallel=False):
        experts = make_experts(impl, dtype=dtype)
        if expert_parallel:  # what transformers' expert-parallel sharding sets on the experts module
            experts._is_expert_parallel = True
        x, idx, w = routing_inputs(dtype)
        gm, records, _ = rewritten(experts, x, idx, w)
        self.assertEqual(counters["mok_inductor"]["moe_replaced"], 1, [str(r) for r in records])
        return graph_text(gm)

    def test_hf_grouped_mm_bf16(self):
        text = self._experts_graph("grouped_mm", torch.bfloat16)
        if SENTINELS_ALWAYS["grouped_mm"]:  # sentinel ids (>= E) become MoK's -1 routes
            self.assertExpectedInline(text, """\
ge_1 = l_args_1_ >= 4
masked_fill_2 = l_args_1_.masked_fill(ge_1, -1)
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, masked_fill_2, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to_2 = moe_default.to(torch.bfloat16)
return (to_2,)""")
        else:
            self.assertExpectedInline(text, """\
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, l_args_1_, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to_2 = moe_default.to(torch.bfloat16)
return (to_2,)""")

    def test_hf_grouped_mm_fallback_fp32(self):
        text = self._experts_graph("grouped_mm", torch.float32)
        if SENTINELS_ALWAYS["grouped_mm"]:
            self.assertExpectedInline(text, """\
ge_1 = l_args_1_ >= 4
masked_fill_2 = l_args_1_.masked_fill(ge_1, -1)
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, masked_fill_2, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to_2 = moe_default.to(torch.float32)
return (to_2,)""")
        else:
            self.assertExpectedInline(text, """\
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, l_args_1_, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to_2 = moe_default.to(torch.float32)
return (to_2,)""")

    def test_hf_batched_mm(self):
        text = self._experts_graph("batched_mm", torch.float32)
        if SENTINELS_ALWAYS["batched_mm"]:  # the experts see clamp(ids, 0, E-1), and so does MoK
            self.assertExpectedInline(text, """\
clamp_1 = l_args_1_.clamp(0, 3)
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, clamp_1, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to = moe_default.to(torch.float32)
return (to,)""")
        else:
            self.assertExpectedInline(text, """\
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, l_args_1_, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to = moe_default.to(torch.float32)
return (to,)""")

    def test_hf_grouped_mm_expert_parallel_bf16(self):
        """`_is_expert_parallel`: the sentinel masks in any version (5.17 ignores the flag: it always masks)."""
        self.assertExpectedInline(self._experts_graph("grouped_mm", torch.bfloat16, expert_parallel=True), """\
ge_1 = l_args_1_ >= 4
masked_fill_2 = l_args_1_.masked_fill(ge_1, -1)
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, masked_fill_2, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to_2 = moe_default.to(torch.bfloat16)
return (to_2,)""")

    def test_hf_batched_mm_expert_parallel(self):
        text = self._experts_graph("batched_mm", torch.float32, expert_parallel=True)
        if SENTINELS_ALWAYS["batched_mm"]:  # 5.17: the clamp only (its routing weights are not masked)
            self.assertExpectedInline(text, """\
clamp_1 = l_args_1_.clamp(0, 3)
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, clamp_1, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to = moe_default.to(torch.float32)
return (to,)""")
        else:  # clamped ids for the gathers, routing weights zeroed at ids >= E
            self.assertExpectedInline(text, """\
clamp_1 = l_args_1_.clamp(0, 3)
ge_1 = l_args_1_ >= 4
masked_fill_1 = clamp_1.masked_fill(ge_1, -1)
moe_default = torch.ops.mok.moe.default(l_args_0_, l_args_2_, masked_fill_1, l_self_parameters_gate_up_proj_, l_self_parameters_down_proj_, None, None, None, None)
to = moe_default.to(torch.float32)
return (to,)""")

    def test_qwen2_moe_shared_expert(self):
        from _pattern_models import build

        model, _ = build("qwen2_moe", "grouped_mm", torch.float32, num_hidden_layers=1, hidden_size=16)
        block = model.model.layers[0].mlp
        x = torch.randn(1, T, 16, generator=torch.Generator().manual_seed(7))
        gm, records, out = rewritten(block, x)
        self.assertEqual(counters["mok_inductor"]["moe_replaced"], 1, [str(r) for r in records])
        torch.testing.assert_close(out, block(x), rtol=1e-4, atol=1e-5)
        if SENTINELS_ALWAYS["grouped_mm"]:
            self.assertExpectedInline(graph_text(gm), """\
hidden_states_reshaped = l_hidden_states_.view(-1, 16)
hidden_states = hidden_states_reshaped.reshape(-1, 16)
router_logits = torch._C._nn.linear(hidden_states, l_self_modules_gate_parameters_weight_)
router_probs = torch.nn.functional.softmax(router_logits, dtype = torch.float32, dim = -1)
topk = torch.topk(router_probs, 2, dim = -1)
router_top_value = topk[0]
router_indices = topk[1]
router_top_value_1 = router_top_value.to(torch.float32)
ge_1 = router_indices >= 4
masked_fill_2 = router_indices.masked_fill(ge_1, -1)
cat = torch.cat([l_self_modules_shared_expert_modules_gate_proj_parameters_weight_, l_self_modules_shared_expert_modules_up_proj_parameters_weight_], dim = 0)
moe_default = torch.ops.mok.moe.default(hidden_states_reshaped, router_top_value_1, masked_fill_2, l_self_modules_experts_parameters_gate_up_proj_, l_self_modules_experts_parameters_down_proj_, cat, l_self_modules_shared_expert_modules_down_proj_parameters_weight_, l_self_modules_shared_expert_gate_parameters_weight_, None)
expert_output_2 = moe_default.reshape(1, 7, 16)
return (expert_output_2,)""")
            return
        self.assertExpectedInline(graph_text(gm), """\
hidden_states_reshaped = l_hidden_states_.view(-1, 16)
hidden_states = hidden_states_reshaped.reshape(-1, 16)
router_logits = torch._C._nn.linear(hidden_states, l_self_modules_gate_parameters_weight_)
router_probs = torch.nn.functional.softmax(router_logits, dtype = torch.float32, dim = -1)
topk = torch.topk(router_probs, 2, dim = -1)
router_top_value = topk[0]
router_indices = topk[1]
router_top_value_1 = router_top_value.to(torch.float32)
cat = torch.cat([l_self_modules_shared_expert_modules_gate_proj_parameters_weight_, l_self_modules_shared_expert_modules_up_proj_parameters_weight_], dim = 0)
moe_default = torch.ops.mok.moe.default(hidden_states_reshaped, router_top_value_1, router_indices, l_self_modules_experts_parameters_gate_up_proj_, l_self_modules_experts_parameters_down_proj_, cat, l_self_modules_shared_expert_modules_down_proj_parameters_weight_, l_self_modules_shared_expert_gate_parameters_weight_, None)
expert_output_2 = moe_default.reshape(1, 7, 16)
return (expert_output_2,)""")

    def test_titan(self):
        block = TitanMoE().bfloat16()
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(8)).bfloat16()
        gm, records, _ = rewritten(block, x)
        self.assertEqual(counters["mok_inductor"]["moe_replaced"], 1, [str(r) for r in records])
        self.assertExpectedInline(graph_text(gm), """\
float_1 = l_x_.float()
float_2 = l_self_parameters_router_.float()
linear = torch._C._nn.linear(float_1, float_2)
scores = linear.softmax(dim = -1)
topk = torch.topk(scores, 2, dim = 1)
ids = topk[1]
gather = scores.gather(1, ids)
top = gather.to(torch.bfloat16)
cat = torch.cat([l_self_parameters_w1_, l_self_parameters_w3_], dim = 1)
moe_default = torch.ops.mok.moe.default(l_x_, top, ids, cat, l_self_parameters_w2_, None, None, None, None)
return (moe_default, ids, top)""")


# ---------------------------------------------------------------------------------------------------
# the switch and the backend registration


class _OtherPass(lowering.cache.CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "other-pass-v1"


@pytest.mark.parametrize("lists", [True, False], ids=["list-slot", "single-slot"])
def test_enable_chains_the_pass_already_installed(lists, monkeypatch):
    """torch >= 2.12 takes a list in the slot; 2.11 one callable (emulated here by the single-slot mode)."""
    from torch._inductor import config

    monkeypatch.setattr(lowering.cache, "slot_takes_lists", lambda: lists)
    other = _OtherPass()
    # torch's own config.patch, not monkeypatch: deleting a config attribute on undo breaks the module
    with config.patch(pre_grad_custom_pass=other):
        lowering.patterns.enable()
        try:
            slot = config.pre_grad_custom_pass
            assert lowering.patterns.is_enabled()
            if lists:  # torch >= 2.12: both passes in the list, each hashed by the caches
                assert isinstance(slot, list) and slot[0] is other and len(slot) == 2
                ours = slot[1]
            else:  # 2.11: one slot, ours runs the other first and hashes both
                ours = slot
                assert ours.chained is other and "other-pass-v1" in ours.uuid()
            assert lowering.cache.fingerprint() in ours.uuid()
            lowering.patterns.enable()  # idempotent
            assert config.pre_grad_custom_pass is slot
            for p in lowering.cache.as_tuple(slot):
                p(torch.fx.Graph())
            assert other.calls == 1
        finally:
            lowering.patterns.disable()
        assert config.pre_grad_custom_pass is other and not lowering.patterns.is_enabled()
    if not lists:
        # a chained pass without uuid() makes the chain's uuid None: the caches bypass, as for that pass alone
        with config.patch(pre_grad_custom_pass=lambda graph: None):
            with mok_inductor.enabled():
                assert config.pre_grad_custom_pass.uuid() is None
            assert not lowering.patterns.is_enabled()


_SWITCH_PROBE = """
import sys
import torch
from torch._inductor import config
import torch._dynamo.backends.registry as registry

before = (config.pre_grad_custom_pass, config.post_grad_custom_post_pass, list(sys.meta_path))
import mok_inductor
import mok_inductor.ops

after_import = (config.pre_grad_custom_pass, config.post_grad_custom_post_pass, list(sys.meta_path))
assert after_import[0] is before[0] and after_import[1] is before[1], "import installed a pass"
assert after_import[2] == before[2], "import changed sys.meta_path"
assert "mok_inductor.lowering" not in sys.modules, "import imported the lowering package"
assert "mok" not in registry._COMPILER_FNS, "import registered the Dynamo backend"

from mok_inductor.lowering import cache, patterns


def ours():
    return (cache.find_in_slot(config.pre_grad_custom_pass, patterns.MokPatternPass),
            cache.find_in_slot(config.post_grad_custom_post_pass, cache.CacheKeyPass))


assert ours() == (None, None)
mok_inductor.enable()
pattern_pass, key_pass = ours()
assert pattern_pass is not None and pattern_pass.active and key_pass is not None
assert key_pass.uuid() == "mok-cache-key:" + cache.fingerprint()
mok_inductor.enable()  # idempotent
assert ours() == (pattern_pass, key_pass)
mok_inductor.disable()
assert config.pre_grad_custom_pass is before[0] and config.post_grad_custom_post_pass is before[1]
assert ours() == (None, None)

with mok_inductor.enabled():
    assert all(p is not None for p in ours())
assert config.pre_grad_custom_pass is before[0] and config.post_grad_custom_post_pass is before[1]

mok_inductor.enable()
with mok_inductor.enabled():  # nested in an enable(): leaves it enabled
    pass
assert all(p is not None for p in ours())
mok_inductor.disable()
assert config.pre_grad_custom_pass is before[0] and config.post_grad_custom_post_pass is before[1]
print("ok")
"""


def test_import_installs_nothing_and_enable_disable_restore():
    """In a fresh process: `import mok_inductor` leaves Inductor's pass slots and the import machinery as they
    were; `enable()` installs the pattern pass and the cache key, `disable()` and `enabled()` restore."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _SWITCH_PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_backend_is_found_by_name_in_a_fresh_process():
    """`torch.compile(backend="mok")` without importing mok_inductor: the installed entry point (pip install -e .).
    This needs the package installed in the interpreter running the tests (a PYTHONPATH checkout has no entry
    point); the failure message says which of the two is wrong."""
    import subprocess
    import sys
    from importlib.metadata import entry_points

    code = ("import torch, sys\n"
            "f = torch.compile(lambda x: x * 2, backend='mok', options={'mok_inner': 'eager'})\n"
            "assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))\n"
            "assert 'mok_inductor.lowering' in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    installed = [ep.value for ep in entry_points(group="torch_dynamo_backends") if ep.name == "mok"]
    if not installed:
        why = (f"the package is not installed in {sys.executable}: no 'mok' entry point in the torch_dynamo_backends "
               f"group, so torch cannot find backend='mok' by name. This test needs it installed: "
               f"`{sys.executable} -m pip install --no-deps --no-build-isolation -e .` (setuptools >= 70.1)")
    else:
        why = f"the 'mok' entry point is installed ({installed}) but the fresh process failed"
    assert r.returncode == 0, why + "\n" + r.stderr[-2000:]


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_dynamic_token_count_is_matched_once(impl):
    """dynamic=True: sizes are symbolic, the matcher compares them without guards; three T, one rewrite."""
    experts = make_experts(impl, dtype=torch.float32)
    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    c = torch.compile(experts, backend="mok", options={"mok_inner": "eager"}, dynamic=True, fullgraph=True)
    for t in (5, 9, 13):  # T below, around and above E * K
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, H, generator=g)
        w, idx = torch.topk(torch.randn(t, E, generator=g).softmax(-1), K, dim=-1)
        gold = oracle_moe(x, w, idx, experts.gate_up_proj, experts.down_proj)
        out = c(x, idx, w)
        assert rel_err(out, gold) <= 1e-4
    assert counters["mok_inductor"]["moe_replaced"] == 1


def test_glm4_moe_ungated_shared_expert_is_fused():
    """GLM4-MoE adds an ungated shared expert to the routed output after viewing it back to [B, S, H]."""
    from _pattern_models import build

    model, _ = build("glm4_moe", "batched_mm", torch.float32)
    block = model.model.layers[1].mlp  # layer 0 is dense
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(12))
    gm, records, out = rewritten(block, x)
    assert [r.formulation for r in records if r.replaced] == ["hf_batched_mm+shared"], [str(r) for r in records]
    (moe,) = [n for n in gm.graph.nodes if n.target is torch.ops.mok.moe.default]
    assert moe.args[5] is not None and moe.args[6] is not None and moe.args[7] is None  # shared, no gate
    torch.testing.assert_close(out, block(x), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# GPT-OSS's experts (transformers' GptOssExperts: biases, interleaved gate/up, [E, in, out] weights, its own
# `_apply_gate`): one mok::moe with activation "gpt_oss" and the biases, as zero-copy views of its parameters


def _gpt_oss_block(impl, dtype, alpha=None):
    """The MoE block (router + experts) of a tiny GptOssForCausalLM; `alpha` overrides the experts' gate alpha."""
    from _pattern_models import build

    model, _ = build("gpt_oss", impl, dtype)
    block = model.model.layers[0].mlp
    if alpha is not None:
        block.experts.alpha = alpha
    return block


def _aot_eager_capture(got: dict):
    """A backend: the pass on Dynamo's graph (kept in got["gm"], its records in got["records"]), then
    AOTAutograd (aot_eager) runs the rewritten graph, forward and backward."""

    def backend(gm, example_inputs):
        got["records"] = patterns.rewrite(gm.graph)
        gm.recompile()
        got["gm"] = gm
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    return backend


def _block_grads(block, x, dy):
    """(output, gradients of <out, dy> w.r.t. x and every parameter, by name)."""
    x = x.detach().requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out  # GptOssMLP returns (output, router scores)
    params = {k.replace("_orig_mod.", ""): p for k, p in block.named_parameters()}
    grads = torch.autograd.grad(out, [x, *params.values()], dy)
    return out.detach(), dict(zip(["x", *params], grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_gpt_oss_block_becomes_one_gpt_oss_moe(impl, dtype):
    """One mok::moe(activation="gpt_oss", swiglu_limit=7, both biases), none of the experts' GEMMs left; output
    and every gradient (x, the router's weight and bias, the four expert parameters) equal eager: fp32 within
    1e-4 of eager fp32; bf16 within 1e-2 of an fp32 eager copy, or at most 2x eager bf16's own error (+1e-3) where
    that is larger (the router bias's gradient: per token the top-K softmax gradients sum to zero, so its sum
    over tokens cancels, and eager bf16 itself is ~1e-2 off there)."""
    block = _gpt_oss_block(impl, dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 32, generator=g).to(dtype)  # [B, S, H]: T = 10 tokens, H = 32, E = 4, K = 2, I = 16
    dy = torch.randn(2, 5, 32, generator=g).to(dtype)
    gold = copy.deepcopy(block).float()
    ref32, gref32 = _block_grads(gold, x.float(), dy.float())
    ref, gref = _block_grads(block, x, dy)
    got = {}
    out, grads = _block_grads(torch.compile(block, backend=_aot_eager_capture(got), fullgraph=True), x, dy)
    gm, records = got["gm"], got["records"]
    assert counters["mok_inductor"]["moe_replaced"] == 1, [str(r) for r in records]
    name = f"hf_gpt_oss_{impl}" + ("_fallback" if impl == "grouped_mm" and dtype == torch.float32 else "")
    assert [r.formulation for r in records if r.replaced] == [name], [str(r) for r in records]
    moe = [n for n in gm.graph.nodes if n.target is torch.ops.mok.moe.default]
    assert len(moe) == 1
    assert moe[0].kwargs["activation"] == "gpt_oss" and moe[0].args[8] == 7.0  # swiglu_limit = the config's limit
    assert moe[0].kwargs["gate_up_bias"] is not None and moe[0].kwargs["down_bias"] is not None
    assert "bmm" not in gm.code and "grouped_mm" not in gm.code and "sigmoid" not in gm.code
    def tol(eager, gold):
        return 1e-4 if dtype == torch.float32 else max(1e-2, 2 * rel_err(eager, gold) + 1e-3)

    assert rel_err(out, ref32) <= tol(ref, ref32)
    for k in gref32:
        assert rel_err(grads[k], gref32[k]) <= tol(gref[k], gref32[k]), k


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_gpt_oss_block_with_another_alpha_is_left_alone(impl, monkeypatch):
    """GPT-OSS's gate with alpha = 1.5 is not MoK's "gpt_oss" activation (alpha = 1.702): left alone, bit-equal
    to eager, the reason logged."""
    block = _gpt_oss_block(impl, torch.bfloat16, alpha=1.5)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = block(x)[0]
    with pattern_log(monkeypatch) as messages:
        gm, records, out = rewritten(block, x)
    assert counters["mok_inductor"]["moe_replaced"] == 0 and not any(r.replaced for r in records)
    reason = 'alpha = 1.5; MoK\'s "gpt_oss" activation has alpha = 1.702'
    assert any(reason in r.detail for r in records), [str(r) for r in records]
    assert any(reason in m for m in messages), messages
    assert "mok.moe" not in gm.code
    torch.testing.assert_close(out[0], ref, rtol=0, atol=0)


def test_gpt_oss_sentinel_masks_are_left_alone(monkeypatch):
    """transformers' expert-parallel sentinel masks (`_is_expert_parallel`) around GPT-OSS's biased GEMMs are not
    matched yet: left alone, bit-equal to eager, the reason logged."""
    experts = _gpt_oss_block("grouped_mm", torch.bfloat16).experts
    experts._is_expert_parallel = True
    _, idx, w = routing_inputs(torch.bfloat16)  # T = 7 tokens, E = 4 (as the tiny GPT-OSS), K = 2
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(3)).bfloat16()  # the tiny GPT-OSS's H = 32
    ref = experts(x, idx, w)
    with pattern_log(monkeypatch) as messages:
        gm, records, out = rewritten(experts, x, idx, w)
    reason = "expert-parallel sentinel masks on GPT-OSS experts"
    assert counters["mok_inductor"]["moe_replaced"] == 0
    assert any(reason in r.detail for r in records), [str(r) for r in records]
    assert any(reason in m for m in messages), messages
    assert "mok.moe" not in gm.code
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def _gpt_oss_like_experts(impl, gate_slice, up_slice, beta):
    """An experts module laid out as GptOssExperts ([E, H, 2I] / [E, I, H] weights, biases) whose gate reads
    gate_up[..., gate_slice] and adds `beta` to up: the near misses of GPT-OSS's gate."""

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.num_experts, self.alpha, self.limit = E, 1.702, 7.0
            self.gate_up_proj = nn.Parameter(0.3 * torch.randn(E, H, 2 * I, generator=g))
            self.gate_up_proj_bias = nn.Parameter(0.3 * torch.randn(E, 2 * I, generator=g))
            self.down_proj = nn.Parameter(0.3 * torch.randn(E, I, H, generator=g))
            self.down_proj_bias = nn.Parameter(0.3 * torch.randn(E, H, generator=g))

        def _apply_gate(self, gate_up):
            gate, up = gate_up[..., gate_slice], gate_up[..., up_slice]
            gate = gate.clamp(min=None, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + beta) * (gate * torch.sigmoid(gate * self.alpha))

        def forward(self, hidden_states, top_k_index, top_k_weights):  # replaced by the decorator
            raise NotImplementedError

    Experts = use_experts_implementation(Experts, is_concatenated=False, is_transposed=True, has_bias=True)
    return Experts(_Config(impl)).bfloat16()


GPT_OSS_NEAR_MISSES = {
    # name: ((gate slice, up slice, beta), expected reason fragment); "canonical" is GPT-OSS's own gate
    "canonical": ((slice(None, None, 2), slice(1, None, 2), 1), None),
    "beta": ((slice(None, None, 2), slice(1, None, 2), 2), "(up + 2); MoK's \"gpt_oss\" activation has (up + 1)"),
    "swapped": ((slice(1, None, 2), slice(None, None, 2), 1), "interleaved halves swapped"),
}


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("case", sorted(GPT_OSS_NEAR_MISSES))
def test_gpt_oss_gate_near_misses(case, impl, monkeypatch):
    """GPT-OSS's gate written by hand in a GptOssExperts-like module: the canonical one is replaced (and equals
    eager); (up + 2) and swapped interleaved halves are left alone, bit-equal to eager, the reason logged."""
    (gs, us, beta), reason = GPT_OSS_NEAR_MISSES[case]
    experts = _gpt_oss_like_experts(impl, gs, us, beta)
    x, idx, w = routing_inputs(torch.bfloat16)
    ref = experts(x, idx, w)
    with pattern_log(monkeypatch) as messages:
        gm, records, out = rewritten(experts, x, idx, w)
    if reason is None:
        assert counters["mok_inductor"]["moe_replaced"] == 1, [str(r) for r in records]
        assert rel_err(out, ref) <= 1e-2
        return
    assert counters["mok_inductor"]["moe_replaced"] == 0
    assert any(reason in r.detail for r in records), [str(r) for r in records]
    assert any(reason in m for m in messages), messages
    assert "mok.moe" not in gm.code
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
