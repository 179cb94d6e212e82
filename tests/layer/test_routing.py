"""Routing invariants, tested apart from any numerics: counts, slots, pool offsets, and that
every (token, k) pick lands in exactly one pool row."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.routing import (pool_layout, pool_rows, pool_sources, source_slots,
                               unpack_source)
from moestream.schedule import build_schedule


@st.composite
def routings(draw):
    R = draw(st.integers(1, 4))
    e_loc = draw(st.integers(1, 5))
    E = R * e_loc
    K = draw(st.integers(1, min(E, 4)))
    block_m = draw(st.sampled_from([1, 2, 4, 16]))
    idxs = []
    for _ in range(R):
        T = draw(st.integers(0, 12))
        # any id in [-1, E): -1 picks, duplicates and empty experts all occur
        idxs.append(torch.tensor(draw(st.lists(st.lists(st.integers(-1, E - 1), min_size=K,
                                                        max_size=K), min_size=T, max_size=T)),
                                 dtype=torch.int32).view(T, K))
    return R, E, K, block_m, idxs


@settings(max_examples=60, deadline=None)
@given(routings())
def test_counts_and_slots(case):
    R, E, K, _, idxs = case
    for idx in idxs:
        counts, slot = source_slots(idx, E)
        assert counts.dtype == slot.dtype == torch.int32
        # counts sum to T*K minus the -1 picks
        assert int(counts.sum()) == int((idx >= 0).sum())
        for e in range(E):
            # an expert's picks are numbered 0..n-1 in (t, k) order
            assert slot[idx == e].tolist() == list(range(int(counts[e])))
        assert bool((slot[idx < 0] == -1).all())


@settings(max_examples=60, deadline=None)
@given(routings())
def test_pool_layout_and_rows(case):
    R, E, K, block_m, idxs = case
    cs = [source_slots(i, E) for i in idxs]
    lay = pool_layout(torch.stack([c for c, _ in cs]), block_m=block_m)
    e_loc = E // R
    # offsets are monotone and every expert's segment starts on a block boundary
    starts = lay.block_start * block_m
    assert bool((lay.block_start[:, 1:] >= lay.block_start[:, :-1]).all())
    assert bool((starts % block_m == 0).all())
    seg = (lay.block_start[:, 1:] - lay.block_start[:, :-1]) * block_m
    assert bool((seg >= lay.expert_count).all()) and bool((seg - lay.expert_count < block_m).all())
    # every pick lands in exactly one pool row of the right rank and inside its expert
    seen = set()
    for s, (idx, (_, slot)) in enumerate(zip(idxs, cs)):
        rows = pool_rows(lay, s, idx, slot)
        for t in range(idx.shape[0]):
            for k in range(K):
                e = int(idx[t, k])
                if e < 0:
                    assert rows[t, k] == -1
                    continue
                d, le = divmod(e, e_loc)
                r = int(rows[t, k])
                assert starts[d, le] <= r < starts[d, le] + lay.expert_count[d, le]
                assert (d, r) not in seen
                seen.add((d, r))
    assert len(seen) == sum(int((i >= 0).sum()) for i in idxs)
    # the source list is the inverse map
    T_max = max([i.shape[0] for i in idxs] + [1])
    cap = int(lay.block_start[:, -1].max()) * block_m + block_m
    src = pool_sources(lay, idxs, [s for _, s in cs], capacity=cap, max_tokens=T_max)
    assert int((src >= 0).sum()) == len(seen)
    for d, r in seen:
        s, t, k = (int(v) for v in unpack_source(src[d, r], max_tokens=T_max, top_k=K))
        assert pool_rows(lay, s, idxs[s], cs[s][1])[t, k] == r


@settings(max_examples=40, deadline=None)
@given(routings())
def test_torch_routing_matches_pure_python_schedule(case):
    R, E, K, block_m, idxs = case
    cs = [source_slots(i, E) for i in idxs]
    lay = pool_layout(torch.stack([c for c, _ in cs]), block_m=block_m)
    sched = build_schedule([i.tolist() for i in idxs], num_experts=E, block_m=block_m,
                           n_blocks_l1=1, n_blocks_l2=1, num_sms=4)
    for d, plan in enumerate(sched.plans):
        assert plan.expert_count == lay.expert_count[d].tolist()
        assert plan.block_start == lay.block_start[d].tolist()
        assert plan.src_row == lay.src_row[d].tolist()


def test_empty_routing_on_every_rank():
    # no tokens anywhere: zero counts, an empty pool
    idx = torch.empty(0, 2, dtype=torch.int32)
    counts, slot = source_slots(idx, 4)
    assert counts.tolist() == [0, 0, 0, 0] and slot.shape == (0, 2)
    lay = pool_layout(torch.stack([counts, counts]), block_m=16)
    assert lay.block_start.tolist() == [[0, 0, 0], [0, 0, 0]]
