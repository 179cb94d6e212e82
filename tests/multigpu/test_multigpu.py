"""mega_moe across real GPUs (one process per GPU, symmetric memory over NVLink).

Each worker builds the same global inputs from a shared seed, so every rank can compute the
reference for its own tokens without gathering. Workers return findings; the parent asserts.
Run on a machine with 2+ GPUs: ``pytest -m multigpu`` (``make test-gpu``).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

WORLD = min(torch.cuda.device_count(), 8) if torch.cuda.is_available() else 0


def _cfg(**kw):
    from moestream import MoEConfig
    base = dict(hidden=512, intermediate=256, num_experts=8, top_k=2, max_tokens_per_rank=96,
                block_m=64)
    return MoEConfig(**{**base, **kw})


def _inputs(cfg, world, rank, T, seed, *, drop=0.0, skew=None, one_expert=False):
    """This rank's inputs and every expert's weights (all ranks draw the same weights)."""
    from moestream.testing import make_routing, make_tokens, make_weights
    gw = torch.Generator().manual_seed(seed)
    w13s, w2s = make_weights(cfg, world, generator=gw)
    g = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    x = make_tokens(T, cfg.hidden, generator=g)
    idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=g, drop=drop, skew=skew)
    if one_expert:
        idx[:] = -1
        idx[:, 0] = cfg.num_experts - 1
    return x, idx, w, w13s, w2s


def _ref(x, idx, w, w13s, w2s):
    from moestream.reference import moe_forward
    dev = x.device
    return moe_forward(x, idx, w, torch.cat(w13s).to(dev), torch.cat(w2s).to(dev))


def _edge_cases(world):
    """(name, T per rank, config changes, input options) of the edge-case workers."""
    return [
        ("T=1 everywhere", [1] * world, {}, {}),
        ("ragged T, not a multiple of block_m", [95, 37, 3, 64, 1, 50, 77, 2][:world], {}, {}),
        ("rank 0 has zero tokens", [0] + [40] * (world - 1), {}, {}),
        ("-1 picks", [60] * world, {"top_k": 3}, {"drop": 0.35}),
        ("all tokens to one expert", [80] * world, {}, {"one_expert": True}),
        ("skewed routing", [96] * world, {"top_k": 4}, {"skew": 0.25}),
        ("experts with no tokens, top-1", [5] * world, {"num_experts": 16, "top_k": 1}, {}),
    ]


def _worker_cases(rank, world, seed):
    import torch.distributed as dist
    from moestream import SymmBuffer, mega_moe
    from moestream.testing import rel_error
    dev = torch.device("cuda", rank)
    out = []
    for name, Ts, changes, opts in _edge_cases(world):
        cfg = _cfg(**changes)
        buf = SymmBuffer(cfg, group=dist.group.WORLD)
        x, idx, w, w13s, w2s = _inputs(cfg, world, rank, Ts[rank], seed, **opts)
        ref = _ref(x.to(dev), idx.to(dev), w.to(dev), w13s, w2s)
        for impl in ("staged", "fused"):
            y = torch.full((Ts[rank], cfg.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
            mega_moe(x.to(dev), idx.to(dev), w.to(dev), w13s[rank].to(dev), w2s[rank].to(dev),
                     buf, out=y, impl=impl)
            buf.check()
            nan = bool(torch.isnan(y).any())
            err = rel_error(y, ref) if Ts[rank] else 0.0
            out.append((f"{name} ({impl})", rank, err, nan))
        buf.destroy()
    return out


def _worker_dispatch_exact(rank, world, seed):
    import torch.distributed as dist
    from moestream import SymmBuffer, staged
    from moestream.routing import pool_layout, pool_sources, source_slots
    from moestream.tuning import Copy, Tuning
    from moestream.testing import stamp_tokens
    dev = torch.device("cuda", rank)
    cfg = _cfg(top_k=3)
    Ts = [29 + 31 * r for r in range(world)]
    xs, idxs, ws = [], [], []
    for r in range(world):
        x, idx, w, _, _ = _inputs(cfg, world, r, Ts[r], seed, drop=0.2)
        xs.append(stamp_tokens(x, r))
        idxs.append(idx)
        ws.append(w)
    buf = SymmBuffer(cfg, group=dist.group.WORLD)
    cs = [source_slots(i, cfg.num_experts) for i in idxs]
    lay = pool_layout(torch.stack([c for c, _ in cs]), block_m=cfg.block_m)
    want = pool_sources(lay, idxs, [s for _, s in cs], capacity=cfg.pool_capacity(world),
                        max_tokens=cfg.max_tokens_per_rank)[rank]
    rows = (want >= 0).nonzero().flatten()
    T_MAX, K = cfg.max_tokens_per_rank, cfg.top_k
    s, t = want[rows] // (T_MAX * K), (want[rows] // K) % T_MAX
    results = []
    # one token per ticket; then the GPU default's tiles of 4 with eager loads and rows in 4
    # parts of 128 words (as decode calls split dsv3's rows), each part its own peer load
    eager = Copy(dispatch_tile=4, dispatch_eager=True, dispatch_parts=4, hidden_chunk=128)
    for tuning in (Tuning(), Tuning(copy=eager)):
        buf.view("pool_x").fill_(float("nan"))
        staged.publish(buf, 0, xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev))
        staged.layout(buf)
        staged.dispatch(buf, tuning=tuning)
        torch.cuda.synchronize()
        buf.check()
        got_src = buf.view("pool_src").cpu()[rows].long()
        pool = buf.view("pool_x").cpu()
        bad_rows = sum(int(not torch.equal(pool[r], xs[si][ti]))
                       for r, si, ti in zip(rows.tolist(), s.tolist(), t.tolist()))
        parts = staged.dispatch_parts(buf, tuning)
        arrived = int(buf.view("arrival").cpu().sum())
        results.append(dict(
            rank=rank, rows=len(rows), parts=parts, arrivals_ok=arrived == len(rows) * parts,
            src_mismatch=int((got_src != want[rows]).sum()), payload_mismatch=bad_rows,
            layout_ok=buf.view("block_start").cpu().tolist() == lay.block_start[rank].tolist()))
        dist.barrier()   # every rank's pulls of this call are done before the next publish
    buf.destroy()
    return results


def _worker_many_calls(rank, world, seed, calls):
    import torch.distributed as dist
    from moestream import MegaMoE
    from moestream.testing import make_routing, make_tokens, rel_error
    dev = torch.device("cuda", rank)
    cfg_a = _cfg()
    cfg_b = _cfg(hidden=256, intermediate=128, num_experts=4 * world, top_k=3,
                 max_tokens_per_rank=40, block_m=16)
    layers = []
    for i, cfg in enumerate((cfg_a, cfg_b)):
        m = MegaMoE(cfg, group=dist.group.WORLD, device=dev)
        # every rank draws all experts' weights alike and keeps its own slice
        full13 = torch.randn(cfg.num_experts, 2 * cfg.intermediate, cfg.hidden,
                             generator=torch.Generator().manual_seed(seed + 10 + i))
        full2 = torch.randn(cfg.num_experts, cfg.hidden, cfg.intermediate,
                            generator=torch.Generator().manual_seed(seed + 20 + i))
        full13 = (full13 * cfg.hidden ** -0.5).bfloat16()
        full2 = (full2 * cfg.intermediate ** -0.5).bfloat16()
        e = m.expert_range
        m.w13.copy_(full13[e.start:e.stop])
        m.w2.copy_(full2[e.start:e.stop])
        layers.append((m, full13.to(dev), full2.to(dev)))
    g = torch.Generator().manual_seed(seed * 7 + rank)
    worst, nan_calls = 0.0, 0
    from moestream.reference import moe_forward
    for call in range(calls):
        m, full13, full2 = layers[call % 2]
        cfg = m.config
        T = int(torch.randint(0, cfg.max_tokens_per_rank + 1, (1,), generator=g))
        x = make_tokens(T, cfg.hidden, generator=g, device=dev)
        idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=g, device=dev, drop=0.05)
        if call < 2:   # the first calls under inference_mode, the rest outside it
            with torch.inference_mode():
                y = m(x, idx, w).clone()
        else:
            y = m(x, idx, w)
        if T:
            ref = moe_forward(x, idx, w, full13, full2)
            worst = max(worst, rel_error(y, ref))
            nan_calls += int(torch.isnan(y).any())
    for m, _, _ in layers:
        m.buffer.check()
        m.destroy()
    return dict(rank=rank, worst=worst, nan_calls=nan_calls)


def _capture(fn):
    """(graph, output) of ``fn`` captured on a side stream after one warm-up call (which
    compiles the kernels and caches the weight tables)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            y = fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph, y


