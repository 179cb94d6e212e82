"""The staged path: each stage of the layer is one kernel launch over a SymmBuffer.

    publish (one launch per local rank; its last program signals the peers) -> layout ->
    dispatch -> L1 -> L2 -> combine

Each launch serves every local rank of the buffer (all R virtual ranks, or this process's one
real rank). Stages communicate only through the buffer's counters, so the same kernels also
run inside the persistent launch (``moestream.fused``). Tests drive the stages one by one to
inspect the buffer.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .buffer import SymmBuffer
from .config import cdiv
from .kernels import combine as _combine
from .kernels import dispatch as _dispatch
from .kernels import l1 as _l1
from .kernels import l2 as _l2
from .kernels import pool as _pool
from .kernels import publish as _publish
from .kernels.common import INTERPRET, next_pow2
from .launch import (a_rows, constants, ensure_allocator, gemm_weights, host_descriptors,
                     launch_kw, programs, row_chunk, row_chunks, split_scratch, stream_ordered,
                     tma, tuning_for, wave_blocks, weight_tables)
from .regions import DIAG_FIELDS
from .tuning import Tuning

__all__ = ["STAGES", "pick_slots", "publish", "layout", "dispatch", "dispatch_parts", "l1",
           "l2", "combine", "run_staged"]

assert DIAG_FIELDS.index("bad_topk") == 8  # the publish kernel adds to diag + 8

# the staged path's launches in order (run_staged's on_stage names)
STAGES = ("publish", "layout", "dispatch", "l1", "l2", "combine")


def pick_slots(topk_idx: torch.Tensor, num_experts: int, *,
               tuning: Tuning = Tuning()) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing.source_slots`` (counts [E] int32, slot [T, K] int32) in one kernel launch
    (``kernels/publish.source_slots_kernel``) instead of a dozen torch ops with a sort. The
    publish launch runs the same numbering in programs of its own, straight into the buffer;
    this form serves tests and callers that want the slots as tensors. ``topk_idx`` must be
    contiguous."""
    T, K = topk_idx.shape
    counts = torch.empty(num_experts, dtype=torch.int32, device=topk_idx.device)
    slot = torch.empty(T, K, dtype=torch.int32, device=topk_idx.device)
    n = T * K
    _publish.source_slots_kernel[(num_experts + 1,)](
        topk_idx, slot, counts, n, num_experts, BLOCK=min(max(next_pow2(max(n, 1)), 128), 4096),
        **launch_kw(tuning.copy.warps))
    return counts, slot


def publish(buffer: SymmBuffer, local: int, x: torch.Tensor, topk_idx: torch.Tensor,
            topk_weights: torch.Tensor, *, tuning: Tuning = Tuning()) -> None:
    """Copy one local rank's inputs into the next parity of its buffer, number its picks
    (``routing.source_slots``), zero its counters, then signal the peers (epoch += 1,
    ready = epoch), all in one launch. Inputs must already be validated (contiguous topk
    tensors, x rows with unit stride)."""
    cfg = buffer.config
    c = constants(buffer)
    T = x.shape[0]
    BT = 8
    copy = max(cdiv(T, BT), cdiv(c.reset_words, 16384), 1)
    n = T * cfg.top_k
    _publish.publish_kernel[(copy + cfg.num_experts + 1,)](
        buffer.table, buffer.global_rank(local), buffer.address(local), x, topk_idx, topk_weights,
        T, x.stride(0) if T else cfg.hidden, cfg.max_tokens_per_rank, cfg.hidden,
        cfg.token_bytes, copy, c.offs, c.reset_words,
        E=cfg.num_experts, K=cfg.top_k, K_PAD=c.K_PAD, BT=BT,
        BH=min(next_pow2(cfg.hidden), 512), BZ=1024,
        BLOCK=min(max(next_pow2(max(n, 1)), 128), 4096), QUANT=cfg.fp8_tokens,
        FIX_ROUNDING=INTERPRET, HOST_BASE=True, PEER_SCOPE=buffer.peer_scope,
        **launch_kw(tuning.copy.warps))


def layout(buffer: SymmBuffer, *, tuning: Tuning = Tuning(), waves: bool = False) -> None:
    """Every local rank's pool layout of this call, after its peers' ready flags; ``waves``:
    also the expert waves (the fused launch walks them; the staged launches do not)."""
    c = constants(buffer)
    cfg = buffer.config
    _pool.layout_kernel[(buffer.local_ranks,)](
        buffer.table, buffer.rank0, buffer.max_spins, buffer.timeout_ns, buffer.host_base or 0,
        c.offs, c.R, c.E_LOC, cfg.block_m,
        cfg.intermediate // tuning.l1_tile(cfg)[0], wave_blocks(buffer, tuning),
        R_PAD=c.R_PAD, E_PAD=c.E_PAD, BLOCK_J=8, USE_TIMER=not INTERPRET, WAVES=waves,
        HOST_BASE=buffer.host_base is not None, STREAM=stream_ordered(buffer, tuning))


