"""The staged Triton kernels on R virtual ranks: on the CPU under Triton's interpreter, on a GPU
(marked gpu) where there is one.

Dispatch is checked exactly (payload rows stamped with their source rank and token), the layer
against the fp32 reference with the written bf16 tolerance, and every output element is checked
to have been written (outputs and buffer data regions are poisoned with NaN first).
"""
from __future__ import annotations

import pytest
import torch

from moestream import MoEConfig
from moestream import staged
from moestream.fused import fused as fused_launch, fused_tuning, max_tickets, run_fused
from moestream.launch import programs
from moestream.tuning import L1, L2, ONE_WAVE, Copy, Fused, Tuning
from moestream.buffer import KernelStallError, SymmBuffer
from moestream.layer import mega_moe_virtual
from moestream.reference import moe_forward_ranks
from moestream.routing import pool_layout, pool_sources, source_slots
from moestream.schedule import build_schedule, valid_m
from moestream.testing import (TOLERANCE, make_routing, make_tokens, make_weights, read_stamp,
                               rel_error, routing_with_counts, stamp_tokens)

from conftest import KERNEL_DEVICES, hopper

TOL = TOLERANCE["bf16"]


def small_config(**kw) -> MoEConfig:
    base = dict(hidden=256, intermediate=128, num_experts=8, top_k=2, max_tokens_per_rank=24,
                block_m=16)
    return MoEConfig(**{**base, **kw})


def poison(buffer: SymmBuffer) -> None:
    """NaN in every data region: a read of a row nothing wrote this call shows up as NaN."""
    for lr in range(buffer.local_ranks):
        for name in ("pool_x", "pool_act", "combine_y"):
            buffer.view(name, lr).fill_(float("nan"))
        buffer.view("pool_weight", lr).fill_(float("nan"))


def make_case(cfg: MoEConfig, R: int, Ts, gen, device, *, skew=None, drop=0.0, stamp=False,
              routing=None):
    xs, idxs, ws = [], [], []
    for r, T in enumerate(Ts):
        x = make_tokens(T, cfg.hidden, generator=gen)
        if stamp:
            stamp_tokens(x, r)
        idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=gen, skew=skew, drop=drop)
        if routing is not None:
            idx = routing(r, T).to(torch.int32)
        xs.append(x.to(device))
        idxs.append(idx.to(device))
        ws.append(w.to(device))
    return xs, idxs, ws


def check_layer(ys, xs, idxs, ws, w13s, w2s, *, hidden, label=""):
    """Every rank's output against the fp32 reference: shape, every row written (outputs are
    NaN-poisoned by the callers), rel. error within the bf16 tolerance, and exact zeros for
    tokens whose picks are all -1."""
    refs = moe_forward_ranks([x.cpu() for x in xs], [i.cpu() for i in idxs],
                             [w.cpu() for w in ws], [w.cpu() for w in w13s],
                             [w.cpu() for w in w2s])
    for r, (y, x) in enumerate(zip(ys, xs)):
        assert y.shape == (x.shape[0], hidden), (label, r)
        assert not torch.isnan(y).any(), f"{label} rank {r}: output rows left unwritten"
        if x.shape[0]:
            err = rel_error(y.cpu(), refs[r])
            assert err < TOL, f"{label} rank {r}: rel error {err:.2e} >= {TOL}"
        assert bool((y[(idxs[r] < 0).all(dim=1)] == 0).all()), (label, r)


