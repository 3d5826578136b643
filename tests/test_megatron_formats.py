"""MoK's data formats at the functional ABI (mok_inductor.functional), as Megatron's MoK bridge hands them over.

- MXFP8 scales in MoK's swizzled layout [E*M/128, K/128, 32, 16] beside the logical [E, M, K/32]: the index
  mapping, the round trip, and forward/backward results equal bit for bit to those with logical scales (the
  reference on the CPU; the Triton kernels at one tiny shape, under the interpreter without CUDA).
- Split weights in MoK's form (`SplitRoutedWeight` with one representative tensor and storage tables from
  the `make_routed_*_storage_table` builders; split main-grads as tables) beside the project's forms
  (per-expert sequences): results equal bit for bit.
- Malformed inputs in these forms: errors that name the argument and the fix.

Swizzling needs M and K to be multiples of 128, so the shapes here are H = I = 128 (T = 8, E = 3, K = 2).
Weights get per-block magnitudes spread over 2**-3 .. 2**3, so their scales differ from block to block and a
wrongly placed scale changes the results.
"""

import dataclasses
from typing import Optional, Tuple

import pytest
import torch

import mok_inductor
from mok_inductor import functional as mf
from mok_inductor import mxfp8

DEV = "cuda" if torch.cuda.is_available() else "cpu"
T, H, I, IS, E, K = 8, 128, 128, 32, 3, 2


def _gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


