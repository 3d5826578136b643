"""Weight operands: how the kernels read a routed weight as [E, n, k] (k the reduction dim) through its
strides, bf16/fp16/fp32 or MXFP8 e4m3 data with E8M0 scales per 32 along k; split per-expert weights through
device tables of the experts' addresses (`ExpertTable`); the TMA descriptors of eager launches; and the
one-pass dequantization of MXFP8 weights (`dequantized`) for the GEMMs at many rows per expert.

    plain(w) / plain_t(w)       a float weight (3-D, or E 2-D tensors) / its transpose as an `Operand`
    w_args(op), w_meta(*ops)    an operand's kernel arguments (data, strides, scales, strides), W_TABLE
    w_bases, w_tile             in a kernel: expert e's starts, a [BLOCK_K, BLOCK_N] tile (dequantized)

Shape legend: E experts, n output columns, k the reduction dim.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import options
from ..types import Operand
from . import common
from .common import e8m0_factor, expert_ptr


@triton.jit
def w_bases(w_ptr, s_ptr, e64, s_e, ss_e, E, TABLE: tl.constexpr, MX: tl.constexpr):
    """(data, scales) starts of expert e of an operand (`w_args`); TABLE as in expert_ptr, for the data (a
    scale table is never declared aligned: the up half's scale rows start mid-line). MX: e4m3 data, uint8
    scales. Plain: the scales argument is a tensor of the weight's dtype (through a table, the dtype the
    addresses are cast to), returned as is."""
    if MX:
        w = expert_ptr(w_ptr, e64, s_e, E, TABLE, tl.float8e4nv)
        s = expert_ptr(s_ptr, e64, ss_e, E, TABLE != 0, tl.uint8)  # (a table, never declared aligned)
    else:
        w = expert_ptr(w_ptr, e64, s_e, E, TABLE, s_ptr.dtype.element_ty)
        s = s_ptr
    return w, s


@triton.jit
def w_tile(w_ptr, s_ptr, kk, cols, kmask, cmask, s_n, s_k, ss_n, ss_k, like_ptr,
           MX: tl.constexpr, DOT_PREC: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile W[e][cols, kk] (k down the tile) of one expert's matrix (w_ptr, s_ptr:
    its starts, `w_bases`); MX: e4m3 data dequantized with its per-32 scales in registers (e4m3 * 2**(s -
    127) is exact in bf16/fp16/fp32) into like_ptr's dtype, for the activation dtype's tl.dot. (`tl.dot_scaled`
    is not used: on Hopper Triton decomposes it into the same upcast, and the interpreter rejects it.) BLOCK_K
    is a multiple of 32: a K step holds whole scale blocks."""
    m = kmask[:, None] & cmask[None, :]
    w = tl.load(w_ptr + kk[:, None] * s_k + cols[None, :] * s_n, mask=m, other=0.0)
    if MX:
        # one scale load per element (L1 hits: 32 neighbours share one); a row of scales per 32-block spread
        # with where(), a scale tile broadcast through a 3-D view, inline-PTX conversions and decoding by bit
        # moves were all slower. The conversions (e4m3 -> f16 -> f32 -> bf16: F2F, a quarter of the float32
        # rate on Hopper) bound this loop
        sc = tl.load(s_ptr + (kk // 32)[:, None] * ss_k + cols[None, :] * ss_n, mask=m, other=0)
        w = w.to(tl.float32) * e8m0_factor(sc)
        if DOT_PREC != "interp":
            w = w.to(like_ptr.dtype.element_ty)
    return w


@triton.jit
def w_tma_tile(w_desc, w_row0, n0, k0, W_KMAJOR: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile W[e][n0 + j, k0 + i] through the TMA descriptor of the weight's 2-D view
    (`tma_weights`), expert e's first row w_row0: rows e*R + n, cols k (W_KMAJOR) or rows e*R + k, cols n.
    Columns past the matrix's n (the rows of another expert or matrix) give garbage the caller's store masks;
    a K step must not run past k (callers run whole steps only, the tail through `w_tile`)."""
    if W_KMAJOR:
        w = tl.trans(w_desc.load([w_row0 + n0, k0]))
    else:
        w = w_desc.load([w_row0 + k0, n0])
    return w


def w_args(op) -> tuple:
    """Kernel arguments of an operand (`mok_inductor.types.Operand` of 3-D tensors or of `ExpertTable`s)
    read as [E, n, k]: data, its strides, scales, their strides. A plain operand's scales are its data
    again (through a table: a tensor of its dtype, which the kernel reads the addresses as)."""
    d = op.data
    s = op.scale if op.scale is not None else d
    dp = d.table if isinstance(d, ExpertTable) else d
    if isinstance(s, ExpertTable):
        sp = s.table if op.scale is not None else s.witness
    else:
        sp = s
    return (dp, d.stride(0), d.stride(1), d.stride(2), sp, s.stride(0), s.stride(1), s.stride(2))


def w_meta(*ops) -> dict:
    """W_TABLE of a launch's weight operands, all tensors (0) or all `ExpertTable`s: 2 when every data
    address is 16-byte aligned, else 1."""
    tables = [isinstance(op.data, ExpertTable) for op in ops]
    if not any(tables):
        return dict(W_TABLE=0)
    if not all(tables):
        raise AssertionError("a launch's weight operands are all ExpertTables or all tensors")
    return dict(W_TABLE=2 if all(op.data.aligned for op in ops) else 1)


class ExpertTable:
    """E [n, k] matrices of one shape, strides and dtype as one kernel operand read as [E, n, k]: the
    kernels read expert e at the address in entry e of `table` (int64, on the device), with the common
    strides (`expert_ptr`). Has a 3-D tensor's metadata for the launch wrappers: shape, stride() (0 between
    experts), dtype, device; `witness` is a tensor of the weights' dtype (the kernels cast the addresses
    to it), `aligned` whether every address is a multiple of 16 bytes."""

    def __init__(self, table, shape, strides, witness, aligned):
        self.table, self.witness, self.aligned = table, witness, aligned
        self.shape, self._strides = torch.Size(shape), tuple(strides)
        self.dtype, self.device = witness.dtype, witness.device

    @staticmethod
    def of(payload) -> Optional["ExpertTable"]:
        """The table of a 3-D tensor's experts (computed on the device, uncached: capturable, and free for a
        transient copy), or of a sequence of E 2-D tensors of one shape, strides, dtype and device (cached
        per set of addresses, `address_table`); None for a sequence that is not so uniform."""
        if isinstance(payload, torch.Tensor):
            ptr, step = payload.data_ptr(), payload.stride(0) * payload.element_size()
            table = torch.arange(payload.shape[0], dtype=torch.int64, device=payload.device) * step + ptr
            return ExpertTable(table, payload.shape, (0,) + payload.stride()[1:], payload,
                               ptr % 16 == 0 and step % 16 == 0)
        tensors = tuple(payload)
        if not tensors or not isinstance(tensors[0], torch.Tensor) or tensors[0].dim() != 2:
            return None
        t0 = tensors[0]
        meta = (t0.shape, t0.stride(), t0.dtype, t0.device)
        ptrs = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or (t.shape, t.stride(), t.dtype, t.device) != meta:
                return None
            ptrs.append(t.data_ptr())
        return ExpertTable(address_table(tuple(ptrs), t0.device), (len(tensors),) + tuple(t0.shape),
                           (0,) + t0.stride(), t0, all(p % 16 == 0 for p in ptrs))

    def t(self) -> "ExpertTable":
        """The transposed matrices ([E, k, n]): the same addresses, the strides swapped."""
        E, n, k = self.shape
        return ExpertTable(self.table, (E, k, n), (0, self._strides[2], self._strides[1]), self.witness,
                           self.aligned)

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]


# The device address tables of split weights, per (device, addresses), least recently used evicted past
# the bound (a CUDA graph that captured a kernel reading an evicted table would read freed memory at its
# replays: the bound is far above one entry per routed weight of each layer).
_TABLES: dict = {}


_TABLES_MAX = 1 << 14


def address_table(ptrs: tuple, device: torch.device) -> torch.Tensor:
    """int64 [E] on `device` holding `ptrs`, cached. A set of addresses seen for the first time is copied to
    the device synchronously (once per set of weights; then visible to every stream), which a CUDA-graph
    capture cannot do: its first call must come before the capture (warm-up)."""
    key = (device, ptrs)
    hit = _TABLES.pop(key, None)
    if hit is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split per-expert weights: their first call is under CUDA-graph capture, which "
                               "cannot copy the weights' address table to the device; run the layer once "
                               "before capturing (warm-up)")
        hit = torch.tensor(ptrs, dtype=torch.int64).to(device)
        while len(_TABLES) >= _TABLES_MAX:
            _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = hit  # (most recently used last)
    return hit


def _split_payload(w, transposed: bool):
    """A sequence of E 2-D weights as an ExpertTable (no copy), or, while traced (no data pointers) or when
    the experts differ in shape or strides, as a tuple of (transposed) tensors, which kernels.forward stacks."""
    w = tuple(w)
    table = None if common.without_pointers(w) else ExpertTable.of(w)
    if table is not None:
        return table.t() if transposed else table
    return tuple(t.transpose(-2, -1) for t in w) if transposed else w


def plain(w) -> Operand:
    """A float weight (3-D, or a sequence of E 2-D tensors) as a kernel operand (no scales)."""
    return Operand(w if isinstance(w, torch.Tensor) else _split_payload(w, False), None)


def plain_t(w) -> Operand:
    """The transpose of a float weight ([E, a, b], or E x [a, b], read as [E, b, a]) as a kernel operand."""
    if isinstance(w, torch.Tensor):
        return Operand(w.transpose(-2, -1), None)
    return Operand(_split_payload(w, True), None)


def scale_words(*ops) -> bool:
    """Whether these MXFP8 operands' scales can be read by 32-bit words of 4 blocks (`MxLoop.F16_WORDS`): plain
    tensors (not `ExpertTable`s) with contiguous rows, and the start, the expert and the row strides multiples
    of 4 bytes. Traced (torch.compile, no address), the start is the view's offset into its storage, the
    storage's own start taken as aligned: CUDA allocations are, and Inductor checks a compiled graph's inputs
    that it takes as aligned (an offset of a multiple of 16 bytes) on each call, copying any that is not
    (`copy_misaligned_inputs`)."""
    for op in ops:
        s = op.scale
        if not isinstance(s, torch.Tensor) or s.stride(2) != 1:
            return False
        start = s.storage_offset() if common.without_pointers((s,)) else s.data_ptr()
        if not all(common.known_multiple(v, 4) for v in (s.stride(1), s.stride(0), start)):
            return False
    return True


# Eager launches load the non-gathered operand tiles (weights; the grouped row GEMM's sorted A rows too)
# through host-built TMA tensor descriptors where the layouts allow it (`tma_eligible`, `tma_weights`; faster
# than pointer loads at training and prefill sizes, slower at decode, where the descriptors' host cost and the
# TMA loads of a few rows do not pay). `options.tma` and `options.tma_min_rows` decide.


def _tma_view(d: torch.Tensor, kmajor: bool):
    """(the 2-D view [rows, cols] a TMA descriptor reads W[e] (n, k) through, R) or None: rows e*R + n, cols k
    (kmajor, k contiguous) or rows e*R + k, cols n. R is the expert stride in rows; the view ends at the last
    expert's last row, so it never reaches past the tensor (e.g. the gate half of a [E, 2I, H] buffer)."""
    E, n, k = d.shape
    s_e, s_n, s_k = d.stride()
    rows_per, cols, row_stride = (n, k, s_n) if kmajor else (k, n, s_k)
    if (s_k if kmajor else s_n) != 1 or row_stride < cols or (E > 1 and s_e % row_stride) or s_e < 0:
        return None
    R = s_e // row_stride if E > 1 else rows_per
    total = (E - 1) * R + rows_per
    if total >= 2 ** 31 or (row_stride * d.element_size()) % 16 or d.data_ptr() % 16:
        return None
    return torch.as_strided(d, (total, cols), (row_stride, 1)), R


