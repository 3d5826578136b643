"""The parts every grouped-GEMM MoE formulation shares: the match record, the grouped-GEMM anchor, the
SwiGLU expert body, the routing metadata chain (offsets <- cumsum <- histc/bincount <- expert ids) and the
token dispatch (x[perm // K] or gather).

A grouped formulation is found in four steps, each of which either returns nodes or raises `Reject`:

    anchor     GEMM nodes (torch._grouped_mm, F.grouped_mm, transformers::grouped_mm_fallback) grouped by
               the `offs` node they share
    body       h = silu(gate) * up between the first GEMM(s) and the last one; gate/up either the two halves
               of one [E, 2I, H] weight (HF) or two weights (torchtitan w1/w3); or GPT-OSS's gate on the
               interleaved halves of an [E, H, 2I] weight, with per-expert biases (`gpt_oss_core`)
    routing    offs = cumsum(histc(ids) | bincount(ids), dtype=int32); perm = sort(ids)[1] | argsort(ids),
               ids = top_experts.reshape(-1), and the dispatched input = x[perm // K]
    combine    per formulation (match_hf / match_titan): scale by router weights, un-permute, sum over K

Shape legend: T tokens, H hidden, I intermediate, E experts, K routes per token, N = T*K.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from .._checks import FLOAT_DTYPES
from ..types import ACTIVATIONS
from ._fx import (Reject, arg, dtype, flat_source, getitem_of, is_fn, is_method, same, same_shape, shape,
                  strip_noop_casts, transposed_last2)

IDS_MAPS = {"sentinel": "ids >= E -> -1 (sentinel masks)", "clamp": "clamp(0, E-1)",
            "clamp_sentinel": "ids >= E -> -1 (masked routing weights), clamp(0, E-1)"}


@dataclasses.dataclass
class MoEMatch:
    """One MoE block found in a graph: the nodes to feed `mok::moe` and the node whose value it replaces."""

    formulation: str
    output: fx.Node  # its value equals mok::moe(...) after the rewrite
    x: fx.Node  # [T, H]
    router_weights: fx.Node  # [T, K]
    top_experts: fx.Node  # [T, K]
    gate_up: Union[fx.Node, tuple]  # [E, 2I, H], or (gate [E, I, H], up [E, I, H]) to concatenate
    down: fx.Node  # [E, H, I]
    swiglu_limit: Optional[float] = None
    shared: Optional[tuple] = None  # (gate [Is, H], up [Is, H], down [H, Is], output_gate [1, H] or None)
    nodes: set = dataclasses.field(default_factory=set)  # block nodes that may be erased once unused
    out_view: Optional[fx.Node] = None  # a view of the [T, H] result whose shape `output` has (shared fusion)
    # how the graph maps the ids before the experts see them, which the replacement must reproduce on
    # `top_experts`: None (as is), "sentinel" (ids >= E contribute nothing: -1 for MoK), "clamp" (clamp(0, E-1)),
    # "clamp_sentinel" (ids >= E -> -1, the rest clamp(0, E-1))
    ids_map: Optional[str] = None
    # GPT-OSS's experts (`gpt_oss_body`): activation "gpt_oss", `gate_up` the [E, H, 2I] interleaved weight and
    # `down` the [E, I, H] one as the checkpoint stores them, the biases [E, 2I] (interleaved) and [E, H]; the
    # replacement hands mok::moe zero-copy views of them (lowering/patterns.py, `_gpt_oss_views`)
    activation: str = "swiglu"
    gate_up_bias: Optional[fx.Node] = None
    down_bias: Optional[fx.Node] = None

    def describe(self) -> str:
        T, H = shape(self.x)
        K = shape(self.top_experts)[1]
        E = shape(self.down)[0]
        I = shape(self.down)[1 if self.activation == "gpt_oss" else 2]
        extra = ""
        if self.shared is not None:
            extra = ", shared expert" + (" + sigmoid gate" if self.shared[3] is not None else "")
        if self.swiglu_limit is not None:
            extra += f", swiglu_limit={self.swiglu_limit}"
        if self.ids_map is not None:
            extra += f", ids: {IDS_MAPS[self.ids_map]}"
        if self.activation != "swiglu":
            extra += f", activation={self.activation}" + (", biases" if self.down_bias is not None else "")
        return (f"{self.formulation} -> {self.output.name}: T={T} H={H} I={I} E={E} K={K}, "
                f"dtype={str(dtype(self.x)).replace('torch.', '')}{extra}")


# ---------------------------------------------------------------------------------------------------
# anchor


def _grouped_mm_targets():
    out = [getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)]
    aten = getattr(torch.ops.aten, "_grouped_mm", None)
    if aten is not None:
        out += [aten, aten.default]
    return tuple(t for t in out if t is not None)


def _hf_fallback_targets():
    try:
        pkt = torch.ops.transformers.grouped_mm_fallback
    except (AttributeError, RuntimeError):
        return ()
    return (pkt, pkt.default)


def is_grouped_gemm(node) -> bool:
    return is_fn(node, *_grouped_mm_targets(), *_hf_fallback_targets())


def gemm_parts(node: fx.Node):
    """(input [N, in], weight operand [E, in, out], offs [E]) of a grouped GEMM node; rejects bias/out_dtype."""
    a = arg(node, 0, "input", arg(node, 0, "mat_a"))
    b = arg(node, 1, "weight", arg(node, 1, "mat_b"))
    offs = arg(node, 2, "offs")
    bias = arg(node, 3, "bias")
    out_dtype = arg(node, 4, "out_dtype")
    if bias is not None:
        raise Reject(f"{node.name}: grouped GEMM with a bias; MoK experts have no bias")
    if out_dtype is not None and out_dtype != dtype(a):
        raise Reject(f"{node.name}: grouped GEMM with out_dtype={out_dtype}")
    if offs is None:
        raise Reject(f"{node.name}: grouped GEMM without offs")
    return a, b, offs


def gemm_weight(node: fx.Node, b) -> fx.Node:
    """The [E, out, in] weight behind a grouped GEMM operand `w.transpose(-2, -1)`."""
    w = transposed_last2(b)
    if w is None:
        raise Reject(f"{node.name}: weight operand {getattr(b, 'name', b)} is not w.transpose(-2, -1) of an "
                     f"[E, out, in] weight (a transposed [E, in, out] layout is not what MoK takes)")
    if len(shape(w) or ()) != 3:
        raise Reject(f"{node.name}: weight {w.name} is not 3-D")
    return w


def group_by_offs(graph: fx.Graph) -> dict:
    groups: dict = {}
    for n in graph.nodes:
        if is_grouped_gemm(n):
            try:
                offs = arg(n, 2, "offs")
            except Exception:
                offs = None
            groups.setdefault(offs, []).append(n)
    return groups


# ---------------------------------------------------------------------------------------------------
# body: h = silu(gate) * up


def _is_silu(n) -> bool:
    if is_fn(n, F.silu, torch.ops.aten.silu.default) and not n.kwargs.get("inplace", False) and \
            not (len(n.args) > 1 and n.args[1] is True):
        return True
    return is_method(n, "silu")


_OTHER_ACTS = {
    "gelu": (F.gelu, getattr(torch, "gelu", None)), "relu": (F.relu, torch.relu), "sigmoid": (torch.sigmoid, F.sigmoid),
    "tanh": (torch.tanh, F.tanh), "mish": (F.mish,), "elu": (F.elu,), "leaky_relu": (F.leaky_relu,),
}


def _act_name(n) -> Optional[str]:
    for name, fns in _OTHER_ACTS.items():
        if is_fn(n, *fns) or is_method(n, name):
            return name
    return None


def _is_mul(n) -> bool:
    return is_fn(n, operator.mul, torch.mul) or is_method(n, "mul", "__mul__")


def _clamp_bounds(n):
    """(src, min, max) of a clamp/clip node, else None."""
    if is_fn(n, torch.clamp, torch.clip) or is_method(n, "clamp", "clip"):
        return n.args[0], arg(n, 1, "min"), arg(n, 2, "max")
    return None


def swiglu(h: fx.Node, nodes: set):
    """h = silu(gate) * up -> (gate, up, swiglu_limit); the clamped SwiGLU of docs/semantics.md gives the limit."""
    h = strip_noop_casts(h)
    if not _is_mul(h) or len(h.args) != 2:
        raise Reject(f"{h.name}: the down GEMM input is not silu(gate) * up ({h.target})")
    a, b = h.args
    silu_a, silu_b = _is_silu(a), _is_silu(b)
    if silu_a == silu_b:
        acts = {_act_name(x) for x in (a, b) if isinstance(x, fx.Node)} - {None}
        why = f"activation {', '.join(sorted(acts))}" if acts else "no single silu() operand"
        raise Reject(f"{h.name}: {why}; MoK computes SwiGLU silu(gate) * up")
    act, up = (a, b) if silu_a else (b, a)
    gate = act.args[0]
    nodes.update((h, act))
    return _unclamped(gate, up, h.name, nodes)


def _unclamped(gate, up, name: str, nodes: set):
    """(gate, up, swiglu_limit) with MoK's clamp form (gate.clamp(max=L), up.clamp(-L, L)) taken off, its
    clamp nodes added to `nodes`; (gate, up, None) where neither is clamped; Reject for any other clamp."""
    cg, cu = _clamp_bounds(gate), _clamp_bounds(up) if isinstance(up, fx.Node) else None
    if cg is None and cu is None:
        return gate, up, None
    if cg is None or cu is None or cg[1] is not None or not isinstance(cg[2], (int, float)) or \
            not isinstance(cu[1], (int, float)) or cu[2] != cg[2] or cu[1] != -cg[2]:
        raise Reject(f"{name}: clamp is not MoK's swiglu_limit form (gate.clamp(max=L), up.clamp(-L, L))")
    nodes.update((gate, up))
    return cg[0], cu[0], float(cg[2])


def chunk_halves(gate, up, nodes: set) -> fx.Node:
    """gate, up = t.chunk(2, dim=-1) -> t; rejects swapped halves."""
    g_src, u_src = getitem_of(gate, 0), getitem_of(up, 1)
    if g_src is None or u_src is None or g_src is not u_src:
        if getitem_of(gate, 1) is not None and getitem_of(up, 0) is getitem_of(gate, 1):
            raise Reject(f"gate/up swapped: silu is applied to the second half ({gate.name}); "
                         "MoK's gate_up_proj has gate rows first")
        raise Reject(f"gate {getattr(gate, 'name', gate)} and up {getattr(up, 'name', up)} are not the two halves of one chunk")
    c = g_src
    is_chunk = (is_method(c, "chunk") or is_fn(c, torch.chunk)) and arg(c, 1, "chunks") == 2
    dim = arg(c, 2, "dim", 0)
    nd = len(shape(c.args[0]) or ())
    if not is_chunk or dim not in (-1, nd - 1):
        raise Reject(f"{c.name}: gate/up split is not chunk(2, dim=-1) (interleaved or other layout)")
    nodes.update((gate, up, c))
    return c.args[0]


# ---------------------------------------------------------------------------------------------------
# routing: offs -> counts -> ids; perm; dispatch


def _strip_any_cast(n):
    while is_method(n, "float", "int", "long", "to", "type"):
        n = n.args[0]
    return n


def routing(offs, num_experts, nodes: set):
    """offs = cumsum(histc(ids) | bincount(ids), dim=0) -> the ids source node (a sort value or flat ids)."""
    o = offs
    if is_method(o, "to", "int") and dtype(o) == torch.int32:
        nodes.add(o)
        o = o.args[0]
    if not (is_fn(o, torch.cumsum) or is_method(o, "cumsum")):
        raise Reject(f"offs {getattr(offs, 'name', offs)} is not a cumsum of per-expert counts (not an MoE graph?)")
    if arg(o, 1, "dim") not in (0, -1):
        raise Reject(f"{o.name}: cumsum over dim {arg(o, 1, 'dim')}")
    if dtype(offs) != torch.int32:
        raise Reject(f"{o.name}: offsets are not int32")
    counts = o.args[0]
    nodes.update((o,))
    if is_method(counts, "to", "int"):
        nodes.add(counts)
        counts = counts.args[0]
    if is_fn(counts, torch.histc) or is_method(counts, "histc"):
        bins, lo, hi = arg(counts, 1, "bins", 100), arg(counts, 2, "min", 0), arg(counts, 3, "max", 0)
        if bins != num_experts or lo != 0 or hi not in (num_experts - 1, num_experts):
            raise Reject(f"{counts.name}: histc(bins={bins}, min={lo}, max={hi}) does not count E={num_experts} experts")
    elif is_fn(counts, torch.bincount) or is_method(counts, "bincount"):
        if arg(counts, 1, "weights") is not None or arg(counts, 2, "minlength", 0) != num_experts:
            raise Reject(f"{counts.name}: bincount without minlength=E={num_experts} (or with weights)")
    else:
        raise Reject(f"offs {getattr(offs, 'name', offs)} is not cumsum(histc|bincount(expert ids)) ({counts.target})")
    nodes.add(counts)
    src = counts.args[0]
    ids = _strip_any_cast(src)
    n = src
    while n is not ids:
        nodes.add(n)
        n = n.args[0]
    return ids


def sort_perm(perm):
    """perm = sort(ids)[1] | argsort(ids) -> (sort node or None, flat ids node)."""
    s = getitem_of(perm, 1)
    if s is not None and (is_fn(s, torch.sort) or is_method(s, "sort")):
        if arg(s, 1, "dim", -1) not in (-1, 0) or arg(s, 2, "descending", False) or s.kwargs.get("descending"):
            raise Reject(f"{s.name}: not an ascending sort of the flat expert ids")
        return s, s.args[0]
    if is_fn(perm, torch.argsort) or is_method(perm, "argsort"):
        if perm.kwargs.get("descending") or arg(perm, 1, "dim", -1) not in (-1, 0):
            raise Reject(f"{perm.name}: not an ascending argsort of the flat expert ids")
        return None, perm.args[0]
    raise Reject(f"{getattr(perm, 'name', perm)} is not the permutation of a sort of the expert ids")


def token_index(idx, nodes: set):
    """idx = perm // K (floordiv or div(rounding_mode='floor')) -> (perm, K)."""
    if is_fn(idx, operator.floordiv) or is_method(idx, "__floordiv__"):
        perm, k = idx.args
    elif (is_fn(idx, torch.div) or is_method(idx, "div")) and idx.kwargs.get("rounding_mode") == "floor":
        perm, k = idx.args[:2]
    else:
        raise Reject(f"{getattr(idx, 'name', idx)}: the dispatch index is not perm // K")
    nodes.add(idx)
    return perm, k


