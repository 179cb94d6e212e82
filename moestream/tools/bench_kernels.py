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

from .. import staged
from .bench import WEIGHT_BYTES, result_row, time_cuda
from ..buffer import SymmBuffer
from ..config import MoEConfig
from ..launch import tuning_for
from ..testing import make_tokens, quantize_weights
from ..tuning import Tuning

__all__ = ["GemmVariant", "VARIANTS", "bench_gemm", "l2_error", "picks_per_token",
           "uniform_routing"]


@dataclass(frozen=True)
class GemmVariant:
    """A GEMM form the bench times: the format, each call's tuning the staged layer's."""

    name: str
    dtype: str = "bf16"
    block_m: int = 128

    def tuning_for(self, buf: SymmBuffer, tokens: int) -> Tuning:
        """The tuning timed on ``buf`` for a call of ``tokens`` tokens per rank: the staged
        layer's (``tuning.select``) with the descriptors built on the host, as the layer's
        CUDA graphs run it."""
        return tuning_for(buf, tokens, impl="staged").with_(host_descriptors=True)


def _by_name(variants: list[GemmVariant]) -> dict[str, GemmVariant]:
    out = {v.name: v for v in variants}
    assert len(out) == len(variants), "two GEMM variants share a name"   # one would vanish
    return out


# What the staged layer runs for the call, in each format the bench times
VARIANTS: dict[str, GemmVariant] = _by_name([
    GemmVariant("layer-call"),
    GemmVariant("fp8-layer-call", "fp8"),
    GemmVariant("fp4w-layer-call", "fp4w"),
])


def _dequantized(w, dtype: str) -> torch.Tensor:
    """fp32 weights [E, N, K] of one rank's ``w`` as the layer takes it: bf16 as it is, an fp8
    (values, scale_inv) or fp4w (packed, scales) pair decoded."""
    from ..quant import dequantize_weight_fp8_blocks, dequantize_weight_mxfp4
    if dtype == "fp8":
        return dequantize_weight_fp8_blocks(*w)
    if dtype == "fp4w":
        return dequantize_weight_mxfp4(*w)
    return w.float()


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
        staged.publish(buf, lr, xs[lr], idxs[lr], ws[lr], tuning=tuning)
    staged.layout(buf)
    staged.dispatch(buf, tuning=tuning)
    counts = buf.view("expert_count", 0)
    assert int(counts.min()) == int(counts.max()) == M, counts
    assert e_loc * M == T * cfg.top_k
    return buf, xs, idxs, tuning


def _row(shape, R, M, E, provider, kernel, t, flops, byts, dtype="bf16", **extra) -> dict:
    from .bench import DEFAULT_CALIB
    us = t["median_us"]
    rate = "bf16_tflops" if dtype == "bf16" else "fp8_tflops"   # fp4w: fp8 MMAs
    floor = max(flops / (DEFAULT_CALIB[rate] * 1e6),
                byts / (DEFAULT_CALIB["weights_tbps"] * 1e6))
    return result_row(shape=shape, ranks=R, tokens_per_rank=M, dtype=dtype, provider=provider,
                      kernel=kernel, tokens_per_expert=M, experts=E, median_us=us,
                      p20_us=t["p20_us"], p80_us=t["p80_us"], host_us=t.get("host_us"),
                      tflops_per_gpu=flops / us / 1e6,
                      weight_tbps=byts / us / 1e6, link_gbps=None, floor_us=floor, **extra)


