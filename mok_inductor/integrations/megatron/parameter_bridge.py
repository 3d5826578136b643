"""The main-grad bridge: Megatron DDP's gradient-accumulation-fusion protocol.

Megatron's DDP gives every parameter a `main_grad` buffer (float32 or bfloat16, the parameter's
shape) and a `grad_added_to_main_grad` flag (set to False when DDP wraps the model and again each
time it zeroes its buffers), and hooks each parameter's gradient accumulator: the hook adds
`param.grad` into `main_grad` unless the flag says the backward already did, then drops `param.grad`.
The MoK op adds weight gradients into `main_grad` itself, so the autograd function sets the flag and
returns a hook-only gradient whose one job is to make autograd run that hook (with
`overlap_grad_reduce`, the hook is what tells DDP a bucket is ready).

The hook-only gradient is `param.detach()`: it shares the weight's storage, so the gradient
accumulator keeps it as `param.grad` without allocating or zero-filling anything, and DDP's hook drops
it. It is only safe when that hook exists; a parameter without DDP's flag gets no gradient at all (as
Megatron's own fused-wgrad linear layers do), and a `param.grad` left over from an earlier backward
stops the backward before autograd could add into it (see `finish_weight_gradient`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..._checks import MAIN_GRAD_DTYPES

# The attribute Megatron's DDP (and Megatron-FSDP) sets on every parameter it manages: its presence is
# how a backward knows that DDP's gradient hook will drop the hook-only gradient.
DDP_FLAG = "grad_added_to_main_grad"


def main_grad_buffer(param: torch.Tensor) -> torch.Tensor:
    """`param.main_grad`, checked in this order (RuntimeError naming the problem): present, the
    parameter's shape, FP32 or BF16, contiguous, no `zero_out_wgrad` (which asks for a gradient in
    `param.grad`), on the parameter's device. Nothing is written."""
    mg = getattr(param, "main_grad", None)
    shape = list(param.shape)
    if mg is None:
        raise RuntimeError(
            f"MoK with gradient_accumulation_fusion=True requires DDP to assign param.main_grad, but the parameter "
            f"of shape {shape} has none: wrap the model in Megatron's DistributedDataParallel, or set "
            "gradient_accumulation_fusion=False"
        )
    if not isinstance(mg, torch.Tensor) or list(mg.shape) != shape:
        got = list(mg.shape) if isinstance(mg, torch.Tensor) else type(mg).__name__
        raise RuntimeError(f"MoK weight-gradient shape mismatch: param.main_grad is {got}, the parameter {shape}")
    if mg.dtype not in MAIN_GRAD_DTYPES:
        raise RuntimeError(
            f"MoK adds weight gradients into an FP32 or BF16 main_grad, got {mg.dtype} (parameter shape {shape})"
        )
    if not mg.is_contiguous():
        raise RuntimeError(
            f"MoK adds weight gradients in place and requires a contiguous main_grad; got strides "
            f"{list(mg.stride())} for shape {shape}"
        )
    if getattr(param, "zero_out_wgrad", False):
        raise RuntimeError(
            f"MoK: zero_out_wgrad is set on a parameter of shape {shape}; MoK accumulates into main_grad and "
            "cannot hand back a separate weight gradient"
        )
    if mg.device != param.device:
        raise RuntimeError(
            f"MoK requires param.main_grad on the parameter device: main_grad is on {mg.device}, the parameter of "
            f"shape {shape} on {param.device}"
        )
    return mg


def dummy_weight_gradient(param: torch.Tensor) -> torch.Tensor:
    """The hook-only gradient of `param`: `param.detach()`, an alias of the weight (no new storage, no
    autograd history). Only for parameters whose gradient hook drops `param.grad` (Megatron DDP's);
    `finish_weight_gradient` decides when that holds."""
    return param.detach()


def finish_weight_gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
    """What a backward returns for a weight whose gradient it has already added into `main_grad`.

    - The parameter carries DDP's `grad_added_to_main_grad` flag: set the flag and return the hook-only
      `dummy_weight_gradient` (allocates nothing); DDP's hook skips the add and drops `param.grad`.
    - No flag (no DDP hook to run): return None, so autograd stores nothing in `param.grad`.

    RuntimeError if `param.grad` is still set while the flag is present: nothing dropped the previous
    backward's hook-only gradient (it aliases the weight), and autograd would now add into it.
    """
    if not hasattr(param, DDP_FLAG):
        return None
    if param.grad is not None:
        aliased = param.grad.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
        raise RuntimeError(
            f"MoK: param.grad of a parameter of shape {list(param.shape)} is still set from an earlier backward"
            f"{' and aliases the weight' if aliased else ''}; with gradient_accumulation_fusion=True the gradient "
            "is in param.main_grad and DDP's gradient hook must drop param.grad after each backward. The "
            f"parameter has `{DDP_FLAG}` but nothing cleared param.grad: wrap the model in Megatron's "
            f"DistributedDataParallel, or remove `{DDP_FLAG}` from parameters that no DDP hook manages"
        )
    setattr(param, DDP_FLAG, True)
    return dummy_weight_gradient(param)
