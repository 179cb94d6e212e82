"""moestream.integrations.transformers: replaced MoE blocks compute what the model computed.

Tiny random-weight models of each family (hidden 256, expert width 128, 4-8 experts, 16 tokens)
run in bf16 on the CPU; the kernels run in Triton's interpreter (block_m=16 keeps it fast).

Tolerance (relative error ||a - b|| / ||b||, both sides bf16): the model's own experts and
moestream's both start from the same bf16 tokens and weights and round the SwiGLU activation and
the output to bf16; transformers also rounds the gate/up projections, the weighted expert
outputs and their running sum to bf16 (unit roundoff 2^-8 = 3.9e-3 each). Over 12 seeds the
difference was 3-6e-3 for a block's output and at most 5.3e-3 for the logits; TOL = 2e-2 leaves
about 4x headroom, while swapping the weights of the two busiest experts (the bug of a wrong
expert offset) moved the logits by 1.4e-1 to 5.5e-1 (checked below, so the comparison can fail).

Routing: the logits are compared on models with a single MoE layer, whose router sees bit-equal
inputs in both runs. After a replaced MoE layer, bf16 noise (~5e-3) can flip a later router's
choice between two near-tied experts, a legitimate difference of up to ~2e-2 on the logits; the
all-MoE models are therefore compared block by block, each block on the inputs the original
model gave it.

Also here, without a GPU: replace_moe_blocks' checks across several ranks (with a faked group),
the multi-GPU test's worker (tests/multigpu/test_integrations_multigpu.py) with one gloo rank, and
``moestream bench-layer``'s code on tiny models.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# moestream first: transformers' model classes import Triton, and on a CPU-only machine moestream
# must switch Triton to its interpreter before that happens.
from moestream.integrations.tiny import (
    EXPERT_WIDTH, FAMILIES, HIDDEN, VOCAB, moe_blocks, tiny_config, tiny_model)
from moestream.integrations.transformers import ExpertsLayout, MegaMoEExperts, replace_moe_blocks
from moestream.testing import rel_error

transformers = pytest.importorskip(
    "transformers", reason="moestream.integrations.transformers needs Hugging Face transformers "
    "(pip install transformers)")

TOL = 2e-2
# fp4w experts (MXFP4, ~0.2 relative error per expert output on random weights) against the
# bf16 model's logits: seen 4.8e-2 to 5.6e-2 (qwen3_moe, 4 seeds); a scale off by 2 is ~1
LOGITS_FP4W = 0.15
H, I_MOE = HIDDEN, EXPERT_WIDTH


# ---- models (moestream.integrations.tiny builds them; the multi-GPU tests use the same) -----

def _config(family: str, *, single_moe_layer: bool):
    return tiny_config(family, single_moe_layer=single_moe_layer)


def _model(family: str, gen: torch.Generator, *, single_moe_layer: bool) -> nn.Module:
    """A bf16 eval-mode model whose random weights come from ``gen`` (replayable)."""
    return tiny_model(family, int(torch.randint(2**62, (1,), generator=gen)),
                      single_moe_layer=single_moe_layer)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return moe_blocks(model)


def _ids(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=gen)   # 16 tokens


def _assert_same_structure(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape \
            and got.dtype == want.dtype, (type(got), getattr(got, "shape", None), want.shape)
    else:
        assert type(got) is type(want) and len(got) == len(want), (type(got), type(want))
        for g, w in zip(got, want):
            _assert_same_structure(g, w)


def _swap_busiest_experts(model: nn.Module, ids: torch.Tensor) -> None:
    """Give the two most used experts of the last MoE block each other's weights."""
    experts = _blocks(model)[-1].experts
    seen = []
    hook = experts.register_forward_pre_hook(lambda mod, args: seen.append(args[1]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    counts = torch.bincount(seen[-1].flatten(), minlength=experts.num_experts)
    e1, e2 = counts.argsort(descending=True)[:2].tolist()
    with torch.no_grad():
        for w in (experts.moe.w13, experts.moe.w2):
            w[[e1, e2]] = w[[e2, e1]].clone()


# ---- whole models -------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_and_a_wrong_expert_does_not(family, gen):
    model = _model(family, gen, single_moe_layer=True)
    ids = _ids(gen)
    with torch.no_grad():
        before = model(ids, output_router_logits=family != "deepseek_v3")
    replace_moe_blocks(model, block_m=16)
    assert all(isinstance(b.experts, MegaMoEExperts) for b in _blocks(model))
    with torch.no_grad():
        after = model(ids, output_router_logits=family != "deepseek_v3")
    err = rel_error(after.logits, before.logits)
    assert err <= TOL, f"{family}: logits differ by {err:.3e} (tolerance {TOL})"
    if family != "deepseek_v3":
        # The model's own router still runs, so transformers still records its logits.
        assert len(after.router_logits) == len(before.router_logits) == 1
        assert torch.equal(after.router_logits[0], before.router_logits[0])

    _swap_busiest_experts(model, ids)
    with torch.no_grad():
        wrong = model(ids).logits
    assert rel_error(wrong, before.logits) > 2 * TOL, \
        f"{family}: swapping two experts' weights went unnoticed by the comparison"


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "fp8"), ("deepseek_v3", "fp8"),
                                         ("qwen3_moe", "fp4w")])
