"""The fused persistent kernel: dispatch, L1 + SwiGLU, L2 and combine in one launch.

Programs take tickets from an atomic counter, in the dependency order of
``moestream.schedule`` (``Schedule.virtual_order`` for the launch's local ranks):

    every dispatch task (local rank, source rank, DT source tokens from token j * DT)
    per local rank, per expert wave: its L1 blocks (m-block, n fastest; or in groups of
        GROUP_M1 m-blocks, m fastest within a group), then the previous wave's L2 blocks (the
        last wave's after all L1 blocks; with split-K each block's S2 parts in a row)
    every combine task (local rank, CT tokens from token j * CT, column part p of CP)

A ticket only waits on tickets handed out before it (dispatch -> L1 via arrival counts, L1 ->
L2 via l1_done, L2 -> combine via the combine flags, possibly of another rank's launch, whose L2
never waits on combine), and a program holds at most the ticket it works on plus the next one
it already claimed (claimed early to hide the counter's latency; still later than the current
one; a dispatch task claims the next ticket only when it is done). So programs never wait in a
cycle, however few of them are resident, and a sequential run (the interpreter) finishes too.

The publish, signal and layout steps run before this launch (they are per-call setup: the
pool layout needs every peer's counts).

FP8 (constexpr): as the staged kernels' FP8 (l1.py, l2.py): byte rows of e4m3 values + fp32 scales
(dispatch copies ROW_W 16-bit words per row), fp8 weights with 128x128 block scales (second
weight tables), kernels/gemm_fp8.py's block math, bf16 L2 rows and combine.

Legend: as in dispatch.py, l1.py, l2.py and combine.py. Tickets: D = dispatch tasks, G = GEMM
blocks (per local rank total m-blocks x (NB1 + T2); T2 = NB2 L2 tickets x S2 split-K parts),
C = combine tasks.
Trace (TRACE): int64 [tickets, 8] = phase, rank, a, b, c, SM, start ns, end ns, where
(a, b, c) = (source, first token, -1) for dispatch, (expert, m-block, n-block) for L1/L2 and
(first token, column part, -1) for combine.
"""
from __future__ import annotations

from triton.language.extra.cuda import smid

from .common import (launch_context, now_ns, peer_ptr, peer_ptrs, rank_base, stalled, tl,
                     triton, wait_at_least)
from .combine import combine_tokens
from .dispatch import pull_tokens
from .epilogue import signal_block_rows
from .l1 import l1_either_block
from .l2 import l2_either_block, l2_split_part
from .operands import expert_weights, l1_descriptors, l2_descriptors, pool_piece_descriptors
from .tickets import l1_tile_of, split_count

# the moestream.schedule.Phase values
PHASE_DISPATCH = tl.constexpr(0)
PHASE_L1 = tl.constexpr(1)
PHASE_L2 = tl.constexpr(2)
PHASE_COMBINE = tl.constexpr(3)


