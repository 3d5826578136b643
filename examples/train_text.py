"""Train a small Qwen3-MoE model on real text with each experts backend: "mok" against "grouped_mm" and "eager".

The text is the Python standard library's own source (every `*.py` file under `sysconfig`'s stdlib path,
sorted, bytes as tokens: a vocabulary of 256), so every machine with Python has it and nothing is downloaded.
Every 20th file is held out for the validation loss. The model is transformers' `Qwen3MoeForCausalLM` built
from a config with random weights; each run starts from the same weights and sees the same batches as every
other run with its seed, so backends differ only in how the experts compute.

    # CPU: a tiny model, 200 steps, one intra-op thread (about 2 minutes; compiling is most of a cold run)
    python examples/train_text.py
    # GPU: Qwen3-30B-A3B's layer sizes (hidden 2048, 128 experts top-8, expert intermediate 768), 2 layers, bf16
    python examples/train_text.py --device cuda --preset qwen3-30b-a3b-layers --out runs/qwen3

What it prints and writes (under --out): a progress bar per run, tokens/s per run (training steps only,
compilation and evaluation excluded), `loss.png` (training loss, smoothed, and validation loss, per run),
`results.json` (every loss, the timings, the verdict). The verdict compares each backend with the baseline
("grouped_mm") at the first seed, and states the noise it is measured against: the largest gap between the
baseline's smoothed training-loss curves at two seeds over the last quarter of the run. "Within noise" means
the backend's gap to the baseline (same seed: same weights, same batches) is no larger than that.

torch.compile (default mode, Inductor unless --compile says otherwise) wraps forward + loss; its backward is
compiled with it, the optimizer step stays eager. "mok" and "grouped_mm" compile with fullgraph=True. HF's
"eager" experts loop cannot (`nonzero` and a Python loop over the experts hit), so it compiles with graph
breaks; the record counts them. "mok" runs inside `mok_inductor.enabled()` and the other backends outside it,
so MoK's graph pass cannot swap their experts for MoK and the baselines stay transformers' own.

tqdm (which transformers depends on) draws the progress bars and matplotlib the PNG; without matplotlib the
example still runs, and the curves are in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

import mok_inductor

BACKENDS = ("mok", "grouped_mm", "eager")
# HF's eager experts loop is data-dependent Python (nonzero, a loop over the experts hit): no single graph
NOT_FULLGRAPH = {"eager"}
VAL_EVERY_NTH_FILE = 20
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Preset:
    model: dict  # Qwen3MoeConfig fields
    batch: int
    seq: int
    steps: int
    lr: float
    dtype: str
    eval_every: int
    eval_batches: int


PRESETS = {
    # seconds of CPU per run once compiled
    "tiny": Preset(
        model=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2),
        batch=8, seq=128, steps=200, lr=3e-3, dtype="float32", eval_every=25, eval_batches=4,
    ),
    # Qwen3-30B-A3B's layer sizes; 2 of its 48 layers fit one GPU with bf16 AdamW states
    "qwen3-30b-a3b-layers": Preset(
        model=dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=2,
                   num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                   num_experts_per_tok=8, norm_topk_prob=True),
        batch=8, seq=1024, steps=300, lr=1e-3, dtype="bfloat16", eval_every=25, eval_batches=4,
    ),
}


# ---------------------------------------------------------------------------------------------
# Data: the standard library's sources, bytes as tokens


@dataclass
class Corpus:
    root: str
    train: torch.Tensor  # [N_train] uint8
    val: torch.Tensor  # [N_val] uint8
    train_files: int
    val_files: int


def source_files(root: str) -> list:
    """The `*.py` files under `root` (installed packages and caches left out), sorted by relative path."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: p.replace(os.sep, "/"))


def load_corpus(root: Optional[str] = None) -> Corpus:
    """Every 20th file (in sorted order) is validation, the rest training; each file ends with a newline."""
    root = root or sysconfig.get_paths()["stdlib"]
    files = source_files(root)
    if len(files) < 2 * VAL_EVERY_NTH_FILE:
        raise FileNotFoundError(f"found {len(files)} *.py files under {root}; pass --data DIR, a folder of Python "
                                "sources (this Python may ship its standard library compiled only)")
    parts = {"train": [], "val": []}
    for i, rel in enumerate(files):
        with open(os.path.join(root, rel), "rb") as f:
            parts["val" if i % VAL_EVERY_NTH_FILE == 0 else "train"].append(f.read().rstrip(b"\n") + b"\n")
    train, val = (torch.frombuffer(bytearray(b"".join(parts[k])), dtype=torch.uint8) for k in ("train", "val"))
    return Corpus(root, train, val, len(parts["train"]), len(parts["val"]))