def tma_pre_hook(a_names: tuple, w_names: tuple):
    """An eager pre-hook (`common.autotune`) giving the host descriptors in the named kernel arguments the
    block shapes of the config being launched: A operands [BLOCK_M, BLOCK_K], weights [BLOCK_N, BLOCK_K]
    (W_KMAJOR) or [BLOCK_K, BLOCK_N]."""
    def hook(nargs):
        if nargs["TMA"]:
            bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
            bn *= 2 if nargs.get("INTERLEAVED") else 1  # (a tile of both halves: `interleaved`)
            for a in a_names:
                if nargs[a] is not None:  # (an optional A descriptor left out)
                    nargs[a].block_shape = [bm, bk]
            for w in w_names:
                nargs[w].block_shape = [bn, bk] if nargs["W_KMAJOR"] else [bk, bn]

    return hook


def host_desc(t: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])  # (block shape: tma_pre_hook)


def row_desc(t: torch.Tensor):
    """A host descriptor of the 2-D tensor t read by whole rows, or None where TMA cannot read it: rows
    contiguous and not overlapping, the start and the row stride 16-byte aligned, at least one row."""
    if t.shape[0] == 0 or t.stride(1) != 1 or t.stride(0) < t.shape[1]:
        return None
    if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    return host_desc(t)


