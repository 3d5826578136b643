"""`mok_inductor.MoE`: a Mixture-of-Experts `torch.nn.Module` over `mok_inductor.moe`, for people who write
their own models (docs/api.md, "The MoE module").

    moe = mok_inductor.MoE(hidden_size=2048, intermediate_size=1408, num_experts=60, top_k=4,
                           shared_intermediate_size=5632, shared_expert_gate=True)
    y = moe(x)                          # x [..., H] -> y [..., H]
    logits, w, ids = moe.route(x)       # the routing alone (e.g. for a load-balancing loss) ...
    y = moe(x, w, ids)                  # ... then the layer on it

Data flow of one forward: the router `gate` (a bias-free Linear H -> E) gives logits_TE in x's dtype; a
float32 softmax over the E experts, the top K of them, renormalised over the K picks when `norm_topk_prob`
(Qwen3-MoE, Mixtral) -> router_weights_TK (float32) and top_experts_TK; then one `mok_inductor.moe` call with
the routed experts, the shared expert, its output gate and the clamp. Without a router (`router=False`) the
caller passes router_weights and top_experts.

Parameters and their state-dict keys are those of Hugging Face's sparse-MoE blocks (Qwen2-MoE, Qwen3-MoE,
Mixtral), except that the shared expert is stored fused, as the op takes it:

    gate.weight                    [E, H]     the router (HF: the same key)
    experts.gate_up_proj           [E, 2I, H] gate rows [0, I), up rows [I, 2I) (HF: the same key)
    experts.down_proj              [E, H, I]  (HF: the same key)
    shared_expert.gate_up_proj     [2Is, H]   HF: shared_expert.gate_proj.weight and .up_proj.weight, stacked
    shared_expert.down_proj        [H, Is]    HF: shared_expert.down_proj.weight
    shared_expert_gate.weight      [1, H]     (HF: the same key)

`load_state_dict` takes either layout of the shared expert, and the routed experts also as the per-expert
Linear weights of Hub checkpoints (`experts.{e}.gate_proj.weight` / `up_proj` / `down_proj`, or Mixtral's
`w1` / `w3` / `w2`), stacking them on load.

Shape legend: T tokens, H hidden, I routed intermediate, Is shared intermediate, E experts, K routes per token.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import _checks
from . import types as _types
from .api import moe as _moe

# Per-expert Linear names of Hub checkpoints, (gate, up, down): Qwen/DeepSeek style, then Mixtral's.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _linear_init_(w: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default init for a weight of `fan_in` inputs: uniform in +-1/sqrt(fan_in). Computed here
    rather than by kaiming_uniform_, which would take a stacked [E, M, K] tensor's fan-in as M*K."""
    bound = fan_in ** -0.5
    nn.init.uniform_(w, -bound, bound)


class Experts(nn.Module):
    """The routed experts' weights: `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj`
    [E, H, I]. A holder: `MoE.forward` passes them to the op. `reset_parameters` initialises each expert as
    nn.Linear does its weight: uniform in +-1/sqrt(H) (gate_up_proj) and +-1/sqrt(I) (down_proj)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        # (GPT-OSS's names: gate_up_proj_bias [E, 2I] gate columns then up columns, down_proj_bias [E, H])
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, **kw)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _linear_init_(self.gate_up_proj, self.gate_up_proj.shape[2])
        _linear_init_(self.down_proj, self.down_proj.shape[2])
        if self.gate_up_proj_bias is not None:  # as nn.Linear's bias: the same bound as its weight
            _linear_init_(self.gate_up_proj_bias, self.gate_up_proj.shape[2])
            _linear_init_(self.down_proj_bias, self.down_proj.shape[2])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Hub checkpoints hold one Linear per expert: stack them into the fused tensors when the fused keys are
        # absent (only a complete set of E experts is taken).
        if prefix + "gate_up_proj" not in state_dict and prefix + "down_proj" not in state_dict:
            for gate, up, down in _PER_EXPERT_NAMES:
                g = [f"{prefix}{e}.{gate}.weight" for e in range(self.num_experts)]
                u = [f"{prefix}{e}.{up}.weight" for e in range(self.num_experts)]
                d = [f"{prefix}{e}.{down}.weight" for e in range(self.num_experts)]
                if all(k in state_dict for k in g + u + d):
                    state_dict[prefix + "gate_up_proj"] = torch.stack(
                        [torch.cat([state_dict.pop(a), state_dict.pop(b)]) for a, b in zip(g, u)])
                    state_dict[prefix + "down_proj"] = torch.stack([state_dict.pop(k) for k in d])
                    break
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        E, two_i, H = self.gate_up_proj.shape
        return f"num_experts={E}, hidden_size={H}, intermediate_size={two_i // 2}"


class SharedExpert(nn.Module):
    """The shared expert's weights, fused as the op takes them: `gate_up_proj` [2Is, H] (gate rows, then up
    rows) and `down_proj` [H, Is]. `load_state_dict` also takes Hugging Face's three Linear weights
    (`gate_proj.weight`, `up_proj.weight`, `down_proj.weight`). Init as nn.Linear's: +-1/sqrt(H), +-1/sqrt(Is)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _linear_init_(self.gate_up_proj, self.gate_up_proj.shape[1])
        _linear_init_(self.down_proj, self.down_proj.shape[1])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        gate, up, down = (f"{prefix}{n}.weight" for n in _PER_EXPERT_NAMES[0])
        if prefix + "gate_up_proj" not in state_dict and gate in state_dict and up in state_dict:
            state_dict[prefix + "gate_up_proj"] = torch.cat([state_dict.pop(gate), state_dict.pop(up)])
        if prefix + "down_proj" not in state_dict and down in state_dict:
            state_dict[prefix + "down_proj"] = state_dict.pop(down)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        two_i, H = self.gate_up_proj.shape
        return f"hidden_size={H}, intermediate_size={two_i // 2}"