def _worker_graph(rank, world, seed):
    import torch.distributed as dist
    from moestream import SymmBuffer, mega_moe
    from moestream.testing import rel_error
    dev = torch.device("cuda", rank)
    cfg = _cfg()
    buf = SymmBuffer(cfg, group=dist.group.WORLD)
    T = 48 + 16 * rank
    x, idx, w, w13s, w2s = _inputs(cfg, world, rank, T, seed)
    w13, w2 = w13s[rank].to(dev), w2s[rank].to(dev)
    sx, sidx, sw = x.to(dev), idx.to(dev), w.to(dev)
    graph, y = _capture(lambda: mega_moe(sx, sidx, sw, w13, w2, buf))
    errs = []
    for replay in range(5):
        x2, idx2, w2_, _, _ = _inputs(cfg, world, rank, T, seed + 100 + replay)
        sx.copy_(x2)
        sidx.copy_(idx2)
        sw.copy_(w2_)
        graph.replay()
        torch.cuda.synchronize()
        errs.append(rel_error(y, _ref(sx, sidx, sw, w13s, w2s)))
    buf.check()
    buf.destroy()
    return dict(rank=rank, errs=errs)


def _worker_stall(rank, world, seed):
    import torch.distributed as dist
    from moestream import KernelStallError, SymmBuffer, mega_moe
    dev = torch.device("cuda", rank)
    cfg = _cfg()
    buf = SymmBuffer(cfg, group=dist.group.WORLD)   # the first call may wait for a peer's compile
    x, idx, w, w13s, w2s = _inputs(cfg, world, rank, 16, seed)
    args = (x.to(dev), idx.to(dev), w.to(dev), w13s[rank].to(dev), w2s[rank].to(dev), buf)
    mega_moe(*args)
    torch.cuda.synchronize()
    buf.check()
    buf.timeout_s = 0.5
    dist.barrier()
    message = ""
    if rank == 0:        # the other ranks skip this call: rank 0 must not hang
        mega_moe(*args)
        try:
            buf.check()
        except KernelStallError as exc:
            message = str(exc)
    dist.barrier()
    buf.destroy()
    return dict(rank=rank, message=message)


