"""Lab (kept in git history, removed from the tree; on a GPU: python lab/ab_one_dot.py mixtral,gptoss,qwen3).
A/B: gate/up with gate and up read as one [2E, I, H] TMA box per K step and one dot of 2 BLOCK_N columns
(ONE_DOT: m64n256 wgmma at BLOCK_N 128) against two dots of BLOCK_N (m64n128). Per shape: gate_up alone (both
ways, bitwise compare, error vs fp32 ref, each candidate config forced), and the whole layer fwd / fwd+bwd
(mok_inductor.moe) both ways. Two dots = gate_up.halves_desc patched to return None."""
import json, os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import mok_inductor
from mok_inductor.kernels import configs, gate_up as G
from mok_inductor.types import Operand
from triton.testing import do_bench
from bench_moe import make_inputs

SHAPES = {"mixtral": (8192, 4096, 14336, 8, 2), "gptoss": (8192, 2880, 2880, 32, 4), "qwen3": (16384, 2048, 768, 128, 8),
          "deepseek": (8192, 7168, 2048, 32, 8)}
real_halves = G.halves_desc
def mode(one_dot):
    G.halves_desc = real_halves if one_dot else (lambda g, u: None)

out = {"device": torch.cuda.get_device_name(), "rows": []}
print(out["device"], flush=True)
for name in sys.argv[1].split(",") if len(sys.argv) > 1 else SHAPES:
    T, H, I, E, K = SHAPES[name]
    x, rw, te, w_gu, w_d = make_inputs(T, H, I, E, K, "balanced")
    sched = mok_inductor.kernels.build_schedule(te.to(torch.int32), E)
    routes, offsets = sched[0], sched[1]
    M = T * K
    row = {"shape": name}
    gu = torch.empty(M, 2 * I, device="cuda", dtype=torch.bfloat16); h = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
    og, ou = Operand(w_gu[:, :I], None), Operand(w_gu[:, I:], None)
    f = lambda: G.gate_up(x, og, ou, gu, routes, offsets, K, None, h_out=h)
    res = {}
    for sx in (False, True):
        mode(sx); gu.fill_(float("nan")); h.fill_(float("nan")); f(); torch.cuda.synchronize()
        res[sx] = (gu.clone(), h.clone())
        ms = do_bench(f)
        row[f"gate_up one_dot={sx}"] = (round(ms, 4), round(4 * M * H * I / ms / 1e9, 1))
    row["bitwise equal"] = bool(torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1]))
    xs = x[(routes[:M] // K).long()].float()
    e0 = int((offsets[1] - offsets[0]).item())
    ref = xs[:e0] @ w_gu[0, :I].float().T
    row["err g expert0"] = ((res[True][0][:e0, :I].float() - ref).norm() / ref.norm()).item()
    real_pick = configs.pick
    for tile in G.GATE_UP.candidates:
        configs.pick = lambda fam, prob, rows, dev, tile=tile: tile if fam is G.GATE_UP else real_pick(fam, prob, rows, dev)
        try:
            for sx in (True,):
                mode(sx); ms = do_bench(f)
                row[f"one-dot tile {tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"] = round(4 * M * H * I / ms / 1e9, 1)
        except Exception as ex:
            row[f"tile {tile}"] = repr(ex)[:100]
        finally:
            configs.pick = real_pick
    # whole layer
    xg = x.clone().requires_grad_(); wg = w_gu.clone().requires_grad_(); wd = w_d.clone().requires_grad_()
    dy = torch.randn_like(x)
    for sx in (False, True, False, True):
        mode(sx)
        fw = lambda: mok_inductor.moe(x, rw, te, w_gu, w_d)
        def fb():
            y = mok_inductor.moe(xg, rw, te, wg, wd); y.backward(dy)
        with torch.no_grad():
            t_f = do_bench(fw)
        t_fb = do_bench(fb)
        row.setdefault(f"layer one_dot={sx} fwd/fwdbwd ms", []).append((round(t_f, 3), round(t_fb, 3)))
    mode(True)
    print(json.dumps(row), flush=True)
    out["rows"].append(row)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab_one_dot.json"), "w"), indent=1)
