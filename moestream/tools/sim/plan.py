"""From a routing to the simulator's work items: picks, messages, GEMM blocks and ticket order.

Both engines (the vectorised one in ``model.py`` and the event-queue reference in
``events.py``) read the same :class:`Plan`, so the tests that compare them check the timing
arithmetic, not two copies of the bookkeeping.

Conventions (the same as ``moestream.routing`` and ``moestream.schedule``):

- A *pick* is one valid (source rank s, token t, k) with global expert e; rank d = e // E_loc
  owns the expert. Picks are numbered in (s, t, k) order.
- Rank d's *pool* holds its experts one after another; inside expert e the picks of source 0
  come first, then source 1, ..., each in (t, k) order. Expert segments are split into m-blocks
  of ``block_m`` rows (the last one ragged, ``valid_m``); block ids are global: rank 0's
  blocks first, in pool order.
- A *message* carries picks from s to d. Its picks are consecutive in the (s -> d) *stream*,
  the pool order restricted to s: expert by expert. Granularity ``"token"``: one pick per
  message; ``C`` (int): up to C consecutive picks of the stream (chunks span experts, as a
  per-rank-pair channel does); ``"expert"``: all picks of s for one expert. The combine sends
  the same groups back from d to s.
- An L1 block waits until every pick of its *wait group* has arrived: the block itself for
  token and C granularity (each row arrives with its message), the whole expert for
  ``"expert"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import numpy as np

from ...config import MoEConfig
from ...schedule import expert_waves
from .calib import Calibration
from .links import INTER, INTRA, LOCAL, Fabric

__all__ = ["Granularity", "parse_granularity", "granularity_label", "make_routing", "Plan",
           "build_plan", "L1", "L2"]

Granularity = Union[Literal["token", "expert"], int]
L1, L2 = 1, 2
BLOCK_N = 128   # GEMM output columns per block: the GPU tiles (tuning.gpu_defaults)


def parse_granularity(g: object) -> Granularity:
    """``"token"``, ``"expert"`` or a positive int C (strings of digits are accepted)."""
    if isinstance(g, str):
        s = g.strip().lower()
        if s in ("token", "expert"):
            return s  # type: ignore[return-value]
        if s.isdigit():
            g = int(s)
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or int(g) <= 0:
        raise ValueError(f"granularity must be 'token', 'expert' or a positive int C "
                         f"(tokens per message), got {g!r}")
    return int(g)


def granularity_label(g: Granularity) -> str:
    return g if isinstance(g, str) else f"C={g}"


def _distinct_topk(rng: np.random.Generator, n: int, num_experts: int, top_k: int) -> np.ndarray:
    """n rows of top_k distinct experts, uniform (a random top-k of i.i.d. router logits)."""
    if top_k * top_k > num_experts or num_experts <= 64:
        out = np.empty((n, top_k), dtype=np.int32)
        step = max(1, (1 << 22) // num_experts)   # bound the key matrix to ~32 MB
        for a in range(0, n, step):
            keys = rng.random((min(step, n - a), num_experts), dtype=np.float32)
            out[a:a + step] = np.argpartition(keys, top_k - 1, axis=1)[:, :top_k]
        return out
    # Few picks out of many experts: draw with replacement and redraw rows with a repeat
    # (about K^2 / 2E of them), much cheaper than a key per expert.
    out = rng.integers(0, num_experts, size=(n, top_k), dtype=np.int32)
    redo = np.arange(n)
    while redo.size:
        rows = np.sort(out[redo], axis=1)
        bad = (rows[:, 1:] == rows[:, :-1]).any(axis=1)
        redo = redo[bad]
        out[redo] = rng.integers(0, num_experts, size=(redo.size, top_k), dtype=np.int32)
    return out


def make_routing(*, ranks: int, tokens_per_rank: int, num_experts: int, top_k: int,
                 kind: str = "uniform", skew: float = 0.3, seed: int = 0) -> np.ndarray:
    """[R, T, K] int32 global expert ids (numpy twin of ``moestream.testing.make_routing``).

    ``uniform``: K distinct experts per token, uniformly. ``skewed``: a share ``min(1, skew*K)``
    of the tokens also pick the hot expert 0 (at most one pick per token, so the hot expert's
    share of all picks is at most 1/K), the rest as uniform.
    """
    if kind not in ("uniform", "skewed"):
        raise ValueError(f"routing must be 'uniform', 'skewed' or an [R, T, K] array, got {kind!r}")
    if not 0.0 < skew <= 1.0:
        raise ValueError(f"skew must be in (0, 1], got {skew}")
    rng = np.random.default_rng(seed)
    n = ranks * tokens_per_rank
    idx = _distinct_topk(rng, n, num_experts, top_k)
    if kind == "skewed":
        hot = rng.random(n) < min(1.0, skew * top_k)
        has0 = (idx == 0).any(axis=1)
        idx[hot & ~has0, top_k - 1] = 0
    return idx.reshape(ranks, tokens_per_rank, top_k)


@dataclass
class Plan:
    """Every work item of one simulated call; arrays are numpy, times in µs.

    Picks [P] (valid picks, (s, t, k) order): ``pick_flat`` (index into the [R*T*K] routing),
    ``pick_src``, ``pick_dst``, ``pick_block``, ``pick_msg``.
    ``pool_perm`` [P]: picks in pool order (rank, expert, source, slot); every block's and every
    wait group's picks are contiguous in it, from ``block_pool_start`` / ``wait_pool_start``.
    ``stream_perm`` [P]: picks in stream order (rank d, source s, expert, slot); every
    message's picks are contiguous in it, from ``msg_stream_start``.

    Blocks [B]: ``blk_rank``, ``blk_expert`` (global), ``blk_valid`` rows, ``blk_wait`` (wait
    group), task durations ``d_l1`` / ``d_l2`` on one SM; an L1 block is ``n_l1`` tasks
    (n-blocks), an L2 block ``n_l2``. ``seq_block`` / ``seq_phase`` [R, L] hold each rank's
    ticket order of block *batches* (all n-blocks of one (block, phase)), padded with -1 /
    0 past ``seq_len``; ``l2_pos`` [B] is the position of the block's L2 batch in it.

    Messages [M]: ``msg_src``, ``msg_dst`` (expert owner), ``msg_cls`` (LOCAL/INTRA/INTER),
    ``msg_rows``, ``msg_bytes``, ``msg_first_pool`` (pool position of its first pick),
    ``msg_pool_order`` (message ids sorted by it),
    ``msg_wire`` (bytes / bandwidth), ``msg_service`` (start-up + wire), ``msg_occupy`` (time
    the issuing port is busy, >= service), ``msg_startup``, ``msg_latency``.

    Tokens [R, T]: ``token_reduce_us`` (top-k reduce time of each token at its source).
    """

    config: MoEConfig
    num_ranks: int
    tokens_per_rank: int
    granularity: Granularity
    fabric: Fabric
    comm_sms: int
    compute_sms: int
    gemm: str
    dispatch_order: str
    setup_us: float
    token_bytes: int
    # picks
    pick_flat: np.ndarray
    pick_src: np.ndarray
    pick_dst: np.ndarray
    pick_block: np.ndarray
    pick_msg: np.ndarray
    pool_perm: np.ndarray
    stream_perm: np.ndarray
    # blocks
    blk_rank: np.ndarray
    blk_expert: np.ndarray
    blk_valid: np.ndarray
    blk_wait: np.ndarray
    block_pool_start: np.ndarray
    wait_pool_start: np.ndarray
    d_l1: np.ndarray
    d_l2: np.ndarray
    n_l1: int
    n_l2: int
    seq_block: np.ndarray
    seq_phase: np.ndarray
    seq_len: np.ndarray
    l2_pos: np.ndarray
    # messages
    msg_src: np.ndarray
    msg_dst: np.ndarray
    msg_cls: np.ndarray
    msg_rows: np.ndarray
    msg_bytes: np.ndarray
    msg_first_pool: np.ndarray
    msg_stream_start: np.ndarray
    msg_pool_order: np.ndarray
    msg_wire: np.ndarray
    msg_startup: np.ndarray
    msg_service: np.ndarray
    msg_occupy: np.ndarray
    msg_latency: np.ndarray
    # tokens
    token_reduce_us: np.ndarray

    @property
    def num_picks(self) -> int:
        return int(self.pick_src.size)

    @property
    def num_blocks(self) -> int:
        return int(self.blk_rank.size)

    @property
    def num_messages(self) -> int:
        return int(self.msg_src.size)

    def gemm_work_us(self) -> np.ndarray:
        """[R] SM-µs of GEMM work per rank (sum over tasks of their one-SM durations)."""
        work = self.n_l1 * self.d_l1 + self.n_l2 * self.d_l2
        return np.bincount(self.blk_rank, weights=work, minlength=self.num_ranks)


def stable_argsort(keys: np.ndarray, max_key: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for keys in [0, max_key], as 16-bit radix passes.

    numpy sorts 16-bit integers with a radix sort, ~10x faster than a comparison sort on
    the tens of millions of picks of a large call.
    """
    keys = np.asarray(keys)
    if max_key < 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    if max_key < 1 << 32:
        k = keys.astype(np.uint64)
        lo = np.argsort((k & 0xFFFF).astype(np.uint16), kind="stable")
        hi = np.argsort((k[lo] >> 16).astype(np.uint16), kind="stable")
        return lo[hi]
    return np.argsort(keys, kind="stable")


