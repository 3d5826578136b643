#!/bin/bash
# The MXFP8 decode checks of one device call (written in session 17, when no device was lent): PART picks what
# runs, each part about 300 s (a device call is at most 600 s). Usage with the device tool:
#
#   PART=tests bash benchmarks/mx_decode_suite.sh           # call 1
#   PART=ab bash benchmarks/mx_decode_suite.sh              # call 2
#   PART=compiled,ncu bash benchmarks/mx_decode_suite.sh    # call 3
#
#   tests     the MXFP8, schedule, launch and compile tests on CUDA (failures in $OUT/tests.log)
#   ab        benchmarks/decode_ab.py at T=64: the package against the 64-bit scale pairs, the two-pass
#             row pre-pass, the three-launch schedule and the looped combine; the package at T=128 and 256
#   compiled  decode_ab's torch.compile variants at T=64 (the traced choices, against session 16's)
#   prof      ncu's sections (speed of light, memory workload, warp states, scheduler, occupancy) of the bf16 and
#             the MXFP8 decode GEMMs (benchmarks/mx_profile.py, --bf16 for the former), side by side
#   stream    benchmarks/mx_stream_ab.py: the K-loop styles' weight rates (bf16, the fp16 per-block loop and its variants)
#   fp8rows   decode_ab at T=64: the package against the e4m3 pair loop (moe_fwd.MX_FP8_ROWS); its CUDA tests
#   occ       decode_ab at T=64: the package against 8-row configs of 2 stages or 1 warp (more programs an SM)
#   onedot    (session 20) whole K steps as one dot (moe_fwd.MX_ONE_DOT): its CUDA tests, mx_stream_ab's f16v
#             against f16one and f16, decode_ab at T=64 (bf16 mok, the package, one dot)
#   onetwo    decode_ab at T=64 (one dot over the 8-row configs alone) and T=128
#   run21     (session 21, one dot on) decode_ab at T=64 (bf16 mok, the package, session 20's blocks) and T=128
#   fewrows   torch.compile at T=128 (no graph cache) on 8-row configs up to 8 and up to 4 routes per expert
#   ncu       the gate/up and down kernels' L2 sectors by source, hits, DRAM bytes, and warp stall reasons
#             (benchmarks/mx_profile.py), words against 64-bit pairs
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCHINDUCTOR_CACHE_DIR=/tmp/mok-ind TRITON_CACHE_DIR=/tmp/mok-tri
PART=${PART:-tests}
date -u | tee $OUT/env.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee -a $OUT/env.txt
git log --oneline -1 2>/dev/null | tee -a $OUT/env.txt
ab() {  # decode_ab at T=$1 over the labels $2 (log: decode_T$1_$3.log)
  timeout ${4:-150} python3 benchmarks/decode_ab.py --mxfp8 --tokens $1 --only "$2" --out $OUT 2>&1 | grep -v Warn \
    > $OUT/decode_T$1_$3.log
  mv $OUT/decode_ab_qwen3-decode_T$1.json $OUT/decode_ab_T$1_$3.json 2>/dev/null
  grep -E "^  |^qwen3" $OUT/decode_T$1_$3.log | grep -v "^      "
}
if [[ $PART == *tests* ]]; then
  echo "=== tests"
  MOK_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_mxfp8.py -k "not cpu" 2>&1 \
    | grep -v Warn > $OUT/tests.log
  MOK_AUTOTUNE=0 timeout 90 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py tests/test_launch.py \
    tests/test_compile_reinplace.py -k "schedule or combine or launch or traced or few_rows or words or compiled" 2>&1 \
    | grep -v Warn >> $OUT/tests.log
  grep -E "passed|failed" $OUT/tests.log; grep -E "FAILED|ERROR" $OUT/tests.log | head -20
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_compile_inductor.py -k "mxfp8" 2>&1 | grep -v Warn \
    > $OUT/tests_compile.log
  tail -2 $OUT/tests_compile.log; grep -E "FAILED|ERROR" $OUT/tests_compile.log | head
fi
if [[ $PART == *ab* ]]; then
  echo "=== decode A/B"
  ab 64 "(pkg),(wide),(wide fixed),(two-pass rows),(three-launch schedule),(looped combine)" ab 220
  ab 128 "(pkg),(wide)" t128 80
  ab 256 "(pkg)" t256 60
fi
if [[ $PART == *compiled* ]]; then
  echo "=== compiled decode"
  ab 64 "(pkg),(compiled),(compiled old)" compiled 240
