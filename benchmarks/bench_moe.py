"""One MoE layer, mok against its contenders, fwd and fwd+bwd, on one GPU, in one process.

    python benchmarks/bench_moe.py --out DIR [--shapes qwen3-30b-a3b,mixtral-8x7b,...] [--contenders ...]
    python benchmarks/bench_moe.py --rounds 5 --contenders mok,mok_compiled,grouped_mm_compiled   # ratios
    python benchmarks/bench_moe.py --rounds 3 --modes fwd,fwd+bwd --skewed-shapes mixtral-8x7b ...  # + forward, skewed
    python benchmarks/bench_moe.py --check          # CPU smoke run: every contender against mok, no timing

Contenders: mok (mok_inductor.moe, Triton kernels), mok_compiled (the same under torch.compile, static sizes),
mok_compiled_dynamic (torch.compile(dynamic=True): one graph for every token count), mok_graph
(decode: mok's forward replayed from a CUDA graph), mok_mxfp8 / mok_mxfp8_graph (MXFP8 routed weights,
--mxfp8), mok_pointer_loads (mok with options tma=False), eager (the Hugging Face loop over hit experts),
grouped_mm (sort + gather + torch._grouped_mm, HF's "grouped_mm" experts backend formulation),
grouped_mm_compiled (the same under torch.compile(fullgraph=True)), liger (Liger-Kernel's Triton fused MoE,
when installed), dense (one [T*K, H] x [H, 3I] bf16 GEMM of the same forward FLOPs: the ceiling; fwd+bwd =
it and its two backward GEMMs) and, for decode, the floor (bytes of the touched experts' weights / measured
copy bandwidth).

FLOPs: forward 6*T*K*H*I (gate and up 4*T*K*H*I, down 2*T*K*H*I), fwd+bwd 18*T*K*H*I. Times: median of
triton.testing.do_bench (p20/p80 kept). Peak forward memory: max_memory_allocated during one
forward (outputs and saved activations alive) minus what was allocated before. Every contender is
checked against mok's output before it is timed. Results: a table last, bench.json (+ bench.png).
With --rounds R, per shape and routing (--routing, and --skewed-shapes: none unless given) and mode (--modes:
fwd, fwd+bwd (the default); the forward without autograd recording), after every contender is compiled and warmed
up, R rounds alternate the contenders (each timing at least --iters iterations), and the median, min and max of
each round's ratio (the last contender's time over each other's) go to ratios.json (written after each entry): a
ratio near 1 told from the noise.
Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = {  # name: (T, H, I, E, K)
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
    "gpt-oss-20b": (8192, 2880, 2880, 32, 4),
    "deepseek-v3-slice": (8192, 7168, 2048, 32, 8),
    "qwen3-decode": (64, 2048, 768, 128, 8),
}


@dataclasses.dataclass(frozen=True)
class Result:
    shape: str
    routing: str
    contender: str
    mode: str  # fwd | fwd+bwd
    ms: float
    ms_p20: float
    ms_p80: float
    tflops: float
    peak_fwd_mib: float
    rel_err_vs_mok: float
    note: str = ""


def routing_tensors(T, E, K, kind, gen, device):
    logits = torch.randn(T, E, generator=gen, device=device)
    if kind == "skewed":  # ~half of the routes to 10% of the experts
        hot = max(1, E // 10)
        logits[:, :hot] += 2.0 if E > 16 else 1.0
    probs = logits.softmax(-1)
    rw, te = probs.topk(K, dim=-1)
    rw = rw / rw.sum(-1, keepdim=True)
    return rw.float(), te


def make_inputs(T, H, I, E, K, kind, device="cuda", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device=device, dtype=dtype)
    rw, te = routing_tensors(T, E, K, kind, gen, device)
    w_gu = (torch.randn(E, 2 * I, H, generator=gen, device=device, dtype=dtype) * H ** -0.5)
    w_d = (torch.randn(E, H, I, generator=gen, device=device, dtype=dtype) * I ** -0.5)
    return x, rw, te, w_gu, w_d


# ---------------------------------------------------------------------------------------------
# Contenders: f(x, rw, te, w_gu, w_d) -> y [T, H]


def moe_mok(x, rw, te, w_gu, w_d):
    import mok_inductor

    return mok_inductor.moe(x, rw, te, w_gu, w_d)


def moe_eager(x, rw, te, w_gu, w_d):
    """The Hugging Face eager experts loop."""
    y = torch.zeros_like(x)
    I = w_d.shape[-1]
    mask = F.one_hot(te, num_classes=w_gu.shape[0]).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit.flatten().tolist():
        pos, tok = torch.where(mask[e])
        xe = x[tok]
        gu = xe @ w_gu[e].t()
        h = F.silu(gu[:, :I]) * gu[:, I:]
        out = (h @ w_d[e].t()) * rw[tok, pos, None].to(x.dtype)
        y.index_add_(0, tok, out.to(x.dtype))
    return y


def moe_grouped_mm(x, rw, te, w_gu, w_d):
    """Sort by expert, gather, grouped GEMM, SwiGLU, grouped GEMM, weight, index_add_."""
    T, K = te.shape
    E, two_i, _ = w_gu.shape
    I = two_i // 2
    flat = te.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[tok]
    gu = torch._grouped_mm(xs, w_gu.transpose(-2, -1), offs=offs)
    h = F.silu(gu[:, :I]) * gu[:, I:]
    out = torch._grouped_mm(h, w_d.transpose(-2, -1), offs=offs)
    out = out * rw.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, tok, out)


_compiled = {}


def _compiled_fn(fn, dynamic=False):
    # dynamic=False: every shape gets its own static compile. With automatic dynamic shapes the second shape of
    # a run recompiles with symbolic sizes, which measured slower: it would weaken the compiled baselines
    if (fn, dynamic) not in _compiled:
        _compiled[fn, dynamic] = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    return _compiled[fn, dynamic]


def moe_grouped_mm_compiled(x, rw, te, w_gu, w_d):
    return _compiled_fn(moe_grouped_mm)(x, rw, te, w_gu, w_d)


def moe_mok_compiled(x, rw, te, w_gu, w_d):
    """mok under torch.compile(fullgraph=True, dynamic=False): what a compiled model gets (after
    mok_inductor.enable(), Inductor's generated code launches the same kernels, each with the tile config of the
    tables for the shape)."""
    return _compiled_fn(moe_mok)(x, rw, te, w_gu, w_d)


def moe_mok_compiled_dynamic(x, rw, te, w_gu, w_d):
    """mok under torch.compile(fullgraph=True, dynamic=True): one graph for every token count (a serving or
    variable-length training setup), the tables' config picked for the row bucket at run time."""
    return _compiled_fn(moe_mok, dynamic=True)(x, rw, te, w_gu, w_d)


