"""Combine: each token of this rank sums its K expert outputs (already weighted in L1).

Legend:
    combine_y [T_MAX, K, H] bf16   row (t, k) written by the owner of expert topk_idx[t, k]
    combine_flag [T_MAX, K] int32  set to 1 by the L2 block that completes (t, k)'s row
    y [T, H] bf16                  output (rank lr of the launch at y + lr * y_rank_stride)

One ticket per token (the fused launch: per CT tokens and column part); the hidden dimension
is walked in BH-wide chunks so a program never holds more than CT x BH values. Picks with id
-1 (or outside [0, E)) are skipped.
"""
from __future__ import annotations

from .common import (at, launch_context, rank_base, tl, to_bf16, triton,
                     wait_all_at_least, wait_at_least)


@triton.jit
def combine_tokens(here, rank, t0, n, par64, y_ptr, y_stride, diag, max_spins, timeout_ns,
                   epoch, T_MAX, H, E, off_topk_idx, off_combine_y, off_combine_flag,
                   K: tl.constexpr, K_PAD: tl.constexpr, BH: tl.constexpr, TT: tl.constexpr,
                   FIX_ROUNDING: tl.constexpr, USE_TIMER: tl.constexpr,
                   WAIT_FLAGS: tl.constexpr = True, h_lo=0, h_hi=-1):
    """One combine task: tokens [t0, t0 + n), TT at a time: wait for their valid picks'
    flags (WAIT_FLAGS; without, the caller has already waited for every rank's L2), then
    y[t, h] = fp32 sum over k of combine_y[t, k, h] (y row t at y_ptr + t * y_stride) for
    columns h in [h_lo, h_hi) (default: all H). ``here``: rank ``rank``'s buffer address
    (``rank_base``). Returns False if a wait gave up."""
    if h_hi < 0:
        h_hi = H
    k = tl.arange(0, K_PAD)
    km = k < K
    flags = at(here, off_combine_flag, tl.int32)
    slots = at(here, off_combine_y, tl.bfloat16)
    ok = t0 >= 0
    i = 0
    while (i < n) & ok:
        t = t0 + i + tl.arange(0, TT)
        tm = t < t0 + n
        tk = t.to(tl.int64)[:, None] * K + k[None, :]                               # [TT, K_PAD]
        pick = tm[:, None] & km[None, :]
        idx = tl.load(at(here, off_topk_idx, tl.int32) + par64 * T_MAX * K + tk,
                      mask=pick, other=-1)
        valid = pick & (idx >= 0) & (idx < E)
        if WAIT_FLAGS:
            ok = wait_all_at_least(tl.reshape(flags + tk, [TT * K_PAD]), 1,
                                   tl.reshape(valid, [TT * K_PAD]), diag, max_spins,
                                   timeout_ns, 4, rank, t0 * K, epoch, SCOPE="sys",
                                   USE_TIMER=USE_TIMER)
        if ok:
            for h0 in range(h_lo, h_hi, BH):
                h = h0 + tl.arange(0, BH)
                hm = h < h_hi
                acc = tl.zeros([TT, BH], tl.float32)
                for kk in tl.static_range(K):
                    v_k = tl.sum(tl.where(k[None, :] == kk, valid.to(tl.int32), 0), axis=1) > 0
                    row = t.to(tl.int64) * K + kk
                    acc += tl.load(slots + row[:, None] * H + h[None, :],
                                   mask=v_k[:, None] & hm[None, :], other=0.0).to(tl.float32)
                tl.store(y_ptr + t.to(tl.int64)[:, None] * y_stride + h[None, :],
                         to_bf16(acc, FIX_ROUNDING), mask=tm[:, None] & hm[None, :])
        i += TT
    return ok


@triton.jit
def combine_kernel(
    table, rank0, max_spins, timeout_ns,
    host_base,             # HOST_BASE: this rank's buffer address (else unused)
    y_ptr,                 # bf16 [local ranks, T, H] (y_rank_stride, y_stride elements)
    y_rank_stride, y_stride,
    offs,             # Offsets: every region's byte offset (launch.Offsets)
    T_MAX, H, E, R,
    K: tl.constexpr, K_PAD: tl.constexpr, BH: tl.constexpr, FIX_ROUNDING: tl.constexpr,
    USE_TIMER: tl.constexpr, HOST_BASE: tl.constexpr = False, STREAM: tl.constexpr = False,
):
    """Waits once for every rank's L2 (``l2_ranks_done`` reaching R, released by the last
    program of each rank's L2), then sums each token's picks.
    STREAM: no wait at all: every rank's L2 ran before this launch in stream order on this
    GPU (``launch.stream_ordered``; the L2 then signals nothing).
    HOST_BASE (one local rank): the rank's buffer address is ``host_base`` (``rank_base``),
    not a load of the table ahead of the epoch, and again after the wait (sm_90 SASS:
    table, epoch, token count, wait, table, picks, slots in a row); both parities' token
    counts load with the epoch."""
    pid, nprog, lr, rank, epoch, diag = launch_context(table, rank0, offs.epoch, offs.diag,
                                                       host_base, HOST_BASE)
    here = rank_base(table, rank, host_base, HOST_BASE)
    counts = tl.load(at(here, offs.num_tokens, tl.int32) + tl.arange(0, 2))   # both parities
    par64 = (epoch & 1).to(tl.int64)
    T = tl.sum(tl.where(tl.arange(0, 2) == par64, counts, 0), axis=0)
    y = y_ptr + lr.to(tl.int64) * y_rank_stride
    t = pid
    ok = pid >= 0
    if not STREAM:
        if T > pid:
            ok = wait_at_least(at(here, offs.l2_ranks_done, tl.int32), R, diag,
                               max_spins, timeout_ns, 5, rank, 0, epoch, -1, SCOPE="sys",
                               USE_TIMER=USE_TIMER)
    while (t < T) & ok:
        ok = combine_tokens(here, rank, t, 1, par64, y, y_stride, diag, max_spins, timeout_ns,
                            epoch, T_MAX, H, E, offs.topk_idx, offs.combine_y, offs.combine_flag,
                            K, K_PAD, BH, 1, FIX_ROUNDING, USE_TIMER, False)
        t += nprog
