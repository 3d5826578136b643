"""Shared by the kernel families: launch plumbing (interpreter, tile configs from `configs`, launches through
`wrap_triton` when traced), size choices without guards, and device helpers (tile enumeration, the L2
swizzle, expert addresses, the dot and the output rounding, the clamped SwiGLU).

Kernels are launched through `torch.library.wrap_triton` while AOTAutograd traces them (fake or
functional tensors), so that Inductor emits them as user-defined Triton kernels; in plain eager
they are launched directly (what `triton_op` does), and always directly under TRITON_INTERPRET=1
(torch 2.11's wrap_triton rejects interpreted kernels).

Tiles: a program of a grouped GEMM owns a BLOCK_M x BLOCK_N tile of one expert's rows. The grid is the worst
case cdiv(N, BLOCK_M) + E + 1 row tiles (from shapes only); `_tile_rows` finds each program's expert from the
device offsets (a prefix sum of per-expert tile counts) and idle programs exit. The shared expert runs the
same kernels with SINGLE=True: one group of T rows, no gather.

Shape legend: T tokens, E experts, K routes per token (TOPK in kernels), N = T*K routes (M rows in a grouped
kernel), G groups (E, or E + 1 with the `-1` tail).
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from .. import _checks
from ..options import INTERPRET
from ..types import clip_bounds
from . import configs
from .configs import Tile

GROUP_M = 8  # row tiles per L2 group (see _tile_ids)

# ---------------------------------------------------------------------------------------------
# Configs and launches


def cfg(bm, bn, bk, warps, stages) -> Tile:
    return Tile(bm, bn, bk, warps, stages)


def traced(args) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    key = torch._C._TorchDispatchModeKey
    if torch._C._get_dispatch_mode(key.FUNCTIONAL) is not None or torch._C._get_dispatch_mode(key.FAKE) is not None:
        return True
    return any(isinstance(a, (FakeTensor, FunctionalTensor)) for a in args)


def assert_expert_ids(ok: torch.Tensor, top_experts: torch.Tensor, num_experts: int) -> None:
    """The kernels' expert-id check (`ok`: 0 where an id is outside [-1, E)). On the device an asynchronous
    assert (no host synchronisation); on CPU tensors (the interpreter) read at once, so the call raises the
    contract's ValueError with the offending value, as the CPU path does."""
    if ok.device.type == "cpu" and not traced((ok,)):
        if not bool(ok):
            _checks.check_expert_ids_eager(top_experts, num_experts)
        return
    torch._assert_async(ok, _checks.expert_ids_message(num_experts))


def without_pointers(tensors) -> bool:
    """Whether these tensors have no data pointers to read: torch.compile is tracing, or they are fake or
    functional (AOTAutograd). Split weights are then stacked instead of read through address tables."""
    return torch.compiler.is_compiling() or traced(tensors)


