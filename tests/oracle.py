"""An independent float64 oracle for the MoK computation, written plainly (a loop over experts).

It shares no code with `mok_inductor`: it follows docs/semantics.md ("Forward") line by line and gets
every gradient from torch.autograd on float64 tensors, so it checks the package's hand-written
backward too.
"""

import torch
import torch.nn.functional as F


def oracle_moe(x, router_weights, top_experts, gate_up_proj, down_proj, shared_gate_up_proj=None,
               shared_down_proj=None, shared_output_gate=None, swiglu_limit=None, activation="swiglu",
               gate_up_bias=None, down_bias=None):
    """Float64 forward of docs/semantics.md on [T, H] inputs; differentiable by autograd.

    activation "gpt_oss" is GPT-OSS's expert (transformers' GptOssExperts._apply_gate, written out here):
    glu = g * sigmoid(1.702 g), h = (u + 1) * glu, after the same clamps; gate_up_bias [E, 2I] (gate columns,
    then up columns) is added to g, u before the clamps, down_bias [E, H] to the expert's output before the
    routing weight."""
    x = x.double()
    rw = router_weights.double()
    w1 = gate_up_proj.double()
    w2 = down_proj.double()
    T, H = x.shape
    E, two_i, _ = w1.shape
    I = two_i // 2

    def act(g, u):
        if swiglu_limit is not None:
            g = torch.clamp(g, max=swiglu_limit)
            u = torch.clamp(u, min=-swiglu_limit, max=swiglu_limit)
        if activation == "gpt_oss":
            return (u + 1) * (g * torch.sigmoid(g * 1.702))
        assert activation == "swiglu", activation
        return F.silu(g) * u

    y = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    for e in range(E):
        token_idx, k_idx = torch.where(top_experts == e)
        if token_idx.numel() == 0:
            continue
        xe = x[token_idx]
        g = xe @ w1[e, :I].T
        u = xe @ w1[e, I:].T
        if gate_up_bias is not None:
            g = g + gate_up_bias.double()[e, :I]
            u = u + gate_up_bias.double()[e, I:]
        out = act(g, u) @ w2[e].T
        if down_bias is not None:
            out = out + down_bias.double()[e]
        y = y.index_add(0, token_idx, out * rw[token_idx, k_idx][:, None])
    if shared_gate_up_proj is not None:
        s1 = shared_gate_up_proj.double()
        s2 = shared_down_proj.double()
        i_s = s1.shape[0] // 2
        s = act(x @ s1[:i_s].T, x @ s1[i_s:].T) @ s2.T
        if shared_output_gate is not None:
            s = s * torch.sigmoid(x @ shared_output_gate.double().T)
        y = y + s
    return y
