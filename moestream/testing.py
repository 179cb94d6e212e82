"""Inputs for tests, the CLI and the benchmarks: random routings (uniform, skewed, with -1
picks), expert weights of realistic scale, and rank/token-stamped payloads.

Everything draws from a caller-supplied ``torch.Generator`` so a failing case can be replayed.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .config import MoEConfig
from .reference import route

__all__ = ["make_routing", "routing_with_counts", "make_tokens", "make_weights", "quantize_weights", "stamp_tokens",
           "read_stamp", "rel_error", "TOLERANCE"]

# Written tolerances of ||out - ref|| / ||ref|| against the fp32 reference, per activation dtype.
# bf16: inputs, weights and the L1 activation are rounded to bf16 (8 mantissa bits, ~4e-3 per
# rounding); sums accumulate in fp32; the bound leaves 2-3x headroom over what we observe.
# fp8: the layer against the quantization-aware reference (moe_forward(..., quant="fp8"): the
# same e4m3 bytes and scales), so only summation order, rare one-ulp flips of the L1 output's
# re-quantization and the bf16 rounding of the L2 rows and the output differ (seen ~3e-3 on
# the CPU); against the unquantized bf16 layer fp8 is ~6e-2 on random data (quantization.md).
# fp4w: the same against moe_forward(..., quant="fp4w") (MXFP4 weights, the same fp8 bytes).
TOLERANCE = {"bf16": 1e-2, "fp8": 3e-2, "fp4w": 3e-2}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN anywhere in ``out`` gives NaN: never passes)."""
    out64, ref64 = out.double(), ref.double()
    den = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / den if den > 0 else num


# the hot expert's logit lead over a hot token's best other expert (make_routing's skew)
HOT_MARGIN = 4.0


