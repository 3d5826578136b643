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
- split: a sequence of E 2-D tensors (Megatron's per-expert allocations), or `SplitRoutedWeight`;
- combined FC1: the SAME object passed as `routed_gate` and `routed_up`, covering [E, 2I, H] (or E
  tensors [2I, H]); the gate is rows [0, I) and up rows [I, 2I) of each expert, taken as zero-copy
  views. The shared expert accepts the same aliasing ([2Is, H] passed twice).
- MXFP8: MoK's (data, scale) tuples for a combined FC1 and the down weight (see `_mxfp8_routed`),
  or split per expert as `SplitRoutedWeight`s with scales (and column-wise pairs for backward); forward reads
  the row-wise pairs, backward the column-wise ones for dgrad. Swizzled scale layouts are not supported yet.

Gradient destinations (`backward`): `main_grads` = six buffers in MoK's order (shared_gate, routed_gate,
shared_up, routed_up, shared_down, routed_down), float32 or bfloat16; weight gradients are ADDED
into them and the returned weight gradients are those very objects. Routed entries are 3-D tensors
or sequences of E tensors; aliasing routed_gate/routed_up entries (one combined buffer) get the same
row offsets as the weights. With split per-expert buffers, `main_grad_storage_tables` =
(gate_table, up_table, down_table), each a sequence of E tensors (gate_table is up_table for a
combined FC1 buffer); the routed entries of `main_grads` are then representatives, returned as is.

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


class SplitRoutedWeight(NamedTuple):
    """A descriptor of split per-expert allocations: `data` holds E 2-D tensors (e.g. Megatron's
    `weight0 ... weight{E-1}`), used in place without stacking. Owns nothing.

    MXFP8 (MoK's field names): `data` E float8_e4m3fn [M, K] and `scale` E uint8 E8M0 [M, K/32]
    (the row-wise pairs, what forward reads); for backward also the column-wise pairs, `transposed_data`
    E [K, M] and `transposed_scale` E [K, M/32], or, with `native_columnwise=True`, Transformer Engine's
    column-wise storage E [M, K] and E [M/32, K]. `of_mxfp8` builds one from E `mxfp8.quantize` results."""

    data: Tuple[torch.Tensor, ...]
    scale: Optional[Tuple[torch.Tensor, ...]] = None
    transposed_data: Optional[Tuple[torch.Tensor, ...]] = None
    transposed_scale: Optional[Tuple[torch.Tensor, ...]] = None
    native_columnwise: bool = False

    @classmethod
    def of_mxfp8(cls, weights) -> "SplitRoutedWeight":
        """The descriptor of E per-expert `mxfp8.MXFP8Weight`s (2-D each; column-wise pairs when present)."""
        from ... import mxfp8

        weights = tuple(weights)
        if not weights or not all(isinstance(q, mxfp8.MXFP8Weight) for q in weights):
            raise TypeError("weights: expected a non-empty sequence of mok_inductor.mxfp8.MXFP8Weight")
        cols = all(q.data_t is not None for q in weights)
        return cls(tuple(q.data for q in weights), tuple(q.scale for q in weights),
                   tuple(q.data_t for q in weights) if cols else None,
                   tuple(q.scale_t for q in weights) if cols else None)


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


# MXFP8 routed weights (MoK's layout with logical, unswizzled scales). Forward: (data, scale)
# per weight, [E, M, K] float8_e4m3fn and [E, M, K/32] uint8 (E8M0). Backward: gate/up as
# (data, scale, data_t, scale_t) or TE's native (data, scale, col_data [E, M, K], col_scale [E, M/32, K], True);
# down as its column-wise pair (data_t [E, K, M], scale_t [E, K, M/32]), (col_data, col_scale, True) native, or
# a 4-tuple. A combined FC1 is the same tuple passed as routed_gate and routed_up. An MXFP8Weight
# (mok_inductor.mxfp8.quantize) is accepted wherever a tuple is.


