"""`mok_inductor.MoE`, the nn.Module: forward and every gradient against an independent float64 computation
(the router written out here, the layer by tests/oracle.py), Hugging Face's Qwen2-MoE and Qwen3-MoE sparse
blocks after loading their state dicts, the per-expert checkpoint layouts, deferred (meta-device) init,
activation checkpointing, deepcopy, state-dict round trips, torch.compile(fullgraph=True), torch.autocast, the
Triton kernels under the interpreter, and FSDP2 (fully_shard over gloo, 2 CPU ranks) against one process.

Shapes are tiny: H=16, I=8, Is=12, E=6, K=2 unless a test says otherwise. Seeds are fixed per test, as in
tests/_helpers.py (docs there say why).

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E experts, K routes per token.
"""

import copy
import datetime
import gc
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint

import mok_inductor
from _helpers import assert_close_to_oracle, gloo_threads, rel_err
from oracle import oracle_moe

H, I, IS, E, K = 16, 8, 12, 6, 2


def _module(seed=0, **kw) -> mok_inductor.MoE:
    torch.manual_seed(seed)
    args = dict(shared_intermediate_size=IS, shared_expert_gate=True)
    args.update(kw)
    return mok_inductor.MoE(H, I, E, K, **args)


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _oracle(m: mok_inductor.MoE, x, dy, top_experts):
    """(y, {name: grad}) in float64 of the module's computation on x, routed to the module's own picks
    `top_experts`: the router (logits, softmax, the picked probabilities, renormalised when the module says so)
    written out here, the layer by tests/oracle.py; gradients by autograd. Keyed as named_parameters, plus "x"."""
    params = {n: p.detach().double().requires_grad_(True) for n, p in m.named_parameters()}
    x64 = x.detach().double().requires_grad_(True)
    x_TH = x64.reshape(-1, m.hidden_size)
    te_TK = top_experts.reshape(-1, m.top_k)
    probs_TE = torch.softmax(x_TH @ params["gate.weight"].T, dim=-1)
    rw_TK = probs_TE.gather(1, te_TK)
    if m.norm_topk_prob:
        rw_TK = rw_TK / rw_TK.sum(dim=1, keepdim=True)
    y = oracle_moe(x_TH, rw_TK, te_TK, params["experts.gate_up_proj"], params["experts.down_proj"],
                   params.get("shared_expert.gate_up_proj"), params.get("shared_expert.down_proj"),
                   params.get("shared_expert_gate.weight"), m.swiglu_limit, activation=m.activation,
                   gate_up_bias=params.get("experts.gate_up_proj_bias"),
                   down_bias=params.get("experts.down_proj_bias")).reshape(x.shape)
    y.backward(dy.double())
    return y.detach(), {"x": x64.grad, **{n: p.grad for n, p in params.items()}}


def _run(m, x, dy, *routing, fn=None):
    """(y, {name: grad}) of the module (called as `fn`, e.g. compiled, when given) on a fresh leaf copy of x,
    keyed as `_oracle`'s."""
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = (m if fn is None else fn)(x, *routing)
    y.backward(dy)
    return y.detach(), {"x": x.grad, **{n: p.grad for n, p in m.named_parameters()}}


# ---------------------------------------------------------------------------------------------- the computation