def dispatch_parts(buffer: SymmBuffer, tuning: Tuning) -> int:
    """Parts of a row the staged dispatch moves as separate tickets (``Copy.dispatch_parts``,
    at most one per row chunk); the L1 waits for valid_m times this many arrivals."""
    return min(tuning.copy.dispatch_parts,
               row_chunks(constants(buffer).row_words, tuning.copy.hidden_chunk))


def dispatch(buffer: SymmBuffer, *, tuning: Tuning = Tuning()) -> None:
    """Every local rank pulls its experts' tokens from every source rank into its pool."""
    cfg = buffer.config
    c = constants(buffer)
    grid = (programs(buffer, tuning, 4), buffer.local_ranks)
    _dispatch.dispatch_kernel[grid](
        buffer.table, buffer.rank0, buffer.host_base or 0,
        c.offs,
        cfg.max_tokens_per_rank, c.row_words, c.R, c.E_LOC, cfg.block_m, c.P,
        dispatch_parts(buffer, tuning), K=cfg.top_k, K_PAD=c.K_PAD, R_PAD=c.R_PAD,
        BH=row_chunk(c.row_words, tuning.copy.hidden_chunk), TT=tuning.copy.dispatch_tile,
        EAGER=tuning.copy.dispatch_eager, SIGNAL=tuning.wait,
        HOST_BASE=buffer.host_base is not None, **launch_kw(tuning.copy.warps))


def l1(buffer: SymmBuffer, w13s: Sequence, *, tuning: Tuning = Tuning()) -> None:
    """w13s: per local rank, w13 [E/R, 2I, H] bf16, or in fp8 mode (values, scale_inv), in
    fp4w mode (packed, scales)."""
    cfg = buffer.config
    c = constants(buffer)
    w13s = gemm_weights(buffer, w13s, tuning, "l1")
    bn, bk = tuning.l1_tile(cfg)
    fp8 = cfg.fp8_tokens
    w4 = tuning.fp4w_pieces(cfg)
    tail = tuning.tail_pieces(cfg, "l1")
    dm = 0 if w4 else (tuning.decode_pieces(cfg) or tail)
    # fp8 L1: pointer loads (its descriptor form spills in the K loop and is slower), except
    # in decode and tail pieces, whose accumulators are small; fp4w: pointer loads
    use_tma = tma(buffer, tuning) and (not fp8 or dm > 0) and not w4
    ensure_allocator(use_tma)
    whole = not fp8 and not dm and not w4   # bf16 whole tiles
    one_dot = tuning.l1.one_dot and use_tma and whole
    E_LOC, H, I = c.E_LOC, cfg.hidden, cfg.intermediate
    descs, host_kw = host_descriptors(
        buffer, tuning, use_tma, region="pool_x", cols=H, w=w13s[0][0] if fp8 else w13s[0],
        w_shape=(E_LOC * 2, I, H) if one_dot else (E_LOC * 2 * I, H),
        a_rows=a_rows(cfg.block_m, cfg.block_m, dm, cfg.block_m if tail else 0), block_n=bn,
        block_k=bk)
    split = tuning.l1.split_k if dm and not tail else 1
    sums, counts = split_scratch(buffer, tuning, "l1", split, (2, bn, dm))
    # the host's base in decode pieces only: whole tiles are slower with it, and there a
    # program's first loads weigh nothing
    host_base = buffer.host_base if dm and not tail else None
    args = (buffer.table, buffer.rank0, *weight_tables(buffer, w13s), host_base or 0,
            buffer.max_spins, buffer.timeout_ns,
            c.offs, c.offs.gemm_claims, H, I, E_LOC, c.P, cfg.token_bytes,
            cfg.act_bytes, dispatch_parts(buffer, tuning), *descs, sums, counts)
    kw = dict(BM=cfg.block_m, BN=bn, BK=bk, UPCAST=INTERPRET, USE_TMA=use_tma, WAIT=tuning.wait,
              USE_TIMER=not INTERPRET, FP8=fp8, DM=dm, W4=w4, TAIL=tail > 0, SIGNAL=tuning.wait,
              GROUP_M=tuning.l1.group_m, ONE_DOT=one_dot, SPLIT_K=split,
              CLAIM=tuning.gemm_claim, HOST_BASE=host_base is not None, **host_kw,
              **launch_kw(tuning.l1.warps, (one_dot and tuning.l1.one_dot_stages)
                          or tuning.l1.stages))
    grid = (programs(buffer, tuning, tuning.gemm_per_sm, _l1.l1_kernel, args, kw),
            buffer.local_ranks)
    _l1.l1_kernel[grid](*args, **kw)


