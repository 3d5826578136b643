"""scripts/gpu_checks.sh (the CUDA tests and the sanitizers, for a GPU machine): on a machine without one it
stops with exit status 2 before doing anything, its file list is every test file with CUDA cases, and the tests
it hands to compute-sanitizer exist and have CUDA cases (a renamed test would otherwise leave the sanitizer runs
checking nothing)."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "gpu_checks.sh")


def _array(name: str) -> list:
    text = open(SCRIPT).read()
    return re.search(name + r"=\((.*?)\)", text, re.S).group(1).split()


def test_tests_step_covers_every_file_with_cuda_cases():
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                          "tests"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = {line.split("::")[0] for line in run.stdout.splitlines() if "::" in line}
    order = _array("ORDER")
    assert len(order) == len(set(order))
    assert files and files == set(order), (sorted(files - set(order)), sorted(set(order) - files))


def test_sanitized_tests_have_cuda_cases():
    ids = _array("SANITIZED")
    assert len(ids) >= 4
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-k", "cuda",
                          *ids], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    for node in ids:
        assert any(line.startswith(node + "[") and "cuda" in line for line in collected), node


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_stops_before_any_work(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""))
    run = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2 and "needs torch and a CUDA GPU" in run.stderr, run.stderr
    assert not (tmp_path / "out" / "pip.log").exists()
