"""Hugging Face transformers experts backends (transformers/integrations/moe.py), as Dynamo captures them.

"grouped_mm" (bf16: torch._grouped_mm; fp32 under compile: transformers::grouped_mm_fallback):

    ids = top_k_index.reshape(-1); ids_g, perm = sort(ids); xs = x[perm // K]; sw = top_k_weights.reshape(-1)[perm]
    offs = cumsum(histc(ids_g.float(), bins=E, min=0, max=E-1), dim=0, dtype=int32)
    gate, up = grouped_mm(xs, gate_up_proj.transpose(-2, -1), offs).chunk(2, dim=-1)
    y = grouped_mm(silu(gate) * up, down_proj.transpose(-2, -1), offs) * sw.unsqueeze(-1)
    inv = empty_like(perm); inv[perm] = arange(N); out = y[inv].view(T, K, H).sum(dim=1)

"batched_mm":

    xr = x.repeat_interleave(K, dim=0); ids = top_k_index.reshape(-1)
    gate, up = bmm(gate_up_proj[ids], xr.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    y = bmm(down_proj[ids], (silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    out = (y * top_k_weights.reshape(-1).unsqueeze(-1)).view(T, K, H).sum(dim=1)

Expert-parallel sentinel handling (traced always by transformers 5.17, under `_is_expert_parallel` by 5.23):
grouped_mm adds `mask = (ids_g >= E).unsqueeze(-1)`, `ids_g.clamp_(max=E-1)`, `xs.masked_fill_(mask, 0.)` and
`.masked_fill(mask, 0.)` on both GEMM outputs (matched in `_experts.sentinel_masks`; sentinels become -1
routes); batched_mm clamps `ids = ids.clamp(0, E-1)` before the gathers (MoK gets the clamped ids) and, in
5.23, zeroes `sample_weights` at `ids >= E` (those become -1 routes too).

GPT-OSS's experts (`is_transposed=True`, `has_bias=True`, its own `_apply_gate`) are matched too, with
activation "gpt_oss" and the biases: grouped_mm in `_experts.gpt_oss_core`, batched_mm in
`_match_batched_gpt_oss` (below). Other biases (`out.add_(bias)` on a SwiGLU block), `is_transposed=True`
weights with SwiGLU, other activations, other custom `_apply_gate` and any other mask or clamp differ from these
graphs and are rejected with a reason.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .._checks import FLOAT_DTYPES
from ._experts import (GroupedCore, MoEMatch, _clamp_bounds, _is_gpt_oss_gate, bias_add, check_routing_shapes,
                       check_weights, chunk_halves, gpt_oss_body, masked_fill_parts, router_weights_of, scaled_by,
                       swiglu)
from ._fx import (Reject, arg, dtype, flat_source, is_fn, is_method, same, same_shape, shape, strip_noop_casts)


def _sum_over_k(r, T, K, H, nodes: set):
    """r [N, H] -> the node of r.view(T, K, H).sum(dim=1) (an output-dtype cast after it may follow)."""
    for v in r.users:
        if is_method(v, "view", "reshape") and same_shape(shape(v), (T, K, H)):
            for s in v.users:
                if (is_method(s, "sum") or is_fn(s, torch.sum)) and arg(s, 1, "dim") in (1, -2, (1,), [1]) and \
                        not s.kwargs.get("keepdim", False) and s.kwargs.get("dtype") is None:
                    nodes.update((v, s))
                    return s
    raise Reject(f"{r.name}: the weighted expert outputs are not summed over K with view(T, K, H).sum(dim=1)")


def _output_in_x_dtype(s, x, nodes: set):
    if dtype(s) == dtype(x):
        return s
    for u in s.users:
        if is_method(u, "to", "type_as") and dtype(u) == dtype(x):
            nodes.add(s)
            return u
    raise Reject(f"{s.name}: the block output has dtype {dtype(s)}, x has {dtype(x)}")


def _is_inverse_of(inv, perm, nodes: set) -> bool:
    """inv = empty_like(perm); inv[perm] = arange(N)   or   inv = perm.argsort()."""
    if (is_fn(inv, torch.argsort) or is_method(inv, "argsort")) and inv.args[0] is perm:
        nodes.add(inv)
        return True
    if not is_fn(inv, torch.empty_like) or inv.args[0] is not perm:
        return False
    sets = [u for u in inv.users if is_fn(u, operator.setitem) and u.args[0] is inv]
    if len(sets) != 1 or sets[0].args[1] is not perm:
        return False
    ar = sets[0].args[2]
    if not (is_fn(ar, torch.arange) and same_shape(shape(ar), shape(perm))):
        return False
    nodes.update((inv, sets[0], ar))
    return True


def combine_grouped(core: GroupedCore) -> MoEMatch:
    """The HF grouped_mm combine: y * sw.unsqueeze(-1) -> [inv_perm] -> view(T, K, H).sum(1)."""
    nodes = set(core.nodes)
    T, H = shape(core.x)
    K = shape(core.top_experts)[1]
    for m in core.y_N.users:
        sw = scaled_by(m, core.y_N)
        if sw is None:
            continue
        rw = router_weights_of(sw, core.perm, core.top_experts, nodes)
        nodes.update((m, *[a for a in m.args if isinstance(a, fx.Node) and a is not core.y_N]))
        for r in m.users:
            if is_fn(r, operator.getitem) and isinstance(r.args[1], fx.Node) and _is_inverse_of(r.args[1], core.perm, nodes):
                nodes.add(r)
                s = _sum_over_k(r, T, K, H, nodes)
                out = _output_in_x_dtype(s, core.x, nodes)
                name = "hf_grouped_mm_fallback" if core.uses_fallback else "hf_grouped_mm"
                if core.activation == "gpt_oss":
                    name = name.replace("hf_", "hf_gpt_oss_")
                return MoEMatch(name, out, core.x, rw, core.top_experts, core.gate_up, core.down,
                                core.swiglu_limit, None, nodes, ids_map=core.ids_map, activation=core.activation,
                                gate_up_bias=core.gate_up_bias, down_bias=core.down_bias)
        raise Reject(f"{m.name}: the weighted outputs are not un-permuted with y[inverse(perm)]")
    raise Reject(f"{core.y_N.name}: the down GEMM output is not scaled by the sorted routing weights")


# ---------------------------------------------------------------------------------------------------
# batched_mm


def _gathered_weight(n):
    """n = W[ids] with W a 3-D tensor and ids a 1-D index node -> (W, ids)."""
    if is_fn(n, operator.getitem) and isinstance(n.args[1], fx.Node) and len(shape(n.args[0]) or ()) == 3 and \
            len(shape(n.args[1]) or ()) == 1 and dtype(n.args[1]) in (torch.int32, torch.int64):
        return n.args[0], n.args[1]
    return None


def _sentinel_weights(mf, sw, flat_ids, ids_map, num_experts, nodes: set):
    """sw = rw_flat.masked_fill(flat_ids >= E, 0) with the ids clamped for the gathers -> rw_flat."""
    src, mask, value = mf
    if ids_map != "clamp":
        raise Reject(f"{sw.name}: routing weights masked, but the expert ids are not clamped to [0, E-1]")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 0:
        raise Reject(f"{sw.name}: the routing weights are filled with {getattr(value, 'name', value)}, not 0")
    ge = mask
    if not ((is_fn(ge, operator.ge, torch.ge) or is_method(ge, "ge", "__ge__")) and len(ge.args) == 2) or \
            ge.args[0] is not flat_ids:
        raise Reject(f"{getattr(mask, 'name', mask)}: the routing-weight mask is not (expert ids >= E)")
    bound = ge.args[1]
    if isinstance(bound, bool) or not isinstance(bound, (int, torch.SymInt)) or not same(bound, num_experts):
        raise Reject(f"{ge.name}: the routing-weight mask is ids >= {getattr(bound, 'name', bound)}, not ids >= E={num_experts}")
    if set(ge.users) != {sw}:
        raise Reject(f"{ge.name}: the sentinel mask is also used outside the block")
    nodes.update((sw, ge))
    return src


def bmm_candidates(graph: fx.Graph):
    """Down-projection bmm nodes of the batched_mm formulation: bmm(W[ids], h.unsqueeze(-1)), h not a bmm input
    (and, for the near-miss report, bmm(h.unsqueeze(1), W[ids]) transposed ones)."""
    for n in graph.nodes:
        if not is_fn(n, torch.bmm, torch.matmul) and not is_method(n, "bmm"):
            continue
        a, b = n.args[:2]
        if _gathered_weight(a) is not None and (is_method(b, "unsqueeze") or is_fn(b, torch.unsqueeze)):
            src = strip_noop_casts(b.args[0])
            if not is_method(src, "repeat_interleave"):
                yield n
        elif _gathered_weight(b) is not None and is_method(a, "unsqueeze") and arg(a, 1, "dim") == 1:
            src = strip_noop_casts(a.args[0])
            if not is_method(src, "repeat_interleave"):
                yield n


def _squeezed(bmm_node, nodes: set):
    for u in bmm_node.users:
        if (is_method(u, "squeeze") or is_fn(u, torch.squeeze)) and arg(u, 1, "dim") in (-1, 2):
            nodes.add(u)
            return u
    raise Reject(f"{bmm_node.name}: the bmm output is not squeezed to [N, out]")


def _squeezed_dim1(n, what: str, nodes: set):
    """n = bmm(...).squeeze(1) -> the bmm node."""
    if not ((is_method(n, "squeeze") or is_fn(n, torch.squeeze)) and arg(n, 1, "dim") in (1, -2)):
        raise Reject(f"{getattr(n, 'name', n)}: {what} is not a bmm output squeezed to [N, out]")
    b = n.args[0]
    if not (is_fn(b, torch.bmm, torch.matmul) or is_method(b, "bmm")):
        raise Reject(f"{n.name}: {what} is not a bmm")
    nodes.update((n, b))
    return b


def _match_batched_gpt_oss(b2: fx.Node, nodes: set):
    """GPT-OSS's experts in the batched_mm backend ([E, in, out] weights, `is_transposed=True`):

        out = bmm(xr.unsqueeze(1), gate_up_proj[ids]).squeeze(1); out.add_(gate_up_proj_bias[ids])
        h = GPT-OSS's gate of out (interleaved halves, _experts.gpt_oss_body)
        y = bmm(h.unsqueeze(1), down_proj[ids]).squeeze(1); y.add_(down_proj_bias[ids])

    -> (x, K, ids, gate_up [E, H, 2I], down [E, I, H], limit, y, gate_up_bias, down_bias)."""
    a, b = b2.args[:2]
    down, ids = _gathered_weight(b)
    y = None
    for u in b2.users:
        if (is_method(u, "squeeze") or is_fn(u, torch.squeeze)) and arg(u, 1, "dim") in (1, -2):
            y = u
    if y is None:
        raise Reject(f"{b2.name}: the down bmm output is not squeezed to [N, H]")
    nodes.update((a, b, y))
    limit, src = gpt_oss_body(a.args[0], nodes)
    b1 = _squeezed_dim1(src, "the GPT-OSS gate input", nodes)
    gw = _gathered_weight(b1.args[1])
    if gw is None or gw[1] is not ids:
        raise Reject(f"{b1.name}: the gate_up bmm does not gather its weight with the same expert ids")
    gate_up = gw[0]
    xcol = b1.args[0]
    if not (is_method(xcol, "unsqueeze") and arg(xcol, 1, "dim") == 1):
        raise Reject(f"{b1.name}: the gate_up bmm operand is not x.unsqueeze(1)")
    xr = strip_noop_casts(xcol.args[0])
    if not (is_method(xr, "repeat_interleave") and arg(xr, 2, "dim") == 0):
        raise Reject(f"{xcol.name}: the expert input is not x.repeat_interleave(K, dim=0)")
    nodes.update((b1.args[1], xcol, xr))
    E, H, two_i = shape(gate_up) if len(shape(gate_up) or ()) == 3 else (None, None, None)
    if E is None or not isinstance(two_i, int) or two_i % 2 or \
            not same_shape(shape(down), (E, two_i // 2, H)):
        raise Reject(f"GPT-OSS weights {gate_up.name} {shape(gate_up)} / {down.name} {shape(down)} are not "
                     "[E, H, 2I] / [E, I, H]")
    bg, ids_g = bias_add(src, two_i, nodes)
    bd, ids_d = bias_add(y, H, nodes)
    if (bg is None) != (bd is None):
        raise Reject(f"{b1.name}: GPT-OSS experts with only one of the two biases")
    if any(i is not None and i is not ids for i in (ids_g, ids_d)):
        raise Reject("the biases are gathered with other ids than the weights")
    for t in (gate_up, down, bg, bd):
        if t is not None and dtype(t) != dtype(xr.args[0]):
            raise Reject(f"{t.name} has dtype {dtype(t)}, x has {dtype(xr.args[0])}")
    return xr.args[0], arg(xr, 1, "repeats"), ids, gate_up, down, limit, y, bg, bd


def match_batched(b2: fx.Node) -> MoEMatch:
    nodes: set = {b2}
    a, b = b2.args[:2]
    variant = {}
    if _gathered_weight(a) is None and (is_method(a, "unsqueeze") or is_fn(a, torch.unsqueeze)) and \
            _is_gpt_oss_gate(a.args[0]):
        x, k, ids, gate_up, down, limit, y, bg, bd = _match_batched_gpt_oss(b2, nodes)
        variant = dict(activation="gpt_oss", gate_up_bias=bg, down_bias=bd)
        return _batched_combine(b2, nodes, x, k, ids, gate_up, down, limit, y, variant)
    if _gathered_weight(a) is None:
        raise Reject(f"{b2.name}: bmm(h.unsqueeze(1), W[ids]) reads [E, in, out] (transposed) weights; "
                     "MoK takes [E, out, in]")
    down, ids = _gathered_weight(a)
    if arg(b, 1, "dim") not in (-1, 2):
        raise Reject(f"{b.name}: the down bmm operand is not h.unsqueeze(-1)")
    nodes.update((a, b))
    h = b.args[0]
    gate, up, limit = swiglu(h, nodes)
    src = chunk_halves(gate, up, nodes)
    out1 = strip_noop_casts(src)
    if not (is_method(out1, "squeeze") or is_fn(out1, torch.squeeze)):
        raise Reject(f"{src.name}: the SwiGLU input is not a squeezed bmm output")
    b1 = out1.args[0]
    if not (is_fn(b1, torch.bmm, torch.matmul) or is_method(b1, "bmm")):
        raise Reject(f"{out1.name}: the SwiGLU input is not a bmm")
    nodes.update((out1, b1))
    gw = _gathered_weight(b1.args[0])
    if gw is None or gw[1] is not ids:
        raise Reject(f"{b1.name}: the gate_up bmm does not gather its weight with the same expert ids")
    gate_up = gw[0]
    xcol = b1.args[1]
    if not (is_method(xcol, "unsqueeze") and arg(xcol, 1, "dim") in (-1, 2)):
        raise Reject(f"{b1.name}: the gate_up bmm operand is not x.unsqueeze(-1)")
    xr = strip_noop_casts(xcol.args[0])
    if not (is_method(xr, "repeat_interleave") and arg(xr, 2, "dim") == 0):
        raise Reject(f"{xcol.name}: the expert input is not x.repeat_interleave(K, dim=0)")
    x, k = xr.args[0], arg(xr, 1, "repeats")
    nodes.update((b1.args[0], xcol, xr))
    y = _squeezed(b2, nodes)
    return _batched_combine(b2, nodes, x, k, ids, gate_up, down, limit, y, {})


def _batched_combine(b2, nodes: set, x, k, ids, gate_up, down, limit, y, variant: dict) -> MoEMatch:
    """The batched_mm tail: the ids (clamped under expert parallelism), y * sw.unsqueeze(-1), sum over K."""
    num_experts = shape(down)[0]
    flat_ids, ids_map = ids, None
    cl = _clamp_bounds(ids)
    if cl is not None and flat_source(cl[0]) is not None:  # the expert-parallel clamp (always there in 5.17)
        if cl[1] != 0 or isinstance(cl[2], bool) or not isinstance(cl[2], (int, torch.SymInt)) or \
                not same(cl[2], num_experts - 1):
            raise Reject(f"{ids.name}: expert ids clamped to [{cl[1]}, {cl[2]}], not [0, E-1={num_experts - 1}]")
        flat_ids, ids_map = cl[0], "clamp"
    te = flat_source(flat_ids)
    if te is None:
        raise Reject(f"{ids.name}: expert ids are not top_experts.reshape(-1)")
    nodes.update((ids, flat_ids))
    check_routing_shapes(x, te, k, num_experts)
    if variant:  # GPT-OSS's [E, H, 2I] / [E, I, H] weights, checked in _match_batched_gpt_oss
        if dtype(x) not in FLOAT_DTYPES:
            raise Reject(f"x has dtype {dtype(x)}")
    else:
        check_weights(x, gate_up, down, num_experts)
    T, H = shape(x)
    K = shape(te)[1]
    for m in y.users:
        sw = scaled_by(m, y)
        if sw is None:
            continue
        mf = masked_fill_parts(sw, inplace=False)
        if mf is not None:  # routing weights zeroed at the sentinels (transformers >= 5.2x under expert parallelism)
            sw, ids_map = _sentinel_weights(mf, sw, flat_ids, ids_map, num_experts, nodes), "clamp_sentinel"
        rw = router_weights_of(sw, None, te, nodes)
        nodes.update((m, *[a for a in m.args if isinstance(a, fx.Node) and a is not y]))
        s = _sum_over_k(m, T, K, H, nodes)
        out = _output_in_x_dtype(s, x, nodes)
        name = "hf_gpt_oss_batched_mm" if variant else "hf_batched_mm"
        return MoEMatch(name, out, x, rw, te, gate_up, down, limit, None, nodes, ids_map=ids_map, **variant)
    raise Reject(f"{y.name}: the down bmm output is not scaled by the routing weights")