@dataclass(frozen=True)
class PoolBlocks:
    """Where picks sit in the pool and the BLOCK_M-row blocks of every expert (all ranks'
    experts numbered globally, blocks in expert order).

    Per expert [E]: ``count`` picks, ``expert_start`` pool position, ``m_blocks``,
    ``expert_block0`` first block. Per pick [P]: ``pool_pos``, ``row_in_expert``,
    ``pick_block``. Per block [num_blocks]: ``blk_expert``, ``blk_m`` (block of its expert),
    ``blk_valid`` rows, ``blk_rank`` (the rank owning its expert)."""

    count: np.ndarray
    expert_start: np.ndarray
    m_blocks: np.ndarray
    expert_block0: np.ndarray
    pool_pos: np.ndarray
    row_in_expert: np.ndarray
    pick_block: np.ndarray
    blk_expert: np.ndarray
    blk_m: np.ndarray
    blk_valid: np.ndarray
    blk_rank: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.blk_expert.size)


def pool_blocks(e: np.ndarray, pool_perm: np.ndarray, *, num_experts: int, block_m: int,
                experts_per_rank: int) -> PoolBlocks:
    """``PoolBlocks`` of picks with global expert ids ``e`` [P] in pool order ``pool_perm``."""
    count = np.bincount(e, minlength=num_experts)               # picks per global expert
    expert_start = np.cumsum(count) - count                     # pool position of each expert
    pool_pos = np.empty(e.size, dtype=np.int64)
    pool_pos[pool_perm] = np.arange(e.size)
    row_in_expert = pool_pos - expert_start[e]
    m_blocks = -(-count // block_m)
    expert_block0 = np.cumsum(m_blocks) - m_blocks
    blk_expert = np.repeat(np.arange(num_experts), m_blocks)
    blk_m = np.arange(blk_expert.size) - expert_block0[blk_expert]
    return PoolBlocks(count=count, expert_start=expert_start, m_blocks=m_blocks,
                      expert_block0=expert_block0, pool_pos=pool_pos,
                      row_in_expert=row_in_expert,
                      pick_block=expert_block0[e] + row_in_expert // block_m,
                      blk_expert=blk_expert, blk_m=blk_m,
                      blk_valid=np.minimum(block_m, count[blk_expert] - blk_m * block_m),
                      blk_rank=blk_expert // experts_per_rank)


def check_routing(routing, cfg: MoEConfig) -> np.ndarray:
    """``routing`` as an [R, T, K] integer array of expert ids in [-1, E) for ``cfg`` and R
    ranks it can be split over (ValueError naming what is wrong otherwise)."""
    routing = np.asarray(routing)
    if routing.ndim != 3 or routing.shape[2] != cfg.top_k:
        raise ValueError(f"routing must be an [R, T, K={cfg.top_k}] array of expert ids, got "
                         f"shape {routing.shape}")
    if not np.issubdtype(routing.dtype, np.integer):
        raise ValueError(f"routing must hold integer expert ids, got dtype {routing.dtype}")
    cfg.check_ranks(routing.shape[0])
    E = cfg.num_experts
    bad = (routing < -1) | (routing >= E)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"routing{list(where)} = {int(routing[where])} is outside [-1, {E})")
    return routing


def build_plan(*, config: MoEConfig, routing: np.ndarray, fabric: Fabric,
               granularity: Granularity, comm_sms: int, calib: Calibration, gemm: str,
               dispatch_order: str = "pool", block_n: int = BLOCK_N) -> Plan:
    """The plan of one call. ``routing`` is [R, T, K] global expert ids, -1 for no pick;
    ``block_n``: the GEMMs' output columns per block (a power of two dividing hidden and
    intermediate)."""
    cfg = config
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16 \
            or block_n & (block_n - 1) or cfg.hidden % block_n or cfg.intermediate % block_n:
        raise ValueError(f"block_n must be a power of two >= 16 dividing hidden and "
                         f"intermediate, got {block_n!r}")
    routing = check_routing(routing, cfg)
    R, T, K = routing.shape
    E, E_loc, BM = cfg.num_experts, cfg.num_experts // R, cfg.block_m
    if dispatch_order not in ("pool", "source"):
        raise ValueError(f"dispatch_order must be 'pool' or 'source', got {dispatch_order!r}")
    if gemm not in calib.gemm_providers:
        raise ValueError(f"unknown GEMM provider {gemm!r}; known: {list(calib.gemm_providers)}")
    num_sms = calib.num_sms
    if isinstance(comm_sms, bool) or not isinstance(comm_sms, int) or not 0 <= comm_sms < num_sms:
        raise ValueError(f"comm_sms must be an int in [0, {num_sms}) (the calibrated GPU has "
                         f"{num_sms} SMs and GEMMs need at least one), got {comm_sms!r}")
    links = fabric.links()
    used = fabric.classes_between(R)
    if comm_sms == 0 and any(links[c].device_initiated for c in used):
        raise ValueError(f"comm_sms must be >= 1: fabric {fabric.name!r} has device-initiated "
                         f"links, whose transfers are issued by communication SMs")
    compute_sms = num_sms - comm_sms
    H, I = cfg.hidden, cfg.intermediate
    token_bytes = H * cfg.bytes_per_element

    # ---- picks -----------------------------------------------------------------------------
    flat = routing.reshape(-1).astype(np.int64)
    pick_flat = np.flatnonzero(flat >= 0)
    e = flat[pick_flat]
    src = (pick_flat // (T * K)).astype(np.int64)
    dst = e // E_loc
    P = pick_flat.size

    # pool order is (expert, source, slot) (the expert id orders rank, then local expert);
    # picks are in source order already, so a stable sort by expert gives it
    pool_perm = stable_argsort(e, E - 1)
    pb = pool_blocks(e, pool_perm, num_experts=E, block_m=BM, experts_per_rank=E_loc)
    count, expert_start, pool_pos, m_blocks = pb.count, pb.expert_start, pb.pool_pos, pb.m_blocks
    expert_block0, pick_block, B = pb.expert_block0, pb.pick_block, pb.num_blocks
    blk_expert, blk_m, blk_valid, blk_rank = pb.blk_expert, pb.blk_m, pb.blk_valid, pb.blk_rank
    block_pool_start = expert_start[blk_expert] + blk_m * BM
    if granularity == "expert":
        nz = np.flatnonzero(count)
        wait_pool_start = expert_start[nz]
        wait_of_expert = np.full(E, -1, dtype=np.int64)
        wait_of_expert[nz] = np.arange(nz.size)
        blk_wait = wait_of_expert[blk_expert]
    else:
        wait_pool_start = block_pool_start
        blk_wait = np.arange(B)

    # ---- messages ----------------------------------------------------------------------------
    le = e % E_loc
    stream_key = (dst * R + src) * E_loc + le
    stream_perm = stable_argsort(stream_key, R * E - 1)
    sk = stream_key[stream_perm]
    pair = sk // E_loc
    if P:
        new_pair = np.r_[True, pair[1:] != pair[:-1]]
        if granularity == "token":
            boundary = np.ones(P, dtype=bool)
        elif granularity == "expert":
            boundary = np.r_[True, sk[1:] != sk[:-1]]
        else:
            pair_start = np.maximum.accumulate(np.where(new_pair, np.arange(P), 0))
            boundary = new_pair | ((np.arange(P) - pair_start) % int(granularity) == 0)
    else:
        boundary = np.zeros(0, dtype=bool)
    msg_stream_start = np.flatnonzero(boundary)
    msg_of_stream = np.cumsum(boundary) - 1
    pick_msg = np.empty(P, dtype=np.int64)
    pick_msg[stream_perm] = msg_of_stream
    first = stream_perm[msg_stream_start]
    msg_src, msg_dst = src[first], dst[first]
    msg_rows = np.diff(np.r_[msg_stream_start, P])
    msg_bytes = msg_rows * token_bytes
    msg_first_pool = (np.minimum.reduceat(pool_pos[stream_perm], msg_stream_start)
                      if P else np.zeros(0, dtype=np.int64))
    # messages in pool order of their first pick (first pool positions are distinct)
    slots = np.full(P, -1, dtype=np.int64)
    slots[msg_first_pool] = np.arange(msg_first_pool.size)
    msg_pool_order = slots[slots >= 0]
    msg_cls = fabric.link_class(msg_src, msg_dst)
    M = msg_src.size
    msg_service = np.zeros(M)
    msg_occupy = np.zeros(M)
    msg_latency = np.zeros(M)
    msg_wire = np.zeros(M)
    msg_startup = np.zeros(M)
    for c in (LOCAL, INTRA, INTER):
        sel = msg_cls == c
        if not sel.any():
            continue
        link = links[c]
        if link is None:
            raise AssertionError(f"class {c} message on fabric {fabric.name} without that link")
        msg_wire[sel] = msg_bytes[sel] / (link.gbps * 1e3)
        msg_startup[sel] = link.startup_us
        msg_service[sel] = link.service_us(msg_bytes[sel])
        msg_occupy[sel] = link.occupancy_us(msg_bytes[sel], comm_sms=max(comm_sms, 1))
        msg_latency[sel] = link.latency_us

    # ---- GEMM blocks: durations on one SM and each rank's ticket order ---------------------
    per_sm = calib.gemm_tflops(count[blk_expert], provider=gemm) * 1e6 / num_sms  # FLOP/µs
    bn = block_n
    with np.errstate(divide="ignore", invalid="ignore"):
        d_l1 = np.where(np.isinf(per_sm), 0.0, 2.0 * blk_valid * (2 * bn) * H / per_sm)
        d_l2 = np.where(np.isinf(per_sm), 0.0, 2.0 * blk_valid * bn * I / per_sm)
    n_l1, n_l2 = I // bn, H // bn
    seqs = []
    rank_block0 = expert_block0[np.arange(R) * E_loc] if B else np.zeros(R, dtype=np.int64)
    for d in range(R):
        cnt = count[d * E_loc:(d + 1) * E_loc]
        bs = np.r_[0, np.cumsum(m_blocks[d * E_loc:(d + 1) * E_loc])] + rank_block0[d]
        parts_b, parts_p = [], []
        for a, b in expert_waves(cnt.tolist(), block_m=BM, n_blocks_l1=n_l1,
                                 num_sms=compute_sms):
            blocks = np.arange(bs[a], bs[b])
            parts_b += [blocks, blocks]
            parts_p += [np.full(blocks.size, L1), np.full(blocks.size, L2)]
        seqs.append((np.concatenate(parts_b), np.concatenate(parts_p)))
    seq_len = np.array([s[0].size for s in seqs], dtype=np.int64)
    L = int(seq_len.max()) if R else 0
    seq_block = np.full((R, L), -1, dtype=np.int64)
    seq_phase = np.zeros((R, L), dtype=np.int8)
    l2_pos = np.zeros(B, dtype=np.int64)
    for d, (blocks, phases) in enumerate(seqs):
        seq_block[d, :blocks.size] = blocks
        seq_phase[d, :blocks.size] = phases
        is2 = phases == L2
        l2_pos[blocks[is2]] = np.flatnonzero(is2)

    # ---- top-k reduce at the source: read every pick's row once ---------------------------
    picks_per_token = (routing >= 0).sum(axis=2)
    token_reduce_us = picks_per_token * token_bytes / (fabric.local.gbps * 1e3)

    return Plan(
        config=cfg, num_ranks=R, tokens_per_rank=T, granularity=granularity, fabric=fabric,
        comm_sms=comm_sms, compute_sms=compute_sms, gemm=gemm, dispatch_order=dispatch_order,
        setup_us=fabric.setup_us(R), token_bytes=token_bytes,
        pick_flat=pick_flat, pick_src=src, pick_dst=dst, pick_block=pick_block,
        pick_msg=pick_msg, pool_perm=pool_perm, stream_perm=stream_perm,
        blk_rank=blk_rank, blk_expert=blk_expert, blk_valid=blk_valid, blk_wait=blk_wait,
        block_pool_start=block_pool_start, wait_pool_start=wait_pool_start,
        d_l1=d_l1, d_l2=d_l2, n_l1=n_l1, n_l2=n_l2, seq_block=seq_block, seq_phase=seq_phase,
        seq_len=seq_len, l2_pos=l2_pos,
        msg_src=msg_src, msg_dst=msg_dst, msg_cls=msg_cls, msg_rows=msg_rows,
        msg_bytes=msg_bytes, msg_first_pool=msg_first_pool, msg_stream_start=msg_stream_start,
        msg_pool_order=msg_pool_order, msg_wire=msg_wire, msg_startup=msg_startup,
        msg_service=msg_service, msg_occupy=msg_occupy, msg_latency=msg_latency,
        token_reduce_us=token_reduce_us)
