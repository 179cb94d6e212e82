"""The L2 GEMM over pool_act: each tile's rows written straight into the combine slot of the
token's own rank.

Legend:
    pool_act [P, I] bf16  the L1's output (FP8: e4m3 byte rows with their scales)
    w2 [E_LOC, H, I]      one tensor per local rank, reached through w2_table
    combine_y [T_MAX, K, H] bf16 on the token's rank, flag combine_flag [T_MAX, K]
    l2_done [m-blocks]    L2 column blocks finished (the fused launch: the block that
                          completes an m-block releases the combine flags of its rows)

An L2 block waits until all L1 column blocks of its m-block are done (``l1_done``). Decode,
tail and fp4w pieces as in kernels/l1.py; SPLIT_M splits an m-block into row pieces walked as
m-blocks of their own. Persistent: grid (programs, local ranks).
"""
from __future__ import annotations

from .common import at, peer_ptr, peer_ptrs, tl, triton, wait_at_least, zero_acc
from .epilogue import l2_epilogue, signal_block_rows, slot_codes
from .gemm_fp4 import l2_fp4w_rows
from .gemm_fp8 import fp8_descriptors, l2_fp8_acc, l2_fp8_rows
from .operands import gemm_context, l2_descriptors, pool_piece_descriptors, weight_tile
from .tickets import (advance, claiming, claims_ptr, count_split_part, finish_claims, first_next,
                      grouped_tile, l1_tile_of, next_tickets, split_count, split_range, split_tile,
                      split_total)


