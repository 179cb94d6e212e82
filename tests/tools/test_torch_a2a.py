"""The all_to_all baseline (moestream.tools.baselines.moe_forward_a2a) against the fp32 reference,
on 1, 2 and 4 gloo ranks spawned on the CPU.

Every case's inputs come from a generator seeded by (case, world size): each rank rebuilds
the global view and keeps its own share, and the parent rebuilds the same view for the
reference. One spawn per world size runs all cases (process start-up dominates the cost).
"""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from moestream.tools.baselines import moe_forward_a2a
from moestream.config import MoEConfig
from moestream.tools.distributed import spawn
from moestream.reference import moe_forward_ranks
from moestream.testing import TOLERANCE, make_routing, make_tokens, make_weights, rel_error

H, I, E, K = 256, 128, 8, 2

# name -> (tokens per rank as a function of R, routing mode). What each stresses:
CASES = {
    # uneven token counts per rank, uniform routing: the ordinary ragged all_to_all.
    "uniform": (lambda R: [16 + 7 * r for r in range(R)], "uniform"),
    # T=1 on every rank: splits of 0 and 1 rows, most experts idle.
    "one_token": (lambda R: [1] * R, "uniform"),
    # rank 0 has T=0: it sends nothing but must still compute and return rows for the others.
    "empty_rank": (lambda R: [0] + [9] * (R - 1), "uniform"),
    # ~35% of picks are -1, including whole tokens: never sent, contribute nothing, y row 0.
    "drop": (lambda R: [24] * R, "drop"),
    # every pick of every token goes to one expert (duplicates within a token, K rows each):
    # the ranks not owning it receive nothing (empty GEMM path), its owner receives all.
    "one_expert": (lambda R: [12] * R, "one_expert"),
    # an expert that receives no token: a zero-length group between non-empty ones.
    "idle_expert": (lambda R: [20] * R, "idle_expert"),
}
HOT_EXPERT = E - 1     # owned by the last rank, so rank 0's tokens cross the link
IDLE_EXPERT = 1        # owned by rank 0 for every R tested; experts 0 and 2 stay busy


def _seed(case: str, world_size: int) -> int:
    return zlib.crc32(f"{case}/{world_size}".encode())


def build_inputs(case: str, world_size: int) -> dict:
    """The global view of one case: per-rank lists x, topk_idx, topk_weights, w13, w2."""
    tokens_fn, mode = CASES[case]
    tokens = tokens_fn(world_size)
    g = torch.Generator().manual_seed(_seed(case, world_size))
    cfg = MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K,
                    max_tokens_per_rank=max(1, max(tokens)))
    w13s, w2s = make_weights(cfg, world_size, generator=g)
    xs, idxs, ws = [], [], []
    for T in tokens:
        xs.append(make_tokens(T, H, generator=g))
        idx, w = make_routing(T, E, K, generator=g, drop=0.35 if mode == "drop" else 0.0)
        if mode == "drop" and T:
            idx[0] = -1  # one token with no expert at all
            w[0] = 0.0
        if mode == "one_expert":
            idx.fill_(HOT_EXPERT)
        if mode == "idle_expert":
            for t in range(T):
                row = idx[t].tolist()
                if IDLE_EXPERT in row:
                    free = [e for e in range(E) if e not in row and e != IDLE_EXPERT]
                    idx[t, row.index(IDLE_EXPERT)] = free[t % len(free)]
        idxs.append(idx)
        ws.append(w)
    return dict(x=xs, topk_idx=idxs, topk_weights=ws, w13=w13s, w2=w2s)


def _rank_main(rank: int, world_size: int, cases: list[str]) -> dict:
    out = {}
    for case in cases:
        inp = build_inputs(case, world_size)
        out[case] = moe_forward_a2a(inp["x"][rank], inp["topk_idx"][rank],
                                    inp["topk_weights"][rank], inp["w13"][rank], inp["w2"][rank],
                                    num_experts=E)
    # E=7 does not split over the ranks: rejected before any collective, so no rank hangs.
    inp = build_inputs("one_token", world_size)
    try:
        moe_forward_a2a(inp["x"][rank], inp["topk_idx"][rank], inp["topk_weights"][rank],
                        inp["w13"][rank], inp["w2"][rank], num_experts=7)
        out["bad_num_experts"] = None
    except ValueError as err:
        out["bad_num_experts"] = str(err)
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    cache: dict[int, list | Exception] = {}

    def get(world_size: int) -> list:
        if world_size not in cache:
            try:
                cache[world_size] = spawn(_rank_main, world_size=world_size, backend="gloo",
                                          args=(list(CASES),), timeout_s=120)
            except RuntimeError as err:  # remembered: one failing spawn per world size
                cache[world_size] = err
        if isinstance(cache[world_size], Exception):
            raise cache[world_size]
        return cache[world_size]
    return get


