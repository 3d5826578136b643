"""Expert parallelism (EP) over torch.distributed: tokens travel to the ranks that own their experts.

Every rank of an EP group passes its own tokens `x [T, H]` (T may differ between ranks, and may be
0), global expert ids `top_experts [T, K]` in `[-1, E)` and the weights of its `E_local = E / W`
local experts (and, for GPT-OSS's experts, their biases); rank r (its rank in the group) owns experts
`[r*E_local, (r+1)*E_local)`.

Data flow of one layer on rank r (W ranks; S rows sent, R rows received):

    plan (the EP schedule; one host synchronisation):
        dest[t, k] = top_experts[t, k] // E_local             (-1 routes: no destination, never sent)
        pairs (d, t): token t has a route to rank d; one row per pair, ordered by (d, t)
        all_to_all of the per-rank row counts (+ K, H, E_local, id range, dtype for the checks)
        -> host: send/recv split sizes                        (the ONE host sync, `Tensor.tolist`)
        all_to_all of the rows' LOCAL ids [S, K] (the k slots routed elsewhere are -1)
        local schedule of the received ids (torch.ops.mok.schedule, on the device)
    forward:
        x[token_S], router_weights masked to the row's rank  --all_to_all-->  x_R [R, H], rw_R [R, K]
        y_R = the megakernel on (x_R, rw_R, local ids, local weights)  (combine over the local k routes; a
              local down bias joins each route's output before its routing weight, as on one device)
        y_R --all_to_all back--> y_S [S, H]
        y[t] = shared(x)[t] + sum over t's destination ranks, ascending, of y_S[pair (d, t)]   (fp32)
    backward (no host sync: the split sizes are the forward's):
        dy[token_S] --all_to_all--> megakernel backward (local weight and bias gradients, dx_R, d rw_R)
        --all_to_all back--> dx[t] = dx_shared[t] + sum over ranks, ascending; d rw[t, k] read back.

The shared expert runs locally on each rank's own tokens (it is replicated, not dispatched), with
the same megakernel (a call with no routed route) and the same gated activation as the routed experts
(as on one device; routed biases with a shared expert are refused there and here). Every sum has a
fixed order (ascending rank; a local expert's bias gradient sums its received rows in schedule order),
so results are bitwise reproducible run to run.

Collectives pair across ranks in call order: every rank of the group must call each MoE layer, and
its backward, the same number of times in the same order (also with T = 0 tokens), and the ranks
must agree on whether the backward runs (as they do in data-parallel training).

Entry points: `mok_inductor.moe(..., group=pg)` (through `moe` below, differentiable) and the MoK
functional ABI (`mok_inductor.functional` with a workspace of a group larger than one rank), which
calls `plan`, `forward` and `backward` here.

Shape legend: T tokens (this rank), H hidden, I intermediate, K routes per token, W ranks,
E_local local experts, S rows this rank sends (pairs (rank, token)), R rows it receives.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _checks, ops
from . import options as _options
from .types import (ACTIVATIONS, SWIGLU, Activation, GradBuffers, RoutedOperands, Schedule,
                    activation as _activation, shared_saved_dtype, split_gate_up)

__all__ = ["EPPlan", "EPForwardState", "group_size", "plan", "forward", "backward", "moe"]

_DUMMY_I = 16  # intermediate size of the shared-only call's placeholder routed expert (never read)
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}


def group_size(group) -> int:
    """World size of `group` (None: 1). Raises ValueError when torch.distributed is not initialized."""
    if group is None:
        return 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: a process group was given but torch.distributed is not initialized")
    return dist.get_world_size(group)


class EPPlan(NamedTuple):
    """The expert-parallel schedule of one batch of routes on one rank. Tensors live on the device of
    top_experts; the split sizes are host ints (the count exchange's one synchronisation)."""

    group: Any
    world_size: int
    rank: int
    num_local_experts: int
    num_tokens: int  # T
    topk: int  # K
    send_splits: Tuple[int, ...]  # rows sent to each rank
    recv_splits: Tuple[int, ...]  # rows received from each rank
    token_S: torch.Tensor  # int64 [S], the source token of each sent row (rows ordered by (rank, token))
    local_mask_SK: torch.Tensor  # bool [S, K], which k slots of a sent row route to that row's rank
    slot_TJ: torch.Tensor  # int64 [T, J] (J = min(K, W)): row of token t's j-th destination rank; S = none
    pair_TK: torch.Tensor  # int64 [T, K]: the sent row carrying route (t, k); S for a -1 route
    top_experts_RK: torch.Tensor  # int32 [R, K], local expert ids of the received rows (-1 = elsewhere)
    schedule_R: Schedule  # the local schedule of top_experts_RK over the E_local experts

    @property
    def num_sent(self) -> int:
        return sum(self.send_splits)

    @property
    def num_received(self) -> int:
        return sum(self.recv_splits)


class EPForwardState(NamedTuple):
    """What `forward` leaves for `backward`: the received rows and their saved activations."""

    x_RH: torch.Tensor
    rw_RK: torch.Tensor  # float32
    gu_N2I: torch.Tensor  # the local megakernel's saved [g | u] (over the R*K received routes)
    gu_shared_T2Is: torch.Tensor  # [T, 2Is], or [0, 0] without a shared expert


# ---------------------------------------------------------------------------------------------
# Collectives


def _all_to_all(t: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group, *,
                pad: bool = False) -> torch.Tensor:
    """Rows of `t` (grouped by destination rank, `send_splits` rows each) to their ranks; returns the
    received rows, grouped by source rank, plus one zero row at the end when `pad`."""
    t = t.contiguous()
    rows = sum(recv_splits)
    out = t.new_empty((rows + int(pad),) + tuple(t.shape[1:]))
    if pad:
        out[rows:].zero_()
    dist.all_to_all_single(out[:rows] if pad else out, t, list(recv_splits), list(send_splits), group=group)
    return out


# ---------------------------------------------------------------------------------------------
# The plan


def plan(top_experts: torch.Tensor, num_local_experts: int, group, *, hidden_size: int,
         dtype: torch.dtype, variant: tuple = ()) -> EPPlan:
    """The EP schedule of `top_experts` [T, K] (global ids in [-1, W * num_local_experts)).

    Collective over `group`: exchanges the row counts (one host synchronisation) and the rows' local
    expert ids. Every rank checks, from the exchanged values, that all ranks agree on K, H,
    E_local, the activation dtype and `variant` (what the experts compute: (activation name, swiglu_limit,
    has gate_up_bias, has down_bias); () where the caller passes those to the forward itself), and that every
    rank's ids are in range; a violation anywhere raises ValueError on every rank (no rank is left waiting in a
    collective)."""
    W = dist.get_world_size(group)
    rank = dist.get_rank(group)
    El = int(num_local_experts)
    E = El * W
    T, K = top_experts.shape
    dev = top_experts.device
    te = top_experts.to(torch.int64)

    valid_TK = te >= 0
    dest_TK = torch.where(valid_TK, torch.div(te, El, rounding_mode="floor"), torch.full_like(te, W))
    dest_TK = dest_TK.clamp(max=W)  # ids >= E (an error reported below) must not index past the sentinel
    onehot_TW = torch.zeros(T, W + 1, dtype=torch.bool, device=dev).scatter_(1, dest_TK, True)[:, :W]
    send_counts_W = onehot_TW.sum(0)

    # the count exchange, with what every rank must agree on
    if T * K > 0:
        lo, hi = te.min(), te.max()
    else:
        lo = hi = torch.zeros((), dtype=torch.int64, device=dev)
    meta = torch.stack([
        torch.full((), K, dtype=torch.int64, device=dev), torch.full((), hidden_size, dtype=torch.int64, device=dev),
        torch.full((), El, dtype=torch.int64, device=dev), lo, hi,
        torch.full((), _DTYPE_CODES.get(dtype, 0), dtype=torch.int64, device=dev),
        *(torch.full((), v, dtype=torch.int64, device=dev) for v in _variant_codes(variant)),
    ])
    send_meta = torch.cat([send_counts_W[:, None], meta[None, :].expand(W, -1)], 1).contiguous()
    recv_meta = torch.empty_like(send_meta)
    dist.all_to_all_single(recv_meta, send_meta, group=group)
    host = torch.cat([send_meta, recv_meta]).tolist()  # THE host synchronisation of the EP path
    sent, received = host[:W], host[W:]
    _check_exchanged(sent[0], received, rank, E)
    send_splits = tuple(int(row[0]) for row in sent)
    recv_splits = tuple(int(row[0]) for row in received)
    S = sum(send_splits)

    # the sent rows: pairs (d, t) in (d, t) order; pos[d*T + t] is the row of pair (d, t)
    flat_WT = onehot_TW.t().reshape(-1)
    pos_WT = torch.cumsum(flat_WT.to(torch.int64), 0) - 1
    where_WT = torch.where(flat_WT, pos_WT, torch.full_like(pos_WT, S))  # S: a scratch row, dropped
    token_ids = torch.arange(T, device=dev, dtype=torch.int64).repeat(W)
    token_S = torch.empty(S + 1, dtype=torch.int64, device=dev).scatter_(0, where_WT, token_ids)[:S]
    rank_ids = torch.arange(W, device=dev, dtype=torch.int64).repeat_interleave(T)
    rank_S = torch.empty(S + 1, dtype=torch.int64, device=dev).scatter_(0, where_WT, rank_ids)[:S]
    pos_TW = torch.where(flat_WT, pos_WT, torch.full_like(pos_WT, S)).view(W, T).t()

    # which k slots of each row go to that row's rank, and their local ids
    local_mask_SK = dest_TK[token_S] == rank_S[:, None]
    local_ids_SK = torch.where(local_mask_SK, te[token_S] - rank_S[:, None] * El, torch.full_like(te[token_S], -1))

    # token t's destination ranks in ascending order -> rows (S = none), for the fixed-order sums
    J = min(K, W)
    dsort_TK = torch.sort(dest_TK, dim=1).values
    dup = torch.zeros_like(valid_TK)
    dup[:, 1:] = dsort_TK[:, 1:] == dsort_TK[:, :-1]
    distinct_TK = torch.sort(torch.where(dup, torch.full_like(dsort_TK, W), dsort_TK), dim=1).values[:, :J]
    pos_pad_TW1 = torch.cat([pos_TW, torch.full((T, 1), S, dtype=torch.int64, device=dev)], 1)
    slot_TJ = pos_pad_TW1.gather(1, distinct_TK)
    pair_TK = pos_pad_TW1.gather(1, dest_TK)

    top_experts_RK = _all_to_all(local_ids_SK.to(torch.int32), send_splits, recv_splits, group)
    schedule_R = Schedule(*torch.ops.mok.schedule(top_experts_RK, El))
    return EPPlan(group, W, rank, El, T, K, send_splits, recv_splits, token_S, local_mask_SK, slot_TJ, pair_TK,
                  top_experts_RK, schedule_R)


def _check_exchanged(mine, received, rank: int, E: int) -> None:
    """Raise the same kind of error on every rank when any rank's arguments disagree or are out of range."""
    _, K, H, El, lo, hi, code, act, limit_bits = mine
    # agreement first: with another rank's expert count, E (and the id range) differs between ranks
    for j, (_, Kj, Hj, Elj, _, _, codej, actj, limit_bitsj) in enumerate(received):
        if (Kj, Hj, Elj, codej) != (K, H, El, code):
            raise ValueError(
                f"group: the ranks disagree on (topk, hidden size, local experts, x dtype): rank {rank} has "
                f"({K}, {H}, {El}, {_dtype_name(code)}), rank {j} has ({Kj}, {Hj}, {Elj}, {_dtype_name(codej)})"
            )
        if (actj, limit_bitsj) != (act, limit_bits):
            raise ValueError(
                f"group: the ranks disagree on what the experts compute (activation, swiglu_limit, routed biases): "
                f"rank {rank} has {_variant_text(act, limit_bits)}, rank {j} has {_variant_text(actj, limit_bitsj)}"
            )
    if lo < -1 or hi >= E:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"top_experts: expected global expert indices in [-1, {E}) (-1 means no route; E = {El} local experts "
            f"x {len(received)} ranks), found {bad}"
        )
    for j, (_, _, _, _, loj, hij, _, _, _) in enumerate(received):
        if loj < -1 or hij >= E:
            raise ValueError(
                f"top_experts: rank {j} of the expert-parallel group passed expert indices outside [-1, {E})"
            )