def dispatch(xs, nodes: set):
    """xs = x[perm // K] or gather(x, 0, (perm // K).reshape(-1, 1).expand(-1, H)) -> (x, idx)."""
    xs = strip_noop_casts(xs)
    if is_fn(xs, operator.getitem) and isinstance(xs.args[1], fx.Node):
        x, idx = xs.args
    elif (is_fn(xs, torch.gather) or is_method(xs, "gather")) and arg(xs, 1, "dim") == 0:
        x, e = xs.args[0], arg(xs, 2, "index")
        idx = expanded_column(e, shape(x)[1] if shape(x) else None, nodes)
    else:
        raise Reject(f"{getattr(xs, 'name', xs)}: the GEMM input is not x gathered by a permutation")
    nodes.add(xs)
    return x, idx


def expanded_column(e, H, nodes: set):
    """e = idx.reshape(-1, 1).expand(-1, H) (or idx[:, None].expand) -> idx."""
    if not (is_method(e, "expand", "expand_as")):
        raise Reject(f"{getattr(e, 'name', e)}: index is not idx.reshape(-1, 1).expand(-1, H)")
    col = e.args[0]
    if not (is_method(col, "reshape", "view", "unsqueeze") and shape(col) is not None and len(shape(col)) == 2
            and same(shape(col)[1], 1)) or not same_shape(shape(e), (shape(col)[0], H)):
        raise Reject(f"{e.name}: index is not a [N, 1] column expanded to [N, H]")
    nodes.update((e, col))
    return col.args[0]


