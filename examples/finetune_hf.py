"""Fine-tune a Hugging Face transformers MoE model with the "mok" experts backend.

Trains the same model (same initial weights, same batches) once per experts implementation and
saves the loss curves as a PNG plus a JSON record; prints tokens/s per implementation.

    # CPU, a few steps (what CI runs): "mok" under torch.compile against HF's eager experts loop
    python examples/finetune_hf.py --preset tiny --steps 8

    # H200: a Qwen3-MoE (30B-A3B) layer stack with 2 layers, bf16, against "grouped_mm"
    python examples/finetune_hf.py --preset qwen3-moe-2l --device cuda --dtype bfloat16 \\
        --impls mok,grouped_mm,eager --steps 30 --batch 4 --seq 2048

Implementations in `--compile-impls` are wrapped in `torch.compile(fullgraph=True)` (forward and
backward; the optimizer step stays eager). HF's "eager" experts loop is data-dependent Python
control flow, so it runs uncompiled: it is the reference curve. tokens/s is measured after
`--warmup` steps (compilation excluded) with device synchronisation.

The data is a synthetic, learnable language: each sequence follows t[i+1] = (a * t[i] + b) mod V
with (a, b) drawn per sequence from a small set, so the loss falls quickly and every run sees the
same batches. matplotlib is needed for the PNG (`pip install matplotlib`); without it the JSON is
still written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch

import mok_inductor
import mok_inductor.integrations.transformers

PRESETS = {
    # tiny: seconds on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 vocab_size=256, max_position_embeddings=512),
    # Qwen3-30B-A3B's layer sizes, 2 layers, a 32k vocabulary (the embedding is not what is measured)
    "qwen3-moe-2l": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                         num_experts_per_tok=8, vocab_size=32768, max_position_embeddings=4096, norm_topk_prob=True),
}


@dataclass
class RunResult:
    impl: str
    compiled: bool
    losses: list = field(default_factory=list)
    tokens_per_s: float = float("nan")
    step_ms: float = float("nan")


def build_model(preset: str, dtype: torch.dtype, device: str, seed: int = 0, layers: int | None = None):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    sizes = dict(PRESETS[preset])
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    cfg = Qwen3MoeConfig(**sizes)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3MoeForCausalLM._from_config(cfg, dtype=dtype, experts_implementation="eager")
    return model


def make_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rules = torch.tensor([[3, 1], [5, 7], [7, 3], [11, 5]])
    out = []
    for _ in range(steps):
        r = rules[torch.randint(0, len(rules), (batch,), generator=g)]
        t = torch.empty(batch, seq, dtype=torch.long)
        t[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for i in range(1, seq):
            t[:, i] = (r[:, 0] * t[:, i - 1] + r[:, 1]) % vocab
        out.append(t)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_loss_fn(model):
    """The compiled unit: forward + causal-LM loss (backward through it is compiled as well)."""

    def loss_fn(input_ids):
        return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss

    return loss_fn


def train(model, impl: str, batches, *, compiled: bool, lr: float, device: str, warmup: int) -> RunResult:
    # "mok" runs inside mok_inductor.enabled(): it registers the "mok" experts backend and installs the compile-cache
    # key over the package. The other implementations run outside it, so its graph pass cannot swap their experts
    # for MoK and the baselines stay transformers' own.
    with mok_inductor.enabled() if impl == "mok" else contextlib.nullcontext():
        return _train(model, impl, batches, compiled=compiled, lr=lr, device=device, warmup=warmup)


def _train(model, impl: str, batches, *, compiled: bool, lr: float, device: str, warmup: int) -> RunResult:
    model.set_experts_implementation(impl)
    if impl == "mok":
        # decide each experts module's plan eagerly (optional: a compiled first call decides it while tracing)
        mok_inductor.integrations.transformers.prepare(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    loss_fn = make_loss_fn(model)
    step_fn = torch.compile(loss_fn, fullgraph=True) if compiled else loss_fn
    res = RunResult(impl, compiled)
    t_start, tokens = None, 0
    for i, ids in enumerate(batches):
        if i == warmup:
            _sync(device)
            t_start = time.perf_counter()
        ids = ids.to(device)
        loss = step_fn(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        res.losses.append(float(loss.detach()))
        if t_start is not None:
            tokens += ids.numel()
    _sync(device)
    if t_start is not None and tokens:
        secs = time.perf_counter() - t_start
        res.tokens_per_s = tokens / secs
        res.step_ms = 1000.0 * secs / (len(batches) - warmup)
    return res


def plot(results, path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        label = f"{r.impl}{' (compiled)' if r.compiled else ''}"
        if r.tokens_per_s == r.tokens_per_s:  # not NaN
            label += f", {r.tokens_per_s:,.0f} tok/s"
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=label, marker="o" if len(r.losses) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--impls", default="mok,eager", help="comma-separated experts implementations, e.g. mok,grouped_mm,eager")
    p.add_argument("--compile-impls", default="mok,grouped_mm", help="which of --impls run under torch.compile")
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from tokens/s (compilation happens here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="finetune_hf", help="output prefix: <out>.png and <out>.json")
    args = p.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    impls = [s for s in args.impls.split(",") if s]
    compile_impls = {s for s in args.compile_impls.split(",") if s}
    model = build_model(args.preset, dtype, args.device, args.seed, args.layers)
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = make_batches(args.steps, args.batch, args.seq, model.config.vocab_size, args.seed)
    warmup = min(args.warmup, max(args.steps - 1, 0))

    results = []
    for impl in impls:
        model.load_state_dict(init_state)
        torch._dynamo.reset()
        r = train(model, impl, batches, compiled=impl in compile_impls, lr=args.lr, device=args.device, warmup=warmup)
        results.append(r)
        print(f"{impl:12s} compiled={r.compiled!s:5s} loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}   "
              f"{r.tokens_per_s:,.0f} tokens/s   {r.step_ms:.1f} ms/step")
    base = next((r for r in results if r.impl == "grouped_mm"), None)
    mok = next((r for r in results if r.impl == "mok"), None)
    if base is not None and mok is not None:
        print(f"mok / grouped_mm tokens/s: {mok.tokens_per_s / base.tokens_per_s:.2f}x")

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    n_layers = model.config.num_hidden_layers
    title = f"{args.preset} ({n_layers} layer{'s' if n_layers != 1 else ''}, {args.dtype}, {device_name})"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    png = args.out + ".png"
    wrote_png = plot(results, png, title)
    record = dict(
        preset=args.preset, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, dtype=args.dtype,
        device=device_name, torch=torch.__version__, transformers=__import__("transformers").__version__,
        results=[asdict(r) for r in results], png=png if wrote_png else None,
    )
    with open(args.out + ".json", "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {args.out}.json" + (f" and {png}" if wrote_png else ""))
    return record


if __name__ == "__main__":
    main()
