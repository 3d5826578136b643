#!/bin/bash
# One device call: kernel tests on CUDA, compile report (regs/spills/wgmma), then the benchmark.
# Usage (device tool): bash benchmarks/device_run.sh [TEST_SECONDS] [BENCH_SECONDS] [bench args...]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCHINDUCTOR_CACHE_DIR=/tmp/mok-ind-$$ TRITON_CACHE_DIR=/tmp/mok-tri-$$
T_TESTS=${1:-150}; T_BENCH=${2:-330}; shift 2
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a $OUT/env.txt
if [ "$T_TESTS" != 0 ]; then
  MOK_AUTOTUNE=0 timeout $T_TESTS python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py ${PYTEST_K:+-k "$PYTEST_K"} -rA 2>&1 | grep -v Warn | tee $OUT/tests.log | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -30
  [ -n "$REPORT" ] && timeout 90 python3 benchmarks/kernel_report.py 2>&1 | tee $OUT/kernel_report.md | tail -30
fi
[ -n "$BREAKDOWN" ] && timeout 150 python3 benchmarks/breakdown.py --shapes $BREAKDOWN --out $OUT 2>&1 | grep -v Warning
timeout $T_BENCH python3 benchmarks/bench_moe.py --out $OUT "$@" 2>&1 | grep -v Warning | tail -60