def run_dispatch(buffer, xs, idxs, ws, *, tuning=Tuning()):
    for lr in range(buffer.local_ranks):
        staged.publish(buffer, lr, xs[lr], idxs[lr], ws[lr])
    staged.layout(buffer)
    staged.dispatch(buffer, tuning=tuning)
    buffer.check()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tile, eager, parts", [
    (1, False, 1),   # one token per ticket, picks -> slots -> row in three round trips
    (4, True, 1),    # the GPU default: tiles of 4 tokens, last tile of a source short, eager
    (2, False, 3),   # tiles of 2, rows in 3 parts of 2, 2 and 0 chunks (the empty part counts)
    (4, True, 9),    # eager, parts asked past the row's chunks: one per chunk (4)
])
@pytest.mark.parametrize("R, Ts, e_per_rank", [
    (1, [13], 5),            # R=1: every pick is local; 5 experts (prime-ish count per rank)
    (2, [17, 0], 4),         # a rank with zero tokens sends nothing and still receives
    (3, [5, 24, 1], 3),      # 3 ranks, T=1 on one, T=max on another, 3 experts per rank
    (4, [9, 3, 16, 7], 2),   # 4 ranks, T not a multiple of block_m
])
def test_dispatch_is_exact(device, gen, R, Ts, e_per_rank, tile, eager, parts):
    cfg = small_config(num_experts=R * e_per_rank, top_k=min(3, R * e_per_rank))
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    poison(buf)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.15, stamp=True)
    # hidden_chunk 64: a row (hidden 256) is 4 chunks
    tuning = Tuning(copy=Copy(dispatch_tile=tile, dispatch_eager=eager, dispatch_parts=parts,
                              hidden_chunk=64))
    run_dispatch(buf, xs, idxs, ws, tuning=tuning)
    parts = staged.dispatch_parts(buf, tuning)   # arrivals per row

    cs = [source_slots(i.cpu(), cfg.num_experts) for i in idxs]
    lay = pool_layout(torch.stack([c for c, _ in cs]), block_m=cfg.block_m)
    cap = cfg.pool_capacity(R)
    want_src = pool_sources(lay, [i.cpu() for i in idxs], [s for _, s in cs], capacity=cap,
                            max_tokens=cfg.max_tokens_per_rank)
    e_loc = cfg.experts_per_rank(R)
    for d in range(R):
        # the device-computed layout equals the torch one
        assert buf.view("expert_count", d).cpu().tolist() == lay.expert_count[d].tolist()
        assert buf.view("block_start", d).cpu().tolist() == lay.block_start[d].tolist()
        assert buf.view("src_row", d).cpu().tolist() == lay.src_row[d].tolist()
        assert buf.view("src_tokens", d).cpu().tolist() == Ts
        rows = (want_src[d] >= 0).nonzero().flatten()
        got_src = buf.view("pool_src", d).cpu()
        assert torch.equal(got_src[rows], want_src[d][rows].to(torch.int32))
        # each filled row is bit-identical to its source token, and carries its stamp
        pool = buf.view("pool_x", d).cpu()
        s_, t_, k_ = (want_src[d][rows] // (cfg.max_tokens_per_rank * cfg.top_k),
                      (want_src[d][rows] // cfg.top_k) % cfg.max_tokens_per_rank,
                      want_src[d][rows] % cfg.top_k)
        for row, s, t, k in zip(rows.tolist(), s_.tolist(), t_.tolist(), k_.tolist()):
            assert torch.equal(pool[row], xs[s][t].cpu()), (d, row, s, t)
            assert float(buf.view("pool_weight", d).cpu()[row]) == float(ws[s][t, k])
        rank_of, tok_of = read_stamp(pool[rows])
        assert torch.equal(rank_of, s_) and torch.equal(tok_of, t_)
        # arrival counters reached valid_m, and nothing arrived past the layout
        arrival = buf.view("arrival", d).cpu()
        n_blocks = int(lay.block_start[d, -1])
        for e in range(e_loc):
            b0, b1 = int(lay.block_start[d, e]), int(lay.block_start[d, e + 1])
            for mb in range(b0, b1):
                want = valid_m(int(lay.expert_count[d, e]), mb - b0, cfg.block_m) * parts
                assert int(arrival[mb]) == want
        assert int(arrival[n_blocks:].abs().sum()) == 0
        # each m-block's expert and valid rows, as the GEMM blocks read them
        meta = buf.view("block_meta", d).cpu()[:n_blocks]
        for e in range(e_loc):
            b0, b1 = int(lay.block_start[d, e]), int(lay.block_start[d, e + 1])
            for mb in range(b0, b1):
                assert int(meta[mb]) >> 9 == e
                assert (int(meta[mb]) & 511) * parts == int(arrival[mb])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("impl", ["staged", "fused"])
@pytest.mark.parametrize("case", [
    # name, R, Ts, config changes, routing options; each line says what it stresses
    ("T=1 on every rank", 2, [1, 1], {}, {}),
    ("T not a multiple of block_m, ragged last blocks", 3, [23, 17, 5], {"num_experts": 6}, {}),
    ("R=1, five experts (prime-ish per rank)", 1, [19], {"num_experts": 5}, {}),
    ("a rank with zero tokens", 2, [0, 21], {}, {}),
    ("-1 picks, some tokens with none at all", 2, [20, 12], {"top_k": 3}, {"drop": 0.4}),
    ("all tokens to one expert", 4, [8, 8, 3, 24], {}, {"routing": "one"}),
    ("experts that receive no token", 2, [6, 4], {"num_experts": 16, "top_k": 1}, {}),
    ("skewed routing, hot expert", 2, [24, 24], {"top_k": 4}, {"skew": 0.25}),
    ("K=E, every expert gets every token", 2, [10, 7], {"num_experts": 4, "top_k": 4}, {}),
    ("block_m=64 larger than any expert's tokens", 2, [5, 9], {"block_m": 64}, {}),
    ("hidden 512, intermediate 256", 2, [11, 6], {"hidden": 512, "intermediate": 256}, {}),
], ids=lambda c: c[0])
def test_layer_matches_reference(device, gen, case, impl):
    _, R, Ts, changes, opts = case
    cfg = small_config(**changes)
    routing = None
    if opts.get("routing") == "one":
        routing = lambda r, T: torch.full((T, cfg.top_k), -1).index_fill_(1, torch.tensor([0]), 5)
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    poison(buf)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, skew=opts.get("skew"),
                             drop=opts.get("drop", 0.0), routing=routing)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=device)
    out = torch.full((R, max(Ts), cfg.hidden), float("nan"), dtype=torch.bfloat16, device=device)
    ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, out=out, impl=impl)
    check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("granularity", [16, 48, "expert", "token-tiles", "combine-parts"])
