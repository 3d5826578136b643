"""MXFP8 weights (OCP Microscaling): quantize and dequantize.

A weight [..., M, K] whose reduction dim is K (the last, contiguous one) is stored as float8_e4m3fn data
[..., M, K] and one power-of-two scale per 32 consecutive elements along K, kept as its biased E8M0
exponent (uint8, value 2**(e - 127)) [..., M, K/32]. The forward GEMMs read this row-wise pair. The
backward's dgrad reduces over M instead, so `quantize` also produces the column-wise pair: the same
quantization applied to the transposed weight, data [..., K, M] and scales [..., K, M/32].

Scale choice (the OCP rule MoK uses): e = clamp(ceil(log2(amax / 448)), -127, 127) per block, so every
scaled element lies in [-448, 448], e4m3's finite range, and the block's largest element keeps the most
mantissa bits; an all-zero block gets e = -127. Every scale byte means 2**(byte - 127), byte 0 included
(2**-127, a float32 subnormal), in the kernels as in `dequantize`. The scale is taken over a block's finite
elements; NaN stays NaN and +-Inf becomes e4m3's NaN (it has no Inf), so non-finite values propagate as NaN.

Consumers:
- `mok_inductor.moe` takes an `MXFP8Weight` (or a list of E per-expert ones) in place of a routed
  `gate_up_proj` / `down_proj`. The forward GEMMs read the row-wise pair; backward reads only the
  column-wise pair, for the data gradient (dx, and dy @ down, which gives d router_weights and the
  SwiGLU's input gradient): the forward saves the gate/up pre-activations, so no GEMM is recomputed.
- Gradients (straight-through, MoK's semantics): an MXFP8 weight is the forward/dgrad operand of a bf16
  master weight. `quantize(w)` keeps a reference to `w` in `.master` when `w.requires_grad` (or pass
  `master=`; `with_master(q, w)` attaches one later). The weight gradient, computed from the activations
  and dy exactly as for a bf16 weight (it needs no weights), is accumulated into `master.grad`, as if the
  dequantized weight had been used. Without a master no weight gradient is computed.
- `mok_inductor.functional` takes MoK's (data, scale) tuples (docs/megatron.md), with the scales logical or in
  MoK's swizzled layout (`swizzle_scale` / `unswizzle_scale` below).
- On the CPU (and in the reference path) the weights are dequantized to x.dtype and the one reference
  implementation runs; on CUDA `mok_inductor.kernels` reads e4m3 data + E8M0 scales in its
  GEMMs' K loops.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.autograd.forward_ad import unpack_dual

from .types import Operand, RoutedOperands, narrow_payload, split_gate_up, transposed_payload

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
    master: Optional[torch.Tensor] = None  # the high-precision weight that receives the weight gradient


def _quantize_lastdim(w: torch.Tensor, block: int = BLOCK):
    """(float8 data, uint8 E8M0 scales) of `w` with `block`-element blocks along its last dim (MX: 32; other
    lengths for comparisons of other block lengths)."""
    *lead, k = w.shape
    blocks = w.float().reshape(*lead, k // block, block)
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


_NO_MASTER = object()


def quantize(weight: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
             master=_NO_MASTER) -> MXFP8Weight:
    """Quantize a bf16/fp16/fp32 weight [..., M, K] (at least 2-D) to MXFP8, row-wise (blocks along K) and
    column-wise (blocks along M). The blocked dims must be multiples of 32.

    `master`: the tensor that receives the weight gradient when the result is used in `mok_inductor.moe`;
    by default `weight` itself when it requires grad or carries a forward-mode tangent (torch.func.jvp), else
    None (pass `master=None` to drop it)."""
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
    if master is _NO_MASTER:
        master = weight if _carries_derivative(weight) else None
    data = scale = data_t = scale_t = None
    with torch.no_grad():  # (and detached: no_grad does not stop a forward-mode tangent)
        w = weight.detach()
        if rowwise:
            data, scale = _quantize_lastdim(w)
        if columnwise:
            data_t, scale_t = _quantize_lastdim(w.transpose(-2, -1))
            data_t = data_t.contiguous()
    return MXFP8Weight(data, scale, data_t, scale_t, weight.dtype, master)


def with_master(q: MXFP8Weight, master: Optional[torch.Tensor]) -> MXFP8Weight:
    """`q` with `master` as the tensor that receives its weight gradient (None: no weight gradient)."""
    if not isinstance(q, MXFP8Weight):
        raise TypeError(f"q: expected an MXFP8Weight (from mok_inductor.mxfp8.quantize), got {type(q).__name__}")
    return q._replace(master=master)


def _dequantize_lastdim(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    *lead, k = data.shape
    factor = torch.exp2(scale.float() - E8M0_BIAS)
    blocks = data.float().reshape(*lead, k // block, block) * factor.unsqueeze(-1)
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


# ---------------------------------------------------------------------------------------------
# MoK's swizzled scale layout
#
# Mixture-of-Kittens reads E8M0 scales in the tcgen05 scale-factor layout: the logical scales [E, M, K/32] of
# a weight [E, M, K] cut into tiles of 128 rows by 4 scales (128 elements of K), each tile stored as 512
# bytes [32, 16], the whole as [E*M/128, K/128, 32, 16]:
#     swizzled[e*M/128 + mb, kb, lane, 4*g + c] = logical[e, 128*mb + 32*g + lane, 4*kb + c]
# (lane 0..31, row group g 0..3, scale c 0..3): inside a tile, byte 4*g + c of lane `lane` holds scale c of
# the tile's row 32*g + lane. A column-wise pair is swizzled as the logical [E, K, M/32] scales of the transposed
# weight. The layout cannot be read as a strided view of the logical one (the row index is split across
# non-adjacent dims), so converting either way is a copy of the scale bytes (1/32 of the data's).

SWIZZLE_TILE = 128  # rows, and elements of K, per swizzled tile


def is_swizzled_scale(scale) -> bool:
    """Whether `scale` is in MoK's swizzled layout by its shape: 4-D, [E*M/128, K/128, 32, 16]."""
    return isinstance(scale, torch.Tensor) and scale.dim() == 4


