"""mok over a sweep of token counts T: first call at a new T, tables against a per-T search, compiled.

    python benchmarks/sweep_tokens.py --out DIR [--shapes qwen3-30b-a3b,mixtral-8x7b]
                                      [--tokens 1,7,64,300,1000,4097,16384] [--parts a,b,c,d] [--rep 100]
    python benchmarks/sweep_tokens.py --report DIR1/sweep_tokens.json DIR2/sweep_tokens.json   # merge, print
    python benchmarks/sweep_tokens.py --device cpu --shapes tiny --tokens 1,7 --out /tmp/sweep  # CPU smoke run

Per shape and T (bf16, balanced routing of bench_moe.make_inputs), parts:
  a  first fwd+bwd call at T, wall clock, in a fresh process that has run one fwd+bwd at another T of the same
     shape (the previous T of --tokens; 64 for the first): what a new token count costs. Default options
     (tables, no search, the default tables folder: MOK_* variables are dropped); with --child-cache fresh
     (the default) each process has an empty Triton cache, so a tile config not compiled yet is compiled there.
     `compiles`: kernels written to the Triton cache during that call.
  b  warm fwd and fwd+bwd with the tables' configs (default options): median of triton.testing.do_bench, and
     the kernels' device time per call (`*_dev_ms`, torch.profiler; host time left out).
  c  the same after a full search at this T (options autotune=True, a fresh tables folder per (shape, T),
     picks of b forgotten first); `search_s`: the first calls, which search. The tables it wrote go to
     DIR/tables/. table/autotune = b / c of the kernels' device time (target: at most 1.05).
  d  torch.compile(mok_inductor.moe, fullgraph=True) after mok_inductor.enable(): static (dynamic=False, a fresh
     compile per T) and dynamic (dynamic=True, one compile reused over the T of the sweep, in order: its first
     call at each T and the Dynamo graphs that call compiled). compiled/eager = d / b, fwd+bwd.
Results: DIR/sweep_tokens.json (written after every T, so a run cut short keeps what it measured), a
markdown table last, DIR/sweep_tokens.log. Shape legend: T tokens, H hidden, I intermediate, E experts, K routes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import mok_inductor  # noqa: E402
from bench_moe import SHAPES, bench, fwd_bwd_step, grad_leaves, make_inputs, tee_log  # noqa: E402

SWEEP_SHAPES = {**{n: s[1:] for n, s in SHAPES.items()}, "tiny": (64, 32, 8, 2)}  # name: (H, I, E, K)
DEFAULT_TOKENS = "1,7,64,300,1000,4097,16384"
PARTS = ("a", "b", "c", "d")


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def first_ms(fn, device):
    """Wall-clock ms of one call, the device drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def warm_ms(fn, device, rep, min_calls=10):
    """Median ms: do_bench on CUDA over `rep` ms and at least `min_calls` calls; on the CPU (smoke runs) a few
    wall-clock calls."""
    est = first_ms(fn, device)
    if device == "cuda":
        return bench(fn, warmup=max(10, rep // 4, 2 * est), rep=max(rep, min_calls * est))[0]
    return statistics.median([est] + [first_ms(fn, device) for _ in range(2)])


def device_ms(fn, device, iters=5):
    """Mean GPU time of one call's kernels (ms): the sum of their durations under torch.profiler, host time left
    out (an eager call at a small T is host-bound, and the host's noise would hide the kernels' differences)."""
    if device != "cuda":
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters / 1e3


def layer(fn, shape, T, device):
    """(fwd, fwd+bwd) no-argument callables of `fn` at T tokens of `shape`, on fresh random inputs."""
    H, I, E, K = shape
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced", device=device)
    leaves, dy = grad_leaves(x, rw, w_gu, w_d)
    del x, rw, w_gu, w_d

    def fwd():
        with torch.no_grad():
            return fn(leaves[0], leaves[1], te, leaves[2], leaves[3])

    return fwd, fwd_bwd_step(fn, leaves, te, dy)


def triton_cache_dir():
    try:
        import triton.knobs

        return triton.knobs.cache.dir
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def cache_entries():
    d = triton_cache_dir()
    return len(os.listdir(d)) if d and os.path.isdir(d) else 0


def child(a):
    """Part a inside a fresh process: one fwd+bwd at --warm-t, then the timed first one at --target-t."""
    shape = SWEEP_SHAPES[a.shape]
    _, step = layer(mok_inductor.moe, shape, a.warm_t, a.device)
    warm = first_ms(step, a.device)
    del step
    _, step = layer(mok_inductor.moe, shape, a.target_t, a.device)
    sync(a.device)
    n0 = cache_entries()
    first = first_ms(step, a.device)
    compiles = cache_entries() - n0
    second = first_ms(step, a.device)
    print(json.dumps(dict(warm_t=a.warm_t, warm_call_ms=warm, first_ms=first, second_ms=second, compiles=compiles,
                          options=str(mok_inductor.options.current()))))


def part_a(a, name, T, warm_t, log):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOK_")}  # the default options
    tmp = tempfile.mkdtemp(prefix="mok-sweep-triton-") if a.child_cache == "fresh" else None
    if tmp:
        env["TRITON_CACHE_DIR"] = tmp
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shape", name, "--warm-t", str(warm_t),
           "--target-t", str(T), "--device", a.device]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.child_timeout)
        if p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}: {p.stderr.strip()[-1500:]}")
        res = json.loads(p.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        res = dict(error=f"{type(e).__name__}: {str(e)[-1500:]}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    res["process_s"] = time.time() - t0
    log(f"  a: {res}")
    return res


def unique_graphs():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def measure(a, fn, shape, T, **opts):
    """First calls (fwd+bwd, then fwd; the Dynamo graphs each compiled) and warm times of `fn` at T, under the
    options `opts` (default: autotune off, the default tables folder)."""
    with mok_inductor.options.override(**{"autotune": False, "tables_dir": None, **opts}):
        fwd, step = layer(fn, shape, T, a.device)
        u0 = unique_graphs()
        res = dict(first_fwd_bwd_ms=first_ms(step, a.device))
        u1 = unique_graphs()
        res.update(first_fwd_ms=first_ms(fwd, a.device), new_graphs_fwd_bwd=u1 - u0)
        res["new_graphs_fwd"] = unique_graphs() - u1
        res.update(fwd_ms=warm_ms(fwd, a.device, a.rep), fwd_bwd_ms=warm_ms(step, a.device, a.rep))
        res.update(fwd_dev_ms=device_ms(fwd, a.device), fwd_bwd_dev_ms=device_ms(step, a.device))
    return res


def part_c(a, name, shape, T):
    from mok_inductor.kernels import configs

    configs.reset()  # no pick of part b is reused
    tmp = tempfile.mkdtemp(prefix="mok-sweep-tables-")
    try:
        res = measure(a, mok_inductor.moe, shape, T, autotune=True, tables_dir=tmp)
        res["search_s"] = (res["first_fwd_bwd_ms"] + res["first_fwd_ms"]) / 1e3
        dest = os.path.join(a.out, "tables")
        for f in os.listdir(tmp):  # what the search picked, for the record
            os.makedirs(dest, exist_ok=True)
            shutil.copy(os.path.join(tmp, f), os.path.join(dest, f"{name}-T{T}-{f}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        configs.reset()
    return res


def _f(v, fmt="{:.3f}"):
    return fmt.format(v) if isinstance(v, (int, float)) and v == v else "—"


def _pair(d, k1="fwd_ms", k2="fwd_bwd_ms"):
    return f"{_f(d.get(k1))} / {_f(d.get(k2))}" if d else "—"


def _ratio(x, y):
    return x / y if isinstance(x, float) and isinstance(y, float) and y > 0 else None


def table(records):
    out = ["| shape | T | a: first call ms (compiles) | b: table fwd / fwd+bwd ms | c: autotune fwd / fwd+bwd ms "
           "(search s) | table/autotune fwd / fwd+bwd (CUDA: kernel time) | d: static fwd / fwd+bwd ms | d: dynamic fwd / fwd+bwd ms | "
           "dynamic first fwd+bwd ms (new graphs fwd+bwd + fwd) | compiled/eager fwd+bwd static / dynamic |",
           "|" + " --- |" * 10]
    for r in records:
        a, b, c = r.get("a", {}), r.get("b", {}), r.get("c", {})
        s, d = r.get("d_static", {}), r.get("d_dynamic", {})
        acell = f"{_f(a.get('first_ms'), '{:.1f}')} ({a.get('compiles', '—')})" if a else "—"
        if a.get("error"):
            acell = "failed"
        ccell = f"{_pair(c)} ({_f(c.get('search_s'), '{:.1f}')})" if c else "—"
        dev = all(isinstance(x.get("fwd_bwd_dev_ms"), float) and x["fwd_bwd_dev_ms"] == x["fwd_bwd_dev_ms"]
                  for x in (b, c))  # the kernels' device time where measured (host noise left out)
        tr = [_ratio(b.get(k), c.get(k)) for k in (("fwd_dev_ms", "fwd_bwd_dev_ms") if dev else ("fwd_ms", "fwd_bwd_ms"))]
        trcell = " / ".join(_f(x) for x in tr) + (" **>1.05**" if any(x and x > 1.05 for x in tr) else "") \
            if b and c else "—"
        dyn = f"{_f(d.get('first_fwd_bwd_ms'), '{:.1f}')} ({d.get('new_graphs_fwd_bwd')}+{d.get('new_graphs_fwd')})" \
            if d else "—"
        ce = " / ".join(_f(_ratio(x.get("fwd_bwd_ms"), b.get("fwd_bwd_ms"))) for x in (s, d))
        out.append(f"| {r['shape']} | {r['T']} | {acell} | {_pair(b)} | {ccell} | {trcell} | {_pair(s)} | {_pair(d)} | "
                   f"{dyn} | {ce} |")
    return "\n".join(out)


def merge(paths):
    """Records of several runs' JSON files; a later file's parts replace an earlier one's for the same (shape, T)."""
    by_key, meta = {}, []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        meta.append(data.get("meta", {}))
        for r in data["records"]:
            by_key.setdefault((r["shape"], r["T"]), {}).update(r)
    return meta, list(by_key.values())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b", help=f"comma-separated: {', '.join(SWEEP_SHAPES)}")
    p.add_argument("--tokens", default=DEFAULT_TOKENS, help="comma-separated token counts, in sweep order")
    p.add_argument("--parts", default="a,b,c,d", help="comma-separated subset of a,b,c,d (see the module doc)")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep (ms of timed calls per measurement)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--child-cache", default="fresh", choices=("fresh", "shared"),
                   help="part a: an empty Triton cache per process (fresh) or the user's (shared)")
    p.add_argument("--child-timeout", type=int, default=600, help="part a: seconds per child process")
    p.add_argument("--report", nargs="+", metavar="JSON", help="merge these results files and print the table")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--warm-t", type=int, help=argparse.SUPPRESS)
    p.add_argument("--target-t", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.device == "cpu" and not a.child and not a.report and set(a.shapes.split(",")) - {"tiny"}:
        p.error("model-sized shapes on the CPU: the timings need a CUDA GPU (--shapes tiny is the CPU smoke run)")
    if a.child:
        return child(a)
    if a.report:
        meta, records = merge(a.report)
        print("\n".join(json.dumps(m) for m in meta))
        print(table(records))
        return
    shapes, tokens = a.shapes.split(","), [int(t) for t in a.tokens.split(",")]
    parts = set(a.parts.split(","))
    unknown = sorted(set(shapes) - set(SWEEP_SHAPES)) + sorted(parts - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown shape(s) or part(s): {', '.join(unknown)}")
    log = tee_log(a.out, "sweep_tokens.log")

    from mok_inductor.kernels import configs

    meta = dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", torch=torch.__version__,
                shapes=shapes, tokens=tokens, parts=sorted(parts), rep=a.rep, child_cache=a.child_cache,
                shipped_tables=[t.name for t in configs.shipped_tables()],
                default_tables_dir=str(mok_inductor.options.DEFAULT_TABLES_DIR),
                env_options={k: v for k, v in os.environ.items() if k.startswith("MOK_")},
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    log(json.dumps(meta))
    records = {(s, T): dict(shape=s, T=T, H_I_E_K=SWEEP_SHAPES[s]) for s in shapes for T in tokens}

    def save():
        with open(os.path.join(a.out, "sweep_tokens.json"), "w") as f:
            json.dump(dict(meta=meta, records=list(records.values())), f, indent=1)

    if "a" in parts:  # first: the children then have the GPU to themselves
        for s in shapes:
            for i, T in enumerate(tokens):
                warm_t = tokens[i - 1] if i else (64 if T != 64 else (tokens[1] if len(tokens) > 1 else 1))
                log(f"== a {s} T={T} (after T={warm_t} in a fresh process)")
                records[(s, T)]["a"] = part_a(a, s, T, warm_t, log)
                save()
    for s in shapes:
        shape = SWEEP_SHAPES[s]
        for T in tokens:
            if parts & {"b", "c"}:
                log(f"== {s} T={T} {shape} (H, I, E, K)")
            if "b" in parts:
                records[(s, T)]["b"] = r = measure(a, mok_inductor.moe, shape, T)
                log(f"  b (tables): {r}")
            if "c" in parts:
                records[(s, T)]["c"] = r = part_c(a, s, shape, T)
                log(f"  c (autotune): {r}")
            save()
            if a.device == "cuda":
                torch.cuda.empty_cache()
        if "d" not in parts:
            continue
        mok_inductor.enable()
        for T in tokens:
            torch._dynamo.reset()  # a fresh static compile per T
            f = torch.compile(mok_inductor.moe, fullgraph=True, dynamic=False)
            records[(s, T)]["d_static"] = r = measure(a, f, shape, T)
            log(f"== d {s} T={T} static: {r}")
            save()
        torch._dynamo.reset()
        g = torch.compile(mok_inductor.moe, fullgraph=True, dynamic=True)  # one compile, reused over the sweep
        for T in tokens:
            records[(s, T)]["d_dynamic"] = r = dict(measure(a, g, shape, T), reused_over_sweep=True)
            log(f"== d {s} T={T} dynamic (compiled once for the sweep, T in --tokens order): {r}")
            save()
        torch._dynamo.reset()
    log(table(list(records.values())))


if __name__ == "__main__":
    main()
