"""FP8 (e4m3, DeepSeek-V3 block scales) grouped GEMMs over a pool of BM-row blocks: L1 (gate/up
+ SwiGLU x topk weight + fp8 re-quantization) and L2 (down projection). The block functions
serve the layer (kernels/gemm.py's L1/L2 kernels with FP8, over packed byte rows) and the
standalone kernels below (separate value and scale tensors, no waits, no peers; launchers:
moestream/tools/fp8.py). sm_90 compile check: ``python -m moestream.tools.aot --fp8``.

Legend (formats: moestream/quant.py, docs/quantization.md):
    pool_x_q [P, H] fp8 e4m3      rows of the pool, P = blocks * BM; block m holds rows
                                  m*BM .. m*BM+BM-1, of which the first valid_m are real
    pool_x_scale [P, H/128] fp32  per row per 128 channels: x ~= q * scale
    block_meta [P/BM] int32       per block: expert * 512 + valid_m (moestream.regions's
                                  encoding; ``fp8.pack_block_meta``), valid_m in [0, BM]; an expert
                                  may own any number of blocks (zero included), in any order
    w13_q [E, 2I, H] fp8          gate rows 0..I-1, up rows I..2I-1
    w13_scale_inv [E, 2I/128, H/128] fp32   per 128x128 block: w ~= q * scale_inv
    pool_weight [P] fp32          topk weight of each row
    act_q [P, I] fp8, act_scale [P, I/128] fp32
                                  act = silu(x @ gate^T) * (x @ up^T) * topk weight, quantized
                                  per row per 128 columns exactly as quant.quantize_act_fp8
    w2_q [E, H, I] fp8, w2_scale_inv [E, H/128, I/128] fp32
    y [P, H] bf16 or fp32         act @ w2^T

GEMM: BK = 128 = one scale block per K step; each K step is its own fp32 dot (on Hopper: four
k=32 fp8 warpgroup MMAs), scaled and added to the fp32 accumulator in registers:
``acc += dot(xq_k, wq_k) * (x_scale[:, k] (x) w_scale[n // 128, k])`` (DeepGEMM's promotion,
which also keeps the tensor cores' limited-precision fp8 accumulation to 128 products).
Rows past valid_m are computed from whatever the pool holds there (rows are independent) and
never stored; a block with valid_m = 0 does nothing. Grid (column blocks, row blocks).

Interpreter (CPU): its fp32 -> fp8 cast does not round to nearest even (and mishandles
subnormals), so with FIX_ROUNDING the value is first rounded, in exact fp32/integer arithmetic,
to the e4m3 value it must become; the cast then has nothing to round (as common.to_bf16).
"""
from __future__ import annotations

from .common import DECODE_STORE_EVICT, tl, to_bf16, triton, zero_acc

# quant_rows_128's constants: moestream.quant's FP8_E4M3_MAX and FP8_MIN_SCALE (moestream.tools.fp8
# asserts they agree; kernels import nothing of ours but common)
FP8_MAX = tl.constexpr(448.0)
FP8_MIN_SCALE = tl.constexpr(1.1754943508222875e-38)   # 2**-126


# ---- device helpers -------------------------------------------------------------------------

