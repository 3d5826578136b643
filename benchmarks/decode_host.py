"""The host's share of an eager decode forward (qwen3 decode shape, no CUDA graph): the wall time per call of
back-to-back calls with the TMA descriptors allowed and not (kernels.moe_fwd.TMA_KERNELS; below TMA_MIN_ROWS
rows per expert they are not built either way), then a cProfile of 200 calls (where the Python time goes).
--stub-launches (no GPU needed): mok's own Python layers alone, on CPU tensors through the Triton path
(MOK_BACKEND=triton, the interpreter) with every kernel launch replaced by a no-op, so what is timed is the
op, autograd and launch-wrapper code that runs before each launch (the best of 5 rounds of --calls calls;
the shape is scaled down, which only changes what the no-op launches would have read).

    python benchmarks/decode_host.py [--shape qwen3-decode] [--calls 200]   # GPU
    python benchmarks/decode_host.py --stub-launches [--calls 2000]          # CPU
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


def stubbed(calls: int):
    """Microseconds per forward of mok's Python layers, launches stubbed (see the module docstring)."""
    import mok_inductor
    from mok_inductor.kernels import _launch

    launched = []
    _launch.launch = lambda kernel, grid, *args, **kwargs: launched.append(kernel)
    torch._assert_async = lambda *args, **kwargs: None  # (its flag comes from a stubbed kernel)
    x, rw, te, w_gu, w_d = make_inputs(64, 256, 128, 128, 8, "balanced", device="cpu")  # (qwen3 decode's T, E, K)
    for _ in range(50):
        mok_inductor.moe(x, rw, te, w_gu, w_d)
    best = float("inf")
    for _ in range(5):
        launched.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            mok_inductor.moe(x, rw, te, w_gu, w_d)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    print(f"mok's Python layers: {best:.1f} us per forward (best of 5 rounds of {calls}), "
          f"{len(launched) // calls} launches stubbed", flush=True)


def main():
    if "--stub-launches" in sys.argv:  # (before triton is imported)
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MOK_BACKEND"] = "triton"
    import mok_inductor
    from mok_inductor.kernels import moe_fwd

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-decode")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--stub-launches", action="store_true")
    a = p.parse_args()
    if a.stub_launches:
        return stubbed(a.calls)
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
