"""How a launch of our kernels picks its tile config (kernels/common.py `launch`, kernels/configs.py), checked
on CPU without a GPU: the tuned kernel families (`configs.Family`), what a traced launch hands to Inductor
(the jitted function with the picked tile's BLOCK_* as constexpr arguments and num_warps/num_stages, or under
mode="max-autotune" an autotuner over every candidate), the eager launch's table pick and opt-in search,
and that no kernel specialises on a row count. The CUDA compile tests (tests/test_compile_inductor.py) run both
modes end to end; the tables themselves: tests/test_configs.py."""

import json
import random

import pytest
import torch
from torch._inductor import config

import mok_inductor
from mok_inductor import kernels
from mok_inductor.kernels import configs

FAMILIES = {
    "gate_up": (kernels.gate_up.GATE_UP, kernels.gate_up._GATE_UP_CONFIGS),
    "gate_up_mx": (kernels.gate_up.GATE_UP_MX, kernels.mx_loop._MX_F16_CONFIGS),
    "grouped_rows": (kernels.grouped_gemm.GROUPED_ROWS, kernels.grouped_gemm._GROUPED_ROWS_CONFIGS),
    "grouped_rows_mx": (kernels.grouped_gemm.GROUPED_ROWS_MX, kernels.mx_loop._MX_F16_CONFIGS),
    "bwd_act": (kernels.bwd_act.BWD_ACT, kernels.bwd_act._BWD_ACT_CONFIGS),
    "bwd_gemm": (kernels.bwd_act.BWD_GEMM, kernels.bwd_act._BWD_GEMM_CONFIGS),
    "wgrad": (kernels.wgrad.WGRAD, kernels.wgrad._WGRAD_CONFIGS),
}
# the MXFP8 fp16 K loops' config at few rows per expert (decode) without a table: the 8-row picks of a search
SMALL = {"gate_up_mx": (8, 32, 256, 2, 3), "grouped_rows_mx": (8, 32, 128, 1, 4)}
E = 8  # experts of the test problems


