"""mok_inductor.mxfp8: OCP MX quantization of weights (shared/SPEC.md section 6).

Each check derives what is right from the format's definition (e4m3: 3 mantissa bits, finite range
+-448, subnormal spacing 2**-9; E8M0: a power-of-two scale 2**(byte - 127)), never from stored numbers.
"""

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
