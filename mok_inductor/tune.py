"""Tune the kernels' tile configs for a model's MoE layer shape on this GPU and write them to a table.

    python -m mok_inductor.tune --hidden 4096 --intermediate 14336 --experts 8 --topk 2
    python -m mok_inductor.tune --model path/to/config.json --expert-parallel 8   # a transformers config
    python -m mok_inductor.tune --preset qwen3-30b-a3b,mixtral-8x7b --max-tokens 16384
    python -m mok_inductor.tune --list-presets

For each token count (powers of two from 1 to --max-tokens) the layer's forward and backward run once with
`options.autotune` on: each kernel launch at a (problem, row bucket) times every candidate tile config and
keeps the fastest (`mok_inductor.kernels.configs`). The picks are merged into the table of this GPU in --out
(default: the user's table folder, `options.tables_dir`, which later runs read before the shipped tables),
replacing earlier picks of the same problem and bucket. Most of a first tuning run is Triton compiling the
candidates (about two minutes a shape; once per machine: the compiled kernels stay in Triton's disk cache), so
with several shapes `--jobs` processes first compile them side by side (`--compile-only`: one token count per
kernel-selection regime, nothing timed or written), and the timing then runs alone on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

# name: (hidden, intermediate, experts (local), routes per token, shared expert intermediate or 0)
PRESETS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, 0),
    "qwen2-57b-a14b": (3584, 2560, 64, 8, 20480),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4, 5632),
    "mixtral-8x7b": (4096, 14336, 8, 2, 0),
    "mixtral-8x22b": (6144, 16384, 8, 2, 0),
    "gpt-oss-20b": (2880, 2880, 32, 4, 0),
    "gpt-oss-120b": (2880, 2880, 128, 4, 0),
    "deepseek-v3-ep8": (7168, 2048, 32, 8, 2048),  # 256 experts over 8 ranks; Kimi-K2's slices have these sizes
    "deepseek-v3-ep16": (7168, 2048, 16, 8, 2048),
    "olmoe-1b-7b": (2048, 1024, 64, 8, 0),
}


def shape_from_config(path: str, expert_parallel: int = 1) -> tuple:
    """(hidden, intermediate, local experts, topk, shared intermediate) from a transformers config (a
    config.json, a folder holding one, or a model id transformers can resolve)."""
    if isinstance(expert_parallel, bool) or not isinstance(expert_parallel, int) or expert_parallel < 1:
        raise ValueError(f"expert parallelism: expected a number of ranks >= 1, got {expert_parallel!r}")
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        cfg = json.loads(p.read_text())
    elif p.suffix == ".json":
        raise FileNotFoundError(f"{p}: no such config file")
    else:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path).to_dict()
    cfg = {**(cfg.get("text_config") or {}), **cfg}

    def first(*names, default=None):
        for n in names:
            if cfg.get(n) is not None:
                return cfg[n]
        if default is not None:
            return default
        raise ValueError(f"{path}: none of {names} in the config")

    hidden = first("hidden_size")
    inter = first("moe_intermediate_size", "intermediate_size")
    experts = first("num_experts", "num_local_experts", "n_routed_experts")
    topk = first("num_experts_per_tok", "experts_per_token", "top_k")
    shared = first("shared_expert_intermediate_size", "shared_intermediate_size", default=0)  # (GraniteMoeShared)
    if not shared and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * inter
    if not shared and str(cfg.get("model_type", "")).startswith("llama4"):
        shared = inter  # Llama 4's MoE layers always add a shared expert of the routed experts' size
    if experts % expert_parallel:
        raise ValueError(f"{experts} experts do not divide over {expert_parallel} ranks")
    return int(hidden), int(inter), experts // expert_parallel, int(topk), int(shared)


def _layer(T, H, I, E, K, Is, dtype, device, gen):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype).requires_grad_()

    x = rand(T, H)
    logits = torch.randn(T, E, generator=gen, device=device)
    if K <= E:
        rw, te = torch.topk(logits.softmax(-1), K)
    else:  # a rank's few local experts under expert parallelism: a token's routes repeat them
        te = torch.randint(0, E, (T, K), generator=gen, device=device)
        rw = torch.rand(T, K, generator=gen, device=device).softmax(-1)
    w = dict(gate_up_proj=rand(E, 2 * I, H, scale=H ** -0.5), down_proj=rand(E, H, I, scale=I ** -0.5))
    if Is:
        w.update(shared_gate_up_proj=rand(2 * Is, H, scale=H ** -0.5), shared_down_proj=rand(H, Is, scale=Is ** -0.5),
                 shared_output_gate=rand(1, H, scale=H ** -0.5))
    return x, rw, te, w


def _regime(shape: tuple, T: int, o, mxfp8: bool = False) -> tuple:
    """Which kernels and variants a layer of `shape` launches at T tokens, as the kernels decide it from the
    routes M = T*K against `options`' thresholds times the experts (the shared expert: T rows, one expert):
    TMA loads, the two-pass SwiGLU backward, and with `mxfp8` the MXFP8 forward's K loop (fp16 up to
    mx_f16_dot_max_rows per expert, dequantizing below mx_dequantize_min_rows, dequantized up front from it)."""
    H, I, E, K, Is = shape
    M = T * K
    regime = (M >= o.tma_min_rows * E, M >= o.two_pass_min_rows * E)
    if mxfp8:
        regime += (M > o.mx_f16_dot_max_rows * E, M >= o.mx_dequantize_min_rows * E)
    return regime + (bool(Is) and T >= o.tma_min_rows, bool(Is) and T >= o.two_pass_min_rows)


def regime_tokens(shape: tuple, tokens: list, cap: int = 8192, mxfp8: bool = False) -> list:
    """The first token count (up to `cap`) of each kernel-selection regime (`_regime`) among `tokens`: these
    compile every kernel the others launch."""
    from mok_inductor import options

    o = options.current()
    firsts = {}
    for T in sorted(tokens):
        if T > cap:
            break
        firsts.setdefault(_regime(shape, T, o, mxfp8), T)
    return list(firsts.values())


def default_tokens(shape: tuple, max_tokens: int, mxfp8: bool = False) -> list:
    """The token counts a shape is tuned at: the powers of two up to `max_tokens`, and the last count before
    each regime change (`_regime`). A regime's kernel variant is its own problem in the tables, so its row
    buckets need picks of their own: e.g. mixtral's routed GEMMs load through TMA from 512 tokens on (1024
    rows), and the pointer-load variant at 257-511 tokens (rows in bucket 1024) would otherwise have only the
    picks of 256 tokens' bucket."""
    from mok_inductor import options

    o = options.current()
    tokens = {1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens}
    prev = _regime(shape, 1, o, mxfp8)
    for T in range(2, max_tokens + 1):
        now = _regime(shape, T, o, mxfp8)
        if now != prev:
            tokens.add(T - 1)
            prev = now
    return sorted(tokens)