def _int_at_least(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


class MoE(nn.Module):
    """A Mixture-of-Experts layer with gated experts (SwiGLU or GPT-OSS's), an optional router, shared expert and shared output
    gate, computed by one `mok_inductor.moe` call (docs/api.md, "The MoE module").

    Args:
        hidden_size: H.
        intermediate_size: I, each routed expert's.
        num_experts: E.
        top_k: K, routes per token.
        shared_intermediate_size: Is of the shared expert; 0 (the default): no shared expert.
        shared_expert_gate: scale the shared expert's output by sigmoid(x @ shared_expert_gate.weight^T) per
            token (Qwen2-MoE); needs a shared expert.
        router: hold the router `gate` (a bias-free Linear H -> E) and route in `forward(x)`. False: no router
            parameter; `forward(x, router_weights, top_experts)` takes the routing.
        norm_topk_prob: renormalise the K picked softmax probabilities to sum to 1 (Qwen3-MoE and Mixtral; HF's
            Qwen2-MoE and Qwen3-MoE configs default to False).
        swiglu_limit: the clamp of the gated activation (gate clamped above, up to [-limit, limit]), routed and
            shared.
        activation: the experts' gated activation, "swiglu" (silu(gate) * up) or "gpt_oss"
            (gate * sigmoid(1.702 gate) * (up + 1)), routed and shared (docs/semantics.md).
        expert_bias: the routed experts' projections have biases, `experts.gate_up_proj_bias` [E, 2I] and
            `experts.down_proj_bias` [E, H] (GPT-OSS); not with a shared expert.
        device, dtype: of the parameters (x must have their dtype, or any float dtype under torch.autocast).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 shared_intermediate_size: int = 0, shared_expert_gate: bool = False, router: bool = True,
                 norm_topk_prob: bool = True, swiglu_limit: Optional[float] = None, activation: str = "swiglu",
                 expert_bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size = _int_at_least("hidden_size", hidden_size)
        self.intermediate_size = _int_at_least("intermediate_size", intermediate_size)
        self.num_experts = _int_at_least("num_experts", num_experts)
        self.top_k = _int_at_least("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k: expected at most num_experts ({num_experts}) routes per token, got {top_k}")
        self.shared_intermediate_size = _int_at_least("shared_intermediate_size", shared_intermediate_size, 0)
        if shared_expert_gate and not shared_intermediate_size:
            raise ValueError("shared_expert_gate: gates the shared expert's output, so it needs a shared expert "
                             "(shared_intermediate_size > 0)")
        if dtype is not None and dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"dtype: expected one of {', '.join(map(str, _checks.FLOAT_DTYPES))} (what the op "
                            f"takes), got {dtype}")
        if expert_bias and shared_intermediate_size:
            raise ValueError("expert_bias: routed biases are not taken together with a shared expert "
                             "(shared_intermediate_size > 0)")
        self.activation = _types.activation(activation).name
        self.norm_topk_prob = bool(norm_topk_prob)
        self.swiglu_limit = _checks.check_swiglu_limit(swiglu_limit)
        kw = dict(device=device, dtype=dtype)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **kw) if router else None
        self.experts = Experts(num_experts, hidden_size, intermediate_size, bias=bool(expert_bias), **kw)
        self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size, **kw) \
            if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **kw) if shared_expert_gate else None

    def reset_parameters(self) -> None:
        """Every parameter as nn.Linear initialises a weight of its fan-in: uniform in +-1/sqrt(fan_in)
        (H for the router, gate_up_proj and the shared gate; I and Is for the down projections). Works on
        the parameters FSDP2 shards: build on the meta device, shard, `to_empty`, then call this."""
        for m in (self.gate, self.experts, self.shared_expert, self.shared_expert_gate):
            if m is not None:
                m.reset_parameters()

    def _check_x(self, x) -> None:
        _checks.require_tensor("x", x)
        if x.dim() < 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected shape [..., {self.hidden_size}] (leading token dims, then hidden_size), "
                             f"got {list(x.shape)}")
        w = self.experts.gate_up_proj
        # under autocast the router's Linear and the op cast x and the weights to the autocast dtype themselves
        # (the float dtypes autocast casts: not float64)
        autocast = torch.is_autocast_enabled(x.device.type) and x.dtype in _checks.FLOAT_DTYPES
        if x.dtype != w.dtype and not autocast:
            raise TypeError(f"x: expected dtype {str(w.dtype)[6:]} (the module's parameters'), got {str(x.dtype)[6:]}")
        if x.device != w.device:
            raise ValueError(f"x: expected a tensor on {w.device} (the module's parameters'), got one on {x.device}")

    def route(self, x: torch.Tensor):
        """(router_logits [..., E] in x.dtype, router_weights [..., K] float32, top_experts [..., K] int64) of
        x [..., H]: softmax over the experts in float32, the top K, renormalised when `norm_topk_prob`."""
        if self.gate is None:
            raise ValueError("route: this MoE has no router (built with router=False); route the tokens yourself")
        self._check_x(x)
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        router_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            router_weights = router_weights / router_weights.sum(dim=-1, keepdim=True)
        return logits, router_weights, top_experts

    def forward(self, x: torch.Tensor, router_weights: Optional[torch.Tensor] = None,
                top_experts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y [..., H] in x.dtype (the autocast dtype under torch.autocast) of x [..., H]. Routed by the module's
        router, or by `router_weights` [..., K] and `top_experts` [..., K] (ids in [0, E) or -1) when given (both
        or neither)."""
        if (router_weights is None) != (top_experts is None):
            given, absent = ("router_weights", "top_experts") if top_experts is None else \
                ("top_experts", "router_weights")
            raise ValueError(f"{absent}: {given} was given without it; pass both routing tensors or neither")
        if router_weights is None:
            if self.gate is None:
                raise ValueError("router_weights, top_experts: this MoE has no router (built with router=False); "
                                 "pass the routing: moe(x, router_weights, top_experts)")
            _, router_weights, top_experts = self.route(x)
        else:
            self._check_x(x)
            _checks.require_tensor("router_weights", router_weights)
            if router_weights.shape[-1:] != (self.top_k,):
                raise ValueError(f"router_weights: expected shape [..., top_k={self.top_k}], got "
                                 f"{list(router_weights.shape)}")
        shared = self.shared_expert
        gate = self.shared_expert_gate
        return _moe(x, router_weights, top_experts, self.experts.gate_up_proj, self.experts.down_proj,
                    shared_gate_up_proj=None if shared is None else shared.gate_up_proj,
                    shared_down_proj=None if shared is None else shared.down_proj,
                    shared_output_gate=None if gate is None else gate.weight,
                    swiglu_limit=self.swiglu_limit, activation=self.activation,
                    gate_up_bias=self.experts.gate_up_proj_bias, down_bias=self.experts.down_proj_bias)

    def extra_repr(self) -> str:
        s = (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
             f"num_experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}")
        if self.shared_intermediate_size:
            s += f", shared_intermediate_size={self.shared_intermediate_size}"
        if self.swiglu_limit is not None:
            s += f", swiglu_limit={self.swiglu_limit}"
        if self.activation != "swiglu":
            s += f", activation={self.activation!r}"
        return s
