"""Launch settings of one call: small frozen dataclasses, one per part of the launch.

    Tuning         what every launch shares (programs, loads, waits, decode pieces)
      .l1  L1      the first GEMM (gate and up, SwiGLU)
      .l2  L2      the second GEMM (into the combine slots)
      .copy Copy   the staged publish, dispatch and combine launches
      .fused Fused the persistent launch's own task shapes

Plain Python (no torch): ``moestream.tuning.policy.select`` picks them per call, the launchers
read them. A field changed with ``Tuning.with_(l1={"block_n": 64}, wait=False)``. The data
layout depends on ``MoEConfig.block_m`` only, so any valid tuning serves any call of a buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..config import FP8_GROUP, MoEConfig, cdiv

__all__ = ["Tuning", "L1", "L2", "Copy", "Fused", "CHUNK_TILE", "EXPERT_CHUNK_TOKENS",
           "EXPERT_CHUNK_BLOCKS", "ONE_WAVE", "next_pow2", "check_granularity",
           "row_chunk", "row_chunks"]

# chunked modes (Tuning.with_granularity): tokens a chunk's dispatch task moves at once, the
# "expert" mode's dispatch task size and its chunk (more m-blocks than any expert has)
CHUNK_TILE = 4
EXPERT_CHUNK_TOKENS = 256
EXPERT_CHUNK_BLOCKS = 1 << 30
# Fused.wave_blocks that puts every expert of a call in one wave (an int32 in the kernels)
ONE_WAVE = 1 << 30


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def row_chunk(words: int, hidden_chunk: int) -> int:
    """16-bit words of a row of ``words`` that a copy moves per load."""
    return min(next_pow2(words), hidden_chunk)


def row_chunks(words: int, hidden_chunk: int) -> int:
    """Loads of ``row_chunk`` words that move one row."""
    return cdiv(words, row_chunk(words, hidden_chunk))


def check_granularity(granularity: int | str, block_m: int) -> None:
    """ValueError unless ``granularity`` is a streaming mode ``Tuning.with_granularity``
    takes: "token", "expert" or a positive multiple of ``block_m``."""
    if isinstance(granularity, str) and granularity in ("token", "expert"):
        return
    if isinstance(granularity, bool) or not isinstance(granularity, int) \
            or granularity < block_m or granularity % block_m:
        raise ValueError(f"granularity must be 'token', 'expert' or a positive multiple "
                         f"of block_m={block_m} (tokens per chunk), got {granularity!r}")


def _int(owner: str, name: str, v: Any, low: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{owner}.{name} must be an int >= {low}, got {v!r}")


def _pow2(owner: str, name: str, v: Any, *, optional: bool = False) -> None:
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"{owner}.{name} must be a power of two, got {v!r}")


def _one_of(owner: str, name: str, v: Any, allowed: tuple) -> None:
    if type(v) is not int or v not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {allowed}, got {v!r}")


def _bool(owner: str, name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{owner}.{name} must be a bool, got {v!r}")


@dataclass(frozen=True)
class L1:
    """The first GEMM: gate and up columns of each m-block, SwiGLU and the top-k weight in
    the epilogue.

    block_n, block_k: the tile (None: 64, capped at the GEMM's dimension; fp8 / fp4w: block_n
        128 or 256, block_k the 128-wide scale block).
    warps, stages: warps of a program and software-pipeline depth.
    group_m: tickets walk this many m-blocks at a time, m fastest within a group (1: n
        fastest), so concurrent programs share weight tiles where an m-block has many
        column blocks.
    one_dot: gate and up as one MMA of 2 * block_n columns per K step (bf16 whole tiles with
        tensor descriptors; other forms ignore it). one_dot_stages: its depth (None: stages).
    split_k: 1, 4, 8 or 16: in decode pieces, up to this many programs share a tile's K loop
        when a call's tiles are at most a quarter of the programs (the device picks the
        parts; the last part to finish adds them in a fixed order).
    tail_rows: 0, 16 or 32: a block of at most this many valid rows runs as one decode
        piece (whole tiles otherwise; not with decode_rows or fp4w).
    """

    block_n: int | None = None
    block_k: int | None = None
    warps: int = 4
    stages: int = 3
    group_m: int = 1
    one_dot: bool = False
    one_dot_stages: int | None = None
    split_k: int = 1
    tail_rows: int = 0

    def __post_init__(self) -> None:
        _int("L1", "warps", self.warps, 1)
        _int("L1", "stages", self.stages, 1)
        _int("L1", "group_m", self.group_m, 1)
        _bool("L1", "one_dot", self.one_dot)
        v = self.one_dot_stages
        if v is not None and (type(v) is not int or not 1 <= v <= 8):
            raise ValueError(f"L1.one_dot_stages must be None (stages) or an int in 1..8, "
                             f"got {v!r}")
        _one_of("L1", "split_k", self.split_k, (1, 4, 8, 16))
        _one_of("L1", "tail_rows", self.tail_rows, (0, 16, 32))


@dataclass(frozen=True)
class L2:
    """The second GEMM: each tile stored into its rows' combine slots.

    block_n, block_k, warps, stages: as ``L1``.
    flat: the staged persistent loop over tiles and the K loop as one flat loop, so the next
        tile's first loads overlap this tile's epilogue (only without waits, whole tiles).
    epilogue_split: the tile stored in 1, 2 or 4 column pieces (fewer live registers).
    split_m: tiles of block_m / split_m rows (1 or 2): half-height fp8 tiles fit 4 warps and
        several programs per SM.
    split_k: as ``L1.split_k``, for the bf16 decode L2 (the fused launch splits its L2
        tickets the same way).
    tail_rows: as ``L1.tail_rows``, per row piece of block_m / split_m rows.
    """

    block_n: int | None = None
    block_k: int | None = None
    warps: int = 4
    stages: int = 3
    flat: bool = False
    epilogue_split: int = 1
    split_m: int = 1
    split_k: int = 1
    tail_rows: int = 0

    def __post_init__(self) -> None:
        _int("L2", "warps", self.warps, 1)
        _int("L2", "stages", self.stages, 1)
        _bool("L2", "flat", self.flat)
        _one_of("L2", "epilogue_split", self.epilogue_split, (1, 2, 4))
        _one_of("L2", "split_m", self.split_m, (1, 2))
        _one_of("L2", "split_k", self.split_k, (1, 4, 8, 16))
        _one_of("L2", "tail_rows", self.tail_rows, (0, 16, 32))


@dataclass(frozen=True)
class Copy:
    """The staged copy launches: publish, dispatch and combine.

    warps: warps of the publish, numbering and dispatch programs.
    hidden_chunk: 16-bit words of a row moved per load (a power of two).
    dispatch_tile: tokens a dispatch ticket moves at once (a power of two; bytes in flight).
    dispatch_eager: a tile loads picks, slots, weights and its first row chunk at once (one
        peer round trip instead of three in a row).
    dispatch_parts: each row moved in this many parts, each its own ticket (at most one per
        ``hidden_chunk`` chunk), so a call with few tokens keeps more loads in flight.
    combine_warps, combine_per_sm: the combine launch's warps (None: ``warps``) and programs
        per SM.
    combine_chunk: hidden columns a combine task sums at once (None: hidden_chunk); the fused
        launch's combine tasks too.
    """

    warps: int = 4
    hidden_chunk: int = 1024
    dispatch_tile: int = 1
    dispatch_eager: bool = False
    dispatch_parts: int = 1
    combine_warps: int | None = None
    combine_per_sm: int = 4
    combine_chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("warps", "hidden_chunk", "dispatch_tile"):
            _pow2("Copy", name, getattr(self, name))
        for name in ("combine_warps", "combine_chunk"):
            _pow2("Copy", name, getattr(self, name), optional=True)
        for name in ("warps", "combine_warps"):
            if (getattr(self, name) or 1) > 16:
                raise ValueError(f"Copy.{name} must be at most 16 (warps of one program), "
                                 f"got {getattr(self, name)!r}")
        _bool("Copy", "dispatch_eager", self.dispatch_eager)
        _int("Copy", "dispatch_parts", self.dispatch_parts, 1)
        _int("Copy", "combine_per_sm", self.combine_per_sm, 1)


@dataclass(frozen=True)
class Fused:
    """The persistent launch's own shapes (it takes tiles, warps and depth from ``L1`` /
    ``L2``, row chunks and dispatch tiles from ``Copy``).

    per_sm: programs asked for per SM (capped at what one SM holds of the compiled kernel).
    l2_group: column blocks per L2 ticket (whole tiles only; must divide the L2's column
        blocks): one flat loop over them and one completion count per ticket.
    dispatch_tokens: source tokens per dispatch task (1: token-granular).
    dispatch_programs: token mode: size dispatch tasks so that about this many cover a call
        (0: off, dispatch_tokens as given).
    chunk_blocks: m-blocks of an expert an L1 block waits for (1: its own; see
        ``Tuning.with_granularity``).
    combine_tile: tokens per combine task (a power of two); combine_parts: column parts of
        the hidden dimension per task.
    wave_blocks: L1 blocks that close an expert wave (None: one per SM; ``ONE_WAVE``: every
        expert of the call in one wave).
    """

    per_sm: int = 1
    l2_group: int = 1
    dispatch_tokens: int = 1
    dispatch_programs: int = 0
    chunk_blocks: int = 1
    combine_tile: int = 1
    combine_parts: int = 1
    wave_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("per_sm", "l2_group", "dispatch_tokens", "chunk_blocks", "combine_parts"):
            _int("Fused", name, getattr(self, name), 1)
        _int("Fused", "dispatch_programs", self.dispatch_programs, 0)
        _pow2("Fused", "combine_tile", self.combine_tile)
        if self.wave_blocks is not None:
            _int("Fused", "wave_blocks", self.wave_blocks, 1)


_PARTS = {"l1": L1, "l2": L2, "copy": Copy, "fused": Fused}


@dataclass(frozen=True)
class Tuning:
    """Launch settings of one call, shared by every launch of it.

    programs: persistent programs per local rank (0: per SM counts; see ``gemm_per_sm``).
    gemm_per_sm: L1 / L2 programs asked for per SM (capped at what one SM holds).
    use_tma: load GEMM tiles with tensor descriptors (None: on Hopper GPUs).
    wait: GEMM blocks acquire their input counters, and dispatch and L1 count them. Stream
        order already completes every producer in the staged path, so the GPU defaults
        turn them off (nothing is counted then either); the interpreter's tests keep them.
    decode_rows: 0, 16 or 32: both GEMMs compute each block as weights @ rows^T (the weight
        tile as the MMA's row operand, a 16- or 32-column side for the tokens), a block of at
        most decode_rows valid rows as one piece, a fuller one in 32-row pieces.
    fp4w_rows: MXFP4 weights: rows per piece of a block (16: fp16 warp MMAs, exact; 64: fp8
        warpgroup MMAs), each piece decoding the block's weights again.
    fp4w_expand: MXFP4 weights: expand them to fp8 128x128 blocks once per call (one launch
        per GEMM, ``launch.fp4w_as_fp8``) and run the fp8 GEMMs on them, instead of decoding
        them in every m-block (fp4w_rows is then unused).
    host_descriptors: with one local rank, the host builds the GEMMs' tensor descriptors
        (None: only while a CUDA graph is captured, whose replays pay nothing for them).
    gemm_claim: the staged GEMM programs claim their tickets past their first two from a
        counter instead of taking every programs-th (a costly block holds up fewer tiles).
    """

    l1: L1 = L1()
    l2: L2 = L2()
    copy: Copy = Copy()
    fused: Fused = Fused()
    programs: int = 0
    gemm_per_sm: int = 2
    use_tma: bool | None = None
    wait: bool = True
    decode_rows: int = 0
    fp4w_rows: int = 64
    fp4w_expand: bool = False
    host_descriptors: bool | None = None
    gemm_claim: bool = False

    def __post_init__(self) -> None:
        for name, cls in _PARTS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"Tuning.{name} must be a {cls.__name__}, got "
                                 f"{getattr(self, name)!r}")
        _int("Tuning", "programs", self.programs, 0)
        _int("Tuning", "gemm_per_sm", self.gemm_per_sm, 1)
        for name in ("use_tma", "host_descriptors"):
            v = getattr(self, name)
            if v is not None and type(v) is not bool:
                raise ValueError(f"Tuning.{name} must be None, True or False, got {v!r}")
        _bool("Tuning", "wait", self.wait)
        _bool("Tuning", "gemm_claim", self.gemm_claim)
        _bool("Tuning", "fp4w_expand", self.fp4w_expand)
        _one_of("Tuning", "decode_rows", self.decode_rows, (0, 16, 32))
        _one_of("Tuning", "fp4w_rows", self.fp4w_rows, (16, 32, 64, 128, 256))

    # ---- changing fields ----------------------------------------------------------------
    def with_(self, **changes: Any) -> "Tuning":
        """A copy with ``changes``: top-level fields by name, and for ``l1``, ``l2``, ``copy``,
        ``fused`` either an instance or a dict of that part's fields to change."""
        parts = {}
        for name, value in changes.items():
            if name in _PARTS and isinstance(value, dict):
                parts[name] = replace(getattr(self, name), **value)
            elif name not in self.field_names():
                raise ValueError(f"Tuning has no field {name!r}; fields: {self.field_names()}")
            else:
                parts[name] = value
        return replace(self, **parts)

    @staticmethod
    def field_names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(Tuning))

    @staticmethod
    def dotted_names() -> tuple[str, ...]:
        """Every settable name: top-level fields and ``part.field`` (``l1.block_n``)."""
        out = []
        for f in fields(Tuning):
            if f.name in _PARTS:
                out += [f"{f.name}.{g.name}" for g in fields(_PARTS[f.name])]
            else:
                out.append(f.name)
        return tuple(out)

    def with_dotted(self, changes: dict[str, Any]) -> "Tuning":
        """``with_`` from ``{"l1.block_n": 128, "wait": False}`` (the CLI's --tuning)."""
        nested: dict[str, Any] = {}
        for key, value in changes.items():
            part, dot, name = key.partition(".")
            if key not in self.dotted_names():
                raise ValueError(f"unknown Tuning field {key!r}; fields: "
                                 f"{', '.join(self.dotted_names())}")
            if dot:
                nested.setdefault(part, {})[name] = value
            else:
                nested[key] = value
        return self.with_(**nested)

    def with_granularity(self, granularity: int | str, block_m: int) -> "Tuning":
        """This tuning in a streaming mode of the fused launch:

        "token"   dispatch tasks of one token; an L1 block waits for its own m-block only.
        C (int)   chunked, DeepEP-normal style: dispatch tasks of C source tokens, and an L1
                  block waits for the whole chunk of C rows (C / block_m m-blocks) of its
                  expert. C must be a positive multiple of block_m.
        "expert"  an L1 block waits for every row of its expert; dispatch tasks of
                  EXPERT_CHUNK_TOKENS source tokens.
        Chunked modes fix the dispatch task size (dispatch_programs off), so resolving a
        resolved tuning again changes nothing.
        """
        check_granularity(granularity, block_m)
        if granularity == "token":
            return self
        if granularity == "expert":
            return self.with_(fused=dict(chunk_blocks=EXPERT_CHUNK_BLOCKS, dispatch_programs=0,
                                         dispatch_tokens=EXPERT_CHUNK_TOKENS),
                              copy=dict(dispatch_tile=CHUNK_TILE))
        return self.with_(fused=dict(chunk_blocks=granularity // block_m,
                                     dispatch_tokens=granularity, dispatch_programs=0),
                          copy=dict(dispatch_tile=min(CHUNK_TILE, next_pow2(granularity))))

    # ---- rules that need the config (ValueError before anything is launched) -------------
    def l1_tile(self, cfg: MoEConfig) -> tuple[int, int]:
        """(block_n, block_k) of L1. fp8 / fp4w: block_k is the scale block (128) and a block
        re-quantizes whole 128-column groups, so block_n is 128 (default) or 256."""
        if cfg.fp8_tokens:
            bn = self.l1.block_n or 128
            if bn not in (128, 256) or cfg.intermediate % bn:
                raise ValueError(f"fp8 needs L1.block_n 128 or 256 dividing "
                                 f"intermediate={cfg.intermediate}, got {bn}")
            return bn, FP8_GROUP
        return _tile("L1", self.l1.block_n, self.l1.block_k, n=("intermediate", cfg.intermediate),
                     k=("hidden", cfg.hidden))

    def l2_tile(self, cfg: MoEConfig) -> tuple[int, int]:
        """(block_n, block_k) of L2 (fp8 / fp4w: block_k is the scale block, 128)."""
        if cfg.fp8_tokens:
            return _tile("L2", self.l2.block_n or 128, FP8_GROUP, n=("hidden", cfg.hidden),
                         k=("intermediate", cfg.intermediate))
        return _tile("L2", self.l2.block_n, self.l2.block_k, n=("hidden", cfg.hidden),
                     k=("intermediate", cfg.intermediate))

    def fp4w_pieces(self, cfg: MoEConfig) -> int:
        """Rows per piece of an fp4w block decoded in the GEMMs (at most block_m; 0 in other
        formats and with fp4w_expand)."""
        return min(self.fp4w_rows, cfg.block_m) if self.decodes_fp4w(cfg) else 0

    def decodes_fp4w(self, cfg: MoEConfig) -> bool:
        """Whether the GEMMs read MXFP4 weights themselves (fp4w without fp4w_expand)."""
        return cfg.dtype == "fp4w" and not self.fp4w_expand

    def decode_pieces(self, cfg: MoEConfig) -> int:
        """decode_rows checked against the config (0: off)."""
        dm = self.decode_rows
        if dm and cfg.block_m % dm:
            raise ValueError(f"Tuning.decode_rows={dm} must divide block_m={cfg.block_m}")
        return dm

    def tail_pieces(self, cfg: MoEConfig, gemm: str) -> int:
        """L1.tail_rows / L2.tail_rows (``gemm`` "l1" / "l2") checked against the config: the
        rows of a tail piece, 0 where tail pieces do not apply (off, decode_rows, fp4w)."""
        dm = self.l1.tail_rows if gemm == "l1" else self.l2.tail_rows
        if not dm or self.decode_rows or self.decodes_fp4w(cfg):
            return 0
        piece = cfg.block_m // (self.l2.split_m if gemm == "l2" else 1)
        if piece % dm:
            raise ValueError(f"{gemm.upper()}.tail_rows={dm} must divide the {gemm.upper()} row "
                             f"piece of {piece} rows (block_m={cfg.block_m}"
                             + (f", L2.split_m={self.l2.split_m})" if gemm == "l2" else ")"))
        return dm

    def check(self, cfg: MoEConfig) -> None:
        """Every config-dependent rule (ValueError), so that a call fails before its first
        launch rather than between launches."""
        self.l1_tile(cfg)
        self.l2_tile(cfg)
        self.decode_pieces(cfg)
        self.tail_pieces(cfg, "l1")
        self.tail_pieces(cfg, "l2")


DEFAULT_BLOCK_N = 64   # a GEMM tile's columns where the tuning names none (the interpreter's)
DEFAULT_BLOCK_K = 64   # ... and its K step


def _tile(gemm: str, bn: int | None, bk: int | None, *, n: tuple[str, int],
          k: tuple[str, int]) -> tuple[int, int]:
    """(bn, bk), defaults capped at the dimension, after checking that each is a power of two
    >= 16 dividing its GEMM dimension: the kernels walk whole tiles (a column block past the
    last whole one would go unwritten)."""
    bn = bn if bn is not None else min(DEFAULT_BLOCK_N, n[1])
    bk = bk if bk is not None else min(DEFAULT_BLOCK_K, k[1])
    for what, v, (dim, size) in (("block_n", bn, n), ("block_k", bk, k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1) \
                or size % v:
            raise ValueError(f"{gemm}.{what} must be a power of two >= 16 dividing "
                             f"{dim}={size}, got {v!r}")
    return bn, bk
