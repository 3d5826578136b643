"""Tile configs of the tuned kernel families: tables, the fallback heuristic, and the opt-in run-time search.

A tuned kernel family (`Family`: the grouped GEMMs, the fused SwiGLU backward, the weight gradient) takes its
tile config (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from a table keyed on

- the problem: the family's `fields` (the dtype, the GEMM's sizes, and the flags that select a variant whose
  costs differ: TMA loads, MXFP8 weights read in the K loop, two-operand or scattering launches, ...; variants
  that only change the epilogue or the weights' layout, such as the activation, biases or GPT-OSS's interleaved
  gate/up, share their plain problem's picks), and
- the bucket of its row count: the smallest power of two >= rows (bucket b holds rows in (b/2, b]).

Tables are JSON files, one per GPU name (`table_name`): the ones shipped in `kernels/tables/` and the user's in
`options.tables_dir` (written by `python -m mok_inductor.tune` and by the run-time search), which take
precedence. A GPU without a table of its own name uses a shipped table of the same compute capability.
A problem no table holds takes the configs of the nearest problem of the same family and flags in those tables
(sizes compared on a log scale), at the bucket nearest in rows per expert; with no tables at all, the family's
`default` (its first candidate; `small` at few rows per expert where the family has one).

A user's table overrides the shipped ones pick by pick: a (problem, bucket) it holds wins, the shipped
tables still answer the buckets it lacks.

With `options.autotune`, an eager launch whose (problem, bucket) the user's table lacks times every candidate on
scratch copies of the outputs, runs the fastest and records it in the user's table (so later processes
read it like a tuned table). Launches that cannot search (in compiled graphs) take the tables as without it.

Stage families (`stage`) use the same tables to pick how a whole stage runs (the fused Triton kernel, or
`torch._grouped_mm` and an elementwise pass), by name, searched like the tiles.

Every config a table names must be one of its family's `candidates` (the configs the kernels are tested and
tuned with): anything else is an error when the table is loaded, not a silent fallback. Row counts never
specialise a kernel (`do_not_specialize`), so a new token count compiles nothing once its bucket's
configs have compiled.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
import re
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import options
from ..options import INTERPRET

FORMAT = "mok-inductor/tile-configs/1"
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"


@dataclasses.dataclass(frozen=True)
class Tile:
    """One tile config; or, named (`stage`), one way of running a stage (a stage family's candidates)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    name: str = ""

    @property
    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k}

    @functools.cached_property
    def launch_kwargs(self) -> dict:
        """The launch's meta-parameters (built once: eager decode launches are host-bound; do not modify)."""
        return {**self.meta, "num_warps": self.num_warps, "num_stages": self.num_stages}

    def as_list(self):
        """The table's form: [BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages], or a stage's name."""
        return self.name or [self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages]

    def triton_config(self):
        import triton

        return triton.Config(self.meta, num_warps=self.num_warps, num_stages=self.num_stages)


