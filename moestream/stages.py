"""The staged path: each stage of the layer is one kernel launch over a SymmBuffer.

    publish (one launch per local rank; its last program signals the peers) -> layout ->
    dispatch -> L1 -> L2 -> combine

Each launch serves every local rank of the buffer (all R virtual ranks, or this process's one
real rank). Stages communicate only through the buffer's counters, so the same kernels can later
run inside one persistent launch. Tests drive the stages one by one to inspect the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from .buffer import SymmBuffer
from .config import FP8_GROUP, cdiv
from .kernels import combine as _combine
from .kernels import dispatch as _dispatch
from .kernels import fused as _fused
from .kernels import gemm as _gemm
from .kernels._common import INTERPRET, next_pow2, triton
from .layout import DIAG_FIELDS

__all__ = ["Tuning", "publish", "layout", "dispatch", "l1", "l2", "combine", "fused",
           "run_staged", "run_fused", "fused_tuning", "fused_default", "max_tickets", "STAGES",
           "resident_per_sm",
           "pick_slots", "decode_rows_for", "tail_rows_for", "fp8_l1_split_for"]

assert DIAG_FIELDS.index("bad_topk") == 8  # the publish kernel adds to diag + 8


# chunked modes (Tuning.with_granularity): tokens a chunk's dispatch task moves at once, the
# "expert" mode's dispatch task size and its chunk (more m-blocks than any expert has)
CHUNK_TILE = 4
EXPERT_CHUNK_TOKENS = 256
EXPERT_CHUNK_BLOCKS = 1 << 30


def mean_rows_per_expert(*, tokens: int, ranks: int, top_k: int, num_experts: int) -> float:
    """Rows an expert receives on average under uniform routing: tokens * ranks * top_k /
    num_experts (``tokens`` per rank)."""
    return tokens * ranks * top_k / max(num_experts, 1)


def decode_rows_for(*, tokens: int, ranks: int, top_k: int, num_experts: int,
                    block_m: int) -> int:
    """``Tuning.decode_rows`` for a call (0: off): 16 when an expert is unlikely to receive
    more than 32 rows under uniform routing (mean + 3 standard deviations + 1 of a Poisson
    count with mean tokens * ranks * top_k / num_experts, at most 32): blocks of up to 16
    rows then run one 16-row piece and blocks of 17-32 one 32-row piece, each reading its
    weights once (faster than the 128-row tiles at 16 and 32 rows per expert).
    A hot expert's fuller blocks take up to block_m / 32 pieces."""
    mean = mean_rows_per_expert(tokens=tokens, ranks=ranks, top_k=top_k, num_experts=num_experts)
    if block_m % 16 == 0 and mean + 3 * mean ** 0.5 + 1 <= 32:
        return 16
    return 0


def fp8_l1_split_for(*, tokens: int, top_k: int, experts_per_rank: int,
                     l1_tiles_per_block: int, programs: int) -> int:
    """``Tuning.l1_split_k`` for an fp8 call in decode pieces: 4 where the m-blocks a rank
    expects (one per expert hit: about tokens * top_k picks under uniform routing, at most
    its experts) leave at most a quarter of the L1's programs a tile, so the device splits
    (``kernels/gemm.split_count``), else 1. The fp8 L1 compiled with its split parts holds
    255 registers and runs its unsplit tiles slower than the kernel without them, so the
    split form is launched only where it is expected to split."""
    blocks = min(experts_per_rank, max(tokens, 1) * top_k)
    return 4 if blocks * l1_tiles_per_block * 4 <= programs else 1


