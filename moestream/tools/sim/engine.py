"""The vectorised engine: event times of a :class:`~moestream.tools.sim.plan.Plan` without a heap.

Every resource is a server that takes its work in a fixed order (a port's queue, the SMs'
ticket counter, the reduce loop), so its event times follow Lindley's recursion
``start_i = max(start_{i-1} + occupancy_{i-1}, ready_i)``, evaluated in closed form: with
``P_i`` the occupancy queued before item i, ``start_i = P_i + max_{j<=i}(ready_j - P_j)``.
The GEMM SMs are in ``gemm.py``. ``events.py`` computes the same times with an explicit event
queue, one event at a time; the tests check that the two agree.

Ports. Every rank has, per link class, an incoming and an outgoing port (one per direction).

- Dispatch s -> d: rank d pulls its picks in pool order, all known after the count exchange
  (``setup``), so d's incoming port is busy without a gap over ``[setup, setup + Din_d]``
  (occupancy: start-up, wire, request window). The same bytes leave s's outgoing port, which
  is busy for their wire time ``Dout_s`` from ``setup`` on.
- Combine d -> s: once every row of a message has its L2 output, d writes it back, in d's L2
  ticket order, on d's outgoing port after d's own dispatch traffic (dispatch has priority: it
  feeds the GEMMs). The bytes then enter s's incoming port, which is free only after s's
  dispatch: the message lands at ``max(out_start + startup, setup + Din_s) + wire + latency``.
  Several senders' combine streams into one rank are not queued against each other (they are
  balanced in the routings we generate); everything else a port carries is.

So both directions of every port carry their full load: a rank's incoming port sees all it
receives (dispatch, then combine), its outgoing port all it sends.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gemm import GemmTimes, schedule_gemm
from .links import LOCAL
from .plan import Plan, stable_argsort

__all__ = ["Timeline", "run_plan", "lindley", "lindley_rows", "union_length", "block_ready",
           "dispatch_order", "combine_order"]


def lindley(ready: np.ndarray, occupy: np.ndarray) -> np.ndarray:
    """Start times of a single server taking items in the given order."""
    if ready.size == 0:
        return ready.astype(np.float64)
    P = np.cumsum(occupy) - occupy
    return P + np.maximum.accumulate(ready - P)


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Measure of the union of the intervals [start_i, end_i)."""
    if start.size == 0:
        return 0.0
    o = np.argsort(start, kind="stable")
    s, e = start[o], end[o]
    prev = np.maximum.accumulate(np.r_[-np.inf, e[:-1]])
    return float(np.maximum(0.0, e - np.maximum(s, prev)).sum())


@dataclass
class Timeline:
    """Event times of one call (µs).

    Messages [M]: ``disp_start`` / ``disp_arrival``; ``comb_start`` (leaves the owner's port),
    ``comb_arrival`` (landed at the source; NaN for LOCAL messages, which are not sent).
    Ports [R, 3] (by class): ``din`` / ``dout``, the dispatch busy time of the incoming /
    outgoing port from ``setup``. Blocks [B]: ``l1_ready``, ``l1_end``, ``l2_end``. Ranks [R]:
    ``gemm_first`` / ``gemm_last``, ``rank_end``. Tokens [R, T]: ``token_ready`` (all its rows
    back), ``reduce_end``. ``recv_dispatch`` / ``sent_combine`` [R]: bytes counted where the
    ports delivered them (for the conservation checks).
    """

    disp_start: np.ndarray
    disp_arrival: np.ndarray
    din: np.ndarray
    dout: np.ndarray
    l1_ready: np.ndarray
    l1_end: np.ndarray
    l2_end: np.ndarray
    comb_ready: np.ndarray
    comb_start: np.ndarray
    comb_arrival: np.ndarray
    gemm_first: np.ndarray
    gemm_last: np.ndarray
    token_ready: np.ndarray
    reduce_end: np.ndarray
    rank_end: np.ndarray
    recv_dispatch: np.ndarray
    sent_combine: np.ndarray


def _segments(plan: Plan, rank: np.ndarray, order: np.ndarray, sel: np.ndarray
              ) -> list[np.ndarray]:
    """The messages ``sel`` selects, grouped by (``rank``, class), each group in the order
    they have in ``order`` (message ids, queue order)."""
    o = order[sel[order]]
    if o.size == 0:
        return []
    seg = rank[o].astype(np.int64) * 4 + plan.msg_cls[o]
    by = stable_argsort(seg, 4 * plan.num_ranks - 1)
    o, seg = o[by], seg[by]
    return np.split(o, np.flatnonzero(seg[1:] != seg[:-1]) + 1)


def block_ready(plan: Plan, pick_arrival: np.ndarray) -> np.ndarray:
    """[B] time each block may start L1: the last arrival in its wait group."""
    if plan.num_blocks == 0:
        return np.zeros(0)
    wait = np.maximum.reduceat(pick_arrival[plan.pool_perm], plan.wait_pool_start)
    return wait[plan.blk_wait]


def dispatch_order(plan: Plan) -> np.ndarray:
    """Message ids in the order every incoming port pulls them."""
    if plan.dispatch_order == "pool":
        return plan.msg_pool_order
    return np.arange(plan.num_messages)   # stream order: source by source


