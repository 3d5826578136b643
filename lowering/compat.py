"""A post-grad graph fix-up for torch 2.11's handling of our Triton launches under dynamic shapes.

Inside compiled graphs our kernels are `triton_kernel_wrapper_functional` nodes (the launches are traced
through functionalization). Inductor decomposes each node that its reinplacing pass could not turn back into a
mutation (`decompose_triton_kernel_wrapper_functional`), and torch 2.11 does that through
`Match.replace_by_example`, which, for a node carrying `eager_input_vals`, traces the replacement twice (with the
eager and with the Inductor metadata) and asserts the two graphs have equally many nodes. With symbolic token
counts they do not (the second trace adds size nodes), so every `dynamic=True` compile of a MoK graph on CUDA
fails with a bare `AssertionError` on torch 2.11. Later torch versions propagate the
eager values of these nodes separately (`post_grad._propagate_triton_eager_input_vals`) and do not trip.

The fix: on a torch without that function, drop `eager_input_vals` from the functional nodes of OUR kernels
when the node has symbolic sizes, before the decomposition runs. The only other reader of the entry is the
layout constraint of user-defined Triton kernels, which without it constrains the inputs to the FX node's
strides (`constrain_to_fx_strides`): the strides our launch wrappers read when they were traced, so the
stride arguments baked into the launch stay right. Static-shape graphs, other kernels and newer torch are
left untouched. It runs from the post-grad custom pass (`mok_inductor.lowering.cache.CacheKeyPass`), which
Inductor calls before its reinplacing and decomposition passes.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def _needed() -> bool:
    try:
        from torch._inductor.fx_passes import post_grad
    except ImportError:  # pragma: no cover
        return False
    return not hasattr(post_grad, "_propagate_triton_eager_input_vals")


def _python_fn(kernel):
    """The Python function behind a (possibly autotuned/heuristics-wrapped) Triton kernel."""
    fn = kernel
    for _ in range(8):
        inner = getattr(fn, "fn", None)
        if inner is None:
            break
        fn = inner
    return fn


def is_mok_kernel(kernel) -> bool:
    return getattr(_python_fn(kernel), "__module__", "").startswith("mok_inductor.")


def _symbolic(values) -> bool:
    for v in pytree.tree_leaves(values):
        if isinstance(v, torch.SymInt):
            return True
        if isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride())):
            return True
    return False


def strip_eager_input_vals(graph: torch.fx.Graph, *, force: bool = False) -> int:
    """Drop `eager_input_vals` from our symbolic-shape functional Triton nodes (see the module docstring).
    Returns how many nodes were changed. `force` applies it on any torch version (for tests)."""
    if not (force or _needed()):
        return 0
    hop = getattr(torch.ops.higher_order, "triton_kernel_wrapper_functional", None)
    if hop is None:  # pragma: no cover
        return 0
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    changed = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not hop or "eager_input_vals" not in node.meta:
            continue
        idx = node.kwargs.get("kernel_idx")
        if idx is None or not is_mok_kernel(kernel_side_table.get_kernel(idx)):
            continue
        if not _symbolic(node.meta["eager_input_vals"]):
            continue
        del node.meta["eager_input_vals"]
        changed += 1
    return changed
