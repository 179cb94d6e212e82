"""MXFP4-weight ("fp4w") grouped GEMMs over a pool of BM-row blocks: L1 (gate/up + SwiGLU x topk
weight + fp8 re-quantization) and L2 (down projection). The twins of gemm_fp8.py with MXFP4
weights instead of fp8 128x128 blocks; activations are fp8 exactly as there. The block functions
take the same arguments as gemm_fp8's (row strides included) so that the layer can swap them
in; the kernels below are standalone (no waits, no peers; launchers: moestream/tools/fp4.py). The
layer's staged L1/L2 (kernels/gemm.py, constexpr W4) call the row-piece forms
``l1_fp4w_rows`` / ``l2_fp4w_rows``; the fused launch has no fp4w blocks.

Legend (formats: moestream/quant.py, docs/quantization.md; P = blocks * BM):
    x_q [P, H] fp8 e4m3           pool rows; block m holds rows m*BM .. m*BM+BM-1, of which the
                                  first valid_m are real. Row stride X_STRIDE (fp8 elements)
    x_scale [P, H/128] fp32       per row per 128 channels: x ~= q * scale. Row stride
                                  XS_STRIDE (fp32 elements). The strides are explicit because in
                                  the layer one byte row holds both: values at bytes [0, H),
                                  scales at bytes [H, H + 4*H/128)
    block_meta [P/BM] int32       per block: expert * 512 + valid_m (moestream.regions's
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

Decode: Hopper has no FP4 MMA. Every e2m1 value times 2**-6 is an e4m3 value with the same
bits in the same places (``place_e2m1_pairs``), so each nibble becomes an e4m3 byte with two
shifts and masks (in PTX on four bytes per register on GPUs), bitcast to fp8, in a K order that
keeps those registers whole (``mx_dot``); the MMA is the fp8 one (QGMMA ... E4M3.E4M3 on sm_90a
at BM >= 64; at BM = 16 Triton widens the e4m3 values to fp16, exactly, for warp MMAs) with
fp32 accumulation. The packed bytes are staged in shared memory (asynchronous copies), the
decode runs in registers.

GEMM: the K loop steps by BK = 128 (one activation scale per row); each step is four k=32 fp8
dots, one per MXFP4 block (the weight scale changes every 32 K elements, per output column):

    blk = sum_j dot(x_q[:, 32j:32j+32], w_q'[:, 32j:32j+32]^T) * (2 * 2**e_w[:, 4k+j])
    acc += blk * (x_scale[:, k] * 32)

with w_q' = 2**-6 x the weights (the decode) and 2 * 2**e the E8M0 decode (``e8m0_twice``);
2**6 / 2 = 32 goes back through the activation scale. Each dot sums 32 exact fp8 products in
fp32 and every factor is a power of two, so this is the dequantized product up to fp32 rounding
(about the fp8 kernels' error). Folding 2**e into the decoded e4m3 values instead (one k=128
dot per step, a quarter of the scaling work) is exact only while a row's four exponents of a
step span <= 14 binades (e4m3 holds e2m1 * 2**d exactly for d in [-8, 6]); it would need a
per-tile check and fallback, so it is not done (see
docs/quantization.md). Rows past valid_m are computed from whatever the pool holds there (rows
are independent) and never stored; a block with valid_m = 0 does nothing. Grid (column blocks,
row blocks).
"""
from __future__ import annotations

from .common import INTERPRET, tl, triton
from .gemm_fp8 import l1_fp8_epilogue, store_pool_rows

ACT_GROUP = tl.constexpr(128)   # K elements per activation scale: the K step
MX_BLOCK = tl.constexpr(32)     # K elements per E8M0 weight scale: one dot


# ---- device helpers -------------------------------------------------------------------------

# e4m3 holds every e2m1 value times 2**-6 at the same bit positions (shown by the table below,
# checked for all 16 codes in tests/kernels/test_gemm_fp4.py); the kernels give the 2**6 back through
# the activation scale (exact: a power of two, and an fp8 activation scale is at most 2**120)
# and e8m0_twice's factor 2 with it: 2**6 / 2 = 32
DECODE_SHIFT = tl.constexpr(32.0)
MAX_E8M0 = 253   # the largest E8M0 code e8m0_twice decodes exactly
ASM = tl.constexpr(not INTERPRET)   # the decode's bit operations in PTX, 4 bytes at a time

_PLACE_ASM = tl.constexpr("""{
.reg .b32 t0, t1;
shl.b32 t0, $2, 2;
and.b32 t0, t0, 0x1C1C1C1C;
shl.b32 t1, $2, 4;
and.b32 t1, t1, 0x80808080;
or.b32 $0, t0, t1;
shr.b32 t0, $2, 2;
and.b32 t0, t0, 0x1C1C1C1C;
and.b32 t1, $2, 0x80808080;
or.b32 $1, t0, t1;
}""")


