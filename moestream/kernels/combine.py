"""Combine: each token of this rank sums its K expert outputs (already weighted in L1).

Legend:
    combine_y [T_MAX, K, H] bf16   row (t, k) written by the owner of expert topk_idx[t, k]
    combine_flag [T_MAX, K] int32  set to 1 by the L2 block that completes (t, k)'s row
    y [T, H] bf16                  output (rank lr of the launch at y + lr * y_rank_stride)

One ticket per token; the hidden dimension is walked in BH-wide chunks so a program never
holds more than K x BH values. Picks with id -1 (or outside [0, E)) are skipped.
"""
from __future__ import annotations

from ._common import launch_context, peer_ptr, tl, to_bf16, triton, wait_all_at_least


@triton.jit
def combine_token(table, rank, t, par64, y_row, diag, max_spins, timeout_ns, epoch, T_MAX, H, E,
                  off_topk_idx, off_combine_y, off_combine_flag,
                  K: tl.constexpr, K_PAD: tl.constexpr, BH: tl.constexpr,
                  FIX_ROUNDING: tl.constexpr, USE_TIMER: tl.constexpr):
    """One combine task: wait for token ``t``'s valid picks, then y_row[:] = sum of its slots.
    Returns False if the wait gave up."""
    k = tl.arange(0, K_PAD)
    km = k < K
    tk = t.to(tl.int64) * K + k
    idx = tl.load(peer_ptr(table, rank, off_topk_idx, tl.int32) + par64 * T_MAX * K + tk,
                  mask=km, other=-1)
    valid = km & (idx >= 0) & (idx < E)
    flags = peer_ptr(table, rank, off_combine_flag, tl.int32)
    ok = wait_all_at_least(flags + tk, 1, valid, diag, max_spins, timeout_ns, 4, rank, t * K,
                           epoch, SCOPE="sys", USE_TIMER=USE_TIMER)
    if ok:
        slots = peer_ptr(table, rank, off_combine_y, tl.bfloat16)
        for h0 in range(0, H, BH):
            h = h0 + tl.arange(0, BH)
            hm = h < H
            v = tl.load(slots + tk[:, None] * H + h[None, :], mask=valid[:, None] & hm[None, :],
                        other=0.0)
            tl.store(y_row + h, to_bf16(tl.sum(v.to(tl.float32), axis=0), FIX_ROUNDING), mask=hm)
    return ok


@triton.jit
def combine_kernel(
    table, rank0, max_spins, timeout_ns,
    y_ptr,                 # bf16 [local ranks, T, H] (y_rank_stride, y_stride elements)
    y_rank_stride, y_stride,
    off_epoch, off_diag, off_num_tokens, off_topk_idx, off_combine_y, off_combine_flag,
    T_MAX, H, E,
    K: tl.constexpr, K_PAD: tl.constexpr, BH: tl.constexpr, FIX_ROUNDING: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    pid, nprog, lr, rank, epoch, diag = launch_context(table, rank0, off_epoch, off_diag)
    par64 = (epoch & 1).to(tl.int64)
    T = tl.load(peer_ptr(table, rank, off_num_tokens, tl.int32) + par64)
    y = y_ptr + lr.to(tl.int64) * y_rank_stride
    t = pid
    ok = pid >= 0
    while (t < T) & ok:
        ok = combine_token(table, rank, t, par64, y + t.to(tl.int64) * y_stride, diag, max_spins,
                           timeout_ns, epoch, T_MAX, H, E, off_topk_idx, off_combine_y,
                           off_combine_flag, K, K_PAD, BH, FIX_ROUNDING, USE_TIMER)
        t += nprog
