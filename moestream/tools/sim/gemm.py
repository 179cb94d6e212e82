"""GEMM tasks on a rank's compute SMs, in ticket order, vectorised over ranks.

The model (a persistent GEMM kernel): S compute SMs take tickets from one counter
in ticket order. The SM that became free first claims the next ticket, waits (idle) until the
ticket's inputs are ready, runs it for its duration, and claims again. So ticket i starts at
``max(claim_i, ready_i)``, where ``claim_i`` is the smallest free time among the SMs when it is
claimed. This in-order greedy list schedule never skips a ticket, which also makes it monotone:
earlier inputs or shorter tasks never delay any task (no Graham anomaly).

The n-blocks of one (block, phase) are identical tickets (same ready time and duration), so we
hand them out as a *batch*. The batch's start times are the n smallest of the slots
``{g_j + i*d}`` with ``g_j = max(free_j, ready)``: while the batch lasts, SM j can start at g_j,
g_j + d, ... Each *round* hands one ticket to every SM whose g is below ``min(g) + d`` (their
slots come before any later slot), or, in the last round, to the first ones in claim order
(g, then free time, then SM index). Rounds are vectorised over all ranks whose ticket list
is not yet exhausted; ranks are kept sorted by ticket count so those are a prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .plan import L1, Plan

__all__ = ["GemmTimes", "schedule_gemm"]


@dataclass
class GemmTimes:
    """Per block: ``l1_end`` / ``l2_end`` (last n-block done) and per rank ``first_start`` /
    ``last_end`` (inf / -inf for a rank without blocks). ``intervals``: (start, end) arrays of
    every task of the recorded ranks, when asked for."""

    l1_end: np.ndarray
    l2_end: np.ndarray
    first_start: np.ndarray
    last_end: np.ndarray
    intervals: tuple[np.ndarray, np.ndarray] | None = field(default=None)


def _assign(free: np.ndarray, ready: np.ndarray, n: np.ndarray, d: np.ndarray,
            starts: list[np.ndarray] | None, durs: list[np.ndarray] | None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Hand out one batch per row (n identical tasks of duration d, ready at ``ready``) to the
    SMs whose free times are the row of ``free`` (updated in place).

    Returns the first start and the last end of each row's batch.
    """
    A, S = free.shape
    remaining = n.astype(np.int64).copy()
    first = np.full(A, np.inf)
    last = np.full(A, -np.inf)
    rows = np.flatnonzero(remaining > 0)
    sm_index = np.arange(S)
    while rows.size:
        f = free[rows]
        g = np.maximum(f, ready[rows, None])
        dd = d[rows, None]
        m0 = g.min(axis=1, keepdims=True)
        # zero-length tasks all start at the earliest slot; otherwise a slot below m0 + d
        # comes before every SM's second slot
        window = np.where(dd > 0, g < m0 + dd, g <= m0)
        cnt = window.sum(axis=1)
        rem = remaining[rows]
        take = window
        part = np.flatnonzero(cnt > rem)
        if part.size:
            order = np.lexsort((np.broadcast_to(sm_index, (part.size, S)), f[part], g[part]),
                               axis=-1)
            pos = np.empty_like(order)
            np.put_along_axis(pos, order, np.broadcast_to(sm_index, (part.size, S)), axis=1)
            take = window.copy()
            take[part] = pos < rem[part, None]
        end = g + dd
        free[rows] = np.where(take, end, f)
        first[rows] = np.minimum(first[rows], np.where(take, g, np.inf).min(axis=1))
        last[rows] = np.maximum(last[rows], np.where(take, end, -np.inf).max(axis=1))
        if starts is not None:
            r_i, s_i = np.nonzero(take)
            starts.append(g[r_i, s_i])
            durs.append(np.broadcast_to(dd, g.shape)[r_i, s_i])
        remaining[rows] = rem - take.sum(axis=1)
        rows = rows[remaining[rows] > 0]
    return first, last


def schedule_gemm(plan: Plan, l1_ready: np.ndarray, *, ranks: np.ndarray | None = None,
                  record: bool = False) -> GemmTimes:
    """Start and end times of every GEMM task given each block's L1 ready time.

    Args:
        plan: the call's plan (ticket order, durations, compute SMs).
        l1_ready: [B] time each block's rows are all in the pool.
        ranks: simulate only these ranks (default all); other blocks keep NaN times.
        record: also return every task's (start, end) on the simulated ranks.
    """
    R = plan.num_ranks
    ranks = np.arange(R) if ranks is None else np.asarray(ranks, dtype=np.int64)
    B = plan.num_blocks
    l1_end = np.full(B, np.nan)
    l2_end = np.full(B, np.nan)
    first_start = np.full(R, np.inf)
    last_end = np.full(R, -np.inf)
    order = ranks[np.argsort(-plan.seq_len[ranks], kind="stable")]
    lens = plan.seq_len[order]
    seq_b = plan.seq_block[order]
    seq_p = plan.seq_phase[order]
    S = plan.compute_sms
    free = np.zeros((order.size, S))
    fs = np.full(order.size, np.inf)
    le = np.full(order.size, -np.inf)
    starts: list[np.ndarray] | None = [] if record else None
    durs: list[np.ndarray] | None = [] if record else None
    n_by_phase = np.array([0, plan.n_l1, plan.n_l2])
    active = order.size
    for step in range(int(lens.max()) if order.size else 0):
        while active and lens[active - 1] <= step:
            active -= 1
        blocks = seq_b[:active, step]
        is_l1 = seq_p[:active, step] == L1
        ready = np.where(is_l1, l1_ready[blocks], l1_end[blocks])
        n = n_by_phase[seq_p[:active, step]]
        d = np.where(is_l1, plan.d_l1[blocks], plan.d_l2[blocks])
        f_sub = free[:active]
        first, last = _assign(f_sub, ready, n, d, starts, durs)
        l1_end[blocks[is_l1]] = last[is_l1]
        l2_end[blocks[~is_l1]] = last[~is_l1]
        np.minimum(fs[:active], first, out=fs[:active])
        np.maximum(le[:active], last, out=le[:active])
    first_start[order] = fs
    last_end[order] = le
    intervals = None
    if record:
        st = np.concatenate(starts) if starts else np.zeros(0)
        du = np.concatenate(durs) if durs else np.zeros(0)
        intervals = (st, st + du)
    return GemmTimes(l1_end, l2_end, first_start, last_end, intervals)
