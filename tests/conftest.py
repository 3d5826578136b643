"""Test-session setup.

- Without CUDA, the Triton kernels run under Triton's interpreter on CPU tensors: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection start.
- Every test session compiles into its own Inductor cache directory, so a stale on-disk cache from
  another checkout can never answer for this one, and has its own (empty) user tile-config table folder.
- The `cuda` marker (pyproject.toml) is kept true both ways: a test marked `cuda` is skipped without CUDA, with
  that reason, and every test skipped for "needs CUDA" carries the marker, so `pytest -m cuda` on a GPU
  machine selects exactly the tests CI never runs, and `-m "not cuda"` the ones it does.
- `poisoned_empty`: a fixture for tests whose kernels write into buffers from torch.empty (NaN-filled there).
"""

import os
import re
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
# ... and reads tile-config tables from a folder of its own (empty: the shipped tables alone), never the user's
os.environ.setdefault("MOK_TABLES_DIR", tempfile.mkdtemp(prefix="mok-inductor-tables-"))

sys.path.insert(0, os.path.dirname(__file__))


# The reasons the suite gives a CUDA-only skip: "needs CUDA", or "needs CUDA: why" / "needs CUDA (why)". Not
# "needs CUDA or TRITON_INTERPRET=1": the interpreter runs those tests on CPU.
_NEEDS_CUDA = re.compile(r"needs CUDA(?:$|[:(]| \()")
_NO_CUDA_REASON = "needs CUDA (torch.cuda.is_available() is False)"


def _skips_for_cuda(mark) -> bool:
    return mark.name == "skipif" and bool(_NEEDS_CUDA.match(str(mark.kwargs.get("reason", ""))))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    for item in items:
        marks = list(item.iter_markers())
        if any(_skips_for_cuda(m) for m in marks) and not any(m.name == "cuda" for m in marks):
            item.add_marker(pytest.mark.cuda)
        if not cuda and item.get_closest_marker("cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=_NO_CUDA_REASON))


def pytest_runtest_logreport(report):
    """MOK_FAILLOG=path: append each failure's traceback to that file as it happens (device runs end at a
    time limit, possibly before pytest's summary)."""
    path = os.environ.get("MOK_FAILLOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty and Tensor.new_empty from here on give NaN-filled float tensors and zero-filled integer ones
    (the decode forward's id check reads 0 as "a bad id": a flag never written fails the call)."""
    real_empty, real_new_empty = torch.empty, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(0)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(real_new_empty(self, *a, **kw)))
