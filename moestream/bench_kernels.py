"""Single-GPU benchmark of the L1/L2 grouped GEMMs against torch._grouped_mm on the same pool.

The pool comes from the real path: R virtual ranks publish a routing that gives every local
expert exactly M tokens, the dispatch kernel fills the pools, then the L1 and L2 launches are
timed alone (their counters stay satisfied, so they can be repeated). torch._grouped_mm runs on
the same tokens, packed without the pool's padding, and the same weights. Ours includes the
fused SwiGLU x weight epilogue (L1) and the scatter into the combine slots (L2); torch's is the
bare GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import torch

from . import stages
from .bench import result_row, time_cuda
from .buffer import SymmBuffer
from .config import MoEConfig
from .testing import make_tokens, quantize_weights

__all__ = ["GemmVariant", "VARIANTS", "bench_gemm", "l2_error", "picks_per_token",
           "uniform_routing"]


@dataclass(frozen=True)
class GemmVariant:
    """A GEMM configuration: the pool's block_m plus the launch tuning (and the format).
    ``tuning`` None: what the staged layer picks for each call (``tuning_for``)."""

    name: str
    block_m: int
    tuning: stages.Tuning | None
    dtype: str = "bf16"

    def tuning_for(self, buf: SymmBuffer, tokens: int) -> stages.Tuning:
        """The tuning timed on ``buf`` for a call of ``tokens`` tokens per rank: the
        variant's own, or (``tuning`` None) ``stages.Tuning.for_call``'s for that call with
        the descriptors built on the host, as the layer's CUDA graphs run it (decode pieces
        at 16 rows per expert, the L1's gate and up as one MMA from 256)."""
        if self.tuning is not None:
            return self.tuning
        return replace(stages.Tuning.for_call(buf, tokens), host_descriptors=True)


def _v(name: str, block_m: int, l1: tuple, l2: tuple, **kw) -> GemmVariant:
    """l1/l2 = (block_n, block_k, warps, stages)."""
    return GemmVariant(name, block_m, stages.Tuning(
        l1_block_n=l1[0], l1_block_k=l1[1], l1_warps=l1[2], l1_stages=l1[3],
        l2_block_n=l2[0], l2_block_k=l2[1], l2_warps=l2[2], l2_stages=l2[3],
        **{"use_tma": True, "wait": False, **kw}))


# GEMM variants: the layer's defaults and alternatives to them, timed side by side (the
# choices they informed: docs/tuning.md).
# The layer's defaults at block_m 128 (Tuning.hopper; every benchmark shape's hidden is a
# multiple of 256, so the bf16 L2 is the 128x256 tile); _BF16_S20: the 128x128 bf16 L2 (4 warps,
# 3 stages, two programs per SM; the default where 256 does not divide hidden), which the
# "l2-*" variants vary.
# The GEMMs run eagerly here, but are timed as the layer runs them in a CUDA graph: with the
# descriptors built on the host (Tuning.host_descriptors; "*-devdesc": built in the kernel)
_BF16 = replace(stages.Tuning.hopper(128, hidden=4096, intermediate=2048), use_tma=True,
                host_descriptors=True)
_BF16_S20 = replace(_BF16, l2_block_n=128, l2_warps=4, l2_stages=3)
# fp8: the L2 in 64-row pieces (the layer's default where intermediate < 2048, qwen3) and
# _FP8_S5 the 128-row 8-warp tile (the default from 2048 on: dsv3, v4flash, mixtral)
_FP8 = replace(stages.Tuning.hopper(128, "fp8", hidden=2048, intermediate=768),
               host_descriptors=True)
_FP8_S5 = replace(_FP8, l2_split_m=1, l2_warps=8, l2_stages=4, l2_flat=False)
assert _FP8_S5 == replace(stages.Tuning.hopper(128, "fp8", hidden=4096, intermediate=2048),
                          host_descriptors=True)
# Tuning.decode looks at the dtype and whether intermediate is a multiple of 64 (all shapes)
_DIMS_64 = MoEConfig(hidden=128, intermediate=128, num_experts=1, top_k=1, max_tokens_per_rank=1)
_DIMS_FP8 = replace(_DIMS_64, dtype="fp8")
def _by_name(variants: list[GemmVariant]) -> dict[str, GemmVariant]:
    out = {v.name: v for v in variants}
    assert len(out) == len(variants), "two GEMM variants share a name"   # one would vanish
    return out


