"""Argument validation shared by every public entry point.

Each check raises ValueError naming the argument, what it got and what is allowed. The only
check that reads tensor values (the topk_idx range) synchronises with the device; callers on a
hot path ask for it explicitly (``validate=True``) and document it.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["check_tensor", "check_routing", "check_topk_range", "check_expert_weights",
           "check_expert_weights_fp8", "check_expert_weights_fp4w", "check_e8m0_codes",
           "check_fp4w_alignment",
           "INDEX_DTYPES"]

INDEX_DTYPES = (torch.int32, torch.int64)


def _fmt_dtypes(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t: object, *, ndim: int | None = None,
                 shape: Sequence[int | None] | None = None,
                 dtype: torch.dtype | Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None, contiguous: bool = False) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries in ``shape`` match any size."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                want_s = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{name} must have shape {want_s}, got {tuple(t.shape)} "
                                 f"(dimension {i} differs)")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise ValueError(f"{name} must have dtype {_fmt_dtypes(allowed)}, got "
                             f"{str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {torch.device(device)}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() once, outside the hot "
                         f"path), got strides {t.stride()}")
    return t


def check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                  hidden: int, top_k: int | None = None,
                  x_dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
                  max_tokens: int | None = None, prefix: str = "") -> int:
    """Check x [T, H], topk_idx [T, K] int, topk_weights [T, K] fp32 on one device; return T."""
    check_tensor(f"{prefix}x", x, ndim=2, dtype=tuple(x_dtypes))
    T = x.shape[0]
    if x.shape[1] != hidden:
        raise ValueError(f"{prefix}x must have shape (T, {hidden}) (hidden size), got "
                         f"{tuple(x.shape)}")
    if max_tokens is not None and T > max_tokens:
        raise ValueError(f"{prefix}x has {T} tokens, more than max_tokens_per_rank={max_tokens} "
                         f"that the buffer was sized for")
    check_tensor(f"{prefix}topk_idx", topk_idx, ndim=2, dtype=INDEX_DTYPES, device=x.device)
    if topk_idx.shape[0] != T:
        raise ValueError(f"{prefix}topk_idx must have one row per token of x ({T}), got shape "
                         f"{tuple(topk_idx.shape)}")
    if top_k is not None and topk_idx.shape[1] != top_k:
        raise ValueError(f"{prefix}topk_idx must have top_k={top_k} columns, got shape "
                         f"{tuple(topk_idx.shape)}")
    check_tensor(f"{prefix}topk_weights", topk_weights, shape=tuple(topk_idx.shape),
                 dtype=torch.float32, device=x.device)
    return T


def check_topk_range(topk_idx: torch.Tensor, num_experts: int, *, name: str = "topk_idx") -> None:
    """Values must lie in [-1, num_experts). Reads the tensor: a host synchronisation."""
    if topk_idx.numel() == 0:
        return
    lo, hi = int(topk_idx.min()), int(topk_idx.max())
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise ValueError(f"{name} values must lie in [-1, {num_experts}) (-1 = no expert), "
                         f"found {bad}")


def check_expert_weights(w13: torch.Tensor, w2: torch.Tensor, *, experts: int, hidden: int,
                         intermediate: int, dtype: torch.dtype | Sequence[torch.dtype],
                         device: torch.device | None = None, contiguous: bool = False,
                         prefix: str = "") -> None:
    """w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I]."""
    check_tensor(f"{prefix}w13", w13, shape=(experts, 2 * intermediate, hidden), dtype=dtype,
                 device=device, contiguous=contiguous)
    check_tensor(f"{prefix}w2", w2, shape=(experts, hidden, intermediate), dtype=dtype,
                 device=w13.device, contiguous=contiguous)


def _pair(name: str, w: object, fmt: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(w, (tuple, list)) or len(w) != 2:
        what = ("(values, scale_inv) pair in fp8 mode (e.g. from moestream.quant."
                "convert_expert_weights_fp8)" if fmt == "fp8" else
                "(packed, scales) pair in fp4w mode (e.g. from moestream.quant."
                "convert_expert_weights_mxfp4)")
        raise ValueError(f"{name} must be a {what}, got {type(w).__name__}")
    return w[0], w[1]


def check_expert_weights_fp8(w13: object, w2: object, *, experts: int, hidden: int,
                             intermediate: int, device: torch.device | None = None,
                             prefix: str = "") -> None:
    """fp8 experts as (values, scale_inv) pairs (DeepSeek-V3 format, docs/quantization.md):
    w13 ([E, 2I, H] e4m3, [E, 2I/128, H/128] fp32), w2 ([E, H, I] e4m3, [E, H/128, I/128]
    fp32), all contiguous. H and I are multiples of 128 (MoEConfig checks it)."""
    (q13, s13), (q2, s2) = _pair(f"{prefix}w13", w13), _pair(f"{prefix}w2", w2)
    check_expert_weights(q13, q2, experts=experts, hidden=hidden, intermediate=intermediate,
                         dtype=torch.float8_e4m3fn, device=device, contiguous=True,
                         prefix=prefix)
    g_h, g_i = hidden // 128, intermediate // 128
    check_tensor(f"{prefix}w13 scale_inv", s13, shape=(experts, 2 * g_i, g_h),
                 dtype=torch.float32, device=q13.device, contiguous=True)
    check_tensor(f"{prefix}w2 scale_inv", s2, shape=(experts, g_h, g_i), dtype=torch.float32,
                 device=q13.device, contiguous=True)


MAX_E8M0 = 253   # the largest E8M0 code the fp4w GEMMs decode (moestream/kernels/gemm_fp4.py)


def check_e8m0_codes(name: str, scales: torch.Tensor) -> None:
    """Every E8M0 code of ``scales`` (uint8) is at most MAX_E8M0: the fp4w GEMMs decode code c
    as 2**(c - 126) with one add and a shift, which gives inf for 254 and -0.0 for 255. Reads
    the values (a device synchronisation)."""
    if scales.numel() and int(scales.max()) > MAX_E8M0:
        raise ValueError(f"{name} holds E8M0 codes above {MAX_E8M0} (254 = 2**127, 255 = NaN), "
                         f"which the kernels do not decode; quant.quantize_weight_mxfp4 writes "
                         f"at most 252 for finite weights")


def check_expert_weights_fp4w(w13: object, w2: object, *, experts: int, hidden: int,
                              intermediate: int, device: torch.device | None = None,
                              prefix: str = "", codes: bool = False) -> None:
    """fp4w experts as (packed, scales) pairs (MXFP4, docs/quantization.md): w13 ([E, 2I, H/2]
    uint8 e2m1 pairs, [E, 2I, H/32] uint8 E8M0), w2 ([E, H, I/2], [E, H, I/32]), all
    contiguous and 16-byte aligned (the GEMMs read the codes four at a time). ``codes``: also
    check every E8M0 code is at most 253 (reads the values: a device synchronisation)."""
    (p13, s13), (p2, s2) = _pair(f"{prefix}w13", w13, "fp4w"), _pair(f"{prefix}w2", w2, "fp4w")
    H, I = hidden, intermediate
    check_tensor(f"{prefix}w13 packed", p13, shape=(experts, 2 * I, H // 2), dtype=torch.uint8,
                 device=device, contiguous=True)
    dev = p13.device
    check_tensor(f"{prefix}w13 scales", s13, shape=(experts, 2 * I, H // 32), dtype=torch.uint8,
                 device=dev, contiguous=True)
    check_tensor(f"{prefix}w2 packed", p2, shape=(experts, H, I // 2), dtype=torch.uint8,
                 device=dev, contiguous=True)
    check_tensor(f"{prefix}w2 scales", s2, shape=(experts, H, I // 32), dtype=torch.uint8,
                 device=dev, contiguous=True)
    if not torch.compiler.is_compiling():   # a traced graph has no addresses: the op checks
        check_fp4w_alignment((p13, s13), (p2, s2), prefix=prefix)
    if codes:
        check_e8m0_codes(f"{prefix}w13 scales", s13)
        check_e8m0_codes(f"{prefix}w2 scales", s2)


def check_fp4w_alignment(w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], *,
                         prefix: str = "") -> None:
    """fp4w (packed, scales) pairs start at 16-byte aligned addresses: the kernels load them
    with 16-byte alignment hints (torch allocations are aligned; an offset view may not be)."""
    for name, t in ((f"{prefix}w13 packed", w13[0]), (f"{prefix}w13 scales", w13[1]),
                    (f"{prefix}w2 packed", w2[0]), (f"{prefix}w2 scales", w2[1])):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address (torch "
                             f"allocations are), got data_ptr % 16 = {t.data_ptr() % 16}")
