#!/usr/bin/env bash
# What CI (CPU only) cannot run, for a machine with a CUDA GPU (Hopper), with torch, triton and transformers
# already installed in the python on PATH (as on a GPU machine without network access):
#   1. tests:      every CUDA-only test (pytest -m cuda), file by file in the order of FILES below (the kernels'
#                  numbers first, the slow compile tests last); extra arguments go to this pytest
#   2. memcheck:   compute-sanitizer's memory checker over the kernels at small shapes (SANITIZED below)
#   3. racecheck:  its shared-memory race checker over the same tests
# STEPS=tests,memcheck,racecheck picks steps (default: all); FILES="tests/test_a.py ..." limits the tests step;
# WHEELS=DIR installs the wheels in DIR first (without network: e.g. expecttest, which tests/test_errors.py needs);
# logs go to ${OUT:-gpu-checks}/. Every test's result is logged as it finishes (pytest -v) and each sanitized test
# runs in its own sanitizer process with its own summary line, so a run cut short still says what passed.
# Exit status 0 only if every step passed (a sanitizer step fails on any error or hazard it reports).
# On an H100 memcheck takes under 2 minutes and racecheck several (three of the four tests: 1.7 minutes); the
# tests step takes longer than a 10-minute call: split it with FILES.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
steps=${STEPS:-tests,memcheck,racecheck}
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" 2>/dev/null ||
  { echo "gpu_checks: needs torch and a CUDA GPU (the python on PATH: $(command -v python))" >&2; exit 2; }
if [[ -n ${WHEELS:-} ]]; then python -m pip install -q --no-deps "$WHEELS"/*.whl >"$out/pip-wheels.log" 2>&1 ||
  echo "gpu_checks: installing the wheels of $WHEELS failed (log: $out/pip-wheels.log)" >&2; fi
# (installed, not put on PYTHONPATH: the repository's lowering/ folder is mok_inductor.lowering only once installed)
python -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 ||
  { echo "gpu_checks: pip install -e . failed (log: $out/pip.log)" >&2; exit 2; }

# Every test file with CUDA cases (tests/test_gpu_checks.py checks that none is missing).
ORDER=(
  tests/test_gpt_oss.py tests/test_moe.py tests/test_functional.py tests/test_mxfp8.py tests/test_kernels.py
  tests/test_transformers.py tests/test_functorch.py tests/test_autocast.py tests/test_determinism.py
  tests/test_runtime.py tests/test_megatron.py tests/test_distributed.py tests/test_errors.py tests/test_opcheck.py
  tests/test_patterns_cuda.py tests/test_compile_inductor.py
)
# The CUDA cases of these tests reach every kernel family at small shapes: schedule, gate/up (pointer and TMA
# loads), grouped rows, combine, the SwiGLU backward (fused and two-pass), weight gradients, bias gradients,
# GPT-OSS's layout, the MXFP8 loops, the functional ABI's main-grad accumulation.
SANITIZED=(
  tests/test_gpt_oss.py::test_cuda_kernels_against_oracle
  tests/test_functional.py::test_forward_backward_match_oracle
  tests/test_mxfp8.py::test_moe_equals_the_computation_on_dequantized_weights
  tests/test_moe.py::test_matches_oracle
)

status=0
if [[ $steps == *tests* ]]; then
  read -ra files <<<"${FILES:-${ORDER[*]}}"
  echo "gpu_checks: pytest -m cuda over ${#files[@]} files (log: $out/tests.log)"
  MOK_FAILLOG=$out/failures.log python -m pytest -v -rfE -p no:cacheprovider --continue-on-collection-errors -m cuda \
    "${files[@]}" "$@" >"$out/tests.log" 2>&1 || status=1
  tail -5 "$out/tests.log"
fi
for tool in memcheck racecheck; do
  [[ $steps == *$tool* ]] || continue
  for node in "${SANITIZED[@]}"; do
    log="$out/$tool-$(basename "${node%%::*}" .py).log"
    compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 30 \
      python -m pytest -q -p no:cacheprovider -k cuda "$node" >"$log" 2>&1 || status=1
    echo "gpu_checks: $tool $node: $(grep -hE "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/=* *//')," \
      "$(grep -hE "[0-9]+ (passed|failed)" "$log" | tail -1)"
  done
done
exit $status