def _blocks(c):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of a triton.Config or a Tile."""
    if isinstance(c, configs.Tile):
        return tuple(c.as_list())
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)


def _problem(family) -> tuple:
    """A problem of `family`: bf16, its sizes 64 (E experts), its flags off (the fp16 K loop for MX_LOOP)."""
    return tuple("bfloat16" if f == "dtype" else E if f == "E" else 64 if f in family.sizes else
                 1 if f == "MX_LOOP" else False for f in family.fields)


@pytest.fixture
def no_gpu_tables(tmp_path, monkeypatch):
    """Launches as on a GPU (not the interpreter) of a name and compute capability no shipped table has, the
    user's tables in an empty tmp_path; the launched kernels are recorded instead of run: (kernel, grid, args,
    kwargs) per launch through wrap_triton (`traced`), (tile, args, kwargs) per eager launch (`eager`)."""
    monkeypatch.setattr(kernels.common, "INTERPRET", False)
    monkeypatch.setattr(configs, "INTERPRET", False)
    monkeypatch.setattr(configs, "_device_facts", lambda device: ("test gpu without tables", "0.0"))
    traced, eager = [], []

    def wrap_triton(kernel):
        return _Grid(lambda grid, args, kwargs: traced.append((kernel, grid, args, kwargs)))

    monkeypatch.setattr(torch.library, "wrap_triton", wrap_triton)
    monkeypatch.setattr(configs, "launch_eager",
                        lambda family, tile, grid, args, kwargs: eager.append((tile, list(args), dict(kwargs))))
    configs.reset()
    with mok_inductor.options.override(tables_dir=str(tmp_path), autotune=False):
        yield traced, eager
    configs.reset()


class _Grid:
    def __init__(self, record):
        self.record = record

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.record(grid, args, kwargs)


def _fake(n=4):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(n)


def test_every_family_is_tested():
    import importlib
    import pkgutil

    defined = {}  # the families the kernel modules define
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        defined.update({f.name: f for f in vars(module).values() if isinstance(f, configs.Family)})
    # (stage families launch no kernel of their own: tests/test_configs.py and test_kernels.py test them)
    assert set(FAMILIES) == {n for n, f in defined.items() if not f.is_stage}
    assert {n for n, f in defined.items() if f.is_stage} == {"gate_up_stage"}
    for name, (family, candidates) in FAMILIES.items():
        assert configs.FAMILIES[name] is family and family.name == name
        assert len(candidates) > 1 and family.candidates == tuple(candidates)


@pytest.mark.parametrize("autotune", [False, True])
def test_interpreter_runs_the_interpret_tile(autotune, no_gpu_tables, monkeypatch):
    # under TRITON_INTERPRET one small tile whatever the rows, the tables and options.autotune (nothing timed)
    monkeypatch.setattr(kernels.common, "INTERPRET", True)
    monkeypatch.setattr(configs, "default_timer", lambda *a: pytest.fail("timed under the interpreter"))
    _, eager = no_gpu_tables
    with mok_inductor.options.override(autotune=autotune):
        for family, _ in FAMILIES.values():
            x = torch.zeros(2)
            kernels.common.launch(family, (1,), x, rows=random.randint(1, 1 << 16), problem=_problem(family))
            assert eager[-1] == (family.interpret, [x], {})
    assert len(eager) == len(FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_traced_launch_under_max_autotune_hands_every_candidate(name, no_gpu_tables):
    # Inductor's max-autotune benchmarks the configs of a user-defined autotuned kernel: all the candidates,
    # BLOCK_* in their Configs (not in the launch's arguments); one autotuner per family, built once
    family, candidates = FAMILIES[name]
    traced, _ = no_gpu_tables
    x, grid = _fake(), (lambda meta: (1,))
    for patch in (dict(max_autotune=True), dict(max_autotune=False, max_autotune_gemm=True)):
        with config.patch(**patch):
            kernels.common.launch(family, grid, x, 7, rows=3, problem=_problem(family), GROUP_M=8)
    (k1, g1, a1, kw1), (k2, *_) = traced
    assert k1 is k2 is family.autotuned() and g1 is grid and a1 == (x, 7) and kw1 == {"GROUP_M": 8}
    assert [_blocks(c) for c in k1.configs] == [_blocks(c) for c in candidates]
    assert k1.fn is family.fn


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_traced_launch_passes_the_picked_tile(name, no_gpu_tables):
    # Inductor's default mode: the jitted function itself, the tile of the launch's row count as arguments
    # (BLOCK_* constexprs, num_warps/num_stages: Inductor's one-config autotuner); no tables here, so the
    # family's default: `small` at up to options.mx_few_rows rows per expert where it has one, else the first
    family, candidates = FAMILIES[name]
    traced, _ = no_gpu_tables
    few = mok_inductor.options.current().mx_few_rows * E
    x = _fake()
    with config.patch(max_autotune=False, max_autotune_gemm=False):
        for rows in (few, few + 1, random.randint(few + 2, 1 << 16)):
            traced.clear()
            kernels.common.launch(family, (1,), x, rows=rows, problem=_problem(family), GROUP_M=8)
            [(kernel, grid, args, kwargs)] = traced
            want = SMALL[name] if name in SMALL and rows <= few else _blocks(candidates[0])
            assert kernel is family.fn and grid == (1,) and args == (x,)
            assert kwargs == {"GROUP_M": 8, "BLOCK_M": want[0], "BLOCK_N": want[1], "BLOCK_K": want[2],
                              "num_warps": want[3], "num_stages": want[4]}


def test_traced_launch_at_a_symbolic_row_count_takes_the_examples_tile(no_gpu_tables):
    # torch.export with a dynamic token count: the tile of the traced example's rows, without a guard; an
    # unbacked count (no example) takes the many-rows tile
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    family = kernels.gate_up.GATE_UP_MX
    traced, _ = no_gpu_tables
    few = mok_inductor.options.current().mx_few_rows * E
    env = ShapeEnv()
    hinted = env.create_symintnode(env.create_symbol(few, ConstantSource("rows")), hint=few)
    with config.patch(max_autotune=False, max_autotune_gemm=False):
        for rows in (hinted, env.create_unbacked_symint()):
            kernels.common.launch(family, (1,), _fake(), rows=rows, problem=_problem(family))
    assert [_blocks(configs.Tile(*(kw[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))))
            for _, _, _, kw in traced] == [SMALL["gate_up_mx"], _blocks(family.candidates[0])]
    assert not env.guards


def test_eager_launch_honours_options_autotune(no_gpu_tables, tmp_path, monkeypatch):
    # options.autotune=False: the tables' pick (none here: the first candidate), nothing timed. True: the first
    # launch at a (problem, row bucket) times every candidate with the outputs on scratch copies, runs the
    # fastest on the caller's tensors and records it in the user's table (tmp_path); later launches in that
    # bucket, and fresh processes without autotune, run the recorded tile
    family = kernels.wgrad.WGRAD
    _, eager = no_gpu_tables
    fastest = random.choice(family.candidates[1:])  # (not the default: the search must change the pick)
    timed = []

    def timer(run, *_):  # (what `run` launched decides its time)
        run()
        timed.append(eager[-1][0])
        return 1.0 if eager[-1][0] == fastest else 2.0 + random.random()

    monkeypatch.setattr(configs, "default_timer", timer)
    args = [torch.zeros(2) for _ in range(max(family.output_positions) + 1)]
    problem, rows = _problem(family), random.randint(65, 128)
    kernels.common.launch(family, (1,), *args, rows=rows, problem=problem, GROUP_M=8)
    assert [e[0] for e in eager] == [family.candidates[0]] and not timed
    assert eager[0][1] == args and eager[0][2] == {"GROUP_M": 8}
    eager.clear()
    with mok_inductor.options.override(autotune=True):
        kernels.common.launch(family, (1,), *args, rows=rows, problem=problem, GROUP_M=8)
        assert timed == list(family.candidates) and [e[0] for e in eager] == [*family.candidates, fastest]
        for tile, got, kwargs in eager[:-1]:  # the search: scratch outputs, the caller's inputs
            for pos, (a, b) in enumerate(zip(got, args)):
                assert (a is not b) if pos in family.output_positions else (a is b)
            assert kwargs == {"GROUP_M": 8}
        assert all(a is b for a, b in zip(eager[-1][1], args))  # the pick runs on the caller's tensors
        eager.clear()
        kernels.common.launch(family, (1,), *args, rows=128, problem=problem)  # the same bucket: no search
        assert [e[0] for e in eager] == [fastest] and len(timed) == len(family.candidates)
    saved = json.loads((tmp_path / f"{configs.table_name('test gpu without tables')}.json").read_text())
    assert configs.parse(saved).get(family.name, problem) == {128: fastest}
    configs.reset()  # (a fresh process)
    eager.clear()
    kernels.common.launch(family, (1,), *args, rows=100, problem=problem)
    assert [e[0] for e in eager] == [fastest] and len(timed) == len(family.candidates)


def test_one_jitted_function_per_kernel():
    # the bf16 and the MXFP8 families of a kernel, and the fused and two-pass SwiGLU backward, are one jitted
    # function (its name is the one Inductor's code and profiles show) with two candidate lists
    assert kernels.gate_up.GATE_UP.fn is kernels.gate_up.GATE_UP_MX.fn is kernels.gate_up._gate_up_kernel
    assert (kernels.grouped_gemm.GROUPED_ROWS.fn is kernels.grouped_gemm.GROUPED_ROWS_MX.fn
            is kernels.grouped_gemm._grouped_rows_kernel)
    assert kernels.bwd_act.BWD_ACT.fn is kernels.bwd_act.BWD_GEMM.fn is kernels.bwd_act._bwd_act_body
    assert kernels.wgrad.WGRAD.fn is kernels.wgrad._wgrad_body


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_small_tile_at_few_rows_per_expert(name):
    # without a table, the MXFP8 families run their 8-row tile (one of their candidates) at up to
    # options.mx_few_rows rows per expert on average, their first candidate above; the others always the first
    family, candidates = FAMILIES[name]
    few = mok_inductor.options.current().mx_few_rows
    first = _blocks(candidates[0])
    if name in SMALL:
        assert _blocks(family.small) == SMALL[name] and family.small in family.candidates
    else:
        assert family.small is None
    want_few = SMALL.get(name, first)
    assert _blocks(family.default(few * E, E)) == want_few and _blocks(family.default(1, E)) == want_few
    assert _blocks(family.default(few * E + 1, E)) == first
    with mok_inductor.options.override(mx_few_rows=few + 1):
        assert _blocks(family.default(few * E + 1, E)) == want_few
        assert _blocks(family.default((few + 1) * E + 1, E)) == first


# the arguments of every kernel that vary with the token count (rows, routes, chunks of routes): none may
# specialise the kernel (Triton would compile one variant per value's divisibility by 16, and 1)
ROW_ARGS = {
    "gate_up._gate_up_kernel": {"M"},
    "grouped_gemm._grouped_rows_kernel": {"M"},
    "bwd_act._bwd_act_body": {"M", "stride_sp"},
    "bwd_act._swiglu_bwd_kernel": {"M"},
    "wgrad._wgrad_body": {"M"},
    "combine._combine_kernel": {"T"},
    "combine._rowdot_kernel": {"T"},
    "mx_loop._row_f16_kernel": {"R"},
    "schedule._schedule_count_kernel": {"N"},
    "schedule._schedule_prefix_kernel": {"C"},
    "schedule._schedule_scatter_kernel": {"N", "C"},
}


def _not_specialized(fn) -> set:
    """The parameters `fn` is declared do_not_specialize for (a JITFunction; the interpreter's stand-in keeps
    the decorator's arguments)."""
    if hasattr(fn, "params"):
        return {p.name for p in fn.params if p.do_not_specialize}
    names = fn.kwargs.get("do_not_specialize") or ()
    return {fn.arg_names[n] if isinstance(n, int) else n for n in names}


@pytest.mark.parametrize("path", sorted(ROW_ARGS))
def test_no_kernel_specialises_on_a_row_count(path):
    module, name = path.split(".")
    fn = getattr(getattr(kernels, module), name)
    assert ROW_ARGS[path] <= set(fn.arg_names), (path, fn.arg_names)  # (a renamed argument: update the table)
    assert ROW_ARGS[path] <= _not_specialized(fn)
    assert _not_specialized(fn) <= set(fn.arg_names)  # (a misspelt name would be ignored silently)


def test_plain_kernel_is_handed_over_as_is(no_gpu_tables):
    # an untuned kernel (no Family) traced: wrap_triton of the kernel itself, with the launch's arguments alone
    traced, _ = no_gpu_tables
    x = _fake()
    kernels.common.launch(kernels.combine._combine_kernel, (3,), x, 5, BLOCK_H=32)
    assert traced == [(kernels.combine._combine_kernel, (3,), (x, 5), {"BLOCK_H": 32})]


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




@pytest.mark.parametrize("T, E, K, shared, dtype, tma, inline", [
    (64, 128, 8, False, torch.bfloat16, True, True),      # decode: 4 rows per expert, pointer loads eagerly too
    (4096, 128, 8, False, torch.bfloat16, True, False),   # 256 rows per expert: eager loads through TMA
    (100, 8, 2, True, torch.bfloat16, True, True),        # 25 rows per expert, shared expert 100 rows
    (200, 8, 2, True, torch.bfloat16, True, False),       # the shared expert's 200 rows load through TMA
    (4096, 8, 2, False, torch.float32, True, True),       # 32-bit activations: never TMA
    (4096, 8, 2, False, torch.bfloat16, False, True),     # options.tma off
])
def test_compiled_static_calls_inline_only_where_eager_loads_by_pointers(T, E, K, shared, dtype, tma, inline):
    # traced launches cannot take TMA descriptors, and the tables' configs at TMA sizes are the TMA launches'
    # picks: a compiled call there stays opaque (runs the eager kernels), below it the launches are inlined
    from mok_inductor.lowering import decompose

    H, I, meta = 64, 32, dict(device="meta")
    x = torch.empty(T, H, dtype=dtype, **meta)
    te = torch.empty(T, K, dtype=torch.int64, **meta)
    offsets = torch.empty(E + 1, dtype=torch.int32, **meta)
    sgu = torch.empty(2 * I, H, dtype=dtype, **meta) if shared else None
    fwd = [x, torch.empty(T, K, **meta), te, None, offsets, None, None, None, sgu]
    bwd = [torch.empty_like(x)] + fwd
    with mok_inductor.options.override(tma=tma):
        assert decompose._eager_uses_tma("moe_fwd", fwd) is (not inline)
        assert decompose._eager_uses_tma("moe_bwd", bwd) is (not inline)
        assert decompose._eager_uses_tma("schedule", [te, E]) is False