@pytest.mark.parametrize("case", [
    # name, R, Ts, config changes; each line says what it stresses
    ("T=1: a chunk of one row, dispatch task of one token", 2, [1, 1], {}),
    ("ragged T, chunks end mid-expert and past the last token", 3, [23, 17, 5],
     {"num_experts": 6}),
    ("a rank with zero tokens, -1 picks", 2, [0, 21], {"top_k": 3}),
    ("skewed: one expert holds several chunks", 2, [24, 24], {"top_k": 4}),
], ids=lambda c: c[0] if isinstance(c, tuple) else str(c))
def test_chunked_modes_match_reference(device, gen, case, granularity):
    # the fused launch in its chunked modes: dispatch tasks of C tokens (TT at a time), L1
    # blocks waiting for whole C-row chunks (C = block_m 16, 3 * block_m, the whole expert);
    # token-tiles: token mode with multi-token dispatch tasks (dispatch_programs) and combine
    # tasks of 4 tokens summing 64 columns at a time (tiles past T masked)
    _, R, Ts, changes = case
    tuning = None
    if granularity == "token-tiles":
        granularity = "token"
        tuning = Tuning(fused=Fused(dispatch_programs=3, combine_tile=4),
                        copy=Copy(dispatch_tile=2, combine_chunk=64))
    elif granularity == "combine-parts":
        # combine tasks of 2 tokens in 3 column parts of ceil(H / 3) columns (the last
        # shorter), each summed 32 columns at a time: the parts cover every column once
        granularity = "token"
        tuning = Tuning(fused=Fused(combine_tile=2, combine_parts=3), copy=Copy(combine_chunk=32))
    cfg = small_config(**changes)
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    poison(buf)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.2,
                             skew=0.3 if "skewed" in case[0] else None)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=device)
    out = torch.full((R, max(Ts), cfg.hidden), float("nan"), dtype=torch.bfloat16, device=device)
    ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, out=out, impl="fused",
                          granularity=granularity, tuning=tuning)
    check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tokens, tile, programs, eager", [
    (3, 2, 0, False),    # tasks of 3 tokens in tiles of 2: every second tile is half masked
    (5, 8, 0, False),    # a tile larger than the task
    (24, 4, 0, False),   # one task per source (T <= 24)
    (1, 4, 5, False),    # dispatch_programs=5: tasks of ceil(2 * 19 / 5) = 8 tokens
    (3, 2, 0, True),     # eager loads: rows read before the picks are known, masked stores
    (1, 4, 5, True),
])
def test_multi_token_dispatch_tasks_are_exact(device, gen, tokens, tile, programs, eager):
    # dispatch tasks of several tokens (the last one short, tiles past the task's end masked)
    # fill the pool exactly as the token-granular tasks do: stamped rows, sources, weights
    cfg = small_config(num_experts=6, top_k=3)
    R, Ts = 2, [19, 7]
    bufs = [SymmBuffer(cfg, num_ranks=R, device=device) for _ in range(2)]
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.15, stamp=True)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=device)
    # hidden_chunk 64: rows move in 4 chunks (the first one peeled off the loop)
    tuned = Tuning(fused=Fused(dispatch_tokens=tokens, dispatch_programs=programs),
                   copy=Copy(dispatch_tile=tile, dispatch_eager=eager, hidden_chunk=64))
    for buf, tuning in zip(bufs, (Tuning(), tuned)):
        poison(buf)
        y = torch.empty(R, max(Ts), cfg.hidden, dtype=torch.bfloat16, device=device)
        run_fused(buf, xs, idxs, ws, w13s, w2s, y, tuning=tuning)
        buf.check()
    cs = [source_slots(i.cpu(), cfg.num_experts) for i in idxs]
    lay = pool_layout(torch.stack([c for c, _ in cs]), block_m=cfg.block_m)
    want_src = pool_sources(lay, [i.cpu() for i in idxs], [s for _, s in cs],
                            capacity=cfg.pool_capacity(R), max_tokens=cfg.max_tokens_per_rank)
    for d in range(R):
        rows = (want_src[d] >= 0).nonzero().flatten()
        assert len(rows) > 0
        for name in ("arrival", "block_meta"):
            assert torch.equal(bufs[0].view(name, d), bufs[1].view(name, d)), name
        for name in ("pool_src", "pool_x", "pool_weight"):
            a, b = bufs[0].view(name, d)[rows], bufs[1].view(name, d)[rows]
            assert torch.equal(a, b), name
        assert torch.equal(bufs[1].view("pool_src", d)[rows].cpu(), want_src[d][rows].int())
        rank_of, tok_of = read_stamp(bufs[1].view("pool_x", d)[rows].cpu())
        assert torch.equal(rank_of, want_src[d][rows] // (cfg.max_tokens_per_rank * cfg.top_k))


def test_bad_granularity_names_what_is_allowed(gen):
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=1, device="cpu")
    xs, idxs, ws = make_case(cfg, 1, [4], gen, "cpu")
    w13s, w2s = make_weights(cfg, 1, generator=gen)
    for bad in (8, 0, "chunk", 2.0, True):      # 8: not a multiple of block_m=16
        with pytest.raises(ValueError, match="multiple of block_m"):
            mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, impl="fused", granularity=bad)
    with pytest.raises(ValueError, match="impl='fused'"):
        mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, impl="staged", granularity=16)
    # L2 tickets of several column blocks: the group must divide the 4 column blocks
    # (hidden 256 / the 64-wide tiles) and needs whole tiles
    for bad, msg in ((Tuning(fused=Fused(l2_group=3)), "must divide the L2's 4 column blocks"),
                     (Tuning(fused=Fused(l2_group=8)), "must divide the L2's 4 column blocks"),
                     (Tuning(fused=Fused(l2_group=2), decode_rows=16), "needs whole L2 tiles")):
        with pytest.raises(ValueError, match=f"Fused.l2_group=.* {msg}"):
            mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, impl="fused", tuning=bad)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_gemm_tiles_must_divide_their_dimensions(device, gen):
    # a column block past the last whole one went unwritten (hidden 384, l2_block_n 256: the
    # output's last 128 columns were zeros) and a K step past the last whole one read past
    # the row: both are ValueErrors before the first launch, in either path, and the buffer
    # is still usable (nothing was published)
    cfg = small_config(hidden=384, intermediate=384)
    buf = SymmBuffer(cfg, num_ranks=1, device=device)
    xs, idxs, ws = make_case(cfg, 1, [4], gen, device)
    w13s, w2s = make_weights(cfg, 1, generator=gen, device=device)
    for bad, msg in ((Tuning(l1=L1(block_n=256)), "L1.block_n must be a power of two >= 16 "
                                                  "dividing intermediate=384, got 256"),
                     (Tuning(l1=L1(block_k=256)), "L1.block_k .* dividing hidden=384"),
                     (Tuning(l2=L2(block_n=256)), "L2.block_n .* dividing hidden=384"),
                     (Tuning(l2=L2(block_k=256)), "L2.block_k .* dividing intermediate=384"),
                     (Tuning(l2=L2(block_n=96)), "L2.block_n must be a power of two")):
        for impl in ("staged", "fused"):
            with pytest.raises(ValueError, match=msg):
                mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, impl=impl, tuning=bad)
    with pytest.raises(ValueError, match="L2.block_n .* dividing hidden=384"):
        Tuning(l2=L2(block_n=256)).check(cfg.with_(dtype="fp8"))
    ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, tuning=Tuning(l2=L2(block_n=128)))
    check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden)


