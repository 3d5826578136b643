"""Shared helpers of the operator tests: random inputs, the float64 oracle's gradients, error metrics.

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E experts,
K routes per token.

Every tensor is drawn fresh from a seeded generator (never zeros). The seeds are fixed per test, not drawn
per run: at the edge cases' tiny bf16 shapes the contract's relative bound is not attainable for every draw
(d_router_weights at T=1 has two elements, and a draw's cancelling inner products can put even the plain
PyTorch bf16 computation of it above 1e-2). Fresh draws there would need a bound scaled by the inner
products' magnitudes, not by their values. The comparison metric is the relative Frobenius error against
the float64 oracle of `tests/oracle.py` (docs/semantics.md states the bounds: `TOLERANCE`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

import mok_inductor
from oracle import oracle_moe

# The bound on the relative Frobenius error vs the float64 oracle (docs/semantics.md). float16 has more
# mantissa bits than bfloat16, so the bfloat16 bound is a safe bound for it too.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}

# The Triton kernels' device: CUDA where there is one, else the CPU (the interpreter, tests/conftest.py). Tests
# that run backend "triton" build their inputs here: on a GPU machine CPU tensors cannot reach the kernels.
DEV = "cuda" if torch.cuda.is_available() else "cpu"

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]

WEIGHT_NAMES = ("gate_up_proj", "down_proj", "shared_gate_up_proj", "shared_down_proj", "shared_output_gate")
GRAD_NAMES = ("x", "router_weights") + WEIGHT_NAMES


@dataclass
class MoeCase:
    """The arguments of one `mok_inductor.moe` call (x may have leading dims)."""

    x: torch.Tensor
    router_weights: torch.Tensor
    top_experts: torch.Tensor
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    shared_gate_up_proj: Optional[torch.Tensor] = None
    shared_down_proj: Optional[torch.Tensor] = None
    shared_output_gate: Optional[torch.Tensor] = None
    swiglu_limit: Optional[float] = None
    extra: dict = field(default_factory=dict)

    def tensors(self) -> dict:
        """The differentiable inputs by name (absent optional ones left out)."""
        out = {"x": self.x, "router_weights": self.router_weights}
        for name in WEIGHT_NAMES:
            t = getattr(self, name)
            if t is not None:
                out[name] = t
        return out

    def kwargs(self) -> dict:
        return dict(
            shared_gate_up_proj=self.shared_gate_up_proj,
            shared_down_proj=self.shared_down_proj,
            shared_output_gate=self.shared_output_gate,
            swiglu_limit=self.swiglu_limit,
        )

    def args(self) -> tuple:
        return (self.x, self.router_weights, self.top_experts, self.gate_up_proj, self.down_proj)

    def op_args(self) -> tuple:
        """Positional arguments of torch.ops.mok.moe (x must be [T, H])."""
        return self.args() + (self.shared_gate_up_proj, self.shared_down_proj, self.shared_output_gate,
                              self.swiglu_limit)

    def detached(self, requires_grad: bool = True, device=None, dtype=None) -> "MoeCase":
        """A copy with fresh leaf tensors (optionally moved / cast: dtype applies to x and the weights)."""
        def leaf(t, is_float_arg):
            if t is None:
                return None
            t = t.detach()
            if device is not None:
                t = t.to(device)
            if dtype is not None and is_float_arg:
                t = t.to(dtype)
            t = t.clone()
            if t.is_floating_point():
                t.requires_grad_(requires_grad)
            return t

        return MoeCase(
            leaf(self.x, True), leaf(self.router_weights, False), leaf(self.top_experts, False),
            *(leaf(getattr(self, n), True) for n in WEIGHT_NAMES), swiglu_limit=self.swiglu_limit,
            extra=dict(self.extra),
        )


def routing(T: int, K: int, E: int, kind: str = "random", *, generator: torch.Generator,
            index_dtype=torch.int64, drop: float = 0.0) -> torch.Tensor:
    """top_experts [T, K] of one of the kinds:
    random    K distinct experts per token (needs K <= E), a `drop` share of routes set to -1;
    repeat    ids drawn with replacement in [-1, E) (the same expert may repeat within a token);
    one       every route of every token to expert E-1 (every token to one expert; the others empty);
    none      all routes -1;
    low_half  distinct experts from the lower half only (the upper half empty).
    """
    if kind == "none":
        return torch.full((T, K), -1, dtype=index_dtype)
    if kind == "one":
        return torch.full((T, K), E - 1, dtype=index_dtype)
    if kind == "repeat":
        return torch.randint(-1, E, (T, K), generator=generator).to(index_dtype)
    pool = E if kind == "random" else max(K, E // 2)
    assert K <= pool, "distinct routes need K <= E"
    te = torch.stack([torch.randperm(pool, generator=generator)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    te = te.reshape(T, K)
    if drop:
        mask = torch.rand(T, K, generator=generator) < drop
        te = torch.where(mask, torch.full_like(te, -1), te)
    return te.to(index_dtype)


def make_case(T=6, H=16, I=8, E=4, K=2, *, dtype=torch.float32, device="cpu", shared=False, gate=False,
              limit=None, Is=None, kind="random", drop=0.0, rw_dtype=torch.float32, lead=None,
              index_dtype=torch.int64, seed=0, requires_grad=True) -> MoeCase:
    """Random inputs of one moe call. Weights are scaled so that activations are O(1) (the clamp of
    `limit` then really clips some values); router weights are positive, like softmax outputs."""
    gen = torch.Generator().manual_seed(seed)
    Is = I + 4 if Is is None else Is  # the shared intermediate size differs from I by default

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    x = randn(T, H)
    rw = (torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.1).to(rw_dtype)
    te = routing(T, K, E, kind, generator=gen, index_dtype=index_dtype, drop=drop)
    w1 = randn(E, 2 * I, H, scale=H ** -0.5)
    w2 = randn(E, H, I, scale=I ** -0.5)
    s1 = randn(2 * Is, H, scale=H ** -0.5) if shared else None
    s2 = randn(H, Is, scale=Is ** -0.5) if shared else None
    sg = randn(1, H, scale=H ** -0.5) if gate else None
    if lead is not None:
        x = x.reshape(*lead, H)
        rw = rw.reshape(*lead, K)
        te = te.reshape(*lead, K)
    case = MoeCase(x, rw, te, w1, w2, s1, s2, sg, limit)
    return case.detached(requires_grad=requires_grad, device=device)


def run_moe(case: MoeCase, fn=None) -> torch.Tensor:
    fn = fn or mok_inductor.moe
    return fn(*case.args(), **case.kwargs())


def random_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(device=t.device, dtype=t.dtype)


def moe_with_grads(case: MoeCase, dy: torch.Tensor, fn=None):
    """(y, {name: grad}) of the moe call on `case` (fresh leaves), backward of <y, dy>."""
    c = case.detached()
    y = run_moe(c, fn)
    y.backward(dy)
    return y.detach(), {n: t.grad for n, t in c.tensors().items()}


def oracle_with_grads(case: MoeCase, dy: torch.Tensor, device="cpu"):
    """(y, {name: grad}) of the float64 oracle on the same values, computed on `device` (the CPU unless a
    caller asks otherwise) and returned on the CPU, flattened leading dims restored; gradients are float64,
    zero for a leaf the oracle never used."""
    c = case.detached(device=device, dtype=torch.float64)
    c.router_weights = c.router_weights.detach().double().requires_grad_(True)
    H, K = c.x.shape[-1], c.router_weights.shape[-1]
    y = oracle_moe(c.x.reshape(-1, H), c.router_weights.reshape(-1, K), c.top_experts.reshape(-1, K),
                   c.gate_up_proj, c.down_proj, c.shared_gate_up_proj, c.shared_down_proj,
                   c.shared_output_gate, c.swiglu_limit)
    y = y.reshape(c.x.shape)
    if y.requires_grad:  # the oracle's output is a constant zero when no route and no shared expert exist
        y.backward(dy.detach().to(device).double())
    grads = {}
    for n, t in c.tensors().items():
        # a leaf the oracle never used (e.g. no valid route at all) has no grad: its gradient is zero
        grads[n] = (t.grad if t.grad is not None else torch.zeros_like(t)).cpu()
    return y.detach().cpu(), grads


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor) in float64 (`floor`: an absolute scale below which a reference
    counts as rounding noise); when the denominator is zero, ||out - ref|| itself."""
    out = out.detach().cpu().double()
    ref = ref.detach().cpu().double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if out.numel() == 0:
        return 0.0
    den = max(ref.norm().item(), floor)
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def assert_same_arithmetic(y: torch.Tensor, y_other: torch.Tensor) -> None:
    """Two kernel paths that compute the same sums with the same roundings (the decode forward and the grouped
    path): bitwise equal under the interpreter (numpy's dots at both); on CUDA their tensor-core tiles differ, so
    the fp32 sums may differ in the last bits and flip a rounding of g or u: within 1e-5 (float32) or 1e-3
    (bf16, a few one-ulp flips), tighter than the contract's tolerance: skipping a rounding the grouped path
    does (g and u to bf16 before the activation) parts them by 2e-3."""
    if DEV == "cpu":
        assert torch.equal(y, y_other), rel_err(y, y_other)
    else:
        tol = 1e-5 if y.dtype == torch.float32 else 1e-3
        assert rel_err(y, y_other) <= tol, rel_err(y, y_other)