VARIANTS: dict[str, GemmVariant] = _by_name([
    # what the staged layer runs for the call (Tuning.for_call): the kernel issue's table
    GemmVariant("layer-call", 128, None),
    GemmVariant("layer-default", 128, _BF16),   # Tuning.hopper: L2 128x256 8w4s, flat, 1/4
    GemmVariant("l2n128", 128, _BF16_S20),   # L2 128x128 4w3s
    # a baseline: L2 128x64 4w4s, whole-tile epilogue, no flat loop
    _v("s4-default", 128, (128, 64, 8, 4), (64, 64, 4, 4)),
    # ... with 264 programs (2 per SM of an H200): L1 (one program per SM fits) then runs as
    # two passes (stages._programs)
    _v("s4-default-p264", 128, (128, 64, 8, 4), (64, 64, 4, 4), programs=264),
    _v("l1w8s3", 128, (128, 64, 8, 3), (64, 64, 4, 4)),
    _v("l2n128w8s3", 128, (128, 64, 8, 3), (128, 64, 8, 3)),
    _v("l2n128w8s4", 128, (128, 64, 8, 4), (128, 64, 8, 4)),
    _v("m64", 64, (128, 64, 4, 4), (128, 64, 4, 4)),
    GemmVariant("l2-split2", 128, replace(_BF16_S20, l2_epilogue_split=2)),
    GemmVariant("l2-noflat", 128, replace(_BF16_S20, l2_flat=False)),
    GemmVariant("l2-split1", 128, replace(_BF16_S20, l2_epilogue_split=1)),
    GemmVariant("l1n64w4s3", 128, replace(_BF16, l1_block_n=64, l1_warps=4, l1_stages=3)),
    # 64-wide L1 blocks at the default's 8 warps / 4 stages (what Tuning.for_call picks when a
    # call's tiles would leave a second round of programs mostly idle; decode)
    GemmVariant("l1n64", 128, replace(_BF16, l1_block_n=64)),
    # fp8 (DeepSeek-V3 block scales): the layer's fp8 defaults at qwen3 dims (Tuning.hopper(128,
    # "fp8"): the L2 in 64-row pieces, 4 warps, flat); the variants after "fp8-s5" vary
    # _FP8_S5 (one 8-warp 128-row L2 program per SM, the default from intermediate 2048)
    GemmVariant("fp8", 128, replace(_FP8, use_tma=True), "fp8"),
    GemmVariant("fp8-s5", 128, replace(_FP8_S5, use_tma=True), "fp8"),
    # decode pieces (Tuning.decode_rows): the weight tile as the MMA row operand.
    # dec16 / fp8-dec16: what Tuning.for_call picks (Tuning.decode); the others vary it
    GemmVariant("dec16", 128, _BF16.decode(16, _DIMS_64)),
    GemmVariant("dec32", 128, _BF16.decode(32, _DIMS_64)),
    GemmVariant("dec16-l1n128", 128, replace(_BF16.decode(16, _DIMS_64), l1_block_n=128,
                                             l1_stages=4)),   # one program per SM
    GemmVariant("fp8-dec16", 128, replace(_FP8, use_tma=True).decode(16, _DIMS_FP8), "fp8"),
    GemmVariant("fp8-dec32", 128, replace(_FP8, use_tma=True).decode(32, _DIMS_FP8), "fp8"),
    GemmVariant("fp8-dec16-w8", 128, replace(replace(_FP8, use_tma=True).decode(16, _DIMS_FP8),
                                             l1_warps=8, l1_stages=4, l2_warps=8,
                                             l2_stages=4), "fp8"),
    # decode launch shapes (pipeline depth, programs per SM, K step, L2 width)
    GemmVariant("dec16-s4", 128, replace(_BF16.decode(16, _DIMS_64), l1_stages=4, l2_stages=4)),
    # three programs per SM (3 stages: ~61 KB of shared memory each)
    GemmVariant("dec16-p3", 128, replace(_BF16.decode(16, _DIMS_64), l1_stages=3, l2_stages=3,
                                         gemm_per_sm=3)),
    # four programs per SM in 3 stages: at qwen3 dims with 32 experts every decode
    # L1 tile (384) and L2 tile (512) has a program of its own, all in flight at once
    GemmVariant("dec16-p4", 128, replace(_BF16.decode(16, _DIMS_64), l1_stages=3, l2_stages=3,
                                         gemm_per_sm=4)),
    # the fp8 decode L1 split-K (kernels/gemm.l1_fp8_split_part; Tuning.for_call sets it
    # where a call's tiles split, stages.fp8_l1_split_for)
    GemmVariant("fp8-dec16-split4", 128, replace(replace(_FP8, use_tma=True).decode(
        16, _DIMS_FP8), l1_split_k=4), "fp8"),
    # decode pieces by pointer loads (cp.async) instead of TMA descriptors
    GemmVariant("dec16-ptr", 128, replace(_BF16.decode(16, _DIMS_64), use_tma=False)),
    GemmVariant("dec16-l2k128", 128, replace(_BF16.decode(16, _DIMS_64), l2_block_k=128,
                                             l2_stages=2)),
    GemmVariant("dec16-l2n64", 128, replace(_BF16.decode(16, _DIMS_64), l2_block_n=64,
                                            gemm_per_sm=3)),
    # 256-wide decode L2 blocks (half the tiles of dec16: one wave at qwen3 dims instead of
    # two; ~110 KB of shared memory at 3 stages, two programs per SM); no faster than dec16
    GemmVariant("dec16-l2n256", 128, replace(_BF16.decode(16, _DIMS_64), l2_block_n=256,
                                             l2_stages=3)),
    GemmVariant("fp8-dec16-l1s3", 128, replace(replace(_FP8, use_tma=True).decode(16, _DIMS_FP8),
                                               l1_stages=3), "fp8"),   # L1 two per SM
    GemmVariant("fp8-dec16-p3", 128, replace(replace(_FP8, use_tma=True).decode(16, _DIMS_FP8),
                                             l1_stages=3, l2_stages=3, gemm_per_sm=3), "fp8"),
    # deep pipelines (one program per SM, more bytes in flight per SM), for calls with fewer
    # tiles than SMs; equal or slower than the defaults except the qwen3 bf16 L1 at 1 row
    GemmVariant("dec16-deep", 128, replace(_BF16.decode(16, _DIMS_64), l1_stages=10,
                                           l2_stages=10)),
    GemmVariant("fp8-dec16-deep", 128, replace(replace(_FP8, use_tma=True).decode(16, _DIMS_FP8),
                                               l1_stages=5, l2_stages=10), "fp8"),
    GemmVariant("fp8-ptr", 128, replace(_FP8_S5, use_tma=False), "fp8"),   # pointer loads
    GemmVariant("fp8-l1s4", 128, replace(_FP8_S5, use_tma=True, l1_stages=4), "fp8"),
    # L2 in 64-row pieces of the 128-row m-blocks, 4 warps: two programs per SM
    GemmVariant("fp8-sm2", 128, replace(_FP8_S5, use_tma=True, l2_split_m=2, l2_warps=4,
                                        l2_stages=3), "fp8"),
    GemmVariant("fp8-sm2s4", 128, replace(_FP8_S5, use_tma=True, l2_split_m=2, l2_warps=4,
                                          l2_stages=4), "fp8"),
    GemmVariant("fp8-sm2-flat", 128, replace(_FP8_S5, use_tma=True, l2_split_m=2, l2_warps=4,
                                             l2_stages=3, l2_flat=True), "fp8"),
    GemmVariant("l2-sm2", 128, replace(_BF16_S20, l2_split_m=2)),
    GemmVariant("fp8-split1", 128, replace(_FP8_S5, l2_epilogue_split=1), "fp8"),
    GemmVariant("fp8-split4", 128, replace(_FP8_S5, l2_epilogue_split=4), "fp8"),
    GemmVariant("fp8-p264", 128, replace(_FP8_S5, l2_epilogue_split=1, programs=264), "fp8"),
    GemmVariant("fp8-l2n64", 128, replace(_FP8_S5, l2_block_n=64, l2_warps=4, l2_stages=4),
                "fp8"),
    GemmVariant("fp8-l2n64-flat", 128, replace(_FP8_S5, l2_block_n=64, l2_warps=4,
                                               l2_stages=4, l2_flat=True), "fp8"),
    GemmVariant("fp8-s4", 128, replace(_FP8_S5, l1_stages=4, l2_stages=4), "fp8"),
    GemmVariant("fp8-flat", 128, replace(_FP8_S5, l2_flat=True), "fp8"),
    GemmVariant("fp8-m64", 64, replace(_FP8_S5, l1_stages=4, l2_stages=4), "fp8"),
    # tail pieces in both GEMMs (Tuning.l1_tail_rows / l2_tail_rows; run at M just
    # past a multiple of block_m, e.g. 136 or 160, every expert ends in a partly filled block)
    GemmVariant("tail32", 128, replace(_BF16, l1_tail_rows=32, l2_tail_rows=32)),
    GemmVariant("fp8-tail16", 128, replace(_FP8, use_tma=True, l1_tail_rows=16,
                                           l2_tail_rows=16), "fp8"),
    GemmVariant("fp8-tail32", 128, replace(_FP8, use_tma=True, l1_tail_rows=32,
                                           l2_tail_rows=32), "fp8"),
    # a 128x256 bf16 L2 tile, 8 warps, one program per SM (a quarter less operand
    # traffic per FLOP than 128x128; sm_90 compile: 255 registers, no spill at 2 ranks)
    GemmVariant("l2n256w8s3", 128, replace(_BF16, l2_block_n=256, l2_warps=8, l2_stages=3)),
    GemmVariant("l2n256w8s4", 128, replace(_BF16, l2_block_n=256, l2_warps=8, l2_stages=4)),
    # the same tile stored in two halves (sm_90: 192-221 registers, 224 KB of shared memory,
    # no spills)
    GemmVariant("l2n256-split2", 128, replace(_BF16, l2_block_n=256, l2_warps=8, l2_stages=4,
                                              l2_epilogue_split=2)),
    # the L1's gate and up as one 256-wide MMA (a [2, 128, 64] weight tile by a 3-D
    # descriptor; sm_90: fewer instructions per K step than two MMAs, no spills)
    GemmVariant("l1-onedot", 128, replace(_BF16, l1_one_dot=True)),
    # the one-MMA L1 with 128-deep K steps in 2 stages (96 KB each; sm_90 at dsv3 dims: 8
    # HGMMA in 105 instructions per K step against 4 in 80) or in 3 stages of 64
    # (what Tuning.for_call launches from hidden 4096: stages.ONE_DOT_L1_STAGES)
    GemmVariant("l1-onedot-k128s2", 128, replace(_BF16, l1_one_dot=True, l1_block_k=128,
                                                 l1_stages=2)),
    GemmVariant("l1-onedot-s3", 128, replace(_BF16, l1_one_dot=True, l1_stages=3)),
    GemmVariant("l1-s3", 128, replace(_BF16, l1_stages=3)),   # two MMAs, 3 stages
    # the tensor descriptors built in every program (Tuning.host_descriptors off: the eager
    # layer's form; two local ranks and the fused launch build them there too)
    GemmVariant("layer-default-devdesc", 128, replace(_BF16, host_descriptors=False)),
    GemmVariant("dec16-devdesc", 128, replace(_BF16.decode(16, _DIMS_64),
                                              host_descriptors=False)),
    GemmVariant("fp8-devdesc", 128, replace(_FP8, use_tma=True, host_descriptors=False),
                "fp8"),
    GemmVariant("fp8-dec16-devdesc", 128, replace(replace(_FP8, use_tma=True).decode(
        16, _DIMS_FP8), host_descriptors=False), "fp8"),
    # split-K decode GEMMs (Tuning.l1_split_k / l2_split_k, 4 in dec16; they apply only where
    # a call's tiles are at most a quarter of the programs: benchmarks/launch_floor.py walks
    # 1..E blocks): off, or 8 parts; these two set both GEMMs
    GemmVariant("dec16-nosplit", 128, replace(_BF16.decode(16, _DIMS_64), l1_split_k=1,
                                              l2_split_k=1)),
    GemmVariant("dec16-split8", 128, replace(_BF16.decode(16, _DIMS_64), l1_split_k=8,
                                             l2_split_k=8)),
    GemmVariant("dec16-l2nosplit", 128, replace(_BF16.decode(16, _DIMS_64), l2_split_k=1)),
    # round-robin tickets (claims off), the L2's 16-row pieces stored whole
    GemmVariant("dec16-rr", 128, replace(_BF16.decode(16, _DIMS_64), gemm_claim=False)),
    GemmVariant("dec16-epi1", 128, replace(_BF16.decode(16, _DIMS_64), l2_epilogue_split=1)),
    # decode L2 weight tiles 64 rows x 256 columns (512-byte row segments per
    # load instead of 128): 2 stages (two programs per SM) or 3 (one)
    GemmVariant("dec16-l2k256s2", 128, replace(_BF16.decode(16, _DIMS_64), l2_block_n=64,
                                               l2_block_k=256, l2_stages=2)),
    GemmVariant("dec16-l2k256s3", 128, replace(_BF16.decode(16, _DIMS_64), l2_block_n=64,
                                               l2_block_k=256, l2_stages=3)),
    # the bf16 decode L2 with 8 warps (two warpgroups, 64 weight rows each) or 6 stages
    # (18 KB each); both slower than dec16
    GemmVariant("dec16-l2w8", 128, replace(_BF16.decode(16, _DIMS_64), l2_warps=8)),
    GemmVariant("dec16-l2s6", 128, replace(_BF16.decode(16, _DIMS_64), l2_stages=6)),
])


