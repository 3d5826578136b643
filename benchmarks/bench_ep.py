"""Expert parallelism over the GPUs of one host: correctness against one rank computing every
expert, and the MoE layer's fwd+bwd with EP against an all-to-all + torch._grouped_mm baseline, weak
scaling (tokens per rank fixed, the E experts sharded E/n per rank) over groups of 1, 2, 4, ... n ranks,
all in one launch.

    torchrun --nproc-per-node 8 benchmarks/bench_ep.py --shapes qwen3-30b-a3b,deepseek-v3-slice --out DIR
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tiny --out DIR        # CPU (gloo) smoke run

NCCL on CUDA (one process per GPU), gloo on CPU. For each shape of benchmarks/bench_moe.py and each group
size n (the first n ranks; the others wait):

- correctness (n > 1): every rank of the group runs `mok_inductor.moe(..., group=)` forward and backward
  on its own tokens and its E/n experts, and the same layer with all E experts and no group; y, dx and
  d router weights must agree per rank, and the local experts' weight gradients with the one-device ones
  summed over the ranks (all_reduce); relative errors (||a - b|| / ||b||) against bf16's 1e-2;
- time: a fixed number of iterations on every rank (collectives pair by call order, so every rank runs
  the same count), barrier before, the slowest rank's mean reported; TFLOP/s per GPU from 18*T*K*H*I of
  the rank's own tokens (fwd+bwd); the share spent in communication from a profile of a few iterations
  (NCCL kernels' device time on CUDA; gloo's collective ops' CPU time on CPU, approximate);
- the baseline: tokens sorted by destination rank and expert, `all_to_all_single` of one row per route
  (split sizes to the host, as Megatron's all-to-all dispatcher does), `torch._grouped_mm` gate/up, SwiGLU,
  `torch._grouped_mm` down, all-to-all back, router weight, `index_add_`; autograd through
  `torch.distributed._functional_collectives.all_to_all_single_autograd` (what torchtitan's EP uses).

Rank 0 prints a table and writes `bench_ep.json` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, rel_err, routing_tensors  # noqa: E402

TINY = {"tiny": (48, 64, 32, 8, 2)}  # T per rank, H, I, E, K: the CPU smoke run


def full_weights(E, H, I, device, seed=1234):
    """The E experts' weights, the same on every rank (one generator seed)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w_gu = torch.randn(E, 2 * I, H, generator=gen, device=device, dtype=torch.bfloat16) * H ** -0.5
    w_d = torch.randn(E, H, I, generator=gen, device=device, dtype=torch.bfloat16) * I ** -0.5
    return w_gu, w_d


def rank_inputs(T, H, E, K, rank, device):
    """This rank's tokens, routing and output gradient (a seed per rank: each rank has its own tokens)."""
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen, device=device, dtype=torch.bfloat16)
    rw, te = routing_tensors(T, E, K, "balanced", gen, device)
    dy = torch.randn(T, H, generator=gen, device=device, dtype=torch.bfloat16)
    return x, rw, te, dy


# ---------------------------------------------------------------------------------------------
# The baseline: all-to-all of one row per route + torch._grouped_mm