def assert_close_to_oracle(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                           factor: float = 1.0) -> None:
    err = rel_err(out, ref)
    tol = TOLERANCE[dtype] * factor
    assert err <= tol, f"{name}: relative error {err:.3e} vs the float64 oracle exceeds {tol:.1e}"


def check_against_oracle(case: MoeCase, *, dtype=None, seed=123, fn=None, check_grads=True, vs_torch=()):
    """Forward and every gradient of `case` against the float64 oracle at the contract's tolerance
    of x's dtype (docs/semantics.md).
    Also checks output dtype/shape and that each gradient comes back in its input's dtype. vs_torch: names
    of outputs ("y" or a gradient's input name) whose bound is the contract's or twice the error of the plain
    PyTorch computation in the same dtype (`lowp_torch_moe`), the larger: for tensors of a handful of dot
    products, where single roundings (of h in bf16, of a dot product that cancels in float32) magnified by
    cancellation exceed the contract's bound in PyTorch too."""
    dtype = dtype or case.x.dtype
    y_shape = case.x.shape
    dy = random_like(case.x.detach(), seed)
    if check_grads:
        y, grads = moe_with_grads(case, dy, fn)
    else:
        with torch.no_grad():
            y = run_moe(case.detached(requires_grad=False), fn)
        grads = {}
    y_ref, grads_ref = oracle_with_grads(case, dy)
    base_y, base = baseline_with_grads(case, dy) if vs_torch else (None, {})
    assert y.dtype == case.x.dtype and y.shape == y_shape and y.device == case.x.device

    def factor(name, baseline, ref, tol_dtype):  # (the bound's multiple: 1, or twice PyTorch's own error)
        return max(1.0, 2 * rel_err(baseline, ref) / TOLERANCE[tol_dtype]) if name in vs_torch else 1.0

    assert_close_to_oracle("y", y, y_ref, dtype, factor("y", base_y, y_ref, dtype))
    for n, g in grads.items():
        src = case.tensors()[n]
        assert g is not None, f"{n}: no gradient"
        assert g.dtype == src.dtype, f"{n}: gradient dtype {g.dtype}, expected {src.dtype}"
        assert g.shape == src.shape, f"{n}: gradient shape {tuple(g.shape)}, expected {tuple(src.shape)}"
        # a gradient returned in a lower precision than x (bf16 router weights) is held to its own dtype's bound
        g_dtype = g.dtype if TOLERANCE.get(g.dtype, 0.0) > TOLERANCE[dtype] else dtype
        assert_close_to_oracle(f"d_{n}", g, grads_ref[n], g_dtype, factor(n, base.get(n), grads_ref[n], g_dtype))
    return y, grads, y_ref, grads_ref


