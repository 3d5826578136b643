"""The main-grad bridge: Megatron DDP's gradient-accumulation-fusion protocol.

Megatron's DDP gives every parameter a `main_grad` buffer (float32 or bfloat16, the parameter's
shape) and a `grad_added_to_main_grad` flag, and hooks each parameter's gradient accumulator: the hook
adds `param.grad` into `main_grad` unless the flag says the backward already did, then drops
`param.grad`. The MoK op adds weight gradients into `main_grad` itself, so the autograd function sets
the flag and returns a dummy gradient that only exists to fire the hook.
"""

from __future__ import annotations

import torch

from ..._checks import MAIN_GRAD_DTYPES


def main_grad_buffer(param: torch.Tensor) -> torch.Tensor:
    """`param.main_grad`, checked: present, the parameter's shape, float32/bfloat16, contiguous, on the
    parameter's device, and no `zero_out_wgrad` (which asks for a gradient in `param.grad`)."""
    mg = getattr(param, "main_grad", None)
    shape = list(param.shape)
    if mg is None:
        raise RuntimeError(
            f"MoK with gradient_accumulation_fusion=True adds weight gradients into param.main_grad, but the "
            f"parameter of shape {shape} has none: wrap the model in Megatron's DistributedDataParallel (it is "
            "DDP's job to assign param.main_grad), or set gradient_accumulation_fusion=False"
        )
    if not isinstance(mg, torch.Tensor) or list(mg.shape) != shape:
        got = list(mg.shape) if isinstance(mg, torch.Tensor) else type(mg).__name__
        raise RuntimeError(f"MoK: param.main_grad must have the parameter's shape {shape}, got {got}")
    if mg.dtype not in MAIN_GRAD_DTYPES:
        raise RuntimeError(f"MoK: param.main_grad must be FP32 or BF16, got {mg.dtype} (parameter shape {shape})")
    if not mg.is_contiguous():
        raise RuntimeError(f"MoK: param.main_grad must be contiguous (parameter shape {shape})")
    if getattr(param, "zero_out_wgrad", False):
        raise RuntimeError(
            f"MoK: zero_out_wgrad is set on a parameter of shape {shape}; MoK accumulates into main_grad and "
            "cannot hand back a separate weight gradient"
        )
    if mg.device != param.device:
        raise RuntimeError(f"MoK: param.main_grad is on {mg.device}, the parameter on {param.device}")
    return mg


def dummy_weight_gradient(param: torch.Tensor) -> torch.Tensor:
    """A hook-only gradient for `param`: an all-zero tensor of its shape and dtype backed by ONE element
    (a stride-0 expansion), so it can never alias the weight. (Returning `param.detach()` would let the
    gradient accumulator keep the weight's own storage as `param.grad`; without DDP's hook clearing it,
    the next micro-batch would then add into the weights.) The real gradient is in main_grad."""
    return torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)


def finish_weight_gradient(param: torch.Tensor) -> torch.Tensor:
    """Mark `param`'s gradient as already added into main_grad and return its dummy gradient."""
    param.grad_added_to_main_grad = True
    return dummy_weight_gradient(param)
