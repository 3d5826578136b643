"""One eager MoE call at decode sizes (a few tokens, no gradient), what each generated token pays per layer.

    python benchmarks/bench_decode.py --out out/decode
    python benchmarks/bench_decode.py --check          # CPU smoke run (the Triton interpreter): outputs agree

For each shape and token count: the wall time per call in a loop that synchronises only every 200 calls (generate()
runs ahead of the GPU until the host's launch work is the bound: at decode sizes it is), and the kernels' time alone
(their durations summed by torch.profiler). Contenders: mok's decode forward (the default at these sizes,
`options.decode_max_routes`), mok's grouped kernels (`decode_max_routes=0`: the schedule, the grouped GEMMs, the
combine) and `torch._grouped_mm` eager (bench_moe.py's sort, gather, grouped GEMMs, combine), each checked against
the first on the same inputs. The weight-read floor is the routed weights the call touches over the copy bandwidth
measured on the card.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--check" in sys.argv:  # the kernels on CPU tensors: the interpreter, switched on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402
import mok_inductor  # noqa: E402

# name: (H, I, E, K); the token counts of each run are --tokens
SHAPES = {
    "qwen3-moe-small": (1024, 512, 64, 8),  # generate_hf.py's model
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "gpt-oss-20b": (2880, 2880, 32, 4),
}


def mok_grouped(x, rw, te, w_gu, w_d):
    with mok_inductor.options.override(decode_max_routes=0):
        return mok_inductor.moe(x, rw, te, w_gu, w_d)


CONTENDERS = {"mok": bench_moe.moe_mok, "mok_grouped": mok_grouped, "grouped_mm": bench_moe.moe_grouped_mm}


def wall_us(f, n=1000, sync_every=200):
    """Microseconds per call of f, synchronising every `sync_every` calls (and before and after)."""
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        f()
        if i % sync_every == sync_every - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def kernels_us(f, n=50):
    """Microseconds of GPU kernel time per call of f: the kernels' durations summed (torch.profiler, CUDA
    activity only), without the host's launch work or the gaps between kernels. (Not a CUDA-graph replay:
    grouped_mm's eager path sizes its groups with torch.bincount, a host synchronisation a capture refuses.)"""
    from torch.profiler import ProfilerActivity, profile

    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            f()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / n if total > 0 else float("nan")


def run(shapes, tokens, names, log):
    bandwidth = bench_moe.copy_bandwidth()  # bytes/s
    log(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    rows = []
    for name in shapes:
        H, I, E, K = SHAPES[name]
        for T in tokens:
            x, rw, te, w_gu, w_d = bench_moe.make_inputs(T, H, I, E, K, "balanced")
            row = {"shape": name, "T": T, "routes": T * K,
                   "floor_us": bench_moe.weight_read_floor_ms(te, H, I, w_gu.dtype, bandwidth)[0] * 1e3}
            with torch.no_grad():
                ref = None
                for c in names:
                    f = lambda c=c: CONTENDERS[c](x, rw, te, w_gu, w_d)
                    y = f()
                    ref = y if ref is None else ref
                    row[c] = {"wall_us": wall_us(f), "kernels_us": kernels_us(f),
                              "rel_to_first": bench_moe.rel_err(y, ref)}
            rows.append(row)
            log(f"{name} T={T} ({T * K} routes): floor {row['floor_us']:.1f} us; " + "; ".join(
                f"{c} wall {row[c]['wall_us']:.1f} kernels {row[c]['kernels_us']:.1f} "
                f"(rel {row[c]['rel_to_first']:.1e})" for c in names))
    return rows


def check():
    """CPU smoke run under the interpreter, at a tiny decode shape: each contender's output against a float64
    loop, and "mok" ran the decode forward (its gate/up kernel launched)."""
    from mok_inductor.kernels import gemv

    T, H, I, E, K = 2, 32, 16, 8, 2
    x, rw, te, w_gu, w_d = bench_moe.make_inputs(T, H, I, E, K, "balanced", device="cpu")
    ref = bench_moe.moe_eager(x.double(), rw.double(), te, w_gu.double(), w_d.double())  # HF's loop in float64
    ok = True
    launches = []
    real = gemv.gemv_routes
    gemv.gemv_routes = lambda *a, **k: (launches.append(1), real(*a, **k))[1]
    try:
        with torch.no_grad(), mok_inductor.options.override(backend="triton"):
            for c, f in CONTENDERS.items():
                del launches[:]
                err = bench_moe.rel_err(f(x, rw, te, w_gu, w_d).double(), ref)
                good = err <= 1e-2 and (c != "mok" or launches == [1]) and (c != "mok_grouped" or not launches)
                ok &= good
                print(f"{c}: rel {err:.1e}, decode forward {'ran' if launches else 'not run'} "
                      f"{'ok' if good else 'FAILED'}")
    finally:
        gemv.gemv_routes = real
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/decode")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="1,2,4")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--check", action="store_true", help="CPU smoke run (TRITON_INTERPRET=1): the outputs agree")
    a = p.parse_args()
    if a.check:
        sys.exit(0 if check() else 1)
    if not torch.cuda.is_available():
        p.error("the timings need a CUDA GPU; without one, --check compares the outputs under the interpreter")
    os.makedirs(a.out, exist_ok=True)
    log = bench_moe.tee_log(a.out, "decode.log", "w")
    rows = run(a.shapes.split(","), [int(t) for t in a.tokens.split(",")], a.contenders.split(","), log)
    with open(os.path.join(a.out, "decode.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