def moe_liger(x, rw, te, w_gu, w_d):
    """Liger-Kernel's Triton fused MoE (liger-kernel 0.8.5): the closest peer written in Triton."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    return LigerFusedMoEFunction.apply(x, w_gu, w_d, te.to(torch.int32), rw.to(x.dtype))


class GraphedMok:
    """mok's forward captured in a CUDA graph (the op is capturable: no host sync), timed by replay:
    launch overhead out of the way, as in a CUDA-graphed decode step."""

    def __init__(self):
        self.key, self.graph, self.out = None, None, None

    def __call__(self, x, rw, te, w_gu, w_d):
        key = tuple((t.data_ptr(), tuple(t.shape)) for t in (x, rw, te, w_gu, w_d))
        if key != self.key:
            with torch.no_grad():
                moe_mok(x, rw, te, w_gu, w_d)  # autotune outside the capture
                torch.cuda.synchronize()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self.out = moe_mok(x, rw, te, w_gu, w_d)
            self.key = key
        self.graph.replay()
        return self.out


class MokMxfp8:
    """mok with MXFP8 routed weights: the bf16 weights quantized once (outside the timing, as a
    trainer quantizes once per step), each quantized weight keeping its bf16 master for the weight gradients."""

    def __init__(self):
        self.cache = {}

    def quantized(self, w):
        from mok_inductor import mxfp8

        key = (w.data_ptr(), tuple(w.shape), w.requires_grad)
        hit = self.cache.get(key)
        if hit is None or hit[0] is not w:  # the same address may hold a newer tensor (the next shape's weights)
            hit = self.cache[key] = (w, mxfp8.quantize(w))
        return hit[1]

    def __call__(self, x, rw, te, w_gu, w_d):
        import mok_inductor

        return mok_inductor.moe(x, rw, te, self.quantized(w_gu), self.quantized(w_d))


class GraphedMokMxfp8(GraphedMok):
    """mok_mxfp8's forward captured in a CUDA graph (the decode comparison against mok_graph)."""

    def __init__(self):
        super().__init__()
        self.mx = MokMxfp8()

    def __call__(self, x, rw, te, w_gu, w_d):
        global moe_mok
        inner, moe_mok = moe_mok, self.mx
        try:
            return super().__call__(x, rw, te, w_gu, w_d)
        finally:
            moe_mok = inner


