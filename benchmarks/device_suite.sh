#!/bin/bash
# One device call: the demo, the CUDA tests of every part (compiled graphs, kernels, the op, Megatron,
# functional ABI, transformers) and the transformers fine-tune at Qwen3-MoE layer sizes.
# Usage (device tool, with `.whl` carried for megatron-core): bash benchmarks/device_suite.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} TORCHINDUCTOR_CACHE_DIR=/tmp/mok-ic-$$ TRITON_CACHE_DIR=/tmp/mok-tc-$$
export MOK_AUTOTUNE=${MOK_AUTOTUNE:-0}
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
section() { echo; echo "=== $1"; }
section demo; timeout ${T_DEMO:-60} python3 examples/demo.py 2>&1 | grep -v Warn | tee $OUT/demo.log | tail -14
section "compiled graphs + kernels on CUDA"
timeout ${T_T1:-170} python3 -m pytest -q -p no:cacheprovider -rfE tests/test_compile_inductor.py tests/test_kernels.py \
  -k "cuda or real_sizes or graph or compiled or whole_op" 2>&1 | tee $OUT/tests_compile_kernels.log | grep -E "^(FAILED|ERROR)|passed|failed" | tail -15
section "finetune qwen3-moe 2 layers"
timeout ${T_FT:-110} python3 examples/finetune_hf.py --preset qwen3-moe-2l --device cuda --dtype bfloat16 --impls mok,grouped_mm \
  --steps 16 --warmup 4 --batch 4 --seq 2048 --out $OUT/h200_qwen3moe 2>&1 | grep -v Warn | tail -12
section "op, Megatron, functional, runtime, transformers on CUDA"
timeout ${T_T2:-130} python3 -m pytest -q -p no:cacheprovider -rfE tests/test_moe.py tests/test_megatron.py tests/test_functional.py \
  tests/test_runtime.py tests/test_transformers.py tests/test_determinism.py -k cuda 2>&1 | tee $OUT/tests_cuda.log | grep -E "^(FAILED|ERROR)|passed|failed" | tail -20