def _spread(shape, g):
    """A bf16 weight whose 32-element blocks along the last dim have magnitudes 2**-3 .. 2**3 (over sqrt(K))."""
    *lead, k = shape
    w = torch.randn(*lead, k // 32, 32, generator=g) / k**0.5
    w = w * torch.exp2(torch.randint(-3, 4, (*lead, k // 32, 1), generator=g).float())
    return w.reshape(shape).bfloat16()


def _quantized(shape, g):
    """An MXFP8Weight whose column-wise pair is that of ANOTHER weight: a backward that read the row-wise
    pair (or the wrong scales) for dgrad would then be caught."""
    q, other = mxfp8.quantize(_spread(shape, g)), mxfp8.quantize(_spread(shape, g))
    return q._replace(data_t=other.data_t, scale_t=other.scale_t)


def make_problem(device, g=None, *, experts=E):
    g = g or _gen()
    te = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    te[0], te[2] = torch.tensor([1, 2]), torch.tensor([0, 1])  # every expert has rows
    te[1, 1] = -1  # a "no route"
    if experts == 1:
        te[:, 1] = -1
        te[:, 0] = 0
    p = dict(
        E=experts, x=torch.randn(T, H, generator=g).bfloat16(), rw=torch.rand(T, K, generator=g), te=te,
        fc1=_quantized((experts, 2 * I, H), g), fc2=_quantized((experts, H, I), g),
        sgu=(torch.randn(2 * IS, H, generator=g) * 0.1).bfloat16(), sd=(torch.randn(H, IS, generator=g) * 0.1).bfloat16(),
        sog=(torch.randn(1, H, generator=g) * 0.1).bfloat16(), dy=torch.randn(T, H, generator=g).bfloat16(),
        main=[torch.randn(s, generator=g) for s in ((2 * IS, H), (experts, 2 * I, H), (H, IS), (experts, H, I),
                                                     (1, H))],
    )
    for k, v in list(p.items()):
        if isinstance(v, torch.Tensor):
            p[k] = v.to(device)
        elif isinstance(v, mxfp8.MXFP8Weight):
            p[k] = v._replace(**{f: getattr(v, f).to(device) for f in ("data", "scale", "data_t", "scale_t")})
    p["main"] = [m.to(device) for m in p["main"]]
    return p


def run(p, fc1_fwd, fc2_fwd, fc1_bwd, fc2_bwd, *, main_grads=False, tables=None, main=None):
    """forward and backward of the ABI; returns every output tensor, the main-grads after accumulation
    included, flattened to one list (per-expert sequences expanded)."""
    cfg = mf.MoKConfig()
    x = p["x"]
    ws = mf.get_workspace(cfg, None, device=x.device, num_local_tokens=T, hidden_size=H, topk=K)
    sch = mf.build_schedule(ws, cfg, p["te"], num_local_experts=p["E"])
    shared = (p["sgu"][:IS], p["sgu"][IS:], p["sd"])
    y, fctx = mf.forward(cfg, ws, sch, x, p["rw"], *shared, fc1_fwd, fc1_fwd, fc2_fwd,
                         shared_output_gate_weight=p["sog"])
    kw = {}
    if main_grads:
        main = main if main is not None else [m.clone() for m in p["main"]]
        s1, r1, s2, r2, gate = main
        kw = dict(main_grads=(s1[:IS], r1, s1[IS:], r1, s2, r2), shared_output_gate_main_grad=gate)
        if tables is not None:
            kw["main_grads"] = (s1[:IS], tables[0][0], s1[IS:], tables[0][0], s2, tables[2][0])
            kw["main_grad_storage_tables"] = tables
    out = mf.backward(cfg, ws, sch, fctx, p["dy"], x, p["rw"], *shared, fc1_bwd, fc1_bwd, fc2_bwd,
                      shared_output_gate_weight=p["sog"], **kw)
    flat = [y]
    for t in (*out, *(main or ())):
        if isinstance(t, torch.Tensor):
            flat.append(t)
        elif isinstance(t, (tuple, list)):
            flat.extend(t)
    if tables is not None:
        flat.extend(t for table in (tables[0], tables[2]) for t in table)
    return flat


def assert_bitwise_equal(got, want):
    assert len(got) == len(want)
    for j, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, j
        assert torch.equal(a, b), f"output {j} differs"


def swz(s):
    return mxfp8.swizzle_scale(s)


# ---------------------------------------------------------------------------------------------- the layout


@pytest.mark.parametrize("shape", [(1, 128, 4), (3, 256, 12), (128, 8)])
def test_swizzle_places_each_scale_by_moks_index_mapping(shape):
    g = _gen()
    logical = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    out = mxfp8.swizzle_scale(logical)
    e_, m, kb = (1, *shape) if len(shape) == 2 else shape
    assert tuple(out.shape) == (e_ * m // 128, kb // 4, 32, 16) == mxfp8.swizzled_scale_shape(shape)
    assert out.is_contiguous()
    # every element: swizzled[e*M/128 + mb, kb, lane, 4*g + c] = logical[e, 128*mb + 32*g + lane, 4*kb + c]
    e, mb, kbi, lane, gi, c = torch.meshgrid(*(torch.arange(n) for n in (e_, m // 128, kb // 4, 32, 4, 4)),
                                             indexing="ij")
    src = logical.reshape(e_, m, kb)[e, 128 * mb + 32 * gi + lane, 4 * kbi + c]
    assert torch.equal(out[e * (m // 128) + mb, kbi, lane, 4 * gi + c], src)
    assert torch.equal(mxfp8.unswizzle_scale(out, shape), logical)  # the round trip


def test_unswizzle_is_the_inverse_on_any_bytes():
    g = _gen()
    swizzled = torch.randint(0, 256, (6, 2, 32, 16), generator=g, dtype=torch.uint8)
    logical = mxfp8.unswizzle_scale(swizzled, (3, 256, 8))
    assert logical.shape == (3, 256, 8) and logical.is_contiguous()
    assert torch.equal(mxfp8.swizzle_scale(logical), swizzled)


def test_swizzle_into_out_keeps_its_address_and_reads_strided_scales():
    g = _gen()
    col = torch.randint(0, 256, (2, 4, 256), generator=g, dtype=torch.uint8)  # TE's [E, M/32, K] column-wise scales
    logical = col.transpose(1, 2)  # the logical [E, K, M/32], a strided view
    out = torch.full((4, 1, 32, 16), 7, dtype=torch.uint8)
    ptr = out.data_ptr()
    assert mxfp8.swizzle_scale(logical, out=out) is out and out.data_ptr() == ptr
    assert torch.equal(out, mxfp8.swizzle_scale(logical.contiguous()))
    col.add_(1)  # a refresh in place writes the new bytes at the same address
    mxfp8.swizzle_scale(logical, out=out)
    assert out.data_ptr() == ptr and torch.equal(mxfp8.unswizzle_scale(out, (2, 256, 4)), logical)


def test_swizzle_errors_are_clear():
    u8 = lambda *s: torch.zeros(*s, dtype=torch.uint8)  # noqa: E731
    with pytest.raises(TypeError, match=r"^scale: MXFP8 scales must be uint8 \(biased E8M0 exponents\), got float32$"):
        mxfp8.swizzle_scale(torch.zeros(1, 128, 4))
    with pytest.raises(ValueError, match=r"^scale: MoK's swizzled MXFP8 scale layout needs M \(64\) and K \(128\) to "
                                         r"be multiples of 128$"):
        mxfp8.swizzle_scale(u8(1, 64, 4))
    with pytest.raises(ValueError, match=r"^scale: .* needs M \(128\) and K \(96\) to be multiples of 128$"):
        mxfp8.swizzle_scale(u8(128, 3))
    with pytest.raises(ValueError, match=r"^scale: expected logical MXFP8 scales \[E, M, K/32\] or \[M, K/32\], "
                                         r"got shape \[1, 1, 32, 16\]$"):
        mxfp8.swizzle_scale(u8(1, 1, 32, 16))
    with pytest.raises(ValueError, match=r"^out: expected a contiguous uint8 tensor of shape \[1, 1, 32, 16\]"):
        mxfp8.swizzle_scale(u8(1, 128, 4), out=u8(2, 1, 32, 16))
    with pytest.raises(ValueError, match=r"not contiguous$"):
        mxfp8.swizzle_scale(u8(1, 128, 4), out=u8(1, 1, 16, 32).transpose(2, 3))
    with pytest.raises(ValueError, match=r"^w: expected MoK's swizzled MXFP8 scales \[E\*M/128, K/128, 32, 16\] = "
                                         r"\[2, 1, 32, 16\] for the logical scales \[2, 128, 4\], got shape "
                                         r"\[1, 2, 32, 16\]$"):
        mxfp8.unswizzle_scale(u8(1, 2, 32, 16), (2, 128, 4), name="w")
    with pytest.raises(TypeError, match=r"^scale: MXFP8 scales must be uint8"):
        mxfp8.unswizzle_scale(torch.zeros(1, 1, 32, 16), (128, 4))


# ---------------------------------------------------------------------------------------------- dense tuples


def _tuple_forms(p, form):
    """(fc1_fwd, fc2_fwd, fc1_bwd, fc2_bwd) of MoK's MXFP8 tuples. legacy: (data, scale[, data_t, scale_t]);
    native: Transformer Engine's column-wise storage flagged True (5/3 tuples); native-whole: the whole 5-tuple
    for the down weight too. `swizzled`: every scale in MoK's layout (column-wise: of the logical [E, K, M/32])."""
    kind, swizzled = form.rsplit("-", 1)
    f = swz if swizzled == "swizzled" else (lambda s: s)
    q1, q2 = p["fc1"], p["fc2"]
    fwd1, fwd2 = (q1.data, f(q1.scale)), (q2.data, f(q2.scale))
    if kind == "legacy":
        return fwd1, fwd2, (*fwd1, q1.data_t, f(q1.scale_t)), (q2.data_t, f(q2.scale_t))
    native = []
    for q, fwd in ((q1, fwd1), (q2, fwd2)):
        col_data = q.data_t.transpose(1, 2).contiguous()  # TE keeps the column-wise data in the [E, M, K] shape
        col_scale = f(q.scale_t) if swizzled == "swizzled" else q.scale_t.transpose(1, 2).contiguous()
        native.append((*fwd, col_data, col_scale, True))
    return fwd1, fwd2, native[0], native[1] if kind == "native-whole" else native[1][2:]


@pytest.mark.parametrize("main_grads", [False, True])
@pytest.mark.parametrize("kind", ["legacy", "native", "native-whole"])
def test_swizzled_scales_give_the_results_of_logical_scales_bitwise(kind, main_grads):
    p = make_problem("cpu")
    want = run(p, *_tuple_forms(p, f"{kind}-plain"), main_grads=main_grads)
    got = run(p, *_tuple_forms(p, f"{kind}-swizzled"), main_grads=main_grads)
    assert_bitwise_equal(got, want)
    # the scales are read where the mapping puts them: one gate row of expert 1 (token 0's first route) with
    # its exponents three steps higher changes the output
    s = p["fc1"].scale.clone()
    s[1, 37] += 3
    bumped = run(p, (p["fc1"].data, swz(s)), (p["fc2"].data, swz(p["fc2"].scale)), *_tuple_forms(
        p, f"{kind}-swizzled")[2:], main_grads=main_grads)
    assert not torch.equal(bumped[0], want[0])


def test_swizzled_scales_on_the_kernels_bitwise():
    """One tiny shape on the Triton kernels (interpreted without CUDA, so one expert and one route a token):
    TE's native tuples, main-grads."""
    from mok_inductor import reference

    p = make_problem(DEV, experts=1)
    with mok_inductor.options.override(backend="triton"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(reference, "moe_forward", None)  # the kernels, not the reference, must run
        mp.setattr(reference, "moe_backward", None)
        want = run(p, *_tuple_forms(p, "native-plain"), main_grads=True)
        got = run(p, *_tuple_forms(p, "native-swizzled"), main_grads=True)
    assert_bitwise_equal(got, want)


def test_malformed_swizzled_scales_name_the_argument():
    p = make_problem("cpu")
    q1, q2 = p["fc1"], p["fc2"]
    fc2 = (q2.data, swz(q2.scale))
    wrong = torch.zeros(E, 1, 32, 16, dtype=torch.uint8)  # [E*M/128, K/128, ...] is [2E, 1, ...] for the FC1
    with pytest.raises(ValueError, match=r"^routed_gate: expected MoK's swizzled MXFP8 scales \[E\*M/128, K/128, 32, "
                                         rf"16\] = \[{2 * E}, 1, 32, 16\] for the logical scales \[{E}, {2 * I}, 4\], "
                                         rf"got shape \[{E}, 1, 32, 16\]$"):
        run(p, (q1.data, wrong), fc2, None, None)
    with pytest.raises(TypeError, match=r"^routed_down: MXFP8 scales must be uint8 \(biased E8M0 exponents\), got "
                                        r"int32$"):
        run(p, (q1.data, swz(q1.scale)), (q2.data, swz(q2.scale).int()), None, None)
    with pytest.raises(ValueError, match=r"^routed_down \(column-wise\): expected MoK's swizzled MXFP8 scales .* for "
                                         rf"the logical scales \[{E}, {I}, 4\], got shape"):
        fwd1, fwd2, bwd1, bwd2 = _tuple_forms(p, "native-swizzled")
        run(p, fwd1, fwd2, bwd1, (bwd2[0], swz(q1.scale), True))  # the FC1's scales
    # M or K not a multiple of 128: the swizzled layout does not exist for the weight
    small = mxfp8.quantize(torch.randn(E, 96, H))
    with pytest.raises(ValueError, match=r"^routed_gate: MoK's swizzled MXFP8 scale layout needs M \(96\) and K "
                                         rf"\(128\) to be multiples of 128 \(got scales of shape \[{E}, 1, 32, 16\]\)$"):
        run(p, (small.data, torch.zeros(E, 1, 32, 16, dtype=torch.uint8)), fc2, None, None)


# ---------------------------------------------------------------------------------------------- split weights


def test_split_routed_weight_has_moks_fields_in_moks_order():
    assert [f.name for f in dataclasses.fields(mf.SplitRoutedWeight)] == [
        "data", "storage_table", "scale", "scale_storage_table", "scale_tensors", "transposed_data",
        "transposed_scale", "transposed_storage_table", "transposed_scale_storage_table", "transposed_scale_tensors",
        "native_columnwise"]
    w = mf.SplitRoutedWeight(data=torch.zeros(2, 2), storage_table=(torch.zeros(2, 2),))
    assert w.scale is None and w.native_columnwise is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.data = None
    assert w._replace(native_columnwise=True).native_columnwise and not w.native_columnwise


@dataclasses.dataclass(frozen=True)
class ForeignSplit:
    """A stand-in for `mok.functional.SplitRoutedWeight` itself (another class with MoK's field names)."""

    data: torch.Tensor
    storage_table: Tuple[torch.Tensor, ...]
    scale: Optional[torch.Tensor] = None
    scale_storage_table: Optional[Tuple[torch.Tensor, ...]] = None
    scale_tensors: Optional[Tuple[torch.Tensor, ...]] = None
    transposed_data: Optional[torch.Tensor] = None
    transposed_scale: Optional[torch.Tensor] = None
    transposed_storage_table: Optional[Tuple[torch.Tensor, ...]] = None
    transposed_scale_storage_table: Optional[Tuple[torch.Tensor, ...]] = None
    transposed_scale_tensors: Optional[Tuple[torch.Tensor, ...]] = None
    native_columnwise: bool = False


def _experts(t):
    """E fresh per-expert allocations of a stacked [E, ...] tensor (as Megatron's weight0 ... weight{E-1})."""
    return [t[e].clone() for e in range(t.shape[0])]


def _split_mxfp8(q, form, cls=mf.SplitRoutedWeight):
    """A quantized [E, M, K] weight split per expert, TE's native column-wise storage. project: per-expert
    sequences with logical scales; mok: representative tensors, storage tables, swizzled per-expert scales."""
    rows, scales = _experts(q.data), _experts(q.scale)
    cols = _experts(q.data_t.transpose(1, 2).contiguous())  # [M, K] each
    if form == "project":
        col_scales = _experts(q.scale_t.transpose(1, 2).contiguous())  # TE's [M/32, K]
        return cls(data=tuple(rows), scale=tuple(scales), transposed_data=tuple(cols),
                   transposed_scale=tuple(col_scales), native_columnwise=True)
    row_sw = [swz(s) for s in scales]  # [M/128, K/128, 32, 16] each
    col_sw = [swz(s) for s in _experts(q.scale_t)]  # of the logical [K, M/32]
    return cls(data=rows[0], storage_table=mf.make_routed_weight_storage_table_mxfp8(rows),
               scale=row_sw[0], scale_storage_table=mf.make_routed_scale_storage_table(row_sw),
               scale_tensors=tuple(row_sw), transposed_data=cols[0], transposed_scale=col_sw[0],
               transposed_storage_table=mf.make_routed_weight_storage_table_mxfp8(cols),
               transposed_scale_storage_table=mf.make_routed_scale_storage_table(col_sw),
               transposed_scale_tensors=tuple(col_sw), native_columnwise=True)


def _grad_tables(p, form):
    """Main-grads for split weights: the canonical buffers (shared ones, the gate's) with per-expert routed
    buffers of the same prior content, and their tables (the FC1 table passed as gate and up)."""
    main = [m.clone() for m in p["main"]]
    fc1, fc2 = _experts(main[1]), _experts(main[3])
    if form == "mok":
        t1, t2 = mf.make_routed_d_weight_storage_table(fc1), mf.make_routed_d_weight_storage_table(fc2)
    else:
        t1, t2 = fc1, tuple(fc2)
    return main, (t1, t1, t2)


@pytest.mark.parametrize("foreign", [False, True])
def test_split_mxfp8_in_moks_form_matches_the_projects_bitwise(foreign):
    p = make_problem("cpu")
    results = []
    for form in ("project", "mok"):
        cls = ForeignSplit if foreign and form == "mok" else mf.SplitRoutedWeight
        fc1, fc2 = _split_mxfp8(p["fc1"], form, cls), _split_mxfp8(p["fc2"], form, cls)
        main, tables = _grad_tables(p, form)
        results.append(run(p, fc1, fc2, fc1, fc2, main_grads=True, tables=tables, main=main))
    assert_bitwise_equal(results[1], results[0])


@pytest.mark.parametrize("tables_form", ["project", "mok", "none"])
def test_split_bf16_in_moks_form_matches_the_projects_bitwise(tables_form):
    p = make_problem("cpu")
    g = _gen()
    fc1_w, fc2_w = _experts(_spread((E, 2 * I, H), g)), _experts(_spread((E, H, I), g))
    forms = {
        "plain lists": (fc1_w, fc2_w),
        "project": (mf.SplitRoutedWeight(tuple(fc1_w)), mf.SplitRoutedWeight(data=tuple(fc2_w))),
        "mok": (mf.SplitRoutedWeight(data=fc1_w[0], storage_table=mf.make_routed_weight_storage_table_bf16(fc1_w)),
                mf.SplitRoutedWeight(data=fc2_w[0], storage_table=mf.make_routed_weight_storage_table_bf16(fc2_w))),
    }
    results = {}
    for name, (fc1, fc2) in forms.items():
        if tables_form == "none":
            results[name] = run(p, fc1, fc2, fc1, fc2)
        else:
            main, tables = _grad_tables(p, tables_form)
            results[name] = run(p, fc1, fc2, fc1, fc2, main_grads=True, tables=tables, main=main)
    assert_bitwise_equal(results["mok"], results["plain lists"])
    assert_bitwise_equal(results["project"], results["plain lists"])
    if tables_form != "none":  # the accumulation happened (the tables' buffers moved)
        assert not torch.equal(results["mok"][-1], p["main"][3][-1])


def test_storage_table_builders_validate_and_return_the_tensors():
    a, b = torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16)
    table = mf.make_routed_weight_storage_table_bf16([a, b])
    assert isinstance(table, tuple) and table[0] is a and table[1] is b
    with pytest.raises(ValueError, match=r"^weights\[1\]: expected every expert like \[0\] \(\[4, 8\] bfloat16 on "
                                         r"cpu\), got \[4, 7\] bfloat16 on cpu$"):
        mf.make_routed_weight_storage_table_bf16([a, b[:, :7]])
    with pytest.raises(TypeError, match=r"^weights: expected a non-empty sequence of per-expert tensors, got list$"):
        mf.make_routed_weight_storage_table_bf16([])
    with pytest.raises(TypeError, match=r"^weights: expected a non-empty sequence of per-expert tensors, got Tensor$"):
        mf.make_routed_weight_storage_table_bf16(torch.stack([a, b]))
    with pytest.raises(TypeError, match=r"^weights\[0\]: expected dtype float8_e4m3fn, got bfloat16$"):
        mf.make_routed_weight_storage_table_mxfp8([a])
    with pytest.raises(ValueError, match=r"^weights\[0\]: expected a 2-D tensor, got shape \[1, 4, 8\]$"):
        mf.make_routed_weight_storage_table_bf16([a[None]])
    s = torch.zeros(1, 1, 32, 16, dtype=torch.uint8)
    assert mf.make_routed_scale_storage_table([s, s])[1] is s
    with pytest.raises(ValueError, match=r"^scales\[0\]: expected a 2-D or 4-D tensor"):
        mf.make_routed_scale_storage_table([s[0]])
    with pytest.raises(TypeError, match=r"^main_grads\[0\]: expected dtype float32 or bfloat16, got float16$"):
        mf.make_routed_d_weight_storage_table([a.half()])


def test_malformed_split_forms_name_the_fix():
    p = make_problem("cpu")
    q1, q2 = p["fc1"], p["fc2"]
    fc1, fc2 = _split_mxfp8(q1, "mok"), _split_mxfp8(q2, "mok")
    fwd = lambda a, b: run(p, a, b, a, b)  # noqa: E731
    descriptor = torch.zeros(E, 128, dtype=torch.uint8)  # what MoK's compiled builders return
    cases = [
        (TypeError, fc1._replace(storage_table=descriptor), r"^routed_gate: SplitRoutedWeight.storage_table: got a "
         r"tensor, which would be a descriptor table of MoK's compiled mok.ops; this implementation reads per-expert "
         r"tensors: build the table with mok_inductor.functional.make_routed_weight_storage_table_bf16 / _mxfp8"),
        (TypeError, fc1._replace(scale_storage_table=descriptor), r"^routed_gate: SplitRoutedWeight.scale_storage_table: "
         r"got a tensor, .*make_routed_scale_storage_table"),
        (ValueError, fc1._replace(data=fc1.data[:, :64]), rf"^routed_gate: SplitRoutedWeight.data \(the representative "
         rf"expert\) is \[{2 * I}, 64\] float8_e4m3fn on cpu, but storage_table\[0\] is \[{2 * I}, {H}\] float8_e4m3fn"),
        (ValueError, fc1._replace(scale_storage_table=None), r"^routed_gate: a split MXFP8 weight in MoK's form needs "
         r"SplitRoutedWeight.scale_storage_table"),
        (ValueError, fc1._replace(transposed_scale_storage_table=None), r"^routed_gate: SplitRoutedWeight."
         r"transposed_storage_table and transposed_scale_storage_table must be given together"),
        (ValueError, fc1._replace(storage_table=None), r"^routed_gate: SplitRoutedWeight.storage_table is required "
         r"when data is one representative tensor"),
        (ValueError, fc1._replace(scale_storage_table=fc1.scale_storage_table[:2]),
         rf"^routed_gate: SplitRoutedWeight.scale holds 2 tensors, its data {E}$"),
        (ValueError, fc1._replace(scale_storage_table=(fc1.scale, swz(q1.scale[1])[:1], fc1.scale)),
         r"^routed_gate\[1\]: expected MoK's swizzled MXFP8 scales"),
    ]
    for exc, bad, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fwd(bad, fc2)
    # the backward's column-wise experts, each checked and named
    wrong = torch.zeros(2, 1, 32, 16, dtype=torch.uint8)
    bad_col = fc2._replace(transposed_scale_storage_table=(fc2.transposed_scale,) * (E - 1) + (wrong,))
    with pytest.raises(ValueError, match=rf"^routed_down \(column-wise\)\[{E - 1}\]: expected MoK's swizzled MXFP8 "
                                         rf"scales .* for the logical scales \[{H}, 4\]"):
        run(p, fc1, fc2, fc1, bad_col)
    # split main-grads as MoK's descriptor tensors
    main, (t1, _, t2) = _grad_tables(p, "mok")
    with pytest.raises(TypeError, match=r"^main_grad_storage_tables\[0\]: got a tensor, which would be a descriptor "
                                        r"table of MoK's compiled mok.ops; .*make_routed_d_weight_storage_table"):
        run(p, fc1, fc2, fc1, fc2, main_grads=True, tables=(descriptor, descriptor, t2), main=main)
    assert all(torch.equal(a, b) for a, b in zip(main, p["main"]))  # a refused call wrote nothing
    assert all(torch.equal(a, b) for a, b in zip(t2, p["main"][3]))