# Tuning fields a random draw varies, with the values it picks from (invalid ones included)
_RANDOM_TUNING = {
    "l1.block_n": [None, 16, 32, 64, 128, 256], "l2.block_n": [None, 16, 32, 64, 128, 256],
    "l1.block_k": [None, 16, 32, 64, 128], "l2.block_k": [None, 16, 32, 64, 128],
    "l2.epilogue_split": [1, 2, 4], "l2.flat": [False, True], "wait": [True, False],
    "l2.split_m": [1, 2], "use_tma": [None, True, False], "programs": [0, 1, 3],
    "copy.hidden_chunk": [64, 128, 1024], "copy.combine_chunk": [None, 32, 64, 128],
    "copy.dispatch_tile": [1, 2, 4, 8], "l1.group_m": [1, 2, 3], "decode_rows": [0, 16, 32],
    "l1.tail_rows": [0, 16, 32], "l2.tail_rows": [0, 16, 32]}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_random_tunings_are_right_or_rejected(device, gen, dtype):
    # a tuning that a user may pass is either rejected with a ValueError before anything runs
    # or gives the right layer (e.g. a 256-wide L2 on hidden 384 would silently leave
    # columns unwritten): random configs (H, I up to 384, 2-6 experts, block_m 16-64),
    # random subsets of the fields above, staged or fused, 1-2 virtual ranks, 0-24 tokens
    # each. A failure names the draw; MOESTREAM_SEED replays it.
    import random

    from moestream.testing import quantize_weights
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=gen)))
    ran = rejected = 0
    while ran < 3:   # three draws that ran (rejected ones are cheap; bounded below)
        assert rejected < 30, "nearly every draw rejected: the draw no longer fits the rules"
        E = rng.choice([2, 3, 4, 6])
        dims = [rng.choice([128, 256, 384]) for _ in range(2)]
        cfg = MoEConfig(hidden=dims[0], intermediate=dims[1], num_experts=E,
                        top_k=rng.randint(1, min(3, E)), max_tokens_per_rank=24,
                        block_m=rng.choice([16, 32, 64]), dtype=dtype)
        R = rng.choice([1, 2]) if E % 2 == 0 else 1
        fields = {k: rng.choice(v) for k, v in _RANDOM_TUNING.items() if rng.random() < 0.4}
        impl = rng.choice(["staged", "fused"])
        label = f"{cfg} {fields} {impl} R={R}"
        try:
            tuning = Tuning().with_dotted(fields)
        except ValueError:
            rejected += 1
            continue
        Ts = [rng.randint(0, 24) for _ in range(R)]
        xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.1)
        w13s, w2s = make_weights(cfg, R, generator=gen)
        if dtype == "fp8":
            w13s, w2s = quantize_weights(w13s, w2s, fmt="fp8")
        refs = moe_forward_ranks([x.cpu() for x in xs], [i.cpu() for i in idxs],
                                 [w.cpu() for w in ws], w13s, w2s, quant=dtype,
                                 compute_dtype=torch.float64)
        to = (lambda w: tuple(t.to(device) for t in w) if isinstance(w, tuple) else w.to(device))
        w13s, w2s = [to(w) for w in w13s], [to(w) for w in w2s]
        buf = SymmBuffer(cfg, num_ranks=R, device=device)
        try:
            ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, tuning=tuning, impl=impl)
        except ValueError:
            rejected += 1
            continue
        ran += 1
        for r, (y, ref) in enumerate(zip(ys, refs)):
            assert not torch.isnan(y).any(), f"{label}: rank {r} rows left unwritten"
            if ref.norm() > 0:
                assert rel_error(y.cpu(), ref) < TOLERANCE[dtype], f"{label}: rank {r}"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_consecutive_calls_reuse_buffer(device, gen):
    # epochs, double-buffered inputs and per-call counter resets across calls whose token
    # counts and routings change (including a call where one rank has no tokens), with the
    # staged and the fused path sharing one buffer
    cfg = small_config()
    R = 2
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=device)
    for call, Ts in enumerate([[24, 3], [1, 0], [7, 19], [16, 16]]):
        xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.1)
        ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf,
                              impl="fused" if call % 2 else "staged")
        check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden, label=f"call {call}")
        assert buf.view("epoch", 0).item() == call + 1


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_device_layout_follows_schedule(device, gen):
    # the kernels' m-block numbering is the pure-Python scheduler's
    cfg = small_config(num_experts=6)
    R, Ts = 3, [11, 20, 2]
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.1)
    run_dispatch(buf, xs, idxs, ws)
    sched = build_schedule([i.cpu().tolist() for i in idxs], num_experts=cfg.num_experts,
                           block_m=cfg.block_m, n_blocks_l1=cfg.intermediate // 64,
                           n_blocks_l2=cfg.hidden // 64, num_sms=8)   # Tuning()'s tiles
    for d, plan in enumerate(sched.plans):
        assert buf.view("block_start", d).cpu().tolist() == plan.block_start
        pool_src = buf.view("pool_src", d).cpu()
        for row, (s, t, k) in plan.pool_src.items():
            assert int(pool_src[row]) == (s * cfg.max_tokens_per_rank + t) * cfg.top_k + k


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R, Ts, e_per_rank, wave_blocks", [
    (3, [11, 20, 2], 2, 8),     # few experts, one or two waves
    (2, [24, 17], 7, 4),        # several waves per rank, 7 experts (prime-ish), some empty
    (1, [1], 5, 2),             # T=1: most experts receive nothing; empties ride along
    (2, [24, 24], 4, 10_000),   # one wave that never reaches wave_blocks closes at the end
    (2, [24, 0], 5, ONE_WAVE),   # the fused decode default; a rank with no tokens
])
def test_device_waves_follow_schedule(device, gen, R, Ts, e_per_rank, wave_blocks):
    # the layout kernel's expert waves (fused launch only) are moestream.schedule's
    cfg = small_config(num_experts=R * e_per_rank)
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.2)
    run_dispatch(buf, xs, idxs, ws)
    for d in range(R):
        buf.view("wave_mb", d).fill_(-7)
        buf.view("num_waves", d).fill_(-7)
    staged.layout(buf, tuning=Tuning(fused=Fused(wave_blocks=wave_blocks)), waves=True)
    buf.check()
    sched = build_schedule([i.cpu().tolist() for i in idxs], num_experts=cfg.num_experts,
                           block_m=cfg.block_m, n_blocks_l1=cfg.intermediate // 64,
                           n_blocks_l2=cfg.hidden // 64, num_sms=wave_blocks)
    for d, plan in enumerate(sched.plans):
        n = len(plan.waves)
        assert int(buf.view("num_waves", d)) == n
        want = [plan.block_start[a] for a, _ in plan.waves] + [plan.block_start[-1]]
        assert buf.view("wave_mb", d).cpu()[:n + 1].tolist() == want


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_peer_that_never_publishes_raises_instead_of_hanging(device, gen):
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=2, device=device, timeout_spins=64)
    xs, idxs, ws = make_case(cfg, 2, [4, 4], gen, device)
    w13s, w2s = make_weights(cfg, 2, generator=gen, device=device)
    mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf)
    # rank 0 publishes call 2 (epoch and ready flag move on); rank 1 never does, so rank 0's
    # layout step waits for rank 1's ready flag
    buf.view("epoch", 0).add_(1)
    buf.view("ready", 0).add_(1)
    staged.layout(buf)
    with pytest.raises(KernelStallError, match=r"rank 0: .*peer ready flag.*peer rank 1"):
        buf.check()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_gemm_without_dispatch_reports_the_stalled_block(device, gen):
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=2, device=device, timeout_spins=64)
    xs, idxs, ws = make_case(cfg, 2, [8, 8], gen, device)
    w13s, _ = make_weights(cfg, 2, generator=gen, device=device)
    for lr in range(2):
        staged.publish(buf, lr, xs[lr], idxs[lr], ws[lr])
    staged.layout(buf)
    staged.l1(buf, w13s)   # dispatch skipped: no pool block ever fills
    with pytest.raises(KernelStallError, match="L1: pool block arrival count"):
        buf.check()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_combine_without_l2_reports_the_missing_ranks(device, gen):
    # the staged combine waits once for every rank's L2 (the rank signal); with the
    # L2 launch skipped it gives up with a stall naming that wait, instead of summing garbage
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=2, device=device, timeout_spins=64)
    buf.timeout_s = 0.5
    xs, idxs, ws = make_case(cfg, 2, [8, 5], gen, device)
    w13s, _ = make_weights(cfg, 2, generator=gen, device=device)
    for lr in range(2):
        staged.publish(buf, lr, xs[lr], idxs[lr], ws[lr])
    staged.layout(buf)
    staged.dispatch(buf)
    staged.l1(buf, w13s)
    staged.combine(buf, torch.empty(2, 8, cfg.hidden, dtype=torch.bfloat16, device=device))
    with pytest.raises(KernelStallError, match="every rank's L2 finished"):
        buf.check()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_out_of_range_expert_ids(device, gen):
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=2, device=device)
    xs, idxs, ws = make_case(cfg, 2, [4, 4], gen, device)
    w13s, w2s = make_weights(cfg, 2, generator=gen, device=device)
    idxs[1][2, 0] = cfg.num_experts
    with pytest.raises(ValueError, match=r"rank 1: topk_idx values must lie in \[-1, 8\)"):
        mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf)
    # without the host-side check the kernels ignore the pick and report it afterwards
    with pytest.raises(ValueError, match="rank 1: 1 topk_idx values were outside"):
        mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, validate=False)
    buf.check()  # reported once, then cleared


