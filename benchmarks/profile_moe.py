"""Where one MoE layer's time goes: `mok_inductor.moe` at a shape of bench_moe.py, forward or forward and
backward, profiled kernel by kernel with torch.profiler after a warm-up (compilation and autotuning stay out).

    python benchmarks/profile_moe.py --shapes qwen3-30b-a3b [--mode fwd+bwd] [--mxfp8] [--compiled]
                                     [--options autotune=0,tma=0] [--iters 10] [--out DIR]
    python benchmarks/profile_moe.py --device cpu --shapes tiny     # CPU smoke run (the reference's ops)

For each shape: a table of kernels (calls and device milliseconds per layer call, share of the device time,
and for the GEMM kernels their rate: the FLOPs of the GEMMs that kernel runs in the call over its time),
the device time summed over kernels, and the wall time per call (the difference is launch gaps and host
time). `--gemm-refs` adds the same GEMM stages run by `torch._grouped_mm` (CUTLASS; on rows already grouped
by expert, balanced), one dense `torch.mm` of the gate/up stage's FLOPs (the ceiling) and, where the Triton
kernels run, mok's own row GEMM kernel on the same plain gate/up problem (no gather, no SwiGLU: the GEMM core
alone, beside the fused gate/up kernel of the profile; checked against float32 matmuls first), in TFLOP/s.
`--options` sets `mok_inductor.options` fields for the run (see docs/api.md); `--compiled` profiles
`torch.compile(mok_inductor.moe)` after `mok_inductor.enable()`. Writes `profile.json` under --out. The profile
itself uses only the public API, so kernel names are whatever the installed version launches; the row-kernel
reference calls `mok_inductor.kernels.grouped_gemm.grouped_rows`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import mok_inductor  # noqa: E402
from bench_moe import SHAPES, bench, make_inputs  # noqa: E402

SMOKE_SHAPES = {"tiny": (64, 64, 32, 8, 2)}  # T, H, I, E, K


def parse_options(text: str) -> dict:
    """"autotune=0,tma=0,two_pass_min_rows=512" -> changes for mok_inductor.options.override."""
    fields = {f.name: f.type for f in dataclasses.fields(mok_inductor.options.Options)}
    changes = {}
    for item in filter(None, text.split(",")):
        name, _, raw = item.partition("=")
        if name not in fields:
            raise SystemExit(f"--options: unknown option {name!r}; known: {', '.join(sorted(fields))}")
        kind = str(fields[name])
        changes[name] = (raw not in ("0", "false", "False", "no", "off")) if "bool" in kind else \
            int(raw) if "int" in kind else raw
    return changes


def layer_call(shape, mode, mxfp8, compiled, device):
    """A no-argument callable running one layer call (fwd, or fwd+bwd) on fresh random inputs."""
    T, H, I, E, K = shape
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced", device=device)
    leaves = [t.detach().clone().requires_grad_(mode == "fwd+bwd") for t in (x, rw, w_gu, w_d)]
    gu, d = leaves[2], leaves[3]
    if mxfp8:
        from mok_inductor import mxfp8 as mx

        gu, d = mx.quantize(gu), mx.quantize(d)  # once, as a trainer quantizes once per step
    fn = mok_inductor.moe
    if compiled:
        mok_inductor.enable()
        fn = torch.compile(mok_inductor.moe, fullgraph=True, dynamic=False)
    dy = torch.randn_like(x)

    def call():
        if mode == "fwd":
            with torch.no_grad():
                return fn(leaves[0], leaves[1], te, gu, d)
        y = fn(leaves[0], leaves[1], te, gu, d)
        return torch.autograd.grad(y, [leaves[0], leaves[1], leaves[2], leaves[3]], dy, allow_unused=True)

    return call


# The GEMMs each kernel family runs per layer call, in units of N*H*I multiply-adds x 2 (N = T*K routes):
# forward gate/up [N, H] x [H, 2I] and down [N, I] x [I, H]; backward dh (fused with the SwiGLU backward),
# dx [N, 2I] x [2I, H] (the same row kernel as down), the weight gradients of down and gate/up.
GEMM_UNITS = {"fwd": {"_gate_up_kernel": 2, "_grouped_rows_kernel": 1},
              "fwd+bwd": {"_gate_up_kernel": 2, "_grouped_rows_kernel": 3, "_bwd_act_body": 1, "_wgrad_body": 3}}


def gemm_tflops(kernel: str, ms: float, shape, mode: str):
    """The rate of a GEMM kernel family's row of the profile (None for other kernels)."""
    T, H, I, E, K = shape
    units = next((u for name, u in GEMM_UNITS[mode].items() if name in kernel), None)
    return None if units is None or not ms else units * 2 * T * K * H * I / (ms * 1e9)


def _time_ms(fn, device, reps=20):
    """Median milliseconds of fn(): bench_moe's timing on the GPU, a wall-clock loop on the CPU (smoke runs)."""
    if device == "cuda":
        return bench(fn)[0]
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


ROW_KERNEL_STAGE = "gate/up, mok row kernel (no gather, no SwiGLU)"


