"""The pattern pass on CUDA (the H200; skipped without CUDA): real transformers models from tiny configs,
compiled with Inductor through `backend="mok"` and through `mok_inductor.enable()`, bf16 and fp32, with
transformers' "grouped_mm" and "batched_mm" experts backends. The replaced blocks run our Triton kernels
(their names appear in Inductor's output code, no `torch.ops.mok.*` fallback and no `_grouped_mm` left);
the counter equals the number of sparse MoE blocks; logits and every parameter gradient match eager (fp32:
1e-4 relative; bf16: at most 2x eager bf16's own error against an fp32 copy, +1e-3).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import lowering  # noqa: F401  (registers backend="mok")
import mok_inductor
from _pattern_models import SEQ, VOCAB, build, rel

import transformers  # noqa: F401  (a pinned test dependency)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = [
    ("qwen3_moe", "grouped_mm", torch.bfloat16),
    ("qwen2_moe", "grouped_mm", torch.bfloat16),  # shared expert + sigmoid gate fused into the same call
    ("mixtral", "batched_mm", torch.bfloat16),
    ("olmoe", "grouped_mm", torch.float32),
    ("glm4_moe", "batched_mm", torch.float32),
]


def _kernel_names():
    from mok_inductor.kernels import moe_bwd, moe_fwd, schedule

    return {n for m in (moe_fwd, moe_bwd, schedule) for n in dir(m) if n.endswith("_kernel")}


def _step(model, ids, dy):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    (logits * dy).sum().backward()
    grads = {k.replace("_orig_mod.", ""): p.grad.detach().clone() for k, p in model.named_parameters()
             if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("switch", ["backend", "enable"])
@pytest.mark.parametrize("name,impl,dtype", CASES, ids=[f"{n}-{i}-{str(d)[6:]}" for n, i, d in CASES])
def test_model_on_cuda(name, impl, dtype, switch):
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
    joined = "\n".join(codes)
    assert any(k in joined for k in _kernel_names()), "no mok Triton kernel in Inductor's output code"
    assert "torch.ops.mok.moe_fwd" not in joined and "torch.ops.mok.moe_bwd" not in joined
    assert "_grouped_mm" not in joined
    if dtype == torch.float32:
        assert rel(out, ref) <= 1e-4
        for k in gref:
            assert rel(grads[k], gref[k]) <= 1e-4, k
    else:
        assert rel(out, ref32) <= 2 * rel(ref, ref32) + 1e-3
        for k in gref32:
            assert rel(grads[k], gref32[k]) <= 2 * rel(gref[k], gref32[k]) + 1e-3, k
    torch._dynamo.reset()