def test_bad_arguments_name_what_is_wrong(gen):
    cfg = small_config()
    R = 2
    buf = SymmBuffer(cfg, num_ranks=R, device="cpu") if not torch.cuda.is_available() else \
        SymmBuffer(cfg, num_ranks=R, device="cuda")
    dev = buf.device
    xs, idxs, ws = make_case(cfg, R, [4, 4], gen, dev)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=dev)

    def call(**changes):
        args = dict(xs=xs, topk_idxs=idxs, topk_weights=ws, w13s=w13s, w2s=w2s, buffer=buf)
        args.update(changes)
        return mega_moe_virtual(**args)

    cases = [
        (dict(xs=xs[:1]), "xs must be a list with one entry per rank"),
        (dict(xs=[xs[0].float(), xs[1]]), "rank 0: x must have dtype bfloat16"),
        (dict(xs=[xs[0], make_tokens(25, cfg.hidden).to(dev)]), "more than max_tokens_per_rank=24"),
        (dict(topk_idxs=[idxs[0], idxs[1][:, :1]]), "rank 1: topk_idx must have top_k=2 columns"),
        (dict(topk_weights=[ws[0].double(), ws[1]]),
         "rank 0: topk_weights must have dtype float32"),
        (dict(w13s=[w13s[0][:, :, :128], w13s[1]]), "rank 0: w13 must have shape"),
        (dict(w2s=[w2s[0], w2s[1].transpose(1, 2).contiguous().transpose(1, 2)]),
         "rank 1: w2 must be contiguous"),
        (dict(buffer=object()), "buffer must be a virtual SymmBuffer"),
    ]
    if dev.type == "cuda":
        cases.append((dict(xs=[xs[0].cpu(), xs[1]]), "rank 0: x must be on"))
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**changes)
    with pytest.raises(ValueError, match="exactly one of num_ranks"):
        SymmBuffer(cfg)
    with pytest.raises(ValueError, match="divisible"):
        SymmBuffer(cfg, num_ranks=3, device=dev)
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(R, 2, cfg.hidden, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="timeout_s must be"):
        buf.timeout_s = 0
    with pytest.raises(ValueError, match="impl must be one of"):
        call(impl="chunky")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning", [
    Tuning(use_tma=True),                                      # tensor-descriptor loads
    Tuning(use_tma=False),                                     # pointer loads
    Tuning(l1=L1(block_n=32, block_k=32), l2=L2(block_n=128, block_k=16)),  # other tiles
    Tuning(wait=False, programs=3),                            # stream order only
    Tuning(l2=L2(block_n=32), programs=3),                         # more L2 tiles
    Tuning(l2=L2(flat=True), wait=False, programs=3),             # flat L2 (tile, k) loop
    Tuning(l2=L2(epilogue_split=2, block_n=64)),                # L2 stores in two halves
    Tuning(l2=L2(epilogue_split=4, block_n=128), use_tma=True),  # ... in four quarters
    Tuning(l2=L2(flat=True, epilogue_split=2), wait=False, use_tma=True),   # both
    # the staged combine with its own launch shape, summing rows in 64-column chunks (hidden
    # 256: four chunks per token, so the chunk loop's offsets are exercised)
    Tuning(copy=Copy(combine_warps=8, combine_per_sm=1, combine_chunk=64)),
    # L1 tickets in groups of m-blocks (m fastest within a group): 3 does not divide the
    # m-block count, so the last group is smaller; L1 blocks wait on their m-block's arrivals
    Tuning(l1=L1(group_m=3)),
    Tuning(l1=L1(group_m=8), wait=False, programs=3),   # one group holds every m-block
    # 8-token dispatch tickets with eager loads (large calls on GPUs): 21 and 10 tokens end
    # in partly filled tiles
    Tuning(copy=Copy(dispatch_tile=8, dispatch_eager=True)),
    # the L1's gate and up as one MMA over a [2, block_n, K step] weight tile (3-D descriptor)
    Tuning(l1=L1(one_dot=True, block_n=64), use_tma=True),
    # ... without waits, in groups of m-blocks (the last smaller), 3 programs for more tiles
    Tuning(l1=L1(one_dot=True, group_m=3), use_tma=True, wait=False, programs=3),
    # ... asked for with pointer loads: the two-MMA form runs (one dot needs descriptors)
    Tuning(l1=L1(one_dot=True), use_tma=False),
    # the GPU default (tuning.gpu_defaults): one 256-wide L2 column block of 8 warps, flat loop
    hopper(128, hidden=256, intermediate=128),
], ids=["tma", "pointers", "tiles", "nowait", "l2-tiles", "flat", "epilogue-split",
        "epilogue-split4", "flat-split", "combine-shape", "l1-group3", "l1-group8",
        "dispatch-tile8", "l1-one-dot", "l1-one-dot-nowait-grouped", "l1-one-dot-pointers",
        "gpu-default"])
def test_tuning_variants_compute_the_same_layer(device, gen, tuning):
    check_tuned_layer(small_config(), [21, 10], tuning, gen, device)


