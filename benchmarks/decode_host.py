"""The host's share of an eager decode forward (qwen3 decode shape, no CUDA graph): the wall time per call of
back-to-back calls with the TMA descriptors allowed and not (kernels.moe_fwd.TMA_KERNELS; below TMA_MIN_ROWS
rows per expert they are not built either way), then a cProfile of 200 calls (where the Python time goes).

    python benchmarks/decode_host.py [--shape qwen3-decode] [--calls 200]   # GPU
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, make_inputs  # noqa: E402


def main():
    import mok_inductor
    from mok_inductor.kernels import moe_fwd

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-decode")
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    T, H, I, E, K = SHAPES[a.shape]
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")

    def f():
        return mok_inductor.moe(x, rw, te, w_gu, w_d)

    default = moe_fwd.TMA_KERNELS
    for tma in (True, False, True, False):  # (twice each: the spread between repeats)
        moe_fwd.TMA_KERNELS = tma
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            f()
        torch.cuda.synchronize()
        print(f"TMA_KERNELS={tma}: {(time.perf_counter() - t0) / a.calls * 1e3:.3f} ms per call", flush=True)
    moe_fwd.TMA_KERNELS = default
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        f()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
