"""Routing arithmetic as torch ops (CPU or GPU, no host synchronisation).

Conventions shared with the kernels (which compute the same numbers on device, and are tested
against these functions):

- A source rank s numbers its own (token, k) picks per global expert in (t, k) order: the
  pick's *slot*. ``source_slots`` gives the per-expert counts and the slots.
- Destination rank d owns the experts [d*E_loc, (d+1)*E_loc). Its pool holds the experts one
  after another, each segment padded to a multiple of BLOCK_M rows; inside an expert's segment
  the picks of source 0 come first (in slot order), then source 1, ...
- A pool row's source is packed into one int32: ``(s * max_tokens + t) * K + k``; padding rows
  are -1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["source_slots", "PoolLayout", "pool_layout", "pool_rows", "pool_sources",
           "pack_source", "unpack_source"]


def source_slots(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert pick counts of one rank and each pick's slot among the picks of its expert.

    Args:
        topk_idx: [T, K] int32/int64 global expert ids; -1 (and any id outside [0, E)) is no pick.
        num_experts: E.

    Returns:
        counts [E] int32 and slot [T, K] int32 (-1 where there is no pick).
    """
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # bin E collects non-picks
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    sorted_key, order = torch.sort(key, stable=True)
    start = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(flat)
    slot[order] = torch.arange(flat.numel(), device=flat.device) - start[sorted_key]
    slot = torch.where(valid, slot, torch.full_like(slot, -1))
    return counts[:num_experts].to(torch.int32), slot.view(T, K).to(torch.int32)


@dataclass(frozen=True)
class PoolLayout:
    """Where every destination rank's pool puts its experts and its sources' picks.

    Fields (d = destination rank, e = local expert, s = source rank):
        expert_count [R, E_loc]: picks each local expert receives.
        block_start [R, E_loc + 1]: first m-block of each expert (the last entry is the total);
            the expert's rows start at block_start * block_m.
        src_row [R, E_loc, R]: first pool row of source s's picks inside expert e.
    """

    expert_count: torch.Tensor
    block_start: torch.Tensor
    src_row: torch.Tensor
    block_m: int

    @property
    def num_ranks(self) -> int:
        return self.expert_count.shape[0]

    @property
    def experts_per_rank(self) -> int:
        return self.expert_count.shape[1]


def pool_layout(counts: torch.Tensor, *, block_m: int) -> PoolLayout:
    """Pool layout of every destination rank from the per-source counts.

    Args:
        counts: [R, E] int, counts[s, e] = picks of global expert e made by source rank s
            (``source_slots`` of each rank, stacked).
        block_m: the pool's block size.
    """
    R, E = counts.shape
    if E % R:
        raise ValueError(f"counts has {E} experts, not divisible by its {R} ranks")
    e_loc = E // R
    c = counts.long().view(R, R, e_loc).permute(1, 2, 0)              # [d, e, s]
    expert_count = c.sum(-1)                                          # [d, e]
    m_blocks = (expert_count + block_m - 1) // block_m
    block_start = torch.zeros(R, e_loc + 1, dtype=torch.int64, device=counts.device)
    block_start[:, 1:] = torch.cumsum(m_blocks, dim=1)
    src_excl = torch.cumsum(c, dim=-1) - c                            # picks of earlier sources
    src_row = block_start[:, :e_loc, None] * block_m + src_excl
    return PoolLayout(expert_count=expert_count, block_start=block_start, src_row=src_row,
                      block_m=block_m)


def pool_rows(layout: PoolLayout, source: int, topk_idx: torch.Tensor,
              slot: torch.Tensor) -> torch.Tensor:
    """[T, K] int64 pool row (on the destination rank that owns the expert) of each pick of
    ``source``'s tokens; -1 where there is no pick."""
    R, e_loc = layout.num_ranks, layout.experts_per_rank
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < R * e_loc)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    dst, le = safe // e_loc, safe % e_loc
    rows = layout.src_row[dst, le, source] + slot.long()
    return torch.where(valid, rows, torch.full_like(rows, -1))


def pack_source(source: int | torch.Tensor, token: int | torch.Tensor, k: int | torch.Tensor,
                *, max_tokens: int, top_k: int):
    return (source * max_tokens + token) * top_k + k


def unpack_source(code: torch.Tensor, *, max_tokens: int, top_k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source rank, token, k) of packed pool-row codes (garbage where code is -1)."""
    k = code % top_k
    t = (code // top_k) % max_tokens
    s = code // (top_k * max_tokens)
    return s, t, k


def pool_sources(layout: PoolLayout, topk_idxs: Sequence[torch.Tensor],
                 slots: Sequence[torch.Tensor], *, capacity: int, max_tokens: int
                 ) -> torch.Tensor:
    """[R, capacity] int64: the packed (source, token, k) of every pool row, -1 for padding."""
    R = layout.num_ranks
    e_loc = layout.experts_per_rank
    out = torch.full((R, capacity), -1, dtype=torch.int64, device=layout.expert_count.device)
    for s in range(R):
        idx = topk_idxs[s].long()
        T, K = idx.shape
        rows = pool_rows(layout, s, idx, slots[s])
        valid = rows >= 0
        dst = torch.where(valid, idx, torch.zeros_like(idx)) // e_loc
        t = torch.arange(T, device=idx.device)[:, None].expand(T, K)
        k = torch.arange(K, device=idx.device)[None, :].expand(T, K)
        code = pack_source(s, t, k, max_tokens=max_tokens, top_k=K)
        out[dst[valid], rows[valid]] = code[valid]
    return out
