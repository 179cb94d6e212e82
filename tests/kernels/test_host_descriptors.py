"""Tensor descriptors built on the host (``Tuning.host_descriptors``): where the staged L1 / L2
load by descriptor and the buffer has one local rank (every real rank), ``stages`` builds the
descriptors each kernel would build in every program and passes them as kernel parameters
(True: always; None, the default: while a CUDA graph is being captured).

Each case runs one virtual rank (the only place the host form applies) against the reference,
and a spy on ``host_descriptors`` asserts that both GEMMs really took the host form
(a case that silently fell back to in-kernel descriptors would pass the numerics and test
nothing). The in-kernel form keeps its own cases (R >= 2 and eager calls everywhere else)
and some here: host_descriptors=False, the default outside a capture, two local ranks.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

import torch

from moestream import staged
from moestream.fused import run_fused
from moestream.launch import host_descriptors
from moestream.tuning import FP8_L2_TILE_MIN_I, L1, L2, Tuning, for_fused
from conftest import hopper
from moestream.buffer import SymmBuffer
from moestream.layer import mega_moe_virtual
from moestream.testing import make_weights, routing_with_counts

from conftest import KERNEL_DEVICES
from test_fp8_layer import check_tuned_fp8_layer, fp8_config
from test_kernels_virtual import check_layer, check_tuned_layer, make_case, small_config


@pytest.fixture
def host_kinds(monkeypatch):
    """Records, per call of ``host_descriptors``, (region, whether the host form was
    taken, the descriptors' (shape, block_shape))."""
    seen = []
    original = host_descriptors

    def spy(*args, **kw):
        descs, host_kw = original(*args, **kw)
        seen.append((kw["region"], host_kw.get("HOST_DESC", False),
                     [None if d is None else (list(d.shape), list(d.block_shape))
                      for d in descs]))
        return descs, host_kw
    from moestream import fused, staged
    for module in (staged, fused):   # each launcher's own reference to it
        monkeypatch.setattr(module, "host_descriptors", spy)
    return seen


def host(tuning: Tuning) -> Tuning:
    return replace(tuning, host_descriptors=True)


def one_rank_tail_routing(gen):
    # one rank of 70 tokens, top-2, exactly 37 / 52 / 14 / 0 picks per expert (block_m 32):
    # a 5-row last block, a 20-row one, one 14-row block, an expert with no token
    idx = routing_with_counts([37, 52, 14, 0], [70], 2, generator=gen)
    return lambda r, T: idx[r]


BF16_CASES = [   # each with host_descriptors=True (test_host_descriptors_compute_...)
    # whole tiles, two MMAs per K step in L1; T not a multiple of block_m
    (dict(), [37], Tuning(use_tma=True), None, (1, 1)),
    # L1 as one gate-and-up MMA: a 3-D weight descriptor [E*2, I, H] in [2, BN, BK] tiles
    (dict(), [37], Tuning(l1=L1(one_dot=True, block_n=64), use_tma=True, wait=False),
     None, (1, 1)),
    # L2 in 16-row pieces of the 32-row m-blocks (a 16-row A descriptor), flat loop
    (dict(), [37], Tuning(l2=L2(split_m=2, block_n=64, flat=True), use_tma=True, wait=False), None,
     (1, 1)),
    # decode pieces: 16-row and 32-row (DECODE_WIDE) A descriptors in both GEMMs; T=1
    (dict(), [1], Tuning(l2=L2(block_n=64), use_tma=True, decode_rows=16), None, (2, 2)),
    # ... and blocks of ~30 rows (the wide piece)
    (dict(), [37], Tuning(l2=L2(block_n=64), use_tma=True, decode_rows=16, wait=False),
     None, (2, 2)),
    # tail pieces: the second A descriptor is the whole tile (block_m rows in L1, block_m /
    # l2_split_m in L2)
    (dict(max_tokens_per_rank=72), [70],
     Tuning(l1=L1(tail_rows=16), l2=L2(tail_rows=16, block_n=64), use_tma=True), "tail",
     (2, 2)),
    (dict(max_tokens_per_rank=72), [70],
     Tuning(l1=L1(tail_rows=16), l2=L2(tail_rows=16, split_m=2, block_n=64), use_tma=True,
            wait=False), "tail", (2, 2)),
    # the GPU default at these dims (tuning.gpu_defaults: the 256-wide L2 tile, 8 warps, flat),
    # with the descriptor loads it takes on a Hopper GPU
    (dict(), [37], replace(hopper(32, hidden=256, intermediate=128),
                           use_tma=True), None, (1, 1)),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("cfg_changes, Ts, tuning, routing, a_descs", BF16_CASES,
                         ids=["tiles", "one-dot", "l2-row-pieces", "decode-T1", "decode-wide",
                              "tail", "tail-split", "gpu-default"])
def test_host_descriptors_compute_the_same_layer(device, gen, host_kinds, cfg_changes, Ts,
                                                 tuning, routing, a_descs):
    cfg = small_config(**{"block_m": 32, "max_tokens_per_rank": 40, "num_experts": 4,
                          **cfg_changes})
    check_tuned_layer(cfg, Ts, host(tuning), gen, device,
                      routing=one_rank_tail_routing(gen) if routing else None)
    assert [(region, host) for region, host, _ in host_kinds] == [("pool_x", True),
                                                                  ("pool_act", True)]
    for (region, _, descs), n_a in zip(host_kinds, a_descs):
        a = [d for d in descs[:2] if d is not None]
        assert len(a) == n_a, (region, descs)
        cols = cfg.hidden if region == "pool_x" else cfg.intermediate
        assert all(shape[1] == cols for shape, _ in a), descs   # A [P, cols]
        assert descs[2] is not None


FP8_CASES = [   # each with host_descriptors=True
    # decode pieces: e4m3 A rows read from the byte rows (values first, AB bytes per row)
    ([1], Tuning(l2=L2(block_n=128), use_tma=True, decode_rows=16)),
    ([30], Tuning(l2=L2(block_n=128), use_tma=True, decode_rows=16, wait=False)),
    # the L2's 16-row pieces by descriptor (the fp8 L1 loads whole tiles by pointer: only
    # the L2 takes descriptors)
    ([30], Tuning(l2=L2(split_m=2, warps=4, block_n=128, epilogue_split=2), use_tma=True)),
    # the GPU default from FP8_L2_TILE_MIN_I on: whole 32-row L2 tiles
    ([30], replace(hopper(32, "fp8", hidden=256,
                                        intermediate=FP8_L2_TILE_MIN_I), use_tma=True)),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("Ts, tuning", FP8_CASES,
                         ids=["decode-T1", "decode-wide", "l2-row-pieces", "gpu-default-tile"])
def test_host_descriptors_in_the_fp8_layer(device, gen, host_kinds, Ts, tuning):
    check_tuned_fp8_layer(fp8_config(num_experts=4, block_m=32, max_tokens_per_rank=40),
                          Ts, host(tuning), gen, device, drop=0.05)
    took = {region: host for region, host, _ in host_kinds}
    assert took["pool_act"], host_kinds
    assert took["pool_x"] == bool(tuning.decode_rows), host_kinds   # fp8 L1 tiles: pointers


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype, Ts, tuning", [
    # the fused launch's whole bf16 tiles (its fp8 tiles load by pointer)
    ("bf16", [37], Tuning(use_tma=True)),
    # decode pieces, T=1 and blocks of ~30 rows: the DM-row and wide A descriptors
    ("bf16", [1], Tuning(l2=L2(block_n=64), use_tma=True, decode_rows=16)),
    ("bf16", [37], Tuning(l2=L2(block_n=64), use_tma=True, decode_rows=16)),
    ("fp8", [30], Tuning(l2=L2(block_n=128), use_tma=True, decode_rows=16)),
], ids=["tiles", "decode-T1", "decode-wide", "fp8-decode"])
def test_host_descriptors_in_the_fused_launch(device, gen, host_kinds, dtype, Ts, tuning):
    # one fused launch takes both GEMMs' descriptors (ONE_RANK: built once per launch)
    if dtype == "fp8":
        check_tuned_fp8_layer(fp8_config(num_experts=4, block_m=32, max_tokens_per_rank=40),
                              Ts, host(tuning), gen, device, drop=0.05, impl="fused")
    else:
        check_tuned_layer(small_config(block_m=32, max_tokens_per_rank=40, num_experts=4), Ts,
                          host(tuning), gen, device, impl="fused")
    assert [(region, on) for region, on, _ in host_kinds] == [("pool_x", True),
                                                              ("pool_act", True)], host_kinds


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("Ts, tuning", [
    # asked off: in-kernel on one rank
    ([37], Tuning(l2=L2(block_n=64), use_tma=True, decode_rows=16, host_descriptors=False)),
    # the default (None) outside a CUDA graph capture: in-kernel
    ([37], Tuning(l2=L2(block_n=64), use_tma=True, decode_rows=16)),
    # asked for, but two local ranks
    ([37, 23], host(Tuning(l2=L2(block_n=64), use_tma=True, decode_rows=16))),
    ([37], host(Tuning(use_tma=False))),         # pointer loads: no descriptors
], ids=["off", "default-eager", "two-ranks", "pointers"])
def test_in_kernel_descriptors_where_the_host_form_does_not_apply(device, gen, host_kinds, Ts,
                                                                   tuning):
    check_tuned_layer(small_config(block_m=32, max_tokens_per_rank=40, num_experts=4), Ts,
                      tuning, gen, device)
    assert len(host_kinds) == 2 and not any(host for _, host, _ in host_kinds), host_kinds


def test_host_descriptors_by_default_while_a_graph_is_captured(gen, host_kinds, monkeypatch):
    # the default (None) follows whether a CUDA graph is being captured: here made to say
    # "capturing" on the CPU, so the host form is taken without a GPU (the GPU test below
    # captures for real)
    from moestream import launch
    monkeypatch.setattr(launch, "capturing", lambda buffer: True)
    check_tuned_layer(small_config(block_m=32, max_tokens_per_rank=40, num_experts=4), [37],
                      Tuning(l2=L2(block_n=64), use_tma=True, decode_rows=16), gen,
                      torch.device("cpu"))
    assert [host for _, host, _ in host_kinds] == [True, True], host_kinds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["staged", "fused"])
