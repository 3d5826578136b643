"""mok-inductor: a fused Mixture-of-Experts megakernel for PyTorch (Triton on CUDA, PyTorch on CPU).

    import mok_inductor
    y = mok_inductor.moe(x, router_weights, top_experts, gate_up_proj, down_proj, ...)
    layer = mok_inductor.MoE(hidden_size, intermediate_size, num_experts, top_k)   # the same as an nn.Module
    mok_inductor.enable()        # what torch.compile'd graphs need (see `enable`)

Layers: `api` (user API; `module`, the same as an nn.Module) -> `ops` (the torch.library `mok::` ops) ->
`reference` (CPU path and oracle) / `kernels` (Triton). `options` holds every knob. Everything Inductor-facing is
`mok_inductor.lowering` (the repository's `lowering/` folder), imported by `enable()`, never at import;
model integrations live under `mok_inductor.integrations`. Importing this package registers the
`mok::` ops and changes nothing else.
"""

import contextlib

import torch

# Before any process group exists: torch.distributed.nn.functional's collectives bind the world group as a
# default argument when the module is first imported. torch._dynamo imports it, and expert parallelism's first
# call imports torch._dynamo; imported then, after init_process_group, it would keep the world group (and its
# gloo threads, which can abort the interpreter's shutdown) alive past destroy_process_group.
if torch.distributed.is_available():
    import torch.distributed.nn.functional  # noqa: F401

from . import options
from .api import moe
from .module import MoE
from .options import Options
from .ops import path_name

__version__ = "0.1.0"


def enable() -> None:
    """Install what torch.compile'd graphs need: the decomposition of the `mok::` ops into their Triton
    launches (so Inductor emits our kernels in its generated code), the compile-cache key over this
    package's sources and options, the graph pass that replaces MoE blocks with `mok::moe`, and the "mok"
    experts backend of transformers when transformers is installed. Idempotent; `disable()` undoes it."""
    from . import lowering

    lowering.enable()


def disable() -> None:
    """Undo `enable()` (passes installed by others stay)."""
    from . import lowering

    lowering.disable()


@contextlib.contextmanager
def enabled():
    """`with mok_inductor.enabled(): ...` enables for the block, then restores."""
    from . import lowering

    was = lowering.is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()


__all__ = ["moe", "MoE", "options", "Options", "path_name", "enable", "disable", "enabled", "__version__"]
