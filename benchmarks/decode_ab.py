"""Where the decode forward's time goes (issue 3's "within 1.2x of the weight-read floor"): the whole forward
captured in one CUDA graph, and a profile of its replays, kernel by kernel (device time, the weight bytes
each GEMM reads and the bandwidth that makes, the gaps between kernels); then the two GEMMs autotuned over
a wider list of tile configs than the package's (smaller tiles, longer K steps, more stages), each graph
timed again, in the same process.

    python benchmarks/decode_ab.py [--shape qwen3-decode] [--out DIR]

The floor is the bytes of the touched experts' weights over the measured copy bandwidth, as in
benchmarks/bench_moe.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, GraphedMok, bench, copy_bandwidth, make_inputs  # noqa: E402

# Extra tile configs for few rows per expert: the weights stream through small row tiles
_WIDE = [(bm, bn, bk, w, s) for bm, bn, bk, w, s in [
    (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 64, 256, 4, 3), (64, 32, 128, 4, 4), (64, 128, 64, 4, 5),
    (64, 256, 64, 8, 3), (64, 64, 64, 4, 6), (128, 64, 128, 8, 3)]]


def kernel_profile(graph, reps=20):
    """{kernel name: mean device ms per replay} and the replays' mean wall ms (do_bench)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            out[e.key] = e.device_time_total / reps / 1e3
    return out


def main():
    from mok_inductor.kernels import moe_fwd

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-decode")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    T, H, I, E, K = SHAPES[a.shape]
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
    touched = torch.unique(te).numel()
    bw = copy_bandwidth()
    gu_bytes, d_bytes = touched * 2 * I * H * 2, touched * H * I * 2
    floor_ms = (gu_bytes + d_bytes) / bw * 1e3
    print(f"{a.shape}: {touched} experts touched, floor {floor_ms:.4f} ms (gate/up {gu_bytes / bw * 1e3:.4f}, "
          f"down {d_bytes / bw * 1e3:.4f}) at {bw / 1e12:.2f} TB/s", flush=True)
    rows = dict(shape=a.shape, touched=touched, copy_bw=bw, floor_ms=floor_ms, variants=[])
    base = (moe_fwd._gate_up_kernel, moe_fwd._grouped_rows_kernel)
    wide = lambda k: triton.autotune(  # noqa: E731
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                 for bm, bn, bk, w, s in _WIDE] + list(k.configs), key=list(k.keys))(k.fn)
    variants = {"package configs": base, "wider configs, both GEMMs": (wide(base[0]), wide(base[1]))}
    for label, (gk, dk) in variants.items():
        moe_fwd._gate_up_kernel, moe_fwd._grouped_rows_kernel = gk, dk
        try:
            g = GraphedMok()
            g(x, rw, te, w_gu, w_d)
            ms, p20, p80 = bench(lambda: g(x, rw, te, w_gu, w_d))
            kern = kernel_profile(g.graph)
            busy = sum(kern.values())
            v = dict(variant=label, graph_ms=ms, p20=p20, p80=p80, vs_floor=ms / floor_ms, kernels=kern,
                     gaps_ms=ms - busy,
                     configs={n: str(getattr(k, "best_config", "")) for n, k in (("gate_up", gk), ("down", dk))})
            rows["variants"].append(v)
            print(f"  {label}: graph {ms:.4f} ms = {ms / floor_ms:.3f}x the floor; kernels {busy:.4f} ms, "
                  f"gaps {ms - busy:.4f} ms; configs {v['configs']}", flush=True)
            for name, t in sorted(kern.items(), key=lambda kv: -kv[1]):
                gb = gu_bytes if "gate_up" in name else d_bytes if "grouped_rows" in name else 0
                extra = f"  {gb / (t * 1e-3) / 1e12:.2f} TB/s of weights" if gb else ""
                print(f"      {t:8.4f} ms  {name[:90]}{extra}", flush=True)
        finally:
            moe_fwd._gate_up_kernel, moe_fwd._grouped_rows_kernel = base
    with open(os.path.join(a.out, "decode_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
