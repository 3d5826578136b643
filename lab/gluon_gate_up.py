"""Lab (removed in the next commit; kept in git history):  a Gluon (Hopper wgmma + TMA) grouped GEMM, C[rows of e] = A[rows of e] @ B[e]^T, rows sorted by expert.
A [M, K] bf16 (pre-gathered rows), B [E, N, K] bf16 (K contiguous), offsets [E+1] int32. Compared with the
package's tl.dot grouped kernel, torch._grouped_mm and a dense torch.mm of the same FLOPs."""
import os, sys, time, json
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import async_copy, tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.constexpr_function
def _mma_layout(BLOCK_M, BLOCK_N, num_warps):
    wm = min(num_warps, max(BLOCK_M // 16, 4))
    wm = 4 if BLOCK_M <= 64 else min(num_warps, BLOCK_M // 16)
    wn = num_warps // wm
    n = BLOCK_N // wn
    n = min(n, 256)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, n, 16])


@gluon.jit
def _load_step(a_desc, b_desc, bars, a_bufs, b_bufs, prod, row0, brow, k, STAGES: gl.constexpr):
    s = prod % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row0, k], bar, a_bufs.index(s))
    tma.async_copy_global_to_shared(b_desc, [brow, k], bar, b_bufs.index(s))
    return prod + 1


