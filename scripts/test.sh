#!/usr/bin/env bash
# The whole test suite: set up .venv, then run pytest over tests/. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
