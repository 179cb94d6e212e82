"""Grouped GEMMs over the pool: L1 (gate/up + SwiGLU + gate weight) and L2 (down projection,
rows written straight into the combine slot of the token's own rank).

Legend:
    pool_x [P, H] bf16    tokens, each local expert's segment padded to BM rows
    w13 [E_LOC, 2I, H]    gate rows 0..I-1, up rows I..2I-1 (one tensor per local rank,
                          reached through w13_table)
    pool_act [P, I] bf16  silu(x @ gate^T) * (x @ up^T) * topk weight
    w2 [E_LOC, H, I]
    combine_y [T_MAX, K, H] bf16 on the token's rank, flag combine_flag [T_MAX, K]
    l2_done [m-blocks]    L2 column blocks finished; the block that completes an m-block
                          releases the combine flags of its rows (one system-scope release per
                          row, not one per row and column block)
    FP8 (constexpr)       pool_x / pool_act are byte rows of e4m3 values + fp32 scales (XB /
                          AB bytes), weights e4m3 with fp32 scale_inv per 128x128 block (second
                          weight table); the block math is kernels/gemm_fp8.py's

Decode pieces (DM constexpr, ``Tuning.decode_rows``): a block is computed as weights @ rows^T,
one DM-row piece when it has at most DM valid rows, else pieces of DECODE_WIDE = min(32, BM)
rows (written out where marked ``# DECODE_WIDE``: Triton 3.6 has no constexpr helpers).
Tail pieces (TAIL constexpr with DM, ``Tuning.l1_tail_rows`` / ``l2_tail_rows``): only a block
of at most DM valid rows (an expert's last, partly filled m-block) runs as one such piece;
fuller blocks run the usual BM-row tile (L2: each BM / SPLIT_M-row piece on its own, an empty
one skipped).

Block (m_block, n_block): m_block numbers the pool's BM-row blocks (global over the rank's
experts, as moestream.schedule), n fastest. An L1 block waits until its pool block's arrival
count reaches valid_m; an L2 block until all L1 column blocks of its m-block are done.
Persistent: grid (programs, local ranks), tickets pid, pid + programs, ...
A block finds its expert and valid rows in one load of block_meta (expert * 512 + valid_m,
written by the layout step), and the next block's entry is loaded while this block computes,
so no dependent global loads stand between two blocks' GEMMs.
"""
from __future__ import annotations

from ._common import (DECODE_STORE_EVICT, aligned_ptr_from, at, launch_context,
                      peer_ptr, peer_ptrs, rank_base, tl, to_bf16, triton, wait_at_least,
                      zero_acc)
from .gemm_fp4 import l1_fp4w_rows, l2_fp4w_rows
from .gemm_fp8 import (fp8_descriptors, l1_fp8_acc, l1_fp8_block, l1_fp8_decode_block,
                       l1_fp8_epilogue, l2_fp8_acc, l2_fp8_rows)