def window_starts(n_bytes: int, count: int, seq: int, seed: int) -> torch.Tensor:
    """[count] random window starts in [0, n_bytes - seq], drawn from `seed` alone (the run's data order)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_bytes - seq + 1, (count,), generator=g)


def windows(data: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    """[len(starts), seq] int64 token ids: the bytes of each window."""
    idx = starts.to(data.device)[:, None] + torch.arange(seq, device=data.device)
    return data[idx].long()


# ---------------------------------------------------------------------------------------------
# Model, loss, one run


def build_model(sizes: dict, dtype: torch.dtype, device: str, seed: int, seq: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**sizes, vocab_size=256, max_position_embeddings=seq)
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen3MoeForCausalLM._from_config(cfg, dtype=dtype, experts_implementation="eager")


def make_loss_fn(model):
    """What torch.compile wraps: forward + causal-LM loss (HF shifts the labels; backward is compiled with it)."""

    def loss_fn(input_ids):
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss

    return loss_fn


def lr_at(step: int, steps: int, warmup: int) -> float:
    """Multiplier of the peak lr: linear warmup, then cosine down to a tenth of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class RunResult:
    backend: str
    seed: int
    compiled: bool
    fullgraph: bool
    losses: list = field(default_factory=list)  # training loss per step
    val: list = field(default_factory=list)  # [step, validation loss], step 0 = before training
    graph_breaks: int = 0
    step_s: list = field(default_factory=list)  # wall time of each training step (the first ones compile)
    timed_from: int = 1  # the steps timed for tokens/s: after the first tenth (compiling, recompiling)
    tokens_per_s: float = float("nan")  # over the timed steps; evaluation excluded
    step_ms: float = float("nan")  # mean of the timed steps
    median_step_ms: float = float("nan")  # robust where other processes share the CPU


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def evaluate(model, val_ids: list) -> float:
    """Mean validation loss over fixed batches (eager: evaluation is not what is timed)."""
    model.eval()
    loss = sum(float(model(input_ids=ids, labels=ids, use_cache=False).loss) for ids in val_ids) / len(val_ids)
    model.train()
    return loss


def train_run(model, backend: str, seed: int, train_data: torch.Tensor, val_ids: list, *, steps: int, batch: int,
              seq: int, lr: float, compile_backend: str, eval_every: int, device: str) -> RunResult:
    # only the "mok" run enables MoK (the "mok" experts backend, the compile-cache key and the graph pass)
    with mok_inductor.enabled() if backend == "mok" else contextlib.nullcontext():
        model.set_experts_implementation(backend)
        return _train(model, backend, seed, train_data, val_ids, steps=steps, batch=batch, seq=seq, lr=lr,
                      compile_backend=compile_backend, eval_every=eval_every, device=device)


