"""The standalone MXFP4-weight ("fp4w") grouped GEMMs (moestream/kernels/gemm_fp4.py, launched by
moestream.tools.fp4) against the quantization-aware math in fp64 (moestream.quant's dequantize
helpers), on the CPU interpreter (or a GPU where there is one), and their sm_90 compilation (no GPU needed).

Tolerances (written down here, see docs/quantization.md "MXFP4 GEMM kernels (standalone)"):
* decode: every packed byte's two e2m1 codes -> e4m3 bytes of 2**-6 x their values, bit-exact
  (the Triton form, and on a GPU the PTX form); E8M0 code c -> 2**(c - 126) exact for c <= 253.
* L2 and the L1 pre-activation differ from fp64 only by fp32 rounding (each k=32 dot's sum,
  its scaling, the accumulation): |y - ref| <= 1e-5 * (|a| @ |w|^T) elementwise, as the fp8
  kernels; bf16 output adds 2**-8 |ref|.
* Re-quantized activation: scales equal the reference's to 4e-6 relative; each fp8 value equals
  the reference's or is one e4m3 ulp away, on < 1 % of the elements.
* L1 + L2 + sum over picks vs moe_forward(..., quant="fp4w") in fp64: 2e-3 norm-relative.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moestream.tools.aot import SM90_SHARED_LIMIT
from moestream.tools.fp4 import l1_fp4w, l2_fp4w, pack_block_meta
from moestream.kernels.common import tl, triton
from moestream.kernels.gemm_fp4 import MAX_E8M0, e8m0_twice, place_e2m1_pairs
from moestream.quant import (
    E2M1_VALUES,
    convert_expert_weights_mxfp4,
    dequantize_weight_mxfp4,
)

from quant_pool import (block_meta, check_act, check_l2_rows, dq_act, host_pool, make_pool,
                        sum_picks, to_device)

ROOT = Path(__file__).resolve().parents[2]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
F8 = torch.float8_e4m3fn
U8 = torch.uint8
H, I, E = 256, 256, 3
BM = 16
# (expert, valid rows) per block: a full block, partial blocks, a single-row block (T=1-like),
# an empty block (valid_m = 0), expert 1 owns no block, expert 2's blocks not contiguous
BLOCKS = [(0, 16), (0, 5), (2, 1), (2, 16), (0, 0), (2, 9)]
NAN8 = 0x7F   # e4m3fn's NaN code: the poison of fp8 outputs
# padding rows hold garbage and NaN scales on purpose (they must not leak into valid rows), and
# the interpreter's numpy warns about what it computes from them (row max, exp, products)
pytestmark = [pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]






def _spread_exponents(w: torch.Tensor, gen) -> torch.Tensor:
    """Multiply each 32-element K block by 2**r, r in [-24, 12]: a row's four MXFP4 exponents in
    one 128-K step then span up to 36 binades (more than e4m3 could hold if the scale were
    folded into the decoded values), and some blocks are all zero (E8M0 code 0)."""
    *lead, K = w.shape
    r = torch.randint(-24, 13, (*lead, K // 32, 1), generator=gen).float()
    r[torch.rand(r.shape, generator=gen) < 0.05] = float("-inf")      # all-zero blocks
    return (w.reshape(*lead, K // 32, 32) * torch.exp2(r)).reshape(w.shape)


def _weights(gen, bf16=False, spread=False, i_dim=I):
    w13 = torch.randn(E, 2 * i_dim, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, i_dim, generator=gen) / i_dim ** 0.5
    if spread:
        w13, w2 = _spread_exponents(w13, gen), _spread_exponents(w2, gen)
    if bf16:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    return w13, w2, convert_expert_weights_mxfp4(w13, w2)



def _l1_reference(xq, xs, w, pool_w, blocks, bm):
    """fp64 act = silu(x @ gate^T) * (x @ up^T) * weight on valid rows (else 0)."""
    w13 = dequantize_weight_mxfp4(w["w13"], w["w13_scale"], out_dtype=torch.float64)
    i_dim = w13.shape[1] // 2
    act = torch.zeros(xq.shape[0], i_dim, dtype=torch.float64)
    for b, (e, v) in enumerate(blocks):
        if v == 0:
            continue
        rows = slice(b * bm, b * bm + v)
        h = dq_act(xq, xs, rows) @ w13[e].T
        g, u = h[:, :i_dim], h[:, i_dim:]
        act[rows] = g * torch.sigmoid(g) * u * pool_w[rows].double()[:, None]
    return act




# ---- decode ---------------------------------------------------------------------------------

@triton.jit
def _decode_kernel(packed, out_lo, out_hi, e8m0, out_scale, ASM: tl.constexpr):
    o = tl.arange(0, 256)
    p = tl.load(packed + o)
    lo, hi = place_e2m1_pairs(p, ASM)   # ASM: the PTX form (GPU only)
    tl.store(out_lo + o, lo)
    tl.store(out_hi + o, hi)
    words = tl.load(e8m0 + tl.arange(0, 64))
    for j in tl.static_range(4):
        tl.store(out_scale + tl.arange(0, 64) * 4 + j, e8m0_twice(words, j))


@pytest.mark.parametrize("asm", [
    False,
    pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
        DEV != "cuda", reason="PTX inline assembly needs a GPU (the interpreter has none)")]),
])
def test_decode_e2m1_and_e8m0_exact(asm):
    """Every byte (two e2m1 codes, sign << 3 | index, low nibble first) becomes two e4m3 bytes
    holding 2**-6 x the codes' values, bit for bit (-0 for code 8; 0.5 * 2**-6 is e4m3's
    subnormal 2**-7). Every E8M0 code c <= MAX_E8M0 becomes 2 * 2**(c - 127) exactly, read from
    little-endian uint32 words of four codes as the GEMMs read them."""
    packed = torch.arange(256, dtype=torch.int32).to(U8)
    codes = torch.arange(256, dtype=torch.int32).to(U8)
    lo = torch.full((256,), NAN8, dtype=U8).view(F8)
    hi = torch.full((256,), NAN8, dtype=U8).view(F8)
    scale = torch.full((256,), -1.0)
    args = to_device(DEV, packed, lo, hi, codes.view(torch.int32), scale)
    _decode_kernel[(1,)](*args, ASM=asm)
    lo, hi, scale = args[1].cpu(), args[2].cpu(), args[4].cpu()
    value = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)
    for got, nibble in ((lo, packed.long() & 15), (hi, packed.long() >> 4)):
        want = value[nibble] * 2.0 ** -6
        assert torch.equal(got.double(), want)
        assert torch.equal(got.view(U8), want.to(F8).view(U8))       # bytes, -0 included
    c = torch.arange(MAX_E8M0 + 1)
    assert torch.equal(scale[:MAX_E8M0 + 1].double(), torch.ldexp(torch.ones(len(c)).double(),
                                                                  c - 126.0))


# ---- L1 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_n", [128, 256])
def test_l1_matches_quantized_reference(gen, block_n):
    xq, xs, valid = make_pool(gen, BLOCKS, BM, H)
    _, _, w = _weights(gen)
    P = xq.shape[0]
    pool_w = torch.rand(P, generator=gen) + 0.1
    pool_w[~valid] = float("nan")
    act_q = torch.full((P, I), NAN8, dtype=U8).view(F8)              # poison
    act_s = torch.full((P, I // 128), float("nan"))
    args = to_device(DEV, xq, xs, block_meta(BLOCKS), w["w13"], w["w13_scale"], pool_w, act_q,
                     act_s)
    out_q, out_s = l1_fp4w(pool_x_q=args[0], pool_x_scale=args[1], block_meta=args[2],
                           w13_packed=args[3], w13_scale=args[4], pool_weight=args[5],
                           act_q=args[6], act_scale=args[7], block_m=BM, block_n=block_n)
    assert out_q.data_ptr() == args[6].data_ptr() and out_s.data_ptr() == args[7].data_ptr()
    out_q, out_s = out_q.cpu(), out_s.cpu()
    # padding rows (and the empty block) untouched, every valid element written
    assert bool((out_q[~valid].view(U8) == NAN8).all())
    assert bool(out_s[~valid].isnan().all())
    assert not bool((out_q[valid].view(U8) & 0x7F == 0x7F).any())
    assert bool(torch.isfinite(out_s[valid]).all())
    act = _l1_reference(xq, xs, w, pool_w, BLOCKS, BM)
    check_act(out_q, out_s, act, valid)


def test_l1_zero_rows_and_spread_exponents(gen):
    """All-zero activation rows (zero input, zero topk weight) get scale 2**-126 and q = 0;
    weights whose 32-blocks have exponents 36 binades apart and all-zero blocks (E8M0 code 0)
    stay exact (the per-k=32 scaling); expert 2 has no block; I = 128 (one scale group)."""
    blocks = [(0, 16), (1, 3)]
    xq, xs, valid = make_pool(gen, blocks, BM, H)
    xq[:4] = torch.zeros(4, H, dtype=F8)           # rows 0..3: zero input -> zero activation
    _, _, w = _weights(gen, spread=True, i_dim=128)
    assert bool((w["w13_scale"] == 0).any())
    P = xq.shape[0]
    pool_w = torch.rand(P, generator=gen)
    pool_w[4] = 0.0                                  # row 4: zero topk weight
    args = to_device(DEV, xq, xs, block_meta(blocks), w["w13"], w["w13_scale"], pool_w)
    q, s = l1_fp4w(pool_x_q=args[0], pool_x_scale=args[1], block_meta=args[2],
                   w13_packed=args[3], w13_scale=args[4], pool_weight=args[5], block_m=BM)
    q, s = q.cpu(), s.cpu()
    assert bool((s[:5] == 2.0 ** -126).all())
    assert bool((q[:5].float() == 0).all())
    check_act(q, s, _l1_reference(xq, xs, w, pool_w, blocks, BM), valid)


# ---- L2 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype,block_n,spread", [
    (torch.float32, 128, False),
    (torch.bfloat16, 64, False),     # bf16 output, BN smaller than an activation group
    (torch.float32, 256, True),      # exponents 36 binades apart + all-zero blocks in a step
])
def test_l2_matches_quantized_reference(gen, out_dtype, block_n, spread):
    aq, as_, valid = make_pool(gen, BLOCKS, BM, I, scale=0.3)
    _, _, w = _weights(gen, spread=spread)
    P = aq.shape[0]
    y = torch.full((P, H), float("nan"), dtype=out_dtype)           # poison
    args = to_device(DEV, aq, as_, block_meta(BLOCKS), w["w2"], w["w2_scale"], y)
    out = l2_fp4w(act_q=args[0], act_scale=args[1], block_meta=args[2], w2_packed=args[3],
                  w2_scale=args[4], y=args[5], block_m=BM, block_n=block_n)
    assert out.data_ptr() == args[5].data_ptr()
    out = out.cpu()
    assert bool(out[~valid].isnan().all())
    assert bool(torch.isfinite(out[valid]).all())
    w2 = dequantize_weight_mxfp4(w["w2"], w["w2_scale"], out_dtype=torch.float64)
    check_l2_rows(out, aq, as_, w2, BLOCKS, BM, out_dtype)


# ---- packed byte rows (the layer's layout) --------------------------------------------------

def _byte_rows(q, s):
    """Values and fp32 scales of each row in one uint8 row: bytes [0, K) and [K, K + 4*K/128),
    returned as the two strided views (and the buffer)."""
    P, K = q.shape
    buf = torch.zeros(P, K + 4 * (K // 128), dtype=U8, device=q.device)
    buf[:, :K] = q.view(U8)
    buf[:, K:] = s.contiguous().view(U8)
    return buf, buf[:, :K].view(F8), buf[:, K:].view(torch.float32)


def test_packed_byte_rows_match_separate_tensors(gen):
    """L1 reads x from packed byte rows and writes act into packed byte rows; L2 reads them:
    the bytes equal those of the separate-tensor launches (the kernels only see strides)."""
    blocks = [(1, 16), (0, 7), (2, 0)]
    xq, xs, valid = make_pool(gen, blocks, BM, H)
    _, _, w = _weights(gen)
    pool_w = torch.rand(xq.shape[0], generator=gen)
    xq, xs, meta, w13, w13s, w2, w2s, pool_w = to_device(
        DEV, xq, xs, block_meta(blocks), w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], pool_w)
    kw1 = dict(block_meta=meta, w13_packed=w13, w13_scale=w13s, pool_weight=pool_w, block_m=BM)
    ref_q, ref_s = l1_fp4w(pool_x_q=xq, pool_x_scale=xs, **kw1)
    _, xq_v, xs_v = _byte_rows(xq, xs)
    _, aq_v, as_v = _byte_rows(torch.zeros_like(ref_q), torch.zeros_like(ref_s))
    l1_fp4w(pool_x_q=xq_v, pool_x_scale=xs_v, act_q=aq_v, act_scale=as_v, **kw1)
    valid = valid.to(DEV)
    assert torch.equal(aq_v[valid].view(U8), ref_q[valid].view(U8))
    assert torch.equal(as_v[valid], ref_s[valid])
    kw2 = dict(block_meta=meta, w2_packed=w2, w2_scale=w2s, block_m=BM, out_dtype=torch.float32)
    ref_y = l2_fp4w(act_q=ref_q, act_scale=ref_s, **kw2)
    ybuf = torch.full((xq.shape[0], H + 64), float("nan"), device=DEV)   # y rows strided too
    l2_fp4w(act_q=aq_v, act_scale=as_v, y=ybuf[:, :H], **kw2)
    assert torch.equal(ybuf[valid, :H], ref_y[valid])
    assert bool(ybuf[:, H:].isnan().all())


# ---- L1 + L2 against the layer reference ----------------------------------------------------

def test_l1_l2_against_moe_forward_fp4w(gen):
    """Tokens routed to experts, the pool built on the host, both kernels, the picks summed:
    the layer's quantization-aware reference (moe_forward(..., quant="fp4w"), which quantizes
    the same bf16 weights with the same MXFP4 rounding; topk weight after L2) agrees to fp32
    rounding plus rare one-ulp re-quantization flips (the kernel applies the weight first)."""
    from moestream.reference import moe_forward
    from moestream.testing import make_routing, make_tokens
    T, K, bm = 9, 2, 16
    x = make_tokens(T, H, generator=gen)
    idx, tw = make_routing(T, E, K, generator=gen)
    w13, w2, w = _weights(gen, bf16=True)
    pq, ps, pw, blocks, src = host_pool(x, idx, tw, E, bm)
    a = to_device(DEV, pq, ps, block_meta(blocks), w["w13"], w["w13_scale"], pw, w["w2"],
                  w["w2_scale"])
    aq, asc = l1_fp4w(pool_x_q=a[0], pool_x_scale=a[1], block_meta=a[2], w13_packed=a[3],
                      w13_scale=a[4], pool_weight=a[5], block_m=bm)
    yr = l2_fp4w(act_q=aq, act_scale=asc, block_meta=a[2], w2_packed=a[6], w2_scale=a[7],
                 block_m=bm, out_dtype=torch.float32).cpu().double()
    y = sum_picks(yr, src, T)
    ref = moe_forward(x, idx, tw, w13, w2, compute_dtype=torch.float64,
                      out_dtype=torch.float64, quant="fp4w")
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 2e-3, rel


# ---- validation -----------------------------------------------------------------------------

P2 = 2 * BM


def _l1_kwargs(**over):
    kw = dict(pool_x_q=torch.zeros(P2, H, dtype=F8), pool_x_scale=torch.ones(P2, H // 128),
              block_meta=pack_block_meta([0, 1], [BM, 1]),
              w13_packed=torch.zeros(E, 2 * I, H // 2, dtype=U8),
              w13_scale=torch.full((E, 2 * I, H // 32), 127, dtype=U8),
              pool_weight=torch.ones(P2), block_m=BM)
    kw.update(over)
    return kw


def _l2_kwargs(**over):
    kw = dict(act_q=torch.zeros(P2, I, dtype=F8), act_scale=torch.ones(P2, I // 128),
              block_meta=pack_block_meta([0, 1], [BM, 1]),
              w2_packed=torch.zeros(E, H, I // 2, dtype=U8),
              w2_scale=torch.full((E, H, I // 32), 127, dtype=U8), block_m=BM)
    kw.update(over)
    return kw


def _misaligned(shape):
    """A contiguous uint8 tensor starting at an odd address."""
    n = 1
    for d in shape:
        n *= d
    return torch.zeros(n + 1, dtype=U8)[1:].view(shape)


@pytest.mark.parametrize("over,match", [
    (dict(pool_x_q=torch.zeros(P2, H, dtype=torch.bfloat16)), "dtype"),
    (dict(pool_x_q=[[0.0]]), "torch.Tensor"),
    (dict(pool_x_scale=torch.ones(P2, H // 128 + 1)), "shape"),
    (dict(pool_x_scale=torch.ones(P2, H // 128, dtype=torch.float64)), "dtype"),
    (dict(pool_x_q=torch.zeros(H, P2, dtype=F8).T), "contiguous last dimension"),
    (dict(pool_x_q=torch.zeros(1, H, dtype=F8).expand(P2, H)), "overlap"),
    (dict(w13_packed=torch.zeros(E, 2 * I, H, dtype=U8)), "H/2"),
    (dict(w13_packed=torch.zeros(E, 2 * I, H // 2, dtype=F8)), "dtype"),
    (dict(w13_packed=torch.zeros(E, H // 2, 2 * I, dtype=U8).transpose(1, 2)), "contiguous"),
    (dict(w13_scale=torch.ones(E, 2 * I, H // 128, dtype=U8)), "shape"),
    (dict(w13_scale=torch.ones(E, 2 * I, H // 32)), "dtype"),
    (dict(w13_scale=_misaligned((E, 2 * I, H // 32))), "aligned"),
    (dict(pool_x_q=torch.zeros(P2, 160, dtype=F8), pool_x_scale=torch.ones(P2, 2),
          w13_packed=torch.zeros(E, 2 * I, 80, dtype=U8),
          w13_scale=torch.ones(E, 2 * I, 5, dtype=U8)), "multiples of 128"),
    (dict(w13_packed=torch.zeros(E, 2 * 160, H // 2, dtype=U8),
          w13_scale=torch.ones(E, 2 * 160, H // 32, dtype=U8)), "multiples of 128"),
    (dict(pool_weight=torch.ones(P2 + 1)), "shape"),
    (dict(pool_weight=torch.ones(P2, dtype=torch.bfloat16)), "dtype"),
    (dict(block_m=24), "power of two"),
    (dict(block_m=8), "power of two"),
    (dict(block_n=64), "block_n"),
    (dict(block_meta=pack_block_meta([0], [BM])), "shape"),
    (dict(block_meta=pack_block_meta([0, 3], [BM, 1])), "block_meta"),
    (dict(block_meta=pack_block_meta([0, 1], [BM + 1, 1])), "block_meta"),
    (dict(block_meta=pack_block_meta([0, 1], [BM, 1]).long()), "dtype"),
    (dict(act_q=torch.zeros(P2, I, dtype=torch.bfloat16)), "dtype"),
    (dict(act_scale=torch.ones(P2, I // 128 + 1)), "shape"),
    (dict(w13_scale=torch.full((E, 2 * I, H // 32), 254, dtype=U8)), "E8M0 codes above 253"),
])
def test_l1_rejects_bad_inputs(over, match):
    with pytest.raises(ValueError, match=match):
        l1_fp4w(**_l1_kwargs(**over))


@pytest.mark.parametrize("over,match", [
    (dict(act_q=torch.zeros(P2, I, dtype=torch.float32)), "dtype"),
    (dict(act_scale=torch.ones(P2, I // 128 + 1)), "shape"),
    (dict(act_q=torch.zeros(I, P2, dtype=F8).T), "contiguous last dimension"),
    (dict(w2_packed=torch.zeros(E, H, I, dtype=U8)), "I/2"),
    (dict(w2_scale=torch.ones(E, H, I // 32 + 1, dtype=U8)), "shape"),
    (dict(w2_scale=_misaligned((E, H, I // 32))), "aligned"),
    (dict(w2_packed=torch.zeros(E, 96, I // 2, dtype=U8),
          w2_scale=torch.ones(E, 96, I // 32, dtype=U8)), "multiples of 128"),
    (dict(block_m=48), "power of two"),
    (dict(block_n=96), "power of two"),
    (dict(block_n=512), "power of two"),
    (dict(block_meta=pack_block_meta([0, 1], [BM, 1]).float()), "dtype"),
    (dict(block_meta=pack_block_meta([5, 1], [BM, 1])), "block_meta"),
    (dict(y=torch.zeros(P2, H, dtype=torch.float16)), "y must be"),
    (dict(y=torch.zeros(P2, H + 1)), "shape"),
    (dict(out_dtype=torch.float16), "out_dtype"),
    (dict(w2_scale=torch.full((E, H, I // 32), 255, dtype=U8)), "E8M0 codes above 253"),
])
def test_l2_rejects_bad_inputs(over, match):
    with pytest.raises(ValueError, match=match):
        l2_fp4w(**_l2_kwargs(**over))


# ---- sm_90 compilation (no GPU) -------------------------------------------------------------

_COMPILE = """
import json, sys
from moestream.tools.aot import compile_quant_gemms
for bm, warps, stages in json.loads(sys.argv[1]):
    for r in compile_quant_gemms(fmt="fp4w", block_m=bm, block_n=128, num_warps=warps,
                                 num_stages=stages):
        print(json.dumps(dict(r, block_m=bm)))