@triton.jit
def grouped_tile(ticket, num_m, NB, GROUP_M: tl.constexpr):
    """(m_block, n_block) of ``ticket`` when tickets walk GROUP_M m-blocks at a time, m
    fastest within a group (the usual GEMM swizzle): the programs running at once share a few
    weight column blocks across GROUP_M m-blocks instead of streaming a whole expert's weights
    once per m-block (L2 of dsv3 has 112 column blocks, close to the SM count). GROUP_M = 1:
    n fastest."""
    per_group = GROUP_M * NB
    first_m = (ticket // per_group) * GROUP_M
    size_m = tl.maximum(tl.minimum(num_m - first_m, GROUP_M), 1)   # >= 1 past the last ticket
    r = ticket % per_group
    return first_m + r % size_m, r // size_m


@triton.jit
def l1_tile_of(ticket, num_m, NB, GROUP_M: tl.constexpr):
    """(m_block, n_block) of an L1 ticket: ``grouped_tile``, n fastest by plain division
    when GROUP_M is 1 (no grouping)."""
    if GROUP_M == 1:
        return ticket // NB, ticket % NB
    else:
        return grouped_tile(ticket, num_m, NB, GROUP_M)


@triton.jit
def claims_ptr(table, base, off_claims, CLAIM: tl.constexpr):
    """CLAIM: the launch's [next ticket, programs finished] in the rank's buffer at ``base``
    (``rank_base``); else the table (never read)."""
    if CLAIM:
        return at(base, off_claims, tl.int32)
    else:
        return table


@triton.jit
def claiming(total, nprog, CLAIM: tl.constexpr):
    """Whether a CLAIM launch of ``total`` tickets claims any: only past two tickets per
    program. The first two are dealt round-robin (pid, pid + nprog: with programs placed in
    order, one second tile per SM before any SM gets two, where claimed by arrival both
    programs of an SM can take one), and a launch that claims nothing skips the final count
    (claiming from the second ticket was slower for small decode calls)."""
    if CLAIM:
        on = total > 2 * nprog
    else:
        on = total < 0
    return on


@triton.jit
def first_next(pid, nprog, CLAIM: tl.constexpr):
    """CLAIM: the second ticket of program ``pid`` (pid + nprog), the one ``next_tickets``
    starts from. Without CLAIM: 0, unused."""
    if CLAIM:
        return pid + nprog
    else:
        return 0


@triton.jit
def next_tickets(claims, ticket, nxt, nprog, on, CLAIM: tl.constexpr):
    """(the ticket after ``ticket``, the one after that) of a persistent GEMM program.
    Round-robin: ticket + nprog, and the second unused (0: nothing extra is carried through
    the loop). CLAIM: ``nxt``, and the one after it, claimed now (used a tile later) where
    the launch claims (``claiming``: ``on``), else nxt + nprog. A claim is 2 * nprog + the
    count of the launch's counter (``claims`` [next ticket, programs finished]), since every
    program's first two tickets are pid and pid + nprog (``first_next``); it is claimed two
    tiles ahead, so its block meta is loaded a tile early as in the round-robin form, with
    no dependent round trip between tiles."""
    if CLAIM:
        old = tl.atomic_add(claims, 1, sem="relaxed", scope="gpu", mask=on)
        return nxt, tl.where(on, 2 * nprog + old, nxt + nprog)
    else:
        return ticket + nprog, nxt


@triton.jit
def advance(ticket, nxt, after, nprog, CLAIM: tl.constexpr):
    """The end of a tile: (next ticket, the one after) from ``next_tickets``' pair; the
    round-robin form adds nprog here (sm_90: the same PTX as a loop without claims but for
    the order of two instructions)."""
    if CLAIM:
        return nxt, after
    else:
        return ticket + nprog, after


@triton.jit
def finish_claims(claims, nprog, on, CLAIM: tl.constexpr):
    """A program of a launch that claims (``claiming``: ``on``) is done claiming: it counts
    itself, and the last one zeroes the counter and the count, so the next launch (a bench's
    standalone GEMM too) starts at ticket 2 * nprog again (publish zeroes them at every call
    as well). A launch that claims nothing leaves them at zero and counts nothing."""
    if CLAIM:
        if on:
            tl.debug_barrier()   # every claim of this program is issued before it counts
            done = tl.atomic_add(claims + 1, 1, sem="acq_rel", scope="gpu")
            if done == nprog - 1:
                tl.atomic_xchg(claims, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(claims + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def l1_descriptors(pool_x, w13, P, H, I, E_LOC, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, ONE_DOT: tl.constexpr = False):
    """Tensor descriptors (TMA) of L1's A rows [P, H] and weight tiles [E_LOC * 2I, H];
    ONE_DOT: weight tiles [2, BN, BK] of w13 seen as [E_LOC * 2, I, H] (a column block's gate
    and up rows in one load)."""
    a_desc = tl.make_tensor_descriptor(pool_x, shape=[P, H], strides=[H, 1], block_shape=[BM, BK])
    if ONE_DOT:
        w_desc = tl.make_tensor_descriptor(w13, shape=[E_LOC * 2, I, H], strides=[I * H, H, 1],
                                           block_shape=[2, BN, BK])
    else:
        w_desc = tl.make_tensor_descriptor(w13, shape=[E_LOC * 2 * I, H], strides=[H, 1],
                                           block_shape=[BN, BK])
    return a_desc, w_desc


@triton.jit
def l2_descriptors(pool_act, w2, P, H, I, E_LOC, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """Tensor descriptors of L2's A rows [P, I] and weight tiles [E_LOC * H, I]."""
    a_desc = tl.make_tensor_descriptor(pool_act, shape=[P, I], strides=[I, 1],
                                       block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w2, shape=[E_LOC * H, I], strides=[I, 1],
                                       block_shape=[BN, BK])
    return a_desc, w_desc


@triton.jit
def decode_descriptors(a, rows, cols, row_stride, w, w_rows, w_cols, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, DM: tl.constexpr,
                       SECOND: tl.constexpr = 0):
    """Tensor descriptors of decode pieces: ((A [rows, cols] in DM-row tiles, the same in
    tiles of DECODE_WIDE rows, or of SECOND rows if given: tail pieces' full tiles), weights
    [w_rows, w_cols] in [BN, BK] tiles). ``row_stride`` in elements of A (bf16 rows, or the
    fp8 layer's byte rows)."""
    a_dm = tl.make_tensor_descriptor(a, shape=[rows, cols], strides=[row_stride, 1],
                                     block_shape=[DM, BK])
    WIDE: tl.constexpr = SECOND if SECOND > 0 else (32 if BM >= 32 else BM)   # DECODE_WIDE
    a_wide = tl.make_tensor_descriptor(a, shape=[rows, cols], strides=[row_stride, 1],
                                       block_shape=[WIDE, BK])
    w_desc = tl.make_tensor_descriptor(w, shape=[w_rows, w_cols], strides=[w_cols, 1],
                                       block_shape=[BN, BK])
    return (a_dm, a_wide), w_desc


@triton.jit
def pool_piece_descriptors(table, rank, off_a, a, P, cols, A_BYTES, w, w_rows, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, DM: tl.constexpr,
                           SECOND: tl.constexpr, FP8: tl.constexpr):
    """``decode_descriptors`` of a staged GEMM's pool rows [P, cols] (bf16 ``a``, or the fp8
    layer's byte rows of A_BYTES at ``off_a`` of this rank's buffer) and its weights
    [w_rows, cols]."""
    if FP8:
        descs = decode_descriptors(peer_ptr(table, rank, off_a, tl.float8e4nv), P, cols,
                                   A_BYTES, w, w_rows, cols, BM, BN, BK, DM, SECOND)
    else:
        descs = decode_descriptors(a, P, cols, cols, w, w_rows, cols, BM, BN, BK, DM, SECOND)
    return descs


@triton.jit
def weight_tile(w, SWAP: tl.constexpr):
    """A loaded weight tile [BN, BK] as the MMA operand: transposed to [BK, BN] for rows @ w^T,
    as loaded for the decode pieces' w @ rows^T (SWAP)."""
    if not SWAP:
        w = w.T
    return w


@triton.jit
def l1_block(mb, nb, meta, l1_done, pool_x, pool_w, pool_act, w13, a_desc, w_desc, H, I,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             UPCAST: tl.constexpr, USE_TMA: tl.constexpr, SIGNAL: tl.constexpr = True,
             ONE_DOT: tl.constexpr = False):
    """One L1 block: gate and up GEMMs of (m_block, n_block), SwiGLU x weight, release.
    ``meta``: the m-block's block_meta entry (expert * 512 + valid_m). SIGNAL: release-add
    the m-block's ``l1_done`` (``count_l1_done``). ONE_DOT: see ``l1_rows``."""
    # Padding rows past valid_m hold stale data: rows are independent in a GEMM, so they only
    # spoil their own (never stored) output rows.
    l1_rows(mb, 0, nb, meta, pool_x, pool_w, pool_act, w13, a_desc, w_desc, H, I, BM, BN, BK,
            BM, UPCAST, USE_TMA, False, ONE_DOT)
    count_l1_done(l1_done, mb, SIGNAL)


@triton.jit
def count_l1_done(l1_done, mb, SIGNAL: tl.constexpr):
    """Release-add 1 to m-block ``mb``'s ``l1_done`` once the block's rows are stored, for an
    L2 that waits on it. Without SIGNAL (the staged launches on GPUs, whose L2 runs after the
    L1 in stream order and waits for nothing) nothing is counted: the release is a fence that
    holds the program until its stores are done."""
    if SIGNAL:
        tl.debug_barrier()  # all rows stored before the count is released
        tl.atomic_add(l1_done + mb, 1, sem="release", scope="gpu")


@triton.jit
def l1_rows(mb, r0, nb, meta, pool_x, pool_w, pool_act, w13, a_desc, w_desc, H, I,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
            UPCAST: tl.constexpr, USE_TMA: tl.constexpr, SWAP: tl.constexpr,
            ONE_DOT: tl.constexpr = False, EVICT_LAST: tl.constexpr = False):
    """Rows r0 .. r0+ROWS-1 of an L1 block: gate and up GEMMs, SwiGLU x weight, stored into
    pool_act (rows past valid_m are not). SWAP (decode pieces): computed as [BN, ROWS] =
    weight tiles @ rows^T, the weights as the MMA's row operand, and stored transposed.
    USE_TMA: ``a_desc`` has ROWS-row tiles. ONE_DOT (descriptors, not SWAP): gate and up as
    one [ROWS, 2 * BN] MMA per K step, their rows loaded as one [2, BN, BK] tile
    (``l1_descriptors``), then split. EVICT_LAST (decode pieces, with SWAP): as
    ``l1_store``'s."""
    tl.static_assert(not ONE_DOT or (USE_TMA and not SWAP), "one dot: descriptors, no swap")
    e = meta >> 9
    vm = meta & 511
    w_row = 0
    if SWAP:   # decode pieces: the rows' top-k weights loaded before the K loop, which hides it
        w_row = row_weights(pool_w, mb, r0, vm, BM, ROWS)
    if ONE_DOT:
        acc = tl.zeros([ROWS, 2 * BN], tl.float32)
        for k0 in range(0, H, BK):
            a = a_desc.load([mb * BM + r0, k0])
            w = tl.reshape(w_desc.load([e * 2, nb * BN, k0]), [2 * BN, BK])
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w.T, acc)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [ROWS, 2, BN]), (0, 2, 1)))
    else:
        acc_g, acc_u = l1_acc(mb, r0, nb, e, pool_x, w13, a_desc, w_desc, H, I, BM, BN, BK,
                              ROWS, UPCAST, USE_TMA, SWAP)
    l1_store(acc_g, acc_u, mb, r0, nb, vm, pool_w, pool_act, I, BM, BN, ROWS, UPCAST, SWAP,
             SWAP, w_row, EVICT_LAST)


