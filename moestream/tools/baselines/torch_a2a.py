"""The expert-parallel MoE layer built the usual way: all_to_all + grouped GEMM + all_to_all.

This is the benchmarks' ``torch`` provider, what a user builds today without DeepEP:
sort the (token, k) picks by destination rank, exchange counts, read the split sizes on the
host (``.tolist()``: a device synchronisation that is part of what this baseline costs),
dispatch token rows with ``all_to_all_single``, group them by local expert, run the two
expert GEMMs with SwiGLU in between, send the rows back and reduce over k.

Legend (shape suffixes):
    T tokens of this rank, K top-k, H hidden, I intermediate, R ranks,
    E local experts (E_total / R), P = T*K picks, S picks this rank sends (picks != -1),
    N rows this rank receives (= the rows its experts compute).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...checks import check_expert_weights, check_routing, check_tensor, check_topk_range

__all__ = ["moe_forward_a2a"]


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("moe_forward_a2a needs an initialised process group (call "
                         "torch.distributed.init_process_group, or use "
                         "moestream.tools.distributed.spawn / init_from_env)")
    return dist.get_world_size(group), dist.get_rank(group)


def _validate(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
              w13: torch.Tensor, w2: torch.Tensor, *, num_experts: int, num_ranks: int,
              backend: str) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks "
                         f"in the group ({num_ranks})")
    check_tensor("x", x, ndim=2, dtype=torch.bfloat16)
    check_routing(x, topk_idx, topk_weights, hidden=x.shape[1])
    check_tensor("w13", w13, ndim=3, dtype=torch.bfloat16, device=x.device)
    intermediate = w13.shape[1] // 2
    if w13.shape[1] % 2 or intermediate == 0:
        raise ValueError(f"w13 must have shape (E_local, 2*I, H) with I >= 1 (gate rows then up "
                         f"rows), got {tuple(w13.shape)}")
    check_expert_weights(w13, w2, experts=num_experts // num_ranks, hidden=x.shape[1],
                         intermediate=intermediate, dtype=torch.bfloat16, device=x.device)
    if backend == "nccl" and x.device.type != "cuda":
        raise ValueError(f"x must be a CUDA tensor with the nccl backend, got device {x.device}")
    # The baseline synchronises with the host anyway, so the range check costs little here.
    check_topk_range(topk_idx, num_experts)


def _has_grouped_mm(device: torch.device) -> bool:
    # torch._grouped_mm's bf16 kernels target sm90 (Hopper); elsewhere use the per-expert loop.
    return (device.type == "cuda" and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _expert_mm(a_ND: torch.Tensor, w_EMD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Rows of a_ND [N, D] bf16, grouped by expert (counts_E [E] rows each, in expert order),
    times w_EMD[e]^T [D, M]: returns [N, M] bf16, accumulated in fp32."""
    N, M = a_ND.shape[0], w_EMD.shape[1]
    if N == 0:
        return a_ND.new_empty(0, M)
    if _has_grouped_mm(a_ND.device):
        offs_E = counts_E.cumsum(0).to(torch.int32)
        return torch._grouped_mm(a_ND, w_EMD.transpose(-2, -1), offs=offs_E)
    out_NM = a_ND.new_empty(N, M)
    # CPU bf16 matmul need not accumulate in fp32; upcast there. cuBLAS accumulates in fp32.
    upcast = a_ND.device.type != "cuda"
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        if n:
            a_nD, w_MD = a_ND[start:start + n], w_EMD[e]
            if upcast:
                a_nD, w_MD = a_nD.float(), w_MD.float()
            out_NM[start:start + n] = (a_nD @ w_MD.t()).to(out_NM.dtype)
        start += n
    return out_NM


def _wire(t: torch.Tensor) -> torch.Tensor:
    # Payload rows travel as raw bytes: gloo rejects int16 and (in older torch) bf16, while
    # uint8 is accepted by gloo and NCCL alike and moves the same bytes.
    return t.view(torch.uint8)


