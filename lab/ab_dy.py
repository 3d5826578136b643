"""Lab (kept in git history, removed from the tree; on a GPU: python lab/ab_dy.py mixtral,gptoss,qwen3).
bwd_act (dy @ down^T + SwiGLU backward) with dy rows gathered by pointers vs gathered once + TMA (sorted dy):
the stage alone (bitwise, TFLOP/s) and the whole layer fwd+bwd, at mixtral, gpt-oss, qwen3."""
import json, os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import mok_inductor
from mok_inductor.kernels import gate_up as G, bwd_act as B
from mok_inductor.types import Operand
from triton.testing import do_bench
from bench_moe import make_inputs
SHAPES = {"mixtral": (8192, 4096, 14336, 8, 2), "gptoss": (8192, 2880, 2880, 32, 4), "qwen3": (16384, 2048, 768, 128, 8)}
real = B.row_desc
def mode(on):
    B.row_desc = real if on else (lambda t: None)
out = {"device": torch.cuda.get_device_name(), "rows": []}
print(out["device"], flush=True)
for name in sys.argv[1].split(","):
    T, H, I, E, K = SHAPES[name]
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
    sched = mok_inductor.kernels.build_schedule(te.to(torch.int32), E)
    routes, offsets = sched[0], sched[1]
    M = T * K
    gu = torch.empty(M, 2 * I, device="cuda", dtype=torch.bfloat16)
    G.gate_up(x, Operand(w_gu[:, :I], None), Operand(w_gu[:, I:], None), gu, routes, offsets, K, None)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    down_t = Operand(w_d.transpose(1, 2), None)
    scale = rw.float().flatten()
    f = lambda: B.bwd_act(dy, down_t, gu, scale, routes, offsets, K, None)
    row = {"shape": name}
    res = {}
    for on in (False, True):
        mode(on)
        res[on] = [t.clone() for t in f()]
        ms = do_bench(f)
        row[f"bwd_act sorted_dy={on}"] = (round(ms, 4), round(2 * M * H * I / ms / 1e9, 1))
    row["bitwise"] = all(torch.equal(a, b) for a, b in zip(res[False], res[True]))
    xg = x.clone().requires_grad_(); wg = w_gu.clone().requires_grad_(); wd = w_d.clone().requires_grad_()
    dyl = torch.randn_like(x)
    def fb():
        y = mok_inductor.moe(xg, rw, te, wg, wd); y.backward(dyl)
    for on in (False, True, False, True):
        mode(on)
        row.setdefault(f"layer fwdbwd sorted_dy={on}", []).append(round(do_bench(fb), 3))
    mode(True)
    print(json.dumps(row), flush=True)
    out["rows"].append(row)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab_dy.json"), "w"), indent=1)
