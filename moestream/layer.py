"""The layer's public entry points.

``mega_moe_virtual``: all R ranks in this process (virtual ranks), lists indexed by rank.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import stages
from .buffer import SymmBuffer
from .checks import check_expert_weights, check_routing, check_tensor, check_topk_range

__all__ = ["mega_moe_virtual"]


def _prepare_rank(buffer: SymmBuffer, r: int, x: torch.Tensor, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  *, validate: bool, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = buffer.config
    check_routing(x, topk_idx, topk_weights, hidden=cfg.hidden, top_k=cfg.top_k,
                  max_tokens=cfg.max_tokens_per_rank, prefix=prefix)
    if x.device != buffer.device:
        raise ValueError(f"{prefix}x must be on the buffer's device {buffer.device}, got {x.device}")
    if x.shape[0] and x.stride(1) != 1:
        raise ValueError(f"{prefix}x must have unit stride along hidden, got strides {x.stride()}")
    check_expert_weights(w13, w2, experts=cfg.experts_per_rank(buffer.num_ranks),
                         hidden=cfg.hidden, intermediate=cfg.intermediate,
                         dtype=torch.bfloat16, device=buffer.device, contiguous=True,
                         prefix=prefix)
    if validate:
        check_topk_range(topk_idx, cfg.num_experts, name=f"{prefix}topk_idx")
    return topk_idx.contiguous(), topk_weights.contiguous()


def mega_moe_virtual(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
                     topk_weights: Sequence[torch.Tensor], w13s: Sequence[torch.Tensor],
                     w2s: Sequence[torch.Tensor], buffer: SymmBuffer, *,
                     out: torch.Tensor | None = None, validate: bool = True,
                     tuning: stages.Tuning | None = None) -> list[torch.Tensor]:
    """The expert-parallel layer for R virtual ranks held by one process.

    Runs the staged kernels (publish, signal, layout, dispatch, L1, L2, combine: one launch
    each, all ranks per launch) and then checks the kernels' diagnostics, which synchronises
    with the device (this is a development and test path; the per-rank ``mega_moe`` is the
    one without host synchronisation).

    Args:
        xs: per rank r, x [T_r, H] bf16 with T_r <= config.max_tokens_per_rank (T_r may be 0).
        topk_idxs: per rank, [T_r, K] int32/int64 global expert ids, -1 = no expert.
        topk_weights: per rank, [T_r, K] fp32.
        w13s: per rank, [E/R, 2I, H] bf16 contiguous: rank r's experts [r*E/R, (r+1)*E/R).
        w2s: per rank, [E/R, H, I] bf16 contiguous.
        buffer: a virtual ``SymmBuffer`` with num_ranks == R.
        out: optional [R, max T_r, H] bf16 to write into (rows past T_r are left alone).
        validate: check topk id ranges on the host before launching (a synchronisation).

    Returns:
        y per rank, [T_r, H] bf16 (views into ``out`` or a fresh tensor).
    """
    if not isinstance(buffer, SymmBuffer) or not buffer.is_virtual:
        raise ValueError("buffer must be a virtual SymmBuffer(config, num_ranks=R); for one "
                         "rank per process use mega_moe")
    R = buffer.num_ranks
    for name, seq in (("xs", xs), ("topk_idxs", topk_idxs), ("topk_weights", topk_weights),
                      ("w13s", w13s), ("w2s", w2s)):
        if not isinstance(seq, (list, tuple)) or len(seq) != R:
            got = len(seq) if isinstance(seq, (list, tuple)) else type(seq).__name__
            raise ValueError(f"{name} must be a list with one entry per rank ({R}), got {got}")
    idxs, ws = [], []
    for r in range(R):
        i, w = _prepare_rank(buffer, r, xs[r], topk_idxs[r], topk_weights[r], w13s[r], w2s[r],
                             validate=validate, prefix=f"rank {r}: ")
        idxs.append(i)
        ws.append(w)
    buffer.check()  # an earlier call's stall must not pass unnoticed
    t_out = max(x.shape[0] for x in xs)
    if out is None:
        out = torch.empty(R, t_out, buffer.config.hidden, dtype=torch.bfloat16,
                          device=buffer.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, device=buffer.device,
                     ndim=3)
        if out.shape[0] != R or out.shape[1] < t_out or out.shape[2] != buffer.config.hidden \
                or out.stride(2) != 1:
            raise ValueError(f"out must be [R={R}, >= {t_out}, H={buffer.config.hidden}] with "
                             f"unit stride along H, got shape {tuple(out.shape)} strides "
                             f"{out.stride()}")
    stages.run_staged(buffer, xs, idxs, ws, w13s, w2s, out, tuning=tuning or stages.Tuning())
    buffer.check()
    return [out[r, :x.shape[0]] for r, x in enumerate(xs)]
