"""The standalone fp8 grouped GEMMs (moestream/kernels/gemm_fp8.py, launched by moestream.tools.fp8)
against the quantization-aware math in fp64 (moestream.quant's dequantize helpers), on the CPU
interpreter (or a GPU where there is one), and their sm_90 compilation (no GPU needed).

Tolerances (written down here, see docs/quantization.md "FP8 GEMM kernels"):
* L2 and the L1 pre-activation differ from fp64 only by fp32 rounding (the kernel's
  per-128-K-block sums and scaling order): |y - ref| <= 1e-5 * (|a| @ |w|^T) elementwise
  (the bound of a sum's rounding error, robust to cancellation); bf16 output adds 2**-8 |ref|.
* Re-quantized activation: scales equal the reference's to 4e-6 relative (the amax of a row
  group carries the fp32 error of a few operations); each fp8 value equals the reference's or
  is one e4m3 ulp away (a value within fp32 rounding of a rounding midpoint), on < 1 % of the
  elements.
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
from moestream.tools.fp8 import l1_fp8, l2_fp8, pack_block_meta
from moestream.quant import (convert_expert_weights_fp8, dequantize_act_fp8,
                             dequantize_weight_fp8_blocks)

from quant_pool import (block_meta, check_act, check_l2_rows, dq_act, host_pool, make_pool,
                        sum_picks, to_device, ulp_e4m3)

ROOT = Path(__file__).resolve().parents[2]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
F8 = torch.float8_e4m3fn
H, I, E = 256, 256, 3
# (expert, valid rows) per block: partial blocks, a single-row block (T=1-like), an empty
# block, expert 1 owns no block, expert 2's blocks not contiguous in the pool
BLOCKS = [(0, 16), (0, 5), (2, 1), (2, 16), (0, 0), (2, 9)]
BM = 16
NAN8 = 0x7F   # e4m3fn's NaN code: the poison of fp8 outputs
# padding rows hold NaN scales on purpose: the interpreter's row max warns about them
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")





def _weights(gen, bf16=False):
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    if bf16:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    return w13, w2, convert_expert_weights_fp8(w13, w2)



def _l1_reference(xq, xs, w, pool_w, blocks, bm):
    """fp64: (h_gate, h_up, abs-bound of h) and act, rows of valid entries only (else 0)."""
    P = xq.shape[0]
    w13 = dequantize_weight_fp8_blocks(w["w13"], w["w13_scale_inv"], out_dtype=torch.float64)
    act = torch.zeros(P, I, dtype=torch.float64)
    for b, (e, v) in enumerate(blocks):
        rows = slice(b * bm, b * bm + v)
        if v == 0:
            continue
        x = dq_act(xq, xs, rows)
        h = x @ w13[e].T
        g, u = h[:, :I], h[:, I:]
        act[rows] = g * torch.sigmoid(g) * u * pool_w[rows].double()[:, None]
    return act



# ---- L1 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_n", [128, 256])
def test_l1_matches_quantized_reference(gen, block_n):
    xq, xs, valid = make_pool(gen, BLOCKS, BM, H)
    _, _, w = _weights(gen)
    P = xq.shape[0]
    pool_w = torch.rand(P, generator=gen) + 0.1
    pool_w[~valid] = float("nan")
    meta = block_meta(BLOCKS)
    act_q = torch.full((P, I), NAN8, dtype=torch.uint8).view(F8)
    act_s = torch.full((P, I // 128), float("nan"))
    args = to_device(DEV, xq, xs, meta, w["w13"], w["w13_scale_inv"], pool_w, act_q, act_s)
    out_q, out_s = l1_fp8(pool_x_q=args[0], pool_x_scale=args[1], block_meta=args[2],
                          w13_q=args[3], w13_scale_inv=args[4], pool_weight=args[5],
                          act_q=args[6], act_scale=args[7], block_m=BM, block_n=block_n)
    assert out_q.data_ptr() == args[6].data_ptr() and out_s.data_ptr() == args[7].data_ptr()
    out_q, out_s = out_q.cpu(), out_s.cpu()
    # padding rows (and the empty block) untouched, every valid row written
    assert bool((out_q[~valid].view(torch.uint8) == NAN8).all())
    assert bool(out_s[~valid].isnan().all())
    assert not bool((out_q[valid].view(torch.uint8) & 0x7F == 0x7F).any())
    assert bool(torch.isfinite(out_s[valid]).all())

    act = _l1_reference(xq, xs, w, pool_w, BLOCKS, BM)
    check_act(out_q, out_s, act, valid)
    # and the dequantized activation is the fp64 one to within one e4m3 ulp of each value
    got_q, got_s = out_q[valid], out_s[valid]
    deq = dequantize_act_fp8(got_q, got_s, out_dtype=torch.float64)
    s_full = got_s.double().repeat_interleave(128, dim=1)
    assert bool(((deq - act[valid]).abs() <= ulp_e4m3(got_q.float()).double() * s_full).all())


def test_l1_all_zero_rows(gen):
    """An all-zero activation row (zero input, or zero topk weight) gets scale 2**-126 and
    q = 0, as quant.quantize_act_fp8; an expert (2) with no block."""
    blocks = [(0, 16), (1, 3)]
    xq, xs, valid = make_pool(gen, blocks, BM, H)
    xq[:4] = torch.zeros(4, H, dtype=F8)     # rows 0..3: zero input -> zero activation
    _, _, w = _weights(gen)
    P = xq.shape[0]
    pool_w = torch.rand(P, generator=gen)
    pool_w[4] = 0.0                           # row 4: zero topk weight
    meta = pack_block_meta([0, 1], [16, 3])
    args = to_device(DEV, xq, xs, meta, w["w13"], w["w13_scale_inv"], pool_w)
    q, s = l1_fp8(pool_x_q=args[0], pool_x_scale=args[1], block_meta=args[2], w13_q=args[3],
                  w13_scale_inv=args[4], pool_weight=args[5], block_m=BM)
    q, s = q.cpu(), s.cpu()
    assert bool((s[:5] == 2.0 ** -126).all())
    assert bool((q[:5].float() == 0).all())
    check_act(q, s, _l1_reference(xq, xs, w, pool_w, blocks, BM), valid)


# ---- L2 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype,block_n", [(torch.float32, 128), (torch.bfloat16, 64),
                                               (torch.float32, 256)])
def test_l2_matches_quantized_reference(gen, out_dtype, block_n):
    aq, as_, valid = make_pool(gen, BLOCKS, BM, I, scale=0.3)
    _, _, w = _weights(gen)
    P = aq.shape[0]
    meta = block_meta(BLOCKS)
    y = torch.full((P, H), float("nan"), dtype=out_dtype)
    args = to_device(DEV, aq, as_, meta, w["w2"], w["w2_scale_inv"], y)
    out = l2_fp8(act_q=args[0], act_scale=args[1], block_meta=args[2], w2_q=args[3],
                 w2_scale_inv=args[4], y=args[5], block_m=BM, block_n=block_n)
    assert out.data_ptr() == args[5].data_ptr()
    out = out.cpu()
    assert bool(out[~valid].isnan().all())
    assert bool(torch.isfinite(out[valid]).all())
    w2 = dequantize_weight_fp8_blocks(w["w2"], w["w2_scale_inv"], out_dtype=torch.float64)
    check_l2_rows(out, aq, as_, w2, BLOCKS, BM, out_dtype)


# ---- L1 + L2 against the layer reference ----------------------------------------------------

def test_l1_l2_against_moe_forward_fp8(gen):
    """Tokens routed to experts, the pool built on the host, both kernels, the picks summed:
    the layer's quantization-aware reference (topk weight after L2) agrees to fp32 rounding
    plus rare one-ulp re-quantization flips (the kernel applies the weight before them)."""
    from moestream.reference import moe_forward
    from moestream.testing import make_routing, make_tokens
    T, K, bm = 9, 2, 16
    x = make_tokens(T, H, generator=gen)
    idx, tw = make_routing(T, E, K, generator=gen)
    w13, w2, w = _weights(gen, bf16=True)
    pq, ps, pw, blocks, src = host_pool(x, idx, tw, E, bm)
    a = to_device(DEV, pq, ps, block_meta(blocks), w["w13"], w["w13_scale_inv"], pw, w["w2"],
                  w["w2_scale_inv"])
    aq, asc = l1_fp8(pool_x_q=a[0], pool_x_scale=a[1], block_meta=a[2], w13_q=a[3],
                     w13_scale_inv=a[4], pool_weight=a[5], block_m=bm)
    yr = l2_fp8(act_q=aq, act_scale=asc, block_meta=a[2], w2_q=a[6], w2_scale_inv=a[7],
                block_m=bm, out_dtype=torch.float32).cpu().double()
    y = sum_picks(yr, src, T)
    ref = moe_forward(x, idx, tw, w13, w2, compute_dtype=torch.float64,
                      out_dtype=torch.float64, quant="fp8")
    rel = float((y - ref).norm() / ref.norm())
    assert rel < 2e-3, rel


# ---- validation -----------------------------------------------------------------------------

def _l1_kwargs(**over):
    P = 2 * BM
    kw = dict(pool_x_q=torch.zeros(P, H, dtype=F8), pool_x_scale=torch.ones(P, H // 128),
              block_meta=pack_block_meta([0, 1], [BM, 1]),
              w13_q=torch.zeros(E, 2 * I, H, dtype=F8),
              w13_scale_inv=torch.ones(E, 2 * I // 128, H // 128), pool_weight=torch.ones(P),
              block_m=BM)
    kw.update(over)
    return kw


def _l2_kwargs(**over):
    P = 2 * BM
    kw = dict(act_q=torch.zeros(P, I, dtype=F8), act_scale=torch.ones(P, I // 128),
              block_meta=pack_block_meta([0, 1], [BM, 1]), w2_q=torch.zeros(E, H, I, dtype=F8),
              w2_scale_inv=torch.ones(E, H // 128, I // 128), block_m=BM)
    kw.update(over)
    return kw


P2 = 2 * BM


@pytest.mark.parametrize("over,match", [
    (dict(pool_x_q=torch.zeros(P2, H, dtype=torch.bfloat16)), "dtype"),
    (dict(pool_x_q=[[0.0]]), "torch.Tensor"),
    (dict(pool_x_scale=torch.ones(P2, H // 128 + 1)), "shape"),
    (dict(pool_x_scale=torch.ones(P2, H // 128, dtype=torch.float64)), "dtype"),
    (dict(w13_scale_inv=torch.ones(E, 2 * I // 128, H // 128 + 1)), "shape"),
    (dict(w13_q=torch.zeros(E, 2 * I, H + 128, dtype=F8)), "shape"),
    (dict(pool_x_q=torch.zeros(P2, 200, dtype=F8), pool_x_scale=torch.ones(P2, 2),
          w13_q=torch.zeros(E, 2 * I, 200, dtype=F8)), "multiples of 128"),
    (dict(pool_weight=torch.ones(P2 + 1)), "shape"),
    (dict(pool_weight=torch.ones(P2, dtype=torch.bfloat16)), "dtype"),
    (dict(block_m=24), "power of two"),
    (dict(block_m=8), "power of two"),
    (dict(block_n=64), "block_n"),
    (dict(block_meta=pack_block_meta([0], [BM])), "shape"),
    (dict(block_meta=pack_block_meta([0, 3], [BM, 1])), "block_meta"),
    (dict(block_meta=pack_block_meta([0, 1], [BM + 1, 1])), "block_meta"),
    (dict(block_meta=pack_block_meta([0, 1], [BM, 1]).long()), "dtype"),
    (dict(pool_x_q=torch.zeros(H, P2, dtype=F8).T), "contiguous"),
    (dict(act_q=torch.zeros(P2, I, dtype=torch.bfloat16)), "dtype"),
    (dict(act_scale=torch.ones(P2, I // 128 + 1)), "shape"),
])
def test_l1_rejects_bad_inputs(over, match):
    with pytest.raises(ValueError, match=match):
        l1_fp8(**_l1_kwargs(**over))


@pytest.mark.parametrize("over,match", [
    (dict(act_q=torch.zeros(P2, I, dtype=torch.float32)), "dtype"),
    (dict(act_scale=torch.ones(P2, I // 128 + 1)), "shape"),
    (dict(w2_q=torch.zeros(E, H, I + 128, dtype=F8)), "shape"),
    (dict(w2_scale_inv=torch.ones(E, H // 128, I // 128 + 1)), "shape"),
    (dict(block_m=48), "power of two"),
    (dict(block_n=96), "power of two"),
    (dict(block_meta=pack_block_meta([0, 1], [BM, 1]).float()), "dtype"),
    (dict(block_meta=pack_block_meta([5, 1], [BM, 1])), "block_meta"),
    (dict(y=torch.zeros(P2, H, dtype=torch.float16)), "y must be"),
    (dict(y=torch.zeros(P2, H + 1)), "shape"),
    (dict(out_dtype=torch.float16), "out_dtype"),
])
def test_l2_rejects_bad_inputs(over, match):
    with pytest.raises(ValueError, match=match):
        l2_fp8(**_l2_kwargs(**over))


def test_pack_block_meta_rejects_bad_values():
    with pytest.raises(ValueError):
        pack_block_meta([0, 1], [1])
    with pytest.raises(ValueError):
        pack_block_meta([0], [512])
    with pytest.raises(ValueError):
        pack_block_meta([-1], [3])
    assert pack_block_meta([2, 0], [5, 16]).tolist() == [2 * 512 + 5, 16]


# ---- sm_90 compilation (no GPU) -------------------------------------------------------------

@pytest.mark.parametrize("block_m,warps,stages", [(128, 8, 3), (64, 8, 4)])
def test_compiles_for_sm90_with_fp8_warpgroup_mma(block_m, warps, stages):
    """dsv3 dims (H=7168, I=2048), BN=BK=128, compiled for sm_90a in a fresh process (Triton
    in compiler mode): fp8 warpgroup MMAs (SASS QGMMA ... E4M3.E4M3), no bf16/fp16 MMAs, shared
    memory within an H100/H200 block, L2 without spills. L1 holds two fp32 accumulators plus
    the two fresh per-K-block dot results: at BM=128 it reaches 255 registers and spills a
    few bytes (stack 32 seen, Triton 3.6); at BM=64 with 8 warps it does not spill."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "moestream.tools.aot", "--fp8", "--json",
                          "--block-m", str(block_m), "--block-n", "128", "--warps", str(warps),
                          "--stages", str(stages)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = {r["name"]: r for r in map(json.loads, filter(lambda s: s.startswith("{"),
                                                         res.stdout.splitlines()))}
    assert set(rows) == {"l1_fp8_kernel", "l2_fp8_kernel"}
    for name, r in rows.items():
        print(f"{name} BM={block_m} {warps}w{stages}s: smem {r['shared_bytes']} regs "
              f"{r['registers']} stack {r['stack_bytes']} QGMMA {r['qgmma']} "
              f"({time.time() - t0:.1f} s)")
        assert r["num_warps"] == warps and r["num_stages"] == stages, r
        assert r["qgmma"] > 0 and r["e4m3_gmma"] == r["qgmma"], r
        assert r["hgmma"] == 0 and r["hmma"] == 0, r
        assert r["shared_bytes"] <= SM90_SHARED_LIMIT, r
    assert rows["l2_fp8_kernel"]["stack_bytes"] == 0, rows["l2_fp8_kernel"]
    if block_m == 64:
        assert rows["l1_fp8_kernel"]["stack_bytes"] == 0, rows["l1_fp8_kernel"]