def combine_order(plan: Plan) -> np.ndarray:
    """Message ids in the order every outgoing port writes them back: the L2 ticket position of
    the message's last block, then pool order."""
    if plan.num_messages == 0:
        return np.zeros(0, dtype=np.int64)
    l2pos = np.maximum.reduceat(plan.l2_pos[plan.pick_block][plan.stream_perm],
                                plan.msg_stream_start)
    base = plan.msg_pool_order
    return base[stable_argsort(l2pos[base], int(plan.seq_block.shape[1]))]


def run_plan(plan: Plan) -> tuple[Timeline, GemmTimes]:
    """Event times of every message, block and token of ``plan``."""
    R, T, K = plan.num_ranks, plan.tokens_per_rank, plan.config.top_k
    M = plan.num_messages
    remote = plan.msg_cls != LOCAL
    setup = plan.setup_us

    # ---- dispatch: every pull is known at setup, so each port runs back to back ------------
    disp_start = np.full(M, np.nan)
    disp_arrival = np.full(M, np.nan)
    din = np.zeros((R, 3))
    recv_dispatch = np.zeros(R)
    for o in _segments(plan, plan.msg_dst, dispatch_order(plan), np.ones(M, dtype=bool)):
        occ = plan.msg_occupy[o]
        st = setup + (np.cumsum(occ) - occ)
        disp_start[o] = st
        disp_arrival[o] = st + plan.msg_service[o] + plan.msg_latency[o]
        d, c = plan.msg_dst[o[0]], plan.msg_cls[o[0]]
        din[d, c] = occ.sum()
        if c != LOCAL:
            recv_dispatch[d] += plan.msg_bytes[o].sum()
    dout = np.bincount(plan.msg_src[remote] * 3 + plan.msg_cls[remote],
                       weights=plan.msg_wire[remote], minlength=3 * R).reshape(R, 3)

    # ---- GEMM --------------------------------------------------------------------------------
    l1_ready = block_ready(plan, disp_arrival[plan.pick_msg])
    gt = schedule_gemm(plan, l1_ready)

    # ---- combine: a message leaves once every row in it has its L2 output ------------------
    comb_ready = np.full(M, np.nan)
    comb_start = np.full(M, np.nan)
    comb_arrival = np.full(M, np.nan)
    sent_combine = np.zeros(R)
    out_done = np.zeros(R)
    if M:
        comb_ready = np.maximum.reduceat(gt.l2_end[plan.pick_block][plan.stream_perm],
                                         plan.msg_stream_start)
        for o in _segments(plan, plan.msg_dst, combine_order(plan), remote):
            d, c = plan.msg_dst[o[0]], plan.msg_cls[o[0]]
            # the owner's outgoing port is free once its own dispatch bytes have left
            st = lindley(np.maximum(comb_ready[o], setup + dout[d, c]), plan.msg_occupy[o])
            comb_start[o] = st
            sent_combine[d] += plan.msg_bytes[o].sum()
            out_done[d] = max(out_done[d], st[-1] + plan.msg_occupy[o[-1]])
        sel = remote
        src, cls = plan.msg_src[sel], plan.msg_cls[sel]
        comb_arrival[sel] = (np.maximum(comb_start[sel] + plan.msg_startup[sel],
                                        setup + din[src, cls])
                             + plan.msg_wire[sel] + plan.msg_latency[sel])

    # ---- top-k reduce at the source, tokens in order ---------------------------------------
    pick_back = np.where(remote[plan.pick_msg], comb_arrival[plan.pick_msg],
                         gt.l2_end[plan.pick_block])
    full = np.full(R * T * K, -np.inf)
    full[plan.pick_flat] = pick_back
    token_ready = np.maximum(full.reshape(R, T, K).max(axis=2), 0.0)
    reduce_start = lindley_rows(token_ready, plan.token_reduce_us)
    reduce_end = reduce_start + plan.token_reduce_us

    # a rank is done when its reduce, its GEMMs and its outgoing combine are done
    rank_end = np.maximum(reduce_end[:, -1], out_done)
    np.maximum(rank_end, np.where(np.isfinite(gt.last_end), gt.last_end, 0.0), out=rank_end)
    tl = Timeline(disp_start=disp_start, disp_arrival=disp_arrival, din=din, dout=dout,
                  l1_ready=l1_ready, l1_end=gt.l1_end, l2_end=gt.l2_end, comb_ready=comb_ready,
                  comb_start=comb_start, comb_arrival=comb_arrival, gemm_first=gt.first_start,
                  gemm_last=gt.last_end, token_ready=token_ready, reduce_end=reduce_end,
                  rank_end=rank_end, recv_dispatch=recv_dispatch, sent_combine=sent_combine)
    return tl, gt


def lindley_rows(ready: np.ndarray, occupy: np.ndarray) -> np.ndarray:
    """:func:`lindley` along the last axis of [N, n] arrays (one server per row)."""
    P = np.cumsum(occupy, axis=-1) - occupy
    return P + np.maximum.accumulate(ready - P, axis=-1)