def make_routing(num_tokens: int, num_experts: int, top_k: int, *,
                 generator: torch.Generator | None = None, device: str | torch.device = "cpu",
                 skew: float | None = None, drop: float = 0.0, scoring: str = "softmax",
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A realistic routing: top-k without replacement of random router logits.

    Args:
        skew: if set, one hot expert (expert 0) takes this share of all picks besides its
            uniform share, as far as picking without replacement allows (at most one pick
            per token: a share of up to 1/K); each token's other picks stay softmax-random.
        drop: share of picks replaced by -1 (no expert).
    Returns:
        topk_idx [T, K] int32, topk_weights [T, K] fp32 (on ``device``).
    """
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    if skew is not None:
        if not 0.0 < skew <= 1.0:
            raise ValueError(f"skew must be in (0, 1], got {skew}")
        hot_tokens = torch.rand(num_tokens, generator=generator) < min(1.0, skew * top_k)
        # expert 0 first by a margin that keeps every other probability non-zero: a huge
        # logit (e.g. 1e4) leaves the others at exactly 0.0 after the softmax, so top-k
        # breaks the ties the same way for every hot token and every one of them takes the
        # same K experts
        logits[hot_tokens, 0] = logits[hot_tokens].max(dim=1).values + HOT_MARGIN
    idx, w = route(logits, top_k, scoring=scoring)
    if drop > 0:
        gone = torch.rand(idx.shape, generator=generator) < drop
        idx = idx.masked_fill(gone, -1)
        w = w.masked_fill(gone, 0.0)
    return idx.to(torch.int32).to(device), w.to(device)


def routing_with_counts(counts: Sequence[int], num_tokens: Sequence[int], top_k: int, *,
                        generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Per-rank topk_idx [T_r, K] int32 in which expert e receives exactly ``counts[e]`` picks
    over all ranks (every other pick -1), each token's picks distinct, tokens shuffled across
    ranks. Builds block fills on purpose (e.g. an expert ending in a 5-row m-block).
    ``num_tokens``: T_r per rank; sum(counts) must fit sum(T_r) * K, each count sum(T_r)."""
    n = sum(num_tokens)
    if sum(counts) > n * top_k or any(c < 0 or c > n for c in counts):
        raise ValueError(f"counts {list(counts)} do not fit {n} tokens x top_k={top_k} "
                         f"(each count at most {n}, their sum at most {n * top_k})")
    flat = torch.full((top_k * n,), -1, dtype=torch.int32)
    seq = [e for e, c in enumerate(counts) for _ in range(c)]
    flat[:len(seq)] = torch.tensor(seq, dtype=torch.int32)
    # pick k of token t is flat[k * n + t]: an expert's picks are consecutive in flat and
    # at most n long, so they never land twice on one token
    idx = flat.view(top_k, n).T[torch.randperm(n, generator=generator)].contiguous()
    return list(idx.split(list(num_tokens)))


def make_tokens(num_tokens: int, hidden: int, *, generator: torch.Generator | None = None,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
                ) -> torch.Tensor:
    return torch.randn(num_tokens, hidden, generator=generator).to(dtype).to(device)


def make_weights(config: MoEConfig, num_ranks: int, *, generator: torch.Generator | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-rank expert weights w13s[r] [E/R, 2I, H], w2s[r] [E/R, H, I], scaled so that every
    projection keeps unit-variance activations (1/sqrt(fan_in))."""
    e_loc = config.experts_per_rank(num_ranks)
    H, I = config.hidden, config.intermediate
    w13s, w2s = [], []
    for _ in range(num_ranks):
        w13s.append((torch.randn(e_loc, 2 * I, H, generator=generator) * H ** -0.5)
                    .to(dtype).to(device))
        w2s.append((torch.randn(e_loc, H, I, generator=generator) * I ** -0.5)
                   .to(dtype).to(device))
    return w13s, w2s


def quantize_weights(w13s, w2s, *, fmt: str = "fp8", experts_per_step: int = 8
                     ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per-rank bf16 experts (``make_weights``) -> the pairs the quantized layers take: fp8
    ``(values, scale_inv)`` (the DeepSeek-V3 format, ``quant.convert_expert_weights_fp8``) or
    fp4w ``(packed, scales)`` (MXFP4, ``quant.convert_expert_weights_mxfp4``), computed on the
    weights' device a few experts at a time (the quantizer's fp32 temporaries of a whole dsv3
    rank would take tens of GB)."""
    from .quant import convert_expert_weights_fp8, convert_expert_weights_mxfp4
    if fmt not in ("fp8", "fp4w"):
        raise ValueError(f"fmt must be 'fp8' or 'fp4w', got {fmt!r}")
    convert, s13, s2 = ((convert_expert_weights_fp8, "w13_scale_inv", "w2_scale_inv")
                        if fmt == "fp8" else
                        (convert_expert_weights_mxfp4, "w13_scale", "w2_scale"))
    w13q, w2q = [], []
    for w13, w2 in zip(w13s, w2s):
        parts = [convert(w13[i:i + experts_per_step], w2[i:i + experts_per_step])
                 for i in range(0, w13.shape[0], experts_per_step)]
        cat = (lambda k: torch.cat([d[k] for d in parts]))
        w13q.append((cat("w13"), cat(s13)))
        w2q.append((cat("w2"), cat(s2)))
    return w13q, w2q


def stamp_tokens(x: torch.Tensor, rank: int) -> torch.Tensor:
    """Write (rank, token) into columns 0..2 of every row, exactly representable in bf16:
    column 0 = rank, column 1 = token % 256, column 2 = token // 256. Returns x."""
    T = x.shape[0]
    t = torch.arange(T, device=x.device)
    x[:, 0] = float(rank)
    x[:, 1] = (t % 256).to(x.dtype)
    x[:, 2] = (t // 256).to(x.dtype)
    return x


def read_stamp(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank, token) stamped into rows by ``stamp_tokens``."""
    r = rows[:, 0].float().round().long()
    t = rows[:, 1].float().round().long() + 256 * rows[:, 2].float().round().long()
    return r, t
