"""What the standalone fp8 and MXFP4-weight GEMM tests share (tests/kernels/test_gemm_fp8.py,
tests/kernels/test_gemm_fp4.py): a pool of fp8 rows with garbage padding, the block table, and the
checks of a re-quantized activation and of L2 rows against fp64 (their tolerances are written
down in those files' docstrings)."""
from __future__ import annotations

import torch

from moestream.tools.fp8 import pack_block_meta
from moestream.quant import dequantize_act_fp8, quantize_act_fp8

F8 = torch.float8_e4m3fn


def ulp_e4m3(v: torch.Tensor) -> torch.Tensor:
    """One e4m3 ulp at each value's binade (subnormal spacing 2**-9 below 2**-6)."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -9))).clamp_min(-6)
    return torch.exp2(e - 3)


def valid_mask(blocks, bm: int) -> torch.Tensor:
    """bool [len(blocks) * bm]: the valid rows of (expert, valid rows) blocks."""
    m = torch.zeros(len(blocks) * bm, dtype=torch.bool)
    for b, (_, v) in enumerate(blocks):
        m[b * bm: b * bm + v] = True
    return m


def block_meta(blocks) -> torch.Tensor:
    return pack_block_meta([e for e, _ in blocks], [v for _, v in blocks])


def make_pool(gen, blocks, bm: int, k_dim: int, scale: float = 1.0):
    """fp8 rows [P, k_dim] + scales; valid rows quantized from randn, padding rows garbage
    (random bytes, NaN scales): they must not leak into valid rows. Returns (q, s, valid)."""
    P = len(blocks) * bm
    q, s = quantize_act_fp8(torch.randn(P, k_dim, generator=gen) * scale)
    valid = valid_mask(blocks, bm)
    junk = torch.randint(0, 0x7F, (P, k_dim), generator=gen, dtype=torch.uint8).view(F8)
    q[~valid] = junk[~valid]
    s[~valid] = float("nan")
    return q, s, valid


def dq_act(q, s, rows) -> torch.Tensor:
    return dequantize_act_fp8(q[rows], s[rows], out_dtype=torch.float64)


def to_device(dev, *ts) -> list:
    return [t.to(dev) for t in ts]


def check_act(out_q, out_s, act, valid) -> None:
    """The re-quantized activation against quantize_act_fp8 of the fp64 one: scales to 4e-6
    relative, values equal or one e4m3 ulp apart on < 1 % of the elements."""
    ref_q, ref_s = quantize_act_fp8(act[valid])
    got_s = out_s[valid]
    assert torch.allclose(got_s, ref_s, rtol=4e-6, atol=0), (got_s / ref_s - 1).abs().max()
    gq, rq = out_q[valid].float(), ref_q.float()
    diff = (gq - rq).abs()
    assert bool((diff <= torch.maximum(ulp_e4m3(gq), ulp_e4m3(rq))).all()), diff.max()
    assert (diff > 0).float().mean() < 0.01


def check_l2_rows(out, aq, as_, w2, blocks, bm: int, out_dtype) -> None:
    """L2 output ``out`` [P, H] (on the CPU) against fp64 ``act @ w2[e]^T`` per valid block:
    elementwise within 1e-5 * (|a| @ |w|^T) (+ 2**-8 |ref| for bf16), fp32 also to 1e-5
    norm-relative. ``w2``: the dequantized weights, fp64 [E, H, I]."""
    for b, (e, v) in enumerate(blocks):
        if v == 0:
            continue
        rows = slice(b * bm, b * bm + v)
        a = dq_act(aq, as_, rows)
        ref = a @ w2[e].T
        bound = 1e-5 * (a.abs() @ w2[e].abs().T)
        if out_dtype == torch.bfloat16:
            bound = bound + 2.0 ** -8 * ref.abs()
        err = (out[rows].double() - ref).abs()
        assert bool((err <= bound).all()), (err / bound).max()
        if out_dtype == torch.float32:
            assert (err.norm() / ref.norm()) < 1e-5


def host_pool(x, idx, tw, num_experts: int, bm: int):
    """The layer's pool built on the host from tokens x [T, H] routed by idx / tw [T, K]:
    each expert's picks in blocks of bm rows, activations quantized per token. Returns
    (pool_x_q [P, H] fp8, pool_x_scale, pool_weight [P], blocks [(expert, valid)], src: the
    (token, k) of each pool row or None for padding)."""
    xq, xsc = quantize_act_fp8(x)
    T, K = idx.shape
    blocks, src = [], []
    for e in range(num_experts):
        picks = [(t, k) for t in range(T) for k in range(K) if int(idx[t, k]) == e]
        for j in range(0, len(picks), bm):
            chunk = picks[j:j + bm]
            blocks.append((e, len(chunk)))
            src.extend(chunk + [None] * (bm - len(chunk)))
    P = len(blocks) * bm
    pq = torch.zeros(P, x.shape[1], dtype=F8)
    ps = torch.zeros(P, x.shape[1] // 128)
    pw = torch.zeros(P)
    for r, tk in enumerate(src):
        if tk is not None:
            pq[r], ps[r], pw[r] = xq[tk[0]], xsc[tk[0]], tw[tk]
    return pq, ps, pw, blocks, src


def sum_picks(y_rows, src, T: int) -> torch.Tensor:
    """fp64 [T, H]: each token's pool rows (``src`` from ``host_pool``) summed."""
    y = torch.zeros(T, y_rows.shape[1], dtype=torch.float64)
    for r, tk in enumerate(src):
        if tk is not None:
            y[tk[0]] += y_rows[r].double()
    return y
