"""MXFP4 weights expanded to the fp8 GEMMs' blocks (moestream/kernels/expand.py through
``launch.fp4w_as_fp8``), against ``quant.dequantize_weight_mxfp4`` on the CPU interpreter (or
a GPU where there is one).

Tolerance: exact (q * scale_inv equals the MXFP4 value bit for bit) wherever a 128x128
block's E8M0 codes span at most 14; a group further below its block's largest rounds to the
nearest e4m3, an error under half an e4m3 subnormal step, 2**-10 * scale_inv.
"""
from __future__ import annotations

import pytest
import torch

from moestream.launch import fp4w_as_fp8
from moestream.quant import dequantize_weight_mxfp4, quantize_weight_mxfp4

from conftest import KERNEL_DEVICES


def expanded(packed, codes):
    """q * scale_inv of the expansion, fp32 [E, N, K], and scale_inv."""
    q, s = fp4w_as_fp8((packed, codes))
    E, N, K = q.shape
    assert q.dtype == torch.float8_e4m3fn and s.shape == (E, N // 128, K // 128)
    full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return q.float() * full, s


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_expansion_is_exact_for_quantized_weights(device, gen):
    # three experts (an odd count), two row blocks and two K blocks each, weights of widely
    # different magnitudes per row (codes spread over ~10 binades): every value exact
    w = torch.randn(3, 256, 256, generator=gen) * torch.logspace(-6, 2, 256, base=2)[:, None]
    packed, codes = (t.to(device) for t in quantize_weight_mxfp4(w))
    got, _ = expanded(packed, codes)
    assert torch.equal(got, dequantize_weight_mxfp4(packed, codes))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_expansion_edge_codes(device, gen):
    # E8M0 codes 0 (2**-127: a block of the smallest scales, subnormal scale_inv) and 253 (the
    # largest the layer takes), all-zero blocks, and every e2m1 code in every position
    packed = torch.randint(0, 256, (2, 128, 128), generator=gen, dtype=torch.uint8)
    codes = torch.full((2, 128, 8), 253, dtype=torch.uint8)
    codes[0, :, 4:] = 0             # block (0, 0, 1): every code 0
    packed[1, :, 64:] = 0           # block (1, 0, 1): every value 0 (codes 253)
    codes[1, :, :4] = torch.randint(240, 254, (128, 4), generator=gen, dtype=torch.uint8)
    packed, codes = packed.to(device), codes.to(device)
    got, s = expanded(packed, codes)
    assert torch.equal(got, dequantize_weight_mxfp4(packed, codes))
    assert s[0, 0, 1] == 2.0 ** -133 and s[1, 0, 1] == 2.0 ** 120


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_expansion_rounds_groups_far_below_their_block(device, gen):
    # one row's second group 20 binades below the block's largest code: it rounds to the
    # nearest e4m3 (error < 2**-10 scale_inv); every other value stays exact
    packed = torch.randint(0, 256, (1, 128, 64), generator=gen, dtype=torch.uint8)
    codes = torch.full((1, 128, 4), 130, dtype=torch.uint8)
    codes[0, 5, 1] = 110
    packed, codes = packed.to(device), codes.to(device)
    got, s = expanded(packed, codes)
    ref = dequantize_weight_mxfp4(packed, codes)
    far = torch.zeros_like(ref, dtype=torch.bool)
    far[0, 5, 32:64] = True
    assert torch.equal(got[~far], ref[~far])
    err = (got[far] - ref[far]).abs().max()
    assert 0 < err <= 2.0 ** -10 * s[0, 0, 0]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("span", [11, 12, 14])
def test_expansion_is_exact_up_to_14_binades(device, gen, span):
    # a block whose codes span 11 binades (its smallest group's 0.5 still a normal e4m3), 12
    # (that 0.5 an e4m3 subnormal) and 14 (the last exact span), every e2m1 code present
    packed = torch.randint(0, 256, (1, 128, 64), generator=gen, dtype=torch.uint8)
    codes = torch.randint(120 - span, 121, (1, 128, 4), generator=gen, dtype=torch.uint8)
    codes[0, 0, 0], codes[0, 1, 1] = 120, 120 - span
    packed, codes = packed.to(device), codes.to(device)
    got, _ = expanded(packed, codes)
    assert torch.equal(got, dequantize_weight_mxfp4(packed, codes))
