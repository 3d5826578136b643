"""MXFP8 weights (OCP Microscaling, shared/SPEC.md section 6): quantize and dequantize.

A weight [..., M, K] whose reduction dim is K (the last, contiguous one) is stored as float8_e4m3fn data
[..., M, K] and one power-of-two scale per 32 consecutive elements along K, kept as its biased E8M0
exponent (uint8, value 2**(e - 127)) [..., M, K/32]. The forward GEMMs read this row-wise pair. The
backward's dgrad reduces over M instead, so `quantize` also produces the column-wise pair: the same
quantization applied to the transposed weight, data [..., K, M] and scales [..., K, M/32].

Scale choice (the OCP rule MoK uses): e = clamp(ceil(log2(amax / 448)), -127, 127) per block, so every
scaled element lies in [-448, 448], e4m3's finite range, and the block's largest element keeps the most
mantissa bits; an all-zero block gets e = -127. The scale is taken over a block's finite elements; NaN
stays NaN and +-Inf becomes e4m3's NaN (it has no Inf), so non-finite values propagate as NaN.

Not yet consumed by `mok_inductor.moe` or the functional ABI (issue 8 items 2-5).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

BLOCK = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127


class MXFP8Weight(NamedTuple):
    """An MXFP8 weight. `data`/`scale`: row-wise (blocks along the last dim K); `data_t`/`scale_t`:
    column-wise (the transposed weight, blocks along M), or None when not requested."""

    data: Optional[torch.Tensor]  # float8_e4m3fn [..., M, K]
    scale: Optional[torch.Tensor]  # uint8 E8M0 [..., M, K/32]
    data_t: Optional[torch.Tensor]  # float8_e4m3fn [..., K, M]
    scale_t: Optional[torch.Tensor]  # uint8 E8M0 [..., K, M/32]
    dtype: torch.dtype  # the dtype it was quantized from (what dequantize returns by default)


def _quantize_lastdim(w: torch.Tensor):
    """(float8 data, uint8 E8M0 scales) of `w` with 32-element blocks along its last dim."""
    *lead, k = w.shape
    blocks = w.float().reshape(*lead, k // BLOCK, BLOCK)
    finite = torch.isfinite(blocks)
    # the scale comes from the finite elements, so one NaN/Inf does not wipe out its block's neighbours
    amax = torch.where(finite, blocks.abs(), torch.zeros_like(blocks)).amax(-1, keepdim=True)
    # ceil(log2(amax / 448)) from the exact float32 exponent: frexp gives amax/448 = m * 2**p, m in [0.5, 1)
    mant, expo = torch.frexp(amax / E4M3_MAX)
    e = torch.where(mant == 0.5, expo - 1, expo)  # an exact power of two needs no extra bit
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS))
    e = e.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks * torch.exp2(-e.float())
    # e4m3fn has no Inf, and a cast saturates Inf to 448: non-finite inputs become its NaN explicitly
    scaled = torch.where(finite, scaled, torch.full_like(scaled, float("nan")))
    data = scaled.to(torch.float8_e4m3fn).reshape(*lead, k)
    return data, (e + E8M0_BIAS).to(torch.uint8).squeeze(-1)


def quantize(weight: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True) -> MXFP8Weight:
    """Quantize a bf16/fp16/fp32 weight [..., M, K] (at least 2-D) to MXFP8, row-wise (blocks along K) and
    column-wise (blocks along M). The blocked dims must be multiples of 32."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"weight: expected dtype bfloat16, float16 or float32, got {str(weight.dtype).replace('torch.', '')}")
    if weight.dim() < 2:
        raise ValueError(f"weight: expected at least 2 dims [..., M, K], got shape {list(weight.shape)}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise, columnwise: at least one layout must be requested")
    m, k = weight.shape[-2:]
    if rowwise and k % BLOCK:
        raise ValueError(f"weight: the row-wise layout needs the last dim K divisible by {BLOCK}, got shape {list(weight.shape)}")
    if columnwise and m % BLOCK:
        raise ValueError(f"weight: the column-wise layout needs dim -2 (M) divisible by {BLOCK}, got shape {list(weight.shape)}")
    data = scale = data_t = scale_t = None
    if rowwise:
        data, scale = _quantize_lastdim(weight)
    if columnwise:
        data_t, scale_t = _quantize_lastdim(weight.transpose(-2, -1))
        data_t = data_t.contiguous()
    return MXFP8Weight(data, scale, data_t, scale_t, weight.dtype)


def _dequantize_lastdim(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    *lead, k = data.shape
    factor = torch.exp2(scale.float() - E8M0_BIAS)
    blocks = data.float().reshape(*lead, k // BLOCK, BLOCK) * factor.unsqueeze(-1)
    return blocks.reshape(*lead, k).to(dtype)


def dequantize(q: MXFP8Weight, *, layout: str = "row", dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The weight [..., M, K] that `q` represents, in `dtype` (default: the dtype it was quantized from).
    `layout="row"` reads the row-wise pair, `"column"` the column-wise one (transposed back)."""
    if not isinstance(q, MXFP8Weight):
        raise TypeError(f"q: expected an MXFP8Weight (from mok_inductor.mxfp8.quantize), got {type(q).__name__}")
    dtype = dtype or q.dtype
    if layout == "row":
        if q.data is None:
            raise ValueError("q: has no row-wise data (quantized with rowwise=False)")
        return _dequantize_lastdim(q.data, q.scale, dtype)
    if layout == "column":
        if q.data_t is None:
            raise ValueError("q: has no column-wise data (quantized with columnwise=False)")
        return _dequantize_lastdim(q.data_t, q.scale_t, dtype).transpose(-2, -1)
    raise ValueError(f"layout: expected 'row' or 'column', got {layout!r}")
