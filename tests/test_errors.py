"""Bad input (docs/semantics.md, the contract): every violation raises TypeError or ValueError naming the argument.

Each test builds a valid call (T=4 tokens, H=8, I=4, Is=6, E=3 experts, K=2 routes), breaks one
argument, asserts the exception type, that the message starts with the argument's name, and pins the
whole message with expecttest (`EXPECTTEST_ACCEPT=1 pytest tests/test_errors.py` rewrites the pins
after a deliberate change of wording). Meta-device tensors stand in for "a tensor on another device".
Out-of-range expert ids are checked eagerly and inside torch.compile(fullgraph=True).
"""

import math
import subprocess
import sys
import unittest

import expecttest
import pytest
import torch

import mok_inductor
from mok_inductor import _checks
from _helpers import make_case


def _good(**overrides):
    """Keyword arguments of a valid mok_inductor.moe call with a shared expert and gate, then overrides."""
    c = make_case(T=4, H=8, I=4, Is=6, E=3, K=2, shared=True, gate=True, limit=None, requires_grad=False)
    kw = dict(x=c.x, router_weights=c.router_weights, top_experts=c.top_experts, gate_up_proj=c.gate_up_proj,
              down_proj=c.down_proj, shared_gate_up_proj=c.shared_gate_up_proj, shared_down_proj=c.shared_down_proj,
              shared_output_gate=c.shared_output_gate, swiglu_limit=None)
    kw.update(overrides)
    return kw


def _call(kw):
    kw = dict(kw)
    args = [kw.pop(n) for n in ("x", "router_weights", "top_experts", "gate_up_proj", "down_proj")]
    return mok_inductor.moe(*args, **kw)


def _op_call(kw):
    return torch.ops.mok.moe(kw["x"], kw["router_weights"], kw["top_experts"], kw["gate_up_proj"], kw["down_proj"],
                             kw["shared_gate_up_proj"], kw["shared_down_proj"], kw["shared_output_gate"],
                             kw["swiglu_limit"])


def _op_schema_accepts(kw) -> bool:
    """Whether torch.ops.mok.moe's schema takes these arguments (the dispatcher rejects non-tensors and
    non-floats itself, before the op's checks), with x and router_weights already flat."""
    tensors = ("x", "router_weights", "top_experts", "gate_up_proj", "down_proj")
    optional = ("shared_gate_up_proj", "shared_down_proj", "shared_output_gate")
    if not all(isinstance(kw[n], torch.Tensor) for n in tensors):
        return False
    if not all(kw[n] is None or isinstance(kw[n], torch.Tensor) for n in optional):
        return False
    limit = kw["swiglu_limit"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))):
        return False
    return kw["x"].dim() == 2 and kw["router_weights"].dim() == 2


def _meta(t):
    return t.to("meta")


