"""Lab (kept in git history, removed from the tree): the warp-specialized Gluon core (see ws_grouped_gemm.py in
the history) as the fused gate/up GEMM: rows pre-gathered in expert order (x[routes // K], one gather pass), gate and
up tiles of one [E, 2I, H] weight (gate rows [0, I), up rows [I, 2I) of each expert), two accumulators, and the
SwiGLU epilogue (g, u rounded to bf16 and stored into gu [M, 2I], h = silu(g) * u into h [M, I])."""
import os, sys, json
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ws_grouped_gemm import _mma_layout, _tile, tile_tables  # noqa: E402


@gluon.jit
def _gu_producer(a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, tile_list_ptr, n_work, n_tiles_m, tile_e_ptr,
                 tile_row_ptr, offsets_ptr, I, H, STAGES: gl.constexpr):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    i = 0
    for t in range(gl.program_id(0), n_work, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile(t, tile_list_ptr, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr)
        grow = e * (2 * I) + pid_n * BLOCK_N
        for k in range(0, H, BLOCK_K):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, k], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [grow, k], ready.index(s), g_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [grow + I, k], ready.index(s), u_bufs.index(s))
            i += 1


@gluon.jit
def _gu_consumer(a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, gu_ptr, h_ptr, tile_list_ptr, n_work,
                 n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr, I, H, STAGES: gl.constexpr,
                 num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    i = 0
    for t in range(gl.program_id(0), n_work, gl.num_programs(0)):
        e, row0, row_end, pid_n = _tile(t, tile_list_ptr, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr)
        acc_g = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        acc_u = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        prev = 0
        for k in range(0, H, BLOCK_K):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc_g = warpgroup_mma(a_bufs.index(s), g_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a_bufs.index(s), u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
            if k > 0:
                mbarrier.arrive(empty.index(prev), count=1)
            prev = s
            i += 1
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
        mbarrier.arrive(empty.index(prev), count=1)
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        mask = (rows < row_end)[:, None] & (cols < I)[None, :]
        r64 = rows[:, None].to(gl.int64)
        g = acc_g.to(dtype)
        u = acc_u.to(dtype)
        gl.store(gu_ptr + r64 * (2 * I) + cols[None, :], g, mask=mask)
        gl.store(gu_ptr + r64 * (2 * I) + I + cols[None, :], u, mask=mask)
        gf = g.to(gl.float32)
        h = gf / (1.0 + gl.exp(-gf)) * u.to(gl.float32)
        gl.store(h_ptr + r64 * I + cols[None, :], h.to(dtype), mask=mask)


@gluon.jit
def ws_gate_up_kernel(a_desc, w_desc, gu_ptr, h_ptr, tile_list_ptr, n_work, n_tiles_m, tile_e_ptr, tile_row_ptr,
                      offsets_ptr, I, H, STAGES: gl.constexpr, num_warps: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    g_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_gu_consumer, (a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, gu_ptr, h_ptr, tile_list_ptr, n_work,
                        n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr, I, H, STAGES, num_warps)),
        (_gu_producer, (a_desc, w_desc, a_bufs, g_bufs, u_bufs, ready, empty, tile_list_ptr, n_work, n_tiles_m,
                        tile_e_ptr, tile_row_ptr, offsets_ptr, I, H, STAGES)),
    ], [1], [40])


def ws_gate_up(x, w_gu, routes, offsets, topk, gu, h, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4, num_warps=8,
               tables=None, xs=None):
    """gu, h of the sorted rows; w_gu [E, 2I, H] (gate rows then up rows). xs: the pre-gathered rows, else gathered
    here (x[routes // topk], counted in the call's time)."""
    E, I2, H = w_gu.shape
    I = I2 // 2
    xs = xs if xs is not None else x[(routes // topk).long()]
    te, tr, live, max_m = tables if tables is not None else tile_tables(offsets, BLOCK_M, BLOCK_N, I)
    a_desc = TensorDescriptor.from_tensor(xs, [BLOCK_M, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(w_gu.view(E * I2, H), [BLOCK_N, BLOCK_K], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16))
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    ws_gate_up_kernel[(min(sms, live.numel()),)](a_desc, w_desc, gu, h, live, live.numel(), max_m, te, tr, offsets, I, H,
                                                STAGES, num_warps=num_warps)
    return gu, h


CONFIGS = [(128, 128, 64, 4, 8), (128, 128, 64, 3, 8), (64, 128, 64, 5, 4), (128, 64, 64, 6, 4)]


def compile_only(BM, BN, BK, ST, NW):
    from triton.backends.compiler import GPUTarget
    import triton.experimental.gluon._runtime as R
    a_l = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    w_l = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{a_l!r}>", "w_desc": f"tensordesc<bf16[{BN}, {BK}],{w_l!r}>",
           "gu_ptr": "*bf16", "h_ptr": "*bf16", "tile_list_ptr": "*i32", "n_work": "i32", "n_tiles_m": "i32",
           "tile_e_ptr": "*i32", "tile_row_ptr": "*i32", "offsets_ptr": "*i32", "I": "i32", "H": "i32",
           "STAGES": "constexpr", "num_warps": "constexpr"}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("gu_ptr", "h_ptr", "tile_list_ptr", "tile_e_ptr",
                                                                    "tile_row_ptr", "offsets_ptr", "I", "H")}
    src = R.GluonASTSource(ws_gate_up_kernel, sig, constexprs={"STAGES": ST, "num_warps": NW}, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NW})
    ptx = c.asm["ptx"]
    print("compiled", (BM, BN, BK, ST, NW), "smem", c.metadata.shared, "wgmma", ptx.count("wgmma.mma_async"),
          "ld.local", ptx.count("ld.local"))


