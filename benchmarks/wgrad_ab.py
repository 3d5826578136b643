"""Why the grouped weight gradient runs below a plain Triton GEMM of the same shapes: one diagnostic kernel
(written here) whose constexprs add, one at a time, what mok's wgrad does beyond a batched GEMM, timed in
one process against mok's own kernel (`kernels.moe_bwd.wgrad`).

    static rows: expert e owns rows [e*Me, (e+1)*Me), Me = N/E (the batched GEMM of benchmarks/ceiling.py)
    + offsets:   the routing's real per-expert row ranges [offsets[e], offsets[e+1]) (masks on the last step)
    + gather:    B's rows read through an int32 token index per sorted row (precomputed)
    + divide:    the token index computed in the loop as sorted_routes // K (what mok's kernel did up to
                 session 4), then each of: int32 offsets, an L2 swizzle of the tiles, the index loaded one
                 step ahead, gate and up as one GEMM of 2I rows (what it does since)

    python benchmarks/wgrad_ab.py --shapes qwen3-30b-a3b,mixtral-8x7b [--out DIR] [--mok-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, bench, make_inputs  # noqa: E402
from ceiling import _CONFIGS  # noqa: E402
from mok_inductor.kernels.moe_fwd import swizzle  # noqa: E402


@triton.autotune(configs=_CONFIGS, key=["MD", "ND", "M", "E", "DYN", "GATHER", "I32", "SWZ", "PREF"])
@triton.jit
def _wg(a_ptr, sa_r, b_ptr, sb_r, idx_ptr, routes_ptr, offs_ptr, c_ptr, MD, ND, M, E, Me, TOPK,
        DYN: tl.constexpr, GATHER: tl.constexpr, I32: tl.constexpr, SWZ: tl.constexpr, PREF: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[e] = A[rows of e]^T @ B[rows of e] (B's rows gathered when GATHER), c [E, MD, ND] bf16. I32: int32
    row offsets; SWZ: 8 row tiles per L2 group; PREF: the next step's token indices loaded one step ahead."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_n = tl.cdiv(ND, BLOCK_N)
    if SWZ:
        pm, pn = swizzle(pid, tl.cdiv(MD, BLOCK_M), num_n, 8)
    else:
        pm = pid // num_n
        pn = pid % num_n
    ms = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    if DYN:
        lo = tl.load(offs_ptr + e)
        hi = tl.load(offs_ptr + e + 1)
    else:
        lo = e * Me
        hi = lo + Me
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    nxt = tl.load(idx_ptr + lo + ks, mask=lo + ks < hi, other=0)
    for r0 in range(lo, hi, BLOCK_K):
        rows = r0 + ks
        rmask = rows < hi
        if GATHER == 0:
            br = rows
        elif GATHER == 1:
            if PREF:
                br = nxt
                nxt = tl.load(idx_ptr + rows + BLOCK_K, mask=rows + BLOCK_K < hi, other=0)
            else:
                br = tl.load(idx_ptr + rows, mask=rmask, other=0)
        else:
            br = tl.load(routes_ptr + rows, mask=rmask, other=0) // TOPK
        if I32:
            ar = rows[None, :] * sa_r
            brr = br[:, None] * sb_r
        else:
            ar = rows[None, :].to(tl.int64) * sa_r
            brr = br[:, None].to(tl.int64) * sb_r
        a = tl.load(a_ptr + ar + ms[:, None], mask=(ms < MD)[:, None] & rmask[None, :], other=0.0)
        b = tl.load(b_ptr + brr + ns[None, :], mask=rmask[:, None] & (ns < ND)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    e64 = e.to(tl.int64)
    tl.store(c_ptr + e64 * MD * ND + ms[:, None] * ND + ns[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(ms < MD)[:, None] & (ns < ND)[None, :])


def run(name, mok_only=False):
    from mok_inductor import kernels as K_
    from mok_inductor.kernels import moe_bwd

    T, H, I, E, K = SHAPES[name]
    N = T * K
    x, _, te, _, _ = make_inputs(T, H, I, E, K, "balanced")
    sched = K_.build_schedule(te, E)
    so, off = sched.sorted_routes_N, sched.expert_offsets_E1
    tok = (so.long() // K).to(torch.int32)
    dgu = torch.randn(N, 2 * I, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    hs = torch.randn(N, I, device="cuda", dtype=torch.bfloat16)
    xs = x[tok.long()].contiguous()  # pre-gathered rows (no gather in the kernel)
    Me = N // E
    a = dgu[:, :I]
    c = torch.empty(E, I, H, device="cuda", dtype=torch.bfloat16)
    c2 = torch.empty_like(c)
    d_d = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16)
    offl = off.tolist()
    ref = torch.stack([a[offl[e]:offl[e + 1]].float().t() @ xs[offl[e]:offl[e + 1]].float() for e in range(E)])
    f = 2.0 * N * H * I

    cw = torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16)

    def diag(dyn, gather, i32=False, swz=False, pref=False, wide=False):
        b = xs if gather == 0 else x
        aa, md, cc = (dgu, 2 * I, cw) if wide else (a, I, c)
        grid = lambda m: (triton.cdiv(md, m["BLOCK_M"]) * triton.cdiv(H, m["BLOCK_N"]), E)
        _wg[grid](aa, aa.stride(0), b, b.stride(0), tok, so, off, cc, md, H, N, E, Me, K, DYN=dyn, GATHER=gather,
                  I32=i32, SWZ=swz, PREF=pref)
        return cc[:, :I] if wide else cc

    variants = {  # (fn, GEMMs of 2NHI FLOPs it does, check against ref)
        "diag static rows (batched GEMM)": (lambda: diag(False, 0), 1, False),
        "diag + offsets": (lambda: diag(True, 0), 1, True),
        "diag + offsets + gather (index array) = G": (lambda: diag(True, 1), 1, True),
        "diag + offsets + gather (routes // K)": (lambda: diag(True, 2), 1, True),
        "G + int32 offsets": (lambda: diag(True, 1, i32=True), 1, True),
        "G + L2 swizzle": (lambda: diag(True, 1, swz=True), 1, True),
        "G + index prefetch": (lambda: diag(True, 1, pref=True), 1, True),
        "G, gate and up as one GEMM (MD = 2I)": (lambda: diag(True, 1, wide=True), 2, True),
        "G + all four": (lambda: diag(True, 1, i32=True, swz=True, pref=True, wide=True), 2, True),
        "no gather, int32, swizzle, MD = 2I": (lambda: diag(True, 0, i32=True, swz=True, wide=True), 2, True),
    }
    if mok_only:
        variants = {}
    # mok's kernel (moe_bwd._wgrad_kernel, autotuned over its configs) as the backward calls it
    kw = dict(routes_N=so, offsets_E1=off, topk=K, tokens_N=tok)
    variants["mok wgrad gate"] = (lambda: moe_bwd.wgrad(a, x, c, a_gather=False, b_gather=True, **kw), 1, True)
    variants["mok wgrad gate+up (one GEMM)"] = (
        lambda: moe_bwd.wgrad(dgu, x, c, a_gather=False, b_gather=True, dst2_EMN=c2, **kw), 2, True)
    variants["mok wgrad down"] = (lambda: moe_bwd.wgrad(dy, hs, d_d, a_gather=True, b_gather=False, **kw), 1, False)
    rows = []
    for label, (fn, mult, check) in variants.items():
        try:
            out = fn()
            err = ((out.float() - ref).norm() / ref.norm()).item() if check else float("nan")
            ms, _, _ = bench(fn)
            rows.append(dict(shape=name, variant=label, ms=ms, tflops=mult * f / (ms * 1e-3) / 1e12, err=err))
            print(f"  {name:>16} {label:>48}: {ms:7.3f} ms {rows[-1]['tflops']:5.0f} TF  err {err:.1e}", flush=True)
        except Exception as exc:
            rows.append(dict(shape=name, variant=label, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            print(f"  {name:>16} {label:>48}: {rows[-1]['error'][:120]}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--mok-only", action="store_true", help="time mok's kernel alone")
    a = p.parse_args()
    rows = []
    for s in a.shapes.split(","):
        rows += run(s, a.mok_only)
        with open(os.path.join(a.out, "wgrad_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
