"""Everything Inductor-facing, installed as `mok_inductor.lowering`: the graph pass that swaps MoE blocks
for `mok::moe` (`patterns`, matchers in `match_*`), the `backend="mok"` compile backend (`backend`), the
compile-cache keying (`cache`) and torch-version shims (`compat`). Imports `mok_inductor`, never the
reverse at import time: `mok_inductor.enable()` imports this package inside the function.

Importing it registers the "mok" Dynamo backend name; nothing else changes until `enable()`.
"""

from . import backend, cache, patterns

backend.register()


def enable() -> None:
    """Install the compile-cache key and the MoE graph pass; register transformers' "mok" experts backend
    when transformers is installed. Idempotent."""
    from ..integrations import transformers as _hf

    cache.install()
    patterns.enable()
    _hf.register_if_installed()


def disable() -> None:
    patterns.disable()
    cache.uninstall()


def is_enabled() -> bool:
    return patterns.is_enabled()