class Family:
    """A tuned kernel: its jitted function, the candidate configs (first: the pick at large training shapes),
    the problem `fields` (the first is always "dtype"; `sizes` name the GEMM sizes among them, compared on a
    log scale by the heuristic; the other fields select kernel variants and must match), the
    arguments it writes (`outputs`, searched on scratch copies), the interpreter's one config, an optional
    `small` config for launches at few rows per expert, and an eager `pre_hook(nargs)` run before each launch
    (host TMA descriptors take their block shapes from the config).

    A stage family (`stage`: fn None) picks how a whole stage runs instead, its candidates named `Tile`s (the
    first: the fused Triton kernel); it answers only from its own problem's pick of the row bucket (a way
    measured faster at one shape or row count says nothing of another), else its first candidate."""

    def __init__(self, name: str, fn, candidates: list, *, fields: tuple, sizes: tuple, outputs: tuple,
                 interpret: Tile, small: Optional[Tile] = None, pre_hook: Optional[Callable] = None,
                 field_defaults: Optional[dict] = None):
        assert fields[0] == "dtype" and set(sizes) <= set(fields[1:]), (fields, sizes)
        assert (fn is None) == all(c.name for c in candidates), (name, candidates)
        # fields added after tables were written: a table entry without one reads as this value
        self.field_defaults = dict(field_defaults or {})
        assert set(self.field_defaults) <= set(fields) - set(sizes) - {"dtype"}, (name, field_defaults)
        assert small is None or small in candidates, (name, small)
        self.name, self.fn, self.candidates, self.sizes = name, fn, tuple(candidates), tuple(sizes)
        self.fields, self.outputs, self.interpret, self.small, self.pre_hook = fields, outputs, interpret, small, pre_hook
        arg_names = list(fn.arg_names) if fn is not None else []
        self.output_positions = tuple(arg_names.index(n) for n in outputs)
        self.arg_names = arg_names
        self._all = None

    def default(self, rows: int, experts: int) -> Tile:
        """The config without any table: `small` at up to `options.mx_few_rows` rows per expert, else the first
    (`lookup` asks with the row bucket, so that one bucket has one config)."""
        if self.small is not None and rows <= options.current().mx_few_rows * max(experts, 1):
            return self.small
        return self.candidates[0]

    @property
    def autotune_key(self) -> list:
        """The kernel arguments `autotuned`'s Triton autotuner searches per value of, where it runs as it is
        (Inductor's max-autotune takes only its configs and benchmarks each launch of the graph itself): the
        problem's sizes and variant flags, and the MXFP8 operand flags (never the row count)."""
        return [n for n in self.arg_names if n in self.fields or n.startswith("MX")]

    def autotuned(self):
        """The kernel with every candidate as a `triton.autotune` config (for Inductor's max-autotune), keyed on
        `autotune_key` (and the argument dtypes, as Triton keys them)."""
        if self._all is None:
            import triton

            self._all = triton.autotune(configs=[c.triton_config() for c in self.candidates],
                                        key=self.autotune_key)(self.fn)
        return self._all

    @property
    def is_stage(self) -> bool:
        return self.fn is None

    def __repr__(self):
        return f"Family({self.name})"


def stage(name: str, *, fields: tuple, sizes: tuple, ways: tuple) -> Family:
    """A stage family: `ways` the names of the ways a stage can run, the first its fused Triton kernel (the
    default, and the interpreter's)."""
    candidates = [Tile(0, 0, 0, 0, 0, w) for w in ways]
    return Family(name, None, candidates, fields=fields, sizes=sizes, outputs=(), interpret=candidates[0])


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    assert family.name not in FAMILIES, family.name
    FAMILIES[family.name] = family
    return family


def bucket(rows: int) -> int:
    """The row bucket of `rows`: the smallest power of two >= max(rows, 1)."""
    rows = max(int(rows), 1)
    return 1 << (rows - 1).bit_length()


def table_name(device_name: str) -> str:
    """The file stem of a GPU's table: its name in lower case, runs of other characters as '-'."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Table files


class Table:
    """{family name: {problem tuple: {bucket: Tile}}} with the file's device facts."""

    def __init__(self, device: str = "", capability: str = "", entries: Optional[dict] = None, source: str = ""):
        self.device, self.capability, self.source = device, capability, source
        self.entries: dict = entries if entries is not None else {}

    def get(self, family: str, problem: tuple) -> Optional[dict]:
        return self.entries.get(family, {}).get(problem)

    def put(self, family: str, problem: tuple, bkt: int, tile: Tile) -> None:
        self.entries.setdefault(family, {}).setdefault(problem, {})[bkt] = tile

    def merge(self, other: "Table", replace: bool = True) -> int:
        """Add `other`'s picks (replacing this table's for the same problem and bucket, or with replace=False
        only where this one has none); -> the picks taken."""
        n = 0
        for fam, problems in other.entries.items():
            for prob, per in problems.items():
                for b, tile in per.items():
                    if replace or b not in (self.get(fam, prob) or {}):
                        self.put(fam, prob, b, tile)
                        n += 1
        return n

    def to_json(self) -> dict:
        out = {"format": FORMAT, "device": self.device, "capability": self.capability, "families": {}}
        for name in sorted(self.entries):
            fields = FAMILIES[name].fields
            rows = []
            defaults = FAMILIES[name].field_defaults
            for problem in sorted(self.entries[name], key=repr):
                per = self.entries[name][problem]
                # (a field at its default is left out: tables stay readable by versions before the field)
                raw = {f: v for f, v in zip(fields, problem) if f not in defaults or v != defaults[f]}
                rows.append({"problem": raw,
                             "configs": {str(b): per[b].as_list() for b in sorted(per)}})
            out["families"][name] = rows
        return out


