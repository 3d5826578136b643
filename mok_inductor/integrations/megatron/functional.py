"""The MoK functional ABI (docs/megatron.md), with the argument order of Mixture-of-Kittens.

A bridge written for the public `mok.functional` module (Megatron-Core's `megakernel/mok` backend)
runs on this module unchanged:

    ws  = get_workspace(config, group, device=..., num_local_tokens=T, hidden_size=H, topk=K)
    sch = build_schedule(ws, config, top_experts_TK, num_local_experts=E)
    y_TH, fctx = forward(config, ws, sch, x_TH, router_weights_TK, shared_gate, shared_up, shared_down,
                         routed_gate, routed_up, routed_down, swiglu_limit=None,
                         shared_output_gate_weight=None)
    (d_x, d_router_weights, d_routed_gate, d_routed_up, d_routed_down, d_shared_gate, d_shared_up,
     d_shared_down, d_shared_output_gate) = backward(config, ws, sch, fctx, dy_TH, x_TH, ...,
                         main_grads=None, main_grad_storage_tables=None, ...)

Everything here validates arguments (metadata only; `TypeError`/`ValueError` naming the argument,
raised before anything is written to a caller's buffer), maps MoK's layouts onto the operands of
the one implementation, and calls it: `mok_inductor.ops.forward` / `backward` (the Triton kernels on
CUDA, the reference on the CPU, as `mok_inductor.options` says). No math lives in this file.

Routed weight layouts (gate, up: [E, I, H]; down: [E, H, I]):
- dense: a 3-D tensor (strided views are fine);
- split: `SplitRoutedWeight` in MoK's form (one representative expert tensor plus a storage table from
  `make_routed_weight_storage_table_bf16` / `_mxfp8`, the role MoK's `mok.ops` builders have), or in the
  project's (the sequence of E tensors in `data`), or a plain sequence of E 2-D tensors (Megatron's
  per-expert allocations);
- combined FC1: the SAME object passed as `routed_gate` and `routed_up`, covering [E, 2I, H] (or E
  tensors [2I, H]); the gate is rows [0, I) and up rows [I, 2I) of each expert, taken as zero-copy
  views. The shared expert accepts the same aliasing ([2Is, H] passed twice).
- MXFP8: MoK's (data, scale) tuples for a combined FC1 and the down weight (see `_mxfp8_routed`), or
  split per expert as `SplitRoutedWeight`s with scales (and column-wise pairs for backward); forward reads
  the row-wise pairs, backward the column-wise ones for dgrad. Scales come in MoK's swizzled layout
  [E*M/128, K/128, 32, 16] (per expert [M/128, K/128, 32, 16]) or the logical [E, M, K/32]
  (`mok_inductor.mxfp8.swizzle_scale` / `unswizzle_scale`); the results are the same bit for bit.

Gradient destinations (`backward`): `main_grads` = six buffers in MoK's order (shared_gate, routed_gate,
shared_up, routed_up, shared_down, routed_down), float32 or bfloat16; weight gradients are ADDED
into them and the returned weight gradients are those very objects. Routed entries are 3-D tensors
or sequences of E tensors; aliasing routed_gate/routed_up entries (one combined buffer) get the same
row offsets as the weights. With split per-expert buffers, `main_grad_storage_tables` =
(gate_table, up_table, down_table), each from `make_routed_d_weight_storage_table` (or any sequence of E
tensors; gate_table is up_table for a combined FC1 buffer); the routed entries of `main_grads` are then
representatives, returned as is. MoK's descriptor tensors are refused with a TypeError naming the builder.

One device: `group=None` (or a process group of size 1). Expert parallelism: a workspace of a larger
group makes `build_schedule` plan the dispatch (global expert ids; one host synchronisation, the
exchange of the per-rank row counts) and `forward` / `backward` exchange the rows with
torch.distributed and run the same implementation on the received rows (`mok_inductor.distributed`,
docs/distributed.md). The routed weights are then the rank's local experts.

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E local experts,
K routes per token, N = T*K.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch

from ... import _checks, distributed, ops
from ...types import BackwardResult, GradBuffers, Operand, RoutedOperands, Schedule, split_gate_up

__all__ = [
    "MoKConfig",
    "MoKWorkspace",
    "MoKSchedule",
    "MoKForwardContext",
    "SplitRoutedWeight",
    "make_routed_weight_storage_table_bf16",
    "make_routed_weight_storage_table_mxfp8",
    "make_routed_scale_storage_table",
    "make_routed_d_weight_storage_table",
    "get_workspace",
    "build_schedule",
    "forward",
    "backward",
]

_MAIN_GRAD_NAMES = ("shared_gate", "routed_gate", "shared_up", "routed_up", "shared_down", "routed_down")


# ---------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True, slots=True)
class MoKConfig:
    """MoK's launch configuration, with MoK's field names and defaults.

    All six fields are validated as MoK validates them, and all six are IGNORED, on one device
    (group=None) and with expert parallelism too (whose exchanges are plain all_to_all_singles sized by
    the exchanged counts, docs/distributed.md):
    - fwd_num_comm_sms / bwd_num_comm_sms: SMs MoK reserves for expert-parallel communication
      (positive, even). There is no communication on one device.
    - minibatch_size / macrobatch_size: MoK's token pipelining granularity (minibatch a multiple of
      256, macrobatch a multiple of minibatch). The kernels here tile by their own configs.
    - schedule_capacity_multiplier: sizes MoK's expert-parallel receive capacity (positive). On one
      device the schedule holds exactly T*K routes.
    - all_gather_top_experts_chunk_bytes: chunking of the expert-parallel all-gather of top_experts
      (a positive multiple of 16).
    """

    fwd_num_comm_sms: int = 40
    bwd_num_comm_sms: int = 28
    minibatch_size: int = 4096
    macrobatch_size: int = 131072
    schedule_capacity_multiplier: float = 0.5
    all_gather_top_experts_chunk_bytes: int = 2048

    def __post_init__(self):
        def require_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"MoKConfig.{name}: expected an int, got {type(v).__name__}")
            if v <= 0:
                raise ValueError(f"MoKConfig.{name}: expected a positive int, got {v}")
            return v

        for name in ("fwd_num_comm_sms", "bwd_num_comm_sms"):
            if require_int(name) % 2 != 0:
                raise ValueError(f"MoKConfig.{name}: expected an even number of SMs, got {getattr(self, name)}")
        if require_int("minibatch_size") % 256 != 0:
            raise ValueError(f"MoKConfig.minibatch_size: expected a multiple of 256, got {self.minibatch_size}")
        if require_int("macrobatch_size") % self.minibatch_size != 0:
            raise ValueError(
                f"MoKConfig.macrobatch_size: expected a multiple of minibatch_size ({self.minibatch_size}), "
                f"got {self.macrobatch_size}"
            )
        mult = self.schedule_capacity_multiplier
        if isinstance(mult, bool) or not isinstance(mult, (int, float)):
            raise TypeError(f"MoKConfig.schedule_capacity_multiplier: expected a float, got {type(mult).__name__}")
        if not (mult > 0 and math.isfinite(mult)):
            raise ValueError(f"MoKConfig.schedule_capacity_multiplier: expected a finite positive float, got {mult}")
        if require_int("all_gather_top_experts_chunk_bytes") % 16 != 0:
            raise ValueError(
                "MoKConfig.all_gather_top_experts_chunk_bytes: expected a multiple of 16, got "
                f"{self.all_gather_top_experts_chunk_bytes}"
            )


def _require_config(config) -> None:
    if not isinstance(config, MoKConfig):
        raise TypeError(f"config: expected a mok_inductor.functional.MoKConfig, got {type(config).__name__}")


# ---------------------------------------------------------------------------------------------
# Workspace


@dataclasses.dataclass(frozen=True, eq=False)
class MoKWorkspace:
    """Per-shape scratch state. On one device the implementation allocates its own buffers, so the
    workspace only records the shape and device every call on it must match (MoK's rule: all layers of
    one shape share one workspace, and several forward contexts may be alive over it at once)."""

    device: torch.device
    num_local_tokens: int  # T
    hidden_size: int  # H
    topk: int  # K
    ep_size: int = 1
    # the expert-parallel process group (None on one device), held weakly: a cached workspace must not
    # keep a group alive past destroy_process_group (its gloo threads would outlive the interpreter)
    group_ref: Any = None

    @property
    def group(self):
        """The expert-parallel process group (None on one device); RuntimeError once it was freed."""
        if self.group_ref is None:
            return None
        group = self.group_ref()
        if group is None:
            raise RuntimeError("workspace: its expert-parallel process group no longer exists (destroyed); "
                               "get a new workspace for the new group")
        return group


def _normalize_device(device) -> torch.device:
    if device is None:
        raise ValueError("device: expected a torch.device (the device of x), got None")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"device: expected a torch.device, got {device!r}") from exc
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@functools.lru_cache(maxsize=256)
def _one_device_workspace(device: torch.device, T: int, H: int, K: int) -> MoKWorkspace:
    return MoKWorkspace(device, T, H, K)


# expert-parallel workspaces, per group (weakly: they go with their group)
_EP_WORKSPACES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _cached_workspace(device: torch.device, T: int, H: int, K: int, group=None, ep_size: int = 1) -> MoKWorkspace:
    if group is None:
        return _one_device_workspace(device, T, H, K)
    per_group = _EP_WORKSPACES.setdefault(group, {})
    key = (device, T, H, K, ep_size)
    if key not in per_group:
        if len(per_group) >= 256:  # the one-device cache's bound: the oldest shape goes
            per_group.pop(next(iter(per_group)))
        per_group[key] = MoKWorkspace(device, T, H, K, ep_size, weakref.ref(group))
    return per_group[key]


def get_workspace(config: MoKConfig, group, *, device, num_local_tokens: int, hidden_size: int,
                  topk: int) -> MoKWorkspace:
    """The workspace for [T, H] tokens with K routes each on `device`, cached per (device, T, H, K).

    `group=None` (or a process group of size 1) means one device and no expert parallelism. A larger
    group is recorded: schedules, forwards and backwards on this workspace are expert-parallel over it
    (collective calls: every rank of the group makes them, in the same order).
    """
    _require_config(config)
    size = 1
    if group is not None:
        size = distributed.group_size(group)
    ep_group = group if size > 1 else None
    for name, value, lo in (("num_local_tokens", num_local_tokens, 0), ("hidden_size", hidden_size, 1),
                            ("topk", topk, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {value}")
    _checks.check_sizes(num_local_tokens, hidden_size, topk)  # (T*K routes within the int32 schedule)
    return _cached_workspace(_normalize_device(device), num_local_tokens, hidden_size, topk, ep_group, size)


def _require_workspace(workspace) -> MoKWorkspace:
    if not isinstance(workspace, MoKWorkspace):
        raise TypeError(f"workspace: expected the MoKWorkspace of get_workspace(), got {type(workspace).__name__}")
    return workspace


# ---------------------------------------------------------------------------------------------
# Schedule


class MoKSchedule(NamedTuple):
    """The expert schedule of one batch of routes; every tensor lives on the device (built without a
    host synchronisation).

    sorted_routes: int32 [N], the flat route t*K+k of each sorted slot (ascending expert, then route;
        `-1` routes last).
    expert_offsets: int32 [E+1], expert e owns sorted slots [offsets[e], offsets[e+1]).
    route_slots: int32 [N], the inverse permutation.
    tokens_per_expert: int32 [E], routes per local expert.
    padded_expert_offsets: int32 [E+1], the row offsets with each expert padded to a multiple of
        `expert_padding` (MoK's row layout; the implementation here computes unpadded).
    top_experts: the [T, K] expert ids the schedule was built from.
    ep: with expert parallelism, the `mok_inductor.distributed.EPPlan` (the dispatch); the fields
        above then describe the local experts' schedule over the rows this rank RECEIVES.
    """

    sorted_routes: torch.Tensor
    expert_offsets: torch.Tensor
    route_slots: torch.Tensor
    tokens_per_expert: torch.Tensor
    padded_expert_offsets: torch.Tensor
    top_experts: torch.Tensor
    num_local_experts: int
    expert_padding: int
    ep: Any = None

    def as_schedule(self) -> Schedule:
        """The core `types.Schedule` of this schedule (the ops' argument)."""
        return Schedule(self.sorted_routes, self.expert_offsets, self.route_slots)


def build_schedule(workspace: MoKWorkspace, config: MoKConfig, top_experts: torch.Tensor, *,
                   num_local_experts: int, expert_padding: int = 256) -> MoKSchedule:
    """Sort the routes of `top_experts` [T, K] (int32/int64; values in [-1, E), -1 = no route) by
    expert with `torch.ops.mok.schedule`. Values out of range raise eagerly on the CPU and trip a
    device-side assert on CUDA.

    With an expert-parallel workspace, `top_experts` holds global ids in [-1, W * num_local_experts) and
    this is a collective: it exchanges the per-rank row counts (one host synchronisation; ids out of
    range on any rank then raise ValueError on every rank) and the rows' local ids, and sorts the
    received routes by local expert."""
    ws = _require_workspace(workspace)
    _require_config(config)
    for name, value in (("num_local_experts", num_local_experts), ("expert_padding", expert_padding)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value}")
    _checks.require_tensor("top_experts", top_experts)
    _checks.require_dtype("top_experts", top_experts, _checks.INDEX_DTYPES)
    _checks.require_shape("top_experts", top_experts, (ws.num_local_tokens, ws.topk),
                          "[T, K] (the workspace's num_local_tokens and topk)")
    if top_experts.device != ws.device:
        raise ValueError(
            f"top_experts: expected a tensor on {ws.device} (the workspace's device), got {top_experts.device}"
        )
    ep = None
    if ws.ep_size > 1:
        ep = distributed.plan(top_experts, num_local_experts, ws.group, hidden_size=ws.hidden_size, dtype=None)
        sorted_routes, offsets, slots = ep.schedule_R
    else:
        sorted_routes, offsets, slots = torch.ops.mok.schedule(top_experts, num_local_experts)
    counts = offsets[1:] - offsets[:-1]
    padded = torch.zeros_like(offsets)
    padded[1:] = torch.cumsum((counts + (expert_padding - 1)) // expert_padding * expert_padding, 0)
    return MoKSchedule(sorted_routes, offsets, slots, counts, padded, top_experts, num_local_experts, expert_padding,
                       ep)


def _require_schedule(schedule, ws: MoKWorkspace) -> MoKSchedule:
    if not isinstance(schedule, MoKSchedule):
        raise TypeError(f"schedule: expected the MoKSchedule of build_schedule(), got {type(schedule).__name__}")
    if tuple(schedule.top_experts.shape) != (ws.num_local_tokens, ws.topk):
        raise ValueError(
            f"schedule: built for top_experts of shape {list(schedule.top_experts.shape)}, but the workspace is "
            f"for [T, K] = [{ws.num_local_tokens}, {ws.topk}]"
        )
    if (schedule.ep is not None) != (ws.ep_size > 1):
        raise ValueError(
            f"schedule: built for {'an expert-parallel' if schedule.ep is not None else 'a one-device'} workspace, "
            f"but this workspace has ep_size={ws.ep_size}"
        )
    return schedule


# ---------------------------------------------------------------------------------------------
# Weight operands


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class SplitRoutedWeight:
    """One routed weight [E, M, K] held as E independent per-expert allocations (Megatron's `weight0` ...
    `weight{E-1}`), read in place, never stacked. MoK's dataclass: MoK's field names, order and defaults.

    MoK's form (what Megatron's MoK bridge builds): `data` is ONE representative expert tensor [M, K] (for
    dtype, shape and device) and `storage_table` the table of all E experts, from
    `make_routed_weight_storage_table_bf16` / `make_routed_weight_storage_table_mxfp8`. Here a table is a
    tuple of the E tensors; MoK's compiled descriptor tensors (`mok.ops`) cannot be read, and are refused
    with a TypeError that names the builder to use instead. MXFP8 adds:
    - `scale` (representative) and `scale_storage_table` (`make_routed_scale_storage_table` of the E
      row-wise scales, each MoK's swizzled [M/128, K/128, 32, 16] or logical [M, K/32]); `scale_tensors`
      owns the scales in MoK and is not read here;
    - for the backward's dgrad, the column-wise `transposed_data` / `transposed_storage_table` (E [K, M], or
      with `native_columnwise=True` Transformer Engine's column-wise storage E [M, K]) and
      `transposed_scale` / `transposed_scale_storage_table` (swizzled from the logical [K, M/32] in either
      case, or logical: [K, M/32], and [M/32, K] when native); `transposed_scale_tensors` is not read.

    The project's form (a convenience): `storage_table` None and `data` the sequence of the E tensors
    themselves; `scale`, `transposed_data` and `transposed_scale` are then sequences of E as well, and the
    other table fields None. E.g. `SplitRoutedWeight(tuple(weights))`, or `of_mxfp8` of E quantized
    experts.

    A combined FC1 ([2I, H] per expert) is one object passed as routed_gate and routed_up. Split main-grad
    buffers go to `backward` as tables from `make_routed_d_weight_storage_table`.
    """

    data: Any
    storage_table: Any = None
    scale: Any = None
    scale_storage_table: Any = None
    scale_tensors: Optional[Tuple[torch.Tensor, ...]] = None
    transposed_data: Any = None
    transposed_scale: Any = None
    transposed_storage_table: Any = None
    transposed_scale_storage_table: Any = None
    transposed_scale_tensors: Optional[Tuple[torch.Tensor, ...]] = None
    native_columnwise: bool = False

    def _replace(self, **changes) -> "SplitRoutedWeight":
        """A copy with `changes` (`dataclasses.replace`, by the name the former NamedTuple had)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of_mxfp8(cls, weights) -> "SplitRoutedWeight":
        """The project's form of E per-expert `mxfp8.MXFP8Weight`s (2-D each; column-wise pairs when present)."""
        from ... import mxfp8

        weights = tuple(weights)
        if not weights or not all(isinstance(q, mxfp8.MXFP8Weight) for q in weights):
            raise TypeError("weights: expected a non-empty sequence of mok_inductor.mxfp8.MXFP8Weight")
        cols = all(q.data_t is not None for q in weights)
        return cls(data=tuple(q.data for q in weights), scale=tuple(q.scale for q in weights),
                   transposed_data=tuple(q.data_t for q in weights) if cols else None,
                   transposed_scale=tuple(q.scale_t for q in weights) if cols else None)


# ---------------------------------------------------------------------------------------------
# Storage tables: the role of MoK's `mok.ops.make_routed_*_storage_table`, for this implementation. MoK
# encodes one TMA descriptor per expert in a device tensor; the kernels here take per-expert tensors as
# they are (they build their own address tables), so a table is the tuple of the E tensors, validated
# once when it is built: every expert of one shape, dtype and device, 2-D.


def _storage_table(what: str, tensors, dtypes, dims=(2,)) -> Tuple[torch.Tensor, ...]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (tuple, list)) or not tensors:
        raise TypeError(f"{what}: expected a non-empty sequence of per-expert tensors, got {type(tensors).__name__}")
    first = tensors[0]
    for e, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{e}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            raise TypeError(f"{what}[{e}]: expected dtype {_checks._fmt_dtypes(dtypes)}, got "
                            f"{str(t.dtype).replace('torch.', '')}")
        if t.dim() not in dims:
            raise ValueError(f"{what}[{e}]: expected a {' or '.join(f'{d}-D' for d in dims)} tensor, got shape "
                             f"{list(t.shape)}")
        if e and (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device):
            raise ValueError(f"{what}[{e}]: expected every expert like [0] ({_describe(first)}), got {_describe(t)}")
    return tuple(tensors)


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"


def make_routed_weight_storage_table_bf16(weights) -> Tuple[torch.Tensor, ...]:
    """The storage table of E per-expert float weights [M, K] (bfloat16 as in MoK; float16 and float32
    too): the tuple of the tensors, for `SplitRoutedWeight.storage_table`."""
    return _storage_table("weights", weights, _checks.FLOAT_DTYPES)


def make_routed_weight_storage_table_mxfp8(weights) -> Tuple[torch.Tensor, ...]:
    """The storage table of E per-expert MXFP8 data tensors [M, K] float8_e4m3fn (row-wise, or column-wise
    for `transposed_storage_table`)."""
    return _storage_table("weights", weights, (torch.float8_e4m3fn,))


def make_routed_scale_storage_table(scales) -> Tuple[torch.Tensor, ...]:
    """The storage table of E per-expert MXFP8 scales (uint8; MoK's swizzled [M/128, K/128, 32, 16] or
    logical 2-D), for `scale_storage_table` / `transposed_scale_storage_table`."""
    return _storage_table("scales", scales, (torch.uint8,), dims=(2, 4))


def make_routed_d_weight_storage_table(main_grads) -> Tuple[torch.Tensor, ...]:
    """The storage table of E per-expert main-grad buffers (float32 or bfloat16, 2-D), one entry of
    `backward`'s `main_grad_storage_tables`."""
    return _storage_table("main_grads", main_grads, _checks.MAIN_GRAD_DTYPES)


def _is_split(obj) -> bool:
    """A SplitRoutedWeight, or an object with MoK's field names (e.g. `mok.functional`'s own dataclass)."""
    if isinstance(obj, SplitRoutedWeight):
        return True
    return not isinstance(obj, (torch.Tensor, tuple, list)) and all(
        hasattr(obj, f) for f in ("data", "storage_table", "native_columnwise"))


def _read_table(name: str, table) -> Tuple[torch.Tensor, ...]:
    builder = {"storage_table": "make_routed_weight_storage_table_bf16 / _mxfp8",
               "transposed_storage_table": "make_routed_weight_storage_table_mxfp8"}.get(
                   name.rsplit(".", 1)[-1], "make_routed_scale_storage_table")
    if isinstance(table, torch.Tensor):
        raise TypeError(
            f"{name}: got a tensor, which would be a descriptor table of MoK's compiled mok.ops; this "
            f"implementation reads per-expert tensors: build the table with mok_inductor.functional.{builder} "
            "(the tuple of the E tensors)")
    if not isinstance(table, (tuple, list)) or not table:
        raise TypeError(f"{name}: expected a table from mok_inductor.functional.{builder} (a non-empty tuple "
                        f"of per-expert tensors), got {type(table).__name__}")
    for e, t in enumerate(table):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{e}]: expected a torch.Tensor, got {type(t).__name__}")
    return tuple(table)


def _representative(name: str, field: str, rep, table, table_field: str) -> None:
    if not isinstance(rep, torch.Tensor):
        raise TypeError(f"{name}: SplitRoutedWeight.{field}: expected one representative expert tensor (MoK's "
                        f"form, with {table_field}), got {type(rep).__name__}")
    first = table[0]
    if rep.shape != first.shape or rep.dtype != first.dtype or rep.device != first.device:
        raise ValueError(f"{name}: SplitRoutedWeight.{field} (the representative expert) is {_describe(rep)}, "
                         f"but {table_field}[0] is {_describe(first)}")


def _per_expert(name: str, w) -> SplitRoutedWeight:
    """`w` (MoK's form, the project's, or an object with MoK's field names) in the project's form, the one
    the rest of this module reads: per-expert sequences in data, scale, transposed_data, transposed_scale."""
    field = lambda f: getattr(w, f, None)  # noqa: E731
    if field("storage_table") is None:
        if isinstance(field("data"), torch.Tensor):
            raise ValueError(f"{name}: SplitRoutedWeight.storage_table is required when data is one representative "
                             "tensor (MoK's form): build it with make_routed_weight_storage_table_bf16 / _mxfp8")
        extra = [f for f in ("scale_storage_table", "transposed_storage_table", "transposed_scale_storage_table")
                 if field(f) is not None]
        if extra:
            raise ValueError(f"{name}: SplitRoutedWeight.{extra[0]} is given without storage_table (MoK's form has "
                             "all tables; the project's form, per-expert sequences, none)")
        if isinstance(w, SplitRoutedWeight):
            return w
        return SplitRoutedWeight(data=field("data"), scale=field("scale"), transposed_data=field("transposed_data"),
                                 transposed_scale=field("transposed_scale"),
                                 native_columnwise=bool(field("native_columnwise")))

    data = _read_table(f"{name}: SplitRoutedWeight.storage_table", w.storage_table)
    _representative(name, "data", field("data"), data, "storage_table")
    scale = None
    if field("scale") is not None or field("scale_storage_table") is not None:
        if field("scale_storage_table") is None:
            raise ValueError(f"{name}: a split MXFP8 weight in MoK's form needs SplitRoutedWeight.scale_storage_table "
                             "(make_routed_scale_storage_table of its E per-expert scales)")
        scale = _read_table(f"{name}: SplitRoutedWeight.scale_storage_table", w.scale_storage_table)
        if field("scale") is None:
            raise ValueError(f"{name}: SplitRoutedWeight.scale_storage_table is given without the representative "
                             "scale (SplitRoutedWeight.scale)")
        _representative(name, "scale", field("scale"), scale, "scale_storage_table")
    col = [field(f) for f in ("transposed_storage_table", "transposed_scale_storage_table")]
    if (col[0] is None) != (col[1] is None):
        raise ValueError(f"{name}: SplitRoutedWeight.transposed_storage_table and transposed_scale_storage_table "
                         "must be given together (the column-wise MXFP8 data and its scales)")
    data_t = scale_t = None
    if col[0] is not None:
        data_t = _read_table(f"{name}: SplitRoutedWeight.transposed_storage_table", col[0])
        scale_t = _read_table(f"{name}: SplitRoutedWeight.transposed_scale_storage_table", col[1])
        for rep_field, table, table_field in (("transposed_data", data_t, "transposed_storage_table"),
                                              ("transposed_scale", scale_t, "transposed_scale_storage_table")):
            if field(rep_field) is not None:
                _representative(name, rep_field, field(rep_field), table, table_field)
    elif field("transposed_data") is not None or field("transposed_scale") is not None:
        raise ValueError(f"{name}: SplitRoutedWeight.transposed_data is given without transposed_storage_table "
                         "(MoK's form reads the column-wise experts from the tables)")
    return SplitRoutedWeight(data=data, scale=scale, transposed_data=data_t, transposed_scale=scale_t,
                             native_columnwise=bool(field("native_columnwise")))


def _canonical_routed(routed_gate, routed_up, routed_down):
    """The three routed arguments with every split weight in the project's form; one object passed twice
    (a combined FC1) stays one object."""
    done = {}
    out = []
    for name, arg in zip(("routed_gate", "routed_up", "routed_down"), (routed_gate, routed_up, routed_down)):
        if _is_split(arg):
            if id(arg) not in done:
                done[id(arg)] = _per_expert(name, arg)
            arg = done[id(arg)]
        out.append(arg)
    return tuple(out)


def _is_mxfp8_piece(v) -> bool:
    if isinstance(v, bool):
        return True
    return isinstance(v, torch.Tensor) and (v.dtype in (torch.uint8, torch.int8) or "float8" in str(v.dtype))


def _mxfp8_error(name: str) -> TypeError:
    return TypeError(
        f"{name}: MXFP8 is accepted only for the routed experts, as (data, scale) tuples of a combined FC1 and "
        "the down weight (not bare float8 tensors, not the shared expert, which is bf16 as in MoK); pass "
        "bfloat16, float16 or float32 tensors"
    )


# MXFP8 routed weights (MoK's layouts). Forward: (data, scale) per weight, [E, M, K] float8_e4m3fn and
# uint8 E8M0 scales, either logical [E, M, K/32] or MoK's swizzled [E*M/128, K/128, 32, 16] (told apart by
# their dims: 3 or 4; mok_inductor.mxfp8 describes the layout). Backward: gate/up as (data, scale, data_t,
# scale_t) or TE's native (data, scale, col_data [E, M, K], col_scale, True); down as its column-wise pair
# (data_t [E, K, M], scale_t), (col_data, col_scale, True) native, or a 4- or 5-tuple (its column-wise half
# is read). Column-wise scales are logical [E, K, M/32] (TE's [E, M/32, K] when native) or swizzled from the
# logical [E, K, M/32] in both cases. A combined FC1 is the same tuple passed as routed_gate and routed_up. An
# MXFP8Weight (mok_inductor.mxfp8.quantize) is accepted wherever a tuple is.
#
# Swizzled scales are de-swizzled on every call (a copy of the scale bytes, 1/32 of the data's), never
# cached: MoK's bridge refreshes them in place at a fixed address (and a CUDA graph replays that refresh),
# so no pointer or version counter tells a stale copy from a fresh one.


def _is_mxfp8_tuple(v) -> bool:
    return (isinstance(v, tuple) and len(v) >= 2
            and isinstance(v[0], torch.Tensor) and v[0].dtype == torch.float8_e4m3fn)


def _check_mx_tuple(name: str, t: tuple, *, column_only: bool) -> None:
    """Raise unless the MXFP8 tuple `t` is one of MoK's forms: (data, scale), (data, scale, data_t, scale_t),
    (data, scale, col_data, col_scale, True) (Transformer Engine's column-wise storage flagged), and, where only
    the column-wise pair is read (`column_only`: the backward's down), (col_data, col_scale, True). Nothing else
    is ignored silently: an extra or misplaced entry is an error."""
    n = len(t)
    flagged = n in (3, 5) and t[-1] is True
    tensors = t[:-1] if flagged else t
    if (n in (2, 4) or (flagged and (n == 5 or column_only))) and all(isinstance(v, torch.Tensor) for v in tensors):
        return
    forms = ["(data, scale)", "(data, scale, data_t, scale_t)", "(data, scale, col_data, col_scale, True)"]
    if column_only:
        forms = ["(data_t, scale_t)", *forms, "(col_data, col_scale, True)"]
    kinds = ", ".join("True" if v is True else type(v).__name__ for v in t)
    raise ValueError(f"{name}: expected an MXFP8 tuple {', '.join(forms[:-1])} or {forms[-1]}, got a {n}-tuple "
                     f"({kinds})")


def _logical_scale(name: str, data, scale):
    """`scale` of the MXFP8 data `data` [..., M, K] as logical [..., M, K/32] scales: MoK's swizzled layout is
    de-swizzled (a copy); anything else is returned as given, for `mxfp8.check_weight` to validate."""
    from ... import mxfp8

    if not (mxfp8.is_swizzled_scale(scale) and isinstance(data, torch.Tensor) and data.dim() >= 2
            and data.shape[-1] % mxfp8.BLOCK == 0):
        return scale
    *lead, m, k = data.shape
    if scale.device != data.device:
        raise ValueError(f"{name}: expected MXFP8 scales on {data.device} (the device of its data), got {scale.device}")
    return mxfp8.unswizzle_scale(scale, (*lead, m, k // mxfp8.BLOCK), name=name)


def _logical_scales(name: str, data, scales):
    """`_logical_scale` per expert of a split weight (sequences of E); left as given when not two sequences
    of one length (`mxfp8.check_split_weight` names what is wrong)."""
    if not (isinstance(data, (tuple, list)) and isinstance(scales, (tuple, list)) and len(data) == len(scales)):
        return scales
    return tuple(_logical_scale(f"{name}[{e}]", d, sc) for e, (d, sc) in enumerate(zip(data, scales)))


def _mx_native_col(name: str, data, scale):
    """TE's native column-wise pair (data [E, M, K] or E pieces [M, K]; scales TE's [E, M/32, K], or swizzled
    from the logical [E, K, M/32]) as (data_t, scale_t): views, the swizzled scales de-swizzled."""
    from ... import mxfp8
    from ...types import transposed_payload as _transposed

    if isinstance(data, (tuple, list)) and isinstance(scale, (tuple, list)) and len(data) == len(scale):
        pairs = [_mx_native_col(f"{name}[{e}]", d, sc) for e, (d, sc) in enumerate(zip(data, scale))]
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    data_t = _transposed(data)
    if mxfp8.is_swizzled_scale(scale):
        return data_t, _logical_scale(name, data_t, scale)
    return data_t, _transposed(scale)


def _is_split_mxfp8(v) -> bool:
    return isinstance(v, SplitRoutedWeight) and (
        v.scale is not None or (isinstance(v.data, (tuple, list)) and any(_is_mxfp8_piece(t) for t in v.data)))


def _split_columnwise(name: str, w: SplitRoutedWeight):
    """(data_t, scale_t) sequences of a split MXFP8 weight for the backward's dgrad ([K, M], [K, M/32] each)."""
    if w.transposed_data is None or w.transposed_scale is None:
        raise ValueError(f"{name}: the backward needs the column-wise MXFP8 data of the split weight "
                         "(SplitRoutedWeight.transposed_data and transposed_scale)")
    for field in ("transposed_data", "transposed_scale"):
        seq = getattr(w, field)
        if not isinstance(seq, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in seq):
            raise TypeError(f"{name}: SplitRoutedWeight.{field} must be a sequence of E tensors")
    if w.native_columnwise:  # Transformer Engine's [M, K] data (and [M/32, K] logical scales), as transposed views
        return _mx_native_col(f"{name} (column-wise)", tuple(w.transposed_data), tuple(w.transposed_scale))
    return tuple(w.transposed_data), _logical_scales(f"{name} (column-wise)", w.transposed_data, w.transposed_scale)


def _mxfp8_routed(x, routed_gate, routed_up, routed_down, *, backward: bool):
    """(RoutedOperands, stand-ins for the three routed arguments) when they are MXFP8 (tuples or split
    `SplitRoutedWeight`s), else (None, the arguments). The stand-ins are x-dtype zero-stride tensors of the
    logical weight shapes (E of them for a split weight; aliasing kept for a combined FC1), so the common
    checks and buffer logic apply unchanged."""
    from ... import mxfp8

    args = (routed_gate, routed_up, routed_down)
    if isinstance(routed_gate, mxfp8.MXFP8Weight) or isinstance(routed_down, mxfp8.MXFP8Weight):
        # (its pairs as MoK's tuple: the row-wise one alone where quantized without the column-wise layout)
        args = tuple((a[:2] if a.data_t is None else a[:4]) if isinstance(a, mxfp8.MXFP8Weight) else a for a in args)
        if routed_gate is routed_up:
            args = (args[0], args[0], args[2])
    gate, up, down = args
    kinds = [_is_mxfp8_tuple(a) or _is_split_mxfp8(a) for a in args]
    if not any(kinds):
        return None, args
    if not all(kinds):
        bad = ("routed_gate", "routed_up", "routed_down")[kinds.index(False)]
        raise TypeError(f"{bad}: expected an MXFP8 weight (a (data, scale) tuple or a SplitRoutedWeight with "
                        "scales), as the other routed weights")
    if gate is not up:
        raise TypeError("routed_gate: MXFP8 routed weights are supported as a combined FC1 (the same (data, scale) "
                        "tuple or SplitRoutedWeight passed as routed_gate and routed_up)")
    for name, t in (("routed_gate", gate), ("routed_down", down)):
        if isinstance(t, tuple):
            _check_mx_tuple(name, t, column_only=backward and name == "routed_down")

    def split_parts(name, w):
        """(data, scale, data_t, scale_t) sequences of a split weight, validated (column-wise: backward only)."""
        if not isinstance(w.data, (tuple, list)) or not w.data:
            raise TypeError(f"{name}: SplitRoutedWeight.data must be a non-empty sequence of 2-D tensors")
        dt = st = None
        if backward:
            dt, st = _split_columnwise(name, w)
        scale = _logical_scales(name, w.data, w.scale)
        mxfp8.check_split_weight(name, w.data, scale, dt, st, x.dtype, x.device, split_rows=name == "routed_gate")
        return tuple(w.data), tuple(scale), dt, st

    def piece(p):  # a payload's first expert matrix (3-D: its [M, K] shape is the trailing dims anyway)
        return p if isinstance(p, torch.Tensor) else p[0]

    def gate_up_parts(t):
        if isinstance(t, SplitRoutedWeight):
            return split_parts("routed_gate", t)
        row = (t[0], _logical_scale("routed_gate", t[0], t[1]))
        if not backward:
            return (*row, None, None)
        if len(t) == 5 and t[4] is True:
            return (*row, *_mx_native_col("routed_gate (column-wise)", t[2], t[3]))
        if len(t) == 4:
            return (*row, t[2], _logical_scale("routed_gate (column-wise)", t[2], t[3]))
        raise ValueError("routed_gate: the backward needs the MXFP8 gate/up as (data, scale, data_t, scale_t) or "
                         "(data, scale, col_data, col_scale, True)")

    def down_columnwise(t):
        if isinstance(t, SplitRoutedWeight):
            return split_parts("routed_down", t)[2:]
        col = "routed_down (column-wise)"
        if len(t) == 3 and t[2] is True:
            dt, st = _mx_native_col(col, t[0], t[1])
        elif len(t) == 5 and t[4] is True:  # the whole native tuple: its column-wise half
            dt, st = _mx_native_col(col, t[2], t[3])
        elif len(t) == 4:
            dt, st = t[2], _logical_scale(col, t[2], t[3])
        else:  # (data_t, scale_t): `_check_mx_tuple` let no other form through
            dt, st = t[0], _logical_scale(col, t[0], t[1])
        mxfp8.check_weight("routed_down (column-wise)", dt, st, None, None, None, x.dtype, x.device)
        return dt, st

    def standin(like, shape):
        """x-dtype zero-stride stand-ins: [E, *shape] for a 3-D payload, E x shape for a split one."""
        if isinstance(like, torch.Tensor):
            return x.new_empty(()).expand(like.shape[0], *shape)
        return tuple(x.new_empty(()).expand(*shape) for _ in like)

    gu = gate_up_parts(gate)
    if not isinstance(gate, SplitRoutedWeight):
        mxfp8.check_weight("routed_gate", *gu, None, x.dtype, x.device, split_rows=True)
    two_i, H = piece(gu[0]).shape[-2:]
    if backward:
        dt, st = down_columnwise(down)
        i, h = piece(dt).shape[-2:]  # the column-wise down is [I, H] per expert
        standin_down = standin(dt, (h, i))
        dn = (standin_down, None, None, None)
        ops_ = mxfp8.routed_operands(gu, dn)._replace(down_t=Operand(dt, st))
    else:
        if isinstance(down, SplitRoutedWeight):
            dn = split_parts("routed_down", down)
        else:
            dn = (down[0], _logical_scale("routed_down", down[0], down[1]), None, None)
            mxfp8.check_weight("routed_down", *dn, None, x.dtype, x.device)
        ops_ = mxfp8.routed_operands(gu, dn)
        standin_down = standin(dn[0], piece(dn[0]).shape[-2:])
    standin_fc1 = standin(gu[0], (two_i, H))
    return ops_, (standin_fc1, standin_fc1, standin_down)


def _payload(name: str, obj, dim: int):
    """Classify a weight argument: ("dense", tensor) or ("split", tuple of E tensors)."""
    if isinstance(obj, SplitRoutedWeight):
        obj = obj.data
        if not isinstance(obj, (tuple, list)):
            raise TypeError(
                f"{name}: SplitRoutedWeight.data must be a sequence of 2-D tensors, got {type(obj).__name__}"
            )
    if isinstance(obj, torch.Tensor):
        if _is_mxfp8_piece(obj):
            raise _mxfp8_error(name)
        if obj.dim() != dim:
            raise ValueError(f"{name}: expected a {dim}-D tensor, got shape {list(obj.shape)}")
        return "dense", obj
    if isinstance(obj, (tuple, list)):
        if any(_is_mxfp8_piece(v) for v in obj):
            raise _mxfp8_error(name)
        if len(obj) == 0:
            raise ValueError(f"{name}: expected at least one expert, got an empty sequence")
        for e, v in enumerate(obj):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{name}[{e}]: expected a torch.Tensor, got {type(v).__name__}")
            if v.dim() != dim - 1:
                raise ValueError(f"{name}[{e}]: expected a {dim - 1}-D tensor, got shape {list(v.shape)}")
        return "split", tuple(obj)
    raise TypeError(f"{name}: expected a tensor or a sequence of per-expert tensors, got {type(obj).__name__}")


def _num_experts(kind, w) -> int:
    return w.shape[0] if kind == "dense" else len(w)


def _expert_shape(kind, w, e=0) -> tuple:
    return tuple(w.shape[1:]) if kind == "dense" else tuple(w[e].shape)


def _check_payload(name, kind, w, shape, dtype, device, dtype_what="the dtype of x") -> None:
    items = [w] if kind == "dense" else list(w)
    for j, p in enumerate(items):
        label = name if kind == "dense" else f"{name}[{j}]"
        got = tuple(p.shape[1:]) if kind == "dense" else tuple(p.shape)
        if got != tuple(shape):
            raise ValueError(f"{label}: expected per-expert shape {list(shape)}, got {list(p.shape)}")
        if dtype is not None and p.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
            want = _checks._fmt_dtypes(dtype if isinstance(dtype, tuple) else (dtype,))
            raise TypeError(f"{label}: expected dtype {want} ({dtype_what}), got {str(p.dtype).replace('torch.', '')}")
        if p.device != device:
            raise ValueError(f"{label}: expected a tensor on {device} (the device of x), got one on {p.device}")


class _Operands(NamedTuple):
    gate: Any  # [E, I, H] tensor or E x [I, H]
    up: Any
    down: Any  # [E, H, I] tensor or E x [H, I]
    s_gate: Optional[torch.Tensor]
    s_up: Optional[torch.Tensor]
    s_down: Optional[torch.Tensor]
    s_out_gate: Optional[torch.Tensor]
    E: int
    I: int
    Is: int
    routed_combined: bool
    routed_kinds: Tuple[str, str, str]  # of the (gate, up, down) arguments as given
    shared_combined: bool


def _operands(x, shared_gate, shared_up, shared_down, routed_gate, routed_up, routed_down,
              shared_output_gate_weight) -> _Operands:
    dtype, device = x.dtype, x.device
    H = x.shape[1]

    # routed experts
    combined = routed_gate is routed_up
    kg, wg = _payload("routed_gate", routed_gate, 3)
    if combined:
        ku, wu = kg, wg
    else:
        ku, wu = _payload("routed_up", routed_up, 3)
    kd, wd = _payload("routed_down", routed_down, 3)
    E = _num_experts(kg, wg)
    if E < 1:
        raise ValueError("routed_gate: expected at least one expert")
    first = _expert_shape(kg, wg)
    if combined:
        if first[0] % 2 != 0:
            raise ValueError(
                f"routed_gate: passed as routed_up too (a combined FC1), so expected per-expert shape [2*I, H] with an "
                f"even first dim, got {list(first)}"
            )
        I = first[0] // 2
        _check_payload("routed_gate", kg, wg, (2 * I, H), dtype, device)
        gate, up = split_gate_up(wg)
    else:
        I = first[0]
        _check_payload("routed_gate", kg, wg, (I, H), dtype, device)
        if _num_experts(ku, wu) != E:
            raise ValueError(f"routed_up: expected {E} experts (as routed_gate), got {_num_experts(ku, wu)}")
        _check_payload("routed_up", ku, wu, (I, H), dtype, device)
        gate, up = wg, wu
    if _num_experts(kd, wd) != E:
        raise ValueError(f"routed_down: expected {E} experts (as routed_gate), got {_num_experts(kd, wd)}")
    _check_payload("routed_down", kd, wd, (H, I), dtype, device)

    # shared expert
    shared = (shared_gate, shared_up, shared_down)
    names = ("shared_gate", "shared_up", "shared_down")
    if any(s is None for s in shared):
        if not all(s is None for s in shared):
            missing = names[[s is None for s in shared].index(True)]
            raise ValueError(f"{missing}: the shared expert needs shared_gate, shared_up and shared_down (or none)")
        s_gate = s_up = s_down = None
        Is = 0
        s_combined = False
    else:
        for n, s in zip(names, shared):
            if isinstance(s, (tuple, list)):
                raise _mxfp8_error(n) if any(_is_mxfp8_piece(v) for v in s) else TypeError(
                    f"{n}: expected a 2-D tensor, got {type(s).__name__}")
            _checks.require_tensor(n, s)
            if _is_mxfp8_piece(s):
                raise _mxfp8_error(n)
            _checks.require_dtype(n, s, (dtype,))
            _checks.require_dim(n, s, 2, "[Is, H]" if n != "shared_down" else "[H, Is]")
            _checks.require_device(n, s, device)
        s_combined = shared_gate is shared_up
        if s_combined:
            if shared_gate.shape[0] % 2 != 0 or shared_gate.shape[1] != H:
                raise ValueError(
                    f"shared_gate: passed as shared_up too (a combined FC1), so expected shape [2*Is, {H}], got "
                    f"{list(shared_gate.shape)}"
                )
            Is = shared_gate.shape[0] // 2
            s_gate, s_up = split_gate_up(shared_gate)
        else:
            Is = shared_gate.shape[0]
            _checks.require_shape("shared_gate", shared_gate, (Is, H), f"[Is, H] (H = {H} of x)")
            _checks.require_shape("shared_up", shared_up, (Is, H), "[Is, H] (matching shared_gate)")
            s_gate, s_up = shared_gate, shared_up
        _checks.require_shape("shared_down", shared_down, (H, Is), "[H, Is] (matching shared_gate)")
        s_down = shared_down

    gw = shared_output_gate_weight
    if gw is not None:
        _checks.require_tensor("shared_output_gate_weight", gw)
        if s_gate is None:
            raise ValueError("shared_output_gate_weight: given without a shared expert (shared_gate is None)")
        _checks.require_dtype("shared_output_gate_weight", gw, (dtype,))
        _checks.require_device("shared_output_gate_weight", gw, device)
        _checks.require_shape("shared_output_gate_weight", gw, (1, H), "[1, H]")
        if not gw.is_contiguous():
            raise ValueError("shared_output_gate_weight: expected a contiguous [1, H] tensor")
    return _Operands(gate, up, wd, s_gate, s_up, s_down, gw, E, I, Is, combined, (kg, ku, kd), s_combined)


def _check_activations(ws: MoKWorkspace, x, router_weights):
    _checks.require_tensor("x", x)
    if _is_mxfp8_piece(x):
        raise TypeError(
            "x: expected dtype float32, bfloat16 or float16 (MXFP8 activations are not supported yet)"
        )
    _checks.require_dtype("x", x, _checks.FLOAT_DTYPES)
    _checks.require_shape("x", x, (ws.num_local_tokens, ws.hidden_size), "[T, H] (the workspace's shape)")
    if x.device != ws.device:
        raise ValueError(f"x: expected a tensor on {ws.device} (the workspace's device), got {x.device}")
    _checks.require_tensor("router_weights", router_weights)
    if not router_weights.dtype.is_floating_point:
        raise TypeError(f"router_weights: expected float32, got {str(router_weights.dtype).replace('torch.', '')}")
    _checks.require_shape("router_weights", router_weights, (ws.num_local_tokens, ws.topk),
                          "[T, K] (the workspace's shape)")
    _checks.require_device("router_weights", router_weights, x.device)


def _check_common(config, workspace, schedule, x, router_weights, weights, shared_output_gate_weight, swiglu_limit):
    _require_config(config)
    ws = _require_workspace(workspace)
    sch = _require_schedule(schedule, ws)
    _check_activations(ws, x, router_weights)
    ops_ = _operands(x, *weights, shared_output_gate_weight)
    if sch.num_local_experts != ops_.E:
        raise ValueError(
            f"routed_gate: holds {ops_.E} experts, but the schedule was built with num_local_experts="
            f"{sch.num_local_experts}"
        )
    limit = _checks.check_swiglu_limit(swiglu_limit)
    return ws, sch, ops_, limit


# ---------------------------------------------------------------------------------------------
# Forward


@dataclasses.dataclass(eq=False)
class MoKForwardContext:
    """What one forward call leaves for its backward. Several may be alive over one workspace.

    gu_N2I: [N, 2I] gate/up pre-activations [g | u] (before the clamp) in sorted-slot order (x.dtype);
    gu_shared_T2Is: [T, 2Is] (or [0, 0]). The backward recomputes h from them elementwise; the shared
    output gate is recomputed and y_tk never materialised (see mok_inductor.ops). `gated` records whether
    a shared output gate was applied.
    """

    gu_N2I: torch.Tensor
    gu_shared_T2Is: torch.Tensor
    gated: bool
    has_shared: bool
    swiglu_limit: Optional[float]
    num_tokens: int
    num_local_experts: int
    ep: Any = None  # expert parallelism: the distributed.EPForwardState (received rows, saved activations)


def forward(config: MoKConfig, workspace: MoKWorkspace, schedule: MoKSchedule, x: torch.Tensor,
            router_weights: torch.Tensor, shared_gate, shared_up, shared_down, routed_gate, routed_up,
            routed_down, swiglu_limit: Optional[float] = None,
            shared_output_gate_weight: Optional[torch.Tensor] = None):
    """The MoE forward: returns (y [T, H] in x.dtype, MoKForwardContext)."""
    routed_gate, routed_up, routed_down = _canonical_routed(routed_gate, routed_up, routed_down)
    mx, (routed_gate, routed_up, routed_down) = _mxfp8_routed(x, routed_gate, routed_up, routed_down, backward=False)
    ws, sch, w, limit = _check_common(config, workspace, schedule, x, router_weights,
                                      (shared_gate, shared_up, shared_down, routed_gate, routed_up, routed_down),
                                      shared_output_gate_weight, swiglu_limit)
    if mx is not None and ws.ep_size > 1:
        raise NotImplementedError("routed_gate: MXFP8 routed weights with expert parallelism are not supported yet")
    if ws.ep_size > 1:  # expert parallelism: dispatch, the same implementation on the received rows, combine
        y, state = distributed.forward(sch.ep, x, router_weights, w.gate, w.up, w.down, w.s_gate, w.s_up, w.s_down,
                                       w.s_out_gate, limit)
        ctx = MoKForwardContext(state.gu_N2I, state.gu_shared_T2Is, w.s_out_gate is not None, w.s_gate is not None,
                                limit, ws.num_local_tokens, w.E, state)
        return y, ctx
    operands = mx if mx is not None else RoutedOperands.of_weights(w.gate, w.up, w.down)
    res = ops.forward(x, router_weights, sch.top_experts, sch.as_schedule(), operands, w.s_gate, w.s_up, w.s_down,
                      w.s_out_gate, limit)
    ctx = MoKForwardContext(res.gu_N2I, res.gu_shared_T2Is, w.s_out_gate is not None, w.s_gate is not None, limit,
                            ws.num_local_tokens, w.E)
    return res.y_TH, ctx


# ---------------------------------------------------------------------------------------------
# Backward


def _table(name: str, obj, E: int):
    """The E per-expert main-grad tensors of one storage table: a tuple from
    `make_routed_d_weight_storage_table` (or any sequence of E tensors, or a SplitRoutedWeight of them)."""
    if _is_split(obj):
        obj = _per_expert(name, obj).data
    if isinstance(obj, torch.Tensor):
        raise TypeError(
            f"{name}: got a tensor, which would be a descriptor table of MoK's compiled mok.ops; this implementation "
            f"reads per-expert tensors: build the table with mok_inductor.functional.make_routed_d_weight_storage_table "
            f"(the tuple of the {E} main-grad tensors)")
    if not isinstance(obj, (tuple, list)):
        raise TypeError(f"{name}: expected a sequence of {E} per-expert main-grad tensors, got {type(obj).__name__}")
    if len(obj) != E:
        raise ValueError(f"{name}: expected {E} per-expert tensors (one per local expert), got {len(obj)}")
    for e, t in enumerate(obj):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{e}]: expected a torch.Tensor, got {type(t).__name__}")
    return tuple(obj)


def _main_grad_tensor(name, t, shape, device, dim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _checks.require_dtype(name, t, _checks.MAIN_GRAD_DTYPES)
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got one on {t.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def _routed_destinations(main_grads, tables, w: _Operands, H: int, device):
    """Validated destination operands (gate, up, down) for the routed weights from the caller's
    buffers; None entries mean 'allocate'."""
    E, I = w.E, w.I
    if tables is not None:
        if not isinstance(tables, (tuple, list)) or len(tables) != 3:
            raise ValueError("main_grad_storage_tables: expected (gate_table, up_table, down_table)")
        if main_grads is None:
            raise ValueError(
                "main_grad_storage_tables: given without main_grads (the tables describe main-grad buffers)"
            )
        tg = _table("main_grad_storage_tables[0]", tables[0], E)
        tu = tg if tables[1] is tables[0] else _table("main_grad_storage_tables[1]", tables[1], E)
        td = _table("main_grad_storage_tables[2]", tables[2], E)
        for n, rep in (("main_grads[1]", main_grads[1]), ("main_grads[3]", main_grads[3]),
                       ("main_grads[5]", main_grads[5])):
            _main_grad_tensor(n, rep, None, device, None)  # representatives: returned as is
        if tables[1] is tables[0]:
            for e, t in enumerate(tg):
                _main_grad_tensor(f"main_grad_storage_tables[0][{e}]", t, (2 * I, H), device, 2)
            gate, up = split_gate_up(tg)
        else:
            for name, tab in (("main_grad_storage_tables[0]", tg), ("main_grad_storage_tables[1]", tu)):
                for e, t in enumerate(tab):
                    _main_grad_tensor(f"{name}[{e}]", t, (I, H), device, 2)
            gate, up = tg, tu
        for e, t in enumerate(td):
            _main_grad_tensor(f"main_grad_storage_tables[2][{e}]", t, (H, I), device, 2)
        return gate, up, td

    if main_grads is None:
        return None, None, None

    def one(name, buf, shape):
        if buf is None:
            return None
        kind, b = _payload(name, buf, 3)
        if _num_experts(kind, b) != E:
            raise ValueError(f"{name}: expected {E} experts, got {_num_experts(kind, b)}")
        _check_payload(name, kind, b, shape, _checks.MAIN_GRAD_DTYPES, device, "a main-grad buffer")
        return kind, b

    mg_g, mg_u, mg_d = main_grads[1], main_grads[3], main_grads[5]
    if mg_g is not None and mg_g is mg_u:
        kb = one("main_grads[1]", mg_g, (2 * I, H))
        gate, up = split_gate_up(kb[1])
    else:
        g, u = one("main_grads[1]", mg_g, (I, H)), one("main_grads[3]", mg_u, (I, H))
        gate, up = (g[1] if g else None), (u[1] if u else None)
    d = one("main_grads[5]", mg_d, (H, I))
    return gate, up, (d[1] if d else None)


def backward(config: MoKConfig, workspace: MoKWorkspace, schedule: MoKSchedule, forward_context: MoKForwardContext,
             grad_output: torch.Tensor, x: torch.Tensor, router_weights: torch.Tensor, shared_gate, shared_up,
             shared_down, routed_gate, routed_up, routed_down, swiglu_limit: Optional[float] = None,
             main_grads: Optional[Sequence] = None, main_grad_storage_tables: Optional[Sequence] = None,
             shared_output_gate_weight: Optional[torch.Tensor] = None,
             shared_output_gate_main_grad: Optional[torch.Tensor] = None):
    """The MoE backward. Returns MoK's nine items:
    (d_x [T, H] x.dtype, d_router_weights [T, K] float32, d_routed_gate, d_routed_up, d_routed_down,
    d_shared_gate, d_shared_up, d_shared_down, d_shared_output_gate float32 [1, H] or None).

    Without `main_grads`, the weight gradients are fresh tensors in the weights' dtype, shaped like the
    arguments (a combined FC1 passed as gate and up gets one combined gradient, returned in both
    slots). With `main_grads`, they are ADDED into the six buffers and the buffers are returned.
    `shared_output_gate_main_grad` ([1, H], float32/bfloat16) likewise receives the gate's gradient. A
    combined shared FC1 (one [2Is, H] weight passed as shared_gate and shared_up) takes its main-grads as the
    row halves of one buffer, main_grads[0] and main_grads[2]; one half passed twice is an error. Every
    argument is validated before anything is written.

    MXFP8 `routed_down`: a 2-tuple here IS the column-wise (data_t [E, I, H], scale_t) pair, as MoK's bridge
    passes it; the forward's row-wise (data, scale) passed by mistake is caught by its shape only where H != I
    (with H == I it runs, with wrong gradients): an `MXFP8Weight` or a 4-tuple cannot be misread. A tuple of
    none of MoK's forms is a ValueError listing them.
    """
    routed_gate, routed_up, routed_down = _canonical_routed(routed_gate, routed_up, routed_down)
    mx, (routed_gate, routed_up, routed_down) = _mxfp8_routed(x, routed_gate, routed_up, routed_down, backward=True)
    ws, sch, w, limit = _check_common(config, workspace, schedule, x, router_weights,
                                      (shared_gate, shared_up, shared_down, routed_gate, routed_up, routed_down),
                                      shared_output_gate_weight, swiglu_limit)
    T, H = x.shape
    device = x.device
    fctx = forward_context
    if not isinstance(fctx, MoKForwardContext):
        raise TypeError(f"forward_context: expected the MoKForwardContext of forward(), got {type(fctx).__name__}")
    if fctx.num_tokens != T or fctx.num_local_experts != w.E:
        raise ValueError(
            f"forward_context: recorded T={fctx.num_tokens}, E={fctx.num_local_experts}, but the arguments have "
            f"T={T}, E={w.E}"
        )
    if (fctx.ep is not None) != (ws.ep_size > 1):
        raise ValueError("forward_context: made by a forward on a workspace of another expert-parallel size")
    if fctx.gated and w.s_out_gate is None:
        raise ValueError("shared_output_gate_weight: the forward context is gated, so the gate weight is required")
    if not fctx.gated and w.s_out_gate is not None:
        raise ValueError("shared_output_gate_weight: given, but the forward ran ungated")
    if fctx.has_shared != (w.s_gate is not None):
        raise ValueError("shared_gate: the shared expert must be the same in forward and backward")
    if fctx.swiglu_limit != limit:
        raise ValueError(f"swiglu_limit: the forward ran with {fctx.swiglu_limit}, backward got {limit}")
    _checks.require_tensor("grad_output", grad_output)
    _checks.require_dtype("grad_output", grad_output, (x.dtype,))
    _checks.require_shape("grad_output", grad_output, (T, H), "[T, H] (the shape of x)")
    _checks.require_device("grad_output", grad_output, device)

    # ---- destinations (validated; nothing written yet)
    if main_grads is not None:
        if isinstance(main_grads, torch.Tensor) or not isinstance(main_grads, (tuple, list)) or len(main_grads) != 6:
            raise ValueError(
                "main_grads: expected six buffers (shared_gate, routed_gate, shared_up, routed_up, shared_down, "
                "routed_down)"
            )
    dg, du, dd = _routed_destinations(main_grads, main_grad_storage_tables, w, H, device)
    ds = [None, None, None]
    if main_grads is not None:
        shapes = ((w.Is, H), (w.Is, H), (H, w.Is))
        for j, idx in enumerate((0, 2, 4)):
            buf = main_grads[idx]
            if buf is None:
                continue
            if w.s_gate is None:
                raise ValueError(
                    f"main_grads[{idx}]: a {_MAIN_GRAD_NAMES[idx]} buffer was given without a shared expert"
                )
            _main_grad_tensor(f"main_grads[{idx}]", buf, shapes[j], device, 2)
            ds[j] = buf
        if w.shared_combined and main_grads[0] is not None and main_grads[0] is main_grads[2]:
            raise ValueError("main_grads[0]: pass the shared gate and up main-grads as row views, not one buffer twice")
    gmg = shared_output_gate_main_grad
    if gmg is not None:
        if w.s_out_gate is None:
            raise ValueError("shared_output_gate_main_grad: given without shared_output_gate_weight")
        _main_grad_tensor("shared_output_gate_main_grad", gmg, (1, H), device, 2)
        if not gmg.is_contiguous():
            raise ValueError("shared_output_gate_main_grad: expected a contiguous [1, H] tensor")

    given = [b for b in (dg, du, dd, *ds, gmg) if b is not None]
    accumulate = bool(given)

    # ---- fresh buffers for what the caller did not give (zeros when accumulating into the rest)
    grads = GradBuffers.allocate(
        GradBuffers(dg, du, dd, ds[0], ds[1], ds[2], gmg), w.gate, w.up, w.down, w.s_gate, w.s_up, w.s_down,
        w.s_out_gate, gate_up=_combined_payload(routed_gate) if w.routed_combined else None,
        s_gate_up=shared_gate if w.shared_combined else None, dtype=x.dtype, out_gate_dtype=torch.float32,
        zero=accumulate)
    if mx is not None and ws.ep_size > 1:
        raise NotImplementedError("routed_gate: MXFP8 routed weights with expert parallelism are not supported yet")
    if ws.ep_size > 1:  # expert parallelism: the forward's exchange in reverse (collective, no host sync)
        dx, d_rw = distributed.backward(sch.ep, fctx.ep, grad_output, x, router_weights, w.gate, w.up, w.down,
                                        w.s_gate, w.s_up, w.s_down, w.s_out_gate, limit, grads=grads,
                                        accumulate=accumulate)
        res = BackwardResult(dx, d_rw, grads)
    else:
        operands = mx if mx is not None else RoutedOperands.of_weights(w.gate, w.up, w.down)
        res = ops.backward(grad_output, x, router_weights, sch.top_experts, sch.as_schedule(), operands,
                           fctx.gu_N2I, w.s_gate, w.s_up, w.s_down, w.s_out_gate, fctx.gu_shared_T2Is, limit,
                           grads=grads, accumulate=accumulate)
    d_rw = res.d_router_weights_TK
    if d_rw.dtype != torch.float32:
        d_rw = d_rw.float()

    # ---- results: the caller's own objects where given; a fresh combined FC1 gradient in both slots
    def out(idx, written, combined):
        if main_grads is not None and main_grads[idx] is not None:
            return main_grads[idx]
        return combined if combined is not None else written

    fresh_gu = grads.d_gate_up if dg is None and du is None else None
    d_routed = (out(1, grads.d_gate, fresh_gu), out(3, grads.d_up, fresh_gu), out(5, grads.d_down, None))
    d_shared = [None, None, None]
    if w.s_gate is not None:
        fresh_sgu = grads.d_s_gate_up if ds[0] is None and ds[1] is None else None
        d_shared = [out(0, grads.d_s_gate, fresh_sgu), out(2, grads.d_s_up, fresh_sgu), out(4, grads.d_s_down, None)]
    d_gate = grads.d_s_out_gate if w.s_out_gate is not None else None
    return (res.dx_TH, d_rw, *d_routed, *d_shared, d_gate)


def _combined_payload(routed_gate):
    """The combined FC1 payload of a routed gate argument (a tensor, a sequence, or a SplitRoutedWeight)."""
    return routed_gate.data if isinstance(routed_gate, SplitRoutedWeight) else routed_gate