@triton.jit
def l2_fp8_pool_block(mb, nb, NB, meta, table, rank, l2_done, pool_src, off_pool_act,
                      off_combine_y, off_combine_flag, w2, w2_s, H, I, AB, T_MAX, R,
                      K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      FIX_ROUNDING: tl.constexpr,
                      SIGNAL_ROWS: tl.constexpr = True, EPI_SPLIT: tl.constexpr = 1,
                      a_desc=0, w_desc=0, USE_TMA: tl.constexpr = False, sub=0,
                      SPLIT_M: tl.constexpr = 1, DM: tl.constexpr = 0, W4: tl.constexpr = 0,
                      TAIL: tl.constexpr = False):
    """One fp8 L2 block over pool_act's byte rows, into the combine slots (``l2_epilogue``).
    USE_TMA: values through ``fp8_descriptors`` (built once per launch). SPLIT_M / sub: the
    block is row piece ``sub`` of BM / SPLIT_M rows of m-block ``mb`` (``l2_block``).
    DM > 0: decode pieces (``l2_fp8_rows`` with SWAP; SIGNAL_ROWS after the last); with
    TAIL, row piece ``sub`` as one DM-row decode piece when it holds at most DM valid rows,
    else as usual (nothing when it holds none).
    W4 > 0: MXFP4 weights, the piece's valid rows in pieces of W4 rows (without
    SIGNAL_ROWS when W4 < BM / SPLIT_M)."""
    act_q = peer_ptr(table, rank, off_pool_act, tl.float8e4nv)
    act_s = peer_ptr(table, rank, off_pool_act + I, tl.float32)
    if W4:
        BMT: tl.constexpr = BM // SPLIT_M   # l2_epilogue asserts pieces < BM do not signal rows
        vm = meta & 511
        for r0 in range(sub * BMT, tl.minimum(vm, sub * BMT + BMT), W4):
            acc = l2_fp4w_rows(mb, r0, nb, meta >> 9, act_q, act_s, w2, w2_s, H, I, AB, AB // 4,
                               BM, BN, BK, W4)
            l2_epilogue(acc, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                        off_combine_flag, H, T_MAX, R, K, BM, BN, FIX_ROUNDING,
                        SIGNAL_ROWS, EPI_SPLIT, r0 // W4, BM // W4)
    elif DM > 0 and TAIL:   # as l2_decode_block's TAIL
        tl.static_assert(not SIGNAL_ROWS, "tail pieces need the caller to signal")
        BMP: tl.constexpr = BM // SPLIT_M
        vm = meta & 511
        pv = vm - sub * BMP
        if pv > DM:
            acc_f = l2_fp8_acc(mb, nb, meta >> 9, act_q, act_s, w2, w2_s, H, I, AB, AB // 4, BM,
                               BN, BK, a_desc[1], w_desc, USE_TMA, sub, SPLIT_M)
            l2_epilogue(acc_f, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                        off_combine_flag, H, T_MAX, R, K, BM, BN, FIX_ROUNDING,
                        False, EPI_SPLIT, sub, SPLIT_M)
        elif pv > 0:
            acc_t = l2_fp8_rows(mb, sub * BMP, nb, meta >> 9, act_q, act_s, w2, w2_s, H, I, AB,
                                AB // 4, BM, BN, BK, DM, a_desc[0], w_desc, USE_TMA, True)
            l2_epilogue(acc_t, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                        off_combine_flag, H, T_MAX, R, K, BM, BN, FIX_ROUNDING,
                        False, EPI_SPLIT, sub * BMP // DM, BM // DM)
    elif DM > 0:   # pieces as l2_decode_block (SIGNAL_ROWS: signalled after the last)
        WIDE: tl.constexpr = 32 if BM >= 32 else BM   # DECODE_WIDE
        vm = meta & 511
        if vm <= DM:
            acc = l2_fp8_rows(mb, 0, nb, meta >> 9, act_q, act_s, w2, w2_s, H, I, AB, AB // 4,
                              BM, BN, BK, DM, a_desc[0], w_desc, USE_TMA, True)
            l2_epilogue(acc, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                        off_combine_flag, H, T_MAX, R, K, BM, BN, FIX_ROUNDING,
                        False, EPI_SPLIT, 0, BM // DM, EVICT_LAST=True)
        else:
            for r0 in range(0, vm, WIDE):
                acc_w = l2_fp8_rows(mb, r0, nb, meta >> 9, act_q, act_s, w2, w2_s, H, I, AB,
                                    AB // 4, BM, BN, BK, WIDE, a_desc[1], w_desc, USE_TMA, True)
                l2_epilogue(acc_w, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                            off_combine_flag, H, T_MAX, R, K, BM, BN, FIX_ROUNDING,
                            False, EPI_SPLIT, r0 // WIDE, BM // WIDE, EVICT_LAST=True)
        if SIGNAL_ROWS:
            signal_block_rows(mb, NB, vm, table, l2_done, pool_src, off_combine_flag, T_MAX, K,
                              BM)
    else:
        acc = l2_fp8_acc(mb, nb, meta >> 9, act_q, act_s, w2, w2_s, H, I, AB, AB // 4, BM, BN,
                         BK, a_desc, w_desc, USE_TMA, sub, SPLIT_M)
        l2_epilogue(acc, mb, nb, NB, meta & 511, table, l2_done, pool_src, off_combine_y,
                    off_combine_flag, H, T_MAX, R, K, BM, BN, FIX_ROUNDING,
                    SIGNAL_ROWS, EPI_SPLIT, sub, SPLIT_M)


@triton.jit
def l2_block(mb, nb, NB, meta, table, l2_done, pool_act, pool_src, w2, a_desc, w_desc,
             off_combine_y, off_combine_flag, H, I, T_MAX, R,
             K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
             SIGNAL_ROWS: tl.constexpr = True, EPI_SPLIT: tl.constexpr = 1, sub=0,
             SPLIT_M: tl.constexpr = 1):
    """One L2 block: rows of (m_block, n_block) into their tokens' combine slots; the block
    that completes an m-block (of NB column blocks) releases its rows' combine flags.
    SPLIT_M > 1: the block covers row piece ``sub`` (BM / SPLIT_M rows) of the m-block only
    (a descriptor of that many rows; without SIGNAL_ROWS)."""
    e = meta >> 9
    vm = meta & 511
    BMT: tl.constexpr = BM // SPLIT_M
    acc = l2_rows(mb, sub * BMT, nb, e, pool_act, w2, a_desc, w_desc, H, I, BM, BN, BK, BMT,
                  UPCAST, USE_TMA, False)
    l2_epilogue(acc, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y, off_combine_flag,
                H, T_MAX, R, K, BM, BN, UPCAST, SIGNAL_ROWS, EPI_SPLIT, sub, SPLIT_M)


@triton.jit
def l2_decode_block(mb, nb, NB, meta, table, l2_done, pool_act, pool_src, w2, a_desc, w_desc,
                    off_combine_y, off_combine_flag, H, I, T_MAX, R, K: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DM: tl.constexpr,
                    UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
                    EPI_SPLIT: tl.constexpr, TAIL: tl.constexpr = False, sub=0,
                    SPLIT_M: tl.constexpr = 1, SIGNAL_ROWS: tl.constexpr = False):
    """``l2_block`` for decode (pieces as ``l1_decode_block``): [BN, rows] = w2 tile @ rows^T,
    transposed into the combine slots. The caller signals (per program, ``l2_kernel``'s
    RANK_SIGNAL), or with SIGNAL_ROWS the block does after its last piece, as ``l2_block``
    (the fused launch). TAIL (tail pieces): row piece ``sub`` of BM / SPLIT_M rows is one
    DM-row decode piece when it holds at most DM valid rows, else the usual tile
    (``a_desc[1]`` of BM / SPLIT_M rows); a piece without valid rows computes nothing."""
    tl.static_assert(not (TAIL and SIGNAL_ROWS), "tail pieces: the caller signals")
    WIDE: tl.constexpr = 32 if BM >= 32 else BM   # DECODE_WIDE
    BMP: tl.constexpr = BM // SPLIT_M
    vm = meta & 511
    if TAIL:
        pv = vm - sub * BMP
        if pv > DM:
            acc_f = l2_rows(mb, sub * BMP, nb, meta >> 9, pool_act, w2, a_desc[1], w_desc, H, I,
                            BM, BN, BK, BMP, UPCAST, USE_TMA, False)
            l2_epilogue(acc_f, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                        off_combine_flag, H, T_MAX, R, K, BM, BN, UPCAST, False,
                        EPI_SPLIT, sub, SPLIT_M)
        elif pv > 0:
            acc_t = l2_rows(mb, sub * BMP, nb, meta >> 9, pool_act, w2, a_desc[0], w_desc, H, I,
                            BM, BN, BK, DM, UPCAST, USE_TMA, True)
            l2_epilogue(acc_t, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                        off_combine_flag, H, T_MAX, R, K, BM, BN, UPCAST, False,
                        EPI_SPLIT, sub * BMP // DM, BM // DM)
    elif vm <= DM:
        # the rows' slots are loaded before the K loop, whose time hides the load
        code = slot_codes(pool_src, mb, vm, 0, BM, DM)[0]
        acc = l2_rows(mb, 0, nb, meta >> 9, pool_act, w2, a_desc[0], w_desc, H, I, BM, BN, BK,
                      DM, UPCAST, USE_TMA, True)
        l2_epilogue(acc, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                    off_combine_flag, H, T_MAX, R, K, BM, BN, UPCAST, False,
                    EPI_SPLIT, 0, BM // DM, True, code, EVICT_LAST=True)
    else:
        for r0 in range(0, vm, WIDE):
            # its own name: Triton's if needs a value of one shape in both branches
            acc_w = l2_rows(mb, r0, nb, meta >> 9, pool_act, w2, a_desc[1], w_desc, H, I, BM, BN,
                            BK, WIDE, UPCAST, USE_TMA, True)
            l2_epilogue(acc_w, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                        off_combine_flag, H, T_MAX, R, K, BM, BN, UPCAST, False,
                        EPI_SPLIT, r0 // WIDE, BM // WIDE, EVICT_LAST=True)
    if SIGNAL_ROWS:
        signal_block_rows(mb, NB, vm, table, l2_done, pool_src, off_combine_flag, T_MAX, K, BM)


@triton.jit
def l2_split_part(tile, part, S, mb, nb, NB, meta, table, l2_done, pool_act, pool_src, w2,
                  a_desc, w_desc, sums, counts, off_combine_y, off_combine_flag, H, I, T_MAX, R,
                  K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  DM: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
                  EPI_SPLIT: tl.constexpr,
                  SIGNAL_ROWS: tl.constexpr = False):
    """Part ``part`` of S of a decode L2 block's K loop (split-K, ``L2.split_k``), as
    ``l1_split_part``: its fp32 sums [DM, BN] go to ``sums`` slot tile * S + part, and the
    part that counts last adds the S slots in order, stores the rows into their combine
    slots and sets the count back to 0. The caller signals (``l2_kernel``'s RANK_SIGNAL), or
    with SIGNAL_ROWS the part that stores the block's rows does (the fused launch, as
    ``l2_decode_block``). A block of more than DM rows (wide pieces) runs whole in part 0."""
    vm = meta & 511
    if vm <= DM:
        k_lo, k_hi = split_range(part, S, I, BK)
        acc = l2_rows(mb, 0, nb, meta >> 9, pool_act, w2, a_desc[0], w_desc, H, I, BM, BN, BK,
                      DM, UPCAST, USE_TMA, True, k_lo, k_hi)
        cell = tl.arange(0, DM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(sums + (tile * S + part).to(tl.int64) * (BN * DM) + cell, acc)
        if count_split_part(counts, tile) == S - 1:
            total = split_total(sums + (tile * S).to(tl.int64) * (BN * DM), cell, S, BN * DM,
                                DM, BN)
            l2_epilogue(total, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y,
                        off_combine_flag, H, T_MAX, R, K, BM, BN, UPCAST, False,
                        EPI_SPLIT, 0, BM // DM, EVICT_LAST=True)
            tl.atomic_xchg(counts + tile, 0, sem="relaxed", scope="gpu")
            if SIGNAL_ROWS:
                signal_block_rows(mb, NB, vm, table, l2_done, pool_src, off_combine_flag,
                                  T_MAX, K, BM)
    elif part == 0:
        l2_decode_block(mb, nb, NB, meta, table, l2_done, pool_act, pool_src, w2, a_desc,
                        w_desc, off_combine_y, off_combine_flag, H, I, T_MAX, R, K, BM, BN, BK,
                        DM, UPCAST, USE_TMA, EPI_SPLIT, False, 0, 1, SIGNAL_ROWS)


@triton.jit
def l2_rows(mb, r0, nb, e, pool_act, w2, a_desc, w_desc, H, I, BM: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr,
            USE_TMA: tl.constexpr, SWAP: tl.constexpr, k_lo=0, k_hi=-1):
    """fp32 [ROWS, BN]: rows r0 .. r0+ROWS-1 of m_block @ w2[e]^T, columns of n_block, over
    K columns [k_lo, k_hi) (k_hi -1: I; split-K parts, ``l2_split_part``).
    SWAP (decode pieces): computed as w2 tile @ rows^T ([BN, ROWS], the weights as the MMA's
    row operand) and transposed. USE_TMA: ``a_desc`` has ROWS-row tiles."""
    if k_hi < 0:
        k_hi = I
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    kk = k_lo + tl.arange(0, BK)
    n = nb * BN + tl.arange(0, BN)
    a_ptrs = pool_act + rows[:, None] * I + kk[None, :]
    w_ptrs = w2 + e.to(tl.int64) * H * I + n[:, None].to(tl.int64) * I + kk[None, :]
    acc = zero_acc(ROWS, BN, SWAP)
    for k0 in range(k_lo, k_hi, BK):
        if USE_TMA:
            a = a_desc.load([mb * BM + r0, k0])
            w = weight_tile(w_desc.load([e * H + nb * BN, k0]), SWAP)
        else:
            a = tl.load(a_ptrs)
            w = weight_tile(tl.load(w_ptrs), SWAP)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if SWAP:
            acc = tl.dot(w, a.T, acc)
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BK
        w_ptrs += BK
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def l2_either_block(mb, nb, NB, meta, table, rank, l2_done, pool_act, pool_src, w2, w2_s,
                    a_desc, w_desc, off_pool_act, off_combine_y, off_combine_flag, H, I, AB,
                    T_MAX, R, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
                    SIGNAL_ROWS: tl.constexpr,
                    EPI_SPLIT: tl.constexpr, FP8: tl.constexpr, sub, SPLIT_M: tl.constexpr,
                    DM: tl.constexpr = 0, W4: tl.constexpr = 0, TAIL: tl.constexpr = False):
    """One L2 block of the staged kernel in either format (``l2_fp8_pool_block`` over byte
    rows, with MXFP4 weights when W4 > 0, or ``l2_block``), row piece ``sub`` of SPLIT_M, or
    in decode pieces of DM rows (TAIL: only a row piece of at most DM valid rows)."""
    if FP8:
        l2_fp8_pool_block(mb, nb, NB, meta, table, rank, l2_done, pool_src, off_pool_act,
                          off_combine_y, off_combine_flag, w2, w2_s, H, I, AB, T_MAX, R, K, BM,
                          BN, BK, UPCAST, SIGNAL_ROWS, EPI_SPLIT, a_desc, w_desc,
                          USE_TMA, sub, SPLIT_M, DM, W4, TAIL)
    elif DM > 0:
        l2_decode_block(mb, nb, NB, meta, table, l2_done, pool_act, pool_src, w2, a_desc,
                        w_desc, off_combine_y, off_combine_flag, H, I, T_MAX, R, K, BM, BN, BK,
                        DM, UPCAST, USE_TMA, EPI_SPLIT, TAIL, sub, SPLIT_M,
                        SIGNAL_ROWS)
    else:
        l2_block(mb, nb, NB, meta, table, l2_done, pool_act, pool_src, w2, a_desc, w_desc,
                 off_combine_y, off_combine_flag, H, I, T_MAX, R, K, BM, BN, BK, UPCAST,
                 USE_TMA, SIGNAL_ROWS, EPI_SPLIT, sub, SPLIT_M)


@triton.jit
def l2_kernel(
    table, rank0, w2_table,    # int64[R] buffers, int64[local ranks] w2 bases
    w2s_table,                 # FP8: int64[local ranks] w2_scale_inv bases
    host_base,                 # HOST_BASE: this rank's buffer address (else unused)
    max_spins, timeout_ns,
    offs,                      # Offsets: every region's byte offset (launch.Offsets)
    off_claims,                # CLAIM: this GEMM's [next ticket, programs finished]
    H, I, E_LOC, T_MAX, NB1, P,
    R: tl.constexpr,           # ranks: the combine-slot stores unroll over them
    R_PAD: tl.constexpr,       # R rounded up to a power of two (the rank signal's vector)
    AB,                        # FP8: bytes per pool_act row
    ad0, ad1, wd,              # HOST_DESC: the descriptors built on the host (else None)
    split_sums, split_counts,  # SPLIT_K > 1: fp32 [local ranks, programs, DM, BN] and
                               # int32 [local ranks, programs], counts zero between calls
    K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    UPCAST: tl.constexpr, USE_TMA: tl.constexpr, WAIT: tl.constexpr,
    USE_TIMER: tl.constexpr, FP8: tl.constexpr = False, FLAT: tl.constexpr = False,
    EPI_SPLIT: tl.constexpr = 1, SPLIT_M: tl.constexpr = 1,
    DM: tl.constexpr = 0, W4: tl.constexpr = 0, TAIL: tl.constexpr = False,
    HOST_DESC: tl.constexpr = False, SPLIT_K: tl.constexpr = 1, CLAIM: tl.constexpr = False,
    HOST_BASE: tl.constexpr = False, PEER_SCOPE: tl.constexpr = "sys",
    STREAM: tl.constexpr = False,
):
    """FP8, W4, HOST_DESC, CLAIM (not with FLAT), HOST_BASE: as ``l1_kernel``; the output
    tile is rounded to bf16 for the combine slots.
    Tickets walk the tiles n fastest.
    SPLIT_M: tiles of BM / SPLIT_M rows (row pieces of an m-block walked like m-blocks of
    their own), so smaller programs fit more per SM.
    The rank signal: each program counts itself once when it is done (not every tile per
    m-block: that would be one acq_rel atomic, i.e. a wait for the tile's stores, per tile),
    and the last program of the rank releases ``l2_ranks_done`` on every rank (at PEER_SCOPE:
    "sys", or "gpu" where every rank's buffer is on this GPU, ``SymmBuffer.one_device``; their
    addresses loaded at the start, not after the count); the staged combine waits for R there.
    STREAM: every rank's combine runs after this launch in stream order on this GPU
    (``launch.stream_ordered``), so nothing is counted or released at all.
    DM > 0: decode pieces of DM rows (``l2_decode_block``; SPLIT_M 1);
    with TAIL only row pieces of at most DM valid rows (any SPLIT_M), fuller ones as usual.
    SPLIT_K > 1 (bf16 decode pieces, no tail pieces): as ``l1_kernel``'s, S >= 4 programs
    share each tile's K loop when the call's tiles are at most a quarter of the programs
    (``l2_split_part``)."""
    tl.static_assert(DM == 0 or SPLIT_M == 1 or TAIL, "decode pieces: whole m-blocks")
    tl.static_assert(DM > 0 or not TAIL, "tail pieces of DM rows")
    tl.static_assert(W4 == 0 or (FP8 and DM == 0 and not USE_TMA), "fp4w: fp8 rows, pointers")
    tl.static_assert(USE_TMA or not HOST_DESC, "host descriptors are TMA descriptors")
    tl.static_assert(SPLIT_K == 1 or (DM > 0 and not FP8 and not TAIL and W4 == 0),
                     "split-K: bf16 decode pieces")
    tl.static_assert(not (CLAIM and FLAT), "claimed tickets: the plain loop")
    tl.static_assert(PEER_SCOPE == "sys" or PEER_SCOPE == "gpu", "peer scope: sys or gpu")
    (pid, nprog, lr, rank, epoch, diag, here, w2, w2_s, block_start,
     block_meta) = gemm_context(table, rank0, offs.epoch, offs.diag, host_base, w2_table,
                                w2s_table, offs.block_start, offs.block_meta, FP8, W4,
                                HOST_BASE)
    l1_done = at(here, offs.l1_done, tl.int32)
    l2_done = at(here, offs.l2_done, tl.int32)
    pool_act = at(here, offs.pool_act, tl.bfloat16)
    pool_src = at(here, offs.pool_src, tl.int32)
    peers = tl.arange(0, R_PAD)
    if not STREAM:   # every rank's l2_ranks_done, for the last release
        ranks_done = peer_ptrs(table, peers, offs.l2_ranks_done, peers < R, tl.int32)
    # the block count and the first block's meta before the descriptors (as in l1_kernel)
    NB = H // BN
    num_m = tl.load(block_start + E_LOC) * SPLIT_M   # row pieces (m-blocks when SPLIT_M = 1)
    total = num_m * NB
    ticket = pid
    ok = pid >= 0
    pm, nb = l1_tile_of(ticket, num_m, NB, 1)
    meta = tl.load(block_meta + pm // SPLIT_M, mask=(pm // SPLIT_M < P // BM) & (not FLAT),
                   other=0)   # within the region, not waiting for num_m
    a_desc = 0
    w_desc = 0
    BMT: tl.constexpr = BM // SPLIT_M
    if DM > 0 and not USE_TMA:
        a_desc = (0, 0)      # the decode blocks index a pair
    if HOST_DESC:
        a_desc = (ad0, ad1) if DM > 0 else ad0
        w_desc = wd
    elif USE_TMA and DM > 0:   # decode pieces: (DM-row, WIDE-row or TAIL: BMT-row) A descriptors
        a_desc, w_desc = pool_piece_descriptors(table, rank, offs.pool_act, pool_act, P, I, AB, w2,
                                                E_LOC * H, BM, BN, BK, DM,
                                                BMT if TAIL else 0, FP8)
    elif USE_TMA:
        if FP8:
            a_desc, w_desc = fp8_descriptors(
                peer_ptr(table, rank, offs.pool_act, tl.float8e4nv), P, I, AB, w2,
                E_LOC * H, BMT, BN, BK)
        else:
            a_desc, w_desc = l2_descriptors(pool_act, w2, P, H, I, E_LOC, BMT, BN, BK)
    if SPLIT_K > 1:
        S = split_count(total, nprog, SPLIT_K)
        if S > 1:   # one part per program: total * S <= nprog
            tile, mb, nb_s, meta_s = split_tile(pid, S, total, num_m, NB, block_meta, 1)
            if tile < total:
                if WAIT:
                    ok = wait_at_least(l1_done + mb, NB1, diag, max_spins, timeout_ns, 3,
                                       rank, mb, epoch, -1, SCOPE="gpu",
                                       USE_TIMER=USE_TIMER)
                if ok:
                    # this local rank's slots: [local ranks, programs, ...] (staged.l2)
                    l2_split_part(tile, pid % S, S, mb, nb_s, NB, meta_s, table, l2_done,
                                  pool_act, pool_src, w2, a_desc, w_desc,
                                  split_sums + (lr * nprog).to(tl.int64) * (BN * DM),
                                  split_counts + lr * nprog, offs.combine_y, offs.combine_flag,
                                  H, I, T_MAX, R, K, BM, BN, BK, DM, UPCAST, USE_TMA,
                                  EPI_SPLIT)
            ticket = total   # the loop below has nothing left
    if FLAT:
        # no waits: one flat loop over (tile, k step), which Triton's pipeliner can prefetch
        # across tiles (the next tile's first loads overlap this tile's epilogue)
        for t in tl.range(pid, total, nprog, flatten=True):
            pm, nb = grouped_tile(t, num_m, NB, 1)
            mb = pm // SPLIT_M
            l2_either_block(mb, nb, NB, tl.load(block_meta + mb), table, rank, l2_done,
                            pool_act, pool_src, w2, w2_s, a_desc, w_desc, offs.pool_act,
                            offs.combine_y, offs.combine_flag, H, I, AB, T_MAX, R, K, BM, BN, BK,
                            UPCAST, USE_TMA, False, EPI_SPLIT, FP8,
                            pm % SPLIT_M, SPLIT_M, DM, W4, TAIL)
        ticket = total   # the loop below has nothing left
    claims = claims_ptr(table, here, off_claims, CLAIM)
    on = claiming(total, nprog, CLAIM)
    nxt = first_next(pid, nprog, CLAIM)
    while (ticket < total) & ok:
        nxt, after = next_tickets(claims, ticket, nxt, nprog, on, CLAIM)
        pm_next, nb_next = grouped_tile(nxt, num_m, NB, 1)
        meta_next = tl.load(block_meta + pm_next // SPLIT_M, mask=nxt < total, other=0)
        mb = pm // SPLIT_M
        if WAIT:
            ok = wait_at_least(l1_done + mb, NB1, diag, max_spins, timeout_ns, 3,
                               rank, mb, epoch, -1, SCOPE="gpu",
                               USE_TIMER=USE_TIMER)
        if ok:
            l2_either_block(mb, nb, NB, meta, table, rank, l2_done, pool_act, pool_src, w2,
                            w2_s, a_desc, w_desc, offs.pool_act, offs.combine_y, offs.combine_flag,
                            H, I, AB, T_MAX, R, K, BM, BN, BK, UPCAST, USE_TMA,
                            False, EPI_SPLIT, FP8, pm % SPLIT_M, SPLIT_M, DM, W4,
                            TAIL)
        pm = pm_next
        nb = nb_next
        meta = meta_next
        ticket, nxt = advance(ticket, nxt, after, nprog, CLAIM)
    finish_claims(claims, nprog, on, CLAIM)
    if not STREAM:
        if ok:   # a program that gave up does not count: the peers' combine then stalls too
            tl.debug_barrier()  # this program's rows are stored before it counts itself
            # gpu scope between the programs of this GPU, then one cumulative system-scope
            # release per rank by the last one (as in release_rows)
            done = tl.atomic_add(at(here, offs.l2_programs, tl.int32), 1,
                                 sem="acq_rel", scope="gpu")
            if done == nprog - 1:
                tl.atomic_add(ranks_done, 1, mask=peers < R, sem="release", scope=PEER_SCOPE)
