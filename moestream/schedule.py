"""The Mega MoE scheduler in pure Python: waves, blocks, valid_m and the ticket order.

The kernels hand out work in the order this module writes down, and the tests check them
against it. Three levels, as in DeepGEMM's Mega MoE scheduler:

- expert *waves*: consecutive local experts grouped until the wave's L1 blocks can fill the
  SMs; the L1 blocks of wave w + 1 are handed out, then the L2 blocks of wave w (``l2_lag``
  1, the default: they find their L1 blocks done instead of waiting for blocks that just
  started), so L2 of wave w overlaps L1 of wave w + 1; ``l2_lag`` 0 hands out a wave's L2
  blocks right after its own L1 blocks;
- *blocks* (expert, m_block, n_block), n fastest, so concurrent programs share the A rows;
  L1 blocks optionally in groups of m-blocks (``l1_group_m``), so that where an m-block has
  many column blocks (mixtral) concurrent programs share weight tiles instead;
- *tokens*: dispatch tasks (one per source token) and combine tasks (one per own token).

Ticket order on one rank: every dispatch task, then wave by wave its L1 blocks and the
previous wave's L2 blocks (``l2_lag`` 0: its own), then every combine task. A task only
waits on tasks earlier in the order (or, for combine, on L2 blocks of other ranks, which never
wait on combine), so programs that take tickets in order from an atomic counter can never
deadlock, however few of them run at once.

m_block numbers are global within a rank's pool (expert e's blocks are block_start[e] ...), the
same numbering as the pool layout in ``moestream.routing`` and the kernels' counters.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

__all__ = ["Phase", "Task", "RankPlan", "Schedule", "valid_m", "m_blocks_of", "expert_waves",
           "build_schedule"]


class Phase(IntEnum):
    DISPATCH = 0
    L1 = 1
    L2 = 2
    COMBINE = 3


@dataclass(frozen=True, order=True)
class Task:
    """One ticket. Fields that do not apply to the phase are -1.

    DISPATCH: pull ``token`` of rank ``source`` into ``rank``'s pool (all its picks of
    ``rank``'s experts). L1/L2: block (``expert`` (local), ``m_block`` (global in the pool),
    ``n_block``) of ``wave``. COMBINE: reduce ``token`` of ``rank``.
    """

    rank: int
    phase: Phase
    expert: int = -1
    m_block: int = -1
    n_block: int = -1
    source: int = -1
    token: int = -1
    wave: int = -1


def valid_m(count: int, m_block_in_expert: int, block_m: int) -> int:
    """Rows of an expert's m-th block that hold tokens (the last block may be ragged)."""
    return max(0, min(block_m, count - m_block_in_expert * block_m))


