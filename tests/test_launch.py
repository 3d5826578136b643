"""The tile configs our kernels hand to Inductor when torch.compile traces them (kernels/_launch.py):
Inductor re-benchmarks every config of a user-defined autotuned kernel, so the default mode gets the first
config alone (a cheaper compile) and mode="max-autotune" gets them all. Checked on the kernel objects, on CPU;
the CUDA compile tests (tests/test_compile_inductor.py) run both modes end to end."""

import pytest
import torch
from torch._inductor import config

from mok_inductor.kernels import _launch, moe_bwd, moe_fwd

KERNELS = {
    "gate_up": (moe_fwd._gate_up_kernel, moe_fwd._GATE_UP_CONFIGS),
    "gate_up_persistent": (moe_fwd._gate_up_persistent_kernel, moe_fwd._GATE_UP_CONFIGS),
    "grouped_rows": (moe_fwd._grouped_rows_kernel, moe_fwd._GROUPED_ROWS_CONFIGS),
    "bwd_act": (moe_bwd._bwd_act_kernel, moe_bwd._BWD_ACT_CONFIGS),
    "bwd_gemm": (moe_bwd._bwd_gemm_kernel, moe_bwd._BWD_GEMM_CONFIGS),
    "bwd_act_sub": (moe_bwd._bwd_act_sub_kernel, moe_bwd._BWD_ACT_SUB_CONFIGS),
    "wgrad": (moe_bwd._wgrad_kernel, moe_bwd._WGRAD_CONFIGS),
}


def _blocks(c):
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_traced_launch_configs(name):
    kernel, configs = KERNELS[name]
    assert len(configs) > 1
    with config.patch(max_autotune=False, max_autotune_gemm=False):
        default = _launch.traced_variant(kernel)
    with config.patch(max_autotune=True):
        tuned = _launch.traced_variant(kernel)
    with config.patch(max_autotune=False, max_autotune_gemm=True):
        tuned_gemm = _launch.traced_variant(kernel)
    assert [_blocks(c) for c in default.configs] == [_blocks(configs[0])]
    assert [_blocks(c) for c in tuned.configs] == [_blocks(c) for c in configs]
    assert tuned_gemm is tuned
    # the same Python function and autotune key behind every variant (one kernel, different config lists)
    for v in (default, tuned):
        assert v.fn is kernel.fn and v.keys == kernel.keys
    assert default.restore_value == kernel.restore_value


def test_untuned_kernel_is_handed_over_as_is():
    assert _launch.traced_variant(moe_fwd._combine_kernel) is moe_fwd._combine_kernel


def test_size_choice_adds_no_guard_on_a_symbolic_size():
    # the size thresholds (two-pass bwd_act, MXFP8 dequantize-first) decide concrete sizes by value; an
    # unknown symbolic size takes the caller's choice and adds no guard (a guard would recompile across T)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert _launch.at_least(300, 256, symbolic=False) and not _launch.at_least(255, 256, symbolic=True)
    env = ShapeEnv()
    n = env.create_unbacked_symint()
    assert _launch.at_least(n, 256, symbolic=True) is True
    assert _launch.at_least(n, 256, symbolic=False) is False
    assert _launch.at_least(n * 0 + 512, 256, symbolic=False) is True  # statically known
    assert not env.guards


def test_wgrad_int32_offsets_choice():
    # the wgrad's int32 offsets only where every element offset fits: large views (meta tensors, no
    # memory), a column-major view, a stride-0 expansion; a symbolic size takes int64 and adds no guard
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fits = moe_bwd.offsets_fit_int32
    rows = 2 ** 20
    assert fits(torch.empty(rows, 2 ** 11, device="meta"))  # largest offset 2**31 - 1
    assert not fits(torch.empty(rows + 1, 2 ** 11, device="meta"))
    assert not fits(torch.empty(2 ** 11, 2 ** 20 + 1, device="meta").t())  # column-major: the columns' stride
    assert fits(torch.empty(1, 4, device="meta").expand(2 ** 31, 4))  # stride 0: one row read again
    assert not fits(torch.empty(3, 3, device="meta"), torch.empty(rows + 1, 2 ** 11, device="meta"))
    env = ShapeEnv()
    n = env.create_unbacked_symint()
    x = torch.empty(2, 2048, device="meta")
    assert fits(x) and not moe_bwd.offsets_fit_int32(_SymView((n, 2048), (2048, 1)), x)
    assert not env.guards


class _SymView:
    """A stand-in view with symbolic shape and strides (what a traced wgrad operand carries)."""

    def __init__(self, shape, stride):
        self.shape, self._stride = shape, stride

    def stride(self):
        return self._stride