class TableError(ValueError):
    pass


_DTYPES = ("bfloat16", "float16", "float32")  # the activation dtypes the kernels take


def _problem_from_json(family: Family, raw, where: str) -> tuple:
    if isinstance(raw, dict):
        raw = {**{f: v for f, v in family.field_defaults.items() if f not in raw}, **raw}
    if not isinstance(raw, dict) or set(raw) != set(family.fields):
        raise TableError(f"{where}: problem must have exactly the fields {list(family.fields)}, got {raw!r}")
    values = []
    for f in family.fields:
        v = raw[f]
        if f == "dtype":
            if v not in _DTYPES:
                raise TableError(f"{where}: dtype {v!r} is not one the kernels take ({', '.join(_DTYPES)})")
        elif f in family.sizes:
            if type(v) is not int or v < 1:
                raise TableError(f"{where}: size {f!r} must be a positive int, got {v!r}")
        elif f == "MX_LOOP":
            if type(v) is not int or v not in _MX_LOOPS:
                raise TableError(f"{where}: MX_LOOP must be one of {list(_MX_LOOPS)} (the fp16 K loops), got {v!r}")
        elif type(v) is not bool:
            raise TableError(f"{where}: flag {f!r} must be true or false, got {v!r}")
        values.append(v)
    return tuple(values)


_MX_LOOPS = (1, 2)  # mx_loop.MxLoop.F16, F16_WORDS: the loops the `_mx` families run (checked by the tests)


def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise TableError(f"the key {k!r} appears twice in one object")
        out[k] = v
    return out


