"""Token-granular pull dispatch: one task per (source rank, source tokens) pulls each token's
row once from the source's buffer and stores it into the pool row of each of its picks of
this rank's experts, then release-adds the block's arrival count.

Dispatch copies rows as 16-bit words without looking at them: ``H`` of the pull functions is
the row width in words (the hidden size in bf16 mode; ``config.token_bytes // 2`` in fp8 mode,
where a row is e4m3 values followed by their fp32 scales).
"""
from __future__ import annotations

from .common import at, launch_context, peer_ptr, rank_base, tl, triton


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
    offs,             # Offsets: every region's byte offset (launch.Offsets)
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
    pid, nprog, _, rank, epoch, diag = launch_context(table, rank0, offs.epoch, offs.diag,
                                                      host_base, HOST_BASE)
    par64 = (epoch & 1).to(tl.int64)
    sv = tl.arange(0, R_PAD)
    src_tokens = tl.load(at(rank_base(table, rank, host_base, HOST_BASE), offs.src_tokens,
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
                    offs.x, offs.topk_idx, offs.topk_weights, offs.slot, offs.src_row, offs.pool_x,
                    offs.pool_src, offs.pool_weight, offs.arrival, K, K_PAD, BH, TT, EAGER,
                    h_lo, tl.minimum(h_lo + part_words, H), SIGNAL)
        ticket += nprog
