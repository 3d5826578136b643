"""The decomposition of the `mok::` ops into their Triton launches while AOTAutograd traces CUDA graphs.

Under torch.compile, AOTAutograd functionalizes the graph under a `FunctionalTensorMode`. The rule installed
here runs mok::schedule, mok::moe_fwd and mok::moe_bwd's implementations inside that mode when their tensors
are on CUDA and the Triton backend is chosen (`mok_inductor.ops.use_triton`): the graph then holds the
Triton kernel launches themselves, and Inductor copies our kernels into its generated code (as
`torch.library.triton_op` does) instead of calling an opaque op. Elsewhere (CPU, backend "reference") the
ops stay opaque and the compiled graph calls them.

A graph traced with a symbolic size (torch.compile with a dynamic token count) keeps the ops opaque too: the
kernels' tile configs come from tables keyed on a bucket of the row count (`mok_inductor.kernels.configs`),
and only the op's implementation, running at each call, knows the bucket; inlined, the launches would run one
config for every token count. So does a call whose eager launches would load through TMA descriptors (enough
rows per expert, `options.tma_min_rows`): traced launches load by pointers, slower at those sizes, so the
compiled graph runs the eager kernels there; it inlines where eager loads by pointers too (decode, small
prefill), which saves the launches' host work. torch.export inlines them anyway (a deployed package must hold its kernels),
with the configs of the traced example's row counts.

`install()` registers the rule on a library fragment of its own, so `uninstall()` can take it away;
`mok_inductor.lowering.enable()` / `disable()` call them. Without it the ops work the same, opaque in
compiled graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import ops, options

_OPS = (("schedule", ops.schedule_impl), ("moe_fwd", ops.moe_fwd_impl), ("moe_bwd", ops.moe_bwd_impl))
_X = {"moe_fwd": 0, "moe_bwd": 1}  # where x sits in the op's arguments (then router_weights, top_experts, the
# schedule's three tensors, the routed weights, shared_gate_up_proj)
_lib: Optional[torch.library.Library] = None


def _rule(name, impl):
    def rule(mode, func, types, args, kwargs):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        if any(t not in (Tensor, FakeTensor, FunctionalTensor) for t in types):
            return NotImplemented
        first = args[0]
        if first.device.type == "cuda" and ops.use_triton(first) and (torch.compiler.is_exporting() or (
                not _symbolic(args, kwargs) and not _eager_uses_tma(name, args))):
            with mode:
                return impl(*args, **kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    return rule


def _eager_uses_tma(name: str, args) -> bool:
    """Whether an eager call with these (static) sizes loads some operand through TMA descriptors
    (`kernels.operands.tma_eligible`: 16-bit activations, `options.tma`, at least `options.tma_min_rows` rows per
    expert, the routed experts' or the shared expert's). Traced launches cannot (they load by pointers), and
    the tables' configs at those row counts are the TMA launches' picks, so such a call stays opaque and runs
    the eager kernels with their configs; below the threshold eager loads by pointers too and inlining saves
    the host work of the launches (decode)."""
    i = _X.get(name)
    opts = options.current()
    if i is None or not opts.tma:
        return False
    x, top_experts, expert_offsets, shared = args[i], args[i + 2], args[i + 4], args[i + 8]
    if x.element_size() != 2:
        return False
    T, K = top_experts.shape
    E = expert_offsets.shape[0] - 1
    return T * K >= opts.tma_min_rows * max(E, 1) or (shared is not None and T >= opts.tma_min_rows)


def _symbolic(args, kwargs) -> bool:
    """Whether a tensor argument has a symbolic size."""
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, Tensor) and any(isinstance(s, torch.SymInt) for s in t.shape):
                return True
    return False


def install() -> None:
    """Register the decomposition rule of every `mok::` op that launches kernels. Idempotent."""
    global _lib
    if _lib is not None:
        return
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    lib = torch.library.Library("mok", "FRAGMENT")
    for name, impl in _OPS:
        torch.library.register_torch_dispatch(f"mok::{name}", FunctionalTensorMode, _rule(name, impl), lib=lib)
    _lib = lib


def uninstall() -> None:
    """Remove the rules `install` registered."""
    global _lib
    if _lib is not None:
        _lib._destroy()
        _lib = None


def is_installed() -> bool:
    return _lib is not None
