"""Argument validation shared by the user API, the op registration and the functional ABI.

Every check here reads only metadata (dtype, shape, device, strides), so it is free under
torch.compile: Dynamo traces it on fake tensors. Checks that read values (expert ids in range)
live in the op implementations (`mok_inductor.ops`), where they run eagerly on the CPU and as a
device-side assert on CUDA. Errors are `TypeError` (wrong kind or dtype) or `ValueError` (wrong
shape, device, value), and every message starts with the argument's name.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch

# The float dtypes the op computes in: activations, weights, routing weights (one dtype per call).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Megatron's main-grad buffers, into which the weight gradients are added.
MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# The kernels compute in float32, so a larger clamp would overflow when the op converts it.
FLOAT32_MAX = torch.finfo(torch.float32).max
# The schedule is int32 (sorted route ids in [0, T*K) and offsets up to T*K).
MAX_ROUTES = 2**31 - 1


def _fmt_dtypes(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _shape(t: torch.Tensor) -> list:
    return list(t.shape)


def require_tensor(name: str, t, *, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def stack_per_expert(name: str, w):
    """A routed weight given split per expert (a list or tuple of E tensors of one shape, dtype and device)
    as the [E, ...] tensor the op takes; anything else is returned as it is, for the op's own checks."""
    if not isinstance(w, (list, tuple)):
        return w
    if len(w) == 0:
        raise ValueError(f"{name}: expected at least one expert, got an empty {type(w).__name__}")
    for e, t in enumerate(w):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or a sequence of per-expert tensors, got "
                            f"{type(t).__name__} at index {e}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected 2-D per-expert tensors, got shape {_shape(t)} at index {e}")
        if t.shape != w[0].shape or t.dtype != w[0].dtype or t.device != w[0].device:
            raise ValueError(
                f"{name}: expected per-expert tensors of one shape, dtype and device, got {_shape(w[0])} "
                f"{str(w[0].dtype).replace('torch.', '')} on {w[0].device} at index 0 and {_shape(t)} "
                f"{str(t.dtype).replace('torch.', '')} on {t.device} at index {e}"
            )
    return torch.stack(tuple(w))


def require_dtype(name: str, t: torch.Tensor, dtypes, why: str = "") -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {_fmt_dtypes(dtypes)}{why}, got {str(t.dtype).replace('torch.', '')}")


# (a weight's dtype must be x's: the message says how to get there)
_AS_X = " (x's dtype: cast the weights, or run under torch.autocast, which casts both)"


def require_dim(name: str, t: torch.Tensor, dim: int, what: str) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor {what}, got shape {_shape(t)}")


def require_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of x), got one on {t.device}")


def require_shape(name: str, t: torch.Tensor, expected: Sequence, what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {list(expected)} {what}, got {_shape(t)}")


def _traced_numpy(v) -> bool:
    """Whether `v` is a NumPy scalar as Dynamo traces it: a numpy.ndarray stand-in for a graph input, whose
    float() is a data-dependent value the checks below cannot compare (np.float64, a float subclass, is a
    constant and passes as one)."""
    t = type(v)
    return torch.compiler.is_compiling() and t.__name__ == "ndarray" and getattr(t, "__module__", None) == "numpy"


def check_swiglu_limit(swiglu_limit) -> Optional[float]:
    if swiglu_limit is None:
        return None
    if _traced_numpy(swiglu_limit):
        raise TypeError("swiglu_limit: torch.compile traces a NumPy scalar as a tensor, not a constant; pass "
                        "float(swiglu_limit)")
    # numbers.Real also takes NumPy scalars (np.float32 limits read from a config); bools are not limits
    if isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, numbers.Real):
        raise TypeError(f"swiglu_limit: expected a float or None, got {type(swiglu_limit).__name__}")
    value = float(swiglu_limit)
    # also false for NaN and inf; traceable when value is a SymFloat. finfo here, not the FLOAT32_MAX global:
    # torch.compile(dynamic=True) makes a module's float global a symbol, then restarts the trace to specialise it
    if not (0.0 < value <= torch.finfo(torch.float32).max):
        raise ValueError(
            f"swiglu_limit: expected a finite positive float (at most the float32 maximum, {FLOAT32_MAX:.7g}), "
            f"got {swiglu_limit}"
        )
    return value


