"""mok_inductor.mxfp8: OCP MX quantization of weights, and mok_inductor.moe on MXFP8 weights.

Each check derives what is right from the format's definition (e4m3: 3 mantissa bits, finite range
+-448, subnormal spacing 2**-9; E8M0: a power-of-two scale 2**(byte - 127)), never from stored numbers.
"""

import contextlib
import math
import zlib

import pytest
import torch

from mok_inductor import mxfp8


def _weight(*shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    # block magnitudes spread over many octaves, so scales differ from block to block
    spread = torch.exp2(torch.randint(-8, 9, (*shape[:-1], shape[-1] // 32, 1), generator=g).float())
    w = torch.randn(*shape[:-1], shape[-1] // 32, 32, generator=g) * spread
    return w.reshape(shape).to(dtype)


def _block_exponents(scale):
    return scale.long() - mxfp8.E8M0_BIAS


@pytest.mark.parametrize("shape", [(64, 96), (3, 32, 64), (2, 2, 96, 32)])  # 2-D, [E, M, K], extra leading dims
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_layouts_shapes_and_error_bound(shape, dtype):
    w = _weight(*shape, dtype=dtype)
    q = mxfp8.quantize(w)
    *lead, m, k = shape
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == torch.Size(shape)
    assert q.scale.dtype == torch.uint8 and q.scale.shape == torch.Size([*lead, m, k // 32])
    assert q.data_t.shape == torch.Size([*lead, k, m]) and q.data_t.is_contiguous()
    assert q.scale_t.shape == torch.Size([*lead, k, m // 32])
    for layout, wl, scale in (("row", w, q.scale), ("column", w.transpose(-2, -1), q.scale_t)):
        d = mxfp8.dequantize(q, layout=layout)
        assert d.dtype == dtype and d.shape == w.shape
        dl = d if layout == "row" else d.transpose(-2, -1)
        step = torch.exp2(_block_exponents(scale).double()).repeat_interleave(32, dim=-1)
        # half an ulp: 2**-4 relative for normal e4m3 numbers, 2**-10 * scale in the subnormal range
        bound = wl.double().abs() * 2.0**-4 + step * 2.0**-10
        assert ((dl.double() - wl.double()).abs() <= bound * (1 + 1e-6)).all(), layout


def test_scale_is_the_smallest_power_of_two_that_fits():
    w = _weight(4, 64, 128, seed=1, dtype=torch.float32)
    q = mxfp8.quantize(w, columnwise=False)
    amax = w.reshape(4, 64, 4, 32).abs().amax(-1).double()
    e = _block_exponents(q.scale).double()
    # amax / 2**e lies in (224, 448]: one exponent less would overflow e4m3's 448
    r = amax / torch.exp2(e)
    assert (r <= 448).all() and (r > 224).all()


def test_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 256, (32, 64), generator=g, dtype=torch.uint8)
    e4m3 = codes.view(torch.float8_e4m3fn).float()
    e4m3 = torch.where(e4m3.isnan(), torch.ones_like(e4m3), e4m3)
    e4m3[:, ::32] = 448.0  # each block holds the format's largest value, so its scale is exactly 2**k
    w = e4m3 * torch.exp2(torch.randint(-20, 20, (32, 2, 1), generator=g).float()).repeat_interleave(32, -1).reshape(32, 64)
    q = mxfp8.quantize(w, columnwise=False)
    assert torch.equal(mxfp8.dequantize(q), w)


def test_zero_block_nan_and_inf():
    w = _weight(32, 64, seed=3, dtype=torch.float32)
    w[0, :32] = 0.0  # an all-zero block: the smallest scale, zero data
    w[1, 5] = float("nan")
    w[2, 40] = float("inf")
    q = mxfp8.quantize(w)
    assert q.scale[0, 0] == 0 and (mxfp8.dequantize(q)[0, :32] == 0).all()
    d = mxfp8.dequantize(q)
    assert d[1, 5].isnan() and d[2, 40].isnan()  # e4m3 has no Inf: it becomes NaN, never a finite value
    assert torch.isfinite(d[3:]).all()
    # the neighbours of a non-finite element keep their precision (the scale ignores it)
    for row, cols in ((1, slice(0, 32)), (2, slice(32, 64))):
        keep = torch.isfinite(w[row, cols])
        err = (d[row, cols][keep] - w[row, cols][keep]).abs()
        assert (err <= w[row, cols][keep].abs() * 2.0**-4 + w[row, cols][keep].abs().max() * 2.0**-12).all()


@pytest.mark.parametrize(
    "shape,kwargs,message",
    [
        ((64, 48), {}, "weight: the row-wise layout needs the last dim K divisible by 32"),
        ((48, 64), {}, "weight: the column-wise layout needs dim -2 (M) divisible by 32"),
        ((64,), {}, "weight: expected at least 2 dims"),
        ((64, 64), {"rowwise": False, "columnwise": False}, "rowwise, columnwise: at least one layout"),
    ],
)
def test_bad_shapes_raise_value_error(shape, kwargs, message):
    with pytest.raises(ValueError) as info:
        mxfp8.quantize(torch.randn(shape), **kwargs)
    assert str(info.value).startswith(message)


def test_one_layout_only_and_bad_arguments():
    q = mxfp8.quantize(torch.randn(48, 64), columnwise=False)  # M=48 is fine without the column layout
    assert q.data_t is None and q.scale_t is None
    with pytest.raises(ValueError, match="^q: has no column-wise data"):
        mxfp8.dequantize(q, layout="column")
    with pytest.raises(ValueError, match="^layout: expected 'row' or 'column'"):
        mxfp8.dequantize(q, layout="diagonal")
    with pytest.raises(TypeError, match="^weight: expected dtype"):
        mxfp8.quantize(torch.randn(32, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match="^q: expected an MXFP8Weight"):
        mxfp8.dequantize(torch.randn(32, 32))


# ============================================================================================
# mok_inductor.moe with MXFP8 routed weights
#
# The oracle: the same MoE in float64 on the dequantized weights, where every routed GEMM runs forward
# with the row-wise dequantized weight and its data gradient with the column-wise one (what the MXFP8
# path computes: the transposed operand is quantized separately), and the weight gradient dy^T @ a goes
# to the master (straight-through). Power-of-two block scales make the two layouts of one weight almost
# equal (e4m3 rounding is relative), so the tests give the column-wise pair of ANOTHER random weight:
# a GEMM that reads the wrong layout then fails by O(1), not by a rounding. d router_weights comes from
# the column-wise down (<dy @ down, h>, as MoK, whose backward takes only the column-wise down). It is written here as a per-route loop, independent of
# mok_inductor.reference. Tolerances: the contract of docs/semantics.md (bf16 1e-2, float32 1e-4, relative Frobenius).

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import mok_inductor  # noqa: E402
from _helpers import DEV, DEVICES, TOLERANCE, make_case, record_launches, rel_err  # noqa: E402
from mok_inductor import kernels  # noqa: E402
from mok_inductor.kernels import configs  # noqa: E402

T, H, I, IS, E, K = 6, 64, 32, 32, 3, 2
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _DualLinear(torch.autograd.Function):
    """a @ w_row^T forward; da = g @ w_col, dw_row = g^T @ a."""

    @staticmethod
    def forward(ctx, a, w_row, w_col):
        ctx.save_for_backward(a, w_col)
        return a @ w_row.t()

    @staticmethod
    def backward(ctx, g):
        a, w_col = ctx.saved_tensors
        return g @ w_col, g.t() @ a, None


class _WeightedDown(torch.autograd.Function):
    """rw * (h @ d_row^T) forward. Backward reads only the column-wise down (MoK's backward gets no
    row-wise down): d rw = <g, h @ d_col^T> (= <g @ d_col, h>), dh = rw * g @ d_col, dd_row = rw * g^T @ h."""

    @staticmethod
    def forward(ctx, rw, h, d_row, d_col):
        ctx.save_for_backward(rw, h, d_col)
        return rw * (h @ d_row.t())

    @staticmethod
    def backward(ctx, g):
        rw, h, d_col = ctx.saved_tensors
        return (g * (h @ d_col.t())).sum().reshape(rw.shape), rw * (g @ d_col), rw * (g.t() @ h), None


def _swiglu64(g, u, limit):
    if limit is not None:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, min=-limit, max=limit)
    return torch.nn.functional.silu(g) * u


def _oracle(x, rw, te, gu_row, gu_col, d_row, d_col, sgu=None, sd=None, sg=None, limit=None):
    """float64 y; routed weights [E, 2I, H], [E, H, I] (row: forward, col: data gradient)."""
    i = gu_row.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        xt = x[t:t + 1]
        yt = torch.zeros(1, x.shape[1], dtype=x.dtype)
        if sgu is not None:
            i_s = sgu.shape[0] // 2
            s = _swiglu64(xt @ sgu[:i_s].t(), xt @ sgu[i_s:].t(), limit) @ sd.t()
            yt = yt + (s * torch.sigmoid(xt @ sg.t()) if sg is not None else s)
        for k in range(te.shape[1]):
            e = int(te[t, k])
            if e < 0:
                continue
            gu = _DualLinear.apply(xt, gu_row[e], gu_col[e])
            h = _swiglu64(gu[:, :i], gu[:, i:], limit)
            yt = yt + _WeightedDown.apply(rw[t, k], h, d_row[e], d_col[e])
        rows.append(yt)
    return torch.cat(rows)


def _problem(dtype, device, *, shared=False, limit=None, seed=0, drop=True):
    """A `make_case` draw by short names (gu, d, sgu, sd, sg); with `drop` a `-1` route; expert 2 gets fewer
    routes."""
    c = make_case(T, H, I, E, K, dtype=dtype, device=device, shared=shared, gate=shared, limit=limit, Is=IS,
                  seed=seed, requires_grad=False)
    te = c.top_experts
    if drop:
        te[1, 0] = -1  # a `-1` route
    te[2:4] = torch.tensor([0, 1], device=te.device)  # expert 2 gets fewer routes
    p = dict(x=c.x, rw=c.router_weights, te=te, gu=c.gate_up_proj, d=c.down_proj, limit=limit)
    if shared:
        p.update(sgu=c.shared_gate_up_proj, sd=c.shared_down_proj, sg=c.shared_output_gate)
    return p


def _dual(w, q):
    """(row, col) float64 dequantized weights of a routed weight (a plain tensor: itself twice)."""
    if q is None:
        return w.detach().cpu().double(), w.detach().cpu().double()
    return (mxfp8.dequantize(q, dtype=torch.float64).cpu(),
            mxfp8.dequantize(q, layout="column", dtype=torch.float64).cpu())


def _within_oracle(y, dx, x, rw, te, dy, q1, q2):
    """Whether the output y and input gradient dx of a call on quantized routed weights q1, q2 (no shared expert)
    are within the bf16 tolerance of the float64 oracle on their dequantized values."""
    (w1, w1c), (w2, w2c) = _dual(None, q1), _dual(None, q2)
    x64 = x.detach().cpu().double().requires_grad_(True)
    y64 = _oracle(x64, rw.detach().cpu().double(), te.cpu(), w1, w1c, w2, w2c)
    y64.backward(dy.detach().cpu().double())
    return rel_err(y, y64) <= TOLERANCE[torch.bfloat16] and rel_err(dx, x64.grad) <= TOLERANCE[torch.bfloat16]


def _split(q):
    """A quantized [E, M, K] weight as E per-expert MXFP8Weights (views), each with its master slice."""
    return [mxfp8.MXFP8Weight(q.data[e], q.scale[e], q.data_t[e], q.scale_t[e], q.dtype, None) for e in range(E)]


def _run_and_check(p, layout, dtype, quantized=("gu", "d")):
    """moe with the routed weights of `p` quantized (which: `quantized`) in `layout`, vs the oracle."""
    dev = p["x"].device
    masters = {n: p[n].detach().clone().requires_grad_(True) for n in ("gu", "d")}
    leaves = {n: p[n].detach().clone().requires_grad_(True) for n in ("x", "sgu", "sd", "sg") if n in p}
    rw = p["rw"].detach().clone().requires_grad_(True)
    qs, args = {}, {}
    for n in ("gu", "d"):
        if n not in quantized:
            qs[n], args[n] = None, masters[n]
            continue
        q = mxfp8.quantize(masters[n])
        assert q.master is masters[n]
        other = mxfp8.quantize(torch.randn(p[n].shape, generator=torch.Generator().manual_seed(11)).to(p[n]) * p[n].std())
        qs[n] = q._replace(data_t=other.data_t, scale_t=other.scale_t)  # see the note above _DualLinear
        if layout == "split":
            # per-expert quantized weights whose masters are views of one leaf
            args[n] = [mxfp8.quantize(masters[n][e])._replace(data_t=other.data_t[e], scale_t=other.scale_t[e])
                       for e in range(E)]
        else:
            args[n] = qs[n]
    y = mok_inductor.moe(leaves["x"], rw, p["te"], args["gu"], args["d"], shared_gate_up_proj=leaves.get("sgu"),
                         shared_down_proj=leaves.get("sd"), shared_output_gate=leaves.get("sg"),
                         swiglu_limit=p["limit"])
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype).to(dev)
    y.backward(dy)

    ref = {n: t.detach().cpu().double().requires_grad_(True) for n, t in leaves.items()}
    rw64 = p["rw"].detach().cpu().double().requires_grad_(True)
    (gr, gc), (dr, dc) = _dual(masters["gu"], qs["gu"]), _dual(masters["d"], qs["d"])
    gr.requires_grad_(True)
    dr.requires_grad_(True)
    y64 = _oracle(ref["x"], rw64, p["te"].cpu(), gr, gc, dr, dc, ref.get("sgu"), ref.get("sd"), ref.get("sg"),
                  p["limit"])
    y64.backward(dy.cpu().double())
    tol = TOLERANCE[dtype]
    checks = [("y", y, y64), ("dx", leaves["x"].grad, ref["x"].grad), ("d_router_weights", rw.grad, rw64.grad),
              ("d_gate_up_master", masters["gu"].grad, gr.grad), ("d_down_master", masters["d"].grad, dr.grad)]
    checks += [(f"d_{n}", leaves[n].grad, ref[n].grad) for n in ("sgu", "sd", "sg") if n in leaves]
    for name, out, want in checks:
        assert out is not None, f"{name}: no gradient"
        assert out.dtype == (torch.float32 if name == "d_router_weights" else dtype), name
        err = rel_err(out, want)
        assert err <= tol, f"{name}: relative error {err:.2e} vs the float64 oracle on the dequantized weights > {tol}"


# (path, device) pairs that exist in this process: the reference on the CPU and on CUDA; the Triton kernels on
# CUDA, or on CPU tensors under the interpreter where there is no CUDA (tests/conftest.py sets TRITON_INTERPRET=1
# then; a process with CUDA does not interpret)
BACKENDS = [
    ("reference", "cpu"),
    pytest.param("reference", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ("triton", DEV),
]


_OPTION_SCOPES = []


@pytest.fixture(autouse=True)
def _options_scope():
    """Options a test sets through `_backend` hold until the test ends."""
    with contextlib.ExitStack() as stack:
        _OPTION_SCOPES.append(stack)
        try:
            yield
        finally:
            _OPTION_SCOPES.pop()


def _backend(monkeypatch, path):
    _OPTION_SCOPES[-1].enter_context(mok_inductor.options.override(backend=path))


@pytest.mark.parametrize("path,device", BACKENDS)
@pytest.mark.parametrize("layout,dtype,quantized,shared,limit", [
    ("combined", torch.bfloat16, ("gu", "d"), False, None),
    ("combined", torch.float32, ("gu", "d"), True, 0.9),  # shared expert + gate + clamp, float32 at 1e-4
    ("split", torch.bfloat16, ("gu", "d"), False, None),
    ("combined", torch.bfloat16, ("gu",), True, None),  # MXFP8 gate_up next to a bf16 down_proj
    ("combined", torch.bfloat16, ("d",), False, 0.9),  # bf16 gate_up next to an MXFP8 down_proj
], ids=["combined-bf16", "shared-gate-limit-fp32", "split-bf16", "mx-gate-up-only", "mx-down-only"])
def test_moe_equals_the_computation_on_dequantized_weights(monkeypatch, device, path, layout, dtype, quantized,
                                                          shared, limit):
    _backend(monkeypatch, path)
    seed = zlib.crc32(repr((layout, dtype, quantized)).encode()) % 1000  # (not hash(): it changes per process)
    p = _problem(dtype, device, shared=shared, limit=limit, seed=seed)
    _run_and_check(p, layout, dtype, quantized)


@pytest.mark.parametrize("layout", ["combined", "split"])
def test_dequantizing_k_loop_with_bf16_activations(monkeypatch, layout):
    # at this file's sizes bf16 activations take the fp16 K loop (few routes per expert); the dequantizing K
    # loop, which they take above options.mx_f16_dot_max_rows routes per expert, checked here at the same sizes
    _backend(monkeypatch, "triton")
    _knobs(mx_f16_dot_max_rows=0)
    launched = record_launches(monkeypatch)
    p = _problem(torch.bfloat16, DEV, shared=True, limit=0.9, seed=29 + len(layout))
    _run_and_check(p, layout, torch.bfloat16)
    assert kernels.gate_up.GATE_UP in launched and kernels.gate_up.GATE_UP_MX not in launched
    assert kernels.grouped_gemm.GROUPED_ROWS in launched and kernels.grouped_gemm.GROUPED_ROWS_MX not in launched


@pytest.mark.parametrize("layout,quantized,shared,limit", [
    ("combined", ("gu", "d"), True, 0.9),
    ("split", ("gu", "d"), False, None),
    ("combined", ("d",), False, None),
], ids=["combined-shared-limit", "split", "mx-down-only"])
def test_kernels_dequantize_first_path(monkeypatch, layout, quantized, shared, limit):
    # the large-shape path (options.mx_dequantize_min_rows): operands dequantized once per call, then the
    # bf16 kernels; forced here at a tiny shape
    _knobs(mx_dequantize_min_rows=0)
    _backend(monkeypatch, "triton")
    p = _problem(torch.bfloat16, DEV, shared=shared, limit=limit, seed=len(quantized) * 10 + len(layout))
    _run_and_check(p, layout, torch.bfloat16, quantized)


def test_kernel_dequantize_is_exact_on_strided_views():
    # kernels.operands.dequantized on the gate/up row views of a combined weight and on the column-wise
    # transposed layout: bitwise what mxfp8.dequantize gives
    from mok_inductor import kernels
    from mok_inductor.mxfp8 import Operand

    w = _weight(3, 64, 96, seed=4)
    # blocks below 448 * 2**-127 get scale byte 0, 2**-127, with nonzero data: in both layouts here
    # (values kept above bf16's smallest normal, 1.2e-38: the interpreter's bf16 cast rounds subnormals wrongly)
    w[0, :32, :32] = w[0, :32, :32].sign() * (1 + w[0, :32, :32].abs() / w[0, :32, :32].abs().max()) * 1e-37
    q = mxfp8.quantize(w.to(DEV))
    assert (q.scale[0, :32, 0] == 0).all() and (q.scale_t[0, :32, 0] == 0).all()
    assert q.data[0, :32, :32].float().abs().max() > 0
    full = mxfp8.dequantize(q, dtype=torch.bfloat16)
    assert full[0, :32, :32].abs().max() > 0
    for lo, n in ((0, 32), (32, 32)):
        got = kernels.dequantized(Operand(q.data[:, lo:lo + n], q.scale[:, lo:lo + n]), torch.bfloat16).data
        assert got.is_contiguous() and torch.equal(got, full[:, lo:lo + n])
    col = mxfp8.dequantize(q, layout="column", dtype=torch.bfloat16)  # [E, 64, 96] again
    got_t = kernels.dequantized(Operand(q.data_t, q.scale_t), torch.bfloat16).data  # [E, 96, 64]
    assert torch.equal(got_t, col.transpose(-2, -1))
    # the backward's gate_t / up_t: the column-wise pair narrowed along k (its last dim), as routed_operands does
    col_t = col.transpose(-2, -1)
    for lo in (0, 32):
        op = Operand(q.data_t[..., lo:lo + 32], q.scale_t[..., lo // 32:lo // 32 + 1])
        assert torch.equal(kernels.dequantized(op, torch.bfloat16).data, col_t[..., lo:lo + 32])


def test_kernel_dequantize_reads_split_weights_in_place(monkeypatch):
    # split per-expert MXFP8 (separate allocations; the up rows of a combined FC1 as row views) is read
    # through address tables, not stacked; experts of different strides are stacked once: bitwise the same
    from mok_inductor import kernels
    from mok_inductor.mxfp8 import Operand

    q = mxfp8.quantize(_weight(3, 64, 96, seed=6).to(DEV))
    full = mxfp8.dequantize(q, dtype=torch.bfloat16)
    data, scale = [t.clone() for t in q.data], [t.clone() for t in q.scale]
    stacked, real_stack = [], torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacked.append(len(ts)) or real_stack(ts, *a, **k))
    tables, real_table = [], kernels.operands.address_table
    monkeypatch.setattr(kernels.operands, "address_table", lambda ptrs, dev: tables.append(ptrs) or real_table(ptrs, dev))
    for lo in (0, 32):
        op = Operand([t[lo:lo + 32] for t in data], [t[lo:lo + 32] for t in scale])
        got = kernels.dequantized(op, torch.bfloat16).data
        assert torch.equal(got, full[:, lo:lo + 32]), lo
        assert tuple(t.data_ptr() for t in op.data) in tables
    assert stacked == []
    mixed = Operand([data[0], data[1].t().contiguous().t(), data[2]], scale)  # expert 1 column-major: no common table
    assert torch.equal(kernels.dequantized(mixed, torch.bfloat16).data, full)
    assert stacked == [3, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_no_master_no_weight_gradient_and_no_grad_needs_no_columnwise(device):
    p = _problem(torch.bfloat16, device)
    q1, q2 = mxfp8.quantize(p["gu"], columnwise=False), mxfp8.quantize(p["d"], columnwise=False)
    assert q1.master is None  # p["gu"] does not require grad
    with torch.no_grad():
        y = mok_inductor.moe(p["x"], p["rw"], p["te"], q1, q2)
    want = _oracle(p["x"].cpu().double(), p["rw"].cpu().double(), p["te"].cpu(), *_dual(p["gu"], mxfp8.quantize(p["gu"])),
                   *_dual(p["d"], mxfp8.quantize(p["d"])))
    assert rel_err(y, want) <= TOLERANCE[torch.bfloat16]
    x = p["x"].clone().requires_grad_(True)
    q1, q2 = mxfp8.quantize(p["gu"]), mxfp8.quantize(p["d"])
    mok_inductor.moe(x, p["rw"], p["te"], q1, q2).sum().backward()  # dx only: no master, no weight gradient
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_float32_masters_are_not_needed_without_grad(device, mode):
    # weights quantized from float32 parameters keep them as masters; a call that computes no gradient (bf16 x)
    # does not need them, so their dtype is not checked: the result is the masterless call's
    p = _problem(torch.bfloat16, device)
    gu32 = torch.nn.Parameter(p["gu"].float())
    d32 = torch.nn.Parameter(p["d"].float())
    q1, q2 = mxfp8.quantize(gu32), mxfp8.quantize(d32)
    assert q1.master is gu32 and q2.master is d32
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        got = mok_inductor.moe(p["x"], p["rw"], p["te"], q1, q2)
        want = mok_inductor.moe(p["x"], p["rw"], p["te"], mxfp8.quantize(gu32.detach()), mxfp8.quantize(d32.detach()))
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="^gate_up_proj: the master weight must have the dtype of x"):
        mok_inductor.moe(p["x"], p["rw"], p["te"], q1, q2)  # with grad mode on the master is needed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_matches_reference_at_a_larger_shape_on_cuda():
    torch.manual_seed(0)
    t, h, i, e, k = 300, 512, 256, 8, 2
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    rw = torch.rand(t, k, device="cuda") + 0.1
    te = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).cuda()
    w1 = (torch.randn(e, 2 * i, h, device="cuda") * h ** -0.5).bfloat16().requires_grad_(True)
    w2 = (torch.randn(e, h, i, device="cuda") * i ** -0.5).bfloat16().requires_grad_(True)
    out = {}
    for path in ("triton", "reference"):
        with mok_inductor.options.override(backend=path):
            xx = x.clone().requires_grad_(True)
            w1.grad = w2.grad = None
            y = mok_inductor.moe(xx, rw, te, mxfp8.quantize(w1), mxfp8.quantize(w2))
            y.backward(torch.ones_like(y))
            out[path] = (y.detach(), xx.grad, w1.grad.clone(), w2.grad.clone())
    for a, b in zip(out["triton"], out["reference"]):
        assert rel_err(a, b) <= TOLERANCE[torch.bfloat16]


# ---------------------------------------------------------------------------------------------- tensor cores
#
# At up to options.mx_f16_dot_max_rows routes per expert, bf16/fp16 activations with MXFP8 weights read in the K
# loop go to the fp16 tensor cores by 32-blocks (kernels.mx_loop.MxLoop): the activation rows scaled into fp16 once per
# call (kernels.mx_loop.row_f16), each block's product scaled by its weight scales, read by a byte load per block
# (MxLoop.F16) or by 32-bit words of 4 blocks where the scale rows allow it (MxLoop.F16_WORDS, kernels.operands.scale_words;
# on 8-row tiles each whole K step as one dot, kernels.mx_loop.mx_step_t). The forward GEMMs and the backward's dx GEMM
# take that path; float32 activations keep the dequantizing loop. Under the interpreter the kernels run one
# 16x16x32 tile, where both loops are the same code: the tests below that pick 8- and 16-row tiles with K steps of
# 128 and 256 (`_one_mx_config`) run every form.

F16, F16_WORDS = kernels.mx_loop.MxLoop.F16, kernels.mx_loop.MxLoop.F16_WORDS


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_scaled_fp16_activations(monkeypatch, dtype, one_pass):
    # kernels.mx_loop.row_f16: each row times one power of two into fp16's largest octave, read through strides; exact
    # but far below the row's largest element (fp16's subnormals); a NaN or an Inf poisons its row's scale. Both
    # kernel forms: a row read once (ONE_PASS), or twice in steps of columns.
    launched, real = [], kernels.common.launch
    monkeypatch.setattr(kernels.common, "launch", lambda k, *a, **kw: launched.append(kw["ONE_PASS"]) or real(k, *a, **kw))
    g = torch.Generator().manual_seed(6)
    octaves = 20 if dtype == torch.bfloat16 else 6
    base = torch.randn(200, 9, generator=g) * torch.exp2(torch.randint(-octaves, octaves, (1, 9), generator=g).float())
    a = base.t()  # [9, 200], strides (1, 9)
    a[:, 17] *= 64
    a[2] = 0.0  # an all-zero row
    a[5, 3] = float("nan")
    a[6, 100] = float("inf")
    a = a.to(dtype)
    a16, r_s = kernels.mx_loop.row_f16(a.to(DEV), **({} if one_pass else dict(one_pass_max=64)))
    a16, r_s = a16.cpu(), r_s.cpu().double()
    assert launched == [one_pass]
    assert a16.dtype == torch.float16 and a16.shape == a.shape and a16.is_contiguous()
    assert torch.isnan(r_s[5]) and torch.isnan(r_s[6])
    a64 = a.double()
    for r in [r for r in range(9) if r not in (5, 6)]:
        s = r_s[r].item()
        assert s > 0 and math.frexp(s)[0] == 0.5  # a power of two
        amax = a64[r].abs().max().item()
        assert amax == 0 or 2.0 ** 14 <= amax / s < 2.0 ** 15
        back = a16[r].double() * s
        big = a64[r].abs() >= amax * 2.0 ** -28
        assert torch.equal(back[big], a64[r][big]), r
        assert ((back - a64[r]).abs() <= s * 2.0 ** -25).all(), r
    assert torch.equal(a16[2], torch.zeros(200, dtype=torch.float16))


def test_fp16_loop_with_block_scales_far_apart(monkeypatch):
    # the fp16 K loop with weight blocks up to 40 octaves apart in one row (and activation rows scaled as a
    # whole): within bf16's tolerance of the float64 computation on the dequantized weights, no NaN or Inf, an
    # all-zero weight row's outputs zero. Two experts, k = 192 (one whole K step of 4 blocks, two tail blocks)
    from mok_inductor.mxfp8 import Operand

    launched = _mx_dot_on(monkeypatch)
    g = torch.Generator().manual_seed(8)
    e, n, kd, m = 2, 40, 192, 18
    spread = torch.exp2(torch.randint(-40, 1, (e, n, kd // 32, 1), generator=g).float())
    w = (torch.randn(e, n, kd // 32, 32, generator=g) * spread).reshape(e, n, kd)
    w[1, 7] = 0.0
    q = mxfp8.quantize(w.bfloat16(), columnwise=False)
    assert (q.scale[1, 7] == 0).all() and (q.scale.int().amax(-1) - q.scale.int().amin(-1)).max() >= 30
    a = torch.randn(m, kd, generator=g).bfloat16()
    offsets = torch.tensor([0, 11, m], dtype=torch.int32)
    routes = torch.arange(m, dtype=torch.int32)
    dev = DEV
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    kernels.grouped_gemm.grouped_rows(a.to(dev), Operand(q.data.to(dev), q.scale.to(dev)), out, routes.to(dev), offsets.to(dev),
                         scatter=False)
    assert kernels.grouped_gemm.GROUPED_ROWS_MX in launched
    wd = mxfp8.dequantize(q, dtype=torch.float64)
    want = torch.cat([a[:11].double() @ wd[0].t(), a[11:].double() @ wd[1].t()])
    out = out.cpu()
    assert torch.isfinite(out).all() and rel_err(out, want) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[11:, 7], torch.zeros(m - 11, dtype=torch.bfloat16))


def _to_device(q, device):
    """An MXFP8Weight with its data and scales (both layouts) on `device`."""
    return q._replace(**{f: getattr(q, f).to(device) for f in ("data", "scale", "data_t", "scale_t")})


def _knobs(**changes):
    """`mok_inductor.options.override(**changes)` from the call until the test ends (`_options_scope`)."""
    _OPTION_SCOPES[-1].enter_context(mok_inductor.options.override(**changes))


def _mx_dot_on(monkeypatch):
    """The kernels launched (a list, filled as they run), the fp16 K loops taken at every row count."""
    _knobs(mx_f16_dot_max_rows=1 << 40)
    return record_launches(monkeypatch)


def _f16_kernels():
    """(gate/up, grouped rows) kernel families of the fp16 K loops."""
    return kernels.gate_up.GATE_UP_MX, kernels.grouped_gemm.GROUPED_ROWS_MX


def test_fp16_tensor_cores_at_decode_sizes_only(monkeypatch):
    # bf16/fp16 activations take the fp16 K loop at most options.mx_f16_dot_max_rows routes per expert on
    # average, the dequantizing loop above that, for float32 activations, next to a bf16 operand, and for a
    # symbolic row count not known to be that small (no guard)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    q = mxfp8.Operand(torch.ones(E, 64, 64).to(torch.float8_e4m3fn), torch.full((E, 64, 2), 127, dtype=torch.uint8))
    plain = mxfp8.Operand(torch.ones(E, 64, 64, dtype=torch.bfloat16), None)
    most = mok_inductor.options.current().mx_f16_dot_max_rows * E
    use, dequantize = kernels.mx_loop.use_mx_loop, kernels.mx_loop.MxLoop.DEQUANTIZE
    for dtype in (torch.bfloat16, torch.float16):
        assert use(dtype, 1, E, q, q) == F16 and use(dtype, most, E, q, q) == F16
        assert use(dtype, most + 1, E, q, q) == dequantize
        assert use(dtype, 1, E, q, plain) == dequantize
    assert use(torch.float32, 1, E, q, q) == dequantize
    n = ShapeEnv().create_unbacked_symint()
    assert use(torch.bfloat16, n, E, q, q) == dequantize
    assert use(torch.bfloat16, n * 0 + most, E, q, q) == F16  # statically known

    # and the layer launches accordingly: the fp16 loop (and its row pre-pass) at max_rows * E routes, the
    # dequantizing one past them
    _backend(monkeypatch, "triton")
    launched = record_launches(monkeypatch)
    _knobs(mx_f16_dot_max_rows=2)  # (small problems for the interpreter)
    g = torch.Generator().manual_seed(23)
    q1, q2 = mxfp8.quantize(_weight(E, 2 * I, H, seed=3)), mxfp8.quantize(_weight(E, H, I, seed=4))
    q1, q2 = _to_device(q1, DEV), _to_device(q2, DEV)
    for t, want in ((2 * E // K, kernels.gate_up.GATE_UP_MX), (2 * E // K + 1, kernels.gate_up.GATE_UP)):
        x = torch.randn(t, H, generator=g).bfloat16().to(DEV)
        rw = (torch.rand(t, K, generator=g) + 0.1).to(DEV)
        te = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(DEV)
        launched.clear()
        with torch.no_grad():
            mok_inductor.moe(x, rw, te, q1, q2)
        gate_up = [k for k in launched if k in (kernels.gate_up.GATE_UP_MX, kernels.gate_up.GATE_UP)]
        assert gate_up == [want], (t, gate_up)
        assert launched.count(kernels.mx_loop._row_f16_kernel) == (2 if want is kernels.gate_up.GATE_UP_MX else 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout,shared,limit", [("combined", True, 0.9), ("split", False, None)])
def test_tensor_core_path_vs_oracle(monkeypatch, dtype, layout, shared, limit):
    # the fp16 GEMMs run (forward gate/up and down, backward dx) and the layer is within bf16's tolerance of the
    # float64 computation on the dequantized weights, gradients included
    _backend(monkeypatch, "triton")
    launched = _mx_dot_on(monkeypatch)
    p = _problem(dtype, DEV, shared=shared, limit=limit, seed=17 + len(layout))
    _run_and_check(p, layout, dtype)
    gate_up, rows = _f16_kernels()
    assert gate_up in launched and rows in launched
    assert launched.count(rows) == 2  # the forward's down, the backward's dx


def test_tensor_core_path_against_the_dequantizing_loop(monkeypatch):
    # the same layer through both K loops at a deeper reduction (H = 256: 8 scale blocks), activations with
    # outliers: the fp16 path is as close to the exact dequantized-weight computation as bf16 rounding allows,
    # and float32 activations never take it

    _backend(monkeypatch, "triton")
    g = torch.Generator().manual_seed(21)
    t, h, i, e, k = 12, 256, 64, 3, 2
    x = torch.randn(t, h, generator=g) * torch.exp2(torch.randint(-6, 7, (t, 1), generator=g).float())
    x[:, 7] *= 30
    rw = torch.rand(t, k, generator=g) + 0.1
    te = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    q1, q2 = mxfp8.quantize(_weight(e, 2 * i, h, seed=1)), mxfp8.quantize(_weight(e, h, i, seed=2))
    dev = DEV
    args = [v.to(dev) for v in (rw, te)]
    q1, q2 = _to_device(q1, dev), _to_device(q2, dev)
    w1, w2 = (mxfp8.dequantize(q, dtype=torch.float64).cpu() for q in (q1, q2))
    want = _oracle(x.bfloat16().double(), rw.double(), te, w1, w1, w2, w2)  # (forward only: no column-wise)
    launched = _mx_dot_on(monkeypatch)
    gate_up, rows = _f16_kernels()
    with torch.no_grad():
        y_dot = mok_inductor.moe(x.bfloat16().to(dev), *args, q1, q2)
        assert gate_up in launched
        launched.clear()
        with mok_inductor.options.override(mx_f16_dot_max_rows=0):  # the dequantizing loop
            y_deq = mok_inductor.moe(x.bfloat16().to(dev), *args, q1, q2)
        assert kernels.gate_up.GATE_UP in launched and gate_up not in launched
        launched.clear()
        mok_inductor.moe(x.to(dev), *args, q1, q2)  # float32 activations
        assert gate_up not in launched and rows not in launched
    e_dot, e_deq = rel_err(y_dot, want), rel_err(y_deq, want)
    # both well inside bf16's 1e-2; the exact fp16 term adds no rounding of its own
    assert e_deq < 4e-3 and e_dot < 4e-3, (e_dot, e_deq)


@pytest.mark.parametrize("kd", [32, 160])  # no whole K step; one whole step (4 blocks) and a 1-block tail
def test_tensor_core_path_reads_no_scale_past_k(monkeypatch, kd):
    # K steps of BLOCK_K 128 over k = 32 or 160 (a tail of one block): no block past k's end may be read, its
    # scale least of all (one byte 255 is 2**128, and a zero tile times Inf is NaN, which a loop over whole K
    # steps would produce). The scales are a view into a buffer holding 255 right after each row's blocks
    from mok_inductor.mxfp8 import Operand

    launched = _mx_dot_on(monkeypatch)
    wide = configs.Tile(16, 16, 128, 1, 3)
    _force_tile(monkeypatch, wide, [kernels.grouped_gemm.GROUPED_ROWS_MX])
    tiles = _record_tiles(monkeypatch)
    e, n, m = 2, 48, 20
    q = mxfp8.quantize(_weight(e, n, kd, seed=5), columnwise=False)
    nb = kd // 32
    buf = torch.full((e, n, nb + 3), 255, dtype=torch.uint8)
    buf[..., :nb] = q.scale
    a = torch.randn(m, kd, generator=torch.Generator().manual_seed(2)).bfloat16()
    offsets = torch.tensor([0, 12, m], dtype=torch.int32)
    routes = torch.arange(m, dtype=torch.int32)
    dev = DEV
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    kernels.grouped_gemm.grouped_rows(a.to(dev), Operand(q.data.to(dev), buf.to(dev)[..., :nb]), out, routes.to(dev),
                         offsets.to(dev), scatter=False)
    assert kernels.grouped_gemm.GROUPED_ROWS_MX in launched and tiles == [(kernels.grouped_gemm.GROUPED_ROWS_MX, wide)]
    w = mxfp8.dequantize(q, dtype=torch.float64)
    want = torch.cat([a[:12].double() @ w[0].t(), a[12:].double() @ w[1].t()])
    assert torch.isfinite(out).all() and rel_err(out, want) <= TOLERANCE[torch.bfloat16]


def _record_modes(monkeypatch) -> list:
    """(kernel family, MX_LOOP) of each launch of the two fp16 K-loop families from here on (a list filled as
    they run; every launch still runs)."""
    seen, real = [], kernels.common.launch

    def launch(kernel, *args, **kwargs):
        if kernel in _f16_kernels():
            seen.append((kernel, kwargs.get("MX_LOOP")))
        return real(kernel, *args, **kwargs)

    monkeypatch.setattr(kernels.common, "launch", launch)
    return seen


def _force_tile(monkeypatch, tile, families):
    """Launches of `families` on `tile` alone: the interpreter's tile (`Family.interpret`) and, on CUDA, the
    tables' pick (`configs.pick`); a later call for the same families replaces the tile."""
    real = getattr(configs.pick, "unforced", configs.pick)

    def pick(family, *args, **kwargs):
        return tile if family in families else real(family, *args, **kwargs)

    pick.unforced = real
    monkeypatch.setattr(configs, "pick", pick)
    for family in families:
        monkeypatch.setattr(family, "interpret", tile)


def _record_tiles(monkeypatch) -> list:
    """(kernel family, tile) of each eager launch of a tuned kernel from here on (a list filled as they run)."""
    seen, real = [], configs.launch_eager

    def launch_eager(family, tile, *args, **kwargs):
        seen.append((family, tile))
        return real(family, tile, *args, **kwargs)

    monkeypatch.setattr(configs, "launch_eager", launch_eager)
    return seen


def _one_mx_config(monkeypatch, block_m, block_k):
    """Both fp16 K-loop families (gate/up, grouped rows) on one tile config: BLOCK_N 128, 2 warps, 3 stages."""
    _force_tile(monkeypatch, configs.Tile(block_m, 128, block_k, 2, 3), _f16_kernels())


def _spread_problem(seed, *, t, h, i, e, k):
    """(gate_up, down quantized, x, router weights, expert ids, dy) of a bf16 layer whose weight blocks are up to
    40 octaves apart (block scales far from each other)."""
    g = torch.Generator().manual_seed(seed)

    def spread_weight(n, kd):
        spread = torch.exp2(torch.randint(-40, 1, (e, n, kd // 32, 1), generator=g).float())
        return (torch.randn(e, n, kd // 32, 32, generator=g) * spread).reshape(e, n, kd).bfloat16()

    q1, q2 = mxfp8.quantize(spread_weight(2 * i, h)), mxfp8.quantize(spread_weight(h, i))
    x = torch.randn(t, h, generator=g).bfloat16()
    rw = torch.rand(t, k, generator=g) + 0.1
    te = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return q1, q2, x, rw, te, torch.randn(t, h, generator=g).bfloat16()


def _padded_scales(q, to, fields=("scale",)):
    """q with the same scales (`fields`: the row-wise ones, or also the column-wise), each row padded with 255s to
    a stride of a multiple of `to` bytes, or (to=1) one byte longer: a stride no word load may take. Made on q's
    device (a copy there would be contiguous)."""
    def pad(s):
        nb = s.shape[-1]
        stride = -(-nb // to) * to + (1 if to == 1 else 0)
        buf = torch.full((*s.shape[:-1], stride), 255, dtype=torch.uint8, device=s.device)
        buf[..., :nb] = s
        return buf[..., :nb]

    return q._replace(**{f: pad(getattr(q, f)) for f in fields})


def _fwd_bwd(seen, x, rw, te, q1, q2, dy):
    """(y, dx, the K-loop kernels' modes) of one forward and backward of the layer on DEV (q1, q2 there
    already), `_record_modes`'s list `seen` cleared first."""
    dev = DEV
    seen.clear()
    xl = x.to(dev, copy=True).requires_grad_(True)
    y = mok_inductor.moe(xl, rw.to(dev), te.to(dev), q1, q2)
    y.backward(dy.to(dev))
    return y.detach().cpu(), xl.grad.cpu(), [mode for _, mode in seen]


def _spread_setup(monkeypatch, seed, block_m, block_k, **shape):
    """The triton backend, the fp16 K loops at every row count (`_mx_dot_on`) on one tile config
    (`_one_mx_config`), the launches' modes recorded from here on (`_record_modes`), and a `_spread_problem` of
    this shape: (seen, gate_up, down quantized, x, router weights, expert ids, dy)."""
    _backend(monkeypatch, "triton")
    _mx_dot_on(monkeypatch)
    seen = _record_modes(monkeypatch)
    _one_mx_config(monkeypatch, block_m, block_k)
    return (seen, *_spread_problem(seed, **shape))


@pytest.mark.parametrize("block_k", [128, 256])
def test_scale_words_match_the_byte_loads(monkeypatch, block_k):
    # MxLoop.F16_WORDS (kernels.operands.scale_words) on 16-row tiles: each column's scales of 4 blocks read by one 32-bit
    # word (rows of a multiple of 4 blocks). Blocks 40 octaves apart; H = 384 (3 K steps of 128, or one of 256 and
    # 4 tail blocks), I = 256: the layer is bit for bit what the byte loads give (MxLoop.F16: scale rows whose
    # stride is not a multiple of 4), also with the gate/up scale rows padded to 16 bytes, and within bf16's
    # tolerance of the float64 computation
    seen, q1, q2, x, rw, te, _ = _spread_setup(monkeypatch, 31, 16, block_k, t=10, h=384, i=256, e=3, k=2)
    dev = DEV

    def run(a, b):
        seen.clear()
        with torch.no_grad():
            y = mok_inductor.moe(x.to(dev), rw.to(dev), te.to(dev), a, b).cpu()
        return y, [mode for _, mode in seen]

    q1, q2 = _to_device(q1, dev), _to_device(q2, dev)
    y_words, modes_words = run(q1, q2)
    y_bytes, modes_bytes = run(_padded_scales(q1, 1), _padded_scales(q2, 1))
    y_padded, modes_padded = run(_padded_scales(q1, 8), q2)
    assert modes_words == [F16_WORDS, F16_WORDS] and modes_bytes == [F16, F16]
    assert modes_padded == [F16_WORDS, F16_WORDS]
    assert torch.equal(y_words, y_bytes) and torch.equal(y_words, y_padded)
    w1, w2 = (mxfp8.dequantize(q, dtype=torch.float64).cpu() for q in (q1, q2))
    want = _oracle(x.double(), rw.double(), te, w1, w1, w2, w2)
    assert rel_err(y_words, want) <= TOLERANCE[torch.bfloat16]


def test_transposed_row_tiles(monkeypatch):
    # row tiles of 8 with scale bytes (MxLoop.F16, kernels.mx_loop.mx_dot_t: each block's product computed as W @ A^T, the
    # weights on the MMA's 16-row side): forward (gate/up, down) and backward (dx, both halves) equal the float64
    # computation on the dequantized weights within bf16's tolerance, and the 16-row tiles' result within a few
    # roundings. H = 384 (3 whole K steps; gate/up's scale rows padded: bytes), I = 160 (one step and a tail
    # block, scale rows of 5 blocks: bytes), blocks 40 octaves apart, experts with more routes than a tile holds
    seen, q1, q2, x, rw, te, dy = _spread_setup(monkeypatch, 37, 8, 128, t=12, h=384, i=160, e=3, k=2)
    dev = DEV
    q1, q2 = _padded_scales(_to_device(q1, dev), 1), _to_device(q2, dev)

    def run(block_m):
        _one_mx_config(monkeypatch, block_m, 128)
        y, dx, modes = _fwd_bwd(seen, x, rw, te, q1, q2, dy)
        assert modes == [F16, F16, F16]  # the forward's gate/up and down, the backward's dx
        return y, dx

    y8, dx8 = run(8)
    y16, dx16 = run(16)
    assert _within_oracle(y8, dx8, x, rw, te, dy, q1, q2)
    assert rel_err(y8, y16) <= 4e-3 and rel_err(dx8, dx16) <= 4e-3


@pytest.mark.parametrize("block_k", [128, 256])
def test_one_dot_k_steps(monkeypatch, block_k):
    # MxLoop.F16_WORDS on 8-row tiles (kernels.mx_loop.mx_step_t): each whole K step as one fp16 dot, each weight scaled by
    # 2**(s - top) in fp16 (s its block's scale, top the step's largest in its column), the tail's blocks one by
    # one. Blocks 40 octaves apart, so that in a step some factors are fp16 subnormals and some blocks drop out;
    # H = 384 (3 steps of 128, or one of 256 and a tail of 4 blocks), I = 256 (scale rows of 8 and 16 blocks:
    # words, in the forward's gate/up and down and the backward's dx): forward and dx within bf16's tolerance of
    # the float64 computation, and within a few roundings of the blocks one by one (MxLoop.F16: every scale row,
    # row-wise and column-wise, padded to a stride no word load takes)
    seen, q1, q2, x, rw, te, dy = _spread_setup(monkeypatch, 43, 8, block_k, t=12, h=384, i=256, e=3, k=2)
    dev = DEV
    q1, q2 = _to_device(q1, dev), _to_device(q2, dev)
    y8, dx8, modes8 = _fwd_bwd(seen, x, rw, te, q1, q2, dy)
    qb1, qb2 = (_padded_scales(q, 1, ("scale", "scale_t")) for q in (q1, q2))
    yb, dxb, modesb = _fwd_bwd(seen, x, rw, te, qb1, qb2, dy)
    assert modes8 == [F16_WORDS] * 3 and modesb == [F16] * 3
    assert torch.isfinite(y8).all() and torch.isfinite(dx8).all()
    assert _within_oracle(y8, dx8, x, rw, te, dy, q1, q2)
    assert rel_err(y8, yb) <= 4e-3 and rel_err(dx8, dxb) <= 4e-3


@pytest.mark.parametrize("where", ["x", pytest.param("weight", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the interpreter decodes the e4m3 NaN (0x7F) as 480"))])
def test_one_dot_k_steps_propagate_nan(monkeypatch, where):
    # F16_WORDS's one-dot steps: a NaN activation poisons its token's output rows only; a NaN weight element (in a
    # block that is not its step's largest, so that its factor is below 1) its expert's routes
    seen, q1, q2, x, rw, te, _ = _spread_setup(monkeypatch, 47, 8, 128, t=12, h=384, i=256, e=3, k=2)
    if where == "x":
        x = x.clone()
        x[4, 10] = float("nan")
        bad = torch.zeros(x.shape[0], dtype=torch.bool)
        bad[4] = True
    else:
        row = q1.scale[1, 3, :4].int()  # expert 1's gate row 3, the first K step's 4 blocks
        b = int(row.argmin())
        assert row[b] < row.max()
        data = q1.data.clone()
        data[1, 3, 32 * b + 5] = float("nan")
        q1 = q1._replace(data=data)
        bad = (te == 1).any(1)
    dev = DEV
    with torch.no_grad():
        y = mok_inductor.moe(x.to(dev), rw.to(dev), te.to(dev), _to_device(q1, dev), _to_device(q2, dev)).cpu()
    assert [mode for _, mode in seen] == [F16_WORDS, F16_WORDS]
    assert torch.isnan(y[bad]).all(dim=1).all() and torch.isfinite(y[~bad]).all()


@pytest.mark.parametrize("where", ["x", pytest.param("weight", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the interpreter decodes the e4m3 NaN (0x7F) as 480"))])
def test_tensor_core_path_propagates_nan(monkeypatch, where):
    # a NaN activation poisons its token's output rows only; a NaN weight element its expert's routes
    _backend(monkeypatch, "triton")
    _mx_dot_on(monkeypatch)
    p = _problem(torch.bfloat16, DEV, drop=False)
    x = p["x"].clone()
    q1, q2 = mxfp8.quantize(p["gu"]), mxfp8.quantize(p["d"])
    if where == "x":
        x[4, 10] = float("nan")
        bad = torch.zeros(T, dtype=torch.bool)
        bad[4] = True
    else:
        data = q1.data.clone()
        data[1, 3, 40] = float("nan")  # expert 1's gate row 3
        q1 = q1._replace(data=data)
        bad = (p["te"].cpu() == 1).any(1)
    with torch.no_grad():
        y = mok_inductor.moe(x, p["rw"], p["te"], q1, q2).cpu()
    assert torch.isnan(y[bad]).all(dim=1).all() and torch.isfinite(y[~bad]).all()


# ---------------------------------------------------------------------------------------------- e4m3 decoding
#
# The dequantizing K loop (kernels.operands.w_tile) must give the dequantized value e4m3 * 2**(s - 127) for every e4m3
# bit pattern and every scale byte: exact in bf16's normal range, rounded once where it underflows.


@triton.jit
def _decode_kernel(w_ptr, s_ptr, like_ptr, out_ptr, DOT_PREC: tl.constexpr):
    n = tl.program_id(0) * 64 + tl.arange(0, 64)  # 256 rows: row n has scale byte n in each 32-block
    k = tl.program_id(1) * 64 + tl.arange(0, 64)  # 256 columns: column k holds e4m3 bit pattern k
    ones = tl.full([64], 1, tl.int1)
    w = kernels.operands.w_tile(w_ptr, s_ptr, k, n, ones, ones, 256, 1, 8, 1, like_ptr, True, DOT_PREC)  # [k, n]
    tl.store(out_ptr + n[None, :] * 256 + k[:, None], w.to(tl.float32))


def test_every_e4m3_pattern_and_scale_decodes_exactly():
    patterns = torch.arange(256, dtype=torch.uint8)
    data = patterns.repeat(256, 1).view(torch.float8_e4m3fn).to(DEV)  # [n, k]
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8).to(DEV)  # [n, k / 32]
    out = torch.full((256, 256), 12345.0, device=DEV)  # poisoned: every element must be written
    like = torch.empty(1, dtype=torch.bfloat16, device=DEV)
    _decode_kernel[(4, 4)](data, scales, like, out, DOT_PREC=kernels.common.dot_precision(torch.bfloat16))
    # from the formats' definitions: e4m3 S.EEEE.MMM (bias 7, subnormals at E = 0, NaN at EEEE.MMM = 1111.111),
    # E8M0 2**(byte - 127) (byte 0: 2**-127, a float32 subnormal), in float32 as the kernels build it: byte 255
    # is Inf
    sign = torch.where(patterns >= 128, -1.0, 1.0).double()
    e, m = ((patterns >> 3) & 15).double(), (patterns & 7).double()
    value = sign * torch.where(e > 0, (1 + m / 8) * torch.exp2(e - 7), m / 8 * 2.0 ** -6)
    value[(patterns & 127) == 127] = float("nan")
    factor = torch.exp2(torch.arange(256).double() - 127)
    factor[255] = float("inf")
    # exact, then the tile's dtype: bf16 (its range and rounding of underflow); the interpreter keeps the decoded
    # tile in float32, which holds every product exactly
    tile_dtype = torch.float32 if kernels.common.INTERPRET else torch.bfloat16
    want = (factor[:, None] * value[None, :]).to(tile_dtype).double()
    got = out.cpu().double()
    if kernels.common.INTERPRET:
        # the interpreter's own e4m3 conversion reads the NaN pattern as +-480 (CUDA's does not: it is checked
        # there)
        keep = (patterns & 127) != 127
        got, want = got[:, keep], want[:, keep]
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all(), f"{(~same).sum().item()} of {same.numel()} decoded values differ, e.g. {got[~same][:4]} vs " \
                       f"{want[~same][:4]}"


# ---------------------------------------------------------------------------------------------- bad input


def _mx_call(gu, d, x=None, p=None):
    p = p or _problem(torch.bfloat16, "cpu")
    return mok_inductor.moe(p["x"] if x is None else x, p["rw"], p["te"], gu, d)


def test_bad_mxfp8_weights_raise_naming_the_argument():
    p = _problem(torch.bfloat16, "cpu")
    q1, q2 = mxfp8.quantize(p["gu"]), mxfp8.quantize(p["d"])
    cases = [
        # reduction dim not a multiple of 32 (hand-built: quantize itself refuses it)
        (ValueError, mxfp8.MXFP8Weight(q1.data[..., :48], q1.scale[..., :1], None, None, torch.bfloat16), q2,
         "gate_up_proj: MXFP8 needs the reduction dim (the last, 48) divisible by 32"),
        (TypeError, q1._replace(data=p["gu"]), q2, "gate_up_proj: MXFP8 data must be float8_e4m3fn, got bfloat16"),
        (TypeError, q1, q2._replace(scale=q2.scale.float()),
         "down_proj: MXFP8 scale must be uint8 (biased E8M0 exponents), got float32"),
        (ValueError, q1, q2._replace(scale=q2.scale[:, :, :0]),
         "down_proj: expected MXFP8 scale of shape [3, 64, 1], got [3, 64, 0]"),
        (ValueError, q1._replace(data_t=None), q2, "gate_up_proj: column-wise MXFP8 data and scales must be given together"),
        (TypeError, q1, mxfp8.quantize(p["d"].float().requires_grad_(True)),
         "down_proj: the master weight must have the dtype of x (bfloat16), got float32"),
        (ValueError, q1, mxfp8.quantize(p["d"][:, :, :32].repeat(1, 1, 2)[:, :32]),
         "down_proj: expected shape [3, 64, 32] [E, H, I] (matching gate_up_proj [E, 2*I, H]), got [3, 32, 64]"),
    ]
    for exc, gu, d, message in cases:
        with pytest.raises(exc) as info:
            _mx_call(gu, d, p=p)
        assert str(info.value) == message


def test_missing_columnwise_data_when_backward_is_needed():
    p = _problem(torch.bfloat16, "cpu")
    x = p["x"].clone().requires_grad_(True)
    with pytest.raises(ValueError) as info:
        _mx_call(mxfp8.quantize(p["gu"], columnwise=False), mxfp8.quantize(p["d"]), x=x, p=p)
    assert str(info.value) == ("gate_up_proj: the backward needs the column-wise MXFP8 data (quantize with "
                               "columnwise=True), or run under torch.no_grad()")


def test_combined_gate_up_needs_i_divisible_by_32_for_the_columnwise_layout():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 32, generator=g).bfloat16()
    rw, te = torch.rand(4, 1, generator=g), torch.zeros(4, 1, dtype=torch.int64)
    q1 = mxfp8.quantize(torch.randn(1, 32, 32, generator=g).bfloat16())  # I = 16
    q2 = torch.randn(1, 32, 16, generator=g).bfloat16()  # a bf16 down_proj (I = 16 cannot be MXFP8 row-wise)
    with pytest.raises(ValueError) as info:
        with torch.no_grad():
            mok_inductor.moe(x, rw, te, q1, q2)
    assert str(info.value) == ("gate_up_proj: the column-wise MXFP8 layout of a combined gate/up weight needs I (16) "
                               "divisible by 32 (a scale block must not hold both gate and up rows)")


def test_split_list_errors():
    p = _problem(torch.bfloat16, "cpu")
    parts = [mxfp8.quantize(p["gu"][e]) for e in range(E)]
    parts[1] = mxfp8.quantize(p["gu"][1, :32])
    with pytest.raises(ValueError, match=r"^gate_up_proj\[1\]: expected the shape of gate_up_proj\[0\] \[64, 64\]"):
        _mx_call(parts, mxfp8.quantize(p["d"]), p=p)


# ---------------------------------------------------------------------------------------------- functional ABI


def _split_abi(q, native: bool):
    """A quantized [E, M, K] weight as a split SplitRoutedWeight of per-expert copies (fresh allocations, as
    Megatron's weight0 ... weight{E-1}): column-wise pairs as [K, M] / [K, M/32], or TE's native [M, K] /
    [M/32, K] storage."""
    from mok_inductor import functional as mf

    def copies(t):
        return tuple(t[e].clone() for e in range(t.shape[0]))

    if native:
        return mf.SplitRoutedWeight(data=copies(q.data), scale=copies(q.scale),
                                    transposed_data=copies(q.data_t.transpose(1, 2).contiguous()),
                                    transposed_scale=copies(q.scale_t.transpose(1, 2).contiguous()),
                                    native_columnwise=True)
    return mf.SplitRoutedWeight(data=copies(q.data), scale=copies(q.scale), transposed_data=copies(q.data_t),
                                transposed_scale=copies(q.scale_t))


@pytest.mark.parametrize("path,device", BACKENDS)
@pytest.mark.parametrize("layout", ["legacy", "native", "split", "split-native", "split-dequantized-first"])
def test_functional_abi_with_mxfp8_tuples_and_main_grads(monkeypatch, device, path, layout):
    from mok_inductor import functional as mf, kernels

    _backend(monkeypatch, path)
    if layout == "split-dequantized-first":  # the large-shape path (operands dequantized once per call), forced
        _OPTION_SCOPES[-1].enter_context(mok_inductor.options.override(mx_dequantize_min_rows=0))
    p = _problem(torch.bfloat16, device, shared=True, seed=21)
    q1 = mxfp8.quantize(p["gu"])
    o1 = mxfp8.quantize(torch.randn(p["gu"].shape, generator=torch.Generator().manual_seed(3)).to(p["gu"]) * p["gu"].std())
    q1 = q1._replace(data_t=o1.data_t, scale_t=o1.scale_t)  # a distinct column-wise pair (see above)
    q2 = mxfp8.quantize(p["d"])
    cfg = mf.MoKConfig()
    ws = mf.get_workspace(cfg, None, device=p["x"].device, num_local_tokens=T, hidden_size=H, topk=K)
    sch = mf.build_schedule(ws, cfg, p["te"], num_local_experts=E)
    sgu, sd, sg = p["sgu"], p["sd"], p["sg"]
    shared = (sgu[:IS], sgu[IS:], sd)
    split = layout.startswith("split")
    if split:  # one descriptor per weight for forward and backward (MoK's split layout)
        fc1_fwd = fc1_bwd = _split_abi(q1, layout == "split-native")
        fc2_fwd = fc2_bwd = _split_abi(q2, layout == "split-native")
    else:
        fc1_fwd, fc2_fwd = (q1.data, q1.scale), (q2.data, q2.scale)
    stacked_mx, real_stack = [], torch.stack
    if split:  # the kernels read split MXFP8 in place (address tables): no stacked copy of e4m3 data or scales
        monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacked_mx.extend(
            t.dtype for t in ts if t.dtype in (torch.float8_e4m3fn, torch.uint8)) or real_stack(ts, *a, **k))
    y, fctx = mf.forward(cfg, ws, sch, p["x"], p["rw"], *shared, fc1_fwd, fc1_fwd, fc2_fwd,
                         shared_output_gate_weight=sg)
    if layout == "legacy":
        fc1_bwd = (q1.data, q1.scale, q1.data_t, q1.scale_t)
        fc2_bwd = (q2.data_t, q2.scale_t)
    elif layout == "native":  # TE's native column-wise storage: [E, M, K] data, [E, M/32, K] scales, flagged True
        fc1_bwd = (q1.data, q1.scale, q1.data_t.transpose(1, 2).contiguous(), q1.scale_t.transpose(1, 2).contiguous(),
                   True)
        fc2_bwd = (q2.data_t.transpose(1, 2).contiguous(), q2.scale_t.transpose(1, 2).contiguous(), True)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(y)
    g = torch.Generator().manual_seed(8)
    main = [torch.randn(s, generator=g).to(p["x"].device) for s in
            ((IS, H), (E, 2 * I, H), (IS, H), (E, 2 * I, H), (H, IS), (E, H, I))]
    main[3] = main[1]  # one combined routed FC1 buffer, passed twice
    start = [m.clone() for m in main]
    tables = None
    if split:  # per-expert main-grad buffers (Megatron's layout): tables of views; the entries representatives
        main[1], main[5] = [m.clone() for m in main[1]], [m.clone() for m in main[5]]
        tables = (main[1], main[1], main[5])
        main_args = [main[0], main[1][0], main[2], main[1][0], main[4], main[5][0]]
    else:
        main_args = main
    out = mf.backward(cfg, ws, sch, fctx, dy, p["x"], p["rw"], *shared, fc1_bwd, fc1_bwd, fc2_bwd,
                      main_grads=main_args, main_grad_storage_tables=tables, shared_output_gate_weight=sg)
    assert out[2] is main_args[1] and out[4] is main_args[5]
    if path == "triton":
        assert stacked_mx == []
    monkeypatch.setattr(torch, "stack", real_stack)
    if split:
        main[1], main[5] = torch.stack(main[1]), torch.stack(main[5])

    leaves = {n: p[n].detach().cpu().double().requires_grad_(True) for n in ("x", "rw", "sgu", "sd", "sg")}
    (gr, gc), (dr, dc) = _dual(p["gu"], q1), _dual(p["d"], q2)
    gr.requires_grad_(True)
    dr.requires_grad_(True)
    y64 = _oracle(leaves["x"], leaves["rw"], p["te"].cpu(), gr, gc, dr, dc, leaves["sgu"], leaves["sd"], leaves["sg"])
    y64.backward(dy.cpu().double())
    tol = TOLERANCE[torch.bfloat16]
    assert rel_err(y, y64) <= tol
    assert rel_err(out[0], leaves["x"].grad) <= tol
    assert rel_err(out[1], leaves["rw"].grad) <= tol
    assert rel_err(main[1] - start[1], gr.grad) <= tol
    assert rel_err(main[5] - start[5], dr.grad) <= tol
    assert rel_err(main[0] - start[0], leaves["sgu"].grad[:IS]) <= tol
    assert rel_err(main[4] - start[4], leaves["sd"].grad) <= tol


def test_functional_abi_mxfp8_errors():
    from mok_inductor import functional as mf

    p = _problem(torch.bfloat16, "cpu")
    q1, q2 = mxfp8.quantize(p["gu"]), mxfp8.quantize(p["d"])
    cfg = mf.MoKConfig()
    ws = mf.get_workspace(cfg, None, device="cpu", num_local_tokens=T, hidden_size=H, topk=K)
    sch = mf.build_schedule(ws, cfg, p["te"], num_local_experts=E)
    fwd = lambda gate, up, down: mf.forward(cfg, ws, sch, p["x"], p["rw"], None, None, None, gate, up, down)  # noqa
    fc1 = (q1.data, q1.scale)
    cases = [
        (TypeError, (fc1, fc1, p["d"]), "routed_down: expected an MXFP8 weight (a (data, scale) tuple or a "
                                        "SplitRoutedWeight with scales), as the other routed weights"),
        (TypeError, (fc1, (q1.data, q1.scale), (q2.data, q2.scale)),
         "routed_gate: MXFP8 routed weights are supported as a combined FC1 (the same (data, scale) tuple or "
         "SplitRoutedWeight passed as routed_gate and routed_up)"),
        (TypeError, ((q1.data, q1.scale.float()),) * 2 + ((q2.data, q2.scale),),  # one tuple, passed twice
         "routed_gate: MXFP8 scale must be uint8 (biased E8M0 exponents), got float32"),
    ]
    # split per-expert MXFP8 (SplitRoutedWeight): each piece is checked, named by its expert
    sp1, sp2 = _split_abi(q1, False), _split_abi(q2, False)
    short = sp1._replace(data=(sp1.data[0], sp1.data[1][:32], sp1.data[2]))
    cases += [
        (ValueError, (sp1._replace(scale=None),) * 2 + (sp2,),
         "routed_gate: split MXFP8 data needs its scales (SplitRoutedWeight.scale)"),
        (ValueError, (sp1._replace(scale=sp1.scale[:2]),) * 2 + (sp2,),
         f"routed_gate: SplitRoutedWeight.scale holds 2 tensors, its data {E}"),
        (ValueError, (short,) * 2 + (sp2,), f"routed_gate[1]: expected the shape of routed_gate[0] [{2 * I}, {H}], "
                                            f"got [32, {H}]"),
        (TypeError, (sp1,) * 2 + (sp2._replace(scale=tuple(t.float() for t in sp2.scale)),),
         "routed_down[0]: MXFP8 scale must be uint8 (biased E8M0 exponents), got float32"),
        (ValueError, (sp1._replace(data=tuple(t[None] for t in sp1.data)),) * 2 + (sp2,),
         f"routed_gate[0]: expected 2-D MXFP8 data [M, K], got shape [1, {2 * I}, {H}]"),
        (TypeError, (sp1,) * 2 + (p["d"],), "routed_down: expected an MXFP8 weight (a (data, scale) tuple or a "
                                             "SplitRoutedWeight with scales), as the other routed weights"),
    ]
    # tuples of none of MoK's forms: an entry would be ignored (a forward reads only the row-wise pair)
    forms = "(data, scale), (data, scale, data_t, scale_t) or (data, scale, col_data, col_scale, True)"
    junk = (q1.data, q1.scale, "extra")
    cases += [
        (ValueError, (junk, junk, (q2.data, q2.scale)), f"routed_gate: expected an MXFP8 tuple {forms}, got a "
                                                        "3-tuple (Tensor, Tensor, str)"),
        (ValueError, (fc1, fc1, (q2.data, q2.scale, q2.data_t)), f"routed_down: expected an MXFP8 tuple {forms}, "
                                                                 "got a 3-tuple (Tensor, Tensor, Tensor)"),
        (ValueError, (fc1, fc1, (q2.data_t, q2.scale_t, True)), f"routed_down: expected an MXFP8 tuple {forms}, "
                                                                "got a 3-tuple (Tensor, Tensor, True)"),
        (ValueError, (fc1, fc1, (q2.data, q2.scale, q2.data_t, q2.scale_t, False)),
         f"routed_down: expected an MXFP8 tuple {forms}, got a 5-tuple (Tensor, Tensor, Tensor, Tensor, bool)"),
        (ValueError, ((*fc1, None, q1.scale_t),) * 2 + ((q2.data, q2.scale),),
         f"routed_gate: expected an MXFP8 tuple {forms}, got a 4-tuple (Tensor, Tensor, NoneType, Tensor)"),
    ]
    for exc, args, message in cases:
        with pytest.raises(exc) as info:
            fwd(*args)
        assert str(info.value) == message
    y, fctx = fwd(fc1, fc1, (q2.data, q2.scale))
    # MXFP8Weights stand for their tuples, a row-wise-only one for its (data, scale)
    rows_only = mxfp8.quantize(p["gu"], columnwise=False), mxfp8.quantize(p["d"], columnwise=False)
    assert torch.equal(fwd(rows_only[0], rows_only[0], rows_only[1])[0], y)
    assert torch.equal(fwd(q1, q1, q2)[0], y)
    with pytest.raises(ValueError) as info:  # the backward's down: its column-wise forms as well
        mf.backward(cfg, ws, sch, fctx, torch.ones_like(y), p["x"], p["rw"], None, None, None, fc1, fc1,
                    (q2.data_t, q2.scale_t, "x"))
    assert str(info.value) == ("routed_down: expected an MXFP8 tuple (data_t, scale_t), (data, scale), (data, scale, "
                               "data_t, scale_t), (data, scale, col_data, col_scale, True) or (col_data, col_scale, "
                               "True), got a 3-tuple (Tensor, Tensor, str)")
    with pytest.raises(ValueError) as info:
        mf.backward(cfg, ws, sch, fctx, torch.ones_like(y), p["x"], p["rw"], None, None, None, fc1, fc1,
                    (q2.data_t, q2.scale_t))
    assert str(info.value).startswith("routed_gate: the backward needs the MXFP8 gate/up as (data, scale, data_t, "
                                      "scale_t)")
    # a split weight without column-wise pairs serves forward only
    fwd_only = sp1._replace(transposed_data=None, transposed_scale=None)
    y, fctx = fwd(fwd_only, fwd_only, sp2)
    with pytest.raises(ValueError) as info:
        mf.backward(cfg, ws, sch, fctx, torch.ones_like(y), p["x"], p["rw"], None, None, None, fwd_only, fwd_only,
                    sp2)
    assert str(info.value) == ("routed_gate: the backward needs the column-wise MXFP8 data of the split weight "
                               "(SplitRoutedWeight.transposed_data and transposed_scale)")
    # of_mxfp8: the descriptor of per-expert quantize results (views of the stacked ones here)
    parts = _split(q1)
    of = mf.SplitRoutedWeight.of_mxfp8(parts)
    for field, attr in (("data", "data"), ("scale", "scale"), ("transposed_data", "data_t"),
                        ("transposed_scale", "scale_t")):
        assert all(a is getattr(q, attr) for a, q in zip(getattr(of, field), parts)), field
    assert not of.native_columnwise
    rows_only = mf.SplitRoutedWeight.of_mxfp8([q._replace(data_t=None, scale_t=None) for q in parts])
    assert rows_only.transposed_data is None and rows_only.transposed_scale is None
    with pytest.raises(TypeError, match="^weights: expected a non-empty sequence of mok_inductor.mxfp8.MXFP8Weight"):
        mf.SplitRoutedWeight.of_mxfp8([q1.data])
