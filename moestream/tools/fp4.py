"""Launchers of the standalone MXFP4-weight ("fp4w") grouped GEMMs (moestream/kernels/gemm_fp4.py:
formats, legend, numerics). Activations are fp8 e4m3 with one fp32 scale per row per 128
channels, exactly as in moestream.tools.fp8; weights are MXFP4 as
``quant.convert_expert_weights_mxfp4`` writes them. One launch per GEMM over a pool of block_m-row blocks described by block_meta
(expert * 512 + valid_m, ``fp8.pack_block_meta``); the layer (MoEConfig dtype "fp4w") runs the
same row functions inside its own kernels. Works on the CPU (Triton's interpreter) and on GPUs
(tested on an H200, the PTX decode included).

The activation tensors (pool_x_q / pool_x_scale, act_q / act_scale) and y may be row-strided
views (last dimension contiguous), e.g. the values and the scales of one packed byte row
(values at bytes [0, H), fp32 scales at bytes [H, H + 4*H/128)); the weights must be contiguous.
"""
from __future__ import annotations

import torch

from ..checks import MAX_E8M0 as CHECKED_E8M0, check_e8m0_codes
from .fp8 import (_act_out, _check_meta, _dims, _launch_kw, _pool_blocks, _pow2, _tensor,
                  _y_out, pack_block_meta)
from ..kernels.common import INTERPRET
from ..kernels.gemm_fp4 import ACT_GROUP, MAX_E8M0, MX_BLOCK, l1_fp4w_kernel, l2_fp4w_kernel
from ..quant import FP8_BLOCK, MXFP4_BLOCK

__all__ = ["l1_fp4w", "l2_fp4w", "pack_block_meta"]

_FP8 = torch.float8_e4m3fn
_U8 = torch.uint8


