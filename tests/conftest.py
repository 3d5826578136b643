"""Test-session setup.

- Without CUDA, the Triton kernels run under Triton's interpreter on CPU tensors: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection start.
- Every test session compiles into its own Inductor cache directory, so a stale on-disk cache from
  another checkout can never answer for this one.
"""

import os
import sys
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before tests/conftest.py could set TRITON_INTERPRET"
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests use tiny shapes: one intra-op thread is faster there than two fighting over two cores.
torch.set_num_threads(1)

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mok-inductor-cache-"))

sys.path.insert(0, os.path.dirname(__file__))


def pytest_runtest_logreport(report):
    """MOK_FAILLOG=path: append each failure's traceback to that file as it happens (device runs end at a
    time limit, possibly before pytest's summary)."""
    path = os.environ.get("MOK_FAILLOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


def pytest_sessionfinish(session, exitstatus):
    """No process group may outlive the tests: a gloo group still alive when the interpreter shuts down
    can abort the process (SIGABRT) as one of its threads frees a finished collective's tensors."""
    import gc

    from _helpers import gloo_threads

    gc.collect()
    left = gloo_threads()
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"gloo threads alive at the end of the session (a process group outlived its tests): {left}"
        if reporter is not None:
            reporter.write_line(f"ERROR: {message}", red=True)
        else:
            print(f"ERROR: {message}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