class MokPointerLoads:
    """mok with every tile loaded by pointers (options tma=False), forward and backward: the A/B of the TMA
    loads, and how a compiled graph's kernels load."""

    def context(self):
        import mok_inductor

        return mok_inductor.options.override(tma=False)

    def __call__(self, x, rw, te, w_gu, w_d):
        with self.context():
            return moe_mok(x, rw, te, w_gu, w_d)


CONTENDERS = {"mok": moe_mok, "mok_pointer_loads": MokPointerLoads(), "mok_mxfp8": MokMxfp8(), "mok_mxfp8_graph": GraphedMokMxfp8(), "mok_graph": GraphedMok(), "grouped_mm": moe_grouped_mm, "grouped_mm_compiled": moe_grouped_mm_compiled,
              "mok_compiled": moe_mok_compiled, "mok_compiled_dynamic": moe_mok_compiled_dynamic, "eager": moe_eager,
              "liger": moe_liger}


# ---------------------------------------------------------------------------------------------
# Timing


def grad_leaves(x, rw, w_gu, w_d):
    """Leaf copies of the four differentiable inputs and an output gradient, for fwd+bwd timings."""
    return [t.detach().clone().requires_grad_(True) for t in (x, rw, w_gu, w_d)], torch.randn_like(x)


def fwd_bwd_step(f, leaves, te, dy):
    """One fwd+bwd of contender `f` on `leaves` (x, rw, w_gu, w_d): a callable returning their gradients."""
    context = getattr(f, "context", contextlib.nullcontext)  # (a switch held for the backward too)

    def step():
        with context():
            return torch.autograd.grad(f(leaves[0], leaves[1], te, leaves[2], leaves[3]), leaves, dy)

    return step


def bench(fn, warmup=25, rep=100):
    import triton

    q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="all")
    q = torch.tensor(q)
    return q.median().item(), q.quantile(0.2).item(), q.quantile(0.8).item()


def peak_fwd_mib(f, args):
    f(*args)  # fills a contender's caches (compiled graphs, quantized weights) outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = f(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del y
    return peak / 2**20


def copy_bandwidth():
    a = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms, _, _ = bench(lambda: b.copy_(a), warmup=5, rep=30)
    return 2 * a.numel() / (ms * 1e-3)


def weight_read_floor_ms(te, H, I, dtype, bandwidth):
    """(ms, experts touched): the routed weights a call reads, each touched expert's gate/up and down once, over
    `bandwidth` bytes/s (`copy_bandwidth`)."""
    touched = int(torch.unique(te[te >= 0]).numel())
    return touched * 3 * H * I * torch.finfo(dtype).bits // 8 / bandwidth * 1e3, touched


