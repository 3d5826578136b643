"""Everything Inductor-facing, installed as `mok_inductor.lowering` (the repository's `lowering/` folder).

Modules:
    decompose    the decomposition of the `mok::` ops into their Triton launches while AOTAutograd traces
                 CUDA graphs, so Inductor copies our kernels into its generated code
    patterns     the graph pass that replaces MoE blocks of Dynamo's graph with one `mok::moe` call, and its
                 switch (`pre_grad_custom_pass`)
    match_hf     the matchers of transformers' "grouped_mm" and "batched_mm" experts backends
    match_titan  the matcher of a torchtitan-style grouped MoE
    match_shared the fusion of a shared expert (and its sigmoid gate) into a matched block
    _experts     what the grouped matchers share: the match record, the grouped-GEMM anchor, SwiGLU, routing
    _fx          helpers for reading Dynamo FX graphs without adding guards
    backend      `torch.compile(model, backend="mok")`: the pattern rewrite, then Inductor
    cache        the compile-cache key over the package's sources and options, and the pass-slot helpers
    compat       torch-version shims (a torch 2.11 post-grad fix-up for our dynamic-shape launches)

It imports `mok_inductor`, never the reverse at import time: `mok_inductor.enable()` imports this package
inside the function. Importing it registers the "mok" Dynamo backend name; nothing else changes until
`enable()`.
"""

from . import backend, cache, decompose, patterns

backend.register()


def install_graph_support() -> None:
    """Install what compiled graphs of the `mok::` ops need, for `enable()` and `backend="mok"` alike: the
    compile-cache key (Inductor looks the graph up with it) and the decomposition of the ops into their Triton
    launches. Idempotent; `disable()` removes both."""
    cache.install()
    decompose.install()


def enable() -> None:
    """Install the compile-cache key, the decomposition of the `mok::` ops into their Triton launches and the
    MoE graph pass; register transformers' "mok" experts backend when transformers is installed. Idempotent."""
    from ..integrations import transformers as _hf

    install_graph_support()
    patterns.enable()
    _hf.register_if_installed()


def disable() -> None:
    patterns.disable()
    decompose.uninstall()
    cache.uninstall()


def is_enabled() -> bool:
    return patterns.is_enabled()
