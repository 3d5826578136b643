"""Where the decode forward's time goes (issue 3's "within 1.2x of the weight-read floor"): the whole forward
captured in one CUDA graph, and a profile of its replays, kernel by kernel (device time, the weight bytes
each GEMM reads and the bandwidth that makes, the gaps between kernels); then the two GEMMs autotuned over
a wider list of tile configs than the package's (smaller tiles, longer K steps, more stages), each graph
timed again, in the same process; --mxfp8 adds MXFP8 routed weights through the fp8 tensor cores
(moe_fwd.MX_FP8_DOT), the fp16 ones (moe_fwd.MX_F16_DOT; also over a wider config list), the e4m3 ones on rows split once (moe_fwd.MX_FP8_ROWS), its variant on
activation rows scaled once per call (moe_fwd.MX_F16_MODE 3; rows3 with a byte load per scale, words with
32-bit loads of 4 scales, moe_fwd.SCALE_WORDS; trans and fixed: 8-row tiles alone, moe_fwd.mx_dot_t; one dot:
whole K steps as one dot, moe_fwd.MX_ONE_DOT) and the dequantizing K loop. --tokens runs the shape at another token count: up to kernels.MX_DEQUANTIZE_MIN_ROWS
routes per expert MXFP8 stays in the K loop, so this times the K-loop choices between decode and prefill.

    python benchmarks/decode_ab.py [--shape qwen3-decode] [--tokens T] [--mxfp8] [--only LABELS] [--out DIR]

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
from config_ab import extended, retuned  # noqa: E402

from mok_inductor.kernels._launch import cfg  # noqa: E402

# Extra tile configs for few rows per expert: the weights stream through small row tiles
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
_WIDE = [(64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 64, 256, 4, 3), (64, 32, 128, 4, 4), (64, 128, 64, 4, 5),
         (64, 256, 64, 8, 3), (64, 64, 64, 4, 6), (128, 64, 128, 8, 3)]
# and for the MXFP8 loops by 32-blocks (moe_fwd._MX_DOT_CONFIGS: 16-row tiles first)
_MX_WIDE = [(16, 64, 64, 4, 6), (16, 128, 64, 4, 5), (16, 256, 64, 8, 4), (16, 128, 128, 8, 3), (16, 256, 128, 8, 3),
            (16, 64, 128, 2, 5), (16, 32, 256, 2, 3), (16, 128, 256, 8, 2), (32, 128, 128, 8, 3), (16, 64, 256, 4, 2)]
# and for the variant on rows scaled once: taller row tiles too (no activation split per block to repeat)
_ROWS_WIDE = _MX_WIDE + [(64, 64, 64, 4, 6), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4), (32, 64, 128, 4, 5),
                         (16, 64, 128, 4, 6)]

# and 8-row tiles, the products transposed (moe_fwd.mx_dot_t: the weights on the MMA's 16-row side; with scale
# words, loaded a K step ahead), alone
_TRANS = [(8, 32, 128, 2, 4), (8, 32, 128, 1, 4), (8, 64, 128, 2, 4), (8, 64, 128, 4, 4), (8, 32, 128, 2, 6),
          (8, 128, 128, 4, 3), (8, 32, 256, 2, 3), (8, 64, 256, 4, 3), (8, 16, 128, 1, 6), (8, 64, 128, 2, 6),
          (8, 32, 128, 1, 8), (8, 16, 256, 1, 4)]
# and 8-row configs for more resident warps (2 stages: half the shared memory a program; 1 warp): ncu (run 17) found
# the 8-row gate/up loop at 15.6% occupancy (5 programs of 2 warps an SM, by shared memory) with 10.5 cycles
# between a warp's instructions, so latency is hidden by few warps; with the package's picks for reference
_OCC = [(8, 32, 256, 2, 2), (8, 32, 128, 2, 2), (8, 16, 256, 1, 2), (8, 64, 256, 4, 2), (8, 64, 128, 4, 2),
        (8, 32, 128, 1, 3), (8, 32, 256, 2, 3), (8, 64, 128, 4, 4)]
# (gate/up, down) configs timed alone
_TRANS_PAIRS = [((8, 32, 256, 2, 3), (8, 64, 128, 4, 4)), ((8, 32, 128, 2, 4), (8, 64, 128, 4, 4)),
                ((8, 64, 256, 4, 3), (8, 128, 128, 4, 3))]



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


def reference64(x, rw, te, w_gu, w_d):
    """The layer in float64 on the device (an expert at a time; weights as given: bf16, or an MXFP8 weight's
    dequantized values), each variant's error measured against it."""
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    I = w_d.shape[-1]
    x64 = x.double()
    for e in torch.unique(te).tolist():
        t, k = (te == e).nonzero(as_tuple=True)
        gu = x64[t] @ w_gu[e].double().t()
        h = torch.nn.functional.silu(gu[:, :I].to(x.dtype).double()) * gu[:, I:].to(x.dtype).double()
        y.index_add_(0, t, (h.to(x.dtype).double() @ w_d[e].double().t()) * rw[t, k].double()[:, None])
    return y