@pytest.mark.parametrize("config", [
    # shared expert with its output gate and the clamp (Qwen2-MoE with a limit), 3-D input
    dict(dtype=torch.float32, lead=(2, 5), kw=dict(swiglu_limit=0.7)),
    # no shared expert, no renormalisation (HF's Qwen2/Qwen3-MoE config default), K = 3, 2-D input
    dict(dtype=torch.float32, lead=(9,), kw=dict(shared_intermediate_size=0, shared_expert_gate=False,
                                                  norm_topk_prob=False), top_k=3),
    # bfloat16 parameters and input, shared expert without its gate
    dict(dtype=torch.bfloat16, lead=(3, 4), kw=dict(shared_expert_gate=False)),
    # GPT-OSS's experts: its activation and the routed biases (no shared expert), float32 and bfloat16
    dict(dtype=torch.float32, lead=(11,), kw=dict(shared_intermediate_size=0, shared_expert_gate=False,
                                                   activation="gpt_oss", expert_bias=True, swiglu_limit=0.9)),
    dict(dtype=torch.bfloat16, lead=(2, 6), kw=dict(shared_intermediate_size=0, shared_expert_gate=False,
                                                     activation="gpt_oss", expert_bias=True)),
])
def test_forward_and_gradients_match_float64(config):
    dtype, lead = config["dtype"], config["lead"]
    top_k = config.get("top_k", K)
    torch.manual_seed(1)
    m = mok_inductor.MoE(H, I, E, top_k, **{**dict(shared_intermediate_size=IS, shared_expert_gate=True),
                                             **config["kw"]}, dtype=dtype)
    x = _randn(*lead, H, seed=2, dtype=dtype)
    dy = _randn(*lead, H, seed=3, dtype=dtype)
    logits, rw, te = m.route(x)
    assert logits.shape == (*lead, E) and logits.dtype == dtype
    assert rw.shape == te.shape == (*lead, top_k) and rw.dtype == torch.float32 and te.dtype == torch.int64
    # the picks are K distinct experts with the largest float64 probabilities (up to the rounding of the logits)
    probs = torch.softmax(x.double() @ m.gate.weight.detach().double().T, dim=-1)
    te_flat = te.reshape(-1, top_k)
    assert all(len(set(row.tolist())) == top_k for row in te_flat)
    picked = probs.reshape(-1, E).gather(1, te_flat)
    others = probs.reshape(-1, E).scatter(1, te_flat, -1.0)
    slack = 1e-6 if dtype == torch.float32 else 2e-2
    assert (picked.min(1).values >= others.max(1).values - slack).all()
    y, grads = _run(m, x, dy)
    y_ref, grads_ref = _oracle(m, x, dy, te)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close_to_oracle("y", y, y_ref, dtype)
    assert set(grads) == set(grads_ref)
    for n, g in grads.items():
        assert g is not None and g.dtype == dtype, n
        assert_close_to_oracle(f"d {n}", g, grads_ref[n], dtype)


def test_routing_given_by_the_caller():
    """router=False: no router parameter, the routing comes in (with -1 routes); the result is exactly that of
    mok_inductor.moe on the module's weights. With a router, explicit routing overrides it: route() then
    forward(x, w, ids) is bitwise forward(x)."""
    torch.manual_seed(4)
    m = mok_inductor.MoE(H, I, E, K, router=False, shared_intermediate_size=IS, swiglu_limit=1.5)
    assert "gate.weight" not in m.state_dict() and m.gate is None
    x = _randn(7, H, seed=5)
    rw = torch.rand(7, K, generator=torch.Generator().manual_seed(6)) + 0.1
    te = torch.randint(-1, E, (7, K), generator=torch.Generator().manual_seed(7))
    y = m(x, rw, te)
    expected = mok_inductor.moe(x, rw, te, m.experts.gate_up_proj, m.experts.down_proj,
                                shared_gate_up_proj=m.shared_expert.gate_up_proj,
                                shared_down_proj=m.shared_expert.down_proj, swiglu_limit=1.5)
    assert torch.equal(y, expected)
    with pytest.raises(ValueError, match="no router"):
        m(x)
    with pytest.raises(ValueError, match="no router"):
        m.route(x)

    routed = _module(seed=8)
    x = _randn(2, 3, H, seed=9)
    _, rw, te = routed.route(x)
    assert torch.equal(routed(x, rw, te), routed(x))
    assert routed(x[:0]).shape == (0, 3, H)  # no tokens: an empty result, as mok_inductor.moe gives


