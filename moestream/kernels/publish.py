"""Publish: copy one rank's tokens and picks into its buffer, number each expert's picks
(slot, send_counts), zero the counters, and signal the peers (epoch, ready)."""
from __future__ import annotations

from .common import at, rank_base, tl, triton
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
    offs,             # Offsets: every region's byte offset (launch.Offsets)
    reset_words,
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
    itself done (acq_rel, gpu scope); the last one resets that count and signals: epoch += 1,
    ready = epoch (release at PEER_SCOPE: "sys", or "gpu" where every rank's buffer is on this GPU,
    ``SymmBuffer.one_device``; cumulative over the other programs' stores, which it acquired).

    QUANT (fp8 mode): publish each row as e4m3 values followed by its fp32 scales, one per
    128 channels (moestream.quant.quantize_act_fp8's format; BH a multiple of 128).

    HOST_BASE: the rank's buffer address is ``host_base`` (``rank_base``; the host knows it
    for every local rank, one launch each), so the epoch, and the stores whose addresses
    follow from it, do not wait for a load of the table first."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    here = rank_base(table, rank, host_base, HOST_BASE)
    epoch = tl.load(at(here, offs.epoch, tl.int32))
    par = (epoch + 1) & 1   # the signal below makes epoch + 1 current
    meta0 = par.to(tl.int64) * T_MAX * K
    c = pid - (E + 1)   # copy program c
    if c < 0:
        number_picks(topk_idx_TK, at(here, offs.slot, tl.int32) + meta0,
                     at(here, offs.send_counts, tl.int32) + par * E, T * K,
                     pid, E, BLOCK)
    else:
        # Zero this program's share of the per-call counters (arrival, l1_done,
        # combine_flag). Peers write combine_flag only after this call's ready flag, which
        # this launch sets after every program is done.
        zero_ptr = at(here, offs.reset, tl.int32)
        per_prog = tl.cdiv(tl.cdiv(reset_words, COPY), BZ) * BZ
        z = c * per_prog
        z_end = tl.minimum(z + per_prog, reset_words)
        while z < z_end:
            words = z + tl.arange(0, BZ)
            tl.store(zero_ptr + words, tl.zeros([BZ], tl.int32), mask=words < z_end)
            z += BZ

        # Tokens [c*BT, c*BT + BT): rows of x and their K picks.
        t = c * BT + tl.arange(0, BT)
        tm = t < T
        t64 = t.to(tl.int64)
        if QUANT:
            row64 = par.to(tl.int64) * T_MAX + t64
            q_dst = at(here, offs.x, tl.float8e4nv) + row64 * XB
            s_dst = at(here, offs.x + H, tl.float32) + row64 * (XB // 4)
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
            x_dst = at(here, offs.x, tl.bfloat16) + par.to(tl.int64) * T_MAX * H
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
        tl.store(at(here, offs.topk_idx, tl.int32) + meta0 + tk, idx, mask=tk_mask)
        tl.store(at(here, offs.topk_weights, tl.float32) + meta0 + tk,
                 tl.load(topk_w_TK + tk, mask=tk_mask, other=0.0), mask=tk_mask)
        n_bad = tl.sum(tl.sum((tk_mask & ((idx < -1) | (idx >= E))).to(tl.int32), axis=1),
                       axis=0)
        if n_bad > 0:
            tl.atomic_add(at(here, offs.diag, tl.int32) + 8, n_bad, sem="relaxed")
        if c == 0:
            tl.store(at(here, offs.num_tokens, tl.int32) + par, T)

    # the signal, by the last program to finish
    tl.debug_barrier()   # every thread's stores of this program precede its count
    published = at(here, offs.published, tl.int32)
    if tl.atomic_add(published, 1, sem="acq_rel", scope="gpu") == nprog - 1:
        tl.store(published, 0)   # the next call's publish launch runs after this one
        tl.store(at(here, offs.epoch, tl.int32), epoch + 1)
        tl.atomic_xchg(at(here, offs.ready, tl.int32), epoch + 1, sem="release",
                       scope=PEER_SCOPE)