@triton.jit
def to_fp8(v, FIX_ROUNDING: tl.constexpr):
    """fp32 -> fp8 e4m3fn, round to nearest even. ``v`` must lie in [-448, 448]."""
    if FIX_ROUNDING:
        bits = v.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        mag = bits & 0x7FFFFFFF
        # normal e4m3 (>= 2**-6): keep 3 mantissa bits, RTNE on the fp32 bits (<= 448 stays <= 448)
        nrm = (mag + (((mag >> 20) & 1) + 0x7FFFF)) & 0xFFF00000
        # subnormal e4m3 (< 2**-6): multiples of 2**-9; r + 2**23 - 2**23 rounds r to an even
        # integer (exact IEEE fp32 arithmetic, 0 <= r < 8)
        a = mag.to(tl.float32, bitcast=True)
        r = a * 512.0
        r = (r + 8388608.0) - 8388608.0
        sub = (r * 0.001953125).to(tl.uint32, bitcast=True)
        mag = tl.where(a < 0.015625, sub, nrm)
        v = (mag | sign).to(tl.float32, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def quant_rows_128(act, FIX_ROUNDING: tl.constexpr):
    """act [BM, BN] fp32 (BN a multiple of 128) -> (q [BM, BN] fp8, scale [BM, BN/128] fp32),
    per row per 128 columns: scale = max(amax / 448, 2**-126), q = fp8(clamp(act / scale))
    (correctly rounded divisions, as torch computes quant.quantize_act_fp8).

    An all-zero group (a masked or padding row: 7 of 8 rows of a publish tile at 1 token, 15
    of 16 rows of a decode piece) quantizes to its zeros with scale 2**-126 without dividing:
    both divisions see 1.0 / 1.0 there, because a zero or tiny operand sends the GPU's
    correctly rounded division to its slow path (which made the fp8 publish slower at 1
    token than at 128). The results are unchanged."""
    BM: tl.constexpr = act.shape[0]
    BN: tl.constexpr = act.shape[1]
    G: tl.constexpr = BN // 128
    a3 = tl.reshape(act, [BM, G, 128])
    amax = tl.max(tl.abs(a3), axis=2)
    live = amax > 0                                                       # [BM, G]
    scale = tl.maximum(tl.where(live, tl.math.div_rn(tl.where(live, amax, 1.0), FP8_MAX), 0.0),
                       FP8_MIN_SCALE)
    live3 = live[:, :, None]
    q = tl.where(live3, tl.math.div_rn(tl.where(live3, a3, 1.0),
                                       tl.where(live, scale, 1.0)[:, :, None]), a3)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    q = to_fp8(tl.reshape(q, [BM, BN]), FIX_ROUNDING)
    return q, scale


@triton.jit
def fp8_descriptors(x_q, rows, cols, row_stride, w, w_rows, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """Tensor descriptors (TMA) of a GEMM's e4m3 operands: A rows [rows, cols] with row stride
    ``row_stride`` bytes (the layer's byte rows: a multiple of 16, moestream.config), and the
    weights [w_rows, cols] (all experts' rows stacked). Tiles [BM, BK] and [BN, BK].
    The staged L2 uses them (faster than pointers at dsv3 dims)."""
    a_desc = tl.make_tensor_descriptor(x_q, shape=[rows, cols], strides=[row_stride, 1],
                                       block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w, shape=[w_rows, cols], strides=[cols, 1],
                                       block_shape=[BN, BK])
    return a_desc, w_desc


@triton.jit
def fp8_w_scales(w_s, e64, rows_per_e, nb, BN: tl.constexpr, KB):
    """Pointer to the weight scales of column block ``nb`` (BN rows of the weight) of expert
    e64 in a [E, rows_per_e / 128, KB] scale_inv tensor, at K step 0: one scalar pointer per K
    step when BN <= 128 (the block's rows share one scale group), else [BN] pointers."""
    if BN <= 128:   # constexpr: one branch is compiled
        p = w_s + e64 * (rows_per_e // 128) * KB + (nb * BN // 128) * KB
    else:
        p = w_s + e64 * (rows_per_e // 128) * KB + ((nb * BN + tl.arange(0, BN)) // 128) * KB
    return p


@triton.jit
def next_scale_step(kb, KB):
    """The K step whose scales a K loop loads during step ``kb``: kb + 1, or the last step
    again at the end (an in-bounds reload, never used). Loading a step's activation and weight
    scales one step ahead hides their latency behind the step's MMAs; loaded in the step that
    uses them, they hold the warps at the promotion ("long scoreboard" stalls in ncu)."""
    return tl.minimum(kb + 1, KB - 1)


# ---- L1 -------------------------------------------------------------------------------------

@triton.jit
def l1_fp8_block(mb, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                 X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 FIX_ROUNDING: tl.constexpr):
    """One L1 block (m_block, n_block): gate and up with per-K-block scales, SwiGLU x weight,
    fp8 re-quantization of its BN columns (BN/128 scale groups per row).
    Row strides (elements): x_q X_STRIDE, x_scale XS_STRIDE, act_q A_STRIDE, act_scale
    AS_STRIDE (H, H/128, I, I/128 for separate tensors; the layer packs values and scales
    in one byte row). Pointer loads only: with tensor descriptors this block spills inside
    its K loop and runs slower."""
    l1_fp8_rows(mb, 0, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE, BM, BN, BK, BM, 0, 0, False,
                FIX_ROUNDING, False)


@triton.jit
def l1_fp8_rows(mb, r0, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, ROWS: tl.constexpr, a_desc, w_desc, USE_TMA: tl.constexpr,
                FIX_ROUNDING: tl.constexpr, SWAP: tl.constexpr,
                EVICT_LAST: tl.constexpr = False):
    """Rows r0 .. r0+ROWS-1 of an fp8 L1 block (``l1_fp8_block``). SWAP (decode pieces): the
    weights as the MMA row operand ([BN, ROWS] accumulators, ``fp8_swap_step``), transposed
    for the epilogue. USE_TMA: ``a_desc`` has ROWS-row tiles. EVICT_LAST: the epilogue's
    stores at ``DECODE_STORE_EVICT`` priority (``l1_fp8_epilogue``)."""
    acc_g, acc_u = l1_fp8_acc(mb, r0, nb, e, x_q, x_scale, w13, w13_s, H, I, X_STRIDE,
                              XS_STRIDE, BM, BN, BK, ROWS, a_desc, w_desc, USE_TMA, SWAP)
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    l1_fp8_epilogue(acc_g, acc_u, mb, nb, vm, pool_w, act_q, act_scale, A_STRIDE, AS_STRIDE,
                    BM, BN, FIX_ROUNDING, r0, EVICT_LAST)


@triton.jit
def l1_fp8_acc(mb, r0, nb, e, x_q, x_scale, w13, w13_s, H, I, X_STRIDE, XS_STRIDE,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
               a_desc, w_desc, USE_TMA: tl.constexpr, SWAP: tl.constexpr, kb_lo=0, kb_hi=-1):
    """The fp32 gate and up sums of rows r0 .. r0+ROWS-1 of an fp8 L1 block over K steps
    [kb_lo, kb_hi) (kb_hi -1: every step; a split-K part's range, ``kernels/gemm.
    l1_fp8_split_part``), each step's product scaled by its activation and weight scales:
    [ROWS, BN] each, or [BN, ROWS] with SWAP (not transposed)."""
    KB = H // BK
    if kb_hi < 0:
        kb_hi = KB
    kk = tl.arange(0, BK)
    n = nb * BN + tl.arange(0, BN)
    e64 = e.to(tl.int64)
    # BN <= 128: the block's columns share one scale group, so its weight scale per K step is
    # one scalar instead of a [BN] vector of equal values (fewer registers)
    ONE_GROUP: tl.constexpr = BN <= 128
    sg_ptrs = fp8_w_scales(w13_s, e64, 2 * I, nb, BN, KB)   # gate rows
    su_ptrs = sg_ptrs + (I // 128) * KB                      # up rows
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    a_ptrs = x_q + rows[:, None] * X_STRIDE + kb_lo * BK + kk[None, :]
    wg_ptrs = w13 + e64 * 2 * I * H + n[:, None].to(tl.int64) * H + kb_lo * BK + kk[None, :]
    wu_ptrs = wg_ptrs + I * H
    xs_ptrs = x_scale + rows * XS_STRIDE
    acc_g = zero_acc(ROWS, BN, SWAP)
    acc_u = zero_acc(ROWS, BN, SWAP)
    # step kb_lo's scales (kb_lo < KB: a split part with no step does not come here)
    xs_n, sg_n = tl.load(xs_ptrs + kb_lo), tl.load(sg_ptrs + kb_lo)
    su_n = tl.load(su_ptrs + kb_lo)
    for kb in range(kb_lo, kb_hi):
        # this step's scales were loaded one step ahead (``next_scale_step``)
        xs, sg, su = xs_n, sg_n, su_n
        kn = next_scale_step(kb, KB)
        xs_n, sg_n, su_n = tl.load(xs_ptrs + kn), tl.load(sg_ptrs + kn), tl.load(su_ptrs + kn)
        if USE_TMA:
            a = a_desc.load([mb * BM + r0, kb * BK])
            g = w_desc.load([e * 2 * I + nb * BN, kb * BK])
            u = w_desc.load([e * 2 * I + I + nb * BN, kb * BK])
        else:
            a = tl.load(a_ptrs)
            g = tl.load(wg_ptrs)
            u = tl.load(wu_ptrs)
        if not SWAP:
            g = g.T
            u = u.T
        if SWAP:
            acc_g = fp8_swap_step(acc_g, g, a, xs, sg, BN)
            acc_u = fp8_swap_step(acc_u, u, a, xs, su, BN)
        else:
            if ONE_GROUP:
                acc_g += tl.dot(a, g) * (xs * sg)[:, None]
                acc_u += tl.dot(a, u) * (xs * su)[:, None]
            else:
                acc_g += tl.dot(a, g) * (xs[:, None] * sg[None, :])
                acc_u += tl.dot(a, u) * (xs[:, None] * su[None, :])
        a_ptrs += BK
        wg_ptrs += BK
        wu_ptrs += BK
    return acc_g, acc_u


@triton.jit
def l1_fp8_epilogue(acc_g, acc_u, mb, nb, vm, pool_w, act_q, act_scale, A_STRIDE, AS_STRIDE,
                    BM: tl.constexpr, BN: tl.constexpr, FIX_ROUNDING: tl.constexpr, r0=0,
                    EVICT_LAST: tl.constexpr = False):
    """An L1 block's fp32 gate/up tiles [ROWS, BN] (rows r0 .. r0+ROWS-1 of m-block ``mb`` of
    BM rows; ROWS = BM unless a decode piece) -> silu(gate) * up * topk weight, quantized per
    row per 128 columns into act_q / act_scale (rows past vm are not stored). EVICT_LAST
    (decode pieces): both stores at ``DECODE_STORE_EVICT`` priority in the L2 cache, as the
    bf16 L1's (kernels/gemm.py ``l1_store``)."""
    POLICY: tl.constexpr = DECODE_STORE_EVICT if EVICT_LAST else ""
    ROWS: tl.constexpr = acc_g.shape[0]
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    n = nb * BN + tl.arange(0, BN)
    rv = r0 + tl.arange(0, ROWS) < vm
    w_row = tl.load(pool_w + rows, mask=rv, other=0.0)
    act = acc_g * tl.sigmoid(acc_g) * acc_u * w_row[:, None]
    q, scale = quant_rows_128(act, FIX_ROUNDING)
    tl.store(act_q + rows[:, None] * A_STRIDE + n[None, :], q, mask=rv[:, None],
             eviction_policy=POLICY)
    G: tl.constexpr = BN // 128
    groups = nb * G + tl.arange(0, G)
    tl.store(act_scale + rows[:, None] * AS_STRIDE + groups[None, :], scale, mask=rv[:, None],
             eviction_policy=POLICY)


@triton.jit
def l1_fp8_kernel(x_q, x_scale, w13, w13_s, pool_w, block_meta, act_q, act_scale, H, I,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  FIX_ROUNDING: tl.constexpr):
    nb = tl.program_id(0)
    mb = tl.program_id(1)
    meta = tl.load(block_meta + mb)
    vm = meta & 511
    if vm > 0:
        l1_fp8_block(mb, nb, meta >> 9, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale,
                     H, I, H, H // 128, I, I // 128, BM, BN, BK, FIX_ROUNDING)


# ---- L2 -------------------------------------------------------------------------------------

@triton.jit
def l2_fp8_acc(mb, nb, e, act_q, act_scale, w2, w2_s, H, I, A_STRIDE, AS_STRIDE,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, a_desc=0, w_desc=0,
               USE_TMA: tl.constexpr = False, sub=0, SPLIT_M: tl.constexpr = 1):
    """fp32 [BM / SPLIT_M, BN] = rows of m_block (row piece ``sub``) @ w2[e]^T, columns of
    n_block, per-K-block scales. Row strides (elements): act_q A_STRIDE, act_scale AS_STRIDE
    (as ``l1_fp8_block``). USE_TMA: value tiles through ``fp8_descriptors`` (act_q's rows
    in pieces of BM / SPLIT_M, w2 as [E * H, I])."""
    BMT: tl.constexpr = BM // SPLIT_M
    return l2_fp8_rows(mb, sub * BMT, nb, e, act_q, act_scale, w2, w2_s, H, I, A_STRIDE,
                       AS_STRIDE, BM, BN, BK, BMT, a_desc, w_desc, USE_TMA, False)


@triton.jit
def l2_fp8_rows(mb, r0, nb, e, act_q, act_scale, w2, w2_s, H, I, A_STRIDE, AS_STRIDE,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                a_desc, w_desc, USE_TMA: tl.constexpr, SWAP: tl.constexpr):
    """fp32 [ROWS, BN]: rows r0 .. r0+ROWS-1 of m_block @ w2[e]^T, columns of n_block,
    per-K-block scales (``l2_fp8_acc``). SWAP (decode pieces): computed as weights @ rows^T,
    the weight tile as the MMA's row operand (``fp8_swap_step``), and transposed. USE_TMA:
    ``a_desc`` has ROWS-row tiles."""
    KB = I // BK
    rows = mb.to(tl.int64) * BM + r0 + tl.arange(0, ROWS)
    kk = tl.arange(0, BK)
    n = nb * BN + tl.arange(0, BN)
    e64 = e.to(tl.int64)
    a_ptrs = act_q + rows[:, None] * A_STRIDE + kk[None, :]
    w_ptrs = w2 + e64 * H * I + n[:, None].to(tl.int64) * I + kk[None, :]
    as_ptrs = act_scale + rows * AS_STRIDE
    ONE_GROUP: tl.constexpr = BN <= 128   # one weight scale per K step (as l1_fp8_block)
    ws_ptrs = fp8_w_scales(w2_s, e64, H, nb, BN, KB)
    acc = zero_acc(ROWS, BN, SWAP)
    xs_n, ws_n = tl.load(as_ptrs), tl.load(ws_ptrs)   # K step 0
    for kb in range(0, KB):
        xs, ws = xs_n, ws_n   # loaded one step ahead (``next_scale_step``)
        kn = next_scale_step(kb, KB)
        xs_n, ws_n = tl.load(as_ptrs + kn), tl.load(ws_ptrs + kn)
        if USE_TMA:
            a = a_desc.load([mb * BM + r0, kb * BK])
            w = w_desc.load([e * H + nb * BN, kb * BK])
        else:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        if not SWAP:
            w = w.T
        if SWAP:
            acc = fp8_swap_step(acc, w, a, xs, ws, BN)
        elif ONE_GROUP:
            acc += tl.dot(a, w) * (xs * ws)[:, None]
        else:
            acc += tl.dot(a, w) * (xs[:, None] * ws[None, :])
        a_ptrs += BK
        w_ptrs += BK
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def l2_fp8_block(mb, nb, e, vm, act_q, act_scale, w2, w2_s, y, H, I,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 OUT_BF16: tl.constexpr, FIX_ROUNDING: tl.constexpr):
    """One L2 block (m_block, n_block): y rows = act @ w2^T with per-K-block scales."""
    acc = l2_fp8_acc(mb, nb, e, act_q, act_scale, w2, w2_s, H, I, I, I // 128, BM, BN, BK)
    store_pool_rows(acc, mb, nb, vm, y, H, BM, BN, OUT_BF16, FIX_ROUNDING)


@triton.jit
def store_pool_rows(acc, mb, nb, vm, y, Y_STRIDE, BM: tl.constexpr, BN: tl.constexpr,
                    OUT_BF16: tl.constexpr, FIX_ROUNDING: tl.constexpr):
    """A standalone L2 block's tile [BM, BN] into y's rows of m_block (row stride Y_STRIDE),
    columns of n_block, as bf16 or fp32; rows past vm are not stored."""
    rows = mb.to(tl.int64) * BM + tl.arange(0, BM)
    n = nb * BN + tl.arange(0, BN)
    rv = tl.arange(0, BM) < vm
    if OUT_BF16:
        out = to_bf16(acc, FIX_ROUNDING)
    else:
        out = acc
    tl.store(y + rows[:, None] * Y_STRIDE + n[None, :], out, mask=rv[:, None])


@triton.jit
def l2_fp8_kernel(act_q, act_scale, w2, w2_s, block_meta, y, H, I,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  OUT_BF16: tl.constexpr, FIX_ROUNDING: tl.constexpr):
    nb = tl.program_id(0)
    mb = tl.program_id(1)
    meta = tl.load(block_meta + mb)
    vm = meta & 511
    if vm > 0:
        l2_fp8_block(mb, nb, meta >> 9, vm, act_q, act_scale, w2, w2_s, y, H, I, BM, BN, BK,
                     OUT_BF16, FIX_ROUNDING)


# ---- decode pieces (Tuning.decode_rows): weights as the MMA row operand ----------------

@triton.jit
def fp8_swap_step(acc, w, a, xs, ws, BN: tl.constexpr):
    """acc [BN, DM] += (w [BN, BK] @ a[DM, BK]^T) * (w scale (x) x scale [DM]): one K step of
    a decode piece, the weight tile as the MMA's row operand (swap AB)."""
    if BN <= 128:   # constexpr
        acc += tl.dot(w, a.T) * (ws * xs)[None, :]
    else:
        acc += tl.dot(w, a.T) * (ws[:, None] * xs[None, :])
    return acc


@triton.jit
def l1_fp8_decode_block(mb, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                        X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        DM: tl.constexpr, a_desc, w_desc, USE_TMA: tl.constexpr,
                        FIX_ROUNDING: tl.constexpr, TAIL: tl.constexpr = False):
    """``l1_fp8_block`` for decode (``Tuning.decode_rows``; pieces as kernels/gemm.py's
    ``l1_decode_block``): [BN, rows] = weights @ rows^T, one piece of DM rows when vm <= DM
    (the weight tile fills the MMA's 64-row side; 16 tokens cost 16 MMA columns, not a
    128-row tile of padding), else pieces of min(32, BM) rows. USE_TMA: ``a_desc`` a pair of
    descriptors of DM-row and 32-row x tiles, ``w_desc`` of BN-row weight tiles over
    [E * 2I, H] (kernels/gemm.py's ``decode_descriptors``).
    TAIL (tail pieces): a fuller block runs as ``l1_fp8_block`` (pointer loads) instead."""
    WIDE: tl.constexpr = 32 if BM >= 32 else BM   # DECODE_WIDE
    HINT: tl.constexpr = not TAIL   # decode pieces, not tail pieces: DECODE_STORE_EVICT
    if vm <= DM:
        l1_fp8_rows(mb, 0, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                    X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE, BM, BN, BK, DM, a_desc[0], w_desc,
                    USE_TMA, FIX_ROUNDING, True, HINT)
    elif TAIL:
        l1_fp8_block(mb, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale, H, I,
                     X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE, BM, BN, BK, FIX_ROUNDING)
    else:
        for r0 in range(0, vm, WIDE):
            l1_fp8_rows(mb, r0, nb, e, vm, x_q, x_scale, w13, w13_s, pool_w, act_q, act_scale,
                        H, I, X_STRIDE, XS_STRIDE, A_STRIDE, AS_STRIDE, BM, BN, BK, WIDE,
                        a_desc[1], w_desc, USE_TMA, FIX_ROUNDING, True, True)