@pytest.mark.parametrize("make,error,match", [
    (lambda: mok_inductor.MoE(H, I, 4, 5), ValueError, "^top_k: expected at most num_experts"),
    (lambda: mok_inductor.MoE(H, I, E, 0), ValueError, "^top_k: expected an int >= 1"),
    (lambda: mok_inductor.MoE(H, 8.0, E, K), TypeError, "^intermediate_size: expected an int"),
    (lambda: mok_inductor.MoE(H, I, E, K, shared_expert_gate=True), ValueError, "^shared_expert_gate: .* needs a "),
    (lambda: mok_inductor.MoE(H, I, E, K, dtype=torch.float64), TypeError, "^dtype: expected one of"),
    (lambda: mok_inductor.MoE(H, I, E, K, swiglu_limit=-1.0), ValueError, "^swiglu_limit: expected a finite"),
    (lambda: mok_inductor.MoE(H, I, E, K, activation="gelu"), ValueError, "^activation: expected one of"),
    (lambda: mok_inductor.MoE(H, I, E, K, shared_intermediate_size=IS, expert_bias=True), ValueError,
     "^expert_bias: routed biases are not taken together with a shared expert"),
    (lambda: _module()(torch.randn(3, H + 1)), ValueError, r"^x: expected shape \[\.\.\., 16\]"),
    (lambda: _module()(torch.randn(H)), ValueError, r"^x: expected shape \[\.\.\., 16\]"),
    (lambda: _module()(torch.randn(3, H), torch.rand(3, K)), ValueError, "^top_experts: router_weights was given"),
    (lambda: _module()(torch.randn(3, H), None, torch.zeros(3, K, dtype=torch.long)), ValueError,
     "^router_weights: top_experts was given"),
    (lambda: _module()(torch.randn(3, H), torch.rand(3, K + 1), torch.zeros(3, K + 1, dtype=torch.long)),
     ValueError, r"^router_weights: expected shape \[\.\.\., top_k=2\]"),
    (lambda: _module()(torch.randn(3, H, dtype=torch.bfloat16)), TypeError,
     r"^x: expected dtype float32 \(the module's parameters'\), got bfloat16$"),
    (lambda: _module(router=False)(torch.randn(3, H, dtype=torch.bfloat16), torch.rand(3, K),
                                   torch.zeros(3, K, dtype=torch.long)), TypeError, "^x: expected dtype float32"),
])
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_autocast():
    """float32 parameters under torch.autocast(bfloat16), x in float32 or already in bfloat16 (the output of an
    autocast Linear): the router's Linear and the op compute in bfloat16, within the bfloat16 contract of the
    float32 layer's float64 result; the parameters' gradients stay float32."""
    m = _module(seed=33, swiglu_limit=1.0)
    x = _randn(3, 5, H, seed=34)
    dy = _randn(3, 5, H, seed=35)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _, te = m.route(x)
        y, grads = _run(m, x, dy)
        y_bf16 = m(x.bfloat16())
    assert logits.dtype == y.dtype == torch.bfloat16
    assert torch.equal(y_bf16, y)
    y_ref, grads_ref = _oracle(m, x, dy, te)
    assert_close_to_oracle("y", y, y_ref, torch.bfloat16)
    for n, g in grads.items():
        assert g.dtype == torch.float32, n
        assert_close_to_oracle(f"d {n}", g, grads_ref[n], torch.bfloat16)


# ---------------------------------------------------------------------------------------------- Hugging Face


def _hf_block(kind: str, norm_topk_prob: bool, seed: int):
    """A transformers Qwen2-MoE (shared expert with its gate) or Qwen3-MoE sparse block with random weights
    (its routed experts run transformers' eager loop)."""
    if kind == "qwen2":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=IS,
                             num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=norm_topk_prob)
    cfg._experts_implementation = "eager"
    block = Block(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():  # the router's weight is created as zeros: every parameter is drawn
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return block


@pytest.mark.parametrize("kind,norm_topk_prob", [("qwen2", False), ("qwen2", True), ("qwen3", True)])
def test_matches_hugging_face_block_after_loading_its_state_dict(kind, norm_topk_prob):
    """Loading the HF block's state dict (strict: every key used, none missing) gives the same layer: the
    output and every gradient agree (the shared expert's HF gate_proj/up_proj gradients are the rows of our
    fused one's)."""
    block = _hf_block(kind, norm_topk_prob, seed=10)
    shared = kind == "qwen2"
    torch.manual_seed(11)
    m = mok_inductor.MoE(H, I, E, K, shared_intermediate_size=IS if shared else 0, shared_expert_gate=shared,
                         norm_topk_prob=norm_topk_prob)
    m.load_state_dict(block.state_dict(), strict=True)
    x = _randn(2, 5, H, seed=12)
    dy = _randn(2, 5, H, seed=13)
    y, grads = _run(m, x, dy)
    xh = x.clone().requires_grad_(True)
    y_hf = block(xh)
    y_hf.backward(dy)
    hf = {n: p.grad for n, p in block.named_parameters()}
    assert_close_to_oracle("y vs HF", y, y_hf.detach(), torch.float32)
    assert_close_to_oracle("d x vs HF", grads["x"], xh.grad, torch.float32)
    for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj") + (
            ("shared_expert.down_proj", "shared_expert_gate.weight") if shared else ()):
        assert_close_to_oracle(f"d {n} vs HF", grads[n], hf[n if n in hf else n + ".weight"], torch.float32)
    if shared:
        fused = torch.cat([hf["shared_expert.gate_proj.weight"], hf["shared_expert.up_proj.weight"]])
        assert_close_to_oracle("d shared_expert.gate_up_proj vs HF", grads["shared_expert.gate_up_proj"], fused,
                               torch.float32)


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_per_expert_checkpoint_keys_are_stacked_on_load(names):
    """Hub checkpoints store one Linear per expert (`experts.{e}.gate_proj.weight`, or Mixtral's w1/w3/w2):
    load_state_dict stacks them into the fused tensors; an incomplete set is reported, not guessed at."""
    src = _module(seed=14)
    gate_n, up_n, down_n = names
    sd = {k: v for k, v in src.state_dict().items() if not k.startswith("experts.")}
    for e in range(E):
        sd[f"experts.{e}.{gate_n}.weight"] = src.experts.gate_up_proj[e, :I].detach().clone()
        sd[f"experts.{e}.{up_n}.weight"] = src.experts.gate_up_proj[e, I:].detach().clone()
        sd[f"experts.{e}.{down_n}.weight"] = src.experts.down_proj[e].detach().clone()
    dst = _module(seed=15)
    dst.load_state_dict(sd, strict=True)
    for (n, p), q in zip(dst.named_parameters(), src.parameters()):
        assert torch.equal(p, q), n
    del sd[f"experts.{E - 1}.{down_n}.weight"]
    with pytest.raises(RuntimeError, match="Missing key.*experts.gate_up_proj"):
        _module(seed=15).load_state_dict(sd, strict=True)