def moe_forward_a2a(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor, *, num_experts: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Expert-parallel MoE forward of the calling rank via all_to_all_single (gloo or NCCL).

    Rank r of ``group`` owns the experts [r*E/R, (r+1)*E/R). Every rank of the group must call
    this together (it runs four collectives). Not CUDA-graph capturable: it reads the split
    sizes on the host.

    Args:
        x: [T, H] bf16 tokens of this rank (T may be 0).
        topk_idx: [T, K] int32/int64 global expert ids in [-1, num_experts); -1 = no expert
            (never sent, contributes nothing).
        topk_weights: [T, K] fp32 gate weights, applied as given.
        w13: [E/R, 2I, H] bf16 local experts' gate (rows 0..I-1) and up (rows I..2I-1).
        w2: [E/R, H, I] bf16 local experts' down projection.
        num_experts: E, experts over all ranks (divisible by the group size).
        group: process group; None = the default group.

    Returns:
        y: [T, H] bf16, y[t] = sum_k w[t,k] * w2[e] @ (silu(gate_e x[t]) * up_e x[t]).
        GEMMs accumulate in fp32 and round to bf16 (as torch._grouped_mm does); the SwiGLU
        product is rounded to bf16 before the second GEMM; the sum over k is fp32.

    Raises:
        ValueError: bad shapes, dtypes, devices, expert ids out of range, num_experts not
            divisible by the group size, or no initialised process group.
    """
    R, rank = _group_size_rank(group)
    _validate(x, topk_idx, topk_weights, w13, w2, num_experts=num_experts, num_ranks=R,
              backend=dist.get_backend(group))
    E = num_experts // R
    T, K = topk_idx.shape
    H, I = x.shape[1], w13.shape[1] // 2
    dev = x.device

    # ---- route: the picks that go somewhere, grouped by destination rank -----------------
    idx_P = topk_idx.reshape(-1).to(torch.int64)
    pick_S = (idx_P >= 0).nonzero().squeeze(1)
    dst_S = torch.div(idx_P[pick_S], E, rounding_mode="floor")
    by_dst_S = torch.argsort(dst_S, stable=True)
    pick_S, dst_S = pick_S[by_dst_S], dst_S[by_dst_S]
    tok_S = torch.div(pick_S, K, rounding_mode="floor")
    local_e_S = (idx_P[pick_S] - dst_S * E).to(torch.int32)

    send_counts_R = torch.bincount(dst_S, minlength=R)
    recv_counts_R = torch.empty_like(send_counts_R)
    dist.all_to_all_single(recv_counts_R, send_counts_R, group=group)
    send_splits, recv_splits = send_counts_R.tolist(), recv_counts_R.tolist()
    S, N = len(pick_S), sum(recv_splits)
    assert sum(send_splits) == S

    # ---- dispatch ---------------------------------------------------------------------------
    x_SH = x.index_select(0, tok_S)
    recv_x_NH = torch.empty(N, H, dtype=x.dtype, device=dev)
    dist.all_to_all_single(_wire(recv_x_NH), _wire(x_SH), recv_splits, send_splits, group=group)
    recv_e_N = torch.empty(N, dtype=torch.int32, device=dev)
    dist.all_to_all_single(recv_e_N, local_e_S, recv_splits, send_splits, group=group)

    # ---- local experts: rows grouped by expert, GEMM, SwiGLU, GEMM -----------------------
    by_expert_N = torch.argsort(recv_e_N, stable=True)
    counts_E = torch.bincount(recv_e_N, minlength=E)
    h_N2I = _expert_mm(recv_x_NH[by_expert_N], w13, counts_E)
    act_NI = (F.silu(h_N2I[:, :I].float()) * h_N2I[:, I:].float()).to(x.dtype)
    out_NH = _expert_mm(act_NI, w2, counts_E)
    back_NH = torch.empty(N, H, dtype=x.dtype, device=dev)
    back_NH[by_expert_N] = out_NH  # back to arrival order, which the senders expect

    # ---- combine ----------------------------------------------------------------------------
    ret_SH = torch.empty(S, H, dtype=x.dtype, device=dev)
    dist.all_to_all_single(_wire(ret_SH), _wire(back_NH), send_splits, recv_splits, group=group)
    w_S = topk_weights.reshape(-1)[pick_S]
    y_TH = torch.zeros(T, H, dtype=torch.float32, device=dev)
    y_TH.index_add_(0, tok_S, ret_SH.float() * w_S[:, None])
    return y_TH.to(x.dtype)
