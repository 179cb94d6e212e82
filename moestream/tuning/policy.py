"""The tuning policy: which ``Tuning`` a call runs with, one rule per line.

``select(config, tokens, ranks=R, device=Device(sms, hopper), impl=...)`` is the only entry
point the layer uses; every rule it applies is a named function or constant below, with its
reason in a line. The measured effect of each rule is in docs/tuning.md. Plain Python: the
launchers pass the device's SM count (0 under Triton's interpreter, whose tests choose their
own tilings).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import MoEConfig, cdiv
from .settings import L1, L2, ONE_WAVE, Copy, Tuning, row_chunks

__all__ = ["Device", "select", "gpu_defaults", "in_decode_pieces", "for_fused",
           "mean_rows_per_expert", "decode_rows_for", "tail_rows_for", "one_dot_for",
           "fp8_l1_split_for", "l1_group_m_for", "fused_l2_group_for", "fused_min_split",
           "combine_parts_for", "ONE_DOT_L1_STAGES", "ONE_DOT_SHALLOW_MIN_HIDDEN",
           "FP8_L2_TILE_MIN_I", "DISPATCH_TILE8_PICKS", "FP4W_EXPAND_MIN_ROWS", "fp4w_expands"]


@dataclass(frozen=True)
class Device:
    """What the policy knows of the GPU: its SM count (0: no GPU, the interpreter) and
    whether it is Hopper or newer (tensor descriptors, wgmma)."""

    sms: int = 0
    hopper: bool = False


# The staged one-MMA L1 runs 3 stages of 64-deep K steps where hidden (its K) is at least
# 4096: faster there from 256 rows per expert; a shorter K (qwen3) keeps the L1's 4.
ONE_DOT_L1_STAGES = 3
ONE_DOT_SHALLOW_MIN_HIDDEN = 4096
# The staged fp8 L2 computes whole 128-row tiles where intermediate (its K) is at least this,
# else 64-row pieces two per SM: the tile wins at a long K (dsv3), the pieces at a short one.
FP8_L2_TILE_MIN_I = 2048
# Calls whose rank takes at least this many picks (tokens x top_k) dispatch 8 tokens per
# ticket instead of 4: more rows in flight pays for large calls only.
DISPATCH_TILE8_PICKS = 16384
# fp4w calls whose experts average at least this many rows expand the MXFP4 weights to fp8
# blocks once per call: the GEMMs decode an expert's weights again in every piece of rows, so
# the one expansion pays from 128 rows per expert (at 32 it is as fast, at 16 slower).
FP4W_EXPAND_MIN_ROWS = 64


def mean_rows_per_expert(*, tokens: int, ranks: int, top_k: int, num_experts: int) -> float:
    """Rows an expert receives on average under uniform routing (``tokens`` per rank)."""
    return tokens * ranks * top_k / max(num_experts, 1)


def fp4w_expands(*, tokens: int, ranks: int, top_k: int, num_experts: int,
                 impl: str) -> bool:
    """Whether an fp4w call expands its weights to fp8 blocks (``Tuning.fp4w_expand``): the
    fused launch always (it has no MXFP4 decode), the staged one from FP4W_EXPAND_MIN_ROWS."""
    return impl == "fused" or mean_rows_per_expert(
        tokens=tokens, ranks=ranks, top_k=top_k, num_experts=num_experts) >= FP4W_EXPAND_MIN_ROWS


def decode_rows_for(*, tokens: int, ranks: int, top_k: int, num_experts: int,
                    block_m: int) -> int:
    """``Tuning.decode_rows``: 16 when an expert is unlikely to receive more than 32 rows
    (mean + 3 standard deviations + 1 of a Poisson count at most 32), else 0: decode pieces
    read each block's weights once, faster than 128-row tiles of padding there."""
    mean = mean_rows_per_expert(tokens=tokens, ranks=ranks, top_k=top_k, num_experts=num_experts)
    return 16 if block_m % 16 == 0 and mean + 3 * mean ** 0.5 + 1 <= 32 else 0