def check_routing_shapes(x, te, k, num_experts):
    sx, ste = shape(x), shape(te)
    if sx is None or len(sx) != 2:
        raise Reject(f"x {getattr(x, 'name', x)} is not [T, H]")
    if ste is None or len(ste) != 2 or not same(ste[0], sx[0]):
        raise Reject(f"top experts {getattr(te, 'name', te)} is not [T, K] (shape {ste})")
    if not same(k, ste[1]):
        raise Reject(f"dispatch divides by {k}, but top experts has K={ste[1]} columns")
    if dtype(te) not in (torch.int32, torch.int64):
        raise Reject(f"top experts {te.name} has dtype {dtype(te)}")


def router_weights_of(sw, perm, te, nodes: set):
    """sw = rw.reshape(-1)[perm] (perm may be None for unsorted formulations) -> rw [T, K]."""
    if perm is not None:
        if not (is_fn(sw, operator.getitem) and sw.args[1] is perm):
            raise Reject(f"{getattr(sw, 'name', sw)}: routing weights are not rw.reshape(-1)[perm]")
        nodes.add(sw)
        sw = sw.args[0]
    rw = flat_source(sw)
    if rw is None:
        raise Reject(f"{getattr(sw, 'name', sw)}: routing weights are not a flattened [T, K] tensor")
    nodes.add(sw)
    if not same_shape(shape(rw), shape(te)):
        raise Reject(f"routing weights {rw.name} have shape {shape(rw)}, top experts {shape(te)}")
    if dtype(rw) not in FLOAT_DTYPES:
        raise Reject(f"routing weights {rw.name} have dtype {dtype(rw)}")
    return rw


