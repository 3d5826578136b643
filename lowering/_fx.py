"""Small helpers for reading Dynamo (torch-level, pre-AOTAutograd) FX graphs.

Dynamo graphs mix three node spellings for the same computation: `call_function` on a torch function
(`torch.sort`, `F.silu`, `operator.getitem`), `call_method` on a tensor (`x.view(...)`, `x.chunk(...)`) and,
rarely, `call_function` on an aten overload. The helpers here hide that difference so the matchers read
as the math they look for. Shapes come from `node.meta["example_value"]` (fake tensors, possibly symbolic);
sizes are compared with `statically_known_true` so a match never adds a guard after Dynamo finished.
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx as fx


class Reject(Exception):
    """A candidate block was found but must not be replaced; the message says why (it is logged)."""


def val(node: Any):
    """The fake value of a node (a FakeTensor, SymInt, tuple ...), or the constant itself."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def source_line(node: Any) -> Optional[str]:
    """Where the user's code wrote `node`: "file.py:LINE in func" of the innermost frame of its Dynamo stack
    trace, or None (a node the pass inserted, or a graph traced without stack traces)."""
    trace = node.meta.get("stack_trace") if isinstance(node, fx.Node) else None
    frames = _FRAME.findall(trace or "")
    if not frames:
        return None
    file, line, func = frames[-1]
    return f"{os.path.basename(file)}:{line} in {func}"


def shape(node: Any) -> Optional[tuple]:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Any) -> Optional[torch.dtype]:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def same(a: Any, b: Any) -> bool:
    """a == b for ints/SymInts without adding guards (unknown counts as different)."""
    if isinstance(a, fx.Node):
        a = val(a)
    if isinstance(b, fx.Node):
        b = val(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:
        return False


def same_shape(a: Optional[Sequence], b: Sequence) -> bool:
    return a is not None and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def is_fn(node: Any, *targets) -> bool:
    """node is call_function with one of `targets` (None entries are ignored)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and any(
        t is not None and node.target is t for t in targets)


def is_method(node: Any, *names: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument; for call_method, index 0 is the tensor itself."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def getitem_of(node: Any, index: int) -> Optional[fx.Node]:
    """If node is `src[index]` (operator.getitem with an int), return src."""
    if is_fn(node, operator.getitem) and node.args[1] == index:
        return node.args[0]
    return None


def strip_noop_casts(node: Any) -> Any:
    """Skip `.to(dtype)` / `.type_as(...)` / `.float()`-style casts that do not change the dtype."""
    while isinstance(node, fx.Node):
        if is_method(node, "to", "type", "type_as", "float", "bfloat16", "half", "contiguous") and \
                not node.kwargs.get("copy", False):
            src = node.args[0]
            if dtype(src) is not None and dtype(src) == dtype(node) and \
                    (node.target != "to" or all(not isinstance(a, torch.device) for a in node.args[1:])):
                node = src
                continue
        return node
    return node


def strip_views(node: Any) -> Any:
    """Skip view/reshape/flatten nodes whose result has the same shape as their input."""
    while isinstance(node, fx.Node) and is_method(node, "view", "reshape", "contiguous") and \
            same_shape(shape(node.args[0]), shape(node) or ()):
        node = node.args[0]
    return node


def flat_source(node: Any) -> Optional[fx.Node]:
    """If node is `t.reshape(-1)` / `t.view(-1)` / `t.flatten()` (any 2-D t), return t."""
    if is_method(node, "reshape", "view") and len(node.args) == 2 and node.args[1] == -1:
        return node.args[0]
    if is_method(node, "reshape", "view") and len(node.args) == 2 and node.args[1] == (-1,):
        return node.args[0]
    if (is_method(node, "flatten") or is_fn(node, torch.flatten)) and len(node.args) == 1:
        return node.args[0]
    return None


def transposed_last2(node: Any) -> Optional[fx.Node]:
    """If node is `w.transpose(-2, -1)` (or .mT / transpose(1, 2) on a 3-D w), return w."""
    if is_method(node, "transpose") or is_fn(node, torch.transpose):
        dims = tuple(node.args[1:3])
        w = node.args[0]
        nd = len(shape(w) or ())
        norm = tuple(d % nd for d in dims) if nd and all(isinstance(d, int) for d in dims) else dims
        if nd and sorted(norm) == [nd - 2, nd - 1]:
            return w
    if is_method(node, "permute") and len(shape(node.args[0]) or ()) == 3 and tuple(node.args[1:]) in ((0, 2, 1),):
        return node.args[0]
    return None


_INPLACE_FNS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def is_mutating(user: fx.Node, of: fx.Node) -> bool:
    """Whether `user` may write into `of` (an in-place method or operator on it, or an out= argument)."""
    if user.op == "call_method" and isinstance(user.target, str) and user.target.endswith("_") and \
            not user.target.startswith("__") and user.args and user.args[0] is of:
        return True
    if user.op == "call_function" and user.target in _INPLACE_FNS and user.args and user.args[0] is of:
        return True
    if user.kwargs.get("out") is of:
        return True
    return False


def check_not_mutated(nodes: Iterable[fx.Node], allowed: Iterable[fx.Node] = ()) -> None:
    """Raise Reject if an in-place op writes into any node of the block (e.g. a bias `add_`, `masked_fill_`)."""
    allowed = set(allowed)
    for n in nodes:
        if not isinstance(n, fx.Node):
            continue
        for u in n.users:
            if u not in allowed and is_mutating(u, n):
                raise Reject(f"{n.name} is modified in place by {u.name} ({u.target}); "
                             "MoK does not compute that (bias, mask or clamp?)")