def check_tuned_layer(cfg: MoEConfig, Ts, tuning: Tuning, gen, device, *,
                      routing=None, impl: str = "staged") -> SymmBuffer:
    """One call (``impl``) with ``tuning`` on len(Ts) virtual ranks (10 % -1 picks, or
    ``routing`` as ``make_case`` takes it) against the reference, buffer poisoned first.
    Returns the buffer (its counters as the call left them)."""
    R = len(Ts)
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    poison(buf)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.1, routing=routing)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=device)
    ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, tuning=tuning, impl=impl)
    check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden)
    return buf


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("wait", [True, False])
def test_counters_are_counted_only_for_launches_that_wait(device, gen, wait):
    # wait=False (the staged path on GPUs: each launch runs after the previous one in stream
    # order): dispatch counts no arrivals and L1 no l1_done, since each count is a release
    # fence that holds its program; with waits both count. The layer is right either way.
    buf = check_tuned_layer(small_config(block_m=32, max_tokens_per_rank=40, num_experts=4),
                            [37, 23], Tuning(wait=wait, programs=3), gen, device)
    for d in range(2):
        arrivals = int(buf.view("arrival", d).cpu().sum())
        l1_done = int(buf.view("l1_done", d).cpu().sum())
        assert (arrivals > 0, l1_done > 0) == (wait, wait), (d, arrivals, l1_done)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning", [
    Tuning(l2=L2(split_m=2, block_n=64), use_tma=True),          # pieces by descriptor
    # pointers, flat
    Tuning(l2=L2(split_m=2, flat=True, epilogue_split=2), use_tma=False, wait=False, programs=3),
], ids=["tma", "pointers-flat"])
def test_l2_in_row_pieces_computes_the_same_layer(device, gen, tuning):
    # L2 tiles of half an m-block (block_m 32: pieces of 16 rows, the least a GPU dot takes);
    # two experts per rank get ~30 rows each: first pieces full, second ones partly filled
    check_tuned_layer(small_config(block_m=32, max_tokens_per_rank=40, num_experts=4),
                      [37, 23], tuning, gen, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("Ts, tuning", [
    # block_m 32 in pieces of 16 rows: ~30 rows per expert, so an m-block runs a full and a
    # partial piece (weights read twice); descriptor loads; dispatch moves rows in 2 parts
    # (tiles of 4 tokens, eager), so the L1 waits for 2 arrivals per row
    ([37, 23], Tuning(l2=L2(block_n=64), decode_rows=16, use_tma=True,
                      copy=Copy(dispatch_parts=2, hidden_chunk=128, dispatch_tile=4,
                                dispatch_eager=True))),
    # pointer loads, no waits, quarters; a piece of 16 rows in a 32-row block
    ([37, 23], Tuning(l2=L2(epilogue_split=4, block_n=64), decode_rows=16, use_tma=False,
                      wait=False, programs=3)),
    # decode proper: T=1 and T=2 (an m-block holds 1-4 valid rows of one 32-row piece);
    # l2_flat and l2_split_m are set but do not apply in decode pieces
    ([1, 2], Tuning(l2=L2(flat=True, split_m=2), decode_rows=32, use_tma=True, wait=False)),
], ids=["wide-piece-tma", "wide-piece-pointers", "decode-T1"])
def test_decode_pieces_compute_the_same_layer(device, gen, Ts, tuning):
    # L1 and L2 with the weight tile as the MMA row operand: blocks of <= decode_rows rows
    # in one piece, fuller ones (~30 rows of a 32-row block here) in one 32-row piece
    check_tuned_layer(small_config(block_m=32, max_tokens_per_rank=40, num_experts=4),
                      Ts, tuning, gen, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_decode_pieces_of_a_full_block(device, gen):
    # block_m 64, two experts, top-2: ~57 rows per expert, so two 32-row pieces per m-block
    # (the second partly filled, its L2 rows in the block's second half); T=3 on one rank
    check_tuned_layer(small_config(block_m=64, max_tokens_per_rank=64, num_experts=2),
                      [61, 3], Tuning(l2=L2(block_n=64), decode_rows=16, use_tma=True),
                      gen, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("cfg_changes, Ts, tuning", [
    # block_m 32, ~30 rows per expert: blocks of <= 16 rows in one 16-row piece, fuller ones
    # in one 32-row piece; descriptor loads; each L2 block releases its rows' combine flags
    # after its piece (the fused combine waits on them: a missing release stalls the call)
    ({"block_m": 32, "max_tokens_per_rank": 40, "num_experts": 4}, [37, 23],
     Tuning(l2=L2(block_n=64), fused=Fused(per_sm=2), decode_rows=16, use_tma=True)),
    # decode proper: T=1 and T=2 (1-4 valid rows in one 32-row piece), pointer loads
    ({"block_m": 32, "max_tokens_per_rank": 40, "num_experts": 4}, [1, 2],
     Tuning(decode_rows=32, use_tma=False)),
    # block_m 64, two experts, top-2: ~57 rows per expert, two 32-row pieces per m-block (the
    # release waits for the second); T=3 on one rank, 8-token dispatch tasks
    ({"block_m": 64, "max_tokens_per_rank": 64, "num_experts": 2}, [61, 3],
     Tuning(l2=L2(block_n=64), fused=Fused(dispatch_programs=8), decode_rows=16, use_tma=True)),
], ids=["pieces-16-32-tma", "decode-T1-pointers", "two-wide-pieces"])
def test_fused_launch_in_decode_pieces(device, gen, cfg_changes, Ts, tuning):
    # the fused launch's GEMM blocks in decode pieces (Tuning.decode_rows, as the staged ones)
    check_tuned_layer(small_config(**cfg_changes), Ts, tuning, gen, device, impl="fused")


# Tail pieces (Tuning.l1.tail_rows / l2_tail_rows): block_m 32, two ranks of two experts,
# exactly 37 / 52 / 14 / 0 picks per expert: expert 0 ends in a 5-row m-block (a tail piece),
# expert 1 in a 20-row one (more than 16 rows: the usual tile, or with l2_split_m=2 a full
# 16-row L2 piece and a 4-row tail piece at row 16), expert 2 is one 14-row block (a tail
# piece), expert 3 gets none.
TAIL_COUNTS = [37, 52, 14, 0]
TAIL_TOKENS = [40, 30]


def tail_routing(gen, top_k: int = 2):
    idx = routing_with_counts(TAIL_COUNTS, TAIL_TOKENS, top_k, generator=gen)
    return lambda r, T: idx[r]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning", [
    # rows and weights by descriptor; L2 in whole 32-row blocks
    Tuning(l1=L1(tail_rows=16), l2=L2(tail_rows=16, block_n=64), use_tma=True),
    # pointer loads, no waits; L2 in 16-row pieces (an empty second piece computes nothing)
    # with the flat loop asked for
    Tuning(l1=L1(tail_rows=16), l2=L2(tail_rows=16, split_m=2, flat=True), use_tma=False,
           wait=False, programs=3),
    # 32-row L1 tail pieces: every partly filled block (expert 1's 20 rows too) is one
    # piece; the L2 as usual (flat loop, quarters)
    Tuning(l1=L1(tail_rows=32), l2=L2(block_n=64, flat=True, epilogue_split=4), use_tma=True,
           wait=False),
    # the L2 only, 32-row pieces
    Tuning(l2=L2(tail_rows=32, block_n=64), use_tma=True),
], ids=["tail16-tma", "tail16-pointers-split", "l1-tail32", "l2-tail32"])
def test_tail_pieces_compute_the_same_layer(device, gen, tuning):
    check_tuned_layer(small_config(block_m=32, max_tokens_per_rank=40, num_experts=4),
                      TAIL_TOKENS, tuning, gen, device, routing=tail_routing(gen))


# Claimed GEMM tickets (Tuning.gemm_claim): two ranks of two experts, block_m 64, exactly 60 /
# 3 / 0 / 20 picks per expert: expert 0 is hot (a 60-row block: two 32-row decode pieces,
# the costly block a claiming launch balances), expert 2 gets none. A launch claims the
# tickets past each program's first two (pid, pid + programs) and none when it has at most
# two per program (kernels/tickets.py, ``claiming``).
HOT_COUNTS = [60, 3, 0, 20]


def claims_in(buf, cfg, tuning) -> dict[tuple[str, int], bool]:
    """Which staged GEMM launch of the call just run claimed tickets, per (GEMM, local rank):
    more tickets (m-blocks x column blocks, or row pieces) than twice its programs."""
    progs = programs(buf, tuning, tuning.gemm_per_sm)
    flat = tuning.l2.flat and not tuning.wait
    out = {}
    for d in range(buf.local_ranks):
        blocks = int(buf.view("block_start", d)[-1])
        out["l1", d] = blocks * (cfg.intermediate // tuning.l1_tile(cfg)[0]) > 2 * progs
        l2_tickets = blocks * tuning.l2.split_m * (cfg.hidden // tuning.l2_tile(cfg)[0])
        out["l2", d] = not flat and l2_tickets > 2 * progs
    return out


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning, hot", [
    # decode pieces by descriptor, 3 programs: rank 0 (2 m-blocks, 4 L1 / 4 L2 column
    # blocks) claims in both GEMMs, rank 1 (1 m-block) deals its 4 + 4 tickets round-robin;
    # L1 blocks wait and count l1_done (checked exactly below)
    (Tuning(l1=L1(block_n=32), l2=L2(block_n=64), gemm_claim=True, decode_rows=16, use_tma=True,
            programs=3), True),
    # whole tiles, pointer loads, no waits, 1 program: every ticket past the second claimed;
    # random routing (10 % -1 picks)
    (Tuning(gemm_claim=True, use_tma=False, wait=False, programs=1), False),
    # L1 tickets in groups of m-blocks and L2 row pieces, claimed alike
    (Tuning(l1=L1(group_m=3), l2=L2(split_m=2, block_n=32), gemm_claim=True, programs=2), False),
    # the flat L2 keeps its loop (its tickets are not claimed); the L1's are
    (Tuning(l2=L2(flat=True), l1=L1(block_n=32), gemm_claim=True, wait=False, programs=1),
     True),
], ids=["decode-hot-tma", "tiles-pointers", "grouped-row-pieces", "flat-l2"])
def test_claimed_gemm_tickets_compute_the_same_layer(device, gen, tuning, hot):
    cfg = small_config(block_m=64, max_tokens_per_rank=40, num_experts=4)
    routing = None
    if hot:
        idx = routing_with_counts(HOT_COUNTS, TAIL_TOKENS, cfg.top_k, generator=gen)
        routing = lambda r, T: idx[r]   # noqa: E731
    buf = check_tuned_layer(cfg, TAIL_TOKENS, tuning, gen, device, routing=routing)
    claimed = claims_in(buf, cfg, tuning)
    assert any(claimed.values()), claimed   # the case exercises claims at all
    nb1 = cfg.intermediate // tuning.l1_tile(cfg)[0]
    for d in range(2):
        # the last program of each GEMM zeroed its counter and count (a standalone GEMM
        # launched again, as the GEMM bench does, claims from the start again)
        assert buf.view("gemm_claims", d)[:, :2].cpu().tolist() == [[0, 0], [0, 0]], d
        if tuning.wait:   # every L1 ticket ran exactly once: l1_done is NB1 per m-block
            blocks = int(buf.view("block_start", d)[-1])
            done = buf.view("l1_done", d)[:blocks].cpu()
            assert done.tolist() == [nb1] * blocks, (d, done)


def test_routing_with_counts_gives_exact_counts(gen):
    # the helper the tail tests rely on: exact per-expert counts over all ranks, every token's
    # picks distinct, the rest -1; counts that cannot fit are a ValueError
    idx = torch.cat(routing_with_counts(TAIL_COUNTS, TAIL_TOKENS, 2, generator=gen))
    assert idx.shape == (sum(TAIL_TOKENS), 2) and idx.dtype == torch.int32
    assert [int((idx == e).sum()) for e in range(4)] == TAIL_COUNTS
    assert int((idx == -1).sum()) == 2 * sum(TAIL_TOKENS) - sum(TAIL_COUNTS)
    both = idx[(idx >= 0).all(dim=1)]
    assert bool((both[:, 0] != both[:, 1]).all())
    with pytest.raises(ValueError, match="do not fit"):
        routing_with_counts([71, 0], [40, 30], 2, generator=gen)   # one expert twice a token
    with pytest.raises(ValueError, match="do not fit"):
        routing_with_counts([70, 70, 1], [40, 30], 2, generator=gen)   # more picks than slots


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("T, K, E, case", [
    (1, 2, 8, "random"),        # T=1: one token's picks
    (37, 4, 5, "random"),       # prime-ish expert count, T not a power of two
    (300, 8, 256, "random"),    # more picks than one 128-wide chunk, dsv3's expert count
    (700, 2, 3, "one"),         # every pick to expert 1: long runs across chunks
    (1100, 4, 3, "one"),        # 4400 picks: two 4096-pick steps of the numbering loop (the
                                # next step's picks load during this one), a run across them
    (2100, 8, 16, "random"),    # 16800 picks: five steps, the last partly filled
    (50, 4, 8, "holes"),        # -1 and out-of-range ids (E, E + 5, -7) are no picks
    (0, 4, 8, "random"),        # a rank with no tokens: counts 0, nothing written
])
def test_pick_slots_kernel_equals_source_slots(device, gen, T, K, E, case):
    # the publish step's one-launch slot numbering is routing.source_slots exactly (stable:
    # picks of an expert numbered in flat t * K + k order), for int32 and int64 ids
    if case == "one":
        idx = torch.ones(T, K, dtype=torch.int64)
        idx[:, 1:] = torch.arange(1, K).remainder(E)[None, :] if K > 1 else idx[:, 1:]
    else:
        idx = torch.stack([torch.randperm(max(E, K), generator=gen)[:K] for _ in range(T)]) \
            if T else torch.empty(0, K, dtype=torch.int64)
        idx = idx.remainder(E) if E < K else idx
        if case == "holes":
            bad = torch.tensor([-1, E, E + 5, -7])
            where = torch.rand(T, K, generator=gen) < 0.3
            idx[where] = bad[torch.randint(0, 4, (int(where.sum()),), generator=gen)]
    want_counts, want_slot = source_slots(idx, E)
    for dtype in (torch.int64, torch.int32):
        counts, slot = staged.pick_slots(idx.to(dtype).to(device), E)
        assert torch.equal(counts.cpu(), want_counts), (dtype, counts, want_counts)
        assert torch.equal(slot.cpu(), want_slot), dtype


def test_run_staged_marks_each_stage_in_order(gen):
    # run_staged's on_stage hook (the EP bench's per-stage timer) fires once per stage, in
    # staged.STAGES order, after that stage's launches, and changes nothing in the result
    cfg = small_config()
    R, Ts = 2, [13, 6]
    buf = SymmBuffer(cfg, num_ranks=R, device="cpu")
    poison(buf)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, "cpu", drop=0.1)
    w13s, w2s = make_weights(cfg, R, generator=gen)
    y = torch.full((R, max(Ts), cfg.hidden), float("nan"), dtype=torch.bfloat16)
    names = []
    staged.run_staged(buf, xs, idxs, ws, w13s, w2s, y, on_stage=names.append)
    buf.check()
    assert names == list(staged.STAGES)
    check_layer([y[r, :T] for r, T in enumerate(Ts)], xs, idxs, ws, w13s, w2s,
                hidden=cfg.hidden)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R, Ts, e_per_rank, several_waves, extra", [
    # two ranks, several expert waves each: a wave's L2 tickets after the next wave's L1
    # tickets (the last wave's after all L1)
    (2, [24, 20], 6, True, {}),
    (3, [10, 0, 24], 4, False, {}),  # a rank with no tokens still serves its experts
    # L1 tickets in groups of 3 m-blocks (a wave's last group smaller)
    (2, [24, 20], 6, True, dict(l1=dict(group_m=3))),
    # L2 tickets of 2 of the 4 column blocks (flat loop, one count per ticket), several waves
    (2, [24, 20], 6, True, dict(fused=dict(l2_group=2))),
    # L2 tickets of all 4 column blocks: an m-block completes with its first ticket; a rank
    # with no tokens
    (3, [10, 0, 24], 4, False, dict(fused=dict(l2_group=4))),
    # L2 groups and L1 groups on three ranks, one of them without tokens
    (3, [24, 0, 17], 5, True, dict(fused=dict(l2_group=2), l1=dict(group_m=2))),
    # one rank (R=1: the launch's one set of weights and descriptors), several waves
    (1, [24], 6, True, {}),
])
def test_fused_kernel_hands_out_tickets_in_schedule_order(device, gen, R, Ts, e_per_rank,
                                                          several_waves, extra):
    # the fused kernel's tickets, decoded on the device, are moestream.schedule's virtual order
    cfg = small_config(num_experts=R * e_per_rank)
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, drop=0.1)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=device)
    # small waves on any device, so several form
    tuning = Tuning(fused=Fused(wave_blocks=8)).with_(**extra)
    trace = torch.full((max_tickets(buf, tuning), 8), -9, dtype=torch.int64, device=device)
    y = torch.empty(R, max(Ts), cfg.hidden, dtype=torch.bfloat16, device=device)
    run_fused(buf, xs, idxs, ws, w13s, w2s, y, tuning=tuning, trace=trace)
    buf.check()
    sched = build_schedule([i.cpu().tolist() for i in idxs], num_experts=cfg.num_experts,
                           block_m=cfg.block_m, n_blocks_l1=cfg.intermediate // 64,
                           n_blocks_l2=cfg.hidden // 64 // tuning.fused.l2_group, num_sms=8,
                           l1_group_m=tuning.l1.group_m)
    want = []
    for t in sched.virtual_order():
        if t.phase == 0:
            want.append((0, t.rank, t.source, t.token, -1))
        elif t.phase in (1, 2):
            want.append((int(t.phase), t.rank, t.expert, t.m_block, t.n_block))
        else:   # (first token, column part): one part of all columns here
            want.append((3, t.rank, t.token, 0, -1))
    got = [tuple(r) for r in trace[:len(want), :5].cpu().tolist()]
    assert got == want
    assert int((trace[len(want):, 0] != -9).sum()) == 0   # no ticket past the last
    check_layer([y[r, :T] for r, T in enumerate(Ts)], xs, idxs, ws, w13s, w2s,
                hidden=cfg.hidden)   # and the layer is right in that order
    if several_waves:   # ~7 picks per expert, 2 L1 blocks each: a wave closes after 4 experts
        assert any(len(p.waves) > 1 for p in sched.plans)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fused_with_a_missing_peer_raises(device, gen):
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=2, device=device, timeout_spins=64)
    xs, idxs, ws = make_case(cfg, 2, [5, 5], gen, device)
    w13s, w2s = make_weights(cfg, 2, generator=gen, device=device)
    mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, impl="fused")
    # rank 1's inputs of the next call never arrive: the layout step stalls, the fused launch
    # then hands out no work, and the stall is reported instead of a hang
    buf.view("epoch", 0).add_(1)
    buf.view("ready", 0).add_(1)
    staged.layout(buf, waves=True)
    y = torch.empty(2, 5, cfg.hidden, dtype=torch.bfloat16, device=device)
    fused_launch(buf, w13s, w2s, y)
    with pytest.raises(KernelStallError, match="peer ready flag"):
        buf.check()


