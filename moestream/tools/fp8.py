"""Launchers of the standalone FP8 grouped GEMMs (moestream/kernels/gemm_fp8.py: formats,
legend, numerics): one launch per GEMM over a pool of block_m-row blocks described by
block_meta (expert * 512 + valid_m, moestream.regions's encoding). The layer runs the same block
functions inside its own kernels (moestream.staged). Works on the CPU (Triton's interpreter) and
on GPUs.
"""
from __future__ import annotations

import torch

from ..kernels.common import INTERPRET
from ..kernels.gemm_fp8 import FP8_MAX, FP8_MIN_SCALE, l1_fp8_kernel, l2_fp8_kernel
from ..quant import FP8_BLOCK, FP8_E4M3_MAX
from ..quant import FP8_MIN_SCALE as QUANT_MIN_SCALE

__all__ = ["l1_fp8", "l2_fp8", "pack_block_meta", "META_VALID_BITS"]

META_VALID_BITS = 9   # block_meta = expert << 9 | valid_m (layout: expert * 512 + valid_m)

_FP8 = torch.float8_e4m3fn


def pack_block_meta(experts, valid_rows, *, device=None) -> torch.Tensor:
    """block_meta int32 [blocks] = expert * 512 + valid_m from two equal-length sequences."""
    e = torch.as_tensor(experts, dtype=torch.int64)
    v = torch.as_tensor(valid_rows, dtype=torch.int64)
    if e.dim() != 1 or e.shape != v.shape:
        raise ValueError(f"experts and valid_rows must be 1-D of equal length, got shapes "
                         f"{tuple(e.shape)} and {tuple(v.shape)}")
    if e.numel() and (int(e.min()) < 0 or int(v.min()) < 0 or int(v.max()) >= 512
                      or int(e.max()) >= 2 ** 22):
        raise ValueError("experts must be in [0, 2**22) and valid_rows in [0, 512)")
    return ((e << META_VALID_BITS) | v).to(torch.int32).to(device or "cpu")


