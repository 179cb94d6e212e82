"""Split-K in the staged decode L1 (``Tuning.l1_split_k``): when a call's L1 tiles are at most
a quarter of the programs, S >= 4 programs share one tile's K loop, write fp32 partial sums to
a scratch of the buffer, and the last part adds them in order and applies SwiGLU.

The interpreter runs the programs one after another, so these cases check the arithmetic
(K ranges, slots, the sum, the epilogue), the device's choice of S, blocks that stay whole
(more than decode_rows rows), the counts returning to zero between calls, and several local
ranks; a GPU runs the same cases with the programs at once (marked by KERNEL_DEVICES). Every
case asserts that parts were really written (the sums scratch is no longer all zero), so a
case that silently ran unsplit cannot pass.
"""
from __future__ import annotations

import pytest
import torch

from moestream import stages
from moestream.buffer import SymmBuffer
from moestream.layer import mega_moe_virtual
from moestream.testing import make_weights, routing_with_counts

from conftest import KERNEL_DEVICES
from test_kernels_virtual import check_layer, check_tuned_layer, make_case, poison, small_config


def split_scratch(buf: SymmBuffer) -> tuple[torch.Tensor, torch.Tensor]:
    (sums,) = [t for (name, _, _), t in buf._scratch.items() if name == "l1_split_sums"]
    (counts,) = [t for (name, _, _), t in buf._scratch.items() if name == "l1_split_counts"]
    return sums, counts


def assert_parts_ran(buf: SymmBuffer) -> None:
    sums, counts = split_scratch(buf)
    assert bool((sums != 0).any()), "no split part wrote its sums: the case ran unsplit"
    assert int(counts.abs().sum()) == 0, counts   # every block's count back at zero


def tail_routing(gen):
    # one rank of 70 tokens, top-2, exactly 37 / 52 / 14 / 0 picks per expert (block_m 32):
    # blocks of 32, 5, 32, 20 and 14 rows, so split blocks (<= 16 rows) and whole ones (more)
    # in one call, and an expert with no token
    idx = routing_with_counts([37, 52, 14, 0], [70], 2, generator=gen)
    return lambda r, T: idx[r]


CASES = [
    # T=1: one or two 1-row blocks x 2 column blocks, 16 programs: S = 4 (tiles * 4 <= 16);
    # descriptors built in the kernel
    (dict(), [1], stages.Tuning(decode_rows=16, use_tma=True, l2_block_n=64, l1_split_k=4,
                                programs=16), None),
    # ... built on the host, S capped at 8 by the field (16 programs would allow more for
    # one tile)
    (dict(), [1], stages.Tuning(decode_rows=16, use_tma=True, l2_block_n=64, l1_split_k=8,
                                programs=32, host_descriptors=True), None),
    # pointer loads, no waits: K = 256 in steps of 64 over 8 parts, so parts past the last
    # step get an empty K range (their sums are zeros)
    (dict(), [2], stages.Tuning(decode_rows=16, use_tma=False, wait=False, l2_block_n=64,
                                l1_split_k=16, programs=64), None),
    # blocks of 5 and 14 rows split, blocks of 20 and 32 rows whole (part 0), in one call:
    # 5 m-blocks x 2 column blocks, 4 parts each on 48 programs
    (dict(max_tokens_per_rank=72), [70],
     stages.Tuning(decode_rows=16, use_tma=True, l2_block_n=64, l1_split_k=4, programs=48),
     "tail"),
    # two virtual ranks: each local rank's parts use their own slots and counts
    (dict(), [1, 2], stages.Tuning(decode_rows=16, use_tma=True, l2_block_n=64, l1_split_k=4,
                                   programs=32), None),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("cfg_changes, Ts, tuning, routing", CASES,
                         ids=["T1-s4", "T1-s8-host", "T2-pointers-empty-parts", "mixed-blocks",
                              "two-ranks"])
def test_split_k_computes_the_same_layer(device, gen, cfg_changes, Ts, tuning, routing):
    cfg = small_config(**{"block_m": 32, "max_tokens_per_rank": 40, "num_experts": 4,
                          **cfg_changes})
    buf = check_tuned_layer(cfg, Ts, tuning, gen, device,
                            routing=tail_routing(gen) if routing else None)
    assert_parts_ran(buf)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_split_k_over_consecutive_calls(device, gen):
    # one buffer, four calls with fresh tokens and routing (1-3 tokens: 2-8 tiles on 32
    # programs, so S is 4 or 8 by the call's block count): the counts a call leaves at zero
    # are what the next call's parts count from
    cfg = small_config(block_m=32, max_tokens_per_rank=40, num_experts=4)
    tuning = stages.Tuning(decode_rows=16, use_tma=True, l2_block_n=64, l1_split_k=8,
                           programs=32)
    buf = SymmBuffer(cfg, num_ranks=1, device=device)
    w13s, w2s = make_weights(cfg, 1, generator=gen, device=device)
    for T in (1, 3, 2, 1):
        poison(buf)
        xs, idxs, ws = make_case(cfg, 1, [T], gen, device)
        ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, tuning=tuning)
        check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden, label=f"T={T}")
        assert_parts_ran(buf)


def test_l1_split_k_must_be_a_power_of_two_up_to_16():
    for bad in (0, 2, 3, 32, True, 4.0):   # 2: two parts measured slower than none
        with pytest.raises(ValueError, match="l1_split_k must be 1"):
            stages.Tuning(l1_split_k=bad)
