"""Lab (kept in git history, removed from the tree): compile the gate/up kernel for sm_90 on a machine without a
GPU and report what Hopper would run: shared memory, wgmma count and wait depths, cp.async and TMA ops, spills.
Integer arguments equal to 1 (the unit strides) are given as the constants the launcher specialises them to:
without that the x loads cannot be shown contiguous and the pipeliner leaves them synchronous.

    python lab/ir_probe.py BLOCK_M BLOCK_N BLOCK_K num_warps num_stages TMA(0|1)   -> /tmp/gu.ttgir, /tmp/gu.ptx
"""
import sys, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mok_inductor.kernels import gate_up as G, grouped_gemm as GG

def compile_gate_up(BM, BN, BK, NW, NS, tma=True, write_h=True):
    fn = G._gate_up_kernel
    ptr = {"x_ptr","xr_ptr","routes_ptr","offsets_ptr","wg_ptr","gs_ptr","wu_ptr","us_ptr","gu_ptr","h_ptr","bias_ptr"}
    types = {}
    for n in fn.arg_names:
        if n in ptr: types[n] = "*i32" if n in ("routes_ptr","offsets_ptr") else ("*fp32" if n=="xr_ptr" else "*bf16")
        elif n in ("g_desc","u_desc"): types[n] = f"tensordesc<bf16[{BN}, {BK}]>" if tma else "constexpr"
        elif n in ("limit","above","below","alpha","beta"): types[n] = "fp32"
    const = dict(HAS_BIAS=False, SINGLE=False, MX_G=False, MX_U=False, WRITE_H=write_h, HAS_LIMIT=False, KEEP_CLIP=False,
                 DOT_PREC="tf32", W_TABLE=0, MX_LOOP=0, TMA=tma, W_KMAJOR=True, INTERLEAVED=False, GROUPS_POW2=16,
                 GROUP_M=8, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    if not tma: const.update(g_desc=None, u_desc=None)
    const.update(stride_xh=1, g_k=1, u_k=1, stride_gn=1, stride_hi=1, gs_k=1, us_k=1)
    sig = {}
    for n in fn.arg_names:
        if n in const: sig[n] = "constexpr"
        elif n in types: sig[n] = types[n]
        else: sig[n] = "i32"
    cst = {(fn.arg_names.index(k),): v for k, v in const.items()}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("x_ptr","gu_ptr","h_ptr","wg_ptr","wu_ptr","stride_xt","stride_gm","stride_hm","g_e","u_e","H","I")}
    src = ASTSource(fn, sig, cst, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NW, "num_stages": NS})

c = compile_gate_up(*[int(v) for v in sys.argv[1:6]], tma=sys.argv[6] == "1")
for k in ("ttgir", "ptx"):
    open(f"/tmp/gu.{k}", "w").write(c.asm[k])
ptx = c.asm["ptx"]
print("smem", c.metadata.shared, "wgmma", ptx.count("wgmma.mma_async"), "wait_group", re.findall(r"wgmma.wait_group.sync.aligned \d+", ptx)[:6],
      "cp.async", ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "tma", ptx.count("cp.async.bulk.tensor"), "ld.local", ptx.count("ld.local"), "st.local", ptx.count("st.local"))
