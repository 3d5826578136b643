"""Test-session setup.

- Without CUDA, the Triton kernels run under Triton's interpreter on CPU tensors: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection start.
- Every test session compiles into its own Inductor cache directory, so a stale on-disk cache from
  another checkout can never answer for this one.
- Fresh random inputs each session: the seeded generators of tests/_helpers.py (`make_case`,
  `random_like`) add MOK_TEST_SEED, drawn here when unset (the header prints it: set it to repeat a run).
"""

import os
import random
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

os.environ.setdefault("MOK_TEST_SEED", str(random.SystemRandom().randrange(2 ** 30)))  # (xdist workers inherit it)


def pytest_report_header(config):
    return f"mok-inductor test seed: MOK_TEST_SEED={os.environ['MOK_TEST_SEED']}"


def pytest_runtest_logreport(report):
    """MOK_FAILLOG=path: append each failure's traceback to that file as it happens (device runs end at a
    time limit, possibly before pytest's summary)."""
    path = os.environ.get("MOK_FAILLOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
