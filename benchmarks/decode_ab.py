"""Where the decode forward's time goes (issue 3's "within 1.2x of the weight-read floor"): the whole forward
captured in one CUDA graph, and a profile of its replays, kernel by kernel (device time, the weight bytes
each GEMM reads and the bandwidth that makes, the gaps between kernels); then the two GEMMs autotuned over
a wider list of tile configs than the package's (smaller tiles, longer K steps, more stages), each graph
timed again, in the same process; --mxfp8 adds MXFP8 routed weights through the fp8 tensor cores
(moe_fwd.MX_FP8_DOT), the fp16 ones (moe_fwd.MX_F16_DOT) and the dequantizing K loop.

    python benchmarks/decode_ab.py [--shape qwen3-decode] [--mxfp8] [--out DIR]

The floor is the bytes of the touched experts' weights over the measured copy bandwidth, as in
benchmarks/bench_moe.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, GraphedMok, GraphedMokMxfp8, bench, copy_bandwidth, make_inputs  # noqa: E402
from config_ab import extended  # noqa: E402

from mok_inductor.kernels._launch import cfg  # noqa: E402

# Extra tile configs for few rows per expert: the weights stream through small row tiles
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
_WIDE = [(64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 64, 256, 4, 3), (64, 32, 128, 4, 4), (64, 128, 64, 4, 5),
         (64, 256, 64, 8, 3), (64, 64, 64, 4, 6), (128, 64, 128, 8, 3)]


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
    p.add_argument("--mxfp8", action="store_true", help="also MXFP8 routed weights: the fp8 tensor-core K loop "
                   "and the dequantizing one (floor: 1 + 1/32 bytes per weight element)")
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
    wide = lambda k: extended(k, [cfg(*c) for c in _WIDE])  # noqa: E731
    # label: (graph, gate/up kernel, down kernel, the K loop by 32-blocks (moe_fwd.use_mx_dot: 0 off, 1 fp8,
    # 2 fp16), weight bytes per element)
    variants = {"package configs": (GraphedMok, *base, 0, 2),
                "wider configs, both GEMMs": (GraphedMok, wide(base[0]), wide(base[1]), 0, 2)}
    if a.mxfp8:
        mx = (moe_fwd._gate_up_mx_dot_kernel, moe_fwd._grouped_rows_mx_dot_kernel)
        variants["MXFP8, fp8 tensor cores (MX_FP8_DOT)"] = (GraphedMokMxfp8, *mx, 1, 1 + 1 / 32)
        variants["MXFP8, fp16 tensor cores (MX_F16_DOT)"] = (GraphedMokMxfp8, *mx, 2, 1 + 1 / 32)
        variants["MXFP8, dequantizing K loop"] = (GraphedMokMxfp8, *base, 0, 1 + 1 / 32)
    default_dot = moe_fwd.MX_FP8_DOT, moe_fwd.MX_F16_DOT
    for label, (graphed, gk, dk, mx_dot, elem_bytes) in variants.items():
        if elem_bytes == 2:
            moe_fwd._gate_up_kernel, moe_fwd._grouped_rows_kernel = gk, dk
        moe_fwd.MX_FP8_DOT, moe_fwd.MX_F16_DOT = mx_dot == 1, mx_dot == 2
        gb, db = gu_bytes * elem_bytes / 2, d_bytes * elem_bytes / 2
        v_floor = (gb + db) / bw * 1e3
        try:
            g = graphed()
            g(x, rw, te, w_gu, w_d)
            ms, p20, p80 = bench(lambda: g(x, rw, te, w_gu, w_d))
            kern = kernel_profile(g.graph)
            busy = sum(kern.values())
            v = dict(variant=label, graph_ms=ms, p20=p20, p80=p80, floor_ms=v_floor, vs_floor=ms / v_floor,
                     vs_bf16_floor=ms / floor_ms, kernels=kern, gaps_ms=ms - busy,
                     configs={n: str(getattr(k, "best_config", "")) for n, k in (("gate_up", gk), ("down", dk))})
            rows["variants"].append(v)
            print(f"  {label}: graph {ms:.4f} ms = {ms / v_floor:.3f}x its floor ({v_floor:.4f} ms); kernels "
                  f"{busy:.4f} ms, gaps {ms - busy:.4f} ms; configs {v['configs']}", flush=True)
            for name, t in sorted(kern.items(), key=lambda kv: -kv[1]):
                nb = gb if "gate_up" in name else db if "grouped_rows" in name else 0
                extra = f"  {nb / (t * 1e-3) / 1e12:.2f} TB/s of weights" if nb else ""
                print(f"      {t:8.4f} ms  {name[:90]}{extra}", flush=True)
        except Exception as exc:  # a variant that fails to compile or run is reported, the others still run
            print(f"  {label}: FAILED {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
            rows["variants"].append(dict(variant=label, error=f"{type(exc).__name__}: {exc}"[:4000]))
        finally:
            moe_fwd._gate_up_kernel, moe_fwd._grouped_rows_kernel = base
            moe_fwd.MX_FP8_DOT, moe_fwd.MX_F16_DOT = default_dot
    with open(os.path.join(a.out, "decode_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
