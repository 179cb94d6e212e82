"""Reference engine: the same model as ``engine.py``, one event at a time from a heap.

Slow (pure Python, every message and every n-block task is an event) and meant for small
cases: the tests run both engines on the same plans and require the same times. Keeping an
explicit event queue makes each rule of the model readable on its own:

- a port serves its queue in its fixed order, one message at a time;
- a compute SM, when free, claims the next ticket, waits until it is ready, runs it;
- an arrival counts the rows of its wait group; a finished task counts the n-blocks of its
  block; a finished L2 block counts the rows of its combine messages;
- the reduce takes its rank's tokens in order as they become complete.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .engine import combine_order, dispatch_order
from .links import LOCAL
from .plan import L1, L2, Plan

__all__ = ["EventQueue", "run_events", "EventTimes"]


class EventQueue:
    """Callbacks ordered by (time, insertion order)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        self.now = 0.0
        self.processed = 0

    def at(self, time: float, fn: Callable[..., None], *args: object) -> None:
        assert time >= self.now, f"event at {time} scheduled in the past ({self.now})"
        heapq.heappush(self._heap, (time, self._seq, fn, args))
        self._seq += 1

    def run(self) -> None:
        while self._heap:
            self.now, _, fn, args = heapq.heappop(self._heap)
            self.processed += 1
            fn(*args)


@dataclass
class EventTimes:
    """The times ``engine.Timeline`` also has, as computed by the event engine."""

    disp_arrival: np.ndarray
    l1_ready: np.ndarray
    l1_end: np.ndarray
    l2_end: np.ndarray
    comb_start: np.ndarray
    comb_arrival: np.ndarray
    token_ready: np.ndarray
    reduce_end: np.ndarray
    rank_end: np.ndarray
    events: int


class _Port:
    """A FIFO server with a fixed order; it opens at ``opens`` (earlier traffic has priority)."""

    def __init__(self, q: EventQueue, order: list[int], occupy: np.ndarray, opens: float,
                 on_start: Callable[[int], None]) -> None:
        self.q, self.order, self.occupy, self.on_start = q, order, occupy, on_start
        self.next = 0
        self.busy = False
        self.ready: set[int] = set()
        self.last_free = opens
        self.open = False
        q.at(opens, self._open)

    def _open(self) -> None:
        self.open = True
        self._kick()

    def make_ready(self, m: int) -> None:
        self.ready.add(m)
        self._kick()

    def _kick(self) -> None:
        if not self.open or self.busy or self.next >= len(self.order):
            return
        m = self.order[self.next]
        if m not in self.ready:
            return
        self.next += 1
        self.busy = True
        self.on_start(m)
        self.q.at(self.q.now + self.occupy[m], self._free)

    def _free(self) -> None:
        self.busy = False
        self.last_free = self.q.now
        self._kick()