def _views_of_one(first, second) -> tuple:
    """(a, b): the plain data of two weights (tensors or `Operand`s; MXFP8 data never qualifies) when they are
    3-D views of one storage with the same shape, strides and dtype, else (None, None)."""
    if isinstance(first, Operand):
        if first.quantized or second.quantized:
            return None, None
        first, second = first.data, second.data
    a, b = first, second
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 3 or b.dim() != 3:
        return None, None
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return None, None
    return (a, b) if torch._C._is_alias_of(a, b) else (None, None)


def interleaved(first, second, dim: int) -> Optional[torch.Tensor]:
    """The one tensor whose `dim` (1 or 2) alternates `first` and `second` (two tensors or two `Operand`s;
    element 2i of it is first's i, 2i+1 second's i), when the two are plain 3-D views laid out that way
    (GPT-OSS's checkpoint layout: gate and up columns interleaved in one [E, H, 2I] weight), else None. Read
    whole, its interleaved dim is contiguous where each half alone has a stride of 2, which no load order
    coalesces."""
    a, b = _views_of_one(first, second)
    # the second view one element after the first (storage offsets: traced tensors have no pointers)
    if a is None or a.stride(dim) != 2 or a.shape[dim] == 0 or b.storage_offset() != a.storage_offset() + 1:
        return None
    shape, stride = list(a.shape), list(a.stride())
    shape[dim], stride[dim] = 2 * shape[dim], 1
    return torch.as_strided(a, shape, stride)


