"""The NVSHMEM baseline (moestream.tools.baselines.torch_symm) against the fp32 reference.

Two halves:

* CPU: the layout arithmetic, input validation, the clear errors when the ops / CUDA / NVSHMEM
  are missing, and the whole forward on R virtual ranks in one process with the two symmetric
  ops replaced by an emulation written from torch's kernels (``emulate_dispatch`` /
  ``emulate_combine``) between the module's public stages (``route``, ``run_experts``,
  ``weighted_sum``) on ``SymmA2AContext.unshared`` contexts: routing, tile padding, the regroup
  path and the weighted sum are the real code. Unused recv/send rows are filled with NaN first,
  so padding that leaked would show.
* GPU (``gpu`` + ``multigpu``, skipped without 2 GPUs, the ops or NVSHMEM): the real ops on 2
  ranks spawned with NCCL; every rank rebuilds the global view from a seed, the parent checks
  y against ``moestream.reference`` and the ops' splits/offsets against the emulation's, and
  repeated calls run under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync).
"""
from __future__ import annotations

import zlib

import pytest
import torch

from moestream.tools.baselines.torch_symm import (
    ID_COLUMNS,
    SymmA2AContext,
    SymmA2ALayout,
    SymmUnavailableError,
    check_symm_ops,
    check_symm_support,
    default_expert_groups,
    moe_forward_symm,
    route,
    run_experts,
    symm_unavailable_reason,
    weighted_sum,
)
from moestream.config import MoEConfig
from moestream.reference import moe_forward_ranks
from moestream.testing import (
    TOLERANCE,
    make_routing,
    make_tokens,
    make_weights,
    rel_error,
)

H, I, K = 128, 128, 2          # small (MoEConfig wants multiples of 128): CPU loops
IDLE_EXPERT = 1                # owned by rank 0 for every R tested; experts 0 and 2 stay busy

# name -> (tokens per rank as a function of R, routing mode)
CASES = {
    "uniform": (lambda R: [16 + 7 * r for r in range(R)], "uniform"),
    "one_token": (lambda R: [1] * R, "uniform"),
    # rank 0 sends nothing but still computes and returns rows for the others
    "empty_rank": (lambda R: [0] + [9] * (R - 1), "uniform"),
    # ~35% of picks are -1, including a whole token (y row 0)
    "drop": (lambda R: [24] * R, "drop"),
    # an expert with no token: an empty tile (still A padding rows) between busy ones
    "idle_expert": (lambda R: [20] * R, "idle_expert"),
    # worst case of the sizing: every rank at max_tokens, every pick to the last expert
    "one_expert": (lambda R: [MAX_TOKENS] * R, "one_expert"),
}
MAX_TOKENS = 40


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def build_inputs(case: str, world_size: int, num_experts: int, *, hidden: int = H,
                 intermediate: int = I, top_k: int = K) -> dict:
    """The global view of one case: per-rank lists x, topk_idx, topk_weights, w13, w2."""
    tokens_fn, mode = CASES[case]
    tokens = tokens_fn(world_size)
    g = torch.Generator().manual_seed(_seed(case, world_size, num_experts, hidden, top_k))
    cfg = MoEConfig(hidden=hidden, intermediate=intermediate, num_experts=num_experts,
                    top_k=top_k, max_tokens_per_rank=MAX_TOKENS)
    w13s, w2s = make_weights(cfg, world_size, generator=g)
    xs, idxs, ws = [], [], []
    for T in tokens:
        xs.append(make_tokens(T, hidden, generator=g))
        idx, w = make_routing(T, num_experts, top_k, generator=g,
                              drop=0.35 if mode == "drop" else 0.0)
        if mode == "drop" and T:
            idx[0] = -1
            w[0] = 0.0
        if mode == "one_expert":
            idx.fill_(num_experts - 1)
        if mode == "idle_expert":
            for t in range(T):
                row = idx[t].tolist()
                if IDLE_EXPERT in row:
                    free = [e for e in range(num_experts) if e not in row and e != IDLE_EXPERT]
                    idx[t, row.index(IDLE_EXPERT)] = free[t % len(free)]
        idxs.append(idx)
        ws.append(w)
    return dict(x=xs, topk_idx=idxs, topk_weights=ws, w13=w13s, w2=w2s)


