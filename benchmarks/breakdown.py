"""Per-kernel times of the mok forward and backward at one shape (kernel launchers called directly,
autotuned first), with the TFLOP/s each kernel reaches: where the time goes.

    python benchmarks/breakdown.py --shapes qwen3-30b-a3b,mixtral-8x7b [--out DIR] [--tma-ab] [--wgrad-tma]
        [--kernels wgrad,dx]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, MokPointerLoads, bench, make_inputs  # noqa: E402


def persistent(fn, *args, **kw):
    """fn(*args, **kw) with the persistent gate/up kernel (kernels.moe_fwd.PERSISTENT_GATE_UP)."""
    from mok_inductor.kernels import moe_fwd

    moe_fwd.PERSISTENT_GATE_UP = True
    try:
        return fn(*args, **kw)
    finally:
        moe_fwd.PERSISTENT_GATE_UP = False


def pointer_loads(fn):
    """fn with every tile loaded by pointers (bench_moe.MokPointerLoads' switch: the A/B of the TMA loads)."""
    def run():
        with MokPointerLoads().context():
            return fn()

    return run


def breakdown(name, kind="balanced", tma_ab=False, only=None):
    from mok_inductor import kernels as K_
    from mok_inductor.kernels import bwd_act, combine, gate_up, grouped_rows, plain, plain_t, wgrad
    from mok_inductor.ops import split_gate_up

    T, H, I, E, K = SHAPES[name]
    N = T * K
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, kind)
    wg, wu = split_gate_up(w_gu)
    g_op, u_op, d_op = plain(wg), plain(wu), plain(w_d)
    dy = torch.randn_like(x)
    sched = K_.build_schedule(te, E)
    so, off = sched.sorted_routes_N, sched.expert_offsets_E1
    rw_N = rw.reshape(-1).contiguous()
    te_N = te.reshape(-1).contiguous()
    gu = torch.empty(N, 2 * I, dtype=x.dtype, device="cuda")
    y_N = torch.empty(N, H, dtype=x.dtype, device="cuda")
    y = torch.empty_like(x)
    h = torch.empty(N, I, dtype=x.dtype, device="cuda")
    gate_up(x, g_op, u_op, gu, so, off, K, None, h_out=h)
    dgu, _, hs = bwd_act(dy, plain_t(w_d), gu, rw_N, so, off, K, None)
    d_d, d_g, d_u = torch.empty_like(w_d), torch.empty_like(wg), torch.empty_like(wu)
    dx_N = torch.empty(N, H, dtype=x.dtype, device="cuda")
    f = 2 * N * H * I
    steps = [
        ("schedule", lambda: K_.build_schedule(te, E), 0),
        ("fwd gate_up (+gather), writes g, u, h", lambda: gate_up(x, g_op, u_op, gu, so, off, K, None, h_out=h),
         2 * f),
        ("fwd gate_up persistent (A/B candidate)", lambda: persistent(gate_up, x, g_op, u_op, gu, so, off, K, None,
                                                                    h_out=h), 2 * f),
        ("fwd down (scatter to routes)", lambda: grouped_rows(h, d_op, y_N, so, off), f),
        ("fwd combine", lambda: combine(y_N, te_N, y, rw_N=rw_N), 0),
        ("bwd act fused (dy@down + SwiGLU bwd + drw)",
         lambda: bwd_act(dy, plain_t(w_d), gu, rw_N, so, off, K, None, two_pass=False), f),
        ("bwd act fused, subtiled epilogue (128-wide tiles)",
         lambda: bwd_act(dy, plain_t(w_d), gu, rw_N, so, off, K, None, two_pass=False, subtile=True), f),
        ("bwd act two-pass (GEMM fp32, then SwiGLU bwd)",
         lambda: bwd_act(dy, plain_t(w_d), gu, rw_N, so, off, K, None, two_pass=True), f),
        ("bwd wgrad down", lambda: wgrad(dy, hs, d_d, so, off, K, a_gather=True, b_gather=False), f),
        ("bwd wgrad gate", lambda: wgrad(dgu[:, :I], x, d_g, so, off, K, a_gather=False, b_gather=True), f),
        ("bwd wgrad up", lambda: wgrad(dgu[:, I:], x, d_u, so, off, K, a_gather=False, b_gather=True), f),
        ("bwd wgrad gate+up (one launch)", lambda: wgrad(dgu, x, d_g, so, off, K, a_gather=False, b_gather=True,
                                                         dst2_EMN=d_u), 2 * f),
        ("bwd dx (gate+up dgrad)", lambda: grouped_rows(dgu, plain_t(wg), dx_N, so, off, w2=plain_t(wu)), 2 * f),
        ("bwd combine dx", lambda: combine(dx_N, te_N, y), 0),
    ]
    if only:  # the kernels whose label holds one of these words
        steps = [st for st in steps if any(w in st[0] for w in only)]
    if tma_ab:  # each GEMM also with pointer loads only
        steps = [v for st in steps for v in ([st] if not st[2] else [st, (st[0] + " [pointer loads]",
                                                                          pointer_loads(st[1]), st[2])])]
    rows = []
    for label, fn, flops in steps:
        fn()
        ms, p20, p80 = bench(fn)
        rows.append(dict(shape=name, kernel=label, ms=ms, tflops=flops / (ms * 1e-3) / 1e12 if flops else 0.0))
        print(f"  {name:>18} {label:>62}: {ms:7.3f} ms {rows[-1]['tflops']:6.0f} TFLOP/s", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tma-ab", action="store_true", help="each GEMM also with pointer loads (TMA_KERNELS off)")
    p.add_argument("--wgrad-tma", action="store_true", help="the weight gradients with TMA too (moe_bwd.WGRAD_TMA)")
    p.add_argument("--kernels", default="", help="comma-separated words: only the kernels whose label holds one")
    a = p.parse_args()
    if a.wgrad_tma:
        from mok_inductor.kernels import moe_bwd

        moe_bwd.WGRAD_TMA = True
    rows = []
    only = [w for w in a.kernels.split(",") if w]
    for s in a.shapes.split(","):
        rows += breakdown(s, tma_ab=a.tma_ab, only=only)
    with open(os.path.join(a.out, "breakdown.json"), "w") as f:
        json.dump(rows, f, indent=1)
    from kernel_report import report

    with open(os.path.join(a.out, "kernel_report.md"), "w") as f:
        f.write(report() + "\n")


if __name__ == "__main__":
    main()