def launch(kernel, grid, *args, problem: tuple = (), rows=None, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), through wrap_triton when traced. A `configs.Family` is launched at `rows`
    rows of `problem` (`_launch_tuned`); a plain kernel with the meta-parameters given.

    A tensor the kernel writes is passed once: a pointer argument the launch does not use gets a read-only input
    in its place, never an output. Traced, the launch is a functional node that clones the arguments torch's
    analysis of the kernel's code says it writes (a superset: a pointer an address is computed from counts), so
    a tensor passed twice may become two tensors, and the one read after the launch need not be the one the
    kernel wrote (tests/test_compile_traced.py checks the launches and the analysis)."""
    if isinstance(kernel, configs.Family):
        _launch_tuned(kernel, grid, args, kwargs, problem, rows)
    elif not INTERPRET and traced(args):
        torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def _launch_tuned(family: configs.Family, grid, args, kwargs, problem: tuple, rows) -> None:
    """A launch of a tuned kernel family at `rows` rows of `problem` (`configs`): the config of the tables
    (searched first where `options.autotune` asks for it), or under Inductor's max-autotune every candidate.
    A traced launch at a symbolic row count (torch.export with a dynamic token count; torch.compile keeps
    those ops opaque, see `mok_inductor.lowering.decompose`) takes the config of the traced example's rows."""
    dev = args[0].device
    if INTERPRET:
        configs.launch_eager(family, family.interpret, grid, args, kwargs)
        return
    if traced(args):
        from torch._inductor import config

        if config.max_autotune or config.max_autotune_gemm:
            torch.library.wrap_triton(family.autotuned())[grid](*args, **kwargs)
            return
        if isinstance(rows, torch.SymInt):
            hint = getattr(rows.node, "hint", None)
            rows = int(hint) if hint is not None else 1 << 20
        tile = configs.pick(family, problem, int(rows), dev)
        torch.library.wrap_triton(family.fn)[grid](*args, **kwargs, **tile.launch_kwargs)
        return
    state = configs.needs_search(family, problem, rows, dev)
    if state is None:
        tile = configs.pick(family, problem, rows, dev)
    else:
        timed = configs.time_candidates(family, grid, list(args), kwargs, configs.current_timer())
        tile = min(timed, key=lambda t: t[0])[1]
        configs.record(state, family, problem, rows, tile)
    configs.launch_eager(family, tile, grid, args, kwargs)


def run_stage(family: configs.Family, problem: tuple, rows: int, device: torch.device, ways: dict):
    """Runs a stage the way its stage family (`configs.stage`) picks for `rows` rows of `problem`: `ways` maps
    the names of its ways to callables that return the way's runner, or None where it cannot run this call
    (asked only of the way picked, or of every way when searching; the first candidate, the fused kernel, can
    always run); -> what the runner returns. With `options.autotune`, an unsearched (problem, bucket) where
    more than one way can run times each (every one writes the stage's outputs; the chosen one runs last) and
    records the fastest. A way other than the fused one that raises while timed is left out with a warning,
    and nothing is recorded (this process keeps the fused way for the bucket; a later one searches again);
    the fused way's errors are raised."""
    first = family.candidates[0]
    state = configs.needs_search(family, problem, rows, device)
    if state is None:
        run = ways[configs.pick(family, problem, rows, device).name]()
        return (run or ways[first.name]())()
    runners = {t: run for t in family.candidates if (run := ways[t.name]()) is not None}
    if len(runners) < 2:  # (nothing to choose: searched when a call can run more than one way)
        return runners[first]()
    timer, timed, failed = configs.current_timer(), [], False
    for t, run in runners.items():
        try:
            timed.append((timer(run, t), t))
        except Exception as e:  # noqa: BLE001 - another library's kernel (torch._grouped_mm) on this GPU
            if t == first:
                raise
            failed = True
            warnings.warn(f"{family.name}: the {t.name!r} way failed at {rows} rows of {problem} ({e!r}); it is "
                          f"left out, and nothing is recorded for this row bucket", RuntimeWarning, stacklevel=2)
    tile = min(timed, key=lambda t: t[0])[1]
    if failed:
        configs.remember(state, family, problem, rows, tile)
    else:
        configs.record(state, family, problem, rows, tile)
    return runners[tile]()


