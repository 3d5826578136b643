"""Bitwise determinism (docs/semantics.md, the contract): the same inputs give bitwise identical outputs and gradients,
run after run (10 runs), on the CPU and, when present, on CUDA.

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E experts, K routes.
"""

import pytest
import torch

from _helpers import DEVICES, make_case, moe_with_grads, random_like

RUNS = 10


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t (so that NaN payloads and -0.0 compare too)."""
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", ["plain", "shared_gate_limit", "hot_expert"])
def test_bitwise_deterministic(device, dtype, config):
    # T=33, H=32, I=16, Is=24, E=6, K=3: several routes per expert, so the per-expert reductions of the
    # weight gradients sum many rows; "hot_expert" sends every route to one expert (the longest reduction)
    kw = dict(T=33, H=32, I=16, Is=24, E=6, K=3, dtype=dtype, device=device, drop=0.2, seed=31)
    if config == "shared_gate_limit":
        kw.update(shared=True, gate=True, limit=0.6)
    if config == "hot_expert":
        kw.update(kind="one")
    case = make_case(**kw)
    dy = random_like(case.x.detach(), 32)
    # every run gets fresh copies of the inputs (new allocations), as moe_with_grads clones them
    y0, g0 = moe_with_grads(case, dy)
    assert torch.isfinite(y0).all() and y0.abs().sum() > 0
    for run in range(1, RUNS):
        y, g = moe_with_grads(case, dy)
        assert torch.equal(_bits(y), _bits(y0)), f"run {run}: the output differs"
        for name in g0:
            assert torch.equal(_bits(g[name]), _bits(g0[name])), f"run {run}: d_{name} differs"