def _is_mxfp8_tuple(v) -> bool:
    return (isinstance(v, tuple) and not isinstance(v, SplitRoutedWeight) and len(v) >= 2
            and isinstance(v[0], torch.Tensor) and v[0].dtype == torch.float8_e4m3fn)


def _mx_native_col(data, scale):
    """TE's native column-wise pair ([E, M, K] data, [E, M/32, K] scales, or E such 2-D pieces each) as
    (data_t, scale_t) views."""
    from ...types import transposed_payload as _transposed

    return _transposed(data), _transposed(scale)


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
    if w.native_columnwise:  # Transformer Engine's [M, K] data and [M/32, K] scales, as transposed views
        return _mx_native_col(tuple(w.transposed_data), tuple(w.transposed_scale))
    return tuple(w.transposed_data), tuple(w.transposed_scale)


def _mxfp8_routed(x, routed_gate, routed_up, routed_down, *, backward: bool):
    """(RoutedOperands, stand-ins for the three routed arguments) when they are MXFP8 (tuples or split
    `SplitRoutedWeight`s), else (None, the arguments). The stand-ins are x-dtype zero-stride tensors of the
    logical weight shapes (E of them for a split weight; aliasing kept for a combined FC1), so the common
    checks and buffer logic apply unchanged."""
    from ... import mxfp8

    args = (routed_gate, routed_up, routed_down)
    if isinstance(routed_gate, mxfp8.MXFP8Weight) or isinstance(routed_down, mxfp8.MXFP8Weight):
        args = tuple(a[:4] if isinstance(a, mxfp8.MXFP8Weight) else a for a in args)
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

    def split_parts(name, w):
        """(data, scale, data_t, scale_t) sequences of a split weight, validated (column-wise: backward only)."""
        if not isinstance(w.data, (tuple, list)) or not w.data:
            raise TypeError(f"{name}: SplitRoutedWeight.data must be a non-empty sequence of 2-D tensors")
        dt = st = None
        if backward:
            dt, st = _split_columnwise(name, w)
        mxfp8.check_split_weight(name, w.data, w.scale, dt, st, x.dtype, x.device, split_rows=name == "routed_gate")
        return tuple(w.data), tuple(w.scale), dt, st

    def piece(p):  # a payload's first expert matrix (3-D: its [M, K] shape is the trailing dims anyway)
        return p if isinstance(p, torch.Tensor) else p[0]

    def gate_up_parts(t):
        if isinstance(t, SplitRoutedWeight):
            return split_parts("routed_gate", t)
        if not backward:
            return t[0], t[1], None, None
        if len(t) == 5 and t[4] is True:
            return (t[0], t[1], *_mx_native_col(t[2], t[3]))
        if len(t) == 4:
            return tuple(t)
        raise ValueError("routed_gate: the backward needs the MXFP8 gate/up as (data, scale, data_t, scale_t) or "
                         "(data, scale, col_data, col_scale, True)")

    def down_columnwise(t):
        if isinstance(t, SplitRoutedWeight):
            return split_parts("routed_down", t)[2:]
        if len(t) == 3 and t[2] is True:
            dt, st = _mx_native_col(t[0], t[1])
        elif len(t) == 4:
            dt, st = t[2], t[3]
        elif len(t) == 2:
            dt, st = t
        else:
            raise ValueError("routed_down: the backward needs the MXFP8 down as its column-wise (data_t, scale_t), "
                             "(col_data, col_scale, True) or a 4-tuple")
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
            dn = (down[0], down[1], None, None)
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
    if isinstance(obj, SplitRoutedWeight):
        obj = obj.data
    if isinstance(obj, torch.Tensor) or not isinstance(obj, (tuple, list)):
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
    `shared_output_gate_main_grad` ([1, H], float32/bfloat16) likewise receives the gate's gradient.
    Every argument is validated before anything is written.
    """
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