def concatenated(first, second) -> Optional[torch.Tensor]:
    """The one [E, 2I, H] tensor whose rows are first's [E, I, H] then second's, when the two are plain 3-D
    views laid out that way (gate and up as the halves of one gate_up weight), else None."""
    a, b = _views_of_one(first, second)
    if a is None or 0 in a.shape or b.storage_offset() != a.storage_offset() + a.shape[1] * a.stride(1):
        return None
    return torch.as_strided(a, (a.shape[0], 2 * a.shape[1], a.shape[2]), a.stride())


def interleaved_pair(pair, dim: int) -> Optional[torch.Tensor]:
    """`interleaved(pair[:, 0], pair[:, 1], dim)` of a 4-D [E, 2, A, B] tensor, made by view ops (a permutation
    and a merge of two dims), or None. A buffer a kernel writes must be reached this way under torch.compile:
    functionalization takes a mutation through view ops but not through `as_strided`."""
    if not isinstance(pair, torch.Tensor) or pair.dim() != 4 or pair.shape[1] != 2 or pair.shape[dim + 1] == 0:
        return None
    moved = pair.movedim(1, dim + 1)  # the halves' index right after their interleaved dim
    if moved.stride(dim + 1) != 1 or moved.stride(dim) != 2:
        return None
    shape = list(moved.shape)
    shape[dim:dim + 2] = [2 * shape[dim]]
    return moved.view(shape)


