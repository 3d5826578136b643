"""The graphs torch.compile makes of "mok" Hugging Face models on CUDA, checked for their numbers on CPU.

On CUDA the mok ops decompose into their Triton launches while AOTAutograd traces (`mok_inductor.lowering.
decompose`): the forward and backward graphs hold the launches, functionalized, partitioned by the min-cut
partitioner and reinplaced by Inductor before Inductor writes its code. Everything up to that code generation
is traced here the same way, with CPU tensors standing in for CUDA ones (`_sm90_standin`), and the graphs are
then run with each launch in Triton's interpreter: the loss and every parameter's gradient must equal eager
Hugging Face (float32, 1e-4). What the views, aliasing and in-place rewrites of compilation do to the kernels'
operands and destinations (GPT-OSS's interleaved gate/up weight and bias above all) is checked this way in CI;
Inductor's code generation itself runs on the GPU only (tests/test_transformers.py's CUDA tests).

Runs in a subprocess: without TRITON_INTERPRET at import, so the kernels are traced as for sm_90."""

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(kind: str) -> dict:
    import _sm90_standin
    from _helpers import rel_err

    _sm90_standin.install()
    import test_transformers as tt

    import mok_inductor
    from mok_inductor.integrations import transformers as hf

    hf.register()
    model, loss_fn, ids = tt._model_and_loss(kind)
    ids = ids[:, :16]
    ref_loss, ref = tt._eager_loss_and_grads(model, loss_fn, ids)

    model.set_experts_implementation("mok")
    graphs = []
    torch._dynamo.reset()
    with mok_inductor.enabled():
        compiled = torch.compile(loss_fn, fullgraph=True, backend=_sm90_standin.inductor_like_backend(graphs))
        loss = compiled(ids)
        loss.backward()
    params = dict(model.named_parameters())
    errors = {n: rel_err(params[n].grad, g) if params[n].grad is not None else None for n, g in ref.items()}
    unanalysed = {k: sorted(w - _sm90_standin.ANALYSED_WRITES.get(k, set()))
                  for k, w in _sm90_standin.OBSERVED_WRITES.items()}
    return dict(loss=rel_err(loss, ref_loss), grads=errors, aliased_writes=sorted(set(_sm90_standin.ALIASED_WRITES)),
                analysis_failures=_sm90_standin.ANALYSIS_FAILURES, unanalysed_writes={k: v for k, v in unanalysed.items() if v},
                analysed=sorted(_sm90_standin.ANALYSED_WRITES),
                launches=[g.count("triton_kernel_wrapper") for g in graphs],
                opaque=[op for op in ("mok.moe_fwd", "mok.moe_bwd", "mok.schedule") if any(op in g for g in graphs)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter-only: CPU tensors stand in for CUDA ones on a "
                    "simulated sm_90 target (_sm90_standin), which needs a machine without CUDA; there, "
                    "test_transformers.py's CUDA tests compile these models with Inductor")
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_compiled_cuda_graphs_compute_what_eager_does(kind):
    # qwen3_moe: the routed experts; qwen2_moe: with the shared expert and its gate; gpt_oss: the interleaved
    # gate/up weight and bias of its checkpoint layout, its activation, the expert biases' gradients
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__, "--child", kind], env=env, capture_output=True, text=True,
                         timeout=600, cwd=os.path.dirname(HERE))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got["launches"]) == 2 and min(got["launches"]) >= 4, got["launches"]  # forward and backward, traced
    assert got["opaque"] == [], f"ops left opaque: {got['opaque']}"
    # a launch that writes a tensor it is also given as another argument: Inductor may clone the two apart and
    # keep the unwritten clone (`mok_inductor.kernels.common.launch`)
    assert got["aliased_writes"] == [], got["aliased_writes"]
    # torch's analysis of each launch's code (Inductor's lowering asks it which arguments a kernel writes; where it
    # fails, every argument counts as written) succeeds, and names every argument the launches were seen writing
    assert got["analysis_failures"] == [], got["analysis_failures"]
    assert got["unanalysed_writes"] == {}, got["unanalysed_writes"]
    assert {"_gate_up_kernel", "_bwd_act_body", "_wgrad_body", "_combine_kernel"} <= set(got["analysed"]), got["analysed"]
    assert got["loss"] <= 1e-5, got["loss"]
    assert any(".experts." in n for n in got["grads"])
    bad = {n: e for n, e in got["grads"].items() if e is None or not e <= 1e-4}
    assert not bad, bad


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    sys.path.insert(0, HERE)
    sys.path.insert(0, os.getcwd())
    print(json.dumps(_child(sys.argv[2])))
