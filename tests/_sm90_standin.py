"""The CUDA compiled-graph path on a machine without a GPU, for tests that run in a subprocess without
TRITON_INTERPRET (tests/conftest.py sets it for the test process itself).

`install()` tells Triton it targets an sm_90 GPU, makes `mok_inductor.kernels` importable as available, and makes
the mok ops decompose into their Triton launches for CPU tensors as they do for CUDA ones
(`mok_inductor.lowering.decompose`): AOTAutograd then traces the same launches, with CPU tensors standing in for
CUDA ones. `interpreted_launches()` runs such a traced graph: each launch goes to Triton's interpreter (the
kernels' Python source, no compilation), so the graph's numbers can be checked on CPU."""

from __future__ import annotations

import contextlib
import functools
import tempfile

import torch

_OPS = ("schedule", "moe_fwd", "moe_bwd")


def install() -> None:
    """Stand-in sm_90 target and decomposition for CPU tensors. No tile-config tables (an empty user folder, no
    shipped ones): launches take their families' defaults whatever tables the machine has."""
    import triton
    from triton.backends.compiler import GPUTarget

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cuda")

    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(_Sm90())
        real = torch.cuda.is_available
        torch.cuda.is_available = lambda: True  # (so mok_inductor.kernels imports as available)
        import mok_inductor.kernels  # noqa: F401

        torch.cuda.is_available = real
        # (the tile-config lookup asks torch.cuda for the GPU's name: a stand-in one, sm_90 as told to Triton)
        mok_inductor.kernels.configs._device_facts = lambda device: ("probe-sm90", "9.0")
        # (`ops.use_triton` refuses CPU tensors for backend "triton" unless Triton's interpreter is on: here they
        # stand in for CUDA ones, traced as for sm_90, and their launches run only in `interpreted_launches`.
        # The kernels' own copies of the flag, taken at import, stay off: they are traced as compiled ones.)
        mok_inductor.options.INTERPRET = True
    import mok_inductor
    import mok_inductor.kernels.configs as tile_configs
    from mok_inductor import ops
    from mok_inductor.lowering import decompose

    mok_inductor.options.set_default(backend="triton")  # the kernels, not the CPU reference, for CPU tensors
    mok_inductor.options.set_default(tables_dir=tempfile.mkdtemp(prefix="mok-probe-tables-"))
    tile_configs.shipped_tables = lambda: []
    decompose.install()  # what mok_inductor.enable() installs for compiled graphs
    if not torch.cuda.is_available():  # the rule decomposes CUDA tensors' ops only: these CPU stand-ins' too
        from torch._library.simple_registry import singleton
        from torch._subclasses.functional_tensor import FunctionalTensorMode

        for name in _OPS:
            def rule(mode, func, types, args, kwargs, fn=getattr(ops, f"{name}_impl")):
                with mode:
                    return fn(*args, **kwargs)

            singleton.find(f"mok::{name}").torch_dispatch_rules._data[FunctionalTensorMode] = rule


# Launches seen by `interpreted_launches` that wrote a tensor also passed as another argument:
# (kernel, written argument, the other argument). `common.launch` says why there must be none.
ALIASED_WRITES: list = []
# Per kernel: the arguments its launches were seen writing (`interpreted_launches`), and the ones torch's analysis
# of the kernel's code (what Inductor's lowering asks, `access_analysis`) says it writes; the analysis' failures.
OBSERVED_WRITES: dict = {}
ANALYSED_WRITES: dict = {}
ANALYSIS_FAILURES: list = []


def _changed(before: torch.Tensor, after: torch.Tensor) -> bool:
    if after.is_floating_point():
        return not torch.equal(before.nan_to_num(), after.nan_to_num())
    return not torch.equal(before, after)


class _Interpreted:
    """A traced launch's kernel (a JITFunction, or the one-config Autotuner `wrap_triton` makes of a launch with
    num_warps/num_stages) as the interpreter runs it: the config's meta-parameters passed, the launch options
    dropped. Each launch records in ALIASED_WRITES the tensors it wrote that it was also given as another
    argument."""

    def __init__(self, kernel):
        from triton.runtime.autotuner import Autotuner

        base = kernel.fn if isinstance(kernel, Autotuner) else kernel
        self.name = base.__name__
        self.fn = _interpreted(base)
        self.arg_names = base.arg_names
        self.configs = getattr(kernel, "configs", [])
        self.meta = dict(self.configs[0].kwargs) if isinstance(kernel, Autotuner) and self.configs else {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            for key in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
                kwargs.pop(key, None)
            named = {**dict(zip(self.arg_names, args)), **kwargs}
            tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor) and v.numel()}
            before = {k: v.clone() for k, v in tensors.items()}
            out = self.fn[grid](*args, **kwargs, **self.meta)
            for k, v in tensors.items():
                if _changed(before[k], v):
                    OBSERVED_WRITES.setdefault(self.name, set()).add(k)
                    ALIASED_WRITES.extend((self.name, k, other) for other, w in tensors.items()
                                          if other != k and w.data_ptr() == v.data_ptr())
            return out

        return launch


