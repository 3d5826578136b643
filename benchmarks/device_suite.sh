#!/bin/bash
# One device call: the CUDA tests (pytest-xdist, failures logged as they happen), the transformers fine-tune
# at Qwen3-MoE layer sizes, and a benchmark. Usage with the device tool (carry `.whl`, and `.dev` when a
# snapshot is used):
#
#   git archive HEAD -o .dev/src.tar     # optional: run a committed snapshot, not a working tree in flux
#   SNAPSHOT=.dev/src.tar T_TESTS=200 T_FT=100 T_BENCH=140 bash benchmarks/device_suite.sh
#
# `.whl` holds the wheels the device image lacks (megatron-core 0.16.1 cp312, expecttest 0.3.0,
# liger-kernel 0.8.5; see the device tool's README for `pip download`). TESTS / PYTEST_K pick the tests,
# SHAPES / CONTENDERS the benchmark. Everything lands under $OUT: tests.log (one line per test: a run cut
# by its time limit still says which passed), failures.txt (each failure's traceback, written when it
# happens), the fine-tune's JSON/PNG, bench.{json,png,log}.
set -o pipefail
if [ -n "$SNAPSHOT" ]; then
  mkdir -p /tmp/src && tar -xf "$SNAPSHOT" -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src || exit
fi
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
fi
# the package itself (its dist-info carries the torch_dynamo_backends entry point that one test needs)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site2 . > $OUT/pip_pkg.log 2>&1 \
  || echo "package install failed: the entry-point test will fail"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site:/tmp/site2 TRITON_CACHE_DIR=/tmp/tc MOK_FAILLOG=$OUT/failures.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
echo "=== tests"
MOK_AUTOTUNE=0 timeout ${T_TESTS:-200} python3 -m pytest -p no:cacheprovider -n ${WORKERS:-14} --timeout 170 -v ${TESTS:-tests/} \
  -k "${PYTEST_K:-not cpu}" 2>&1 | grep -v Warning > $OUT/tests.log
grep -oE "(PASSED|FAILED|ERROR) tests/[^ :]+" $OUT/tests.log | sort | uniq -c
grep "^=====" $OUT/failures.txt 2>/dev/null | sort -u | head -40
if [ "${T_FT:-100}" != 0 ]; then
  echo "=== finetune"
  MOK_AUTOTUNE=0 timeout ${T_FT:-100} python3 examples/finetune_hf.py --preset qwen3-moe-2l --device cuda --dtype bfloat16 \
    --impls mok,grouped_mm --steps 16 --warmup 4 --batch 4 --seq 2048 --out $OUT/h200_qwen3moe 2>&1 | grep -v Warn | tail -12
fi
if [ "${T_BENCH:-140}" != 0 ]; then
  echo "=== bench"
  LIGER_FUSED_MOE_AUTOTUNE=${LIGER_FUSED_MOE_AUTOTUNE:-0} timeout ${T_BENCH:-140} python3 benchmarks/bench_moe.py --out $OUT \
    --shapes ${SHAPES:-qwen3-30b-a3b,qwen3-decode} --contenders ${CONTENDERS:-mok,grouped_mm_compiled,liger} --skewed-shapes "" \
    ${BENCH_ARGS:---mxfp8} 2>&1 | grep -v Warning | tail -30
fi
