"""Does Triton's automatic warp specialisation (`tl.range(..., warp_specialize=True)`) help a TMA-fed bf16
GEMM on the H200? Triton 3.6 documents it for Blackwell; its sm_90 pipeline also runs a Hopper warp
specialisation pass. One plain kernel C = A @ B^T (host descriptors for A [M, K] and B [N, K], grouped program
order), each config with and without the flag, against torch.mm, at the shapes of mok's GEMMs (mixtral's
down, gpt-oss's gate/up, mixtral's gate/up). Each output is checked against torch.mm's first.

    python benchmarks/warp_spec_ab.py [--configs 128x256x64w8s3,...] [--out DIR]   # GPU: warp_spec_ab.json
    python benchmarks/warp_spec_ab.py --self-check                                 # interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__" and "--self-check" in sys.argv:  # (before triton is imported)
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mok_inductor.kernels._launch import dot_precision, mma  # noqa: E402

SHAPES = [(16384, 4096, 14336), (32768, 2880, 2880), (16384, 28672, 4096)]  # (M, N, K)
CONFIGS = "128x256x64w8s3,128x128x64w4s4,128x256x64w4s3,128x128x64w8s4"


@triton.jit
def _mm_kernel(a_desc, b_desc, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               WS: tl.constexpr, GROUP: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first = pid // (GROUP * n_n) * GROUP
    size = min(n_m - first, GROUP)
    pm = first + (pid % (GROUP * n_n)) % size
    pn = (pid % (GROUP * n_n)) // size
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        acc = mma(a_desc.load([pm * BM, k * BK]), b_desc.load([pn * BN, k * BK]).T, acc, DOT_PREC)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def parse(c: str):
    """'128x256x64w8s3' -> (128, 256, 64, 8, 3)"""
    tile, rest = c.split("w")
    warps, stages = rest.split("s")
    return (*map(int, tile.split("x")), int(warps), int(stages))


def matmul(a, b, c, cfg, ws):
    """The launch of C = A @ B^T with config cfg = (BM, BN, BK, warps, stages), warp specialisation ws."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (M, K), N = a.shape, b.shape[0]
    bm, bn, bk, warps, stages = cfg
    ad = TensorDescriptor(a, [M, K], [K, 1], [bm, bk])
    bd = TensorDescriptor(b, [N, K], [K, 1], [bn, bk])
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    return lambda: _mm_kernel[grid](ad, bd, c, M, N, K, bm, bn, bk, ws, 8, dot_precision(a.dtype),
                                       num_warps=warps, num_stages=stages)


def self_check():
    """Tiny shapes under the interpreter: the kernel against a float64 product (K not a multiple of BK, M and N
    not multiples of the tile)."""
    for ws in (False, True):
        a = torch.randn(40, 72, dtype=torch.bfloat16)
        b = torch.randn(24, 72, dtype=torch.bfloat16)
        c = torch.full((40, 24), float("nan"), dtype=torch.bfloat16)
        matmul(a, b, c, (16, 16, 32, 1, 1), ws)()
        ref = a.double() @ b.double().T
        err = ((c.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err
        print(f"self-check ws={ws}: relative error {err:.2e}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--self-check", action="store_true")
    a = p.parse_args()
    if a.self_check:
        return self_check()
    rows = []
    for M, N, K in SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ref = x @ w.T
        ms = triton.testing.do_bench(lambda: x @ w.T, warmup=25, rep=200)
        rows.append(dict(shape=[M, N, K], variant="torch.mm", ms=ms, tflops=2 * M * N * K / ms / 1e9))
        print(f"{M}x{N}x{K}: torch.mm {ms:.3f} ms {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
        for c in a.configs.split(","):
            for ws in (False, True):
                out = torch.full_like(ref, float("nan"))
                f = matmul(x, w, out, parse(c), ws)
                try:
                    f()
                except Exception as exc:  # a config that does not compile is reported, the others still run
                    print(f"  {c} ws={ws}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    rows.append(dict(shape=[M, N, K], variant=f"{c} ws={ws}", error=str(exc)[:2000]))
                    continue
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                ms = triton.testing.do_bench(f, warmup=25, rep=200)
                rows.append(dict(shape=[M, N, K], variant=f"{c} ws={ws}", ms=ms, tflops=2 * M * N * K / ms / 1e9,
                                 rel_err=err))
                print(f"  {c} ws={ws}: {ms:.3f} ms {rows[-1]['tflops']:.0f} TFLOP/s (relative error {err:.1e})",
                      flush=True)
        del x, w, ref
    os.makedirs(a.out, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(os.path.join(a.out, "warp_spec_ab.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