def test_quantized_experts_match_the_quantized_reference(family, fmt, gen):
    # dtype=float8_e4m3fn: the experts are quantized at conversion (128x128 block scales) and
    # run the fp8 layer; dtype=float4_e2m1fn_x2: to MXFP4 (E8M0 per 32), the fp4w layer. The
    # experts module against moe_forward(quant=fmt) on the module's own quantized weights (like
    # with like: TOLERANCE[fmt]); the logits against the bf16 model only loosely (fp8: seen
    # 1.6e-2 to 4.4e-2 over qwen3, deepseek_v3 and mixtral, 3 seeds each; fp4w: LOGITS_FP4W)
    from moestream.reference import moe_forward
    from moestream.testing import TOLERANCE
    model = _model(family, gen, single_moe_layer=True)
    ids = _ids(gen)
    with torch.no_grad():
        before = model(ids).logits
    dtype = torch.float8_e4m3fn if fmt == "fp8" else torch.float4_e2m1fn_x2
    replace_moe_blocks(model, block_m=16, dtype=dtype)
    experts = _blocks(model)[-1].experts
    assert experts.moe.config.dtype == fmt
    assert experts.moe.w13.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.uint8)
    x = torch.randn(12, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:experts.top_k]
                       for _ in range(12)])
    w = torch.rand(12, experts.top_k, generator=gen)
    with torch.no_grad():
        got = experts(x, idx, w)
    w13, w2 = experts.moe.experts()
    ref = moe_forward(x, idx, w, w13, w2, quant=fmt)
    assert rel_error(got, ref) < TOLERANCE[fmt]
    with torch.no_grad():
        after = model(ids).logits
    print(f"{family} {fmt}: logits vs the bf16 model {rel_error(after, before):.2e}")
    assert rel_error(after, before) < (0.1 if fmt == "fp8" else LOGITS_FP4W)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_block_matches_on_the_models_own_inputs(family, gen):
    model = _model(family, gen, single_moe_layer=False)
    blocks = _blocks(model)
    assert len(blocks) == 2
    seen: dict[int, tuple] = {}
    hooks = [b.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args, out)))
             for i, b in enumerate(blocks)]
    with torch.no_grad():
        model(_ids(gen))
    for h in hooks:
        h.remove()
    replace_moe_blocks(model, block_m=16)
    for i, block in enumerate(blocks):
        args, want = seen[i]
        assert args[0].shape == (2, 8, H)
        with torch.no_grad():
            got = block(*args)
        _assert_same_structure(got, want)
        err = rel_error(got, want)
        assert err <= TOL, f"{family} block {i}: output differs by {err:.3e} (tolerance {TOL})"


