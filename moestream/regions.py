"""The symmetric buffer's regions: names, shapes, dtypes, byte offsets. Pure Python.

Every rank allocates the same number of bytes and carves them the same way, so a region's
offset is valid in every peer's buffer: peer r's copy of region ``name`` starts at
``ptr_table[r] + layout[name].offset``.

Regions, in order (``parity`` regions exist twice, indexed by the call's epoch & 1, because a
peer may still read call e's copy while this rank publishes call e+1; it can never lag two
calls, since every call waits for every peer's ready flag of that call):

    workspace  epoch, ready, diag, published  control words (local epoch, published epoch,
                                              first stall's diagnostic, publish programs done)
               num_tokens [2], send_counts [2, E]   published with the inputs (peers read)
               expert_count, block_start, src_row, src_tokens, block_meta, wave_mb,
               num_waves                      this rank's pool layout (every call) and expert
                                              waves (calls of the fused launch), on device
               arrival, l1_done, l2_done, tickets, l2_programs, gemm_claims,
               l2_ranks_done,
               combine_flag                   zeroed at every call
    inputs     x [2, T, H], topk_idx [2, T, K], topk_weights [2, T, K], slot [2, T, K]
    pool       pool_x [P, H], pool_src [P], pool_weight [P]   tokens pulled for local experts
    act        pool_act [P, I]                                 L1 output (SwiGLU x weight)
    combine    combine_y [T, K, H]            L2 rows written back by the experts' owners

Token rows: bf16 ``[.., H]``; in fp8 mode ``x``, ``pool_x`` and ``pool_act`` are byte rows
(uint8 ``[.., config.token_bytes]`` / ``[.., config.act_bytes]``): the row's e4m3 values
(bytes 0 .. H-1), then its fp32 scales, one per 128 channels (bytes H .. H + 4*H/128 - 1).
A token and its scales are one row, so dispatch moves them with one copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from .config import MoEConfig, align_up

__all__ = ["Region", "BufferLayout", "make_layout", "bytes_per_rank", "ALIGN", "DIAG_FIELDS",
           "REGION_NAMES"]

ALIGN = 256  # bytes; >= 128 keeps every region TMA- and vector-load aligned
DTYPE_BYTES = {"int32": 4, "float32": 4, "bfloat16": 2, "uint8": 1}

# every region, in buffer order (make_layout's)
REGION_NAMES = ("epoch", "ready", "diag", "published", "num_tokens", "send_counts", "expert_count",
                "block_start", "src_row", "src_tokens", "block_meta", "wave_mb", "num_waves",
                "arrival", "l1_done", "l2_done", "tickets", "l2_programs", "gemm_claims",
                "l2_ranks_done", "combine_flag", "x", "topk_idx", "topk_weights", "slot", "pool_x",
                "pool_src", "pool_weight", "pool_act", "combine_y")

# diag[i]: what a kernel that gave up waiting leaves behind (first stall wins).
# bad_topk counts topk ids outside [-1, E) seen by the publish step (they are ignored).
DIAG_FIELDS = ("stalled", "phase", "rank", "index", "observed", "expected", "epoch", "peer",
               "bad_topk")


@dataclass(frozen=True)
class Region:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    doc: str
    reset_each_call: bool = False   # zeroed by the publish step of every call
    peer_visible: bool = False      # read or written by other ranks

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BufferLayout:
    config: MoEConfig
    num_ranks: int
    regions: dict[str, Region] = field(repr=False)
    total_bytes: int

    def __getitem__(self, name: str) -> Region:
        try:
            return self.regions[name]
        except KeyError:
            raise KeyError(f"no region {name!r}; regions: {list(self.regions)}") from None

    def offsets(self) -> dict[str, int]:
        return {n: r.offset for n, r in self.regions.items()}

    @property
    def reset_span(self) -> tuple[int, int]:
        """(offset, nbytes) of the contiguous run of regions zeroed at every call."""
        rs = [r for r in self.regions.values() if r.reset_each_call]
        lo, hi = min(r.offset for r in rs), max(r.end for r in rs)
        assert all(lo <= r.offset and r.end <= hi for r in rs)
        assert not any(lo <= r.offset < hi for r in self.regions.values() if not r.reset_each_call)
        return lo, hi - lo

    def summary(self) -> list[tuple[str, tuple[int, ...], str, int, int]]:
        return [(r.name, r.shape, r.dtype, r.offset, r.nbytes) for r in self.regions.values()]


def make_layout(config: MoEConfig, num_ranks: int) -> BufferLayout:
    """The regions of one rank's buffer for ``config`` split over ``num_ranks`` ranks."""
    config.check_ranks(num_ranks)
    E, K, H, I = config.num_experts, config.top_k, config.hidden, config.intermediate
    T = config.max_tokens_per_rank
    e_loc = config.experts_per_rank(num_ranks)
    P = config.pool_capacity(num_ranks)
    n_mb = config.max_m_blocks(num_ranks)
    if config.fp8_tokens:
        rows = ("uint8", (config.token_bytes,), (config.act_bytes,), "e4m3 values + fp32 scales: ")
    else:
        rows = ("bfloat16", (H,), (I,), "")
    row_dtype, x_row, act_row, what = rows
    specs: list[tuple] = [
        # name, shape, dtype, doc, reset_each_call, peer_visible
        ("epoch", (1,), "int32", "calls made so far on this rank (device-side counter)", False, False),
        ("ready", (1,), "int32", "epoch whose inputs are published (peers acquire it)", False, True),
        ("diag", (len(DIAG_FIELDS),), "int32", "first stall: " + ", ".join(DIAG_FIELDS), False, False),
        ("published", (1,), "int32", "publish programs of this call that finished (the last one signals, then zeroes it)", False, False),
        ("num_tokens", (2,), "int32", "T of the call, by parity", False, True),
        ("send_counts", (2, E), "int32", "this rank's picks per global expert, by parity", False, True),
        ("expert_count", (e_loc,), "int32", "picks each local expert receives", False, False),
        ("block_start", (e_loc + 1,), "int32", "first m-block of each local expert; last = total", False, False),
        ("src_row", (e_loc, num_ranks), "int32", "first pool row of each source inside each expert", False, False),
        ("src_tokens", (num_ranks,), "int32", "T of each source rank in this call", False, False),
        ("block_meta", (n_mb,), "int32", "per m-block: local expert * 512 + valid_m", False, False),
        ("wave_mb", (e_loc + 1,), "int32", "first m-block of each expert wave; [num_waves] = total (fused path; the staged one leaves it)", False, False),
        ("num_waves", (1,), "int32", "expert waves of this call (moestream.schedule.expert_waves; fused path)", False, False),
        ("arrival", (n_mb,), "int32", "tokens arrived per pool m-block (dispatch -> L1)", True, False),
        ("l1_done", (n_mb,), "int32", "L1 column blocks finished per m-block (L1 -> L2)", True, False),
        ("l2_done", (n_mb,), "int32", "L2 column blocks finished per m-block (the last one signals)", True, False),
        ("tickets", (1,), "int32", "next ticket of the fused kernel (local rank 0 serves the launch)", True, False),
        ("l2_programs", (1,), "int32", "staged L2 programs of this rank that finished", True, False),
        ("gemm_claims", (2, 4), "int32", "staged L1, L2 (Tuning.gemm_claim): [next ticket, programs done, 2 pad words]", True, False),
        ("l2_ranks_done", (1,), "int32", "ranks whose staged L2 finished (peers' L2 -> combine)", True, True),
        ("combine_flag", (T, K), "int32", "1 once a pick's L2 row is complete (peers' L2 -> combine)", True, True),
        ("x", (2, T) + x_row, row_dtype, what + "published tokens, by parity", False, True),
        ("topk_idx", (2, T, K), "int32", "published expert ids, by parity", False, True),
        ("topk_weights", (2, T, K), "float32", "published gate weights, by parity", False, True),
        ("slot", (2, T, K), "int32", "each pick's slot among this rank's picks of its expert", False, True),
        ("pool_x", (P,) + x_row, row_dtype, what + "tokens pulled for the local experts", False, False),
        ("pool_src", (P,), "int32", "packed (source, token, k) of each pool row", False, False),
        ("pool_weight", (P,), "float32", "gate weight of each pool row", False, False),
        ("pool_act", (P,) + act_row, row_dtype, what + "L1 output: silu(gate) * up * weight", False, False),
        ("combine_y", (T, K, H), "bfloat16", "each pick's expert output, written by its owner", False, True),
    ]
    regions: dict[str, Region] = {}
    offset = 0
    for name, shape, dtype, doc, reset, peer in specs:
        offset = align_up(offset, ALIGN)
        r = Region(name, tuple(shape), dtype, offset, doc, reset, peer)
        regions[name] = r
        offset = r.end
    assert tuple(regions) == REGION_NAMES
    return BufferLayout(config=config, num_ranks=num_ranks, regions=regions,
                        total_bytes=align_up(offset, ALIGN))


def bytes_per_rank(config: MoEConfig, num_ranks: int) -> int:
    """Bytes of symmetric memory one rank allocates for ``config`` over ``num_ranks`` ranks."""
    return make_layout(config, num_ranks).total_bytes