@triton.jit
def l1_acc(mb, r0, nb, e, pool_x, w13, a_desc, w_desc, H, I,
           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
           UPCAST: tl.constexpr, USE_TMA: tl.constexpr, SWAP: tl.constexpr, k_lo=0, k_hi=-1):
    """The K loop of ``l1_rows`` as two MMAs per step: fp32 (gate, up) of expert ``e``,
    [ROWS, BN] ([BN, ROWS] with SWAP), over K columns [k_lo, k_hi) (k_hi -1: H; split-K
    parts, ``l1_split_part``)."""
    if k_hi < 0:
        k_hi = H
    kk = k_lo + tl.arange(0, BK)
    n = nb * BN + tl.arange(0, BN)
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    a_ptrs = pool_x + rows[:, None] * H + kk[None, :]
    wg_ptrs = w13 + e.to(tl.int64) * 2 * I * H + n[:, None].to(tl.int64) * H + kk[None, :]
    wu_ptrs = wg_ptrs + I * H
    acc_g = zero_acc(ROWS, BN, SWAP)
    acc_u = zero_acc(ROWS, BN, SWAP)
    for k0 in range(k_lo, k_hi, BK):
        if USE_TMA:
            a = a_desc.load([mb * BM + r0, k0])
            g = weight_tile(w_desc.load([e * 2 * I + nb * BN, k0]), SWAP)
            u = weight_tile(w_desc.load([e * 2 * I + I + nb * BN, k0]), SWAP)
        else:
            a = tl.load(a_ptrs)
            g = weight_tile(tl.load(wg_ptrs), SWAP)
            u = weight_tile(tl.load(wu_ptrs), SWAP)
        # UPCAST (interpreter only): it multiplies bf16 bit patterns (triton #11584) and
        # truncates when casting back to bf16 (to_bf16 fixes that)
        if UPCAST:
            a = a.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        if SWAP:
            acc_g = tl.dot(g, a.T, acc_g)
            acc_u = tl.dot(u, a.T, acc_u)
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BK
        wg_ptrs += BK
        wu_ptrs += BK
    return acc_g, acc_u


@triton.jit
def row_weights(pool_w, mb, r0, vm, BM: tl.constexpr, ROWS: tl.constexpr):
    """The top-k weights of rows r0 .. r0+ROWS-1 of m-block ``mb`` (0 past its vm valid
    rows)."""
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    return tl.load(pool_w + rows, mask=r0 + tl.arange(0, ROWS) < vm, other=0.0)


@triton.jit
def l1_store(acc_g, acc_u, mb, r0, nb, vm, pool_w, pool_act, I, BM: tl.constexpr,
             BN: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr, SWAP: tl.constexpr,
             PRE: tl.constexpr = False, pre_w=0, EVICT_LAST: tl.constexpr = False):
    """The epilogue of ``l1_rows``: SwiGLU x the rows' top-k weights into pool_act (``vm``
    valid rows in the m-block). PRE: ``pre_w`` holds the ``row_weights``, loaded by the
    caller before its K loop. EVICT_LAST (decode pieces, SWAP): the rows stored at
    ``DECODE_STORE_EVICT`` priority in the L2 cache."""
    POLICY: tl.constexpr = DECODE_STORE_EVICT if EVICT_LAST else ""
    n = nb * BN + tl.arange(0, BN)
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    rv = r0 + tl.arange(0, ROWS) < vm
    w_row = row_weights(pool_w, mb, r0, vm, BM, ROWS)
    if PRE:
        w_row = pre_w
    if SWAP:
        act = acc_g * tl.sigmoid(acc_g) * acc_u * w_row[None, :]      # [BN, ROWS]
        tl.store(pool_act + rows[None, :] * I + n[:, None], to_bf16(act, UPCAST),
                 mask=rv[None, :], eviction_policy=POLICY)
    else:
        act = acc_g * tl.sigmoid(acc_g) * acc_u * w_row[:, None]
        tl.store(pool_act + rows[:, None] * I + n[None, :], to_bf16(act, UPCAST),
                 mask=rv[:, None])


@triton.jit
def split_count(tiles, nprog, SPLIT_K: tl.constexpr, MIN_S: tl.constexpr = 4):
    """Programs per tile of a split-K GEMM (``l1_split_part``, ``l2_split_part``): the
    largest power of two S <= SPLIT_K with tiles * S <= nprog, and 1 (no split) unless that
    is at least MIN_S, decided on the device from this call's m-block count. Two parts
    are slower than none where K is short (e.g. qwen3's L1, K = 2048), four or more faster;
    MIN_S 2 is for long K loops (the fused launch's mixtral L2, K = 14336)."""
    s = tiles * 0 + 1
    if MIN_S <= 2 and SPLIT_K >= 2:
        s = tl.where(tiles * 2 <= nprog, 2, s)
    if SPLIT_K >= 4:
        s = tl.where(tiles * 4 <= nprog, 4, s)
    if SPLIT_K >= 8:
        s = tl.where(tiles * 8 <= nprog, 8, s)
    if SPLIT_K >= 16:
        s = tl.where(tiles * 16 <= nprog, 16, s)
    return s


@triton.jit
def split_tile(pid, S, total, num_m, NB, block_meta, GROUP_M: tl.constexpr):
    """Of a staged split-K launch of ``total`` tiles in S parts each (``split_count``, S >
    1): (tile, m-block, n-block, its meta) of program ``pid``, which runs part pid % S of that
    tile (a tile >= total: no part for this program, meta 0). Called only where S > 1, so a
    launch that does not split keeps the first meta it loaded along with the block count
    instead of one that waits for the count (sm_90 SASS: the decode L1 and L2 had table,
    count, meta and the first tile load in a row)."""
    tile = pid // S
    mb, nb = l1_tile_of(tile, num_m, NB, GROUP_M)
    return tile, mb, nb, tl.load(block_meta + mb, mask=tile < total, other=0)