@pytest.mark.parametrize("decode_rows", [0, 16], ids=["tiles", "decode"])
def test_a_captured_graph_replays_with_host_descriptors(gen, host_kinds, impl, decode_rows):
    # the layer's default tuning on one virtual rank, its launches (staged.run_staged /
    # run_fused, what mega_moe runs; mega_moe_virtual checks the buffer on the host and
    # cannot be captured) captured into a CUDA graph, where the host builds the descriptors,
    # then replayed with new tokens, routing and pick weights: each replay against the
    # reference, the output poisoned before it
    dev = torch.device("cuda")
    cfg = small_config(block_m=32, max_tokens_per_rank=40, num_experts=4)
    tuning = hopper(32, hidden=cfg.hidden, intermediate=cfg.intermediate).with_(
        decode_rows=decode_rows)
    buf = SymmBuffer(cfg, num_ranks=1, device=dev)
    xs, idxs, ws = make_case(cfg, 1, [37], gen, dev, drop=0.1)
    w13s, w2s = make_weights(cfg, 1, generator=gen, device=dev)
    out = torch.empty(1, 37, cfg.hidden, dtype=torch.bfloat16, device=dev)
    run = staged.run_staged if impl == "staged" else run_fused
    if impl == "fused":
        tuning = for_fused(tuning, cfg, sms=torch.cuda.get_device_properties(dev)
                           .multi_processor_count)

    def call():
        run(buf, xs, idxs, ws, w13s, w2s, out, tuning=tuning)
    call()   # compiles, caches the weight tables
    torch.cuda.synchronize()
    buf.check()
    host_kinds.clear()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    assert [on for _, on, _ in host_kinds] == [True, True], host_kinds
    for _ in range(3):
        x2, idx2, w2_ = make_case(cfg, 1, [37], gen, dev, drop=0.1)
        xs[0].copy_(x2[0])
        idxs[0].copy_(idx2[0])
        ws[0].copy_(w2_[0])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        buf.check()
        check_layer([out[0]], xs, idxs, ws, w13s, w2s, hidden=cfg.hidden)
    buf.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")   # nothing was captured: right
def test_mega_moe_virtual_says_it_cannot_be_captured(gen):
    # it reads the diagnostics on the host after every call: inside a capture that is a
    # ValueError naming what to capture instead, not a CUDA error that invalidates the capture
    dev = torch.device("cuda")
    cfg = small_config(block_m=32, max_tokens_per_rank=40, num_experts=4)
    buf = SymmBuffer(cfg, num_ranks=1, device=dev)
    xs, idxs, ws = make_case(cfg, 1, [5], gen, dev)
    w13s, w2s = make_weights(cfg, 1, generator=gen, device=dev)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pytest.raises(ValueError, match="CUDA graph capture"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, validate=False)
    torch.cuda.synchronize()
    buf.destroy()


def test_host_descriptors_must_be_none_or_a_bool():
    with pytest.raises(ValueError, match="host_descriptors must be None"):
        Tuning(host_descriptors=1)