def parse(data, source: str = "<table>") -> Table:
    """A validated `Table` from the parsed JSON of a table file; `TableError` naming `source` and the entry on
    anything malformed, an unknown family, or a config that is not one of its family's candidates."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(f"{source}: not a tile-config table (expected \"format\": {FORMAT!r})")
    families = data.get("families")
    if not isinstance(families, dict):
        raise TableError(f"{source}: \"families\" must be an object")
    table = Table(str(data.get("device") or ""), str(data.get("capability") or ""), source=source)
    for name, rows in families.items():
        family = FAMILIES.get(name)
        if family is None:
            raise TableError(f"{source}: unknown kernel family {name!r} (known: {', '.join(sorted(FAMILIES))})")
        if not isinstance(rows, list):
            raise TableError(f"{source}: family {name!r} must hold a list of entries")
        for i, row in enumerate(rows):
            where = f"{source}: {name}[{i}]"
            if not isinstance(row, dict) or set(row) != {"problem", "configs"}:
                raise TableError(f"{where}: an entry is {{\"problem\": ..., \"configs\": ...}}")
            problem = _problem_from_json(family, row["problem"], where)
            if table.get(name, problem) is not None:
                raise TableError(f"{where}: problem {dict(zip(family.fields, problem))} has an earlier entry")
            configs = row["configs"]
            if not isinstance(configs, dict) or not configs:
                raise TableError(f"{where}: \"configs\" must map row buckets to configs")
            for key, value in configs.items():
                if not re.fullmatch(r"[1-9][0-9]*", key) or int(key) & (int(key) - 1):
                    raise TableError(f"{where}: row bucket {key!r} is not a power of two (decimal digits)")
                if family.is_stage:
                    tile = next((c for c in family.candidates if c.name == value), None)
                    if tile is None:
                        raise TableError(f"{where}: bucket {key}: {value!r} is not a way the {name} stage runs "
                                         f"({', '.join(repr(c.name) for c in family.candidates)})")
                    table.put(name, problem, int(key), tile)
                    continue
                if not (isinstance(value, list) and len(value) == 5 and all(type(v) is int for v in value)):
                    raise TableError(f"{where}: bucket {key}: a config is [BLOCK_M, BLOCK_N, BLOCK_K, num_warps, "
                                     f"num_stages], got {value!r}")
                tile = Tile(*value)
                if tile not in family.candidates:
                    raise TableError(f"{where}: bucket {key}: {value} is not a config the {name} kernel takes "
                                     f"(its candidates: {[c.as_list() for c in family.candidates]})")
                table.put(name, problem, int(key), tile)
    return table


def load(path) -> Table:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TableError(f"{path}: not valid JSON text ({e})") from None
    except TableError as e:
        raise TableError(f"{path}: {e}") from None
    return parse(data, str(path))


def save(table: Table, path) -> None:
    """Write `table` to `path` atomically (a temporary file renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(dumps(table))
    os.replace(tmp, path)


def dumps(table: Table) -> str:
    """The JSON text of `table`: indented, with each config list on its bucket's line (a diff of two tables
    shows one line per changed pick)."""
    text = json.dumps(table.to_json(), indent=1)
    return re.sub(r"\[\s*(-?\d+),\s*(-?\d+),\s*(-?\d+),\s*(-?\d+),\s*(-?\d+)\s*\]",
                  lambda m: "[" + ", ".join(m.groups()) + "]", text) + "\n"


def shipped_tables() -> list[Path]:
    return sorted(SHIPPED_DIR.glob("*.json"))


def user_dir(opts=None) -> Path:
    """The user's table folder: `options.tables_dir`, else $XDG_CACHE_HOME (or ~/.cache)/mok_inductor/tables."""
    opts = opts or options.current()
    if opts.tables_dir:
        return Path(opts.tables_dir).expanduser()
    return options.DEFAULT_TABLES_DIR


# ---------------------------------------------------------------------------------------------
# Lookup


@dataclasses.dataclass
class _Tables:
    """The tables one (device, user folder, autotune) sees: the user's first, then the shipped one of this
    GPU's name, then those of other GPUs of its compute capability; and the memo of picks (with autotune, the
    searched ones and those of launches that cannot search)."""

    device: str
    capability: str
    user_path: Path
    user: Table
    shipped: list
    autotune: bool
    picks: dict = dataclasses.field(default_factory=dict)
    searched: set = dataclasses.field(default_factory=set)  # (family, problem, bucket) searched or in the user's

    def chain(self) -> list:
        return [self.user, *self.shipped]


_lock = threading.Lock()
_states: dict = {}
_devices: dict = {}


def _device_facts(device: torch.device) -> tuple:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    facts = _devices.get(idx)
    if facts is None:
        major, minor = torch.cuda.get_device_capability(idx)
        facts = _devices[idx] = (torch.cuda.get_device_name(idx), f"{major}.{minor}")
    return facts


def tables_for(device_name: str, capability: str, opts=None) -> _Tables:
    """The tables (and pick memo) for a GPU, loaded once per (GPU, user folder, autotune, mx_few_rows)."""
    opts = opts or options.current()
    key = (device_name, capability, opts.tables_dir, opts.autotune, opts.mx_few_rows)  # (mx_few_rows: `Family.default`)
    state = _states.get(key)
    if state is not None:
        return state
    folder = user_dir(opts)
    with _lock:
        state = _states.get(key)
        if state is None:
            stem = table_name(device_name)
            user_path = folder / f"{stem}.json"
            user = load(user_path) if user_path.is_file() else Table(device_name, capability, source=str(user_path))
            shipped = [load(p) for p in shipped_tables()]
            same = [t for t in shipped if table_name(t.device) == stem]
            # then the other GPUs of this capability, the most alike by name first (an "H200 NVL" reads the
            # H200's table before the H100's)
            others = [t for t in shipped if table_name(t.device) != stem and t.capability == capability]
            others.sort(key=lambda t: (-len(os.path.commonprefix([table_name(t.device), stem])),
                                       table_name(t.device)))
            shipped = same + others
            state = _states[key] = _Tables(device_name, capability, user_path, user, shipped, opts.autotune)
    return state


def reset() -> None:
    """Forget every loaded table and pick (tables are read again at the next launch)."""
    with _lock:
        _states.clear()


def _nearest_bucket(per: dict, bkt: int, scale: float = 1.0) -> Tile:
    """The config of the bucket of `per` nearest to bkt * scale on a log scale (ties: the larger bucket)."""
    target = math.log2(bkt * scale)
    best = min(per, key=lambda b: (abs(math.log2(b) - target), -b))
    return per[best]


_HALF = ("bfloat16", "float16")  # the same tiles fit both: each takes the other's picks before a default


def _problem_distance(family: Family, a: tuple, b: tuple) -> float:
    d = 0.0
    for f, x, y in zip(family.fields, a, b):
        if f in family.sizes:
            d += abs(math.log2(max(x, 1)) - math.log2(max(y, 1)))
        elif f == "dtype" and x != y and x in _HALF and y in _HALF:
            d += 0.5  # (another 16-bit dtype's problem is as far as sizes 1.4x apart)
        elif x != y:
            return math.inf
    return d


def _experts(family: Family, problem: tuple) -> int:
    return problem[family.fields.index("E")] if "E" in family.fields else 1


def _default_twin(family: Family, problem: tuple) -> Optional[tuple]:
    """The problem with its defaulted fields at their defaults (MXFP8 K-loop launches: the bf16 weights' twin),
    whose buckets stand in for those the problem has no pick of; None where they are at their defaults."""
    if not family.field_defaults:
        return None
    twin = tuple(family.field_defaults.get(f, v) for f, v in zip(family.fields, problem))
    return twin if twin != problem else None


def lookup(state: _Tables, family: Family, problem: tuple, rows: int) -> tuple:
    """(tile, where it came from: "table", "nearest" or "default") for `rows` rows of `problem`, without search."""
    bkt = bucket(rows)
    per = {}
    twin = _default_twin(family, problem)
    for prob in (twin, problem) if twin is not None else (problem,):  # (the problem's own buckets override)
        for table in reversed(state.chain()):  # (each bucket from the first table that holds it)
            per.update(table.get(family.name, prob) or {})
    if family.is_stage:  # (its own problem's own bucket only: a way that won at some rows says nothing of others)
        return (per[bkt], "table") if bkt in per else (family.candidates[0], "default")
    if per:
        return per.get(bkt) or _nearest_bucket(per, bkt), "table"
    best, best_d = None, math.inf
    for table in state.chain():
        for other, per in table.entries.get(family.name, {}).items():
            d = _problem_distance(family, problem, other)
            if d < best_d:
                best, best_d = (other, per), d
    if best is not None:  # the same rows per expert as this launch
        other, per = best
        return _nearest_bucket(per, bkt, _experts(family, other) / max(_experts(family, problem), 1)), "nearest"
    return family.default(bkt, _experts(family, problem)), "default"  # (by bucket: the memo holds one per bucket)


def pick(family: Family, problem: tuple, rows: int, device: torch.device) -> Tile:
    """The config a launch of `family` at `rows` rows of `problem` runs (no search: see `search`)."""
    if INTERPRET:
        return family.interpret
    state = tables_for(*_device_facts(device))
    key = (family.name, problem, bucket(rows))
    tile = state.picks.get(key)
    if tile is None:
        tile = state.picks[key] = lookup(state, family, problem, rows)[0]
    return tile


def needs_search(family: Family, problem: tuple, rows: int, device: torch.device) -> Optional[_Tables]:
    """The tables to record a search in, where `options.autotune` is on and this (problem, bucket) has no
    pick yet; else None."""
    if INTERPRET or not options.current().autotune:
        return None
    state = tables_for(*_device_facts(device))
    key = (family.name, problem, bucket(rows))
    if key in state.searched:  # (not `picks`: a compiled launch's table pick does not stand for a search)
        return None
    per = state.user.get(family.name, problem)
    if per and bucket(rows) in per:
        state.picks[key] = per[bucket(rows)]
        state.searched.add(key)
        return None
    return state


@contextlib.contextmanager
def file_lock(path: Path):
    """Holds an exclusive lock on `path`.lock between processes (where the OS has fcntl) while a table file's
    read-modify-write runs (`record`, `tune.merge_into`), so processes writing side by side do not lose each
    other's picks."""
    try:
        import fcntl
    except ImportError:  # (no fcntl: the write is still atomic, a concurrent pick can be lost)
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remember(state: _Tables, family: Family, problem: tuple, rows: int, tile: Tile) -> None:
    """Keep a pick for this process only, as searched (not written to the user's table)."""
    key = (family.name, problem, bucket(rows))
    state.picks[key] = tile
    state.searched.add(key)


def record(state: _Tables, family: Family, problem: tuple, rows: int, tile: Tile) -> None:
    """Keep a searched pick in memory and put it, alone, into the user's table file as it is on disk now (other
    processes may have changed it since this one read it: their picks stay)."""
    bkt = bucket(rows)
    # (a key the table format cannot hold back, an int flag say, fails here, not when the file is next read)
    _problem_from_json(family, dict(zip(family.fields, problem)), f"{family.name} launch")
    state.picks[(family.name, problem, bkt)] = tile
    state.searched.add((family.name, problem, bkt))
    with _lock, file_lock(state.user_path):
        user = load(state.user_path) if state.user_path.is_file() else Table(source=str(state.user_path))
        user.put(family.name, problem, bkt, tile)
        user.device, user.capability = state.device, state.capability
        save(user, state.user_path)
        state.user = user  # (whole before it is seen: lookups on other threads read state.user)


def time_candidates(family: Family, grid, args: list, kwargs: dict, timer: Callable) -> list:
    """[(ms, tile)] of every candidate of `family` launched on `args` (`timer(run, tile)` -> ms), its outputs
    replaced by scratch copies
    (the caller's buffers are neither read after being written nor changed). A candidate the GPU cannot run
    (too much shared memory, too many registers) times as infinity."""
    scratch = list(args)
    for pos in family.output_positions:
        if isinstance(scratch[pos], torch.Tensor):
            scratch[pos] = scratch[pos].clone()
    out = []
    for tile in family.candidates:
        def run(tile=tile):
            launch_eager(family, tile, grid, scratch, kwargs)
        try:
            ms = timer(run, tile)
        except Exception as e:  # noqa: BLE001 - Triton raises several types for resources it lacks
            if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e).lower():
                raise
            ms = math.inf
        out.append((ms, tile))
    return out


