"""The pattern pass on CUDA (skipped without CUDA), compiled with Inductor.

The CPU matrix of tests/test_patterns.py on the GPU: every model of `_pattern_models.MODELS` (real transformers
classes from tiny configs) x transformers' "grouped_mm" and "batched_mm" experts backends x float32 and
bfloat16, through `backend="mok"`; the `mok_inductor.enable()` switch on a subset (each experts backend, both
dtypes of grouped_mm, whose fp32 graph is transformers' own grouped_mm_fallback op); and the torchtitan-style
block of tests/test_patterns_graphs.py (histc and bincount offsets) in bf16.

Checked per case: the replaced blocks run our Triton kernels (their names appear in Inductor's output code, no
`torch.ops.mok.*` fallback and no `_grouped_mm` left); the counter equals the number of sparse MoE blocks;
outputs and every gradient match (fp32: 1e-4 relative against eager; bf16: at most 2x eager bf16's own error
against a higher-precision reference, +1e-3 — an fp32 copy of the model, or the float64 oracle for the
torchtitan block, whose `torch._grouped_mm` has no fp32 CUDA path).

Cost: one Inductor compile (forward and backward) per case; run with pytest-xdist (`-n 14`) on the device.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import mok_inductor.lowering  # noqa: F401  (registers backend="mok")
import mok_inductor
from _pattern_models import MODELS, SEQ, VOCAB, build
from _helpers import rel_err
from oracle import oracle_moe
from test_patterns_graphs import H as TITAN_H, T as TITAN_T, TitanMoE

import transformers  # noqa: F401  (a pinned test dependency)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

IMPLS = ("grouped_mm", "batched_mm")
DTYPES = (torch.float32, torch.bfloat16)
CASES = [(n, i, d) for n in MODELS for i in IMPLS for d in DTYPES]
ENABLE_CASES = [
    ("qwen2_moe", "grouped_mm", torch.bfloat16),  # shared expert + sigmoid gate fused into the same call
    ("olmoe", "grouped_mm", torch.float32),  # transformers::grouped_mm_fallback
    ("glm4_moe", "batched_mm", torch.bfloat16),  # ungated shared expert, a dense first layer
]


def _ids(cases):
    return [f"{n}-{i}-{str(d)[6:]}" for n, i, d in cases]


def _kernel_names():
    from mok_inductor import kernels

    return {n for m in kernels.MODULES for n in dir(m) if n.endswith("_kernel")}


def _check_code(codes):
    joined = "\n".join(codes)
    assert any(k in joined for k in _kernel_names()), "no mok Triton kernel in Inductor's output code"
    assert "torch.ops.mok.moe_fwd" not in joined and "torch.ops.mok.moe_bwd" not in joined
    assert "_grouped_mm" not in joined


def _step(model, ids, dy):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    (logits * dy).sum().backward()
    grads = {k.replace("_orig_mod.", ""): p.grad.detach().clone() for k, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach(), grads


def _check_model(name, impl, dtype, switch):
    model, n_blocks = build(name, impl, dtype)
    model = model.cuda()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, SEQ, generator=g).cuda()
    dy = torch.randn(*SEQ, VOCAB, generator=g).to(dtype).cuda()
    gold = copy.deepcopy(model).float()
    ref32, gref32 = _step(gold, ids, dy.float())
    ref, gref = _step(model, ids, dy)
    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    if switch == "backend":
        compiled = torch.compile(model, backend="mok", fullgraph=True)
        (out, grads), codes = run_and_get_code(_step, compiled, ids, dy)
    else:
        with mok_inductor.enabled():
            compiled = torch.compile(model, fullgraph=True)
            (out, grads), codes = run_and_get_code(_step, compiled, ids, dy)
    assert counters["mok_inductor"]["moe_replaced"] == n_blocks
    _check_code(codes)
    assert set(grads) == set(gref)
    if dtype == torch.float32:
        assert rel_err(out, ref) <= 1e-4
        for k in gref:
            assert rel_err(grads[k], gref[k]) <= 1e-4, k
    else:
        assert rel_err(out, ref32) <= 2 * rel_err(ref, ref32) + 1e-3
        for k in gref32:
            assert rel_err(grads[k], gref32[k]) <= 2 * rel_err(gref[k], gref32[k]) + 1e-3, k
    torch._dynamo.reset()


@pytest.mark.parametrize("name,impl,dtype", CASES, ids=_ids(CASES))
def test_model_backend_mok(name, impl, dtype):
    _check_model(name, impl, dtype, "backend")


@pytest.mark.parametrize("name,impl,dtype", ENABLE_CASES, ids=_ids(ENABLE_CASES))
def test_model_enable_switch(name, impl, dtype):
    _check_model(name, impl, dtype, "enable")


# ---------------------------------------------------------------------------------------------------
# torchtitan-style block (histc / bincount offsets, separate w1 / w3 / w2) in bf16


def _titan_params(block):
    return [block.router, block.w1, block.w3, block.w2]


def _titan_step(block, x, dy):
    """Output, routes, and the gradients of <out, dy> w.r.t. x, the router and the three expert weights."""
    x = x.detach().requires_grad_()
    out, ids, _ = block(x)
    grads = torch.autograd.grad(out, [x, *_titan_params(block)], dy)
    return out.detach(), ids, grads


def _titan_ref64(block, x, ids, dy):
    """The block's maths in float64 on the CPU (the routes given): router softmax, gathered weights, SwiGLU experts."""
    x64 = x.detach().cpu().double().requires_grad_()
    r, w1, w3, w2 = (p.detach().cpu().double().requires_grad_() for p in _titan_params(block))
    ids = ids.cpu()
    top = F.linear(x64, r).softmax(dim=-1).gather(1, ids)
    out = oracle_moe(x64, top, ids, torch.cat([w1, w3], dim=1), w2)
    return out.detach(), torch.autograd.grad(out, [x64, r, w1, w3, w2], dy.cpu().double())


@pytest.mark.parametrize("counts", ["histc", "bincount"])
def test_titan_block_bf16(counts):
    block = TitanMoE(counts).bfloat16().cuda()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(TITAN_T, TITAN_H, generator=g).bfloat16().cuda()
    dy = torch.randn(TITAN_T, TITAN_H, generator=g).bfloat16().cuda()
    ref, ref_ids, gref = _titan_step(block, x, dy)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        counters["mok_inductor"].clear()
        compiled = torch.compile(block, backend="mok", fullgraph=True)
        (out, ids, grads), codes = run_and_get_code(_titan_step, compiled, x, dy)
    assert counters["mok_inductor"]["moe_replaced"] == 1
    _check_code(codes)
    assert torch.equal(ids, ref_ids)
    out64, g64 = _titan_ref64(block, x, ids, dy)
    assert rel_err(out.cpu(), out64) <= 2 * rel_err(ref.cpu(), out64) + 1e-3
    for name, a, b, gold in zip(("x", "router", "w1", "w3", "w2"), grads, gref, g64):
        assert rel_err(a.cpu(), gold) <= 2 * rel_err(b.cpu(), gold) + 1e-3, name
    torch._dynamo.reset()
