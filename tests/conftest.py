"""Test-session setup.

- Without CUDA, the Triton kernels run under Triton's interpreter on CPU tensors: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection start.
- Every test session compiles into its own Inductor cache directory, so a stale on-disk cache from
  another checkout can never answer for this one, and has its own (empty) user tile-config table folder.
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
# ... and reads tile-config tables from a folder of its own (empty: the shipped tables alone), never the user's
os.environ.setdefault("MOK_TABLES_DIR", tempfile.mkdtemp(prefix="mok-inductor-tables-"))

sys.path.insert(0, os.path.dirname(__file__))


def pytest_runtest_logreport(report):
    """MOK_FAILLOG=path: append each failure's traceback to that file as it happens (device runs end at a
    time limit, possibly before pytest's summary)."""
    path = os.environ.get("MOK_FAILLOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