def lowp_torch_moe(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj=None,
                   shared_down_proj=None, shared_output_gate=None, swiglu_limit=None):
    """A plain PyTorch implementation in x's own dtype (what a bf16 model computes without mok): the
    baseline whose error against the float64 oracle bounds how accurate a low-precision result can be.
    Router weights are upcast as the op does; every other tensor stays in x.dtype."""
    T, H = x.shape
    E, two_i, _ = gate_up_proj.shape
    I = two_i // 2

    def act(g, u):
        if swiglu_limit is not None:
            g = torch.clamp(g, max=swiglu_limit)
            u = torch.clamp(u, min=-swiglu_limit, max=swiglu_limit)
        return torch.nn.functional.silu(g) * u

    acc = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    if shared_gate_up_proj is not None:
        i_s = shared_gate_up_proj.shape[0] // 2
        s = act(x @ shared_gate_up_proj[:i_s].T, x @ shared_gate_up_proj[i_s:].T) @ shared_down_proj.T
        if shared_output_gate is not None:
            s = s * torch.sigmoid(x @ shared_output_gate.T)
        acc = acc + s.float()
    rw = router_weights.float()
    for e in range(E):
        t_idx, k_idx = torch.where(top_experts == e)
        if t_idx.numel():
            xe = x[t_idx]
            out = act(xe @ gate_up_proj[e, :I].T, xe @ gate_up_proj[e, I:].T) @ down_proj[e].T
            acc = acc.index_add(0, t_idx, out.float() * rw[t_idx, k_idx][:, None])
    return acc.to(x.dtype)