def test_replaced_experts_are_freed(gen):
    model = _model("qwen3_moe", gen, single_moe_layer=False)
    old = [weakref.ref(p) for b in _blocks(model) for p in b.experts.parameters()]
    n_before = sum(p.numel() for p in model.parameters())
    n_experts = sum(p.numel() for b in _blocks(model) for p in b.experts.parameters())
    replace_moe_blocks(model, block_m=16)
    gc.collect()
    assert all(r() is None for r in old), "an original expert weight is still alive"
    names = [n for n, _ in model.named_parameters() if ".experts." in n]
    assert names and all(n.endswith(("experts.moe.w13", "experts.moe.w2")) for n in names), names
    # one rank: it holds every expert, so the count is unchanged but now all in MegaMoE weights
    n_moe = sum(p.numel() for b in _blocks(model) for p in b.experts.moe.parameters())
    assert n_moe == n_experts == 2 * 4 * 3 * I_MOE * H
    assert sum(p.numel() for p in model.parameters()) == n_before
    for b in _blocks(model):
        assert b.experts.moe.w13.dtype == torch.bfloat16 and b.experts.moe.w13.is_contiguous()


# ---- expert storage layouts -----------------------------------------------------------------

def _qwen3_block(gen: torch.Generator):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = _config("qwen3_moe", single_moe_layer=False)
    cfg._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(cfg)
    if not hasattr(block.experts, "gate_up_proj"):
        pytest.skip("this transformers stores per-expert Linears (4.x); see the legacy test")
    with torch.no_grad():
        for p in block.parameters():   # the experts are torch.empty until a model inits them
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return block.to(torch.bfloat16).eval()


def _to_layout(experts: nn.Module, layout: str) -> None:
    """Store the experts as [E, H, 2I] / [E, I, H] and/or with gate and up rows interleaved."""
    gu, dn = experts.gate_up_proj.data, experts.down_proj.data
    if "interleaved" in layout:
        i = gu.shape[1] // 2
        gu = torch.stack([gu[:, :i], gu[:, i:]], dim=2).reshape(gu.shape)  # g0 u0 g1 u1 ...
        experts.is_concatenated = False
    if "transposed" in layout:
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
        experts.is_transposed = True
    if layout == "transposed-inferred":
        del experts.is_transposed    # no flag: the shapes must tell
    experts.gate_up_proj = nn.Parameter(gu.contiguous(), requires_grad=False)
    experts.down_proj = nn.Parameter(dn.contiguous(), requires_grad=False)