# ---------------------------------------------------------------------------------------------- nn.Module habits


def _assert_init_bounds(m: mok_inductor.MoE) -> None:
    """Every parameter as nn.Linear initialises a weight of its fan-in (the last dim here): uniform in
    +-1/sqrt(fan_in), the routed biases their weight's; on tensors of a few hundred elements, the spread of a
    uniform too."""
    fan_in = {"experts.gate_up_proj_bias": H, "experts.down_proj_bias": m.intermediate_size}
    for n, p in m.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        bound = fan_in.get(n, p.shape[-1]) ** -0.5
        assert p.abs().max() <= bound, n
        if p.numel() >= 256:
            assert abs(p.double().std().item() / (bound / 3 ** 0.5) - 1) < 0.15, n
            assert p.abs().max() > 0.9 * bound, n


@pytest.mark.parametrize("kw", [dict(shared_intermediate_size=IS, shared_expert_gate=True, swiglu_limit=2.0),
                                dict(activation="gpt_oss", expert_bias=True)], ids=["shared", "gpt_oss"])
def test_meta_init_then_to_empty_and_reset_parameters(kw):
    """Deferred init (how FSDP2 builds big models): built on the meta device, materialised with to_empty, then
    reset_parameters gives the parameters that building on the CPU under the same seed gives."""
    with torch.device("meta"):
        m = mok_inductor.MoE(H, I, E, K, **kw)
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device="cpu")
    torch.manual_seed(16)
    m.reset_parameters()
    torch.manual_seed(16)
    ref = mok_inductor.MoE(H, I, E, K, **kw)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    _assert_init_bounds(m)
    # resetting every submodule that has reset_parameters (what some training loops do) keeps the same rule
    for sub in m.modules():
        if sub is not m and hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    _assert_init_bounds(m)


def test_state_dict_round_trip_and_deepcopy():
    src = _module(seed=17, swiglu_limit=1.0)
    x = _randn(4, 3, H, seed=18)
    dy = _randn(4, 3, H, seed=19)
    y, grads = _run(src, x, dy)
    dst = _module(seed=20, swiglu_limit=1.0)
    dst.load_state_dict(src.state_dict(), strict=True)
    clone = copy.deepcopy(src)
    for other in (dst, clone):
        y2, grads2 = _run(other, x, dy)
        assert torch.equal(y, y2)
        assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    with torch.no_grad():
        clone.experts.down_proj.mul_(2)  # the copy owns its parameters
    assert torch.equal(src(x), y)


def test_activation_checkpointing_recomputes_the_same():
    """torch.utils.checkpoint recomputes the forward in the backward: routing and the op are deterministic, so
    the gradients are bitwise those without checkpointing."""
    m = _module(seed=21, swiglu_limit=1.0)
    x = _randn(2, 6, H, seed=22)
    dy = _randn(2, 6, H, seed=23)
    y, grads = _run(m, x, dy)
    m.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_(True)
    yc = torch.utils.checkpoint.checkpoint(m, xc, use_reentrant=False)
    yc.backward(dy)
    assert torch.equal(yc.detach(), y)
    assert torch.equal(xc.grad, grads["x"])
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def test_torch_compile_fullgraph():
    """The whole module (router, top-k, the op, its backward) traces into one graph."""
    m = _module(seed=24, swiglu_limit=1.0)
    x = _randn(3, 5, H, seed=25)
    dy = _randn(3, 5, H, seed=26)
    y, grads = _run(m, x, dy)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    y2, grads2 = _run(m, x, dy, fn=compiled)
    assert rel_err(y2, y) <= 1e-6
    for n in grads:
        assert rel_err(grads2[n], grads[n]) <= 1e-6, n