fi
M=lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_requests_srcunit_tex_op_read.sum
M=$M,lts__t_sectors_srcunit_ltcfabric.sum,dram__bytes_read.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
M=$M,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,smsp__inst_executed_op_ldgsts.sum,gpu__time_duration.sum
M=$M,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_barrier.ratio
M=$M,smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_wait.ratio
M=$M,smsp__average_warp_latency_issue_stalled_math_pipe_throttle.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio
M=$M,smsp__average_warp_latency_issue_stalled_mio_throttle.ratio,smsp__average_warp_latency_issue_stalled_not_selected.ratio
if [[ $PART == *prof* ]]; then
  echo "=== ncu sections, bf16 against MXFP8"
  for c in "--bf16" "--gate-up 8x32x256x2x3 --down 8x64x128x4x4"; do
    f="$OUT/prof_$( [[ $c == --bf16 ]] && echo bf16 || echo mx ).txt"
    timeout 95 ncu --clock-control none --profile-from-start off -k regex:"_gate_up|_grouped_rows" \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section SchedulerStats --section LaunchStats --metrics $M python3 benchmarks/mx_profile.py $c > "$f" 2>&1
    grep -E "_kernel|Duration|Throughput|Hit Rate|Stall|Warp Cycles|Eligible|Issued Warp|Occupancy|Block Limit|Registers" "$f" | head -60
  done
fi
if [[ $PART == *stream* ]]; then
  echo "=== K-loop styles streaming one GEMM's weights (benchmarks/mx_stream_ab.py)"
  timeout 240 python3 benchmarks/mx_stream_ab.py --out $OUT 2>&1 | grep -v Warn | tee $OUT/stream.log | grep -E "best|TB/s|FAILED"
fi
if [[ $PART == *fp8rows* ]]; then
  echo "=== decode A/B: the e4m3 pair loop (MX_FP8_ROWS) against the package; its CUDA tests"
  ab 64 "(pkg),(fp8 rows)" fp8rows 130
  ids=$(python3 -m pytest --collect-only -q tests/test_mxfp8.py 2>/dev/null \
    | grep -E "e4m3|-6\]|\[6-|\[6\]|words_match|transposed_row|row_scaled")
  MOK_AUTOTUNE=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 $ids 2>&1 | grep -v Warn \
    > $OUT/tests_fp8rows.log
  grep -E "passed|failed" $OUT/tests_fp8rows.log; grep -E "FAILED|ERROR" $OUT/tests_fp8rows.log | head -20
fi
if [[ $PART == *onedot* ]]; then
  echo "=== whole K steps as one dot (MX_ONE_DOT): CUDA tests, stream styles, decode A/B"
  MOK_AUTOTUNE=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_mxfp8.py -k "one_dot" 2>&1 \
    | grep -v Warn > $OUT/tests_onedot.log
  grep -E "passed|failed" $OUT/tests_onedot.log; grep -E "FAILED|ERROR" $OUT/tests_onedot.log | head -20
  timeout 100 python3 benchmarks/mx_stream_ab.py --styles bf16,f16one,f16,f16v --out $OUT 2>&1 | grep -v Warn \
    | tee $OUT/stream_onedot.log | grep -E "best|FAILED"
  ab 64 "package configs,(pkg),(one dot)" onedot 260
fi
if [[ $PART == *onetwo* ]]; then
  echo "=== whole K steps as one dot: 8-row configs alone at T=64, and T=128"
  ab 64 "(pkg),(one dot),(one dot trans)" onedot_trans 300
  ab 128 "(pkg),(one dot)" onedot_t128 120
fi
if [[ $PART == *run21* ]]; then
  echo "=== session 21: one dot on by default; bf16 mok, the package and the old blocks at T=64 and 128"
  ab 64 "package configs,(pkg),(blocks)" run21 200
  ab 128 "(pkg),(blocks)" run21_t128 100
fi
if [[ $PART == *fewrows* ]]; then
  echo "=== session 21: torch.compile at T=128 on 8-row configs up to 8 (the package) and up to 4 routes per expert"
  ab 128 "(pkg),(compiled),(compiled few4)" fewrows_t128 150
fi
if [[ $PART == *occ* ]]; then
  echo "=== decode A/B, configs for more resident warps"
  ab 64 "(pkg),(occ)" occ 150
fi
if [[ $PART == *ncu* ]]; then
  echo "=== ncu"
  for c in "8x32x256x2x3 8x64x128x4x4" "8x32x256x2x3 8x64x256x4x3 --wide" "16x32x128x2x4 16x128x128x4x3"; do
    set -- $c
    f="$OUT/ncu_${c// /_}.txt"
    timeout 90 ncu --clock-control none --profile-from-start off -k regex:"_gate_up|_grouped_rows" --metrics $M \
      python3 benchmarks/mx_profile.py --gate-up $1 --down $2 $3 > "$f" 2>&1
    grep -E "_kernel|sum|ratio" "$f" | head -40
  done
fi
