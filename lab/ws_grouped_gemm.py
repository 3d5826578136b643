"""Lab (kept in git history, removed from the tree): a warp-specialized persistent Gluon grouped GEMM for Hopper, C[rows of e] = A[rows of e] @ B[e]^T with
rows pre-sorted by expert (the GEMM core alone). One producer warp streams A and B tiles by TMA into a ring of
STAGES buffers (ready/empty mbarriers); the default partition (1 or 2 consumer warpgroups) issues async wgmma,
releases each stage once the MMA reading it is done, and stores the tile with masks at the expert's row end.
Program p takes tiles p, p + nprog, ... of a list of live (m-tile, n-tile) pairs, m fastest (neighbouring
programs share the weight tile)."""
import os, sys, json
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, warpgroup_mma, warpgroup_mma_wait


@gluon.constexpr_function
def _mma_layout(BLOCK_M, BLOCK_N, num_warps):
    wm = 4 if BLOCK_M <= 64 else min(num_warps, BLOCK_M // 16)
    wn = num_warps // wm
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, min(BLOCK_N // wn, 256), 16])


@gluon.jit
def _tile(t, tile_list_ptr, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr):
    tile = gl.load(tile_list_ptr + t)
    pid_m = tile % n_tiles_m
    e = gl.load(tile_e_ptr + pid_m)
    return e, gl.load(tile_row_ptr + pid_m), gl.load(offsets_ptr + e + 1), tile // n_tiles_m


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_list_ptr, n_work, n_tiles_m, tile_e_ptr,
              tile_row_ptr, offsets_ptr, N, K, STAGES: gl.constexpr):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    i = 0
    for t in range(gl.program_id(0), n_work, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile(t, tile_list_ptr, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr)
        brow = e * N + pid_n * BLOCK_N
        for k in range(0, K, BLOCK_K):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # (a fresh barrier passes parity 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, k], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [brow, k], ready.index(s), b_bufs.index(s))
            i += 1


@gluon.jit
def _consumer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, tile_list_ptr, n_work, n_tiles_m,
              tile_e_ptr, tile_row_ptr, offsets_ptr, N, K, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    i = 0
    for t in range(gl.program_id(0), n_work, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile(t, tile_list_ptr, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        prev = 0
        for k in range(0, K, BLOCK_K):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if k > 0:  # the MMA before this one is done: its stage may be refilled
                mbarrier.arrive(empty.index(prev), count=1)
            prev = s
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1)
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        gl.store(c_ptr + rows[:, None].to(gl.int64) * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=mask)


@gluon.jit
def ws_grouped_gemm_kernel(a_desc, b_desc, c_ptr, stride_cm, tile_list_ptr, n_work, n_tiles_m, tile_e_ptr,
                           tile_row_ptr, offsets_ptr, N, K, STAGES: gl.constexpr, num_warps: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, c_ptr, stride_cm, tile_list_ptr, n_work,
                     n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr, N, K, STAGES, num_warps)),
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_list_ptr, n_work, n_tiles_m, tile_e_ptr,
                     tile_row_ptr, offsets_ptr, N, K, STAGES)),
    ], [1], [40])


def tile_tables(offsets, BLOCK_M, BLOCK_N, N):
    """Per m-tile (expert, first row), and the list of live (m, n) tiles, m fastest."""
    E = offsets.numel() - 1
    M = int(offsets[-1])
    max_m = triton.cdiv(M, BLOCK_M) + E
    counts = (offsets[1:] - offsets[:-1]).long()
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    cum = torch.cumsum(tiles, 0)
    t = torch.arange(max_m, device=offsets.device)
    e = torch.searchsorted(cum, t, right=True)
    valid = e < E
    ec = e.clamp(max=E - 1)
    row = offsets[:-1].long()[ec] + (t - (cum[ec] - tiles[ec])) * BLOCK_M
    te = torch.where(valid, ec, 0).to(torch.int32)
    tr = torch.where(valid, row, 0).to(torch.int32)
    n_live = int(cum[-1])
    n_n = triton.cdiv(N, BLOCK_N)
    live = (torch.arange(n_live, device=offsets.device)[None, :] + max_m * torch.arange(n_n, device=offsets.device)[:, None])
    return te, tr, live.flatten().to(torch.int32), max_m


def ws_grouped_gemm(A, B, offsets, out, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, STAGES=4, num_warps=8, tables=None):
    M, K = A.shape
    E, N, _ = B.shape
    te, tr, live, max_m = tables if tables is not None else tile_tables(offsets, BLOCK_M, BLOCK_N, N)
    a_desc = TensorDescriptor.from_tensor(A, [BLOCK_M, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16))
    b_desc = TensorDescriptor.from_tensor(B.view(E * N, K), [BLOCK_N, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16))
    sms = torch.cuda.get_device_properties(A.device).multi_processor_count
    grid = (min(sms, live.numel()),)
    ws_grouped_gemm_kernel[grid](a_desc, b_desc, out, out.stride(0), live, live.numel(), max_m, te, tr, offsets, N, K,
                                 STAGES, num_warps=num_warps)
    return out