class TestBadInput(expecttest.TestCase):
    def raises(self, exc_type, name, fn, *args) -> str:
        """Run fn(*args); assert it raises exactly `exc_type` with a message starting with `name`."""
        with self.assertRaises((TypeError, ValueError)) as cm:
            fn(*args)
        self.assertIs(type(cm.exception), exc_type, f"{type(cm.exception).__name__}: {cm.exception}")
        msg = str(cm.exception)
        self.assertTrue(msg.startswith(name + ":"), f"the message does not name {name}: {msg}")
        return msg

    def bad(self, exc_type, name, **overrides) -> str:
        """The error of the user API with one argument replaced; the op itself raises the same error."""
        kw = _good(**overrides)
        msg = self.raises(exc_type, name, _call, kw)
        if _op_schema_accepts(kw):
            self.raises(exc_type, name, _op_call, kw)  # the op checks too (its wording may differ)
        return msg

    def test_good_call_passes(self):
        # the base call of every test below is valid: the errors come from the one broken argument
        y = _call(_good())
        self.assertEqual(y.shape, (4, 8))
        self.assertTrue(torch.isfinite(y).all())

    # ---- not a tensor

    def test_x_not_a_tensor(self):
        self.assertExpectedInline(self.bad(TypeError, "x", x=[[1.0] * 8] * 4),
            """x: expected a torch.Tensor, got list""")

    def test_router_weights_not_a_tensor(self):
        self.assertExpectedInline(self.bad(TypeError, "router_weights", router_weights=0.5),
            """router_weights: expected a torch.Tensor, got float""")

    def test_top_experts_not_a_tensor(self):
        self.assertExpectedInline(self.bad(TypeError, "top_experts", top_experts=[[0, 1]] * 4),
            """top_experts: expected a torch.Tensor, got list""")

    def test_gate_up_proj_not_a_tensor(self):
        w = _good()["gate_up_proj"]
        self.assertExpectedInline(self.bad(TypeError, "gate_up_proj", gate_up_proj={"w": w}),
            """gate_up_proj: expected a torch.Tensor, got dict""")

    def test_gate_up_proj_nested_lists(self):
        # a sequence is read as per-expert weights, so its entries must be tensors
        w = _good()["gate_up_proj"]
        self.assertExpectedInline(self.bad(TypeError, "gate_up_proj", gate_up_proj=w.tolist()),
            """gate_up_proj: expected a torch.Tensor or a sequence of per-expert tensors, got list at index 0""")

    def test_down_proj_not_a_tensor(self):
        self.assertExpectedInline(self.bad(TypeError, "down_proj", down_proj="down"),
            """down_proj: expected a torch.Tensor, got str""")

    def test_shared_output_gate_not_a_tensor(self):
        self.assertExpectedInline(self.bad(TypeError, "shared_output_gate", shared_output_gate=1.0),
            """shared_output_gate: expected a torch.Tensor, got float""")

    # ---- dtype

    def test_x_float64(self):
        self.assertExpectedInline(self.bad(TypeError, "x", x=_good()["x"].double()),
            """x: expected dtype float32 or bfloat16 or float16, got float64""")

    def test_x_integer(self):
        self.assertExpectedInline(self.bad(TypeError, "x", x=torch.ones(4, 8, dtype=torch.int32)),
            """x: expected dtype float32 or bfloat16 or float16, got int32""")

    def test_router_weights_integer(self):
        self.assertExpectedInline(
            self.bad(TypeError, "router_weights", router_weights=torch.ones(4, 2, dtype=torch.int64)),
            """router_weights: expected a floating-point dtype (float32 preferred), got int64""")

    def test_top_experts_float(self):
        self.assertExpectedInline(self.bad(TypeError, "top_experts", top_experts=_good()["top_experts"].float()),
            """top_experts: expected dtype int32 or int64, got float32""")

    def test_top_experts_int16(self):
        self.assertExpectedInline(
            self.bad(TypeError, "top_experts", top_experts=_good()["top_experts"].to(torch.int16)),
            """top_experts: expected dtype int32 or int64, got int16""")

    def test_gate_up_proj_dtype_differs_from_x(self):
        self.assertExpectedInline(
            self.bad(TypeError, "gate_up_proj", gate_up_proj=_good()["gate_up_proj"].bfloat16()),
            """gate_up_proj: expected dtype float32 (x's dtype: cast the weights, or run under torch.autocast, which casts both), got bfloat16""")

    def test_down_proj_dtype_differs_from_x(self):
        self.assertExpectedInline(self.bad(TypeError, "down_proj", down_proj=_good()["down_proj"].half()),
            """down_proj: expected dtype float32 (x's dtype: cast the weights, or run under torch.autocast, which casts both), got float16""")

    def test_shared_gate_up_proj_dtype(self):
        self.assertExpectedInline(
            self.bad(TypeError, "shared_gate_up_proj", shared_gate_up_proj=_good()["shared_gate_up_proj"].bfloat16()),
            """shared_gate_up_proj: expected dtype float32 (x's dtype: cast the weights, or run under torch.autocast, which casts both), got bfloat16""")

    def test_shared_down_proj_dtype(self):
        self.assertExpectedInline(
            self.bad(TypeError, "shared_down_proj", shared_down_proj=_good()["shared_down_proj"].bfloat16()),
            """shared_down_proj: expected dtype float32 (x's dtype: cast the weights, or run under torch.autocast, which casts both), got bfloat16""")

    def test_shared_output_gate_dtype(self):
        self.assertExpectedInline(
            self.bad(TypeError, "shared_output_gate", shared_output_gate=_good()["shared_output_gate"].bfloat16()),
            """shared_output_gate: expected dtype float32 (x's dtype: cast the weights, or run under torch.autocast, which casts both), got bfloat16""")

    # ---- rank and shape

    def test_x_one_dim(self):
        self.assertExpectedInline(self.bad(ValueError, "x", x=_good()["x"][0]),
            """x: expected shape [..., H] with at least one token dim, got [8]""")

    def test_router_weights_rows(self):
        self.assertExpectedInline(
            self.bad(ValueError, "router_weights", router_weights=_good()["router_weights"][:3]),
            """router_weights: expected shape [4] + [K] (the leading dims of x), got [3, 2]""")

    def test_router_weights_rank(self):
        self.assertExpectedInline(
            self.bad(ValueError, "router_weights", router_weights=_good()["router_weights"].reshape(-1)),
            """router_weights: expected shape [4] + [K] (the leading dims of x), got [8]""")

    def test_top_experts_shape(self):
        self.assertExpectedInline(self.bad(ValueError, "top_experts", top_experts=_good()["top_experts"][:, :1]),
            """top_experts: expected shape [4, 2] (router_weights' shape: the two must match), got [4, 1]""")

    def test_gate_up_proj_rank(self):
        self.assertExpectedInline(self.bad(ValueError, "gate_up_proj", gate_up_proj=_good()["gate_up_proj"][0]),
            """gate_up_proj: expected a 3-D tensor [E, 2*I, H] (or [E, 2, I, H]), got shape [8, 8]""")

    def test_gate_up_proj_hidden_size(self):
        self.assertExpectedInline(
            self.bad(ValueError, "gate_up_proj", gate_up_proj=_good()["gate_up_proj"][:, :, :7]),
            """gate_up_proj: expected shape [E, 2*I, 8] (H of x), got [3, 8, 7]""")

    def test_gate_up_proj_odd_rows(self):
        self.assertExpectedInline(
            self.bad(ValueError, "gate_up_proj", gate_up_proj=_good()["gate_up_proj"][:, :7]),
            """gate_up_proj: expected an even second dim (gate rows then up rows), got [3, 7, 8]""")

    def test_gate_up_proj_no_experts(self):
        kw = _good()
        self.assertExpectedInline(
            self.bad(ValueError, "gate_up_proj", gate_up_proj=kw["gate_up_proj"][:0], down_proj=kw["down_proj"][:0],
                     top_experts=torch.full_like(kw["top_experts"], -1)),
            """gate_up_proj: expected at least one expert, got shape [0, 8, 8]""")

    def test_down_proj_expert_count(self):
        self.assertExpectedInline(self.bad(ValueError, "down_proj", down_proj=_good()["down_proj"][:2]),
            """down_proj: expected shape [3, 8, 4] [E, H, I] (matching gate_up_proj [E, 2*I, H]), got [2, 8, 4]""")

    def test_down_proj_intermediate_size(self):
        # gate_up_proj [3, 8, 8] says I=4; a down_proj [3, 8, 3] does not match
        self.assertExpectedInline(self.bad(ValueError, "down_proj", down_proj=_good()["down_proj"][:, :, :3]),
            """down_proj: expected shape [3, 8, 4] [E, H, I] (matching gate_up_proj [E, 2*I, H]), got [3, 8, 3]""")

    def test_down_proj_transposed(self):
        # [E, I, H] instead of [E, H, I]
        self.assertExpectedInline(
            self.bad(ValueError, "down_proj", down_proj=_good()["down_proj"].transpose(1, 2)),
            """down_proj: expected shape [3, 8, 4] [E, H, I] (matching gate_up_proj [E, 2*I, H]), got [3, 4, 8]""")

    def test_down_proj_rank(self):
        self.assertExpectedInline(self.bad(ValueError, "down_proj", down_proj=_good()["down_proj"][0]),
            """down_proj: expected shape [3, 8, 4] [E, H, I] (matching gate_up_proj [E, 2*I, H]), got [8, 4]""")

    def test_shared_gate_up_proj_rank(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_gate_up_proj", shared_gate_up_proj=_good()["shared_gate_up_proj"][None]),
            """shared_gate_up_proj: expected a 2-D tensor [2*Is, H], got shape [1, 12, 8]""")

    def test_shared_gate_up_proj_hidden_size(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_gate_up_proj", shared_gate_up_proj=_good()["shared_gate_up_proj"][:, :7]),
            """shared_gate_up_proj: expected shape [2*Is, 8] with an even first dim, got [12, 7]""")

    def test_shared_gate_up_proj_odd_rows(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_gate_up_proj", shared_gate_up_proj=_good()["shared_gate_up_proj"][:11]),
            """shared_gate_up_proj: expected shape [2*Is, 8] with an even first dim, got [11, 8]""")

    def test_shared_down_proj_size(self):
        # shared_gate_up_proj [12, 8] says Is=6; shared_down_proj [8, 5] does not match
        self.assertExpectedInline(
            self.bad(ValueError, "shared_down_proj", shared_down_proj=_good()["shared_down_proj"][:, :5]),
            """shared_down_proj: expected shape [8, 6] [H, Is] (matching shared_gate_up_proj [2*Is, H]), got [8, 5]""")

    def test_shared_output_gate_shape(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_output_gate", shared_output_gate=_good()["shared_output_gate"][0]),
            """shared_output_gate: expected shape [1, 8] [1, H], got [8]""")

    def test_shared_output_gate_hidden_size(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_output_gate", shared_output_gate=_good()["shared_output_gate"][:, :7]),
            """shared_output_gate: expected shape [1, 8] [1, H], got [1, 7]""")

    # ---- optional arguments given alone

    def test_shared_gate_up_proj_alone(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_down_proj", shared_down_proj=None, shared_output_gate=None),
            """shared_down_proj: the shared expert needs both shared_gate_up_proj and shared_down_proj""")

    def test_shared_down_proj_alone(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_gate_up_proj", shared_gate_up_proj=None, shared_output_gate=None),
            """shared_gate_up_proj: the shared expert needs both shared_gate_up_proj and shared_down_proj""")

    def test_shared_output_gate_without_shared_expert(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_output_gate", shared_gate_up_proj=None, shared_down_proj=None),
            """shared_output_gate: given without a shared expert (shared_gate_up_proj is None)""")

    # ---- swiglu_limit

    def test_swiglu_limit_negative(self):
        self.assertExpectedInline(self.bad(ValueError, "swiglu_limit", swiglu_limit=-1.0),
            """swiglu_limit: expected a finite positive float (at most the float32 maximum, 3.402823e+38), got -1.0""")

    def test_swiglu_limit_zero(self):
        self.assertExpectedInline(self.bad(ValueError, "swiglu_limit", swiglu_limit=0.0),
            """swiglu_limit: expected a finite positive float (at most the float32 maximum, 3.402823e+38), got 0.0""")

    def test_swiglu_limit_nan(self):
        self.assertExpectedInline(self.bad(ValueError, "swiglu_limit", swiglu_limit=math.nan),
            """swiglu_limit: expected a finite positive float (at most the float32 maximum, 3.402823e+38), got nan""")

    def test_swiglu_limit_inf(self):
        self.assertExpectedInline(self.bad(ValueError, "swiglu_limit", swiglu_limit=math.inf),
            """swiglu_limit: expected a finite positive float (at most the float32 maximum, 3.402823e+38), got inf""")

    def test_swiglu_limit_above_float32_max(self):
        # finite as a Python float, but the float32 kernels could not hold it
        self.assertExpectedInline(self.bad(ValueError, "swiglu_limit", swiglu_limit=1e39),
            """swiglu_limit: expected a finite positive float (at most the float32 maximum, 3.402823e+38), got 1e+39""")

    def test_swiglu_limit_float32_max_and_numpy_accepted(self):
        import numpy as np

        kw = _good()
        kw["x"] = kw["x"] * 4  # pre-activations beyond the small limit, so the clamp changes the result
        ref = _call(dict(kw, swiglu_limit=0.5))
        for limit in (np.float32(0.5), np.float64(0.5), np.float16(0.5)):
            self.assertTrue(torch.equal(_call(dict(kw, swiglu_limit=limit)), ref), type(limit).__name__)
        self.assertFalse(torch.equal(_call(dict(kw, swiglu_limit=None)), ref))  # the limit is not ignored
        top = _checks.FLOAT32_MAX
        self.assertTrue(torch.equal(_call(dict(kw, swiglu_limit=top)), _call(dict(kw, swiglu_limit=None))))
        self.assertTrue(torch.equal(_call(dict(kw, swiglu_limit=np.float32(top))), _call(dict(kw, swiglu_limit=None))))

    def test_swiglu_limit_numpy_float32_under_compile(self):
        # Dynamo makes a NumPy float32 a graph input (its value unknown while tracing): a clear error, not a
        # data-dependent guard failure inside the checks
        import numpy as np

        torch._dynamo.reset()
        kw = _good()
        limit = np.float32(7.0)
        fn = torch.compile(lambda kw: _call(dict(kw, swiglu_limit=limit)), backend="eager")
        self.assertExpectedInline(self.raises(TypeError, "swiglu_limit", fn, kw),
            """swiglu_limit: torch.compile traces a NumPy scalar as a tensor, not a constant; pass float(swiglu_limit)""")
        torch._dynamo.reset()

    def test_swiglu_limit_numpy_bool(self):
        import numpy as np

        self.assertExpectedInline(self.bad(TypeError, "swiglu_limit", swiglu_limit=np.True_),
            """swiglu_limit: expected a float or None, got bool""")

    def test_swiglu_limit_string(self):
        self.assertExpectedInline(self.bad(TypeError, "swiglu_limit", swiglu_limit="7"),
            """swiglu_limit: expected a float or None, got str""")

    def test_swiglu_limit_bool(self):
        self.assertExpectedInline(self.bad(TypeError, "swiglu_limit", swiglu_limit=True),
            """swiglu_limit: expected a float or None, got bool""")

    # ---- sizes: H and K of 0, more routes than the int32 schedule holds

    def test_hidden_size_zero(self):
        kw = _good()
        self.assertExpectedInline(
            self.bad(ValueError, "x", x=kw["x"][:, :0], gate_up_proj=kw["gate_up_proj"][:, :, :0],
                     down_proj=kw["down_proj"][:, :0], shared_gate_up_proj=None, shared_down_proj=None,
                     shared_output_gate=None),
            """x: expected a hidden size H >= 1 (the last dim of x), got H = 0""")

    def test_hidden_size_zero_with_leading_dims(self):
        kw = _good()
        x = kw["x"].new_empty(2, 2, 0)
        self.raises(ValueError, "x", _call, dict(kw, x=x, router_weights=kw["router_weights"].view(2, 2, 2),
                                                 top_experts=kw["top_experts"].view(2, 2, 2)))

    def test_routes_per_token_zero(self):
        kw = _good()
        self.assertExpectedInline(
            self.bad(ValueError, "router_weights", router_weights=kw["router_weights"][:, :0],
                     top_experts=kw["top_experts"][:, :0]),
            """router_weights: expected at least one route per token (K >= 1, the last dim), got K = 0""")

    def _meta_call(self, T, K, op=False):
        """A call with T tokens and K routes on meta tensors (expanded: no memory), through the API or the op."""
        kw = {k: (_meta(v) if isinstance(v, torch.Tensor) else v) for k, v in _good().items()}
        kw["x"] = kw["x"][:1].expand(T, 8)
        kw["router_weights"] = kw["router_weights"][:1, :1].expand(T, K)
        kw["top_experts"] = kw["top_experts"][:1, :1].expand(T, K)
        return _op_call(kw) if op else _call(kw)

    def test_routes_beyond_int32_schedule(self):
        for call in (lambda T, K: self._meta_call(T, K), lambda T, K: self._meta_call(T, K, op=True)):
            self.assertEqual(call(2**31 - 1, 1).shape, (2**31 - 1, 8))  # the largest schedule is accepted
            msg = self.raises(ValueError, "top_experts", call, 2**30, 2)  # one route more
            self.assertIn(str(2**31), msg)
        self.assertExpectedInline(self.raises(ValueError, "top_experts", self._meta_call, 2**31, 2),
            """top_experts: 2147483648 tokens x 2 routes = 4294967296 routes, more than the int32 schedule holds (2147483647); split the call into smaller token batches""")

    # ---- routed weights split per expert (a sequence of E tensors, as the functional ABI takes them)

    def test_per_expert_lists_match_stacked(self):
        kw = _good(swiglu_limit=1.5)
        leaves = {k: kw[k].clone().requires_grad_() for k in ("x", "gate_up_proj", "down_proj")}
        y = _call(dict(kw, **leaves))
        dy = torch.randn_like(y)
        y.backward(dy)
        split = {k: [w.detach().clone().requires_grad_() for w in leaves[k].unbind(0)]
                 for k in ("gate_up_proj", "down_proj")}
        x2 = leaves["x"].detach().clone().requires_grad_()
        for kinds in ((list, list), (tuple, lambda w: leaves["down_proj"].detach())):
            args = dict(kw, x=x2, gate_up_proj=kinds[0](split["gate_up_proj"]), down_proj=kinds[1](split["down_proj"]))
            y2 = _call(args)
            torch.testing.assert_close(y2, y, rtol=0, atol=0)
        x2.grad = None
        _call(dict(kw, x=x2, gate_up_proj=split["gate_up_proj"], down_proj=split["down_proj"])).backward(dy)
        torch.testing.assert_close(x2.grad, leaves["x"].grad)
        for k in ("gate_up_proj", "down_proj"):  # each per-expert tensor receives its own slice of the gradient
            for e, w in enumerate(split[k]):
                torch.testing.assert_close(w.grad, leaves[k].grad[e])

    def test_per_expert_list_empty(self):
        self.assertExpectedInline(self.bad(ValueError, "down_proj", down_proj=[]),
            """down_proj: expected at least one expert, got an empty list""")

    def test_per_expert_list_mismatched_shapes(self):
        ws = list(_good()["gate_up_proj"].unbind(0))
        ws[2] = ws[2][:6]
        self.assertExpectedInline(self.bad(ValueError, "gate_up_proj", gate_up_proj=ws),
            """gate_up_proj: expected per-expert tensors of one shape, dtype and device, got [8, 8] float32 on cpu at index 0 and [6, 8] float32 on cpu at index 2""")

    def test_per_expert_list_wrong_rank(self):
        ws = [w.unsqueeze(0) for w in _good()["down_proj"].unbind(0)]
        self.assertExpectedInline(self.bad(ValueError, "down_proj", down_proj=ws),
            """down_proj: expected 2-D per-expert tensors, got shape [1, 8, 4] at index 0""")

    def test_per_expert_list_wrong_count(self):
        # stacked, the list meets the op's own checks: its length is E
        ws = list(_good()["down_proj"].unbind(0))[:2]
        self.raises(ValueError, "down_proj", _call, _good(down_proj=ws))

    # ---- device (meta tensors stand in for another device than x's)

    def test_router_weights_device(self):
        self.assertExpectedInline(
            self.bad(ValueError, "router_weights", router_weights=_meta(_good()["router_weights"])),
            """router_weights: expected a tensor on cpu (the device of x), got one on meta""")

    def test_top_experts_device(self):
        self.assertExpectedInline(self.bad(ValueError, "top_experts", top_experts=_meta(_good()["top_experts"])),
            """top_experts: expected a tensor on cpu (the device of x), got one on meta""")

    def test_gate_up_proj_device(self):
        self.assertExpectedInline(
            self.bad(ValueError, "gate_up_proj", gate_up_proj=_meta(_good()["gate_up_proj"])),
            """gate_up_proj: expected a tensor on cpu (the device of x), got one on meta""")

    def test_down_proj_device(self):
        self.assertExpectedInline(self.bad(ValueError, "down_proj", down_proj=_meta(_good()["down_proj"])),
            """down_proj: expected a tensor on cpu (the device of x), got one on meta""")

    def test_shared_gate_up_proj_device(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_gate_up_proj", shared_gate_up_proj=_meta(_good()["shared_gate_up_proj"])),
            """shared_gate_up_proj: expected a tensor on cpu (the device of x), got one on meta""")

    def test_shared_down_proj_device(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_down_proj", shared_down_proj=_meta(_good()["shared_down_proj"])),
            """shared_down_proj: expected a tensor on cpu (the device of x), got one on meta""")

    def test_shared_output_gate_device(self):
        self.assertExpectedInline(
            self.bad(ValueError, "shared_output_gate", shared_output_gate=_meta(_good()["shared_output_gate"])),
            """shared_output_gate: expected a tensor on cpu (the device of x), got one on meta""")

    # ---- expert ids out of [-1, E)

    def test_expert_id_equal_to_E(self):
        te = _good()["top_experts"].clone()
        te[1, 0] = 3  # E = 3
        self.assertExpectedInline(self.bad(ValueError, "top_experts", top_experts=te),
            """top_experts: expected expert indices in [-1, 3) (-1 means no route), found 3""")

    def test_expert_id_below_minus_one(self):
        te = _good()["top_experts"].clone()
        te[2, 1] = -2
        self.assertExpectedInline(self.bad(ValueError, "top_experts", top_experts=te),
            """top_experts: expected expert indices in [-1, 3) (-1 means no route), found -2""")

    def test_expert_id_int32_large(self):
        te = _good()["top_experts"].to(torch.int32)
        te[0, 0] = 2**31 - 1
        self.assertExpectedInline(self.bad(ValueError, "top_experts", top_experts=te),
            """top_experts: expected expert indices in [-1, 3) (-1 means no route), found 2147483647""")

    def test_expert_id_in_schedule_op(self):
        # mok::schedule checks the ids itself (it is reachable from compiled graphs and the functional ABI)
        te = torch.tensor([[0, 5]], dtype=torch.int64)
        self.assertExpectedInline(self.raises(ValueError, "top_experts", torch.ops.mok.schedule, te, 3),
            """top_experts: expected expert indices in [-1, 3) (-1 means no route), found 5""")

    def test_expert_id_inside_compile(self):
        # the value check runs inside the op, so torch.compile(fullgraph=True) traces the call and the
        # compiled function raises the same error at run time (aot_eager: the same graph, no codegen)
        torch._dynamo.reset()
        fn = torch.compile(_call, fullgraph=True, backend="aot_eager")
        good = _good()
        self.assertEqual(fn(good).shape, (4, 8))  # compiles and runs with valid ids
        for bad in (3, -2):
            te = good["top_experts"].clone()
            te[3, 1] = bad
            msg = self.raises(ValueError, "top_experts", fn, _good(top_experts=te))
            self.assertIn(str(bad), msg)
        self.assertExpectedInline(msg,
            """top_experts: expected expert indices in [-1, 3) (-1 means no route), found -2""")
        torch._dynamo.reset()

    def test_expert_id_message_of_the_device_check(self):
        # the CUDA paths check ids with a device-side assert, which cannot read the bad value back without a
        # host synchronisation: its message says so and where to see the value; the CPU check names it
        self.assertExpectedInline(_checks.expert_ids_message(3),
            """top_experts: expected expert indices in [-1, 3) (-1 means no route), found one outside (checked on the device, which does not read the value back; run the call on the CPU to see it)""")
        self.assertEqual(_checks.expert_ids_message(5, -4),
                         "top_experts: expected expert indices in [-1, 5) (-1 means no route), found -4")

    @pytest.mark.cuda  # a unittest skip is no pytest mark: named here so `pytest -m cuda` selects it
    @unittest.skipUnless(torch.cuda.is_available(), "needs CUDA (the Triton schedule's device-side check)")
    def test_bad_expert_id_on_the_gpu_names_the_argument(self):
        # a device-side assert ends the process's CUDA context, so the call runs in a child process; what the
        # user sees must name the argument and the valid range. 4 routes: the decode forward's check (its
        # gate/up kernel's); 128: the schedule's
        for T in (2, 64):
            code = ("import torch, mok_inductor\n"
                    f"x = torch.randn({T}, 64, device='cuda', dtype=torch.bfloat16)\n"
                    f"te = torch.randint(0, 4, ({T}, 2), device='cuda'); te[1, 1] = 9\n"
                    f"w = torch.randn({T}, 2, device='cuda').softmax(-1)\n"
                    "gu = torch.randn(4, 64, 64, device='cuda', dtype=torch.bfloat16)\n"
                    "d = torch.randn(4, 64, 32, device='cuda', dtype=torch.bfloat16)\n"
                    "mok_inductor.moe(x, w, te, gu, d)\ntorch.cuda.synchronize()\n")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            self.assertNotEqual(proc.returncode, 0, T)
            self.assertIn("top_experts: expected expert indices in [-1, 4)", proc.stderr + proc.stdout, T)

    def test_rejected_call_leaves_inputs_untouched(self):
        # nothing is written to the caller's tensors when a call is rejected
        kw = _good()
        te = kw["top_experts"].clone()
        te[0, 0] = 7
        kw["top_experts"] = te
        before = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}
        self.raises(ValueError, "top_experts", _call, kw)
        for k, v in before.items():
            self.assertTrue(torch.equal(kw[k], v), k)


