"""mok-inductor: a fused Mixture-of-Experts megakernel for PyTorch (Triton on CUDA, PyTorch on CPU).

    import mok_inductor
    y = mok_inductor.moe(x, router_weights, top_experts, gate_up_proj, down_proj, ...)

Layers: `api` (user API) -> `ops` (the torch.library `mok::` ops) -> `reference` (CPU path and
oracle) / `kernels` (Triton). Inductor integration lives in the top-level `lowering` package
(`enable()` imports it on demand) and model integrations under `mok_inductor.integrations`.
"""

import contextlib

from .api import moe
from .ops import path_name

__version__ = "0.1.0"


def enable() -> None:
    """Install the graph pass that replaces MoE blocks in torch.compile'd graphs with `mok::moe`."""
    from lowering import patterns

    patterns.enable()


def disable() -> None:
    """Remove the graph pass installed by `enable()` (other passes stay)."""
    from lowering import patterns

    patterns.disable()


@contextlib.contextmanager
def enabled():
    """`with mok_inductor.enabled(): ...` enables the graph pass for the block, then restores."""
    from lowering import patterns

    was = patterns.is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()


from .integrations import register_on_import as _register_on_import  # noqa: E402

_register_on_import()

import os as _os  # noqa: E402

if _os.environ.get("MOK_CACHE_KEY", "1") not in ("0", "false", "False"):
    # Inductor's FX-graph and AOTAutograd caches do not hash custom ops' Python code: key them on ours.
    from . import compile_cache as _compile_cache

    _compile_cache.install()

__all__ = ["moe", "path_name", "enable", "disable", "enabled", "__version__"]