def run_events(plan: Plan) -> EventTimes:
    """Event times of ``plan`` by discrete-event simulation."""
    q = EventQueue()
    R, T, K = plan.num_ranks, plan.tokens_per_rank, plan.config.top_k
    M, B = plan.num_messages, plan.num_blocks
    setup = plan.setup_us
    remote = plan.msg_cls != LOCAL
    disp_arrival = np.full(M, np.nan)
    comb_start = np.full(M, np.nan)
    comb_arrival = np.full(M, np.nan)
    l1_ready = np.full(B, np.nan)
    l1_end = np.full(B, np.nan)
    l2_end = np.full(B, np.nan)
    task_last_end = np.zeros(R)

    picks_of_msg = [[] for _ in range(M)]
    for p in range(plan.num_picks):
        picks_of_msg[plan.pick_msg[p]].append(p)
    blocks_of_wait: dict[int, list[int]] = {}
    for b in range(B):
        blocks_of_wait.setdefault(int(plan.blk_wait[b]), []).append(b)
    wait_left = {w: int(plan.blk_valid[bs].sum()) for w, bs in blocks_of_wait.items()}
    rows_of_block = [[] for _ in range(B)]
    for p in range(plan.num_picks):
        rows_of_block[plan.pick_block[p]].append(p)

    # dispatch-in totals (the incoming port's busy time) and dispatch-out wire time per port
    din = np.zeros((R, 3))
    np.add.at(din, (plan.msg_dst, plan.msg_cls), plan.msg_occupy)
    dout = np.zeros((R, 3))
    np.add.at(dout, (plan.msg_src[remote], plan.msg_cls[remote]), plan.msg_wire[remote])

    # ---- reduce at the source --------------------------------------------------------------
    tok_left = np.zeros((R, T), dtype=np.int64)
    tok_of_pick = plan.pick_flat // K
    np.add.at(tok_left, (tok_of_pick // T, tok_of_pick % T), 1)
    token_ready = np.full((R, T), np.nan)
    reduce_end = np.full((R, T), np.nan)
    red_next = [0] * R
    red_busy = [False] * R

    def reduce_kick(r: int) -> None:
        t = red_next[r]
        if red_busy[r] or t >= T or np.isnan(token_ready[r, t]):
            return
        red_next[r] += 1
        red_busy[r] = True
        q.at(q.now + plan.token_reduce_us[r, t], reduce_done, r, t)

    def reduce_done(r: int, t: int) -> None:
        reduce_end[r, t] = q.now
        red_busy[r] = False
        reduce_kick(r)

    def row_back(p: int) -> None:
        r, t = divmod(int(tok_of_pick[p]), T)
        tok_left[r, t] -= 1
        if tok_left[r, t] == 0:
            token_ready[r, t] = q.now
            reduce_kick(r)

    for r in range(R):
        for t in range(T):
            if tok_left[r, t] == 0:       # a token without picks is complete from the start
                token_ready[r, t] = 0.0
        reduce_kick(r)

    # ---- combine: out of the owner's port, into the source's port ---------------------------
    comb_left = plan.msg_rows.copy()
    okey = np.empty(M, dtype=np.int64)
    okey[combine_order(plan)] = np.arange(M)
    out_ports: dict[tuple[int, int], _Port] = {}

    def comb_started(m: int) -> None:
        comb_start[m] = q.now
        s, c = int(plan.msg_src[m]), int(plan.msg_cls[m])
        into = max(q.now + plan.msg_startup[m], setup + din[s, c])
        q.at(into + plan.msg_wire[m] + plan.msg_latency[m], comb_landed, m)

    def comb_landed(m: int) -> None:
        comb_arrival[m] = q.now
        for p in picks_of_msg[m]:
            row_back(p)

    for (d, c) in sorted({(int(a), int(b)) for a, b in zip(plan.msg_dst[remote],
                                                              plan.msg_cls[remote])}):
        sel = np.flatnonzero(remote & (plan.msg_dst == d) & (plan.msg_cls == c))
        order = sel[np.argsort(okey[sel], kind="stable")].tolist()
        out_ports[(d, c)] = _Port(q, order, plan.msg_occupy, setup + dout[d, c], comb_started)

    def l2_block_done(b: int) -> None:
        l2_end[b] = q.now
        for p in rows_of_block[b]:
            m = int(plan.pick_msg[p])
            if not remote[m]:
                row_back(p)
                continue
            comb_left[m] -= 1
            if comb_left[m] == 0:
                out_ports[(int(plan.msg_dst[m]), int(plan.msg_cls[m]))].make_ready(m)

    # ---- GEMM: tickets claimed in order by whichever SM is free -----------------------------
    tickets: list[deque] = []
    for r in range(R):
        tk = deque()
        for i in range(int(plan.seq_len[r])):
            b, ph = int(plan.seq_block[r, i]), int(plan.seq_phase[r, i])
            n = plan.n_l1 if ph == L1 else plan.n_l2
            tk.extend((b, ph) for _ in range(n))
        tickets.append(tk)
    ready_at: dict[tuple[int, int], float] = {}
    waiting: dict[tuple[int, int], list[int]] = {}
    tasks_left = {}
    for b in range(B):
        tasks_left[(b, L1)] = plan.n_l1
        tasks_left[(b, L2)] = plan.n_l2

    def claim(r: int) -> None:
        if not tickets[r]:
            return
        b, ph = tickets[r].popleft()
        if (b, ph) in ready_at:
            run_task(r, b, ph)
        else:
            waiting.setdefault((b, ph), []).append(r)

    def run_task(r: int, b: int, ph: int) -> None:
        d = plan.d_l1[b] if ph == L1 else plan.d_l2[b]
        q.at(q.now + d, task_done, r, b, ph)

    def make_task_ready(b: int, ph: int) -> None:
        ready_at[(b, ph)] = q.now
        for r in waiting.pop((b, ph), []):
            run_task(r, b, ph)

    def task_done(r: int, b: int, ph: int) -> None:
        task_last_end[r] = max(task_last_end[r], q.now)
        tasks_left[(b, ph)] -= 1
        if tasks_left[(b, ph)] == 0:
            if ph == L1:
                l1_end[b] = q.now
                make_task_ready(b, L2)
            else:
                l2_block_done(b)
        claim(r)

    for r in range(R):
        for _ in range(plan.compute_sms):
            claim(r)

    # ---- dispatch: each (rank, class) incoming port pulls its queue from setup ---------------
    def disp_started(m: int) -> None:
        q.at(q.now + plan.msg_service[m] + plan.msg_latency[m], disp_landed, m)

    def disp_landed(m: int) -> None:
        disp_arrival[m] = q.now
        for p in picks_of_msg[m]:
            b = int(plan.pick_block[p])
            w = int(plan.blk_wait[b])
            wait_left[w] -= 1
            if wait_left[w] == 0:
                for bb in blocks_of_wait[w]:
                    l1_ready[bb] = q.now
                    make_task_ready(bb, L1)

    dkey = np.empty(M, dtype=np.int64)
    dkey[dispatch_order(plan)] = np.arange(M)
    in_ports = []
    for (d, c) in sorted({(int(a), int(b)) for a, b in zip(plan.msg_dst, plan.msg_cls)}):
        sel = np.flatnonzero((plan.msg_dst == d) & (plan.msg_cls == c))
        order = sel[np.argsort(dkey[sel], kind="stable")].tolist()
        port = _Port(q, order, plan.msg_occupy, setup, disp_started)
        for m in order:
            port.ready.add(m)
        in_ports.append(port)

    q.run()
    rank_end = np.maximum(reduce_end[:, -1], task_last_end)
    for (d, _), port in out_ports.items():
        rank_end[d] = max(rank_end[d], port.last_free)
    return EventTimes(disp_arrival=disp_arrival, l1_ready=l1_ready, l1_end=l1_end, l2_end=l2_end,
                      comb_start=comb_start, comb_arrival=comb_arrival, token_ready=token_ready,
                      reduce_end=reduce_end, rank_end=rank_end, events=q.processed)
