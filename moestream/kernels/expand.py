"""MXFP4 weights re-blocked as the fp8 GEMMs' weights (e4m3 values, one fp32 scale_inv per
128x128 block), for calls large enough that decoding every weight once beats decoding it
again in every m-block (``Tuning.fp4w_expand``; launcher: ``moestream.launch.fp4w_as_fp8``).

Legend (N rows of all experts stacked, K the reduction dimension; both multiples of 128):
    packed [N, K/2] uint8         e2m1 codes, element 2j in the low nibble of byte j
    codes [N, K/32] uint8         E8M0: w = e2m1 * 2**(code - 127), per 32 elements of a row
    q [N, K] fp8 e4m3, scale_inv [N/128, K/128] fp32    w ~= q * scale_inv

A 128x128 block with largest code C gets scale_inv = 2**(C - 133), and element (n, k) becomes
e2m1 * 2**(code[n, k/32] - C + 6): at most 6 * 2**6 = 384 <= 448, and exact while the code is
at least C - 14 (e4m3 holds e2m1 * 2**d for d in [-8, 6]). A group further below rounds to
the nearest e4m3: an error under half e4m3's subnormal step, 2**-10 * scale_inv.
"""
from __future__ import annotations

from .common import tl, triton
from .gemm_fp8 import to_fp8

BLOCK = tl.constexpr(128)   # rows and columns of a scale block
GROUP = tl.constexpr(32)    # K elements per E8M0 code
HEADROOM = tl.constexpr(6)  # 6 * 2**6 = 384: the largest e2m1 value of a block stays in e4m3


@triton.jit
def pow2(e):
    """2**e in fp32 for integer tensors e: exact for e >= -149, 0 below."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, tl.where(e >= -149, sub, 0.0))


@triton.jit
def e2m1_value(nib):
    """e2m1 codes (int32, 0..15) -> their values in fp32 (sign, 2 exponent bits, 1 mantissa
    bit; exponent 0 is the subnormal 0 / 0.5)."""
    e = (nib >> 1) & 3
    m = (nib & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, pow2(e - 1) * (1.0 + 0.5 * m))
    return tl.where((nib & 8) != 0, -mag, mag)


@triton.jit
def mxfp4_to_fp8_kernel(packed, codes, q, scale_inv, K, FIX_ROUNDING: tl.constexpr):
    """One 128x128 block per program: grid (N/128, K/128)."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    rows = nb.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    G: tl.constexpr = BLOCK // GROUP
    # a row's four codes of the block are one aligned uint32 (K is a multiple of 128)
    words = tl.load(codes.to(tl.pointer_type(tl.uint32)) + rows * (K // BLOCK) + kb)
    c = ((words[:, None] >> (8 * tl.arange(0, G))[None, :]) & 255).to(tl.int32)  # [128, 4]
    top = tl.max(tl.max(c, axis=1), axis=0)
    p = tl.load(packed + rows[:, None] * (K // 2) + kb * (BLOCK // 2)
                + tl.arange(0, BLOCK // 2)[None, :]).to(tl.int32)         # [128, 64]
    v = tl.reshape(tl.join(e2m1_value(p & 15), e2m1_value(p >> 4)), [BLOCK, G, GROUP])
    v = v * pow2(c - top + HEADROOM)[:, :, None]
    out = q + rows[:, None] * K + kb * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(out, to_fp8(tl.reshape(v, [BLOCK, BLOCK]), FIX_ROUNDING))
    tl.store(scale_inv + nb * (K // BLOCK) + kb, pow2(top - 127 - HEADROOM))
