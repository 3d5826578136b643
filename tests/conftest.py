"""Test-session setup.

- Without CUDA, the Triton kernels run under Triton's interpreter on CPU tensors: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection start.
- Every test session compiles into its own Inductor cache directory, so a stale on-disk cache from
  another checkout can never answer for this one.
"""

import os
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before tests/conftest.py could set TRITON_INTERPRET"
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests use tiny shapes: one intra-op thread is faster there than two fighting over two cores.
torch.set_num_threads(1)

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mok-inductor-cache-"))

sys.path.insert(0, os.path.dirname(__file__))