@triton.jit
def _sections(table, rank0, NLOC, par64, DT, CT, CP, off_src_tokens, off_block_start,
              off_num_tokens, R, E_LOC, NLOC_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Per local rank: dispatch tasks (DT source tokens each), m-blocks and combine tasks
    (CT tokens and one of CP column parts each) of this call."""
    lv = tl.arange(0, NLOC_PAD)
    lm = lv < NLOC
    sv = tl.arange(0, R_PAD)
    ranks = rank0 + lv
    src_tok = tl.load(peer_ptrs(table, ranks[:, None], off_src_tokens + sv[None, :] * 4,
                                lm[:, None], tl.int32),
                      mask=lm[:, None] & (sv[None, :] < R), other=0)
    d = tl.sum((src_tok + DT - 1) // DT, axis=1)
    g = tl.load(peer_ptrs(table, ranks, off_block_start + E_LOC * 4, lm, tl.int32), mask=lm,
                other=0)
    c = tl.load(peer_ptrs(table, ranks, off_num_tokens + par64 * 4, lm, tl.int32), mask=lm,
                other=0)
    return d, g, (c + CT - 1) // CT * CP


@triton.jit
def _pick(vec, i):
    """vec[i] for a scalar index."""
    return tl.sum(tl.where(tl.arange(0, vec.shape[0]) == i, vec, 0), axis=0)


@triton.jit
def _locate(t, counts):
    """(index, offset): the section ``counts[index]`` that ticket offset ``t`` falls in."""
    incl = tl.cumsum(counts, axis=0)
    i = tl.sum((incl <= t).to(tl.int32), axis=0)
    return i, t - (_pick(incl, i) - _pick(counts, i))


@triton.jit
def _descriptors(table, rank, off_a, w, P, H, I, E_LOC, A_BYTES, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr, FP8: tl.constexpr,
                 DM: tl.constexpr, L2: tl.constexpr):
    """(A, weights) tile descriptors of a rank's L1 (pool_x at ``off_a``, w13) or L2 (L2:
    pool_act, w2) as the staged kernels build them: in decode pieces (DM > 0) A is a pair
    (DM-row and wide tiles, bf16 or fp8 byte rows of A_BYTES); zeros where the blocks load
    by pointer."""
    a = peer_ptr(table, rank, off_a, tl.bfloat16)
    a_d = 0
    w_d = 0
    if DM > 0 and not USE_TMA:
        a_d = (0, 0)   # the decode blocks index a pair
    if USE_TMA and DM > 0:
        if L2:
            a_d, w_d = pool_piece_descriptors(table, rank, off_a, a, P, I, A_BYTES, w,
                                              E_LOC * H, BM, BN, BK, DM, 0, FP8)
        else:
            a_d, w_d = pool_piece_descriptors(table, rank, off_a, a, P, H, A_BYTES, w,
                                              E_LOC * 2 * I, BM, BN, BK, DM, 0, FP8)
    elif USE_TMA:
        tl.static_assert(not FP8, "the fused fp8 blocks load whole tiles by pointer")
        if L2:
            a_d, w_d = l2_descriptors(a, w, P, H, I, E_LOC, BM, BN, BK)
        else:
            a_d, w_d = l1_descriptors(a, w, P, H, I, E_LOC, BM, BN, BK)
    return a_d, w_d


@triton.jit
def fused_kernel(
    table, rank0, NLOC,             # int64[R] buffers; this launch serves ranks rank0 .. +NLOC
    w13_table, w2_table,            # int64[NLOC] weight bases
    w13s_table, w2s_table,          # FP8: int64[NLOC] scale_inv bases
    y_ptr, y_rank_stride, y_stride,  # bf16 [NLOC, T, H]
    trace_ptr,                      # int64 [tickets, 8] (TRACE only)
    max_spins, timeout_ns,
    offs,                           # Offsets: every region's byte offset (launch.Offsets)
    T_MAX, H, I, E, R: tl.constexpr, E_LOC, P,   # R constexpr: L2 stores unrolled per rank
    ROW_W, XB, AB,                  # 16-bit words per token row; FP8: bytes per pool_x/act row
    DT, CHUNK_MB,                   # source tokens per dispatch task; m-blocks per L1 chunk
    CP,                             # column parts per combine task of CT tokens
    hd1a, hd1b, hd1w, hd2a, hd2b, hd2w,   # HOST_DESC: L1 / L2 descriptors (A, A wide, w)
    split_sums, split_counts,       # SPLIT_K > 1: fp32 [NLOC, programs, DM, BN2] and int32
                                    # [NLOC, programs], counts zero between calls
    K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, E_PAD: tl.constexpr,
    NLOC_PAD: tl.constexpr, BM: tl.constexpr,
    BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
    BH: tl.constexpr, TT: tl.constexpr, EAGER: tl.constexpr, CT: tl.constexpr,
    BHC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    USE_TIMER: tl.constexpr,
    ONE_RANK: tl.constexpr, TRACE: tl.constexpr,
    FP8: tl.constexpr = False, GROUP_M1: tl.constexpr = 1, DM: tl.constexpr = 0,
    L2G: tl.constexpr = 1, EPI2: tl.constexpr = 1,
    HOST_DESC: tl.constexpr = False, SPLIT_K: tl.constexpr = 1, MIN_SPLIT: tl.constexpr = 4,
):
    """GROUP_M1: a wave's L1 tickets walk GROUP_M1 of its m-blocks at a time, m fastest
    within a group (``tickets.l1_tile_of``; ``L1.group_m``), else n fastest.
    DM > 0: both GEMMs in decode pieces of DM rows (the weights as the MMA row operand,
    ``l1.l1_decode_block`` / ``l2_decode_block``; ``Tuning.decode_rows``), each L2 block
    releasing its rows after its last piece.
    L2G > 1 (whole tiles only): an L2 ticket is L2G column blocks of one m-block, run as one
    flat (column block, K step) loop so that Triton's pipeliner loads the next block's first
    K steps during this block's epilogue; the m-block's completion is counted once per ticket
    (``Fused.l2_group``). EPI2: its tiles' epilogue in 1, 2 or 4 column pieces.
    A wave's L2 tickets follow the next wave's L1 tickets, so its L1 blocks are done when
    they are claimed.
    HOST_DESC (ONE_RANK, USE_TMA): the L1 and L2 descriptors come built by the host
    (``launch.host_descriptors``; ``hd1b`` / ``hd2b``: the wide A tiles of decode pieces)
    instead of each program building them before its first ticket.
    SPLIT_K > 1 (bf16 decode pieces): when the launch's L2 tiles are at most 1 / MIN_SPLIT
    of the programs, each L2 tile is S2 >= MIN_SPLIT tickets in a row, one split-K part each
    (``l2.l2_split_part``: the part that counts last stores the rows and signals them; no
    part waits for another)."""
    tl.static_assert(L2G == 1 or DM == 0, "L2 tickets of several column blocks: whole tiles")
    tl.static_assert(not HOST_DESC or (ONE_RANK and USE_TMA), "host descriptors: one rank")
    tl.static_assert(SPLIT_K == 1 or (DM > 0 and not FP8), "split-K: bf16 decode pieces")
    _, nprog, _, rank_0, epoch, diag_0 = launch_context(table, rank0, offs.epoch, offs.diag)
    par64 = (epoch & 1).to(tl.int64)
    NB1 = I // BN1
    NB2 = H // BN2 // L2G   # L2 tiles per m-block
    d_v, mb_v, c_v = _sections(table, rank0, NLOC, par64, DT, CT, CP, offs.src_tokens,
                               offs.block_start, offs.num_tokens, R, E_LOC, NLOC_PAD, R_PAD)
    S2 = nprog * 0 + 1   # tickets per L2 tile (split-K parts)
    if SPLIT_K > 1:
        S2 = split_count(tl.sum(mb_v, axis=0) * NB2, nprog, SPLIT_K, MIN_SPLIT)
    T2 = NB2 * S2        # L2 tickets per m-block
    g_v = mb_v * (NB1 + T2)
    D = tl.sum(d_v, axis=0)
    G = tl.sum(g_v, axis=0)
    total = D + G + tl.sum(c_v, axis=0)
    if stalled(diag_0):
        total = 0   # the layout step gave up: nothing of this call is valid
    counter = peer_ptr(table, rank0, offs.tickets, tl.int32)
    if ONE_RANK:   # one set of weights and descriptors for the whole launch
        w13_0, w13s_0 = expert_weights(w13_table, w13s_table, 0, FP8)
        w2_0, w2s_0 = expert_weights(w2_table, w2s_table, 0, FP8)
        if HOST_DESC:
            a1_0 = (hd1a, hd1b) if DM > 0 else hd1a
            a2_0 = (hd2a, hd2b) if DM > 0 else hd2a
            wd1_0 = hd1w
            wd2_0 = hd2w
        else:
            a1_0, wd1_0 = _descriptors(table, rank_0, offs.pool_x, w13_0, P, H, I, E_LOC, XB,
                                       BM, BN1, BK1, USE_TMA, FP8, DM, False)
            a2_0, wd2_0 = _descriptors(table, rank_0, offs.pool_act, w2_0, P, H, I, E_LOC, AB,
                                       BM, BN2, BK2, USE_TMA, FP8, DM, True)
    ticket = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
    ok = ticket >= 0
    while (ticket < total) & ok:
        # the next ticket is claimed now, so that the counter's round trip overlaps this
        # ticket's work; a dispatch task claims it when it is done instead: otherwise a
        # program could hold two dispatch tasks and run them one after the other while the
        # first L1 blocks wait for both (the dispatch phase would take twice a task's time)
        # In a launch whose L2 tiles are split (S2 > 1) a GEMM ticket claims in its branch:
        # an L1 ticket at once, an L2 part when it is done, for the dispatch tasks' reason:
        # the programs that finish their L1 tickets first would each hold two parts (the
        # current one and the next), run them one after the other, and leave the programs
        # still in L1 with none (e.g. mixtral at 1 token, 64 tiles in 128 parts)
        nxt = total
        claim_now = ticket >= D
        if SPLIT_K > 1:
            claim_now = claim_now & ((ticket >= D + G) | (S2 == 1))
        if claim_now:
            nxt = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")   # lands meanwhile
        if TRACE:
            t_start = now_ns(USE_TIMER)
        # trace fields, tensors from the start so every branch may reassign them
        phase = ticket * 0
        rank = ticket * 0
        a = ticket * 0 - 1
        b = ticket * 0 - 1
        c = ticket * 0 - 1
        if ticket < D:
            lr, local = _locate(ticket, d_v)
            rank = rank0 + lr
            sv = tl.arange(0, R_PAD)
            src_tok = tl.load(peer_ptr(table, rank, offs.src_tokens, tl.int32) + sv,
                              mask=sv < R, other=0)
            s, j = _locate(local, (src_tok + DT - 1) // DT)
            t0 = j * DT
            pull_tokens(table, rank, s, t0, tl.minimum(DT, _pick(src_tok, s) - t0), par64,
                        T_MAX, ROW_W, R, E_LOC, BM, P, offs.x, offs.topk_idx, offs.topk_weights,
                        offs.slot, offs.src_row, offs.pool_x, offs.pool_src, offs.pool_weight,
                        offs.arrival, K, K_PAD, BH, TT, EAGER)
            nxt = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
            phase = ticket * 0 + PHASE_DISPATCH
            a = s
            b = t0
        elif ticket < D + G:
            lr, local = _locate(ticket - D, g_v)
            rank = rank0 + lr
            diag = peer_ptr(table, rank, offs.diag, tl.int32)
            ev = tl.arange(0, E_PAD)
            n_waves = tl.load(peer_ptr(table, rank, offs.num_waves, tl.int32))
            wave_mb = peer_ptr(table, rank, offs.wave_mb, tl.int32)
            # segment s: wave s's L1 blocks, then wave s - 1's L2 blocks (segment 0: no L2,
            # segment n_waves: no L1); it starts at wave_mb[s] * NB1 + wave_mb[s - 1] * T2
            # (wave_mb[0] = 0). A wave's L2 follows the next wave's L1, so its L1 blocks are
            # done when its L2 tickets are claimed
            sv = ev + 1
            sm = ev < n_waves
            starts = tl.where(sm, tl.load(wave_mb + sv, mask=sm, other=0) * NB1
                              + tl.load(wave_mb + ev, mask=sm, other=0) * T2, 2147483647)
            w = tl.sum((starts <= local).to(tl.int32), axis=0)
            w0 = tl.load(wave_mb + w)
            l2_mb0 = tl.load(wave_mb + tl.maximum(w - 1, 0))
            n_mb = tl.load(wave_mb + tl.minimum(w + 1, n_waves)) - w0
            in_wave = local - w0 * NB1 - l2_mb0 * T2
            block_meta = peer_ptr(table, rank, offs.block_meta, tl.int32)
            if ONE_RANK:
                w13, w13_s, w2, w2_s = w13_0, w13s_0, w2_0, w2s_0
            else:
                w13, w13_s = expert_weights(w13_table, w13s_table, lr, FP8)
                w2, w2_s = expert_weights(w2_table, w2s_table, lr, FP8)
            if in_wave < n_mb * NB1:
                if SPLIT_K > 1 and S2 > 1:   # an L1 ticket claims early (see above)
                    nxt = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
                mb, nb = l1_tile_of(in_wave, n_mb, NB1, GROUP_M1)
                mb += w0
                meta = tl.load(block_meta + mb)
                # wait for every m-block of the block's chunk: CHUNK_MB consecutive m-blocks
                # of its expert (1: just its own block, the token-granular mode)
                block_start = peer_ptr(table, rank, offs.block_start, tl.int32) + (meta >> 9)
                b0 = tl.load(block_start)
                c0 = b0 + ((mb - b0) // CHUNK_MB) * CHUNK_MB
                c1 = tl.minimum(c0 + CHUNK_MB, tl.load(block_start + 1))
                arrival = peer_ptr(table, rank, offs.arrival, tl.int32)
                while (c0 < c1) & ok:
                    ok = wait_at_least(arrival + c0, tl.load(block_meta + c0) & 511, diag,
                                       max_spins, timeout_ns, 2, rank, c0, epoch, -1,
                                       SCOPE="gpu", USE_TIMER=USE_TIMER)
                    c0 += 1
                if ok:
                    if ONE_RANK:
                        a1, wd1 = a1_0, wd1_0
                    else:
                        a1, wd1 = _descriptors(table, rank, offs.pool_x, w13, P, H, I, E_LOC,
                                               XB, BM, BN1, BK1, USE_TMA, FP8, DM, False)
                    l1_either_block(mb, nb, meta, table, rank,
                                    peer_ptr(table, rank, offs.l1_done, tl.int32),
                                    peer_ptr(table, rank, offs.pool_x, tl.bfloat16),
                                    peer_ptr(table, rank, offs.pool_weight, tl.float32),
                                    peer_ptr(table, rank, offs.pool_act, tl.bfloat16), w13, w13_s,
                                    a1, wd1, offs.pool_x, offs.pool_weight, offs.pool_act, H, I, XB,
                                    AB, BM, BN1, BK1, UPCAST, USE_TMA, FP8, DM)
                phase = ticket * 0 + PHASE_L1
            else:
                in_l2 = in_wave - n_mb * NB1
                mb = l2_mb0 + in_l2 // T2
                nb = in_l2 % T2 // S2   # split-K: the tile's S2 parts in a row
                meta = tl.load(block_meta + mb)
                ok = wait_at_least(peer_ptr(table, rank, offs.l1_done, tl.int32) + mb, NB1, diag,
                                   max_spins, timeout_ns, 3, rank, mb, epoch, -1, SCOPE="gpu",
                                   USE_TIMER=USE_TIMER)
                if ok:   # each ticket releases its rows' combine flags (SIGNAL_ROWS)
                    if ONE_RANK:
                        a2, wd2 = a2_0, wd2_0
                    else:
                        a2, wd2 = _descriptors(table, rank, offs.pool_act, w2, P, H, I, E_LOC,
                                               AB, BM, BN2, BK2, USE_TMA, FP8, DM, True)
                    l2_done = peer_ptr(table, rank, offs.l2_done, tl.int32)
                    pool_act = peer_ptr(table, rank, offs.pool_act, tl.bfloat16)
                    pool_src = peer_ptr(table, rank, offs.pool_src, tl.int32)
                    # (SPLIT_K first: a constexpr False leaves the branch uncompiled, where
                    # a2 is no pair of decode descriptors)
                    if SPLIT_K > 1 and S2 > 1:   # the rank's slots: tile mb * NB2 + nb
                        l2_split_part(mb * NB2 + nb, in_l2 % S2, S2, mb, nb, NB2, meta, table,
                                      l2_done, pool_act, pool_src, w2, a2, wd2,
                                      split_sums + (lr * nprog).to(tl.int64) * (BN2 * DM),
                                      split_counts + lr * nprog, offs.combine_y,
                                      offs.combine_flag, H, I, T_MAX, R, K, BM, BN2, BK2, DM,
                                      UPCAST, USE_TMA, EPI2, True)
                    elif L2G == 1:
                        l2_either_block(mb, nb, NB2, meta, table, rank, l2_done, pool_act,
                                        pool_src, w2, w2_s, a2, wd2, offs.pool_act, offs.combine_y,
                                        offs.combine_flag, H, I, AB, T_MAX, R, K, BM, BN2, BK2,
                                        UPCAST, USE_TMA, True, EPI2, FP8, 0, 1, DM)
                    else:
                        for j in tl.range(0, L2G, flatten=True):
                            l2_either_block(mb, nb * L2G + j, NB2, meta, table, rank, l2_done,
                                            pool_act, pool_src, w2, w2_s, a2, wd2, offs.pool_act,
                                            offs.combine_y, offs.combine_flag, H, I, AB, T_MAX, R,
                                            K, BM, BN2, BK2, UPCAST, USE_TMA, False,
                                            EPI2, FP8, 0, 1, DM)
                        signal_block_rows(mb, NB2, meta & 511, table, l2_done, pool_src,
                                          offs.combine_flag, T_MAX, K, BM)
                if SPLIT_K > 1 and S2 > 1:   # a split part claims when done (see above)
                    nxt = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
                phase = ticket * 0 + PHASE_L2
            a = meta >> 9
            b = mb
            c = nb
        else:
            lr, j = _locate(ticket - D - G, c_v)
            rank = rank0 + lr
            diag = peer_ptr(table, rank, offs.diag, tl.int32)
            t0 = (j // CP) * CT
            part = j % CP
            HP = (H + CP - 1) // CP
            n_tok = tl.load(peer_ptr(table, rank, offs.num_tokens, tl.int32) + par64)
            ok = combine_tokens(rank_base(table, rank, 0, False), rank, t0,
                                tl.minimum(CT, n_tok - t0), par64,
                                y_ptr + lr.to(tl.int64) * y_rank_stride, y_stride, diag,
                                max_spins, timeout_ns, epoch, T_MAX, H, E, offs.topk_idx,
                                offs.combine_y, offs.combine_flag, K, K_PAD, BHC, CT, UPCAST,
                                USE_TIMER, True, part * HP, tl.minimum(part * HP + HP, H))
            phase = ticket * 0 + PHASE_COMBINE
            a = t0
            b = part
        if TRACE:
            row = trace_ptr + ticket.to(tl.int64) * 8
            tl.store(row + 0, phase.to(tl.int64))
            tl.store(row + 1, rank.to(tl.int64))
            tl.store(row + 2, a.to(tl.int64))
            tl.store(row + 3, b.to(tl.int64))
            tl.store(row + 4, c.to(tl.int64))
            if USE_TIMER:
                tl.store(row + 5, smid().to(tl.int64))
            tl.store(row + 6, t_start)
            tl.store(row + 7, now_ns(USE_TIMER))
        ticket = nxt
