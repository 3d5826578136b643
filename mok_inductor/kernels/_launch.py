"""Launch plumbing shared by the kernel families: interpreter detection, autotune configs, launches.

Kernels are launched through `torch.library.wrap_triton` while AOTAutograd traces them (fake or
functional tensors), so that Inductor emits them as user-defined Triton kernels; in plain eager
they are launched directly (what `triton_op` does), and always directly under TRITON_INTERPRET=1
(torch 2.11's wrap_triton rejects interpreted kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import options
from ..options import INTERPRET


def cfg(bm, bn, bk, warps, stages) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


def with_pre_hook(configs: list, pre_hook) -> list:
    return [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=pre_hook)
            for c in configs]


def autotune(configs: list, interpret_config, key: list, restore_value=None, eager_pre_hook=None, few_rows=None):
    """`@triton.autotune` over `configs` for eager launches (`interpret_config` alone under the interpreter:
    one small tile, the interpreter is slow), with its first config alone kept for eager launches under
    `options.autotune=False` (see `launch`), and variants kept for launches traced by torch.compile (see
    `traced_variant`): the first config alone (Inductor's default mode, which re-benchmarks every config it is
    given: one config keeps the compile cheap), all `configs` (mode="max-autotune"), and `few_rows` alone where
    given (the default mode's config for launches at few rows per expert: `launch(..., few_rows=True)`). The
    first config of each list is the one measured best at the large training shapes.
    `eager_pre_hook(nargs)` runs before each eager launch with the config's meta-parameters (host TMA
    descriptors take their block shapes from it); Inductor accepts no pre-hooks, so traced launches have none."""
    extra = {"restore_value": restore_value} if restore_value else {}

    def deco(fn):
        picked = [interpret_config] if INTERPRET else configs
        if eager_pre_hook is not None:
            picked = with_pre_hook(picked, eager_pre_hook)
        eager = triton.autotune(configs=picked, key=key, **extra)(fn)
        eager.mok_untuned = eager if len(picked) == 1 else triton.autotune(configs=picked[:1], key=key, **extra)(fn)
        eager.mok_traced_variants = (triton.autotune(configs=configs[:1], key=key, **extra)(fn),
                                     triton.autotune(configs=configs, key=key, **extra)(fn),
                                     None if few_rows is None else triton.autotune(configs=[few_rows], key=key,
                                                                                   **extra)(fn))
        return eager

    return deco


def traced_variant(kernel, few_rows: bool = False):
    """The kernel a traced launch hands to Inductor: all tile configs under max-autotune, else the first, or
    the few-rows config where the launch asks for it and the kernel has one."""
    variants = getattr(kernel, "mok_traced_variants", None)
    if variants is None:
        return kernel
    from torch._inductor import config

    if config.max_autotune or config.max_autotune_gemm:
        return variants[1]
    return variants[2] if few_rows and variants[2] is not None else variants[0]


def traced(args) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    key = torch._C._TorchDispatchModeKey
    if torch._C._get_dispatch_mode(key.FUNCTIONAL) is not None or torch._C._get_dispatch_mode(key.FAKE) is not None:
        return True
    return any(isinstance(a, (FakeTensor, FunctionalTensor)) for a in args)


def without_pointers(tensors) -> bool:
    """Whether these tensors have no data pointers to read: torch.compile is tracing, or they are fake or
    functional (AOTAutograd). Split weights are then stacked instead of read through address tables."""
    return torch.compiler.is_compiling() or traced(tensors)


def launch(kernel, grid, *args, few_rows: bool = False, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), through wrap_triton when traced (`few_rows`: see `traced_variant`); an
    eager launch under `options.autotune=False` runs the kernel's first tile config."""
    if not INTERPRET and traced(args):
        torch.library.wrap_triton(traced_variant(kernel, few_rows))[grid](*args, **kwargs)
    elif not options.current().autotune:
        getattr(kernel, "mok_untuned", kernel)[grid](*args, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


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