_NO_LIMIT = -1  # the exchanged swiglu_limit of a call without one (no float64's bits as int64 are -1: a NaN)


def _variant_codes(variant: tuple) -> tuple:
    """(activation and biases, swiglu_limit) as two int64s every rank can compare: index of the activation in
    types.ACTIVATIONS (+1) * 4 + 2 * has gate_up_bias + has down_bias, and the limit's float64 bits; (0, -1)
    for an empty variant."""
    if not variant:
        return 0, _NO_LIMIT
    name, limit, has_b1, has_b2 = variant
    names = sorted(ACTIVATIONS)
    bits = _NO_LIMIT if limit is None else struct.unpack("<q", struct.pack("<d", float(limit)))[0]
    return (names.index(name) + 1) * 4 + 2 * bool(has_b1) + bool(has_b2), bits


def _variant_text(act: int, limit_bits: int) -> str:
    if act == 0:
        return "no stated variant"
    limit = None if limit_bits == _NO_LIMIT else struct.unpack("<d", struct.pack("<q", limit_bits))[0]
    name = sorted(ACTIVATIONS)[act // 4 - 1]
    return (f"activation={name!r}, swiglu_limit={limit}, gate_up_bias {'given' if act & 2 else 'absent'}, "
            f"down_bias {'given' if act & 1 else 'absent'}")


def _dtype_name(code: int) -> str:
    for dt, c in _DTYPE_CODES.items():
        if c == code:
            return str(dt).replace("torch.", "")
    return "unsupported"


# ---------------------------------------------------------------------------------------------
# Forward and backward (no autograd: the functional ABI calls these; `moe` wraps them)


def _slot_sum(acc_TX: torch.Tensor, rows_SX: torch.Tensor, slot_TJ: torch.Tensor) -> torch.Tensor:
    """acc + sum_j rows[slot[:, j]] in acc's dtype, j ascending (rows has a zero row at index S)."""
    for j in range(slot_TJ.shape[1]):
        acc_TX = acc_TX + rows_SX[slot_TJ[:, j]].to(acc_TX.dtype)
    return acc_TX


def _shared_only_call(x: torch.Tensor):
    """(router weights, top_experts, schedule, routed operands) of a megakernel call that runs only the shared
    expert: no route, and a one-expert placeholder that no route reads."""
    T, H = x.shape
    none_T1 = torch.full((T, 1), -1, dtype=torch.int32, device=x.device)
    zeros_T1 = torch.zeros(T, 1, dtype=torch.float32, device=x.device)
    sched = Schedule(*torch.ops.mok.schedule(none_T1, 1))
    g = x.new_zeros(1, _DUMMY_I, H)
    return zeros_T1, none_T1, sched, RoutedOperands.of_weights(g, g, x.new_zeros(1, H, _DUMMY_I))


def forward(p: EPPlan, x: torch.Tensor, router_weights: torch.Tensor, w_gate, w_up, w_down,
            s_gate: Optional[torch.Tensor] = None, s_up: Optional[torch.Tensor] = None,
            s_down: Optional[torch.Tensor] = None, s_out_gate: Optional[torch.Tensor] = None,
            swiglu_limit: Optional[float] = None, act: Activation = SWIGLU,
            gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None):
    """y [T, H] (x.dtype) and the EPForwardState for `backward`. Collective (three all_to_alls). `act`: the
    gated activation of the routed and the shared experts; `gate_up_bias` [E_local, 2, I] and `down_bias`
    [E_local, H]: the local experts' optional biases, applied where the experts run (`ops.forward`)."""
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    x_SH = x[p.token_S]
    # float32 whatever each rank passed (as the one-device call reads them): ranks passing different dtypes
    # exchange rows of one size (float64 on one rank beside float32 on another broke the all_to_all)
    rw_f = router_weights.to(torch.float32)
    rw_SK = torch.where(p.local_mask_SK, rw_f[p.token_S], torch.zeros((), dtype=rw_f.dtype, device=x.device))
    x_RH = _all_to_all(x_SH, p.send_splits, p.recv_splits, p.group)
    rw_RK = _all_to_all(rw_SK, p.send_splits, p.recv_splits, p.group)
    res = ops.forward(x_RH, rw_RK, p.top_experts_RK, p.schedule_R, RoutedOperands.of_weights(w_gate, w_up, w_down),
                      swiglu_limit=swiglu_limit, act=act, gate_up_bias=gate_up_bias, down_bias=down_bias)
    y_SH = _all_to_all(res.y_TH, p.recv_splits, p.send_splits, p.group, pad=True)

    T, H = x.shape
    if s_gate is not None:
        zeros_T1, none_T1, sched, dummy = _shared_only_call(x)
        sres = ops.forward(x, zeros_T1, none_T1, sched, dummy, s_gate, s_up, s_down, s_out_gate, swiglu_limit, act)
        acc = sres.y_TH.to(acc_dtype)  # the shared expert first, then the ranks' partial sums, ascending
        gu_shared = sres.gu_shared_T2Is
    else:
        acc = torch.zeros(T, H, dtype=acc_dtype, device=x.device)
        gu_shared = x.new_empty(0, 0, dtype=shared_saved_dtype(x.dtype))
    y = _slot_sum(acc, y_SH, p.slot_TJ).to(x.dtype)
    return y, EPForwardState(x_RH, rw_RK, res.gu_N2I, gu_shared)


def backward(p: EPPlan, state: EPForwardState, dy: torch.Tensor, x: torch.Tensor, router_weights: torch.Tensor,
             w_gate, w_up, w_down, s_gate=None, s_up=None, s_down=None, s_out_gate=None,
             swiglu_limit: Optional[float] = None, act: Activation = SWIGLU,
             gate_up_bias: Optional[torch.Tensor] = None, down_bias: Optional[torch.Tensor] = None, *,
             grads: GradBuffers, accumulate: bool = False):
    """(dx [T, H] x.dtype, d router_weights [T, K] float32). The local experts' weight gradients and
    the shared expert's go into `grads` (written, or ADDED when `accumulate`), as in
    `ops.backward`; with the biases of `forward` (same `act`), theirs into `grads.d_gate_up_bias`
    [E_local, 2, I] and `grads.d_down_bias` [E_local, H], which must then be given. Collective (three
    all_to_alls), no host synchronisation."""
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    T, H = x.shape
    dy = dy.to(x.dtype)
    dy_RH = _all_to_all(dy[p.token_S], p.send_splits, p.recv_splits, p.group)
    # (ops.backward would allocate a missing bias gradient where the caller never sees it)
    assert (gate_up_bias is None or grads.d_gate_up_bias is not None) and \
        (down_bias is None or grads.d_down_bias is not None), "the biases' gradient buffers must be given"
    routed = GradBuffers(grads.d_gate, grads.d_up, grads.d_down, d_gate_up=grads.d_gate_up,
                         d_gate_up_bias=grads.d_gate_up_bias if gate_up_bias is not None else None,
                         d_down_bias=grads.d_down_bias if down_bias is not None else None)
    res = ops.backward(dy_RH, state.x_RH, state.rw_RK, p.top_experts_RK, p.schedule_R,
                       RoutedOperands.of_weights(w_gate, w_up, w_down), state.gu_N2I, swiglu_limit=swiglu_limit,
                       act=act, gate_up_bias=gate_up_bias, down_bias=down_bias, grads=routed, accumulate=accumulate)
    dx_SH = _all_to_all(res.dx_TH, p.recv_splits, p.send_splits, p.group, pad=True)
    drw_SK = _all_to_all(res.d_router_weights_TK.to(state.rw_RK.dtype), p.recv_splits, p.send_splits, p.group, pad=True)

    if s_gate is not None:
        zeros_T1, none_T1, sched, dummy = _shared_only_call(x)
        # the placeholder's gradients are zeros (accumulated into, never read); no bias buffer, or the
        # placeholder's empty expert would zero local expert 0's bias gradient
        shared = GradBuffers.allocate(grads._replace(d_gate=None, d_up=None, d_down=None, d_gate_up=None,
                                                     d_gate_up_bias=None, d_down_bias=None),
                                      dummy.gate.data, dummy.up.data, dummy.down.data, zero=True)
        sres = ops.backward(dy, x, zeros_T1, none_T1, sched, dummy, x.new_zeros(T, 2 * _DUMMY_I), s_gate, s_up,
                            s_down, s_out_gate, state.gu_shared_T2Is, swiglu_limit, act, grads=shared,
                            accumulate=accumulate)
        acc = sres.dx_TH.to(acc_dtype)
    else:
        acc = torch.zeros(T, H, dtype=acc_dtype, device=x.device)
    dx = _slot_sum(acc, dx_SH, p.slot_TJ).to(x.dtype)
    k_idx = torch.arange(p.topk, device=x.device)
    drw = drw_SK[p.pair_TK, k_idx[None, :].expand(T, -1)]
    return dx, drw


# ---------------------------------------------------------------------------------------------
# The differentiable entry point of `mok_inductor.moe(..., group=...)`


class _EPMoE(torch.autograd.Function):
    """forward(x, rw, gate_up [El, 2I, H] (or [El, 2, I, H]), down [El, H, I], shared_gate_up, shared_down,
    shared_gate, gate_up_bias [El, 2I] (or [El, 2, I]), down_bias [El, H], plan, swiglu_limit, act) -> y; its
    backward is the EP backward (collective)."""

    @staticmethod
    def forward(ctx, x, rw, gate_up, down, sgu, sd, sog, gub, db, p, limit, act):
        w_gate, w_up = split_gate_up(gate_up)
        s_gate, s_up = split_gate_up(sgu)
        y, state = forward(p, x, rw, w_gate, w_up, down, s_gate, s_up, sd, sog, limit, act, ops.bias_E2I(gub), db)
        ctx.save_for_backward(x, rw, gate_up, down, sgu, sd, sog, gub, db)
        ctx.plan, ctx.state, ctx.limit, ctx.act = p, state, limit, act
        ctx.options = _options.current()  # the backward runs as its forward did (a per-call `options=` included)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, rw, gate_up, down, sgu, sd, sog, gub, db = ctx.saved_tensors
        w_gate, w_up = split_gate_up(gate_up)
        s_gate, s_up = split_gate_up(sgu)
        # every gradient in its input's layout (strides), as mok::moe_bwd allocates them: the gradient of a
        # strided view (GPT-OSS's checkpoint layout) reaches its parameter without a copy
        grads = GradBuffers.allocate(None, None, None, down, None, None, sd, sog, gate_up=gate_up, s_gate_up=sgu,
                                     preserve_layout=True)
        d_gub = None if gub is None else torch.empty_like(gub, memory_format=torch.preserve_format)
        d_db = None if db is None else torch.empty_like(db, memory_format=torch.preserve_format)
        grads = grads._replace(d_gate_up_bias=ops.bias_E2I(d_gub), d_down_bias=d_db)
        with _options.override(ctx.options):
            dx, drw = backward(ctx.plan, ctx.state, dy, x, rw, w_gate, w_up, down, s_gate, s_up, sd, sog, ctx.limit,
                               ctx.act, ops.bias_E2I(gub), db, grads=grads, accumulate=False)
        ctx.plan = ctx.state = None
        return dx, drw.to(rw.dtype), grads.d_gate_up, grads.d_down, grads.d_s_gate_up, grads.d_s_down, \
            grads.d_s_out_gate, d_gub, d_db, None, None, None


@torch.compiler.disable
def moe(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj=None, shared_down_proj=None,
        shared_output_gate=None, swiglu_limit=None, activation=None, gate_up_bias=None, down_bias=None, *,
        group) -> torch.Tensor:
    """`mok_inductor.moe` over an EP group, on flattened arguments (x [T, H]); gate_up_proj/down_proj (and
    gate_up_bias [E_local, 2I] or [E_local, 2, I], down_bias [E_local, H]) hold this rank's E_local experts.
    Runs eagerly (torch.compile graph-breaks around it: the plan synchronises with the host)."""
    _checks.check_moe_args(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj,
                           shared_down_proj, shared_output_gate, swiglu_limit)
    _checks.check_variant(x, gate_up_proj, down_proj, shared_gate_up_proj, gate_up_bias, down_bias)
    act = _activation(activation)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    p = plan(top_experts, gate_up_proj.shape[0], group, hidden_size=x.shape[1], dtype=x.dtype,
             variant=(act.name, limit, gate_up_bias is not None, down_bias is not None))
    return _EPMoE.apply(x, router_weights, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj,
                        shared_output_gate, gate_up_bias, down_bias, p, limit, act)