def _spawn(fn, *args):
    from moestream.tools.distributed import spawn
    return spawn(fn, world_size=WORLD, backend="nccl", args=args, timeout_s=600)


def test_layer_edge_cases_match_reference():
    from moestream.testing import TOLERANCE
    for per_rank in _spawn(_worker_cases, 1234):
        for name, rank, err, nan in per_rank:
            assert not nan, f"{name}: rank {rank} left output unwritten"
            assert err < TOLERANCE["bf16"], f"{name}: rank {rank} rel error {err:.2e}"


def test_dispatch_is_exact_across_gpus():
    for per_rank in _spawn(_worker_dispatch_exact, 99):
        assert [r["parts"] for r in per_rank] == [1, 4], per_rank
        for r in per_rank:
            assert r["rows"] > 0 and r["layout_ok"] and r["arrivals_ok"], r
            assert r["src_mismatch"] == 0 and r["payload_mismatch"] == 0, r


def test_thousand_calls_two_layers_no_drift():
    from moestream.testing import TOLERANCE
    for r in _spawn(_worker_many_calls, 5, 1000):
        assert r["nan_calls"] == 0 and r["worst"] < TOLERANCE["bf16"], r


def test_cuda_graph_replay_with_new_inputs():
    from moestream.testing import TOLERANCE
    for r in _spawn(_worker_graph, 77):
        assert len(r["errs"]) == 5 and max(r["errs"]) < TOLERANCE["bf16"], r


def test_missing_peer_raises_instead_of_hanging():
    res = _spawn(_worker_stall, 3)
    assert "peer ready flag" in res[0]["message"], res[0]


def _worker_fp8(rank, world, seed):
    return _quant_worker(rank, world, seed, "fp8", 200)