def default_timer(fn, tile: Tile) -> float:
    """Median milliseconds of fn (a launch of `tile`), after a first call (compiles it). A launch of a few
    milliseconds or more is timed three times, not by `do_bench` (its estimate alone runs it five times:
    most of a large shape's search)."""
    import triton.testing

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    if start.elapsed_time(end) < 2.0:
        return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")
    times = []
    for _ in range(3):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[1]


def compile_only_timer(fn, tile: Tile) -> float:
    """Launches `tile` once (compiling it) and times nothing: every candidate ties (`tune --compile-only`)."""
    fn()
    return 0.0


_timer: contextvars.ContextVar = contextvars.ContextVar("mok_inductor_tile_timer", default=None)


@contextlib.contextmanager
def timing_with(timer: Callable):
    """Searches (`options.autotune`) inside the block time candidates with `timer(run, tile)` -> ms."""
    token = _timer.set(timer)
    try:
        yield
    finally:
        _timer.reset(token)


def current_timer() -> Callable:
    """The timer of the innermost `timing_with`, else `default_timer`."""
    return _timer.get() or default_timer


def launch_eager(family: Family, tile: Tile, grid, args, kwargs: dict) -> None:
    meta = tile.launch_kwargs
    if family.pre_hook is not None and kwargs.get("TMA"):  # (the hooks give TMA descriptors their block shapes)
        family.pre_hook({**dict(zip(family.arg_names, args)), **kwargs, **meta})
    family.fn[grid](*args, **kwargs, **meta)