def _train(model, backend, seed, train_data, val_ids, *, steps, batch, seq, lr, compile_backend, eval_every, device):
    from torch._dynamo.utils import counters
    from tqdm.auto import tqdm  # a dependency of transformers

    compiled = compile_backend != "none"
    fullgraph = compiled and backend not in NOT_FULLGRAPH
    res = RunResult(backend, seed, compiled, fullgraph)
    torch._dynamo.reset()
    counters.clear()
    loss_fn = make_loss_fn(model)
    step_fn = torch.compile(loss_fn, fullgraph=fullgraph, backend=compile_backend) if compiled else loss_fn
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, warmup))
    starts = window_starts(train_data.numel(), steps * batch, seq, seed).view(steps, batch)
    res.timed_from = max(1, steps // 10)

    model.train()
    res.val.append([0, evaluate(model, val_ids)])
    bar = tqdm(total=steps, desc=f"{backend} seed {seed}", unit="step", dynamic_ncols=True)
    for step in range(steps):
        ids = windows(train_data, starts[step], seq)
        _sync(device)
        t0 = time.perf_counter()
        loss = step_fn(ids)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        _sync(device)
        res.step_s.append(time.perf_counter() - t0)
        res.losses.append(value)
        bar.set_postfix(loss=f"{value:.3f}", refresh=False)
        bar.update(1)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            res.val.append([step + 1, evaluate(model, val_ids)])
    bar.close()
    res.graph_breaks = int(sum(counters["graph_break"].values()))
    timed = res.step_s[res.timed_from:]
    if timed:
        res.step_ms = 1000.0 * sum(timed) / len(timed)
        res.median_step_ms = 1000.0 * statistics.median(timed)
        res.tokens_per_s = batch * seq * len(timed) / sum(timed)
    torch._dynamo.reset()
    return res


# ---------------------------------------------------------------------------------------------
# Verdict and plot


def smooth(losses: list, window: int) -> list:
    """Trailing mean over `window` steps (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(losses):
        acc += v
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window))
    return out


def verdict(results: list, baseline: str, window: int) -> dict:
    """Each backend's gap to the baseline at the first seed against the noise (the baseline's seed-to-seed
    gap): the largest |difference| of the smoothed training losses over the last quarter of the steps."""
    runs = {(r.backend, r.seed): r for r in results}
    seeds = list(dict.fromkeys(r.seed for r in results if r.backend == baseline))
    if not seeds:
        return {"baseline": baseline, "note": f"no {baseline} run: nothing to compare against"}
    base = runs[(baseline, seeds[0])]
    tail = slice(len(base.losses) - max(1, len(base.losses) // 4), None)

    def gap(a: RunResult, b: RunResult) -> float:
        sa, sb = smooth(a.losses, window)[tail], smooth(b.losses, window)[tail]
        return max(abs(x - y) for x, y in zip(sa, sb))

    noise = gap(runs[(baseline, seeds[1])], base) if len(seeds) > 1 else None
    out = {"baseline": baseline, "seed": seeds[0], "window": window, "tail_steps": len(base.losses[tail]),
           "noise": noise, "noise_seeds": seeds[:2] if noise is not None else None, "backends": {}}
    for r in results:
        if r.seed != seeds[0] or r.backend == baseline:
            continue
        g = gap(r, base)
        out["backends"][r.backend] = dict(
            gap=g, within_noise=None if noise is None else g <= noise,
            final_val_gap=abs(r.val[-1][1] - base.val[-1][1]),
            speedup=r.tokens_per_s / base.tokens_per_s,
        )
    return out


def verdict_lines(v: dict) -> list:
    if "backends" not in v:
        return [v["note"]]
    lines = []
    if v["noise"] is None:
        lines.append("noise: unknown (run the baseline at two seeds, e.g. --seeds 0,1)")
    else:
        lines.append(f"noise: {v['noise']:.4f} = largest gap between {v['baseline']} at seeds "
                     f"{v['noise_seeds'][0]} and {v['noise_seeds'][1]} (training loss, {v['window']}-step mean, "
                     f"last {v['tail_steps']} steps)")
    for name, b in v["backends"].items():
        same = ("" if b["within_noise"] is None else
                ", same curve within noise" if b["within_noise"] else ", OUTSIDE the noise")
        lines.append(f"{name} vs {v['baseline']} (seed {v['seed']}): gap {b['gap']:.4f}{same}; "
                     f"final validation loss gap {b['final_val_gap']:.4f}; "
                     f"tokens/s {b['speedup']:.2f}x ({'faster' if b['speedup'] > 1 else 'slower'})")
    return lines


def plot(results: list, path: str, title: str, window: int) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG, the curves are in results.json (pip install matplotlib)")
        return False
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    # runs of one seed overlap where the backends agree: distinct dashes and widths keep each one visible
    styles = [dict(linestyle="-", linewidth=3.0, alpha=0.5), dict(linestyle="--", linewidth=1.5),
              dict(linestyle=":", linewidth=2.0), dict(linestyle="-.", linewidth=1.2)]
    for i, r in enumerate(results):
        style = styles[i % len(styles)]
        label = f"{r.backend} seed {r.seed}"
        if r.tokens_per_s == r.tokens_per_s:  # not NaN
            label += f", {r.tokens_per_s:,.0f} tok/s"
        line, = ax_train.plot(range(1, len(r.losses) + 1), smooth(r.losses, window), label=label, **style)
        steps, vals = zip(*r.val)
        ax_val.plot(steps, vals, marker="o", markersize=4, color=line.get_color(), label=label, **style)
    ax_train.set_title(f"training loss ({window}-step mean)")
    ax_val.set_title("validation loss (held-out files)")
    for ax in (ax_train, ax_val):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated experts backends")
    p.add_argument("--baseline", default="grouped_mm", help="the backend the others are compared with")
    p.add_argument("--seeds", default="0,1", help="the baseline runs every seed (its spread is the noise), "
                                                  "the other backends the first")
    p.add_argument("--steps", type=int, help="default: the preset's")
    p.add_argument("--batch", type=int, help="default: the preset's")
    p.add_argument("--seq", type=int, help="bytes per sequence; default: the preset's")
    p.add_argument("--layers", type=int, help="default: the preset's")
    p.add_argument("--lr", type=float, help="peak AdamW lr; default: the preset's")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the preset's")
    p.add_argument("--eval-every", type=int, help="default: the preset's")
    p.add_argument("--compile", default="inductor",
                   help='torch.compile backend ("inductor", "aot_eager", ...) or "none" to run eagerly')
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op CPU threads (--device cpu only; 0: torch's default). The tiny preset's matmuls are "
                        "too small to split, and a second thread mostly waits, or stalls the step where other "
                        "processes share the cores")
    p.add_argument("--data", help="a folder of Python sources (default: this Python's standard library)")
    p.add_argument("--out", default="train_text_out", help="folder for loss.png and results.json")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    preset = PRESETS[args.preset]
    for name in ("steps", "batch", "seq", "lr", "dtype", "eval_every"):  # unset: the preset's
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    threads = torch.get_num_threads()
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _main(args, preset)
    finally:
        torch.set_num_threads(threads)


def _git_sha() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _main(args, preset: Preset) -> dict:
    steps, batch, seq = args.steps, args.batch, args.seq
    sizes = dict(preset.model)
    if args.layers:
        sizes["num_hidden_layers"] = args.layers
    backends = [b for b in args.backends.split(",") if b]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not backends or not seeds:
        raise ValueError("--backends and --seeds need at least one entry each")
    runs = [(b, seeds[0]) for b in backends] + [(args.baseline, s) for s in seeds[1:] if args.baseline in backends]

    corpus = load_corpus(args.data)
    train_data, val_data = corpus.train.to(args.device), corpus.val.to(args.device)
    val_starts = window_starts(val_data.numel(), preset.eval_batches * batch, seq, seed=12345)
    val_ids = [windows(val_data, s, seq) for s in val_starts.view(preset.eval_batches, batch)]
    print(f"data: {corpus.root}: {corpus.train_files} files ({corpus.train.numel() / 1e6:.1f} MB) for training, "
          f"{corpus.val_files} held out ({corpus.val.numel() / 1e6:.1f} MB) for validation")

    dtype = getattr(torch, args.dtype)
    results, inits = [], {}
    for backend, seed in runs:
        if seed not in inits:  # one model per seed; every run of that seed starts from its initial weights
            model = build_model(sizes, dtype, args.device, seed, seq)
            inits[seed] = (model, {k: v.detach().clone() for k, v in model.state_dict().items()})
        model, state = inits[seed]
        model.load_state_dict(state)
        r = train_run(model, backend, seed, train_data, val_ids, steps=steps, batch=batch, seq=seq, lr=args.lr,
                      compile_backend=args.compile, eval_every=args.eval_every, device=args.device)
        results.append(r)
        mode = (f"compiled ({args.compile}, {'fullgraph' if r.fullgraph else f'{r.graph_breaks} graph breaks'})"
                if r.compiled else "eager")
        print(f"{backend:>10s} seed {seed}: {mode}; loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f}, validation "
              f"{r.val[0][1]:.3f} -> {r.val[-1][1]:.3f}; {r.tokens_per_s:,.0f} tokens/s, {r.step_ms:.1f} ms/step "
              f"(median {r.median_step_ms:.1f}; first step {r.step_s[0]:.1f} s)")

    window = max(1, steps // 20)
    v = verdict(results, args.baseline, window)
    for line in verdict_lines(v):
        print(line)

    on_cuda = args.device.startswith("cuda")
    device_name = torch.cuda.get_device_name(args.device) if on_cuda else platform.processor() or "cpu"
    title = (f"Qwen3-MoE ({args.preset}, {sizes['num_hidden_layers']} layers, hidden {sizes['hidden_size']}, "
             f"{sizes['num_experts']} experts top-{sizes['num_experts_per_tok']}), {args.dtype}, "
             f"{batch}x{seq} bytes/step, {device_name}")
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "loss.png")
    wrote_png = plot(results, png, title, window)
    record = dict(
        preset=args.preset, model=sizes, steps=steps, batch=batch, seq=seq, lr=args.lr, dtype=args.dtype,
        compile=args.compile, device=device_name, threads=torch.get_num_threads() if args.device == "cpu" else None,
        torch=torch.__version__, transformers=__import__("transformers").__version__,
        mok_inductor=mok_inductor.__version__, git_sha=_git_sha(), python=platform.python_version(),
        data=dict(root=corpus.root, train_files=corpus.train_files, val_files=corpus.val_files,
                  train_bytes=corpus.train.numel(), val_bytes=corpus.val.numel()),
        results=[asdict(r) for r in results], verdict=v, png=png if wrote_png else None,
    )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'results.json')}" + (f" and {png}" if wrote_png else ""))
    return record


if __name__ == "__main__":
    main()
