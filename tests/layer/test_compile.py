"""The layer inside compiled models: ``torch.ops.moestream.mega_moe`` (moestream/ops.py) under
torch.compile, its fake implementation, torch.library.opcheck, the buffer registry, a tiny
Hugging Face Qwen3-MoE model with its MoE blocks replaced, and (GPU) CUDA graphs.

On the CPU the kernels run in Triton's interpreter inside the op; on a GPU machine the same
tests run on cuda. Compiled and eager calls run the same kernels on the same inputs, so their
outputs must be bitwise equal (backends "eager" / "aot_eager": the rest of the graph runs
torch's own kernels as eager does). Inductor's CPU compile takes tens of seconds, so only the
GPU test uses it (mode="reduce-overhead").
"""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from moestream import MegaMoE, MoEConfig, SymmBuffer, mega_moe
from moestream.integrations.tiny import VOCAB, moe_blocks, tiny_model
from moestream.integrations.transformers import MegaMoEExperts, replace_moe_blocks
from moestream.reference import moe_forward, route
from moestream.tuning import Tuning
from moestream.testing import (TOLERANCE, make_routing, make_tokens, make_weights,
                               quantize_weights, rel_error)

from conftest import HAS_CUDA, KERNEL_DEVICES

OP = torch.ops.moestream.mega_moe.default
OP_OUT = torch.ops.moestream.mega_moe_out.default
DTYPES = ["bf16", "fp8"]
# reduce-overhead vs eager logits, per token (the GPU test): inductor's bf16 rounding alone
# moved a token's logits by at most 1.4e-2 (median 0.9e-2; inductor on the CPU, the
# single-MoE-layer model, 2 seeds x 4 batches), and one token whose near-tied routing flipped
# by 2.1e-1 (swapping two experts moves logits by 1.4e-1 to 5.5e-1,
# tests/layer/test_integrations_transformers.py). At most FLIPS such tokens per step.
TOKEN_TOL = 3e-2
FLIPS = 2


def small_config(dtype: str = "bf16", **kw) -> MoEConfig:
    base = dict(hidden=256, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=16,
                block_m=16, dtype=dtype)
    return MoEConfig(**{**base, **kw})


def experts(cfg: MoEConfig, gen, device):
    """One rank's (w13, w2) in the config's format: bf16 tensors, fp8 (values, scale_inv) or
    fp4w (packed, scales) pairs."""
    w13s, w2s = make_weights(cfg, 1, generator=gen)
    if cfg.dtype != "bf16":
        w13s, w2s = quantize_weights(w13s, w2s, fmt=cfg.dtype)
        return tuple(t.to(device) for t in w13s[0]), tuple(t.to(device) for t in w2s[0])
    return w13s[0].to(device), w2s[0].to(device)


def call_args(cfg: MoEConfig, T: int, gen, device):
    x = make_tokens(T, cfg.hidden, generator=gen).to(device)
    idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=gen, device=device)
    return x, idx, w


def op_inputs(buf: SymmBuffer, x, idx, w, w13, w2) -> tuple[tuple, dict]:
    """(args, kwargs) of ``torch.ops.moestream.mega_moe`` as ``mega_moe`` passes them."""
    as_list = (lambda t: [t] if isinstance(t, torch.Tensor) else list(t))
    return ((x, idx, w, as_list(w13), as_list(w2), buf.op_state),
            dict(buffer_id=buf.op_id, impl="staged", granularity="token", tuning=""))


