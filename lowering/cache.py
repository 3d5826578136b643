"""Compile-cache keying: Inductor's FX-graph cache and the AOTAutograd cache must miss when this package changes.

Neither cache hashes the Python code of a `torch.library.custom_op` (its impl, fake or autograd formula), so
an edited `mok::moe_fwd` fake or backward could silently reuse a stale compiled graph (shared/INDUCTOR.md,
trap 1). Both caches do hash the `uuid()` of every `CustomGraphPass` installed in `torch._inductor.config`
(`FxGraphHashDetails`, which `AOTAutogradCacheDetails` extends, in torch 2.11 through 2.13). So:

- `fingerprint()` is a sha256 of the package version and of the bytes of every `*.py` file under
  `mok_inductor/` and `lowering/` (paths relative to the package root, sorted);
- `install()` adds a `CacheKeyPass` (a no-op but for one torch 2.11 fix-up, see its docstring) whose `uuid()` is that fingerprint to
  `torch._inductor.config.post_grad_custom_post_pass`, keeping whatever pass was there (appended to a list
  on torch >= 2.12, chained in front of it in 2.11's single slot). It runs on every compile, so graphs that
  call `mok::moe` directly, without the pattern pass, are keyed too. `import mok_inductor` calls it, so every
  process that can build a MoK graph is keyed (`MOK_CACHE_KEY=0` skips it); `lowering` reaches this module
  as `lowering.cache`;
- the pattern pass (`lowering.patterns.MokPatternPass`) carries the same fingerprint in its own `uuid()`.

The key covers every compile in the process once installed (a changed package also invalidates graphs
without MoE blocks: harmless, and cheaper than deciding per graph). A chained pass without a `uuid()` makes
the chain's `uuid()` None, which bypasses the cache exactly as that pass alone would have.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Optional

import torch

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - torch < 2.6
    CustomGraphPass = object  # type: ignore[misc,assignment]

_ROOT = Path(__file__).resolve().parent.parent
SOURCE_PACKAGES = ("mok_inductor", "lowering")


def package_version() -> str:
    """The installed distribution's version, else `mok_inductor.__version__`."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("mok-inductor")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    import mok_inductor

    return getattr(mok_inductor, "__version__", "unknown")


def hashed_sources() -> list[Path]:
    """Every Python source file the compiled graphs may depend on, sorted."""
    files: list[Path] = []
    for pkg in SOURCE_PACKAGES:
        files.extend(p for p in (_ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(files)


def fingerprint(files: Optional[Iterable[Path]] = None, version: Optional[str] = None) -> str:
    """sha256 hex of the version and of (relative path, bytes) of each source file. Read afresh on each call
    (a few dozen small files) so an edited file changes it within a running process too."""
    h = hashlib.sha256()
    h.update(f"mok-inductor {version if version is not None else package_version()}\n".encode())
    h.update(f"torch {torch.__version__}\n".encode())
    for p in (hashed_sources() if files is None else files):
        p = Path(p)
        try:
            rel = p.resolve().relative_to(_ROOT)
        except ValueError:
            rel = p
        h.update(f"{rel.as_posix()}\n".encode())
        try:
            h.update(p.read_bytes())
        except OSError:
            h.update(b"<missing>")
        h.update(b"\n")
    return h.hexdigest()


def _call_all(passes, graph, *args, **kwargs):
    for p in passes:
        p(graph, *args, **kwargs)


def chained_uuid(mine: str, others) -> Optional[str]:
    """Our uuid combined with those of chained passes; None if any chained pass has none."""
    parts = [mine]
    for p in others:
        u = p.uuid() if isinstance(p, CustomGraphPass) else None
        if u is None:
            return None
        parts.append(repr(u))
    return "|".join(parts)


def as_tuple(p) -> tuple:
    if p is None:
        return ()
    if isinstance(p, (list, tuple)):
        return tuple(p)
    return (p,)


class CacheKeyPass(CustomGraphPass):
    """A post-grad pass whose uuid() keys the compile caches on this package. It changes nothing in a graph
    except, on torch 2.11, the metadata fix-up of `lowering.compat` for our dynamic-shape launches."""

    def __init__(self, chained=None):
        self.chained = chained  # 2.11 single slot: the pass that was there, run first
        self.previous = None  # the slot's value before install(), restored by uninstall()

    def __call__(self, graph, *args, **kwargs) -> None:
        _call_all(as_tuple(self.chained), graph, *args, **kwargs)
        # the one thing it does to graphs: torch 2.11's dynamic-shape fix-up for our Triton launches
        from .lowering.compat import strip_eager_input_vals

        strip_eager_input_vals(graph)

    def uuid(self) -> Optional[str]:
        return chained_uuid("mok-cache-key:" + fingerprint(), as_tuple(self.chained))


# ---------------------------------------------------------------------------------------------------
# custom-pass slots of torch._inductor.config: a list in 2.13, a single callable in 2.11


def slot_takes_lists() -> bool:
    """torch >= 2.12 accepts lists in the custom-pass slots (`get_custom_graph_passes`); 2.11 one callable."""
    try:
        from torch._inductor.custom_graph_pass import get_custom_graph_passes  # noqa: F401
    except ImportError:
        return False
    return True


def find_in_slot(value, cls):
    """Our pass of type `cls` in a slot value: the value itself, a list element, or down a `.chained` chain."""
    stack = list(as_tuple(value))
    while stack:
        p = stack.pop()
        if isinstance(p, cls):
            return p
        stack.extend(as_tuple(getattr(p, "chained", None)))
    return None


def add_to_slot(name: str, make):
    """Install `make(chained)` in config slot `name`, keeping what is there: appended to a list where lists
    are supported (torch then calls each pass its own way, e.g. inference-aware ones), else chained."""
    from torch._inductor import config

    cur = getattr(config, name)
    if slot_takes_lists():
        new = make(None)
        setattr(config, name, [*as_tuple(cur), new])
    else:
        new = make(cur)
        setattr(config, name, new)
    new.previous = cur
    return new


def remove_from_slot(name: str, cls) -> bool:
    """Undo `add_to_slot`: restore the previous value if the slot is as we left it, else drop only ours.
    Returns False when ours is buried under a pass chained on top of it (the caller then deactivates)."""
    from torch._inductor import config

    cur = getattr(config, name)
    ours = find_in_slot(cur, cls)
    if ours is None:
        return True
    if isinstance(cur, cls) or (isinstance(cur, list) and cur and cur[-1] is ours and len(cur) == len(as_tuple(ours.previous)) + 1):
        setattr(config, name, ours.previous)
        return True
    if isinstance(cur, (list, tuple)) and ours in cur:
        rest = [p for p in cur if p is not ours]
        setattr(config, name, rest or None)
        return True
    return False


def installed() -> Optional[CacheKeyPass]:
    from torch._inductor import config

    return find_in_slot(config.post_grad_custom_post_pass, CacheKeyPass)


def install() -> None:
    """Idempotent: add a CacheKeyPass to `post_grad_custom_post_pass`, keeping the passes already there."""
    if installed() is None:
        add_to_slot("post_grad_custom_post_pass", CacheKeyPass)


def uninstall() -> None:
    remove_from_slot("post_grad_custom_post_pass", CacheKeyPass)