def uniform_routing(num_tokens: int, num_experts: int, top_k: int, *, first_expert: int = 0,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """topk_idx [T, K] int32 giving each of ``num_experts`` experts T*K/E picks, distinct
    experts per token (K <= E), experts numbered from ``first_expert``."""
    t = torch.arange(num_tokens, device=device)[:, None]
    k = torch.arange(top_k, device=device)[None, :]
    return ((t * top_k + k) % num_experts + first_expert).to(torch.int32)


def picks_per_token(*, experts: int, rows_per_expert: int, ranks: int, top_k: int) -> int:
    """The K of the GEMM benchmark's routing: the largest k <= min(top_k, experts) for which
    every rank's tokens (experts * rows_per_expert / (ranks * k) each) give every expert
    exactly rows_per_expert rows (v4flash's top-6 over 32 experts at 128 rows each cannot).
    K shapes only which tokens the rows come from, not the GEMMs' work; 1 always fits.
    Every rank routes its tokens alike, so rows_per_expert must be a multiple of ranks."""
    if rows_per_expert % ranks:
        raise ValueError(f"tokens per expert ({rows_per_expert}) must be a multiple of the "
                         f"virtual ranks ({ranks}): each rank sends every expert the same rows")
    for k in range(min(top_k, experts), 0, -1):
        if experts * rows_per_expert % (ranks * k) == 0:
            return k
    raise AssertionError("unreachable: experts is a multiple of ranks")


def _prepare(cfg: MoEConfig, R: int, M: int, variant: GemmVariant, device, gen):
    """Buffer with every virtual rank's pool filled by the dispatch kernel: M tokens for each
    of its E/R experts (sources spread over all ranks); also the variant's tuning for it."""
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    e_loc = cfg.experts_per_rank(R)
    # every rank sends to every rank's experts: T*K picks per rank, E*M/R per rank in all
    T = cfg.num_experts * M // (R * cfg.top_k)
    tuning = variant.tuning_for(buf, T)
    xs = [make_tokens(T, cfg.hidden, generator=gen, device=device) for _ in range(R)]
    idxs = [uniform_routing(T, cfg.num_experts, cfg.top_k, device=device) for _ in range(R)]
    ws = [torch.rand(T, cfg.top_k, generator=gen).to(device) for _ in range(R)]
    for lr in range(R):
        stages.publish(buf, lr, xs[lr], idxs[lr], ws[lr], tuning=tuning)
    stages.layout(buf)
    stages.dispatch(buf, tuning=tuning)
    counts = buf.view("expert_count", 0)
    assert int(counts.min()) == int(counts.max()) == M, counts
    assert e_loc * M == T * cfg.top_k
    return buf, xs, idxs, tuning


def _row(shape, R, M, E, provider, kernel, t, flops, byts, dtype="bf16", **extra) -> dict:
    from .bench import DEFAULT_CALIB
    us = t["median_us"]
    floor = max(flops / (DEFAULT_CALIB[f"{dtype}_tflops"] * 1e6),
                byts / (DEFAULT_CALIB["weights_tbps"] * 1e6))
    return result_row(shape=shape, ranks=R, tokens_per_rank=M, dtype=dtype, provider=provider,
                      kernel=kernel, tokens_per_expert=M, experts=E, median_us=us,
                      p20_us=t["p20_us"], p80_us=t["p80_us"], host_us=t.get("host_us"),
                      tflops_per_gpu=flops / us / 1e6,
                      weight_tbps=byts / us / 1e6, link_gbps=None, floor_us=floor, **extra)


def _l1_error(buf: SymmBuffer, cfg: MoEConfig, w13: torch.Tensor, packed: torch.Tensor, M: int,
              e_loc: int) -> float:
    """Our L1 output on rank 0 against torch: silu(gate) * up * weight, per pool row."""
    from .testing import rel_error
    I = cfg.intermediate
    offs = torch.arange(1, e_loc + 1, device=packed.device, dtype=torch.int32) * M
    h = torch._grouped_mm(packed, w13.transpose(-2, -1), offs=offs).float()
    bs = buf.view("block_start", 0).tolist()
    rows = torch.cat([torch.arange(bs[e] * cfg.block_m, bs[e] * cfg.block_m + M)
                      for e in range(e_loc)]).to(packed.device)
    w = buf.view("pool_weight", 0)[rows]
    ref = torch.nn.functional.silu(h[:, :I]) * h[:, I:] * w[:, None]
    return rel_error(buf.view("pool_act", 0)[rows], ref)


def _l1_error_fp8(buf: SymmBuffer, cfg: MoEConfig, w13q, M: int, e_loc: int) -> float:
    """Our fp8 L1 output on rank 0 (dequantized) against fp32 math on the same fp8 bytes:
    silu(x @ gate^T) * (x @ up^T) * weight, x and w dequantized."""
    from .quant import dequantize_act_fp8, dequantize_weight_fp8_blocks
    from .testing import rel_error
    H, I, BM = cfg.hidden, cfg.intermediate, cfg.block_m
    bs = buf.view("block_start", 0).tolist()
    rows = torch.cat([torch.arange(bs[e] * BM, bs[e] * BM + M)
                      for e in range(e_loc)]).to(buf.device)

    def deq(region, n):
        r = buf.view(region, 0)[rows]
        return dequantize_act_fp8(r[:, :n].contiguous().view(torch.float8_e4m3fn),
                                  r[:, n:n + 4 * (n // 128)].contiguous().view(torch.float32))
    x = deq("pool_x", H).view(e_loc, M, H)
    w = dequantize_weight_fp8_blocks(*w13q)                                  # [E, 2I, H]
    h = torch.bmm(x, w.transpose(1, 2))
    ref = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
    ref = ref.reshape(e_loc * M, I) * buf.view("pool_weight", 0)[rows][:, None]
    return rel_error(deq("pool_act", I), ref)


def l2_error(buf: SymmBuffer, cfg: MoEConfig, w2, *, rank: int = 0) -> float:
    """The L2 output of local rank ``rank``'s experts against fp32 math on the L1 output it
    read: each valid pool row p of expert e (``pool_act``, dequantized in fp8) times w2[e]^T
    (``w2`` [E/R, H, I] bf16, or the fp8 (values, scale_inv) pair), compared with the combine
    slot the row was written to (``pool_src``: source rank * T_MAX * K + token * K + k, on the
    source rank's buffer). Any routing; ``buf`` virtual (every rank local). A row the L2 did
    not write, or wrote to the wrong slot, shows up as a large error."""
    from .quant import dequantize_act_fp8, dequantize_weight_fp8_blocks
    from .testing import rel_error
    H, I, BM = cfg.hidden, cfg.intermediate, cfg.block_m
    slots = cfg.max_tokens_per_rank * cfg.top_k
    counts = buf.view("expert_count", rank).tolist()
    bs = buf.view("block_start", rank).tolist()
    per_expert = [torch.arange(bs[e] * BM, bs[e] * BM + n, device=buf.device)
                  for e, n in enumerate(counts)]
    act = buf.view("pool_act", rank)
    if cfg.fp8_tokens:
        act = dequantize_act_fp8(act[:, :I].contiguous().view(torch.float8_e4m3fn),
                                 act[:, I:I + 4 * (I // 128)].contiguous().view(torch.float32))
        w2 = dequantize_weight_fp8_blocks(*w2)
    ref = torch.cat([act[rows].float() @ w2[e].float().T for e, rows in enumerate(per_expert)])
    src = buf.view("pool_src", rank)[torch.cat(per_expert)].long()
    out = torch.empty_like(ref)
    for r in src.div(slots, rounding_mode="floor").unique().tolist():
        mine = src // slots == r
        out[mine] = buf.view("combine_y", r).view(-1, H)[src[mine] % slots].float()
    return rel_error(out, ref)


def bench_gemm(*, shape: str, tokens_per_expert: Iterable[int], experts_per_rank: int = 32,
               virtual_ranks: int = 1, variants: Iterable[str] | None = None,
               warmup: int = 5, reps: int = 20, seed: int = 0, progress=None,
               device: str | torch.device = "cuda") -> list[dict]:
    """Rows (one per kernel x provider x M): ours for each variant, torch._grouped_mm once.

    Args:
        shape: a shape name of ``moestream.config.SHAPES`` (hidden/intermediate/top_k from it).
        tokens_per_expert: M values; each local expert of every rank gets exactly M tokens.
        experts_per_rank: local experts (the model's expert count is replaced by
            experts_per_rank * virtual_ranks so that the weights fit one GPU).
        virtual_ranks: R; the L1/L2 launches cover all R pools.
    """
    from .config import SHAPES
    device = torch.device(device)
    names = list(variants) if variants else list(VARIANTS)
    dims = SHAPES[shape]
    R = virtual_ranks
    E = experts_per_rank * R
    H, I = dims["hidden"], dims["intermediate"]
    gen = torch.Generator().manual_seed(seed)
    gpu_gen = torch.Generator(device=device).manual_seed(seed)
    # random weights drawn on the GPU (drawing GBs on the host would dominate the run)
    w13s = [(torch.randn(experts_per_rank, 2 * I, H, generator=gpu_gen, device=device)
             * H ** -0.5).bfloat16() for _ in range(R)]
    w2s = [(torch.randn(experts_per_rank, H, I, generator=gpu_gen, device=device)
            * I ** -0.5).bfloat16() for _ in range(R)]
    rows: list[dict] = []
    w8 = None   # fp8 copies of the weights, made when an fp8 variant first needs them
    for M in tokens_per_expert:
        K = picks_per_token(experts=E, rows_per_expert=M, ranks=R, top_k=dims["top_k"])
        t_max = E * M // (R * K)
        weights_cfg = MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K,
                                max_tokens_per_rank=t_max)
        l1_flops = 2 * E * M * 2 * I * H
        l2_flops = 2 * E * M * H * I
        l1_bytes = sum(w.numel() * 2 for w in w13s)
        l2_bytes = sum(w.numel() * 2 for w in w2s)
        packed = None   # the tokens of a bf16 variant's pool, packed for torch
        for name in names:
            v = VARIANTS[name]
            cfg = replace(weights_cfg, block_m=v.block_m, dtype=v.dtype)
            buf, xs, idxs, tuning = _prepare(cfg, R, M, v, device, gen)
            if v.dtype == "fp8":
                if w8 is None:
                    w8 = quantize_weights(w13s, w2s)
                l1 = time_cuda(lambda: stages.l1(buf, w8[0], tuning=tuning), warmup=warmup,
                               reps=reps, queue_ahead=True)
                err = _l1_error_fp8(buf, cfg, w8[0][0], M, experts_per_rank)
                l2 = time_cuda(lambda: stages.l2(buf, w8[1], tuning=tuning), warmup=warmup,
                               reps=reps, queue_ahead=True)
                err2 = l2_error(buf, cfg, w8[1][0])
                for kernel, t, flops, byts in (("l1", l1, l1_flops, l1_bytes // 2),
                                               ("l2", l2, l2_flops, l2_bytes // 2)):
                    rows.append(_row(shape, R, M, E, f"ours:{name}", kernel, t, flops, byts,
                                     dtype="fp8", l1_rel_error=err, l2_rel_error=err2))
                buf.destroy()
                if progress:
                    progress()
                continue
            # the same tokens, packed per expert without padding, for torch
            packed = []
            for d in range(R):
                bs = buf.view("block_start", d).tolist()
                pool = buf.view("pool_x", d)
                packed.append(torch.cat([pool[bs[e] * cfg.block_m: bs[e] * cfg.block_m + M]
                                         for e in range(experts_per_rank)]))
            l1 = time_cuda(lambda: stages.l1(buf, w13s, tuning=tuning), warmup=warmup, reps=reps,
                           queue_ahead=True)
            err = _l1_error(buf, cfg, w13s[0], packed[0], M, experts_per_rank)
            l2 = time_cuda(lambda: stages.l2(buf, w2s, tuning=tuning), warmup=warmup, reps=reps,
                           queue_ahead=True)
            err2 = l2_error(buf, cfg, w2s[0])
            for kernel, t, flops, byts in (("l1", l1, l1_flops, l1_bytes), ("l2", l2, l2_flops, l2_bytes)):
                rows.append(_row(shape, R, M, E, f"ours:{name}", kernel, t, flops, byts,
                                 l1_rel_error=err, l2_rel_error=err2))
            buf.destroy()   # before the next variant allocates its own
            if progress:
                progress()
        if packed is None:   # only fp8 variants ran: no bf16 pool to hand torch
            continue
        # torch on the same tokens
        offs = (torch.arange(1, experts_per_rank + 1, device=device, dtype=torch.int32) * M)
        acts = [torch.randn(experts_per_rank * M, I, device=device).bfloat16() for _ in range(R)]

        def torch_l1():
            for d in range(R):
                torch._grouped_mm(packed[d], w13s[d].transpose(-2, -1), offs=offs)

        def torch_l2():
            for d in range(R):
                torch._grouped_mm(acts[d], w2s[d].transpose(-2, -1), offs=offs)

        for kernel, fn, flops, byts in (("l1", torch_l1, l1_flops, l1_bytes),
                                        ("l2", torch_l2, l2_flops, l2_bytes)):
            t = time_cuda(fn, warmup=warmup, reps=reps, queue_ahead=True)
            rows.append(_row(shape, R, M, E, "torch:_grouped_mm", kernel, t, flops, byts))
        packed = acts = None
        torch.cuda.empty_cache()
    if any(VARIANTS[n].dtype == "fp8" for n in names):
        rows.append(_dense_fp8_row(shape, warmup=warmup, reps=reps, device=device))
    return rows


def _dense_fp8_row(shape: str, *, n: int = 8192, warmup: int, reps: int,
                   device: torch.device) -> dict:
    """The GPU's dense fp8 rate (the fp8 compute ceiling): torch._scaled_mm of two n x n e4m3
    matrices with unit scales, bf16 out, 2 n^3 FLOP."""
    dev = device
    if dev.type != "cuda":
        n = 256
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    t = time_cuda(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                           out_dtype=torch.bfloat16), warmup=warmup, reps=reps)
    return result_row(shape=shape, ranks=1, tokens_per_rank=n, dtype="fp8",
                      provider="torch:_scaled_mm", kernel="dense", median_us=t["median_us"],
                      p20_us=t["p20_us"], p80_us=t["p80_us"],
                      tflops_per_gpu=2 * n ** 3 / t["median_us"] / 1e6, link_gbps=None,
                      floor_us=None)