def tma_eligible(act: torch.Tensor, rows: int, groups: int) -> bool:
    """Whether a launch with activations `act` and `rows` rows over `groups` experts may use host TMA
    descriptors: `options.tma` on, an eager launch (also under the interpreter) of 16-bit activations, at least
    `options.tma_min_rows` rows per expert on average. AOTAutograd's tracing of `wrap_triton` does not carry descriptor
    arguments (torch 2.11-2.13), and Inductor takes no pre-hook to set their block shapes per config: traced
    launches load every tile by pointers."""
    opts = options.current()
    if not opts.tma or act.element_size() != 2 or common.without_pointers((act,)):
        return False
    return rows >= opts.tma_min_rows * groups


def tma_weights(ops) -> Optional[tuple]:
    """(descriptors, R, W_KMAJOR) for the weight operands `ops` (all plain 3-D tensors of one layout and one
    expert stride in rows R, 16-byte aligned), or None (pointer loads)."""
    if any(op.quantized or not isinstance(op.data, torch.Tensor) for op in ops):
        return None
    kmajor = ops[0].data.stride(2) == 1
    views = [_tma_view(op.data, kmajor) for op in ops]
    if any(v is None for v in views) or len({v[1] for v in views}) != 1:
        return None
    return tuple(host_desc(v[0]) for v in views), views[0][1], kmajor


@triton.jit
def _dequant_kernel(
    w_ptr, s_e, s_n, s_k, q_ptr, q_e, q_n, q_k,  # e4m3 data [E, n, k] and E8M0 scales [E, n, k/32] (strided)
    out_ptr,  # [E, n, k] out, contiguous (the activation dtype)
    NR, KD, E,  # n, k (k a multiple of 32), experts
    TABLE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """[BLOCK_R, BLOCK_B, 32] tiles: BLOCK_B scale blocks of 32 along k per row, one scale load per block.
    TABLE: split per-expert data and scales read through address tables (as in expert_ptr)."""
    e64 = tl.program_id(2).to(tl.int64)
    w_ptr = expert_ptr(w_ptr, e64, s_e, E, TABLE, tl.float8e4nv)
    q_ptr = expert_ptr(q_ptr, e64, q_e, E, TABLE != 0, tl.uint8)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    j = tl.arange(0, 32)
    m2 = (rows < NR)[:, None] & (kb < KD // 32)[None, :]
    sc = tl.load(q_ptr + rows[:, None] * q_n + kb[None, :] * q_k, mask=m2, other=0)
    kk = kb[None, :, None] * 32 + j[None, None, :]
    m3 = m2[:, :, None]
    w = tl.load(w_ptr + rows[:, None, None] * s_n + kk * s_k, mask=m3, other=0.0)
    tl.store(out_ptr + e64 * NR * KD + rows[:, None, None] * KD + kk,
             (w.to(tl.float32) * e8m0_factor(sc)[:, :, None]).to(out_ptr.dtype.element_ty), mask=m3)


def dequantized(op: Operand, dtype: torch.dtype) -> Operand:
    """An MXFP8 operand (3-D) as a plain `dtype` one, [E, n, k] contiguous: one pass over the weight (read
    1 byte + 1/32 of a scale, write 2 per element), for the GEMMs whose rows per expert re-read each weight
    tile often enough that dequantizing it in every K loop costs more (`options.mx_dequantize_min_rows`)."""
    if not op.quantized:
        return op
    d, q = op.data, op.scale
    table = 0
    if not isinstance(d, torch.Tensor):  # split per expert: read in place through address tables
        d, q = _split_payload(d, False), _split_payload(q, False)
        if isinstance(d, ExpertTable) and isinstance(q, ExpertTable):
            table = 2 if d.aligned else 1
        else:  # traced, or experts of different shapes/strides: one copy
            d, q = op.stacked()
    E, n, k = d.shape
    out = torch.empty(E, n, k, dtype=dtype, device=d.device)
    if out.numel() == 0:
        return plain(out)
    dp, qp = (d.table, q.table) if table else (d, q)
    br, bb = (8, 2) if common.INTERPRET else (32, 8)
    common.launch(_dequant_kernel, (common.cdiv(n, br), common.cdiv(k // 32, bb), E), dp, d.stride(0),
                   d.stride(1), d.stride(2), qp, q.stride(0), q.stride(1), q.stride(2), out, n, k, E, TABLE=table,
                   BLOCK_R=br, BLOCK_B=bb, num_warps=4)
    return plain(out)