def tail_rows_for(*, tokens: int, ranks: int, top_k: int, num_experts: int, block_m: int,
                  dtype: str, l2_split_m: int = 1) -> tuple[int, int]:
    """(``Tuning.l1_tail_rows``, ``l2_tail_rows``) for a staged call that is not decode-sized:
    on while the mean rows per expert under uniform routing (tokens * ranks * top_k /
    num_experts) are at most block_m / 2, where most experts' only m-block is partly filled.
    fp8 takes both GEMMs' pieces, bf16 the L1's: faster there (fp8 most, largely in the L2,
    whose empty second 64-row piece is skipped), no gain once experts fill whole blocks.
    32-row pieces (16 where 32 does not divide the piece), off for fp4w."""
    mean = mean_rows_per_expert(tokens=tokens, ranks=ranks, top_k=top_k, num_experts=num_experts)
    if dtype not in ("bf16", "fp8") or mean > block_m / 2:
        return 0, 0

    def rows(piece: int) -> int:
        return 32 if piece % 32 == 0 else (16 if piece % 16 == 0 else 0)
    return rows(block_m), (rows(block_m // l2_split_m) if dtype == "fp8" else 0)


def one_dot_for(*, tokens: int, ranks: int, top_k: int, num_experts: int, block_m: int) -> bool:
    """``Tuning.l1_one_dot`` for a bf16 staged call: on once the mean rows per expert under
    uniform routing (tokens * ranks * top_k / num_experts) reach 2 * block_m: faster with
    several whole tiles per expert, slightly slower at 128 rows (see docs/tuning.md)."""
    return mean_rows_per_expert(tokens=tokens, ranks=ranks, top_k=top_k,
                                num_experts=num_experts) >= 2 * block_m


# The staged one-MMA L1 (``Tuning.l1_one_dot_stages``) runs ONE_DOT_L1_STAGES stages of 64-deep
# K steps (147 KB of shared memory) instead of Tuning.hopper's 4 (197 KB) where hidden, its K,
# is at least ONE_DOT_SHALLOW_MIN_HIDDEN: faster there from 256 rows per expert; a shorter K
# (qwen3, hidden 2048) was slower at 256 rows, so it keeps 4 (see docs/tuning.md).
ONE_DOT_L1_STAGES = 3
ONE_DOT_SHALLOW_MIN_HIDDEN = 4096


# The staged fp8 L2 computes whole 128-row tiles (8 warps) where the intermediate size (its K)
# is at least this, else 64-row pieces (4 warps, two programs per SM): the tile is faster at
# a long K (dsv3, I = 2048), the pieces at a short one (qwen3, I = 768).
FP8_L2_TILE_MIN_I = 2048

# Calls whose rank takes at least this many picks (tokens x top_k) dispatch 8 tokens per ticket
# (more rows in flight; 168 registers, three programs per SM) instead of 4: faster for
# large calls, slower with fewer picks.
DISPATCH_TILE8_PICKS = 16384


def fused_l2_group_for(cfg, block_n: int) -> int:
    """Column blocks per L2 ticket of the fused launch in whole tiles (``Tuning.
    fused_l2_group``): in bf16 with I <= 2048, the smallest power of two from 2 that leaves an
    m-block at most 16 tickets and divides its column blocks (qwen3 / v4flash: 2 of 16 / 32,
    dsv3: 4 of 56); otherwise 1."""
    blocks = cfg.hidden // block_n
    if cfg.dtype != "bf16" or cfg.intermediate > 2048 or blocks % 2:
        return 1
    group = 2
    while blocks // group > 16 and blocks % (2 * group) == 0:
        group *= 2
    return group


def l1_group_m_for(column_blocks: int, sms: int) -> int:
    """``Tuning.l1_group_m`` for an L1 of ``column_blocks`` column blocks per m-block on a
    GPU of ``sms`` SMs: 8 when the programs running at once (about one per SM) cover fewer
    than 4 m-blocks with n fastest, so that an expert's m-blocks would each stream its w13
    from HBM again (mixtral: 112 column blocks); else 1 (dsv3, v4flash: 16, qwen3: 6)."""
    return 8 if column_blocks * 4 > sms else 1


def _tile(gemm: str, bn: int, bk: int, *, n: tuple[str, int], k: tuple[str, int]
          ) -> tuple[int, int]:
    """(bn, bk) after checking that each is a power of two dividing its GEMM dimension: the
    kernels walk whole tiles (a column block past the last whole one would go unwritten)."""
    for what, v, (dim, size) in (("block_n", bn, n), ("block_k", bk, k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1) \
                or size % v:
            raise ValueError(f"Tuning.{gemm}_{what} must be a power of two >= 16 dividing "
                             f"{dim}={size}, got {v!r}")
    return bn, bk


@dataclass(frozen=True)
class Tuning:
    """Launch shapes, free to change per call (the data layout depends only on block_m).

    programs: persistent programs per local rank (0 = a multiple of the SM count).
    gemm_per_sm: L1/L2 programs asked for per SM when ``programs`` is 0 (capped at what one
        SM holds of the compiled kernel).
    l1_block_n/k, l2_block_n/k: GEMM tiles (None = the config's block_n/block_k).
    l1_warps/l1_stages, l2_warps/l2_stages: warps and software-pipeline depth of each GEMM.
    use_tma: load GEMM tiles with tensor descriptors (None = on Hopper GPUs, not elsewhere);
        the staged bf16 L1/L2 and fp8 L2 (the fp8 L1 keeps pointer loads), the
        fused launch in bf16.
    wait: GEMM blocks acquire their input counters, and the dispatch and L1 launches count
        them (arrivals, ``l1_done``). Stream order already guarantees them in the staged path
        (``for_buffer`` turns them off on GPUs; then nothing is counted either, since every
        count is a release fence that holds its program until its stores are done); tests
        keep them on.
    wave_blocks: L1 blocks that close an expert wave (None = ``wave_blocks(buffer)``;
        ``ONE_WAVE``: every expert of the call in one wave, as ``for_fused`` sets in decode
        pieces).
    fused_per_sm: fused programs asked for per SM when ``programs`` is 0 (capped at what one
        SM holds of the compiled kernel; ``for_fused``: 2 in decode pieces, else 1).
    fused_l2_group: column blocks per L2 ticket of the fused launch (must divide the L2's
        column blocks; whole tiles only, not with decode_rows): one flat (column block, K
        step) loop, so the next block's first loads overlap this block's epilogue, and one
        completion count (a wait for the ticket's stores) per ticket instead of per block;
        the tiles are stored in l2_epilogue_split column pieces. 1: a ticket per block
        (stored whole when 128 wide).
    dispatch_tokens: source tokens per dispatch task of the fused launch (1: token-granular).
    dispatch_tile: tokens a dispatch task moves at once (a power of two; bytes in flight);
        a ticket of the staged dispatch is one tile of a source's tokens.
    chunk_blocks: m-blocks of an expert an L1 block waits for in the fused launch (1: only
        its own block, the token-granular mode; see ``granularity``).
    dispatch_programs: token mode of the fused launch: size dispatch tasks so that about this
        many tasks cover a call (dispatch_tokens = R * T / dispatch_programs, T this rank's
        tokens), leaving the other programs free for GEMM blocks as m-blocks fill up
        (0: off, dispatch_tokens as given). Arrivals are still signalled per dispatch_tile.
    dispatch_eager: dispatch tiles load picks, slots, weights and the first row chunk at
        once (one peer round trip instead of three in a row; also reads rows with no pick
        here).
    dispatch_parts: the staged dispatch moves each row in this many parts (whole
        ``hidden_chunk`` chunks; at most one part per chunk), each its own ticket, so a call
        with few tokens keeps more row loads in flight (dsv3's 7168-wide rows are seven
        chunks in a row otherwise). ``for_call`` splits decode-sized calls into every chunk.
    l2_flat: the staged L2's persistent loop over tiles and its K loop as one flat loop
        (``tl.range(..., flatten=True)``), so Triton's pipeliner prefetches the next tile's
        first K steps during this tile's epilogue. Only without waits (GPU staged path) and
        (Triton 3.6's loop flattening crashes on a per-tile signal);
        otherwise the plain loop runs. Faster with 128x128 tiles (the same loop in the L1 is
        slower, so the L1 has none).
    l1_one_dot: the staged L1 computes a block's gate and up columns as one MMA of
        2 * l1_block_n columns per K step, their weight rows loaded as one [2, block_n, K
        step] tile of w13 seen as [E/R * 2, I, H] (a 3-D tensor descriptor), instead of two
        MMAs of block_n (sm_90: fewer instructions per K step, no spills). bf16
        whole tiles with descriptors only (ignored in fp8, fp4w, decode and tail pieces, with
        pointer loads, and by the fused launch). ``for_call`` turns it on from 2 * block_m
        rows per expert (``one_dot_for``: faster there, slightly slower at 128).
    l1_one_dot_stages: pipeline depth of the staged L1 in that one-MMA form (None:
        l1_stages). ``for_call`` sets ``ONE_DOT_L1_STAGES`` where hidden (the L1's K) is at
        least ``ONE_DOT_SHALLOW_MIN_HIDDEN``.
    l2_epilogue_split: the staged L2 stores its tile into the combine slots in 1, 2 or 4
        column pieces (fewer live registers: the 128x128 4-warp L2 tile fits two programs per
        SM without spills at any rank count in quarters; halves spill from 2 ranks on). The
        fused launch stores a lone 128-wide tile whole, grouped (``fused_l2_group``) or wider
        tiles in these pieces.
    l1_group_m: m-blocks the staged L1's tickets walk at a time (``grouped_tile``), as
        the fused launch does too. 1: n fastest. ``for_call`` groups 8 when an m-block has
        so many column blocks that the programs running at once cover only a couple of
        m-blocks (mixtral: 112 per m-block), where n fastest streams the expert's w13 from
        HBM once per m-block (bf16 and fp8; fp4w's L1 is bound by its weight decode).
    combine_tile: tokens per combine task of the fused launch (a power of two).
    combine_parts: column parts of the hidden dimension per combine_tile tokens in the fused
        launch, each its own task (``fused_default``: enough tasks for the SMs at small T).
    combine_chunk: hidden columns a combine task sums at once (None = hidden_chunk), in the
        fused launch and the staged combine.
    copy_warps: warps of the staged copy launches (publish, numbering, dispatch).
    combine_warps, combine_per_sm: warps and programs per SM of the staged combine launch
        (None = copy_warps). The combine only loads and sums rows: 8 warps make it faster at
        dsv3 dims, where dispatch is slower with them.
    l2_split_m: the staged L2 works in tiles of block_m / l2_split_m rows (1 or 2): with 2,
        an fp8 128-column tile fits 4 warps (one warpgroup of m64 MMAs, two fp32 tiles of 64
        registers) and several programs per SM, so one program's epilogue overlaps
        another's loads, as the bf16 L2 does at 128 rows.
    decode_rows: 0 (off), 16 or 32: the staged L1 and L2 compute each block as weights @
        rows^T (swap AB: the weight tile is the MMA's row operand, [block_n, rows]
        accumulators): a block of at most decode_rows valid rows as one piece of that many
        rows, so a few decode tokens cost a 16-column MMA instead of a block_m-row tile of
        padding (the fp8 L1 loads by descriptor then); a fuller block in pieces of 32 rows
        (or block_m if smaller). Each piece reads the block's weights once. ``for_call`` turns it
        on for calls whose experts expect few rows (``decode_rows_for``). Must divide
        block_m; the L2 runs its plain loop (l2_flat and l2_split_m
        do not apply); the fused launch ignores it.
    l1_tail_rows, l2_tail_rows: 0 (off), 16 or 32: tail pieces. The staged L1 (L2) computes
        a block (L2: a row piece of block_m / l2_split_m rows) that holds at most this many
        valid rows as one decode piece of that many rows (the weights as the MMA row operand,
        as decode_rows does), and every fuller block as the usual tile; an L2 row piece
        without valid rows computes nothing. Under uniform routing about half of the experts
        end in such a partly filled m-block once calls reach ~block_m rows per expert (dsv3 at
        2048 tokens: ~1.5 m-blocks per expert, each costing a whole tile). Does not apply with
        decode_rows (decode pieces cover those blocks already) or fp4w. Must divide block_m
        (L2: block_m / l2_split_m); with them Triton 3.6
        does not flatten the L2 loop even when l2_flat asks (sm_90 compile: the flat and the
        plain form take the same shared memory).
    fp4w_rows: 16, 32, 64, 128 or 256 (capped at block_m, must divide it): MoEConfig dtype
        "fp4w" computes each block's valid rows in pieces of this many rows, each piece
        decoding the block's weights again (kernels/gemm_fp4.py; decode_rows does not apply).
        16-row pieces run as fp16 warp MMAs (exact; ``decode`` picks them for decode-sized
        calls), 64-row pieces as fp8 warpgroup MMAs (``hopper``'s default). Pieces smaller
        than block_m: the L2 runs its plain loop.
    host_descriptors: where the staged L1 / L2 load by descriptor (use_tma) and the buffer
        has one local rank (every real rank; one virtual rank), the host builds the
        descriptors (``host_descriptors``) and passes them as kernel parameters, instead of
        every program writing each one to global memory and fencing it before its first
        load (three round trips in a row ahead of a decode L2's first weight load; sm_90
        SASS). The GPU saves a µs or two per launch, the host pays tens of µs more per launch
        (Triton encodes each descriptor at every launch), so None (the default) builds them
        only while a CUDA graph is being captured, whose replays pay nothing for them;
        True: always, False: never. The fused launch (one local rank, descriptor loads)
        takes its L1 and L2 descriptors the same way.
    l1_split_k: 1, 4, 8 or 16: with decode pieces (bf16 and fp8, staged), when a call's L1 tiles
        are at most a quarter of the programs, up to this many programs share one tile's K
        loop (the device picks the largest power of two >= 4 that fits the programs, from
        the call's m-block count; ``kernels/gemm.split_count``). Each part's fp32 gate and up
        sums go to a scratch of the buffer (``SymmBuffer.scratch``); the last part to finish
        adds them in a fixed order and applies SwiGLU, so the result does not depend on which
        part was last, and no part waits for another. A program streaming one tile alone is
        bound by its own K loop, which the parts share. ``decode`` sets 4 in bf16; in fp8
        (``kernels/gemm.l1_fp8_split_part``) ``for_call`` sets 4 only where a call's expected
        tiles split (``fp8_l1_split_for``): the fp8 kernel with the split form in it is slower
        where it does not split. Where it applies: a rank receives about T x top-k picks per
        call whatever the number of ranks, so at 1 token per rank a
        top-8 model has ~8 m-blocks on every rank (qwen3: 96 L1 tiles on 264 programs, no
        split); it splits where few experts are hit (top-k <= 4 at qwen3 dims, a rank whose
        tokens share experts). The fused launch ignores it. 1: off.
    l2_split_k: the same for the bf16 decode L2 (``kernels/gemm.l2_split_part``): a part's
        fp32 sums [decode_rows, block_n] go to the scratch, and the last part adds them in
        order and stores the rows into their combine slots. It applies where a call's L2
        tiles are at most a quarter of the programs: qwen3 dims up to 4 m-blocks (16 column
        blocks each), dsv3 one (56), mixtral two (32 each, K = 14336: top-2, so a 1-token
        call). The fused launch splits its L2 tickets the same way (each tile's parts on
        consecutive tickets, a part claiming the next ticket when done), into two parts
        already where K is long (``fused_min_split``, e.g. mixtral at 1 token). ``decode``
        sets 4 in bf16. 1: off.
    gemm_claim: the staged L1 and L2 programs claim their tickets from a per-launch counter
        after their first two (``kernels/gemm.next_tickets``; claimed two tiles ahead, the
        last program zeroes the counter) instead of taking every programs-th ticket: a
        program held up by a costly block takes fewer of the rest. A launch with at most two
        tickets per program deals them all round-robin (``kernels/gemm.claiming``). A hot
        expert's block in a decode call runs several 32-row pieces; claimed tickets spread
        the rest over the other programs. ``decode`` turns it on in every format. Larger calls keep
        round-robin tickets (claims are slower there), except fp4w, whose blocks cost a piece
        per ``fp4w_rows`` valid rows (``for_call``). Not with l2_flat (its L2 keeps the flat
        loop); split-K parts stay one per program. The fused launch ignores it.
    """

    programs: int = 0
    gemm_per_sm: int = 2
    l1_warps: int = 4
    l1_stages: int = 3
    l2_warps: int = 4
    l2_stages: int = 3
    copy_warps: int = 4
    hidden_chunk: int = 1024
    l1_block_n: int | None = None
    l1_block_k: int | None = None
    l2_block_n: int | None = None
    l2_block_k: int | None = None
    use_tma: bool | None = None
    wait: bool = True
    wave_blocks: int | None = None
    fused_per_sm: int = 1
    fused_l2_group: int = 1
    dispatch_tokens: int = 1
    dispatch_tile: int = 1
    chunk_blocks: int = 1
    dispatch_programs: int = 0
    combine_tile: int = 1
    combine_parts: int = 1
    combine_chunk: int | None = None
    combine_warps: int | None = None
    combine_per_sm: int = 4
    dispatch_eager: bool = False
    dispatch_parts: int = 1
    l1_group_m: int = 1
    l2_flat: bool = False
    l1_one_dot: bool = False
    l1_one_dot_stages: int | None = None
    l2_epilogue_split: int = 1
    l2_split_m: int = 1
    decode_rows: int = 0
    l1_tail_rows: int = 0
    l2_tail_rows: int = 0
    fp4w_rows: int = 64
    host_descriptors: bool | None = None
    l1_split_k: int = 1
    l2_split_k: int = 1
    gemm_claim: bool = False

    @classmethod
    def hopper(cls, block_m: int, dtype: str = "bf16", *, hidden: int,
               intermediate: int) -> "Tuning":
        """The layer's GPU defaults for a config of these dims (``MoEConfig.hidden`` and
        ``intermediate``), the tiles measured best on H200 (see docs/tuning.md), no waits (the
        staged path's stream order already completes every producer).
        block_m 128: L1 128x128x64, 8 warps, 4 stages (one program per SM). L2 128x256x64,
        8 warps, 4 stages, one program per SM, a flat loop (the next tile's loads overlap this
        tile's epilogue) and the epilogue in four quarters; where 256 does not divide hidden,
        a 128x128 tile (4 warps, 3 stages, two programs per SM).
        fp8: 128-wide L1 and L2 blocks (K steps of 128, one scale block each); L1 8 warps,
        3 stages. L2 where intermediate >= ``FP8_L2_TILE_MIN_I``: the 128-row tile, 8 warps,
        4 stages, the epilogue in two halves; at a shorter K (qwen3: 768) in 64-row pieces
        with 4 warps, 3 stages and a flat loop, two programs per SM (faster there than the
        tile). Smaller fp8 m-blocks keep the tile (the pieces were measured at block_m 128
        only).
        Dispatch: tickets of 4 source tokens with eager loads, as the fused launch's tasks.
        Combine with 8 warps (faster at dsv3 dims, equal elsewhere)."""
        copy = dict(dispatch_tile=4, dispatch_eager=True, wait=False, combine_warps=8)
        if dtype == "fp4w":   # pointer loads, 64-row pieces (benchmarks/quant_gemm.py)
            return cls(l1_warps=8, l1_stages=3, l2_warps=8, l2_stages=3, l1_block_n=128,
                       l2_block_n=128, fp4w_rows=min(64, block_m), **copy)
        if dtype == "fp8":
            if block_m >= 128 and intermediate < FP8_L2_TILE_MIN_I:
                return cls(l1_warps=8, l1_stages=3, l2_warps=4, l2_stages=3, l1_block_n=128,
                           l2_block_n=128, l2_epilogue_split=2, l2_split_m=2, l2_flat=True,
                           **copy)
            return cls(l1_warps=8, l1_stages=3, l2_warps=8, l2_stages=4, l1_block_n=128,
                       l2_block_n=128, l2_epilogue_split=2, **copy)
        if block_m >= 128:
            l2 = (dict(l2_block_n=256, l2_warps=8, l2_stages=4) if hidden % 256 == 0 else
                  dict(l2_block_n=128, l2_warps=4, l2_stages=3))
            return cls(l1_warps=8, l1_stages=4, l1_block_n=128, l1_block_k=64, l2_block_k=64,
                       l2_flat=True, l2_epilogue_split=4, **l2, **copy)
        return cls(l1_warps=4, l1_stages=4, l2_warps=4, l2_stages=4, l1_block_n=128,
                   l1_block_k=64, l2_block_n=128, l2_block_k=64, **copy)

    @classmethod
    def for_buffer(cls, buffer: SymmBuffer) -> "Tuning":
        """``hopper`` on GPUs; under the interpreter the config's tiles with waits on."""
        if buffer.device.type != "cuda":
            return cls()
        cfg = buffer.config
        return cls.hopper(cfg.block_m, cfg.dtype, hidden=cfg.hidden,
                          intermediate=cfg.intermediate)

    @classmethod
    def for_call(cls, buffer: SymmBuffer, tokens: int, *, decode: bool = True) -> "Tuning":
        """``for_buffer`` fitted to a call's size. ``tokens``: the most tokens any local rank
        passes in this call (peers are assumed to pass no more).

        Decode-sized calls (``decode_rows_for``; ``decode``, the staged path only) run both
        GEMMs in decode pieces with the weights as the MMA row operand (``Tuning.decode``;
        faster GEMMs at 16 rows per expert, fp8 most). Larger staged
        calls run tail pieces (``tail_rows_for``). bf16 L1 column blocks are narrowed when a
        call touches so few experts that 128-wide blocks leave SMs idle (each block then
        streams its weights alone). Large calls dispatch in tiles of 8 tokens
        (``DISPATCH_TILE8_PICKS``); L1 tickets walk groups of m-blocks where an m-block has
        many column blocks (``l1_group_m_for``). bf16 calls of at least 2 * block_m rows per
        expert compute the L1's gate and up as one MMA (``one_dot_for``). fp4w calls claim
        their GEMM tickets at every size (``gemm_claim``)."""
        t = cls.for_buffer(buffer)
        sms = _constants(buffer).sms
        if not sms:
            return t
        cfg = buffer.config
        dm = decode_rows_for(tokens=tokens, ranks=buffer.num_ranks, top_k=cfg.top_k,
                             num_experts=cfg.num_experts, block_m=cfg.block_m) if decode else 0
        if dm:
            t = t.decode(dm, cfg)
            if cfg.dtype == "fp8":
                t = replace(t, l1_split_k=fp8_l1_split_for(
                    tokens=tokens, top_k=cfg.top_k,
                    experts_per_rank=cfg.experts_per_rank(buffer.num_ranks),
                    l1_tiles_per_block=cfg.intermediate // t.l1_tile(cfg)[0],
                    programs=sms * t.gemm_per_sm))
            return t
        if decode:
            l1_tail, l2_tail = tail_rows_for(tokens=tokens, ranks=buffer.num_ranks,
                                             top_k=cfg.top_k, num_experts=cfg.num_experts,
                                             block_m=cfg.block_m, dtype=cfg.dtype,
                                             l2_split_m=t.l2_split_m)
            t = replace(t, l1_tail_rows=l1_tail, l2_tail_rows=l2_tail)
        if tokens * cfg.top_k >= DISPATCH_TILE8_PICKS:
            t = replace(t, dispatch_tile=8)
        if not cfg.fp8_tokens:   # fp8 / fp4w: a block quantizes 128 columns
            # under uniform routing a rank receives about tokens * top_k picks
            touched = min(cfg.experts_per_rank(buffer.num_ranks), max(1, tokens * cfg.top_k))
            bn = t.l1_tile(cfg)[0]
            while bn > 32 and touched * (cfg.intermediate // bn) < sms:
                bn //= 2
            t = replace(t, l1_block_n=bn,
                        l1_one_dot=one_dot_for(tokens=tokens, ranks=buffer.num_ranks,
                                               top_k=cfg.top_k, num_experts=cfg.num_experts,
                                               block_m=cfg.block_m),
                        l1_one_dot_stages=(ONE_DOT_L1_STAGES
                                           if cfg.hidden >= ONE_DOT_SHALLOW_MIN_HIDDEN
                                           else None))
        if cfg.dtype == "fp4w":   # its L1 is bound by the in-kernel decode, not by HBM:
            # grouping m-blocks is slower; a block costs a piece per 64 valid rows, so
            # claimed tickets balance the programs (in fp8 they do not pay)
            return replace(t, gemm_claim=True)
        return replace(t, l1_group_m=l1_group_m_for(cfg.intermediate // t.l1_tile(cfg)[0], sms))

    def decode(self, rows: int, cfg) -> "Tuning":
        """This tuning in decode pieces of ``rows`` (``decode_rows``) with their launch shapes,
        4 warps and 5 stages each: bf16 L1 blocks 64 wide, split-K in four or
        more parts where a call has few tiles (``l1_split_k``, ``l2_split_k``), tickets
        claimed (``gemm_claim``, every format), L1 and L2 two programs per SM (~100 KB of
        shared memory); fp8 L1 128 wide (one scale group) in 3 stages, so that two programs
        share an SM, L2 two; L2 blocks 128 wide. Dispatch moves each row in all its
        ``hidden_chunk`` chunks as separate tickets (``dispatch_parts``)."""
        parts = _row_chunks(cfg.token_bytes // 2, self.hidden_chunk)   # every chunk of a row
        if cfg.dtype == "fp4w":   # no decode pieces: 16-row pieces (fp16 warp MMAs, exact),
            # L1 with 4 warps, two programs per SM (faster at decode sizes)
            return replace(self, fp4w_rows=16, l1_warps=4, l1_stages=3, l2_warps=4,
                           l2_stages=3, l2_split_m=1, l2_flat=False, dispatch_parts=parts,
                           gemm_claim=True)
        if cfg.dtype == "fp8":   # l1_split_k: Tuning.for_call (fp8_l1_split_for)
            return replace(self, decode_rows=rows, l1_block_n=128, l1_warps=4, l1_stages=3,
                           l2_warps=4, l2_stages=5, l2_split_m=1, l2_flat=False,
                           dispatch_parts=parts, gemm_claim=True)
        l1n = 64 if cfg.intermediate % 64 == 0 else self.l1_block_n
        # L2 decode pieces 128 wide (two programs per SM): the 256-wide tile of ``hopper``
        # is no faster in decode and at 5 stages would hold an SM alone
        l2n = 128 if (self.l2_block_n or 0) > 128 else self.l2_block_n
        return replace(self, decode_rows=rows, l1_block_n=l1n, l1_warps=4, l1_stages=5,
                       l2_block_n=l2n, l2_warps=4, l2_stages=5, l2_split_m=1, l2_flat=False,
                       dispatch_parts=parts, l1_split_k=4, l2_split_k=4, gemm_claim=True)

    def for_fused(self, buffer: SymmBuffer, *, sms: int | None = None) -> "Tuning":
        """This tuning with the fused launch's GPU defaults (measured best on H200; see
        docs/tuning.md): 128-wide L2 blocks (the fused launch runs L2 with the
        L1's 8 warps), in bf16 two or more per L2 ticket where I <= 2048
        (``fused_l2_group_for``), one dispatch task per program moving 4 tokens at a time (8
        where this tuning has 8; decode pieces: 1, whole rows) with eager loads, combine
        tasks of 4 tokens, and in decode pieces two programs per SM and one expert wave.
        Unchanged under the interpreter (the tests choose their tilings).
        ``sms``: the GPU's SM count (default the buffer's device's; moestream.aot passes one to
        compile the GPU defaults)."""
        sms = sms or _constants(buffer).sms
        if not sms:
            return self
        cfg = buffer.config
        l2n = 128 if cfg.hidden % 128 == 0 else self.l2_tile(cfg)[0]
        # decode pieces: two programs per SM (~100 KB of shared memory each). Mixtral's L2 has
        # fewer blocks than that (4 experts x 32 column blocks of K = 14336 at EP2), but with
        # split-K L2 tiles two are faster there too
        per_sm = 1
        waves = self.wave_blocks
        # dispatch tiles of 4 tokens (faster than 1), or 8 where for_call picks them for large
        # calls
        tile, chunk = max(4, self.dispatch_tile), self.hidden_chunk
        # bf16 where the L2's K loop is short (I <= 2048), so that per-block costs (pipeline
        # fill, the wait for the stores before the count) weigh: L2 tickets of at least two
        # column blocks, and more until an m-block has at most 16 tickets (larger groups were
        # slower; mixtral, I = 14336, is not grouped: no gain there)
        group = fused_l2_group_for(cfg, l2n)
        if self.decode_rows:
            per_sm = 2
            # one wave: with a wave of one L1 block per SM, the programs past the first SMs'
            # worth take the wave's L2 tickets at once and spin until its L1 ends. A decode
            # call reuses nothing between its waves, and its combine tickets follow all GEMM
            # tickets anyway
            waves = ONE_WAVE
            # a decode dispatch task moves one or two tokens: one token at a time, each row
            # in one load (up to 8192 16-bit words) instead of one peer round trip per
            # 1024-word chunk, since L1 cannot start before the rows are in
            tile, chunk, group = 1, 8192, 1
        return replace(self, l2_block_n=l2n, fused_l2_group=group, dispatch_programs=sms,
                       dispatch_tile=tile, dispatch_eager=True, combine_tile=4, combine_chunk=512,
                       fused_per_sm=per_sm, wave_blocks=waves, hidden_chunk=chunk)

    def __post_init__(self):
        for name in ("dispatch_tokens", "dispatch_tile", "chunk_blocks", "dispatch_programs",
                     "gemm_per_sm", "dispatch_parts", "combine_per_sm",
                     "l1_group_m", "fused_per_sm", "combine_parts", "fused_l2_group"):
            v = getattr(self, name)
            low = 0 if name == "dispatch_programs" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"Tuning.{name} must be an int >= {low}, got {v!r}")
        for name in ("dispatch_tile", "combine_tile", "copy_warps", "combine_warps",
                     "hidden_chunk", "combine_chunk"):
            v = getattr(self, name)
            if v is None and name in ("combine_warps", "combine_chunk"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"Tuning.{name} must be a power of two, got {v!r}")
        for name in ("copy_warps", "combine_warps"):
            if (getattr(self, name) or 1) > 16:
                raise ValueError(f"Tuning.{name} must be at most 16 (warps of one program), "
                                 f"got {getattr(self, name)!r}")
        if self.host_descriptors is not None and type(self.host_descriptors) is not bool:
            raise ValueError(f"Tuning.host_descriptors must be None (while capturing a CUDA "
                             f"graph), True or False, got {self.host_descriptors!r}")
        v = self.l1_one_dot_stages
        if v is not None and (type(v) is not int or not 1 <= v <= 8):
            raise ValueError(f"Tuning.l1_one_dot_stages must be None (l1_stages) or an int in "
                             f"1..8, got {v!r}")
        for name in ("l2_flat", "l1_one_dot", "gemm_claim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Tuning.{name} must be a bool, got {getattr(self, name)!r}")
        if type(self.l2_split_m) is not int or self.l2_split_m not in (1, 2):
            raise ValueError(f"Tuning.l2_split_m must be 1 or 2, got {self.l2_split_m!r}")
        for name in ("l1_split_k", "l2_split_k"):
            v = getattr(self, name)
            if type(v) is not int or v not in (1, 4, 8, 16):
                raise ValueError(f"Tuning.{name} must be 1 (off), 4, 8 or 16, got {v!r}")
        if type(self.fp4w_rows) is not int or self.fp4w_rows not in (16, 32, 64, 128, 256):
            raise ValueError(f"Tuning.fp4w_rows must be 16, 32, 64, 128 or 256, got "
                             f"{self.fp4w_rows!r}")
        if type(self.decode_rows) is not int or self.decode_rows not in (0, 16, 32):
            raise ValueError(f"Tuning.decode_rows must be 0 (off), 16 or 32, got "
                             f"{self.decode_rows!r}")
        for name in ("l1_tail_rows", "l2_tail_rows"):
            v = getattr(self, name)
            if type(v) is not int or v not in (0, 16, 32):
                raise ValueError(f"Tuning.{name} must be 0 (off), 16 or 32, got {v!r}")
        if type(self.l2_epilogue_split) is not int or self.l2_epilogue_split not in (1, 2, 4):
            raise ValueError(f"Tuning.l2_epilogue_split must be 1, 2 or 4, got "
                             f"{self.l2_epilogue_split!r}")

    def with_granularity(self, granularity: "int | str", block_m: int) -> "Tuning":
        """This tuning in a streaming mode of the fused launch (see ``mega_moe``):

        "token"   dispatch tasks of one token; an L1 block waits for its own m-block only.
        C (int)   chunked, DeepEP-normal style: dispatch tasks of C source tokens, and an L1
                  block waits for the whole chunk of C rows (C / block_m m-blocks) of its
                  expert. C must be a positive multiple of block_m.
        "expert"  an L1 block waits for every row of its expert; dispatch tasks of
                  EXPERT_CHUNK_TOKENS source tokens.
        Chunked modes fix the dispatch task size (dispatch_programs is turned off), so
        resolving a resolved tuning again changes nothing.
        """
        if granularity == "token":
            return self
        if granularity == "expert":
            return replace(self, chunk_blocks=EXPERT_CHUNK_BLOCKS, dispatch_programs=0,
                           dispatch_tokens=EXPERT_CHUNK_TOKENS, dispatch_tile=CHUNK_TILE)
        if isinstance(granularity, bool) or not isinstance(granularity, int) \
                or granularity < block_m or granularity % block_m:
            raise ValueError(f"granularity must be 'token', 'expert' or a positive multiple "
                             f"of block_m={block_m} (tokens per chunk), got {granularity!r}")
        return replace(self, chunk_blocks=granularity // block_m, dispatch_tokens=granularity,
                       dispatch_tile=min(CHUNK_TILE, next_pow2(granularity)),
                       dispatch_programs=0)

    def l1_tile(self, cfg) -> tuple[int, int]:
        """(block_n, block_k) of L1. fp8 / fp4w: block_k is the scale block (128), and a block
        re-quantizes whole 128-column groups, so block_n is 128 (default) or 256."""
        if cfg.fp8_tokens:
            bn = self.l1_block_n or 128
            if bn not in (128, 256) or cfg.intermediate % bn:
                raise ValueError(f"fp8 needs Tuning.l1_block_n 128 or 256 dividing "
                                 f"intermediate={cfg.intermediate}, got {bn}")
            return bn, FP8_GROUP
        return _tile("l1", self.l1_block_n or cfg.block_n, self.l1_block_k or cfg.block_k,
                     n=("intermediate", cfg.intermediate), k=("hidden", cfg.hidden))

    def l2_tile(self, cfg) -> tuple[int, int]:
        """(block_n, block_k) of L2 (fp8 / fp4w: block_k is the scale block, 128)."""
        if cfg.fp8_tokens:
            return _tile("l2", self.l2_block_n or 128, FP8_GROUP, n=("hidden", cfg.hidden),
                         k=("intermediate", cfg.intermediate))
        return _tile("l2", self.l2_block_n or cfg.block_n, self.l2_block_k or cfg.block_k,
                     n=("hidden", cfg.hidden), k=("intermediate", cfg.intermediate))

    def fp4w_pieces(self, cfg) -> int:
        """Rows per piece of an fp4w block (fp4w_rows, at most block_m; both powers of two, so
        it divides block_m; 0 in other modes)."""
        if cfg.dtype != "fp4w":
            return 0
        return min(self.fp4w_rows, cfg.block_m)

    def check(self, cfg) -> None:
        """Every config-dependent rule of this tuning (ValueError), so that a staged call
        fails before its first launch rather than between stages."""
        self.l1_tile(cfg)
        self.l2_tile(cfg)
        self.decode_pieces(cfg)
        self.tail_pieces(cfg, "l1")
        self.tail_pieces(cfg, "l2")
        self.fp4w_pieces(cfg)

    def decode_pieces(self, cfg) -> int:
        """decode_rows checked against the config (0: off)."""
        dm = self.decode_rows
        if dm and cfg.block_m % dm:
            raise ValueError(f"Tuning.decode_rows={dm} must divide block_m={cfg.block_m}")
        return dm

    def tail_pieces(self, cfg, gemm: str) -> int:
        """l1_tail_rows / l2_tail_rows (``gemm`` "l1" / "l2") checked against the config: the
        rows of a tail piece, 0 where tail pieces do not apply (off, decode_rows set, fp4w)."""
        dm = self.l1_tail_rows if gemm == "l1" else self.l2_tail_rows
        if not dm or self.decode_rows or cfg.dtype == "fp4w":
            return 0
        piece = cfg.block_m // (self.l2_split_m if gemm == "l2" else 1)
        if piece % dm:
            raise ValueError(f"Tuning.{gemm}_tail_rows={dm} must divide the {gemm.upper()} row "
                             f"piece of {piece} rows (block_m={cfg.block_m}"
                             + (f", l2_split_m={self.l2_split_m})" if gemm == "l2" else ")"))
        return dm

    def tma(self, buffer: SymmBuffer) -> bool:
        return _constants(buffer).hopper if self.use_tma is None else self.use_tma


@dataclass(frozen=True)
class _Constants:
    """Per-buffer launch arguments, computed once (the forward path stays light on Python)."""

    off: dict
    R: int
    E_LOC: int
    R_PAD: int
    E_PAD: int
    K_PAD: int
    P: int
    reset_words: int
    row_words: int      # 16-bit words per token row that dispatch copies (bf16: H)
    sms: int
    hopper: bool


def _constants(buffer: SymmBuffer) -> _Constants:
    c = getattr(buffer, "_launch_constants", None)
    if c is None:
        cfg = buffer.config
        R = buffer.num_ranks
        e_loc = cfg.experts_per_rank(R)
        cuda = buffer.device.type == "cuda"
        props = torch.cuda.get_device_properties(buffer.device) if cuda else None
        c = _Constants(off=buffer.offsets(), R=R, E_LOC=e_loc, R_PAD=next_pow2(R),
                       E_PAD=next_pow2(e_loc), K_PAD=next_pow2(cfg.top_k),
                       P=cfg.pool_capacity(R),
                       reset_words=buffer.layout.reset_span[1] // 4,
                       row_words=cfg.token_bytes // 2,
                       sms=props.multi_processor_count if cuda else 0,
                       hopper=bool(cuda and props.major >= 9))
        buffer._launch_constants = c
    return c


# Tuning.wave_blocks that puts every expert of a call in one wave (an int32 in the kernels)
ONE_WAVE = 1 << 30


def wave_blocks(buffer: SymmBuffer) -> int:
    """L1 blocks that close an expert wave: enough to occupy every SM (8 under the
    interpreter, so small test calls still form several waves)."""
    return _constants(buffer).sms or 8


def _tma_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    # scratch for tensor descriptors built on the device
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator(use_tma: bool) -> None:
    if use_tma and not INTERPRET:
        from triton.runtime import _allocation
        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            triton.set_allocator(_tma_allocator)


# (kernel, constexprs and launch options, device) -> programs of it one SM holds at once
_RESIDENT: dict = {}


def resident_per_sm(*, registers: int, shared_bytes: int, warps: int, sm_registers: int = 65536,
                    sm_shared_bytes: int = 233472, sm_threads: int = 2048,
                    block_reserved_bytes: int = 1024, max_blocks: int = 32) -> int:
    """Programs (thread blocks) of a compiled kernel that one SM runs at once: the least of what
    its registers (allocated per warp in units of 256), shared memory (plus the 1 KB the
    hardware reserves per block) and threads allow. Defaults: Hopper (sm_90)."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = sm_registers // max(regs_per_warp * warps, 1)
    by_shared = sm_shared_bytes // (shared_bytes + block_reserved_bytes)
    by_threads = sm_threads // (32 * warps)
    return max(0, min(by_regs, by_shared, by_threads, max_blocks))


def _programs(buffer: SymmBuffer, tuning: Tuning, per_sm: int, kernel=None, args=(),
              kw=None) -> int:
    """Persistent programs per local rank: ``tuning.programs``, else ``per_sm`` per SM, capped
    at what one SM holds of the compiled ``kernel`` at once. Programs beyond that would wait
    for a whole earlier program to end and then walk their tickets in a second pass, which
    splits the tiles that share an expert's weights in the L2 cache into two far-apart passes
    (measured slower, fp8 L2 most)."""
    if tuning.programs:
        return tuning.programs
    c = _constants(buffer)
    if not c.sms:
        # the interpreter runs programs one after another: 2 still walks the persistent loops
        return 2
    if kernel is not None and not INTERPRET:
        key = (kernel, tuple(sorted((kw or {}).items())), buffer.device.index)
        fit = _RESIDENT.get(key)
        if fit is None:
            compiled = kernel.warmup(*args, grid=(1,), **(kw or {}))
            compiled._init_handles()
            props = torch.cuda.get_device_properties(buffer.device)
            fit = resident_per_sm(registers=compiled.n_regs, shared_bytes=compiled.metadata.shared,
                                  warps=compiled.metadata.num_warps,
                                  sm_registers=props.regs_per_multiprocessor,
                                  sm_shared_bytes=props.shared_memory_per_multiprocessor,
                                  sm_threads=props.max_threads_per_multi_processor)
            _RESIDENT[key] = fit = max(fit, 1)
        per_sm = min(per_sm, fit)
    return c.sms * per_sm


def _launch_kw(warps: int, stages: int | None = None) -> dict:
    if INTERPRET:
        return {}
    kw = dict(num_warps=warps)
    if stages is not None:
        kw["num_stages"] = stages
    return kw


def pick_slots(topk_idx: torch.Tensor, num_experts: int, *,
               tuning: Tuning = Tuning()) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing.source_slots`` (counts [E] int32, slot [T, K] int32) in one kernel launch
    (``kernels/dispatch.source_slots_kernel``) instead of a dozen torch ops with a sort, which
    cost tens of µs of GPU time per call at small T. The
    publish launch runs the same numbering (``kernels/dispatch.number_picks``) in programs of
    its own, straight into the buffer; this standalone form serves tests and callers that
    want the slots as tensors. ``topk_idx`` must be contiguous."""
    T, K = topk_idx.shape
    counts = torch.empty(num_experts, dtype=torch.int32, device=topk_idx.device)
    slot = torch.empty(T, K, dtype=torch.int32, device=topk_idx.device)
    n = T * K
    _dispatch.source_slots_kernel[(num_experts + 1,)](
        topk_idx, slot, counts, n, num_experts, BLOCK=min(max(next_pow2(max(n, 1)), 128), 4096),
        **_launch_kw(tuning.copy_warps))
    return counts, slot


def publish(buffer: SymmBuffer, local: int, x: torch.Tensor, topk_idx: torch.Tensor,
            topk_weights: torch.Tensor, *, tuning: Tuning = Tuning()) -> None:
    """Copy one local rank's inputs into the next parity of its buffer, number its picks
    (``routing.source_slots``), zero its counters, then signal the peers (epoch += 1,
    ready = epoch), all in one launch. Inputs must already be validated (contiguous topk
    tensors, x rows with unit stride)."""
    cfg = buffer.config
    c = _constants(buffer)
    off = c.off
    T = x.shape[0]
    BT = 8
    copy = max(cdiv(T, BT), cdiv(c.reset_words, 16384), 1)
    n = T * cfg.top_k
    _dispatch.publish_kernel[(copy + cfg.num_experts + 1,)](
        buffer.table, buffer.global_rank(local), buffer.address(local), x, topk_idx, topk_weights,
        T, x.stride(0) if T else cfg.hidden, cfg.max_tokens_per_rank, cfg.hidden,
        cfg.token_bytes, copy, off["off_epoch"], off["off_ready"], off["off_published"],
        off["off_diag"], off["off_num_tokens"], off["off_send_counts"],
        off["off_x"], off["off_topk_idx"], off["off_topk_weights"], off["off_slot"],
        off["off_reset"], c.reset_words,
        E=cfg.num_experts, K=cfg.top_k, K_PAD=c.K_PAD, BT=BT,
        BH=min(next_pow2(cfg.hidden), 512), BZ=1024,
        BLOCK=min(max(next_pow2(max(n, 1)), 128), 4096), QUANT=cfg.fp8_tokens,
        FIX_ROUNDING=INTERPRET, HOST_BASE=True, PEER_SCOPE=buffer.peer_scope, **_launch_kw(tuning.copy_warps))


def layout(buffer: SymmBuffer, *, tuning: Tuning = Tuning(), waves: bool = False) -> None:
    """Every local rank's pool layout of this call, after its peers' ready flags; ``waves``:
    also the expert waves (the fused launch walks them; the staged launches do not)."""
    c = _constants(buffer)
    off = c.off
    cfg = buffer.config
    _dispatch.layout_kernel[(buffer.local_ranks,)](
        buffer.table, buffer.rank0, buffer.max_spins, buffer.timeout_ns, buffer.host_base or 0,
        off["off_epoch"], off["off_ready"], off["off_diag"], off["off_send_counts"],
        off["off_num_tokens"], off["off_expert_count"], off["off_block_start"],
        off["off_src_row"], off["off_src_tokens"], off["off_block_meta"], off["off_wave_mb"],
        off["off_num_waves"], c.R, c.E_LOC, cfg.block_m,
        cfg.intermediate // tuning.l1_tile(cfg)[0], tuning.wave_blocks or wave_blocks(buffer),
        R_PAD=c.R_PAD, E_PAD=c.E_PAD, BLOCK_J=8, USE_TIMER=not INTERPRET, WAVES=waves,
        HOST_BASE=buffer.host_base is not None, STREAM=stream_ordered(buffer, tuning))


def _row_chunk(words: int, hidden_chunk: int) -> int:
    """16-bit words of a row of ``words`` that dispatch moves per load (its BH)."""
    return min(next_pow2(words), hidden_chunk)


def _row_chunks(words: int, hidden_chunk: int) -> int:
    """Loads of ``_row_chunk`` words that move one row."""
    return cdiv(words, _row_chunk(words, hidden_chunk))


def dispatch_parts(buffer: SymmBuffer, tuning: Tuning) -> int:
    """Parts of a row the staged dispatch moves as separate tickets (``Tuning.dispatch_parts``,
    at most one per row chunk); the L1 waits for valid_m times this many arrivals."""
    return min(tuning.dispatch_parts, _row_chunks(_constants(buffer).row_words,
                                                  tuning.hidden_chunk))


def dispatch(buffer: SymmBuffer, *, tuning: Tuning = Tuning()) -> None:
    cfg = buffer.config
    c = _constants(buffer)
    off = c.off
    grid = (_programs(buffer, tuning, 4), buffer.local_ranks)
    _dispatch.dispatch_kernel[grid](
        buffer.table, buffer.rank0, buffer.host_base or 0,
        off["off_epoch"], off["off_diag"], off["off_src_row"], off["off_src_tokens"],
        off["off_arrival"], off["off_x"], off["off_topk_idx"], off["off_topk_weights"],
        off["off_slot"], off["off_pool_x"], off["off_pool_src"], off["off_pool_weight"],
        cfg.max_tokens_per_rank, c.row_words, c.R, c.E_LOC, cfg.block_m, c.P,
        dispatch_parts(buffer, tuning), K=cfg.top_k, K_PAD=c.K_PAD, R_PAD=c.R_PAD,
        BH=_row_chunk(c.row_words, tuning.hidden_chunk), TT=tuning.dispatch_tile,
        EAGER=tuning.dispatch_eager, SIGNAL=tuning.wait, HOST_BASE=buffer.host_base is not None, **_launch_kw(tuning.copy_warps))


def _weight_tables(buffer: SymmBuffer, ws: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) address tables of the local ranks' weights: bf16 tensors, fp8
    (values, scale_inv) or fp4w (packed, scales) pairs (the scale table is the value table in
    bf16 mode, unused)."""
    if buffer.config.fp8_tokens:
        return (buffer.weight_table([w[0] for w in ws]),
                buffer.weight_table([w[1] for w in ws]))
    tab = buffer.weight_table(ws)
    return tab, tab


def _capturing(buffer: SymmBuffer) -> bool:
    """Whether the launches on ``buffer``'s device are being captured into a CUDA graph."""
    return buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def host_descriptors(buffer: SymmBuffer, tuning: Tuning, tma: bool, *, region: str,
                     cols: int, w: torch.Tensor, w_shape: tuple, a_rows: tuple,
                     block_n: int, block_k: int) -> tuple[tuple, dict]:
    """The tensor descriptors a GEMM kernel (staged, or the fused launch's blocks) would
    build in every program, built on the host where it may take them
    (``Tuning.host_descriptors`` True, or None while a CUDA graph is being captured; ``tma``;
    one local rank): ``((ad0, ad1, wd), {"HOST_DESC": True})``, else
    ``((None, None, None), {})``.

    A: the pool ``region`` (``pool_x`` / ``pool_act``: [P, cols] bf16, or the fp8 layer's byte
    rows read as e4m3) in tiles of ``a_rows[i]`` rows (one entry for whole tiles, two for
    decode pieces), ``block_k`` columns. Weights: ``w`` (bf16, or fp8 values) seen as
    ``w_shape`` in tiles of ``block_n`` x ``block_k`` (a leading 2 where w_shape is 3-D: the
    L1's gate and up rows as one tile)."""
    on = tuning.host_descriptors
    if on is None:
        on = _capturing(buffer)
    if not (tma and on and buffer.local_ranks == 1):
        return (None, None, None), {}
    from triton.tools.tensor_descriptor import TensorDescriptor
    a = buffer.view(region, 0)
    if buffer.config.fp8_tokens:
        a = a.view(torch.float8_e4m3fn)   # the byte rows: values first, scales after them
    a_descs = [TensorDescriptor(a, [a.shape[0], cols], [a.stride(0), 1], [rows, block_k])
               for rows in a_rows]
    w_v = w.view(w_shape)   # a view: the kernel reads w itself (the layer checks contiguity)
    w_desc = TensorDescriptor.from_tensor(
        w_v, ([2] if len(w_shape) == 3 else []) + [block_n, block_k])
    return (a_descs[0], a_descs[-1] if len(a_rows) > 1 else None, w_desc), {"HOST_DESC": True}


def _a_rows(cfg, tile_rows: int, dm: int, second: int) -> tuple:
    """Rows of the A tiles a staged GEMM loads (``host_descriptors``' a_rows): whole tiles
    of ``tile_rows``, or in decode pieces (dm > 0; ``kernels/gemm.decode_descriptors``) dm
    rows and the wide piece: ``second`` rows for tail pieces, else DECODE_WIDE or block_m if
    smaller."""
    if not dm:
        return (tile_rows,)
    return (dm, second if second else min(32, cfg.block_m))   # DECODE_WIDE


def _split_scratch(buffer: SymmBuffer, tuning: Tuning, gemm: str, split: int,
                   part_shape: tuple, per_sm: int | None = None) -> tuple:
    """(sums, counts) of a split-K GEMM (``l1_split_k``, ``l2_split_k``; ``gemm`` names
    them: l1, l2, fused_l2): fp32 partial sums of ``part_shape`` and an int32 count (zero
    between calls) for up to every program of every local rank (``per_sm``: programs per SM
    asked for, default ``gemm_per_sm``); the buffer's table as placeholders when the launch
    does not split."""
    if split == 1:
        return buffer.table, buffer.table
    most = buffer.local_ranks * _programs(buffer, tuning, per_sm or tuning.gemm_per_sm)
    return (buffer.scratch(f"{gemm}_split_sums", (most, *part_shape), torch.float32),
            buffer.scratch(f"{gemm}_split_counts", (most,), torch.int32))


def l1(buffer: SymmBuffer, w13s: Sequence, *, tuning: Tuning = Tuning()) -> None:
    """w13s: per local rank, w13 [E/R, 2I, H] bf16, or in fp8 mode (values, scale_inv), in
    fp4w mode (packed, scales)."""
    cfg = buffer.config
    c = _constants(buffer)
    off = c.off
    bn, bk = tuning.l1_tile(cfg)
    fp8 = cfg.fp8_tokens
    w4 = tuning.fp4w_pieces(cfg)
    tail = tuning.tail_pieces(cfg, "l1")
    dm = 0 if w4 else (tuning.decode_pieces(cfg) or tail)
    # fp8 L1: pointer loads (its descriptor form spills in the K loop and is slower), except
    # in decode and tail pieces, whose accumulators are small; fp4w: pointer loads
    tma = tuning.tma(buffer) and (not fp8 or dm > 0) and not w4
    _ensure_allocator(tma)
    whole = not fp8 and not dm and not w4   # bf16 whole tiles
    one_dot = tuning.l1_one_dot and tma and whole
    E_LOC, H, I = c.E_LOC, cfg.hidden, cfg.intermediate
    descs, host_kw = host_descriptors(
        buffer, tuning, tma, region="pool_x", cols=H, w=w13s[0][0] if fp8 else w13s[0],
        w_shape=(E_LOC * 2, I, H) if one_dot else (E_LOC * 2 * I, H),
        a_rows=_a_rows(cfg, cfg.block_m, dm, cfg.block_m if tail else 0), block_n=bn,
        block_k=bk)
    split = tuning.l1_split_k if dm and not tail and cfg.dtype in ("bf16", "fp8") else 1
    sums, counts = _split_scratch(buffer, tuning, "l1", split, (2, bn, dm))
    # the host's base in decode pieces only: whole tiles are slower with it, and there a
    # program's first loads weigh nothing
    host_base = buffer.host_base if dm and not tail else None
    args = (buffer.table, buffer.rank0, *_weight_tables(buffer, w13s), host_base or 0,
            buffer.max_spins, buffer.timeout_ns,
            off["off_epoch"], off["off_diag"], off["off_block_start"], off["off_block_meta"],
            off["off_arrival"], off["off_l1_done"], off["off_pool_x"], off["off_pool_weight"],
            off["off_pool_act"], off["off_gemm_claims"], H, I, E_LOC, c.P, cfg.token_bytes,
            cfg.act_bytes, dispatch_parts(buffer, tuning), *descs, sums, counts)
    kw = dict(BM=cfg.block_m, BN=bn, BK=bk, UPCAST=INTERPRET, USE_TMA=tma, WAIT=tuning.wait,
              USE_TIMER=not INTERPRET, FP8=fp8, DM=dm, W4=w4, TAIL=tail > 0, SIGNAL=tuning.wait,
              GROUP_M=tuning.l1_group_m, ONE_DOT=one_dot, SPLIT_K=split,
              CLAIM=tuning.gemm_claim, HOST_BASE=host_base is not None, **host_kw,
              **_launch_kw(tuning.l1_warps, (one_dot and tuning.l1_one_dot_stages)
                           or tuning.l1_stages))
    grid = (_programs(buffer, tuning, tuning.gemm_per_sm, _gemm.l1_kernel, args, kw),
            buffer.local_ranks)
    _gemm.l1_kernel[grid](*args, **kw)


def l2(buffer: SymmBuffer, w2s: Sequence, *, tuning: Tuning = Tuning()) -> None:
    """w2s: per local rank, w2 [E/R, H, I] bf16, or in fp8 mode (values, scale_inv), in fp4w
    mode (packed, scales)."""
    cfg = buffer.config
    c = _constants(buffer)
    off = c.off
    bn, bk = tuning.l2_tile(cfg)
    fp8 = cfg.fp8_tokens
    w4 = tuning.fp4w_pieces(cfg)
    tma = tuning.tma(buffer) and not w4
    tail = tuning.tail_pieces(cfg, "l2")
    dm = 0 if w4 else (tuning.decode_pieces(cfg) or tail)
    # row pieces inside a block (fp4w_pieces checks the signal); tail pieces keep the tiles
    pieces = (dm and not tail) or w4
    split_m = 1 if pieces else tuning.l2_split_m
    _ensure_allocator(tma)
    E_LOC, H, I = c.E_LOC, cfg.hidden, cfg.intermediate
    bmt = cfg.block_m // split_m
    descs, host_kw = host_descriptors(
        buffer, tuning, tma, region="pool_act", cols=I, w=w2s[0][0] if fp8 else w2s[0],
        w_shape=(E_LOC * H, I), a_rows=_a_rows(cfg, bmt, dm, bmt if tail else 0),
        block_n=bn, block_k=bk)
    split = tuning.l2_split_k if dm and not tail and cfg.dtype == "bf16" else 1
    sums, counts = _split_scratch(buffer, tuning, "l2", split, (dm, bn))
    args = (buffer.table, buffer.rank0, *_weight_tables(buffer, w2s), buffer.host_base or 0,
            buffer.max_spins, buffer.timeout_ns,
            off["off_epoch"], off["off_diag"], off["off_block_start"], off["off_block_meta"],
            off["off_l1_done"], off["off_l2_done"], off["off_pool_act"], off["off_pool_src"],
            off["off_combine_y"], off["off_combine_flag"], off["off_l2_programs"],
            off["off_l2_ranks_done"], off["off_gemm_claims"] + 16,   # the L2's row
            H, I, E_LOC, cfg.max_tokens_per_rank,
            I // tuning.l1_tile(cfg)[0], c.P, c.R, c.R_PAD, cfg.act_bytes, *descs, sums, counts)
    flat = tuning.l2_flat and not tuning.wait and not pieces
    kw = dict(K=cfg.top_k, BM=cfg.block_m, BN=bn, BK=bk, UPCAST=INTERPRET, USE_TMA=tma,
              WAIT=tuning.wait, USE_TIMER=not INTERPRET, FP8=fp8, FLAT=flat,
              CLAIM=tuning.gemm_claim and not flat,
              EPI_SPLIT=tuning.l2_epilogue_split, SPLIT_M=split_m,
              DM=dm, W4=w4, TAIL=tail > 0, SPLIT_K=split, HOST_BASE=buffer.host_base is not None,
              PEER_SCOPE=buffer.peer_scope,
              STREAM=l2_stream(buffer, tuning), **host_kw,
              **_launch_kw(tuning.l2_warps, tuning.l2_stages))
    grid = (_programs(buffer, tuning, tuning.gemm_per_sm, _gemm.l2_kernel, args, kw),
            buffer.local_ranks)
    _gemm.l2_kernel[grid](*args, **kw)


def stream_ordered(buffer: SymmBuffer, tuning: Tuning) -> bool:
    """Whether a staged launch may take what earlier launches of the call wrote without a
    signal: every rank's buffer is on this GPU (``SymmBuffer.one_device``: virtual ranks, or a
    group of one), so one process launches each stage for every rank on one stream before
    the next stage, and the tuning relies on stream order (``wait`` off, the GPU defaults).
    Then the layout waits for no peer's ready flag and, with the rank signal ("rank"), the
    L2 counts and releases nothing and the combine waits for nothing (``l2_stream``: saves
    one acquire per peer at the start of the layout, one acq_rel count per program and the
    last program's release at the end of the L2, one flag wait at the start of the combine).
    Across GPUs the signals stay: another GPU's launches are not ordered by this stream."""
    return buffer.one_device and not tuning.wait


def l2_stream(buffer: SymmBuffer, tuning: Tuning) -> bool:
    """The L2 signals nothing and the combine waits for nothing (``stream_ordered`` with the
    rank signal; per-row flags keep their flags)."""
    return stream_ordered(buffer, tuning)


def combine(buffer: SymmBuffer, y: torch.Tensor, *, tuning: Tuning = Tuning()) -> None:
    """y: [local ranks, T, H] bf16 (or [T, H] for one local rank); row stride may exceed H.
    ``tuning`` must be the one this call's L2 ran with: it decides whether the L2 signalled
    (``l2_stream``); a combine that waits for a signal the L2 did not
    send gives up at the buffer's timeout and records the stall (``SymmBuffer.check`` then
    raises ``KernelStallError``)."""
    cfg = buffer.config
    c = _constants(buffer)
    off = c.off
    y3 = y if y.dim() == 3 else y.unsqueeze(0)
    assert y3.shape[0] == buffer.local_ranks and y3.stride(2) == 1
    grid = (_programs(buffer, tuning, tuning.combine_per_sm), buffer.local_ranks)
    _combine.combine_kernel[grid](
        buffer.table, buffer.rank0, buffer.max_spins, buffer.timeout_ns, buffer.host_base or 0,
        y3, y3.stride(0), y3.stride(1),
        off["off_epoch"], off["off_diag"], off["off_num_tokens"], off["off_topk_idx"],
        off["off_combine_y"], off["off_combine_flag"], off["off_l2_ranks_done"],
        cfg.max_tokens_per_rank, cfg.hidden, cfg.num_experts, c.R,
        K=cfg.top_k, K_PAD=c.K_PAD,
        BH=min(next_pow2(cfg.hidden), tuning.combine_chunk or tuning.hidden_chunk),
        FIX_ROUNDING=INTERPRET, USE_TIMER=not INTERPRET,
        HOST_BASE=buffer.host_base is not None, STREAM=l2_stream(buffer, tuning),
        **_launch_kw(tuning.combine_warps or tuning.copy_warps))


def run_staged(buffer: SymmBuffer, xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
               topk_weights: Sequence[torch.Tensor], w13s: Sequence[torch.Tensor],
               w2s: Sequence[torch.Tensor], y: torch.Tensor, *,
               tuning: Tuning | None = None,
               on_stage: Callable[[str], None] | None = None) -> None:
    """All stages for every local rank; y [local ranks, T_out, H] receives the outputs.
    ``on_stage(name)``, if given, is called after each stage's launches are queued (names:
    ``STAGES``), e.g. to record CUDA events between them (``bench_ep.stage_times``)."""
    tuning = tuning or Tuning.for_call(buffer, max(x.shape[0] for x in xs))
    tuning.check(buffer.config)
    mark = on_stage or (lambda name: None)
    for lr in range(buffer.local_ranks):
        publish(buffer, lr, xs[lr], topk_idxs[lr], topk_weights[lr], tuning=tuning)
    mark("publish")
    layout(buffer, tuning=tuning)
    mark("layout")
    dispatch(buffer, tuning=tuning)
    mark("dispatch")
    l1(buffer, w13s, tuning=tuning)
    mark("l1")
    l2(buffer, w2s, tuning=tuning)
    mark("l2")
    combine(buffer, y, tuning=tuning)
    mark("combine")


# the staged path's launches in order (run_staged's on_stage names)
STAGES = ("publish", "layout", "dispatch", "l1", "l2", "combine")


def fused_min_split(cfg) -> int:
    """Fewest split-K parts of the fused launch's L2 tiles (``kernels/gemm.split_count``'s
    MIN_S): 2 where the L2's K loop is long (intermediate >= 8192: mixtral's 14336, whose
    1-token call has 64 L2 tiles on 132 programs), else 4 (two parts of a short K loop are
    slower than none)."""
    return 2 if cfg.intermediate >= 8192 else 4


def max_tickets(buffer: SymmBuffer, tuning: Tuning) -> int:
    """Most tickets one fused launch can hand out (sizes a trace buffer)."""
    cfg = buffer.config
    nb12 = (cfg.intermediate // tuning.l1_tile(cfg)[0]
            + cfg.hidden // tuning.l2_tile(cfg)[0] // tuning.fused_l2_group)
    T = cfg.max_tokens_per_rank
    per_rank = (buffer.num_ranks * T + cdiv(T, tuning.combine_tile) * tuning.combine_parts
                + cfg.max_m_blocks(buffer.num_ranks) * nb12)
    if tuning.l2_split_k > 1 and tuning.decode_pieces(cfg) and cfg.dtype == "bf16":
        # split-K parts: a split launch's L2 tiles x parts are at most its programs
        per_rank += _programs(buffer, tuning, tuning.fused_per_sm)
    return buffer.local_ranks * per_rank


def fused(buffer: SymmBuffer, w13s: Sequence[torch.Tensor], w2s: Sequence[torch.Tensor],
          y: torch.Tensor, *, tuning: Tuning = Tuning(), trace: torch.Tensor | None = None
          ) -> None:
    """Dispatch, L1, L2 and combine of every local rank in one persistent launch (after
    publish and layout). ``trace``: optional int64 [max_tickets, 8] filled per ticket
    (see kernels/fused.py)."""
    cfg = buffer.config
    c = _constants(buffer)
    off = c.off
    if cfg.dtype == "fp4w":
        raise ValueError("MoEConfig dtype 'fp4w' runs on the staged path only (impl='staged')")
    bn1, bk1 = tuning.l1_tile(cfg)
    bn2, bk2 = tuning.l2_tile(cfg)
    fp8 = cfg.dtype == "fp8"
    dm = tuning.decode_pieces(cfg)
    group = tuning.fused_l2_group
    if group > 1 and dm:
        raise ValueError(f"Tuning.fused_l2_group={group} needs whole L2 tiles: use 1 with "
                         f"decode_rows={dm} (decode pieces)")
    if (cfg.hidden // bn2) % group:
        raise ValueError(f"Tuning.fused_l2_group={group} must divide the L2's "
                         f"{cfg.hidden // bn2} column blocks (hidden={cfg.hidden} / l2 "
                         f"block_n={bn2})")
    # fp8 whole tiles load by pointer (as the staged fp8 L1), decode pieces by descriptor
    tma = tuning.tma(buffer) and (not fp8 or dm > 0)
    _ensure_allocator(tma)
    y3 = y if y.dim() == 3 else y.unsqueeze(0)
    assert y3.shape[0] == buffer.local_ranks and y3.stride(2) == 1
    nloc = buffer.local_ranks
    w13_tab, w13s_tab = _weight_tables(buffer, w13s)
    w2_tab, w2s_tab = _weight_tables(buffer, w2s)
    E_LOC, H, I = c.E_LOC, cfg.hidden, cfg.intermediate
    rows = _a_rows(cfg, cfg.block_m, dm, 0)
    descs1, host_kw = host_descriptors(
        buffer, tuning, tma, region="pool_x", cols=H, w=w13s[0][0] if fp8 else w13s[0],
        w_shape=(E_LOC * 2 * I, H), a_rows=rows, block_n=bn1, block_k=bk1)
    descs2, _ = host_descriptors(
        buffer, tuning, tma, region="pool_act", cols=I, w=w2s[0][0] if fp8 else w2s[0],
        w_shape=(E_LOC * H, I), a_rows=rows, block_n=bn2, block_k=bk2)
    split = tuning.l2_split_k if dm and not fp8 else 1
    sums, counts = _split_scratch(buffer, tuning, "fused_l2", split, (dm, bn2),
                                  tuning.fused_per_sm)
    args = (
        buffer.table, buffer.rank0, nloc, w13_tab, w2_tab, w13s_tab, w2s_tab,
        y3, y3.stride(0), y3.stride(1), trace if trace is not None else y3,
        buffer.max_spins, buffer.timeout_ns,
        off["off_epoch"], off["off_diag"], off["off_num_tokens"], off["off_src_tokens"],
        off["off_src_row"], off["off_block_start"], off["off_block_meta"], off["off_wave_mb"],
        off["off_num_waves"], off["off_arrival"], off["off_l1_done"], off["off_l2_done"],
        off["off_tickets"], off["off_x"], off["off_topk_idx"], off["off_topk_weights"],
        off["off_slot"], off["off_pool_x"], off["off_pool_src"], off["off_pool_weight"],
        off["off_pool_act"], off["off_combine_y"], off["off_combine_flag"],
        cfg.max_tokens_per_rank, cfg.hidden, cfg.intermediate, cfg.num_experts, c.R, c.E_LOC,
        c.P, c.row_words, cfg.token_bytes, cfg.act_bytes, tuning.dispatch_tokens,
        tuning.chunk_blocks, tuning.combine_parts, *descs1, *descs2, sums, counts)
    kw = dict(
        K=cfg.top_k, K_PAD=c.K_PAD, R_PAD=c.R_PAD, E_PAD=c.E_PAD, NLOC_PAD=next_pow2(nloc),
        BM=cfg.block_m, BN1=bn1, BK1=bk1, BN2=bn2, BK2=bk2,
        BH=min(next_pow2(c.row_words), tuning.hidden_chunk), TT=tuning.dispatch_tile,
        EAGER=tuning.dispatch_eager, CT=tuning.combine_tile,
        BHC=min(next_pow2(cfg.hidden), tuning.combine_chunk or tuning.hidden_chunk),
        UPCAST=INTERPRET, USE_TMA=tma, USE_TIMER=not INTERPRET,
        ONE_RANK=nloc == 1, TRACE=trace is not None, FP8=fp8, GROUP_M1=tuning.l1_group_m,
        DM=dm, L2G=group, EPI2=tuning.l2_epilogue_split if group > 1 or bn2 > 128 else 1,
        SPLIT_K=split, MIN_SPLIT=fused_min_split(cfg), **host_kw,
        **_launch_kw(tuning.l1_warps, tuning.l1_stages))
    # one program per SM, or fused_per_sm where the compiled kernel fits that many (programs
    # never wait in a cycle however few are resident, kernels/fused.py; co-resident is faster)
    grid = (_programs(buffer, tuning, tuning.fused_per_sm, _fused.fused_kernel, args, kw), 1)
    _fused.fused_kernel[grid](*args, **kw)


def fused_default(buffer: SymmBuffer, tokens: int) -> Tuning:
    """The fused launch's default tuning for a call of ``tokens`` tokens per rank:
    ``Tuning.for_call`` without tail pieces (the fused launch has none), in decode pieces
    where ``decode_rows_for`` puts a staged call in them (``Tuning.decode``'s tiles, 4 warps),
    then ``for_fused``, with combine tasks split into column parts at small T."""
    t = Tuning.for_call(buffer, tokens, decode=False)
    cfg = buffer.config
    dm = decode_rows_for(tokens=tokens, ranks=buffer.num_ranks, top_k=cfg.top_k,
                         num_experts=cfg.num_experts, block_m=cfg.block_m)
    sms = _constants(buffer).sms
    if dm and sms and cfg.dtype != "fp4w":
        t = t.decode(dm, cfg)
    t = t.for_fused(buffer)
    # combine tasks of combine_tile tokens are few at small T (32 at 128 tokens): split the
    # columns until the tasks cover the SMs, down to parts of 256 columns (faster at 1-128
    # tokens, most at 1)
    parts = 1
    tasks = cdiv(max(tokens, 1), t.combine_tile)
    while sms and tasks * parts < sms and cfg.hidden % (2 * parts) == 0 \
            and cfg.hidden // (2 * parts) >= 256:
        parts *= 2
    return replace(t, combine_parts=parts)


def fused_tuning(buffer: SymmBuffer, tokens: int, *, tuning: Tuning | None = None,
                 granularity: int | str = "token") -> Tuning:
    """The tuning a fused call with ``tokens`` tokens (the most of any local rank) runs with:
    ``tuning`` (default: ``fused_default``), its dispatch task size
    resolved from ``dispatch_programs`` in token mode, in streaming mode ``granularity``."""
    tuning = tuning or fused_default(buffer, tokens)
    if tuning.dispatch_programs and granularity == "token":
        tuning = replace(tuning, dispatch_tokens=max(1, cdiv(buffer.num_ranks * tokens,
                                                             tuning.dispatch_programs)))
    return tuning.with_granularity(granularity, buffer.config.block_m)


def run_fused(buffer: SymmBuffer, xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
              topk_weights: Sequence[torch.Tensor], w13s: Sequence[torch.Tensor],
              w2s: Sequence[torch.Tensor], y: torch.Tensor, *, tuning: Tuning | None = None,
              trace: torch.Tensor | None = None, granularity: int | str = "token") -> None:
    """publish, layout, then the fused kernel; y [local ranks, T_out, H].
    ``granularity``: the streaming mode (``Tuning.with_granularity``)."""
    tuning = fused_tuning(buffer, max(x.shape[0] for x in xs), tuning=tuning,
                          granularity=granularity)
    tuning.check(buffer.config)
    for lr in range(buffer.local_ranks):
        publish(buffer, lr, xs[lr], topk_idxs[lr], topk_weights[lr], tuning=tuning)
    layout(buffer, tuning=tuning, waves=True)
    fused(buffer, w13s, w2s, y, tuning=tuning, trace=trace)