def _l1_error(buf: SymmBuffer, cfg: MoEConfig, w13: torch.Tensor, packed: torch.Tensor, M: int,
              e_loc: int) -> float:
    """Our L1 output on rank 0 against torch: silu(gate) * up * weight, per pool row."""
    from ..testing import rel_error
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
    """Our fp8-token L1 output on rank 0 (dequantized) against fp32 math on the same bytes:
    silu(x @ gate^T) * (x @ up^T) * weight, x and w (fp8 or fp4w) dequantized."""
    from ..quant import dequantize_act_fp8
    from ..testing import rel_error
    H, I, BM = cfg.hidden, cfg.intermediate, cfg.block_m
    bs = buf.view("block_start", 0).tolist()
    rows = torch.cat([torch.arange(bs[e] * BM, bs[e] * BM + M)
                      for e in range(e_loc)]).to(buf.device)

    def deq(region, n):
        r = buf.view(region, 0)[rows]
        return dequantize_act_fp8(r[:, :n].contiguous().view(torch.float8_e4m3fn),
                                  r[:, n:n + 4 * (n // 128)].contiguous().view(torch.float32))
    x = deq("pool_x", H).view(e_loc, M, H)
    w = _dequantized(w13q, cfg.dtype)                                        # [E, 2I, H]
    h = torch.bmm(x, w.transpose(1, 2))
    ref = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
    ref = ref.reshape(e_loc * M, I) * buf.view("pool_weight", 0)[rows][:, None]
    return rel_error(deq("pool_act", I), ref)


def l2_error(buf: SymmBuffer, cfg: MoEConfig, w2, *, rank: int = 0) -> float:
    """The L2 output of local rank ``rank``'s experts against fp32 math on the L1 output it
    read: each valid pool row p of expert e (``pool_act``, dequantized in fp8) times w2[e]^T
    (``w2`` [E/R, H, I] bf16, or the fp8 / fp4w pair), compared with the combine
    slot the row was written to (``pool_src``: source rank * T_MAX * K + token * K + k, on the
    source rank's buffer). Any routing; ``buf`` virtual (every rank local). A row the L2 did
    not write, or wrote to the wrong slot, shows up as a large error."""
    from ..quant import dequantize_act_fp8
    from ..testing import rel_error
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
    w2 = _dequantized(w2, cfg.dtype)
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
    from ..config import SHAPES
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
    wq: dict[str, tuple] = {}   # fp8 / fp4w copies of the weights, made when first needed
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
            if v.dtype in ("fp8", "fp4w"):
                if v.dtype not in wq:
                    wq[v.dtype] = quantize_weights(w13s, w2s, fmt=v.dtype)
                w13q, w2q = wq[v.dtype]
                # an expanded fp4w call (Tuning.fp4w_expand) times its expansion too
                l1 = time_cuda(lambda: staged.l1(buf, w13q, tuning=tuning), warmup=warmup,
                               reps=reps, queue_ahead=True)
                err = _l1_error_fp8(buf, cfg, w13q[0], M, experts_per_rank)
                l2 = time_cuda(lambda: staged.l2(buf, w2q, tuning=tuning), warmup=warmup,
                               reps=reps, queue_ahead=True)
                err2 = l2_error(buf, cfg, w2q[0])
                per = WEIGHT_BYTES[v.dtype] / 2   # bytes per weight over bf16's
                for kernel, t, flops, byts in (("l1", l1, l1_flops, l1_bytes * per),
                                               ("l2", l2, l2_flops, l2_bytes * per)):
                    rows.append(_row(shape, R, M, E, f"ours:{name}", kernel, t, flops, byts,
                                     dtype=v.dtype, l1_rel_error=err, l2_rel_error=err2,
                                     weight_bytes=byts))
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
            l1 = time_cuda(lambda: staged.l1(buf, w13s, tuning=tuning), warmup=warmup, reps=reps,
                           queue_ahead=True)
            err = _l1_error(buf, cfg, w13s[0], packed[0], M, experts_per_rank)
            l2 = time_cuda(lambda: staged.l2(buf, w2s, tuning=tuning), warmup=warmup, reps=reps,
                           queue_ahead=True)
            err2 = l2_error(buf, cfg, w2s[0])
            for kernel, t, flops, byts in (("l1", l1, l1_flops, l1_bytes),
                                           ("l2", l2, l2_flops, l2_bytes)):
                rows.append(_row(shape, R, M, E, f"ours:{name}", kernel, t, flops, byts,
                                 l1_rel_error=err, l2_rel_error=err2, weight_bytes=byts))
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
            rows.append(_row(shape, R, M, E, "torch:_grouped_mm", kernel, t, flops, byts,
                             weight_bytes=byts))
        packed = acts = None
        torch.cuda.empty_cache()
    if any(VARIANTS[n].dtype != "bf16" for n in names):
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
