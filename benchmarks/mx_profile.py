"""One MXFP8 decode forward (qwen3 shape) inside a CUDA profiler range, after warm-up forwards, with fixed tile
configs for both GEMMs, for Nsight Compute. Run 17 (docs/benchmarks.md) used it this way:

    ncu --clock-control none --profile-from-start off -k regex:"_gate_up|_grouped_rows" \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python benchmarks/mx_profile.py --gate-up 8x32x256x2x3 --down 8x64x128x4x4

or with `--metrics lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,
dram__bytes_read.sum,...` for where the L2 traffic comes from. A config is BLOCK_M x BLOCK_N x BLOCK_K x warps
x stages; --no-words keeps the scales' byte loads (moe_fwd.SCALE_WORDS off), --wide reads a K step's two words by
one 64-bit load (moe_fwd.SCALE_WIDE, BLOCK_K 256); --bf16 profiles the bf16 weights' forward instead.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

from bench_moe import SHAPES, make_inputs  # noqa: E402


def main():
    import mok_inductor
    from mok_inductor import mxfp8
    from mok_inductor.kernels import _launch, moe_fwd
    from mok_inductor.kernels._launch import cfg

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-decode")
    p.add_argument("--tokens", type=int)
    p.add_argument("--gate-up", default="8x32x256x2x3")
    p.add_argument("--down", default="8x64x128x4x4")
    p.add_argument("--words", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--wide", action="store_true")
    p.add_argument("--bf16", action="store_true", help="the bf16 weights instead (the package's configs), to "
                   "compare the two K loops' counters in one profile")
    a = p.parse_args()
    moe_fwd.SCALE_WORDS, moe_fwd.SCALE_WIDE = a.words, a.wide
    gu, dn = (cfg(*(int(v) for v in c.split("x"))) for c in (a.gate_up, a.down))
    moe_fwd._gate_up_mx_dot_kernel = _launch.autotune([gu], gu, key=moe_fwd._GATE_UP_KEY + ["MX_DOT"])(
        moe_fwd._gate_up_body)
    moe_fwd._grouped_rows_mx_dot_kernel = _launch.autotune([dn], dn, key=moe_fwd._GROUPED_ROWS_KEY + ["MX_DOT"])(
        moe_fwd._grouped_rows_body)
    T, H, I, E, K = SHAPES[a.shape]
    x, rw, te, w_gu, w_d = make_inputs(a.tokens or T, H, I, E, K, "balanced")
    q1, q2 = (w_gu, w_d) if a.bf16 else (mxfp8.quantize(w_gu), mxfp8.quantize(w_d))
    with torch.no_grad():
        for _ in range(3):
            mok_inductor.moe(x, rw, te, q1, q2)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        mok_inductor.moe(x, rw, te, q1, q2)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
