import pytest

from moestream import SHAPES, MoEConfig

BASE = dict(hidden=256, intermediate=128, num_experts=8, top_k=2, max_tokens_per_rank=32)


@pytest.mark.parametrize("change, message", [
    (dict(hidden=200), "hidden must be a multiple of 128"),
    (dict(intermediate=96), "intermediate must be a multiple of 128"),
    (dict(hidden=0), "hidden must be a positive int"),
    (dict(num_experts=-4), "num_experts must be a positive int"),
    (dict(top_k=9), "top_k must be <= num_experts"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank must be a positive int"),
    (dict(max_tokens_per_rank=2.5), "max_tokens_per_rank must be a positive int"),
    (dict(dtype="fp16"), "dtype must be one of"),
    (dict(block_m=48), "block_m must be one of"),
])
def test_invalid_config_names_field_and_rule(change, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**BASE, **change})


def test_ranks_must_divide_experts():
    cfg = MoEConfig(**BASE)
    assert cfg.experts_per_rank(4) == 2
    with pytest.raises(ValueError, match="divisible by the number of ranks"):
        cfg.experts_per_rank(3)
    with pytest.raises(ValueError, match="positive int"):
        cfg.experts_per_rank(0)


def test_pool_capacity_covers_worst_case_and_is_block_aligned():
    cfg = MoEConfig(**BASE, block_m=16)
    for R in (1, 2, 4, 8):
        e_loc = cfg.experts_per_rank(R)
        cap = cfg.pool_capacity(R)
        assert cap % cfg.block_m == 0
        # every pick of every rank lands here, each expert's segment padded to block_m
        worst = R * cfg.max_tokens_per_rank * cfg.top_k
        assert cap >= worst + e_loc * (cfg.block_m - 1)
        assert cfg.max_m_blocks(R) * cfg.block_m == cap


def test_from_shape_and_unknown_shape():
    cfg = MoEConfig.from_shape("dsv3", max_tokens_per_rank=128)
    assert (cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.top_k) == (7168, 2048, 256, 8)
    assert set(SHAPES) == {"dsv3", "v4flash", "qwen3", "mixtral"}
    with pytest.raises(ValueError, match="unknown shape"):
        MoEConfig.from_shape("gpt5", max_tokens_per_rank=1)


def test_packed_source_bound_is_checked():
    # (source rank, token, k) of a pool row is packed into one int32
    cfg = MoEConfig(**{**BASE, "hidden": 128, "max_tokens_per_rank": 2**20, "top_k": 8,
                       "num_experts": 256})
    cfg.check_ranks(128)
    with pytest.raises(ValueError, match="num_ranks \\* max_tokens_per_rank \\* top_k"):
        cfg.check_ranks(256)
    # combine slots [T, K, H] are addressed with int32 offsets
    big = MoEConfig(**{**BASE, "hidden": 7168, "max_tokens_per_rank": 2**16, "top_k": 8,
                       "num_experts": 256})
    with pytest.raises(ValueError, match="max_tokens_per_rank \\* top_k \\* hidden"):
        big.check_ranks(1)
