"""What the GEMMs of one MoE layer cost without MoE: each GEMM of mok's forward and backward timed as
(a) a vendor batched GEMM (`torch.bmm`, cuBLAS) over E equal experts of N/E rows, no gather, no epilogue;
(b) `torch._grouped_mm` (CUTLASS) with the benchmark routing's real per-expert offsets;
(c) a plain Triton batched GEMM (written here, autotuned over a broad config list; also a persistent
    variant whose tile loop is flattened into the K loop so the next tile's loads overlap the epilogue);
(d) mok's own kernel for that GEMM (gather, masks, epilogue included).
The sums say which fwd+bwd times are reachable with GEMMs of each kind: where a target needs less time
than the Triton GEMMs alone take, Triton's GEMM rate at these shapes is what blocks it.

    python benchmarks/ceiling.py --shapes qwen3-30b-a3b,mixtral-8x7b [--out DIR]
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
from mok_inductor.kernels.moe_fwd import swizzle  # noqa: E402


def _c(bm, bn, bk, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)


_CONFIGS = [_c(128, 128, 64, 8, 3), _c(128, 128, 64, 8, 4), _c(128, 256, 64, 8, 3), _c(256, 128, 64, 8, 3),
            _c(128, 128, 64, 4, 4), _c(64, 128, 64, 4, 4), _c(128, 64, 64, 4, 4), _c(128, 128, 128, 8, 3)]


@triton.jit
def _bgemm_tile(a_ptr, sa_e, sa_m, sa_k, b_ptr, sb_e, sb_k, sb_n, c_ptr, M, N, K, e, pid,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile `pid` of C[e] = A[e] @ B[e], C contiguous [E, M, N]; 8 row tiles per L2 group."""
    pm, pn = swizzle(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), 8)
    ms = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(a_ptr + e * sa_e + ms[:, None] * sa_m + kk[None, :] * sa_k,
                    mask=(ms < M)[:, None] & (kk < K)[None, :], other=0.0)
        b = tl.load(b_ptr + e * sb_e + kk[:, None] * sb_k + ns[None, :] * sb_n,
                    mask=(kk < K)[:, None] & (ns < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + e * M * N + ms[:, None] * N + ns[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(ms < M)[:, None] & (ns < N)[None, :])


@triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "E"])
@triton.jit
def _bgemm(a_ptr, sa_e, sa_m, sa_k, b_ptr, sb_e, sb_k, sb_n, c_ptr, M, N, K, E,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The batched GEMMs, one program per tile: grid (tiles of one expert, E)."""
    _bgemm_tile(a_ptr, sa_e, sa_m, sa_k, b_ptr, sb_e, sb_k, sb_n, c_ptr, M, N, K, tl.program_id(1).to(tl.int64),
                tl.program_id(0), BLOCK_M, BLOCK_N, BLOCK_K)


@triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "E"])
@triton.jit
def _bgemm_persistent(a_ptr, sa_e, sa_m, sa_k, b_ptr, sb_e, sb_k, sb_n, c_ptr, M, N, K, E, NUM_SMS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same GEMMs, NUM_SMS programs looping over all tiles (experts outermost), the tile loop flattened."""
    per_e = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), per_e * E, NUM_SMS, flatten=True):
        _bgemm_tile(a_ptr, sa_e, sa_m, sa_k, b_ptr, sb_e, sb_k, sb_n, c_ptr, M, N, K, (tile // per_e).to(tl.int64),
                    tile % per_e, BLOCK_M, BLOCK_N, BLOCK_K)


def triton_bmm(a, b, c, persistent=False):
    E, M, K = a.shape
    N = b.shape[2]
    args = (a, *a.stride(), b, *b.stride(), c, M, N, K, E)
    if persistent:
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        _bgemm_persistent[(sms,)](*args, NUM_SMS=sms)
    else:
        _bgemm[lambda m: (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]), E)](*args)
    return c


def best_config(kernel):
    cfg = getattr(kernel, "best_config", None)
    return str(cfg) if cfg is not None else ""


def gemms(T, H, I, E, K):
    """(name, A [E, M, K] view maker, B [E, K, N], mok kernel label) per GEMM of the layer; Me = N/E rows."""
    Me = T * K // E
    return [  # name, (M, K, N) per expert, A transposed?, B transposed?, breakdown label of mok's kernel
        ("fwd gate+up", (Me, H, 2 * I), False, True, "fwd gate_up (+gather), writes g, u, h"),
        ("fwd down", (Me, I, H), False, True, "fwd down (scatter to routes)"),
        ("bwd dh = dy @ down", (Me, H, I), False, False, "bwd act two-pass (GEMM fp32, then SwiGLU bwd)"),
        ("bwd dx = dgu @ [gate; up]", (Me, 2 * I, H), False, False, "bwd dx (gate+up dgrad)"),
        ("bwd wgrad gate+up", (2 * I, Me, H), True, False, "bwd wgrad gate+up (one launch)"),
        ("bwd wgrad down", (H, Me, I), True, False, "bwd wgrad down"),
    ]


