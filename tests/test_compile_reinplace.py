"""Under torch.compile our kernels become `triton_kernel_wrapper_functional` nodes, and Inductor's reinplacing
pass turns each back into an in-place launch unless the tensors it writes cannot be reused; the rest it
clones (and scatters back into their base when they are views). A kernel that writes two views of one
gradient buffer was such a case: the paired gate/up weight gradient cost three extra copies of the
[E, 2I, H] gradient per compiled backward, which made the compiled layer slower than eager.

The probe traces the schedule, forward and backward ops the way AOTAutograd does (fake tensors, functional
mode) into the kernels' graph, runs Inductor's reinplacing pass on it and reports what is still copied. It
needs no GPU: without CUDA it stands fake CPU tensors in for CUDA ones and tells Triton an sm_90 target, so
the same kernels are traced (not the interpreter). It runs in a subprocess, outside the interpreter mode
that tests/conftest.py sets."""

import json
import os
import subprocess
import sys

import pytest
import torch

T, H, I, E, K, IS = 48, 64, 96, 4, 2, 32
# torch's mutation analysis of _schedule_scatter_kernel marks the routing ids as written (a store address is
# computed from them), so they are copied once: T*K int32
ALLOWED = {("_schedule_scatter_kernel", "te_ptr")}


def _probe(variant: str) -> dict:
    shared, mx = variant in ("shared", "mxfp8", "mxfp8-decode"), variant.startswith("mxfp8")
    hf = variant == "gpt-oss-hf"
    T, H, I = (8, 128, 128) if variant == "mxfp8-decode" else (globals()["T"], globals()["H"], globals()["I"])
    import copy

    import _sm90_standin

    _sm90_standin.install()  # (no tile-config tables: the configs reported do not depend on the machine's)
    from torch._functorch.aot_autograd import aot_export_module
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    hop = torch.ops.higher_order.triton_kernel_wrapper_functional
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    class Layer(torch.nn.Module):
        def forward(self, x, rw, te, gu, d, dy, sgu, sd, sg, *q):
            if not shared:
                sgu = sd = sg = None
            s, o, slots = torch.ops.mok.schedule(te, E)
            if mx:  # MXFP8 routed weights (row-wise and column-wise data + scales), bf16 masters
                gq, gqs, gqt, gqst, dq, dqs, dqt, dqst = q
                y, g, gs = torch.ops.mok.moe_fwd(x, rw, te, s, o, slots, gq, dq, sgu, sd, sg, 0.75, gqs, gqt, gqst,
                                                 dqs, dqt, dqst, gu, d)
                return (y, *torch.ops.mok.moe_bwd(dy, x, rw, te, s, o, slots, gq, dq, sgu, sd, sg, g, gs, 0.75, gqs,
                                                  gqt, gqst, dqs, dqt, dqst, True, True))
            if hf:  # GPT-OSS's checkpoint layout: gu [E, H, 2I] with gate/up interleaved, down [E, I, H]
                gu, d = gu.view(E, H, I, 2).permute(0, 3, 2, 1), d.transpose(1, 2)
                b1, b2 = q[0].view(E, I, 2).transpose(1, 2), q[1]  # (the gate/up bias interleaved likewise)
                y, g, gs = torch.ops.mok.moe_fwd(x, rw, te, s, o, slots, gu, d, None, None, None, 7.0, *([None] * 8),
                                                 "gpt_oss", b1, b2)
                return (y, *torch.ops.mok.moe_bwd(dy, x, rw, te, s, o, slots, gu, d, None, None, None, g, gs, 7.0,
                                                  *([None] * 6), True, True, "gpt_oss", b1, b2))
            y, g, gs = torch.ops.mok.moe_fwd(x, rw, te, s, o, slots, gu, d, sgu, sd, sg, 0.75)
            return (y, *torch.ops.mok.moe_bwd(dy, x, rw, te, s, o, slots, gu, d, sgu, sd, sg, g, gs, 0.75))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        bf = dict(device=dev, dtype=torch.bfloat16)
        args = (torch.randn(T, H, **bf), torch.rand(T, K, device=dev), torch.randint(0, E, (T, K), device=dev,
                dtype=torch.int32), torch.randn(E, 2 * I, H, **bf) if not hf else torch.randn(E, H, 2 * I, **bf),
                torch.randn(E, H, I, **bf) if not hf else torch.randn(E, I, H, **bf), torch.randn(T, H, **bf),
                torch.randn(2 * IS, H, **bf), torch.randn(H, IS, **bf), torch.randn(1, H, **bf))
        if hf:
            args += (torch.randn(E, 2 * I, **bf), torch.randn(E, H, **bf))
        if mx:
            f8, u8 = dict(device=dev, dtype=torch.float8_e4m3fn), dict(device=dev, dtype=torch.uint8)
            args += tuple(torch.empty(*shape, **(u8 if scale else f8)) for shape, scale in (
                ((E, 2 * I, H), 0), ((E, 2 * I, H // 32), 1), ((E, H, 2 * I), 0), ((E, H, 2 * I // 32), 1),
                ((E, H, I), 0), ((E, H, I // 32), 1), ((E, I, H), 0), ((E, I, H // 32), 1)))
        gm, _ = aot_export_module(Layer(), args, trace_joint=False)
    kernels = sum(1 for n in gm.graph.nodes if n.target is hop)
    gm = copy.deepcopy(gm)
    _sm90_standin.reinplace(gm, mode)

    def name(n):
        k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        while not hasattr(k, "__name__") and hasattr(k, "fn"):
            k = k.fn
        return getattr(k, "__name__", str(k))

    clones = [[name(n), a] for n in gm.graph.nodes if n.target is hop for a in n.kwargs.get("tensors_to_clone", [])]
    scatters = [str(n.target) for n in gm.graph.nodes if "scatter" in str(n.target) or "copy_" in str(n.target)]
    mx_launches = []  # the MXFP8 K loops' launches: kernel, mode, the tile configs handed to Inductor
    for n in gm.graph.nodes:
        if n.target is hop:
            consts = n.kwargs["kwargs"]  # (the launch's arguments; the constexprs among them as values)
            if consts.get("MX_LOOP"):
                # a launch at one config passes BLOCK_* as constexpr arguments and num_warps/num_stages, which
                # wrap_triton turns into a one-config autotuner (a Config without BLOCK_*); under max-autotune
                # the family's autotuner holds every candidate, BLOCK_* in its Configs
                k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
                tiles = [[c.kwargs.get(b, consts.get(b)) for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K")]
                         + [c.num_warps, c.num_stages] for c in getattr(k, "configs", ())]
                mx_launches.append([name(n), consts["MX_LOOP"], tiles])
    return dict(kernels=kernels, clones=clones, scatters=scatters, mx=mx_launches)


def _run_probe(variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, "--probe", variant], env=env, capture_output=True,
                         text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", ["routed", "shared", "mxfp8", "gpt-oss-hf"])
def test_compiled_backward_writes_its_gradients_in_place(variant):
    # routed experts alone; with the shared expert, its output gate and the clamp; MXFP8 routed weights; GPT-OSS
    # in its checkpoint layout (gate/up interleaved: the backward writes the gradient as one interleaved buffer)
    got = _run_probe(variant)
    assert got["kernels"] >= 8, got  # the schedule, forward and backward launches were traced
    left = [tuple(c) for c in got["clones"] if tuple(c) not in ALLOWED]
    assert left == [], f"outputs Inductor would copy after reinplacing: {left}"
    assert got["scatters"] == [], f"copies back into a base tensor: {got['scatters']}"


def test_compiled_mxfp8_decode_reads_scale_words_on_8_row_tiles():
    # MXFP8 at decode sizes (4 routes per expert, rows scaled once): traced, the forward's K loops read the
    # scales by words (their offsets aligned: operands.scale_words) on the 8-row configs (without a table, the
    # MXFP8 families' `small` tiles at up to options.mx_few_rows routes per expert), each whole K step as one
    # dot (mx_loop.MxLoop.F16_WORDS), the backward's dx GEMM likewise; the graph still reinplaces as the other
    # variants
    from mok_inductor.kernels.mx_loop import MxLoop

    got = _run_probe("mxfp8-decode")
    words = int(MxLoop.F16_WORDS)
    assert got["mx"] == [["_gate_up_kernel", words, [[8, 32, 256, 2, 3]]],
                         ["_grouped_rows_kernel", words, [[8, 32, 128, 1, 4]]],
                         ["_grouped_rows_kernel", words, [[8, 32, 128, 1, 4]]]], got["mx"]
    assert [tuple(c) for c in got["clones"] if tuple(c) not in ALLOWED] == [] and got["scatters"] == []


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.getcwd())
    print(json.dumps(_probe(sys.argv[2])))
