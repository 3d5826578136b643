"""Routed-weight views for MoK: MCore / Transformer Engine expert parameters in the functional ABI's forms.

The backend (`MoKMegakernel.quantized_routed_weights`) builds its cached routed-weight views with the two
helpers here; nothing is copied except MXFP8 scales, which MoK reads in its own tile layout:

    _native_single_grouped_weight_view(weight, num_experts=E, rows=M, columns=K, use_mxfp8=..., cached_view=None)
        one grouped parameter [E, M, K] ->
          high precision: the parameter itself (or a view of a TE GroupedTensor's backing storage);
          MXFP8: (row_data [E, M, K] fp8, row_scale swizzled, col_data [E, M, K] fp8, col_scale swizzled, True),
                 TE's column-wise payload kept in its native [E, M, K] shape (the trailing True says so).
    _native_split_weight_view(params, rows=M, columns=K, use_mxfp8=..., cached_view=None)
        E per-expert parameters [M, K] ->
          with this project's functional: the E tensors themselves (high precision), or a
            `functional.SplitRoutedWeight` over TE's own MXFP8 storage (logical scales, native column-wise);
          with Mixture-of-Kittens' functional loaded: MoK's `SplitRoutedWeight` over `mok.ops` storage tables
            (swizzled per-expert scales, kept so that a refresh rewrites them in place).

MXFP8 scale layouts (E8M0 bytes): Transformer Engine keeps the logical [E, M, K/32] (row-wise) and
[E, M/32, K] (column-wise); MoK reads the swizzled [E*M/128, K/128, 32, 16], where

    swizzled[e*M/128 + mb, kb, lane, 4*g + c] = logical[e, 128*mb + 32*g + lane, 4*kb + c]

(lane 0..31, row group g 0..3, scale column c 0..3). A refresh (`cached_view=`) rewrites the swizzled
scales in place, so the addresses MoK captured (TMA descriptors, CUDA graphs) stay valid; it is done once
per optimizer iteration, when the weights change.

Which functional is in use is decided at call time, by the bridge's rule (`runtime.functional_module`):
Mixture-of-Kittens' when a `mok.functional` module is loaded, this project's otherwise. Megatron helpers
that only newer megatron-core releases have (`fp8_utils.is_grouped_mxfp8tensor`,
`get_grouped_quantized_members`) are also looked up at call time. This module imports no Megatron at
import time.
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
import warnings
from typing import Optional

import torch

from ... import mxfp8 as _mxfp8
from . import functional as _project_functional
from . import runtime as _runtime

__all__ = ["mok_functional", "mok_ops", "uses_project_functional", "split_main_grad_tables",
           "prepare_shared_expert_config"]


# ---------------------------------------------------------------------------------------------
# The MoK implementation in use


def mok_functional():
    """The functional module the bridge calls (`runtime.functional_module`: `runtime.set_functional`'s, else
    a loaded `mok.functional`, else this project's `mok_inductor.functional`)."""
    lookup = getattr(_runtime, "functional_module", None)
    if lookup is not None:
        return lookup()
    loaded = sys.modules.get("mok.functional")  # the same rule, for a bridge without the lookup
    return _project_functional if loaded is None else loaded


def uses_project_functional() -> bool:
    return mok_functional() is _project_functional


def mok_ops():
    """Mixture-of-Kittens' `mok.ops` (descriptor-table builders), for when its functional is in use."""
    package = sys.modules.get("mok")
    ops = getattr(package, "ops", None) if package is not None else None
    if ops is None:
        ops = sys.modules.get("mok.ops")
    if ops is None:
        try:
            ops = importlib.import_module("mok.ops")
        except ImportError as e:
            raise ImportError(
                "Mixture-of-Kittens' mok.functional is loaded, but mok.ops (its storage-table builders for "
                "per-expert weights) cannot be imported"
            ) from e
    return ops


# ---------------------------------------------------------------------------------------------
# Shared-expert construction


_shared_config_warned = False


def prepare_shared_expert_config(config):
    """The config to build an MoE layer's shared expert with when MoK runs the layer.

    MoK computes the shared expert from native BF16 weights, also when the routed experts hold MXFP8
    parameters (`fp8_param`): the shared expert must then be built without FP8 parameters or FP8
    execution. Returns `config` itself when it has no FP8 parameters, else a shallow copy with
    `fp8=None` and `fp8_param=False` (and warns once per process)."""
    global _shared_config_warned
    if not getattr(config, "fp8_param", False):
        return config
    if not _shared_config_warned:
        _shared_config_warned = True
        warnings.warn(
            "MoK runs the shared expert in BF16: it is built without FP8 parameters or FP8 execution, "
            "while the routed experts keep their MXFP8 parameters",
            stacklevel=2,
        )
    shared = copy.copy(config)
    shared.fp8 = None
    shared.fp8_param = False
    return shared


# ---------------------------------------------------------------------------------------------
# Storage access


def _parameter_storage_attr(param, name: str):
    """A Transformer Engine storage field of `param` (e.g. `rowwise_data`, `_rowwise_scale_inv`), or None.

    TE releases expose these under a public name or an underscore one, on the Parameter itself or on
    its `.data`; reading them never materialises the logical (dequantised) tensor."""
    names = (name,) if name.startswith("_") else (name, "_" + name)
    for holder in (param, getattr(param, "data", None)):
        if holder is None:
            continue
        for n in names:
            value = getattr(holder, n, None)
            if value is not None:
                return value
    return None


def _storage_view(storage: torch.Tensor, shape, *, dtype: torch.dtype, name: str) -> torch.Tensor:
    """`storage` viewed as a dense `shape` of `dtype`, without a copy. TE keeps FP8 payloads as uint8;
    those are reinterpreted as float8_e4m3fn."""
    shape = tuple(int(s) for s in shape)
    if not isinstance(storage, torch.Tensor):
        raise RuntimeError(f"MoK {name} storage: expected a tensor, got {type(storage).__name__}")
    if storage.dtype != dtype:
        if storage.dtype == torch.uint8 and dtype == torch.float8_e4m3fn:
            storage = storage.view(dtype)
        else:
            raise RuntimeError(f"MoK {name} storage has dtype {storage.dtype}, expected {dtype}")
    if not storage.is_contiguous():
        raise RuntimeError(f"MoK {name} storage must be contiguous")
    if storage.numel() != math.prod(shape):
        raise RuntimeError(
            f"MoK {name} storage holds {storage.numel()} elements, expected {math.prod(shape)} for shape {list(shape)}"
        )
    return storage.view(shape)


def _single_grouped_mxfp8_scale_view(param, member_attr: str, shape, *, name: str) -> torch.Tensor:
    """One [E, ...] view of a single grouped MXFP8 parameter's per-expert scales (`member_attr` of each
    of TE's per-expert members), which must lie expert-major in one storage."""
    from megatron.core import fp8_utils

    members_of = getattr(fp8_utils, "get_grouped_quantized_members", None)
    if members_of is None:
        raise RuntimeError(
            "MoK single grouped MXFP8 weights need megatron.core.fp8_utils.get_grouped_quantized_members "
            "(a megatron-core release with Transformer Engine grouped tensors)"
        )
    shape = tuple(int(s) for s in shape)
    members = list(members_of(param) or ())
    if len(members) != shape[0]:
        raise RuntimeError(f"MoK {name}: expected {shape[0]} grouped members, got {len(members)}")
    first = getattr(members[0], member_attr)
    per_expert = math.prod(shape[1:])
    base = first.untyped_storage().data_ptr()
    for e, member in enumerate(members):
        scale = getattr(member, member_attr)
        if (tuple(scale.shape) != shape[1:] or not scale.is_contiguous()
                or scale.untyped_storage().data_ptr() != base
                or scale.storage_offset() != first.storage_offset() + e * per_expert):
            raise RuntimeError(
                f"MoK {name}: member {e} scale is not packed expert-major in one storage "
                f"(shape {list(scale.shape)}, expected {list(shape[1:])} at element offset "
                f"{first.storage_offset() + e * per_expert})"
            )
    return torch.as_strided(first, (math.prod(shape),), (1,), first.storage_offset()).view(shape)


# ---------------------------------------------------------------------------------------------
# MXFP8 scale layouts


def _swizzle_mxfp8_scale(logical_scale: torch.Tensor, *, rows: int, columns: int,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TE's logical E8M0 scales [E, rows, columns/32] -> MoK's swizzled [E*rows/128, columns/128, 32, 16]
    (the formula in the module docstring; `mxfp8.swizzle_scale` does the copy). With `out`, writes into it
    and returns it (its address kept). RuntimeError for scales or an `out` of another shape or dtype."""
    if rows % 128 or columns % 128:
        raise RuntimeError(f"MoK MXFP8 scale dimensions must be divisible by 128, got rows={rows}, columns={columns}")
    if not isinstance(logical_scale, torch.Tensor) or logical_scale.dtype != torch.uint8 or logical_scale.dim() != 3:
        got = (f"{logical_scale.dtype} {list(logical_scale.shape)}" if isinstance(logical_scale, torch.Tensor)
               else type(logical_scale).__name__)
        raise RuntimeError(f"MoK requires logical uint8 MXFP8 scales shaped [E, M, K/32], got {got}")
    E = logical_scale.shape[0]
    if tuple(logical_scale.shape) != (E, rows, columns // 32):
        raise RuntimeError(
            f"MoK logical MXFP8 scale shape mismatch: got {list(logical_scale.shape)}, expected "
            f"[{E}, {rows}, {columns // 32}]"
        )
    if out is not None:
        shape = (E * rows // 128, columns // 128, 32, 16)
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != torch.uint8
                or out.device != logical_scale.device or not out.is_contiguous()):
            got = (f"{out.dtype} {list(out.shape)} on {out.device}, contiguous={out.is_contiguous()}"
                   if isinstance(out, torch.Tensor) else type(out).__name__)
            raise RuntimeError(
                f"MoK MXFP8 scale refresh: out must be a contiguous uint8 {list(shape)} on {logical_scale.device}, "
                f"got {got}"
            )
    return _mxfp8.swizzle_scale(logical_scale, out=out)


# ---------------------------------------------------------------------------------------------
# Views of the routed weights


def _native_single_grouped_weight_view(weight, *, num_experts: int, rows: int, columns: int, use_mxfp8: bool,
                                       cached_view=None):
    """The functional ABI's view of one single grouped parameter [E, rows, columns] (module docstring).
    `cached_view`: the MXFP8 tuple this call built before; its swizzled scales are rewritten in place."""
    shape = (int(num_experts), int(rows), int(columns))
    if tuple(weight.shape) != shape:
        raise RuntimeError(f"MoK requires native single-grouped weight shape {list(shape)}, got {list(weight.shape)}")
    if not use_mxfp8:
        # a high-precision TE GroupedTensor keeps its payload in rowwise_data: view that storage rather
        # than let an op materialise the logical wrapper
        storage = _parameter_storage_attr(weight, "rowwise_data")
        if storage is None:
            return weight
        return _storage_view(storage, shape, dtype=weight.dtype, name="single-grouped rowwise")

    from megatron.core import fp8_utils

    is_grouped_mxfp8 = getattr(fp8_utils, "is_grouped_mxfp8tensor", None)
    if is_grouped_mxfp8 is None:
        raise RuntimeError(
            "MoK single grouped MXFP8 weights need megatron.core.fp8_utils.is_grouped_mxfp8tensor (a megatron-core "
            "release with Transformer Engine grouped tensors)"
        )
    if not is_grouped_mxfp8(weight):
        raise RuntimeError("MoK MXFP8 requires native Transformer Engine grouped MXFP8 parameters")
    E, M, K = shape
    row_data = _storage_view(_parameter_storage_attr(weight, "rowwise_data"), shape, dtype=torch.float8_e4m3fn,
                             name="single-grouped MXFP8 rowwise")
    col_data = _storage_view(_parameter_storage_attr(weight, "columnwise_data"), shape, dtype=torch.float8_e4m3fn,
                             name="single-grouped MXFP8 columnwise")
    row_scale = _single_grouped_mxfp8_scale_view(weight, "_rowwise_scale_inv", (E, M, K // 32),
                                                 name="single-grouped rowwise")
    # TE's column-wise scales [E, M/32, K] are MoK's dgrad scales of the transposed [K, M] operand
    col_scale = _single_grouped_mxfp8_scale_view(weight, "_columnwise_scale_inv", (E, M // 32, K),
                                                 name="single-grouped columnwise").transpose(-2, -1)
    row_out = None if cached_view is None else cached_view[1]
    col_out = None if cached_view is None else cached_view[3]
    return (row_data, _swizzle_mxfp8_scale(row_scale, rows=M, columns=K, out=row_out),
            col_data, _swizzle_mxfp8_scale(col_scale, rows=K, columns=M, out=col_out),
            True)


def _split_mxfp8_storage(params, rows: int, columns: int):
    """Per expert: (row payload [M, K] fp8, column payload [M, K] fp8, row scale [M, K/32], column scale
    [M/32, K]), all TE's own storage."""
    from megatron.core import fp8_utils

    out = []
    for e, param in enumerate(params):
        if not fp8_utils.is_mxfp8tensor(param):
            raise RuntimeError(
                f"MoK MXFP8 split weights need every per-expert parameter in native Transformer Engine MXFP8 "
                f"storage; expert {e} is a {type(param).__name__}"
            )
        fields = {n: _parameter_storage_attr(param, n)
                  for n in ("rowwise_data", "columnwise_data", "_rowwise_scale_inv", "_columnwise_scale_inv")}
        missing = [n for n, v in fields.items() if v is None]
        if missing:
            raise RuntimeError(f"MoK MXFP8 split expert {e} is missing native storage {missing} "
                               f"(parameter {type(param).__name__} of shape {list(param.shape)})")
        row_scale, col_scale = fields["_rowwise_scale_inv"], fields["_columnwise_scale_inv"]
        if tuple(row_scale.shape) != (rows, columns // 32) or tuple(col_scale.shape) != (rows // 32, columns):
            raise RuntimeError(
                f"MoK MXFP8 split expert {e}: scales {list(row_scale.shape)} / {list(col_scale.shape)}, expected "
                f"[{rows}, {columns // 32}] / [{rows // 32}, {columns}]"
            )
        out.append((
            _storage_view(fields["rowwise_data"], (rows, columns), dtype=torch.float8_e4m3fn,
                          name="split MXFP8 rowwise"),
            _storage_view(fields["columnwise_data"], (rows, columns), dtype=torch.float8_e4m3fn,
                          name="split MXFP8 columnwise"),
            row_scale, col_scale,
        ))
    return out


def _native_split_weight_view(params, *, rows: int, columns: int, use_mxfp8: bool, cached_view=None):
    """The functional ABI's view of E per-expert parameters [rows, columns] (module docstring).
    `cached_view`: the MXFP8 view this call built before, refreshed for new weights."""
    params = tuple(params)
    if not params:
        raise RuntimeError("MoK split routed weights: the parameter list is empty")
    for e, p in enumerate(params):
        if tuple(p.shape) != (rows, columns):
            raise RuntimeError(f"MoK split routed weight {e}: shape {list(p.shape)}, expected [{rows}, {columns}]")
    if cached_view is not None and not use_mxfp8:
        raise RuntimeError("MoK high-precision split weights are used in place and never refreshed")
    functional = mok_functional()

    if functional is _project_functional:
        if not use_mxfp8:
            # the tensors themselves: a later `param.data = ...` is seen without a rebuild
            views = []
            for p in params:
                storage = _parameter_storage_attr(p, "rowwise_data")
                views.append(p if storage is None else
                             _storage_view(storage, (rows, columns), dtype=p.dtype, name="split rowwise"))
            return tuple(views)
        # TE's scales are used in their logical layout and TE rewrites them in place, so a refresh only
        # re-reads the storage fields
        storage = _split_mxfp8_storage(params, rows, columns)
        return functional.SplitRoutedWeight(
            data=tuple(s[0] for s in storage), scale=tuple(s[2] for s in storage),
            transposed_data=tuple(s[1] for s in storage), transposed_scale=tuple(s[3] for s in storage),
            native_columnwise=True,
        )

    # Mixture-of-Kittens: one representative tensor and a descriptor table per operand
    ops = mok_ops()
    if not use_mxfp8:
        payloads = []
        for p in params:
            storage = _parameter_storage_attr(p, "rowwise_data")
            payloads.append(_storage_view(p if storage is None else storage, (rows, columns), dtype=torch.bfloat16,
                                          name="split BF16 rowwise"))
        return functional.SplitRoutedWeight(data=payloads[0],
                                            storage_table=ops.make_routed_weight_storage_table_bf16(payloads))
    storage = _split_mxfp8_storage(params, rows, columns)
    if cached_view is not None:
        row_out, col_out = cached_view.scale_tensors, cached_view.transposed_scale_tensors
        if row_out is None or col_out is None or len(row_out) != len(params) or len(col_out) != len(params):
            raise RuntimeError(f"MoK split MXFP8 refresh: the cached view does not hold {len(params)} row-wise and "
                               "column-wise scale tensors")
        for (_, _, row_scale, col_scale), r, c in zip(storage, row_out, col_out):
            _swizzle_mxfp8_scale(row_scale.unsqueeze(0), rows=rows, columns=columns, out=r)
            _swizzle_mxfp8_scale(col_scale.transpose(0, 1).unsqueeze(0), rows=columns, columns=rows, out=c)
        return cached_view
    # each expert's scales stay a separate allocation, as TE's are; the tables select the expert
    row_scales = tuple(_swizzle_mxfp8_scale(s[2].unsqueeze(0), rows=rows, columns=columns) for s in storage)
    col_scales = tuple(_swizzle_mxfp8_scale(s[3].transpose(0, 1).unsqueeze(0), rows=columns, columns=rows)
                       for s in storage)
    row_data, col_data = [s[0] for s in storage], [s[1] for s in storage]
    return functional.SplitRoutedWeight(
        data=row_data[0],
        storage_table=ops.make_routed_weight_storage_table_mxfp8(row_data),
        scale=row_scales[0],
        scale_storage_table=ops.make_routed_scale_storage_table(list(row_scales)),
        scale_tensors=row_scales,
        transposed_data=col_data[0],
        transposed_scale=col_scales[0],
        transposed_storage_table=ops.make_routed_weight_storage_table_mxfp8(col_data),
        transposed_scale_storage_table=ops.make_routed_scale_storage_table(list(col_scales)),
        transposed_scale_tensors=col_scales,
        native_columnwise=True,
    )


def split_main_grad_tables(fc1_grads, fc2_grads):
    """(fc1_table, fc2_table) for split per-expert main-grads: MoK's descriptor tables when its
    functional is in use, else the E tensors themselves (this project's table form)."""
    if uses_project_functional():
        return tuple(fc1_grads), tuple(fc2_grads)
    ops = mok_ops()
    return (ops.make_routed_d_weight_storage_table(list(fc1_grads)),
            ops.make_routed_d_weight_storage_table(list(fc2_grads)))
