"""MXFP4-weight ("fp4w") grouped GEMMs over a pool of BM-row blocks: L1 (gate/up + SwiGLU x topk
weight + fp8 re-quantization) and L2 (down projection). The twins of gemm_fp8.py with MXFP4
weights instead of fp8 128x128 blocks; activations are fp8 exactly as there. The block functions
take the same arguments as gemm_fp8's (row strides included) so that the layer can swap them
in; the kernels below are standalone (no waits, no peers; launchers: moestream/fp4.py). Not
wired into the layer (moestream.stages / fused.py) yet.

Legend (formats: moestream/quant.py, docs/quantization.md; P = blocks * BM):
    x_q [P, H] fp8 e4m3           pool rows; block m holds rows m*BM .. m*BM+BM-1, of which the
                                  first valid_m are real. Row stride X_STRIDE (fp8 elements)
    x_scale [P, H/128] fp32       per row per 128 channels: x ~= q * scale. Row stride
                                  XS_STRIDE (fp32 elements). The strides are explicit because in
                                  the layer one byte row holds both: values at bytes [0, H),
                                  scales at bytes [H, H + 4*H/128)
    block_meta [P/BM] int32       per block: expert * 512 + valid_m (moestream.layout's
                                  encoding), valid_m in [0, BM]; any number of blocks per expert
    w13 [E, 2I, H/2] uint8        MXFP4 e2m1 codes, gate rows 0..I-1, up rows I..2I-1; element
                                  2j in the low nibble of byte j, 2j+1 in the high nibble
    w13_s [E, 2I, H/32] uint8     E8M0 codes: w = e2m1 * 2**(code - 127), per 32 K elements
    pool_w [P] fp32               topk weight of each row
    act_q [P, I] fp8, act_scale [P, I/128] fp32   row strides A_STRIDE, AS_STRIDE;
                                  act = silu(x @ gate^T) * (x @ up^T) * topk weight, quantized
                                  per row per 128 columns exactly as quant.quantize_act_fp8
    w2 [E, H, I/2] uint8, w2_s [E, H, I/32] uint8
    y [P, H] bf16 or fp32         act @ w2^T, row stride Y_STRIDE
H and I are multiples of 128 (so a weight row's E8M0 codes of one 128-K step are one aligned
uint32, loaded at once).

Decode: Hopper has no FP4 MMA. Every e2m1 value (0, +-0.5 .. +-6) is exactly an e4m3 value,
so each nibble becomes an e4m3 byte with integer ops (decode_e2m1_to_e4m3), bitcast to fp8, and
the MMA is the fp8 one (QGMMA ... E4M3.E4M3 on sm_90a) with fp32 accumulation. The decoded
tile goes through shared memory to the MMA (Triton stages it).

GEMM: the K loop steps by BK = 128 (one activation scale per row); each step is four k=32 fp8
dots, one per MXFP4 block (the weight scale changes every 32 K elements, per output column),
each scaled and added to the fp32 accumulator as gemm_fp8 does per 128:

    acc += dot(x_q[:, 32j:32j+32], w_q[:, 32j:32j+32]^T) * (x_scale[:, k] (x) 2**e_w[:, 4k+j])

Each dot sums 32 exact fp8 products in fp32 and the power-of-two factor is exact, so this is the
dequantized product up to fp32 rounding (about the fp8 kernels' error). Folding 2**e into the
decoded e4m3 values instead (one k=128 dot per step, a quarter of the scaling work) is exact
only while a row's four exponents of a step span <= 14 binades (e4m3 holds e2m1 * 2**d exactly
for d in [-8, 6]); it would need a per-tile check and fallback, so it is not done (see
docs/quantization.md). Rows past valid_m are computed from whatever the pool holds there (rows
are independent) and never stored; a block with valid_m = 0 does nothing. Grid (column blocks,
row blocks).
"""
from __future__ import annotations

from ._common import tl, triton
from .gemm_fp8 import l1_fp8_epilogue, store_pool_rows

ACT_GROUP = tl.constexpr(128)   # K elements per activation scale: the K step
MX_BLOCK = tl.constexpr(32)     # K elements per E8M0 weight scale: one dot


# ---- device helpers -------------------------------------------------------------------------