def check_sizes(T, H, K) -> None:
    """The sizes of a call: a hidden size and a route count of at least 1, and T*K routes within the
    int32 schedule (T = 0 is a valid empty call)."""
    if H == 0:
        raise ValueError("x: expected a hidden size H >= 1 (the last dim of x), got H = 0")
    if K == 0:
        raise ValueError("router_weights: expected at least one route per token (K >= 1, the last dim), got K = 0")
    if T * K > MAX_ROUTES:
        raise ValueError(
            f"top_experts: {T} tokens x {K} routes = {T * K} routes, more than the int32 schedule holds "
            f"({MAX_ROUTES}); split the call into smaller token batches"
        )


def check_moe_args(
    x: torch.Tensor,
    router_weights: torch.Tensor,
    top_experts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    shared_gate_up_proj: Optional[torch.Tensor],
    shared_down_proj: Optional[torch.Tensor],
    shared_output_gate: Optional[torch.Tensor],
    swiglu_limit,
) -> None:
    """Validate the flattened arguments of `torch.ops.mok.moe` (x is [T, H])."""
    require_tensor("x", x)
    require_dtype("x", x, FLOAT_DTYPES)
    require_dim("x", x, 2, "[T, H]")
    T, H = x.shape
    device = x.device
    if H == 0:  # named with x, before the other arguments' checks
        check_sizes(T, H, 1)

    require_tensor("router_weights", router_weights)
    if not router_weights.dtype.is_floating_point:
        raise TypeError(
            f"router_weights: expected a floating-point dtype (float32 preferred), got "
            f"{str(router_weights.dtype).replace('torch.', '')}"
        )
    require_dim("router_weights", router_weights, 2, "[T, K]")
    require_device("router_weights", router_weights, device)
    if router_weights.shape[0] != T:
        raise ValueError(
            f"router_weights: expected {T} rows (one per token of x), got shape {_shape(router_weights)}"
        )
    K = router_weights.shape[1]
    check_sizes(T, H, K)

    require_tensor("top_experts", top_experts)
    require_dtype("top_experts", top_experts, INDEX_DTYPES)
    require_device("top_experts", top_experts, device)
    require_shape("top_experts", top_experts, (T, K), "(router_weights' shape [T, K]: the two must match)")

    require_tensor("gate_up_proj", gate_up_proj)
    require_dtype("gate_up_proj", gate_up_proj, (x.dtype,), _AS_X)
    if gate_up_proj.dim() == 4:  # [E, 2, I, H] (index 0 gate rows, 1 up rows; any strides: GPT-OSS's layout)
        if gate_up_proj.shape[1] != 2:
            raise ValueError(f"gate_up_proj: expected a 4-D FC1 of shape [E, 2, I, H] (gate rows, up rows), got "
                             f"{_shape(gate_up_proj)}")
        # checked below as the [E, 2I, H] it stands for (a stand-in with its dtype and device: no copy)
        E4, _, I4, H4 = gate_up_proj.shape
        gate_up_proj = gate_up_proj.new_empty(()).expand(E4, 2 * I4, H4)
    require_dim("gate_up_proj", gate_up_proj, 3, "[E, 2*I, H] (or [E, 2, I, H])")
    require_device("gate_up_proj", gate_up_proj, device)
    E, two_i, h_w = gate_up_proj.shape
    if h_w != H:
        raise ValueError(f"gate_up_proj: expected shape [E, 2*I, {H}] (H of x), got {_shape(gate_up_proj)}")
    if two_i % 2 != 0:
        raise ValueError(f"gate_up_proj: expected an even second dim (gate rows then up rows), got {_shape(gate_up_proj)}")
    if E < 1:
        raise ValueError(f"gate_up_proj: expected at least one expert, got shape {_shape(gate_up_proj)}")
    I = two_i // 2

    require_tensor("down_proj", down_proj)
    require_dtype("down_proj", down_proj, (x.dtype,), _AS_X)
    require_device("down_proj", down_proj, device)
    require_shape("down_proj", down_proj, (E, H, I), "[E, H, I] (matching gate_up_proj [E, 2*I, H])")

    require_tensor("shared_gate_up_proj", shared_gate_up_proj, optional=True)
    require_tensor("shared_down_proj", shared_down_proj, optional=True)
    require_tensor("shared_output_gate", shared_output_gate, optional=True)
    if (shared_gate_up_proj is None) != (shared_down_proj is None):
        missing = "shared_down_proj" if shared_down_proj is None else "shared_gate_up_proj"
        raise ValueError(f"{missing}: the shared expert needs both shared_gate_up_proj and shared_down_proj")
    if shared_gate_up_proj is not None:
        require_dtype("shared_gate_up_proj", shared_gate_up_proj, (x.dtype,), _AS_X)
        require_dim("shared_gate_up_proj", shared_gate_up_proj, 2, "[2*Is, H]")
        require_device("shared_gate_up_proj", shared_gate_up_proj, device)
        two_is, hs = shared_gate_up_proj.shape
        if hs != H or two_is % 2 != 0:
            raise ValueError(
                f"shared_gate_up_proj: expected shape [2*Is, {H}] with an even first dim, got "
                f"{_shape(shared_gate_up_proj)}"
            )
        require_dtype("shared_down_proj", shared_down_proj, (x.dtype,), _AS_X)
        require_device("shared_down_proj", shared_down_proj, device)
        require_shape(
            "shared_down_proj", shared_down_proj, (H, two_is // 2), "[H, Is] (matching shared_gate_up_proj [2*Is, H])"
        )
    if shared_output_gate is not None:
        if shared_gate_up_proj is None:
            raise ValueError("shared_output_gate: given without a shared expert (shared_gate_up_proj is None)")
        require_dtype("shared_output_gate", shared_output_gate, (x.dtype,), _AS_X)
        require_device("shared_output_gate", shared_output_gate, device)
        require_shape("shared_output_gate", shared_output_gate, (1, H), "[1, H]")
    check_swiglu_limit(swiglu_limit)


def check_variant(x, gate_up_proj, down_proj, shared_gate_up_proj, gate_up_bias, down_bias) -> None:
    """The routed biases (after `check_moe_args` accepted the weights): gate_up_bias [E, 2*I] (gate columns then
    up columns) or [E, 2, I] (any strides), down_bias [E, H], x's dtype and device; not with a shared expert
    (its biases are not supported, and routed biases with an unbiased shared expert match no model)."""
    E, H = down_proj.shape[0], down_proj.shape[1]
    I = down_proj.shape[2]
    for name, b in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if b is None:
            continue
        require_tensor(name, b)
        require_dtype(name, b, (x.dtype,), _AS_X)
        require_device(name, b, x.device)
        if shared_gate_up_proj is not None:
            raise ValueError(f"{name}: routed biases are not supported with a shared expert (shared_gate_up_proj)")
    if gate_up_bias is not None and tuple(gate_up_bias.shape) not in ((E, 2 * I), (E, 2, I)):
        raise ValueError(f"gate_up_bias: expected shape [{E}, {2 * I}] or [{E}, 2, {I}] ([E, 2*I] or [E, 2, I] of "
                         f"gate_up_proj), got {_shape(gate_up_bias)}")
    if down_bias is not None:
        require_shape("down_bias", down_bias, (E, H), "[E, H] (of down_proj [E, H, I])")


def expert_ids_message(num_experts: int, found=None) -> str:
    """The message of an expert id outside [-1, E): with the offending value where it was read (the CPU
    check), else (a device-side assert, which cannot read it back without a host synchronisation) how to see it."""
    msg = f"top_experts: expected expert indices in [-1, {num_experts}) (-1 means no route)"
    if found is not None:
        return f"{msg}, found {found}"
    return (f"{msg}, found one outside (checked on the device, which does not read the value back; run the call "
            "on the CPU to see it)")


def check_expert_ids_eager(top_experts: torch.Tensor, num_experts: int) -> None:
    """The value check of SPEC section 5 for the CPU path (reads values; never traced)."""
    if top_experts.numel() == 0:
        return
    lo = int(top_experts.min())
    hi = int(top_experts.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(expert_ids_message(num_experts, lo if lo < -1 else hi))