def swizzled_scale_shape(shape) -> tuple:
    """MoK's swizzled shape [E*M/128, K/128, 32, 16] of logical scales of `shape` [E, M, K/32] (or [M, K/32],
    one expert). ValueError unless M and K are multiples of 128."""
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"expected logical MXFP8 scales [E, M, K/32] or [M, K/32], got shape {list(shape)}")
    e, m, kb = (1, *shape) if len(shape) == 2 else shape
    if m % SWIZZLE_TILE or (kb * BLOCK) % SWIZZLE_TILE:
        raise ValueError(
            f"MoK's swizzled MXFP8 scale layout needs M ({m}) and K ({kb * BLOCK}) to be multiples of "
            f"{SWIZZLE_TILE}"
        )
    return (e * m // SWIZZLE_TILE, kb * BLOCK // SWIZZLE_TILE, 32, 16)


def _tiles(shape):
    """(E, M/128, K/128) of logical scales of `shape`."""
    e, m, kb = (1, *shape) if len(shape) == 2 else shape
    return e, m // SWIZZLE_TILE, kb * BLOCK // SWIZZLE_TILE


def _require_scale_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise TypeError(f"{name}: MXFP8 scales must be uint8 (biased E8M0 exponents), got {_dt(t)}")


def swizzle_scale(scale: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logical E8M0 scales [E, M, K/32] (or [M, K/32]; any strides) in MoK's swizzled layout
    [E*M/128, K/128, 32, 16]. With `out` (contiguous uint8 of that shape, on the scales' device) the bytes
    are written into it and `out` is returned: its address stays the same, as descriptors captured over it
    need."""
    _require_scale_tensor("scale", scale)
    if scale.dim() not in (2, 3):
        raise ValueError(f"scale: expected logical MXFP8 scales [E, M, K/32] or [M, K/32], got shape "
                         f"{list(scale.shape)}")
    try:
        want = swizzled_scale_shape(scale.shape)
    except ValueError as exc:
        raise ValueError(f"scale: {exc}") from None
    e, mb, kb = _tiles(scale.shape)
    # logical [E, (mb, g, lane), (kb, c)] -> [E, mb, kb, lane, g, c]
    source = scale.reshape(e, mb, 4, 32, kb, 4).permute(0, 1, 4, 3, 2, 5)
    if out is None:
        return source.reshape(want)  # the permuted dims do not merge: reshape copies
    _require_scale_tensor("out", out)
    if tuple(out.shape) != want or out.device != scale.device or not out.is_contiguous():
        raise ValueError(
            f"out: expected a contiguous uint8 tensor of shape {list(want)} on {scale.device}, got shape "
            f"{list(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}"
        )
    out.view(e, mb, kb, 32, 4, 4).copy_(source)
    return out


def unswizzle_scale(swizzled: torch.Tensor, shape, *, name: str = "scale") -> torch.Tensor:
    """The logical scales of `shape` [E, M, K/32] (or [M, K/32]), contiguous, from MoK's swizzled layout
    [E*M/128, K/128, 32, 16] (the inverse of `swizzle_scale`; a copy). Errors name `name`."""
    _require_scale_tensor(name, swizzled)
    shape = tuple(int(d) for d in shape)
    try:
        want = swizzled_scale_shape(shape)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc} (got scales of shape {list(swizzled.shape)})") from None
    if tuple(swizzled.shape) != want:
        raise ValueError(
            f"{name}: expected MoK's swizzled MXFP8 scales [E*M/128, K/128, 32, 16] = {list(want)} for the "
            f"logical scales {list(shape)}, got shape {list(swizzled.shape)}"
        )
    e, mb, kb = _tiles(shape)
    # [E, mb, kb, lane, g, c] -> [E, mb, g, lane, kb, c] = logical [E, M, K/32]
    return swizzled.reshape(e, mb, kb, 32, 4, 4).permute(0, 1, 4, 3, 2, 5).reshape(shape).contiguous()


# ---------------------------------------------------------------------------------------------
# GEMM operands of MXFP8 weights (`mok_inductor.types.Operand`, `RoutedOperands`)


def routed_operands(gate_up, down, *, columnwise: bool = True) -> RoutedOperands:
    """Operands of a combined FC1 `gate_up` ([E, 2I, H]) and `down` ([E, H, I]), each given as
    (data, scale, data_t, scale_t): scale None means `data` is a plain float weight (its column-wise
    operand is its transpose); data_t None means no column-wise data (`columnwise=False`: none built). I must be a multiple of 32 when
    gate_up's column-wise data is given (the gate/up boundary must fall on a scale block)."""
    gd, gs, gdt, gst = gate_up
    dd, ds, ddt, dst = down
    two_i = (gd.shape[-2] if isinstance(gd, torch.Tensor) else gd[0].shape[-2])
    i = two_i // 2
    (gate_data, up_data), (gate_scale, up_scale) = split_gate_up(gd), split_gate_up(gs)
    gate, up = Operand(gate_data, gate_scale), Operand(up_data, up_scale)
    if not columnwise:  # a forward reads the row-wise operands only (views, but on every call's path)
        return RoutedOperands(gate, up, Operand(dd, ds), None, None, None)
    if gs is None:
        gate_t, up_t = Operand(transposed_payload(gate.data), None), Operand(transposed_payload(up.data), None)
    elif gdt is None:
        gate_t = up_t = None
    else:
        gate_t = Operand(narrow_payload(gdt, -1, 0, i), narrow_payload(gst, -1, 0, i // BLOCK))
        up_t = Operand(narrow_payload(gdt, -1, i, i), narrow_payload(gst, -1, i // BLOCK, i // BLOCK))
    if ds is None:
        down_t = Operand(transposed_payload(dd), None)
    else:
        down_t = None if ddt is None else Operand(ddt, dst)
    return RoutedOperands(gate, up, Operand(dd, ds), gate_t, up_t, down_t)


# ---------------------------------------------------------------------------------------------
# Validation of a routed weight given as (data, scale, data_t, scale_t, master) tensors (metadata only)


def _dt(t) -> str:
    return str(t.dtype).replace("torch.", "")


def check_weight(name: str, data, scale, data_t, scale_t, master, dtype: torch.dtype, device: torch.device,
                 *, split_rows: bool = False, dims: int = 3) -> None:
    """Errors (TypeError / ValueError naming `name`) for a routed weight [E, M, K] given as MXFP8 data
    (float8_e4m3fn [E, M, K], scales uint8 [E, M, K/32], optional column-wise data [E, K, M] and scales
    [E, K, M/32]) or, with scale None, as a plain `dtype` weight. `split_rows`: the weight is a combined
    gate/up FC1 whose column-wise scale blocks must not straddle the gate/up boundary (I % 32 == 0).
    `dims=2`: one expert's weight [M, K] (a piece of a split weight)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or an MXFP8Weight, got {type(data).__name__}")
    if scale is None:
        if data_t is not None or scale_t is not None:
            raise ValueError(f"{name}: column-wise MXFP8 data given without the row-wise scales")
        return
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: MXFP8 data must be float8_e4m3fn, got {_dt(data)}")
    if data.dim() != dims:
        what = "[E, M, K]" if dims == 3 else "[M, K]"
        raise ValueError(f"{name}: expected {dims}-D MXFP8 data {what}, got shape {list(data.shape)}")
    if data.device != device:
        raise ValueError(f"{name}: expected MXFP8 data on {device} (the device of x), got one on {data.device}")
    *lead, M, K = data.shape
    if K % BLOCK:
        raise ValueError(f"{name}: MXFP8 needs the reduction dim (the last, {K}) divisible by {BLOCK}")
    for label, s, shape in (("scale", scale, (*lead, M, K // BLOCK)), ("scale_t", scale_t, (*lead, K, M // BLOCK))):
        if s is None:
            continue
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{name}: MXFP8 {label} must be a torch.Tensor, got {type(s).__name__}")
        if s.dtype != torch.uint8:
            raise TypeError(f"{name}: MXFP8 {label} must be uint8 (biased E8M0 exponents), got {_dt(s)}")
        if s.device != device:
            raise ValueError(f"{name}: expected MXFP8 {label} on {device} (the device of x), got one on {s.device}")
        if label == "scale_t" and M % BLOCK:
            raise ValueError(f"{name}: the column-wise MXFP8 layout needs dim -2 ({M}) divisible by {BLOCK}")
        if tuple(s.shape) != shape:
            raise ValueError(f"{name}: expected MXFP8 {label} of shape {list(shape)}, got {list(s.shape)}")
    if (data_t is None) != (scale_t is None):
        raise ValueError(f"{name}: column-wise MXFP8 data and scales must be given together")
    if data_t is not None:
        if not isinstance(data_t, torch.Tensor) or data_t.dtype != torch.float8_e4m3fn:
            got = _dt(data_t) if isinstance(data_t, torch.Tensor) else type(data_t).__name__
            raise TypeError(f"{name}: column-wise MXFP8 data must be float8_e4m3fn, got {got}")
        if tuple(data_t.shape) != (*lead, K, M):
            raise ValueError(f"{name}: expected column-wise MXFP8 data of shape {[*lead, K, M]}, got "
                             f"{list(data_t.shape)}")
        if data_t.device != device:
            raise ValueError(f"{name}: expected MXFP8 data on {device} (the device of x), got one on {data_t.device}")
        if split_rows and (M // 2) % BLOCK:
            raise ValueError(
                f"{name}: the column-wise MXFP8 layout of a combined gate/up weight needs I ({M // 2}) divisible by "
                f"{BLOCK} (a scale block must not hold both gate and up rows)"
            )
    if master is not None:
        if not isinstance(master, torch.Tensor):
            raise TypeError(f"{name}: the master weight must be a torch.Tensor, got {type(master).__name__}")
        if master.dtype != dtype:
            raise TypeError(f"{name}: the master weight must have the dtype of x ({_dt_name(dtype)}), got {_dt(master)}")
        if tuple(master.shape) != (*lead, M, K):
            raise ValueError(f"{name}: expected the master weight of shape {[*lead, M, K]}, got {list(master.shape)}")
        if master.device != device:
            raise ValueError(f"{name}: expected the master weight on {device} (the device of x), got {master.device}")


def check_split_weight(name: str, data, scale, data_t, scale_t, dtype: torch.dtype, device: torch.device, *,
                       split_rows: bool = False) -> None:
    """`check_weight` for a routed weight split per expert: sequences of E 2-D data [M, K], scales
    [M, K/32] and, optionally, column-wise data [K, M] and scales [K, M/32], every expert of one shape."""
    E = len(data)
    for label, seq in (("scale", scale), ("transposed_data", data_t), ("transposed_scale", scale_t)):
        if seq is None:
            if label == "scale":
                raise ValueError(f"{name}: split MXFP8 data needs its scales (SplitRoutedWeight.scale)")
            continue
        if not isinstance(seq, (tuple, list)):
            raise TypeError(f"{name}: SplitRoutedWeight.{label} must be a sequence of {E} tensors, got "
                            f"{type(seq).__name__}")
        if len(seq) != E:
            raise ValueError(f"{name}: SplitRoutedWeight.{label} holds {len(seq)} tensors, its data {E}")
    for e in range(E):
        d = data[e]
        if e and isinstance(d, torch.Tensor) and d.shape != data[0].shape:
            raise ValueError(f"{name}[{e}]: expected the shape of {name}[0] {list(data[0].shape)}, got "
                             f"{list(d.shape)}")
        check_weight(f"{name}[{e}]", d, scale[e], None if data_t is None else data_t[e],
                     None if scale_t is None else scale_t[e], None, dtype, device, split_rows=split_rows, dims=2)


def _dt_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------------
# mok_inductor.moe's routed-weight arguments -> mok::moe's (weight, scale, data_t, scale_t, master)


class _StackedMasters(torch.autograd.Function):
    """A stand-in [E, M, K] for E per-expert master weights: no copy in forward (a zero-stride tensor the
    op never reads); backward hands each master its slice of the gradient."""

    @staticmethod
    def forward(*masters):
        return masters[0].new_empty(()).expand(len(masters), *masters[0].shape)

    @staticmethod
    def setup_context(ctx, inputs, output):  # (nothing to save; this form works under torch.func)
        pass

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.unbind(0))


def is_quantized_arg(w) -> bool:
    """Whether a routed-weight argument of mok_inductor.moe is MXFP8 (one MXFP8Weight, or a list of them)."""
    if isinstance(w, MXFP8Weight):
        return True
    return isinstance(w, (list, tuple)) and len(w) > 0 and all(isinstance(q, MXFP8Weight) for q in w)


def _carries_derivative(t: torch.Tensor) -> bool:
    """Whether a derivative flows from t: it requires grad with grad mode on (backward; under no_grad or
    inference_mode a float32 master of bf16 activations is not needed, so not checked), or it has a
    forward-mode tangent (torch.func.jvp, jacfwd, forward_ad dual tensors)."""
    return (t.requires_grad and torch.is_grad_enabled()) or unpack_dual(t).tangent is not None


def _live_master(m):
    return m if isinstance(m, torch.Tensor) and _carries_derivative(m) else None


def op_args(name: str, w) -> tuple:
    """(data, scale, data_t, scale_t, master) of a routed weight: an MXFP8Weight with 3-D data [E, M, K], a
    list of E MXFP8Weights with 2-D data [M, K] (stacked: one copy of the quantized bytes), or a plain
    tensor (scale and master None: it receives its own gradient). The master is passed only when it
    requires grad."""
    if isinstance(w, torch.Tensor):
        return (w, None, None, None, None)
    if isinstance(w, MXFP8Weight):
        if w.data is None:
            raise ValueError(f"{name}: the MXFP8 weight has no row-wise data (quantized with rowwise=False)")
        return (w.data, w.scale, w.data_t, w.scale_t, _live_master(w.master))
    if not is_quantized_arg(w):
        raise TypeError(f"{name}: expected a torch.Tensor, an MXFP8Weight or a list of MXFP8Weights, got "
                        f"{type(w).__name__}")
    for e, q in enumerate(w):
        if q.data is None:
            raise ValueError(f"{name}[{e}]: the MXFP8 weight has no row-wise data (quantized with rowwise=False)")
        if not isinstance(q.data, torch.Tensor) or q.data.dim() != 2:
            raise ValueError(f"{name}[{e}]: expected a per-expert MXFP8 weight with 2-D data [M, K], got "
                             f"shape {list(q.data.shape)}")
        if q.data.shape != w[0].data.shape:
            raise ValueError(f"{name}[{e}]: expected the shape of {name}[0] {list(w[0].data.shape)}, got "
                             f"{list(q.data.shape)}")
        if (q.data_t is None) != (w[0].data_t is None):
            raise ValueError(f"{name}[{e}]: every expert must have column-wise data, or none")
    has = [q.master is not None for q in w]
    if any(has) and not all(has):
        raise ValueError(f"{name}: every per-expert MXFP8 weight needs a master weight, or none")

    def stack(field):
        parts = [getattr(q, field) for q in w]
        return None if parts[0] is None else torch.stack(parts)

    master = None
    masters = [q.master for q in w] if all(has) else []
    if torch.is_grad_enabled() and any(m.requires_grad for m in masters):
        master = _StackedMasters.apply(*masters)
    elif any(_carries_derivative(m) for m in masters):  # forward mode only: the tangents need a real tensor
        master = torch.stack(masters)
    return (stack("data"), stack("scale"), stack("data_t"), stack("scale_t"), master)