@triton.jit
def decode_e2m1_to_e4m3(nibbles):
    """uint8 tensor of e2m1 codes (0..15, sign << 3 | index) -> the same values as fp8 e4m3fn,
    exactly. index 0 -> 0; 1 (0.5) -> 0x30; index i >= 2 (1, 1.5, 2, 3, 4, 6) -> 0x38 + 4 (i - 2)
    (e2m1's exponent and mantissa bit land in e4m3's exponent + 6 and top mantissa bit); the
    sign bit moves from bit 3 to bit 7 (code 8, -0, becomes e4m3's -0)."""
    idx = nibbles & 7
    mag = tl.where(idx > 1, idx * 4 + 48, idx * 48)
    bits = mag | ((nibbles & 8) << 4)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def e8m0_to_fp32(codes):
    """uint8 E8M0 codes -> 2**(code - 127) in fp32, exactly (code 0: the subnormal 2**-127;
    255, never written by quant.quantize_weight_mxfp4: NaN)."""
    c = codes.to(tl.uint32)
    bits = tl.where(c == 0, 0x00400000, c << 23)
    bits = tl.where(c == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_mx_chunk(w_ptrs_packed):
    """One 32-element K chunk of BN weight rows: packed [BN, 16] uint8 -> [32, BN] fp8 e4m3
    (the dot's B operand), element 2j from the low nibble of byte j, 2j+1 from the high."""
    p = tl.load(w_ptrs_packed)                                # [BN, 16]
    lo = decode_e2m1_to_e4m3(p & 15)
    hi = decode_e2m1_to_e4m3(p >> 4)
    BN: tl.constexpr = p.shape[0]
    return tl.trans(tl.reshape(tl.join(lo, hi), [BN, 32]))


@triton.jit
def mx_scale(words, j: tl.constexpr):
    """The scale of chunk j (0..3) of a 128-K step from its four E8M0 codes loaded as one
    little-endian uint32 per weight row ([BN] uint32) -> [BN] fp32."""
    return e8m0_to_fp32((words >> (8 * j)) & 255)


# ---- L1 -------------------------------------------------------------------------------------

@triton.jit
def l1_fp4w_block(mb, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                  X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  FIX_ROUNDING: tl.constexpr):
    """One L1 block (m_block, n_block): gate and up (four k=32 dots per 128-K step, each with
    its per-column MXFP4 scale), SwiGLU x topk weight, fp8 re-quantization of its BN columns
    (BN/128 scale groups per row). Row strides (elements): x_q X_STRIDE, x_scale XS_STRIDE,
    act_q A_STRIDE, act_scale AS_STRIDE (H, H/128, I, I/128 for separate tensors). The
    arguments are ``gemm_fp8.l1_fp8_block``'s with MXFP4 weights; BK must be 128."""
    tl.static_assert(BK == ACT_GROUP)
    KS = H // BK                   # K steps
    HB = H // 2                    # packed bytes per weight row
    HW = H // (4 * MX_BLOCK)       # uint32 words of E8M0 codes per weight row (4 per word)
    rows = mb.to(tl.int64) * BM + tl.arange(0, BM)
    n = nb * BN + tl.arange(0, BN)
    wrow = e.to(tl.int64) * 2 * I + n.to(tl.int64)                          # gate rows [BN]
    a_ptrs = x_q + rows[:, None] * X_STRIDE + tl.arange(0, MX_BLOCK)[None, :]   # [BM, 32]
    xs_ptrs = x_scale + rows * XS_STRIDE
    wg_ptrs = w13 + wrow[:, None] * HB + tl.arange(0, MX_BLOCK // 2)[None, :]   # [BN, 16]
    wu_ptrs = wg_ptrs + I * HB
    # a 128-K step's four E8M0 codes are 4 consecutive bytes of a row: one uint32 per row
    sg_ptrs = w13_s.to(tl.pointer_type(tl.uint32)) + wrow * HW                   # [BN]
    su_ptrs = sg_ptrs + I * HW
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for ks in range(KS):
        xs = tl.load(xs_ptrs + ks)
        sg_words = tl.load(sg_ptrs + ks)
        su_words = tl.load(su_ptrs + ks)
        for j in tl.static_range(BK // MX_BLOCK):
            a = tl.load(a_ptrs)
            g = load_mx_chunk(wg_ptrs)
            u = load_mx_chunk(wu_ptrs)
            acc_g += tl.dot(a, g) * (xs[:, None] * mx_scale(sg_words, j)[None, :])
            acc_u += tl.dot(a, u) * (xs[:, None] * mx_scale(su_words, j)[None, :])
            a_ptrs += MX_BLOCK
            wg_ptrs += MX_BLOCK // 2
            wu_ptrs += MX_BLOCK // 2
    l1_fp8_epilogue(acc_g, acc_u, mb, nb, vm, pool_w, act_q, act_scale, A_STRIDE, AS_STRIDE,
                    BM, BN, FIX_ROUNDING)


@triton.jit
def l1_fp4w_kernel(x_q, x_scale, w13, w13_s, pool_w, block_meta, act_q, act_scale, H, I,
                   X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   FIX_ROUNDING: tl.constexpr):
    nb = tl.program_id(0)
    mb = tl.program_id(1)
    meta = tl.load(block_meta + mb)
    vm = meta & 511
    if vm > 0:
        l1_fp4w_block(mb, nb, meta >> 9, vm, x_q, x_scale, w13, w13_s, pool_w, act_q,
                      act_scale, H, I, X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE, BM, BN, BK,
                      FIX_ROUNDING)


# ---- L2 -------------------------------------------------------------------------------------

@triton.jit
def l2_fp4w_acc(mb, nb, e, act_q, act_scale, w2, w2_s, H, I, A_STRIDE, AS_STRIDE,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """fp32 [BM, BN] = rows of m_block @ w2[e]^T, columns of n_block: four k=32 dots per
    128-K step. Row strides (elements): act_q A_STRIDE, act_scale AS_STRIDE (as
    ``gemm_fp8.l2_fp8_acc``); BK must be 128."""
    tl.static_assert(BK == ACT_GROUP)
    KS = I // BK
    IB = I // 2
    IW = I // (4 * MX_BLOCK)
    rows = mb.to(tl.int64) * BM + tl.arange(0, BM)
    wrow = e.to(tl.int64) * H + (nb * BN + tl.arange(0, BN)).to(tl.int64)   # [BN]
    a_ptrs = act_q + rows[:, None] * A_STRIDE + tl.arange(0, MX_BLOCK)[None, :]
    as_ptrs = act_scale + rows * AS_STRIDE
    w_ptrs = w2 + wrow[:, None] * IB + tl.arange(0, MX_BLOCK // 2)[None, :]
    s_ptrs = w2_s.to(tl.pointer_type(tl.uint32)) + wrow * IW
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for ks in range(KS):
        xs = tl.load(as_ptrs + ks)
        s_words = tl.load(s_ptrs + ks)
        for j in tl.static_range(BK // MX_BLOCK):
            a = tl.load(a_ptrs)
            w = load_mx_chunk(w_ptrs)
            acc += tl.dot(a, w) * (xs[:, None] * mx_scale(s_words, j)[None, :])
            a_ptrs += MX_BLOCK
            w_ptrs += MX_BLOCK // 2
    return acc


@triton.jit
def l2_fp4w_block(mb, nb, e, vm, act_q, act_scale, w2, w2_s, y, H, I, A_STRIDE, AS_STRIDE,
                  Y_STRIDE, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  OUT_BF16: tl.constexpr, FIX_ROUNDING: tl.constexpr):
    """One L2 block (m_block, n_block): y rows (row stride Y_STRIDE) = act @ w2^T, rows past
    valid_m not stored."""
    acc = l2_fp4w_acc(mb, nb, e, act_q, act_scale, w2, w2_s, H, I, A_STRIDE, AS_STRIDE,
                      BM, BN, BK)
    store_pool_rows(acc, mb, nb, vm, y, Y_STRIDE, BM, BN, OUT_BF16, FIX_ROUNDING)


@triton.jit
def l2_fp4w_kernel(act_q, act_scale, w2, w2_s, block_meta, y, H, I, A_STRIDE, AS_STRIDE,
                   Y_STRIDE, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   OUT_BF16: tl.constexpr, FIX_ROUNDING: tl.constexpr):
    nb = tl.program_id(0)
    mb = tl.program_id(1)
    meta = tl.load(block_meta + mb)
    vm = meta & 511
    if vm > 0:
        l2_fp4w_block(mb, nb, meta >> 9, vm, act_q, act_scale, w2, w2_s, y, H, I, A_STRIDE,
                      AS_STRIDE, Y_STRIDE, BM, BN, BK, OUT_BF16, FIX_ROUNDING)
