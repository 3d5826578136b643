"""The graph pass: find MoE blocks in Dynamo's torch-level graph and replace each with one `mok::moe` call.

It runs before AOTAutograd (`torch._inductor.config.pre_grad_custom_pass`, or inside `backend="mok"`), so
the replaced block's backward is MoK's own `mok::moe_bwd`. Each formulation is a hand-written matcher
(`match_hf`, `match_titan`; shared parts in `_experts`, shared-expert fusion in `match_shared`) that checks
structure, dtypes and shapes (from `node.meta["example_value"]`) and raises `Reject` with a reason on anything
MoK does not compute. Nothing is rewritten unless the whole block matched.

Observability:
- `torch._dynamo.utils.counters["mok_inductor"]["moe_replaced"]` (and `["moe_rejected"]`);
- every match and rejection, with its reason and the user's source line, is logged once per process through
  the `torch._logging` artifact "mok_patterns" (off by default): `torch._logging.set_logs(
  modules={"mok_patterns": True})` after `mok_inductor.enable()`. `mok_inductor.options.current().log_patterns`
  (`MOK_PATTERNS_LOG=1`) prints the same lines to stderr where torch's logging does not show the artifact.
  `TORCH_LOGS="+mok_patterns"` cannot work: torch parses TORCH_LOGS at `import torch`, before any other
  package can register an artifact, and rejects names it does not know;
- `rewrite(graph)` returns the same records as `MatchRecord`s; `MokPatternPass.last_records` keeps the last.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import sys
from typing import Optional

import torch
import torch._logging._internal as _tlog
import torch.fx as fx
from torch._dynamo.utils import counters

from .. import options
from . import cache, match_hf, match_shared, match_titan
from ._experts import MoEMatch, group_by_offs, grouped_core
from ._fx import Reject, check_not_mutated, is_mutating, shape, source_line, val

ARTIFACT = "mok_patterns"
# (torch exports these two only from `_internal`, where its own registrations import them from)
_tlog.register_artifact(
    ARTIFACT, "mok-inductor's MoE graph pass: each block replaced by mok::moe, and why each other candidate was "
    "left alone", off_by_default=True)
# torch attaches its log handler only to registered logs: without this the artifact's lines would reach no handler
_tlog.register_log("mok_inductor", "mok_inductor")
_log = torch._logging.getArtifactLogger(__name__, ARTIFACT)


def _report(records) -> None:
    """Log each record once per process: through the artifact when torch's logging enables it, else to stderr
    while `options.log_patterns` is on, else nowhere (the counters and `rewrite`'s result still say it)."""
    # torch enables an off-by-default artifact by letting its logger propagate at DEBUG
    to_torch = _log.propagate and _log.isEnabledFor(logging.DEBUG)
    if to_torch or options.current().log_patterns:
        for r in records:
            _say(str(r), to_torch)


@functools.lru_cache(maxsize=None)
def _say(message: str, to_torch: bool) -> None:
    # cached, so a recompile of the same code (new shapes, a second model instance) repeats nothing
    if to_torch:
        _log.debug("%s", message)
    else:
        print(f"[{ARTIFACT}] {message}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class MatchRecord:
    formulation: str  # e.g. "hf_grouped_mm", "hf_batched_mm", "titan_grouped_mm"
    anchor: str  # the node the matcher started from
    replaced: bool
    detail: str  # what matched (shapes) or why it was rejected
    where: Optional[str] = None  # the user's source line of the anchor ("file.py:LINE in func"), when known

    def __str__(self) -> str:
        at = self.anchor if self.where is None else f"{self.anchor} ({self.where})"
        return f"{'replaced' if self.replaced else 'rejected'} {self.formulation} at {at}: {self.detail}"


# ---------------------------------------------------------------------------------------------------
# finding


def _find(graph: fx.Graph):
    """-> ([MoEMatch], [MatchRecord of rejections])."""
    matches, rejected = [], []
    for offs, gemms in group_by_offs(graph).items():
        anchor = gemms[-1].name
        try:
            core = grouped_core(offs, gemms)
            errors = []
            for combine in (match_hf.combine_grouped, match_titan.combine):
                try:
                    matches.append(combine(core))
                    break
                except Reject as e:
                    errors.append(str(e))
            else:
                raise Reject(" / ".join(errors))
        except Reject as e:
            rejected.append(MatchRecord("grouped_mm", anchor, False, str(e), source_line(gemms[-1])))
    for b2 in match_hf.bmm_candidates(graph):
        try:
            matches.append(match_hf.match_batched(b2))
        except Reject as e:
            rejected.append(MatchRecord("hf_batched_mm", b2.name, False, str(e), source_line(b2)))
    return matches, rejected


# ---------------------------------------------------------------------------------------------------
# replacing


def _fake(fn, *args, **kwargs):
    try:
        return fn(*(val(a) if isinstance(a, fx.Node) else a for a in args), **kwargs)
    except Exception:
        return None


def _cat(graph: fx.Graph, parts, dim: int) -> fx.Node:
    n = graph.call_function(torch.cat, ([*parts],), {"dim": dim})
    ev = _fake(lambda *ts: torch.cat(ts, dim=dim), *parts)
    if ev is not None:
        n.meta["example_value"] = ev
    return n


def _inputs(m: MoEMatch) -> list:
    ins = [m.x, m.router_weights, m.top_experts, m.down, *(b for b in (m.gate_up_bias, m.down_bias) if b is not None)]
    ins += list(m.gate_up) if isinstance(m.gate_up, tuple) else [m.gate_up]
    if m.shared is not None:
        ins += [w for w in m.shared if w is not None]
    return ins


def _erase_unused(graph: fx.Graph, nodes: set) -> None:
    for n in reversed(list(graph.nodes)):
        if n not in nodes or n.users or n.op in ("placeholder", "output", "get_attr"):
            continue
        # an in-place write (inv_perm[perm] = arange) may go only when nothing else reads what it wrote
        target = n.args[0] if n.args and isinstance(n.args[0], fx.Node) and is_mutating(n, n.args[0]) else None
        if target is not None and any(u is not n and u not in nodes for u in target.users):
            continue
        graph.erase_node(n)


def _method(graph: fx.Graph, name: str, *args) -> fx.Node:
    n = graph.call_method(name, args)
    ev = _fake(lambda t, *rest: getattr(t, name)(*rest), *args)
    if ev is not None:
        n.meta["example_value"] = ev
    return n


def _mapped_ids(graph: fx.Graph, m: MoEMatch) -> fx.Node:
    """top_experts as the matched block's experts saw them (`MoEMatch.ids_map`), in MoK's convention."""
    te = m.top_experts
    if m.ids_map is None:
        return te
    E = shape(m.down)[0]
    out = te
    if m.ids_map in ("clamp", "clamp_sentinel"):
        out = _method(graph, "clamp", te, 0, E - 1)
    if m.ids_map in ("sentinel", "clamp_sentinel"):
        sentinel = graph.call_function(operator.ge, (te, E))
        ev = _fake(operator.ge, te, E)
        if ev is not None:
            sentinel.meta["example_value"] = ev
        out = _method(graph, "masked_fill", out, sentinel, -1)
    return out


def _gpt_oss_views(graph: fx.Graph, m: MoEMatch):
    """GPT-OSS's checkpoint layout as mok::moe takes it, zero-copy: the interleaved [E, H, 2I] FC1 as
    [E, 2, I, H], the [E, I, H] FC2 as [E, H, I], the interleaved [E, 2I] FC1 bias as [E, 2, I]
    (docs/semantics.md); gradients flow back through the views to the parameters."""
    gate_up = _method(graph, "permute", _method(graph, "unflatten", m.gate_up, -1, (-1, 2)), 0, 3, 2, 1)
    down = _method(graph, "transpose", m.down, 1, 2)
    b1 = None
    if m.gate_up_bias is not None:
        b1 = _method(graph, "transpose", _method(graph, "unflatten", m.gate_up_bias, -1, (-1, 2)), 1, 2)
    return gate_up, down, b1


def _replace(graph: fx.Graph, m: MoEMatch) -> fx.Node:
    with graph.inserting_before(m.output):
        top_experts = _mapped_ids(graph, m)
        gate_up = _cat(graph, m.gate_up, 1) if isinstance(m.gate_up, tuple) else m.gate_up
        down, variant = m.down, {}
        if m.activation == "gpt_oss":
            gate_up, down, b1 = _gpt_oss_views(graph, m)
            variant = {"activation": m.activation, "gate_up_bias": b1, "down_bias": m.down_bias}
        sgu = sd = sog = None
        if m.shared is not None:
            wsg, wsu, sd, sog = m.shared
            sgu = _cat(graph, (wsg, wsu), 0)
        new = graph.call_function(
            torch.ops.mok.moe.default,
            (m.x, m.router_weights, top_experts, gate_up, down, sgu, sd, sog, m.swiglu_limit),
            variant,
        )
        if m.out_view is not None:  # back to the shape of the replaced node, with the view's own arguments
            new.meta["example_value"] = m.out_view.args[0].meta.get("example_value")
            new = graph.call_method(m.out_view.target, (new, *m.out_view.args[1:]), dict(m.out_view.kwargs))
    for k in ("example_value", "stack_trace", "nn_module_stack", "source_fn_stack", "val"):
        if k in m.output.meta:
            new.meta[k] = m.output.meta[k]
    m.output.replace_all_uses_with(new)
    _erase_unused(graph, m.nodes | {m.output})
    return new


def rewrite(graph: fx.Graph) -> list[MatchRecord]:
    """Replace every MoE block of `graph` (a Dynamo graph) that matches; return what matched and what not."""
    import mok_inductor.ops  # noqa: F401  (registers mok::moe)

    matches, records = _find(graph)
    claimed: set = set()
    for m in matches:
        why = match_shared.fuse(m)
        if why is not None:
            records.append(MatchRecord(m.formulation + "+shared", m.output.name, False,
                                       f"shared expert left unfused: {why}", source_line(m.output)))
        try:
            check_not_mutated(m.nodes | set(_inputs(m)), allowed=m.nodes)
            if m.nodes & claimed:
                raise Reject("overlaps a block already replaced")
        except Reject as e:
            records.append(MatchRecord(m.formulation, m.output.name, False, str(e), source_line(m.output)))
            continue
        claimed |= m.nodes
        desc, where = m.describe(), source_line(m.output)
        new = _replace(graph, m)
        counters["mok_inductor"]["moe_replaced"] += 1
        records.append(MatchRecord(m.formulation, new.name, True, desc, where))
    for r in records:
        if not r.replaced:
            counters["mok_inductor"]["moe_rejected"] += 1
    _report(records)
    if any(r.replaced for r in records):
        graph.lint()
        if isinstance(graph.owning_module, fx.GraphModule):
            graph.owning_module.recompile()
    return records


# ---------------------------------------------------------------------------------------------------
# the Inductor pass and the global switch


class MokPatternPass(cache.CustomGraphPass):
    """`pre_grad_custom_pass` entry. In 2.11's single slot it runs the pass that was there first (`chained`);
    on torch >= 2.12 it is appended to the slot's list and `chained` is None."""

    def __init__(self, chained=None):
        self.chained = chained
        self.previous = None
        self.active = True
        self.last_records: list[MatchRecord] = []

    def __call__(self, graph: fx.Graph) -> None:
        for p in cache.as_tuple(self.chained):
            p(graph)
        if self.active:
            self.last_records = rewrite(graph)

    def uuid(self) -> Optional[str]:
        mine = f"mok-patterns:{'on' if self.active else 'off'}:{cache.fingerprint()}"
        return cache.chained_uuid(mine, cache.as_tuple(self.chained))


def _ours() -> Optional[MokPatternPass]:
    from torch._inductor import config

    return cache.find_in_slot(config.pre_grad_custom_pass, MokPatternPass)


def enable() -> None:
    """Install the pass in `torch._inductor.config.pre_grad_custom_pass` (idempotent, keeps what is there).
    `mok_inductor.enable()` installs it together with the cache key."""
    ours = _ours()
    if ours is not None:
        ours.active = True
        return
    cache.add_to_slot("pre_grad_custom_pass", MokPatternPass)


def disable() -> None:
    """Remove the pass (restoring the slot's previous value); if another pass was chained on top of ours,
    only deactivate it."""
    ours = _ours()
    if ours is not None and not cache.remove_from_slot("pre_grad_custom_pass", MokPatternPass):
        ours.active = False


def is_enabled() -> bool:
    ours = _ours()
    return ours is not None and ours.active