def reference(inp: dict) -> list[torch.Tensor]:
    return moe_forward_ranks(inp["x"], inp["topk_idx"], inp["topk_weights"], inp["w13"],
                             inp["w2"], out_dtype=torch.float32)


def check_outputs(ys, inp: dict, what: str) -> None:
    for rank, (y, ref, x, idx) in enumerate(zip(ys, reference(inp), inp["x"], inp["topk_idx"])):
        assert y.shape == x.shape and y.dtype == torch.bfloat16, (what, rank, y.shape, y.dtype)
        assert not torch.isnan(y).any(), f"{what} rank {rank}: NaN in y"
        if x.shape[0]:
            assert ref.norm() > 0
        err = rel_error(y, ref)
        assert err <= TOLERANCE["bf16"], f"{what} rank {rank}: rel error {err:.3g}"
        none = (idx == -1).all(dim=1)
        assert (y[none] == 0).all(), f"{what} rank {rank}: a token with only -1 picks"


# ---- the ops, emulated from torch's kernels (nvshmem_extension.cu) ----------------------------

def _exclusive_cumsum(v: list[int]) -> list[int]:
    out, acc = [], 0
    for n in v:
        out.append(acc)
        acc += n
    return out


def expected_dispatch_splits_offsets(in_splits: list[list[int]], dest: int, groups: int,
                                     major_align: int) -> torch.Tensor:
    """[2, R*G] out_splits_offsets of all_to_all_vdev_2d on rank ``dest``, from every rank's
    in_splits: group-major chunks (g*R + src), each group tile padded to a multiple of
    major_align and at least major_align rows."""
    R, G, A = len(in_splits), groups, major_align
    splits, offsets, start = [], [], 0
    for g in range(G):
        tile = [in_splits[s][dest * G + g] for s in range(R)]
        for s, off in zip(range(R), _exclusive_cumsum(tile)):
            splits.append(tile[s])
            offsets.append(start + off)
        start += max(-(-sum(tile) // A) * A, A)
    return torch.tensor([splits, offsets], dtype=torch.int64)


def emulate_dispatch(ctxs: list) -> None:
    """all_to_all_vdev_2d(send, recv, in_splits, disp_splits_offsets, _, major_align) on all
    ranks at once."""
    L = ctxs[0].layout
    R, G = L.num_ranks, L.expert_groups
    ins = [c.in_splits.tolist() for c in ctxs]
    src_off = [_exclusive_cumsum(s) for s in ins]
    for d, cd in enumerate(ctxs):
        so = expected_dispatch_splits_offsets(ins, d, G, L.major_align)
        for g in range(G):
            for s in range(R):
                n, o = int(so[0, g * R + s]), int(so[1, g * R + s])
                so_src = src_off[s][d * G + g]
                assert o + n <= cd.recv.shape[0], "recv buffer too small"
                cd.recv[o:o + n] = ctxs[s].send[so_src:so_src + n]
        cd.disp_splits_offsets.copy_(so)


def emulate_combine(ctxs: list) -> None:
    """all_to_all_vdev_2d_offset(recv, send, disp_splits_offsets, comb_splits_offsets, _) on
    all ranks at once: chunk (g, d) of rank s returns to rank d, rank-major and packed."""
    L = ctxs[0].layout
    R, G = L.num_ranks, L.expert_groups
    for d, cd in enumerate(ctxs):
        splits, offsets, pos = [], [], 0
        for s in range(R):
            so = ctxs[s].disp_splits_offsets
            for g in range(G):
                n, o = int(so[0, g * R + d]), int(so[1, g * R + d])
                cd.send[pos:pos + n] = ctxs[s].recv[o:o + n]
                splits.append(n)
                offsets.append(pos)
                pos += n
        cd.comb_splits_offsets.copy_(torch.tensor([splits, offsets], dtype=torch.int64))


def emulated_forward(inp: dict, world_size: int, num_experts: int, *, major_align: int,
                     expert_groups: int | None, hidden: int = H, top_k: int = K) -> tuple:
    """moe_forward_symm's stages on ``world_size`` virtual ranks, the ops emulated."""
    layout = SymmA2ALayout(max_tokens=MAX_TOKENS, hidden=hidden, top_k=top_k,
                           num_experts=num_experts, num_ranks=world_size,
                           major_align=major_align, expert_groups=expert_groups)
    ctxs = [SymmA2AContext.unshared(layout, r) for r in range(world_size)]
    for c in ctxs:   # stale rows: NaN, so that padding or unsent rows used by mistake show up
        c.send.fill_(float("nan"))
        c.recv.fill_(float("nan"))
    plans = [route(c, x, idx) for c, x, idx in zip(ctxs, inp["x"], inp["topk_idx"])]
    emulate_dispatch(ctxs)
    for c, w13, w2 in zip(ctxs, inp["w13"], inp["w2"]):
        run_experts(c, w13, w2)
    emulate_combine(ctxs)
    ys = [weighted_sum(c, p, w) for c, p, w in zip(ctxs, plans, inp["topk_weights"])]
    return ys, ctxs


# ---- CPU: sizes ----------------------------------------------------------------------------

@pytest.mark.parametrize("local, groups", [(1, 1), (4, 4), (16, 16), (17, 1), (24, 12),
                                           (32, 16), (64, 16), (128, 16), (256, 16)])
def test_default_expert_groups(local: int, groups: int) -> None:
    assert default_expert_groups(local) == groups


@pytest.mark.parametrize("R, E, G, A, regroup", [(2, 8, None, 16, False), (2, 256, None, 16, True),
                                                 (4, 8, 1, 1, True), (1, 8, 8, 5, False)])
def test_layout_sizes(R: int, E: int, G, A: int, regroup: bool) -> None:
    lay = SymmA2ALayout(max_tokens=100, hidden=7168, top_k=8, num_experts=E, num_ranks=R,
                        major_align=A, expert_groups=G)
    e = E // R
    g = default_expert_groups(e) if G is None else G
    assert lay.local_experts == e and lay.expert_groups == g and lay.regroup == regroup
    assert lay.experts_per_group == e // g
    W = 7168 + (ID_COLUMNS if regroup else 0)
    assert lay.row_width == W
    assert lay.send_rows == 800
    assert lay.recv_rows == R * 800 + g * A       # all picks of all ranks + a tile pad per group
    assert lay.num_splits == R * g
    shapes = lay.buffer_shapes()
    assert shapes["send"] == ((800, W), torch.bfloat16)
    assert shapes["recv"] == ((R * 800 + g * A, W), torch.bfloat16)
    assert shapes["in_splits"] == ((R * g,), torch.int64)
    assert shapes["disp_splits_offsets"] == ((2, R * g), torch.int64)
    assert shapes["comb_splits_offsets"] == ((2, R * g), torch.int64)
    assert lay.nbytes == (800 + R * 800 + g * A) * W * 2 + 5 * R * g * 8


def test_layout_dsv3_two_ranks() -> None:
    # the benchmark's biggest case: dsv3, 2 ranks, 4096 tokens -> 128 local experts, 16 groups
    lay = SymmA2ALayout(max_tokens=4096, hidden=7168, top_k=8, num_experts=256, num_ranks=2)
    assert (lay.expert_groups, lay.experts_per_group, lay.row_width) == (16, 8, 7176)
    assert lay.recv_rows == 2 * 4096 * 8 + 16 * 16
    assert 1.4e9 < lay.nbytes < 1.5e9


@pytest.mark.parametrize("kw, err, match", [
    (dict(max_tokens=0), ValueError, "max_tokens must be a positive int"),
    (dict(top_k=True), ValueError, "top_k must be a positive int"),
    (dict(major_align=0), ValueError, "major_align must be a positive int"),
    (dict(num_experts=7), ValueError, "divisible by the number of ranks"),
    (dict(expert_groups=3), ValueError, "must divide the local expert count"),
    (dict(expert_groups=0), ValueError, "expert_groups must be a positive int"),
    (dict(num_ranks=32, num_experts=64), SymmUnavailableError, "at most 16 ranks"),
])
def test_layout_rejects(kw: dict, err, match: str) -> None:
    args = dict(max_tokens=8, hidden=128, top_k=2, num_experts=8, num_ranks=2) | kw
    with pytest.raises(err, match=match):
        SymmA2ALayout(**args)


def test_unavailable_error_is_runtime_error() -> None:
    # the benchmark may catch either
    assert issubclass(SymmUnavailableError, NotImplementedError)
    assert issubclass(SymmUnavailableError, RuntimeError)


# ---- CPU: availability -----------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_needs_cuda() -> None:
    with pytest.raises(SymmUnavailableError, match="needs CUDA"):
        check_symm_support()
    assert "CUDA" in symm_unavailable_reason()
    # the context fails the same way before it needs a process group
    with pytest.raises(SymmUnavailableError, match="needs CUDA"):
        SymmA2AContext(8, H, K, 8)


class SymmMemOps:
    """Stands in for torch.ops.symm_mem: ``renamed`` maps an op's name to another real op's
    name, or to None for an op this torch would not register; other names pass through."""

    def __init__(self, real, renamed: dict) -> None:
        self.real, self.renamed = real, renamed

    def __getattr__(self, name: str):
        target = self.renamed.get(name, name)
        if target is None:
            raise AttributeError(f"'_OpNamespace' 'symm_mem' object has no attribute '{name}'")
        return getattr(self.real, target)


def test_missing_op_is_named(monkeypatch) -> None:
    monkeypatch.setattr(torch.ops, "symm_mem",
                        SymmMemOps(torch.ops.symm_mem, {"all_to_all_vdev_2d_offset": None}))
    with pytest.raises(SymmUnavailableError,
                       match=r"no torch\.ops\.symm_mem\.all_to_all_vdev_2d_offset"):
        check_symm_support()
    assert "all_to_all_vdev_2d_offset" in symm_unavailable_reason()


def test_other_schema_is_named(monkeypatch) -> None:
    # an op without major_align (the 1D all_to_all_vdev has the first five arguments)
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        pytest.skip("this torch has no all_to_all_vdev to stand in for an old schema")
    monkeypatch.setattr(torch.ops, "symm_mem",
                        SymmMemOps(torch.ops.symm_mem, {"all_to_all_vdev_2d": "all_to_all_vdev"}))
    with pytest.raises(SymmUnavailableError, match=r"all_to_all_vdev_2d has schema .*major_align"):
        check_symm_support()


def test_installed_schemas_match() -> None:
    # the installed torch registers both ops (CPU builds too) with the relied-on schemas
    check_symm_ops()


# ---- CPU: argument checks ---------------------------------------------------------------------

def _unshared_call_args(**changes) -> tuple[dict, SymmA2AContext]:
    inp = build_inputs("uniform", 1, 8)
    args = dict(x=inp["x"][0], topk_idx=inp["topk_idx"][0], topk_weights=inp["topk_weights"][0],
                w13=inp["w13"][0], w2=inp["w2"][0], num_experts=8)
    args.update(changes)
    layout = SymmA2ALayout(max_tokens=MAX_TOKENS, hidden=H, top_k=K, num_experts=8, num_ranks=1)
    return args, SymmA2AContext.unshared(layout, 0)


def test_good_arguments_reach_the_ops() -> None:
    # everything validates; the unshared (test) context is then refused before any op
    args, ctx = _unshared_call_args()
    with pytest.raises(RuntimeError, match="no symmetric memory"):
        moe_forward_symm(**args, ctx=ctx, validate=True)


@pytest.mark.parametrize("change, match", [
    (lambda a: dict(x=a["x"].float()), "x must have dtype bfloat16"),
    (lambda a: dict(x=torch.zeros(MAX_TOKENS + 1, H, dtype=torch.bfloat16),
                    topk_idx=torch.zeros(MAX_TOKENS + 1, K, dtype=torch.int32),
                    topk_weights=torch.zeros(MAX_TOKENS + 1, K)), "more than max_tokens"),
    (lambda a: dict(topk_idx=a["topk_idx"][:, :1].contiguous(),
                    topk_weights=a["topk_weights"][:, :1].contiguous()), "top_k=2 columns"),
    (lambda a: dict(topk_idx=a["topk_idx"].float()), "topk_idx must have dtype"),
    (lambda a: dict(topk_weights=a["topk_weights"].double()),
     "topk_weights must have dtype float32"),
    (lambda a: dict(num_experts=16), r"num_experts \(16\) differs from the context's \(8\)"),
    (lambda a: dict(num_experts=0), "num_experts must be a positive int"),
    (lambda a: dict(w13=a["w13"][:4].contiguous()), "w13 must have shape"),
    (lambda a: dict(w2=a["w2"][:, :, :64].contiguous()), "w2 must have shape"),
    (lambda a: dict(x=a["x"][:, :32].contiguous()), r"x must have shape \(T, 128\)"),
])
def test_bad_arguments(change, match: str) -> None:
    args, ctx = _unshared_call_args()
    args.update(change(args))
    with pytest.raises(ValueError, match=match):
        moe_forward_symm(**args, ctx=ctx)


def test_range_checked_only_with_validate() -> None:
    args, ctx = _unshared_call_args()
    args["topk_idx"] = args["topk_idx"].index_fill(0, torch.tensor([0]), 8)
    with pytest.raises(ValueError, match=r"topk_idx values must lie in \[-1, 8\)"):
        moe_forward_symm(**args, ctx=ctx, validate=True)
    with pytest.raises(RuntimeError, match="no symmetric memory"):   # not read otherwise
        moe_forward_symm(**args, ctx=ctx)


def test_bad_ctx() -> None:
    args, ctx = _unshared_call_args()
    with pytest.raises(ValueError, match="ctx must be a SymmA2AContext"):
        moe_forward_symm(**args, ctx=None)
    ctx.close()
    with pytest.raises(RuntimeError, match="closed"):
        moe_forward_symm(**args, ctx=ctx)


# ---- CPU: the forward on virtual ranks, ops emulated -----------------------------------------

def test_emulated_dispatch_layout() -> None:
    # the example of torch's docstring: c0 has 5 rows and d0 7 (12 in expert 0's tile); with
    # major_align 16 expert 1's tile starts at 16; an empty tile still takes 16 rows
    so = expected_dispatch_splits_offsets([[5, 3, 0], [7, 0, 0]], 0, 3, 16)
    assert so.tolist() == [[5, 7, 3, 0, 0, 0], [0, 5, 16, 19, 32, 32]]
    so = expected_dispatch_splits_offsets([[5, 3, 0], [7, 0, 0]], 0, 3, 1)
    assert so.tolist() == [[5, 7, 3, 0, 0, 0], [0, 5, 12, 15, 15, 15]]
    # major_align 1: tiles packed, but an empty tile still takes one row
    so = expected_dispatch_splits_offsets([[5, 0, 3], [7, 0, 0]], 0, 3, 1)
    assert so.tolist() == [[5, 7, 0, 0, 3, 0], [0, 5, 12, 12, 13, 16]]


# (major_align, expert_groups): direct path (G = E) with and without padding, an odd
# alignment, and the regroup path with 2 and 1 groups
PATHS = [(16, None), (1, None), (5, None), (8, 2), (1, 1)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("major_align, expert_groups", PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_matches_reference(case: str, world_size: int, major_align: int,
                                    expert_groups) -> None:
    inp = build_inputs(case, world_size, 8)
    ys, ctxs = emulated_forward(inp, world_size, 8, major_align=major_align,
                                expert_groups=expert_groups)
    check_outputs(ys, inp, f"{case} R={world_size} A={major_align} G={expert_groups}")
    for c, idx in zip(ctxs, inp["topk_idx"]):
        # every pick that went out came back: combine splits = dispatch in_splits
        assert torch.equal(c.comb_splits_offsets[0], c.in_splits)
        assert c.in_splits.sum() == (idx >= 0).sum()


def test_emulated_worst_case_fills_recv() -> None:
    # every pick of every rank lands on the last rank's last expert: its recv holds R*P rows
    # (plus tile padding) and fits
    R = 4
    inp = build_inputs("one_expert", R, 8)
    ys, ctxs = emulated_forward(inp, R, 8, major_align=16, expert_groups=None)
    check_outputs(ys, inp, "worst case")
    last = ctxs[-1]
    used = int((last.disp_splits_offsets[1] + last.disp_splits_offsets[0]).max())
    assert used == R * MAX_TOKENS * K + (last.layout.expert_groups - 1) * 16
    assert used <= last.layout.recv_rows


@pytest.mark.parametrize("case", ["uniform", "drop", "idle_expert", "empty_rank"])
def test_emulated_many_local_experts(case: str) -> None:
    # 64 experts on 2 ranks: 32 local experts, above the ops' 16 -> 16 groups of 2 (regroup)
    inp = build_inputs(case, 2, 64, top_k=4)
    ys, ctxs = emulated_forward(inp, 2, 64, major_align=16, expert_groups=None, top_k=4)
    assert ctxs[0].layout.expert_groups == 16 and ctxs[0].layout.regroup
    check_outputs(ys, inp, f"{case} E=64 R=2")


# ---- GPU: the real ops on 2 ranks ------------------------------------------------------------

WORLD = 2
_REASON = symm_unavailable_reason()
needs_symm = pytest.mark.skipif(_REASON is not None, reason=f"torch-symm unavailable: {_REASON}")

# name -> (case, num_experts, top_k, major_align, expert_groups)
GPU_RUNS = {
    "uniform direct A=16": ("uniform", 8, 2, 16, None),
    "one_token direct A=1": ("one_token", 8, 2, 1, None),
    "empty_rank direct A=16": ("empty_rank", 8, 2, 16, None),
    "drop direct A=16": ("drop", 8, 2, 16, None),
    "idle_expert direct A=16": ("idle_expert", 8, 2, 16, None),
    "idle_expert direct A=1": ("idle_expert", 8, 2, 1, None),
    "one_expert (worst case) direct A=16": ("one_expert", 8, 2, 16, None),
    "uniform regroup G=2 A=8": ("uniform", 8, 2, 8, 2),
    "drop regroup G=1 A=1": ("drop", 8, 2, 1, 1),
    "empty_rank regroup E=64 (32 local)": ("empty_rank", 64, 4, 16, None),
    "idle_expert regroup E=64 (32 local)": ("idle_expert", 64, 4, 16, None),
    "one_expert regroup E=64 (32 local)": ("one_expert", 64, 4, 16, None),
}
GPU_HIDDEN, GPU_INTER = 256, 128
REPEAT_CALLS = 6


def _repeat_inputs(world: int, call: int) -> dict:
    case = ("uniform", "drop", "empty_rank", "idle_expert")[call % 4]
    return build_inputs(case, world, 64, hidden=GPU_HIDDEN, intermediate=GPU_INTER, top_k=4)


def _gpu_main(rank: int, world: int) -> dict:
    import torch.distributed as dist
    dev = torch.device("cuda", rank)
    out: dict = {"runs": {}}

    def to_dev(inp):
        return [inp[k][rank].to(dev) for k in ("x", "topk_idx", "topk_weights", "w13", "w2")]

    for name, (case, E, top_k, A, G) in GPU_RUNS.items():
        inp = build_inputs(case, world, E, hidden=GPU_HIDDEN, intermediate=GPU_INTER, top_k=top_k)
        ctx = SymmA2AContext(MAX_TOKENS, GPU_HIDDEN, top_k, E, major_align=A, expert_groups=G)
        ctx.recv.fill_(float("nan"))    # padding rows stay NaN: must not reach y
        ctx.send.fill_(float("nan"))
        x, idx, w, w13, w2 = to_dev(inp)
        y = moe_forward_symm(x, idx, w, w13, w2, num_experts=E, ctx=ctx)
        torch.cuda.synchronize(dev)
        # the ops' splits/offsets against the emulation's (every rank knows the global view)
        L = ctx.layout
        in_splits = []
        for t in inp["topk_idx"]:
            c = torch.bincount(t[t >= 0].long(), minlength=E)
            in_splits.append(c.view(L.num_splits, L.experts_per_group).sum(1).tolist())
        want_so = expected_dispatch_splits_offsets(in_splits, rank, L.expert_groups, A)
        got_comb = ctx.comb_splits_offsets.cpu()
        mine = torch.tensor(in_splits[rank])
        out["runs"][name] = dict(
            y=y, in_splits_ok=ctx.in_splits.cpu().tolist() == in_splits[rank],
            disp_so=ctx.disp_splits_offsets.cpu(), want_disp_so=want_so,
            comb_ok=torch.equal(got_comb[0], mine)
            and got_comb[1].tolist() == _exclusive_cumsum(mine.tolist()))
        ctx.close()

    # repeated calls on one context: no host sync, no race between back-to-back calls
    ctx = SymmA2AContext(MAX_TOKENS, GPU_HIDDEN, 4, 64)
    calls = [to_dev(_repeat_inputs(world, c)) for c in range(REPEAT_CALLS)]
    moe_forward_symm(*calls[0][:5], num_experts=64, ctx=ctx)   # first call: lazy inits
    torch.cuda.synchronize(dev)
    dist.barrier()
    ys, sync_error = [], None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, idx, w, w13, w2 in calls:
            ys.append(moe_forward_symm(x, idx, w, w13, w2, num_experts=64, ctx=ctx))
    except RuntimeError as exc:
        sync_error = f"{type(exc).__name__}: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize(dev)
    out["repeat"] = dict(ys=ys, sync_error=sync_error)
    ctx.close()
    return out


@pytest.fixture(scope="module")
def gpu_runs() -> list:
    from moestream.tools.distributed import spawn
    return spawn(_gpu_main, world_size=WORLD, backend="nccl", timeout_s=600)


@pytest.mark.parametrize("name", list(GPU_RUNS))
@pytest.mark.gpu
@pytest.mark.multigpu
@needs_symm
def test_gpu_matches_reference(gpu_runs, name: str) -> None:
    case, E, top_k, _, _ = GPU_RUNS[name]
    inp = build_inputs(case, WORLD, E, hidden=GPU_HIDDEN, intermediate=GPU_INTER, top_k=top_k)
    check_outputs([r["runs"][name]["y"] for r in gpu_runs], inp, name)


@pytest.mark.parametrize("name", list(GPU_RUNS))
@pytest.mark.gpu
@pytest.mark.multigpu
@needs_symm
def test_gpu_op_semantics(gpu_runs, name: str) -> None:
    # what the module relies on: in_splits as built, the dispatch's padded group-major layout,
    # and the combine returning every chunk rank-major and packed
    for rank, r in enumerate(gpu_runs):
        run = r["runs"][name]
        assert run["in_splits_ok"], (name, rank)
        assert torch.equal(run["disp_so"], run["want_disp_so"]), (
            name, rank, run["disp_so"].tolist(), run["want_disp_so"].tolist())
        assert run["comb_ok"], (name, rank)


@pytest.mark.gpu
@pytest.mark.multigpu
@needs_symm
def test_gpu_repeated_calls_without_host_sync(gpu_runs) -> None:
    for rank, r in enumerate(gpu_runs):
        assert r["repeat"]["sync_error"] is None, f"rank {rank}: {r['repeat']['sync_error']}"
    for c in range(REPEAT_CALLS):
        check_outputs([r["repeat"]["ys"][c] for r in gpu_runs], _repeat_inputs(WORLD, c),
                      f"repeated call {c}")
