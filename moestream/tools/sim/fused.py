"""The fused-kernel execution model: the persistent launch of ``moestream.kernels.fused`` as built.

The stream model (``model.py``) describes what a persistent MoE kernel could do: dedicated
communication SMs, GEMMs at the standalone grouped-GEMM rates. This module describes the kernel
this project has (kernels/fused.py, tuning of ``moestream.stages``), task by task:

- **P programs per rank, one per SM, no dedicated communication SMs.** They take tickets from
  one counter in ticket order: every dispatch task, then per expert wave its L1 blocks
  (m-block major, n fastest) then its L2 blocks, then every combine task.
- **Claim ahead.** A program claims its next ticket when it *begins* the current one (the
  kernel's ``nxt = atomic_add(...)`` at the top of the loop), so ticket n goes to the program
  whose current ticket began first; it runs it after that current ticket. At launch every
  program claims twice: the first P tickets are the programs' first tickets, the next P their
  second (the trace shows almost no interleaving of the two). This is the kernel the
  calibration traces ran; the current kernel's dispatch tasks claim their next ticket only
  when done, which the model does not follow.
- **Ticket overhead**: a program begins a ticket ``ticket_overhead_us`` after its previous one
  ended (bookkeeping: locating the ticket, loading its metadata).
- **Waits inside a ticket.** A program waits (idle) until its ticket's inputs are ready:
  an L1 block for its m-block's rows (token mode and C = block_m), for the C / block_m m-blocks
  of its chunk (C mode) or for every m-block of its expert (``expert``); an L2 block for the
  L1 blocks of its m-block; a combine task for the L2 rows of its tokens' picks (plus the flag's
  flight, half the flag round trip, for picks computed on a peer).
- **Task sizes as the kernel sizes them**: dispatch tasks of DT source tokens (token mode:
  ``DT = ceil(R * T / dispatch_programs)``, ``dispatch_programs = SMs * dispatch_programs_per_sm``
  of the calibration: SMs / 2 in the kernel the calibration traces ran; chunk C: ``DT = C``;
  ``expert``: 256), moving ``DISPATCH_TILE = 4`` tokens at a time (the rows of a
  tile arrive when the tile is stored); combine tasks of 4 tokens; L1 blocks BM x BN1 with
  BN1 = 128 narrowed (64, 32) when a call touches too few experts to fill the SMs
  (``tuning.select``); L2 blocks BM x 128; expert waves close at ``num_sms`` L1 blocks.
- **Task durations from the calibration** (``Calibration.fused_kernel()``):

  * L1 / L2 block: ``max(fixed + tile FLOPs / per-SM rate, HBM bytes / per-SM HBM rate)``.
    The tile is computed in full whatever its valid rows (TMA loads BM rows), so the FLOPs are
    ``2*BM*2*BN1*H`` (L1) and ``2*BM*BN2*I`` (L2). The HBM bytes are the block's weight tile
    shared by the m-blocks of its expert (they run in the same wave and hit the L2 cache) plus
    its activation tile shared by the n-blocks of its m-block:
    ``W_tile / m_blocks(expert) + A_tile / n_blocks``; decode-size experts (one m-block) are
    weight-bandwidth bound.
  * dispatch task: per token of the task with a pick on this rank, ``token_bytes /
    read_rate`` (local source: ``dispatch_local_gbps``; a peer: ``dispatch_remote_read_gbps``,
    capped by an equal share of the link's bandwidth among the rank's remote dispatch tasks
    that run at once), plus ``rows * token_bytes / dispatch_local_gbps`` for its pool writes.
  * combine task: ``(valid picks + 1) * token_bytes / combine_gbps`` per token.

- **Per-call fixed cost** ``call_fixed_us[family]`` added to the kernel time (the publish,
  signal and layout launches before the fused launch and the graph replay).

Every rank's launch starts at 0 (the layout step already waited for every peer); a rank's
dispatch and GEMM tickets depend only on its own tickets, its combine tickets also on the
peers' L2 blocks, so the ranks are simulated dispatch + GEMM first, then combine. The layer
time is the slowest rank's last ticket plus the fixed cost.

Not modelled: contention between the L2 blocks' remote stores (they write their rows into the
source's combine slots) beyond what the calibrated L2 rate includes; interleaved launch claims;
HBM contention beyond the calibrated rates; RDMA (the kernel reads peers through NVLink
addresses: a fabric with RDMA between the ranks is refused).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...config import MoEConfig
from ...schedule import expert_waves
from .calib import Calibration, FusedKernelCalib
from .engine import union_length
from .links import INTER, Fabric
from .plan import (Granularity, check_routing, granularity_label, parse_granularity,
                   pool_blocks)

__all__ = ["FusedResult", "FusedPlan", "simulate_fused", "fused_tuning", "FusedTuning",
           "DISPATCH_TILE", "COMBINE_TILE", "EXPERT_CHUNK_TOKENS", "PHASE_NAMES"]

# kernel constants (moestream.tuning: CHUNK_TILE, EXPERT_CHUNK_TOKENS, policy.for_fused)
DISPATCH_TILE = 4         # tokens a dispatch task moves at once (arrivals released per tile)
COMBINE_TILE = 4          # tokens per combine task
EXPERT_CHUNK_TOKENS = 256  # dispatch task size of the "expert" mode
L1_BLOCK_N = 128          # tuning.gpu_defaults' L1 block_n, narrowed by tuning.select
L1_BLOCK_N_MIN = 32
L2_BLOCK_N = 128          # tuning.for_fused's L2 block_n (hidden % 128 == 0)

PHASE_NAMES = ("dispatch", "L1", "L2", "combine")
DISPATCH, L1, L2, COMBINE = range(4)


@dataclass(frozen=True)
class FusedTuning:
    """The launch shape the fused kernel runs a call with (as ``moestream.stages.fused_tuning``
    resolves it on a GPU with ``num_sms`` SMs)."""

    programs: int
    dispatch_tokens: int
    chunk_blocks: int          # m-blocks an L1 block waits for (a huge number: whole expert)
    l1_block_n: int
    l2_block_n: int
    wave_blocks: int
    dispatch_tile: int = DISPATCH_TILE
    combine_tile: int = COMBINE_TILE


def fused_tuning(config: MoEConfig, *, ranks: int, tokens_per_rank: int, num_sms: int,
                 granularity: Granularity, programs: int | None = None,
                 dispatch_programs_per_sm: float = 0.5) -> FusedTuning:
    """Task sizes of one call (tuning.select(..., impl="fused").with_granularity(...));
    token mode sizes dispatch tasks for ``round(num_sms * dispatch_programs_per_sm)``
    programs (``Fused.dispatch_programs``). The model keeps the 128-row GEMM tiles, one
    program per SM and one combine part its calibration was traced with. The current kernel
    also runs decode-sized calls in decode pieces, two programs per SM where the L2 has the
    blocks, and splits small calls' combine tasks into column parts; decode calls run in one
    expert wave with one-token dispatch tiles, and large calls dispatch in tiles of 8 tokens
    (``tuning.select``); bf16 L2 tickets hold several column blocks
    (``tuning.fused_l2_group_for``), and a wave's L2 tickets follow the next wave's L1.
    This model does none of that (its order is ``schedule.build_schedule``'s ``l2_lag`` 0)."""
    R, T = ranks, tokens_per_rank
    E_loc = config.num_experts // R
    touched = min(E_loc, max(1, T * config.top_k))
    bn1 = L1_BLOCK_N   # hidden and intermediate are multiples of 128 (MoEConfig)
    while bn1 > L1_BLOCK_N_MIN and touched * (config.intermediate // bn1) < num_sms:
        bn1 //= 2
    bn2 = L2_BLOCK_N
    if granularity == "token":
        dp = max(1, int(round(num_sms * dispatch_programs_per_sm)))
        dt = max(1, -(-R * T // dp))
        chunk = 1
    elif granularity == "expert":
        dt, chunk = EXPERT_CHUNK_TOKENS, 1 << 30
    else:
        # the kernel needs C to be a multiple of block_m; other C wait for C // block_m
        # m-blocks (at least one)
        dt, chunk = int(granularity), max(1, int(granularity) // config.block_m)
    P = programs or num_sms
    if isinstance(P, bool) or not isinstance(P, int) or P <= 0:
        raise ValueError(f"programs must be a positive int, got {programs!r}")
    return FusedTuning(programs=P, dispatch_tokens=dt, chunk_blocks=chunk, l1_block_n=bn1,
                       l2_block_n=bn2, wave_blocks=num_sms)


@dataclass
class FusedPlan:
    """Work items of one call, per rank (lists indexed by rank).

    Dispatch tasks: ``d_src``, ``d_t0``, ``d_n``, ``d_dur`` (µs on one program), ``d_bytes``
    (remote bytes read). Per task token ``d_tok_off`` (arrival offset of each token of the
    task's source range from the task's start, µs; a token's rows arrive when its tile is
    stored). M-blocks (global ids): ``blk_rank``, ``blk_expert``, ``blk_valid``, ``blk_first``
    / ``blk_last`` (the m-blocks of its wait group), ``d_l1`` / ``d_l2`` (block durations).
    Per rank ``gemm_seq``: (phase, m-block) per GEMM ticket in ticket order (n-blocks
    expanded). Combine: ``c_t0``, ``c_n``, ``c_dur`` per rank.
    """

    config: MoEConfig
    num_ranks: int
    tokens_per_rank: int
    granularity: Granularity
    tuning: FusedTuning
    fk: FusedKernelCalib
    token_bytes: int
    latency_us: float
    # dispatch
    d_src: list[np.ndarray]
    d_t0: list[np.ndarray]
    d_n: list[np.ndarray]
    d_dur: list[np.ndarray]
    d_bytes: list[np.ndarray]
    tok_off: list[np.ndarray]        # [R_src, T] arrival offset within its task, per rank
    # picks (source order) and blocks
    pick_flat: np.ndarray
    pick_src: np.ndarray
    pick_dst: np.ndarray
    pick_block: np.ndarray
    blk_rank: np.ndarray
    blk_expert: np.ndarray
    blk_valid: np.ndarray
    blk_first: np.ndarray
    blk_last: np.ndarray
    d_l1: np.ndarray
    d_l2: np.ndarray
    n_l1: int
    n_l2: int
    gemm_phase: list[np.ndarray]
    gemm_block: list[np.ndarray]
    # combine
    c_t0: np.ndarray
    c_n: np.ndarray
    c_dur: np.ndarray                # [R, tasks]

    def task_count(self, rank: int) -> dict[str, int]:
        g = self.gemm_phase[rank]
        return {"dispatch": int(self.d_src[rank].size), "L1": int((g == L1).sum()),
                "L2": int((g == L2).sum()), "combine": int(self.c_t0.size)}


def _block_times(cfg: MoEConfig, tun: FusedTuning, fk: FusedKernelCalib, w_gbps: float,
                 m_blocks_of_expert: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(L1, L2) duration of a block on one program, by its expert's m-block count."""
    BM, H, I, b = cfg.block_m, cfg.hidden, cfg.intermediate, cfg.bytes_per_element
    bn1, bn2 = tun.l1_block_n, tun.l2_block_n
    nb1, nb2 = I // bn1, H // bn2
    nm = np.maximum(m_blocks_of_expert, 1).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        c1 = fk.l1_fixed_us + (0.0 if math.isinf(fk.l1_tflops_per_sm)
                               else 2.0 * BM * 2 * bn1 * H / (fk.l1_tflops_per_sm * 1e6))
        c2 = fk.l2_fixed_us + (0.0 if math.isinf(fk.l2_tflops_per_sm)
                               else 2.0 * BM * bn2 * I / (fk.l2_tflops_per_sm * 1e6))
        if math.isinf(w_gbps):
            m1 = m2 = np.zeros_like(nm)
        else:
            m1 = (2 * bn1 * H * b / nm + BM * H * b / nb1) / (w_gbps * 1e3)
            m2 = (bn2 * I * b / nm + BM * I * b / nb2) / (w_gbps * 1e3)
    return np.maximum(c1, m1), np.maximum(c2, m2)


def _per(rate_gbps: float) -> float:
    """µs per byte at a GB/s rate (0 for an infinite rate)."""
    return 0.0 if math.isinf(rate_gbps) else 1.0 / (rate_gbps * 1e3)


def build_fused_plan(*, config: MoEConfig, routing: np.ndarray, fabric: Fabric,
                     granularity: Granularity, calib: Calibration,
                     programs: int | None = None) -> FusedPlan:
    """The fused kernel's tickets of one call (routing: [R, T, K] expert ids, -1 = no pick)."""
    cfg = config
    routing = check_routing(routing, cfg)
    R, T, K = routing.shape
    E, E_loc, BM = cfg.num_experts, cfg.num_experts // R, cfg.block_m
    if INTER in fabric.classes_between(R):
        raise ValueError(f"the fused kernel reads peers through NVLink addresses; fabric "
                         f"{fabric.name!r} joins these {R} ranks with RDMA (use the stream "
                         f"model, execution='stream')")
    fk = calib.fused_kernel()
    tun = fused_tuning(cfg, ranks=R, tokens_per_rank=T, num_sms=calib.num_sms,
                       granularity=granularity, programs=programs,
                       dispatch_programs_per_sm=fk.dispatch_programs_per_sm)
    P = tun.programs
    tb = cfg.hidden * cfg.bytes_per_element

    # ---- picks, pool layout, m-blocks (as moestream.schedule / sim.plan) --------------------
    flat = routing.reshape(-1).astype(np.int64)
    pick_flat = np.flatnonzero(flat >= 0)
    e = flat[pick_flat]
    src = pick_flat // (T * K)
    tok = (pick_flat // K) % T
    dst = e // E_loc
    pool_perm = np.argsort(e, kind="stable")
    pb = pool_blocks(e, pool_perm, num_experts=E, block_m=BM, experts_per_rank=E_loc)
    count, m_blocks = pb.count, pb.m_blocks
    expert_block0, pick_block, B = pb.expert_block0, pb.pick_block, pb.num_blocks
    blk_expert, blk_m, blk_valid, blk_rank = pb.blk_expert, pb.blk_m, pb.blk_valid, pb.blk_rank
    c0 = (blk_m // tun.chunk_blocks) * tun.chunk_blocks
    blk_first = expert_block0[blk_expert] + c0
    blk_last = expert_block0[blk_expert] + np.minimum(c0 + tun.chunk_blocks,
                                                      m_blocks[blk_expert]) - 1
    d_l1, d_l2 = _block_times(cfg, tun, fk, calib.weight_gbps_per_sm(), m_blocks[blk_expert])

    # ---- dispatch tasks ----------------------------------------------------------------------
    links = fabric.links()
    intra = links[1]
    DT, TT = tun.dispatch_tokens, tun.dispatch_tile
    n_tasks_src = -(-T // DT)
    per_local = _per(fk.dispatch_local_gbps)
    d_src, d_t0, d_n, d_dur, d_bytes, tok_off = [], [], [], [], [], []
    tok_ids = np.arange(T)
    task_of_tok = tok_ids // DT
    t0_of_tok = task_of_tok * DT
    # a task moves its tokens TT at a time from its first token: last token of each tile
    tile_end = t0_of_tok + ((tok_ids - t0_of_tok) // TT + 1) * TT
    tile_end = np.minimum(np.minimum(tile_end, t0_of_tok + DT), T) - 1
    for d in range(R):
        mine = dst == d
        rows = np.bincount(src[mine] * T + tok[mine], minlength=R * T).reshape(R, T)
        has = rows > 0
        remote_tasks = (R - 1) * n_tasks_src
        conc = max(1, min(remote_tasks, P))
        remote_rate = min(fk.dispatch_remote_read_gbps, intra.gbps / conc)
        per_read = np.full(R, _per(remote_rate))
        per_read[d] = per_local
        cost = has * (tb * per_read[:, None]) + rows * (tb * per_local)       # [R, T] µs
        # cumulative cost inside each task, read at the end of each token's tile
        cs = np.cumsum(cost, axis=1)
        starts = np.arange(n_tasks_src) * DT
        base = np.where(starts > 0, cs[:, np.maximum(starts - 1, 0)], 0.0)   # [R, tasks]
        off = cs[:, tile_end] - base[:, task_of_tok]
        ends = np.minimum(starts + DT, T) - 1
        dur = cs[:, ends] - base
        rbytes = np.add.reduceat((has * tb).astype(np.float64), starts, axis=1)
        rbytes[d] = 0.0
        d_src.append(np.repeat(np.arange(R), n_tasks_src))
        d_t0.append(np.tile(starts, R))
        d_n.append(np.tile(np.minimum(starts + DT, T) - starts, R))
        d_dur.append(dur.reshape(-1))
        d_bytes.append(rbytes.reshape(-1))
        tok_off.append(off)

    # ---- GEMM tickets per rank: expert waves, L1 blocks then L2 blocks ----------------------
    nb1 = cfg.intermediate // tun.l1_block_n
    nb2 = cfg.hidden // tun.l2_block_n
    gemm_phase, gemm_block = [], []
    for d in range(R):
        cnt = count[d * E_loc:(d + 1) * E_loc]
        bs = np.r_[0, np.cumsum(m_blocks[d * E_loc:(d + 1) * E_loc])] \
            + (expert_block0[d * E_loc] if B else 0)
        ph, bl = [], []
        for a, b in expert_waves(cnt.tolist(), block_m=BM, n_blocks_l1=nb1,
                                 num_sms=tun.wave_blocks):
            blocks = np.arange(bs[a], bs[b])
            ph += [np.full(blocks.size * nb1, L1, np.int8), np.full(blocks.size * nb2, L2, np.int8)]
            bl += [np.repeat(blocks, nb1), np.repeat(blocks, nb2)]
        gemm_phase.append(np.concatenate(ph) if ph else np.zeros(0, np.int8))
        gemm_block.append(np.concatenate(bl) if bl else np.zeros(0, np.int64))

    # ---- combine tasks: CT tokens each, every valid pick read once plus the output row --------
    CT = tun.combine_tile
    picks_per_tok = (routing >= 0).sum(axis=2)                              # [R, T]
    c_t0 = np.arange(0, T, CT)
    c_n = np.minimum(c_t0 + CT, T) - c_t0
    per_c = _per(fk.combine_gbps)
    c_dur = (np.add.reduceat((picks_per_tok + 1) * tb * per_c, c_t0, axis=1)
             if T else np.zeros((R, 0)))
    return FusedPlan(
        config=cfg, num_ranks=R, tokens_per_rank=T, granularity=granularity, tuning=tun, fk=fk,
        token_bytes=tb, latency_us=intra.latency_us if R > 1 else 0.0,
        d_src=d_src, d_t0=d_t0, d_n=d_n, d_dur=d_dur, d_bytes=d_bytes, tok_off=tok_off,
        pick_flat=pick_flat, pick_src=src, pick_dst=dst, pick_block=pick_block,
        blk_rank=blk_rank, blk_expert=blk_expert, blk_valid=blk_valid, blk_first=blk_first,
        blk_last=blk_last, d_l1=d_l1, d_l2=d_l2, n_l1=nb1, n_l2=nb2,
        gemm_phase=gemm_phase, gemm_block=gemm_block, c_t0=c_t0, c_n=c_n, c_dur=c_dur)


def launch_claims(P: int, early: int) -> list[int]:
    """Program of each of the 2P claims made at launch (every program claims twice in a
    row). ``early`` programs (the first launched) make their second claim before the last
    ``early`` programs make their first: those second claims take positions P - 2*early + 1,
    P - 2*early + 3, ..., P - 1 (interleaved with the last first claims, as the traces show)."""
    early = max(0, min(int(early), P // 2))
    spots = {P - 2 * early + 1 + 2 * i for i in range(early)}
    seq, first, second = [], 0, 0
    for pos in range(2 * P):
        if pos in spots or first >= P:
            seq.append(second)
            second += 1
        else:
            seq.append(first)
            first += 1
    return seq


class _Programs:
    """P programs of one rank taking tickets in order with claim-ahead (see the module
    docstring). ``take(ready, dur)`` hands the next ticket out; returns (program, claim time,
    begin, start, end)."""

    def __init__(self, P: int, overhead: float, early: int = 0) -> None:
        # (claim time, order, program, launch claim): the 2P launch claims at time 0
        self.heap = [(0.0, i, p, True) for i, p in enumerate(launch_claims(P, early))]
        self.seq = 2 * P
        self.launch_left = [2] * P
        self.last_end = [0.0] * P
        self.ovh = overhead

    def take(self, ready: float, dur: float) -> tuple[int, float, float, float, float]:
        claim, _, p, launch = heapq.heappop(self.heap)
        begin = self.last_end[p] + self.ovh
        start = begin if begin >= ready else ready
        end = start + dur
        self.last_end[p] = end
        if launch:
            self.launch_left[p] -= 1
        if not launch or self.launch_left[p] == 0:
            # the program claims its next ticket when it begins this one
            heapq.heappush(self.heap, (begin, self.seq, p, False))
            self.seq += 1
        return p, claim, begin, start, end


@dataclass(frozen=True)
class FusedResult:
    """What one call did in the fused-kernel model. Times in µs; per-rank arrays are [R].

    ``layer_us`` = ``kernel_us`` (the slowest rank's last ticket) + ``fixed_us`` (the
    calibrated per-call cost of the provider family). ``phases`` (the critical rank):
    ``dispatch_us`` (its last dispatch task ended), ``l1_start_us``, ``gemm_end_us``,
    ``combine_start_us``, ``kernel_us``; per phase ``<phase>_sm_us`` (program time running
    tasks) and ``wait_sm_us`` (program time waiting for inputs), ``gemm_busy_us`` (time >= 1
    GEMM task ran). ``tasks``: tickets per phase on the critical rank. ``compute_floor_us``:
    the critical rank's task time over its programs (perfect packing, no waits).
    ``link_floor_us``: the busiest rank's remote dispatch bytes over the link. ``overlap``:
    share of the critical rank's dispatch + combine busy time during which a GEMM task ran.
    ``tickets`` (with ``record=True``): per rank a dict of arrays ``phase``, ``program``,
    ``claim``, ``begin``, ``start``, ``end``, ``ready``, ``block`` (m-block or -1), in ticket
    order.
    """

    shape: str | None
    config: MoEConfig
    num_ranks: int
    tokens_per_rank: int
    granularity: Granularity
    link: str
    routing: str
    tuning: FusedTuning
    family: str
    layer_us: float
    kernel_us: float
    fixed_us: float
    critical_rank: int
    rank_end_us: np.ndarray
    phases: dict[str, float]
    tasks: dict[str, int]
    compute_floor_us: float
    link_floor_us: float
    link_util: dict[str, float]
    overlap: float
    remote_dispatch_bytes: np.ndarray
    tickets: list[dict[str, np.ndarray]] | None = field(default=None, repr=False)
    comm_sms: int = 0
    gemm: str = "fused-kernel"
    execution: str = "fused"

    @property
    def label(self) -> str:
        return granularity_label(self.granularity)

    @property
    def messages_per_rank(self) -> float:
        """Dispatch tasks per rank (what the kernel's programs pull per ticket)."""
        return float(self.tasks["dispatch"])

    @property
    def link_util_max(self) -> float:
        return max(self.link_util.values(), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "execution": "fused", "shape": self.shape, "config": self.config.to_dict(),
            "ranks": self.num_ranks, "tokens_per_rank": self.tokens_per_rank,
            "granularity": self.granularity, "link": self.link, "routing": self.routing,
            "family": self.family, "tuning": self.tuning.__dict__, "layer_us": self.layer_us,
            "kernel_us": self.kernel_us, "fixed_us": self.fixed_us,
            "critical_rank": self.critical_rank, "rank_end_us": self.rank_end_us.tolist(),
            "phases": self.phases, "tasks": self.tasks,
            "compute_floor_us": self.compute_floor_us, "link_floor_us": self.link_floor_us,
            "link_util": self.link_util, "overlap": self.overlap,
            "remote_dispatch_bytes": self.remote_dispatch_bytes.tolist(),
        }


def run_fused_plan(plan: FusedPlan, *, record: bool = False) -> dict[str, Any]:
    """Ticket times of every rank. Returns rank_end [R], per-rank ticket arrays, block ends."""
    R, T = plan.num_ranks, plan.tokens_per_rank
    tun, fk = plan.tuning, plan.fk
    B = plan.blk_rank.size
    progs = [_Programs(tun.programs, fk.ticket_overhead_us, fk.launch_early_claims)
             for _ in range(R)]
    recs: list[dict[str, list]] = [dict(phase=[], program=[], claim=[], begin=[], start=[],
                                        end=[], ready=[], block=[]) for _ in range(R)]
    l1_end = np.zeros(B)
    l2_end = np.zeros(B)
    rank_end = np.zeros(R)

    def log(d, phase, blk, ready, out):
        r = recs[d]
        p, claim, begin, start, end = out
        r["phase"].append(phase)
        r["program"].append(p)
        r["claim"].append(claim)
        r["begin"].append(begin)
        r["start"].append(start)
        r["end"].append(end)
        r["ready"].append(ready)
        r["block"].append(blk)

    # rows' arrival: pick -> (its source's task on the owner rank) start + offset
    pick_arrival = np.zeros(plan.pick_flat.size)
    K = plan.config.top_k
    for d in range(R):
        pr = progs[d]
        starts = np.empty(plan.d_src[d].size)
        for i, dur in enumerate(plan.d_dur[d].tolist()):
            out = pr.take(0.0, dur)
            starts[i] = out[3]
            rank_end[d] = max(rank_end[d], out[4])
            if record:
                log(d, DISPATCH, -1, 0.0, out)
        mine = np.flatnonzero(plan.pick_dst == d)
        s = plan.pick_src[mine]
        t = (plan.pick_flat[mine] // K) % T
        n_src = -(-T // tun.dispatch_tokens)
        task = s * n_src + t // tun.dispatch_tokens
        pick_arrival[mine] = starts[task] + plan.tok_off[d][s, t]
    # block ready: every row of its wait group in
    blk_arr = np.zeros(B)
    if B:
        np.maximum.at(blk_arr, plan.pick_block, pick_arrival)
        # wait groups are consecutive m-blocks: max over [first, last]
        grp = plan.blk_first
        gmax = np.zeros(B)
        np.maximum.at(gmax, grp, blk_arr)
        # propagate: every block of a group shares the group's max (group keyed by first)
        l1_ready = gmax[grp]
    else:
        l1_ready = blk_arr
    d_l1, d_l2 = plan.d_l1.tolist(), plan.d_l2.tolist()
    l1r = l1_ready.tolist()
    l1e, l2e = [0.0] * B, [0.0] * B
    for d in range(R):
        pr = progs[d]
        last = rank_end[d]
        for ph, b in zip(plan.gemm_phase[d].tolist(), plan.gemm_block[d].tolist()):
            if ph == L1:
                ready = l1r[b]
                out = pr.take(ready, d_l1[b])
                if out[4] > l1e[b]:
                    l1e[b] = out[4]
            else:
                ready = l1e[b]
                out = pr.take(ready, d_l2[b])
                if out[4] > l2e[b]:
                    l2e[b] = out[4]
            if out[4] > last:
                last = out[4]
            if record:
                log(d, ph, b, ready, out)
        rank_end[d] = last
    l1_end[:] = l1e
    l2_end[:] = l2e
    # combine: a token is ready when every pick's L2 m-block is done (+ flag flight if remote)
    lat = plan.latency_us
    back = l2_end[plan.pick_block] + np.where(plan.pick_dst != plan.pick_src, lat, 0.0)
    tok_ready = np.zeros(R * T)
    np.maximum.at(tok_ready, plan.pick_flat // K, back)
    tok_ready = tok_ready.reshape(R, T)
    c_ready = (np.maximum.reduceat(tok_ready, plan.c_t0, axis=1) if T else np.zeros((R, 0)))
    for d in range(R):
        pr = progs[d]
        for ready, dur in zip(c_ready[d].tolist(), plan.c_dur[d].tolist()):
            out = pr.take(ready, dur)
            if out[4] > rank_end[d]:
                rank_end[d] = out[4]
            if record:
                log(d, COMBINE, -1, ready, out)
    tickets = None
    if record:
        tickets = [{k: np.asarray(v) for k, v in r.items()} for r in recs]
    return {"rank_end": rank_end, "tickets": tickets, "l1_end": l1_end, "l2_end": l2_end,
            "l1_ready": l1_ready, "pick_arrival": pick_arrival}


def simulate_fused(*, config: MoEConfig, routing: np.ndarray, fabric: Fabric,
                   granularity: Granularity | str = "token", calib: Calibration,
                   family: str = "graph", programs: int | None = None, shape: str | None = None,
                   routing_name: str = "given", record: bool = False) -> FusedResult:
    """The fused-kernel model of one call (see the module docstring).

    Args:
        config, routing ([R, T, K] expert ids), fabric, granularity: the call.
        calib: rates; its ``fused_kernel()`` section (or the packaged H200 derivation).
        family: which ``call_fixed_us`` entry to add (``"graph"``; ``"none"`` adds nothing).
        programs: programs per rank (default: one per SM, as the kernel launches).
        record: also return every ticket's times (``FusedResult.tickets``).
    """
    g = parse_granularity(granularity)
    plan = build_fused_plan(config=config, routing=routing, fabric=fabric, granularity=g,
                            calib=calib, programs=programs)
    fk = plan.fk
    if family == "none":
        fixed = 0.0
    elif family in fk.call_fixed_us:
        fixed = float(fk.call_fixed_us[family])
    else:
        raise ValueError(f"no per-call fixed cost for family {family!r} in the calibration; "
                         f"known: {sorted(fk.call_fixed_us)} (or 'none')")
    out = run_fused_plan(plan, record=True)
    R = plan.num_ranks
    rank_end = out["rank_end"]
    kernel = float(rank_end.max()) if R else 0.0
    c = int(np.argmax(rank_end)) if R else 0
    tk = out["tickets"][c]
    ph = tk["phase"]
    run = tk["end"] - tk["start"]
    wait = tk["start"] - tk["begin"]

    def span(sel, arr, fn, default=math.nan):
        return float(fn(arr[sel])) if sel.any() else default

    isd, is1, is2, isc = (ph == DISPATCH), (ph == L1), (ph == L2), (ph == COMBINE)
    gem = is1 | is2
    comm = isd | isc
    gemm_busy = union_length(tk["start"][gem], tk["end"][gem])
    comm_busy = union_length(tk["start"][comm], tk["end"][comm])
    both = union_length(np.r_[tk["start"][gem], tk["start"][comm]],
                        np.r_[tk["end"][gem], tk["end"][comm]])
    overlap = (gemm_busy + comm_busy - both) / comm_busy if comm_busy > 0 else 1.0
    phases = {
        "dispatch_us": span(isd, tk["end"], np.max, 0.0),
        "l1_start_us": span(is1, tk["start"], np.min),
        "gemm_end_us": span(gem, tk["end"], np.max),
        "combine_start_us": span(isc, tk["start"], np.min),
        "kernel_us": float(rank_end[c]),
        "dispatch_sm_us": float(run[isd].sum()), "L1_sm_us": float(run[is1].sum()),
        "L2_sm_us": float(run[is2].sum()), "combine_sm_us": float(run[isc].sum()),
        "wait_sm_us": float(wait.sum()), "gemm_busy_us": gemm_busy,
    }
    rbytes = np.array([float(b.sum()) for b in plan.d_bytes])
    intra = fabric.links()[1]
    link_floor = float(rbytes.max() / (intra.gbps * 1e3)) if R > 1 and rbytes.size else 0.0
    layer = kernel + fixed
    util = {}
    if R > 1:
        util["intra"] = (float(rbytes.sum() / (R * intra.gbps * 1e3 * kernel))
                         if kernel > 0 else 0.0)
    return FusedResult(
        shape=shape, config=plan.config, num_ranks=R, tokens_per_rank=plan.tokens_per_rank,
        granularity=g, link=fabric.name, routing=routing_name, tuning=plan.tuning,
        family=family, layer_us=layer, kernel_us=kernel, fixed_us=fixed, critical_rank=c,
        rank_end_us=rank_end, phases=phases, tasks=plan.task_count(c),
        compute_floor_us=float(run.sum() / plan.tuning.programs),
        link_floor_us=link_floor, link_util=util, overlap=float(min(1.0, max(0.0, overlap))),
        remote_dispatch_bytes=rbytes, tickets=out["tickets"] if record else None)