def _rows(name, t, *, dtype, shape, device):
    """A [rows, cols] tensor whose rows may be strided (last dimension contiguous); returns its
    row stride in elements."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    rows, cols = shape
    if cols > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides "
                         f"{t.stride()}")
    if rows > 1 and t.stride(0) < cols:
        raise ValueError(f"{name}'s rows must not overlap: row stride {t.stride(0)} < {cols}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other tensors on {device}")
    return t.stride(0) if rows > 1 else cols


def _word_aligned(name, t):
    # the kernels load a row's four E8M0 codes of a 128-K step as one uint32
    if t.data_ptr() % 4:
        raise ValueError(f"{name} must start at a 4-byte aligned address (its codes are read "
                         f"4 at a time), got data_ptr % 4 = {t.data_ptr() % 4}")


def _check_hi(H, I):
    if H % FP8_BLOCK or I % FP8_BLOCK or H <= 0 or I <= 0:
        raise ValueError(f"H and I must be positive multiples of {FP8_BLOCK} (one activation "
                         f"scale per 128 K elements), got H={H}, I={I}")


def l1_fp4w(*, pool_x_q: torch.Tensor, pool_x_scale: torch.Tensor, block_meta: torch.Tensor,
            w13_packed: torch.Tensor, w13_scale: torch.Tensor, pool_weight: torch.Tensor,
            block_m: int, block_n: int = 128, act_q: torch.Tensor | None = None,
            act_scale: torch.Tensor | None = None, num_warps: int | None = None,
            num_stages: int | None = None, validate: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """L1 of the pool, MXFP4 weights: ``act = silu(x @ gate^T) * (x @ up^T) * pool_weight``,
    re-quantized to fp8 per row per 128 columns (as ``quant.quantize_act_fp8``).

    Args (shapes: moestream/kernels/gemm_fp4.py legend; P = len(block_meta) * block_m; H and I
    positive multiples of 128):
        pool_x_q [P, H] fp8 e4m3, pool_x_scale [P, H/128] fp32: rows may be strided (last
            dimension contiguous), e.g. views into one packed byte row.
        block_meta [P/BM] int32: expert * 512 + valid_m.
        w13_packed [E, 2I, H/2] uint8 (e2m1 pairs, low nibble first), w13_scale [E, 2I, H/32]
            uint8 (E8M0), as ``quant.convert_expert_weights_mxfp4``'s "w13" / "w13_scale";
            contiguous. pool_weight [P] fp32, contiguous. All on one device (CPU: Triton's
            interpreter).
        block_m: rows per block, a power of two in [16, 256]. block_n: 128 or 256, dividing I.
        act_q [P, I] fp8 / act_scale [P, I/128] fp32: written in place when given (rows may be
            strided; rows past each block's valid_m and blocks with valid_m 0 are left as they
            are), else allocated with torch.empty.
        validate: check block_meta's values and that the E8M0 codes are at most 253 (the
            quantizer writes at most 252) on the host (device synchronisations).

    Returns:
        (act_q, act_scale).
    """
    P, H = _dims("pool_x_q", pool_x_q, 2, _FP8)
    E, two_i, HB = _dims("w13_packed", w13_packed, 3, _U8)
    dev = pool_x_q.device
    I = two_i // 2
    if HB * 2 != H or two_i % 2:
        raise ValueError(f"w13_packed must have shape (E, 2I, H/2={H // 2}) for H={H}, got "
                         f"{(E, two_i, HB)}")
    _check_hi(H, I)
    _pow2("block_m", block_m, 16, 256)
    if block_n not in (128, 256) or I % block_n:
        raise ValueError(f"block_n must be 128 or 256 and divide I={I}, got {block_n!r}")
    nblk = _pool_blocks(P, block_m)
    x_stride = _rows("pool_x_q", pool_x_q, dtype=_FP8, shape=(P, H), device=dev)
    xs_stride = _rows("pool_x_scale", pool_x_scale, dtype=torch.float32, shape=(P, H // 128),
                      device=dev)
    _tensor("w13_packed", w13_packed, dtype=_U8, shape=(E, 2 * I, H // 2), device=dev)
    _tensor("w13_scale", w13_scale, dtype=_U8, shape=(E, 2 * I, H // MXFP4_BLOCK), device=dev)
    _word_aligned("w13_scale", w13_scale)
    if validate:
        check_e8m0_codes("w13_scale", w13_scale)
    _tensor("pool_weight", pool_weight, dtype=torch.float32, shape=(P,), device=dev)
    _check_meta(block_meta, nblk, block_m, E, dev, validate)
    act_q, act_scale = _act_out(act_q, act_scale, P, I, dev)
    a_stride = _rows("act_q", act_q, dtype=_FP8, shape=(P, I), device=dev)
    as_stride = _rows("act_scale", act_scale, dtype=torch.float32, shape=(P, I // 128),
                      device=dev)
    if nblk:
        l1_fp4w_kernel[(I // block_n, nblk)](
            pool_x_q, pool_x_scale, w13_packed, w13_scale, pool_weight, block_meta, act_q,
            act_scale, H, I, x_stride, xs_stride, a_stride, as_stride, BM=block_m, BN=block_n,
            BK=ACT_GROUP.value, FIX_ROUNDING=INTERPRET,
            **_launch_kw(num_warps, num_stages))
    return act_q, act_scale


def l2_fp4w(*, act_q: torch.Tensor, act_scale: torch.Tensor, block_meta: torch.Tensor,
            w2_packed: torch.Tensor, w2_scale: torch.Tensor, block_m: int, block_n: int = 128,
            y: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
            num_warps: int | None = None, num_stages: int | None = None,
            validate: bool = True) -> torch.Tensor:
    """L2 of the pool, MXFP4 weights: ``y = act @ w2^T`` (fp32 accumulation).

    Args (shapes: moestream/kernels/gemm_fp4.py legend; P = len(block_meta) * block_m; H and I
    positive multiples of 128):
        act_q [P, I] fp8 e4m3, act_scale [P, I/128] fp32: rows may be strided (last dimension
            contiguous).
        block_meta [P/BM] int32: expert * 512 + valid_m.
        w2_packed [E, H, I/2] uint8, w2_scale [E, H, I/32] uint8 (E8M0), contiguous, as
            ``quant.convert_expert_weights_mxfp4``'s "w2" / "w2_scale". One device.
        block_m: a power of two in [16, 256]. block_n: a power of two in [16, 256] dividing H.
        y [P, H] bf16 or fp32: written in place when given (only valid rows; rows may be
            strided), else allocated (torch.empty) with ``out_dtype``.
        validate: check block_meta's values and the E8M0 codes (at most 253) on the host.

    Returns:
        y.
    """
    P, I = _dims("act_q", act_q, 2, _FP8)
    E, H, IB = _dims("w2_packed", w2_packed, 3, _U8)
    dev = act_q.device
    if IB * 2 != I:
        raise ValueError(f"w2_packed must have shape (E, H, I/2={I // 2}) for I={I}, got "
                         f"{(E, H, IB)}")
    _check_hi(H, I)
    _pow2("block_m", block_m, 16, 256)
    _pow2("block_n", block_n, 16, 256)
    if H % block_n:
        raise ValueError(f"block_n={block_n} must divide H={H}")
    nblk = _pool_blocks(P, block_m)
    a_stride = _rows("act_q", act_q, dtype=_FP8, shape=(P, I), device=dev)
    as_stride = _rows("act_scale", act_scale, dtype=torch.float32, shape=(P, I // 128),
                      device=dev)
    _tensor("w2_packed", w2_packed, dtype=_U8, shape=(E, H, I // 2), device=dev)
    _tensor("w2_scale", w2_scale, dtype=_U8, shape=(E, H, I // MXFP4_BLOCK), device=dev)
    _word_aligned("w2_scale", w2_scale)
    if validate:
        check_e8m0_codes("w2_scale", w2_scale)
    _check_meta(block_meta, nblk, block_m, E, dev, validate)
    y = _y_out(y, out_dtype, P, H, dev)
    y_stride = _rows("y", y, dtype=y.dtype, shape=(P, H), device=dev)
    if nblk:
        l2_fp4w_kernel[(H // block_n, nblk)](
            act_q, act_scale, w2_packed, w2_scale, block_meta, y, H, I, a_stride, as_stride,
            y_stride, BM=block_m, BN=block_n, BK=ACT_GROUP.value,
            OUT_BF16=y.dtype == torch.bfloat16, FIX_ROUNDING=INTERPRET,
            **_launch_kw(num_warps, num_stages))
    return y


# the kernels' blocking is moestream.quant's format, and checks.py (the layer's weight check)
# rejects exactly the E8M0 codes they cannot decode
assert MAX_E8M0 == CHECKED_E8M0
assert ACT_GROUP.value == FP8_BLOCK and MX_BLOCK.value == MXFP4_BLOCK