def check_weights(x, gate_up, down, num_experts):
    """x [T, H]; gate_up [E, 2I, H] (or a (gate, up) pair of [E, I, H]); down [E, H, I]; one dtype."""
    T, H = shape(x)
    dx = dtype(x)
    if dx not in FLOAT_DTYPES:
        raise Reject(f"x has dtype {dx}")
    sd = shape(down)
    if sd is None or len(sd) != 3 or not same(sd[0], num_experts) or not same(sd[1], H):
        raise Reject(f"down weight {down.name} has shape {sd}, expected [E={num_experts}, H={H}, I]")
    I = sd[2]
    parts = gate_up if isinstance(gate_up, tuple) else (gate_up,)
    rows = I if isinstance(gate_up, tuple) else 2 * I
    for w in parts:
        if not same_shape(shape(w), (num_experts, rows, H)):
            raise Reject(f"weight {w.name} has shape {shape(w)}, expected [{num_experts}, {rows}, {H}]")
    for w in (*parts, down):
        if dtype(w) != dx:
            raise Reject(f"weight {w.name} has dtype {dtype(w)}, x has {dx}")


# ---------------------------------------------------------------------------------------------------
# expert-parallel sentinel masks (transformers' grouped_mm: always applied in 5.17, only under
# `_is_expert_parallel` in later versions). A sorted id >= E is a sentinel: `histc(max=E-1)` leaves it out of
# the offsets, so the GEMMs skip its row, and three fills with one mask `(ids_g >= E).unsqueeze(-1)` zero it:
# in place on the gathered rows (before the first GEMM reads them) and on both GEMM outputs. `ids_g.clamp_(
# max=E-1)` after the last read of `ids_g` only keeps bias gathers in range. Together that is exactly MoK's
# -1 route (no output, no gradient), so the replacement passes `top_experts.masked_fill(top_experts >= E, -1)`.

SENTINEL_FILLS = ("gathered rows", "first GEMM output", "down GEMM output")


def masked_fill_parts(n, inplace: bool):
    """n = src.masked_fill(mask, value) (masked_fill_ when inplace) -> (src, mask, value), else None."""
    if (is_method(n, "masked_fill_") if inplace else (is_method(n, "masked_fill") or is_fn(n, torch.masked_fill))) \
            and len(n.args) >= 2:
        return n.args[0], n.args[1], arg(n, 2, "value")
    return None


def masked_fill_user(src, inplace: bool) -> Optional[fx.Node]:
    """The (first) masked_fill(_) of `src` among its users, else None."""
    for u in src.users:
        mf = masked_fill_parts(u, inplace)
        if mf is not None and mf[0] is src:
            return u
    return None


