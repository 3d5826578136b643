"""Same-process A/B of split per-expert weights (Megatron's SequentialMLP layout: E separate [2I, H] and
[H, I] allocations) against one 3-D tensor each, through the functional ABI (what the Megatron backend
calls): forward, and forward + backward with fresh weight gradients. Three ways to run the split weights:

- "split, address tables" (the default since session 6): the kernels read each expert in place through a
  device table of its address (`kernels.moe_fwd.ExpertTable`);
- "split, stacked per call": one copy of the weights per forward and per backward (what MXFP8 lists did,
  and what torch.compile traces), timed here by forcing the stacking path;
- "3-D weights": the floor the split layouts should reach.

Expected: the tables cost one scalar load per tile, so "split, address tables" within noise of "3-D"; the
stacking costs about 2 x the weight bytes / the copy bandwidth per call (qwen3: 1.2 GB of bf16 weights,
~0.6 ms each way at ~4 TB/s).

    python benchmarks/split_ab.py --shapes qwen3-30b-a3b,mixtral-8x7b [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, bench, make_inputs  # noqa: E402


def main():
    from mok_inductor import functional as mf

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    rows = []
    from mok_inductor.kernels.moe_fwd import ExpertTable

    real_of = ExpertTable.of
    for name in a.shapes.split(","):
        T, H, I, E, K = SHAPES[name]
        x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
        dy = torch.randn_like(x)
        cfg = mf.MoKConfig()
        ws = mf.get_workspace(cfg, None, device=x.device, num_local_tokens=T, hidden_size=H, topk=K)
        fc1 = [w.clone() for w in w_gu.unbind(0)]  # separate allocations, as Megatron's per-expert params
        fc2 = [w.clone() for w in w_d.unbind(0)]
        layouts = {"3-D weights": (w_gu, w_gu, w_d), "split, address tables": (fc1, fc1, fc2),
                   "split, stacked per call": (fc1, fc1, fc2)}
        flops = {"fwd": 6 * T * K * H * I, "fwd+bwd": 18 * T * K * H * I}

        def steps(routed):
            def fwd():
                sch = mf.build_schedule(ws, cfg, te, num_local_experts=E)
                return mf.forward(cfg, ws, sch, x, rw, None, None, None, *routed)

            def fwd_bwd():
                sch = mf.build_schedule(ws, cfg, te, num_local_experts=E)
                y, fctx = mf.forward(cfg, ws, sch, x, rw, None, None, None, *routed)
                return mf.backward(cfg, ws, sch, fctx, dy, x, rw, None, None, None, *routed)

            return {"fwd": fwd, "fwd+bwd": fwd_bwd}

        times = {(v, m): [] for v in layouts for m in flops}
        for _ in range(a.rounds):
            for v, routed in layouts.items():
                if v == "split, stacked per call":  # the stacking path (as while torch.compile traces)
                    ExpertTable.of = staticmethod(lambda p: real_of(p) if isinstance(p, torch.Tensor) else None)
                try:
                    for m, fn in steps(routed).items():
                        fn()
                        times[(v, m)].append(bench(fn)[0])
                finally:
                    ExpertTable.of = staticmethod(real_of)
        for (v, m), ts in times.items():
            ms = sorted(ts)[len(ts) // 2]
            base = sorted(times[("3-D weights", m)])[len(ts) // 2]
            rows.append(dict(shape=name, layout=v, mode=m, ms=ms, tflops=flops[m] / (ms * 1e-3) / 1e12,
                             vs_3d=ms / base, rounds=ts))
            print(f"  {name:>18} {m:>8} {v:>24}: {ms:7.3f} ms {rows[-1]['tflops']:6.0f} TFLOP/s "
                  f"{rows[-1]['vs_3d']:5.3f}x the 3-D time", flush=True)
    with open(os.path.join(a.out, "split_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
