"""`torch.compile(model, backend="mok")`: the pattern rewrite on Dynamo's graph, then Inductor.

Registered twice, so the name resolves however this package is reached: the `torch_dynamo_backends` entry
point `mok = "mok_inductor.lowering.backend:mok_backend"` in pyproject.toml (found by torch once the package is
installed, e.g. `pip install -e .`), and `torch._dynamo.register_backend` when `mok_inductor.lowering` is
imported (by `mok_inductor.enable()`). A compile through it first installs what its graphs need and
`mok_inductor.enable()` would otherwise provide: the compile-cache key (`cache.install()`: Inductor looks the
graph up with it) and the decomposition of the `mok::` ops into their Triton launches (`decompose.install()`),
both process-wide until `mok_inductor.disable()`. The pattern pass itself runs here, not from the pre-grad slot.

Options (`torch.compile(..., backend="mok", options={...})`):
    "mok_inner": "inductor" (default) | "aot_eager" | "eager" — what runs the rewritten graph. "aot_eager"
        traces forward and backward with AOTAutograd and runs them eagerly: the same rewrite at a fraction of
        an Inductor compile (used by the test matrix); "eager" runs the rewritten Dynamo graph as is.
    anything else is passed to Inductor as config patches, as `backend="inductor"` would.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import patterns


def mok_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: Optional[str] = None,
                options: Optional[dict] = None, **kwargs: Any):
    options = dict(options or {})
    inner = options.pop("mok_inner", "inductor")
    from . import install_graph_support  # the package's; it imports this module before defining it

    install_graph_support()
    patterns.rewrite(gm.graph)
    gm.recompile()
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)
    if inner != "inductor":
        raise ValueError(f"mok_inner: expected 'inductor', 'aot_eager' or 'eager', got {inner!r}")
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {**(list_mode_options(mode) if mode else {}), **options}
    return compile_fx(gm, example_inputs, config_patches=patches or None, **kwargs)


def register() -> None:
    """Register "mok" with Dynamo unless it is registered or torch already found the entry point (then torch
    registers it itself when the name is first looked up, and registering here would be a duplicate)."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if "mok" in _COMPILER_FNS or _BACKENDS.get("mok") is not None:
        return
    register_backend(mok_backend, name="mok")
