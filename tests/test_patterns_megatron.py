"""Megatron-Core's SequentialMLP and the pattern pass: pinned evidence that there is nothing to match yet.

The pass has no Megatron matcher because Dynamo does not capture SequentialMLP's routed-expert loop as one
graph (docs/patterns.md). These tests pin that claim on a real MCore MoELayer (built on CPU as
tests/test_megatron.py does: one-rank gloo group, allgather dispatcher, `Router.gating` patched, fp32, SiLU GLU
without biases, E=8, K=2, T=24):

- `torch._dynamo.explain` on the MoELayer and on SequentialMLP alone breaks the graph, for the documented
  reasons (`masked_select` in the dispatcher's permute, `warnings.warn` in every parallel Linear,
  `tokens_per_expert.tolist()` at the top of SequentialMLP.forward). A Dynamo or Megatron version that
  captures the loop fails here, with a message saying the matcher is due.
- `torch.compile(layer, backend="mok")` (graph breaks allowed; the pieces run through AOTAutograd) runs, equals eager in output and every
  gradient (fp32, 1e-5 relative), and replaces nothing: the counter stays 0 and no graph piece produced a
  "replaced" record or log line.
"""

from __future__ import annotations

import contextlib
import logging
import traceback

import pytest
import torch
from torch._dynamo.utils import counters

from mok_inductor.lowering import patterns  # (registers backend="mok")
from megatron.core.transformer.moe.experts import SequentialMLP

# the Megatron CPU recipe (module-scoped autouse fixture megatron_env: gloo, parallel_state, Router.gating)
from _helpers import rel_err
from test_megatron import B, E, H, S, build_layer, make_config, megatron_env  # noqa: F401

# The rewrite is the same whatever runs the rewritten pieces; AOTAutograd + eager instead of an Inductor compile
# of each of the ~16 pieces (forward and backward) keeps this at a few seconds instead of ~65 s on CPU.
MOK_AOT = {"mok_inner": "aot_eager"}
CAPTURED = "Dynamo now captures SequentialMLP: a Megatron matcher in lowering/ is due (docs/patterns.md)"


@contextlib.contextmanager
def _graph_break_log():
    """Collect Dynamo's `graph_breaks` artifact messages (each with the user-code traceback). Some breaks,
    e.g. the `.tolist()` one at the very start of a frame, appear there and in `counters["graph_break"]`
    but not in `explain(...).break_reasons`."""
    msgs: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            msgs.append(record.getMessage())

    names = [n for n in list(logging.Logger.manager.loggerDict) if n.endswith(".__graph_breaks")]
    assert names, "no graph_breaks artifact logger found in torch._dynamo"
    saved = []
    h = _Collect(level=logging.DEBUG)
    for n in names:
        lg = logging.getLogger(n)
        saved.append((lg, lg.level))
        lg.setLevel(logging.DEBUG)
        lg.addHandler(h)
    try:
        yield msgs
    finally:
        for lg, level in saved:
            lg.removeHandler(h)
            lg.setLevel(level)


def _explain(module, *args):
    """-> (ExplainOutput, one string of every break reason with its user-code stack)."""
    torch._dynamo.reset()
    counters["graph_break"].clear()
    with _graph_break_log() as logged:
        ex = torch._dynamo.explain(module)(*args)
    parts = [r.reason + "\n" + "".join(traceback.format_list(r.user_stack)) for r in ex.break_reasons]
    parts += list(counters["graph_break"]) + logged
    torch._dynamo.reset()
    return ex, "\n".join(parts)


def _layer():
    torch.manual_seed(0)
    return build_layer(make_config(torch.float32))


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _step(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out, bias = layer(x)
    assert bias is None
    out.backward(dy)
    grads = {k.replace("_orig_mod.", ""): p.grad.detach().clone() for k, p in layer.named_parameters()
             if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def test_dynamo_breaks_the_moe_layer_graph():
    layer = _layer()
    assert isinstance(layer.experts, SequentialMLP) and layer.experts.num_local_experts == E
    x, _ = _inputs(1)
    ex, reasons = _explain(layer, x)
    assert ex.graph_break_count > 0, CAPTURED
    # the permute's data-dependent token count, and the parallel Linears' warning when no tp_group is passed
    for needle in ("masked_select", "warn"):
        assert needle in reasons, f"{CAPTURED} (the {needle!r} break is gone)\n{reasons[:4000]}"


def test_dynamo_breaks_sequential_mlp_alone():
    layer = _layer()
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([3, 0, 5, 7, 2, 9, 4, 6])  # one expert empty, as routing produces
    n = int(counts.sum())
    tokens = torch.randn(n, H, generator=g)
    probs = torch.rand(n, generator=g)
    ex, reasons = _explain(layer.experts, tokens, counts, probs)
    assert ex.graph_break_count > 0, CAPTURED
    # `tokens_per_expert.tolist()`: a host sync Dynamo traces as aten._local_scalar_dense; then the warning
    assert "tolist" in reasons and "_local_scalar_dense" in reasons, f"{CAPTURED}\n{reasons[:4000]}"
    assert "warn" in reasons, f"{CAPTURED}\n{reasons[:4000]}"


def test_backend_mok_runs_the_broken_graph_and_replaces_nothing(monkeypatch, caplog):
    layer = _layer()
    x, dy = _inputs(3)
    ref_out, ref_dx, ref_grads = _step(layer, x, dy)

    records = []
    real_rewrite = patterns.rewrite
    monkeypatch.setattr(patterns, "rewrite", lambda graph: records.append(real_rewrite(graph)) or records[-1])
    torch._dynamo.reset()
    counters["mok_inductor"].clear()
    with caplog.at_level(logging.INFO, logger="mok_inductor.lowering.patterns"):
        out, dx, grads = _step(torch.compile(layer, backend="mok", options=MOK_AOT), x, dy)
    torch._dynamo.reset()

    assert len(records) > 1, f"the pass saw {len(records)} graph(s): is the layer one graph now? {CAPTURED}"
    assert counters["mok_inductor"]["moe_replaced"] == 0
    assert not any(r.replaced for recs in records for r in recs), [str(r) for recs in records for r in recs]
    assert not any(m.startswith("replaced") for m in caplog.messages), caplog.messages
    assert rel_err(out, ref_out) <= 1e-5
    assert rel_err(dx, ref_dx) <= 1e-5
    assert set(grads) == set(ref_grads) and len(grads) > 0
    for k in ref_grads:
        assert rel_err(grads[k], ref_grads[k]) <= 1e-5, k