class RoutedMoE(nn.Module):
    """A router (Linear) in front of a ``MegaMoE``: the smallest model with the layer in it."""

    def __init__(self, cfg: MoEConfig, gen, device) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.hidden, cfg.num_experts, bias=False, dtype=torch.bfloat16,
                                device=device)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(cfg.num_experts, cfg.hidden, generator=gen))
        self.moe = MegaMoE(cfg, device=device)
        self.moe.reset_parameters(generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe.forward_logits(x, self.router(x)) * 2


# ---- the layer under torch.compile ---------------------------------------------------------

@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_module_with_router_compiles_to_one_graph_equal_to_eager(device, dtype, gen):
    model = RoutedMoE(small_config(dtype), gen, device)
    xs = [make_tokens(T, 256, generator=gen).to(device) for T in (7, 16)]
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(xs[0])
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
            explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for x in xs:   # new tokens and a new T: new routing, the graph made dynamic in T
            want = model(x)
            got = compiled(x)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            assert torch.equal(got, want), f"T={x.shape[0]}: compiled differs from eager"
            w13, w2 = model.moe.experts()
            idx, w = route(model.router(x).float(), 2)
            ref = 2 * moe_forward(x, idx, w, w13, w2, quant=dtype)
            assert rel_error(got, ref) < TOLERANCE[dtype]   # both equal, and both right


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + ["fp4w"])
def test_mega_moe_on_a_buffer_compiles_with_and_without_out(device, dtype, gen):
    cfg = small_config(dtype)
    buf = SymmBuffer(cfg, num_ranks=1, device=device)
    w13, w2 = experts(cfg, gen, device)

    def layer(x, idx, w, out, w2):
        y = mega_moe(x, idx, w, w13, w2, buf)
        mega_moe(x, idx, w, w13, w2, buf, out=out)   # declared: mega_moe_out mutates out
        return y

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x, idx, w = call_args(cfg, 9, gen, device)
    want = mega_moe(x, idx, w, w13, w2, buf)
    out = torch.full_like(want, float("nan"))
    got = compiled(x, idx, w, out, w2)
    assert torch.equal(got, want) and torch.equal(out, want)
    if dtype == "fp4w":
        # the 16-byte alignment of fp4w weights is an address check: a traced graph has no
        # addresses, so the op makes it when it runs, with the same ValueError
        packed = torch.zeros(w2[0].numel() + 1, dtype=torch.uint8, device=device)
        odd = (packed[1:].view(w2[0].shape).copy_(w2[0]), w2[1])
        with pytest.raises(ValueError, match="w2 packed must start at a 16-byte aligned"):
            compiled(x, idx, w, out, odd)
    buf.destroy()


def test_a_tuning_reaches_the_kernels_through_the_op(gen):
    # the op carries the tuning as a string of dotted fields (top level and nested ones): a
    # valid one gives eager's result, and a nested field's own check still fires in the op
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=1, device="cpu")
    w13, w2 = experts(cfg, gen, "cpu")
    x, idx, w = call_args(cfg, 9, gen, "cpu")
    good = Tuning().with_dotted({"l1.block_n": 32, "copy.hidden_chunk": 128, "wait": False})
    want = mega_moe(x, idx, w, w13, w2, buf, tuning=good)
    got = torch.compile(lambda *a: mega_moe(*a, w13, w2, buf, tuning=good),
                        backend="aot_eager", fullgraph=True)(x, idx, w)
    assert torch.equal(got, want)
    assert rel_error(got, moe_forward(x, idx, w, w13, w2)) < TOLERANCE["bf16"]
    bad = Tuning().with_dotted({"l2.block_n": 512})   # wider than hidden=256
    with pytest.raises(ValueError, match="L2.block_n must be a power of two >= 16 dividing"):
        torch.compile(lambda *a: mega_moe(*a, w13, w2, buf, tuning=bad),
                      backend="aot_eager", fullgraph=True)(x, idx, w)
    buf.destroy()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning")  # torch's own
def test_export_records_the_buffer_state_mutation(device, gen):
    model = RoutedMoE(small_config(), gen, device)
    x = make_tokens(5, 256, generator=gen).to(device)
    with torch.no_grad():
        want = model(x)
        program = torch.export.export(model, (x,)).run_decompositions()
        mutations = program.graph_signature.buffers_to_mutate
        assert sorted(mutations.values()) == ["moe.op_state"], mutations
        assert torch.equal(program.module()(x), want)


# ---- the op itself: fake implementation, opcheck, registry ---------------------------------