def rel_err(a, b):
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_shape(name, kind, contenders, results, log):
    T, H, I, E, K = SHAPES[name]
    decode = T <= 256
    fwd_flops, all_flops = 6 * T * K * H * I, 18 * T * K * H * I
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, kind)
    hot_share = (te < max(1, E // 10)).float().mean().item()
    log(f"== {name} T={T} H={H} I={I} E={E} K={K} routing={kind} (share of routes to the top 10% experts "
        f"{hot_share:.2f})")
    leaves, dy = grad_leaves(x, rw, w_gu, w_d)
    with torch.no_grad():
        y_mok = moe_mok(x, rw, te, w_gu, w_d).float()

    def add(contender, mode, ms, p20, p80, flops, peak=float("nan"), err=float("nan"), note=""):
        r = Result(name, kind, contender, mode, ms, p20, p80, flops / (ms * 1e-3) / 1e12 if flops else 0.0, peak,
                   err, note)
        results.append(r)
        log(f"   {contender:>20} {mode:>7}: {ms:8.3f} ms  {r.tflops:7.1f} TFLOP/s  peak fwd {peak:8.1f} MiB"
            f"  err {err:.1e} {note}")

    # the ceiling / floor
    A = torch.randn(T * K, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    B = torch.randn(H, 3 * I, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ms = bench(lambda: A @ B)
    add("dense", "fwd", *ms, fwd_flops)
    dC = torch.randn(T * K, 3 * I, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: torch.autograd.grad(A @ B, (A, B), dC))
    add("dense", "fwd+bwd", *ms, all_flops)
    del A, B, dC
    if decode:
        floor_ms, touched = weight_read_floor_ms(te, H, I, w_gu.dtype, copy_bandwidth())
        add("floor", "fwd", floor_ms, floor_ms, floor_ms, fwd_flops, note=f"{touched} experts touched")

    for c in contenders:
        f = CONTENDERS[c]
        args = (x, rw, te, w_gu, w_d)
        try:
            t0 = time.time()
            with torch.no_grad():
                err = rel_err(f(*args), y_mok)
            quick = c == "eager"
            wu, rp = (2, 10) if quick else (25, 100)
            with torch.no_grad():
                ms = bench(lambda: f(*args), wu, rp)
            peak = float("nan") if c.endswith("_graph") else \
                peak_fwd_mib(lambda *a: f(*a), (leaves[0], leaves[1], te, leaves[2], leaves[3]))
            add(c, "fwd", *ms, fwd_flops, peak, err, f"(first call + warmup {time.time() - t0:.0f}s)")
            if decode or c.endswith("_graph"):
                continue

            step = fwd_bwd_step(f, leaves, te, dy)
            step()
            ms = bench(step, wu, rp)
            add(c, "fwd+bwd", *ms, all_flops, peak, err)
        except Exception as exc:  # a contender that fails is recorded, the others still run
            log(f"   {c}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            results.append(Result(name, kind, c, "fwd", float("nan"), float("nan"), float("nan"), 0.0,
                                  float("nan"), float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:200]}"))
        torch.cuda.empty_cache()


def table(results):
    rows = {}
    for r in results:
        rows.setdefault((r.shape, r.routing), {})[(r.contender, r.mode)] = r
    names = ["dense", "mok", "mok_graph", "grouped_mm", "grouped_mm_compiled", "liger", "eager", "floor"]
    out = ["| shape | routing | " + " | ".join(f"{n} fwd / fwd+bwd" for n in names) + " | mok vs compiled fwd+bwd |",
           "|" + " --- |" * (len(names) + 3)]
    for (shape, routing), d in rows.items():
        cells = []
        for n in names:
            f, b = d.get((n, "fwd")), d.get((n, "fwd+bwd"))
            if shape.endswith("decode") or n == "floor":
                cells.append(f"{f.ms:.3f} ms" if f and f.ms == f.ms else "—")
            else:
                cells.append(f"{f.tflops:.0f} / {b.tflops:.0f}" if f and b else (f"{f.tflops:.0f} / —" if f else "—"))
        m, c = d.get(("mok", "fwd+bwd")), d.get(("grouped_mm_compiled", "fwd+bwd"))
        ratio = f"{c.ms / m.ms:.2f}x" if m and c and m.ms == m.ms and c.ms == c.ms else "—"
        out.append(f"| {shape} | {routing} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(out)


def plot(results, path, gpu=""):
    """Bars of TFLOP/s per shape and contender, fwd and fwd+bwd (decode shapes are in the table only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    keys = sorted({(r.shape, r.routing) for r in results if not r.shape.endswith("decode")})
    measured = {r.contender for r in results if r.tflops > 0}
    names = [n for n in ["dense", "mok", "mok_mxfp8", "grouped_mm", "grouped_mm_compiled", "liger", "eager"]
             if n in measured]  # only the contenders this run timed
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, mode in zip(axes, ["fwd", "fwd+bwd"]):
        w = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = []
            for k in keys:
                m = [r.tflops for r in results if (r.shape, r.routing) == k and r.contender == n and r.mode == mode]
                vals.append(m[0] if m else 0.0)
            ax.bar([j + i * w for j in range(len(keys))], vals, w, label=n)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{s}\n{r}" for s, r in keys], fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{mode}, bf16, {gpu}")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(names))  # below the bars
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def timed(fn, iters):
    """Median ms of `fn` over do_bench's repetitions, sized for at least `iters` calls, and their count."""
    import triton

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) * 1e3
    q = triton.testing.do_bench(fn, warmup=max(25, 2 * est), rep=max(100, iters * est), return_mode="all")
    return statistics.median(q), len(q)


def fwd_step(f, leaves, te):
    """One forward of contender `f` without autograd recording (inference)."""
    context = getattr(f, "context", contextlib.nullcontext)

    def step():
        with context(), torch.no_grad():
            return f(leaves[0], leaves[1], te, leaves[2], leaves[3])

    return step


def interleaved(plan, names, rounds, iters, log, modes=("fwd+bwd",), device="cuda", timer=None, on_result=None):
    """Each (shape, routing) of `plan` and each mode ("fwd", "fwd+bwd") of `modes`: the contenders `names` in
    `rounds` alternating rounds; ratios = the last name's ms / each. `on_result(results so far)` after each."""
    unknown = [m for m in modes if m not in ("fwd", "fwd+bwd")]
    if unknown:
        raise ValueError(f"modes: expected fwd and/or fwd+bwd, got {', '.join(unknown)}")
    timer = timer or timed
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    base = names[-1]
    out = []
    for shape, routing in plan:
        # the compiled contenders' graphs of earlier entries go: each entry compiles its own (static sizes, grad on
        # and off), and fullgraph=True turns Dynamo's recompile limit into an error after a few entries
        torch._dynamo.reset()
        T, H, I, E, K = SHAPES[shape]
        x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, routing, device=device)
        leaves, dy = grad_leaves(x, rw, w_gu, w_d)
        for mode in modes:
            steps = {c: (fwd_bwd_step(CONTENDERS[c], leaves, te, dy) if mode == "fwd+bwd"
                         else fwd_step(CONTENDERS[c], leaves, te)) for c in names}
            where = f"{shape} {routing} {mode}"
            for c, s in steps.items():  # compile, autotune, warm up
                t0 = time.time()
                s()
                sync()
                log(f"{where} {c}: first call {time.time() - t0:.0f} s")
            rows = []
            for r in range(rounds):
                row = {}
                for c, s in steps.items():
                    row[c], row[c + "_n"] = timer(s, iters)
                for c in names[:-1]:
                    row[c + "_ratio"] = row[base] / row[c]
                rows.append(row)
                log(f"  round {r + 1}: " + ", ".join(f"{c} {row[c]:.3f} ms ({row[c + '_n']} its)" for c in names)
                    + "; " + ", ".join(f"{c} {row[c + '_ratio']:.3f}x" for c in names[:-1]))
            res = dict(shape=shape, routing=routing, mode=mode, base=base,
                       median_ms={c: statistics.median(r[c] for r in rows) for c in steps}, rounds=rows)
            for c in names[:-1]:
                ratios = [r[c + "_ratio"] for r in rows]
                res[c] = dict(median_ratio=statistics.median(ratios), min_ratio=min(ratios), max_ratio=max(ratios))
                log(f"{where}: {base} / {c} median {res[c]['median_ratio']:.3f}x (min {min(ratios):.3f}, "
                    f"max {max(ratios):.3f}); {c} {res['median_ms'][c]:.3f} ms, {base} {res['median_ms'][base]:.3f} ms")
            out.append(res)
            if on_result is not None:
                on_result(out)
            del steps
        del leaves
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def check(contenders):
    """CPU smoke run: each contender's forward (and fwd+bwd) at a tiny shape against mok's output."""
    T, H, I, E, K = 64, 64, 32, 8, 2
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced", device="cpu")
    leaves, dy = grad_leaves(x, rw, w_gu, w_d)
    with torch.no_grad():
        y_mok = moe_mok(x, rw, te, w_gu, w_d).float()
    bad = []
    for c in contenders:
        f = CONTENDERS[c]
        with torch.no_grad():
            err = rel_err(f(x, rw, te, w_gu, w_d), y_mok)
        grads = fwd_bwd_step(f, leaves, te, dy)()
        # MXFP8 differs from bf16 by the weights' e4m3 rounding (a few percent), the others by bf16 rounding
        ok = err < (1e-1 if "mxfp8" in c else 2e-2) and all(torch.isfinite(g).all() for g in grads)
        print(f"  {c:>20}: relative error against mok {err:.1e}, fwd+bwd ran: {'ok' if ok else 'FAILED'}")
        if not ok:
            bad.append(c)
    if bad:
        raise SystemExit(f"--check failed: {', '.join(bad)}")


def tee_log(out_dir: str, name: str, mode: str = "a"):
    """A `log(line)` that prints the line and appends it to out_dir/name (flushed, so a killed run keeps it)."""
    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, name), mode)

    def log(s):
        print(s, flush=True)
        f.write(s + "\n")
        f.flush()

    return log


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--routing", default="balanced", help="balanced and/or skewed")
    p.add_argument("--skewed-shapes", default=None, help="also time these shapes with skewed routing (default: "
                   "qwen3-30b-a3b for the one-pass table, none with --rounds)")
    p.add_argument("--contenders", default=None, help=f"comma-separated: {', '.join(CONTENDERS)} (default: "
                   "mok,grouped_mm,grouped_mm_compiled,eager; with --check, every contender a CPU runs)")
    p.add_argument("--mxfp8", action="store_true", help="add mok with MXFP8 routed weights (mok_mxfp8)")
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds instead of the one-pass table, at "
                   "each shape and routing (--routing, --skewed-shapes) and mode (--modes); the last contender is "
                   "the baseline (ratios.json)")
    p.add_argument("--modes", default=None, help="with --rounds: fwd and/or fwd+bwd (default: fwd+bwd)")
    p.add_argument("--iters", type=int, default=20, help="with --rounds: at least this many iterations a round")
    p.add_argument("--check", action="store_true", help="CPU smoke run of the contenders at a tiny shape")
    args = p.parse_args()
    named = args.contenders is not None
    args.contenders = args.contenders or "mok,grouped_mm,grouped_mm_compiled,eager"
    unknown = [c for c in args.contenders.split(",") if c not in CONTENDERS]
    if unknown:
        p.error(f"unknown contender(s) {unknown}: {', '.join(CONTENDERS)}")
    if not args.check and not torch.cuda.is_available():
        p.error("the timings need a CUDA GPU; without one, --check runs the contenders at a tiny shape")
    if args.modes is not None and not args.rounds:
        p.error("--modes applies to --rounds only (the one-pass table times fwd and fwd+bwd)")
    modes = (args.modes or "fwd+bwd").split(",")  # (names checked by `interleaved`)
    if args.skewed_shapes is None:
        args.skewed_shapes = "" if args.rounds else "qwen3-30b-a3b"
    import mok_inductor

    # compiled graphs need it to inline mok's Triton kernels; the graph pass it also installs leaves the
    # grouped_mm contenders as they are (their gate/up halves are slices, not one chunk)
    mok_inductor.enable()
    if args.check:  # every contender unless --contenders names some
        cpu = ["mok", "mok_pointer_loads", "mok_compiled", "mok_compiled_dynamic", "mok_mxfp8", "grouped_mm",
               "grouped_mm_compiled", "eager"]  # (the CUDA-graph contenders need a GPU)
        picked = args.contenders.split(",") if named else cpu
        if set(picked) - set(cpu):
            p.error(f"--check runs {', '.join(cpu)}; not {sorted(set(picked) - set(cpu))}")
        check(picked)
        return
    log = tee_log(args.out, "bench.log")

    import triton

    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, git=sha,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    log(f"{meta}")
    plan = [(s, r) for s in args.shapes.split(",") for r in args.routing.split(",")]
    plan += [(s, "skewed") for s in args.skewed_shapes.split(",") if s and (s, "skewed") not in plan]
    if args.rounds:
        def save(out):  # after every (shape, routing, mode): a run cut short keeps what it measured
            with open(os.path.join(args.out, "ratios.json"), "w") as f:
                json.dump(dict(meta=dict(meta, rounds=args.rounds, iters=args.iters, modes=modes), results=out), f,
                          indent=1)

        interleaved(plan, args.contenders.split(","), args.rounds, args.iters, log, modes=modes, on_result=save)
        return
    results = []
    for i, (s, r) in enumerate(plan):
        log(f"[{i + 1}/{len(plan)}] {s} {r}")
        contenders = [c for c in args.contenders.split(",") if c != "eager" or s in ("qwen3-decode", "gpt-oss-20b")]
        if s.endswith("decode"):
            contenders.insert(1, "mok_graph")
        if args.mxfp8:
            contenders.insert(1, "mok_mxfp8")
            if s.endswith("decode"):
                contenders.insert(2, "mok_mxfp8_graph")
        run_shape(s, r, contenders, results, log)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(dict(meta=meta, results=[dataclasses.asdict(x) for x in results]), f, indent=1)
    log(table(results))
    plot(results, os.path.join(args.out, "bench.png"), meta["gpu"])


if __name__ == "__main__":
    main()