@triton.jit
def place_e2m1_pairs(p, ASM: tl.constexpr):
    """Packed e2m1 pairs (uint8, any shape; element 2j in the low nibble of byte j) -> (low,
    high) as fp8 e4m3 tensors of p's shape holding 2**-6 x the e2m1 values, exactly.

    An e2m1 code ``s e1 e0 m`` lands in e4m3 as ``s 0 0 e1 e0 m 0 0``: for e = e1 e0 >= 1 that
    is 2**(e - 7) * (1 + m/2) (e4m3's bias is 7, e2m1's 1), i.e. the e2m1 value 2**(e - 1) *
    (1 + m/2) times 2**-6; for e = 0 it is e4m3's subnormal 2**-6 * (4m / 8) = 2**-6 * (m / 2),
    again the e2m1 value (0 or 0.5) times 2**-6. So a decode is two shifts and masks per nibble
    and no table. ASM (GPU only; Triton's interpreter has no PTX): the same bit operations on
    four packed bytes (eight nibbles) per 32-bit register; bits a shift carries into a
    neighbouring byte are masked off."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_PLACE_ASM, "=r,=r,r", [p],
                                           dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        lo = ((p << 2) & 0x1C) | ((p << 4) & 0x80)
        hi = ((p >> 2) & 0x1C) | (p & 0x80)
    return (lo.to(tl.uint8).to(tl.float8e4nv, bitcast=True),
            hi.to(tl.uint8).to(tl.float8e4nv, bitcast=True))


@triton.jit
def e8m0_twice(words, j: tl.constexpr):
    """Byte j (0..3) of uint32 words of E8M0 codes c -> 2 * 2**(c - 127) = 2**(c - 126) in fp32:
    the code plus one as the exponent field, one add and a shift, no special cases. Exact for
    c <= 253 (code 0 becomes the normal 2**-126); 254 gives inf and 255 -0.0, so the launchers
    reject codes above MAX_E8M0 (the quantizer writes at most 252 for finite weights). The
    kernels take the factor 2 back with the activation scale (``DECODE_SHIFT``)."""
    return ((((words >> (8 * j)) & 255) + 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mx_dot(a_ptrs, w_ptrs_packed, j: tl.constexpr):
    """fp32 [BM, BN] dot of K chunk j (32 elements) of a 128-K step: activations [BM, 32] fp8
    at a_ptrs + 32 j, weights packed [BN, 16] uint8 at w_ptrs_packed + 16 j, decoded to 2**-6 x
    their values (``place_e2m1_pairs``).

    The dot runs the chunk in a permuted K order: per 4 packed bytes (elements 8q .. 8q+7)
    first their four low nibbles (8q, 8q+2, 8q+4, 8q+6), then their four high ones. Each
    decoded register (four e4m3 bytes of one kind of nibble) then feeds the MMA as it is,
    where the natural order needs its bytes interleaved with the other kind's; the small
    activation tile is permuted the same way instead (a dot's sum does not depend on the
    order of K, up to fp32 rounding). This cuts the 16-row K loops' instructions per step and
    makes them faster (see docs/tuning.md). Loading the activations in that order by pointer
    instead (a byte gather) is slower: it cannot be copied asynchronously. Warpgroup MMAs
    (pieces of 64 rows and more) keep the natural order: compiled for sm_90 the permuted one
    spills more in the 64-row L1."""
    a = tl.load(a_ptrs + j * MX_BLOCK)                                 # [BM, 32]
    BM: tl.constexpr = a.shape[0]
    p = tl.load(w_ptrs_packed + j * (MX_BLOCK // 2))                  # [BN, 16]
    lo, hi = place_e2m1_pairs(p, ASM)
    BN: tl.constexpr = p.shape[0]
    if BM < 64:   # warp MMAs (16-/32-row pieces): the permuted K order
        a = tl.reshape(tl.permute(tl.reshape(a, [BM, 4, 4, 2]), (0, 1, 3, 2)), [BM, MX_BLOCK])
        w = tl.join(tl.reshape(lo, [BN, 4, 4]), tl.reshape(hi, [BN, 4, 4]))  # [BN, q, i, nibble]
        w = tl.reshape(tl.permute(w, (0, 1, 3, 2)), [BN, MX_BLOCK])         # 8q + 4 nibble + i
    else:         # warpgroup MMAs: the natural order (the permuted one spilled 64 B more)
        w = tl.reshape(tl.join(lo, hi), [BN, MX_BLOCK])
    return tl.dot(a, tl.trans(w))


@triton.jit
def mx_scale(words, j: tl.constexpr):
    """Chunk j's weight scales (x 2, ``e8m0_twice``) from a row's four E8M0 codes of a 128-K
    step, one little-endian uint32 per weight row ([BN]) -> [1, BN] fp32."""
    return e8m0_twice(words, j)[None, :]


@triton.jit
def mx_step(a_ptrs, w_ptrs_packed, words):
    """One 128-K step without the activation scale: the sum over its four k=32 chunks of
    dot_j x 2 * 2**e_w[:, j] ([BM, BN] fp32). Triton waits for each dot before its scaling
    (a fresh fp32 result, not a chained accumulator), so the chunks run one after another."""
    blk = mx_dot(a_ptrs, w_ptrs_packed, 0) * mx_scale(words, 0)
    for j in tl.static_range(1, ACT_GROUP // MX_BLOCK):
        blk += mx_dot(a_ptrs, w_ptrs_packed, j) * mx_scale(words, j)
    return blk


@triton.jit
def act_scale_of(xs_ptrs):
    """A step's activation scales ([BM] fp32 at xs_ptrs) times DECODE_SHIFT -> [BM, 1]."""
    return (tl.load(xs_ptrs) * DECODE_SHIFT)[:, None]


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
    l1_fp4w_rows(mb, 0, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                 X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE, BM, BN, BK, BM, FIX_ROUNDING)