@pytest.mark.parametrize("T", [0, 1, 7])
def test_fake_implementation_gives_the_output_metadata_without_the_buffer(T, gen):
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=1, device="cpu")
    args, kwargs = op_inputs(buf, *call_args(cfg, T, gen, "cpu"), *experts(cfg, gen, "cpu"))
    buf.destroy()   # the fake implementation must not need the buffer: its id is now unknown
    with FakeTensorMode() as mode:
        fake = [[mode.from_tensor(t) for t in a] if isinstance(a, list) else mode.from_tensor(a)
                for a in args]
        y = OP(*fake, **kwargs)
        assert y is not None and OP_OUT(*fake, fake[0].new_empty(T, cfg.hidden), **kwargs) \
            is None
    assert (tuple(y.shape), y.dtype, y.device) == ((T, cfg.hidden), torch.bfloat16,
                                                   torch.device("cpu"))
    assert y.is_contiguous()
    with pytest.raises(ValueError, match=f"no live SymmBuffer has op_id {buf.op_id}"):
        OP(*args, **kwargs)   # while the real one does


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("T", [0, 1, 7])
def test_fake_and_real_outputs_agree(device, T, gen):
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=1, device=device)
    args, kwargs = op_inputs(buf, *call_args(cfg, T, gen, device), *experts(cfg, gen, device))
    torch.library.opcheck(OP, args, kwargs, test_utils="test_faketensor")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("variant", ["mega_moe", "mega_moe_out"])
