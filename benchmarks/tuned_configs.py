"""Which tile config the eager autotuner picks for each mok kernel at the shapes of shared/BENCH.md, and
whether it is the first of the kernel's list: the one a graph compiled in Inductor's default mode runs
(kernels/_launch.py, `traced_variant`). A pick other than the first is time a compiled model loses against
eager mok.

    python benchmarks/tuned_configs.py [--shapes qwen3-30b-a3b,mixtral-8x7b,gpt-oss-20b,deepseek-v3-slice]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import CONTENDERS, SHAPES, fwd_bwd_step, grad_leaves, make_inputs  # noqa: E402


def autotuners():
    import triton

    from mok_inductor.kernels import moe_bwd, moe_fwd, schedule

    for mod in (moe_fwd, moe_bwd, schedule):
        for name in sorted(dir(mod)):
            k = getattr(mod, name)
            if isinstance(k, triton.runtime.Autotuner):
                yield name, k


def picks() -> dict:
    """{kernel: [(key, config, index of the config in the kernel's list)]} of the autotuners' caches."""
    out = {}
    for name, k in autotuners():
        configs = [str(c) for c in k.configs]
        out[name] = [(str(key[:6]), str(c), configs.index(str(c))) for key, c in k.cache.items()]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,gpt-oss-20b,deepseek-v3-slice")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    res = {}
    for shape in a.shapes.split(","):
        for _, k in autotuners():
            k.cache.clear()
        T, H, I, E, K = SHAPES[shape]
        x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
        leaves, dy = grad_leaves(x, rw, w_gu, w_d)
        fwd_bwd_step(CONTENDERS["mok"], leaves, te, dy)()
        torch.cuda.synchronize()
        res[shape] = picks()
        print(f"== {shape}")
        for name, rows in res[shape].items():
            for key, c, i in rows:
                print(f"  {name}{'' if i == 0 else ' (NOT FIRST)'} #{i} {c}   key {key}")
        del leaves, x, w_gu, w_d
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "tuned_configs.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
