"""Hugging Face generate() on a small random Qwen3-MoE, experts backend "mok" against "grouped_mm", at prompt lengths
seen for the first time (cold) and again (warm).

    python benchmarks/generate_hf.py --out DIR [--backends mok,grouped_mm] [--lengths 37,101,260,515,1030]
                                     [--max-new-tokens 32] [--warm-passes 3] [--child-cache fresh|shared]
                                     [--hf-decode-switch off|on]
                                     [--profile-new-length L] [--no-cudnn-attention] [--static-cache]
    python benchmarks/generate_hf.py --device cpu --tiny --out /tmp/gen     # CPU smoke run (mok runs its reference)

The model is built from a transformers config, nothing is downloaded: Qwen3MoeConfig with 4 layers, hidden 1024,
64 experts, top-8, moe_intermediate_size 512, vocab 32000, random init (seeded, the same weights in every
process: the parameter checksum is reported), bf16. Each backend runs in its own process (neither warms the
other; with --child-cache fresh, the default, each has an empty Triton cache). In it: one untimed generate at
--warmup-len (loads the libraries, the decode step's kernels); then greedy generate() of --max-new-tokens
tokens (batch 1, random prompts, the same in every process) at each length, timed as a whole (cold: each length
new to the process); then the same run again --warm-passes times (warm: the pass of median total time; every
pass's total in warm.passes_total_s: a decode call is host-bound, and its wall time moves between repeats of the same
loop by more than the gap a single pass could show). Reported: seconds, new tokens/s, cold/warm (target at most
1.2), each backend's time against the first backend's, and how many leading greedy tokens agree with the first
backend's at each length (reported, not checked: bf16 rounding may flip near-tied logits of a random model).
transformers (5.23 at least) switches "grouped_mm" to "batched_mm" for decoding inside generate() on GPUs
(`_optimize_model_for_decode`); --hf-decode-switch off (the default) keeps each backend as named for the whole run,
"on" leaves transformers' switch alone. `impl_calls` counts the experts calls by the implementation they ran.
--static-cache generates with `cache_implementation="static"` sized once for the longest prompt (`max_cache_len`,
where transformers takes it): on a GPU transformers then compiles the decoding forward (`torch.compile` with its
`compile_config`), the setup a server would use; without it the whole run is eager (a dynamic cache).
Results: DIR/generate_hf.json, a markdown table last, DIR/generate_hf.log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

MODEL = dict(num_hidden_layers=4, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             intermediate_size=2048, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=8,
             vocab_size=32000, norm_topk_prob=True, max_position_embeddings=4096)
TINY = dict(MODEL, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=512)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def build(backend, dims, device):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    if backend == "mok":
        import mok_inductor

        mok_inductor.enable()  # registers the "mok" experts backend (the other processes stay without it)
    cfg = Qwen3MoeConfig(**dims, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation=backend, dtype=torch.bfloat16).eval()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    return model.to(device), checksum


def child(a):
    t0 = time.perf_counter()
    if a.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dims = TINY if a.tiny else MODEL
    model, checksum = build(a.child, dims, a.device)
    got = getattr(model.config, "_experts_implementation", None)
    experts = [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]
    calls = {}

    def count(module, args):  # which implementation each experts call dispatches to (transformers reads it per call)
        impl = getattr(getattr(module, "config", None), "_experts_implementation", "?")
        key = f"{'prefill' if args[0].shape[0] > 1 else 'decode'}:{impl}"
        calls[key] = calls.get(key, 0) + 1

    for m in experts:
        m.register_forward_pre_hook(count)
    plans = []
    if a.child == "mok":
        from mok_inductor.integrations import transformers as hf

        plans = sorted({hf.experts_plan(m).kind for m in experts})  # "supported", or why it falls back
    switch = hasattr(model, "_optimize_model_for_decode")
    if switch and a.hf_decode_switch == "off":
        model._optimize_model_for_decode = contextlib.nullcontext
    gen = torch.Generator().manual_seed(1)
    prompts = {L: torch.randint(1, dims["vocab_size"], (1, L), generator=gen).to(a.device) for L in a.lengths}
    n = a.max_new_tokens

    cache = {}
    if a.static_cache:
        from transformers import GenerationConfig

        cache = dict(cache_implementation="static")
        if hasattr(GenerationConfig(), "max_cache_len"):  # one cache size for every length (one decode graph)
            cache["max_cache_len"] = max(a.lengths) + n

    def generate(ids, new, record=None):  # (record: the warm-up's; the timed calls return the tokens only)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, num_beams=1, pad_token_id=0, return_dict_in_generate=record is not None,
                             **cache)
        if record is not None:
            record["cache_class"] = type(out.past_key_values).__name__
            out = out.sequences
        return out[0, ids.shape[1]:].tolist()

    def run():
        times, tokens = {}, {}
        with torch.no_grad():
            sync(a.device)
            start = time.perf_counter()
            for L, ids in prompts.items():
                t = time.perf_counter()
                tokens[L] = generate(ids, n)
                sync(a.device)
                times[L] = time.perf_counter() - t
            return dict(total_s=time.perf_counter() - start, per_length_s=times), tokens

    load_s = time.perf_counter() - t0
    facts = {}  # the KV cache class generate() used (from the warm-up call)
    warm_up_s = 0.0
    if a.warmup_len:
        t = time.perf_counter()
        with torch.no_grad():
            generate(torch.randint(1, dims["vocab_size"], (1, a.warmup_len), generator=gen).to(a.device), 2, facts)
        sync(a.device)
        warm_up_s = time.perf_counter() - t
    cold, tokens = run()
    passes = [run() for _ in range(a.warm_passes)]
    warm, tokens_warm = sorted(passes, key=lambda p: p[0]["total_s"])[(len(passes) - 1) // 2]
    warm["passes_total_s"] = [p[0]["total_s"] for p in passes]
    hot_ops = profile_new_length(a, generate, dims) if a.profile_new_length else None
    print(json.dumps(dict(backend=a.child, experts_implementation=got, checksum=checksum, load_s=load_s,
                          warm_up_s=warm_up_s, cold=cold, warm=warm, tokens=tokens,
                          same_tokens_cold_warm=all(tokens == t for _, t in passes), impl_calls=calls, mok_plans=plans,
                          hot_ops=hot_ops, hf_decode_switch_present=switch, hf_decode_switch=a.hf_decode_switch,
                          cache_class=facts.get("cache_class"), cache_kwargs=cache,
                          transformers=__import__("transformers").__version__, torch=torch.__version__)))


def profile_new_length(a, generate, dims):
    """Where a prompt length new to the process spends its time: torch.profiler over one generate() at
    --profile-new-length (a length not run before), against the same call again; the ops whose host time
    grew most, with their counts and device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    ids = torch.randint(1, dims["vocab_size"], (1, a.profile_new_length), generator=torch.Generator().manual_seed(7))
    ids = ids.to(a.device)
    tables = []
    for _ in range(2):
        with torch.no_grad(), profile(activities=acts) as prof:
            t = time.perf_counter()
            generate(ids, a.max_new_tokens)
            sync(a.device)
            wall = time.perf_counter() - t
        ops = {}
        for ev in prof.key_averages():
            ops[ev.key] = dict(count=ev.count, cpu_total_ms=ev.cpu_time_total / 1e3,
                               self_cpu_ms=ev.self_cpu_time_total / 1e3,
                               device_ms=getattr(ev, "self_device_time_total", 0) / 1e3)
        tables.append((wall, ops))
    (new_wall, new), (seen_wall, seen) = tables
    grew = sorted(new, key=lambda k: new[k]["self_cpu_ms"] - seen.get(k, {}).get("self_cpu_ms", 0.0), reverse=True)
    return dict(length=a.profile_new_length, new_s=new_wall, seen_s=seen_wall,
                top=[dict(op=k, new=new[k], seen=seen.get(k)) for k in grew[:25]])


