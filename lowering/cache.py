"""Compile-cache keying: Inductor's FX-graph cache and the AOTAutograd cache must miss when this package changes.

Neither cache hashes the Python code of a `torch.library.custom_op` (its impl, fake or autograd formula), so
an edited `mok::moe_fwd` fake or backward could silently reuse a stale compiled graph (shared/INDUCTOR.md,
trap 1). Both caches do hash the `uuid()` of every `CustomGraphPass` installed in `torch._inductor.config`
(`FxGraphHashDetails`, which `AOTAutogradCacheDetails` extends, in torch 2.11 through 2.13). So:

- `fingerprint()` is a sha256 of the package version and of the bytes of every `*.py` file under
  `mok_inductor/` and `lowering/` (paths relative to the package root, sorted);
- `install()` puts a no-op `CacheKeyPass` whose `uuid()` is that fingerprint into
  `torch._inductor.config.post_grad_custom_post_pass`, chaining whatever pass was there (2.11 has a single
  slot). It runs on every compile, so graphs that call `mok::moe` directly, without the pattern pass, are keyed
  too. `import lowering` calls it (so do `mok_inductor.enable()` and `backend="mok"`);
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
    """A post-grad pass that changes nothing; its uuid() keys the compile caches on this package."""

    def __init__(self, chained=None):
        self.chained = chained  # the object that was in the slot (kept as is, to restore it)

    def __call__(self, graph, *args, **kwargs) -> None:
        _call_all(as_tuple(self.chained), graph, *args, **kwargs)

    def uuid(self) -> Optional[str]:
        return chained_uuid("mok-cache-key:" + fingerprint(), as_tuple(self.chained))


def installed() -> Optional[CacheKeyPass]:
    from torch._inductor import config

    cur = config.post_grad_custom_post_pass
    return cur if isinstance(cur, CacheKeyPass) else None


def install() -> None:
    """Idempotent: put a CacheKeyPass on top of `post_grad_custom_post_pass`, chaining what was there."""
    from torch._inductor import config

    if installed() is None:
        config.post_grad_custom_post_pass = CacheKeyPass(config.post_grad_custom_post_pass)


def uninstall() -> None:
    from torch._inductor import config

    cur = installed()
    if cur is not None:
        config.post_grad_custom_post_pass = cur.chained

