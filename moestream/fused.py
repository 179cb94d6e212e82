"""The fused path: publish and layout as in the staged path, then dispatch, L1, L2 and combine
of every local rank in one persistent launch whose programs take tickets in dependency order
(``kernels/fused.py``; the order is ``moestream.schedule``'s)."""
from __future__ import annotations

from typing import Sequence

import torch

from .buffer import SymmBuffer
from .config import MoEConfig, cdiv
from .kernels import fused as _fused
from .kernels.common import INTERPRET, next_pow2
from .launch import (a_rows, constants, ensure_allocator, gemm_weights, host_descriptors,
                     launch_kw, programs, split_scratch, tma, tuning_for, weight_tables)
from .staged import layout, publish
from .tuning import Tuning, fused_min_split

__all__ = ["fused", "check_fused_tuning", "max_tickets", "fused_tuning", "run_fused"]


def max_tickets(buffer: SymmBuffer, tuning: Tuning) -> int:
    """Most tickets one fused launch can hand out (sizes a trace buffer)."""
    cfg = buffer.config
    nb12 = (cfg.intermediate // tuning.l1_tile(cfg)[0]
            + cfg.hidden // tuning.l2_tile(cfg)[0] // tuning.fused.l2_group)
    T = cfg.max_tokens_per_rank
    per_rank = (buffer.num_ranks * T
                + cdiv(T, tuning.fused.combine_tile) * tuning.fused.combine_parts
                + cfg.max_m_blocks(buffer.num_ranks) * nb12)
    if tuning.l2.split_k > 1 and tuning.decode_pieces(cfg) and cfg.dtype == "bf16":
        # split-K parts: a split launch's L2 tiles x parts are at most its programs
        per_rank += programs(buffer, tuning, tuning.fused.per_sm)
    return buffer.local_ranks * per_rank


def check_fused_tuning(cfg: MoEConfig, tuning: Tuning) -> None:
    """What the fused launch needs of a tuning beyond ``Tuning.check`` (ValueError): fp4w
    weights expanded to fp8 blocks (it has no MXFP4 decode)."""
    if tuning.decodes_fp4w(cfg):
        raise ValueError("the fused launch reads fp4w weights expanded to fp8 blocks: "
                         "Tuning.fp4w_expand=True (the policy's choice for impl='fused')")


def fused(buffer: SymmBuffer, w13s: Sequence[torch.Tensor], w2s: Sequence[torch.Tensor],
          y: torch.Tensor, *, tuning: Tuning = Tuning(), trace: torch.Tensor | None = None
          ) -> None:
    """Dispatch, L1, L2 and combine of every local rank in one persistent launch (after
    publish and layout). ``trace``: optional int64 [max_tickets, 8] filled per ticket
    (see kernels/fused.py)."""
    cfg = buffer.config
    c = constants(buffer)
    check_fused_tuning(cfg, tuning)
    w13s = gemm_weights(buffer, w13s, tuning, "l1")
    w2s = gemm_weights(buffer, w2s, tuning, "l2")
    bn1, bk1 = tuning.l1_tile(cfg)
    bn2, bk2 = tuning.l2_tile(cfg)
    fp8 = cfg.fp8_tokens
    dm = tuning.decode_pieces(cfg)
    group = tuning.fused.l2_group
    if group > 1 and dm:
        raise ValueError(f"Fused.l2_group={group} needs whole L2 tiles: use 1 with "
                         f"decode_rows={dm} (decode pieces)")
    if (cfg.hidden // bn2) % group:
        raise ValueError(f"Fused.l2_group={group} must divide the L2's "
                         f"{cfg.hidden // bn2} column blocks (hidden={cfg.hidden} / L2 "
                         f"block_n={bn2})")
    # fp8 whole tiles load by pointer (as the staged fp8 L1), decode pieces by descriptor
    use_tma = tma(buffer, tuning) and (not fp8 or dm > 0)
    ensure_allocator(use_tma)
    y3 = y if y.dim() == 3 else y.unsqueeze(0)
    assert y3.shape[0] == buffer.local_ranks and y3.stride(2) == 1
    nloc = buffer.local_ranks
    w13_tab, w13s_tab = weight_tables(buffer, w13s)
    w2_tab, w2s_tab = weight_tables(buffer, w2s)
    E_LOC, H, I = c.E_LOC, cfg.hidden, cfg.intermediate
    rows = a_rows(cfg.block_m, cfg.block_m, dm, 0)
    descs1, host_kw = host_descriptors(
        buffer, tuning, use_tma, region="pool_x", cols=H, w=w13s[0][0] if fp8 else w13s[0],
        w_shape=(E_LOC * 2 * I, H), a_rows=rows, block_n=bn1, block_k=bk1)
    descs2, _ = host_descriptors(
        buffer, tuning, use_tma, region="pool_act", cols=I, w=w2s[0][0] if fp8 else w2s[0],
        w_shape=(E_LOC * H, I), a_rows=rows, block_n=bn2, block_k=bk2)
    split = tuning.l2.split_k if dm and not fp8 else 1
    sums, counts = split_scratch(buffer, tuning, "fused_l2", split, (dm, bn2),
                                 tuning.fused.per_sm)
    args = (
        buffer.table, buffer.rank0, nloc, w13_tab, w2_tab, w13s_tab, w2s_tab,
        y3, y3.stride(0), y3.stride(1), trace if trace is not None else y3,
        buffer.max_spins, buffer.timeout_ns,
        c.offs,
        cfg.max_tokens_per_rank, cfg.hidden, cfg.intermediate, cfg.num_experts, c.R, c.E_LOC,
        c.P, c.row_words, cfg.token_bytes, cfg.act_bytes, tuning.fused.dispatch_tokens,
        tuning.fused.chunk_blocks, tuning.fused.combine_parts, *descs1, *descs2, sums, counts)
    copy = tuning.copy
    kw = dict(
        K=cfg.top_k, K_PAD=c.K_PAD, R_PAD=c.R_PAD, E_PAD=c.E_PAD, NLOC_PAD=next_pow2(nloc),
        BM=cfg.block_m, BN1=bn1, BK1=bk1, BN2=bn2, BK2=bk2,
        BH=min(next_pow2(c.row_words), copy.hidden_chunk), TT=copy.dispatch_tile,
        EAGER=copy.dispatch_eager, CT=tuning.fused.combine_tile,
        BHC=min(next_pow2(cfg.hidden), copy.combine_chunk or copy.hidden_chunk),
        UPCAST=INTERPRET, USE_TMA=use_tma, USE_TIMER=not INTERPRET,
        ONE_RANK=nloc == 1, TRACE=trace is not None, FP8=fp8, GROUP_M1=tuning.l1.group_m,
        DM=dm, L2G=group, EPI2=tuning.l2.epilogue_split if group > 1 or bn2 > 128 else 1,
        SPLIT_K=split, MIN_SPLIT=fused_min_split(cfg), **host_kw,
        **launch_kw(tuning.l1.warps, tuning.l1.stages))
    # one program per SM, or Fused.per_sm where the compiled kernel fits that many (programs
    # never wait in a cycle however few are resident, kernels/fused.py; co-resident is faster)
    grid = (programs(buffer, tuning, tuning.fused.per_sm, _fused.fused_kernel, args, kw), 1)
    _fused.fused_kernel[grid](*args, **kw)


def fused_tuning(buffer: SymmBuffer, tokens: int, *, tuning: Tuning | None = None,
                 granularity: int | str = "token") -> Tuning:
    """The tuning a fused call with ``tokens`` tokens (the most of any local rank) runs with:
    ``tuning`` (default: the policy's, ``tuning.select``), its dispatch task size resolved
    from ``Fused.dispatch_programs`` in token mode, in streaming mode ``granularity``."""
    tuning = tuning or tuning_for(buffer, tokens, impl="fused")
    if tuning.fused.dispatch_programs and granularity == "token":
        tuning = tuning.with_(fused=dict(dispatch_tokens=max(1, cdiv(
            buffer.num_ranks * tokens, tuning.fused.dispatch_programs))))
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
    check_fused_tuning(buffer.config, tuning)
    for lr in range(buffer.local_ranks):
        publish(buffer, lr, xs[lr], topk_idxs[lr], topk_weights[lr], tuning=tuning)
    layout(buffer, tuning=tuning, waves=True)
    fused(buffer, w13s, w2s, y, tuning=tuning, trace=trace)
