"""The expert schedule on the device: a stable counting sort of the routes by expert, in three launches.

    top_experts_TK --_schedule_count_kernel--> counts_CG [C, G] (routes per key per chunk), bad_C [C]
    counts_CG --_schedule_prefix_kernel--> base_CG (exclusive prefix over the chunks, per key), totals_G
    top_experts_TK, base_CG, totals_G --_schedule_scatter_kernel--> sorted_routes_N, route_slots_N,
        expert_offsets_E1 (the exclusive prefix of totals_G over the keys, computed in every program)

With few chunks (decode: FUSED_PREFIX_MAX_TILE), in two: each scatter program sums the whole counts_CG itself
(its chunk's base and the totals) and program 0 folds bad_C, so the prefix launch goes.

Keys: the expert id, with `-1` routes as key E (so they sort last, in route order). Stable because
chunk c's routes of key g take the slots after those of chunks < c, in route order inside a chunk
(a one-hot prefix sum). Integer arithmetic only: deterministic. Static shapes, no host
synchronisation (capturable in a CUDA graph). Ids outside [-1, E) are counted per chunk in bad_C, folded
into one flag by the prefix kernel and checked with torch._assert_async; they are treated as `-1` so no write goes out of bounds. The prefix
sums are our own kernel rather than torch.cumsum: one launch instead of five, and no Inductor-generated
scan over a strided dim inside compiled graphs.

Shape legend: T tokens, K routes per token, N = T*K routes, E experts, G = E + 1 keys, C chunks of
BLOCK routes (the last chunk is empty, see build_schedule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common
from ..types import Schedule


@triton.jit
def _keys(te_ptr, routes, N, E):
    mask = routes < N
    ids = tl.load(te_ptr + routes, mask=mask, other=-1).to(tl.int32)
    bad = mask & ((ids < -1) | (ids >= E))
    keys = tl.where((ids < 0) | bad, E, ids)
    return keys, mask, bad


@triton.jit(do_not_specialize=["N"])
def _schedule_count_kernel(
    te_ptr,  # top_experts [N] (flat, int32 or int64)
    counts_ptr,  # int32 [C, G] out
    bad_ptr,  # int32 [C] out: ids outside [-1, E) in the chunk
    N, E,
    G_POW2: tl.constexpr, BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    routes = c * BLOCK + tl.arange(0, BLOCK)
    keys, mask, bad = _keys(te_ptr, routes, N, E)
    g = tl.arange(0, G_POW2)
    onehot = ((keys[:, None] == g[None, :]) & mask[:, None]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    tl.store(counts_ptr + c * (E + 1) + g, counts, mask=g <= E)
    tl.store(bad_ptr + c, tl.sum(bad.to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["C"])
def _schedule_prefix_kernel(
    counts_ptr,  # int32 [C, G]
    base_ptr,  # int32 [C, G] out: routes of key g in chunks < c
    totals_ptr,  # int32 [G] out: routes of key g
    bad_ptr,  # int32 [C]: ids outside [-1, E) per chunk
    ok_ptr,  # int32 [] out (program 0): 1 if no chunk has one, else 0
    C, G,
    BLOCK_C: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """One program per strip of BLOCK_G keys: a running exclusive prefix down the chunks, BLOCK_C at a time.
    Program 0 also folds the per-chunk counts of bad ids into one flag (what torch._assert_async reads: one
    kernel, not a reduction, a comparison and the assert)."""
    if tl.program_id(0) == 0:
        nbad = tl.zeros((BLOCK_C,), dtype=tl.int32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            nbad += tl.load(bad_ptr + c, mask=c < C, other=0)
        tl.store(ok_ptr, (tl.sum(nbad, axis=0) == 0).to(tl.int32))
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = g < G
    carry = tl.zeros((BLOCK_G,), dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        m = (c[:, None] < C) & gmask[None, :]
        offs = c[:, None] * G + g[None, :]
        cnt = tl.load(counts_ptr + offs, mask=m, other=0)
        incl = tl.cumsum(cnt, axis=0)
        tl.store(base_ptr + offs, carry[None, :] + incl - cnt, mask=m)
        carry += tl.sum(cnt, axis=0)
    tl.store(totals_ptr + g, carry, mask=gmask)


@triton.jit(do_not_specialize=["N", "C"])
def _schedule_scatter_kernel(
    te_ptr,  # top_experts [N]
    base_ptr,  # int32 [C, G]: routes of key g in chunks < c (not FUSED)
    totals_ptr,  # int32 [G]: routes of key g (not FUSED)
    counts_ptr,  # int32 [C, G]: routes of key g in chunk c (FUSED)
    bad_ptr,  # int32 [C]: ids outside [-1, E) per chunk (FUSED)
    sorted_ptr,  # int32 [N] out: route held by each slot
    slots_ptr,  # int32 [N] out: slot of each route
    offsets_ptr,  # int32 [G] out (program 0): first slot of each key = expert_offsets_E1
    ok_ptr,  # int32 [] out (FUSED, program 0): 1 if no chunk has a bad id, else 0
    N, E, C,
    G_POW2: tl.constexpr, BLOCK: tl.constexpr, FUSED: tl.constexpr, C_POW2: tl.constexpr,
):
    c = tl.program_id(0)
    g = tl.arange(0, G_POW2)
    if FUSED:  # the prefix kernel's sums, over the whole [C, G] counts (C_POW2 * G_POW2 small)
        cc = tl.arange(0, C_POW2)
        counts = tl.load(counts_ptr + cc[:, None] * (E + 1) + g[None, :],
                         mask=(cc[:, None] < C) & (g[None, :] <= E), other=0)
        totals = tl.sum(counts, axis=0)
        before = tl.sum(tl.where(cc[:, None] < c, counts, 0), axis=0)  # routes of key g in chunks < c
        nbad = tl.sum(tl.load(bad_ptr + cc, mask=cc < C, other=0), axis=0)
        tl.store(ok_ptr, (nbad == 0).to(tl.int32), mask=c == 0)
    else:
        totals = tl.load(totals_ptr + g, mask=g <= E, other=0)
    start = tl.cumsum(totals, axis=0) - totals  # first slot of each key
    tl.store(offsets_ptr + g, start, mask=(g <= E) & (c == 0))  # program 0 writes the offsets
    routes = c * BLOCK + tl.arange(0, BLOCK)
    keys, mask, _ = _keys(te_ptr, routes, N, E)
    onehot = ((keys[:, None] == g[None, :]) & mask[:, None]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # earlier routes of the same key
    if FUSED:
        key_start = tl.sum(onehot * (start + before)[None, :], axis=1)  # start[keys] + before[keys]
        slot = key_start + rank
    else:
        key_start = tl.sum(onehot * start[None, :], axis=1)  # start[keys], without a gather
        base = tl.load(base_ptr + c * (E + 1) + keys, mask=mask, other=0)
        slot = key_start + base + rank
    tl.store(sorted_ptr + slot, routes, mask=mask)
    tl.store(slots_ptr + routes, slot, mask=mask)


# the scatter programs sum the counts themselves (no prefix launch) while the [C, G] tile of counts is at most
# this many entries: C <= 64 at E = 128 (64 routes a chunk: up to 4032 routes, qwen3 decode to T = 504)
FUSED_PREFIX_MAX_TILE = 16384


def _block(num_keys_pow2: int) -> int:
    """Routes per chunk: the one-hot tile [BLOCK, G_POW2] stays at most 16K entries."""
    return max(16, min(1024, 16384 // num_keys_pow2))


def build_schedule(top_experts_TK: torch.Tensor, num_experts: int, *,
                   fused_prefix_max_tile: int = FUSED_PREFIX_MAX_TILE) -> Schedule:
    """Device twin of reference.build_schedule: bit-identical, no host sync. The prefix sums fuse into the
    scatter while the counts tile [C, G_POW2] holds at most `fused_prefix_max_tile` entries (0: never)."""
    te_N = top_experts_TK.reshape(-1)
    if not te_N.is_contiguous():
        te_N = te_N.contiguous()
    dev = te_N.device
    N, E = te_N.numel(), int(num_experts)
    G = E + 1
    if N == 0:
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        return Schedule(empty, torch.zeros(G, dtype=torch.int32, device=dev), empty.clone())
    g_pow2 = common.next_pow2(G)
    block = _block(g_pow2)
    # One chunk more than the routes fill (it holds none: its counts are zeros). Under dynamic shapes C is a
    # symbolic expression of the token count; at C == 1 Inductor specialised the torch reductions over C
    # (then the cumsums of counts_CG, now bad_C.sum) to their size-1 case and guarded on it, so a later T
    # with C >= 2 recompiled. With C >= 2 always, no such guard.
    C = common.cdiv(N, block) + 1
    counts_CG = torch.empty(C, G, dtype=torch.int32, device=dev)
    bad_C = torch.empty(C, dtype=torch.int32, device=dev)
    common.launch(_schedule_count_kernel, (C,), te_N, counts_CG, bad_C, N, E, G_POW2=g_pow2, BLOCK=block)
    ok = torch.empty((), dtype=torch.int32, device=dev)
    sorted_N = torch.empty(N, dtype=torch.int32, device=dev)
    slots_N = torch.empty(N, dtype=torch.int32, device=dev)
    start_G = torch.empty(G, dtype=torch.int32, device=dev)
    fused = not isinstance(C, torch.SymInt) and C * g_pow2 <= fused_prefix_max_tile  # (symbolic: three, no guard)
    if fused:
        common.launch(_schedule_scatter_kernel, (C,), te_N, None, None, counts_CG, bad_C, sorted_N, slots_N,
                       start_G, ok, N, E, C, G_POW2=g_pow2, BLOCK=block, FUSED=True, C_POW2=common.next_pow2(C))
        common.assert_expert_ids(ok, top_experts_TK, E)
        return Schedule(sorted_N, start_G, slots_N)
    base_CG = torch.empty(C, G, dtype=torch.int32, device=dev)
    totals_G = torch.empty(G, dtype=torch.int32, device=dev)
    block_g = 16 if not common.INTERPRET else min(16, g_pow2)
    common.launch(_schedule_prefix_kernel, (common.cdiv(G, block_g),), counts_CG, base_CG, totals_G, bad_C, ok,
                   C, G, BLOCK_C=64, BLOCK_G=block_g)
    common.assert_expert_ids(ok, top_experts_TK, E)
    common.launch(_schedule_scatter_kernel, (C,), te_N, base_CG, totals_G, None, None, sorted_N, slots_N, start_G,
                   ok, N, E, C, G_POW2=g_pow2, BLOCK=block, FUSED=False, C_POW2=1)
    return Schedule(sorted_N, start_G, slots_N)