@pytest.mark.parametrize("layout", ["transposed", "transposed-inferred", "interleaved"])
def test_fused_layouts(layout, gen):
    block = _qwen3_block(gen)
    x = torch.randn(2, 8, H, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = block(x)
    _to_layout(block.experts, layout)
    replace_moe_blocks(block, block_m=16)
    with torch.no_grad():
        got = block(x)
    assert rel_error(got, want) <= TOL


def test_extract_takes_this_ranks_experts(gen):
    """Rank 1 of 2 gets experts [2, 4) in moestream's layout, from any storage layout."""
    block = _qwen3_block(gen)
    gu, dn = block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone()
    for layout, transposed, interleaved in (("transposed", True, False),
                                            ("interleaved", False, True)):
        experts = _qwen3_block(gen).experts
        experts.gate_up_proj.data.copy_(gu)
        experts.down_proj.data.copy_(dn)
        _to_layout(experts, layout)
        spec = ExpertsLayout("fused", 4, I_MOE, transposed=transposed, interleaved=interleaved)
        w13, w2 = spec.extract(experts, range(2, 4))
        assert torch.equal(w13, gu[2:4]) and torch.equal(w2, dn[2:4]), layout


def test_long_inputs_are_chunked_on_one_rank(gen):
    block = _qwen3_block(gen)
    x = torch.randn(2, 8, H, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = block(x)
    replace_moe_blocks(block, block_m=16, buffer_tokens=8)   # 16 tokens: two calls
    with torch.no_grad():
        assert rel_error(block(x), want) <= TOL


def test_fp32_blocks_and_empty_batches(gen):
    block = _qwen3_block(gen).float()
    x = torch.randn(2, 8, H, generator=gen)
    with torch.no_grad():
        want = block(x)
    replace_moe_blocks(block, block_m=16)
    with torch.no_grad():
        got = block(x)
        empty = block(x[:, :0])
    assert got.dtype == torch.float32 and rel_error(got, want) <= TOL   # bf16 inside
    assert empty.shape == (2, 0, H) and empty.dtype == torch.float32


# ---- transformers 4.x layouts (per-expert Linears), rebuilt from the 4.57 source -------------

class _MLP(nn.Module):
    def __init__(self, names: tuple[str, str, str], inter: int = I_MOE) -> None:
        super().__init__()
        self.names = names
        for n, (i, o) in zip(names, ((H, inter), (H, inter), (inter, H))):
            setattr(self, n, nn.Linear(i, o, bias=False))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(self.act_fn(g(x)) * u(x))


def _expert_loop(experts, x, selected, weights):
    out = torch.zeros_like(x)
    mask = F.one_hot(selected, len(experts)).permute(2, 1, 0)
    for e in range(len(experts)):
        k, tok = torch.where(mask[e])
        out.index_add_(0, tok, (experts[e](x[tok]) * weights[tok, k, None]).to(x.dtype))
    return out


class MixtralSparseMoeBlock(nn.Module):    # transformers 4.x: w1/w3/w2, returns (y, logits)
    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.jitter_noise = 2, 0.0
        self.gate = nn.Linear(H, 4, bias=False)
        self.experts = nn.ModuleList(_MLP(("w1", "w3", "w2")) for _ in range(4))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        router_logits = self.gate(x)
        w, sel = torch.topk(F.softmax(router_logits, dim=1, dtype=torch.float), self.top_k, -1)
        w /= w.sum(dim=-1, keepdim=True)
        y = _expert_loop(self.experts, x, sel, w.to(x.dtype))
        return y.reshape(b, s, h), router_logits


class Qwen2MoeSparseMoeBlock(nn.Module):   # transformers 4.x: + norm_topk_prob, shared expert
    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = 2, False
        self.gate = nn.Linear(H, 4, bias=False)
        self.experts = nn.ModuleList(_MLP(("gate_proj", "up_proj", "down_proj")) for _ in range(4))
        self.shared_expert = _MLP(("gate_proj", "up_proj", "down_proj"))
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        router_logits = self.gate(x)
        w, sel = torch.topk(F.softmax(router_logits, dim=1, dtype=torch.float), self.top_k, -1)
        y = _expert_loop(self.experts, x, sel, w.to(x.dtype))
        y = y + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y.reshape(b, s, h), router_logits


class _DeepseekRouter(nn.Module):          # transformers 4.x: returns (topk_indices, topk_weights)
    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.weight = nn.Parameter(torch.randn(8, H) * H ** -0.5)

    def forward(self, hidden_states):
        scores = F.linear(hidden_states.view(-1, H).float(), self.weight.float()).sigmoid()
        idx = scores.topk(self.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        return idx, w / w.sum(dim=-1, keepdim=True) * 2.5


class DeepseekV3MoE(nn.Module):            # transformers 4.x: forward calls self.moe(...)
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(_MLP(("gate_proj", "up_proj", "down_proj")) for _ in range(8))
        self.gate = _DeepseekRouter()
        self.shared_experts = _MLP(("gate_proj", "up_proj", "down_proj"))

    def moe(self, hidden_states, topk_indices, topk_weights):
        return _expert_loop(self.experts, hidden_states, topk_indices, topk_weights)

    def forward(self, hidden_states):
        residuals, shape = hidden_states, hidden_states.shape
        topk_indices, topk_weights = self.gate(hidden_states)
        y = self.moe(hidden_states.view(-1, shape[-1]), topk_indices, topk_weights).view(*shape)
        return y + self.shared_experts(residuals)


@pytest.mark.parametrize("cls", [MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, DeepseekV3MoE])
def test_transformers_4_blocks(cls, gen):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
        block = cls().to(torch.bfloat16).eval()
    x = torch.randn(2, 8, H, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = block(x)
    replace_moe_blocks(block, block_m=16)
    assert isinstance(block.experts, MegaMoEExperts)
    with torch.no_grad():
        got = block(x)
    _assert_same_structure(got, want)
    if isinstance(want, tuple):
        assert torch.equal(got[1], want[1])   # the router logits: the block's own gate
        got, want = got[0], want[0]
    assert rel_error(got, want) <= TOL


# ---- errors ---------------------------------------------------------------------------------

class MyMoeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, 4, bias=False)
        self.experts = nn.ModuleList(_MLP(("w1", "w3", "w2")) for _ in range(4))


def test_unknown_moe_block_is_named_and_nothing_changes(gen):
    block = _qwen3_block(gen)
    experts = block.experts
    model = nn.Sequential(block, MyMoeBlock())
    with pytest.raises(ValueError, match=r"MyMoeBlock.*supported block classes: Mixtral"):
        replace_moe_blocks(model)
    assert block.experts is experts


def test_bad_arguments_and_unsupported_blocks(gen):
    block = _qwen3_block(gen)
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16, torch.float8_e4m3fn"):
        replace_moe_blocks(block, dtype=torch.float16)
    with pytest.raises(ValueError, match="buffer_tokens must be a positive int"):
        replace_moe_blocks(block, buffer_tokens=0)
    with pytest.raises(ValueError, match="found no MoE block in Sequential"):
        replace_moe_blocks(nn.Sequential(nn.Linear(H, H)))
    block.experts.act_fn = nn.GELU()
    with pytest.raises(ValueError, match=r"Qwen3MoeSparseMoeBlock.*GELU"):
        replace_moe_blocks(block)
    legacy = MixtralSparseMoeBlock()
    legacy.experts[1].w2 = nn.Linear(I_MOE, H, bias=True)
    with pytest.raises(ValueError, match=r"MixtralSparseMoeBlock.*expert 1.w2 has a bias"):
        replace_moe_blocks(legacy)
    narrow = MixtralSparseMoeBlock()
    narrow.experts = nn.ModuleList(_MLP(("w1", "w3", "w2"), inter=96) for _ in range(4))
    with pytest.raises(ValueError, match=r"MixtralSparseMoeBlock.*intermediate must be a "
                                         r"multiple of 128"):
        replace_moe_blocks(narrow)


def test_training_through_the_experts_is_refused(gen):
    block = _qwen3_block(gen)
    replace_moe_blocks(block, block_m=16)
    block.train()
    x = torch.randn(1, 2, H, generator=gen).to(torch.bfloat16).requires_grad_()
    with pytest.raises(ValueError, match="inference only"):
        block(x)


# ---- several ranks: the checks that run before anything changes (no GPU needed) -------------

def test_several_ranks_are_checked_on_every_rank_before_anything_changes(gen, monkeypatch):
    """With R > 1 ranks (faked here: the group size and the all_gather_object), a CPU device,
    experts that do not split, another rank's failure or different blocks on another rank
    raise on this rank too, and nothing is modified."""
    import torch.distributed as dist

    block = _qwen3_block(gen)                 # 4 experts
    experts = block.experts
    ranks, peer = {"n": 2}, {}
    gathered = []

    def fake_all_gather_object(out, obj, group=None):
        assert group == "a group" and len(out) == ranks["n"]
        gathered.append(obj)
        out[:] = [obj] + [peer.get("summary", obj)] * (len(out) - 1)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: ranks["n"])
    monkeypatch.setattr(dist, "all_gather_object", fake_all_gather_object)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with pytest.raises(ValueError, match=r"Qwen3MoeSparseMoeBlock.*with 2 ranks the experts and "
                                         r"buffers must be on a CUDA device"):
        replace_moe_blocks(block, group="a group", block_m=16)
    assert gathered[-1]["error"] is not None   # the peers were told before this rank raised
    ranks["n"] = 3
    with pytest.raises(ValueError, match=r"num_experts \(4\) must be divisible by the number of "
                                         r"ranks \(3\)"):
        replace_moe_blocks(block, group="a group", block_m=16, device="cuda")
    ranks["n"] = 2
    peer["summary"] = dict(error="rank 1's own reason", blocks=[])
    with pytest.raises(ValueError, match=r"rank 1 of the group could not replace its MoE blocks, "
                                         r"so no rank does: rank 1's own reason"):
        replace_moe_blocks(block, group="a group", block_m=16, device="cuda")
    peer["summary"] = dict(error=None, blocks=[])
    with pytest.raises(ValueError, match=r"same MoE blocks and arguments on every rank of the "
                                         r"group \(rank 0 vs rank 1: 1 vs 0 blocks\)"):
        replace_moe_blocks(block, group="a group", block_m=16, device="cuda")
    assert block.experts is experts
    assert gathered[-1]["error"] is None
    assert gathered[-1]["blocks"][0][1] == "Qwen3MoeSparseMoeBlock"


def test_the_multi_gpu_worker_runs_on_one_cpu_rank(gen):
    """tests/multigpu/test_integrations_multigpu.py's worker, with one gloo rank on the CPU (the group
    path of replace_moe_blocks with a real process group, generate with synced_gpus, teacher
    forcing), judged as the GPU test judges it."""
    from moestream.tools.distributed import spawn
    from hf_ep_cases import compare_generation, ep_worker
    seed = int(torch.randint(2**31, (1,), generator=gen))
    (res,) = spawn(ep_worker, world_size=1, backend="gloo",
                   args=(seed, "cpu", ("qwen3_moe",), 4, 16), timeout_s=300)
    f = res["qwen3_moe"]
    assert f["logits"]["err"] <= TOL and f["logits"]["err_again"] <= TOL, f["logits"]
    assert f["logits"]["held"] == [dict(range=(0, 4), want=(0, 4), weights_exact=True)]
    assert len(f["blocks"]) == 2 and max(f["blocks"]) <= TOL, f["blocks"]
    g = f["generate"]
    assert g["orig_tokens"].shape == g["new_tokens"].shape == (2, 4)
    assert g["forced_logits"].shape == g["orig_logits"].shape == (4, 2, VOCAB)
    res = compare_generation(g["orig_tokens"], g["new_tokens"], g["orig_logits"],
                             g["new_logits"], g["forced_logits"])
    assert not res["problems"], res


def test_generation_comparison_allows_only_near_ties(gen):
    from hf_ep_cases import compare_generation
    N, B, V = 6, 2, VOCAB
    logits = torch.randn(N, B, V, generator=gen)
    tokens = logits.argmax(-1).T.contiguous()          # [B, N], greedy
    noise = 1e-3 * torch.randn(N, B, V, generator=gen)
    ok = compare_generation(tokens, tokens.clone(), logits, logits + noise, logits + noise)
    assert ok["problems"] == [] and ok["flips"] == []
    # row 1 flips at step 2 to the runner-up: allowed when the two were nearly tied
    runner_up = logits[2, 1].topk(2).indices[1]
    near = logits.clone()
    near[2, 1, runner_up] = near[2, 1, tokens[1, 2]] - 0.01
    flipped = tokens.clone()
    flipped[1, 2:] = runner_up
    res = compare_generation(tokens, flipped, near, near + noise, near + noise)
    assert res["problems"] == [] and [f[:2] for f in res["flips"]] == [(1, 2)]
    # the same flip where the original preferred its token by 1.0 is a failure
    far = logits.clone()
    far[2, 1, runner_up] = far[2, 1, tokens[1, 2]] - 1.0
    res = compare_generation(tokens, flipped, far, far + noise, far + noise)
    assert len(res["problems"]) == 1 and "not a near-tie" in res["problems"][0]
    # a wrong decode step shows in the teacher-forced logits even when the tokens agree
    bad = logits + noise
    bad[4] = torch.randn(B, V, generator=gen)
    res = compare_generation(tokens, tokens.clone(), logits, logits + noise, bad)
    assert len(res["problems"]) == 1 and "teacher-forced step 4" in res["problems"][0]


# ---- moestream bench-layer (its GPU run times the real sizes; here its code on tiny ones) -----

def test_bench_layer_worker_runs_on_the_cpu(tmp_path):
    import json

    from moestream.tools.bench_layer import report, run_layer_bench
    res = run_layer_bench(families=["deepseek_v3"], decode=[2], prefill=[16],
                          providers=["transformers", "transformers-eager", "moestream",
                                     "moestream-graph"],     # skipped on the CPU
                          reps=2, warmup=1, device="cpu", tiny=True, block_m=16,
                          progress=False)
    assert res["failures"] == []
    rows = res["rows"]
    assert [(r["phase"], r["tokens_per_rank"], r["provider"]) for r in rows] == [
        (ph, t, p) for ph, t in (("decode", 2), ("prefill", 16))
        for p in ("transformers", "transformers-eager", "moestream")]
    for r in rows:
        assert r["shape"] == "deepseek_v3-layer" and r["ranks"] == 1 and r["median_us"] > 0
        assert r["clock"] == "perf_counter" and r["experts"] == 8 and r["top_k"] == 2
        assert 0 < r["rel_error_moe"] <= TOL and 0 < r["rel_error_layer"] <= TOL
        assert r["experts_impl"] == {"transformers-eager": "eager",
                                     "moestream": "moestream"}.get(r["provider"],
                                                                   r["experts_impl"])
        assert r["speedup_vs_transformers"] > 0
    out, png = tmp_path / "layer.jsonl", tmp_path / "layer.png"
    report(rows, out=str(out), plot=str(png))
    assert [json.loads(line)["provider"] for line in out.read_text().splitlines()] == \
        [r["provider"] for r in rows]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_layer_arguments(capsys):
    from moestream.tools.bench_layer import layer_config, run_layer_bench
    from moestream.tools.cli import main
    with pytest.raises(ValueError, match="unknown family 'llama'"):
        run_layer_bench(families=["llama"], device="cpu")
    with pytest.raises(ValueError, match="unknown provider 'vllm'"):
        run_layer_bench(providers=["vllm"], device="cpu")
    with pytest.raises(ValueError, match="decode batch sizes must be positive ints"):
        run_layer_bench(decode=[0], device="cpu")
    with pytest.raises(ValueError, match="at least one decode batch size or prefill length"):
        run_layer_bench(decode=[], prefill=[], device="cpu")
    with pytest.raises(ValueError, match="reps must be an int >= 1"):
        run_layer_bench(reps=0, device="cpu")
    with pytest.raises(ValueError, match="device='cpu' runs one rank"):
        run_layer_bench(device="cpu", world=2)
    with pytest.raises(ValueError, match="deepseek_v3: experts must be a multiple of its 8"):
        layer_config("deepseek_v3", experts=12)
    assert layer_config("qwen3_moe").num_experts == 128
    assert layer_config("mixtral", experts=4).num_local_experts == 4
    with pytest.raises(SystemExit) as exc:
        main(["bench-layer", "--family", "llama"])
    err = capsys.readouterr().err   # a usage error naming the option and the valid families
    assert exc.value.code == 2 and "--family" in err and "qwen3_moe" in err
    if not torch.cuda.is_available():
        assert main(["bench-layer", "--decode", "1"]) == 2
        assert "needs CUDA GPUs" in capsys.readouterr().out
