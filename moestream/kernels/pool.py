"""The pool layout of a call: after every peer's ready flag, the rows each local expert
receives from each source, its m-blocks (expert and valid rows each) and the expert waves."""
from __future__ import annotations

from .common import at, rank_base, tl, triton, wait_at_least


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
    offs,             # Offsets: every region's byte offset (launch.Offsets)
    R, E_LOC, BM, NB1, WAVE_BLOCKS,
    R_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_J: tl.constexpr,
    USE_TIMER: tl.constexpr, WAVES: tl.constexpr = True,
    HOST_BASE: tl.constexpr = False, STREAM: tl.constexpr = False,
):
    """Wait for every peer's inputs of this call (STREAM: not at all, every rank's publish
    ran before this launch in stream order on this GPU, ``launch.stream_ordered``), then
    store this rank's pool layout and, for every m-block, its expert and valid rows (so a
    GEMM block needs one load to find them).
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
    epoch = tl.load(at(here, offs.epoch, tl.int32))
    diag = at(here, offs.diag, tl.int32)
    ok = rank >= 0  # a tensor, so the loop may reassign it
    s = R if STREAM else 0
    while (s < R) & ok:
        ready = at(tl.sum(tl.where(sv == s, bases, 0), axis=0), offs.ready, tl.int32)
        ok = wait_at_least(ready, epoch, diag, max_spins, timeout_ns, 1, rank, s, epoch, s,
                           SCOPE="sys", USE_TIMER=USE_TIMER)
        s += 1
    if ok:
        expert_count, block_start, total, src_row_ES, src_tokens = layout_device(
            bases, rank, epoch, offs.send_counts, offs.num_tokens, R, E_LOC, BM, R_PAD, E_PAD)
        e = tl.arange(0, E_PAD)
        em = e < E_LOC
        tl.store(at(here, offs.expert_count, tl.int32) + e, expert_count, mask=em)
        tl.store(at(here, offs.block_start, tl.int32) + e, block_start, mask=em)
        tl.store(at(here, offs.block_start, tl.int32) + E_LOC, total)
        tl.store(at(here, offs.src_row, tl.int32) + e[:, None] * R + sv[None, :],
                 src_row_ES, mask=em[:, None] & (sv[None, :] < R))
        tl.store(at(here, offs.src_tokens, tl.int32) + sv, src_tokens, mask=sv < R)
        m_blocks = (expert_count + BM - 1) // BM                                  # [E_PAD]
        # block_meta[block_start[e] + j] = e * 512 + valid rows of m-block j of expert e
        block_meta = at(here, offs.block_meta, tl.int32)
        most = tl.max(m_blocks, axis=0)
        for j0 in range(0, most, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            vm = tl.minimum(expert_count[:, None] - j[None, :] * BM, BM)           # [E_PAD, BJ]
            tl.store(block_meta + block_start[:, None] + j[None, :], e[:, None] * 512 + vm,
                     mask=em[:, None] & (j[None, :] < m_blocks[:, None]))
        if WAVES:
            # wave w: experts [first, last]; last is the first expert whose L1 blocks since
            # `first` reach WAVE_BLOCKS (or the last expert); wave_mb[w + 1] its end m-block
            wave_mb = at(here, offs.wave_mb, tl.int32)
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
            tl.store(at(here, offs.num_waves, tl.int32), waves)