def tune_shape(shape: tuple, tokens: list, folder: Path, *, dtype=torch.bfloat16, mxfp8: bool = False,
               backward: bool = True, progress=None, device="cuda", compile_only: bool = False) -> None:
    """Run the layer at each token count with the search on, recording into `folder`'s table
    (`compile_only`: each candidate launched once and nothing timed; the picks are meaningless)."""
    import contextlib

    import mok_inductor
    from mok_inductor import mxfp8 as mx
    from mok_inductor import options
    from mok_inductor.kernels import configs

    H, I, E, K, Is = shape
    gen = torch.Generator(device=device).manual_seed(0)
    timing = configs.timing_with(configs.compile_only_timer) if compile_only else contextlib.nullcontext()
    with options.override(autotune=True, tables_dir=str(folder)), timing:
        configs.reset()
        for i, T in enumerate(tokens):
            x, rw, te, w = _layer(T, H, I, E, K, Is, dtype, device, gen)
            y = mok_inductor.moe(x, rw, te, **w)
            if backward:
                y.backward(torch.randn_like(y))
            if mxfp8 and T * K < options.current().mx_dequantize_min_rows * E:  # (from there: bf16, dequantized)
                q = {k: mx.quantize(w[k].detach(), columnwise=False) for k in ("gate_up_proj", "down_proj")}
                with torch.no_grad():
                    mok_inductor.moe(x.detach(), rw, te, q["gate_up_proj"], q["down_proj"],
                                     **{k: v.detach() for k, v in w.items() if k.startswith("shared")})
            del x, y, w
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            if progress is not None:
                progress(i + 1, T)


