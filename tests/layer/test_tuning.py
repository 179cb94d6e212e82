"""The tuning policy and its settings: what ``tuning.select`` picks on an H200 for every model
shape, format and call size (one snapshot table), the properties every pick has, each named
rule on its own, and the ValueErrors of bad settings.

The snapshot is tests/data/tuning_snapshot.txt, one line per call: the fields that differ from
``Tuning()``. A policy change shows there as a diff to read; after checking it, rewrite the
file with ``MOESTREAM_UPDATE_SNAPSHOT=1 pytest tests/layer/test_tuning.py``.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path

import pytest

from conftest import H200, hopper
from moestream import MoEConfig
from moestream.tuning import (FP4W_EXPAND_MIN_ROWS, FP8_L2_TILE_MIN_I, L1, L2, ONE_DOT_L1_STAGES,
                              ONE_DOT_SHALLOW_MIN_HIDDEN, ONE_WAVE, Copy, Device, Fused, Tuning,
                              combine_parts_for, decode_rows_for, fp8_l1_split_for,
                              fused_l2_group_for, l1_group_m_for, one_dot_for, select,
                              tail_rows_for)

SNAPSHOT = Path(__file__).parents[1] / "data" / "tuning_snapshot.txt"
TOKENS = (1, 8, 128, 512, 2048, 8192)


def _grid():
    """(label, config, tokens, ranks, impl): the four shapes in every format, EP2 and one GPU
    (dsv3 and v4flash with one EP8 rank's 32 experts there), decode to prefill sizes."""
    for shape, dtype, T, R, impl in itertools.product(
            ("qwen3", "mixtral", "dsv3", "v4flash"), ("bf16", "fp8", "fp4w"), TOKENS, (1, 2),
            ("staged", "fused")):
        if impl == "fused" and dtype == "fp4w":
            continue   # the fused launch runs bf16 and fp8
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=T, dtype=dtype)
        if R == 1 and shape in ("dsv3", "v4flash"):
            cfg = cfg.with_(num_experts=32)
        yield f"{shape} {dtype} T={T} R={R} E={cfg.num_experts} {impl}", cfg, T, R, impl


def _changed(t: Tuning) -> str:
    """The dotted fields of ``t`` that differ from ``Tuning()``."""
    out = []
    for name in Tuning.dotted_names():
        part, dot, field = name.partition(".")
        get = (lambda x: getattr(getattr(x, part), field)) if dot else \
            (lambda x: getattr(x, name))
        if get(t) != get(Tuning()):
            out.append(f"{name}={get(t)}")
    return " ".join(out)


def test_the_policy_on_an_h200_matches_the_snapshot():
    lines = [f"{label}: {_changed(select(cfg, T, ranks=R, device=H200, impl=impl))}"
             for label, cfg, T, R, impl in _grid()]
    text = "\n".join(lines) + "\n"
    if os.environ.get("MOESTREAM_UPDATE_SNAPSHOT") == "1":
        SNAPSHOT.write_text(text)
    want = SNAPSHOT.read_text().splitlines()
    changed = [f"- {a}\n+ {b}" for a, b in zip(want, lines) if a != b]
    assert len(want) == len(lines) and not changed, "\n".join(changed[:12])