def test_triton_backend_on_cpu_tensors_without_the_interpreter(monkeypatch):
    """options.backend="triton" with CPU tensors where the interpreter is off (a machine with CUDA): a RuntimeError
    that says what to do, before any launch (the compiled kernels would read CPU pointers); "auto" still takes the
    CPU reference. (Here the interpreter is on; turning the package's mirror of it off stands in for such a
    machine.)"""
    from mok_inductor import kernels, options

    launched = []
    monkeypatch.setattr(kernels.common, "launch", lambda *a, **k: launched.append(a[0]))
    monkeypatch.setattr(options, "INTERPRET", False)
    kw = _good()
    with options.override(backend="triton"), pytest.raises(RuntimeError) as err:
        _call(kw)
    assert "options.backend='triton' with CPU tensors" in str(err.value)
    assert "TRITON_INTERPRET=1" in str(err.value) and launched == []
    assert mok_inductor.path_name(kw["x"]) == "reference"
    assert _call(kw).shape == kw["x"].shape


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CUDA present: the interpreter is off and the Triton backend refuses CPU tensors")
@pytest.mark.parametrize("bad", [3, -2])
@pytest.mark.parametrize("grad", [False, True])
def test_bad_expert_id_through_the_triton_kernels_on_cpu_tensors_is_the_cpu_value_error(bad, grad):
    # the interpreter's kernels (schedule, decode forward) flag the id on CPU tensors: read at once, the
    # contract's ValueError with the value, as on the CPU path (not the device assert's RuntimeError)
    from mok_inductor import options

    kw = _good()
    kw["top_experts"] = kw["top_experts"].clone()
    kw["top_experts"][2, 1] = bad
    kw["x"] = kw["x"].detach().requires_grad_(grad)
    with options.override(backend="triton", decode_max_routes=16 if not grad else 0), \
            pytest.raises(ValueError, match=rf"^top_experts: expected expert indices in \[-1, 3\) \(-1 means no "
                                            rf"route\), found {bad}$"):
        _call(kw)


@pytest.mark.parametrize("opts", ["reference", 42, ["backend"]])
def test_options_of_another_kind_name_the_argument(opts):
    with pytest.raises(TypeError, match=r"^options: expected an Options or a dict of option changes, got "):
        _call(_good(options=opts))


def test_an_activation_with_other_numbers_is_refused_not_replaced():
    # the op takes a declared variant by name: an Activation("gpt_oss", 1.0, 0.0) would silently run 1.702 and 1
    from mok_inductor.types import ACTIVATIONS, Activation

    with pytest.raises(ValueError, match=r"^activation: Activation\(name='gpt_oss', alpha=1.0, beta=0.0\) is not a "
                                         r"declared variant"):
        _call(_good(activation=Activation("gpt_oss", 1.0, 0.0)))
    assert torch.equal(_call(_good(activation=ACTIVATIONS["gpt_oss"])), _call(_good(activation="gpt_oss")))


def test_module_float64_x_under_autocast_is_a_type_error_naming_x():
    # autocast casts float32/16-bit inputs, not float64: the module says so before its router's Linear fails
    m = mok_inductor.MoE(8, 4, 3, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="^x: expected dtype float32"):
        m(torch.randn(5, 8, dtype=torch.float64))


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else __import__("unittest").main()