class GraphedCompiledMxfp8(GraphedMokMxfp8):
    """GraphedMokMxfp8 with the forward compiled by torch.compile (default mode, static shapes, one graph; a
    fresh compile per instance): Inductor's code for the traced kernels, captured in the same CUDA graph."""

    def __init__(self):
        super().__init__()
        import mok_inductor

        torch._dynamo.reset()
        # no cached graph: the caches' keys do not hold the flags a variant sets (moe_fwd.MX_FEW_ROWS and others)
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
        compiled = torch.compile(mok_inductor.moe, fullgraph=True, dynamic=False)
        mx = self.mx
        self.mx = lambda x, rw, te, w_gu, w_d: compiled(x, rw, te, mx.quantized(w_gu), mx.quantized(w_d))


def main():
    from mok_inductor.kernels import moe_fwd, schedule

    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-decode")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--mxfp8", action="store_true", help="also MXFP8 routed weights: the fp8 tensor-core K loop "
                   "and the dequantizing one (floor: 1 + 1/32 bytes per weight element)")
    p.add_argument("--tokens", type=int, help="T in place of the shape's (more rows per expert, still K loop)")
    p.add_argument("--only", default="", help="comma-separated parts of the variant labels to run")
    a = p.parse_args()
    T, H, I, E, K = SHAPES[a.shape]
    T = a.tokens or T
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
    touched = torch.unique(te).numel()
    bw = copy_bandwidth()
    gu_bytes, d_bytes = touched * 2 * I * H * 2, touched * H * I * 2
    floor_ms = (gu_bytes + d_bytes) / bw * 1e3
    print(f"{a.shape} at T={T}: {touched} experts touched, floor {floor_ms:.4f} ms (gate/up {gu_bytes / bw * 1e3:.4f}, "
          f"down {d_bytes / bw * 1e3:.4f}) at {bw / 1e12:.2f} TB/s", flush=True)
    rows = dict(shape=a.shape, tokens=T, touched=touched, copy_bw=bw, floor_ms=floor_ms, variants=[])
    names = ("_gate_up_kernel", "_grouped_rows_kernel")
    base = tuple(getattr(moe_fwd, n) for n in names)
    wide = lambda k: extended(k, [cfg(*c) for c in _WIDE])  # noqa: E731
    # label: (graph, gate/up kernel, down kernel, the K loop by 32-blocks (moe_fwd.use_mx_dot: 0 off, 1 fp8,
    # 2 fp16, 3 fp16 on rows scaled once, 4 that with scale words), weight bytes per element[, {(module,
    # attribute): value} set for the variant])
    from mok_inductor import mxfp8

    ref = {2: reference64(x, rw, te, w_gu, w_d)}  # (by bytes per weight element: bf16, or MXFP8's dequantized)
    if a.mxfp8:
        ref[1 + 1 / 32] = reference64(x, rw, te, *(mxfp8.dequantize(mxfp8.quantize(w), dtype=torch.float64)
                                                   for w in (w_gu, w_d)))
    variants = {"package configs": (GraphedMok, {}, 0, 2),
                "wider configs, both GEMMs": (GraphedMok, dict(zip(names, map(wide, base))), 0, 2)}
    if a.mxfp8:
        mx_names = ("_gate_up_mx_dot_kernel", "_grouped_rows_mx_dot_kernel")
        mx_base = tuple(getattr(moe_fwd, n) for n in mx_names)
        mx_wide = {n: extended(k, [cfg(*c) for c in _MX_WIDE]) for n, k in zip(mx_names, mx_base)}
        variants["MXFP8, fp8 tensor cores (MX_FP8_DOT)"] = (GraphedMokMxfp8, {}, 1, 1 + 1 / 32)
        variants["MXFP8, fp16 tensor cores (MX_F16_DOT)"] = (GraphedMokMxfp8, {}, 2, 1 + 1 / 32)
        variants["MXFP8, fp16 tensor cores, wider configs"] = (GraphedMokMxfp8, mx_wide, 2, 1 + 1 / 32)
        rows_wide = {n: extended(k, [cfg(*c) for c in _ROWS_WIDE]) for n, k in zip(mx_names, mx_base)}
        variants["MXFP8, fp16 on rows scaled once (rows3)"] = (GraphedMokMxfp8, {}, 3, 1 + 1 / 32)
        variants["MXFP8, fp16 on rows scaled once, wider configs (rows3)"] = (GraphedMokMxfp8, rows_wide, 3,
                                                                               1 + 1 / 32)
        variants["MXFP8, rows scaled once, scales by 32-bit words (words)"] = (GraphedMokMxfp8, {}, 4, 1 + 1 / 32)
        variants["MXFP8, rows scaled once, scale words, wider configs (words)"] = (GraphedMokMxfp8, rows_wide, 4,
                                                                                1 + 1 / 32)
        trans = {n: retuned(k, [cfg(*c) for c in _TRANS]) for n, k in zip(mx_names, mx_base)}
        variants["MXFP8, scale words, transposed 8-row tiles (trans)"] = (GraphedMokMxfp8, trans, 4, 1 + 1 / 32)
        variants["MXFP8, e4m3 tensor cores on rows split once into two e4m3 terms (fp8 rows)"] = (
            GraphedMokMxfp8, {}, 4, 1 + 1 / 32, {(moe_fwd, "MX_FP8_ROWS"): True})
        occ = {n: retuned(k, [cfg(*c) for c in _OCC]) for n, k in zip(mx_names, mx_base)}
        variants["MXFP8, scale words, 8-row tiles over configs for more resident warps (occ)"] = (
            GraphedMokMxfp8, occ, 4, 1 + 1 / 32)
        for cg, cd in _TRANS_PAIRS:
            variants[f"MXFP8, scale words, transposed {'x'.join(map(str, cg))}, "
                     f"{'x'.join(map(str, cd))} (fixed)"] = (
                GraphedMokMxfp8, {n: retuned(k, [cfg(*c)]) for n, k, c in zip(mx_names, mx_base, (cg, cd))}, 4,
                1 + 1 / 32)
        variants["MXFP8, dequantizing K loop"] = (GraphedMokMxfp8, {}, 0, 1 + 1 / 32)
        # session 17 (not yet measured when written): the 64-bit scale pairs (moe_fwd.SCALE_WIDE), each against
        # the package; the one-pass row pre-pass, the two-launch schedule and the unrolled combine, each against
        # its former form
        variants["MXFP8, package (pkg)"] = (GraphedMokMxfp8, {}, 4, 1 + 1 / 32)
        variants["MXFP8, scale words by 64-bit pairs (wide)"] = (GraphedMokMxfp8, {}, 4, 1 + 1 / 32,
                                                                 {(moe_fwd, "SCALE_WIDE"): True})
        for cg, cd in (((8, 32, 256, 2, 3), (8, 64, 256, 4, 3)), ((8, 32, 256, 2, 3), (8, 64, 128, 4, 4))):
            variants[f"MXFP8, 64-bit pairs, {'x'.join(map(str, cg))}, {'x'.join(map(str, cd))} (wide fixed)"] = (
                GraphedMokMxfp8, {n: retuned(k, [cfg(*c)]) for n, k, c in zip(mx_names, mx_base, (cg, cd))}, 4,
                1 + 1 / 32, {(moe_fwd, "SCALE_WIDE"): True})
        # session 20 (on by default since session 21): each whole K step of the 8-row tiles as one dot
        # (moe_fwd.MX_ONE_DOT), with the package's configs and over the 8-row ones alone
        variants["MXFP8, whole K steps as one dot (one dot)"] = (GraphedMokMxfp8, {}, 4, 1 + 1 / 32,
                                                                 {(moe_fwd, "MX_ONE_DOT"): True})
        variants["MXFP8, blocks of each K step as separate dots, session 20's default (blocks)"] = (
            GraphedMokMxfp8, {}, 4, 1 + 1 / 32, {(moe_fwd, "MX_ONE_DOT"): False})
        variants["MXFP8, whole K steps as one dot, 8-row configs (one dot trans)"] = (
            GraphedMokMxfp8, trans, 4, 1 + 1 / 32, {(moe_fwd, "MX_ONE_DOT"): True})
        variants["MXFP8, rows scaled in two passes (two-pass rows)"] = (GraphedMokMxfp8, {}, 4, 1 + 1 / 32,
                                                                       {(moe_fwd, "ROW_F16_ONE_PASS_MAX"): 0})
        variants["MXFP8, schedule in three launches (three-launch schedule)"] = (
            GraphedMokMxfp8, {}, 4, 1 + 1 / 32, {(schedule, "FUSED_PREFIX_MAX_TILE"): 0})
        variants["MXFP8, combine by a loop over the routes (looped combine)"] = (
            GraphedMokMxfp8, {}, 4, 1 + 1 / 32, {(moe_fwd, "COMBINE_UNROLL_MAX"): 0})
        # torch.compile (default mode, static shapes) captured in the same CUDA graph: the traced launches'
        # choices (moe_fwd.scale_words by offsets, moe_fwd.MX_FEW_ROWS configs) against session 16's (byte
        # loads, the first 16-row config)
        variants["MXFP8 compiled (compiled)"] = (GraphedCompiledMxfp8, {}, 4, 1 + 1 / 32)
        # session 21: compiled graphs on the 8-row configs up to 4 routes per expert (session 17's bound; 8 since
        # session 21, T=128 at qwen3 decode, where MX_DOT 8's eager autotuning picks them)
        variants["MXFP8 compiled, 8-row configs up to 4 routes per expert (compiled few4)"] = (
            GraphedCompiledMxfp8, {}, 4, 1 + 1 / 32, {(moe_fwd, "MX_FEW_ROWS"): 4})
        variants["MXFP8 compiled, session 16's traced choices (compiled old)"] = (
            GraphedCompiledMxfp8, {}, 4, 1 + 1 / 32, {(moe_fwd, "SCALE_WORDS"): False, (moe_fwd, "MX_FEW_ROWS"): 0})
    if a.only:
        variants = {k: v for k, v in variants.items() if any(w in k for w in a.only.split(","))}
    default_kernels = {n: getattr(moe_fwd, n) for n in names + mx_names} if a.mxfp8 else dict(zip(names, base))
    default_dot = (moe_fwd.MX_FP8_DOT, moe_fwd.MX_F16_DOT, moe_fwd.MX_F16_DOT_MAX_ROWS, moe_fwd.MX_F16_MODE,
                   moe_fwd.SCALE_WORDS)
    for label, (graphed, kernels, mx_dot, elem_bytes, *flags) in variants.items():
        for n, k in kernels.items():
            setattr(moe_fwd, n, k)
        flags = flags[0] if flags else {}
        saved = {key: getattr(*key) for key in flags}
        # (a variant's K loop at every row count: the package takes the fp16 one at decode sizes only)
        moe_fwd.MX_FP8_DOT, moe_fwd.MX_F16_DOT, moe_fwd.MX_F16_DOT_MAX_ROWS = mx_dot == 1, mx_dot >= 2, 1 << 40
        moe_fwd.MX_F16_MODE = min(max(mx_dot, 2), 3)
        moe_fwd.SCALE_WORDS = mx_dot == 4
        for (module, attr), value in flags.items():
            setattr(module, attr, value)
        gk, dk = (getattr(moe_fwd, n) for n in (mx_names if mx_dot else names))
        if moe_fwd.MX_FP8_ROWS:
            gk, dk = moe_fwd._gate_up_mx8_kernel, moe_fwd._grouped_rows_mx8_kernel
        gb, db = gu_bytes * elem_bytes / 2, d_bytes * elem_bytes / 2
        v_floor = (gb + db) / bw * 1e3
        try:
            g = graphed()
            y = g(x, rw, te, w_gu, w_d).double()
            err = ((y - ref[elem_bytes]).norm() / ref[elem_bytes].norm()).item()
            ms, p20, p80 = bench(lambda: g(x, rw, te, w_gu, w_d))
            kern = kernel_profile(g.graph)
            busy = sum(kern.values())
            v = dict(variant=label, graph_ms=ms, p20=p20, p80=p80, rel_err=err, floor_ms=v_floor, vs_floor=ms / v_floor,
                     vs_bf16_floor=ms / floor_ms, kernels=kern, gaps_ms=ms - busy,
                     configs={n: str(getattr(k, "best_config", "")) for n, k in (("gate_up", gk), ("down", dk))})
            rows["variants"].append(v)
            print(f"  {label}: graph {ms:.4f} ms = {ms / v_floor:.3f}x its floor ({v_floor:.4f} ms); kernels "
                  f"{busy:.4f} ms, gaps {ms - busy:.4f} ms; rel err {err:.2e}; configs {v['configs']}", flush=True)
            for name, t in sorted(kern.items(), key=lambda kv: -kv[1]):
                nb = gb if "gate_up" in name else db if "grouped_rows" in name else 0
                extra = f"  {nb / (t * 1e-3) / 1e12:.2f} TB/s of weights" if nb else ""
                print(f"      {t:8.4f} ms  {name[:90]}{extra}", flush=True)
        except Exception as exc:  # a variant that fails to compile or run is reported, the others still run
            print(f"  {label}: FAILED {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
            rows["variants"].append(dict(variant=label, error=f"{type(exc).__name__}: {exc}"[:4000]))
        finally:
            for n, k in default_kernels.items():
                setattr(moe_fwd, n, k)
            (moe_fwd.MX_FP8_DOT, moe_fwd.MX_F16_DOT, moe_fwd.MX_F16_DOT_MAX_ROWS, moe_fwd.MX_F16_MODE,
             moe_fwd.SCALE_WORDS) = default_dot
            for (module, attr), value in saved.items():
                setattr(module, attr, value)
    with open(os.path.join(a.out, f"decode_ab_{a.shape}_T{T}.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
