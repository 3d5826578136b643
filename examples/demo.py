"""The demo: one MoE layer with a gated shared expert through `mok_inductor.moe`.

Runs the layer eagerly and under torch.compile, forward and backward, prints which implementation ran
(the Triton kernels on CUDA, the CPU implementation otherwise), the relative error of the output and of
every gradient against a float64 run of the package's reference on the CPU, the time of the first call
(which compiles) beside the steady-state time of later calls, and what Dynamo captured: one graph, no
graph break, the `mok::` op inside.
"""

import argparse
import statistics
import time

import torch

import mok_inductor
from mok_inductor import reference
from mok_inductor.types import split_gate_up


def make_layer(T, H, I, Is, E, K, dtype, device, generator):
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    logits = torch.randn(T, E, generator=generator)
    router_weights, top_experts = torch.topk(logits.softmax(-1), K)
    router_weights = router_weights / router_weights.sum(-1, keepdim=True)
    top_experts[0, -1] = -1  # a missing route: contributes nothing
    return dict(
        x=rnd(T, H),
        router_weights=router_weights.to(device),
        top_experts=top_experts.to(torch.int32).to(device),
        gate_up_proj=rnd(E, 2 * I, H, scale=H**-0.5),
        down_proj=rnd(E, H, I, scale=I**-0.5),
        shared_gate_up_proj=rnd(2 * Is, H, scale=H**-0.5),
        shared_down_proj=rnd(H, Is, scale=Is**-0.5),
        shared_output_gate=rnd(1, H, scale=H**-0.5),
    )


DIFFERENTIABLE = ("x", "router_weights", "gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj",
                  "shared_output_gate")


def float64_reference(inputs, dy, swiglu_limit):
    """Output and gradients from the package's reference, run in float64 on the CPU."""
    d = {k: v.detach().cpu() for k, v in inputs.items()}
    d = {k: (v.double() if v.is_floating_point() else v) for k, v in d.items()}
    sched = reference.build_schedule(d["top_experts"], d["gate_up_proj"].shape[0])
    wg, wu = split_gate_up(d["gate_up_proj"])
    sg, su = split_gate_up(d["shared_gate_up_proj"])
    args = (d["x"], d["router_weights"], d["top_experts"], sched, wg, wu, d["down_proj"])
    shared = (sg, su, d["shared_down_proj"], d["shared_output_gate"])
    fwd = reference.moe_forward(*args, *shared, swiglu_limit)
    bwd = reference.moe_backward(dy.detach().cpu().double(), *args, fwd.gu_N2I, *shared, fwd.gu_shared_T2Is,
                                 swiglu_limit)
    g = bwd.grads
    grads = dict(
        x=bwd.dx_TH, router_weights=bwd.d_router_weights_TK,
        gate_up_proj=torch.cat([g.d_gate, g.d_up], 1), down_proj=g.d_down,
        shared_gate_up_proj=torch.cat([g.d_s_gate, g.d_s_up], 0), shared_down_proj=g.d_s_down,
        shared_output_gate=g.d_s_out_gate,
    )
    return fwd.y_TH, grads


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run(fn, inputs, dy, swiglu_limit):
    leaves = {k: (v.detach().clone().requires_grad_() if k in DIFFERENTIABLE else v) for k, v in inputs.items()}
    y = fn(**leaves, swiglu_limit=swiglu_limit)
    y.backward(dy)
    return y, {k: leaves[k].grad for k in DIFFERENTIABLE}


def timed(fn, inputs, dy, swiglu_limit, steady_calls):
    """(output, gradients, first-call seconds, steady-state seconds: the median of `steady_calls` later calls),
    each call forward + backward."""
    sync = torch.cuda.synchronize if inputs["x"].is_cuda else (lambda: None)
    times = []
    for _ in range(1 + steady_calls):
        sync()
        t0 = time.perf_counter()
        out = run(fn, inputs, dy, swiglu_limit)
        sync()
        times.append(time.perf_counter() - t0)
    return (*out, times[0], statistics.median(times[1:]))


