"""How the GEMM programs find their work: the ticket order (n fastest, or groups of m-blocks),
tickets claimed from a counter past each program's first two, and the split-K bookkeeping
(how many parts, which part a program runs, the per-tile count the last part reads)."""
from __future__ import annotations

from .common import at, tl, triton


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