def at_least(n, bound: int, symbolic: bool) -> bool:
    """n >= bound for a size-based kernel choice, without a guard: a symbolic n (torch.compile with dynamic
    shapes) decides only where that is statically known, else `symbolic` (a guard would recompile the
    graph for every token count across the bound)."""
    if isinstance(n, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        if statically_known_true(n >= bound):
            return True
        if statically_known_true(n < bound):
            return False
        return symbolic
    return n >= bound


def known_multiple(n, m: int) -> bool:
    """n % m == 0 for an int or SymInt, without a guard: a symbolic n only where that is statically known."""
    if isinstance(n, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return statically_known_true(n % m == 0)
    return n % m == 0


def dot_precision(dtype: torch.dtype) -> str:
    """float32 GEMMs in full precision (SPEC's 1e-4 rules out tf32); others use the tensor cores.
    "interp": the interpreter's tl.dot is wrong on bfloat16 operands, so `mma` upcasts them."""
    if INTERPRET:
        return "interp"
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def clamp_args(limit, dtype: torch.dtype) -> tuple:
    """(limit, above, below, KEEP_CLIP) as the gate/up kernels take them (`round_gu`): the clamp bound as a float
    (0.0 without one) and, for bf16/fp16 outputs, its neighbours in that dtype (`types.clip_bounds`). Memoised:
    clip_bounds runs torch ops (about 40 us of host time, a decode call's worth)."""
    if limit is None:
        return 0.0, 0.0, 0.0, False
    if dtype not in (torch.bfloat16, torch.float16):
        return float(limit), 0.0, 0.0, False
    above, below = clip_bounds(limit, dtype)
    return float(limit), float(above), float(below), True


# Host-side integer helpers in plain Python: Triton 3.6's triton.cdiv and triton.next_power_of_2 are
# constexpr functions, whose per-call argument unwrapping costs several microseconds on a launch path run
# about ten times per forward (the eager decode forward is host-bound)
def cdiv(a, b):
    """ceil(a / b) of non-negative ints or SymInts (triton.cdiv's arithmetic)."""
    return (a + b - 1) // b


def next_pow2(n) -> int:
    """The smallest power of two >= max(n, 1) (triton.next_power_of_2's result)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def mma(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b with float32 accumulation (DOT_PREC from `dot_precision`)."""
    if DOT_PREC == "interp":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PREC)
    return out


@triton.jit
def to_out(v, like_ptr, DOT_PREC: tl.constexpr):
    """v in the element type of `like_ptr`, rounded to nearest even; the interpreter truncates
    float32 -> bfloat16, so there the rounding is done by hand on the bits."""
    dtype = like_ptr.dtype.element_ty
    if DOT_PREC == "interp":
        if dtype == tl.bfloat16:
            bits = v.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def round_gu(acc_g, acc_u, like_ptr, limit, above, below, KEEP_CLIP: tl.constexpr, DOT_PREC: tl.constexpr):
    """The float32 accumulators of g and u rounded to the element type of `like_ptr` (as float32 values), never
    across the clamp bound `limit` (KEEP_CLIP; `above`, `below`: the stored dtype's neighbours of it;
    reference.round_keep_clip). where(), not min/max: the GPU's min/max return the non-NaN operand, and a NaN
    must stay NaN (it compares false here)."""
    g = to_out(acc_g, like_ptr, DOT_PREC).to(tl.float32)
    u = to_out(acc_u, like_ptr, DOT_PREC).to(tl.float32)
    if KEEP_CLIP:
        g = tl.where(acc_g > limit, tl.where(g < above, above, g), tl.where(g > below, below, g))
        u = tl.where(acc_u > limit, tl.where(u < above, above, u), tl.where(u > below, below, u))
        u = tl.where(acc_u < -limit, tl.where(u > -above, -above, u), tl.where(u < -below, -below, u))
    return g, u


@triton.jit
def _tile_rows(pid_m, offsets_ptr, M, E, SINGLE: tl.constexpr, WITH_TAIL: tl.constexpr,
               BLOCK_M: tl.constexpr, GROUPS_POW2: tl.constexpr):
    """(group, row_start, row_end) of row tile `pid_m`; row_start >= row_end for an idle program.
    Groups are the experts [0, E) and, WITH_TAIL, group E = the `-1` routes' slots [offsets[E], M)."""
    if SINGLE:
        group = pid_m * 0
        row_start = pid_m * BLOCK_M
        row_end = M + pid_m * 0
    else:
        idx = tl.arange(0, GROUPS_POW2)
        lo = tl.load(offsets_ptr + idx, mask=idx <= E, other=M)
        hi = tl.load(offsets_ptr + idx + 1, mask=idx + 1 <= E, other=M)
        if WITH_TAIL:
            num_groups = E + 1
        else:
            num_groups = E
        ntiles = tl.where(idx < num_groups, tl.cdiv(hi - lo, BLOCK_M), 0)
        cum = tl.cumsum(ntiles, axis=0)
        group = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
        sel = idx == group
        first = tl.sum(tl.where(sel, cum - ntiles, 0), axis=0)
        lo_g = tl.sum(tl.where(sel, lo, 0), axis=0)
        hi_g = tl.sum(tl.where(sel, hi, 0), axis=0)
        row_start = lo_g + (pid_m - first) * BLOCK_M
        row_end = tl.where(group < num_groups, hi_g, row_start)
    return group, row_start, row_end


@triton.jit
def swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of tile `pid` of a num_m x num_n grid, GROUP_M row tiles at a time (L2 reuse: a
    column block is read once per group of row tiles, not once per row tile)."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % gsize, (pid % per_group) // gsize


@triton.jit
def _tile_ids(pid, M, E, NCOLS, SINGLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` over the worst-case row tiles of a schedule (see `swizzle`)."""
    if SINGLE:
        num_m = tl.cdiv(M, BLOCK_M)
    else:
        num_m = tl.cdiv(M, BLOCK_M) + E + 1
    return swizzle(pid, num_m, tl.cdiv(NCOLS, BLOCK_N), GROUP_M)


def row_tiles_worst(M: int, E: int, block_m: int, single: bool) -> int:
    """Upper bound of the row tiles of any schedule of M rows over E (+1) groups: shapes only."""
    return cdiv(M, block_m) if single else cdiv(M, block_m) + E + 1


@triton.jit
def expert_ptr(ptr, e64, stride_e, E, TABLE: tl.constexpr, DT: tl.constexpr):
    """The start of expert e's [n, k] matrix: ptr + e * stride_e, or (TABLE: split per-expert allocations)
    the address in entry e of the int64 table at ptr, as a pointer to DT (e clamped into [0, E): the
    tail group's and idle tiles' e is E and they read nothing). TABLE == 2: every address is a multiple of
    16 bytes, which the compiler must be told (a loaded address has no known alignment, and without it
    the weight tiles are loaded element by element instead of by 16-byte asynchronous copies)."""
    if TABLE == 0:
        return ptr + e64 * stride_e
    else:
        p = tl.load(ptr + tl.where(e64 < E, e64, 0)).to(tl.pointer_type(DT))
        if TABLE == 2:
            p = tl.multiple_of(p, 16)
        return p


@triton.jit
def e8m0_factor(sc):
    """2**(sc - 127) of uint8 E8M0 scales, built from its float32 bits, exact: byte 0 is 2**-127, float32's
    subnormal 0x00400000 (the exponent field alone would read it as 0), byte 255 Inf."""
    bits = sc.to(tl.int32) << 23
    return tl.where(bits == 0, 0x400000, bits).to(tl.float32, bitcast=True)


@triton.jit
def clamp_gu(g, u, limit, HAS_LIMIT: tl.constexpr):
    """(clamp(g, max=limit), clamp(u, -limit, limit)); where() rather than min/max: a NaN is not clipped,
    it propagates."""
    if HAS_LIMIT:
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    return g, u


@triton.jit
def swiglu(g, u, limit, alpha, beta, HAS_LIMIT: tl.constexpr):
    """The gated activation g' * sigmoid(alpha g') * (u' + beta) of g' = clamp(g, max=limit),
    u' = clamp(u, -limit, limit), in float32 (`types.Activation`: the SwiGLU is alpha 1, beta 0, exactly
    silu(g') * u')."""
    g, u = clamp_gu(g, u, limit, HAS_LIMIT)
    return g * tl.sigmoid(alpha * g) * (u + beta)


def flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous 1-D tensor (a view when it already is)."""
    t = t.reshape(-1)
    return t if t.is_contiguous() else t.contiguous()