def baseline_with_grads(case: MoeCase, dy: torch.Tensor):
    """(y, {name: grad}) of `lowp_torch_moe` on the case (fresh leaves)."""
    c = case.detached()
    H, K = c.x.shape[-1], c.router_weights.shape[-1]
    y = lowp_torch_moe(c.x.reshape(-1, H), c.router_weights.reshape(-1, K), c.top_experts.reshape(-1, K),
                       c.gate_up_proj, c.down_proj, c.shared_gate_up_proj, c.shared_down_proj,
                       c.shared_output_gate, c.swiglu_limit).reshape(c.x.shape)
    if y.requires_grad:  # (an empty call, or every route -1 without a shared expert, may build no graph)
        y.backward(dy)
    return y.detach(), {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in c.tensors().items()}


def record_launches(monkeypatch) -> list:
    """The kernels launched through `mok_inductor.kernels.common.launch` from here on, in order (a list filled
    as they run; every launch still runs): the `configs.Family` of a tuned kernel (e.g.
    `kernels.gate_up.GATE_UP_MX`), else the jitted kernel."""
    from mok_inductor.kernels import common

    launched, real = [], common.launch
    monkeypatch.setattr(common, "launch", lambda k, *a, **kw: launched.append(k) or real(k, *a, **kw))
    return launched


def ddp_like(params) -> None:
    """Megatron DDP's side of the main-grad protocol on these parameters: a float32 main_grad (on the
    parameter's device), the grad_added_to_main_grad flag, and a post-accumulation hook that adds .grad into
    main_grad unless the flag is set, then drops .grad (distributed_data_parallel.py: _make_backward_post_hook)."""
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False

        def hook(param):
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


def init_gloo(attempts: int = 5) -> None:
    """A one-rank gloo process group on a free port; another process may take the port between the probe
    and the bind, so a failed bind retries on a new port."""
    import torch.distributed as dist

    for attempt in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            return
        except (RuntimeError, OSError):
            if attempt == attempts - 1:
                raise


def destroy_model_parallel(parallel_state) -> None:
    """megatron.core.parallel_state.destroy_model_parallel, plus the group globals it leaves set
    (megatron-core 0.16.1: the partial data-parallel groups with CP), which would keep those groups,
    and their gloo threads, alive past destroy_process_group: one of those threads freeing a finished
    collective's tensors during interpreter shutdown aborts the process."""
    import torch.distributed as dist

    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)



def gloo_threads() -> list:
    """The names of this process's gloo worker threads (Linux: /proc), [] elsewhere."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for t in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, t, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return [n for n in names if "gloo" in n]