@gluon.jit
def grouped_gemm_kernel(a_desc, b_desc, c_ptr, stride_cm, tile_e_ptr, tile_row_ptr, offsets_ptr, n_tiles_m,
                        N, K, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    pid = gl.program_id(0)
    n_tiles_n = gl.cdiv(N, BLOCK_N)
    pid_m = pid % n_tiles_m
    pid_n = pid // n_tiles_m
    e = gl.load(tile_e_ptr + pid_m)
    if e >= 0:
        row0 = gl.load(tile_row_ptr + pid_m)
        row_end = gl.load(offsets_ptr + e + 1)
        brow = e * N + pid_n * BLOCK_N
        k_steps = gl.cdiv(K, BLOCK_K)
        prod = 0
        cons = 0
        for i in gl.static_range(STAGES - 1):
            prod = _load_step(a_desc, b_desc, bars, a_bufs, b_bufs, prod, row0, brow, i * BLOCK_K, STAGES)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        for kk in range(k_steps):
            s = cons % STAGES
            mbarrier.wait(bars.index(s), (cons // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            # at most one MMA in flight: the one before this has finished reading its stage, refill that stage
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            cons += 1
            gl.thread_barrier()  # every warpgroup's MMA of the stage about to be refilled has finished
            if kk + STAGES - 1 < k_steps:
                prod = _load_step(a_desc, b_desc, bars, a_bufs, b_bufs, prod, row0, brow, (kk + STAGES - 1) * BLOCK_K, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        ptrs = c_ptr + rows[:, None].to(gl.int64) * stride_cm + cols[None, :]
        mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        gl.store(ptrs, acc.to(dtype), mask=mask)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _gu_load(x_ptr, stride_x, tok, rmask, H, g_desc, u_desc, bars, a_bufs, g_bufs, u_bufs, prod, row0, grow,
             urow, k, GATHER: gl.constexpr, a_desc, STAGES: gl.constexpr, a_load_layout: gl.constexpr):
    s = prod % STAGES
    bar = bars.index(s)
    if GATHER:
        mbarrier.expect(bar, g_desc.block_type.nbytes + u_desc.block_type.nbytes)
        BLOCK_K: gl.constexpr = g_desc.block_type.shape[1]
        ks = k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, a_load_layout))
        ptrs = x_ptr + tok[:, None] * stride_x + ks[None, :]
        async_copy.async_copy_global_to_shared(a_bufs.index(s), ptrs, mask=rmask[:, None] & (ks < H)[None, :])
        async_copy.commit_group()
    else:
        mbarrier.expect(bar, a_desc.block_type.nbytes + g_desc.block_type.nbytes + u_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [row0, k], bar, a_bufs.index(s))
    tma.async_copy_global_to_shared(g_desc, [grow, k], bar, g_bufs.index(s))
    tma.async_copy_global_to_shared(u_desc, [urow, k], bar, u_bufs.index(s))
    return prod + 1


@gluon.jit
def gate_up_kernel(x_ptr, stride_x, a_desc, g_desc, u_desc, routes_ptr, gu_ptr, h_ptr, tile_e_ptr, tile_row_ptr,
                   offsets_ptr, n_tiles_m, I, H, TOPK, GATHER: gl.constexpr, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr, num_warps: gl.constexpr):
    """gu[r] = [x[tok r] @ Wg[e]^T | x[tok r] @ Wu[e]^T], h[r] = silu(g) * u for the sorted rows r of expert e;
    Wg, Wu [E, I, H] as 2-D [E*I, H] descriptors. GATHER: x's rows by pointers (cp.async) from the routes, else
    a_desc over pre-gathered rows."""
    BLOCK_N: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[1]
    dtype: gl.constexpr = g_desc.dtype
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    a_load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [num_warps, 1], [1, 0])
    a_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_smem_layout)
    g_bufs = gl.allocate_shared_memory(dtype, [STAGES] + g_desc.block_type.shape, g_desc.layout)
    u_bufs = gl.allocate_shared_memory(dtype, [STAGES] + u_desc.block_type.shape, u_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    pid = gl.program_id(0)
    pid_m = pid % n_tiles_m
    pid_n = pid // n_tiles_m
    e = gl.load(tile_e_ptr + pid_m)
    if e >= 0:
        row0 = gl.load(tile_row_ptr + pid_m)
        row_end = gl.load(offsets_ptr + e + 1)
        lrows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_load_layout))
        rmask = lrows < row_end
        tok = (gl.load(routes_ptr + lrows, mask=rmask, other=0) // TOPK).to(gl.int64)
        grow = e * I + pid_n * BLOCK_N
        k_steps = gl.cdiv(H, BLOCK_K)
        prod = 0
        cons = 0
        for i in gl.static_range(STAGES - 1):
            prod = _gu_load(x_ptr, stride_x, tok, rmask, H, g_desc, u_desc, bars, a_bufs, g_bufs, u_bufs, prod, row0,
                            grow, grow, i * BLOCK_K, GATHER, a_desc, STAGES, a_load_layout)
        acc_g = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        acc_u = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        for kk in range(k_steps):
            s = cons % STAGES
            if GATHER:
                if kk + STAGES - 1 <= k_steps:
                    async_copy.wait_group(STAGES - 2)
                else:
                    async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()
            mbarrier.wait(bars.index(s), (cons // STAGES) & 1)
            acc_g = warpgroup_mma(a_bufs.index(s), g_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a_bufs.index(s), u_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
            cons += 1
            gl.thread_barrier()
            if kk + STAGES - 1 < k_steps:
                prod = _gu_load(x_ptr, stride_x, tok, rmask, H, g_desc, u_desc, bars, a_bufs, g_bufs, u_bufs, prod,
                                row0, grow, grow, (kk + STAGES - 1) * BLOCK_K, GATHER, a_desc, STAGES, a_load_layout)
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
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
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def gate_up(x, Wg, Wu, routes, offsets, topk, gather=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4,
            num_warps=8, gu=None, h=None):
    T, H = x.shape
    E, I, _ = Wg.shape
    M = routes.shape[0]
    gu = gu if gu is not None else torch.empty(M, 2 * I, device=x.device, dtype=x.dtype)
    h = h if h is not None else torch.empty(M, I, device=x.device, dtype=x.dtype)
    max_tiles = triton.cdiv(M, BLOCK_M) + E
    te, tr = tile_table(offsets, BLOCK_M, max_tiles)
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    g_desc = TensorDescriptor.from_tensor(Wg.view(E * I, H), [BLOCK_N, BLOCK_K], w_layout)
    u_desc = TensorDescriptor.from_tensor(Wu.view(E * I, H), [BLOCK_N, BLOCK_K], w_layout)
    if gather:
        a_desc = g_desc  # unused
    else:
        A = x[(routes // topk).long()]
        a_desc = TensorDescriptor.from_tensor(A, [BLOCK_M, BLOCK_K],
                                              gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16))
    grid = (max_tiles * triton.cdiv(I, BLOCK_N),)
    gate_up_kernel[grid](x, x.stride(0), a_desc, g_desc, u_desc, routes, gu, h, te, tr, offsets, max_tiles, I, H, topk,
                         gather, BLOCK_M, STAGES, num_warps=num_warps)
    return gu, h


@gluon.jit
def _tile_of(t, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr, I, BLOCK_N: gl.constexpr):
    """(expert, first row, end row, weight row) of flat tile t (m fastest: neighbours share a weight tile)."""
    pid_m = t % n_tiles_m
    pid_n = t // n_tiles_m
    e = gl.load(tile_e_ptr + pid_m)
    row0 = gl.load(tile_row_ptr + pid_m)
    row_end = gl.load(offsets_ptr + e + 1)
    return e, row0, row_end, e * I + pid_n * BLOCK_N, pid_n


@gluon.jit
def _gu_load_p(prod, pid, nprog, k_steps, tile_list_ptr, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr, routes_ptr,
               x_ptr, stride_x, I, H, TOPK, g_desc, u_desc, bars, a_bufs, g_bufs, u_bufs, GATHER: gl.constexpr, a_desc,
               STAGES: gl.constexpr, BLOCK_M: gl.constexpr, a_load_layout: gl.constexpr):
    """The loads of K step `prod` of this program's flattened (tile, k) sequence."""
    BLOCK_N: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[1]
    t = gl.load(tile_list_ptr + pid + (prod // k_steps) * nprog)
    _e, row0, row_end, wrow, _n = _tile_of(t, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr, I, BLOCK_N)
    lrows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, a_load_layout))
    rmask = lrows < row_end
    tok = (gl.load(routes_ptr + lrows, mask=rmask, other=0) // TOPK).to(gl.int64)
    return _gu_load(x_ptr, stride_x, tok, rmask, H, g_desc, u_desc, bars, a_bufs, g_bufs, u_bufs, prod, row0, wrow,
                    wrow, (prod % k_steps) * BLOCK_K, GATHER, a_desc, STAGES, a_load_layout)


@gluon.jit
def gate_up_persistent_kernel(x_ptr, stride_x, a_desc, g_desc, u_desc, routes_ptr, gu_ptr, h_ptr, tile_list_ptr,
                              n_work, tile_e_ptr, tile_row_ptr, offsets_ptr, n_tiles_m, I, H, TOPK,
                              GATHER: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                              num_warps: gl.constexpr):
    """gate_up_kernel over a persistent grid: program p takes the live tiles tile_list[p::nprog]; the loads run
    STAGES-1 K steps ahead across tile boundaries, so the next tile's loads overlap this tile's epilogue."""
    BLOCK_N: gl.constexpr = g_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = g_desc.block_type.shape[1]
    dtype: gl.constexpr = g_desc.dtype
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    a_load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_K, BLOCK_K // 8], [num_warps, 1], [1, 0])
    a_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_smem_layout)
    g_bufs = gl.allocate_shared_memory(dtype, [STAGES] + g_desc.block_type.shape, g_desc.layout)
    u_bufs = gl.allocate_shared_memory(dtype, [STAGES] + u_desc.block_type.shape, u_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    my_tiles = (n_work - pid + nprog - 1) // nprog
    k_steps = gl.cdiv(H, BLOCK_K)
    total = my_tiles * k_steps
    for i in gl.static_range(STAGES - 1):
        if i < total:
            _gu_load_p(i, pid, nprog, k_steps, tile_list_ptr, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr,
                       routes_ptr, x_ptr, stride_x, I, H, TOPK, g_desc, u_desc, bars, a_bufs, g_bufs, u_bufs, GATHER,
                       a_desc, STAGES, BLOCK_M, a_load_layout)
        elif GATHER:
            async_copy.commit_group()  # (empty: one group per step keeps wait_group's count)
    acc_g = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    acc_u = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    for c in range(total):
        kk = c % k_steps
        s = c % STAGES
        if GATHER:
            async_copy.wait_group(STAGES - 2)
            fence_async_shared()
            gl.thread_barrier()
        mbarrier.wait(bars.index(s), (c // STAGES) & 1)
        acc_g = warpgroup_mma(a_bufs.index(s), g_bufs.index(s).permute((1, 0)), acc_g, is_async=True, use_acc=kk > 0)
        acc_u = warpgroup_mma(a_bufs.index(s), u_bufs.index(s).permute((1, 0)), acc_u, is_async=True, use_acc=kk > 0)
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
        gl.thread_barrier()
        p = c + STAGES - 1
        if p < total:
            _gu_load_p(p, pid, nprog, k_steps, tile_list_ptr, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr,
                       routes_ptr, x_ptr, stride_x, I, H, TOPK, g_desc, u_desc, bars, a_bufs, g_bufs, u_bufs, GATHER,
                       a_desc, STAGES, BLOCK_M, a_load_layout)
        elif GATHER:
            async_copy.commit_group()
        if kk == k_steps - 1:
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            c_t = gl.load(tile_list_ptr + pid + (c // k_steps) * nprog)
            _e, row0, row_end, _w, pid_n = _tile_of(c_t, n_tiles_m, tile_e_ptr, tile_row_ptr, offsets_ptr, I, BLOCK_N)
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
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def gate_up_persistent(x, Wg, Wu, routes, offsets, topk, gather=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64,
                       STAGES=4, num_warps=8, gu=None, h=None, num_sms=None):
    T, H = x.shape
    E, I, _ = Wg.shape
    M = routes.shape[0]
    gu = gu if gu is not None else torch.empty(M, 2 * I, device=x.device, dtype=x.dtype)
    h = h if h is not None else torch.empty(M, I, device=x.device, dtype=x.dtype)
    max_tiles = triton.cdiv(M, BLOCK_M) + E
    te, tr = tile_table(offsets, BLOCK_M, max_tiles)
    n_n = triton.cdiv(I, BLOCK_N)
    flat = torch.arange(max_tiles * n_n, device=x.device, dtype=torch.int32)
    live = flat[te.repeat(n_n) >= 0]  # (the lab builds the list on the host side of the stream; a real
    # kernel would skip dead tiles in place)
    n_work = live.numel()
    w_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    g_desc = TensorDescriptor.from_tensor(Wg.view(E * I, H), [BLOCK_N, BLOCK_K], w_layout)
    u_desc = TensorDescriptor.from_tensor(Wu.view(E * I, H), [BLOCK_N, BLOCK_K], w_layout)
    if gather:
        a_desc = g_desc
    else:
        A = x[(routes // topk).long()]
        a_desc = TensorDescriptor.from_tensor(A, [BLOCK_M, BLOCK_K],
                                              gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16))
    sms = num_sms or torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(sms, n_work),)
    gate_up_persistent_kernel[grid](x, x.stride(0), a_desc, g_desc, u_desc, routes, gu, h, live, n_work, te, tr,
                                    offsets, max_tiles, I, H, topk, gather, BLOCK_M, STAGES, num_warps=num_warps)
    return gu, h


def tile_table(offsets, BLOCK_M, max_tiles):
    counts = (offsets[1:] - offsets[:-1]).long()
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    cum = torch.cumsum(tiles, 0)
    t = torch.arange(max_tiles, device=offsets.device)
    e = torch.searchsorted(cum, t, right=True)
    valid = e < len(counts)
    ec = e.clamp(max=len(counts) - 1)
    start_tile = cum[ec] - tiles[ec]
    row = offsets[:-1].long()[ec] + (t - start_tile) * BLOCK_M
    return torch.where(valid, ec, -1).to(torch.int32), torch.where(valid, row, 0).to(torch.int32)


def grouped_gemm(A, B, offsets, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, STAGES=3, num_warps=8, out=None):
    M, K = A.shape
    E, N, _ = B.shape
    C = out if out is not None else torch.empty(M, N, device=A.device, dtype=A.dtype)
    max_tiles = triton.cdiv(M, BLOCK_M) + E
    te, tr = tile_table(offsets, BLOCK_M, max_tiles)
    a_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
    a_desc = TensorDescriptor.from_tensor(A, [BLOCK_M, BLOCK_K], a_layout)
    b_desc = TensorDescriptor.from_tensor(B.view(E * N, K), [BLOCK_N, BLOCK_K], b_layout)
    grid = (max_tiles * triton.cdiv(N, BLOCK_N),)
    grouped_gemm_kernel[grid](a_desc, b_desc, C, C.stride(0), te, tr, offsets, max_tiles, N, K, STAGES,
                              num_warps=num_warps)
    return C


def compile_only(BM=128, BN=256, BK=64, ST=3, NW=8):
    """CPU: build the kernel for sm_90 (no GPU needed) to catch API and layout errors."""
    from triton.backends.compiler import GPUTarget
    import triton.experimental.gluon._runtime as R
    a_l = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    b_l = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    from triton.experimental.gluon.language.nvidia.hopper.tma import tensor_descriptor_type
    sig = {"a_desc": f"tensordesc<bf16[{BM}, {BK}],{a_l!r}>", "b_desc": f"tensordesc<bf16[{BN}, {BK}],{b_l!r}>",
           "c_ptr": "*bf16", "stride_cm": "i32", "tile_e_ptr": "*i32", "tile_row_ptr": "*i32", "offsets_ptr": "*i32",
           "n_tiles_m": "i32", "N": "i32", "K": "i32", "STAGES": "constexpr", "num_warps": "constexpr"}
    src = R.GluonASTSource(grouped_gemm_kernel, sig, constexprs={"STAGES": ST, "num_warps": NW})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NW})
    print("compiled:", c.metadata.shared, "bytes smem;", "wgmma" in c.asm["ptx"])


def compile_gate_up(GATHER, BM=128, BN=128, BK=64, ST=4, NW=8, kernel=None):
    kernel = kernel or gate_up_kernel
    from triton.backends.compiler import GPUTarget
    import triton.experimental.gluon._runtime as R
    a_l = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    w_l = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    wd = f"tensordesc<bf16[{BN}, {BK}],{w_l!r}>"
    sig = {"x_ptr": "*bf16", "stride_x": "i32", "a_desc": f"tensordesc<bf16[{BM}, {BK}],{a_l!r}>" if not GATHER else wd,
           "g_desc": wd, "u_desc": wd, "routes_ptr": "*i32", "gu_ptr": "*bf16", "h_ptr": "*bf16", "tile_e_ptr": "*i32",
           **({"tile_list_ptr": "*i32", "n_work": "i32"} if kernel is not gate_up_kernel else {}),
           "tile_row_ptr": "*i32", "offsets_ptr": "*i32", "n_tiles_m": "i32", "I": "i32", "H": "i32", "TOPK": "i32",
           "GATHER": "constexpr", "BLOCK_M": "constexpr", "STAGES": "constexpr", "num_warps": "constexpr"}
    names = list(sig)
    div16 = ["x_ptr", "stride_x", "routes_ptr", "gu_ptr", "h_ptr", "tile_e_ptr", "tile_row_ptr", "offsets_ptr", "I", "H"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    sig = {n: sig[n] for n in kernel.arg_names}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = R.GluonASTSource(kernel, sig, constexprs={"GATHER": GATHER, "BLOCK_M": BM, "STAGES": ST, "num_warps": NW},
                           attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NW})
    print("gate_up compiled:", GATHER, c.metadata.shared, "bytes smem;", "cp.async" in c.asm["ptx"], c.asm["ptx"].count("wgmma.mma_async"))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        compile_gate_up(True)
        compile_gate_up(False)
        compile_gate_up(True, kernel=gate_up_persistent_kernel)
        compile_gate_up(False, kernel=gate_up_persistent_kernel)
        for c in [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 4), (128, 128, 64, 5, 8),
                  (64, 256, 64, 4, 4), (256, 128, 64, 3, 8)]:
            compile_only(*c)
        sys.exit(0)
    from triton.testing import do_bench
    from mok_inductor.kernels.grouped_gemm import grouped_rows
    from mok_inductor.types import Operand
    torch.manual_seed(0)
    out_dir = os.environ.get("OUT", ".")
    name = torch.cuda.get_device_name()
    print(name)
    # (label, rows M, E, N, K): mixtral T8192 K2, qwen3 T16384 K8, gpt-oss-20b T8192 K4
    shapes = [("mixtral gate/up", 16384, 8, 28672, 4096), ("mixtral down", 16384, 8, 4096, 14336),
              ("qwen3 gate/up", 131072, 128, 1536, 2048), ("qwen3 down", 131072, 128, 2048, 768),
              ("gptoss gate/up", 32768, 32, 5760, 2880), ("gptoss down", 32768, 32, 2880, 2880)]
    configs = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 4), (128, 128, 64, 5, 8),
               (64, 256, 64, 4, 4), (256, 128, 64, 3, 8)]
    only = os.environ.get("SHAPES")
    res = []
    for label, M, E, N, K in shapes:
        if only and not any(s in label for s in only.split(",")):
            continue
        A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        counts = torch.full((E,), M // E, dtype=torch.int64)
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(counts, 0)
        offsets = offsets.cuda()
        flops = 2 * M * N * K
        ref = torch.empty(M, N, device="cuda", dtype=torch.float32)
        for e in range(E):
            s, t = offsets[e].item(), offsets[e + 1].item()
            ref[s:t] = A[s:t].float() @ B[e].float().T
        row = {"shape": label}
        def tf(ms):
            return round(flops / ms / 1e9, 1)


        if E * N >= N:
            W = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
            row["torch.mm dense"] = tf(do_bench(lambda: torch.mm(A, W)))
        if hasattr(torch, "_grouped_mm"):
            Bt = B.transpose(1, 2)
            o = torch._grouped_mm(A, Bt, offs=offsets[1:])
            row["grouped_mm err"] = ((o.float() - ref).norm() / ref.norm()).item()
            row["torch._grouped_mm"] = tf(do_bench(lambda: torch._grouped_mm(A, Bt, offs=offsets[1:])))
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        routes = torch.arange(M, device="cuda", dtype=torch.int32)
        try:
            grouped_rows(A, Operand(B, None), out, routes, offsets, scatter=False)
            row["mok tl.dot err"] = ((out.float() - ref).norm() / ref.norm()).item()
            row["mok tl.dot"] = tf(do_bench(lambda: grouped_rows(A, Operand(B, None), out, routes, offsets, scatter=False)))
        except Exception as ex:
            row["mok tl.dot"] = repr(ex)[:200]
        for c in configs:
            BM, BN, BK, ST, NW = c
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                grouped_gemm(A, B, offsets, BM, BN, BK, ST, NW, out=out)
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                t = do_bench(lambda: grouped_gemm(A, B, offsets, BM, BN, BK, ST, NW, out=out))
                row[f"gluon {c}"] = (tf(t), f"{err:.1e}")
            except Exception as ex:
                row[f"gluon {c}"] = repr(ex)[:300]
        print(json.dumps(row), flush=True)
        res.append(row)
    json.dump({"device": name, "rows": res}, open(os.path.join(out_dir, "gl_gemm.json"), "w"), indent=1)
    # ---- the gate/up GEMM with the SwiGLU epilogue: gathered rows (cp.async) vs pre-gathered (TMA) ----
    from mok_inductor.kernels.gate_up import gate_up as mok_gate_up
    gu_shapes = [("mixtral", 8192, 2, 8, 4096, 14336), ("qwen3", 16384, 8, 128, 2048, 768),
                 ("gptoss", 8192, 4, 32, 2880, 2880)]
    gu_cfgs = [("grid", True, 128, 128, 64, 4, 8), ("grid", False, 128, 128, 64, 4, 8), ("grid", True, 128, 128, 64, 3, 8),
               ("grid", True, 64, 128, 64, 4, 4), ("grid", True, 128, 64, 64, 4, 4),
               ("persistent", True, 128, 128, 64, 4, 8), ("persistent", False, 128, 128, 64, 4, 8),
               ("persistent", True, 64, 128, 64, 4, 4)]
    gres = []
    for label, T, K, E, H, I in gu_shapes:
        if only and not any(s in label for s in only.split(",")):
            continue
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        Wg = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        Wu = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        top = torch.rand(T, E, device="cuda").topk(K, dim=1).indices.to(torch.int32)
        routes = torch.argsort(top.flatten(), stable=True).to(torch.int32)
        counts = torch.bincount(top.flatten().long(), minlength=E)
        offsets = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
        offsets[1:] = torch.cumsum(counts, 0)
        M = T * K
        ex = top.flatten()[routes.long()].long()
        A = x[(routes // K).long()]
        g_ref = torch.empty(M, I, device="cuda"); u_ref = torch.empty(M, I, device="cuda")
        for e in range(E):
            s_, t_ = offsets[e].item(), offsets[e + 1].item()
            g_ref[s_:t_] = A[s_:t_].float() @ Wg[e].float().T
            u_ref[s_:t_] = A[s_:t_].float() @ Wu[e].float().T
        h_ref = torch.nn.functional.silu(g_ref.bfloat16().float()) * u_ref.bfloat16().float()
        flops = 4 * M * H * I
        def tf(ms):
            return round(flops / ms / 1e9, 1)
        row = {"shape": label, "M": M}
        row["gather x (ms)"] = round(do_bench(lambda: x[(routes // K).long()]), 4)
        W = torch.randn(H, 2 * I, device="cuda", dtype=torch.bfloat16)
        row["torch.mm dense"] = tf(do_bench(lambda: torch.mm(A, W)))
        Wgu = torch.cat([Wg, Wu], 1).transpose(1, 2)
        row["grouped_mm (pre-gathered, no gather)"] = tf(do_bench(lambda: torch._grouped_mm(A, Wgu, offs=offsets[1:])))
        gu = torch.full((M, 2 * I), float("nan"), device="cuda", dtype=torch.bfloat16)
        hh = torch.full((M, I), float("nan"), device="cuda", dtype=torch.bfloat16)
        from mok_inductor.types import Operand as Op
        try:
            mok_gate_up(x, Op(Wg, None), Op(Wu, None), gu, routes, offsets, K, None, h_out=hh)
            row["mok tl.dot err h"] = ((hh.float() - h_ref).norm() / h_ref.norm()).item()
            row["mok tl.dot"] = tf(do_bench(lambda: mok_gate_up(x, Op(Wg, None), Op(Wu, None), gu, routes, offsets, K, None, h_out=hh)))
        except Exception as ex_:
            row["mok tl.dot"] = repr(ex_)[:300]
        for c in gu_cfgs:
            kind, gather, BM, BN, BK, ST, NW = c
            fn = gate_up if kind == "grid" else gate_up_persistent
            gu = torch.full((M, 2 * I), float("nan"), device="cuda", dtype=torch.bfloat16)
            hh = torch.full((M, I), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                fn(x, Wg, Wu, routes, offsets, K, gather, BM, BN, BK, ST, NW, gu=gu, h=hh)
                torch.cuda.synchronize()
                eg = ((gu[:, :I].float() - g_ref).norm() / g_ref.norm()).item()
                eh = ((hh.float() - h_ref).norm() / h_ref.norm()).item()
                t = do_bench(lambda: fn(x, Wg, Wu, routes, offsets, K, gather, BM, BN, BK, ST, NW, gu=gu, h=hh))
                row[f"gluon {c}"] = (tf(t), f"g {eg:.1e} h {eh:.1e}")
            except Exception as ex_:
                row[f"gluon {c}"] = repr(ex_)[:300]
        print(json.dumps(row), flush=True)
        gres.append(row)
    json.dump({"device": name, "rows": res, "gate_up": gres}, open(os.path.join(out_dir, "gl_gemm.json"), "w"), indent=1)
