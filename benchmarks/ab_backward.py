"""Same-process A/B of the kernel choices (mok fwd+bwd through `mok_inductor.moe`, bf16, balanced routing):
the two-pass bwd_act (kernels.moe_bwd.TWO_PASS_MIN_ROWS), the gate/up weight gradient in one launch
(kernels.moe_bwd.PAIR_WGRAD), the one-pass bwd_act with its epilogue over column halves
(kernels.moe_bwd.SUBTILE_EPILOGUE) and the persistent gate/up GEMM of the forward
(kernels.moe_fwd.PERSISTENT_GATE_UP), each against the previous kernels, variants interleaved round by
round so that clock drift hits them alike.

    python benchmarks/ab_backward.py --shapes qwen3-30b-a3b,mixtral-8x7b [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, bench, fwd_bwd_step, grad_leaves, make_inputs  # noqa: E402

# name: (moe_bwd.TWO_PASS_MIN_ROWS, moe_bwd.PAIR_WGRAD, moe_bwd.SUBTILE_EPILOGUE, moe_fwd.PERSISTENT_GATE_UP)
VARIANTS = {
    "fused bwd_act, 3 wgrads (session 3)": (1 << 62, False, False, False),
    "two-pass bwd_act, 3 wgrads": (None, False, False, False),
    "two-pass bwd_act, gate/up wgrad as one GEMM (default)": (None, True, False, False),
    "fused bwd_act with the subtiled epilogue, gate/up wgrad as one GEMM": (1 << 62, True, True, False),
    "default + persistent gate/up GEMM in the forward": (None, True, False, True),
}


def main():
    import mok_inductor
    from mok_inductor.kernels import moe_bwd, moe_fwd

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    default_rows = moe_bwd.TWO_PASS_MIN_ROWS
    rows = []
    for name in a.shapes.split(","):
        T, H, I, E, K = SHAPES[name]
        x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
        leaves, dy = grad_leaves(x, rw, w_gu, w_d)
        flops = 18 * T * K * H * I
        step = fwd_bwd_step(mok_inductor.moe, leaves, te, dy)

        times = {v: [] for v in VARIANTS}
        for _ in range(a.rounds):
            for v, (min_rows, pair, subtile, persistent) in VARIANTS.items():
                moe_bwd.TWO_PASS_MIN_ROWS = default_rows if min_rows is None else min_rows
                moe_bwd.PAIR_WGRAD, moe_bwd.SUBTILE_EPILOGUE = pair, subtile
                moe_fwd.PERSISTENT_GATE_UP = persistent
                step()
                times[v].append(bench(step)[0])
        moe_bwd.TWO_PASS_MIN_ROWS, moe_bwd.PAIR_WGRAD, moe_bwd.SUBTILE_EPILOGUE = default_rows, True, False
        moe_fwd.PERSISTENT_GATE_UP = False
        for v, ts in times.items():
            ms = sorted(ts)[len(ts) // 2]
            rows.append(dict(shape=name, variant=v, ms=ms, tflops=flops / (ms * 1e-3) / 1e12, rounds=ts))
            print(f"  {name:>18} {v:>50}: fwd+bwd {ms:7.3f} ms {rows[-1]['tflops']:6.0f} TFLOP/s", flush=True)
    with open(os.path.join(a.out, "ab_backward.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
