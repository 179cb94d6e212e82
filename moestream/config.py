"""MoEConfig: the sizes of one expert-parallel MoE layer, validated once.

Everything downstream (the buffer layout, the scheduler, the kernels) derives its sizes from
this object, so a bad size is reported here, with what is allowed, and nowhere else.
Pure Python: no torch import (the reference and layout modules depend on this file).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = ["MoEConfig", "SHAPES", "DTYPES", "FP8_GROUP", "cdiv", "align_up"]

# Routed-expert shapes of the models we benchmark.
SHAPES: dict[str, dict[str, int]] = {
    "dsv3": dict(hidden=7168, intermediate=2048, num_experts=256, top_k=8),
    "v4flash": dict(hidden=4096, intermediate=2048, num_experts=256, top_k=6),
    "qwen3": dict(hidden=2048, intermediate=768, num_experts=128, top_k=8),
    "mixtral": dict(hidden=4096, intermediate=14336, num_experts=8, top_k=2),
}

# Activation / weight formats (docs/quantization.md). bf16; fp8: e4m3 activations with one fp32
# scale per token per 128 channels and DeepSeek-V3 weights (e4m3, fp32 scale_inv per 128x128
# block); fp4w: the same fp8 activations with MXFP4 weights (e2m1 pairs + one E8M0 code per 32).
DTYPES = ("bf16", "fp8", "fp4w")
FP8_GROUP = 128   # channels per activation scale, rows/columns per weight scale block
_POW2_TILES = (16, 32, 64, 128, 256)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def align_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Sizes of one routed-expert MoE layer and its pool's block rows (the GEMM tiles are
    launch settings: ``moestream.tuning``).

    Args:
        hidden: model width H (multiple of 128).
        intermediate: expert FFN width I (multiple of 128); w13 is [E, 2I, H], w2 is [E, H, I].
        num_experts: routed experts E over all ranks (divisible by the rank count).
        top_k: experts per token K (1 <= K <= E).
        max_tokens_per_rank: the most tokens T any rank passes in one call; buffers are sized
            for it (the pool holds the worst case: every token of every rank sending all K picks
            to one rank), so no routing can overflow them.
        dtype: "bf16", "fp8" (tokens cross NVLink as e4m3 bytes plus an fp32 scale per 128
            channels, quantized by the layer; weights are e4m3 with 128x128 block scales; the
            L2 output and the combine stay bf16) or "fp4w" (tokens as in "fp8"; weights MXFP4,
            two e2m1 values per byte and one E8M0 scale per 32 along K, decoded to e4m3 in the
            GEMMs; the staged path only).
        block_m: pool rows per GEMM block. Each expert's pool segment is padded to a multiple
            of it, and an L1 block starts once that many of its tokens (or the expert's ragged
            remainder) have arrived.
    """

    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    dtype: str = "bf16"
    block_m: int = 128

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "num_experts", "top_k", "max_tokens_per_rank",
                     "block_m"):
            _positive_int(name, getattr(self, name))
        for name in ("hidden", "intermediate"):
            if getattr(self, name) % 128:
                raise ValueError(f"MoEConfig.{name} must be a multiple of 128 (the FP8 scale "
                                 f"block and the kernels' tiles), got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k must be <= num_experts ({self.num_experts}), "
                             f"got {self.top_k}")
        if self.dtype not in DTYPES:
            raise ValueError(f"MoEConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_m not in _POW2_TILES:
            raise ValueError(f"MoEConfig.block_m must be one of {_POW2_TILES}, got {self.block_m}")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_shape(cls, shape: str, *, max_tokens_per_rank: int, **overrides: Any) -> "MoEConfig":
        """A config for one of the benchmark shapes in ``SHAPES`` (dsv3, v4flash, qwen3, mixtral)."""
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known shapes: {sorted(SHAPES)}")
        return cls(**{**SHAPES[shape], **overrides}, max_tokens_per_rank=max_tokens_per_rank)

    def with_(self, **changes: Any) -> "MoEConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---- derived sizes --------------------------------------------------------------------
    def check_ranks(self, num_ranks: int) -> None:
        """Raise ValueError unless the experts split evenly over ``num_ranks`` ranks."""
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks <= 0:
            raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
        if self.num_experts % num_ranks:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the number "
                             f"of ranks ({num_ranks})")
        # The source rank, token and k of a pool row are packed into one int32 (pool_src).
        if num_ranks * self.max_tokens_per_rank * self.top_k >= 2**31:
            raise ValueError(f"num_ranks * max_tokens_per_rank * top_k must stay below 2**31, got "
                             f"{num_ranks} * {self.max_tokens_per_rank} * {self.top_k}")
        # combine slots [T, K, H] are addressed with int32 element offsets
        if self.max_tokens_per_rank * self.top_k * self.hidden >= 2**31:
            raise ValueError("max_tokens_per_rank * top_k * hidden must stay below 2**31 (int32 "
                             f"offsets into the combine slots), got {self.max_tokens_per_rank} * "
                             f"{self.top_k} * {self.hidden}")

    def experts_per_rank(self, num_ranks: int) -> int:
        self.check_ranks(num_ranks)
        return self.num_experts // num_ranks

    def max_pool_pairs(self, num_ranks: int) -> int:
        """Most (token, k) pairs one rank can receive: every pick of every rank's tokens.

        Duplicate expert ids within a token are legal input (each pick contributes), so the
        bound is T*K per source rank, not T*min(K, E_local).
        """
        self.check_ranks(num_ranks)
        return num_ranks * self.max_tokens_per_rank * self.top_k

    def pool_capacity(self, num_ranks: int) -> int:
        """Pool rows per rank: the worst case pairs plus each expert's padding to block_m."""
        e_loc = self.experts_per_rank(num_ranks)
        return align_up(self.max_pool_pairs(num_ranks) + e_loc * (self.block_m - 1), self.block_m)

    def max_m_blocks(self, num_ranks: int) -> int:
        return self.pool_capacity(num_ranks) // self.block_m

    @property
    def fp8_tokens(self) -> bool:
        """Tokens (and L1 outputs) cross as e4m3 bytes + fp32 scales: "fp8" and "fp4w"."""
        return self.dtype in ("fp8", "fp4w")

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one token value: 2 for bf16, 1 for fp8 and fp4w (scales excluded); also a
        weight value's in bf16 and fp8 (fp4w weights take half a byte)."""
        return 1 if self.fp8_tokens else 2

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's row as it crosses NVLink: bf16 values, or fp8 values followed
        by their fp32 scales (one per 128 channels), padded to 16 bytes (aligned rows)."""
        if self.fp8_tokens:
            return align_up(self.hidden + 4 * (self.hidden // FP8_GROUP), 16)
        return 2 * self.hidden

    @property
    def act_bytes(self) -> int:
        """Bytes of one L1 output row (the L2 input): as ``token_bytes`` with I columns."""
        if self.fp8_tokens:
            return align_up(self.intermediate + 4 * (self.intermediate // FP8_GROUP), 16)
        return 2 * self.intermediate

    def flops_per_token(self) -> int:
        """GEMM FLOPs of one token: K experts x (L1: 2*H*2I + L2: 2*I*H)."""
        return 6 * self.top_k * self.hidden * self.intermediate
