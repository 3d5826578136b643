"""Compile-cache keying: Inductor's FX-graph cache and the AOTAutograd cache must miss when this package changes.

Neither cache hashes the Python code of a `torch.library.custom_op` (its impl, fake or autograd formula), so
an edited `mok::moe_fwd` fake or backward could silently reuse a stale compiled graph. Both caches do hash the
`uuid()` of every `CustomGraphPass` installed in `torch._inductor.config` (`FxGraphHashDetails`, which
`AOTAutogradCacheDetails` extends, in torch 2.11 through 2.13). So:

- `fingerprint()` is a sha256 of the package and torch versions, of `mok_inductor.options.current()` (the
  options decide what the traced graphs contain: which kernels, tile configs and TMA loads) and of the bytes
  of every source file of `mok_inductor` and `mok_inductor.lowering`, found from the imported packages'
  `__path__` (so it holds for an editable install, where `lowering/` is a folder of its own, and for a wheel,
  where it sits inside `mok_inductor/`);
- `install()` adds a `CacheKeyPass` (a no-op but for one torch 2.11 fix-up, see its docstring) whose `uuid()`
  is that fingerprint to `torch._inductor.config.post_grad_custom_post_pass`, keeping whatever pass was there
  (appended to a list on torch >= 2.12, chained in front of it in 2.11's single slot). It runs on every
  compile, so graphs that call `mok::moe` directly, without the pattern pass, are keyed too.
  `mok_inductor.enable()` installs it (and `backend="mok"` does for its own compiles); importing the package
  does not, so a process that compiles MoK graphs through `backend="inductor"` must call `enable()`;
- the pattern pass (`patterns.MokPatternPass`) carries the same fingerprint in its own `uuid()`.

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

# The packages whose files the compiled graphs depend on, innermost first: a wheel nests lowering inside
# mok_inductor, and each file is counted once, under the innermost package that holds it.
SOURCE_PACKAGES = ("mok_inductor.lowering", "mok_inductor")
SOURCE_SUFFIXES = (".py", ".json")  # the files hashed into the cache key (.json: the shipped tile configs)


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


def package_roots() -> list[tuple[str, Path]]:
    """(package name, folder) for each folder of each source package's `__path__`, innermost package first."""
    import importlib

    roots = []
    for name in SOURCE_PACKAGES:
        for folder in importlib.import_module(name).__path__:
            roots.append((name, Path(folder).resolve()))
    return roots


def _sources_with_names() -> dict[Path, str]:
    """{resolved file: its name in the key, "<package>/<path inside the package folder>"}."""
    found: dict[Path, str] = {}
    for name, root in package_roots():
        for p in root.rglob("*"):
            if p.suffix not in SOURCE_SUFFIXES or "__pycache__" in p.parts or not p.is_file():
                continue
            found.setdefault(p.resolve(), f"{name}/{p.relative_to(root).as_posix()}")
    return found


def hashed_sources() -> list[Path]:
    """Every source file the compiled graphs may depend on, each once, in the order of their names in the key
    (which do not depend on where the packages are installed)."""
    names = _sources_with_names()
    return sorted(names, key=names.__getitem__)


def options_key() -> str:
    """The options in effect, as they enter the key."""
    from .. import options

    return repr(options.current())


def user_tables() -> list[Path]:
    """The user's tile-config tables (`options.tables_dir`): the configs of traced launches come from them."""
    from ..kernels import configs

    folder = configs.user_dir()
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def fingerprint(files: Optional[Iterable[Path]] = None, version: Optional[str] = None) -> str:
    """sha256 hex of the versions, the options in effect, (name, bytes) of each source file and of the user's
    tile-config tables. Read afresh on each call (a few dozen small files) so an edited file, table or a
    changed option changes it within a running process too."""
    h = hashlib.sha256()
    h.update(f"mok-inductor {version if version is not None else package_version()}\n".encode())
    h.update(f"torch {torch.__version__}\n".encode())
    h.update(f"options {options_key()}\n".encode())
    for p in user_tables():
        h.update(f"user table {p.name}\n".encode())
        try:
            h.update(p.read_bytes())
        except OSError:
            h.update(b"<missing>")
    names = _sources_with_names()
    for p in (hashed_sources() if files is None else files):
        p = Path(p)
        h.update(f"{names.get(p.resolve(), p.as_posix())}\n".encode())
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
    except, on torch 2.11, the metadata fix-up of `compat` for our dynamic-shape launches."""

    def __init__(self, chained=None):
        self.chained = chained  # 2.11 single slot: the pass that was there, run first
        self.previous = None  # the slot's value before install(), restored by uninstall()

    def __call__(self, graph, *args, **kwargs) -> None:
        _call_all(as_tuple(self.chained), graph, *args, **kwargs)
        # the one thing it does to graphs: torch 2.11's dynamic-shape fix-up for our Triton launches
        from .compat import strip_eager_input_vals

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
