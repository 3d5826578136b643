#!/usr/bin/env bash
# The main job: set up .venv, then run the demo (a MoE layer with a gated shared expert through
# mok_inductor.moe, eager and compiled, forward and backward, against the float64 reference; first-call and
# steady-state times; what Dynamo captured). Extra arguments go to examples/demo.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python examples/demo.py "$@"
