"""Publish, layout and token-granular pull dispatch.

Legend (shapes; every pointer below is int32 unless marked):
    T      tokens of this call on a rank (T_MAX: the buffer's capacity), H hidden, K top-k
    E      experts over all ranks, E_LOC experts per rank, R ranks, P pool rows, BM block_m
    par    parity of the call (epoch & 1): which copy of the double-buffered inputs is in use

Call order on every rank (each step one launch; the fused kernel replaces dispatch onwards):
    publish  copy x/topk into the buffer's next parity copy, number each expert's picks
             (slot, send_counts), zero the counters; its last program to finish signals:
             epoch += 1, ready = epoch (release, system scope: peers may now read the inputs)
    layout   wait for every peer's ready, read their counts for my experts -> pool layout
    dispatch one task per (source rank, source token): pull the token's row once, store it in
             the pool row of each of its picks of my experts, release-add the block's arrival

Dispatch copies rows as 16-bit words without looking at them: ``H`` of the pull functions is
the row width in words (the hidden size in bf16 mode; ``config.token_bytes // 2`` in fp8 mode,
where a row is e4m3 values followed by their fp32 scales).
"""
from __future__ import annotations

from ._common import (at, launch_context, peer_ptr, peer_ptrs, rank_base, tl,
                      triton, wait_at_least)
from .gemm_fp8 import quant_rows_128


@triton.jit
def number_picks(topk_idx_TK, slot_TK, counts_E, N, e, E, BLOCK: tl.constexpr):
    """routing.source_slots for expert ``e`` without a sort: walk the N = T * K picks in flat
    order t * K + k and number those of expert e 0, 1, 2, ... (a running cumsum: stable, as
    the torch version), then write counts_E[e]. e == E writes -1 for picks outside [0, E)
    (-1 included). Run for every e in [0, E], each slot is written exactly once."""
    mine = e < E
    base = tl.zeros([], tl.int32)
    i = tl.arange(0, BLOCK)
    key_next = tl.load(topk_idx_TK + i, mask=i < N, other=-1)
    for s in range(0, N, BLOCK):
        i = s + tl.arange(0, BLOCK)
        m = i < N
        key = key_next
        # the next block's picks load while this one is numbered: the loop is a chain of
        # N / BLOCK steps, each of which would otherwise wait for its own load
        key_next = tl.load(topk_idx_TK + i + BLOCK, mask=i + BLOCK < N, other=-1)
        hit = m & tl.where(mine, key == e, (key < 0) | (key >= E))
        c = tl.cumsum(hit.to(tl.int32), 0)
        tl.store(slot_TK + i, tl.where(mine, base + c - 1, -1), mask=hit)
        base += tl.sum(hit.to(tl.int32), 0)
    tl.store(counts_E + e, base, mask=mine)


@triton.jit
def source_slots_kernel(
    topk_idx_TK,      # int32/int64 [T, K], read as N = T * K picks in flat order t * K + k
    slot_TK,          # int32 [T, K] out: the pick's slot among its expert's picks, -1: no pick
    counts_E,         # int32 [E] out: picks per expert
    N, E, BLOCK: tl.constexpr,
):
    """routing.source_slots in one launch (grid E + 1: program e runs ``number_picks``)."""
    number_picks(topk_idx_TK, slot_TK, counts_E, N, tl.program_id(0), E, BLOCK)


