"""Buffer layout arithmetic and the scheduler's ordering properties (pure Python)."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream import MoEConfig, bytes_per_rank, make_layout
from moestream.regions import ALIGN
from moestream.schedule import Phase, build_schedule, expert_waves, wave_block_order, valid_m


def test_regions_aligned_disjoint_and_sized():
    cfg = MoEConfig(hidden=512, intermediate=256, num_experts=12, top_k=3, max_tokens_per_rank=40,
                    block_m=32)
    lay = make_layout(cfg, 3)
    regions = sorted(lay.regions.values(), key=lambda r: r.offset)
    for a, b in zip(regions, regions[1:]):
        assert a.end <= b.offset, (a.name, b.name)
    assert all(r.offset % ALIGN == 0 for r in regions)
    assert lay.total_bytes >= regions[-1].end and lay.total_bytes % ALIGN == 0
    assert lay["pool_x"].shape == (cfg.pool_capacity(3), 512)
    assert lay["combine_y"].shape == (40, 3, 512)
    assert lay["x"].shape == (2, 40, 512)            # double-buffered by call parity
    lo, n = lay.reset_span
    assert {r.name for r in regions if lo <= r.offset < lo + n} == {
        "arrival", "l1_done", "l2_done", "tickets", "l2_programs", "gemm_claims",
        "l2_ranks_done", "combine_flag"}
    with pytest.raises(KeyError, match="no region"):
        lay["nope"]


def test_bytes_per_rank_dsv3_ep2_in_expected_range():
    cfg = MoEConfig.from_shape("dsv3", max_tokens_per_rank=8192)
    # pool 2*8192*8 rows of 7168 bf16 (+ padding) dominates: ~2.1 GB, plus act and combine
    gib = bytes_per_rank(cfg, 2) / 2**30
    assert 3.0 < gib < 4.0
    assert bytes_per_rank(cfg.with_(max_tokens_per_rank=128), 2) < bytes_per_rank(cfg, 2)


def test_valid_m_and_waves_cover_every_expert():
    assert [valid_m(70, m, 32) for m in range(4)] == [32, 32, 6, 0]
    waves = expert_waves([0, 100, 3, 0, 0, 64], block_m=32, n_blocks_l1=2, num_sms=8)
    # 100 tokens = 4 blocks x 2 n-blocks = 8 >= 8 SMs closes the first wave
    assert waves == [(0, 2), (2, 6)]
    assert expert_waves([], block_m=32, n_blocks_l1=2, num_sms=8) == [(0, 0)]
    with pytest.raises(ValueError, match="num_sms"):
        expert_waves([1], block_m=32, n_blocks_l1=1, num_sms=0)


@st.composite
def schedules(draw):
    R = draw(st.integers(1, 3))
    e_loc = draw(st.integers(1, 4))
    E = R * e_loc
    K = draw(st.integers(1, min(E, 3)))
    topk = [draw(st.lists(st.lists(st.integers(-1, E - 1), min_size=K, max_size=K),
                          min_size=0, max_size=10)) for _ in range(R)]
    return build_schedule(topk, num_experts=E, block_m=draw(st.sampled_from([1, 2, 4])),
                          n_blocks_l1=draw(st.integers(1, 3)), n_blocks_l2=draw(st.integers(1, 3)),
                          num_sms=draw(st.integers(1, 8)), l1_group_m=draw(st.integers(1, 3)),
                          l2_lag=draw(st.integers(0, 1)))


def test_wave_block_order_groups_m_blocks():
    # n fastest, and groups of 2 m-blocks (m fastest within a group, a last group of one)
    assert wave_block_order(range(3, 6), 2) == [(3, 0), (3, 1), (4, 0), (4, 1), (5, 0), (5, 1)]
    assert wave_block_order(range(3, 6), 2, 2) == [(3, 0), (4, 0), (3, 1), (4, 1), (5, 0), (5, 1)]


@settings(max_examples=80, deadline=None)
@given(schedules())
def test_every_block_exactly_once(sched):
    for plan in sched.plans:
        for phase, n_blocks in ((Phase.L1, sched.n_blocks_l1), (Phase.L2, sched.n_blocks_l2)):
            blocks = [(t.m_block, t.n_block) for t in plan.tickets if t.phase == phase]
            want = [(mb, n) for mb in range(plan.block_start[-1]) for n in range(n_blocks)]
            assert sorted(blocks) == want
        # valid_m of an expert's blocks adds up to its tokens
        for e, c in enumerate(plan.expert_count):
            assert sum(sched.block_valid_m(plan.rank, mb)
                       for mb in range(plan.block_start[e], plan.block_start[e + 1])) == c


@settings(max_examples=80, deadline=None)
@given(schedules())
def test_l1_of_a_wave_before_its_l2_and_dependencies_earlier(sched):
    for plan in sched.plans:
        order = plan.tickets
        pos = {t: i for i, t in enumerate(order)}
        for w in range(len(plan.waves)):
            l1 = [pos[t] for t in order if t.phase == Phase.L1 and t.wave == w]
            l2 = [pos[t] for t in order if t.phase == Phase.L2 and t.wave == w]
            if l1 and l2:
                assert max(l1) < min(l2)
        for t in order:
            for dep in sched.dependencies(t):
                if dep.rank == t.rank:
                    assert pos[dep] < pos[t], (dep, t)
                else:
                    # the only cross-rank wait: a combine on a peer's L2 (never waits back)
                    assert t.phase == Phase.COMBINE and dep.phase == Phase.L2
    # one launch for all virtual ranks: every dependency strictly earlier
    order = sched.virtual_order()
    pos = {t: i for i, t in enumerate(order)}
    assert len(pos) == len(order)
    for t in order:
        for dep in sched.dependencies(t):
            assert pos[dep] < pos[t], (dep, t)


def test_l2_lag_puts_a_waves_l2_after_the_next_waves_l1():
    # 4 experts of 2 m-blocks (block_m 2, 4 picks each), 2 L1 column blocks: a wave closes at
    # 4 L1 blocks (num_sms), so each expert is its own wave
    topk = [[[e] for e in range(4) for _ in range(4)]]
    kw = dict(num_experts=4, block_m=2, n_blocks_l1=2, n_blocks_l2=3, num_sms=4)
    base = build_schedule(topk, **kw, l2_lag=0).plans[0]
    lag = build_schedule(topk, **kw, l2_lag=1).plans[0]
    assert len(base.waves) == len(lag.waves) == 4
    seq = lambda plan: [(int(t.phase), t.wave) for t in plan.tickets if t.phase in (1, 2)]
    runs = lambda plan: [k for i, k in enumerate(seq(plan)) if i == 0 or seq(plan)[i - 1] != k]
    assert runs(base) == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3)]
    assert runs(lag) == [(1, 0), (1, 1), (2, 0), (1, 2), (2, 1), (1, 3), (2, 2), (2, 3)]
    assert sorted(base.tickets, key=repr) == sorted(lag.tickets, key=repr)   # same tasks


def test_bad_schedule_input():
    with pytest.raises(ValueError, match="outside"):
        build_schedule([[[5]]], num_experts=4, block_m=1, n_blocks_l1=1, n_blocks_l2=1, num_sms=1)
    with pytest.raises(ValueError, match="divisible"):
        build_schedule([[], []], num_experts=3, block_m=1, n_blocks_l1=1, n_blocks_l2=1, num_sms=1)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="l1_group_m must be an int >= 1"):
            build_schedule([[[0]]], num_experts=1, block_m=1, n_blocks_l1=1, n_blocks_l2=1,
                           num_sms=1, l1_group_m=bad)
    for bad in (2, -1, True, 1.0):
        with pytest.raises(ValueError, match="l2_lag must be 0 or 1"):
            build_schedule([[[0]]], num_experts=1, block_m=1, n_blocks_l1=1, n_blocks_l2=1,
                           num_sms=1, l2_lag=bad)
