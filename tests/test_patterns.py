"""The pattern pass on real transformers model classes (tiny configs, no downloads).

Every (model, experts backend, dtype) case compiles through `backend="mok"` with `mok_inner="eager"`: the
same Dynamo-graph rewrite as under Inductor (the rewrite is backend-independent), then the rewritten graph
runs eagerly, so the backward is MoK's own `mok::moe_bwd` through the op's registered autograd. That costs
one Dynamo trace per case instead of an Inductor compile (~20 s on two cores). AOTAutograd on rewritten
graphs is covered by tests/test_patterns_graphs.py (aot_eager) and tests/test_patterns_inductor.py (Inductor).

Checked per case: the counter equals the number of sparse MoE blocks; logits and every parameter gradient
match. fp32: relative Frobenius error <= 1e-4 against eager fp32. bf16: the compiled model's error against
an fp32 eager copy of the same weights is at most 2x eager bf16's own error (+1e-3), so the MoK path is no
worse than the PyTorch bf16 path it replaces.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import mok_inductor.lowering  # noqa: F401  (registers backend="mok")
from _pattern_models import MODELS, SEQ, VOCAB, build, loss_and_grads
from _helpers import rel_err

import transformers  # noqa: F401  (a pinned test dependency: its absence must fail, not skip)

MOK_EAGER = {"mok_inner": "eager"}


def _compiled(model):
    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    return torch.compile(model, backend="mok", options=MOK_EAGER, fullgraph=True)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", MODELS)
def test_model_fp32(name, impl):
    model, n_blocks = build(name, impl, torch.float32)
    ids = torch.randint(0, VOCAB, SEQ)
    ref, gref = loss_and_grads(model, ids)
    out, g = loss_and_grads(_compiled(model), ids)
    assert counters["mok_inductor"]["moe_replaced"] == n_blocks
    assert rel_err(out, ref) <= 1e-4
    for k in gref:
        assert rel_err(g[k], gref[k]) <= 1e-4, k


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", MODELS)
def test_model_bf16(name, impl):
    model, n_blocks = build(name, impl, torch.bfloat16)
    ids = torch.randint(0, VOCAB, SEQ)
    gold = copy.deepcopy(model).float()
    ref32, gref32 = loss_and_grads(gold, ids)
    ref, gref = loss_and_grads(model, ids)
    out, g = loss_and_grads(_compiled(model), ids)
    assert counters["mok_inductor"]["moe_replaced"] == n_blocks
    assert rel_err(out, ref32) <= 2 * rel_err(ref, ref32) + 1e-3
    for k in gref32:
        assert rel_err(g[k], gref32[k]) <= 2 * rel_err(gref[k], gref32[k]) + 1e-3, k


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_gpt_oss_model_fp32(impl):
    """A whole tiny GPT-OSS (attention sinks, router bias, experts with biases and GPT-OSS's gate): its one
    experts block becomes mok::moe(activation="gpt_oss"); logits and every gradient within 1e-4 of eager.
    (bf16 and the rewritten graph itself: test_patterns_graphs.py, test_gpt_oss_block_becomes_one_gpt_oss_moe.)"""
    model, n_blocks = build("gpt_oss", impl, torch.float32)
    ids = torch.randint(0, VOCAB, SEQ)
    ref, gref = loss_and_grads(model, ids)
    out, g = loss_and_grads(_compiled(model), ids)
    assert counters["mok_inductor"]["moe_replaced"] == n_blocks == 1
    assert rel_err(out, ref) <= 1e-4
    for k in gref:
        assert rel_err(g[k], gref[k]) <= 1e-4, k