def gemm_refs(shape, mode, device, dtype=torch.bfloat16):
    """The layer's GEMM stages as torch._grouped_mm runs them (rows grouped by expert, E equal groups), one
    dense torch.mm of the gate/up stage's FLOPs and, where the kernels run, mok's row GEMM kernel on the plain
    gate/up problem: {stage: (ms, TFLOP/s)}."""
    T, H, I, E, K = shape
    N = T * K
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*size):
        return torch.randn(*size, generator=g, device=device, dtype=dtype)

    xs, h, dys, dgu = rnd(N, H), rnd(N, I), rnd(N, H), rnd(N, 2 * I)
    w_gu, w_d = rnd(E, 2 * I, H), rnd(E, H, I)
    offs = (torch.arange(1, E + 1, device=device) * N // E).to(torch.int32)
    mm = torch._grouped_mm
    stages = {"gate/up": (lambda: mm(xs, w_gu.transpose(1, 2), offs=offs), 2),
              "down": (lambda: mm(h, w_d.transpose(1, 2), offs=offs), 1)}
    if mode == "fwd+bwd":
        stages.update({"dh": (lambda: mm(dys, w_d, offs=offs), 1), "dx": (lambda: mm(dgu, w_gu, offs=offs), 2),
                       "wgrad down": (lambda: mm(dys.t(), h, offs=offs), 1),
                       "wgrad gate/up": (lambda: mm(dgu.t(), xs, offs=offs), 2)})
    dense_b = rnd(H, 2 * I)
    stages["dense mm (gate/up FLOPs)"] = (lambda: torch.mm(xs, dense_b), 2)
    if mok_inductor.ops.kernels_module() is not None:  # CUDA, or the interpreter on a CPU smoke run
        from mok_inductor.kernels.grouped_gemm import grouped_rows
        from mok_inductor.types import Operand

        routes = torch.arange(N, device=device, dtype=torch.int32)
        offsets = torch.cat([torch.zeros(1, device=device, dtype=torch.int32), offs])
        gu = torch.full((N, 2 * I), float("nan"), device=device, dtype=dtype)

        def rows():
            return grouped_rows(xs, Operand(w_gu, None), gu, routes, offsets, scatter=False)

        bounds = [0, *offs.tolist()]
        want = torch.cat([xs[a:b].float() @ w_gu[e].float().T for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        err = ((rows().float() - want).norm() / want.norm()).item()
        if not err <= 1e-2:  # (checked before it is timed, like every contender)
            raise RuntimeError(f"{ROW_KERNEL_STAGE}: relative error {err:.3g} against a float32 matmul")
        stages[ROW_KERNEL_STAGE] = (rows, 2)
    out = {}
    for name, (fn, units) in stages.items():
        try:
            ms = _time_ms(fn, device)
        except RuntimeError as e:  # a layout this torch's grouped_mm does not take: say so, time the rest
            out[name] = (None, f"failed: {str(e).splitlines()[0][:120]}")
            continue
        out[name] = (ms, units * 2 * N * H * I / (ms * 1e9))
    return out


def profile(call, iters, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):  # compile, autotune, warm caches
        call()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / iters
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            call()
        sync()
    rows = []
    for ev in prof.key_averages():
        if device == "cuda":
            us = getattr(ev, "self_device_time_total", None)
            if us is None:
                us = getattr(ev, "self_cuda_time_total", 0.0)
            if not us or ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:  # the reference's aten ops, self CPU time
            us = ev.self_cpu_time_total
            if not us or not ev.key.startswith("aten::"):
                continue
        rows.append(dict(kernel=ev.key, calls=ev.count / iters, ms=us / 1e3 / iters))
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = r["ms"] / total if total else 0.0
    return dict(wall_ms=wall_ms, kernel_ms=total, kernels=rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b", help=f"comma-separated: {', '.join(SHAPES)}, tiny")
    p.add_argument("--mode", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
    p.add_argument("--mxfp8", action="store_true", help="MXFP8 routed weights (mok_inductor.mxfp8.quantize)")
    p.add_argument("--compiled", action="store_true", help="torch.compile(mok_inductor.moe) after enable()")
    p.add_argument("--options", default="", help="mok_inductor.options changes, e.g. autotune=0,tma=0")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=25, help="print this many kernels per shape")
    p.add_argument("--gemm-refs", action="store_true",
                   help="also time the GEMM stages with torch._grouped_mm and a dense torch.mm (TFLOP/s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    if a.device == "cpu" and set(a.shapes.split(",")) - set(SMOKE_SHAPES):
        p.error("model-sized shapes on the CPU: the timings need a CUDA GPU (--shapes tiny is the CPU smoke run)")
    changes = parse_options(a.options)
    shapes = {**SHAPES, **SMOKE_SHAPES}
    meta = dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", torch=torch.__version__,
                mode=a.mode, mxfp8=a.mxfp8, compiled=a.compiled, options=changes,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(meta, flush=True)
    out = []
    with mok_inductor.options.override(**changes):
        for name in a.shapes.split(","):
            res = profile(layer_call(shapes[name], a.mode, a.mxfp8, a.compiled, a.device), a.iters, a.device)
            for r in res["kernels"]:
                r["tflops"] = gemm_tflops(r["kernel"], r["ms"], shapes[name], a.mode)
            if a.gemm_refs:
                res["gemm_refs"] = gemm_refs(shapes[name], a.mode, a.device)
            out.append(dict(shape=name, **res))
            print(f"== {name} {shapes[name]} (T, H, I, E, K), {a.mode}: wall {res['wall_ms']:.3f} ms per call, "
                  f"kernels {res['kernel_ms']:.3f} ms")
            print(f"| kernel | calls | ms | share | TFLOP/s |\n| --- | --- | --- | --- | --- |")
            for r in res["kernels"][:a.top]:
                rate = "" if r["tflops"] is None else f"{r['tflops']:.0f}"
                print(f"| {r['kernel'][:70]} | {r['calls']:g} | {r['ms']:.4f} | {r['share']:.1%} | {rate} |")
            for stage, (ms, rate) in res.get("gemm_refs", {}).items():
                print(f"reference {stage}: " + (rate if ms is None else f"{ms:.4f} ms, {rate:.0f} TFLOP/s"))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile.json"), "w") as f:
        json.dump(dict(meta=meta, results=out), f, indent=1)


if __name__ == "__main__":
    main()