def _check_case(runs, case: str, world_size: int) -> dict:
    ys = [r[case] for r in runs(world_size)]
    inp = build_inputs(case, world_size)
    refs = moe_forward_ranks(inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w13"],
                             inp["w2"], out_dtype=torch.float32)
    for rank, (y, ref, x) in enumerate(zip(ys, refs, inp["x"])):
        assert y.shape == x.shape and y.dtype == torch.bfloat16, (rank, y.shape, y.dtype)
        assert not torch.isnan(y).any(), f"rank {rank}: NaN in y"
        if x.shape[0]:
            assert ref.norm() > 0  # the comparison below must be able to fail
        err = rel_error(y, ref)
        assert err <= TOLERANCE["bf16"], f"{case} R={world_size} rank {rank}: rel error {err:.3g}"
    return dict(ys=ys, inputs=inp)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", ["uniform", "one_token", "empty_rank", "one_expert"])
def test_matches_reference(runs, case: str, world_size: int) -> None:
    _check_case(runs, case, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_drop_picks(runs, world_size: int) -> None:
    got = _check_case(runs, "drop", world_size)
    for y, idx in zip(got["ys"], got["inputs"]["topk_idx"]):
        assert (idx == -1).any() and (idx >= 0).any()
        none = (idx == -1).all(dim=1)
        assert none.any()
        assert (y[none] == 0).all(), "a token with only -1 picks must get y = 0"


@pytest.mark.parametrize("world_size", [2, 4])
def test_idle_expert(runs, world_size: int) -> None:
    got = _check_case(runs, "idle_expert", world_size)
    picked = torch.cat(got["inputs"]["topk_idx"]).flatten()
    assert not (picked == IDLE_EXPERT).any()
    assert (picked == IDLE_EXPERT - 1).any() and (picked == IDLE_EXPERT + 1).any()


def test_single_rank(runs) -> None:
    # R=1: every collective is a local copy; all experts live on the one rank.
    for case in CASES:
        _check_case(runs, case, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_num_experts_not_divisible(runs, world_size: int) -> None:
    for rank_out in runs(world_size):
        msg = rank_out["bad_num_experts"]
        assert msg is not None and "num_experts" in msg and "divisible" in msg


# ---- spawn itself: a failing or stuck rank is reported, never a hang ----------------------

def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("rank one gives up")
    dist.barrier()  # rank 0 would wait here forever: spawn must kill it
    return rank


def _sleep_forever(rank: int, world_size: int) -> None:
    import time
    time.sleep(3600)


def test_spawn_returns_in_rank_order() -> None:
    assert spawn(_rank_and_size, world_size=2, backend="gloo", args=(5,)) == [(0, 2, 5), (1, 2, 5)]


def _rank_and_size(rank: int, world_size: int, extra: int) -> tuple:
    dist.barrier()
    return (dist.get_rank(), dist.get_world_size(), extra)


def test_spawn_reports_failing_rank() -> None:
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*KeyError.*rank one gives up"):
        spawn(_fail_on_rank_1, world_size=2, backend="gloo", timeout_s=60)


def test_spawn_timeout() -> None:
    with pytest.raises(RuntimeError, match="timed out"):
        spawn(_sleep_forever, world_size=1, backend="gloo", timeout_s=4)


# ---- bad inputs: validated before any collective, on a 1-rank group in this process -------

@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    # A file store (removed by destroy) rather than a TCP port: nothing to collide with.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _good_inputs() -> dict:
    inp = build_inputs("uniform", 1)
    return {k: v[0] for k, v in inp.items()}


def test_good_inputs_pass(one_rank_group) -> None:
    # The bad-input tests below change one argument of this call, which must work as is.
    inp = _good_inputs()
    y = moe_forward_a2a(inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w13"], inp["w2"],
                        num_experts=E)
    assert y.shape == inp["x"].shape and not torch.isnan(y).any()


@pytest.mark.parametrize("arg, bad, match", [
    ("x", lambda t: t.float(), "x must have dtype bfloat16"),
    ("w13", lambda t: t[:, :, :128].contiguous(), "w13 must have shape"),     # wrong hidden
    ("w13", lambda t: t[:E - 1].contiguous(), "w13 must have shape"),         # not E/R experts
    ("w2", lambda t: t.transpose(1, 2).contiguous(), "w2 must have shape"),
    ("topk_idx", lambda t: t.index_fill(0, torch.tensor([0]), E),            # id E: too big
     r"topk_idx values must lie in \[-1, 8\)"),
    ("topk_idx", lambda t: t.float(), "topk_idx must have dtype"),
    ("topk_weights", lambda t: t[:, :1].contiguous(), "topk_weights must have shape"),
    ("topk_weights", lambda t: t.double(), "topk_weights must have dtype float32"),
])
def test_bad_inputs(one_rank_group, arg: str, bad, match: str) -> None:
    inp = _good_inputs()
    inp[arg] = bad(inp[arg])
    with pytest.raises(ValueError, match=match):
        moe_forward_a2a(inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w13"], inp["w2"],
                        num_experts=E)


def test_needs_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    inp = _good_inputs()
    with pytest.raises(ValueError, match="initialised process group"):
        moe_forward_a2a(inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w13"], inp["w2"],
                        num_experts=E)
