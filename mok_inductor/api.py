"""The user-facing API: `mok_inductor.moe`.

It checks the leading dims, flattens them into the token dim and calls `torch.ops.mok.moe`, which
validates the rest (shapes, dtypes, devices: metadata only, so Dynamo traces it for free) and runs
the schedule, forward and (under autograd) backward ops of `mok_inductor.ops`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import _checks
from . import mxfp8 as _mxfp8
from . import options as _options
from . import ops as _ops  # noqa: F401  (registers the mok:: ops)
from . import types as _types


def moe(
    x: torch.Tensor,
    router_weights: torch.Tensor,
    top_experts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    shared_gate_up_proj: Optional[torch.Tensor] = None,
    shared_down_proj: Optional[torch.Tensor] = None,
    shared_output_gate: Optional[torch.Tensor] = None,
    swiglu_limit: Optional[float] = None,
    activation: str = "swiglu",
    gate_up_bias: Optional[torch.Tensor] = None,
    down_bias: Optional[torch.Tensor] = None,
    group=None,
    options=None,
) -> torch.Tensor:
    """A Mixture-of-Experts layer with SwiGLU experts (docs/api.md).

    Args:
        x: [..., H] activations, float32, bfloat16 or float16. Leading dims are flattened into T tokens.
        router_weights: [..., K] routing weights (float32; other float dtypes are upcast, and their
            gradient comes back in their own dtype).
        top_experts: [..., K] int32/int64 expert ids in [0, E), or -1 for "no route".
        gate_up_proj: [E, 2*I, H] routed FC1, gate rows [0, I) then up rows [I, 2I), or [E, 2, I, H] (index 0
            the gate rows, 1 the up rows; any strides: Hugging Face GPT-OSS's interleaved [E, H, 2I] is
            `w.view(E, H, I, 2).permute(0, 3, 2, 1)`, read in place), or a sequence of E
            per-expert [2*I, H] tensors (stacked per call; gradients reach each); or its MXFP8 form,
            `mok_inductor.mxfp8.quantize(w)` (or a list of E per-expert quantized [2*I, H] weights): the
            weight gradient then goes to the quantized weight's `master` (docs/api.md, MXFP8).
        down_proj: [E, H, I] routed FC2, or a sequence of E per-expert [H, I] tensors (or its MXFP8 form,
            as gate_up_proj).
        shared_gate_up_proj: optional [2*Is, H] shared expert FC1 (gate rows, then up rows).
        shared_down_proj: optional [H, Is] shared expert FC2.
        shared_output_gate: optional [1, H]; the shared expert's output is scaled by
            sigmoid(x @ shared_output_gate^T) per token.
        swiglu_limit: optional clamp of the SwiGLU: gate clamped above, up clamped to [-limit, limit].
        activation: the gated activation, "swiglu" (silu(g) * u) or "gpt_oss" (g * sigmoid(1.702 g) * (u + 1),
            GPT-OSS's), with the clamp above either way; it applies to the shared expert too.
        gate_up_bias: optional [E, 2*I] routed FC1 bias (gate columns, then up columns), or [E, 2, I] (any
            strides), added before the clamp. Not with a shared expert.
        down_bias: optional [E, H] routed FC2 bias, added to each route's output before its routing weight.
        group: optional torch.distributed process group for expert parallelism (docs/distributed.md):
            each rank passes its own tokens, global expert ids in [-1, E_local * world_size), and the
            weights of its E_local experts (rank r owns [r*E_local, (r+1)*E_local)). None, or a group
            of one rank, is the one-device call.
        options: optional `mok_inductor.Options`, or a dict of changes to the current ones, for this eager
            call (e.g. {"backend": "reference"}). Not under torch.compile: there, wrap the compiled call in
            `with mok_inductor.options.override(...)`.

    Returns:
        [..., H] in x.dtype: shared(x) * gate(x) + sum_k router_weights[k] * expert_{top_experts[k]}(x).
    """
    if torch.compiler.is_dynamo_compiling():
        _options.guard_in_trace()
    if options is not None:
        if torch.compiler.is_compiling():
            raise ValueError(
                "options: a per-call options= cannot be traced by torch.compile (the compiled graph would not "
                "depend on it); wrap the call of the compiled function in `with mok_inductor.options.override(...)`"
            )
        with _options.override(options):
            return moe(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj=shared_gate_up_proj,
                       shared_down_proj=shared_down_proj, shared_output_gate=shared_output_gate,
                       swiglu_limit=swiglu_limit, activation=activation, gate_up_bias=gate_up_bias,
                       down_bias=down_bias, group=group)
    # Kinds first, so a wrong kind gets a TypeError naming it rather than a dispatcher error.
    mx = _mxfp8.is_quantized_arg(gate_up_proj) or _mxfp8.is_quantized_arg(down_proj)
    if not mx:  # split per expert, as the functional ABI takes them: stacked per call (the op takes one tensor)
        gate_up_proj = _checks.stack_per_expert("gate_up_proj", gate_up_proj)
        down_proj = _checks.stack_per_expert("down_proj", down_proj)
    for name, t in (("x", x), ("router_weights", router_weights), ("top_experts", top_experts),
                    ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not (mx and name in ("gate_up_proj", "down_proj")):
            _checks.require_tensor(name, t)
    for name, t in (("shared_gate_up_proj", shared_gate_up_proj), ("shared_down_proj", shared_down_proj),
                    ("shared_output_gate", shared_output_gate)):
        _checks.require_tensor(name, t, optional=True)
    swiglu_limit = _checks.check_swiglu_limit(swiglu_limit)
    act = _types.activation(activation)
    variant = act is not _types.SWIGLU or gate_up_bias is not None or down_bias is not None
    for name, t in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        _checks.require_tensor(name, t, optional=True)
    if x.dim() < 2:
        raise ValueError(f"x: expected shape [..., H] with at least one token dim, got {list(x.shape)}")
    lead = x.shape[:-1]
    if router_weights.dim() != x.dim() or router_weights.shape[:-1] != lead:
        raise ValueError(
            f"router_weights: expected shape {list(lead)} + [K] (the leading dims of x), got {list(router_weights.shape)}"
        )
    if top_experts.shape != router_weights.shape:
        raise ValueError(
            f"top_experts: expected shape {list(router_weights.shape)} (router_weights' shape: the two must match), "
            f"got {list(top_experts.shape)}"
        )
    H = x.shape[-1]
    K = router_weights.shape[-1]
    # before the reshapes below, which cannot flatten a zero-sized last dim and would name no argument
    _checks.check_sizes(math.prod(lead), H, K)
    if group is not None:
        from . import distributed as _distributed

        if _distributed.group_size(group) > 1:
            if mx:
                raise TypeError("gate_up_proj/down_proj: MXFP8 routed weights are not supported with expert "
                                "parallelism (group= of more than one rank) yet; pass bf16 weights")
            autocast = _ops.autocast_dtype(x)
            if autocast is not None:  # the autocast policy of mok::moe (ops.autocast_cast), which this path bypasses
                # (mok::moe's argument positions: the biases follow the MXFP8 arguments and the activation)
                cast = _ops.autocast_cast((x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj,
                                           shared_down_proj, shared_output_gate) + (None,) * 10
                                          + (gate_up_bias, down_bias), autocast)
                x, _, _, gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj, shared_output_gate = cast[:8]
                gate_up_bias, down_bias = cast[18:]
            y = _distributed.moe(x.reshape(-1, H), router_weights.reshape(-1, K), top_experts.reshape(-1, K),
                                 gate_up_proj, down_proj, shared_gate_up_proj, shared_down_proj, shared_output_gate,
                                 swiglu_limit, act, gate_up_bias, down_bias, group=group)
            return y.view(x.shape)
    args = (x.reshape(-1, H), router_weights.reshape(-1, K), top_experts.reshape(-1, K))
    tail = (shared_gate_up_proj, shared_down_proj, shared_output_gate, swiglu_limit)
    # the variant's arguments follow the MXFP8 ones in mok::moe's schema (given only when they differ from the
    # default, so the plain call's graph is unchanged)
    var = (act.name, gate_up_bias, down_bias) if variant else ()
    if mx:  # each routed weight as (data, scale, data_t, scale_t, master): the optional MXFP8 arguments of mok::moe
        gu, gus, gut, gust, gum = _mxfp8.op_args("gate_up_proj", gate_up_proj)
        d, ds, dt, dst, dm = _mxfp8.op_args("down_proj", down_proj)
        y = _ops.call_moe(*args, gu, d, *tail, gus, gut, gust, ds, dt, dst, gum, dm, *var)
    else:
        y = _ops.call_moe(*args, gate_up_proj, down_proj, *tail, *((None,) * 8 if var else ()), *var)
    return y.view(x.shape)
