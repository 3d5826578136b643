"""Compile cost: a 2-layer MoE model using mok::moe against the same model written with torch._grouped_mm.

Each measurement runs in a fresh subprocess with an empty Inductor cache directory, so it is a cold compile:
the time of the first compiled forward+backward call minus the time of an eager forward+backward call.
Prints a table and writes JSON (`--json`).

    python benchmarks/compile_time.py [--device cuda|cpu] [--json out.json]

On the CPU the mok model's compiled graph calls the PyTorch reference, so only the GPU figure compares
the compilers' work; the CPU run is a smoke test.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class MoELayer(nn.Module):
    """Router + top-k + SwiGLU experts with Hugging Face's weight layout; `impl` picks the formulation."""

    def __init__(self, H, I, E, K, impl):
        super().__init__()
        self.K, self.impl = K, impl
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H) * H**-0.5)
        self.down_proj = nn.Parameter(torch.randn(E, H, I) * I**-0.5)

    def forward(self, x):
        T, H = x.shape
        rw, te = torch.topk(self.router(x).float().softmax(-1), self.K)
        if self.impl == "mok":
            import mok_inductor

            return x + mok_inductor.moe(x, rw, te, self.gate_up_proj, self.down_proj)
        # the torch._grouped_mm formulation (sort, gather, grouped GEMM, SwiGLU, grouped GEMM, weight, scatter)
        E = self.gate_up_proj.shape[0]
        flat = te.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=E, min=0, max=E - 1)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        xs = x[order // self.K]
        gu = torch._grouped_mm(xs, self.gate_up_proj.transpose(-2, -1), offs=offs)
        g, u = gu.chunk(2, dim=-1)
        h = F.silu(g) * u
        ys = torch._grouped_mm(h, self.down_proj.transpose(-2, -1), offs=offs)
        ys = ys * rw.reshape(-1)[order, None].to(ys.dtype)
        out = torch.zeros(T * self.K, H, dtype=ys.dtype, device=x.device).index_copy(0, order, ys)
        return x + out.view(T, self.K, H).sum(1)


def one(impl, device, dtype, T, H, I, E, K):
    torch.manual_seed(0)
    model = nn.Sequential(MoELayer(H, I, E, K, impl), MoELayer(H, I, E, K, impl)).to(device=device, dtype=dtype)
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)

    def step(m):
        m(x).float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    step(model)  # warm eager (kernel loading, autotuning outside the compile)
    t0 = time.perf_counter()
    step(model)
    eager = time.perf_counter() - t0
    if impl == "mok":
        import mok_inductor

        mok_inductor.enable()  # compiled graphs inline mok's Triton kernels (grouped_mm's process stays without it)
    compiled = torch.compile(model, fullgraph=True)
    t0 = time.perf_counter()
    step(compiled)
    first = time.perf_counter() - t0
    return {"impl": impl, "compile_s": first - eager, "first_call_s": first, "eager_step_s": eager}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    p.add_argument("--child", nargs=1)
    a = p.parse_args()
    shape = dict(T=256, H=256, I=128, E=8, K=2)
    dtype = torch.bfloat16  # torch._grouped_mm compiles only in bf16
    if a.child:
        print(json.dumps(one(a.child[0], a.device, dtype, **shape)))
        return
    rows = []
    for impl in ("grouped_mm", "mok"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="mok-compile-time-"))
        out = subprocess.run([sys.executable, __file__, "--device", a.device, "--child", impl], env=env,
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"cold compile of a 2-layer MoE model, fwd+bwd, {a.device}, bf16, {shape}, torch {torch.__version__}")
    for r in rows:
        print(f"  {r['impl']:<11} compile {r['compile_s']:6.1f} s  (first call {r['first_call_s']:.1f} s, "
              f"eager step {r['eager_step_s'] * 1e3:.1f} ms)")
    print(f"  mok / grouped_mm compile time: {rows[1]['compile_s'] / rows[0]['compile_s']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "torch": torch.__version__, "shape": shape, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
