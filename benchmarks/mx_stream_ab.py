"""How fast each style of K loop streams one GEMM's weights at decode sizes, outside the MoE kernels: every
program one [BLOCK_N, K] weight slab of one expert against that expert's few activation rows, as the decode
gate/up GEMM reads them (qwen3: E 128, N 1536, K 2048, 4 routes an expert), so the rate of the loop itself is
seen, without the schedule, the gathers or the epilogues.

Styles (STYLE):
  bf16   bf16 weights, one tl.dot per K step ([BLOCK_N, BLOCK_K] @ [BLOCK_K, 16]): the bf16 loop's rate
  f16    e4m3 weights converted to fp16 per 32-block, [BLOCK_N, 32] @ [32, 8] fp16 activations, each block's
         product scaled by the weight scales (the package's MX_DOT 4 at 8-row tiles, `moe_fwd.mx_dot_t`)
  fp8x2  e4m3 weights straight into an e4m3 tl.dot ([BLOCK_N, 32] @ [32, 16]: Hopper's wgmma, no conversion),
         the activations as two e4m3 terms hi + lo of rows scaled once (about 2**-8 relative, within SPEC's bf16
         tolerance), the two products chained in one accumulator per block, then scaled
  fp8x1  the same with one activation term (3 mantissa bits, outside SPEC section 6's accuracy): the ceiling of
         the fp8 loop, timed for comparison only
  f16one the e4m3 tile of a whole K step converted to fp16 and one tl.dot per step, no scales (wrong numbers:
         the cost of the conversion alone, against bf16)
  f16nos f16's per-32-block dots chained in one accumulator, no scales (wrong numbers: the cost of splitting the
         step into blocks, against f16one; f16 against it, the cost of the per-block rescaling)
  f16el  one fp16 tl.dot per K step as f16one, each weight first scaled in fp16 by 2**(s - top) (s its block's
         scale, top the row's largest less 7, found once before the loop; blocks under 2**-22 of the row's largest
         dropped), the product scaled by 2**top after the loop: f16's numbers without splitting the step. Triton
         computes the factors in the loaded tile's layout and moves the scaled tile into the dot's through shared
         memory (its dot-operand hoisting stops at a broadcast along k; sm_90 TTGIR)
  f16b3  a K step as one 3-D (batched) tl.dot, [G, BLOCK_N, 32] @ [G, 32, 8] over its G blocks, each block's product
         scaled by its weight scales and summed over the blocks: f16's numbers, the blocks' loads and dots as one
  f16v   one fp16 tl.dot per K step on weights scaled per (row, block) through a [BLOCK_N, G, 32] view of the
         step's tile: 2**(s - top) in fp16 by the package's `moe_fwd.step_factors` (top the row's largest scale in
         the step), the product scaled by 2**top in float32: f16's numbers, MX_DOT 8's loop alone. The views keep the scaled tile in the
         dot operand's registers (sm_90 TTGIR: the tile's local_load is laid out for the reshapes; no shared
         memory round trip but the [BLOCK_N, G] factors'; 12 LDGSTS a K step, as f16one)
  f16rs  f16el's loop with one factor per column and step (the step's first block's): wrong numbers where a step's
         blocks differ; its factors go through shared memory too (the per-row reference's broadcast also stops
         the hoisting), so it measures the same round trip with simpler factors

    python benchmarks/mx_stream_ab.py [--rows 4] [--out DIR]

Prints the weight bytes each style streams per second (e4m3 data + scales, or bf16), the best config of each,
and each style's error against a float64 product of the dequantized weights; writes mx_stream_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from mok_inductor.kernels import moe_fwd  # noqa: E402

STYLES = {"bf16": 0, "f16": 1, "fp8x2": 2, "fp8x1": 3, "f16one": 4, "f16nos": 5, "f16el": 6, "f16b3": 7, "f16rs": 8, "f16v": 9}
F16_ROWS = (1, 4, 5, 6, 7, 8, 9)  # the styles on fp16 activation rows, 8 a tile (scaled once per row, as `row_f16`)


@triton.jit
def _stream_kernel(w_ptr, s_ptr, a_ptr, o_ptr, N, K, R, STYLE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """o[e, cols, rows] (o [E, N, 16]) = W[e][cols, :] @ A[e][rows, :]^T for program (e, column tile); A [E, BLOCK_M, KA] with
    KA = K (bf16, f16) or 2K (fp8: hi in [0, K), lo in [K, 2K)); rows >= R masked (zero)."""
    tiles = N // BLOCK_N
    e = tl.program_id(0) // tiles
    cols = (tl.program_id(0) % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < R
    e64 = e.to(tl.int64)
    w = w_ptr + e64 * N * K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if STYLE == 0 or STYLE == 4:
        a = a_ptr + e64 * BLOCK_M * K
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            wt = tl.load(w + cols[:, None] * K + kk[None, :])
            at = tl.trans(tl.load(a + rows[:, None] * K + kk[None, :], mask=rmask[:, None], other=0.0))
            if STYLE == 4:
                wt = wt.to(tl.float16)
            acc = tl.dot(wt, at, acc)
    elif STYLE == 5:
        a = a_ptr + e64 * BLOCK_M * K
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(BLOCK_K // 32):
                kk = k0 + j * 32 + tl.arange(0, 32)
                wt = tl.load(w + cols[:, None] * K + kk[None, :])
                at = tl.trans(tl.load(a + rows[:, None] * K + kk[None, :], mask=rmask[:, None], other=0.0))
                acc = tl.dot(wt.to(tl.float16), at, acc)
    elif STYLE == 6 or STYLE == 8:
        a = a_ptr + e64 * BLOCK_M * K
        s_row = s_ptr + (e64 * N + cols) * (K // 32)
        top = tl.zeros((BLOCK_N,), dtype=tl.int32)
        for b0 in range(0, K // 32, 64):  # the row's largest scale
            blocks = b0 + tl.arange(0, 64)
            sb = tl.load(s_row[:, None] + blocks[None, :], mask=blocks[None, :] < K // 32, other=0)
            top = tl.maximum(top, tl.max(sb.to(tl.int32), axis=1))
        top = top - 7  # 2**top: the row's reference (its weights scaled by 2**(s - top) <= 2**7 into fp16)
        top64 = (top - 15).to(tl.int64)
        sh = ((tl.arange(0, BLOCK_K) // 32) * 8).to(tl.int64)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            if STYLE == 6:  # (BLOCK_K 256: the step's 8 scale bytes a column by one aligned 8-byte load)
                sc = tl.load((s_row + k0 // 32).to(tl.pointer_type(tl.int64)))
                fb = tl.maximum(((sc[:, None] >> sh[None, :]) & 255) - top64[:, None], 0) << 10  # fp16 bits
            else:
                sc = tl.load(s_row + k0 // 32).to(tl.int64)
                fb = tl.maximum(sc[:, None] - top64[:, None], 0) << 10
            f = tl.inline_asm_elementwise("cvt.u16.u64 $0, $1;", "=h,l", [fb], dtype=tl.int16, is_pure=True,
                                          pack=1).to(tl.float16, bitcast=True)  # 2**(s - top) (0 under 2**-14)
            wt = tl.load(w + cols[:, None] * K + kk[None, :])
            at = tl.trans(tl.load(a + rows[:, None] * K + kk[None, :], mask=rmask[:, None], other=0.0))
            acc = tl.dot(wt.to(tl.float16) * f, at, acc)
        acc = acc * (top << 23).to(tl.float32, bitcast=True)[:, None]
    elif STYLE == 7:
        a = a_ptr + e64 * BLOCK_M * K
        s_row = s_ptr + (e64 * N + cols) * (K // 32)
        G: tl.constexpr = BLOCK_K // 32
        j = tl.arange(0, G)
        kq = tl.arange(0, 32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 + j * 32
            w3 = tl.load(w + cols[None, :, None] * K + kb[:, None, None] + kq[None, None, :])  # [G, BLOCK_N, 32]
            a3 = tl.load(a + rows[None, None, :] * K + kb[:, None, None] + kq[None, :, None],
                         mask=rmask[None, None, :], other=0.0)  # [G, 32, BLOCK_M]
            sw = (tl.load(s_row[None, :] + k0 // 32 + j[:, None]).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            acc += tl.sum(tl.dot(w3.to(tl.float16), a3) * sw[:, :, None], axis=0)
    elif STYLE == 9:
        a = a_ptr + e64 * BLOCK_M * K
        s_row = s_ptr + (e64 * N + cols) * (K // 32)
        G9: tl.constexpr = BLOCK_K // 32
        j = tl.arange(0, G9)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            # the package's factors (`moe_fwd.step_factors`: 2**(s - top) in fp16, top the step's largest a row)
            f, top = moe_fwd.step_factors(tl.load(s_row[:, None] + k0 // 32 + j[None, :]).to(tl.int32))
            wt = tl.reshape(tl.reshape(tl.load(w + cols[:, None] * K + kk[None, :]).to(tl.float16),
                                       (BLOCK_N, G9, 32)) * f[:, :, None], (BLOCK_N, BLOCK_K))
            at = tl.trans(tl.load(a + rows[:, None] * K + kk[None, :], mask=rmask[:, None], other=0.0))
            acc += tl.dot(wt, at) * moe_fwd.e8m0_factor(top)[:, None]
    else:
        KA = K if STYLE == 1 else 2 * K
        a = a_ptr + e64 * BLOCK_M * KA
        s_row = s_ptr + (e64 * N + cols) * (K // 32)
        for k0 in range(0, K, BLOCK_K):
            for q in tl.static_range(BLOCK_K // 128):
                word = tl.load((s_row + k0 // 32 + 4 * q).to(tl.pointer_type(tl.int32)))
                for j in tl.static_range(4):
                    kk = k0 + (4 * q + j) * 32 + tl.arange(0, 32)
                    sw = (((word >> (8 * j)) & 0xFF) << 23).to(tl.float32, bitcast=True)
                    wt = tl.load(w + cols[:, None] * K + kk[None, :])
                    hi = tl.trans(tl.load(a + rows[:, None] * KA + kk[None, :], mask=rmask[:, None], other=0.0))
                    if STYLE == 1:
                        p = tl.dot(wt.to(tl.float16), hi)
                    else:
                        p = tl.dot(wt, hi)
                        if STYLE == 2:
                            lo = tl.trans(tl.load(a + rows[:, None] * KA + K + kk[None, :], mask=rmask[:, None],
                                                  other=0.0))
                            p = tl.dot(wt, lo, p)
                    acc += p * sw[:, None]
    tl.store(o_ptr + (e64 * N + cols[:, None]) * 16 + rows[None, :], acc)


def split_e4m3(a: torch.Tensor):
    """(hi | lo as one [.., 2K] e4m3 tensor, row scales): a / scale = hi + lo within about 2**-8, each row's
    largest magnitude put in [128, 256)."""
    amax = a.abs().amax(-1, keepdim=True).clamp_min(2.0**-100)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 7)
    v = a / scale
    hi = v.to(torch.float8_e4m3fn)
    lo = (v - hi.float()).to(torch.float8_e4m3fn)
    return torch.cat([hi, lo], -1), scale


def main():
    from bench_moe import bench, copy_bandwidth

    from mok_inductor import mxfp8

    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--n", type=int, default=1536)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--rows", type=int, default=4, help="real activation rows an expert (decode: 4)")
    p.add_argument("--styles", default="bf16,f16,f16one,f16nos,f16v,f16el,f16b3,f16rs")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    E, N, K, R = a.experts, a.n, a.k, a.rows
    torch.manual_seed(0)
    wb = (torch.randn(E, N, K, device="cuda") * K**-0.5).to(torch.bfloat16)
    q = mxfp8.quantize(wb)
    data, scale = q.data.contiguous(), q.scale.contiguous()
    assert data.shape == (E, N, K) and scale.shape == (E, N, K // 32), (data.shape, scale.shape)
    wd = mxfp8.dequantize(q).float()  # [E, N, K]
    x = torch.randn(E, 16, K, device="cuda").to(torch.bfloat16)
    x[:, R:] = 0
    ref = torch.einsum("enk,emk->enm", wd.double(), x.double())  # [E, N, 16]
    bw = copy_bandwidth()
    print(f"E {E} N {N} K {K}, {R} rows an expert; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    configs = {  # (BLOCK_N, BLOCK_K, warps, stages)
        "bf16": [(64, 128, 4, 4), (128, 128, 4, 3)],
        "f16": [(32, 256, 2, 3), (32, 128, 2, 4), (64, 128, 4, 4)],
        "fp8x2": [(64, 128, 4, 4), (64, 128, 4, 2), (64, 256, 4, 3), (128, 128, 8, 4)],
    }
    configs["f16one"] = [(32, 256, 2, 3), (64, 128, 4, 4)]
    configs["f16nos"] = configs["f16one"]
    configs["f16el"] = [(32, 256, 2, 3), (64, 256, 4, 3)]  # (BLOCK_K 256 only: its scales by 8-byte loads)
    configs["f16b3"] = [(32, 256, 2, 3), (32, 128, 2, 4), (64, 128, 4, 4), (64, 256, 4, 3)]
    configs["f16v"] = [(32, 256, 2, 3), (32, 128, 2, 4), (64, 128, 4, 4), (64, 256, 4, 3), (32, 256, 1, 3)]
    configs["f16rs"] = [(32, 256, 2, 3), (32, 128, 2, 4)]
    configs["fp8x1"] = configs["fp8x2"][:2]
    out = dict(E=E, N=N, K=K, rows=R, copy_bw=bw, styles={})
    o = torch.empty(E, N, 16, device="cuda")
    for style in a.styles.split(","):
        s = STYLES[style]
        bm = 8 if s in F16_ROWS else 16
        if s == 0:
            w, sc, act, nbytes = wb, wb, x, wb.numel() * 2
        else:
            w, sc, nbytes = data, scale, data.numel() + scale.numel()
            if s in F16_ROWS:
                r16 = x.float().abs().amax(-1, keepdim=True).clamp_min(2.0**-100)
                rs = torch.exp2(torch.floor(torch.log2(r16)) - 14)
                act, rscale = (x.float() / rs).half()[:, :bm].contiguous(), rs[:, :bm]
            else:
                act, rscale = split_e4m3(x.float())
                if s == 3:
                    act = act.clone()
                    act[..., K:] = 0
        rows_out = []
        for bn, bk, warps, stages in configs[style]:
            grid = (E * (N // bn),)
            try:
                def run():
                    _stream_kernel[grid](w, sc, act, o, N, K, R, STYLE=s, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk,
                                         num_warps=warps, num_stages=stages)

                o.fill_(float("nan"))
                run()
                y = o[:, :, :bm].double()
                if s != 0:
                    y = y * rscale[:, None, :bm, 0].double()
                refm = ref[:, :, :bm]
                if s == 0:
                    refm = torch.einsum("enk,emk->enm", wb.double(), x.double())[:, :, :bm]
                elif s in (4, 5):  # (the e4m3 values unscaled: these styles read no scales)
                    refm = torch.einsum("enk,emk->enm", data.double(), x.double())[:, :, :bm]
                err = ((y - refm).norm() / refm.norm()).item()
                ms, p20, p80 = bench(run)
                tbs = nbytes / (ms * 1e-3) / 1e12
                rows_out.append(dict(config=(bn, bm, bk, warps, stages), ms=ms, p20=p20, p80=p80, tb_s=tbs, rel_err=err))
                print(f"  {style:6s} {bn}x{bm}x{bk} w{warps} s{stages}: {ms:.4f} ms, {tbs:.2f} TB/s of weights, "
                      f"rel err {err:.2e}", flush=True)
            except Exception as exc:  # a config that fails to compile is reported, the others still run
                print(f"  {style:6s} {bn}x{bm}x{bk} w{warps} s{stages}: FAILED {type(exc).__name__}: {str(exc)[:300]}",
                      flush=True)
        out["styles"][style] = rows_out
        if rows_out:
            best = min(rows_out, key=lambda r: r["ms"])
            print(f"{style}: best {best['config']} {best['ms']:.4f} ms, {best['tb_s']:.2f} TB/s", flush=True)
    with open(os.path.join(a.out, "mx_stream_ab.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
