"""Lab (kept in git history, removed from the tree; on a GPU: python lab/ab_gate_up.py mixtral,gptoss,qwen3).
The fused gate/up kernel four ways: x rows gathered by pointers or gathered once into sorted order and loaded
by TMA (SORTED_X; off = gate_up.row_desc patched to return None), and gate/up as two m64n128 dots or one
[2, BLOCK_N, BLOCK_K] TMA box and one m64n256 dot (ONE_DOT; off = gate_up.halves_desc patched to None).
Per shape: gate_up alone each way (bitwise against the base way, error against a float32 reference, TFLOP/s),
each candidate tile config forced with both on, and the whole layer fwd / fwd+bwd (mok_inductor.moe) each
way, twice."""
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
real_row_desc, real_halves = G.row_desc, G.halves_desc
MODES = [(False, False), (True, False), (False, True), (True, True)]  # (SORTED_X, ONE_DOT)
def mode(m):
    G.row_desc = real_row_desc if m[0] else (lambda t: None)
    G.halves_desc = real_halves if m[1] else (lambda g, u: None)

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
    for m in MODES:
        mode(m); gu.fill_(float("nan")); h.fill_(float("nan")); f(); torch.cuda.synchronize()
        res[m] = (gu.clone(), h.clone())
        ms = do_bench(f)
        row[f"gate_up sorted_x,one_dot={m}"] = (round(ms, 4), round(4 * M * H * I / ms / 1e9, 1))
        row[f"bitwise equal to base {m}"] = bool(torch.equal(res[m][0], res[MODES[0]][0]) and
                                                 torch.equal(res[m][1], res[MODES[0]][1]))
    xs = x[(routes[:M] // K).long()].float()
    e0 = int((offsets[1] - offsets[0]).item())
    ref = xs[:e0] @ w_gu[0, :I].float().T
    row["err g expert0"] = ((res[MODES[-1]][0][:e0, :I].float() - ref).norm() / ref.norm()).item()
    real_pick = configs.pick
    for tile in G.GATE_UP.candidates:
        configs.pick = lambda fam, prob, rows, dev, tile=tile: tile if fam is G.GATE_UP else real_pick(fam, prob, rows, dev)
        try:
            for m in MODES[-1:]:
                mode(m); ms = do_bench(f)
                row[f"both tile {tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages}"] = round(4 * M * H * I / ms / 1e9, 1)
        except Exception as ex:
            row[f"tile {tile}"] = repr(ex)[:100]
        finally:
            configs.pick = real_pick
    # whole layer
    xg = x.clone().requires_grad_(); wg = w_gu.clone().requires_grad_(); wd = w_d.clone().requires_grad_()
    dy = torch.randn_like(x)
    for m in MODES + MODES:
        mode(m)
        fw = lambda: mok_inductor.moe(x, rw, te, w_gu, w_d)
        def fb():
            y = mok_inductor.moe(xg, rw, te, wg, wd); y.backward(dy)
        with torch.no_grad():
            t_f = do_bench(fw)
        t_fb = do_bench(fb)
        row.setdefault(f"layer {m} fwd/fwdbwd ms", []).append((round(t_f, 3), round(t_fb, 3)))
    mode(MODES[-1])
    print(json.dumps(row), flush=True)
    out["rows"].append(row)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab_gate_up.json"), "w"), indent=1)
