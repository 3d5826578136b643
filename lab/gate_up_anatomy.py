"""Lab (kept in git history, removed from the tree): where the fused gate/up kernel loses against the plain row
GEMM. Same problem, the package's kernels run several ways, each checked against a float32 reference first:

  fused            gate_up as the layer runs it (token rows gathered by pointers, g, u and h written)
  fused, no h      the same without the h store (h_out=None)
  fused, sorted    x pre-gathered into expert order, routes = r*K (so row r reads row r: no random gather);
                   the gather's own time is reported apart
  fused, tile c    every candidate config of the gate_up family forced (fused, as the layer runs it)
  row kernel       grouped_rows on the pre-gathered rows, one [E, 2I, H] weight (no epilogue beyond the store)
  grouped_mm       torch._grouped_mm on the pre-gathered rows

    python lab/gate_up_anatomy.py [--shapes mixtral,gptoss,qwen3]      (CUDA; on CPU: a tiny interpreter run)
"""
import argparse, json, os, sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from mok_inductor.kernels import configs  # noqa: E402
from mok_inductor.kernels.gate_up import GATE_UP, gate_up  # noqa: E402
from mok_inductor.kernels.grouped_gemm import grouped_rows  # noqa: E402
from mok_inductor.types import Operand  # noqa: E402

SHAPES = {"mixtral": (8192, 2, 8, 4096, 14336), "gptoss": (8192, 4, 32, 2880, 2880),
          "qwen3": (16384, 8, 128, 2048, 768), "tiny": (24, 2, 4, 64, 32)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mixtral,gptoss,qwen3")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if cuda:
        from triton.testing import do_bench
    else:
        a.shapes = "tiny"
        def do_bench(fn):
            fn()
            return float("nan")
    out = []
    for name in a.shapes.split(","):
        T, K, E, H, I = SHAPES[name]
        g0 = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g0)
        Wg = (torch.randn(E, I, H, device=dev, generator=g0) / H ** 0.5).bfloat16()
        Wu = (torch.randn(E, I, H, device=dev, generator=g0) / H ** 0.5).bfloat16()
        top = torch.rand(T, E, device=dev, generator=g0).topk(K, dim=1).indices.to(torch.int32)
        routes = torch.argsort(top.flatten(), stable=True).to(torch.int32)
        offsets = torch.zeros(E + 1, dtype=torch.int32, device=dev)
        offsets[1:] = torch.cumsum(torch.bincount(top.flatten().long(), minlength=E), 0)
        M = T * K
        xs = x[(routes // K).long()]
        g_ref = torch.empty(M, I, device=dev)
        for e in range(E):
            s, t = offsets[e].item(), offsets[e + 1].item()
            g_ref[s:t] = xs[s:t].float() @ Wg[e].float().T
        flops = 4 * M * H * I
        row = {"shape": name, "rows": M}

        def check_time(label, fn, gu):
            gu.fill_(float("nan"))
            fn()
            err = ((gu[:, :I].float() - g_ref).norm() / g_ref.norm()).item()
            assert err < 1e-2, (label, err)
            ms = do_bench(fn)
            row[label] = (round(ms, 4), round(flops / ms / 1e9, 1))

        gu = torch.empty(M, 2 * I, device=dev, dtype=torch.bfloat16)
        h = torch.empty(M, I, device=dev, dtype=torch.bfloat16)
        op_g, op_u = Operand(Wg, None), Operand(Wu, None)
        check_time("fused", lambda: gate_up(x, op_g, op_u, gu, routes, offsets, K, None, h_out=h), gu)
        check_time("fused, no h", lambda: gate_up(x, op_g, op_u, gu, routes, offsets, K, None), gu)
        seq = torch.arange(M, device=dev, dtype=torch.int32) * K
        check_time("fused, sorted rows", lambda: gate_up(xs, op_g, op_u, gu, seq, offsets, K, None, h_out=h), gu)
        row["gather x[rows] alone (ms)"] = round(do_bench(lambda: x[(routes // K).long()]), 4)
        real_pick = configs.pick
        for tile in GATE_UP.candidates:
            configs.pick = lambda family, problem, rows, device, tile=tile: (
                tile if family is GATE_UP else real_pick(family, problem, rows, device))
            try:
                check_time(f"fused, tile {tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} "
                           f"s{tile.num_stages}", lambda: gate_up(x, op_g, op_u, gu, routes, offsets, K, None, h_out=h), gu)
            except Exception as ex:  # (a config this GPU cannot run)
                row[f"tile {tile}"] = repr(ex)[:120]
            finally:
                configs.pick = real_pick
        try:
            from mok_inductor.kernels.configs import dtype_name
            row["table pick"] = str(configs.pick(GATE_UP, (dtype_name(x.dtype), H, I, E, True), M, x.device))
        except Exception as ex:
            row["table pick"] = repr(ex)[:120]
        w_gu = torch.cat([Wg, Wu], 1)
        check_time("row kernel (sorted rows)", lambda: grouped_rows(xs, Operand(w_gu, None), gu, seq // K, offsets,
                                                                    scatter=False), gu)
        check_time("grouped_mm (sorted rows)", lambda: gu.copy_(torch._grouped_mm(xs, w_gu.transpose(1, 2),
                                                                                  offs=offsets[1:])), gu)
        print(json.dumps(row), flush=True)
        out.append(row)
    json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "rows": out},
              open(os.path.join(os.environ.get("OUT", "."), "gate_up_anatomy.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
