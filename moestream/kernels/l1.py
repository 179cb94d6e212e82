"""The L1 GEMM over the pool: each block's gate and up columns, SwiGLU times the pick's gate
weight into pool_act.

Legend:
    pool_x [P, H] bf16    tokens, each local expert's segment padded to BM rows
    w13 [E_LOC, 2I, H]    gate rows 0..I-1, up rows I..2I-1 (one tensor per local rank,
                          reached through w13_table)
    pool_act [P, I] bf16  silu(x @ gate^T) * (x @ up^T) * topk weight
    FP8 (constexpr)       pool_x / pool_act are byte rows of e4m3 values + fp32 scales (XB /
                          AB bytes), weights e4m3 with fp32 scale_inv per 128x128 block (second
                          weight table); the block math is kernels/gemm_fp8.py's

Decode pieces (DM constexpr, ``Tuning.decode_rows``): a block is computed as weights @ rows^T,
one DM-row piece when it has at most DM valid rows, else pieces of DECODE_WIDE = min(32, BM)
rows (written out where marked ``# DECODE_WIDE``: Triton 3.6 has no constexpr helpers).
Tail pieces (TAIL constexpr with DM, ``L1.tail_rows``): only a block of at most DM valid rows
(an expert's last, partly filled m-block) runs as one such piece; fuller blocks run the usual
BM-row tile.

Block (m_block, n_block): m_block numbers the pool's BM-row blocks (global over the rank's
experts, as moestream.schedule), n fastest. An L1 block waits until its pool block's arrival
count reaches valid_m. Persistent: grid (programs, local ranks), tickets pid, pid + programs,
... A block finds its expert and valid rows in one load of block_meta (expert * 512 +
valid_m, written by the layout step), and the next block's entry is loaded while this block
computes, so no dependent global loads stand between two blocks' GEMMs.
"""
from __future__ import annotations

from .common import at, peer_ptr, tl, triton, wait_at_least, zero_acc
from .epilogue import l1_part_totals, l1_store, row_weights, store_l1_part
from .gemm_fp4 import l1_fp4w_rows
from .gemm_fp8 import l1_fp8_acc, l1_fp8_block, l1_fp8_decode_block, l1_fp8_epilogue
from .operands import gemm_context, l1_descriptors, pool_piece_descriptors, weight_tile
from .tickets import (advance, claiming, claims_ptr, finish_claims, first_next, l1_tile_of,
                      next_tickets, split_count, split_range, split_tile)


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
def l1_split_part(tile, part, S, mb, nb, meta, l1_done, pool_x, pool_w, pool_act, w13, a_desc,
                  w_desc, sums, counts, H, I, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, DM: tl.constexpr, UPCAST: tl.constexpr,
                  USE_TMA: tl.constexpr, SIGNAL: tl.constexpr):
    """Part ``part`` of S of a decode L1 block's K loop (split-K, ``L1.split_k``):
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
    offs,                      # Offsets: every region's byte offset (launch.Offsets)
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
     block_meta) = gemm_context(table, rank0, offs.epoch, offs.diag, host_base, w13_table,
                                w13s_table, offs.block_start, offs.block_meta, FP8, W4,
                                HOST_BASE)
    arrival = at(here, offs.arrival, tl.int32)
    l1_done = at(here, offs.l1_done, tl.int32)
    pool_x = at(here, offs.pool_x, tl.bfloat16)
    pool_w = at(here, offs.pool_weight, tl.float32)
    pool_act = at(here, offs.pool_act, tl.bfloat16)
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
        a_desc, w_desc = pool_piece_descriptors(table, rank, offs.pool_x, pool_x, P, H, XB, w13,
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
                                          l1_done, offs.pool_x, offs.pool_weight, offs.pool_act,
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
                            pool_w, pool_act, w13, w13_s, a_desc, w_desc, offs.pool_x,
                            offs.pool_weight, offs.pool_act, H, I, XB, AB, BM, BN, BK, UPCAST,
                            USE_TMA, FP8, DM, W4, TAIL, SIGNAL, ONE_DOT)
        meta = meta_next
        ticket, nxt = advance(ticket, nxt, after, nprog, CLAIM)
    finish_claims(claims, nprog, on, CLAIM)
