"""The reference layer against a literal per-token transcription of the math contract, and the
router's invariants."""
import math

import pytest
import torch
import torch.nn.functional as F

from moestream import MoEConfig
from moestream.reference import moe_forward, moe_forward_ranks, route
from moestream.testing import make_routing, make_tokens, make_weights, rel_error


def literal_layer(x, idx, w, w13, w2):
    """The layer's definition (sum over picks of weight * w2 @ silu(gate) * up) written out
    token by token in fp64."""
    I = w13.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            xt = x[t].double()
            gate = w13[e, :I].double() @ xt
            up = w13[e, I:].double() @ xt
            y[t] += float(w[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return y


@pytest.mark.parametrize("T, E, K, drop", [
    (1, 4, 1, 0.0),     # T=1, top-1
    (9, 6, 3, 0.3),     # -1 picks mixed in
    (16, 8, 8, 0.0),    # K = E: every expert picked by every token
])
def test_reference_matches_literal_math(gen, T, E, K, drop):
    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=E, top_k=K, max_tokens_per_rank=T)
    (w13,), (w2,) = make_weights(cfg, 1, generator=gen)
    x = make_tokens(T, 128, generator=gen)
    idx, w = make_routing(T, E, K, generator=gen, drop=drop)
    ref = literal_layer(x, idx, w, w13, w2)
    out = moe_forward(x, idx, w, w13, w2, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert rel_error(out, ref) < 1e-12


def test_duplicate_picks_add_and_all_minus_one_gives_zero(gen):
    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=4)
    (w13,), (w2,) = make_weights(cfg, 1, generator=gen)
    x = make_tokens(2, 128, generator=gen)
    idx = torch.tensor([[3, 3], [-1, -1]])
    w = torch.rand(2, 2, generator=gen)
    y = moe_forward(x, idx, w, w13, w2, out_dtype=torch.float64)
    one = moe_forward(x[:1], torch.tensor([[3]]), w[:1, :1] + w[:1, 1:], w13, w2,
                      out_dtype=torch.float64)
    assert rel_error(y[:1], one) < 1e-6
    assert torch.equal(y[1], torch.zeros(128, dtype=torch.float64))


def test_ranks_view_equals_global_view(gen):
    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=6, top_k=2, max_tokens_per_rank=8)
    w13s, w2s = make_weights(cfg, 3, generator=gen)
    Ts = [5, 0, 8]   # a rank with no tokens
    xs = [make_tokens(T, 128, generator=gen) for T in Ts]
    rts = [make_routing(T, 6, 2, generator=gen) for T in Ts]
    ys = moe_forward_ranks(xs, [r[0] for r in rts], [r[1] for r in rts], w13s, w2s,
                           out_dtype=torch.float32)
    assert [y.shape[0] for y in ys] == Ts
    full = moe_forward(xs[2], rts[2][0], rts[2][1], torch.cat(w13s), torch.cat(w2s),
                       out_dtype=torch.float32)
    # the same math on a different batch: equal up to fp32 summation order
    assert rel_error(ys[2], full) < 1e-5


def test_softmax_route_picks_largest_and_renormalises(gen):
    logits = torch.randn(32, 16, generator=gen)
    idx, w = route(logits, 4)
    assert idx.shape == w.shape == (32, 4) and w.dtype == torch.float32
    torch.testing.assert_close(w.sum(-1), torch.ones(32))
    assert torch.equal(idx.sort(-1).values, logits.topk(4, dim=-1).indices.sort(-1).values)
    # distinct experts per token
    assert all(len(set(r.tolist())) == 4 for r in idx)


