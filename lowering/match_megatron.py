"""Megatron-Core SequentialMLP: why there is no matcher (megatron-core 0.16.1, torch 2.13, CPU; 2026-12-02).

The routed-expert loop of `megatron.core.transformer.moe.experts.SequentialMLP` is not captured by Dynamo
as one graph, so there is nothing for a pre-grad pass to rewrite. Evidence (module built on CPU per
shared/MEGATRON.md 3.3/3.4: gloo world of 1, allgather dispatcher, `Router.gating` patched, SiLU GLU,
no bias, fp32; `torch._dynamo.explain` and `torch.compile(fullgraph=True, backend="eager")`):

1. `MoELayer` (router + allgather dispatcher + SequentialMLP): 16 graphs, 15 graph breaks. Reasons:
   - "Dynamic shape operator: aten.masked_select.default" in `moe_utils.permute` (line 369) and
     `token_dispatcher.dispatch_postprocess` (line 304): the permuted token count depends on the routing;
   - "Attempted to call function marked as skipped: _warnings.warn" in
     `utils.get_tensor_model_parallel_group_if_none` (line 501), reached from every
     Column/RowParallelLinear forward when no `tp_group` is passed.
   `fullgraph=True` fails on the first of them.
2. `SequentialMLP` alone (permuted tokens, `tokens_per_expert`, probs), even with
   `capture_scalar_outputs=True`, `capture_dynamic_output_shape_ops=True` and `warnings.warn` added to
   `reorderable_logging_functions`: 6 graphs, 5 breaks — "attempted to reorder a debugging function that
   can't actually be reordered" (the warning's category argument) at the same line, inside
   `linear_fc2` -> `linear_with_grad_accumulation_and_async_allreduce`. Its forward also starts with
   `tokens_per_expert.tolist()` (a host sync: E unbacked sizes for `torch.split`). With Dynamo's defaults it
   gives 9 graphs, 8 breaks: the `.tolist()` break ("Data dependent operator: aten._local_scalar_dense",
   reported in the `graph_breaks` log and `counters["graph_break"]`, not in `explain().break_reasons`), then
   the `warnings.warn` one, which falls inside the expert loop ("graph break in loop": the loop's frame runs
   eagerly).
3. Even a captured loop would not be enough: SequentialMLP receives tokens already permuted by the token
   dispatcher, so the graph holds neither `x [T, H]` nor `top_experts [T, K]`; a replacement would have to
   match the dispatcher and the combine too, across the breaks above.

Pinned by tests/test_patterns_megatron.py: `explain` on MoELayer and on SequentialMLP must still show these
breaks (a version that captures the loop fails there, saying this matcher is due), and
`torch.compile(layer, backend="mok")` must run the broken graph equal to eager with nothing replaced.

Megatron models reach MoK through the Megatron integration instead (the MoK backend of
`mok_inductor.integrations` / `mok_inductor.runtime`, an explicit module swap), which also keeps Megatron's
main-grad accumulation. `find` stays as the hook where a matcher goes once Megatron's graph is capturable.
"""

from __future__ import annotations


def find(graph):
    """-> iterable of (MoEMatch or None, MatchRecord or None). Nothing to match yet (see the module docstring)."""
    return []