def _worker_fp4w(rank, world, seed):
    return _quant_worker(rank, world, seed, "fp4w", 60)


def _quant_worker(rank, world, seed, fmt, calls):
    """fp8 or fp4w (MoEConfig dtype ``fmt``) across GPUs: edge cases against the
    quantization-aware reference, then a CUDA graph replayed with new inputs, then ``calls``
    calls in a row."""
    import torch.distributed as dist
    from moestream import SymmBuffer, mega_moe
    from moestream.reference import moe_forward
    from moestream.testing import quantize_weights, rel_error
    dev = torch.device("cuda", rank)

    def ref(cfg, x, idx, w, w13q, w2q):
        cat = (lambda ws: tuple(torch.cat([p[i] for p in ws]).to(dev) for i in range(2)))
        return moe_forward(x, idx, w, cat(w13q), cat(w2q), quant=fmt)

    out = []
    for name, Ts, changes, opts in _edge_cases(world):
        if name == "skewed routing":   # routing only: the bf16 worker covers it
            continue
        cfg = _cfg(dtype=fmt, **changes)
        buf = SymmBuffer(cfg, group=dist.group.WORLD)
        x, idx, w, w13s, w2s = _inputs(cfg, world, rank, Ts[rank], seed, **opts)
        w13q, w2q = quantize_weights(w13s, w2s, fmt=fmt)
        x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
        mine = (lambda p: (p[0].to(dev), p[1].to(dev)))
        y = torch.full((Ts[rank], cfg.hidden), float("nan"), dtype=torch.bfloat16, device=dev)
        mega_moe(x, idx, w, mine(w13q[rank]), mine(w2q[rank]), buf, out=y)
        buf.check()
        err = rel_error(y, ref(cfg, x, idx, w, w13q, w2q)) if Ts[rank] else 0.0
        out.append((name, err, bool(torch.isnan(y).any())))
        buf.destroy()

    cfg = _cfg(dtype=fmt)
    buf = SymmBuffer(cfg, group=dist.group.WORLD)
    T = 48 + 16 * rank
    x, idx, w, w13s, w2s = _inputs(cfg, world, rank, T, seed)
    w13q, w2q = quantize_weights(w13s, w2s, fmt=fmt)
    w13, w2 = (w13q[rank][0].to(dev), w13q[rank][1].to(dev)), (w2q[rank][0].to(dev),
                                                               w2q[rank][1].to(dev))
    sx, sidx, sw = x.to(dev), idx.to(dev), w.to(dev)
    graph, y = _capture(lambda: mega_moe(sx, sidx, sw, w13, w2, buf))
    for replay in range(3):
        x2, idx2, w2_, _, _ = _inputs(cfg, world, rank, T, seed + 100 + replay)
        sx.copy_(x2)
        sidx.copy_(idx2)
        sw.copy_(w2_)
        graph.replay()
        torch.cuda.synchronize()
        out.append((f"graph replay {replay}", rel_error(y, ref(cfg, sx, sidx, sw, w13q, w2q)),
                    bool(torch.isnan(y).any())))
    worst = 0.0
    for call in range(calls):
        x2, idx2, w2_, _, _ = _inputs(cfg, world, rank, (call * 7 + rank) % 97, seed + call)
        y = mega_moe(x2.to(dev), idx2.to(dev), w2_.to(dev), w13, w2, buf)
        if call % (calls // 5) == calls // 5 - 1 and y.shape[0]:   # five checks
            worst = max(worst, rel_error(y, ref(cfg, x2.to(dev), idx2.to(dev), w2_.to(dev),
                                                w13q, w2q)))
    torch.cuda.synchronize()
    buf.check()
    out.append((f"{calls} calls", worst, False))
    buf.destroy()
    return out


@pytest.mark.parametrize("fmt", ["fp8", "fp4w"])
def test_quantized_layer_across_gpus(fmt):
    from moestream.testing import TOLERANCE
    for per_rank in _spawn(_worker_fp8 if fmt == "fp8" else _worker_fp4w, 4321):
        assert len(per_rank) == 10
        for name, err, nan in per_rank:
            assert not nan, f"{fmt} {name}: output left unwritten"
            assert err < TOLERANCE[fmt], f"{fmt} {name}: rel error {err:.2e}"
