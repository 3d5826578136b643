"""Do TMA tensor descriptors help mok's grouped GEMMs on the H200? The forward down GEMM (h_NI @ down[e]^T,
rows scattered to their routes: `moe_fwd.grouped_rows`, bf16 3-D weights) timed in one process against
variants written here that differ from it only in how the operand tiles are loaded:

    tma W (device):    the weight tile by `tl.make_tensor_descriptor` over the [E*H, I] view of down, block
                       [BLOCK_N, BLOCK_K] at [e*H + n0, k0], then dot(a, w.T). A tile running past expert e's
                       H rows reads expert e+1's rows (those output columns are masked at the store); past
                       the last expert TMA fills zeros, as it does past I along k.
    tma W+A (device):  also h's rows by descriptor ([N, I], block [BLOCK_M, BLOCK_K] at [row_start, k0]): rows
                       past the expert's row_end belong to the next expert, and their results are masked at
                       the store as well.
    ... (host):        the same with descriptors built on the host (`TensorDescriptor`, kernel parameters)
                       instead of in every program (device-side ones need `triton.set_allocator`).

All kernels autotune over `moe_fwd._GROUPED_ROWS_CONFIGS`. Every variant's output (NaN-poisoned first) is
checked against the package kernel's, then all are timed interleaved (median of bench_moe.bench medians).

    python benchmarks/tma_ab.py [--shapes qwen3-30b-a3b,...] [--rounds 3] [--out DIR]   # GPU: tma_ab.json
    python benchmarks/tma_ab.py --self-check    # tiny shapes (interpreter without CUDA), then the sm_90 compile
    python benchmarks/tma_ab.py --compile-sm90  # PTX for sm_90 (no GPU needed): TMA / wgmma instruction counts
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

if "--self-check" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # (before triton is imported)
if "--compile-sm90" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SHAPES, bench, make_inputs  # noqa: E402
from mok_inductor.kernels import _launch, moe_fwd  # noqa: E402
from mok_inductor.kernels._launch import mma, to_out  # noqa: E402
from mok_inductor.kernels.moe_fwd import _tile_ids, _tile_rows, row_tiles_worst  # noqa: E402


def _set_blocks(nargs):
    """Host descriptors get the block shape of the config being launched."""
    if isinstance(nargs["w_arg"], TensorDescriptor):
        nargs["w_arg"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]
    if isinstance(nargs["a_arg"], TensorDescriptor):
        nargs["a_arg"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]


_CONFIGS = [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=_set_blocks)
            for c in _launch.pick_configs(moe_fwd._GROUPED_ROWS_CONFIGS, _launch.cfg(16, 16, 32, 1, 1))]


@triton.autotune(configs=_CONFIGS, key=["M", "NCOL", "KD", "E", "A_DESC", "HOST"])
@triton.jit
def _down_tma_kernel(
    a_arg, stride_am,  # A [M, KD] sorted rows: a pointer, or (A_DESC and HOST) its descriptor
    routes_ptr, offsets_ptr,  # sorted_routes [M], expert_offsets [E+1]
    w_arg, stride_wn,  # the weight as [E*NCOL, KD] (contiguous): a pointer, or (HOST) its descriptor
    out_ptr, stride_om,  # out [M, NCOL], row = route
    M, NCOL, KD, E,
    A_DESC: tl.constexpr, HOST: tl.constexpr, DOT_PREC: tl.constexpr,
    GROUPS_POW2: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_grouped_rows_kernel (SCATTER, one weight, plain bf16, W_TABLE=0) with descriptor loads."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, E, NCOL, False, BLOCK_M, BLOCK_N, GROUP_M)
    group, row_start, row_end = _tile_rows(pid_m, offsets_ptr, M, E, False, False, BLOCK_M, GROUPS_POW2)
    if row_start >= row_end:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < NCOL
    ks = tl.arange(0, BLOCK_K)
    if HOST:
        w_desc = w_arg
    else:
        w_desc = tl.make_tensor_descriptor(w_arg, shape=[E * NCOL, KD], strides=[stride_wn, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    if A_DESC:
        if HOST:
            a_desc = a_arg
        else:
            a_desc = tl.make_tensor_descriptor(a_arg, shape=[M, KD], strides=[stride_am, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
    else:
        a_row = a_arg + rows[:, None].to(tl.int64) * stride_am
    w_row0 = group * NCOL + pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        if A_DESC:
            a = a_desc.load([row_start, k0])
        else:
            kk = k0 + ks
            a = tl.load(a_row + kk[None, :], mask=rmask[:, None] & (kk < KD)[None, :], other=0.0)
        w = w_desc.load([w_row0, k0])
        acc = mma(a, tl.trans(w), acc, DOT_PREC)
    dest = tl.load(routes_ptr + rows, mask=rmask, other=0)
    o_ptrs = out_ptr + dest[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(o_ptrs, to_out(acc, out_ptr, DOT_PREC), mask=rmask[:, None] & cmask[None, :])


def down_tma(h, w, out, routes, offsets, a_desc, host):
    """out[routes[r]] = h[r] @ w[e]^T for the rows r of expert e; w [E, NCOL, KD] contiguous."""
    M, KD = h.shape
    E, NCOL, _ = w.shape
    assert w.is_contiguous() and h.stride(1) == 1 and out.stride(1) == 1
    w2 = w.view(E * NCOL, KD)
    w_arg = TensorDescriptor.from_tensor(w2, [16, 32]) if host else w2  # (block shapes: _set_blocks)
    a_arg = TensorDescriptor.from_tensor(h, [16, 32]) if host and a_desc else h
    grid = lambda m: (row_tiles_worst(M, E, m["BLOCK_M"], False) * triton.cdiv(NCOL, m["BLOCK_N"]),)  # noqa: E731
    _down_tma_kernel[grid](a_arg, h.stride(0), routes, offsets, w_arg, w2.stride(0), out, out.stride(0),
                           M, NCOL, KD, E, A_DESC=a_desc, HOST=host, DOT_PREC=_launch.dot_precision(h.dtype),
                           GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=moe_fwd.GROUP_M)
    return out


VARIANTS = {"tma W (device)": (False, False), "tma W+A (device)": (True, False),
            "tma W (host)": (False, True), "tma W+A (host)": (True, True)}


def setup(T, H, I, E, K, kind, dev):
    """(h [N, I] sorted rows, down [E, H, I], sorted_routes, offsets, {label: fn(out) -> out})."""
    from mok_inductor import kernels as K_

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    _, _, te, _, w_d = make_inputs(T, H, I, E, K, kind, device=dev)
    sched = K_.build_schedule(te, E)
    so, off = sched.sorted_routes_N, sched.expert_offsets_E1
    h = torch.randn(T * K, I, device=dev, dtype=torch.bfloat16, generator=torch.Generator(dev).manual_seed(1))
    fns = {"package grouped_rows": lambda o: moe_fwd.grouped_rows(h, moe_fwd.plain(w_d), o, so, off)}
    for label, (a_desc, host) in VARIANTS.items():
        fns[label] = lambda o, a=a_desc, s=host: down_tma(h, w_d, o, so, off, a, s)
    return h, w_d, so, off, fns


def checked(fns, N, H, dev):
    """{label: (output, ok, bitwise equal to the package's, relative error, best config)}: outputs NaN-poisoned
    first; ok = no NaN left and bitwise equal or within 1e-2 relative norm."""
    res, ref = {}, None
    for label, fn in fns.items():
        out = fn(torch.full((N, H), float("nan"), device=dev, dtype=torch.bfloat16))
        tuner = moe_fwd._grouped_rows_kernel if ref is None else _down_tma_kernel
        c = getattr(tuner, "best_config", None)
        best = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**c.kwargs) + f" w{c.num_warps} s{c.num_stages}" if c else ""
        ref = out if ref is None else ref
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        same = bool(torch.equal(out, ref))
        res[label] = (out, not out.isnan().any().item() and (same or err <= 1e-2), same, err, best)
    return res


def run(name, rounds):
    T, H, I, E, K = SHAPES[name]
    N, dev = T * K, "cuda" if torch.cuda.is_available() else "cpu"
    h, w_d, so, off, fns = setup(T, H, I, E, K, "balanced", dev)
    res = checked(fns, N, H, dev)
    outs = {label: torch.empty(N, H, device=dev, dtype=torch.bfloat16) for label in fns}
    times = {label: [] for label in fns}
    for _ in range(rounds):  # interleaved: clocks and thermals drift alike for all
        for label, fn in fns.items():
            times[label].append(bench(lambda: fn(outs[label]))[0])
    flops, rows = 2.0 * N * H * I, []
    print(f"  {'shape':>18} {'variant':>22}: median ms, TFLOP/s, x = package ms / variant ms, check, config")
    base = torch.tensor(times["package grouped_rows"]).median().item()
    for label in fns:
        ms = torch.tensor(times[label]).median().item()
        _, ok, same, err, best = res[label]
        rows.append(dict(shape=name, variant=label, ms=ms, ms_rounds=times[label], tflops=flops / ms / 1e9,
                         vs_package=base / ms, bitwise=same, rel_err=err, ok=ok, config=best))
        print(f"  {name:>18} {label:>22}: {ms:7.3f} ms {rows[-1]['tflops']:5.0f} TFLOP/s  x{base / ms:5.3f}"
              f"  {'bitwise' if same else f'err {err:.1e}'}{'' if ok else '  MISMATCH'}  [{best}]", flush=True)
    return rows


def self_check():
    """Tiny shapes: the package kernel against a float reference, every variant against the package kernel.
    (16, 72, 48, 16, 2): weight tiles cross experts (H % 16 != 0), a partial K step (I % 32 != 0), skewed routing."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"self-check on {dev}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}", flush=True)
    ok = True
    for T, H, I, E, K, kind in [(8, 64, 64, 4, 2, "balanced"), (16, 72, 48, 16, 2, "skewed")]:
        h, w_d, so, off, fns = setup(T, H, I, E, K, kind, dev)
        offl = off.tolist()
        ref = torch.empty(T * K, H, device=dev)
        for e in range(E):
            r = slice(offl[e], offl[e + 1])
            ref[so[r].long()] = h[r].float() @ w_d[e].float().t()
        print(f"  T={T} H={H} I={I} E={E} K={K} {kind}: rows per expert {[b - a for a, b in zip(offl, offl[1:])]}")
        for label, (out, ok_pkg, same, err, _) in checked(fns, T * K, H, dev).items():
            ref_err = ((out.float() - ref).norm() / ref.norm()).item()
            good = ok_pkg and ref_err <= 1e-2
            ok &= good
            print(f"    {label:>22}: {'bitwise = package' if same else f'err vs package {err:.1e}'}, "
                  f"err vs float reference {ref_err:.1e}  {'OK' if good else 'FAIL'}", flush=True)
    if not torch.cuda.is_available():  # the sm_90 compile needs the real compiler: a process without the interpreter
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        ok &= subprocess.run([sys.executable, __file__, "--compile-sm90", "--out", ARGS.out], env=env).returncode == 0
    print("self-check", "PASSED" if ok else "FAILED")
    return ok


def compile_sm90(out_dir):
    """Compile the package kernel and the variants for sm_90 at the qwen3-30b-a3b shape, config 128x128x64
    8 warps 3 stages (no GPU needed); count the PTX's TMA (cp.async.bulk.tensor), device-side descriptor
    (tensormap.*), plain async copy (cp.async.cg/ca) and wgmma instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    T, H, I, E, K = SHAPES["qwen3-30b-a3b"]
    M, bm, bn, bk = T * K, 128, 128, 64
    blocks = dict(GROUPS_POW2=_launch.next_pow2(E + 1), GROUP_M=moe_fwd.GROUP_M, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    ints = dict(M=M, NCOL=H, KD=I, E=E, stride_am=I, stride_ak=1, stride_om=H, stride_on=1, stride_wn=I)
    for p in "12":
        ints.update({f"s{p}_e": H * I, f"s{p}_n": I, f"s{p}_k": 1, f"q{p}_e": H * I, f"q{p}_n": I, f"q{p}_k": 1})
    wdesc, adesc = f"tensordesc<bf16[{bn}, {bk}]>", f"tensordesc<bf16[{bm}, {bk}]>"
    pfn = moe_fwd._grouped_rows_kernel.fn  # its other flags (SINGLE, TWO, MX1, MX2, MX_DOT, ...) False
    pkg = {n: False for i, n in enumerate(pfn.arg_names) if i in pfn.constexprs and n not in blocks}
    kernels = {"package grouped_rows": (pfn, {**pkg, "SCATTER": True, "DOT_PREC": "tf32", "W_TABLE": 0}, {})}
    for label, (a_desc, host) in VARIANTS.items():
        types = dict(w_arg=wdesc if host else "*bf16", a_arg=adesc if host and a_desc else "*bf16")
        kernels[label] = (_down_tma_kernel.fn, dict(A_DESC=a_desc, HOST=host, DOT_PREC="tf32"), types)
    report = {}
    for label, (fn, consts, types) in kernels.items():
        consts = {**consts, **blocks}
        sig, attrs = {}, {}
        for i, n in enumerate(fn.arg_names):  # as the JIT specializes: 1 -> constexpr, % 16 == 0 -> divisibility
            v = types.get(n) or ("*i32" if n in ("routes_ptr", "offsets_ptr") else "*bf16" if n.endswith("_ptr")
                                 else ints.get(n))
            if n in consts or v == 1:
                sig[n] = "constexpr"
                consts.setdefault(n, v)
            else:
                sig[n] = v if isinstance(v, str) else "i32"
                if (isinstance(v, str) and v.startswith("*")) or (isinstance(v, int) and v % 16 == 0):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        try:
            k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=8, num_stages=3))
            ptx = k.asm["ptx"]
            report[label] = {s: ptx.count(s) for s in ("cp.async.bulk.tensor", "tensormap.", "cp.async.cg",
                                                       "cp.async.ca", "wgmma.mma_async", "mma.sync")}
            report[label]["shared_bytes"] = k.metadata.shared
        except Exception as exc:  # noqa: BLE001
            report[label] = {"error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
        print(f"  sm_90 {label:>22}: {report[label]}", flush=True)
    with open(os.path.join(out_dir, "tma_compile_sm90.json"), "w") as f:
        json.dump(report, f, indent=1)
    return all("error" not in r and r["wgmma.mma_async"] > 0 for r in report.values())


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b,gpt-oss-20b,deepseek-v3-slice")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--self-check", action="store_true", help="tiny shapes (interpreter without CUDA), sm_90 compile")
    p.add_argument("--compile-sm90", action="store_true", help="compile for sm_90 only and count instructions")
    ARGS = p.parse_args()
    if ARGS.compile_sm90:
        sys.exit(0 if compile_sm90(ARGS.out) else 1)
    if ARGS.self_check:
        sys.exit(0 if self_check() else 1)
    rows = []
    for s in ARGS.shapes.split(","):
        rows += run(s, ARGS.rounds)
        with open(os.path.join(ARGS.out, "tma_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
