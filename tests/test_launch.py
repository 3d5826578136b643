"""The tile configs our kernels hand to Inductor when torch.compile traces them (kernels/kernels.common.py):
Inductor re-benchmarks every config of a user-defined autotuned kernel, so the default mode gets the first
config alone (a cheaper compile) and mode="max-autotune" gets them all. Checked on the kernel objects, on CPU;
the CUDA compile tests (tests/test_compile_inductor.py) run both modes end to end."""

import pytest
import torch
from torch._inductor import config

import mok_inductor
from mok_inductor import kernels

KERNELS = {
    "gate_up": (kernels.gate_up._gate_up_kernel, kernels.gate_up._GATE_UP_CONFIGS),
    "grouped_rows": (kernels.grouped_gemm._grouped_rows_kernel, kernels.grouped_gemm._GROUPED_ROWS_CONFIGS),
    "bwd_act": (kernels.bwd_act._bwd_act_kernel, kernels.bwd_act._BWD_ACT_CONFIGS),
    "bwd_gemm": (kernels.bwd_act._bwd_gemm_kernel, kernels.bwd_act._BWD_GEMM_CONFIGS),
    "wgrad": (kernels.wgrad._wgrad_kernel, kernels.wgrad._WGRAD_CONFIGS),
    "gate_up_f16": (kernels.gate_up._gate_up_f16_kernel, kernels.mx_loop._MX_F16_CONFIGS),
    "grouped_rows_f16": (kernels.grouped_gemm._grouped_rows_f16_kernel, kernels.mx_loop._MX_F16_CONFIGS),
}
# the MXFP8 fp16 K loops' config for traced launches at few rows per expert (decode): the 8-row eager picks
FEW_ROWS = {"gate_up_f16": (8, 32, 256, 2, 3), "grouped_rows_f16": (8, 32, 128, 1, 4)}


def _blocks(c):
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_traced_launch_configs(name):
    kernel, configs = KERNELS[name]
    assert len(configs) > 1
    with config.patch(max_autotune=False, max_autotune_gemm=False):
        default = kernels.common.traced_variant(kernel)
    with config.patch(max_autotune=True):
        tuned = kernels.common.traced_variant(kernel)
    with config.patch(max_autotune=False, max_autotune_gemm=True):
        tuned_gemm = kernels.common.traced_variant(kernel)
    assert [_blocks(c) for c in default.configs] == [_blocks(configs[0])]
    assert [_blocks(c) for c in tuned.configs] == [_blocks(c) for c in configs]
    assert tuned_gemm is tuned
    with config.patch(max_autotune=False, max_autotune_gemm=False):
        few = kernels.common.traced_variant(kernel, few_rows=True)
    with config.patch(max_autotune=True):
        assert kernels.common.traced_variant(kernel, few_rows=True) is tuned  # max-autotune benchmarks them all
    if name in FEW_ROWS:
        assert [_blocks(c) for c in few.configs] == [FEW_ROWS[name]] and few.fn is kernel.fn
        assert FEW_ROWS[name] in [_blocks(c) for c in configs]  # one of the eager autotuner's candidates
    else:
        assert few is default  # a kernel without one keeps its first config
    # the same Python function and autotune key behind every variant (one kernel, different config lists)
    for v in (default, tuned):
        assert v.fn is kernel.fn and v.keys == kernel.keys
    assert default.restore_value == kernel.restore_value


def test_few_rows_per_expert_choice():
    # at most options.mx_few_rows sorted rows per expert on average; a symbolic row count: not, without a guard
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    E = 128
    few = mok_inductor.options.current().mx_few_rows
    assert kernels.mx_loop.few_rows_per_expert(few * E, E)
    assert not kernels.mx_loop.few_rows_per_expert(few * E + 1, E)
    with mok_inductor.options.override(mx_few_rows=few + 1):
        assert kernels.mx_loop.few_rows_per_expert(few * E + 1, E)
    env = ShapeEnv()
    assert not kernels.mx_loop.few_rows_per_expert(env.create_unbacked_symint(), E) and not env.guards


