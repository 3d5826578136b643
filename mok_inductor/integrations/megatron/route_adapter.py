"""Megatron's dense routing ([T, E] probs and boolean routing_map) -> MoK's compact [T, K] inputs.

The routing map is authoritative (not topk(probs)): each row's routed experts are compacted in
ascending expert order, routes past K are dropped, unused slots get index -1 and weight 0. Pure torch
with no host synchronisation (a top-k over per-row keys and a gather), so it runs on any device and
under CUDA graphs; the weights stay differentiable with respect to `probs` (the gather's backward is a
dense [T, E] gradient in probs.dtype, zero off the valid routes); the indices are not differentiable.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..._checks import FLOAT_DTYPES


def routing_map_to_mok_inputs(probs: torch.Tensor, routing_map: torch.Tensor, topk: int,
                              *, index_dtype: torch.dtype = torch.int32) -> Tuple[torch.Tensor, torch.Tensor]:
    """(router_weights float32 [T, K], top_experts `index_dtype` [T, K]) from probs [T, E] and
    routing_map [T, E] (bool, or integer 0/1)."""
    if not isinstance(probs, torch.Tensor) or not isinstance(routing_map, torch.Tensor):
        raise TypeError("probs, routing_map: expected torch.Tensors")
    if probs.dim() != 2:
        raise ValueError(f"probs: expected a 2-D tensor [T, E], got shape {list(probs.shape)}")
    if routing_map.shape != probs.shape:
        raise ValueError(
            f"routing_map: expected shape {list(probs.shape)} (the shape of probs), got {list(routing_map.shape)}"
        )
    if probs.dtype not in FLOAT_DTYPES:
        raise TypeError(f"probs: expected float32, bfloat16 or float16, got {probs.dtype}")
    if routing_map.device != probs.device:
        raise ValueError(
            f"routing_map: expected a tensor on {probs.device} (the device of probs), got {routing_map.device}"
        )
    if index_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"index_dtype: expected torch.int32 or torch.int64, got {index_dtype}")
    T, E = probs.shape
    if isinstance(topk, bool) or not isinstance(topk, int) or not 0 < topk <= E:
        raise ValueError(f"topk: expected an int in [1, {E}] (E = number of experts), got {topk}")
    routed = routing_map if routing_map.dtype == torch.bool else routing_map != 0
    expert_ids = torch.arange(E, device=probs.device, dtype=torch.int64)
    # unrouted experts get key E, so the K smallest keys are the first K routed experts, ascending
    key = torch.where(routed, expert_ids.expand(T, E), torch.full_like(expert_ids, E).expand(T, E))
    first_k, _ = torch.topk(key, topk, dim=1, largest=False, sorted=True)
    valid = first_k < E
    safe = torch.where(valid, first_k, torch.zeros_like(first_k))
    weights = torch.gather(probs, 1, safe).float()
    weights = torch.where(valid, weights, torch.zeros_like(weights))
    indices = torch.where(valid, first_k, torch.full_like(first_k, -1)).to(index_dtype)
    return weights, indices