def _positions(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def sentinel_masks(fills: dict, xs, ids_g, sort, num_experts, nodes: set) -> Optional[str]:
    """Check the sentinel handling found around a grouped block (`fills`: SENTINEL_FILLS -> masked_fill node or
    None; `xs` the gathered rows; `ids_g` the ids the offsets count) -> "sentinel", or None if there is none."""
    present = {k: v for k, v in fills.items() if v is not None}
    clamps = [u for u in ids_g.users if is_method(u, "clamp_", "clip_") and u.args[0] is ids_g] \
        if isinstance(ids_g, fx.Node) else []
    if not present and not clamps:
        return None
    if not present:
        raise Reject(f"{clamps[0].name}: the sorted expert ids are clamped in place without the sentinel masks")
    if len(present) != len(SENTINEL_FILLS):
        missing = [k for k in SENTINEL_FILLS if k not in present]
        raise Reject(f"partial sentinel masks (none on the {', '.join(missing)}); MoK's -1 route equals the "
                     "three masks together")
    if sort is None or getitem_of(ids_g, 0) is not sort:
        raise Reject("sentinel masks, but the offsets do not count the sorted expert ids")
    masks = set()
    for where, n in present.items():
        _, mask, value = masked_fill_parts(n, inplace=(where == SENTINEL_FILLS[0]))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 0:
            raise Reject(f"{n.name}: the {where} are filled with {getattr(value, 'name', value)}, not 0")
        masks.add(mask)
    if len(masks) != 1:
        raise Reject("the gathered rows and the GEMM outputs are masked with different masks")
    (mask,) = masks
    col = unsqueezed_column(mask)
    if col is None:
        raise Reject(f"{getattr(mask, 'name', mask)}: the sentinel mask is not a [N, 1] column")
    ge = col
    if not ((is_fn(ge, operator.ge, torch.ge) or is_method(ge, "ge", "__ge__")) and len(ge.args) == 2):
        raise Reject(f"{getattr(ge, 'name', ge)}: the sentinel mask is not (ids >= E)")
    if ge.args[0] is not ids_g:
        raise Reject(f"{ge.name}: the sentinel mask is not computed from the sorted expert ids {ids_g.name}")
    bound = ge.args[1]
    if isinstance(bound, bool) or not isinstance(bound, (int, torch.SymInt)) or not same(bound, num_experts):
        raise Reject(f"{ge.name}: the sentinel mask is ids >= {getattr(bound, 'name', bound)}, not ids >= E={num_experts}")
    if set(mask.users) != set(present.values()) or set(ge.users) != {mask}:
        raise Reject(f"{mask.name}: the sentinel mask is also used outside the block")
    pos = _positions(ids_g.graph)
    pre = present[SENTINEL_FILLS[0]]
    if any(pos[u] < pos[pre] for u in xs.users if u is not pre):
        raise Reject(f"{xs.name}: the gathered rows are read before their sentinel mask {pre.name}")
    if len(clamps) > 1:
        raise Reject(f"{ids_g.name}: clamped in place more than once")
    for c in clamps:
        lo, hi = arg(c, 1, "min"), arg(c, 2, "max")
        if lo not in (None, 0) or isinstance(hi, bool) or not isinstance(hi, (int, torch.SymInt)) or \
                not same(hi, num_experts - 1):
            raise Reject(f"{c.name}: the sorted ids are clamped to [{lo}, {hi}], not to max=E-1={num_experts - 1}")
        # the block's own reads (the histogram, the mask) must see the unclamped ids; a later reader outside the
        # block (a bias gather) keeps the clamp, which the rewrite leaves in place for it
        late = [u for u in ids_g.users if u is not c and pos[u] > pos[c] and (u in nodes or u is ge)]
        if late:
            raise Reject(f"{late[0].name} reads the sorted expert ids after their in-place clamp {c.name}")
    nodes.update((*present.values(), mask, ge, *clamps))
    return "sentinel"


# ---------------------------------------------------------------------------------------------------
# the grouped core: anchor + body + routing + dispatch


@dataclasses.dataclass
class GroupedCore:
    """What a grouped formulation has before its combine step."""

    x: fx.Node
    idx: fx.Node  # perm // K, the token of each sorted route
    perm: fx.Node
    top_experts: fx.Node
    gate_up: Union[fx.Node, tuple]
    down: fx.Node
    swiglu_limit: Optional[float]
    y_N: fx.Node  # the down GEMM's output (after its sentinel mask, if any), in sorted route order
    uses_fallback: bool
    nodes: set
    ids_map: Optional[str] = None  # "sentinel" when the expert-parallel sentinel masks were matched
    activation: str = "swiglu"
    gate_up_bias: Optional[fx.Node] = None  # GPT-OSS: [E, 2I] (interleaved), gathered by the sorted ids
    down_bias: Optional[fx.Node] = None  # GPT-OSS: [E, H]


def chain(start, end, nodes: set) -> None:
    """Add the nodes from `start` down the first-argument chain to (excluding) `end`."""
    n = start
    while isinstance(n, fx.Node) and n is not end:
        nodes.add(n)
        n = n.args[0] if n.args else None


def grouped_core(offs, gemms: list) -> GroupedCore:
    nodes: set = set(gemms)
    if len(gemms) not in (2, 3):
        _, w, _ = gemm_parts(gemms[-1])
        routing(offs, (shape(w) or (0,))[0], set())  # a non-MoE offs gets the more telling reason
        raise Reject(f"{len(gemms)} grouped GEMMs share offs {getattr(offs, 'name', offs)}; expected 2 (gate_up, down) "
                     "or 3 (gate, up, down)")
    down_gemm = gemms[-1]
    a2, b2, _ = gemm_parts(down_gemm)
    if len(gemms) == 2 and _is_gpt_oss_gate(a2):
        return gpt_oss_core(offs, gemms, nodes)
    down = gemm_weight(down_gemm, b2)
    chain(b2, down, nodes)
    gate, up, limit = swiglu(a2, nodes)
    chain(a2, strip_noop_casts(a2), nodes)
    fills = dict.fromkeys(SENTINEL_FILLS)
    fills[SENTINEL_FILLS[2]] = masked_fill_user(down_gemm, inplace=False)
    if len(gemms) == 2:
        g1 = gemms[0]
        src = chunk_halves(gate, up, nodes)
        mf = masked_fill_parts(src, inplace=False)
        if mf is not None and strip_noop_casts(mf[0]) is g1:  # a sentinel mask, checked below
            fills[SENTINEL_FILLS[1]] = src
            src = mf[0]
        if strip_noop_casts(src) is not g1:
            raise Reject(f"the SwiGLU input {src.name} is not the first grouped GEMM {g1.name}")
        chain(src, g1, nodes)
        a1, b1, _ = gemm_parts(g1)
        gate_up = gemm_weight(g1, b1)
        chain(b1, gate_up, nodes)
    else:
        g_gate, g_up = strip_noop_casts(gate), strip_noop_casts(up)
        if {g_gate, g_up} != set(gemms[:2]):
            raise Reject(f"silu(gate) * up does not take its operands from the grouped GEMMs {gemms[0].name}, {gemms[1].name}")
        chain(gate, g_gate, nodes)
        chain(up, g_up, nodes)
        ag, bg, _ = gemm_parts(g_gate)
        au, bu, _ = gemm_parts(g_up)
        if strip_noop_casts(ag) is not strip_noop_casts(au):
            raise Reject(f"gate GEMM {g_gate.name} and up GEMM {g_up.name} read different inputs")
        wg, wu = gemm_weight(g_gate, bg), gemm_weight(g_up, bu)
        chain(bg, wg, nodes)
        chain(bu, wu, nodes)
        gate_up = (wg, wu)
        a1 = ag
    num_experts = shape(down)[0]
    x, idx, perm, te, ids, sort, xs = routed_input(a1, offs, num_experts, nodes)
    fills[SENTINEL_FILLS[0]] = masked_fill_user(xs, inplace=True)
    check_weights(x, gate_up, down, num_experts)
    ids_map = sentinel_masks(fills, xs, ids, sort, num_experts, nodes)
    y_N = fills[SENTINEL_FILLS[2]] if ids_map is not None else down_gemm
    uses_fallback = any(is_fn(g, *_hf_fallback_targets()) for g in gemms)
    return GroupedCore(x, idx, perm, te, gate_up, down, limit, y_N, uses_fallback, nodes, ids_map)


def routed_input(a1, offs, num_experts, nodes: set):
    """The first GEMM's input a1 = x[perm // K] with offs counting the sorted ids -> (x, idx, perm, top_experts,
    ids the offsets count, sort node or None, the gathered rows)."""
    ids = routing(offs, num_experts, nodes)
    xs = strip_noop_casts(a1)
    chain(a1, xs, nodes)
    if _is_mul(xs):
        raise Reject(f"{xs.name}: router weights are applied to the expert inputs (score before experts); "
                     "MoK scales the expert outputs")
    x, idx = dispatch(xs, nodes)
    perm, k = token_index(idx, nodes)
    sort, te_flat = sort_perm(perm)
    te = flat_source(te_flat)
    if te is None:
        raise Reject(f"{getattr(te_flat, 'name', te_flat)}: sorted ids are not top_experts.reshape(-1)")
    ok_ids = ids is te_flat or flat_source(ids) is te or (sort is not None and getitem_of(ids, 0) is sort)
    if not ok_ids:
        raise Reject(f"the expert counts are taken from {getattr(ids, 'name', ids)}, not from the ids that were sorted")
    nodes.update(n for n in (perm, te_flat, sort, ids if getitem_of(ids, 0) is sort else None) if n is not None)
    check_routing_shapes(x, te, k, num_experts)
    return x, idx, perm, te, ids, sort, xs


# ---------------------------------------------------------------------------------------------------
# GPT-OSS's experts (transformers' GptOssExperts: is_transposed=True, has_bias=True, its own _apply_gate), as
# the grouped_mm backend traces them:
#
#     out = grouped_mm(xs, gate_up_proj [E, H, 2I], offs); out.add_(gate_up_proj_bias[ids_g])
#     gate, up = out[..., ::2].clamp(max=L), out[..., 1::2].clamp(-L, L)
#     h = (up + 1) * (gate * sigmoid(gate * alpha))
#     y = grouped_mm(h, down_proj [E, I, H], offs); y.add_(down_proj_bias[ids_g])      (then HF's combine)
#
# = mok::moe(activation="gpt_oss", swiglu_limit=L) with alpha = 1.702, the weights and the FC1 bias as
# zero-copy [E, 2, I, H] / [E, H, I] / [E, 2, I] views (the bias enters before the routing weight, as in MoK).

GPT_OSS = ACTIVATIONS["gpt_oss"]  # g * sigmoid(alpha g) * (u + beta): alpha = 1.702, beta = 1 (docs/semantics.md)


def _plus_const(n):
    """n = a + c (c a number) -> (a, c), else None."""
    if (is_fn(n, operator.add, torch.add) or is_method(n, "add", "__add__", "__radd__")) and len(n.args) == 2:
        a, c = n.args
        if isinstance(a, (int, float)) and isinstance(c, fx.Node):
            a, c = c, a
        if isinstance(a, fx.Node) and isinstance(c, (int, float)) and not isinstance(c, bool) and \
                n.kwargs.get("alpha", 1) == 1:
            return a, c
    return None


def _is_gpt_oss_gate(h) -> bool:
    """Whether the down GEMM input looks like GPT-OSS's gate `(up + beta) * glu` (checked in gpt_oss_body)."""
    h = strip_noop_casts(h)
    return isinstance(h, fx.Node) and _is_mul(h) and len(h.args) == 2 and \
        any(isinstance(a, fx.Node) and _plus_const(a) is not None for a in h.args)


def _is_sigmoid(n) -> bool:
    return is_fn(n, torch.sigmoid, F.sigmoid) or is_method(n, "sigmoid")


def _scaled_by_const(n, src):
    """n = src * c (either order, c a number) -> c, else None."""
    if not _is_mul(n) or len(n.args) != 2:
        return None
    a, b = n.args
    if a is src and isinstance(b, (int, float)) and not isinstance(b, bool):
        return b
    if b is src and isinstance(a, (int, float)) and not isinstance(a, bool):
        return a
    return None


def _interleaved_half(n, first: int):
    """n = t[..., first::2] -> t, else None."""
    if not (is_fn(n, operator.getitem) and isinstance(n.args[1], tuple) and len(n.args[1]) == 2):
        return None
    ell, sl = n.args[1]
    if ell is not Ellipsis or not isinstance(sl, slice) or sl.step != 2 or (sl.start or 0) != first or \
            sl.stop is not None:
        return None
    return n.args[0]


def bias_add(gemm: fx.Node, rows: int, nodes: set):
    """The in-place `gemm.add_(bias[ids])` right after a grouped GEMM -> (bias [E, rows], ids), or (None, None)."""
    adds = [u for u in gemm.users if is_method(u, "add_") and u.args[0] is gemm]
    if not adds:
        return None, None
    add = adds[0]
    if len(adds) > 1 or len(add.args) != 2 or add.kwargs:
        raise Reject(f"{gemm.name}: more than one in-place add on the grouped GEMM output")
    g = add.args[1]
    if not (is_fn(g, operator.getitem) and isinstance(g.args[1], fx.Node) and len(shape(g.args[0]) or ()) == 2):
        raise Reject(f"{add.name}: the GEMM output's in-place add is not a per-expert bias bias[ids]")
    bias, ids = g.args
    if not same(shape(bias)[1], rows):
        raise Reject(f"{add.name}: bias {bias.name} has shape {shape(bias)}, {rows} columns expected")
    pos = _positions(gemm.graph)
    if any(pos[u] < pos[add] for u in gemm.users if u is not add):
        raise Reject(f"{gemm.name}: read before its bias {add.name} is added")
    nodes.update((add, g))
    return bias, ids


def gpt_oss_body(h, nodes: set):
    """h = (up + 1) * (gate * sigmoid(gate * 1.702)), gate/up the interleaved halves of one tensor (clamped as
    swiglu_limit's form or not at all) -> (swiglu_limit, that tensor, stripped of no-op casts)."""
    h0 = strip_noop_casts(h)
    chain(h, h0, nodes)
    a, b = h0.args
    up_beta, glu = (a, b) if isinstance(a, fx.Node) and _plus_const(a) is not None else (b, a)
    up_c, beta = _plus_const(up_beta)
    if beta != GPT_OSS.beta:
        raise Reject(f"{h0.name}: GPT-OSS-style gate with (up + {beta}); MoK's \"gpt_oss\" activation has "
                     f"(up + {GPT_OSS.beta:g})")
    if not (isinstance(glu, fx.Node) and _is_mul(glu) and len(glu.args) == 2):
        raise Reject(f"{h0.name}: (up + 1) does not multiply gate * sigmoid(alpha * gate)")
    ga, gb = glu.args
    sig, gate_c = (ga, gb) if _is_sigmoid(ga) else (gb, ga)
    if not _is_sigmoid(sig) or not isinstance(gate_c, fx.Node):
        raise Reject(f"{glu.name}: (up + 1) does not multiply gate * sigmoid(alpha * gate)")
    alpha = _scaled_by_const(sig.args[0], gate_c)
    if alpha is None:
        raise Reject(f"{sig.name}: the sigmoid does not read alpha * gate with a constant alpha")
    if alpha != GPT_OSS.alpha:
        raise Reject(f"{sig.name}: GPT-OSS-style gate with alpha = {alpha}; MoK's \"gpt_oss\" activation has "
                     f"alpha = {GPT_OSS.alpha}")
    nodes.update((h0, up_beta, glu, sig, sig.args[0]))
    gate, up, limit = _unclamped(gate_c, up_c, h0.name, nodes)
    src_g, src_u = _interleaved_half(gate, 0), _interleaved_half(up, 1)
    if src_g is None or src_u is None or src_g is not src_u:
        if _interleaved_half(gate, 1) is not None and _interleaved_half(up, 0) is _interleaved_half(gate, 1):
            raise Reject(f"{h0.name}: gate/up interleaved halves swapped (gate = [..., 1::2])")
        raise Reject(f"{h0.name}: GPT-OSS-style gate whose gate/up are not the interleaved halves [..., ::2] / "
                     "[..., 1::2] of one GEMM output")
    nodes.update((gate, up))
    src = strip_noop_casts(src_g)
    chain(src_g, src, nodes)
    return limit, src


def gpt_oss_core(offs, gemms: list, nodes: set) -> GroupedCore:
    """GPT-OSS's grouped experts (the block comment above) -> the GroupedCore with activation "gpt_oss"."""
    g1, g2 = gemms
    a2, w2, _ = gemm_parts(g2)
    a1, w1, _ = gemm_parts(g1)
    limit, src = gpt_oss_body(a2, nodes)
    mf = masked_fill_parts(src, inplace=False)
    if mf is not None and strip_noop_casts(mf[0]) is g1:
        raise Reject(f"{src.name}: expert-parallel sentinel masks on GPT-OSS experts (with biases) are not matched yet")
    if src is not g1:
        raise Reject(f"the GPT-OSS gate input {src.name} is not the first grouped GEMM {g1.name}")
    for g, w in ((g1, w1), (g2, w2)):
        if transposed_last2(w) is not None:
            raise Reject(f"{g.name}: GPT-OSS-style gate with [E, out, in] weights {w.name}; MoK matches GPT-OSS's "
                         "[E, in, out] layout (is_transposed=True) there")
        if len(shape(w) or ()) != 3:
            raise Reject(f"{g.name}: weight {getattr(w, 'name', w)} is not 3-D")
    num_experts, H, two_i = shape(w1)
    b1, ids1 = bias_add(g1, two_i, nodes)
    b2, ids2 = bias_add(g2, H, nodes)
    x, idx, perm, te, ids, sort, xs = routed_input(a1, offs, num_experts, nodes)
    if (b1 is None) != (b2 is None):
        raise Reject(f"{g1.name}: GPT-OSS experts with only one of the two biases")
    for bi in (ids1, ids2):
        if bi is not None and not (bi is ids or (sort is not None and getitem_of(bi, 0) is sort)):
            raise Reject(f"{bi.name}: the biases are gathered with other ids than the sorted expert ids")
    if masked_fill_user(xs, inplace=True) is not None or masked_fill_user(g2, inplace=False) is not None or \
            any(is_method(u, "clamp_", "clip_") for u in getattr(ids, "users", ())):
        raise Reject("expert-parallel sentinel masks on GPT-OSS experts (with biases) are not matched")
    T, Hx = shape(x)
    if dtype(x) not in FLOAT_DTYPES:
        raise Reject(f"x has dtype {dtype(x)}")
    I = two_i // 2 if isinstance(two_i, int) else None
    if not same(Hx, H) or I is None or 2 * I != two_i:
        raise Reject(f"gate_up weight {w1.name} has shape {shape(w1)}, expected [E, H={Hx}, 2I]")
    if not same_shape(shape(w2), (num_experts, I, H)):
        raise Reject(f"down weight {w2.name} has shape {shape(w2)}, expected [E={num_experts}, I={I}, H={H}]")
    for t, want in ((b1, (num_experts, two_i)), (b2, (num_experts, H))):
        if t is not None and not same_shape(shape(t), want):
            raise Reject(f"bias {t.name} has shape {shape(t)}, expected {list(want)}")
    for t in (w1, w2, b1, b2):
        if t is not None and dtype(t) != dtype(x):
            raise Reject(f"{t.name} has dtype {dtype(t)}, x has {dtype(x)}")
    uses_fallback = any(is_fn(g, *_hf_fallback_targets()) for g in gemms)
    return GroupedCore(x, idx, perm, te, w1, w2, limit, g2, uses_fallback, nodes, None, "gpt_oss", b1, b2)


def unsqueezed_column(n):
    """n = t.unsqueeze(-1) / t.unsqueeze(1) / t.reshape(-1, 1) / t.view(-1, 1) of a 1-D t -> t."""
    if is_method(n, "unsqueeze") or is_fn(n, torch.unsqueeze):
        if arg(n, 1, "dim") in (-1, 1) and len(shape(n.args[0]) or (0, 0)) == 1:
            return n.args[0]
    if is_method(n, "reshape", "view") and tuple(n.args[1:]) in ((-1, 1),) and len(shape(n.args[0]) or (0, 0)) == 1:
        return n.args[0]
    return None


def scaled_by(n, y) -> Optional[fx.Node]:
    """If n = y * col (either order) with col a [N, 1] column of a 1-D tensor, return that 1-D tensor."""
    if not _is_mul(n) or len(n.args) != 2:
        return None
    a, b = n.args
    other = b if strip_noop_casts(a) is y or a is y else (a if strip_noop_casts(b) is y or b is y else None)
    return unsqueezed_column(other) if isinstance(other, fx.Node) else None
