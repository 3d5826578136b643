"""Everything Inductor-facing: the graph pass that swaps MoE blocks for `mok::moe` (`patterns`, matchers in
`match_*`), the `backend="mok"` compile backend (`backend`) and the compile-cache keying (`cache`, which is `mok_inductor.compile_cache`). Imports
`mok_inductor`, never the reverse at import time (`mok_inductor.enable()` imports this package inside the
function).

Importing this package registers the "mok" Dynamo backend and installs the cache-key pass (`cache.install`;
`MOK_CACHE_KEY=0` skips it). Nothing else changes until `mok_inductor.enable()` / `patterns.enable()`.
"""

import os as _os
import sys as _sys

# The cache keying lives in the op's package (every `import mok_inductor` installs it); it is
# `lowering.cache` here, the same module object.
from mok_inductor import compile_cache as cache

_sys.modules[__name__ + ".cache"] = cache

from . import backend, patterns  # noqa: E402,F401

backend.register()
if _os.environ.get("MOK_CACHE_KEY", "1") not in ("0", "false", "False"):
    cache.install()