"""


def test_compiles_for_sm90_with_fp8_warpgroup_mma():
    """dsv3 dims (H=7168, I=2048), BN=128, BK=128 (4 x k=32 dots), compiled for sm_90a in a
    fresh process (Triton in compiler mode, as test_sm90_compile.py): the decoded weights feed
    fp8 warpgroup MMAs (SASS QGMMA ... E4M3.E4M3) at BM >= 64 and warp MMAs on fp16 (the e4m3
    values widened, exactly) at BM = 16, no bf16/fp16 warpgroup MMAs, shared memory within an
    H100/H200 block, L2 at BM=64 and both GEMMs at BM=16 without spills. L1 (two
    accumulators, decode of two weight tiles) spills at BM 64 and 128 (figures printed, see
    docs/quantization.md)."""
    configs = [(128, 8, 3), (64, 8, 4), (16, 4, 3)]   # BM=16: the decode-sized block
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    t0 = time.time()
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(configs)], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")]
    assert sorted((r["name"], r["block_m"]) for r in rows) == sorted(
        (n, bm) for n in ("l1_fp4w_kernel", "l2_fp4w_kernel") for bm, _, _ in configs)
    by = {(r["name"], r["block_m"]): r for r in rows}
    for (name, bm), r in sorted(by.items()):
        print(f"{name} BM={bm} {r['num_warps']}w{r['num_stages']}s: smem {r['shared_bytes']} "
              f"regs {r['registers']} stack {r['stack_bytes']} QGMMA {r['qgmma']} "
              f"HMMA {r['hmma']} ({time.time() - t0:.1f} s)")
        assert r["hgmma"] == 0, r
        if bm >= 64:   # warpgroup fp8 MMAs on the decoded tiles
            assert r["qgmma"] > 0 and r["e4m3_gmma"] == r["qgmma"] and r["hmma"] == 0, r
        else:   # M = 16 is below a warpgroup MMA: Triton 3.6 widens e4m3 to fp16 (exact) for
            assert r["hmma"] > 0 and r["qgmma"] == 0, r   # warp MMAs (HMMA.16816.F32)
        assert r["shared_bytes"] <= SM90_SHARED_LIMIT, r
    assert by[("l2_fp4w_kernel", 64)]["stack_bytes"] == 0, by[("l2_fp4w_kernel", 64)]
    for name in ("l1_fp4w_kernel", "l2_fp4w_kernel"):   # the decode-sized blocks spill nowhere
        assert by[(name, 16)]["stack_bytes"] == 0, by[(name, 16)]


def test_compile_quant_gemms_names_the_formats():
    from moestream.tools.aot import compile_quant_gemms
    with pytest.raises(ValueError, match="fmt must be 'fp8' or 'fp4w'"):
        compile_quant_gemms(fmt="fp4")
