#!/usr/bin/env bash
# The whole test suite: set up .venv, then run pytest over tests/ in two worker processes (the tests pin one
# intra-op thread each, so two workers use both cores of the CI machine). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --durations=20 tests "$@"
