"""The one place mok-inductor's knobs live: a frozen `Options`, read from the environment once.

    import mok_inductor
    mok_inductor.options.current()                    # the options in effect
    with mok_inductor.options.override(autotune=False):   # for a block (process-wide while it runs)
        y = mok_inductor.moe(...)
    y = mok_inductor.moe(..., options={"backend": "reference"})  # for one eager call
    mok_inductor.options.set_default(tma=False)       # for the rest of the process

Environment variables, read once when this module is imported (later changes to `os.environ` do not count):

    MOK_BACKEND=auto|reference|triton   `backend`
    MOK_AUTOTUNE=0|1                     `autotune`
    MOK_TABLES_DIR=path                  `tables_dir`
    MOK_TMA=0|1                          `tma`
    MOK_PATTERNS_LOG=0|1                 `log_patterns`

(A switch also takes true/false, yes/no, on/off, in any case; anything else is an error at import.)

Overrides are process-wide, not per thread: the autograd engine runs CUDA backward passes on its own
threads, and they must see the options the forward ran with. Kernels and ops read `current()` when they
run; torch.compile reads it while tracing, and the compile-cache key covers it (`mok_inductor.enable()`);
Dynamo guards a traced `mok_inductor.moe` on every option (`guard_in_trace`).
`TRITON_INTERPRET` is Triton's own switch; `INTERPRET` mirrors it for the code that must know.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Iterator, Mapping, Optional, Union

BACKENDS = ("auto", "reference", "triton")

# Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) runs the kernels on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclasses.dataclass(frozen=True)
class Options:
    """Every user-settable knob of mok-inductor.

    backend: which implementation runs the ops. "auto": the Triton kernels on CUDA tensors, the PyTorch
        reference (`mok_inductor.reference`) on CPU; "reference": always the reference; "triton": always the
        kernels (on CPU tensors only under TRITON_INTERPRET=1; without it a CPU tensor is a RuntimeError).
    autotune: search the tile configs at run time: the first launch of a kernel at a (problem, row bucket) the
        user's table lacks times every candidate config and records the fastest in that table (seconds per
        new shape, once per machine). False (the default) takes the configs of the tuned tables, shipped and
        the user's, and of their nearest shapes where no table has the problem (`mok_inductor.kernels.configs`;
        `python -m mok_inductor.tune` writes tables for a model).
    tables_dir: the folder of the user's tile-config tables, which take precedence over the shipped ones;
        None: $XDG_CACHE_HOME/mok_inductor/tables (~/.cache/mok_inductor/tables without XDG_CACHE_HOME).
    tma: let the grouped GEMMs load through TMA descriptors where the operands allow (Hopper).
    log_patterns: log every MoE block the graph pass replaces, and why it left others alone.

    Tuning thresholds (a count of routes per expert on average, T*K/E, unless said otherwise):
    mx_dequantize_min_rows: MXFP8 weights are dequantized once per call into a transient copy at this many
        routes per expert and more, and read by the GEMMs' K loops below it (decode: weight bytes dominate).
    mx_f16_dot_max_rows: up to this many, the MXFP8 K loops run on the fp16 tensor cores (decode).
    mx_few_rows: up to this many, MXFP8 launches that no table covers use the few-rows tile configs (counted
        on the launch's row bucket, the power of two above T*K: with E not a power of two it cuts in lower).
    two_pass_min_rows: at this many and more, the SwiGLU backward runs as a second pass after the
        down-projection's data-gradient GEMM instead of in its epilogue.
    tma_min_rows: the fewest rows per expert at which the TMA loads pay for their descriptors.
    decode_max_routes: eager calls that need no gradient with at most this many routes in all (T*K, and at most
        E; plain weights, not MXFP8 or split) run the decode forward: gate/up and down a route per program, then
        the combine, without the schedule (`mok_inductor.kernels.gemv`; 0: never). Decode steps are host-bound.
    """

    backend: str = "auto"
    autotune: bool = False
    tables_dir: Optional[str] = None
    tma: bool = True
    log_patterns: bool = False
    mx_dequantize_min_rows: int = 256
    mx_f16_dot_max_rows: int = 16
    mx_few_rows: int = 8
    two_pass_min_rows: int = 256
    tma_min_rows: int = 128
    decode_max_routes: int = 16

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"options.backend: expected one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.tables_dir is not None and not isinstance(self.tables_dir, (str, os.PathLike)):
            raise TypeError(f"options.tables_dir: expected a path or None, got {self.tables_dir!r}")
        if isinstance(self.tables_dir, os.PathLike):
            object.__setattr__(self, "tables_dir", os.fspath(self.tables_dir))
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(v, bool):
                raise TypeError(f"options.{f.name}: expected a bool, got {v!r}")
            if f.type in ("int", int) and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"options.{f.name}: expected a non-negative int, got {v!r}")

    def replace(self, **changes) -> "Options":
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ValueError(f"options: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)


_ENV = {"backend": "MOK_BACKEND", "autotune": "MOK_AUTOTUNE", "tma": "MOK_TMA", "log_patterns": "MOK_PATTERNS_LOG",
        "tables_dir": "MOK_TABLES_DIR"}
_STRINGS = ("backend", "tables_dir")
_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n", "")


def _env_bool(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{var}={raw!r}: expected 1/true/yes/on or 0/false/no/off (any case)")


def default_tables_dir(environ: Mapping[str, str] = os.environ):
    """$XDG_CACHE_HOME/mok_inductor/tables, or ~/.cache/mok_inductor/tables (the user's tile-config tables)."""
    from pathlib import Path

    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mok_inductor" / "tables"


def from_env(environ: Mapping[str, str] = os.environ) -> Options:
    """Options with the defaults overridden by the MOK_* variables set in `environ`."""
    changes = {}
    for name, var in _ENV.items():
        if var in environ:
            raw = environ[var]
            changes[name] = raw if name in _STRINGS else _env_bool(var, raw)
    try:
        return Options().replace(**changes)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{e} (from the environment: " +
                         ", ".join(f"{_ENV[k]}={environ[_ENV[k]]!r}" for k in changes) + ")") from None


_lock = threading.Lock()
_default = from_env()
DEFAULT_TABLES_DIR = default_tables_dir()  # (where `tables_dir` is None)
_stack: list = []


def current() -> Options:
    """The options in effect: the innermost `override`, else the process default."""
    stack = _stack
    return stack[-1] if stack else _default


def _resolve(opts: Union[None, Options, Mapping], changes: dict) -> Options:
    base = current()
    if isinstance(opts, Options):
        base = opts
    elif isinstance(opts, Mapping):
        changes = {**opts, **changes}
    elif opts is not None:
        raise TypeError(f"options: expected an Options or a dict of option changes, got {type(opts).__name__}")
    return base.replace(**changes) if changes else base


@contextlib.contextmanager
def override(opts: Union[None, Options, Mapping] = None, **changes) -> Iterator[Options]:
    """Use `opts` (an Options, or a dict of changes) and/or the keyword changes for the block."""
    new = _resolve(opts, changes)
    with _lock:
        _stack.append(new)
    try:
        yield new
    finally:
        with _lock:  # by identity: an equal Options pushed by another block is not this one
            del _stack[max(i for i, o in enumerate(_stack) if o is new)]


_DEFAULTS = Options()
_NAMES = tuple(f.name for f in dataclasses.fields(Options))


def guard_in_trace() -> None:
    """Called where Dynamo traces (`mok_inductor.moe`): each option's value compared, one by one (a tuple
    comparison would stop at the first difference), makes Dynamo guard the compiled frame on every value, so
    a call under other options (an `override` around the compiled function, a `set_default`) compiles again
    instead of running a graph whose kernels, tile configs and decomposition were chosen under the old ones.
    A no-op when run eagerly."""
    opts = current()
    for name in _NAMES:
        if getattr(opts, name) == getattr(_DEFAULTS, name):
            pass


def set_default(opts: Optional[Options] = None, **changes) -> Options:
    """Change the process default (what `current()` gives outside any `override`); returns the new one."""
    global _default
    with _lock:
        _default = (opts or _default).replace(**changes)
        return _default
