#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the pinned requirements and the
# package itself installed in editable mode. Idempotent: a second run installs nothing new (and takes seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup_venv: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
if .venv/bin/python -c "import torch" 2>/dev/null; then
  say "checking the pinned requirements (requirements.txt) in .venv ..."
else
  say "installing the pinned requirements (requirements.txt: torch 2.13.0, triton 3.6.0, transformers 5.23.0,"
  say "megatron-core 0.16.1, pytest ...). torch is the large one (on Linux PyPI's torch wheel brings CUDA"
  say "libraries, a few GB): this takes a few minutes the first time"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
say "installing mok-inductor itself (editable, from this checkout)"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
say "ready: $(.venv/bin/python -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")' 2>/dev/null || .venv/bin/python -c 'import torch; print(f"torch {torch.__version__}")')"
