"""What the GEMMs do with their accumulators: the L1's SwiGLU times the pick weight into
pool_act (whole tiles and split-K parts), the L2's rows stored into their combine slots on
the token's rank and the completion counts and flags that release them."""
from __future__ import annotations

from .common import DECODE_STORE_EVICT, peer_ptr, peer_ptrs, tl, to_bf16, triton
from .tickets import count_split_part, split_total


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
