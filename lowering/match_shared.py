"""Fuse a shared expert (and its sigmoid output gate) that sits in the same graph as a matched routed block.

Qwen2-MoE style (Qwen2MoeSparseMoeBlock; also qwen3_next, qwen3_5_moe, qwen3_omni_moe), and ungated shared
experts such as GLM4-MoE's, whose addends are viewed back to [B, S, H] first:

    s = down_s(silu(gate_s(x)) * up_s(x))                       # three bias-free Linear
    out = routed(x) + sigmoid(shared_expert_gate(x)) * s          # gate: Linear(H, 1), optional

`mok::moe` takes the shared FC1 as one [2Is, H] tensor, gate rows first. HF keeps gate_proj and up_proj as
two parameters, so the rewrite builds `torch.cat([gate_s.weight, up_s.weight], dim=0)` in the graph: one
[2Is, H] copy per step (its backward is a free split of the gradient). Two separate parameters cannot be
proven adjacent in memory at trace time, so no zero-copy view is attempted.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ._experts import MoEMatch, swiglu
from ._fx import Reject, arg, dtype, is_fn, is_method, same_shape, shape, strip_noop_casts, strip_views


def _linear(n):
    """n = linear(inp, w) without bias -> (inp, w), else None."""
    if is_fn(n, F.linear, torch._C._nn.linear):
        if arg(n, 2, "bias") is not None:
            raise Reject(f"{n.name}: shared expert Linear has a bias")
        return n.args[0], arg(n, 1, "weight")
    return None


def _is_sigmoid(n) -> bool:
    return is_fn(n, torch.sigmoid, F.sigmoid) or is_method(n, "sigmoid")


def _is_add(n) -> bool:
    return (is_fn(n, operator.add, torch.add) or is_method(n, "add", "__add__")) and len(n.args) == 2 and \
        arg(n, 2, "alpha", 1) == 1


def _view_root(n):
    while is_method(n, "view", "reshape") or is_fn(n, torch.reshape):
        n = n.args[0]
    return n


def _same_input(a, x) -> bool:
    """a holds the same tokens as the routed input x: x itself, or a view of the same tensor (GLM4-MoE's shared
    expert reads the 3-D `residuals` while the experts read `residuals.view(-1, H)`)."""
    if a is x or strip_views(a) is strip_views(x):
        return True
    sa, sx = shape(a), shape(x)
    return _view_root(a) is _view_root(x) and sa is not None and sx is not None and same_shape(sa[-1:], sx[-1:])


def _shared_branch(s, x, nodes: set):
    """s = [sigmoid(linear(x, wg)) *] linear(silu(linear(x, wsg)) * linear(x, wsu), wsd) -> weights."""
    gate_w = None
    if is_fn(s, operator.mul, torch.mul) or is_method(s, "mul"):
        a, b = s.args
        sig, body = (a, b) if _is_sigmoid(a) else ((b, a) if _is_sigmoid(b) else (None, None))
        if sig is None:
            raise Reject(f"{s.name}: the shared expert output is scaled by something other than a sigmoid gate")
        lin = _linear(sig.args[0])
        if lin is None or not _same_input(lin[0], x):
            raise Reject(f"{sig.name}: the shared gate is not sigmoid(x @ w^T)")
        gate_w = lin[1]
        if not same_shape(shape(gate_w), (1, shape(x)[1])):
            raise Reject(f"shared gate weight {gate_w.name} has shape {shape(gate_w)}, expected [1, H]")
        nodes.update((s, sig, sig.args[0]))
        s = body
    down = _linear(s)
    if down is None:
        raise Reject(f"{s.name}: the other addend is not a shared expert MLP")
    h, wsd = down
    g, u, limit = swiglu(h, nodes)
    if limit is not None:
        raise Reject(f"{h.name}: clamped shared expert")
    lg, lu = _linear(g), _linear(u)
    if lg is None or lu is None or not _same_input(lg[0], x) or not _same_input(lu[0], x):
        raise Reject(f"{h.name}: shared gate/up are not Linear layers of the routed block's input")
    wsg, wsu = lg[1], lu[1]
    Is, H = (shape(wsg) or (None, None))[0], shape(x)[1]
    for w, want in ((wsg, (Is, H)), (wsu, (Is, H)), (wsd, (H, Is))):
        if not same_shape(shape(w), want) or dtype(w) != dtype(x):
            raise Reject(f"shared weight {w.name}: shape {shape(w)} dtype {dtype(w)}, expected {want} {dtype(x)}")
    if gate_w is not None and dtype(gate_w) != dtype(x):
        raise Reject(f"shared gate weight {gate_w.name} has dtype {dtype(gate_w)}")
    nodes.update((s, g, u))
    return wsg, wsu, wsd, gate_w


def fuse(m: MoEMatch):
    """Extend `m` with the shared expert added to its output, if there is one. Returns a reject reason or None."""
    if m.activation != "swiglu":  # mok::moe applies the activation to the shared expert too: leave it outside
        return None
    outs = [m.output] + [u for u in m.output.users if strip_noop_casts(u) is m.output]
    # the routed output may be viewed back to [B, S, H] before the shared expert is added (GLM4-MoE)
    views = [u for o in outs for u in o.users if is_method(u, "view", "reshape") and len(shape(u) or ()) >= 2
             and same_shape(shape(u)[-1:], shape(m.x)[-1:])]
    for o in outs + views:
        for add in o.users:
            if not _is_add(add):
                continue
            other = add.args[1] if add.args[0] is o else add.args[0]
            if not isinstance(other, fx.Node) or not same_shape(shape(other), shape(o)):
                continue
            nodes: set = set()
            try:
                weights = _shared_branch(other, m.x, nodes)
            except Reject as e:
                return str(e)
            if dtype(add) != dtype(m.x):
                return f"{add.name}: the routed + shared sum has dtype {dtype(add)}"
            m.nodes |= nodes | {m.output, *outs, o}
            if o in views:
                m.out_view = o
            m.shared = weights
            m.output = add
            m.formulation += "+shared"
            return None
    return None
