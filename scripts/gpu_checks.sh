#!/usr/bin/env bash
# What CI (CPU only) cannot run, for a machine with a CUDA GPU (Hopper), with torch, triton and transformers
# already installed in the python on PATH (as on a GPU machine without network access):
#   1. tests:      every CUDA-only test (pytest -m cuda); extra arguments go to this pytest
#   2. memcheck:   compute-sanitizer's memory checker over the kernels at small shapes (SANITIZED below)
#   3. racecheck:  its shared-memory race checker over the same tests
# STEPS=tests,memcheck,racecheck picks steps (default: all); logs go to ${OUT:-gpu-checks}/. Exit status 0 only
# if every step passed (a sanitizer step fails on any error or hazard it reports).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
steps=${STEPS:-tests,memcheck,racecheck}
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null ||
  { echo "gpu_checks: needs torch and a CUDA GPU (the python on PATH: $(command -v python))" >&2; exit 2; }
python -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || export PYTHONPATH=$PWD

# The CUDA cases of these tests reach every kernel family at small shapes: schedule, gate/up (pointer and TMA
# loads), grouped rows, combine, the SwiGLU backward (fused and two-pass), weight gradients, bias gradients,
# GPT-OSS's layout, the MXFP8 loops, the functional ABI's main-grad accumulation.
SANITIZED=(
  tests/test_moe.py::test_matches_oracle
  tests/test_gpt_oss.py::test_cuda_kernels_against_oracle
  tests/test_mxfp8.py::test_moe_equals_the_computation_on_dequantized_weights
  tests/test_functional.py::test_forward_backward_match_oracle
)

status=0
if [[ $steps == *tests* ]]; then
  echo "gpu_checks: pytest -m cuda (log: $out/tests.log)"
  MOK_FAILLOG=$out/failures.log python -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m cuda \
    tests "$@" >"$out/tests.log" 2>&1 || status=1
  tail -5 "$out/tests.log"
fi
for tool in memcheck racecheck; do
  [[ $steps == *$tool* ]] || continue
  echo "gpu_checks: compute-sanitizer --tool $tool (log: $out/$tool.log)"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 30 \
    python -m pytest -q -p no:cacheprovider -k cuda "${SANITIZED[@]}" >"$out/$tool.log" 2>&1 || status=1
  grep -E "SUMMARY|passed|failed" "$out/$tool.log" | sort | uniq -c
done
exit $status