def gpu_main():
    from triton.testing import do_bench
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from mok_inductor.kernels.gate_up import gate_up
    from mok_inductor.types import Operand
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    print(res["device"])
    shapes = [("tiny-skewed", 300, 2, 4, 256, 192), ("mixtral", 8192, 2, 8, 4096, 14336),
              ("qwen3", 16384, 8, 128, 2048, 768), ("gptoss", 8192, 4, 32, 2880, 2880)]
    for label, T, K, E, H, I in shapes:
        g0 = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g0)
        w_gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g0) / H ** 0.5).bfloat16()
        logits = torch.rand(T, E, device="cuda", generator=g0)
        if label.endswith("skewed"):
            logits[:, 0] += 1.0  # most tokens pick expert 0
            logits[:, E - 1] -= 5.0  # the last expert gets none
        top = logits.topk(K, dim=1).indices.to(torch.int32)
        routes = torch.argsort(top.flatten(), stable=True).to(torch.int32)
        offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
        offsets[1:] = torch.cumsum(torch.bincount(top.flatten().long(), minlength=E), 0)
        M = T * K
        xs = x[(routes // K).long()]
        g_ref = torch.cat([xs[offsets[e]:offsets[e + 1]].float() @ w_gu[e, :I].float().T for e in range(E)])
        u_ref = torch.cat([xs[offsets[e]:offsets[e + 1]].float() @ w_gu[e, I:].float().T for e in range(E)])
        h_ref = torch.nn.functional.silu(g_ref.bfloat16().float()) * u_ref.bfloat16().float()
        tf = lambda ms: round(4 * M * H * I / ms / 1e9, 1)
        row = {"shape": label}
        gu = torch.empty(M, 2 * I, device="cuda", dtype=torch.bfloat16)
        h = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
        op_g, op_u = Operand(w_gu[:, :I], None), Operand(w_gu[:, I:], None)
        gate_up(x, op_g, op_u, gu, routes, offsets, K, None, h_out=h)
        row["mok tl.dot fused"] = tf(do_bench(lambda: gate_up(x, op_g, op_u, gu, routes, offsets, K, None, h_out=h)))
        row["grouped_mm (pre-gathered, gather not counted)"] = tf(do_bench(
            lambda: torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=offsets[1:])))
        for cfg in CONFIGS:
            gu.fill_(float("nan"))
            h.fill_(float("nan"))
            try:
                tables = tile_tables(offsets, cfg[0], cfg[1], I)
                ws_gate_up(x, w_gu, routes, offsets, K, gu, h, *cfg, tables=tables)
                eg = ((gu[:, :I].float() - g_ref).norm() / g_ref.norm()).item()
                eu = ((gu[:, I:].float() - u_ref).norm() / u_ref.norm()).item()
                eh = ((h.float() - h_ref).norm() / h_ref.norm()).item()
                ms = do_bench(lambda: ws_gate_up(x, w_gu, routes, offsets, K, gu, h, *cfg, tables=tables))
                ms_pre = do_bench(lambda: ws_gate_up(x, w_gu, routes, offsets, K, gu, h, *cfg, tables=tables, xs=xs))
                row[f"ws {cfg}"] = {"with gather": tf(ms), "pre-gathered": tf(ms_pre),
                                    "err g/u/h": f"{eg:.1e}/{eu:.1e}/{eh:.1e}"}
            except Exception as ex:
                row[f"ws {cfg}"] = repr(ex)[:200]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ws_gate_up.json"), "w"), indent=1)


if __name__ == "__main__":
    if torch.cuda.is_available():
        gpu_main()
    else:
        for c in CONFIGS:
            compile_only(*c)
