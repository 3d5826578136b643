"""mok-inductor: a fused Mixture-of-Experts megakernel for PyTorch (Triton on CUDA, PyTorch on CPU).

    import mok_inductor
    y = mok_inductor.moe(x, router_weights, top_experts, gate_up_proj, down_proj, ...)

Layers: `api` (user API) -> `ops` (the torch.library `mok::` ops) -> `reference` (CPU path and
oracle) / `kernels` (Triton). Inductor integration lives in the top-level `lowering` package and
model integrations under `mok_inductor.integrations`.
"""

from .api import moe
from .ops import path_name

__version__ = "0.1.0"

__all__ = ["moe", "path_name", "__version__"]