@triton.jit
def publish_kernel(
    table,            # int64[R]: base address of each rank's buffer
    rank,             # the rank whose inputs these are
    host_base,        # HOST_BASE: that rank's buffer address (else unused)
    x_TH,             # bf16 [T, H], row stride x_stride
    topk_idx_TK,      # int32/int64 [T, K]
    topk_w_TK,        # fp32 [T, K]
    T, x_stride, T_MAX, H, XB,  # XB: bytes per published row (QUANT)
    COPY,             # programs [0, E] number picks; [E + 1, E + 1 + COPY) copy and zero
    off_epoch, off_ready, off_published, off_diag, off_num_tokens, off_send_counts, off_x,
    off_topk_idx, off_topk_weights, off_slot, off_reset, reset_words,
    E: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr, BZ: tl.constexpr, BLOCK: tl.constexpr,
    QUANT: tl.constexpr = False, FIX_ROUNDING: tl.constexpr = False,
    HOST_BASE: tl.constexpr = False, PEER_SCOPE: tl.constexpr = "sys",
):
    """One rank's inputs of the next call into its buffer, then the signal that publishes
    them. Grid E + 1 + COPY: program e <= E numbers expert e's picks into ``slot`` and
    ``send_counts`` (``number_picks``; first, so that these long loops start at once, whatever
    the GPU holds of the copy programs); program E + 1 + c zeroes its share of the per-call
    counters and copies tokens [c*BT, c*BT + BT) (rows and picks). Each program then counts
    itself done (acq_rel, gpu scope); the last one resets that count and signals: epoch += 1, ready = epoch
    (release at PEER_SCOPE: "sys", or "gpu" where every rank's buffer is on this GPU,
    ``SymmBuffer.one_device``; cumulative over the other programs' stores, which it acquired).

    QUANT (fp8 mode): publish each row as e4m3 values followed by its fp32 scales, one per
    128 channels (moestream.quant.quantize_act_fp8's format; BH a multiple of 128).

    HOST_BASE: the rank's buffer address is ``host_base`` (``rank_base``; the host knows it
    for every local rank, one launch each), so the epoch, and the stores whose addresses
    follow from it, do not wait for a load of the table first."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    here = rank_base(table, rank, host_base, HOST_BASE)
    epoch = tl.load(at(here, off_epoch, tl.int32))
    par = (epoch + 1) & 1   # the signal below makes epoch + 1 current
    meta0 = par.to(tl.int64) * T_MAX * K
    c = pid - (E + 1)   # copy program c
    if c < 0:
        number_picks(topk_idx_TK, at(here, off_slot, tl.int32) + meta0,
                     at(here, off_send_counts, tl.int32) + par * E, T * K,
                     pid, E, BLOCK)
    else:
        # Zero this program's share of the per-call counters (arrival, l1_done,
        # combine_flag). Peers write combine_flag only after this call's ready flag, which
        # this launch sets after every program is done.
        zero_ptr = at(here, off_reset, tl.int32)
        per_prog = tl.cdiv(tl.cdiv(reset_words, COPY), BZ) * BZ
        z = c * per_prog
        z_end = tl.minimum(z + per_prog, reset_words)
        while z < z_end:
            offs = z + tl.arange(0, BZ)
            tl.store(zero_ptr + offs, tl.zeros([BZ], tl.int32), mask=offs < z_end)
            z += BZ

        # Tokens [c*BT, c*BT + BT): rows of x and their K picks.
        t = c * BT + tl.arange(0, BT)
        tm = t < T
        t64 = t.to(tl.int64)
        if QUANT:
            row64 = par.to(tl.int64) * T_MAX + t64
            q_dst = at(here, off_x, tl.float8e4nv) + row64 * XB
            s_dst = at(here, off_x + H, tl.float32) + row64 * (XB // 4)
            G: tl.constexpr = BH // 128
            for h0 in range(0, H, BH):
                h = h0 + tl.arange(0, BH)
                hm = h < H
                v = tl.load(x_TH + t64[:, None] * x_stride + h[None, :],
                            mask=tm[:, None] & hm[None, :], other=0.0).to(tl.float32)
                q, scale = quant_rows_128(v, FIX_ROUNDING)
                tl.store(q_dst[:, None] + h[None, :], q, mask=tm[:, None] & hm[None, :])
                g = h0 // 128 + tl.arange(0, G)
                tl.store(s_dst[:, None] + g[None, :], scale,
                         mask=tm[:, None] & (g[None, :] * 128 < H))
        else:
            x_dst = at(here, off_x, tl.bfloat16) + par.to(tl.int64) * T_MAX * H
            for h0 in range(0, H, BH):
                h = h0 + tl.arange(0, BH)
                hm = h < H
                v = tl.load(x_TH + t64[:, None] * x_stride + h[None, :],
                            mask=tm[:, None] & hm[None, :])
                tl.store(x_dst + t64[:, None] * H + h[None, :], v,
                         mask=tm[:, None] & hm[None, :])
        k = tl.arange(0, K_PAD)
        tk_mask = tm[:, None] & (k[None, :] < K)
        tk = t64[:, None] * K + k[None, :]
        idx = tl.load(topk_idx_TK + tk, mask=tk_mask, other=-1).to(tl.int32)
        tl.store(at(here, off_topk_idx, tl.int32) + meta0 + tk, idx, mask=tk_mask)
        tl.store(at(here, off_topk_weights, tl.float32) + meta0 + tk,
                 tl.load(topk_w_TK + tk, mask=tk_mask, other=0.0), mask=tk_mask)
        n_bad = tl.sum(tl.sum((tk_mask & ((idx < -1) | (idx >= E))).to(tl.int32), axis=1),
                       axis=0)
        if n_bad > 0:
            tl.atomic_add(at(here, off_diag, tl.int32) + 8, n_bad, sem="relaxed")
        if c == 0:
            tl.store(at(here, off_num_tokens, tl.int32) + par, T)

    # the signal, by the last program to finish
    tl.debug_barrier()   # every thread's stores of this program precede its count
    published = at(here, off_published, tl.int32)
    if tl.atomic_add(published, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.store(published, 0)   # the next call's publish launch runs after this one
        tl.store(at(here, off_epoch, tl.int32), epoch + 1)
        tl.atomic_xchg(at(here, off_ready, tl.int32), epoch + 1, sem="release",
                       scope=PEER_SCOPE)


@triton.jit
def layout_device(bases, rank, epoch, off_send_counts, off_num_tokens,
                  R, E_LOC, BM, R_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """This rank's pool layout from every source's published counts (call after the peers'
    ready flags were acquired; ``bases``: int64 [R_PAD], every rank's buffer address, loaded
    before the waits). Returns (expert_count [E_PAD], block_start [E_PAD] (exclusive), total
    m-blocks, src_row [E_PAD, R_PAD], src_tokens [R_PAD])."""
    par = epoch & 1
    s = tl.arange(0, R_PAD)
    e = tl.arange(0, E_PAD)
    sm = s < R
    em = e < E_LOC
    E = R * E_LOC
    cnt_ptrs = (bases[:, None] + off_send_counts
                + ((par * E + rank * E_LOC + e[None, :]) * 4).to(tl.int64)).to(
                    tl.pointer_type(tl.int32))
    c_SE = tl.load(cnt_ptrs, mask=sm[:, None] & em[None, :], other=0)          # [R_PAD, E_PAD]
    src_tokens = tl.load((bases + off_num_tokens + par.to(tl.int64) * 4).to(
        tl.pointer_type(tl.int32)), mask=sm, other=0)
    expert_count = tl.sum(c_SE, axis=0)                                         # [E_PAD]
    m_blocks = (expert_count + BM - 1) // BM
    block_start = tl.cumsum(m_blocks, axis=0) - m_blocks
    total_blocks = tl.sum(m_blocks, axis=0)
    src_excl = tl.cumsum(c_SE, axis=0) - c_SE                                   # [R_PAD, E_PAD]
    src_row = block_start[None, :] * BM + src_excl
    return expert_count, block_start, total_blocks, tl.trans(src_row), src_tokens


@triton.jit
def layout_kernel(
    table, rank0, max_spins, timeout_ns,
    host_base,         # HOST_BASE: this rank's buffer address (else unused)
    off_epoch, off_ready, off_diag, off_send_counts, off_num_tokens,
    off_expert_count, off_block_start, off_src_row, off_src_tokens, off_block_meta,
    off_wave_mb, off_num_waves,
    R, E_LOC, BM, NB1, WAVE_BLOCKS,
    R_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_J: tl.constexpr,
    USE_TIMER: tl.constexpr, WAVES: tl.constexpr = True,
    HOST_BASE: tl.constexpr = False, STREAM: tl.constexpr = False,
):
    """Wait for every peer's inputs of this call (STREAM: not at all, every rank's publish
    ran before this launch in stream order on this GPU, ``launch.stream_ordered``), then
    store this rank's pool layout and, for every m-block, its expert and valid rows (so a GEMM block needs one load to find them).
    WAVES (the fused launch reads them): also the expert waves, consecutive experts until a
    wave's L1 blocks (NB1 column blocks per m-block) reach WAVE_BLOCKS, as
    moestream.schedule.expert_waves.

    Every step is a vector operation over the experts (a loop of per-expert reductions costs
    time per local expert): block_meta in BLOCK_J m-blocks of every expert at a time, the waves one
    search per wave.

    HOST_BASE (one local rank): this rank's buffer address is ``host_base`` (``rank_base``),
    so the epoch loads at once; every rank's address is loaded before the waits, not after
    each (sm_90 SASS: table, epoch, then per peer a table load and the wait, then the
    table again before the counts)."""
    rank = rank0 + tl.program_id(0)
    here = rank_base(table, rank, host_base, HOST_BASE)
    sv = tl.arange(0, R_PAD)
    bases = tl.load(table + sv, mask=sv < R, other=0).to(tl.int64)   # every rank's buffer
    epoch = tl.load(at(here, off_epoch, tl.int32))
    diag = at(here, off_diag, tl.int32)
    ok = rank >= 0  # a tensor, so the loop may reassign it
    s = R if STREAM else 0
    while (s < R) & ok:
        ready = at(tl.sum(tl.where(sv == s, bases, 0), axis=0), off_ready, tl.int32)
        ok = wait_at_least(ready, epoch, diag, max_spins, timeout_ns, 1, rank, s, epoch, s,
                           SCOPE="sys", USE_TIMER=USE_TIMER)
        s += 1
    if ok:
        expert_count, block_start, total, src_row_ES, src_tokens = layout_device(
            bases, rank, epoch, off_send_counts, off_num_tokens, R, E_LOC, BM, R_PAD, E_PAD)
        e = tl.arange(0, E_PAD)
        em = e < E_LOC
        tl.store(at(here, off_expert_count, tl.int32) + e, expert_count, mask=em)
        tl.store(at(here, off_block_start, tl.int32) + e, block_start, mask=em)
        tl.store(at(here, off_block_start, tl.int32) + E_LOC, total)
        tl.store(at(here, off_src_row, tl.int32) + e[:, None] * R + sv[None, :],
                 src_row_ES, mask=em[:, None] & (sv[None, :] < R))
        tl.store(at(here, off_src_tokens, tl.int32) + sv, src_tokens, mask=sv < R)
        m_blocks = (expert_count + BM - 1) // BM                                  # [E_PAD]
        # block_meta[block_start[e] + j] = e * 512 + valid rows of m-block j of expert e
        block_meta = at(here, off_block_meta, tl.int32)
        most = tl.max(m_blocks, axis=0)
        for j0 in range(0, most, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            vm = tl.minimum(expert_count[:, None] - j[None, :] * BM, BM)           # [E_PAD, BJ]
            tl.store(block_meta + block_start[:, None] + j[None, :], e[:, None] * 512 + vm,
                     mask=em[:, None] & (j[None, :] < m_blocks[:, None]))
        if WAVES:
            # wave w: experts [first, last]; last is the first expert whose L1 blocks since
            # `first` reach WAVE_BLOCKS (or the last expert); wave_mb[w + 1] its end m-block
            wave_mb = at(here, off_wave_mb, tl.int32)
            incl = tl.cumsum(m_blocks * NB1, axis=0)                                # [E_PAD]
            tl.store(wave_mb, 0)
            waves = 0
            first = 0
            before = 0   # L1 blocks of the experts before `first`
            while first < E_LOC:
                closes = em & (e >= first) & (incl - before >= WAVE_BLOCKS)
                last = tl.min(tl.where(closes, e, E_LOC - 1), axis=0)
                is_last = e == last
                waves += 1
                tl.store(wave_mb + waves,
                         tl.sum(tl.where(is_last, block_start + m_blocks, 0), axis=0))
                before = tl.sum(tl.where(is_last, incl, 0), axis=0)
                first = last + 1
            tl.store(at(here, off_num_waves, tl.int32), waves)


@triton.jit
def _store_rows(pool_x, v, row64, mine, k, h, hm, H, K: tl.constexpr):
    """v [TT, BH] into the pool row of each of its tokens' picks (row64, mine [TT, K_PAD]).
    A loop, not unrolled: unrolled over K the addresses of all K stores are live at once
    (about twice the registers on sm_90, so fewer programs per SM)."""
    for kk in range(K):
        sel = k[None, :] == kk
        r_k = tl.sum(tl.where(sel, row64, 0), axis=1)
        m_k = tl.sum(tl.where(sel, mine.to(tl.int32), 0), axis=1) > 0
        tl.store(pool_x + r_k[:, None] * H + h[None, :], v, mask=m_k[:, None] & hm[None, :])


@triton.jit
def pull_tokens(table, rank, s, t0, n, par64, T_MAX, H, R, E_LOC, BM, P,
                off_x, off_topk_idx, off_topk_weights, off_slot, off_src_row, off_pool_x,
                off_pool_src, off_pool_weight, off_arrival,
                K: tl.constexpr, K_PAD: tl.constexpr, BH: tl.constexpr, TT: tl.constexpr,
                EAGER: tl.constexpr = False, h_lo=0, h_hi=-1, SIGNAL: tl.constexpr = True):
    """One dispatch task: tokens [t0, t0 + n) of source rank ``s`` into ``rank``'s pool, TT
    tokens at a time (TT = 1: the token-granular task).

    Per TT tokens: reads their K picks from the source; pulls each token that has a pick of
    ``rank``'s experts once, stores it in the pool row of each such pick with its source and
    weight, and release-adds 1 per row to the rows' m-block arrival counters.
    EAGER: issue the slot, weight and first row-chunk loads together with the picks' load
    (one peer round trip instead of three in a row; reads the rows of tokens with no pick
    here too).
    [h_lo, h_hi): the part of the rows this task moves (h_hi = -1: to the end; h_lo a
    multiple of BH); the task of part h_lo = 0 also stores the rows' sources and weights, and
    every part adds its own arrival (``dispatch_kernel``'s PARTS). Without SIGNAL no arrival
    is counted (nothing waits on them: the release is a fence that holds the program until
    its row stores are done).
    """
    k = tl.arange(0, K_PAD)
    km = k < K
    pool_x = peer_ptr(table, rank, off_pool_x, tl.bfloat16)
    x_src = peer_ptr(table, s, off_x, tl.bfloat16) + par64 * T_MAX * H
    h_end = tl.where(h_hi < 0, H, h_hi)
    h_0 = h_lo + tl.arange(0, BH)
    hm_0 = h_0 < h_end
    for i in range(0, n, TT):
        t = t0 + i + tl.arange(0, TT)
        tm = t < t0 + n
        t64 = t.to(tl.int64)
        meta = par64 * T_MAX * K + t64[:, None] * K + k[None, :]                  # [TT, K_PAD]
        pick = tm[:, None] & km[None, :]
        idx = tl.load(peer_ptr(table, s, off_topk_idx, tl.int32) + meta, mask=pick, other=-1)
        if EAGER:
            slot_e = tl.load(peer_ptr(table, s, off_slot, tl.int32) + meta, mask=pick, other=0)
            w_e = tl.load(peer_ptr(table, s, off_topk_weights, tl.float32) + meta, mask=pick,
                          other=0.0)
            v_0 = tl.load(x_src + t64[:, None] * H + h_0[None, :],
                          mask=tm[:, None] & hm_0[None, :])
        le = idx - rank * E_LOC
        mine = pick & (idx >= 0) & (le >= 0) & (le < E_LOC)
        if tl.sum(tl.sum(mine.to(tl.int32), axis=1), axis=0) > 0:
            if EAGER:
                slot = slot_e
                w = w_e
            else:
                slot = tl.load(peer_ptr(table, s, off_slot, tl.int32) + meta, mask=mine,
                               other=0)
                w = tl.load(peer_ptr(table, s, off_topk_weights, tl.float32) + meta, mask=mine,
                            other=0.0)
            row = tl.load(peer_ptr(table, rank, off_src_row, tl.int32) + le * R + s, mask=mine,
                          other=0) + slot
            mine = mine & (row >= 0) & (row < P)   # a corrupt peer never writes out of bounds
            row64 = row.to(tl.int64)
            wanted = tl.sum(mine.to(tl.int32), axis=1) > 0                           # [TT]
            if not EAGER:
                v_0 = tl.load(x_src + t64[:, None] * H + h_0[None, :],
                              mask=wanted[:, None] & hm_0[None, :])
            _store_rows(pool_x, v_0, row64, mine, k, h_0, hm_0, H, K)
            for h0 in range(h_lo + BH, h_end, BH):
                h = h0 + tl.arange(0, BH)
                hm = h < h_end
                v = tl.load(x_src + t64[:, None] * H + h[None, :],
                            mask=wanted[:, None] & hm[None, :])                     # [TT, BH]
                _store_rows(pool_x, v, row64, mine, k, h, hm, H, K)
            if h_lo == 0:
                tl.store(peer_ptr(table, rank, off_pool_src, tl.int32) + row,
                         (s * T_MAX + t[:, None]) * K + k[None, :], mask=mine)
                tl.store(peer_ptr(table, rank, off_pool_weight, tl.float32) + row, w,
                         mask=mine)
            if SIGNAL:
                tl.debug_barrier()  # every thread's row stores precede the release below
                tl.atomic_add(peer_ptr(table, rank, off_arrival, tl.int32) + row // BM, 1,
                              mask=mine, sem="release", scope="gpu")


@triton.jit
def dispatch_kernel(
    table, rank0,
    host_base,        # HOST_BASE: this rank's buffer address (else unused)
    off_epoch, off_diag, off_src_row, off_src_tokens, off_arrival,
    off_x, off_topk_idx, off_topk_weights, off_slot,
    off_pool_x, off_pool_src, off_pool_weight,
    T_MAX, H, R, E_LOC, BM, P, PARTS,
    K: tl.constexpr, K_PAD: tl.constexpr, R_PAD: tl.constexpr, BH: tl.constexpr,
    TT: tl.constexpr = 1, EAGER: tl.constexpr = False,
    SIGNAL: tl.constexpr = True, HOST_BASE: tl.constexpr = False,
):
    """Token-granular pull. Ticket i over (source rank, tile of TT source tokens, part of the
    row), sources in rank order; ``pull_tokens`` moves a tile's tokens together (TT = 1: one
    token per ticket; EAGER: its picks, slots, weights and first row chunk in one round trip
    to the peer). Rows move in PARTS parts of whole BH chunks, each its own ticket (more loads
    in flight when a call has few tokens); each part adds its arrival, so an m-block is
    complete at valid_m * PARTS. SIGNAL False: no arrivals are counted (for an L1 that waits
    for nothing, running after this launch in stream order).

    Grid (programs, local ranks); each program walks tickets pid, pid + programs, ...
    HOST_BASE (one local rank): the epoch, diag and source counts at ``host_base``
    (``rank_base``), not after a load of the table.
    """
    pid, nprog, _, rank, epoch, diag = launch_context(table, rank0, off_epoch, off_diag,
                                                      host_base, HOST_BASE)
    par64 = (epoch & 1).to(tl.int64)
    sv = tl.arange(0, R_PAD)
    src_tokens = tl.load(at(rank_base(table, rank, host_base, HOST_BASE), off_src_tokens,
                            tl.int32) + sv, mask=sv < R, other=0)
    tiles = (src_tokens + TT - 1) // TT
    incl = tl.cumsum(tiles, axis=0)
    excl = incl - tiles
    total = tl.sum(tiles, axis=0) * PARTS
    if tl.load(diag, volatile=True) != 0:
        total = 0   # the layout step gave up waiting: its layout is stale, pull nothing
    part_words = tl.cdiv(tl.cdiv(H, BH), PARTS) * BH
    ticket = pid
    while ticket < total:
        tile = ticket // PARTS
        h_lo = (ticket % PARTS) * part_words
        s = tl.sum((incl <= tile).to(tl.int32), axis=0)             # source rank of the tile
        t0 = (tile - tl.sum(tl.where(sv == s, excl, 0), axis=0)) * TT   # first token on it
        n = tl.minimum(TT, tl.sum(tl.where(sv == s, src_tokens, 0), axis=0) - t0)
        pull_tokens(table, rank, s, t0, n, par64, T_MAX, H, R, E_LOC, BM, P,
                    off_x, off_topk_idx, off_topk_weights, off_slot, off_src_row, off_pool_x,
                    off_pool_src, off_pool_weight, off_arrival, K, K_PAD, BH, TT, EAGER,
                    h_lo, tl.minimum(h_lo + part_words, H), SIGNAL)
        ticket += nprog
