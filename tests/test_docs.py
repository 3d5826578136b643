"""The documentation stays true: every ```python block of README.md and docs/*.md runs as written, the demo
runs, the files the pages cite exist, and the install metadata agrees with the pinned test environment.

Each page's blocks run in one fresh Python process (so `enable()`, `set_default` and the like stay there), each
block in a namespace of its own: a block must be complete, as a reader would copy it. The blocks run on the CPU
at tiny shapes. A block that cannot run here is preceded by a `<!-- no-test: why -->` line (it needs CUDA, a
process group, a download); `OPTED_OUT` below counts them per page, so opting a block out is a visible change of
this file, and even those blocks must parse.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "text")  # every fence names one, so no Python hides in an untagged block

# page -> the number of its ```python blocks marked `<!-- no-test: ... -->`
OPTED_OUT = {
    "docs/distributed.md": 3,  # a process group of several ranks under torchrun (one with NCCL and a download)
    "docs/megatron.md": 2,  # a Megatron-LM training script's model provider; a Megatron-Core model in its groups
    "docs/transformers.md": 0,
}

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_NO_TEST = re.compile(r"^\s*<!--\s*no-test:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    no_test: Optional[str]  # the reason given in a `<!-- no-test: ... -->` line right above the fence


def blocks(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, language, start = len(m.group(1)), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not _FENCE.match(lines[i]):
            body.append(lines[i][indent:])
            i += 1
        assert i < len(lines), f"{page}:{start + 1}: a code fence is never closed"
        above = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        no_test = _NO_TEST.match(above)
        found.append(Block(page, start + 1, language, "\n".join(body) + "\n", no_test and no_test.group(1)))
        i += 1
    return found


def python_blocks(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.language == "python"]


def test_every_fence_names_a_language_and_python_blocks_parse():
    for page in PAGES:
        for b in blocks(page):
            assert b.language in LANGUAGES, f"{b.page}:{b.line}: fence language {b.language!r}, not one of {LANGUAGES}"
            if b.language == "python":
                try:
                    ast.parse(b.code, f"{b.page}:{b.line}")
                except SyntaxError as e:
                    pytest.fail(f"{b.page}:{b.line}: not Python as written: {e}")


def test_opted_out_blocks_are_few_and_listed():
    got = {page: [(b.line, b.no_test) for b in python_blocks(page) if b.no_test is not None] for page in PAGES}
    got = {page: v for page, v in got.items() if v}
    listing = "\n".join(f"  {page}:{line}: {why}" for page, v in got.items() for line, why in v)
    assert {p: len(v) for p, v in got.items()} == {p: n for p, n in OPTED_OUT.items() if n}, (
        f"blocks opted out of running (update OPTED_OUT only with a reason):\n{listing}")
    assert all(why for v in got.values() for _, why in v), listing


# Runs each block of one page in its own namespace in this (fresh) process; reports the failing block's line.
_RUNNER = r"""
import json, sys, traceback
for page, line, code in json.loads(sys.argv[1]):
    print(f"----- {page}:{line}", flush=True)
    try:
        exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        print(f"FAILED: the block at {page}:{line}", flush=True)
        sys.exit(1)
"""


def _child_env():
    env = dict(os.environ)  # TRITON_INTERPRET, the session's Inductor cache and tables folders (conftest.py)
    env["OMP_NUM_THREADS"] = "1"  # tiny shapes: one thread is faster on a shared 2-core machine
    return env


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.no_test is None for b in python_blocks(p))])
def test_page_snippets_run(page, tmp_path):
    todo = [(b.page, b.line, b.code) for b in python_blocks(page) if b.no_test is None]
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(todo)], cwd=tmp_path, env=_child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


def test_demo_runs_and_reports(tmp_path):
    """The README's first command (scripts/demo.sh runs examples/demo.py): at a small size and with the
    "aot_eager" backend (the same graphs, no code generation), it passes its own checks and prints the times and
    what Dynamo captured."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--tokens", "24", "--hidden", "64", "--intermediate", "32",
         "--shared-intermediate", "32", "--experts", "4", "--steady-calls", "2", "--compile-backend", "aot_eager"],
        cwd=tmp_path, env=_child_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr[-4000:]}"
    assert re.search(r"^\s+eager\s+\S+ m?s\s+\S+ m?s$", out, re.M), out
    assert re.search(r"^\s+torch\.compile \(aot_eager\)\s+\S+ m?s\s+\S+ m?s$", out, re.M), out
    assert "1 graph, 0 graph breaks, mok ops in the graph: mok::moe" in out, out
    assert out.rstrip().splitlines()[-1].startswith("OK: "), out


def test_readme_setup_commands_exist():
    """The README's two set-up commands name scripts of this repository."""
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"^\s{4}(bash scripts/\S+)\s*$", text, re.M)
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"], commands
    for c in commands:
        assert (ROOT / c.split()[1]).is_file(), c


_CITED = re.compile(r"`((?:docs|examples|scripts|benchmarks|tests|lowering|mok_inductor)/[^`\s]*)`")
# paths the pages cite that are not this repository's files, each named as what it is where it is cited
NOT_OURS = {
    "tests/unit_tests/transformer/moe/test_mok_megakernel.py",  # Megatron-LM's test of its MoK bridge
    "mok_inductor/lowering/",  # where `lowering/` lands in an installed wheel
}


def test_cited_repository_files_exist():
    """Every repository path a page cites in backticks exists (a page citing files outside the repository, or
    a renamed one, fails here). Patterns (`<gpu>`, `{json,png}`, `*`) are left out."""
    missing = []
    for page in [*PAGES, "benchmarks/README.md"]:
        text = (ROOT / page).read_text()
        # the project's working notes (shared/SPEC.md and the like) are not part of the repository
        missing += [f"{page}: {m}" for m in re.findall(r"\bshared/[A-Z]\w*\.md", text)]
        for path in _CITED.findall(text):
            path = path.split("::")[0].rstrip(".,:;")
            if re.search(r"[<{*]", path) or path in NOT_OURS:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page}: {path}")
    assert not missing, "\n".join(missing)


def test_pinned_environment_is_inside_the_declared_bounds():
    """requirements.txt pins one release of each package pyproject.toml declares (runtime and `dev`), inside
    the declared bounds, so `pip install -e .[dev]` and scripts/setup_venv.sh describe the same tested set."""
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in [*meta["dependencies"], *meta["optional-dependencies"]["dev"]]]
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            pins[r.name.lower()] = r
    for req in declared:
        pin = pins.get(req.name.lower())
        assert pin is not None, f"requirements.txt does not pin {req.name} (pyproject.toml: {req})"
        exact = [s.version for s in pin.specifier if s.operator == "=="]
        if exact:
            assert req.specifier.contains(exact[0], prereleases=True), f"requirements.txt {pin} is outside {req}"
        else:
            assert str(pin.specifier) == str(req.specifier), f"requirements.txt {pin} differs from pyproject {req}"
    for name in ("hf", "transformers", "megatron"):
        assert name in meta["optional-dependencies"], f"pyproject.toml has no [{name}] extra"
