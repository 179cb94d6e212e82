"""The ground truth: the whole MoE layer in one process, from the global view, in fp32/fp64.

    y[t] = sum_j  w[t, j] * w2[e] @ (silu(w_gate[e] @ x[t]) * (w_up[e] @ x[t])),  e = idx[t, j] >= 0

w13 [E, 2I, H] holds the gate rows 0..I-1 and the up rows I..2I-1 of every expert; w2 is
[E, H, I]. A -1 in topk_idx contributes nothing; a token picking the same expert twice gets
both contributions. Imports nothing of ours but config, the argument checks and, for the
quantization-aware modes (``quant="fp8"``/``"fp4w"``), the format definitions in ``quant``.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .checks import check_expert_weights, check_routing, check_tensor, check_topk_range
from .quant import QUANT_MODES, fake_quant_act_fp8, fake_quant_expert_weights

__all__ = ["moe_forward", "moe_forward_ranks", "route"]


def moe_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                w13: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                w2: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
                compute_dtype: torch.dtype = torch.float32,
                out_dtype: torch.dtype | None = None, quant: str = "bf16") -> torch.Tensor:
    """Reference MoE layer over all experts.

    Args:
        x: [T, H] bf16/fp16/fp32/fp64 tokens.
        topk_idx: [T, K] int32/int64 global expert ids in [-1, E).
        topk_weights: [T, K] fp32 gate weights (applied as given; no renormalisation here).
        w13: [E, 2I, H] gate (rows 0..I-1) and up (rows I..2I-1) projections.
        w2: [E, H, I] down projection.
        compute_dtype: torch.float32 (default) or torch.float64 for every product and sum.
        out_dtype: dtype of y; defaults to x.dtype.
        quant: the quantization steps of the layer's precision mode (docs/quantization.md):
            "bf16" (default): none, the inputs are used as given.
            "fp8": x is quantized per token per 128 channels to fp8 e4m3 and dequantized
            (the bytes that cross NVLink); the weights are quantized to fp8 with one scale per
            128x128 block and dequantized; after SwiGLU the activation is re-quantized per
            (token, expert) row per 128 channels (the L1 epilogue) before L2. Products and
            sums stay in ``compute_dtype``; the topk weight is applied after L2.
            "fp4w": as "fp8" but the weights are MXFP4 (e2m1, a power-of-two scale per 32 K
            elements, OCP floor rounding).
            In the quantized modes w13 and w2 may be float tensors (quantized here, as
            ``moestream.quant.convert_expert_weights_fp8`` / ``_mxfp4`` do) or pre-quantized
            pairs ``(q, scale_inv)`` (fp8) / ``(packed, scales)`` (fp4w), e.g. from
            ``moestream.quant.load_deepseek_v3_experts``. fp8 needs I % 128 == 0; fp4w needs
            H and I multiples of 32.

    Returns:
        y: [T, H] in ``out_dtype``.
    """
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}")
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    quantized = quant != "bf16"
    if quantized:
        w13, w2 = fake_quant_expert_weights(w13, w2, mode=quant)    # fp32, dequantized
    float_types = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    check_tensor("w13", w13, ndim=3, dtype=float_types)
    E, two_i, H = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 must have an even middle dimension (2I), got shape {tuple(w13.shape)}")
    check_expert_weights(w13, w2, experts=E, hidden=H, intermediate=two_i // 2,
                         dtype=float_types, device=x.device if isinstance(x, torch.Tensor) else None)
    check_routing(x, topk_idx, topk_weights, hidden=H, x_dtypes=float_types)
    check_topk_range(topk_idx, E)
    T, K = topk_idx.shape
    I = two_i // 2

    xc = (fake_quant_act_fp8(x) if quantized else x).to(compute_dtype)
    y = torch.zeros(T, H, dtype=compute_dtype, device=x.device)
    flat_idx = topk_idx.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).to(compute_dtype)
    token_of_pair = torch.arange(T, device=x.device).repeat_interleave(K)
    for e in torch.unique(flat_idx).tolist():
        if e < 0:
            continue
        sel = (flat_idx == e).nonzero(as_tuple=True)[0]
        tok = token_of_pair[sel]
        h = xc[tok] @ w13[e].to(compute_dtype).t()            # [n, 2I]
        act = F.silu(h[:, :I]) * h[:, I:]                    # [n, I]
        if quantized:
            act = fake_quant_act_fp8(act).to(compute_dtype)
        out = act @ w2[e].to(compute_dtype).t()              # [n, H]
        y.index_add_(0, tok, out * flat_w[sel, None])
    return y.to(out_dtype or x.dtype)


def moe_forward_ranks(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
                      topk_weights: Sequence[torch.Tensor], w13s: Sequence[torch.Tensor],
                      w2s: Sequence[torch.Tensor], *, compute_dtype: torch.dtype = torch.float32,
                      out_dtype: torch.dtype | None = None, quant: str = "bf16"
                      ) -> list[torch.Tensor]:
    """The reference on the expert-parallel view: lists indexed by rank.

    Rank r holds x[r] [T_r, H] and the experts [r*E/R, (r+1)*E/R) as w13s[r] [E/R, 2I, H],
    w2s[r] [E/R, H, I]; topk ids are global. Returns y[r] [T_r, H] per rank. ``quant`` as in
    ``moe_forward`` (pre-quantized weights: one (values, scales) pair per rank).
    """
    R = len(xs)
    if not (len(topk_idxs) == len(topk_weights) == len(w13s) == len(w2s) == R) or R == 0:
        raise ValueError("xs, topk_idxs, topk_weights, w13s and w2s must be non-empty lists of "
                         f"the same length (one entry per rank), got lengths {len(xs)}, "
                         f"{len(topk_idxs)}, {len(topk_weights)}, {len(w13s)}, {len(w2s)}")

    def cat(ws):
        if quant != "bf16" and all(isinstance(w, (tuple, list)) for w in ws):
            return tuple(torch.cat([w[i].to(xs[0].device) for w in ws]) for i in range(2))
        return torch.cat([w.to(xs[0].device) for w in ws])

    y = moe_forward(torch.cat(list(xs)), torch.cat([t.to(torch.int64) for t in topk_idxs]),
                    torch.cat(list(topk_weights)), cat(w13s), cat(w2s),
                    compute_dtype=compute_dtype, out_dtype=out_dtype, quant=quant)
    return list(torch.split(y, [x.shape[0] for x in xs]))


def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          bias: torch.Tensor | None = None, num_groups: int | None = None,
          topk_groups: int | None = None, scaling_factor: float = 1.0,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top-k experts per token from router logits.

    ``scoring="softmax"`` (Mixtral, Qwen-MoE): probabilities over all experts, top-k of them,
    renormalised to sum to 1 when ``renormalize``. ``scoring="sigmoid"`` (DeepSeek-V3):
    independent sigmoid scores; the choice uses score + ``bias`` (the load-balancing
    correction) and, with ``num_groups``/``topk_groups``, only experts of the ``topk_groups``
    groups whose two best biased scores sum highest; the weights are the unbiased scores of the
    chosen experts, renormalised when ``renormalize``, times ``scaling_factor``.

    Args:
        logits: [T, E] float router logits.
        top_k: experts per token, 1 <= top_k <= E.

    Returns:
        (topk_idx [T, K] int64, topk_weights [T, K] fp32).
    """
    check_tensor("logits", logits, ndim=2, dtype=(torch.float16, torch.bfloat16, torch.float32,
                                                    torch.float64))
    T, E = logits.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, {E}] (the number of experts), got {top_k!r}")
    logits = logits.float()
    if scoring == "softmax":
        if bias is not None or num_groups is not None:
            raise ValueError("bias and num_groups apply to scoring='sigmoid' only")
        probs = logits.softmax(dim=-1)
        w, idx = probs.topk(top_k, dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores
        if bias is not None:
            check_tensor("bias", bias, shape=(E,), device=logits.device)
            choice = scores + bias.float()
        if num_groups is not None or topk_groups is not None:
            if num_groups is None or topk_groups is None:
                raise ValueError("num_groups and topk_groups must be given together")
            if num_groups <= 0 or E % num_groups:
                raise ValueError(f"num_groups must divide the number of experts ({E}), got "
                                 f"{num_groups}")
            if not 1 <= topk_groups <= num_groups:
                raise ValueError(f"topk_groups must be in [1, num_groups={num_groups}], got "
                                 f"{topk_groups}")
            per_group = E // num_groups
            if top_k > topk_groups * per_group:
                raise ValueError(f"top_k={top_k} exceeds the experts in the kept groups "
                                 f"({topk_groups} x {per_group})")
            grouped = choice.view(T, num_groups, per_group)
            group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
            keep = group_score.topk(topk_groups, dim=-1).indices
            mask = torch.zeros(T, num_groups, dtype=torch.bool, device=logits.device)
            mask.scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(per_group, dim=1), float("-inf"))
        idx = choice.topk(top_k, dim=-1).indices
        w = scores.gather(1, idx)
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return idx, (w * scaling_factor).float()