def l2(buffer: SymmBuffer, w2s: Sequence, *, tuning: Tuning = Tuning()) -> None:
    """w2s: per local rank, w2 [E/R, H, I] bf16, or in fp8 mode (values, scale_inv), in fp4w
    mode (packed, scales)."""
    cfg = buffer.config
    c = constants(buffer)
    w2s = gemm_weights(buffer, w2s, tuning, "l2")
    bn, bk = tuning.l2_tile(cfg)
    fp8 = cfg.fp8_tokens
    w4 = tuning.fp4w_pieces(cfg)
    use_tma = tma(buffer, tuning) and not w4
    tail = tuning.tail_pieces(cfg, "l2")
    dm = 0 if w4 else (tuning.decode_pieces(cfg) or tail)
    # row pieces inside a block; tail pieces keep the tiles
    pieces = (dm and not tail) or w4
    split_m = 1 if pieces else tuning.l2.split_m
    ensure_allocator(use_tma)
    E_LOC, H, I = c.E_LOC, cfg.hidden, cfg.intermediate
    bmt = cfg.block_m // split_m
    descs, host_kw = host_descriptors(
        buffer, tuning, use_tma, region="pool_act", cols=I, w=w2s[0][0] if fp8 else w2s[0],
        w_shape=(E_LOC * H, I), a_rows=a_rows(cfg.block_m, bmt, dm, bmt if tail else 0),
        block_n=bn, block_k=bk)
    split = tuning.l2.split_k if dm and not tail and cfg.dtype == "bf16" else 1
    sums, counts = split_scratch(buffer, tuning, "l2", split, (dm, bn))
    args = (buffer.table, buffer.rank0, *weight_tables(buffer, w2s), buffer.host_base or 0,
            buffer.max_spins, buffer.timeout_ns,
            c.offs, c.offs.gemm_claims + 16,   # the L2's claims row
            H, I, E_LOC, cfg.max_tokens_per_rank,
            I // tuning.l1_tile(cfg)[0], c.P, c.R, c.R_PAD, cfg.act_bytes, *descs, sums, counts)
    flat = tuning.l2.flat and not tuning.wait and not pieces
    kw = dict(K=cfg.top_k, BM=cfg.block_m, BN=bn, BK=bk, UPCAST=INTERPRET, USE_TMA=use_tma,
              WAIT=tuning.wait, USE_TIMER=not INTERPRET, FP8=fp8, FLAT=flat,
              CLAIM=tuning.gemm_claim and not flat,
              EPI_SPLIT=tuning.l2.epilogue_split, SPLIT_M=split_m,
              DM=dm, W4=w4, TAIL=tail > 0, SPLIT_K=split, HOST_BASE=buffer.host_base is not None,
              PEER_SCOPE=buffer.peer_scope,
              STREAM=stream_ordered(buffer, tuning), **host_kw,
              **launch_kw(tuning.l2.warps, tuning.l2.stages))
    grid = (programs(buffer, tuning, tuning.gemm_per_sm, _l2.l2_kernel, args, kw),
            buffer.local_ranks)
    _l2.l2_kernel[grid](*args, **kw)


def combine(buffer: SymmBuffer, y: torch.Tensor, *, tuning: Tuning = Tuning()) -> None:
    """y: [local ranks, T, H] bf16 (or [T, H] for one local rank); row stride may exceed H.
    ``tuning`` must be the one this call's L2 ran with: it decides whether the L2 signalled
    (``stream_ordered``); a combine that waits for a signal the L2 did not send gives up at
    the buffer's timeout and records the stall (``SymmBuffer.check`` then raises
    ``KernelStallError``)."""
    cfg = buffer.config
    c = constants(buffer)
    y3 = y if y.dim() == 3 else y.unsqueeze(0)
    assert y3.shape[0] == buffer.local_ranks and y3.stride(2) == 1
    grid = (programs(buffer, tuning, tuning.copy.combine_per_sm), buffer.local_ranks)
    _combine.combine_kernel[grid](
        buffer.table, buffer.rank0, buffer.max_spins, buffer.timeout_ns, buffer.host_base or 0,
        y3, y3.stride(0), y3.stride(1),
        c.offs,
        cfg.max_tokens_per_rank, cfg.hidden, cfg.num_experts, c.R,
        K=cfg.top_k, K_PAD=c.K_PAD,
        BH=min(next_pow2(cfg.hidden), tuning.copy.combine_chunk or tuning.copy.hidden_chunk),
        FIX_ROUNDING=INTERPRET, USE_TIMER=not INTERPRET,
        HOST_BASE=buffer.host_base is not None, STREAM=stream_ordered(buffer, tuning),
        **launch_kw(tuning.copy.combine_warps or tuning.copy.warps))


def run_staged(buffer: SymmBuffer, xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
               topk_weights: Sequence[torch.Tensor], w13s: Sequence[torch.Tensor],
               w2s: Sequence[torch.Tensor], y: torch.Tensor, *,
               tuning: Tuning | None = None,
               on_stage: Callable[[str], None] | None = None) -> None:
    """All stages for every local rank; y [local ranks, T_out, H] receives the outputs.
    ``tuning``: None for the policy's (``tuning.select``). ``on_stage(name)``, if given, is
    called after each stage's launches are queued (names: ``STAGES``), e.g. to record CUDA
    events between them."""
    tuning = tuning or tuning_for(buffer, max(x.shape[0] for x in xs), impl="staged")
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