def test_fused_tuning_resolves_once():
    # a resolved tuning resolves to itself (trace and aot pass one back into run_fused), and
    # a chunked mode's dispatch task size survives a base tuning with dispatch_programs
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=2, device="cpu")
    base = Tuning(fused=Fused(dispatch_programs=5))
    chunk = fused_tuning(buf, 19, tuning=base, granularity=32)
    assert (chunk.fused.dispatch_tokens, chunk.fused.chunk_blocks,
            chunk.fused.dispatch_programs) == (32, 2, 0)
    assert fused_tuning(buf, 19, tuning=chunk, granularity=32) == chunk
    assert fused_tuning(buf, 19, tuning=chunk) == chunk
    token = fused_tuning(buf, 19, tuning=base)
    assert token.fused.dispatch_tokens == 8 and token.fused.chunk_blocks == 1   # ceil(2 * 19 / 5)
    assert fused_tuning(buf, 19, tuning=token) == token


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("impl", ["staged", "fused"])
def test_eight_virtual_ranks(device, gen, impl):
    # EP8 as one 8-GPU node would run it (the EP8 issue, on what this machine allows): 8 ranks,
    # skewed routing, one rank with zero tokens, one with T=1, 3 experts per rank (24 in all)
    R, Ts = 8, [11, 0, 7, 1, 16, 5, 9, 13]
    cfg = small_config(num_experts=3 * R, top_k=3)
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    poison(buf)
    xs, idxs, ws = make_case(cfg, R, Ts, gen, device, skew=0.3, drop=0.1)
    w13s, w2s = make_weights(cfg, R, generator=gen, device=device)
    out = torch.full((R, max(Ts), cfg.hidden), float("nan"), dtype=torch.bfloat16, device=device)
    ys = mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, out=out, impl=impl)
    check_layer(ys, xs, idxs, ws, w13s, w2s, hidden=cfg.hidden)