def agreement(ref, other):
    """Per prompt length: how many leading greedy tokens are the same."""
    out = {}
    for L, toks in ref.items():
        k = 0
        for x, y in zip(toks, other.get(L, [])):
            if x != y:
                break
            k += 1
        out[L] = k
    return out


def table(rows, lengths, n):
    new = len(lengths) * n
    ref = rows[0]
    out = [f"greedy generate(), {n} new tokens at each prompt length {', '.join(map(str, lengths))} (batch 1)", "",
           f"| backend | cold s | warm s | cold tok/s | warm tok/s | cold/warm | cold s / {ref['backend']}'s | "
           f"warm s / {ref['backend']}'s | leading tokens equal to {ref['backend']}'s (min over lengths) |",
           "|" + " --- |" * 9]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['backend']} | failed: {r['error'].strip().splitlines()[-1][:200]} |" + " |" * 7)
            continue
        c, w = r["cold"]["total_s"], r["warm"]["total_s"]
        flag = " **>1.2**" if c / w > 1.2 else ""
        vs = [f"{r[k]['total_s'] / ref[k]['total_s']:.2f}" if "error" not in ref else "—" for k in ("cold", "warm")]
        agree = r.get("agreement", {})
        out.append(f"| {r['backend']} | {c:.2f} | {w:.2f} | {new / c:.0f} | {new / w:.0f} | {c / w:.2f}{flag} | "
                   f"{vs[0]} | {vs[1]} | {min(agree.values()) if agree else '—'} of {n} |")
    out.append("")
    ok = [r for r in rows if "error" not in r]
    out.append("warm passes, total s (the median one is the warm column): " + "; ".join(
        f"{r['backend']}: " + ", ".join(f"{t:.2f}" for t in r["warm"]["passes_total_s"]) for r in ok))
    out.append("")
    per = {r["backend"]: (r["cold"]["per_length_s"], r["warm"]["per_length_s"]) for r in ok}
    out.append("per length, cold / warm s: " + "; ".join(
        f"{b}: " + ", ".join(f"{L} {c[str(L)]:.2f}/{w[str(L)]:.2f}" for L in lengths) for b, (c, w) in per.items()))
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--backends", default="mok,grouped_mm", help="experts implementations, the first is the reference")
    p.add_argument("--lengths", default="37,101,260,515,1030", help="prompt lengths, in order")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--warm-passes", type=int, default=3,
                   help="timed passes over the seen lengths (warm: the median one)")
    p.add_argument("--warmup-len", type=int, default=16, help="prompt length of the untimed first generate (0: none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke runs)")
    p.add_argument("--child-cache", default="fresh", choices=("fresh", "shared"),
                   help="an empty Triton cache per backend process (fresh) or the user's (shared)")
    p.add_argument("--hf-decode-switch", default="off", choices=("off", "on"),
                   help="transformers' grouped_mm -> batched_mm switch for decoding inside generate()")
    p.add_argument("--no-cudnn-attention", action="store_true",
                   help="turn PyTorch's cuDNN attention backend off (it builds a plan per new sequence length)")
    p.add_argument("--static-cache", action="store_true",
                   help="generate with a static KV cache (on a GPU transformers then compiles the decoding forward)")
    p.add_argument("--profile-new-length", type=int, default=0,
                   help="after the timed runs, profile one generate() at this new prompt length against the same "
                        "call again (hot_ops in the JSON: the ops whose host time grew most)")
    p.add_argument("--child-timeout", type=int, default=900)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.device == "cpu" and not a.child and not a.tiny:
        p.error("the model-sized run on the CPU: the timings need a CUDA GPU (--tiny is the CPU smoke run)")
    a.lengths = [int(x) for x in a.lengths.split(",")]
    if a.warm_passes < 1:
        p.error("--warm-passes: at least 1")
    if a.child:
        return child(a)
    os.makedirs(a.out, exist_ok=True)
    logf = open(os.path.join(a.out, "generate_hf.log"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    meta = dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", model=TINY if a.tiny else MODEL,
                lengths=a.lengths, cudnn_attention=not a.no_cudnn_attention, static_cache=a.static_cache,
                max_new_tokens=a.max_new_tokens,
                warmup_len=a.warmup_len, child_cache=a.child_cache,
                env_options={k: v for k, v in os.environ.items() if k.startswith("MOK_")},
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    log(json.dumps(meta))
    rows = []
    for b in a.backends.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", b, "--lengths", ",".join(map(str, a.lengths)),
               "--max-new-tokens", str(a.max_new_tokens), "--warm-passes", str(a.warm_passes),
               "--warmup-len", str(a.warmup_len), "--device", a.device,
               "--hf-decode-switch", a.hf_decode_switch, "--profile-new-length", str(a.profile_new_length)] + (
                   ["--tiny"] if a.tiny else []) + (["--no-cudnn-attention"] if a.no_cudnn_attention else []) + (
                   ["--static-cache"] if a.static_cache else [])
        env = dict(os.environ)
        tmp = tempfile.mkdtemp(prefix="mok-generate-triton-") if a.child_cache == "fresh" else None
        if tmp:
            env["TRITON_CACHE_DIR"] = tmp
        log(f"== {b}")
        t0 = time.time()
        try:
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.child_timeout)
            if res.returncode != 0:
                raise RuntimeError(f"exit {res.returncode}: {res.stderr.strip()[-2000:]}")
            row = json.loads(res.stdout.strip().splitlines()[-1])
        except Exception as e:  # noqa: BLE001 - recorded, the other backends still run
            row = dict(backend=b, error=f"{type(e).__name__}: {str(e)[-2000:]}")
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        row["process_s"] = time.time() - t0
        log(f"  {json.dumps({k: v for k, v in row.items() if k != 'tokens'})}")
        rows.append(row)
    ref = rows[0]
    for r in rows:
        if "error" not in r and "error" not in ref:
            r["agreement"] = agreement(ref["tokens"], r["tokens"])
            r["same_weights_as_first"] = r["checksum"] == ref["checksum"]
            log(f"  {r['backend']}: leading tokens equal to {ref['backend']} per length {r['agreement']}, "
                f"same weights {r['same_weights_as_first']}, cold == warm tokens {r['same_tokens_cold_warm']}")
    with open(os.path.join(a.out, "generate_hf.json"), "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    log(table(rows, a.lengths, a.max_new_tokens))


if __name__ == "__main__":
    main()
