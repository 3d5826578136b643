"""Issue 3's fwd+bwd ratios (mok against compiled torch._grouped_mm), measured in interleaved rounds.

benchmarks/bench_moe.py times each contender once, one after the other, with a fixed 100 ms of
repetitions: at the mixtral shape (about 32 ms per fwd+bwd) that is three samples, and mok's figure moved
by 4-7% between runs (docs/benchmarks.md, run 9). Here, per shape, after both contenders are compiled and
warmed up, R rounds alternate them (mok, compiled, mok, compiled, ...), each timing at least --iters
iterations (triton's do_bench, median); the report gives every round's ratio and their median, min and max,
so a ratio near a target can be told from the noise. --contenders takes two or more names; the last is the
baseline every other one is divided into (e.g. mok,mok_compiled,grouped_mm_compiled).

    python benchmarks/ratio_ab.py [--shapes mixtral-8x7b,gpt-oss-20b,qwen3-30b-a3b] [--rounds 5] [--iters 20]
                                  [--contenders mok,grouped_mm_compiled]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import CONTENDERS, SHAPES, fwd_bwd_step, grad_leaves, make_inputs  # noqa: E402

TARGETS = {"qwen3-30b-a3b": 1.4, "mixtral-8x7b": 1.03, "gpt-oss-20b": 1.15, "deepseek-v3-slice": 1.05}


def timed(fn, iters):
    """Median ms of `fn` over do_bench's repetitions, sized for at least `iters` calls."""
    import triton

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    q = triton.testing.do_bench(fn, warmup=max(25, 2 * est), rep=max(100, iters * est), return_mode="all")
    return statistics.median(q), len(q)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="mixtral-8x7b,gpt-oss-20b,qwen3-30b-a3b")
    p.add_argument("--contenders", default="mok,grouped_mm_compiled")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    names = a.contenders.split(",")
    base = names[-1]  # every other contender's ratio is base / it
    out = []
    for shape in a.shapes.split(","):
        T, H, I, E, K = SHAPES[shape]
        x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
        leaves, dy = grad_leaves(x, rw, w_gu, w_d)
        steps = {c: fwd_bwd_step(CONTENDERS[c], leaves, te, dy) for c in names}
        for c, s in steps.items():  # compile, autotune, warm up
            t0 = time.time()
            s()
            torch.cuda.synchronize()
            print(f"{shape} {c}: first call {time.time() - t0:.0f} s", flush=True)
        rounds = []
        for r in range(a.rounds):
            row = {}
            for c, s in steps.items():
                row[c], row[c + "_n"] = timed(s, a.iters)
            for c in names[:-1]:
                row[c + "_ratio"] = row[base] / row[c]
            rounds.append(row)
            print(f"  round {r + 1}: " + ", ".join(f"{c} {row[c]:.3f} ms ({row[c + '_n']} its)" for c in names)
                  + "; " + ", ".join(f"{c} {row[c + '_ratio']:.3f}x" for c in names[:-1]), flush=True)
        res = dict(shape=shape, target=TARGETS.get(shape), base=base,
                   median_ms={c: statistics.median(r[c] for r in rounds) for c in steps}, rounds=rounds)
        for c in names[:-1]:
            ratios = [r[c + "_ratio"] for r in rounds]
            res[c] = dict(median_ratio=statistics.median(ratios), min_ratio=min(ratios), max_ratio=max(ratios))
            print(f"{shape}: fwd+bwd {base} / {c} median {res[c]['median_ratio']:.3f}x (min {min(ratios):.3f}, max "
                  f"{max(ratios):.3f}; target {res['target']}x); {c} {res['median_ms'][c]:.3f} ms, {base} "
                  f"{res['median_ms'][base]:.3f} ms", flush=True)
        out.append(res)
        del steps, leaves
        torch.cuda.empty_cache()
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rounds=a.rounds, iters=a.iters)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ratio_ab.json"), "w") as f:
        json.dump(dict(meta=meta, results=out), f, indent=1)


if __name__ == "__main__":
    main()
