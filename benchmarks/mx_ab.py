"""MXFP8 routed weights at training/prefill sizes (issue 8's "forward at least 1.2x BF16 MoK"): the forward
of one layer, same process, variants interleaved round by round:

- bf16 mok (the weights as bf16);
- MXFP8, dequantized once per call then the bf16 GEMMs (the package's choice at >= MX_DEQUANTIZE_MIN_ROWS
  routes per expert);
- MXFP8 on the fp8 tensor cores in the K loop (moe_fwd.MX_FP8_DOT: two e4m3 activation terms, per-32-block
  float32 scaling), forced at this size;
- MXFP8 dequantized in the K loop (forced).

    python benchmarks/mx_ab.py --shapes mixtral-8x7b,qwen3-30b-a3b [--rounds 3] [--out DIR]

Also prints each variant's relative difference to bf16 mok's output on the dequantized weights (for bf16 mok
itself: the weights' quantization error).
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
    import mok_inductor
    from mok_inductor import kernels, mxfp8
    from mok_inductor.kernels import moe_fwd

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="mixtral-8x7b,qwen3-30b-a3b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    results = []
    # label: (quantized, MX_DEQUANTIZE_MIN_ROWS (None: the package's), MX_FP8_DOT (None: the package's))
    variants = {"bf16 mok": (False, None, None), "MXFP8, dequantized once per call (default)": (True, None, None),
                "MXFP8, fp8 tensor cores in the K loop": (True, 1 << 62, True),
                "MXFP8, dequantized in the K loop": (True, 1 << 62, False)}
    for shape in a.shapes.split(","):
        T, H, I, E, K = SHAPES[shape]
        x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
        q_gu, q_d = mxfp8.quantize(w_gu, columnwise=False), mxfp8.quantize(w_d, columnwise=False)
        dq_gu, dq_d = mxfp8.dequantize(q_gu), mxfp8.dequantize(q_d)
        flops = 6 * T * K * H * I
        default_rows, default_dot = kernels.MX_DEQUANTIZE_MIN_ROWS, moe_fwd.MX_FP8_DOT
        times = {v: [] for v in variants}
        errs = {}
        with torch.no_grad():
            want = mok_inductor.moe(x, rw, te, dq_gu, dq_d).float()
            for r in range(a.rounds):
                for label, (quant, rows, fp8_dot) in variants.items():
                    kernels.MX_DEQUANTIZE_MIN_ROWS = default_rows if rows is None else rows
                    moe_fwd.MX_FP8_DOT = default_dot if fp8_dot is None else fp8_dot
                    try:
                        args = (x, rw, te, q_gu, q_d) if quant else (x, rw, te, w_gu, w_d)
                        if r == 0:
                            y = mok_inductor.moe(*args).float()
                            errs[label] = ((y - want).norm() / want.norm()).item()
                        times[label].append(bench(lambda: mok_inductor.moe(*args))[0])
                    finally:
                        kernels.MX_DEQUANTIZE_MIN_ROWS = default_rows
                        moe_fwd.MX_FP8_DOT = default_dot
        bf16 = min(times["bf16 mok"])
        for label, ts in times.items():
            ms = min(ts)
            results.append(dict(shape=shape, variant=label, fwd_ms=ms, tflops=flops / ms / 1e9, vs_bf16=bf16 / ms,
                                rel_diff_to_bf16_on_dequantized=errs[label], rounds=ts))
            print(f"{shape:>18} {label:>45}: fwd {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  {bf16 / ms:5.2f}x bf16 "
                  f"mok  rel diff {errs[label]:.1e}", flush=True)
    with open(os.path.join(a.out, "mx_ab.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