@triton.jit
def split_range(part, S, K, BK: tl.constexpr):
    """K columns [k_lo, k_hi) of split-K part ``part`` of S: whole BK steps, the parts past
    the last step empty."""
    per = (K // BK + S - 1) // S
    k_lo = part * per * BK
    return k_lo, tl.minimum(k_lo + per * BK, K)


@triton.jit
def count_split_part(counts, tile):
    """After a split-K part stored its partial sums: counts it for ``tile`` (acq_rel, so the
    part that counts last sees every part's sums) and returns how many counted before."""
    tl.debug_barrier()   # every thread's sums are stored before the count is released
    done = tl.atomic_add(counts + tile, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    return done


@triton.jit
def split_total(first, cell, S, SLOT: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """The S parts' fp32 [A, B] sums at ``first + j * SLOT + cell``, added in part order (the
    same sum whichever part counted last)."""
    total = tl.zeros([A, B], tl.float32)
    for j in range(0, S):
        total += tl.load(first + j * SLOT + cell)
    return total


@triton.jit
def store_l1_part(acc_g, acc_u, tile, part, S, sums, counts, BN: tl.constexpr,
                  DM: tl.constexpr):
    """A split-K L1 part's fp32 gate and up sums [BN, DM] into ``sums`` slot tile * S + part,
    then its count; whether it counted last (and so finishes the tile, ``l1_part_totals``)."""
    cell = tl.arange(0, BN)[:, None] * DM + tl.arange(0, DM)[None, :]
    slot = sums + (tile * S + part).to(tl.int64) * (2 * BN * DM)
    tl.store(slot + cell, acc_g)
    tl.store(slot + BN * DM + cell, acc_u)
    return count_split_part(counts, tile) == S - 1


@triton.jit
def l1_part_totals(sums, tile, S, BN: tl.constexpr, DM: tl.constexpr):
    """The gate and up sums of a split-K L1 tile's S parts, added in part order."""
    cell = tl.arange(0, BN)[:, None] * DM + tl.arange(0, DM)[None, :]
    first = sums + (tile * S).to(tl.int64) * (2 * BN * DM)
    return (split_total(first, cell, S, 2 * BN * DM, BN, DM),
            split_total(first + BN * DM, cell, S, 2 * BN * DM, BN, DM))


@triton.jit
def l1_split_part(tile, part, S, mb, nb, meta, l1_done, pool_x, pool_w, pool_act, w13, a_desc,
                  w_desc, sums, counts, H, I, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, DM: tl.constexpr, UPCAST: tl.constexpr,
                  USE_TMA: tl.constexpr, SIGNAL: tl.constexpr):
    """Part ``part`` of S of a decode L1 block's K loop (split-K, ``Tuning.l1_split_k``):
    its fp32 gate and up sums [BN, DM] go to ``sums`` slot tile * S + part; the part that
    counts last in ``counts[tile]`` adds the S slots in order (the same sum whoever is last),
    applies SwiGLU x weight, stores the rows, sets the count back to 0 for the next call and
    signals the block. A block of more than DM rows (wide pieces) runs whole in part 0."""
    vm = meta & 511
    if vm <= DM:
        k_lo, k_hi = split_range(part, S, H, BK)
        acc_g, acc_u = l1_acc(mb, 0, nb, meta >> 9, pool_x, w13, a_desc[0], w_desc, H, I, BM,
                              BN, BK, DM, UPCAST, USE_TMA, True, k_lo, k_hi)
        if store_l1_part(acc_g, acc_u, tile, part, S, sums, counts, BN, DM):
            sum_g, sum_u = l1_part_totals(sums, tile, S, BN, DM)
            l1_store(sum_g, sum_u, mb, 0, nb, vm, pool_w, pool_act, I, BM, BN, DM, UPCAST,
                     True, EVICT_LAST=True)
            tl.atomic_xchg(counts + tile, 0, sem="relaxed", scope="gpu")
            count_l1_done(l1_done, mb, SIGNAL)
    elif part == 0:
        l1_decode_block(mb, nb, meta, l1_done, pool_x, pool_w, pool_act, w13, a_desc, w_desc,
                        H, I, BM, BN, BK, DM, UPCAST, USE_TMA, False, SIGNAL)


@triton.jit
def l1_decode_block(mb, nb, meta, l1_done, pool_x, pool_w, pool_act, w13, a_desc, w_desc, H, I,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DM: tl.constexpr,
                    UPCAST: tl.constexpr, USE_TMA: tl.constexpr, TAIL: tl.constexpr = False,
                    SIGNAL: tl.constexpr = True):
    """``l1_block`` for decode (``Tuning.decode_rows``): computed as weights @ rows^T
    ([BN, rows] accumulators: the weight tile is the MMA's row operand). A block of at most
    DM valid rows is one piece of DM rows, so a few decode tokens cost a DM-column MMA
    instead of a BM-row tile of padding; a fuller block (a hot expert) runs in pieces of
    WIDE = min(32, BM) rows. Each piece reads the block's weights once. USE_TMA: ``a_desc``
    is a pair of descriptors of DM-row and WIDE-row tiles (``decode_descriptors``).
    TAIL (tail pieces): a fuller block runs as the usual BM-row tile instead (``a_desc[1]``
    has BM-row tiles then)."""
    WIDE: tl.constexpr = 32 if BM >= 32 else BM   # DECODE_WIDE
    HINT: tl.constexpr = not TAIL   # decode pieces, not tail pieces: DECODE_STORE_EVICT
    vm = meta & 511
    if vm <= DM:
        l1_rows(mb, 0, nb, meta, pool_x, pool_w, pool_act, w13, a_desc[0], w_desc, H, I, BM,
                BN, BK, DM, UPCAST, USE_TMA, True, EVICT_LAST=HINT)
    elif TAIL:
        l1_rows(mb, 0, nb, meta, pool_x, pool_w, pool_act, w13, a_desc[1], w_desc, H, I, BM,
                BN, BK, BM, UPCAST, USE_TMA, False)
    else:
        for r0 in range(0, vm, WIDE):
            l1_rows(mb, r0, nb, meta, pool_x, pool_w, pool_act, w13, a_desc[1], w_desc, H, I,
                    BM, BN, BK, WIDE, UPCAST, USE_TMA, True, EVICT_LAST=True)
    count_l1_done(l1_done, mb, SIGNAL)


@triton.jit
def gemm_context(table, rank0, off_epoch, off_diag, host_base, w_table, s_table,
                 off_block_start, off_block_meta, FP8: tl.constexpr, W4: tl.constexpr,
                 HOST_BASE: tl.constexpr):
    """What a staged GEMM program starts from: ``launch_context``'s six values, its rank's
    buffer address from the table (``here``, for every region but the next two), its local
    rank's weight pointers (``expert_weights``), and the block count and meta pointers, which
    take the host's address where HOST_BASE (``rank_base``: the first loads do not wait for
    the table's; only these two, see there)."""
    pid, nprog, lr, rank, epoch, diag = launch_context(table, rank0, off_epoch, off_diag)
    first = rank_base(table, rank, host_base, HOST_BASE)   # for the first loads only
    here = rank_base(table, rank, 0, False)
    w, w_s = expert_weights(w_table, s_table, lr, FP8, W4 > 0)
    return (pid, nprog, lr, rank, epoch, diag, here, w, w_s,
            at(first, off_block_start, tl.int32), at(first, off_block_meta, tl.int32))


@triton.jit
def expert_weights(w_table, s_table, index, FP8: tl.constexpr, W4: tl.constexpr = False):
    """(values, scale_inv) pointers of local rank ``index``'s experts: e4m3 values and fp32
    block scales (FP8; torch allocations, 16-byte aligned), MXFP4 packed pairs and E8M0 codes
    (W4, both uint8; 16-byte aligned, checks.check_expert_weights_fp4w), or bf16 values (the
    second pointer is the first, unused)."""
    if W4:
        w = aligned_ptr_from(w_table, index, tl.uint8)
        s = aligned_ptr_from(s_table, index, tl.uint8)
    elif FP8:
        w = aligned_ptr_from(w_table, index, tl.float8e4nv)
        s = aligned_ptr_from(s_table, index, tl.float32)
    else:
        w = tl.load(w_table + index).to(tl.int64).to(tl.pointer_type(tl.bfloat16))
        s = w
    return w, s


@triton.jit
def l1_fp8_pool_block(mb, nb, meta, table, rank, l1_done, off_pool_x, off_pool_weight,
                      off_pool_act, w13, w13_s, H, I, XB, AB, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, FIX_ROUNDING: tl.constexpr,
                      DM: tl.constexpr = 0, a_desc=0, w_desc=0, USE_TMA: tl.constexpr = False,
                      W4: tl.constexpr = 0, TAIL: tl.constexpr = False,
                      SIGNAL: tl.constexpr = True):
    """One fp8 L1 block over the pool's byte rows (e4m3 values, then fp32 scales: XB / AB
    bytes per pool_x / pool_act row), then the release of the m-block's ``l1_done``.
    DM > 0: in decode pieces of DM rows (``l1_fp8_decode_block``; USE_TMA only there), or
    with TAIL only a block of at most DM rows (fuller ones: ``l1_fp8_block``).
    W4 > 0: MXFP4 weights (kernels/gemm_fp4.py), the valid rows in pieces of W4 rows."""
    x_q = peer_ptr(table, rank, off_pool_x, tl.float8e4nv)
    x_s = peer_ptr(table, rank, off_pool_x + H, tl.float32)
    pool_w = peer_ptr(table, rank, off_pool_weight, tl.float32)
    act_q = peer_ptr(table, rank, off_pool_act, tl.float8e4nv)
    act_s = peer_ptr(table, rank, off_pool_act + I, tl.float32)
    if W4:   # MXFP4 weights: the block's valid rows in pieces of W4 rows
        for r0 in range(0, meta & 511, W4):
            l1_fp4w_rows(mb, r0, nb, meta >> 9, meta & 511, x_q, x_s, w13, w13_s, pool_w, act_q,
                         act_s, H, I, XB, XB // 4, AB, AB // 4, BM, BN, BK, W4, FIX_ROUNDING)
    elif DM > 0:
        l1_fp8_decode_block(mb, nb, meta >> 9, meta & 511, x_q, x_s, w13, w13_s, pool_w, act_q,
                            act_s, H, I, XB, XB // 4, AB, AB // 4, BM, BN, BK, DM, a_desc,
                            w_desc, USE_TMA, FIX_ROUNDING, TAIL)
    else:
        l1_fp8_block(mb, nb, meta >> 9, meta & 511, x_q, x_s, w13, w13_s, pool_w, act_q, act_s,
                     H, I, XB, XB // 4, AB, AB // 4, BM, BN, BK, FIX_ROUNDING)
    count_l1_done(l1_done, mb, SIGNAL)


@triton.jit
def l1_fp8_split_part(tile, part, S, mb, nb, meta, table, rank, l1_done, off_pool_x,
                      off_pool_weight, off_pool_act, w13, w13_s, a_desc, w_desc, sums, counts,
                      H, I, XB, AB, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      DM: tl.constexpr, FIX_ROUNDING: tl.constexpr, USE_TMA: tl.constexpr,
                      SIGNAL: tl.constexpr):
    """``l1_split_part`` for fp8 decode pieces: part ``part`` of S runs whole BK-column K
    steps (one scale block each, every product scaled by its step's activation and weight
    scales), its fp32 gate and up sums [BN, DM] go to ``sums`` slot tile * S + part, and the
    part that counts last adds the S slots in order, applies SwiGLU x weight, re-quantizes
    the rows (``l1_fp8_epilogue``), sets the count back to 0 and signals the block. A block
    of more than DM rows runs whole in part 0 (``l1_fp8_pool_block``)."""
    vm = meta & 511
    if vm <= DM:
        x_q = peer_ptr(table, rank, off_pool_x, tl.float8e4nv)
        x_s = peer_ptr(table, rank, off_pool_x + H, tl.float32)
        k_lo, k_hi = split_range(part, S, H, BK)
        acc_g = tl.zeros([BN, DM], tl.float32)
        acc_u = tl.zeros([BN, DM], tl.float32)
        if k_lo < k_hi:   # parts past the last step keep zero sums
            acc_g, acc_u = l1_fp8_acc(mb, 0, nb, meta >> 9, x_q, x_s, w13, w13_s, H, I, XB,
                                      XB // 4, BM, BN, BK, DM, a_desc[0], w_desc, USE_TMA,
                                      True, k_lo // BK, k_hi // BK)
        if store_l1_part(acc_g, acc_u, tile, part, S, sums, counts, BN, DM):
            sum_g, sum_u = l1_part_totals(sums, tile, S, BN, DM)
            l1_fp8_epilogue(tl.trans(sum_g), tl.trans(sum_u), mb, nb, vm,
                            peer_ptr(table, rank, off_pool_weight, tl.float32),
                            peer_ptr(table, rank, off_pool_act, tl.float8e4nv),
                            peer_ptr(table, rank, off_pool_act + I, tl.float32), AB, AB // 4,
                            BM, BN, FIX_ROUNDING, 0, EVICT_LAST=True)
            tl.atomic_xchg(counts + tile, 0, sem="relaxed", scope="gpu")
            count_l1_done(l1_done, mb, SIGNAL)
    elif part == 0:
        l1_fp8_pool_block(mb, nb, meta, table, rank, l1_done, off_pool_x, off_pool_weight,
                          off_pool_act, w13, w13_s, H, I, XB, AB, BM, BN, BK, FIX_ROUNDING, DM,
                          a_desc, w_desc, USE_TMA, 0, False, SIGNAL)


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
def l1_either_block(mb, nb, meta, table, rank, l1_done, pool_x, pool_w, pool_act, w13, w13_s,
                    a_desc, w_desc, off_pool_x, off_pool_weight, off_pool_act, H, I, XB, AB,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    UPCAST: tl.constexpr, USE_TMA: tl.constexpr, FP8: tl.constexpr,
                    DM: tl.constexpr = 0, W4: tl.constexpr = 0, TAIL: tl.constexpr = False,
                    SIGNAL: tl.constexpr = True, ONE_DOT: tl.constexpr = False):
    """One L1 block of the staged kernel in either format (``l1_fp8_pool_block`` over byte
    rows, with MXFP4 weights when W4 > 0, or ``l1_block``); DM > 0: in decode pieces of DM
    rows (TAIL: only a block of at most DM rows). ONE_DOT: bf16 whole tiles (``l1_rows``)."""
    if FP8:
        l1_fp8_pool_block(mb, nb, meta, table, rank, l1_done, off_pool_x, off_pool_weight,
                          off_pool_act, w13, w13_s, H, I, XB, AB, BM, BN, BK, UPCAST, DM,
                          a_desc, w_desc, USE_TMA, W4, TAIL, SIGNAL)
    elif DM > 0:
        l1_decode_block(mb, nb, meta, l1_done, pool_x, pool_w, pool_act, w13, a_desc, w_desc,
                        H, I, BM, BN, BK, DM, UPCAST, USE_TMA, TAIL, SIGNAL)
    else:
        l1_block(mb, nb, meta, l1_done, pool_x, pool_w, pool_act, w13, a_desc, w_desc, H, I,
                 BM, BN, BK, UPCAST, USE_TMA, SIGNAL, ONE_DOT)


@triton.jit
def l1_kernel(
    table, rank0, w13_table,   # int64[R] buffers, int64[local ranks] w13 bases
    w13s_table,                # FP8: int64[local ranks] w13_scale_inv bases
    host_base,                 # HOST_BASE: this rank's buffer address (else unused)
    max_spins, timeout_ns,
    off_epoch, off_diag, off_block_start, off_block_meta, off_arrival, off_l1_done,
    off_pool_x, off_pool_weight, off_pool_act,
    off_claims,                # CLAIM: this GEMM's [next ticket, programs finished]
    H, I, E_LOC, P, XB, AB,    # FP8: bytes per pool_x / pool_act row
    PARTS,                     # arrivals per pool row (dispatch_kernel's row parts)
    ad0, ad1, wd,              # HOST_DESC: the descriptors built on the host (else None)
    split_sums, split_counts,  # SPLIT_K > 1: fp32 [local ranks, programs, 2, BN, DM] and
                               # int32 [local ranks, programs], counts zero between calls
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    UPCAST: tl.constexpr, USE_TMA: tl.constexpr, WAIT: tl.constexpr, USE_TIMER: tl.constexpr,
    FP8: tl.constexpr = False, DM: tl.constexpr = 0,
    W4: tl.constexpr = 0, TAIL: tl.constexpr = False, SIGNAL: tl.constexpr = True,
    GROUP_M: tl.constexpr = 1, ONE_DOT: tl.constexpr = False, HOST_DESC: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, CLAIM: tl.constexpr = False, HOST_BASE: tl.constexpr = False,
):
    """FP8: e4m3 byte rows (values, then fp32 scales per 128 channels; moestream.regions) and
    e4m3 weights with 128x128 block scales (kernels/gemm_fp8.py); BK is 128 then.
    W4 > 0 (with FP8): MXFP4 weights (kernels/gemm_fp4.py; pointer loads), a block's valid
    rows in pieces of W4 rows.
    DM > 0: decode pieces of DM rows with the weights as the MMA row operand
    (``l1_decode_block``; the fp8 form loads by descriptor too); with TAIL only in blocks of
    at most DM valid rows (tail pieces), fuller blocks as usual.
    WAIT: a block waits until its m-block's arrival count reaches valid_m * PARTS.
    SIGNAL: a finished block release-adds its m-block's ``l1_done`` (for an L2 that waits).
    GROUP_M: tickets walk GROUP_M m-blocks at a time (``grouped_tile``). With n fastest
    (1) and many column blocks (mixtral: I / BN = 112 against 132 SMs), the programs running
    at once cover about one m-block, so every m-block streams its expert's whole w13 from
    HBM again; grouped, the m-blocks of a group share each weight tile while it is cached.
    ONE_DOT (bf16 whole tiles by descriptor): gate and up as one MMA of 2 * BN columns per K
    step (``l1_rows``).
    HOST_DESC (with USE_TMA, one local rank): ``ad0`` (and for decode pieces ``ad1``) and
    ``wd`` are the descriptors this kernel would build (``launch.host_descriptors``), passed
    as kernel parameters: no descriptor is written and fenced in global memory first.
    SPLIT_K > 1 (bf16 or fp8 decode pieces, no tail pieces): when the call's tiles are at
    most a quarter of the programs, S >= 4 programs share each tile's K loop (``split_count``,
    ``l1_split_part``, ``l1_fp8_split_part``), one part per program.
    CLAIM: after its first two tickets (pid, pid + nprog) a program claims each next one
    from a counter (``next_tickets``) instead of taking every nprog-th: a program held up by
    a costly block (a hot expert's block of several decode pieces) then takes fewer of the
    rest. A launch of at most two tickets per program claims none (``claiming``).
    HOST_BASE (one local rank; ``staged.l1`` sets it in decode pieces only): ``host_base``
    is this rank's buffer address (``rank_base``), so the block count and the first meta
    load at once, not after a load of the table (the other regions' pointers still come
    from the table: see ``rank_base``)."""
    tl.static_assert(W4 == 0 or (FP8 and DM == 0 and not USE_TMA), "fp4w: fp8 rows, pointers")
    tl.static_assert(SPLIT_K == 1 or (DM > 0 and not TAIL and W4 == 0),
                     "split-K: bf16 or fp8 decode pieces")
    tl.static_assert(DM > 0 or not TAIL, "tail pieces of DM rows")
    tl.static_assert(USE_TMA or not HOST_DESC, "host descriptors are TMA descriptors")
    (pid, nprog, lr, rank, epoch, diag, here, w13, w13_s, block_start,
     block_meta) = gemm_context(table, rank0, off_epoch, off_diag, host_base, w13_table,
                                w13s_table, off_block_start, off_block_meta, FP8, W4,
                                HOST_BASE)
    arrival = at(here, off_arrival, tl.int32)
    l1_done = at(here, off_l1_done, tl.int32)
    pool_x = at(here, off_pool_x, tl.bfloat16)
    pool_w = at(here, off_pool_weight, tl.float32)
    pool_act = at(here, off_pool_act, tl.bfloat16)
    # the block count and the first block's meta before the descriptors: their loads are in
    # flight while each descriptor is written and fenced (a round trip each)
    NB = I // BN
    num_m = tl.load(block_start + E_LOC)
    total = num_m * NB
    ticket = pid
    ok = pid >= 0
    mb0 = l1_tile_of(ticket, num_m, NB, GROUP_M)[0]
    meta = tl.load(block_meta + mb0, mask=mb0 < P // BM, other=0)   # not waiting for num_m
    a_desc = 0
    w_desc = 0
    if DM > 0 and not USE_TMA:
        a_desc = (0, 0)      # the decode blocks index a pair
    if HOST_DESC:
        a_desc = (ad0, ad1) if DM > 0 else ad0
        w_desc = wd
    elif USE_TMA and DM > 0:   # decode pieces: (DM-row, WIDE-row or TAIL: BM-row) A descriptors
        a_desc, w_desc = pool_piece_descriptors(table, rank, off_pool_x, pool_x, P, H, XB, w13,
                                                E_LOC * 2 * I, BM, BN, BK, DM,
                                                BM if TAIL else 0, FP8)
    elif USE_TMA and not FP8:  # bulk tensor copies (TMA) of the A rows and the weight tiles
        a_desc, w_desc = l1_descriptors(pool_x, w13, P, H, I, E_LOC, BM, BN, BK, ONE_DOT)
    if SPLIT_K > 1:
        S = split_count(total, nprog, SPLIT_K)
        if S > 1:   # one part per program: total * S <= nprog
            tile, mb, nb, meta_s = split_tile(pid, S, total, num_m, NB, block_meta, GROUP_M)
            if tile < total:
                if WAIT:
                    ok = wait_at_least(arrival + mb, (meta_s & 511) * PARTS, diag, max_spins,
                                       timeout_ns, 2, rank, mb, epoch, -1, SCOPE="gpu",
                                       USE_TIMER=USE_TIMER)
                # this local rank's slots: [local ranks, programs, ...] (staged.l1)
                sums = split_sums + (lr * nprog).to(tl.int64) * (2 * BN * DM)
                # FP8 decides at compile time (``ok and FP8`` would compile the bf16 part into
                # fp8 kernels too, which fails for pointer loads)
                if FP8:
                    if ok:
                        l1_fp8_split_part(tile, pid % S, S, mb, nb, meta_s, table, rank,
                                          l1_done, off_pool_x, off_pool_weight, off_pool_act,
                                          w13, w13_s, a_desc, w_desc, sums,
                                          split_counts + lr * nprog, H, I, XB, AB, BM, BN, BK,
                                          DM, UPCAST, USE_TMA, SIGNAL)
                elif ok:
                    l1_split_part(tile, pid % S, S, mb, nb, meta_s, l1_done, pool_x, pool_w,
                                  pool_act, w13, a_desc, w_desc, sums, split_counts + lr * nprog,
                                  H, I, BM, BN, BK, DM, UPCAST, USE_TMA, SIGNAL)
            ticket = total   # the loop below has nothing left
    claims = claims_ptr(table, here, off_claims, CLAIM)
    on = claiming(total, nprog, CLAIM)
    nxt = first_next(pid, nprog, CLAIM)
    while (ticket < total) & ok:
        mb, nb = l1_tile_of(ticket, num_m, NB, GROUP_M)
        nxt, after = next_tickets(claims, ticket, nxt, nprog, on, CLAIM)
        meta_next = tl.load(block_meta + l1_tile_of(nxt, num_m, NB, GROUP_M)[0],
                            mask=nxt < total, other=0)   # lands meanwhile
        if WAIT:
            ok = wait_at_least(arrival + mb, (meta & 511) * PARTS, diag, max_spins,
                               timeout_ns, 2, rank, mb, epoch, -1, SCOPE="gpu",
                               USE_TIMER=USE_TIMER)
        if ok:
            l1_either_block(mb, nb, meta, table, rank, l1_done, pool_x,
                            pool_w, pool_act, w13, w13_s, a_desc, w_desc, off_pool_x,
                            off_pool_weight, off_pool_act, H, I, XB, AB, BM, BN, BK, UPCAST,
                            USE_TMA, FP8, DM, W4, TAIL, SIGNAL, ONE_DOT)
        meta = meta_next
        ticket, nxt = advance(ticket, nxt, after, nprog, CLAIM)
    finish_claims(claims, nprog, on, CLAIM)


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
    """Part ``part`` of S of a decode L2 block's K loop (split-K, ``Tuning.l2_split_k``), as
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
def store_slot_rows(tile, tk, src, rv, col0, table, off_combine_y, H, R,
                    FIX_ROUNDING: tl.constexpr, EVICT_LAST: tl.constexpr = False):
    """fp32 ``tile`` [BM, W] -> bf16 columns col0 .. col0+W-1 of the combine slots ``tk``
    (token * K + k) on ranks ``src``, rows where ``rv``. One masked store per source rank,
    from one 64-bit address per row (not per value). EVICT_LAST: at ``DECODE_STORE_EVICT``
    priority in the L2 cache."""
    POLICY: tl.constexpr = DECODE_STORE_EVICT if EVICT_LAST else ""
    out = to_bf16(tile, FIX_ROUNDING)
    cols = col0 + tl.arange(0, tile.shape[1])[None, :]
    # R constexpr (l2_kernel, fused_kernel): unrolled, so a flat (tile, k) loop around the
    # caller has no third loop level for Triton's loop flattening to give up on
    for s in tl.static_range(R):
        # one address per slot row, 16-byte aligned (peer_ptr's region start, H a multiple
        # of 128): the stores move 16 bytes per instruction; this form compiles shorter per
        # flat L2 trip than offsets from the region's start
        slot_rows = tl.multiple_of(peer_ptr(table, s, off_combine_y, tl.bfloat16) + tk * H, [16])
        tl.store(slot_rows[:, None] + cols, out, mask=(rv & (src == s))[:, None],
                 eviction_policy=POLICY)


@triton.jit
def slot_codes(pool_src, mb, vm, sub, BM: tl.constexpr, BMT: tl.constexpr):
    """(each row's pool_src code, which rows are valid) of row piece ``sub`` (BMT rows) of
    m-block ``mb`` (vm valid rows): where ``l2_epilogue`` stores the piece."""
    rows = mb.to(tl.int64) * BM + sub * BMT + tl.arange(0, BMT)
    rv = tl.arange(0, BMT) < vm - sub * BMT
    return tl.load(pool_src + rows, mask=rv, other=0), rv


@triton.jit
def l2_epilogue(acc, mb, nb, NB, vm, table, l2_done, pool_src, off_combine_y, off_combine_flag,
                H, T_MAX, R, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                FIX_ROUNDING: tl.constexpr,
                SIGNAL_ROWS: tl.constexpr = True, EPI_SPLIT: tl.constexpr = 1, sub=0,
                SPLIT_M: tl.constexpr = 1, PRE: tl.constexpr = False, pre_code=0,
                EVICT_LAST: tl.constexpr = False):
    """An L2 block's fp32 tile ``acc`` [BM / SPLIT_M, BN] (row piece ``sub`` of m_block,
    columns of n_block) into its tokens' combine slots as bf16; with SIGNAL_ROWS, the block
    that completes an m-block (of NB column blocks) releases its rows' combine flags (without:
    the caller signals; SPLIT_M > 1 needs that). vm: valid rows of the whole m-block.
    EPI_SPLIT 2 / 4: stored as two column halves / four quarters (fewer live registers).
    PRE: ``pre_code`` holds the rows' ``slot_codes``, loaded by the caller before its K loop
    (no dependent load between the last MMA and the first store). EVICT_LAST (decode pieces):
    the slots stored at ``DECODE_STORE_EVICT`` priority in the L2 cache."""
    tl.static_assert(SPLIT_M == 1 or not SIGNAL_ROWS, "row pieces need the caller to signal")
    BMT: tl.constexpr = BM // SPLIT_M
    code, rv = slot_codes(pool_src, mb, vm, sub, BM, BMT)
    if PRE:
        code = pre_code
    src = code // (T_MAX * K)
    tk = code % (T_MAX * K)                      # token * K + k on the source rank
    if EPI_SPLIT == 4:   # four column quarters (a, b) -> columns (2a + b) * BN / 4 ...
        W: tl.constexpr = BN // 4
        q = tl.permute(tl.reshape(acc, [BMT, 2, 2, W]), (0, 3, 1, 2))   # [BMT, W, a, b]
        b0, b1 = tl.split(q)
        q00, q10 = tl.split(b0)
        q01, q11 = tl.split(b1)
        c0 = nb * BN
        store_slot_rows(q00, tk, src, rv, c0, table, off_combine_y, H, R, FIX_ROUNDING,
                        EVICT_LAST)
        store_slot_rows(q01, tk, src, rv, c0 + W, table, off_combine_y, H, R, FIX_ROUNDING,
                        EVICT_LAST)
        store_slot_rows(q10, tk, src, rv, c0 + 2 * W, table, off_combine_y, H, R, FIX_ROUNDING,
                        EVICT_LAST)
        store_slot_rows(q11, tk, src, rv, c0 + 3 * W, table, off_combine_y, H, R, FIX_ROUNDING,
                        EVICT_LAST)
    elif EPI_SPLIT == 2:   # two column halves: half the registers for offsets and values
        lo, hi = tl.split(tl.permute(tl.reshape(acc, [BMT, 2, BN // 2]), (0, 2, 1)))
        store_slot_rows(lo, tk, src, rv, nb * BN, table, off_combine_y, H, R, FIX_ROUNDING,
                        EVICT_LAST)
        store_slot_rows(hi, tk, src, rv, nb * BN + BN // 2, table, off_combine_y, H, R,
                        FIX_ROUNDING, EVICT_LAST)
    else:
        store_slot_rows(acc, tk, src, rv, nb * BN, table, off_combine_y, H, R, FIX_ROUNDING,
                        EVICT_LAST)
    if SIGNAL_ROWS:
        release_rows(mb, NB, src, tk, rv, table, l2_done, off_combine_flag)


@triton.jit
def release_rows(mb, NB, src, tk, rv, table, l2_done, off_combine_flag):
    """Counts one finished column block of m-block ``mb`` in ``l2_done``; the block that
    completes it (NB column blocks) releases the combine flags of its rows (``rv``: valid;
    ``src`` / ``tk``: each row's source rank and token * K + k there)."""
    tl.debug_barrier()  # every thread's rows are stored before the count is released
    # gpu scope suffices: the blocks synchronise on this GPU, the last one releases to the
    # peers at system scope, and release is cumulative
    done = tl.atomic_add(l2_done + mb, 1, sem="acq_rel", scope="gpu")
    if done == NB - 1:
        # last column block of this m-block: every block's rows are visible (acquired
        # above), so one release per row tells the token's rank that its row is complete
        flags = peer_ptrs(table, src, off_combine_flag + tk.to(tl.int64) * 4, rv, tl.int32)
        tl.atomic_xchg(flags, 1, mask=rv, sem="release", scope="sys")


@triton.jit
def signal_block_rows(mb, NB, vm, table, l2_done, pool_src, off_combine_flag, T_MAX,
                      K: tl.constexpr, BM: tl.constexpr):
    """``release_rows`` for a whole m-block of ``vm`` valid rows, after an L2 block that
    stored them in pieces (decode pieces in the fused launch, which signals per row)."""
    rows = mb.to(tl.int64) * BM + tl.arange(0, BM)
    rv = tl.arange(0, BM) < vm
    code = tl.load(pool_src + rows, mask=rv, other=0)
    release_rows(mb, NB, code // (T_MAX * K), code % (T_MAX * K), rv, table, l2_done,
                 off_combine_flag)


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
    off_epoch, off_diag, off_block_start, off_block_meta, off_l1_done, off_l2_done,
    off_pool_act, off_pool_src, off_combine_y, off_combine_flag, off_l2_programs,
    off_l2_ranks_done,
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
     block_meta) = gemm_context(table, rank0, off_epoch, off_diag, host_base, w2_table,
                                w2s_table, off_block_start, off_block_meta, FP8, W4,
                                HOST_BASE)
    l1_done = at(here, off_l1_done, tl.int32)
    l2_done = at(here, off_l2_done, tl.int32)
    pool_act = at(here, off_pool_act, tl.bfloat16)
    pool_src = at(here, off_pool_src, tl.int32)
    peers = tl.arange(0, R_PAD)
    if not STREAM:   # every rank's l2_ranks_done, for the last release
        ranks_done = peer_ptrs(table, peers, off_l2_ranks_done, peers < R, tl.int32)
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
        a_desc, w_desc = pool_piece_descriptors(table, rank, off_pool_act, pool_act, P, I, AB, w2,
                                                E_LOC * H, BM, BN, BK, DM,
                                                BMT if TAIL else 0, FP8)
    elif USE_TMA:
        if FP8:
            a_desc, w_desc = fp8_descriptors(
                peer_ptr(table, rank, off_pool_act, tl.float8e4nv), P, I, AB, w2,
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
                                  split_counts + lr * nprog, off_combine_y, off_combine_flag,
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
                            pool_act, pool_src, w2, w2_s, a_desc, w_desc, off_pool_act,
                            off_combine_y, off_combine_flag, H, I, AB, T_MAX, R, K, BM, BN, BK,
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
                            w2_s, a_desc, w_desc, off_pool_act, off_combine_y, off_combine_flag,
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
            done = tl.atomic_add(at(here, off_l2_programs, tl.int32), 1,
                                 sem="acq_rel", scope="gpu")
            if done == nprog - 1:
                tl.atomic_add(ranks_done, 1, mask=peers < R, sem="release", scope=PEER_SCOPE)