@functools.cache
def _interpreted(fn):
    """The interpreter's version of the @triton.jit function fn (made once per function)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn.fn)


@contextlib.contextmanager
def interpreted_launches():
    """While a traced graph runs: its launches (`triton_kernel_wrapper_*` nodes) and the @triton.jit helpers
    they call run in Triton's interpreter. Only while it runs: tracing reads the real JITFunctions."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.jit import JITFunction

    get_kernel, call = kernel_side_table.get_kernel, JITFunction.__call__
    kernel_side_table.get_kernel = lambda idx: _Interpreted(get_kernel(idx))
    JITFunction.__call__ = lambda self, *a, **kw: _interpreted(self)(*a, **kw)  # (a helper inside a kernel)
    try:
        yield
    finally:
        kernel_side_table.get_kernel, JITFunction.__call__ = get_kernel, call


def access_analysis(gm) -> None:
    """torch's analysis of which arguments each launch of gm writes, asked as Inductor's lowering asks it
    (`ir.UserDefinedTritonKernel`: the constant arguments merged in, the first config's meta-parameters, symbolic
    sizes as sympy expressions; fake tensors where the lowering has its IR buffers), into ANALYSED_WRITES; where
    it raises, ANALYSIS_FAILURES (Inductor then takes every argument as written). Must run before any launch is
    interpreted: the interpreter's patches of triton.language break the code generation the analysis uses."""
    import sympy
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    from triton.runtime.autotuner import Autotuner

    def written(kernel, args, tma):
        if hasattr(wrap, "identify_accessed_tensors"):  # torch 2.13
            return {d.name for d in wrap.identify_accessed_tensors(kernel, args, tma).read_writes.writes}
        return set(wrap.identify_mutated_tensors(kernel, args, tma))  # torch 2.11, 2.12

    for node in gm.graph.nodes:
        if node.op != "call_function" or "triton_kernel_wrapper" not in str(node.target):
            continue
        kernel = wrap.kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        name = (kernel.fn if isinstance(kernel, Autotuner) else kernel).__name__
        args = dict(wrap.kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]))
        for k, v in node.kwargs["kwargs"].items():
            val = v.meta.get("val") if isinstance(v, torch.fx.Node) else v
            args[k] = sympy.Symbol(f"s_{k}", integer=True) if isinstance(val, torch.SymInt) else val
        if isinstance(kernel, Autotuner) and kernel.configs:
            args.update(kernel.configs[0].kwargs)
        tma = node.kwargs.get("tma_descriptor_metadata", {})
        try:
            wrap.generate_ttir(kernel, dict(args), tma)  # (the analysis swallows its errors)
        except Exception as e:  # noqa: BLE001 - reported by the test
            ANALYSIS_FAILURES.append((name, f"{type(e).__name__}: {str(e)[-300:]}"))
            continue
        ANALYSED_WRITES.setdefault(name, set()).update(written(kernel, args, tma))


def reinplace(gm, fake_mode) -> None:
    """Inductor's reinplacing pass on gm (functional launches back to in-place ones where it can)."""
    import inspect

    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.virtualized import V

    with fake_mode, V.set_fake_mode(fake_mode):
        # (torch 2.13's FakeTensorUpdater takes the GraphModule, 2.11's the Graph)
        first = list(inspect.signature(FakeTensorUpdater.__init__).parameters)[1]
        reinplace_inplaceable_ops(FakeTensorUpdater(gm.graph if first == "graph" else gm), gm.graph)
    gm.recompile()


def inductor_like_backend(graphs: list):
    """A torch.compile backend doing what Inductor does to our launches up to code generation (AOTAutograd with
    its min-cut partitioner, the reinplacing pass, the lowering's `access_analysis`), then running the graphs
    eagerly with `interpreted_launches`. Each graph's code is appended to `graphs`. The backward graph is made
    when the forward is (not at the first backward), so that it is analysed before any launch runs."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._guards import detect_fake_mode

    def compiler(gm, example_inputs):
        reinplace(gm, detect_fake_mode(example_inputs))
        access_analysis(gm)
        graphs.append(gm.code)

        def run(*args):
            with interpreted_launches():
                return gm(*args)

        return run

    aot = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, partition_fn=min_cut_rematerialization_partition)

    def backend(gm, example_inputs):
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            return aot(gm, example_inputs)

    return backend