def baseline_moe(x, rw, te, w_gu, w_d, group):
    """y [T, H] of the local experts w_gu [E_local, 2I, H], w_d [E_local, H, I] over `group`."""
    W = dist.get_world_size(group)
    T, K = te.shape
    El = w_gu.shape[0]
    I = w_d.shape[-1]
    flat = te.reshape(-1)
    valid = flat >= 0
    dest = torch.where(valid, flat // El, W)  # W: a -1 route, never sent
    order = torch.argsort(dest * El + torch.where(valid, flat % El, 0), stable=True)
    n_sent = int(valid.sum())  # host sync (as the split sizes below)
    order = order[:n_sent]
    tok = order // K
    send = torch.bincount(dest[order], minlength=W)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_l, recv_l = send.tolist(), recv.tolist()
    ids = (flat[order] % El).to(torch.int32)
    ids_r = torch.empty(sum(recv_l), dtype=torch.int32, device=x.device)
    dist.all_to_all_single(ids_r, ids, recv_l, send_l, group=group)
    x_r = funcol.wait_tensor(funcol.all_to_all_single_autograd(x[tok], recv_l, send_l, group))
    o2 = torch.argsort(ids_r, stable=True)
    offs = torch.cumsum(torch.bincount(ids_r, minlength=El), 0).to(torch.int32)
    gu = torch._grouped_mm(x_r[o2], w_gu.transpose(-2, -1), offs=offs)
    h = F.silu(gu[:, :I]) * gu[:, I:]
    out_sorted = torch._grouped_mm(h, w_d.transpose(-2, -1), offs=offs)
    out = torch.empty_like(out_sorted).index_copy(0, o2, out_sorted)
    y_s = funcol.wait_tensor(funcol.all_to_all_single_autograd(out, send_l, recv_l, group))
    y_s = y_s * rw.reshape(-1)[order, None].to(y_s.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y_s)


# ---------------------------------------------------------------------------------------------
# Timing and communication share, with every rank running the same number of iterations


def timed(fn, iters, warmup, group, device):
    """The slowest rank's mean ms per call of fn (fn is collective: every rank of `group` calls this)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = torch.tensor([(time.perf_counter() - t0) / iters * 1e3], dtype=torch.float64)
    if device.type == "cuda":
        ms = ms.to(device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms.item())


def comm_ms(fn, iters, group, device):
    """(ms per call spent in communication, its share of the profiled calls' wall time): NCCL kernels'
    device time (CUDA), or the span of gloo's collectives (CPU; approximate). Both include the waits for
    the peers. The slowest rank's figures."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    dist.barrier(group=group)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    total = 0.0
    for e in prof.key_averages():
        name = e.key.lower()
        if device.type == "cuda":
            if "nccl" in name and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:  # kernels
                total += e.device_time_total
        elif name.startswith("gloo:"):  # gloo's collectives (their span, waits on the peers included)
            total += e.cpu_time_total
    ms = torch.tensor([total / iters / 1e3, total / 1e6 / wall], dtype=torch.float64,
                      device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms[0]), float(ms[1])


# ---------------------------------------------------------------------------------------------


def run(name, shape, n, group, rank, device, args, log):
    import mok_inductor

    T, H, I, E, K = shape
    if E % n:
        log(f"  {name} n={n}: skipped (E={E} is not a multiple of {n})")
        return None
    El = E // n
    w_gu, w_d = full_weights(E, H, I, device)
    x, rw, te, dy = rank_inputs(T, H, E, K, rank, device)
    loc = [w_gu[rank * El:(rank + 1) * El].clone(), w_d[rank * El:(rank + 1) * El].clone()]
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, rw, *loc)]
    ep_group = group if n > 1 else None
    out = dict(shape=name, ranks=n, T_per_rank=T, H=H, I=I, E=E, K=K, E_local=El)

    def mok_fwd():
        with torch.no_grad():
            return mok_inductor.moe(x, rw, te, loc[0], loc[1], group=ep_group)

    def mok_step():
        y = mok_inductor.moe(leaves[0], leaves[1], te, leaves[2], leaves[3], group=ep_group)
        return torch.autograd.grad(y, leaves, dy)

    b_leaves = [t.detach().clone().requires_grad_(True) for t in (x, rw, *loc)]

    def base_fwd():
        with torch.no_grad():
            return baseline_moe(x, rw, te, loc[0], loc[1], group)

    def base_step():
        y = baseline_moe(b_leaves[0], b_leaves[1], te, b_leaves[2], b_leaves[3], group)
        return torch.autograd.grad(y, b_leaves, dy)

    if n > 1 and not args.no_check:  # EP against one rank computing all E experts
        y_ep = mok_inductor.moe(leaves[0], leaves[1], te, leaves[2], leaves[3], group=ep_group)
        g_ep = torch.autograd.grad(y_ep, leaves, dy)
        full = [t.detach().clone().requires_grad_(True) for t in (x, rw, w_gu, w_d)]
        y_1 = mok_inductor.moe(full[0], full[1], te, full[2], full[3])
        g_1 = list(torch.autograd.grad(y_1, full, dy))
        for j in (2, 3):  # the one-device weight gradients summed over the ranks' tokens
            g = g_1[j].float()
            dist.all_reduce(g, group=group)
            g_1[j] = g[rank * El:(rank + 1) * El]
        errs = dict(y=rel_err(y_ep, y_1), dx=rel_err(g_ep[0], g_1[0]), d_router_weights=rel_err(g_ep[1], g_1[1]),
                    d_gate_up=rel_err(g_ep[2], g_1[2]), d_down=rel_err(g_ep[3], g_1[3]))
        y_b = baseline_moe(x, rw, te, loc[0], loc[1], group)
        errs["baseline_y"] = rel_err(y_b, y_1)
        t = torch.tensor(list(errs.values()), dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        out["max_rel_err"] = dict(zip(errs, t.tolist()))
        out["correct"] = bool(max(t.tolist()) <= 1e-2)
        del full, g_1, y_1, g_ep, y_ep

    flops = 18.0 * T * K * H * I
    for label, fwd, step in (("mok", mok_fwd, mok_step), ("baseline", base_fwd, base_step)):
        f_ms = timed(fwd, args.iters, args.warmup, group, device)
        s_ms = timed(step, args.iters, args.warmup, group, device)
        c_ms, share = comm_ms(step, args.profile_iters, group, device) if n > 1 else (0.0, 0.0)
        out[label] = dict(fwd_ms=f_ms, fwd_bwd_ms=s_ms, tflops_per_gpu=flops / (s_ms * 1e-3) / 1e12,
                          comm_ms=c_ms, comm_share=share)
    out["mok_vs_baseline"] = out["baseline"]["fwd_bwd_ms"] / out["mok"]["fwd_bwd_ms"]
    m, b = out["mok"], out["baseline"]
    log(f"  {name:>18} n={n}: mok fwd {m['fwd_ms']:.3f} fwd+bwd {m['fwd_bwd_ms']:.3f} ms "
        f"({m['tflops_per_gpu']:.0f} TF/GPU, comm {m['comm_share']:.0%}) | baseline fwd {b['fwd_ms']:.3f} "
        f"fwd+bwd {b['fwd_bwd_ms']:.3f} ms ({b['tflops_per_gpu']:.0f} TF/GPU, comm {b['comm_share']:.0%}) | "
        f"{out['mok_vs_baseline']:.2f}x" + (f" | max rel err {max(out['max_rel_err'].values()):.1e}"
                                             if "max_rel_err" in out else ""))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3-slice")
    p.add_argument("--tiny", action="store_true", help="the CPU smoke shape instead of --shapes")
    p.add_argument("--sizes", default="", help="group sizes, e.g. 1,2,4,8 (default: powers of 2 up to the world)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile-iters", type=int, default=3)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        p.error("the model-sized shapes need CUDA GPUs; without them, --tiny runs the CPU smoke shape over gloo")
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s] or [n for n in (1, 2, 4, 8, 16, 32) if n <= world]
    except ValueError:
        sizes = [0]  # (reported below)
    if not all(1 <= n <= world for n in sizes):
        if rank == 0:
            print(f"bench_ep.py: error: --sizes {args.sizes!r}: comma-separated group sizes from 1 to the world "
                  f"size, {world}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    log(f"bench_ep: world {world}, {'nccl, ' + torch.cuda.get_device_name() if cuda else 'gloo, CPU'}, "
        f"torch {torch.__version__}, group sizes {sizes}")
    shapes = TINY if args.tiny else {s: SHAPES[s] for s in args.shapes.split(",")}
    groups = {n: dist.new_group(list(range(n))) for n in sizes}  # every rank creates every group
    results = []
    for name, shape in shapes.items():
        for n in sizes:
            if rank < n:
                r = run(name, shape, n, groups[n], rank, device, args, log)
                if r is not None and rank == 0:
                    results.append(r)
            dist.barrier()
            if cuda:
                torch.cuda.empty_cache()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(world=world, backend="nccl" if cuda else "gloo", torch=torch.__version__,
                    device=torch.cuda.get_device_name() if cuda else "cpu",
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        with open(os.path.join(args.out, "bench_ep.json"), "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
        log("| shape | ranks | mok fwd+bwd ms | TFLOP/s per GPU | comm share | baseline fwd+bwd ms | TFLOP/s per GPU "
            "| comm share | mok / baseline | correct |")
        log("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in results:
            m, b = r["mok"], r["baseline"]
            log(f"| {r['shape']} | {r['ranks']} | {m['fwd_bwd_ms']:.3f} | {m['tflops_per_gpu']:.0f} | "
                f"{m['comm_share']:.0%} | {b['fwd_bwd_ms']:.3f} | {b['tflops_per_gpu']:.0f} | {b['comm_share']:.0%} "
                f"| {r['mok_vs_baseline']:.2f}x | {r.get('correct', '—')} |")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and any(r.get("correct") is False for r in results):
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