def test_scale_words_of_traced_scales_by_their_offset():
    # traced scales (no address) take words where the view's storage offset and strides are multiples of the
    # load's width (Inductor copies a misaligned graph input it takes as aligned); real ones by their address
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mok_inductor.mxfp8 import Operand

    def words(scale):
        return kernels.operands.scale_words(Operand(torch.empty(0), scale))

    with FakeTensorMode():
        base = torch.empty(4, 64, 64, dtype=torch.uint8)
        assert words(base)
        assert words(base[:, :, 4:])  # offset 4
        assert not words(base[:, :, 2:])  # offset 2
        assert not words(base[:, :, :63].contiguous())  # rows of 63 bytes
        assert not words(base.transpose(1, 2))  # column-major rows
    real = torch.empty(4, 64, 64, dtype=torch.uint8)
    assert words(real) and words(real[:, :, 4:]) == (real[:, :, 4:].data_ptr() % 4 == 0)
    assert not words(real[:, :, 1:])


def test_untuned_kernel_is_handed_over_as_is():
    assert kernels.common.traced_variant(kernels.combine._combine_kernel) is kernels.combine._combine_kernel


def test_size_choice_adds_no_guard_on_a_symbolic_size():
    # the size thresholds (two-pass bwd_act, MXFP8 dequantize-first) decide concrete sizes by value; an
    # unknown symbolic size takes the caller's choice and adds no guard (a guard would recompile across T)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert kernels.common.at_least(300, 256, symbolic=False) and not kernels.common.at_least(255, 256, symbolic=True)
    env = ShapeEnv()
    n = env.create_unbacked_symint()
    assert kernels.common.at_least(n, 256, symbolic=True) is True
    assert kernels.common.at_least(n, 256, symbolic=False) is False
    assert kernels.common.at_least(n * 0 + 512, 256, symbolic=False) is True  # statically known
    assert not env.guards


def test_wgrad_int32_offsets_choice():
    # the wgrad's int32 offsets only where every element offset fits: large views (meta tensors, no
    # memory), a column-major view, a stride-0 expansion; a symbolic size takes int64 and adds no guard
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fits = kernels.wgrad.offsets_fit_int32
    rows = 2 ** 20
    assert fits(torch.empty(rows, 2 ** 11, device="meta"))  # largest offset 2**31 - 1
    assert not fits(torch.empty(rows + 1, 2 ** 11, device="meta"))
    assert not fits(torch.empty(2 ** 11, 2 ** 20 + 1, device="meta").t())  # column-major: the columns' stride
    assert fits(torch.empty(1, 4, device="meta").expand(2 ** 31, 4))  # stride 0: one row read again
    assert not fits(torch.empty(3, 3, device="meta"), torch.empty(rows + 1, 2 ** 11, device="meta"))
    env = ShapeEnv()
    n = env.create_unbacked_symint()
    x = torch.empty(2, 2048, device="meta")
    assert fits(x) and not kernels.wgrad.offsets_fit_int32(_SymView((n, 2048), (2048, 1)), x)
    assert not env.guards


class _SymView:
    """A stand-in view with symbolic shape and strides (what a traced wgrad operand carries)."""

    def __init__(self, shape, stride):
        self.shape, self._stride = shape, stride

    def stride(self):
        return self._stride


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_untuned_eager_variant_is_the_first_config(name):
    # options.autotune=False: eager launches run the kernel's first eager config (one config: no benchmarking)
    kernel, _ = KERNELS[name]
    untuned = kernel.mok_untuned
    assert [_blocks(c) for c in untuned.configs] == [_blocks(kernel.configs[0])]
    assert untuned.fn is kernel.fn and untuned.keys == kernel.keys


def test_launch_honours_options_autotune():
    calls = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(self.name)

    kernel = Kernel("tuned")
    kernel.mok_untuned = Kernel("untuned")
    kernels.common.launch(kernel, (1,), torch.empty(1))
    with mok_inductor.options.override(autotune=False):
        kernels.common.launch(kernel, (1,), torch.empty(1))
    kernels.common.launch(kernel, (1,), torch.empty(1))
    assert calls == ["tuned", "untuned", "tuned"]
