"""The staged L2 (bf16) with warp specialisation, in Gluon (Hopper only).

Same contract as ``gemm.l2_kernel`` with ``RANK_SIGNAL``, no waits and whole tiles (the GPU
default of a bf16 staged call): grid (programs, local ranks); tickets (m_block, n_block) as
``gemm.grouped_tile``; each tile's rows [BM, BN] of ``pool_act @ w2[e]^T`` are stored as bf16
into their tokens' combine slots on the token's rank; the last program of a rank releases
``l2_ranks_done`` on every rank.

Why a second L2: Triton 3.6 does not warp-specialise on sm_90, so the one L2 program issues
its own TMA loads, waits on them and runs the MMAs and the scatter epilogue in turn
(benchmarks/NOTES.md, sessions 6, 12, 19: the dsv3 L2 at 79-88 % of torch._grouped_mm from
512 rows per expert). Here one loader warp keeps ``STAGES`` K steps in flight across tiles,
and the MMA warps only wait on mbarriers:

    loader (1 warp)      for each tile, K step: wait slot empty, TMA A rows + w2 tile -> slot
    default (MMA warps)  for each tile, K step: wait slot full, async wgmma, release the slot
                         whose MMA finished; then the scatter epilogue

Gluon has no interpreter: this kernel runs on Hopper GPUs only (its tests are marked gpu and
check it against the Triton L2 and the reference); the Triton ``l2_kernel`` stays the path
under TRITON_INTERPRET and the one this kernel is measured against.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

__all__ = ["l2_ws_kernel"]


@gluon.jit
def _peer(table, rank, byte_offset, DTYPE: gl.constexpr):
    """Pointer to ``byte_offset`` inside rank ``rank``'s buffer (``_common.peer_ptr``)."""
    base = gl.load(table + rank).to(gl.int64)
    return (base + byte_offset).to(gl.pointer_type(DTYPE))


@gluon.jit
def _tile(ticket, num_m, NB, GROUP_M: gl.constexpr):
    """(m_block, n_block) of ``ticket``: ``gemm.grouped_tile`` (scalars)."""
    per_group = GROUP_M * NB
    first_m = (ticket // per_group) * GROUP_M
    size_m = gl.maximum(gl.minimum(num_m - first_m, GROUP_M), 1)
    r = ticket % per_group
    return first_m + r % size_m, r // size_m


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, block_meta, num_m, NB, H, I, pid,
            nprog, GROUP_M: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    i = 0
    for t in range(pid, num_m * NB, nprog):
        mb, nb = _tile(t, num_m, NB, GROUP_M)
        row_w = (gl.load(block_meta + mb) >> 9) * H + nb * BN
        for k in range(0, I, BK):
            s = i % STAGES
            # slots start free: the first pass waits on the phase before the barrier's first
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [mb * BM, k], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [row_w, k], ready.index(s), w_bufs.index(s))
            i += 1


@gluon.jit
def _mma_epilogue(a_bufs, w_bufs, ready, empty, table, block_meta, pool_src, off_combine_y,
                  num_m, NB, H, I, T_MAX, pid, nprog, R: gl.constexpr, K: gl.constexpr,
                  GROUP_M: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16])
    # stores: 8 bf16 (16 B) per thread, a row's BN columns over BN / 8 threads
    TPW_N: gl.constexpr = BN // 8 if BN // 8 < 32 else 32
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_N, TPW_N], [num_warps, 1],
                                                [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, out_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, out_layout)
    cols = gl.arange(0, BN, layout=col_layout)
    i = 0
    for t in range(pid, num_m * NB, nprog):
        mb, nb = _tile(t, num_m, NB, GROUP_M)
        vm = gl.load(block_meta + mb) & 511
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for k in range(0, I, BK):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc,
                                is_async=True)
            # one MMA in flight: the previous K step's is done, its slot goes back to the loader
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=k > 0)
            i += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES))
        # scatter epilogue (``gemm.l2_epilogue`` / ``store_slot_rows``)
        out = gl.convert_layout(acc.to(gl.bfloat16), out_layout)
        r = gl.arange(0, BM, layout=row_layout)
        rv = r < vm
        code = gl.load(pool_src + (mb.to(gl.int64) * BM + r), mask=rv, other=0)
        src = code // (T_MAX * K)
        tk = code % (T_MAX * K)
        row_off = tk * H + nb * BN
        for s in gl.static_range(R):
            # each row's first column is 16-byte aligned (region starts, H and BN multiples of
            # 8): said on the row pointers, so a thread stores its 8 columns in one instruction
            rows_s = gl.multiple_of(_peer(table, s, off_combine_y, gl.bfloat16) + row_off, [16])
            gl.store(gl.expand_dims(rows_s, 1) + gl.expand_dims(cols, 0), out,
                     mask=gl.expand_dims(rv & (src == s), 1))


@gluon.jit
def l2_ws_kernel(table, rank0, w2_table, off_block_start, off_block_meta, off_pool_act,
                 off_pool_src, off_combine_y, off_l2_programs, off_l2_ranks_done,
                 H, I, E_LOC, T_MAX, P,
                 R: gl.constexpr, K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                 BK: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                 num_warps: gl.constexpr):
    """See the module docstring. num_warps: the MMA warps (4 for BN 128, 8 for BN 256); the
    loader is one more warp."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    rank = rank0 + gl.program_id(1)
    w2 = gl.load(w2_table + gl.program_id(1)).to(gl.pointer_type(gl.bfloat16))
    block_start = _peer(table, rank, off_block_start, gl.int32)
    block_meta = _peer(table, rank, off_block_meta, gl.int32)
    pool_src = _peer(table, rank, off_pool_src, gl.int32)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    a_desc = tma.make_tensor_descriptor(_peer(table, rank, off_pool_act, gl.bfloat16),
                                        shape=[P, I], strides=[I, 1], block_shape=[BM, BK],
                                        layout=a_layout)
    w_desc = tma.make_tensor_descriptor(w2, shape=[E_LOC * H, I], strides=[I, 1],
                                        block_shape=[BN, BK], layout=w_layout)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], w_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    NB = H // BN
    num_m = gl.load(block_start + E_LOC)
    gl.warp_specialize([
        (_mma_epilogue, (a_bufs, w_bufs, ready, empty, table, block_meta, pool_src,
                         off_combine_y, num_m, NB, H, I, T_MAX, pid, nprog, R, K, GROUP_M, BN,
                         num_warps)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, block_meta, num_m, NB, H, I,
                   pid, nprog, GROUP_M)),
    ], [1], [40])
    # this program's rows are stored: count it; the rank's last program releases every rank
    # (``gemm.l2_kernel``'s RANK_SIGNAL: gpu scope among this GPU's programs, then one
    # cumulative system-scope release per rank)
    gl.thread_barrier()
    done = gl.atomic_add(_peer(table, rank, off_l2_programs, gl.int32), 1, sem="acq_rel",
                         scope="gpu")
    if done == nprog - 1:
        for s in gl.static_range(R):
            gl.atomic_add(_peer(table, s, off_l2_ranks_done, gl.int32), 1, sem="release",
                          scope="sys")
