"""Split-K in the decode GEMMs (``Tuning.l1.split_k``, ``l2_split_k``): when a call's tiles of
one GEMM are at most a quarter of the programs, S >= 4 programs share one tile's K loop, write
fp32 partial sums to a scratch of the buffer, and the last part adds them in order and
finishes the tile (L1: SwiGLU into pool_act; L2: the rows into their combine slots). The
staged L1 and L2 split; the fused launch splits its L2 tickets (each tile's parts on
consecutive tickets, the last part also signalling the block's rows).

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

from moestream import MoEConfig
from moestream.tuning import L1, L2, Tuning, for_fused, in_decode_pieces
from conftest import hopper
from moestream.buffer import SymmBuffer
from moestream.kernels.common import tl, triton
from moestream.kernels.tickets import split_count
from moestream.layer import mega_moe_virtual
from moestream.testing import make_routing, make_weights, routing_with_counts

from conftest import KERNEL_DEVICES
from test_kernels_virtual import check_layer, check_tuned_layer, make_case, poison, small_config


def split_scratch(buf: SymmBuffer, gemm: str) -> tuple[torch.Tensor, torch.Tensor]:
    (sums,) = buf.scratch_named(f"{gemm}_split_sums")
    (counts,) = buf.scratch_named(f"{gemm}_split_counts")
    return sums, counts


def assert_parts_ran(buf: SymmBuffer, gemm: str) -> None:
    sums, counts = split_scratch(buf, gemm)
    assert bool((sums != 0).any()), f"no {gemm} split part wrote its sums: the case ran unsplit"
    assert int(counts.abs().sum()) == 0, counts   # every block's count back at zero


def split_in(gemm: str, tuning: Tuning) -> Tuning:
    """A case written for the L1 (``l1_split_k``, programs for its tiles), moved to ``gemm``
    (l2, fused_l2): the L2 has twice the L1's column blocks in these configs (hidden 256 / 64
    against intermediate 128 / 64), so twice the programs give it the same S."""
    if gemm == "l1":
        return tuning
    return tuning.with_(l1=dict(split_k=1), l2=dict(split_k=tuning.l1.split_k),
                        programs=2 * tuning.programs)


def every_pick(cfg, gen):
    # uniform routing without -1 picks (check_tuned_layer's default drops 10 %): a 1-token
    # call whose picks were all dropped would have no tile to split, and the case's check
    # that parts ran would fail by chance
    return lambda r, T: make_routing(T, cfg.num_experts, cfg.top_k, generator=gen)[0]


def tail_routing(gen):
    # one rank of 70 tokens, top-2, exactly 37 / 52 / 14 / 0 picks per expert (block_m 32):
    # blocks of 32, 5, 32, 20 and 14 rows, so split blocks (<= 16 rows) and whole ones (more)
    # in one call, and an expert with no token
    idx = routing_with_counts([37, 52, 14, 0], [70], 2, generator=gen)
    return lambda r, T: idx[r]


CASES = [
    # T=1: one or two 1-row blocks x 2 column blocks, 16 programs: S = 4 (tiles * 4 <= 16);
    # descriptors built in the kernel
    (dict(), [1], Tuning(l2=L2(block_n=64), l1=L1(split_k=4), decode_rows=16, use_tma=True,
                         programs=16), None),
    # ... built on the host, S capped at 8 by the field (16 programs would allow more for
    # one tile)
    (dict(), [1], Tuning(l2=L2(block_n=64), l1=L1(split_k=8), decode_rows=16, use_tma=True,
                         programs=32, host_descriptors=True), None),
    # pointer loads, no waits: K = 256 in steps of 64 over 8 parts, so parts past the last
    # step get an empty K range (their sums are zeros)
    (dict(), [2], Tuning(l2=L2(block_n=64), l1=L1(split_k=16), decode_rows=16, use_tma=False,
                         wait=False, programs=64), None),
    # blocks of 5 and 14 rows split, blocks of 20 and 32 rows whole (part 0), in one call:
    # 5 m-blocks x 2 column blocks, 4 parts each on 48 programs
    (dict(max_tokens_per_rank=72), [70],
     Tuning(l2=L2(block_n=64), l1=L1(split_k=4), decode_rows=16, use_tma=True, programs=48),
     "tail"),
    # intermediate 256: K = 256 in steps of 64 in both GEMMs over S = 4 parts (the field's
    # cap), so every part has one step and a part left out of the sum shows in the output
    (dict(intermediate=256), [1],
     Tuning(l2=L2(block_n=64), l1=L1(split_k=4), decode_rows=16, use_tma=True, programs=32),
     None),
    # two virtual ranks: each local rank's parts use their own slots and counts
    (dict(), [1, 2], Tuning(l2=L2(block_n=64), l1=L1(split_k=4), decode_rows=16, use_tma=True,
                            programs=32), None),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("gemm", ["l1", "l2", "fused_l2"])
@pytest.mark.parametrize("cfg_changes, Ts, tuning, routing", CASES,
                         ids=["T1-s4", "T1-s8-host", "T2-pointers-empty-parts", "mixed-blocks",
                              "every-part-a-step", "two-ranks"])
def test_split_k_computes_the_same_layer(device, gen, gemm, cfg_changes, Ts, tuning, routing):
    # the L2 cases: K = intermediate (128 but in every-part-a-step) in steps of 64, so S >= 4
    # leaves parts with an empty K range (zero sums) next to parts with one step
    cfg = small_config(**{"block_m": 32, "max_tokens_per_rank": 40, "num_experts": 4,
                          **cfg_changes})
    buf = check_tuned_layer(cfg, Ts, split_in(gemm, tuning), gen, device,
                            routing=tail_routing(gen) if routing else every_pick(cfg, gen),
                            impl="fused" if gemm.startswith("fused") else "staged")
    assert_parts_ran(buf, gemm)


FP8_CASES = [
    # T=1: 1-2 m-blocks x 2 column blocks of 128 on 16 programs, S = 4; hidden 256 is two
    # 128-column K steps (one scale block each), so parts 2 and 3 have no step (zero sums)
    (dict(), [1], Tuning(l1=L1(block_n=128, split_k=4), decode_rows=16, use_tma=True, programs=16),
     None),
    # hidden 512: four steps, one per part (a part left out of the sum shows), pointer loads,
    # no waits, two virtual ranks (each its own slots and counts)
    (dict(hidden=512), [2, 1], Tuning(l1=L1(block_n=128, split_k=4), decode_rows=16, use_tma=False,
                                      wait=False, programs=32), None),
    # blocks of 5 and 14 rows split, blocks of 20 and 32 rows whole (part 0, as unsplit), an
    # expert with no token, in one call: 5 m-blocks x 2 column blocks, 4 parts on 48 programs
    (dict(block_m=32, max_tokens_per_rank=72, num_experts=4), [70],
     Tuning(l1=L1(block_n=128, split_k=4), decode_rows=16, use_tma=True, programs=48),
     "tail"),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("cfg_changes, Ts, tuning, routing", FP8_CASES,
                         ids=["T1-empty-parts", "step-per-part-two-ranks", "mixed-blocks"])
def test_fp8_l1_split_k_computes_the_same_layer(device, gen, cfg_changes, Ts, tuning, routing):
    # the fp8 decode L1 split (``kernels/l1.l1_fp8_split_part``): each part's steps scaled
    # by their own activation and weight scales, the last part's SwiGLU and re-quantization,
    # against the quantization-aware reference
    from test_fp8_layer import check_tuned_fp8_layer, fp8_config
    cfg = fp8_config(**cfg_changes)
    buf = check_tuned_fp8_layer(cfg, Ts, tuning, gen, device, drop=0.0,
                                routing=tail_routing(gen) if routing else None)
    assert_parts_ran(buf, "l1")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fused_l2_in_two_parts_where_k_is_long(device, gen, monkeypatch):
    # fused_min_split is 2 from intermediate 8192 (mixtral), too large for the interpreter:
    # patched to 2 here, 16 programs for 4-8 L2 tiles (T = 1, one or two 1-row blocks x 4
    # column blocks) leave room for 2 parts only where there are 8 tiles, else 4; both
    # compute the layer, and the run must have split
    from moestream import fused
    monkeypatch.setattr(fused, "fused_min_split", lambda cfg: 2)
    cfg = small_config(block_m=32, max_tokens_per_rank=40, num_experts=4)
    tuning = Tuning(l2=L2(block_n=64, split_k=4), decode_rows=16, use_tma=True, programs=16)
    buf = check_tuned_layer(cfg, [1], tuning, gen, device, routing=every_pick(cfg, gen),
                            impl="fused")
    assert_parts_ran(buf, "fused_l2")


@triton.jit
def _split_counts(tiles_ptr, out_ptr, nprog, N: tl.constexpr, SPLIT_K: tl.constexpr,
                  MIN_S: tl.constexpr):
    t = tl.load(tiles_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), split_count(t, nprog, SPLIT_K, MIN_S))


@pytest.mark.parametrize("split_k, min_s", [(4, 4), (8, 4), (16, 4), (4, 2), (16, 2)])
def test_split_count_is_the_largest_power_of_two_that_fits(split_k, min_s):
    # the device's choice of S (kernels/tickets.split_count) against its rule written in
    # Python: the largest power of two <= split_k with tiles * S <= programs, 1 below min_s
    tiles = torch.arange(1, 129, dtype=torch.int32)
    out = torch.zeros_like(tiles)
    _split_counts[(1,)](tiles, out, 132, N=128, SPLIT_K=split_k, MIN_S=min_s)
    for t, got in zip(tiles.tolist(), out.tolist()):
        s = max([p for p in (2, 4, 8, 16) if p <= split_k and t * p <= 132], default=1)
        assert got == (s if s >= min_s else 1), (t, got)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_split_k_over_consecutive_calls(device, gen):
    # one buffer, four calls with fresh tokens and routing, both GEMMs split (1-3 tokens:
    # 2-8 L1 and 4-16 L2 tiles on 64 programs, so S is 4 or 8 by the call's block count):
    # the counts a call leaves at zero are what the next call's parts count from
    cfg = small_config(block_m=32, max_tokens_per_rank=40, num_experts=4)
    tuning = Tuning(l2=L2(block_n=64, split_k=8), l1=L1(split_k=8), decode_rows=16, use_tma=True,
                    programs=64)
    buf = SymmBuffer(cfg, num_ranks=1, device=device)
    w13s, w2s = make_weights(cfg, 1, generator=gen, device=device)
    for T in (1, 3, 2, 1):
        poison(buf)
        xs, idxs, ws = make_case(cfg, 1, [T], gen, device)
        ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, tuning=tuning)
        check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden, label=f"T={T}")
        assert_parts_ran(buf, "l1")
        assert_parts_ran(buf, "l2")


@pytest.mark.parametrize("part", [L1, L2])
def test_split_k_must_be_a_power_of_two_up_to_16(part):
    for bad in (0, 2, 3, 32, True, 4.0):   # 2: two parts measured slower than none
        with pytest.raises(ValueError, match=rf"{part.__name__}.split_k must be one of \(1, 4"):
            part(split_k=bad)


@pytest.mark.parametrize("shape", ["mixtral", "qwen3", "dsv3"])
def test_fused_decode_runs_two_programs_per_sm(shape):
    # the fused launch's GPU defaults in decode pieces: two programs per SM at every shape,
    # mixtral's few long L2 tiles included, since they split (for_fused; one program
    # per SM there is slower); larger
    # calls keep one (their L1 tiles are 8-warp 128x256)
    cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=64)
    base = hopper(cfg.block_m, hidden=cfg.hidden, intermediate=cfg.intermediate)
    assert for_fused(in_decode_pieces(base, 16, cfg), cfg, sms=132).fused.per_sm == 2
    assert for_fused(base, cfg, sms=132).fused.per_sm == 1
