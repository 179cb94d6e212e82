"""The staged launches' first loads: a launch that serves one local rank (every
real rank, one virtual rank) takes that rank's buffer address from the host
(``SymmBuffer.host_base``, kernel parameter ``host_base`` with ``HOST_BASE``) instead of
loading it from the table ahead of everything else: the GEMMs for their block count and
first meta (the L1 in decode pieces only), layout, dispatch and combine for their epoch and
counts; publish, one launch
per local rank, always (``SymmBuffer.address``). The L2's last program releases every
rank's ``l2_ranks_done`` at GPU scope where every rank's buffer is on this GPU
(``SymmBuffer.one_device``).

The layer's numerics over these launches are covered by every one-rank case of the kernel
suites (a wrong base reads another region's words as the block count); here a spy on the
kernels asserts which form each launch took, so that a case which silently fell back to
the table would not pass as a test of the host form, and the layer still matches the
reference in both forms.

Stream order: where every rank is on this GPU and waits are off (``stream_ordered``),
the layout waits for no ready flag and the L2 and the combine skip the rank signal; the
same spy checks which launches took that form, and the L2's counters show that nothing was
counted or released.
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from moestream.launch import stream_ordered
from moestream.tuning import L1, L2, Tuning
from moestream.buffer import SymmBuffer
from moestream.layer import mega_moe_virtual
from moestream.testing import make_weights

from conftest import KERNEL_DEVICES
from test_kernels_virtual import check_layer, make_case, small_config

# where each kernel takes host_base: (table, rank0, weights, scales, host_base, ...),
# (table, rank, host_base, ...), (table, rank0, max_spins, timeout_ns, host_base, ...)
HOST_BASE_ARG = {"l1_kernel": 4, "l2_kernel": 4, "publish_kernel": 2, "dispatch_kernel": 2,
                 "layout_kernel": 4, "combine_kernel": 4}


class _Spy:
    """Stands in for a Triton kernel: records (kernel name, args, kwargs) of each launch."""

    def __init__(self, kernel, seen: list) -> None:
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            self.seen.append((self.kernel.fn.__name__, args, kw))
            return launch(*args, **kw)
        return run

    def __getattr__(self, name):   # warmup, fn, ... (programs on GPUs)
        return getattr(self.kernel, name)


@pytest.fixture
def launches(monkeypatch) -> list:
    seen: list = []
    from moestream.kernels import combine, dispatch, l1, l2, pool, publish
    for module, names in ((l1, ("l1_kernel",)), (l2, ("l2_kernel",)),
                          (publish, ("publish_kernel",)), (pool, ("layout_kernel",)),
                          (dispatch, ("dispatch_kernel",)), (combine, ("combine_kernel",))):
        for name in names:
            monkeypatch.setattr(module, name, _Spy(getattr(module, name), seen))
    return seen


def _run_layer_checked(device, gen, R: int, Ts: list[int], tuning) -> SymmBuffer:
    """One layer call on R virtual ranks with fresh inputs (the output poisoned with NaN),
    checked against the reference; returns the buffer for its counters."""
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=device)
    out = torch.full((R, max(Ts), cfg.hidden), float("nan"), dtype=torch.bfloat16,
                     device=device)
    ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, out=out, tuning=tuning)
    check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden)
    return buf


def test_host_base_is_the_one_local_rank_s_buffer(device="cpu"):
    cfg = small_config()
    one = SymmBuffer(cfg, num_ranks=1, device=device)
    assert one.host_base == one.view("epoch").data_ptr() - one.layout["epoch"].offset
    assert one.host_base == int(one.table[0])
    four = SymmBuffer(cfg, num_ranks=4, device=device)
    assert four.host_base is None   # 4 local ranks: each program's rank picks its buffer
    assert [four.address(r) for r in range(4)] == four.table.tolist()
    assert one.one_device and SymmBuffer(cfg, num_ranks=2, device=device).one_device
    # a real rank of a group of two: one local rank, peers on other GPUs
    assert not SymmBuffer.one_device.fget(SimpleNamespace(local_ranks=1, num_ranks=2))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R,Ts,tuning", [
    # one rank, decode pieces with split-K parts (T=1: few tiles): the split branch loads its
    # own meta, the unsplit one keeps the first
    (1, [1], Tuning(l1=L1(split_k=4), l2=L2(split_k=4, block_n=64), decode_rows=16, wait=False)),
    # one rank, whole tiles, T not a multiple of block_m, waits on (counts and signals); the
    # L1 takes the table form there
    (1, [23], Tuning()),
    # one rank, claimed tickets in decode pieces (the claim counter's pointer)
    (1, [21], Tuning(decode_rows=16, gemm_claim=True, programs=3)),
    # two local ranks: the table form (each program's rank picks its own buffer)
    (2, [5, 19], Tuning(l2=L2(block_n=64), decode_rows=16)),
])
def test_launches_take_the_host_base_with_one_local_rank(device, gen, launches, R, Ts,
                                                         tuning):
    buf = _run_layer_checked(device, gen, R, Ts, tuning)
    assert sorted(name for name, _, _ in launches) == sorted(
        ["publish_kernel"] * R + ["layout_kernel", "dispatch_kernel", "l1_kernel", "l2_kernel",
         "combine_kernel"])
    published = []
    for name, args, kw in launches:
        if name == "publish_kernel":   # one launch per local rank, each with its own buffer
            assert kw["HOST_BASE"] is True
            assert kw["PEER_SCOPE"] == "gpu"   # its ready flag: every reader on this GPU
            published.append((args[1], args[HOST_BASE_ARG[name]]))
            continue
        # the L1 in decode pieces only (its whole tiles measured slower with it)
        want = R == 1 and (name != "l1_kernel" or tuning.decode_rows > 0)
        assert kw["HOST_BASE"] == want, (name, kw["HOST_BASE"])
        assert args[HOST_BASE_ARG[name]] == (buf.host_base if want else 0), name
        if name == "l2_kernel":   # virtual ranks share this device: GPU-scope release
            assert kw["PEER_SCOPE"] == "gpu"
    assert sorted(published) == [(r, buf.address(r)) for r in range(R)]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R,Ts,tuning,stream", [
    # one rank, decode pieces, waits off (the GPU defaults): the combine follows the L2 in
    # stream order, so the L2 counts and releases nothing and the combine waits for nothing
    (1, [3], Tuning(l2=L2(block_n=64), decode_rows=16, wait=False), True),
    # four virtual ranks, whole tiles, waits off, a rank with zero tokens: still one device
    # and one stream (every rank's L2 is one launch, every rank's combine the next)
    (4, [7, 0, 12, 1], Tuning(wait=False), True),
    # waits on (the interpreter's default): the rank signal and the combine's wait stay
    (2, [5, 9], Tuning(l2=L2(block_n=64), decode_rows=16), False),
])
def test_stream_ordered_launches_skip_their_signals(device, gen, launches, R, Ts, tuning,
                                                    stream):
    buf = _run_layer_checked(device, gen, R, Ts, tuning)
    # every case has its ranks on one device: the layout skips its waits whenever waits are
    # off, the L2 and the combine their signal with the rank signal too
    assert stream_ordered(buf, tuning) is (not tuning.wait)
    assert stream_ordered(buf, tuning) is stream
    kinds = {name: kw for name, _, kw in launches
             if name in ("layout_kernel", "l2_kernel", "combine_kernel")}
    assert kinds["layout_kernel"]["STREAM"] is (not tuning.wait)
    assert kinds["l2_kernel"]["STREAM"] is stream and kinds["combine_kernel"]["STREAM"] is stream
    # what the L2's programs left in this call's counters (publish zeroes them every call):
    # with the rank signal every program counted itself and every rank was released once
    # by each rank's last program; stream-ordered, nothing
    rank_signal = not stream
    for r in range(R):
        assert int(buf.view("l2_ranks_done", r)[0]) == (R if rank_signal else 0), r
        assert (int(buf.view("l2_programs", r)[0]) > 0) is rank_signal, r
    # across GPUs another GPU's combine is not ordered by this stream: the signal stays
    other_gpus = SimpleNamespace(one_device=False)
    assert not stream_ordered(other_gpus, replace(tuning, wait=False))
    assert not stream_ordered(other_gpus, replace(tuning, wait=False))
