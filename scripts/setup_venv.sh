#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the pinned requirements and the
# package itself installed in editable mode. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
