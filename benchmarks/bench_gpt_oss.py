"""GPT-OSS experts as a GPT-OSS model runs them: transformers' `GptOssExperts` (biases, interleaved gate/up
columns, its clamped gate `(up + 1) * gate * sigmoid(1.702 * gate)`) at the gpt-oss-20b shape, fwd and fwd+bwd,
with the "mok" experts backend (eager and under torch.compile) against the same module on transformers'
"grouped_mm" backend under torch.compile, on one GPU, in one process. The same run times the plain SwiGLU
without biases at the same shape (bench_moe.py's mok and grouped_mm_compiled) so the two ratios sit side by side.

    python benchmarks/bench_gpt_oss.py --out DIR [--tokens 8192] [--rounds 3] [--iters 10]
    python benchmarks/bench_gpt_oss.py --check     # CPU smoke run at a tiny shape: the checks, no timing

Every contender's output and gradients are checked against the module's own eager loop (transformers' reference
formulation) before timing. fwd+bwd: the gradients of x, the routing weights and the four parameters. The
rounds alternate the contenders; ratios are grouped_mm_compiled's time over each contender's (above 1: faster
than grouped_mm). Results: gpt_oss.json and the log.
Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_moe import SHAPES, rel_err, routing_tensors, tee_log, timed  # noqa: E402


def experts_module(T, H, I, E, K, seed=0, device="cuda"):
    """A GptOssExperts of the gpt-oss config at (H, I, E, K) with random weights and biases (bf16) and routing
    inputs for T tokens."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    torch.manual_seed(seed)
    m = GptOssExperts(cfg)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn_like(m.gate_up_proj) * H ** -0.5)
        m.gate_up_proj_bias.copy_(torch.randn_like(m.gate_up_proj_bias) * 0.1)
        m.down_proj.copy_(torch.randn_like(m.down_proj) * I ** -0.5)
        m.down_proj_bias.copy_(torch.randn_like(m.down_proj_bias) * 0.1)
    m = m.to(device, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device=device, dtype=torch.bfloat16)
    rw, te = routing_tensors(T, E, K, "balanced", gen, device)
    return m, x, te, rw.to(torch.bfloat16)


def with_backend(module, backend):
    """A view of `module` (the same parameters) whose experts run on `backend`."""
    m = copy.copy(module)
    m.config = copy.copy(module.config)
    m.config._experts_implementation = backend
    return m


def contenders(module):
    import mok_inductor

    mok_inductor.enable()  # registers "mok" in transformers' experts interface
    compile_ = dict(fullgraph=True, dynamic=False)
    return {
        "mok": with_backend(module, "mok"),
        "mok_compiled": torch.compile(with_backend(module, "mok"), **compile_),
        "grouped_mm_compiled": torch.compile(with_backend(module, "grouped_mm"), **compile_),
    }


def leaves_of(module, x, rw):
    return [x.detach().clone().requires_grad_(True), rw.detach().clone().requires_grad_(True),
            *module.parameters()]


def step_fn(f, module, x, te, rw, dy, grad):
    """fwd (no autograd) or fwd+bwd (the gradients of x, rw and the parameters) of contender `f`."""
    if not grad:
        def fwd():
            with torch.no_grad():
                return f(x, te, rw)
        return fwd
    leaves = leaves_of(module, x, rw)

    def fwd_bwd():
        return torch.autograd.grad(f(leaves[0], te, leaves[1]), leaves, dy)
    return fwd_bwd