def operands(E, M, Kd, N, a_t, b_t):
    """bf16 A [E, M, Kd] and B [E, Kd, N] in the layouts the layer has (a transposed view when the
    reduction runs over token rows: the wgrads; B as [E, N, Kd] transposed for the weights of the fwd)."""
    a = (torch.randn(E, Kd, M, device="cuda", dtype=torch.bfloat16).transpose(1, 2) if a_t
         else torch.randn(E, M, Kd, device="cuda", dtype=torch.bfloat16))
    b = (torch.randn(E, N, Kd, device="cuda", dtype=torch.bfloat16).transpose(1, 2) if b_t
         else torch.randn(E, Kd, N, device="cuda", dtype=torch.bfloat16))
    return a, b


def ceiling(name, mok_rows):
    T, H, I, E, K = SHAPES[name]
    x, rw, te, _, _ = make_inputs(T, H, I, E, K, "balanced")
    counts = torch.bincount(te.reshape(-1), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    mok_ms = {r["kernel"]: r["ms"] for r in mok_rows if r["shape"] == name}
    rows = []
    for label, (M, Kd, N), a_t, b_t, mok_label in gemms(T, H, I, E, K):
        flops = 2.0 * E * M * Kd * N
        a, b = operands(E, M, Kd, N, a_t, b_t)
        c = torch.empty(E, M, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.bmm(a.float(), b.float())
        entry = dict(shape=name, gemm=label, M=M, K=Kd, N=N, E=E)
        fns = {"bmm (cuBLAS)": lambda: torch.bmm(a, b, out=c),
               "triton": lambda: triton_bmm(a, b, c),
               "triton persistent": lambda: triton_bmm(a, b, c, persistent=True)}
        # torch._grouped_mm with the routing's offsets: rows grouped along M (fwd, dgrad) or along the
        # reduction (wgrad: A^T [rows -> K] of each expert's rows)
        if not a_t:
            ag = a.reshape(E * M, Kd)[: int(offs[-1])]
            fns["grouped_mm (CUTLASS)"] = lambda: torch._grouped_mm(ag, b, offs=offs)
        else:
            xa = torch.randn(int(offs[-1]), M, device="cuda", dtype=torch.bfloat16)  # [rows, MD]
            xb = torch.randn(int(offs[-1]), N, device="cuda", dtype=torch.bfloat16)  # [rows, ND]
            fns["grouped_mm (CUTLASS)"] = lambda: torch._grouped_mm(xa.t(), xb, offs=offs)
        for kind, fn in fns.items():
            try:
                out = fn()
                if kind != "grouped_mm (CUTLASS)":
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, f"{kind} wrong: {err}"
                ms, _, _ = bench(fn)
                entry[kind] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                if kind.startswith("triton"):
                    entry[kind]["config"] = best_config(_bgemm_persistent if "persistent" in kind else _bgemm)
            except Exception as exc:  # a variant that does not compile is a result, not a crash
                entry[kind] = dict(error=f"{type(exc).__name__}: {str(exc)[:200]}")
        if mok_label in mok_ms:
            ms = mok_ms[mok_label]
            entry["mok"] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        rows.append(entry)
        cells = "  ".join(f"{k}: {v['ms']:.3f} ms {v['tflops']:.0f} TF" if "ms" in v else f"{k}: {v['error'][:60]}"
                          for k, v in entry.items() if isinstance(v, dict))
        print(f"  {name:>18} {label:>26}  {cells}", flush=True)
    kinds = ["bmm (cuBLAS)", "grouped_mm (CUTLASS)", "triton", "triton persistent", "mok"]
    tot = {k: sum(r[k]["ms"] for r in rows if "ms" in r.get(k, {})) for k in kinds}
    weights = {"fwd gate+up": 1, "fwd down": 1}
    fwd = {k: sum(r[k]["ms"] for r in rows if r["gemm"] in weights and "ms" in r.get(k, {})) for k in kinds}
    f_fwd = 6.0 * T * K * H * I
    summary = dict(shape=name, gemm="sum", fwd_ms=fwd, fwd_bwd_ms=tot,
                   fwd_tflops={k: f_fwd / (v * 1e-3) / 1e12 for k, v in fwd.items() if v},
                   fwd_bwd_tflops={k: 3 * f_fwd / (v * 1e-3) / 1e12 for k, v in tot.items() if v})
    print(f"  {name:>18} {'GEMMs only, fwd+bwd':>26}  " + "  ".join(
        f"{k}: {v:.3f} ms {summary['fwd_bwd_tflops'][k]:.0f} TF" for k, v in tot.items() if v), flush=True)
    rows.append(summary)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--no-mok", action="store_true", help="skip mok's own kernels (benchmarks/breakdown.py)")
    a = p.parse_args()
    from breakdown import breakdown

    rows = []
    for s in a.shapes.split(","):
        mok_rows = [] if a.no_mok else breakdown(s)
        rows += mok_rows
        rows += ceiling(s, mok_rows)
        with open(os.path.join(a.out, "ceiling.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