def _tensor(name, t, *, dtype, shape, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other tensors on {device}")
    return t


def _dims(name, t, ndim, dtype):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    return tuple(t.shape)


def _pow2(name, v, lo, hi):
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or v > hi or v & (v - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {v!r}")


def _check_meta(block_meta, n_blocks, block_m, num_experts, device, validate):
    _tensor("block_meta", block_meta, dtype=torch.int32, shape=(n_blocks,), device=device)
    if validate and n_blocks:
        m = block_meta.to("cpu", torch.int64)
        e, v = m >> META_VALID_BITS, m & 511
        if int(m.min()) < 0 or int(e.max()) >= num_experts or int(v.max()) > block_m:
            raise ValueError(f"block_meta entries must be expert * 512 + valid_m with expert in "
                             f"[0, {num_experts}) and valid_m in [0, block_m={block_m}]")


def _launch_kw(num_warps, num_stages):
    kw = {}
    if num_warps is not None:
        kw["num_warps"] = num_warps
    if num_stages is not None:
        kw["num_stages"] = num_stages
    return kw


def _pool_blocks(P, block_m):
    """m-blocks of a pool of P rows (ValueError unless block_m divides P)."""
    if P % block_m:
        raise ValueError(f"pool rows P={P} must be a multiple of block_m={block_m}")
    return P // block_m


def _act_out(act_q, act_scale, P, I, device):
    """L1's outputs as given, or allocated: act_q [P, I] e4m3, act_scale [P, I/128] fp32
    (the callers check given ones)."""
    if act_q is None:
        act_q = torch.empty(P, I, dtype=_FP8, device=device)
    if act_scale is None:
        act_scale = torch.empty(P, I // 128, dtype=torch.float32, device=device)
    return act_q, act_scale


def _y_out(y, out_dtype, P, H, device):
    """L2's output as given (bf16 or fp32; the callers check its shape), or allocated [P, H]
    with ``out_dtype``."""
    if y is None:
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
        y = torch.empty(P, H, dtype=out_dtype, device=device)
    if not isinstance(y, torch.Tensor) or y.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("y must be a bfloat16 or float32 tensor")
    return y


def l1_fp8(*, pool_x_q: torch.Tensor, pool_x_scale: torch.Tensor, block_meta: torch.Tensor,
           w13_q: torch.Tensor, w13_scale_inv: torch.Tensor, pool_weight: torch.Tensor,
           block_m: int, block_n: int = 128, act_q: torch.Tensor | None = None,
           act_scale: torch.Tensor | None = None, num_warps: int | None = None,
           num_stages: int | None = None, validate: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """L1 of the pool in fp8: ``act = silu(x @ gate^T) * (x @ up^T) * pool_weight``, quantized.

    Args (shapes: module legend; P = len(block_meta) * block_m; H, I multiples of 128):
        pool_x_q [P, H] fp8, pool_x_scale [P, H/128] fp32, block_meta [P/BM] int32,
        w13_q [E, 2I, H] fp8, w13_scale_inv [E, 2I/128, H/128] fp32, pool_weight [P] fp32,
        all contiguous on one device (CPU: Triton's interpreter).
        block_m: rows per block, a power of two in [16, 256]. block_n: a multiple of 128
            (128 or 256) dividing I.
        act_q [P, I] fp8 / act_scale [P, I/128] fp32: written in place when given (rows past
            each block's valid_m, and blocks with valid_m 0, are left as they are), else
            allocated with torch.empty.
        validate: check block_meta's values on the host (a device synchronisation).

    Returns:
        (act_q, act_scale).
    """
    P, H = _dims("pool_x_q", pool_x_q, 2, _FP8)
    E, two_i, H2 = _dims("w13_q", w13_q, 3, _FP8)
    dev = pool_x_q.device
    I = two_i // 2
    if H2 != H or two_i % 2:
        raise ValueError(f"w13_q must have shape (E, 2I, H={H}), got {(E, two_i, H2)}")
    if H % FP8_BLOCK or I % FP8_BLOCK or H == 0 or I == 0:
        raise ValueError(f"H and I must be positive multiples of {FP8_BLOCK}, got H={H}, I={I}")
    _pow2("block_m", block_m, 16, 256)
    if block_n not in (128, 256) or I % block_n:
        raise ValueError(f"block_n must be 128 or 256 and divide I={I}, got {block_n!r}")
    nblk = _pool_blocks(P, block_m)
    _tensor("pool_x_q", pool_x_q, dtype=_FP8, shape=(P, H))
    _tensor("pool_x_scale", pool_x_scale, dtype=torch.float32, shape=(P, H // 128), device=dev)
    _tensor("w13_q", w13_q, dtype=_FP8, shape=(E, 2 * I, H), device=dev)
    _tensor("w13_scale_inv", w13_scale_inv, dtype=torch.float32,
            shape=(E, 2 * I // 128, H // 128), device=dev)
    _tensor("pool_weight", pool_weight, dtype=torch.float32, shape=(P,), device=dev)
    _check_meta(block_meta, nblk, block_m, E, dev, validate)
    act_q, act_scale = _act_out(act_q, act_scale, P, I, dev)
    _tensor("act_q", act_q, dtype=_FP8, shape=(P, I), device=dev)
    _tensor("act_scale", act_scale, dtype=torch.float32, shape=(P, I // 128), device=dev)
    if nblk:
        l1_fp8_kernel[(I // block_n, nblk)](
            pool_x_q, pool_x_scale, w13_q, w13_scale_inv, pool_weight, block_meta, act_q,
            act_scale, H, I, BM=block_m, BN=block_n, BK=FP8_BLOCK, FIX_ROUNDING=INTERPRET,
            **_launch_kw(num_warps, num_stages))
    return act_q, act_scale


def l2_fp8(*, act_q: torch.Tensor, act_scale: torch.Tensor, block_meta: torch.Tensor,
           w2_q: torch.Tensor, w2_scale_inv: torch.Tensor, block_m: int, block_n: int = 128,
           y: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
           num_warps: int | None = None, num_stages: int | None = None,
           validate: bool = True) -> torch.Tensor:
    """L2 of the pool in fp8: ``y = act @ w2^T`` (fp32 accumulation, per-K-block scales).

    Args (shapes: module legend; P = len(block_meta) * block_m; H, I multiples of 128):
        act_q [P, I] fp8, act_scale [P, I/128] fp32, block_meta [P/BM] int32,
        w2_q [E, H, I] fp8, w2_scale_inv [E, H/128, I/128] fp32, contiguous, one device.
        block_m: a power of two in [16, 256]. block_n: a power of two in [16, 256] dividing H.
        y [P, H] bf16 or fp32: written in place when given (only valid rows), else allocated
            (torch.empty) with ``out_dtype``.
        validate: check block_meta's values on the host.

    Returns:
        y.
    """
    P, I = _dims("act_q", act_q, 2, _FP8)
    E, H, I2 = _dims("w2_q", w2_q, 3, _FP8)
    dev = act_q.device
    if I2 != I:
        raise ValueError(f"w2_q must have shape (E, H, I={I}), got {(E, H, I2)}")
    if H % FP8_BLOCK or I % FP8_BLOCK or H == 0 or I == 0:
        raise ValueError(f"H and I must be positive multiples of {FP8_BLOCK}, got H={H}, I={I}")
    _pow2("block_m", block_m, 16, 256)
    _pow2("block_n", block_n, 16, 256)
    if H % block_n:
        raise ValueError(f"block_n={block_n} must divide H={H}")
    nblk = _pool_blocks(P, block_m)
    _tensor("act_scale", act_scale, dtype=torch.float32, shape=(P, I // 128), device=dev)
    _tensor("w2_q", w2_q, dtype=_FP8, shape=(E, H, I), device=dev)
    _tensor("w2_scale_inv", w2_scale_inv, dtype=torch.float32,
            shape=(E, H // 128, I // 128), device=dev)
    _check_meta(block_meta, nblk, block_m, E, dev, validate)
    y = _y_out(y, out_dtype, P, H, dev)
    _tensor("y", y, dtype=y.dtype, shape=(P, H), device=dev)
    if nblk:
        l2_fp8_kernel[(H // block_n, nblk)](
            act_q, act_scale, w2_q, w2_scale_inv, block_meta, y, H, I, BM=block_m, BN=block_n,
            BK=FP8_BLOCK, OUT_BF16=y.dtype == torch.bfloat16, FIX_ROUNDING=INTERPRET,
            **_launch_kw(num_warps, num_stages))
    return y


# the kernels' re-quantization uses moestream.quant's format exactly
assert FP8_MAX.value == FP8_E4M3_MAX and FP8_MIN_SCALE.value == QUANT_MIN_SCALE == 2.0 ** -126