def what_dynamo_captured(inputs, swiglu_limit):
    """torch._dynamo.explain of the call: the number of graphs and graph breaks, and the mok ops in the graph."""
    ex = torch._dynamo.explain(mok_inductor.moe)(**inputs, swiglu_limit=swiglu_limit)
    ops = sorted({"mok::" + str(n.target).split(".")[1] for g in ex.graphs for n in g.graph.nodes
                  if isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
                  and str(n.target).startswith("mok.")})
    return ex.graph_count, ex.graph_break_count, ops, [str(b.reason) for b in ex.break_reasons]


def fmt_s(t):
    return f"{t:.2f} s" if t >= 0.1 else f"{t * 1e3:.2f} ms"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--shared-intermediate", type=int, default=96)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--swiglu-limit", type=float, default=7.0)
    p.add_argument("--steady-calls", type=int, default=5, help="later calls timed for the steady state (median)")
    p.add_argument("--compile-backend", default="inductor",
                   help='torch.compile backend ("aot_eager" traces the same graphs without code generation)')
    a = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, a.dtype)
    gen = torch.Generator().manual_seed(0)
    inputs = make_layer(a.tokens, a.hidden, a.intermediate, a.shared_intermediate, a.experts, a.topk, dtype,
                        device, gen)
    dy = torch.randn(a.tokens, a.hidden, generator=gen).to(dtype).to(device)
    y_ref, g_ref = float64_reference(inputs, dy, a.swiglu_limit)
    tol = 1e-4 if dtype == torch.float32 else 1e-2

    print(f"mok-inductor {mok_inductor.__version__}, torch {torch.__version__}, device {device}, {a.dtype}")
    print(f"layer: T={a.tokens} H={a.hidden} I={a.intermediate} Is={a.shared_intermediate} E={a.experts} "
          f"K={a.topk}, gated shared expert, swiglu_limit={a.swiglu_limit}")
    print(f"path: {mok_inductor.path_name(inputs['x'])} "
          f"({'Triton kernels' if mok_inductor.path_name(inputs['x']) == 'triton' else 'CPU implementation'})")

    mok_inductor.enable()  # compiled graphs: Inductor copies the Triton kernels into its generated code
    compiled = torch.compile(mok_inductor.moe, fullgraph=True, backend=a.compile_backend)
    worst, times = 0.0, {}
    for name, fn in (("eager", mok_inductor.moe), (f"torch.compile ({a.compile_backend})", compiled)):
        y, grads, first, steady = timed(fn, inputs, dy, a.swiglu_limit, a.steady_calls)
        times[name] = first, steady
        errs = {"output": rel_err(y, y_ref)} | {f"d {k}": rel_err(grads[k], g_ref[k]) for k in DIFFERENTIABLE}
        worst = max(worst, *errs.values())
        print(f"\n{name}: relative error vs float64 reference (tolerance {tol:g})")
        for k, v in errs.items():
            print(f"  {k:<22} {v:.2e}")

    print(f"\ntime per call, forward + backward (steady state: median of {a.steady_calls} later calls)")
    print(f"  {'':<28} {'first call':>12} {'steady state':>14}")
    for name, (first, steady) in times.items():
        print(f"  {name:<28} {fmt_s(first):>12} {fmt_s(steady):>14}")
    print("  (the compiled first call includes tracing and compiling the forward and backward graphs)")

    graphs, breaks, ops, reasons = what_dynamo_captured(inputs, a.swiglu_limit)
    print(f"\ntorch._dynamo.explain(mok_inductor.moe): {graphs} graph{'s' * (graphs != 1)}, {breaks} graph breaks, "
          f"mok ops in the graph: {', '.join(ops) or 'none'}")
    for r in reasons:
        print(f"  graph break: {r}")
    ok = worst <= tol and graphs == 1 and breaks == 0 and ops
    print(f"\n{'OK' if ok else 'FAILED'}: worst relative error {worst:.2e}"
          f"{'' if graphs == 1 and breaks == 0 and ops else '; the call did not compile to one graph holding mok ops'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