def check(module, fs, x, te, rw, dy, log):
    """Each contender's output and gradients against the module's eager loop (in float32 from the same bf16
    values). mok's must be within bf16's 2e-2; the baseline's are logged (its bias gradients, summed in bf16,
    measured 3.4e-2 / 3.8e-2 on an H100)."""
    ref = with_backend(copy.deepcopy(module).float(), "eager")
    leaves = leaves_of(ref, x.float(), rw.float())
    y_ref = ref(leaves[0], te, leaves[1])
    g_ref = torch.autograd.grad(y_ref, leaves, dy.float())
    names = ["y", "dx", "drw"] + ["d" + n for n, _ in module.named_parameters()]
    worst = {}
    for c, f in fs.items():
        mine = leaves_of(module, x, rw)
        y = f(mine[0], te, mine[1])
        g = torch.autograd.grad(y, mine, dy)
        errs = {n: rel_err(a, b) for n, a, b in zip(names, (y, *g), (y_ref, *g_ref))}
        worst[c] = max(errs.values())
        log(f"check {c}: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
        if c.startswith("mok") and not worst[c] <= 2e-2:
            raise SystemExit(f"{c} disagrees with transformers' eager GptOssExperts: {errs}")
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out/gpt-oss")
    p.add_argument("--check", action="store_true", help="CPU smoke run: a tiny shape, the checks only")
    p.add_argument("--tokens", type=int, default=SHAPES["gpt-oss-20b"][0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    if not a.check and not torch.cuda.is_available():
        p.error("the timings need a CUDA GPU; without one, --check runs the checks at a tiny shape")

    if a.check:
        module, x, te, rw = experts_module(16, 64, 32, 4, 2, device="cpu")
        check(module, contenders(module), x, te, rw, torch.randn_like(x), print)
        return
    log = tee_log(a.out, "gpt_oss.log", "w")

    _, H, I, E, K = SHAPES["gpt-oss-20b"]
    T = a.tokens
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} transformers "
        f"{__import__('transformers').__version__}; GptOssExperts T={T} H={H} I={I} E={E} K={K} bf16")
    module, x, te, rw = experts_module(T, H, I, E, K)
    dy = torch.randn_like(x)
    fs = contenders(module)
    worst = check(module, fs, x, te, rw, dy, log)

    # the plain SwiGLU without biases at the same shape (bench_moe's contenders), for the ratio it reaches
    from bench_moe import grad_leaves, make_inputs, moe_grouped_mm_compiled, moe_mok

    px, prw, pte, pgu, pdn = make_inputs(T, H, I, E, K, "balanced")
    pleaves, pdy = grad_leaves(px, prw, pgu, pdn)

    def plain(f, grad):
        if not grad:
            def fwd():
                with torch.no_grad():
                    return f(px, prw, pte, pgu, pdn)
            return fwd
        return lambda: torch.autograd.grad(f(pleaves[0], pleaves[1], pte, pleaves[2], pleaves[3]), pleaves, pdy)

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": dict(T=T, H=H, I=I, E=E,
               K=K), "check_max_rel_err": worst}
    base = "grouped_mm_compiled"
    for mode, grad in (("fwd", False), ("fwd+bwd", True)):
        steps = {f"gpt_oss {c}": step_fn(f, module, x, te, rw, dy, grad) for c, f in fs.items()}
        steps["swiglu mok"] = plain(moe_mok, grad)
        steps["swiglu grouped_mm_compiled"] = plain(moe_grouped_mm_compiled, grad)
        for c, s in steps.items():  # compile and warm up
            t0 = time.time()
            s()
            torch.cuda.synchronize()
            log(f"{mode} {c}: first call {time.time() - t0:.1f} s")
        rounds = []
        for r in range(a.rounds):
            row = {c: timed(s, a.iters)[0] for c, s in steps.items()}
            rounds.append(row)
            log(f"{mode} round {r + 1}: " + ", ".join(f"{c} {ms:.3f} ms" for c, ms in row.items()))
        med = {c: statistics.median(r[c] for r in rounds) for c in steps}
        ratios = {}
        for family in ("gpt_oss", "swiglu"):
            for c in steps:
                if c.startswith(family + " ") and not c.endswith(base):
                    rs = [r[f"{family} {base}"] / r[c] for r in rounds]
                    ratios[c] = dict(median=statistics.median(rs), min=min(rs), max=max(rs))
                    log(f"{mode} {c}: {med[c]:.3f} ms, {family} {base} {med[family + ' ' + base]:.3f} ms: "
                        f"{ratios[c]['median']:.3f}x (min {min(rs):.3f}, max {max(rs):.3f})")
        results[mode] = dict(median_ms=med, ratios_vs_grouped_mm_compiled=ratios, rounds=rounds)
    with open(os.path.join(a.out, "gpt_oss.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