def test_sigmoid_group_limited_route_stays_in_best_groups(gen):
    T, E, groups, keep = 64, 32, 8, 2
    logits = torch.randn(T, E, generator=gen)
    bias = torch.randn(E, generator=gen) * 0.1
    idx, w = route(logits, 4, scoring="sigmoid", bias=bias, num_groups=groups, topk_groups=keep,
                   scaling_factor=2.5)
    torch.testing.assert_close(w.sum(-1), torch.full((T,), 2.5))
    choice = (logits.sigmoid() + bias).view(T, groups, E // groups)
    best = choice.topk(2, dim=-1).values.sum(-1).topk(keep, dim=-1).indices
    for t in range(T):
        assert set((idx[t] // (E // groups)).tolist()) <= set(best[t].tolist())
    # weights are the unbiased scores, renormalised, scaled
    s = logits.sigmoid().gather(1, idx)
    torch.testing.assert_close(w, s / s.sum(-1, keepdim=True) * 2.5)


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.zeros(3, 128, dtype=torch.int32)), "x must have dtype"),
    (dict(x=torch.zeros(3, 64)), r"x must have shape \(T, 128\)"),
    (dict(topk_idx=torch.zeros(3, 2)), "topk_idx must have dtype"),
    (dict(topk_idx=torch.full((3, 2), 4)), r"values must lie in \[-1, 4\)"),
    (dict(topk_idx=torch.full((3, 2), -2)), r"values must lie in \[-1, 4\)"),
    (dict(topk_idx=torch.zeros(2, 2, dtype=torch.int64)), "one row per token"),
    (dict(topk_weights=torch.zeros(3, 3)), "topk_weights must have shape"),
    (dict(topk_weights=torch.zeros(3, 2, dtype=torch.float64)), "topk_weights must have dtype"),
    (dict(w2=torch.zeros(4, 128, 64)), "w2 must have shape"),
])
def test_reference_bad_input(gen, bad, message):
    args = dict(x=torch.randn(3, 128, generator=gen), topk_idx=torch.zeros(3, 2, dtype=torch.int64),
                topk_weights=torch.rand(3, 2, generator=gen),
                w13=torch.randn(4, 256, 128, generator=gen), w2=torch.randn(4, 128, 128, generator=gen))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        moe_forward(**args)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=0), "top_k must be an int"),
    (dict(top_k=17), "top_k must be an int"),
    (dict(top_k=2, scoring="relu"), "scoring must be"),
    (dict(top_k=2, scoring="sigmoid", num_groups=3, topk_groups=1), "num_groups must divide"),
    (dict(top_k=2, scoring="sigmoid", num_groups=4), "given together"),
    (dict(top_k=2, bias=torch.zeros(16)), "sigmoid"),
])
def test_route_bad_input(gen, kwargs, message):
    with pytest.raises(ValueError, match=message):
        route(torch.randn(4, 16, generator=gen), **kwargs)


@pytest.mark.parametrize("T, E, K, skew", [(256, 128, 8, 0.3), (256, 8, 2, 0.3),
                                           (200, 16, 4, 0.1)])
def test_skewed_routing_has_one_hot_expert_and_random_rest(gen, T, E, K, skew):
    # make_routing(skew=s): expert 0 takes s of all picks (at most one per token, so 1/K at
    # most) besides its uniform share, and the other picks stay spread like uniform routing's.
    # A hot logit so large that it zeroes every other probability would make each hot token
    # take the same K experts: caught here by the distinct other-expert sets and their spread
    idx, w = make_routing(T, E, K, generator=gen, skew=skew)
    share = (idx == 0).sum().item() / idx.numel()
    hot_tokens = min(1.0, skew * K)     # plus the other tokens' uniform chance of expert 0
    assert abs(share - (hot_tokens + (1 - hot_tokens) * K / E) / K) < 0.05, share
    hot = (idx == 0).any(dim=1)
    rest = [tuple(sorted(row[row != 0].tolist())) for row in idx[hot]]
    # the hot tokens' other picks differ (as many sets as there can be, for few experts)
    assert len(set(rest)) >= min(math.comb(E - 1, K - 1), len(rest) // 2)
    others = idx[hot][idx[hot] != 0]
    assert others.unique().numel() >= min(E - 1, others.numel() // 4)
    # each token's picks are distinct and its weights positive and summing to one
    assert all(len(set(row.tolist())) == K for row in idx)
    assert bool((w > 0).all()) and torch.allclose(w.sum(1), torch.ones(T))