def m_blocks_of(count: int, block_m: int) -> int:
    return -(-count // block_m)


def expert_waves(expert_counts: Sequence[int], *, block_m: int, n_blocks_l1: int,
                 num_sms: int) -> list[tuple[int, int]]:
    """Split local experts [0, E_loc) into waves [start, end).

    A wave closes as soon as its L1 blocks reach ``num_sms`` (enough to fill the machine);
    experts that receive no token add no blocks and ride along with their neighbours.
    """
    if num_sms <= 0:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    waves: list[tuple[int, int]] = []
    start, blocks = 0, 0
    for e, c in enumerate(expert_counts):
        blocks += m_blocks_of(c, block_m) * n_blocks_l1
        if blocks >= num_sms:
            waves.append((start, e + 1))
            start, blocks = e + 1, 0
    if start < len(expert_counts) or not waves:
        waves.append((start, len(expert_counts)))
    return waves


@dataclass
class RankPlan:
    """Everything one rank's kernels need to know about a call's routing."""

    rank: int
    expert_count: list[int]          # [E_loc] picks received per local expert
    block_start: list[int]           # [E_loc + 1] first m-block of each expert
    src_row: list[list[int]]         # [E_loc][R] first pool row of each source in each expert
    pool_src: dict[int, tuple[int, int, int]]   # pool row -> (source, token, k)
    waves: list[tuple[int, int]]
    tickets: list[Task]


@dataclass
class Schedule:
    num_ranks: int
    experts_per_rank: int
    block_m: int
    n_blocks_l1: int
    n_blocks_l2: int
    top_k: int
    tokens: list[int]                 # T of each rank
    plans: list[RankPlan]
    # (rank, token, k) -> (owner rank, pool row) of every pick
    pick_row: dict[tuple[int, int, int], tuple[int, int]]

    def rank_order(self, rank: int) -> list[Task]:
        """Ticket order of one rank's persistent launch."""
        return self.plans[rank].tickets

    def virtual_order(self) -> list[Task]:
        """One launch serving all ranks (virtual ranks): every rank's dispatch tasks, then each
        rank's waves, then every combine task. Dependencies stay earlier in the order."""
        dispatch = [t for p in self.plans for t in p.tickets if t.phase == Phase.DISPATCH]
        gemm = [t for p in self.plans for t in p.tickets if t.phase in (Phase.L1, Phase.L2)]
        combine = [t for p in self.plans for t in p.tickets if t.phase == Phase.COMBINE]
        return dispatch + gemm + combine

    def expert_of_block(self, rank: int, m_block: int) -> int:
        bs = self.plans[rank].block_start
        for e in range(self.experts_per_rank):
            if bs[e] <= m_block < bs[e + 1]:
                return e
        raise ValueError(f"m_block {m_block} is past the last block ({bs[-1]}) of rank {rank}")

    def block_valid_m(self, rank: int, m_block: int) -> int:
        e = self.expert_of_block(rank, m_block)
        plan = self.plans[rank]
        return valid_m(plan.expert_count[e], m_block - plan.block_start[e], self.block_m)

    def dependencies(self, task: Task) -> list[Task]:
        """The tasks ``task`` waits for (possibly on other ranks)."""
        plan = self.plans[task.rank]
        if task.phase == Phase.DISPATCH:
            return []
        if task.phase == Phase.L1:
            row0 = task.m_block * self.block_m
            rows = range(row0, row0 + self.block_valid_m(task.rank, task.m_block))
            srcs = sorted({plan.pool_src[r][:2] for r in rows})
            return [Task(task.rank, Phase.DISPATCH, source=s, token=t) for s, t in srcs]
        if task.phase == Phase.L2:
            return [Task(task.rank, Phase.L1, expert=task.expert, m_block=task.m_block,
                         n_block=n, wave=task.wave) for n in range(self.n_blocks_l1)]
        deps: list[Task] = []
        for k in range(self.top_k):
            hit = self.pick_row.get((task.rank, task.token, k))
            if hit is None:
                continue
            owner, row = hit
            mb = row // self.block_m
            e = self.expert_of_block(owner, mb)
            wave = _wave_of(self.plans[owner].waves, e)
            deps += [Task(owner, Phase.L2, expert=e, m_block=mb, n_block=n, wave=wave)
                     for n in range(self.n_blocks_l2)]
        return deps


def _wave_of(waves: Sequence[tuple[int, int]], expert: int) -> int:
    for w, (a, b) in enumerate(waves):
        if a <= expert < b:
            return w
    raise AssertionError(f"expert {expert} is in no wave {waves}")


def wave_block_order(m_blocks: range, n_blocks: int, group_m: int = 1) -> list[tuple[int, int]]:
    """(m_block, n_block) of a wave's GEMM tickets in order: n fastest, or with ``group_m`` > 1
    in groups of that many m-blocks, m fastest within a group (the last group may be smaller;
    ``kernels/tickets.grouped_tile``)."""
    ms = list(m_blocks)
    return [(m, n) for g in range(0, len(ms), group_m) for n in range(n_blocks)
            for m in ms[g:g + group_m]]


def build_schedule(topk_idx: Sequence[Sequence[Sequence[int]]], *, num_experts: int,
                   block_m: int, n_blocks_l1: int, n_blocks_l2: int, num_sms: int,
                   l1_group_m: int = 1, l2_lag: int = 1) -> Schedule:
    """The schedule of one call from every rank's routing (plain nested lists of ints).

    Args:
        topk_idx: per rank, T_r rows of K global expert ids (-1 = no pick).
        num_experts: E over all ranks; rank r owns [r*E/R, (r+1)*E/R).
        block_m: pool block rows. n_blocks_l1 / n_blocks_l2: column blocks of L1 (I) and L2 (H).
        num_sms: programs that fit on the device at once (sizes the waves).
        l1_group_m: a wave's L1 tickets in groups of this many m-blocks (``wave_block_order``,
            ``L1.group_m``).
        l2_lag: 1 (the order the fused launch runs): a wave's L2
            tickets follow the next wave's L1 tickets (the last wave's come after every L1
            ticket); 0: they follow its own L1 tickets.
    """
    if isinstance(l1_group_m, bool) or not isinstance(l1_group_m, int) or l1_group_m < 1:
        raise ValueError(f"l1_group_m must be an int >= 1 (m-blocks per group), got "
                         f"{l1_group_m!r}")
    if type(l2_lag) is not int or l2_lag not in (0, 1):
        raise ValueError(f"l2_lag must be 0 or 1 (waves an L2 ticket follows its L1 by), got "
                         f"{l2_lag!r}")
    R = len(topk_idx)
    if R == 0 or num_experts % R:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the rank count ({R})")
    e_loc = num_experts // R
    # per source: counts per global expert and each pick's slot (same as routing.source_slots)
    counts = [[0] * num_experts for _ in range(R)]
    slot: dict[tuple[int, int, int], int] = {}
    for s, rows in enumerate(topk_idx):
        for t, row in enumerate(rows):
            for k, e in enumerate(row):
                if 0 <= e < num_experts:
                    slot[(s, t, k)] = counts[s][e]
                    counts[s][e] += 1
                elif e != -1:
                    raise ValueError(f"topk_idx[{s}][{t}][{k}] = {e} is outside [-1, {num_experts})")
    plans: list[RankPlan] = []
    pick_row: dict[tuple[int, int, int], tuple[int, int]] = {}
    for d in range(R):
        expert_count = [sum(counts[s][d * e_loc + e] for s in range(R)) for e in range(e_loc)]
        block_start = [0]
        for c in expert_count:
            block_start.append(block_start[-1] + m_blocks_of(c, block_m))
        src_row = []
        for e in range(e_loc):
            row, per_src = block_start[e] * block_m, []
            for s in range(R):
                per_src.append(row)
                row += counts[s][d * e_loc + e]
            src_row.append(per_src)
        pool_src: dict[int, tuple[int, int, int]] = {}
        for (s, t, k), sl in slot.items():
            e = topk_idx[s][t][k]
            if e // e_loc == d:
                row = src_row[e % e_loc][s] + sl
                pool_src[row] = (s, t, k)
                pick_row[(s, t, k)] = (d, row)
        waves = expert_waves(expert_count, block_m=block_m, n_blocks_l1=n_blocks_l1,
                             num_sms=num_sms)
        tickets = [Task(d, Phase.DISPATCH, source=s, token=t)
                   for s in range(R) for t in range(len(topk_idx[s]))]
        expert_of = [e for e in range(e_loc) for _ in range(block_start[e], block_start[e + 1])]
        l1, l2 = [], []
        for w, (a, b) in enumerate(waves):
            mbs = range(block_start[a], block_start[b])
            l1.append([Task(d, Phase.L1, expert=expert_of[mb], m_block=mb, n_block=n, wave=w)
                       for mb, n in wave_block_order(mbs, n_blocks_l1, l1_group_m)])
            l2.append([Task(d, Phase.L2, expert=expert_of[mb], m_block=mb, n_block=n, wave=w)
                       for mb, n in wave_block_order(mbs, n_blocks_l2)])
        for w in range(len(waves) + l2_lag):   # L1 of wave w, then L2 of wave w - l2_lag
            tickets += l1[w] if w < len(waves) else []
            tickets += l2[w - l2_lag] if w >= l2_lag else []
        tickets += [Task(d, Phase.COMBINE, token=t) for t in range(len(topk_idx[d]))]
        plans.append(RankPlan(d, expert_count, block_start, src_row, pool_src, waves, tickets))
    top_k = max((len(row) for rows in topk_idx for row in rows), default=0)
    return Schedule(R, e_loc, block_m, n_blocks_l1, n_blocks_l2, top_k,
                    [len(rows) for rows in topk_idx], plans, pick_row)