def tail_rows_for(*, tokens: int, ranks: int, top_k: int, num_experts: int, block_m: int,
                  dtype: str, l2_split_m: int = 1) -> tuple[int, int]:
    """(``L1.tail_rows``, ``L2.tail_rows``) of a call that is not decode-sized: on while the
    mean rows per expert are at most block_m / 2, where most experts' only m-block is partly
    filled (fp8 both GEMMs, bf16 the L1; 32-row pieces, 16 where 32 does not divide; fp4w
    none): faster there, no gain once experts fill whole blocks."""
    mean = mean_rows_per_expert(tokens=tokens, ranks=ranks, top_k=top_k, num_experts=num_experts)
    if dtype not in ("bf16", "fp8") or mean > block_m / 2:
        return 0, 0

    def rows(piece: int) -> int:
        return 32 if piece % 32 == 0 else (16 if piece % 16 == 0 else 0)
    return rows(block_m), (rows(block_m // l2_split_m) if dtype == "fp8" else 0)


def one_dot_for(*, tokens: int, ranks: int, top_k: int, num_experts: int, block_m: int) -> bool:
    """``L1.one_dot`` of a bf16 staged call: from 2 * block_m mean rows per expert (faster
    with several whole tiles per expert, slightly slower at one)."""
    return mean_rows_per_expert(tokens=tokens, ranks=ranks, top_k=top_k,
                                num_experts=num_experts) >= 2 * block_m


def fp8_l1_split_for(*, tokens: int, top_k: int, experts_per_rank: int,
                     l1_tiles_per_block: int, programs: int) -> int:
    """``L1.split_k`` of an fp8 call in decode pieces: 4 where the m-blocks a rank expects
    (about tokens * top_k, at most its experts) leave at most a quarter of the programs a
    tile, else 1: the fp8 L1 compiled with split parts runs unsplit tiles slower."""
    blocks = min(experts_per_rank, max(tokens, 1) * top_k)
    return 4 if blocks * l1_tiles_per_block * 4 <= programs else 1


def l1_group_m_for(column_blocks: int, sms: int) -> int:
    """``L1.group_m``: 8 when the programs running at once (about one per SM) cover fewer than
    4 m-blocks n fastest, so an expert's w13 would stream from HBM once per m-block
    (mixtral: 112 column blocks); else 1."""
    return 8 if column_blocks * 4 > sms else 1


def fused_l2_group_for(cfg: MoEConfig, block_n: int) -> int:
    """``Fused.l2_group`` in whole tiles: in bf16 with I <= 2048 (a short K loop, where a
    block's fixed costs weigh), the smallest power of two from 2 that leaves an m-block at
    most 16 tickets and divides its column blocks; otherwise 1."""
    blocks = cfg.hidden // block_n
    if cfg.dtype != "bf16" or cfg.intermediate > 2048 or blocks % 2:
        return 1
    group = 2
    while blocks // group > 16 and blocks % (2 * group) == 0:
        group *= 2
    return group


def fused_min_split(cfg: MoEConfig) -> int:
    """Fewest split-K parts of the fused launch's L2 tiles: 2 where the L2's K loop is long
    (intermediate >= 8192, mixtral), else 4 (two parts of a short K loop are slower than none)."""
    return 2 if cfg.intermediate >= 8192 else 4


def combine_parts_for(cfg: MoEConfig, tokens: int, combine_tile: int, sms: int) -> int:
    """``Fused.combine_parts``: split the columns until the combine tasks cover the SMs, down
    to parts of 256 columns (few tasks at small T left SMs idle)."""
    parts, tasks = 1, cdiv(max(tokens, 1), combine_tile)
    while sms and tasks * parts < sms and cfg.hidden % (2 * parts) == 0 \
            and cfg.hidden // (2 * parts) >= 256:
        parts *= 2
    return parts


def gpu_defaults(cfg: MoEConfig) -> Tuning:
    """The tiles measured best on H200 for the config's format and dims, no waits (the
    staged path's stream order completes every producer); dispatch tickets of 4 source
    tokens with eager loads, a combine of 8 warps."""
    copy = Copy(dispatch_tile=4, dispatch_eager=True, combine_warps=8)
    base = dict(copy=copy, wait=False)
    if cfg.dtype == "fp4w":   # pointer loads, 64-row pieces
        return Tuning(l1=L1(block_n=128, warps=8, stages=3), l2=L2(block_n=128, warps=8, stages=3),
                      fp4w_rows=min(64, cfg.block_m), **base)
    if cfg.dtype == "fp8":
        l1 = L1(block_n=128, warps=8, stages=3)
        if cfg.block_m >= 128 and cfg.intermediate < FP8_L2_TILE_MIN_I:
            return Tuning(l1=l1, l2=L2(block_n=128, warps=4, stages=3, epilogue_split=2,
                                       split_m=2, flat=True), **base)
        return Tuning(l1=l1, l2=L2(block_n=128, warps=8, stages=4, epilogue_split=2), **base)
    if cfg.block_m >= 128:
        # a 128x256 L2 tile of 8 warps where 256 divides hidden, else 128x128 two per SM
        l2 = (L2(block_n=256, block_k=64, warps=8, stages=4, flat=True, epilogue_split=4)
              if cfg.hidden % 256 == 0 else
              L2(block_n=128, block_k=64, warps=4, stages=3, flat=True, epilogue_split=4))
        return Tuning(l1=L1(block_n=128, block_k=64, warps=8, stages=4), l2=l2, **base)
    return Tuning(l1=L1(block_n=128, block_k=64, warps=4, stages=4),
                  l2=L2(block_n=128, block_k=64, warps=4, stages=4), **base)


def in_decode_pieces(t: Tuning, rows: int, cfg: MoEConfig) -> Tuning:
    """``t`` in decode pieces of ``rows`` with their launch shapes (4 warps, two programs per
    SM, claimed tickets, each row's chunks dispatched as separate tickets):
    bf16 L1 blocks 64 wide, split-K of four where a call has few tiles; fp8 L1 128 wide in
    3 stages; L2 blocks 128 wide (a 256-wide decode L2 is no faster and holds an SM alone)."""
    copy = dict(dispatch_parts=row_chunks(cfg.token_bytes // 2, t.copy.hidden_chunk))
    if cfg.dtype == "fp4w":   # no decode pieces: 16-row pieces (fp16 warp MMAs, exact)
        return t.with_(fp4w_rows=16, gemm_claim=True, copy=copy,
                       l1=dict(warps=4, stages=3), l2=dict(warps=4, stages=3, split_m=1,
                                                           flat=False))
    l2 = dict(warps=4, stages=5, split_m=1, flat=False)
    if cfg.dtype == "fp8":   # L1.split_k: select (fp8_l1_split_for)
        return t.with_(decode_rows=rows, gemm_claim=True, copy=copy,
                       l1=dict(block_n=128, warps=4, stages=3), l2=l2)
    l1n = 64 if cfg.intermediate % 64 == 0 else t.l1.block_n
    l2n = 128 if (t.l2.block_n or 0) > 128 else t.l2.block_n
    return t.with_(decode_rows=rows, gemm_claim=True, copy=copy,
                   l1=dict(block_n=l1n, warps=4, stages=5, split_k=4),
                   l2=dict(l2, block_n=l2n, split_k=4))


def for_fused(t: Tuning, cfg: MoEConfig, *, sms: int) -> Tuning:
    """``t`` with the fused launch's shapes: 128-wide L2 blocks (it runs L2 with the L1's
    warps), grouped L2 tickets (``fused_l2_group_for``), one dispatch task per program moving
    4 tokens at a time (8 where ``t`` has 8) with eager loads, combine tasks of 4 tokens in
    512-column chunks; in decode pieces two programs per SM, one expert wave (nothing is
    reused between waves) and one-token tasks moving whole rows (L1 waits for whole rows)."""
    l2n = 128 if cfg.hidden % 128 == 0 else t.l2_tile(cfg)[0]
    fused = dict(l2_group=fused_l2_group_for(cfg, l2n), dispatch_programs=sms, combine_tile=4,
                 per_sm=1, wave_blocks=t.fused.wave_blocks)
    copy = dict(dispatch_tile=max(4, t.copy.dispatch_tile), dispatch_eager=True,
                combine_chunk=512, hidden_chunk=t.copy.hidden_chunk)
    if t.decode_rows:
        fused.update(per_sm=2, wave_blocks=ONE_WAVE, l2_group=1)
        copy.update(dispatch_tile=1, hidden_chunk=8192)
    return t.with_(l2=dict(block_n=l2n), fused=fused, copy=copy)


def _staged(cfg: MoEConfig, tokens: int, ranks: int, sms: int, *, decode: bool) -> Tuning:
    """The staged path's tuning for a call (``decode`` False: the fused launch's start,
    which has no tail pieces and takes its decode pieces itself)."""
    t = gpu_defaults(cfg)
    shape = dict(tokens=tokens, ranks=ranks, top_k=cfg.top_k, num_experts=cfg.num_experts)
    dm = decode_rows_for(**shape, block_m=cfg.block_m) if decode else 0
    if dm:
        t = in_decode_pieces(t, dm, cfg)
        if cfg.dtype == "fp8":
            t = t.with_(l1=dict(split_k=fp8_l1_split_for(
                tokens=tokens, top_k=cfg.top_k, experts_per_rank=cfg.experts_per_rank(ranks),
                l1_tiles_per_block=cfg.intermediate // t.l1_tile(cfg)[0],
                programs=sms * t.gemm_per_sm)))
        return t
    if decode:
        l1_tail, l2_tail = tail_rows_for(**shape, block_m=cfg.block_m, dtype=cfg.dtype,
                                         l2_split_m=t.l2.split_m)
        t = t.with_(l1=dict(tail_rows=l1_tail), l2=dict(tail_rows=l2_tail))
    if tokens * cfg.top_k >= DISPATCH_TILE8_PICKS:
        t = t.with_(copy=dict(dispatch_tile=8))
    if not cfg.fp8_tokens:   # fp8 / fp4w: a block quantizes 128 columns
        # narrow L1 column blocks while the touched experts' tiles leave SMs idle (each
        # block then streams its weights alone); a rank receives about tokens * top_k picks
        touched = min(cfg.experts_per_rank(ranks), max(1, tokens * cfg.top_k))
        bn = t.l1_tile(cfg)[0]
        while bn > 32 and touched * (cfg.intermediate // bn) < sms:
            bn //= 2
        deep = cfg.hidden >= ONE_DOT_SHALLOW_MIN_HIDDEN
        t = t.with_(l1=dict(block_n=bn, one_dot=one_dot_for(**shape, block_m=cfg.block_m),
                            one_dot_stages=ONE_DOT_L1_STAGES if deep else None))
    if cfg.dtype == "fp4w":   # bound by its weight decode: claimed tickets balance programs
        return t.with_(gemm_claim=True)
    return t.with_(l1=dict(group_m=l1_group_m_for(cfg.intermediate // t.l1_tile(cfg)[0], sms)))


def select(config: MoEConfig, tokens: int, *, ranks: int, device: Device,
           impl: str = "staged") -> Tuning:
    """The tuning a call of ``tokens`` tokens per rank (the most any rank passes) runs with,
    on ``ranks`` ranks and ``device``; ``impl``: "staged" or "fused" (before its streaming
    mode, ``Tuning.with_granularity``). Without a GPU (``device.sms`` 0): ``Tuning()``."""
    if impl not in ("staged", "fused"):
        raise ValueError(f"impl must be 'staged' or 'fused', got {impl!r}")
    if config.dtype == "fp4w" and fp4w_expands(tokens=tokens, ranks=ranks, top_k=config.top_k,
                                               num_experts=config.num_experts, impl=impl):
        # the expanded weights run the fp8 GEMMs: the fp8 call's tuning
        return select(config.with_(dtype="fp8"), tokens, ranks=ranks, device=device,
                      impl=impl).with_(fp4w_expand=True)
    if not device.sms:
        return Tuning()
    if impl == "staged":
        return _staged(config, tokens, ranks, device.sms, decode=True)
    t = _staged(config, tokens, ranks, device.sms, decode=False)
    dm = decode_rows_for(tokens=tokens, ranks=ranks, top_k=config.top_k,
                         num_experts=config.num_experts, block_m=config.block_m)
    if dm and config.dtype != "fp4w":
        t = in_decode_pieces(t, dm, config)
    t = for_fused(t, config, sms=device.sms)
    return t.with_(fused=dict(combine_parts=combine_parts_for(config, tokens,
                                                              t.fused.combine_tile,
                                                              device.sms)))
