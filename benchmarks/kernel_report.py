"""Compile report of the mok Triton kernels after a run: registers, spills, shared memory, and whether
the PTX holds wgmma (Hopper tensor cores) and the SASS HGMMA. Run in the process that ran them
(import and call `report()`), or as a script after a small forward+backward."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _jit_fns():
    from mok_inductor.kernels import moe_bwd, moe_fwd, schedule

    for mod in (moe_fwd, moe_bwd, schedule):
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                k = getattr(mod, name)
                yield name, getattr(k, "fn", k), getattr(k, "best_config", None)


def _sass_hgmma(cubin: bytes) -> int:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run(["cuobjdump", "--dump-sass", f.name], capture_output=True, text=True).stdout
        return out.count("HGMMA")
    except Exception:
        return -1
    finally:
        os.unlink(f.name)


def report() -> str:
    lines = ["| kernel | compiled name | warps | stages | regs | spills | shared B | wgmma in PTX | HGMMA in SASS |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    picks = []
    for name, fn, best in _jit_fns():
        from mok_inductor.kernels import moe_bwd, moe_fwd

        tuner = getattr(moe_fwd, name, None) or getattr(moe_bwd, name, None)
        for key, c in getattr(tuner, "cache", {}).items():
            picks.append(f"- {name} key {key[:5]}: {c}")
        for dev, caches in getattr(fn, "device_caches", {}).items():
            for key, ck in caches[0].items():
                try:
                    ck._init_handles()
                except Exception:
                    pass
                md = ck.metadata
                ptx = ck.asm.get("ptx", "")
                hg = _sass_hgmma(ck.asm["cubin"]) if "cubin" in ck.asm else -1
                blocks = ck.metadata.name[-40:]
                lines.append(f"| {name} | {blocks} | {md.num_warps} | {md.num_stages} | "
                             f"{getattr(ck, 'n_regs', '?')} | {getattr(ck, 'n_spills', '?')} | {md.shared} | "
                             f"{ptx.count('wgmma.mma_async')} | {hg} |")
    return "\n".join(lines + ["", "Autotuner picks:"] + picks)


if __name__ == "__main__":
    import torch

    import mok_inductor

    T, H, I, E, K = 4096, 2048, 768, 128, 8
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rw = torch.rand(T, K, device="cuda", requires_grad=True)
    te = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w1 = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    w2 = (torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    s1 = (torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    s2 = (torch.randn(H, I, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    sg = (torch.randn(1, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    y = mok_inductor.moe(x, rw, te, w1, w2, shared_gate_up_proj=s1, shared_down_proj=s2, shared_output_gate=sg)
    y.sum().backward()
    torch.cuda.synchronize()
    print(report())
