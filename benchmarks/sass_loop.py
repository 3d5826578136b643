"""The sm_90 machine code of the MXFP8 decode K loops, compiled on a machine without a GPU: for each tile config,
the registers, the shared memory and the instruction histogram of the kernel's longest loop (one K step),
from the SASS that Triton's own ptxas and nvdisasm give. It is a quick check, before a device call, of what a
change to the loop costs in instructions (docs/benchmarks.md, run 17). It does not measure speed.

    python benchmarks/sass_loop.py [--kernel gate_up|down] [--mode 4] [--configs 16x32x128x2x4,8x32x256x2x3]

--mode is the kernels' MX_DOT: 0 the dequantizing loop (bf16 weights unless --mx), 1 fp8, 2 fp16, 3 fp16 on rows
scaled once, 4 that with scale words, 6 the e4m3 pair loop on rows split once (moe_fwd.MX_FP8_ROWS; 7 with
scale bytes), 8 mode 4 with a whole K step as one dot (moe_fwd.MX_ONE_DOT). A config is BLOCK_M x BLOCK_N x BLOCK_K x warps x stages. The
integer arguments are declared divisible by 16, as a launch at the benchmark shapes finds them.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.pop("TRITON_INTERPRET", None)  # (compiles the real kernels)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mok_inductor.kernels import moe_fwd  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _signature(fn, pointers: dict, consts: dict, divisible: set):
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t != "constexpr" and (t.startswith("*") or n in divisible)}
    return ASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs)


def gate_up_source(mode: int, mx: bool, bm: int, bn: int, bk: int):
    act = "*fp8e4nv" if mode in (6, 7) else "*fp16" if mode >= 3 else "*bf16"
    w, s = ("*fp8e4nv", "*u8") if mx else ("*bf16", "*bf16")
    pointers = {"x_ptr": act, "xr_ptr": "*fp32", "routes_ptr": "*i32", "offsets_ptr": "*i32", "wg_ptr": w,
                "gs_ptr": s, "wu_ptr": w, "us_ptr": s, "gu_ptr": "*bf16", "h_ptr": "*bf16", "limit": "fp32",
                "above": "fp32", "below": "fp32"}
    consts = dict(g_desc=None, u_desc=None, SINGLE=False, MX_G=mx, MX_U=mx, WRITE_H=True, HAS_LIMIT=False,
                  KEEP_CLIP=False, DOT_PREC="ieee", W_TABLE=False, MX_DOT=mode, TMA=False, W_KMAJOR=False,
                  GROUPS_POW2=256, GROUP_M=moe_fwd.GROUP_M, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  g_k=1, u_k=1, gs_k=1, us_k=1, stride_xh=1, stride_gn=1, stride_hi=1)
    divisible = {"stride_xt", "g_e", "g_n", "gs_e", "gs_n", "u_e", "u_n", "us_e", "us_n", "stride_gm", "stride_hm",
                 "M", "H", "I", "E", "TOPK", "w_rows"}
    return _signature(moe_fwd._gate_up_body, pointers, consts, divisible)


def down_source(mode: int, mx: bool, bm: int, bn: int, bk: int):
    act = "*fp8e4nv" if mode in (6, 7) else "*fp16" if mode >= 3 else "*bf16"
    w, s = ("*fp8e4nv", "*u8") if mx else ("*bf16", "*bf16")
    pointers = {"a_ptr": act, "ar_ptr": "*fp32", "routes_ptr": "*i32", "offsets_ptr": "*i32", "w1_ptr": w,
                "q1_ptr": s, "w2_ptr": w, "q2_ptr": s, "out_ptr": "*bf16"}
    consts = dict(a_desc=None, w1_desc=None, w2_desc=None, SINGLE=False, SCATTER=True, TWO=False, MX1=mx, MX2=mx,
                  DOT_PREC="ieee", W_TABLE=False, MX_DOT=mode, TMA=False, W_KMAJOR=False, GROUPS_POW2=256,
                  GROUP_M=moe_fwd.GROUP_M, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, stride_ak=1, s1_k=1, q1_k=1,
                  s2_k=1, q2_k=1, stride_on=1)
    divisible = {"stride_am", "s1_e", "s1_n", "q1_e", "q1_n", "s2_e", "s2_n", "q2_e", "q2_n", "stride_om", "M",
                 "NCOL", "KD", "E", "w_rows"}
    return _signature(moe_fwd._grouped_rows_body, pointers, consts, divisible)


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(_BIN, name), *args], capture_output=True, text=True, check=True).stdout


def longest_loop(sass: str) -> list:
    """The opcodes (predicates dropped) between a label and the furthest backward branch to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):\s*$", l))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    if best is None:
        return []
    ops = []
    for line in lines[best[0]:best[1] + 1]:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m.group(1).split(".")[0])
    return ops


def report(kernel: str, mode: int, mx: bool, config: tuple) -> str:
    bm, bn, bk, warps, stages = config
    src = (gate_up_source if kernel == "gate_up" else down_source)(mode, mx, bm, bn, bk)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        regs = re.search(r"REG:(\d+)", _tool("cuobjdump", "-res-usage", path))
        ops = longest_loop(_tool("nvdisasm", "-c", path))
    hist = collections.Counter(ops).most_common(14)
    return (f"{kernel} MX_DOT {mode} {'x'.join(map(str, config))}: {regs.group(1) if regs else '?'} registers, "
            f"{ck.metadata.shared} B shared, {len(ops)} instructions a warp per loop iteration: "
            + ", ".join(f"{op} {n}" for op, n in hist))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="gate_up", choices=("gate_up", "down"))
    p.add_argument("--mode", type=int, default=4)
    p.add_argument("--mx", action=argparse.BooleanOptionalAction, default=None,
                   help="MXFP8 weights (default: with any MX_DOT mode; mode 0 without it: bf16 weights)")
    p.add_argument("--configs", default="16x32x128x2x4,8x32x256x2x3")
    a = p.parse_args()
    mx = a.mode > 0 if a.mx is None else a.mx
    for c in a.configs.split(","):
        print(report(a.kernel, a.mode, mx, tuple(int(v) for v in c.split("x"))), flush=True)


if __name__ == "__main__":
    main()
