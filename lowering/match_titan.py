"""A torchtitan-style MoE (torchtitan/models/moe: TokenReorderer + GroupedExperts), as Dynamo captures it:

    scores_TE = softmax(router(x)); top_scores, ids_TK = topk(scores_TE, K)       # or scores_TE.gather(1, ids_TK)
    counts = histc(ids_TK.view(-1).float(), bins=E, min=0, max=E) | bincount(ids_TK.view(-1), minlength=E)
    perm = argsort(ids_TK.view(-1), stable=True); sw = top_scores.view(-1)[perm]; idx = perm // K
    xs = gather(x, 0, idx.reshape(-1, 1).expand(-1, H))                           # or x[idx]
    offs = cumsum(counts, dim=0, dtype=int32)
    h = silu(grouped_mm(xs, w1.transpose(-2, -1), offs)) * grouped_mm(xs, w3.transpose(-2, -1), offs)
    y = grouped_mm(h, w2.transpose(-2, -1), offs) * sw.reshape(-1, 1)
    out = zeros_like(x).scatter_add(0, idx.reshape(-1, 1).expand(-1, H), y)        # or index_add(0, idx, y)

w1 (gate) and w3 (up) are separate [E, I, H] parameters, so the rewrite concatenates them into MoK's
[E, 2I, H] (one copy per step; see docs/patterns.md). `score_before_experts=True` (the scores multiply the
expert *inputs*) computes something else and is rejected.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ._experts import GroupedCore, MoEMatch, expanded_column, router_weights_of, scaled_by, token_index
from ._fx import Reject, arg, is_fn, is_method, same_shape, shape


def _is_zeros_like(base, x) -> bool:
    if is_fn(base, torch.zeros_like) and base.args[0] is x:
        return True
    if is_fn(base, torch.zeros) and same_shape(shape(base), shape(x)):
        return True
    if is_method(base, "new_zeros") and same_shape(shape(base), shape(x)):
        return True
    return False


def _same_token_index(i, core: GroupedCore, nodes: set) -> bool:
    if i is core.idx:
        return True
    try:
        perm, k = token_index(i, nodes)
    except Reject:
        return False
    perm0, k0 = core.idx.args[:2]
    return perm is perm0 and k == k0


def combine(core: GroupedCore) -> MoEMatch:
    nodes = set(core.nodes)
    T, H = shape(core.x)
    ys = [core.y_N] + [u for u in core.y_N.users if is_method(u, "type_as", "to") and u.args[0] is core.y_N]
    for y in ys:
        for m in y.users:
            sw = scaled_by(m, y)
            if sw is None:
                continue
            rw = router_weights_of(sw, core.perm, core.top_experts, nodes)
            nodes.update((y, m, *[a for a in m.args if isinstance(a, fx.Node) and a is not y]))
            for sc in m.users:
                if (is_method(sc, "scatter_add") or is_fn(sc, torch.scatter_add)) and arg(sc, 1, "dim") == 0 and \
                        arg(sc, 3, "src") is m:
                    i = expanded_column(arg(sc, 2, "index"), H, nodes)
                elif (is_method(sc, "index_add") or is_fn(sc, torch.index_add)) and arg(sc, 1, "dim") == 0 and \
                        arg(sc, 3, "source") is m and arg(sc, 4, "alpha", 1) == 1:
                    i = arg(sc, 2, "index")
                else:
                    continue
                if not _same_token_index(i, core, nodes):
                    raise Reject(f"{sc.name}: outputs are scattered to other rows than the tokens they came from")
                if not _is_zeros_like(sc.args[0], core.x):
                    raise Reject(f"{sc.name}: outputs are added into {sc.args[0].name}, not into zeros")
                nodes.update((sc, sc.args[0]))
                return MoEMatch("titan_grouped_mm", sc, core.x, rw, core.top_experts, core.gate_up, core.down,
                                core.swiglu_limit, None, nodes, activation=core.activation,
                                gate_up_bias=core.gate_up_bias, down_bias=core.down_bias)
            raise Reject(f"{m.name}: the weighted outputs are not scatter-added back to their tokens")
    raise Reject(f"{core.y_N.name}: the down GEMM output is not scaled by the sorted routing weights")