@triton.jit
def l1_fp4w_rows(mb, r0, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                 X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                 FIX_ROUNDING: tl.constexpr):
    """``l1_fp4w_block`` on rows r0 .. r0+ROWS-1 of the m-block (the layer walks a block's
    valid rows in pieces: 16-row pieces run as exact fp16 warp MMAs, docs/quantization.md)."""
    tl.static_assert(BK == ACT_GROUP)
    KS = H // BK                   # K steps
    HB = H // 2                    # packed bytes per weight row
    HW = H // (4 * MX_BLOCK)       # uint32 words of E8M0 codes per weight row (4 per word)
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    n = nb * BN + tl.arange(0, BN)
    wrow = e.to(tl.int64) * 2 * I + n.to(tl.int64)                          # gate rows [BN]
    a_ptrs = x_q + rows[:, None] * X_STRIDE + tl.arange(0, MX_BLOCK)[None, :]   # [ROWS, 32]
    xs_ptrs = x_scale + rows * XS_STRIDE
    wg_ptrs = w13 + wrow[:, None] * HB + tl.arange(0, MX_BLOCK // 2)[None, :]   # [BN, 16]
    wu_ptrs = wg_ptrs + I * HB
    # a 128-K step's four E8M0 codes are 4 consecutive bytes of a row: one uint32 per row
    sg_ptrs = w13_s.to(tl.pointer_type(tl.uint32)) + wrow * HW                   # [BN]
    su_ptrs = sg_ptrs + I * HW
    acc_g = tl.zeros([ROWS, BN], dtype=tl.float32)
    acc_u = tl.zeros([ROWS, BN], dtype=tl.float32)
    for ks in range(KS):
        xs = act_scale_of(xs_ptrs + ks)
        acc_g += mx_step(a_ptrs, wg_ptrs, tl.load(sg_ptrs + ks)) * xs
        acc_u += mx_step(a_ptrs, wu_ptrs, tl.load(su_ptrs + ks)) * xs
        a_ptrs += BK
        wg_ptrs += BK // 2
        wu_ptrs += BK // 2
    l1_fp8_epilogue(acc_g, acc_u, mb, nb, vm, pool_w, act_q, act_scale, A_STRIDE, AS_STRIDE,
                    BM, BN, FIX_ROUNDING, r0)


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
    return l2_fp4w_rows(mb, 0, nb, e, act_q, act_scale, w2, w2_s, H, I, A_STRIDE, AS_STRIDE,
                        BM, BN, BK, BM)


@triton.jit
def l2_fp4w_rows(mb, r0, nb, e, act_q, act_scale, w2, w2_s, H, I, A_STRIDE, AS_STRIDE,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr):
    """``l2_fp4w_acc`` on rows r0 .. r0+ROWS-1 of the m-block: fp32 [ROWS, BN]."""
    tl.static_assert(BK == ACT_GROUP)
    KS = I // BK
    IB = I // 2
    IW = I // (4 * MX_BLOCK)
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    wrow = e.to(tl.int64) * H + (nb * BN + tl.arange(0, BN)).to(tl.int64)   # [BN]
    a_ptrs = act_q + rows[:, None] * A_STRIDE + tl.arange(0, MX_BLOCK)[None, :]
    as_ptrs = act_scale + rows * AS_STRIDE
    w_ptrs = w2 + wrow[:, None] * IB + tl.arange(0, MX_BLOCK // 2)[None, :]
    s_ptrs = w2_s.to(tl.pointer_type(tl.uint32)) + wrow * IW
    acc = tl.zeros([ROWS, BN], dtype=tl.float32)
    for ks in range(KS):
        acc += mx_step(a_ptrs, w_ptrs, tl.load(s_ptrs + ks)) * act_scale_of(as_ptrs + ks)
        a_ptrs += BK
        w_ptrs += BK // 2
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