def merge_into(src: Path, dst: Path) -> int:
    """Merge every table in `src` into the same-named table in `dst` (src's picks replace dst's); -> the picks
    merged."""
    from mok_inductor.kernels import configs

    n = 0
    for f in sorted(src.glob("*.json")):
        new = configs.load(f)
        target = dst / f.name
        with configs.file_lock(target):  # (a search or another tuning run may write it meanwhile)
            table = configs.load(target) if target.is_file() else configs.Table(new.device, new.capability)
            n += table.merge(new)
            table.device, table.capability = new.device or table.device, new.capability or table.capability
            configs.save(table, target)
    return n


def _peak_bytes(shape: tuple, tokens: list, mxfp8: bool) -> int:
    """A rough upper bound of a `--compile-only` run's GPU memory: the bf16 weights, their gradients and
    the float32 temporaries of quantizing them, the largest call's routed activations, the CUDA context."""
    H, I, E, K, Is = shape
    weights = 2 * (3 * E * I * H + 3 * Is * H)
    return (6 if mxfp8 else 2) * weights + 16 * max(tokens) * K * 2 * I + (1 << 30)


def precompile(shapes: dict, tokens: dict, args, jobs: int) -> None:
    """Compile every shape's candidates in up to `jobs` processes side by side (`--compile-only` runs at
    `regime_tokens`), so that the timing afterwards finds them in Triton's disk cache; a process starts
    only while the estimated memory of those running (`_peak_bytes`) fits in 85% of the GPU's free memory."""
    base = [sys.executable, "-m", "mok_inductor.tune", "--compile-only", "--dtype", args.dtype]
    base += ["--mxfp8"] if args.mxfp8 else []
    base += ["--forward-only"] if args.forward_only else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    pending = []
    for name, s in shapes.items():
        tok = regime_tokens(s, tokens[name], mxfp8=args.mxfp8)
        if not tok:  # every count above the cap: the shape's tuning compiles its candidates
            sys.stderr.write(f"not compiling {name} ahead (its token counts are all above the compile runs' cap): "
                             "its tuning compiles\n")
            continue
        cmd = base + ["--hidden", str(s[0]), "--intermediate", str(s[1]), "--experts", str(s[2]), "--topk",
                      str(s[3]), "--shared-intermediate", str(s[4]), "--tokens", ",".join(map(str, tok))]
        pending.append((name, cmd, _peak_bytes(s, tok, args.mxfp8)))
    budget = 0.85 * torch.cuda.mem_get_info()[0]
    running, start = [], time.time()
    sys.stderr.write(f"compiling the candidates of {len(pending)} shape(s), up to {jobs} processes at a time\n")
    while pending or running:
        while pending and len(running) < jobs and (
                not running or sum(r[1] for r in running) + pending[0][2] <= budget):
            name, cmd, peak = pending.pop(0)
            log = tempfile.TemporaryFile()  # (not a pipe: a child's warnings could fill it and block it)
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
            running.append((name, peak, proc, log))
        done = [r for r in running if r[2].poll() is not None]
        if not done:
            time.sleep(0.5)
            continue
        for r in done:
            running.remove(r)
            name, _, proc, log = r
            log.seek(0)
            err = log.read().decode(errors="replace")
            log.close()
            if proc.returncode:
                sys.stderr.write(f"compiling {name} failed (its tuning compiles instead):\n{err[-2000:]}\n")
            else:
                sys.stderr.write(f"compiled {name} ({time.time() - start:.0f} s)\n")
        sys.stderr.flush()


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, width: int = 30):
        self.total, self.width, self.done, self.start = total, width, 0, time.time()

    def step(self, label: str) -> None:
        self.done += 1
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {label} ({time.time() - self.start:.0f} s)   ")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_inductor.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, help="the model's hidden size")
    p.add_argument("--intermediate", type=int, help="the routed experts' intermediate size")
    p.add_argument("--experts", type=int, help="local experts (after expert parallelism)")
    p.add_argument("--topk", type=int, help="routes per token")
    p.add_argument("--shared-intermediate", type=int, default=0, help="the shared expert's intermediate size")
    p.add_argument("--model", help="a transformers config.json, a folder holding one, or a model id")
    p.add_argument("--expert-parallel", type=int, default=1, help="with --model: ranks the experts spread over")
    p.add_argument("--preset", help=f"comma-separated, or 'all': {', '.join(PRESETS)}")
    p.add_argument("--list-presets", action="store_true")
    p.add_argument("--tokens", help="comma-separated token counts (default: powers of two up to --max-tokens and "
                                    "the last count before each change of kernel variant)")
    p.add_argument("--max-tokens", type=int, default=65536, help="the largest token count tuned (default 65536)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--mxfp8", action="store_true", help="also tune the MXFP8 decode kernels (forward)")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--out", help="table folder (default: the user's, options.tables_dir)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="processes compiling the candidates side by side before the timing (1: compile while timing)")
    p.add_argument("--compile-only", action="store_true",
                   help="launch every candidate once to compile it (into Triton's disk cache); time and write nothing")
    args = p.parse_args(argv)

    if args.list_presets:
        for name, s in PRESETS.items():
            print(f"{name}: hidden {s[0]}, intermediate {s[1]}, experts {s[2]}, topk {s[3]}, shared {s[4]}")
        return 0
    shapes = {}
    if args.preset:
        names = list(PRESETS) if args.preset == "all" else args.preset.split(",")
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            p.error(f"unknown preset(s) {unknown}; --list-presets shows them")
        shapes.update({n: PRESETS[n] for n in names})
    if args.model:
        try:
            shapes[args.model] = shape_from_config(args.model, args.expert_parallel)
        except (ValueError, OSError) as e:
            p.error(str(e))
    if args.hidden or args.intermediate or args.experts or args.topk:
        if not (args.hidden and args.intermediate and args.experts and args.topk):
            p.error("--hidden, --intermediate, --experts and --topk go together")
        shapes["command line"] = (args.hidden, args.intermediate, args.experts, args.topk, args.shared_intermediate)
    if not shapes:
        p.error("give a shape: --hidden/--intermediate/--experts/--topk, --model or --preset")
    if not torch.cuda.is_available():
        p.error("tuning needs a CUDA GPU")
    if args.tokens:
        try:
            explicit = [int(t) for t in args.tokens.split(",")]
        except ValueError:
            p.error(f"--tokens: expected comma-separated token counts, got {args.tokens!r}")
        if min(explicit) < 1:
            p.error(f"--tokens: token counts must be >= 1, got {args.tokens!r}")
        tokens = {name: explicit for name in shapes}
    else:
        tokens = {name: default_tokens(shape, args.max_tokens, args.mxfp8) for name, shape in shapes.items()}

    from mok_inductor.kernels import configs

    dtype = getattr(torch, args.dtype)
    if args.compile_only:
        with tempfile.TemporaryDirectory() as tmp:
            for name, shape in shapes.items():
                tune_shape(shape, tokens[name], Path(tmp), dtype=dtype, mxfp8=args.mxfp8, backward=not args.forward_only,
                           compile_only=True)
        return 0
    out = Path(args.out).expanduser() if args.out else configs.user_dir()
    if args.jobs > 1 and len(shapes) > 1:
        precompile(shapes, tokens, args, args.jobs)
    bar = Progress(sum(map(len, tokens.values())))
    with tempfile.TemporaryDirectory() as tmp:
        def done(i, T, name):  # merged after every token count: an interrupted run keeps what it tuned
            bar.step(f"{name} T={T}")
            merge_into(Path(tmp), out)

        for name, shape in shapes.items():
            tune_shape(shape, tokens[name], Path(tmp), dtype=dtype, mxfp8=args.mxfp8, backward=not args.forward_only,
                       progress=lambda i, T, name=name: done(i, T, name))
    path = out / (configs.table_name(torch.cuda.get_device_name()) + ".json")
    table = configs.load(path)
    n = sum(len(per) for problems in table.entries.values() for per in problems.values())
    print(f"{path}: {n} picks")
    for line in stage_summary(table):
        print(line)
    return 0


def stage_summary(table) -> list:
    """A line per problem of a stage family where a way other than the fused kernel won some buckets."""
    from mok_inductor.kernels import configs

    lines = []
    for name, problems in sorted(table.entries.items()):
        family = configs.FAMILIES[name]
        if not family.is_stage:
            continue
        for problem, per in sorted(problems.items(), key=repr):
            won = {}
            for b, tile in sorted(per.items()):
                if tile != family.candidates[0]:
                    won.setdefault(tile.name, []).append(b)
            sizes = ", ".join(f"{f} {v}" for f, v in zip(family.fields, problem))
            lines += [f"{name} ({sizes}): {way} at row buckets {', '.join(map(str, bs))}" for way, bs in won.items()]
    return lines


if __name__ == "__main__":
    sys.exit(main())