def compile_only(BM, BN, BK, ST, NW):
    from triton.backends.compiler import GPUTarget
    import triton.experimental.gluon._runtime as R
    a_l = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_l = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{a_l!r}>", "b_desc": f"tensordesc<bf16[{BN}, {BK}],{b_l!r}>",
           "c_ptr": "*bf16", "stride_cm": "i32", "tile_list_ptr": "*i32", "n_work": "i32", "n_tiles_m": "i32",
           "tile_e_ptr": "*i32", "tile_row_ptr": "*i32", "offsets_ptr": "*i32", "N": "i32", "K": "i32",
           "STAGES": "constexpr", "num_warps": "constexpr"}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("c_ptr", "stride_cm", "tile_list_ptr", "tile_e_ptr",
                                                                    "tile_row_ptr", "offsets_ptr", "N", "K")}
    src = R.GluonASTSource(ws_grouped_gemm_kernel, sig, constexprs={"STAGES": ST, "num_warps": NW}, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NW})
    ptx = c.asm["ptx"]
    print("compiled", (BM, BN, BK, ST, NW), "smem", c.metadata.shared, "wgmma", ptx.count("wgmma.mma_async"),
          "setmaxnreg" in ptx, "spills" if "local" in ptx and ".local" in ptx else "")


CONFIGS = [(128, 256, 64, 4, 8), (128, 256, 64, 3, 8), (128, 128, 64, 5, 4), (128, 128, 64, 4, 8), (64, 256, 64, 4, 4)]

if __name__ == "__main__" and not torch.cuda.is_available():
    for c in CONFIGS:
        compile_only(*c)


def ptx_of(BM=128, BN=256, BK=64, ST=4, NW=8):
    from triton.backends.compiler import GPUTarget
    import triton.experimental.gluon._runtime as R
    a_l = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_l = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{a_l!r}>", "b_desc": f"tensordesc<bf16[{BN}, {BK}],{b_l!r}>",
           "c_ptr": "*bf16", "stride_cm": "i32", "tile_list_ptr": "*i32", "n_work": "i32", "n_tiles_m": "i32",
           "tile_e_ptr": "*i32", "tile_row_ptr": "*i32", "offsets_ptr": "*i32", "N": "i32", "K": "i32",
           "STAGES": "constexpr", "num_warps": "constexpr"}
    src = R.GluonASTSource(ws_grouped_gemm_kernel, sig, constexprs={"STAGES": ST, "num_warps": NW})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NW}).asm["ptx"]


def gpu_main():
    from triton.testing import do_bench
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from mok_inductor.kernels.grouped_gemm import grouped_rows
    from mok_inductor.types import Operand
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    print(res["device"])
    # correctness first: partial tiles, an empty expert, skewed counts
    for (M, E, N, K, counts) in [(1000, 4, 384, 320, [0, 700, 1, 299]), (4096, 8, 512, 256, None)]:
        A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        c = torch.tensor(counts) if counts else torch.full((E,), M // E)
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(c, 0)
        offsets = offsets.cuda()
        ref = torch.cat([A[offsets[e]:offsets[e + 1]].double() @ B[e].double().T for e in range(E)])
        for cfg in CONFIGS:
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            ws_grouped_gemm(A, B, offsets, out, *cfg)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print("check", (M, E, N, K), cfg, f"{err:.2e}", "nan" if out.isnan().any() else "", flush=True)
    shapes = [("mixtral gate/up", 16384, 8, 28672, 4096), ("mixtral down", 16384, 8, 4096, 14336),
              ("qwen3 gate/up", 131072, 128, 1536, 2048), ("qwen3 down", 131072, 128, 2048, 768),
              ("gptoss gate/up", 32768, 32, 5760, 2880), ("gptoss down", 32768, 32, 2880, 2880)]
    for label, M, E, N, K in shapes:
        A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(torch.full((E,), M // E), 0)
        offsets = offsets.cuda()
        flops = 2 * M * N * K
        tf = lambda ms: round(flops / ms / 1e9, 1)
        row = {"shape": label}
        W = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        row["torch.mm"] = tf(do_bench(lambda: torch.mm(A, W)))
        Bt = B.transpose(1, 2)
        row["grouped_mm"] = tf(do_bench(lambda: torch._grouped_mm(A, Bt, offs=offsets[1:])))
        ref = torch._grouped_mm(A, Bt, offs=offsets[1:]).float()
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        routes = torch.arange(M, device="cuda", dtype=torch.int32)
        grouped_rows(A, Operand(B, None), out, routes, offsets, scatter=False)
        row["mok tl.dot"] = tf(do_bench(lambda: grouped_rows(A, Operand(B, None), out, routes, offsets, scatter=False)))
        for cfg in CONFIGS:
            out.fill_(float("nan"))
            try:
                tables = tile_tables(offsets, cfg[0], cfg[1], N)
                ws_grouped_gemm(A, B, offsets, out, *cfg, tables=tables)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row[f"ws {cfg}"] = (tf(do_bench(lambda: ws_grouped_gemm(A, B, offsets, out, *cfg, tables=tables))),
                                    f"{err:.1e}")
            except Exception as ex:
                row[f"ws {cfg}"] = repr(ex)[:200]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ws_gemm.json"), "w"), indent=1)


if __name__ == "__main__" and torch.cuda.is_available():
    gpu_main()