def test_opcheck(device, variant, gen):
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=1, device=device)
    args, kwargs = op_inputs(buf, *call_args(cfg, 7, gen, device), *experts(cfg, gen, device))
    op = OP
    if variant == "mega_moe_out":
        op, args = OP_OUT, args + (torch.empty(7, cfg.hidden, dtype=torch.bfloat16,
                                               device=device),)
    # test_schema: mutations and aliasing of the arguments as declared (out, state); the
    # buffer's memory, reached by id, is outside its view. test_faketensor: fake vs real
    # metadata. test_aot_dispatch_dynamic: AOTAutograd (functionalization of state and out,
    # dynamic T) gives the eager result; each call is independent of the last, so the op's
    # repeated runs must agree. Run on inputs that need no grad: with one that does,
    # AOTAutograd would trace a backward, and the op has none.
    torch.library.opcheck(op, args, kwargs,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    # test_autograd_registration needs an input that requires grad: the op's autograd
    # registration (a fallthrough) must leave no output requiring grad without a formula
    x = args[0].clone().requires_grad_()
    torch.library.opcheck(op, (x,) + args[1:], kwargs,
                          test_utils="test_autograd_registration")


def test_the_layer_is_not_differentiable(gen):
    # registered with an autograd fallthrough: the output never requires grad, as the
    # layer's never has (no gradient flows through the experts)
    cfg = small_config()
    buf = SymmBuffer(cfg, num_ranks=1, device="cuda" if HAS_CUDA else "cpu")
    x, idx, w = call_args(cfg, 4, gen, buf.device)
    y = mega_moe(x.requires_grad_(), idx, w, *experts(cfg, gen, buf.device), buf)
    assert not y.requires_grad and y.grad_fn is None


def test_buffers_register_while_they_live():
    cfg = small_config()
    a = SymmBuffer(cfg, num_ranks=1, device="cpu")
    b = SymmBuffer(cfg, num_ranks=1, device="cpu")
    assert a.op_id != b.op_id
    assert SymmBuffer.from_op_id(a.op_id) is a and SymmBuffer.from_op_id(b.op_id) is b
    a.destroy()
    with pytest.raises(ValueError, match="destroyed or never created"):
        SymmBuffer.from_op_id(a.op_id)
    with pytest.raises(ValueError, match="buffer was destroyed"):
        mega_moe(torch.zeros(1, 256, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32),
                 torch.zeros(1, 2), torch.zeros(2, 256, 256), torch.zeros(2, 256, 128), a)
    gone = b.op_id
    del b   # dropped without destroy: the registry holds no reference to it
    gc.collect()
    with pytest.raises(ValueError, match=f"op_id {gone}"):
        SymmBuffer.from_op_id(gone)
    m = MegaMoE(cfg, device="cpu")
    assert SymmBuffer.from_op_id(m.buffer.op_id) is m.buffer
    m.destroy()
    with pytest.raises(ValueError, match="destroyed"):
        SymmBuffer.from_op_id(m.buffer.op_id)
    c = SymmBuffer(cfg, num_ranks=1, device="cpu")
    assert c.op_id > m.buffer.op_id   # ids are never reused


# ---- a Hugging Face model with its MoE blocks replaced -------------------------------------

@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_qwen3_moe_model_compiles_without_graph_breaks(device, gen):
    pytest.importorskip("transformers")
    seed = int(torch.randint(2**62, (1,), generator=gen))
    model = tiny_model("qwen3_moe", seed, single_moe_layer=False).to(device)   # 2 MoE layers
    replace_moe_blocks(model, block_m=16, buffer_tokens=16)
    assert all(isinstance(b.experts, MegaMoEExperts) for b in moe_blocks(model))
    batches = [torch.randint(0, VOCAB, (2, 8), generator=gen).to(device) for _ in range(2)]
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(batches[0])
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
            explained.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for ids in batches:   # new tokens: new routing through both replaced layers
            assert torch.equal(compiled(ids).logits, model(ids).logits)


@pytest.mark.gpu
def test_reduce_overhead_replays_cuda_graphs_with_changing_routing(gen):
    pytest.importorskip("transformers")
    from torch._dynamo.utils import counters
    counters.clear()
    torch._dynamo.reset()
    # Each step calls eager first: the layer allocates its work tensors (weight-address
    # tables, split-K sums) on its first call at a token count, and CUDA graph trees refuse
    # allocations made in their warm-up that outlive it (docs/integrations.md).
    # The layer alone: the recorded graph replays the same kernels on new tokens and a new
    # routing (copied into the graph's inputs), so it must give eager's bits.
    cfg = small_config(max_tokens_per_rank=32)
    moe = MegaMoE(cfg, device="cuda")
    moe.reset_parameters(generator=gen)
    layer = torch.compile(moe, mode="reduce-overhead", fullgraph=True)   # nothing but the op
    with torch.no_grad():
        for step in range(5):   # warm-up, recording, then replays
            x, idx, w = call_args(cfg, 32, gen, "cuda")
            want = moe(x, idx, w)
            assert torch.equal(layer(x, idx, w), want), f"step {step}: the replay differs"
    moe.buffer.check()

    # A tiny Qwen3-MoE (layer 0 dense, layer 1 MoE, replaced) against the eager model.
    # Inductor's own kernels for attention, norms and router round bf16 differently from
    # eager, which can flip a near-tied routing choice; after the MoE layer come only
    # per-token steps, so a flip changes that token's logits alone. A replay of stale
    # tokens or routing would change every token's.
    seed = int(torch.randint(2**62, (1,), generator=gen))
    model = tiny_model("qwen3_moe", seed, single_moe_layer=True).cuda()
    replace_moe_blocks(model, buffer_tokens=16)
    experts_module = moe_blocks(model)[0].experts
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    last = None
    with torch.no_grad():
        for step in range(5):
            ids = torch.randint(0, VOCAB, (2, 8), generator=gen).cuda()
            picks = []   # the expert ids the replaced layer receives (eager call only)
            hook = experts_module.register_forward_pre_hook(
                lambda mod, args: picks.append(args[1]))
            want = model(ids, use_cache=False).logits.float()
            hook.remove()
            got = compiled(ids, use_cache=False).logits.float()
            per_token = (got - want).norm(dim=-1) / want.norm(dim=-1)   # [2, 8]
            off = int((per_token > TOKEN_TOL).sum())
            assert off <= FLIPS, (f"step {step}: {off} of 16 tokens differ from eager by more "
                                  f"than {TOKEN_TOL}: {per_token.tolist()}")
            assert last is None or not torch.equal(picks[0], last), "the routing did not change"
            last = picks[0]
    experts_module.moe.buffer.check()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