def test_every_pick_is_valid_for_its_call():
    for label, cfg, T, R, impl in _grid():
        t = select(cfg, T, ranks=R, device=H200, impl=impl)
        t.check(cfg)                                   # tiles divide their dims, pieces fit
        assert t.wait is False and t.use_tma is None, label   # stream order; TMA on Hopper
        rows = T * R * cfg.top_k / cfg.num_experts     # mean rows per expert
        assert (t.decode_rows > 0) <= (rows < 32), label      # pieces only where rows are few
        if impl == "fused":
            bn2 = t.l2_tile(cfg)[0]
            assert (cfg.hidden // bn2) % t.fused.l2_group == 0, label
            assert t.fused.l2_group == 1 or not t.decode_rows, label
            assert t.fused.dispatch_programs == H200.sms, label
            assert (t.fused.per_sm, t.fused.wave_blocks == ONE_WAVE) == (
                (2, True) if t.decode_rows else (1, False)), label
        else:
            assert (t.l1.tail_rows, t.l2.tail_rows) == (0, 0) or not t.decode_rows, label


def test_without_a_gpu_the_interpreter_keeps_the_plain_settings():
    # the plain settings, but fp4w weights are expanded wherever the GPU's policy would
    cfg = MoEConfig.from_shape("qwen3", max_tokens_per_rank=8)
    for impl in ("staged", "fused"):
        assert select(cfg, 8, ranks=2, device=Device(), impl=impl) == Tuning()
    fp4w = cfg.with_(dtype="fp4w")
    assert select(fp4w, 8, ranks=2, device=Device()) == Tuning()
    assert select(fp4w, 8, ranks=2, device=Device(), impl="fused") == Tuning(fp4w_expand=True)
    with pytest.raises(ValueError, match="impl must be 'staged' or 'fused'"):
        select(cfg, 8, ranks=2, device=H200, impl="chunked")


# ---- each named rule --------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["staged", "fused"])
def test_fp4w_expands_from_a_few_blocks_per_expert_and_then_runs_as_fp8(impl):
    # staged: expanded from FP4W_EXPAND_MIN_ROWS rows per expert on average, decoded in the
    # GEMMs below; fused: always (it has no MXFP4 decode). Expanded, the call takes the fp8
    # call's tuning
    cfg = MoEConfig.from_shape("dsv3", num_experts=32, max_tokens_per_rank=8192,
                               dtype="fp4w")
    for tokens in (1, 8, 64, 512, 2048, 8192):
        t = select(cfg, tokens, ranks=1, device=H200, impl=impl)
        rows = tokens * cfg.top_k / cfg.num_experts
        assert t.fp4w_expand == (impl == "fused" or rows >= FP4W_EXPAND_MIN_ROWS), tokens
        if t.fp4w_expand:
            fp8 = select(cfg.with_(dtype="fp8"), tokens, ranks=1, device=H200, impl=impl)
            assert t == fp8.with_(fp4w_expand=True)
            assert not t.decodes_fp4w(cfg) and t.fp4w_pieces(cfg) == 0
        else:
            assert t.decodes_fp4w(cfg) and t.fp4w_pieces(cfg) > 0


def test_gpu_defaults_follow_the_dims():
    # bf16 L2 128x256 where 256 divides hidden, else 128x128 two per SM; fp8 L2 as 128-row
    # tiles from FP8_L2_TILE_MIN_I on, 64-row pieces below (qwen3's K = 768)
    wide = hopper(128, hidden=7168, intermediate=2048)
    narrow = hopper(128, hidden=7296, intermediate=2048)
    assert (wide.l2.block_n, wide.l2.warps, wide.l2.stages) == (256, 8, 4)
    assert (narrow.l2.block_n, narrow.l2.warps, narrow.l2.stages) == (128, 4, 3)
    tile = hopper(128, "fp8", hidden=7168, intermediate=FP8_L2_TILE_MIN_I)
    pieces = hopper(128, "fp8", hidden=2048, intermediate=768)
    assert (tile.l2.split_m, tile.l2.warps, pieces.l2.split_m, pieces.l2.warps) == (1, 8, 2, 4)
    assert hopper(64, "fp8", hidden=2048, intermediate=768).l2.split_m == 1


def test_l1_groups_where_an_m_block_has_many_column_blocks():
    # an H200 at the model shapes' L1 column blocks (intermediate / 128): mixtral's 112
    # would leave about one m-block in flight with n fastest; the others keep n fastest
    sms = 132
    assert l1_group_m_for(14336 // 128, sms) == 8           # mixtral
    for intermediate in (2048, 768):                        # dsv3 / v4flash, qwen3
        assert l1_group_m_for(intermediate // 128, sms) == 1
    assert l1_group_m_for(33, sms) == 1 and l1_group_m_for(34, sms) == 8


def test_one_dot_l1_from_two_m_blocks_per_expert():
    # the L1 as one gate-and-up MMA once the mean rows per expert reach 2 * block_m; EP2
    def on(tokens, experts, top_k):
        return one_dot_for(tokens=tokens, ranks=2, top_k=top_k, num_experts=experts,
                           block_m=128)
    assert on(2048, 128, 8) and on(8192, 128, 8)            # qwen3: 256 / 1024 rows
    assert not on(2048, 256, 8) and on(4096, 256, 8)        # dsv3: 128 / 256 rows
    assert not on(2048, 256, 6) and on(8192, 256, 6)        # v4flash: 96 / 384 rows
    assert on(512, 8, 2) and not on(511, 8, 2)              # mixtral: the boundary at 256
    assert not on(0, 8, 2)                                  # an empty call


@pytest.mark.parametrize("shape, stages_l1", [
    ("dsv3", ONE_DOT_L1_STAGES),      # hidden 7168
    ("mixtral", ONE_DOT_L1_STAGES),   # hidden 4096 (the threshold)
    ("qwen3", None),                  # hidden 2048: the L1's own depth
])
def test_one_dot_l1_depth_follows_hidden(shape, stages_l1):
    # whole-tile calls set L1.one_dot_stages by the L1's K (hidden); the other L1 forms and
    # the fused launch keep the L1's depth
    assert ONE_DOT_SHALLOW_MIN_HIDDEN == 4096
    for tokens in (2048, 8192):
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=tokens)
        t = select(cfg, tokens, ranks=2, device=H200, impl="staged")
        assert t.l1.one_dot_stages == stages_l1, tokens
        depth = hopper(128, hidden=cfg.hidden, intermediate=cfg.intermediate).l1.stages
        assert t.l1.stages == depth, tokens
        assert select(cfg, tokens, ranks=2, device=H200, impl="fused").l1.stages == depth


@pytest.mark.parametrize("tokens, ranks, top_k, experts, block_m, want", [
    (1, 2, 8, 256, 128, 16),     # dsv3 decode: ~0.06 rows per expert
    (128, 2, 8, 256, 128, 16),   # dsv3 T=128: mean 8, rarely past 32 rows
    (256, 2, 8, 256, 128, 16),   # mean 16: 16 + 12 + 1 <= 32
    (512, 2, 8, 256, 128, 0),    # mean 32: 128-row tiles
    (32, 2, 2, 8, 128, 16),      # mixtral T=32: mean 16
    (64, 2, 2, 8, 128, 0),       # mixtral T=64: mean 32, off
    (8, 2, 2, 8, 16, 16),        # block_m 16 takes pieces of 16
    (1, 2, 2, 8, 24, 0),         # block_m 24 (not a multiple of 16): off
    (0, 2, 8, 256, 128, 16),     # no tokens: nothing to lose
])
def test_decode_rows_rule(tokens, ranks, top_k, experts, block_m, want):
    assert decode_rows_for(tokens=tokens, ranks=ranks, top_k=top_k, num_experts=experts,
                           block_m=block_m) == want


@pytest.mark.parametrize("tokens, top_k, experts, block_m, dtype, split, want", [
    (512, 8, 256, 128, "fp8", 2, (32, 32)),    # dsv3 T=512: mean 32 rows, 64-row L2 pieces
    (512, 8, 128, 128, "fp8", 2, (32, 32)),    # qwen3 T=512: mean 64 = block_m / 2
    (1024, 8, 128, 128, "fp8", 2, (0, 0)),     # mean 128: whole tiles, the flat L2 loop
    (2048, 6, 256, 128, "fp8", 2, (0, 0)),     # v4flash T=2048: mean 96, off
    (512, 8, 256, 128, "bf16", 1, (32, 0)),    # bf16: the L1 only
    (2048, 8, 256, 128, "bf16", 1, (0, 0)),    # mean 128: off
    (512, 8, 256, 128, "fp4w", 1, (0, 0)),     # fp4w has its own row pieces
    (64, 2, 8, 64, "fp8", 1, (32, 32)),        # block_m 64: mean 32 = block_m / 2
    (16, 2, 8, 16, "fp8", 1, (16, 16)),        # block_m 16: pieces of 16
    (16, 2, 8, 32, "fp8", 2, (32, 16)),        # L2 pieces of 16 rows take 16-row tails
    (16, 2, 8, 24, "fp8", 1, (0, 0)),          # block_m 24: no piece divides it
])
def test_tail_rows_rule(tokens, top_k, experts, block_m, dtype, split, want):
    assert tail_rows_for(tokens=tokens, ranks=2, top_k=top_k, num_experts=experts,
                         block_m=block_m, dtype=dtype, l2_split_m=split) == want


@pytest.mark.parametrize("tokens, top_k, experts, tiles, programs, want", [
    (1, 8, 128, 6, 264, 4),     # qwen3 fp8, 1 token: 8 blocks x 6 tiles x 4 = 192 <= 264
    (2, 8, 128, 6, 264, 1),     # 2 tokens: 16 blocks, 384 > 264 (the device would not split)
    (1, 8, 128, 16, 264, 1),    # dsv3 fp8 (I = 2048: 16 tiles a block): 512 > 264
    (1, 4, 128, 6, 264, 4),     # top-4: 96 <= 264
    (8, 8, 2, 6, 264, 4),       # 2 local experts: at most 2 blocks whatever the picks
    (1, 8, 128, 6, 132, 1),     # one program per SM: 192 > 132
    (0, 8, 128, 6, 264, 4),     # no tokens: as one (the call may still have peers' picks)
])
def test_fp8_l1_split_rule(tokens, top_k, experts, tiles, programs, want):
    assert fp8_l1_split_for(tokens=tokens, top_k=top_k, experts_per_rank=experts,
                            l1_tiles_per_block=tiles, programs=programs) == want


def test_fused_l2_groups_leave_at_most_16_tickets_per_m_block():
    # bf16 with a short L2 K loop (I <= 2048): two column blocks per ticket at least, more
    # until an m-block has at most 16 tickets; long K (mixtral), fp8 and odd counts: one
    want = {"qwen3": 2, "v4flash": 2, "dsv3": 4, "mixtral": 1}   # 16, 32, 56, 32 blocks
    for shape, g in want.items():
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=8)
        assert fused_l2_group_for(cfg, 128) == g, shape
        assert (cfg.hidden // 128) % g == 0 and cfg.hidden // 128 // g <= 16 or g == 1
        assert fused_l2_group_for(cfg.with_(dtype="fp8"), 128) == 1
    odd = MoEConfig.from_shape("qwen3", max_tokens_per_rank=8).with_(hidden=2048 + 128)
    assert fused_l2_group_for(odd, 128) == 1        # 17 column blocks
    wide = MoEConfig.from_shape("qwen3", max_tokens_per_rank=8).with_(hidden=128 * 96)
    assert fused_l2_group_for(wide, 128) == 8       # 96 blocks: 12 tickets of 8


def test_combine_parts_cover_the_sms_down_to_256_columns():
    dsv3 = MoEConfig.from_shape("dsv3", max_tokens_per_rank=8)   # hidden 7168
    # 128 tokens in tasks of 4: 32 tasks x 8 parts; 1 token: 16 parts of 448; 4096: one part
    assert [combine_parts_for(dsv3, T, 4, 132) for T in (128, 1, 4096)] == [8, 16, 1]
    assert combine_parts_for(dsv3, 1, 4, 0) == 1                 # no SMs to cover
    qwen3 = MoEConfig.from_shape("qwen3", max_tokens_per_rank=8)  # hidden 2048: >= 256 each
    assert combine_parts_for(qwen3, 1, 4, 132) == 8


# ---- settings: what a bad value says ------------------------------------------------------------

@pytest.mark.parametrize("make, msg", [
    (lambda: Tuning(gemm_claim=1), "Tuning.gemm_claim must be a bool"),
    (lambda: Tuning(decode_rows=64), r"Tuning.decode_rows must be one of \(0, 16, 32\)"),
    (lambda: Tuning(fp4w_rows=48), "Tuning.fp4w_rows must be one of"),
    (lambda: Tuning(programs=-1), "Tuning.programs must be an int >= 0"),
    (lambda: Tuning(use_tma=1), "Tuning.use_tma must be None, True or False"),
    (lambda: Tuning(l1=dict(block_n=64)), "Tuning.l1 must be a L1"),
    (lambda: L1(tail_rows=8), r"L1.tail_rows must be one of \(0, 16, 32\)"),
    (lambda: L1(split_k=2), "L1.split_k must be one of"),
    (lambda: L1(one_dot_stages=9), "L1.one_dot_stages must be None"),
    (lambda: L2(epilogue_split=3), "L2.epilogue_split must be one of"),
    (lambda: L2(split_m=4), "L2.split_m must be one of"),
    (lambda: L2(flat=1), "L2.flat must be a bool"),
    (lambda: Copy(dispatch_tile=3), "Copy.dispatch_tile must be a power of two"),
    (lambda: Copy(combine_warps=32), "Copy.combine_warps must be at most 16"),
    (lambda: Fused(l2_group=0), "Fused.l2_group must be an int >= 1"),
    (lambda: Fused(combine_tile=6), "Fused.combine_tile must be a power of two"),
    (lambda: Tuning().with_(l3={}), "Tuning has no field 'l3'"),
    (lambda: Tuning().with_dotted({"l1.blok_n": 64}), "unknown Tuning field 'l1.blok_n'"),
])
def test_bad_settings_name_the_field_and_what_is_allowed(make, msg):
    with pytest.raises(ValueError, match=msg):
        make()


def test_config_rules_are_checked_before_a_launch():
    cfg = MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2,
                    max_tokens_per_rank=24, block_m=32)
    with pytest.raises(ValueError, match="L2.tail_rows=32 must divide the L2 row piece"):
        Tuning(l2=L2(tail_rows=32, split_m=2)).check(cfg)
    with pytest.raises(ValueError, match="L1.tail_rows=32 must divide"):
        Tuning(l1=L1(tail_rows=32)).check(cfg.with_(block_m=16))
    with pytest.raises(ValueError, match="must divide block_m=16"):
        Tuning(decode_rows=32).check(cfg.with_(block_m=16))
    with pytest.raises(ValueError, match="fp8 needs L1.block_n 128 or 256"):
        Tuning(l1=L1(block_n=64)).check(cfg.with_(dtype="fp8"))
    # tail pieces step aside where decode pieces or fp4w pieces already cover the blocks
    t = Tuning(l1=L1(tail_rows=32), l2=L2(tail_rows=16, split_m=2))
    assert (t.tail_pieces(cfg, "l1"), t.tail_pieces(cfg, "l2")) == (32, 16)
    assert Tuning(l1=L1(tail_rows=16), decode_rows=16).tail_pieces(cfg, "l1") == 0
    assert Tuning(l2=L2(tail_rows=16)).tail_pieces(cfg.with_(dtype="fp4w"), "l2") == 0
    # tiles default to 64, capped at the dimension
    assert Tuning().l1_tile(cfg) == (64, 64) and Tuning().l2_tile(cfg) == (64, 64)


def test_with_changes_parts_by_dict_and_dotted_names():
    t = Tuning().with_(l1={"block_n": 32}, wait=False, fused=Fused(per_sm=2))
    assert (t.l1.block_n, t.l1.warps, t.wait, t.fused.per_sm) == (32, L1().warps, False, 2)
    assert Tuning().with_dotted({"l1.block_n": 32, "wait": False, "fused.per_sm": 2}) == t
    assert set(Tuning.dotted_names()) >= {"l1.block_n", "copy.dispatch_tile", "wait"}
    assert all(len(dataclasses.fields(c)) <= 20 for c in (Tuning, L1, L2, Copy, Fused))