def test_triton_kernels_under_the_interpreter():
    """backend="triton": the module's call runs the Triton kernels (the interpreter on CPU tensors)."""
    torch.manual_seed(27)
    m = mok_inductor.MoE(32, 16, 5, 2, shared_intermediate_size=24, shared_expert_gate=True, swiglu_limit=1.0)
    x = _randn(9, 32, seed=28)
    dy = _randn(9, 32, seed=29)
    if torch.cuda.is_available():  # (the kernels take CPU tensors only under the interpreter)
        m, x, dy = m.cuda(), x.cuda(), dy.cuda()
    with mok_inductor.options.override(backend="triton"):
        assert mok_inductor.path_name(x) == "triton"
        y, grads = _run(m, x, dy)
    m, x, dy, y = m.cpu(), x.cpu(), dy.cpu(), y.cpu()
    grads = {n: g.cpu() for n, g in grads.items()}
    y_ref, grads_ref = _oracle(m, x, dy, m.route(x)[2])
    assert_close_to_oracle("y", y, y_ref, torch.float32)
    for n, g in grads.items():
        assert_close_to_oracle(f"d {n}", g, grads_ref[n], torch.float32)


# ---------------------------------------------------------------------------------------------- FSDP2


def _fsdp_worker(rank, world, init_file):
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        _fsdp_case(rank, world, fully_shard)
    except Exception as exc:
        raise AssertionError(f"rank {rank}/{world}: {exc}\n{traceback.format_exc()}") from exc
    finally:
        gc.collect()
        # DTensor's sharding-propagation cache keeps the specs of the sharded parameters that reset_parameters
        # ran on, and through their device mesh the process group and its gloo threads, past
        # destroy_process_group (see test_distributed)
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
        dist.destroy_process_group()
    gc.collect()
    assert not gloo_threads(), f"rank {rank}: gloo threads alive after destroy_process_group"


def _shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of t as FSDP2 shards a parameter: torch.chunk over dim 0 (a rank past the last chunk
    holds none)."""
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank] if rank < len(chunks) else t[:0]


def _fsdp_case(rank, world, fully_shard):
    """Built on meta, sharded, materialised and reset (the init rule holds on the shards), then given the
    reference's weights: each rank's output is the one-process module's on its tokens, and the reduced
    gradients are the one-process gradients of the mean of the ranks' losses. (Shards are read and written
    through to_local(), so the test runs no DTensor collective of its own.)"""
    kw = dict(shared_intermediate_size=IS, shared_expert_gate=True, swiglu_limit=1.0)
    with torch.device("meta"):
        m = mok_inductor.MoE(H, I, E, K, **kw)
    fully_shard(m)
    m.to_empty(device="cpu")
    m.reset_parameters()
    for n, p in m.named_parameters():  # to_empty left garbage: every shard drawn from the init's uniform
        local, bound = p.to_local(), p.shape[-1] ** -0.5
        assert (local.abs() <= bound).all(), n
        assert local.numel() < 16 or local.std() > 0.5 * bound / 3 ** 0.5, n
    torch.manual_seed(30)  # the same reference module and global batch on every rank
    ref = mok_inductor.MoE(H, I, E, K, **kw)
    with torch.no_grad():
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            p.to_local().copy_(_shard(q, rank, world))
    T = [5, 8][:world]  # uneven token counts
    x_all = _randn(sum(T), H, seed=31)
    dy_all = _randn(sum(T), H, seed=32)
    rows = slice(sum(T[:rank]), sum(T[:rank + 1]))
    y, grads = _run(m, x_all[rows], dy_all[rows])
    y_ref, grads_ref = _run(ref, x_all, dy_all)
    assert rel_err(y, y_ref[rows]) <= 1e-6
    assert rel_err(grads["x"], grads_ref["x"][rows]) <= 1e-6
    for n, g in grads.items():
        if n != "x":  # FSDP2 averages the ranks' gradients
            assert rel_err(g.to_local(), _shard(grads_ref[n], rank, world) / world) <= 1e-6, n


def test_fsdp2_fully_shard_over_gloo(tmp_path):
    """Two CPU ranks over gloo (`_fsdp_case`): FSDP2's deferred init, sharded forward and reduced gradients."""
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "pg_init")), nprocs=2, join=True)
