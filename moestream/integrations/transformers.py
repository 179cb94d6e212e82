"""Run the routed experts of Hugging Face transformers MoE models on moestream's layer.

``replace_moe_blocks(model)`` finds the sparse MoE blocks of Mixtral, Qwen2-MoE, Qwen3-MoE and
DeepSeek-V3 models, moves this rank's routed experts into a ``moestream.MegaMoE`` and makes the
block run them there. Everything else stays the model's own code: the router (so routing is
bit-for-bit the model's), the shared experts, the reshapes and the block's return value.

Two generations of transformers code are recognised (docs/integrations.md lists the classes):

- transformers 5.x: the block calls ``self.experts(hidden [T, H], top_k_index [T, K],
  top_k_weights [T, K])`` on a fused experts module (``gate_up_proj`` [E, 2I, H] with gate
  rows first, ``down_proj`` [E, H, I]; the transposed [E, H, 2I] / [E, I, H] and gate/up
  interleaved variants that transformers' ``use_experts_implementation`` describes are handled
  too). The experts module is swapped for ``MegaMoEExperts``; the block's forward is untouched.
- transformers 4.x: ``experts`` is an ``nn.ModuleList`` of per-expert MLPs (``gate_proj`` /
  ``up_proj`` / ``down_proj`` or Mixtral's ``w1`` / ``w3`` / ``w2`` Linears). DeepSeek-V3's
  block calls ``self.moe(hidden, topk_indices, topk_weights)`` after its own router, which is
  redirected; Mixtral's and Qwen's blocks inline softmax top-k and the expert loop, so their
  forward is replaced by the same computation (returning ``(hidden, router_logits)`` as 4.x did).

This module never imports transformers: blocks are recognised by class name and structure, so
it works with whichever version is installed (and fails with a ValueError naming the class
when a block is not one it knows).
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MoEConfig
from ..layer import MegaMoE

__all__ = ["replace_moe_blocks", "MegaMoEExperts", "ExpertsLayout", "SUPPORTED_BLOCKS",
           "DEFAULT_BUFFER_TOKENS"]

# Tokens per rank per call that the buffers hold unless buffer_tokens says otherwise: a prefill
# of a few thousand tokens fits; decode batches are far smaller.
DEFAULT_BUFFER_TOKENS = 4096

# Block class name -> model family. Class names, not classes: importing transformers here would
# tie this module to one version, and the names have been stable across 4.x and 5.x.
SUPPORTED_BLOCKS: dict[str, str] = {
    "MixtralSparseMoeBlock": "mixtral",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "DeepseekV3MoE": "deepseek_v3",
}
_SOFTMAX_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Per-expert Linear names: (gate, up, down). Qwen/DeepSeek use the first, Mixtral 4.x the second.
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_SILU_CLASS_NAMES = ("SiLU", "SiLUActivation")


# ---- reading the experts' weights ----------------------------------------------------------

def _check_silu(act: object, where: str) -> None:
    """moestream computes silu(gate) * up; any other activation would silently change results."""
    if act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ in _SILU_CLASS_NAMES:
        return
    what = "no act_fn attribute" if act is None else f"act_fn {type(act).__name__}"
    raise ValueError(f"{where}: moestream's experts compute silu(gate) * up (SwiGLU), but the "
                     f"experts have {what}; only SiLU-gated experts are supported")


@dataclass(frozen=True)
class ExpertsLayout:
    """How one block stores its routed experts, and their sizes."""

    kind: str                 # "fused" (3D parameters) or "per_expert" (a ModuleList of MLPs)
    num_experts: int
    intermediate: int
    transposed: bool = False  # fused: gate_up_proj [E, H, 2I] and down_proj [E, I, H]
    interleaved: bool = False  # fused: gate_up rows alternate gate, up, gate, up, ...
    names: tuple[str, str, str] = ("", "", "")  # per_expert: (gate, up, down) Linear names

    def extract(self, experts: nn.Module, rng: range) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts ``rng`` in moestream's layout, in the source dtype and device.

        Returns w13 [len(rng), 2I, H] (rows 0..I-1 gate, I..2I-1 up) and w2 [len(rng), H, I];
        views of the source where the layout allows (the caller copies them).
        """
        lo, hi = rng.start, rng.stop
        if self.kind == "per_expert":
            g, u, d = self.names
            w13 = torch.stack([torch.cat([getattr(experts[e], g).weight,
                                          getattr(experts[e], u).weight]) for e in rng])
            w2 = torch.stack([getattr(experts[e], d).weight for e in rng])
            return w13, w2
        gate_up, down = experts.gate_up_proj[lo:hi], experts.down_proj[lo:hi]
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        if self.interleaved:
            gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        return gate_up, down


def _fused_layout(experts: nn.Module, hidden: int, where: str) -> ExpertsLayout:
    gate_up, down = experts.gate_up_proj, experts.down_proj
    for pname, p in (("gate_up_proj", gate_up), ("down_proj", down)):
        if not isinstance(p, torch.Tensor) or p.dim() != 3:
            raise ValueError(f"{where}: experts.{pname} must be a 3D tensor [E, ., .], got "
                             f"{type(p).__name__} {tuple(getattr(p, 'shape', ()))}")
    if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) \
            is not None or getattr(experts, "down_proj_bias", None) is not None:
        raise ValueError(f"{where}: the experts have biases; moestream's experts have none")
    if getattr(experts, "has_gate", True) is False:
        raise ValueError(f"{where}: the experts are not gated (has_gate=False); moestream's "
                         f"experts compute silu(gate) * up")
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        raise ValueError(f"{where}: {type(experts).__name__} defines its own _apply_gate; only "
                         f"the plain silu(gate) * up is supported")
    _check_silu(getattr(experts, "act_fn", None), where)
    E = gate_up.shape[0]

    def fits(transposed: bool) -> int | None:
        """I if the shapes match this orientation, else None."""
        two_i = gate_up.shape[2] if transposed else gate_up.shape[1]
        h_gu = gate_up.shape[1] if transposed else gate_up.shape[2]
        want_down = (E, two_i // 2, hidden) if transposed else (E, hidden, two_i // 2)
        ok = two_i % 2 == 0 and h_gu == hidden and tuple(down.shape) == want_down
        return two_i // 2 if ok else None

    # transformers >= 5 records the orientation (is_transposed); without it the shapes decide,
    # and they always can: both orientations fitting would need 2I == H and I == H at once.
    declared = getattr(experts, "is_transposed", None)
    options = [bool(declared)] if declared is not None else [False, True]
    matches = [(t, fits(t)) for t in options if fits(t) is not None]
    if len(matches) != 1:
        raise ValueError(
            f"{where}: experts.gate_up_proj {tuple(gate_up.shape)} and down_proj "
            f"{tuple(down.shape)} do not match hidden size {hidden} in the layouts moestream "
            f"reads ([E, 2I, H] and [E, H, I], or transposed [E, H, 2I] and [E, I, H]"
            f"{'' if declared is None else f', is_transposed={declared}'})")
    transposed, inter = matches[0]
    return ExpertsLayout("fused", E, inter, transposed=transposed,
                          interleaved=getattr(experts, "is_concatenated", True) is False)


def _per_expert_layout(experts: nn.Module, hidden: int, where: str) -> ExpertsLayout:
    if len(experts) == 0:
        raise ValueError(f"{where}: experts is an empty ModuleList")
    first = experts[0]
    names = next((n for n in _PER_EXPERT_NAMES if all(hasattr(first, a) for a in n)), None)
    if names is None:
        raise ValueError(f"{where}: each expert must have Linear layers named "
                         f"{' or '.join('/'.join(n) for n in _PER_EXPERT_NAMES)}; expert 0 "
                         f"({type(first).__name__}) has {[n for n, _ in first.named_children()]}")
    inter = None
    for e, mlp in enumerate(experts):
        _check_silu(getattr(mlp, "act_fn", None), f"{where} expert {e}")
        shapes = []
        for a in names:
            lin = getattr(mlp, a, None)
            w = getattr(lin, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 2:
                raise ValueError(f"{where}: expert {e}.{a} must be a Linear with a 2D weight")
            if getattr(lin, "bias", None) is not None:
                raise ValueError(f"{where}: expert {e}.{a} has a bias; moestream's experts have "
                                 f"none")
            shapes.append(tuple(w.shape))
        inter = shapes[0][0] if inter is None else inter
        want = [(inter, hidden), (inter, hidden), (hidden, inter)]
        if shapes != want:
            raise ValueError(f"{where}: expert {e} weights {dict(zip(names, shapes))} must be "
                             f"{dict(zip(names, want))} (gate/up [I, H], down [H, I])")
    return ExpertsLayout("per_expert", len(experts), inter, names=names)


# ---- the replacement modules ---------------------------------------------------------------

class MegaMoEExperts(nn.Module):
    """A transformers experts module backed by ``moestream.MegaMoE`` (this rank's experts).

    Called like transformers' own experts: ``forward(hidden_states [..., H], top_k_index
    [..., K] int (global expert ids), top_k_weights [..., K] float) -> [..., H]`` in the dtype
    of ``hidden_states``. Tokens are computed in bf16 with fp32 gate weights. Inference only.
    The layer runs as the torch custom op ``torch.ops.moestream.mega_moe``, so a compiled
    model keeps it in its graph (docs/integrations.md, compiled models).

    Attributes:
        moe: the ``MegaMoE`` (its ``w13`` [E/R, 2I, H] and ``w2`` [E/R, H, I] bf16 hold the
            experts ``moe.expert_range``, or e4m3 with ``w13_scale_inv`` / ``w2_scale_inv``
            for dtype=torch.float8_e4m3fn, or MXFP4 uint8 with ``w13_scale`` / ``w2_scale``
            for dtype=torch.float4_e2m1fn_x2; ``moe.buffer`` its communication buffer).
        num_experts: E over all ranks.
        source: the class name of the block this replaced the experts of.
    """

    def __init__(self, moe: MegaMoE, *, source: str) -> None:
        super().__init__()
        self.moe = moe
        self.num_experts = moe.config.num_experts
        self.top_k = moe.config.top_k
        self.source = source

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        cfg = self.moe.config
        if hidden_states.shape[-1] != cfg.hidden:
            raise ValueError(f"hidden_states must be [..., {cfg.hidden}], got "
                             f"{tuple(hidden_states.shape)}")
        if self.training and torch.is_grad_enabled() and hidden_states.requires_grad:
            # The kernels have no backward: training through them would leave the experts'
            # and every earlier layer's gradients silently wrong.
            raise ValueError("moestream's experts are inference only: call model.eval() or run "
                             "under torch.no_grad() / torch.inference_mode()")
        lead = hidden_states.shape[:-1]
        # inference_mode(False): state the layer creates lazily on its first call (the buffer's
        # pinned diagnostics copy, cached tables) and updates in place on later calls must be
        # ordinary tensors. Created inside a caller's torch.inference_mode() they would be
        # inference tensors, and the next call outside it (generate() runs under no_grad)
        # would fail with "Inplace update to inference tensor outside InferenceMode". Reading
        # the caller's inference tensors in here is allowed.
        with torch.inference_mode(False), torch.no_grad():
            x = hidden_states.detach().reshape(-1, cfg.hidden).to(torch.bfloat16).contiguous()
            T = x.shape[0]
            idx = top_k_index.detach().reshape(T, top_k_index.shape[-1])
            w = top_k_weights.detach().reshape(T, top_k_weights.shape[-1]).float()
            cap = cfg.max_tokens_per_rank
            if T <= cap:
                y = self.moe(x, idx, w)
            elif self.moe.buffer.num_ranks == 1:
                # One rank: chunks are independent calls. Several ranks must call the layer the
                # same number of times, which a per-rank chunk count cannot promise.
                y = torch.cat([self.moe(x[s:s + cap], idx[s:s + cap], w[s:s + cap])
                               for s in range(0, T, cap)])
            else:
                raise ValueError(f"{T} tokens reached a {self.source} on this rank but its "
                                 f"buffers hold {cap} (buffer_tokens); pass a larger "
                                 f"buffer_tokens to replace_moe_blocks or feed smaller batches")
        return y.to(hidden_states.dtype).reshape(*lead, cfg.hidden)

    def extra_repr(self) -> str:
        c = self.moe.config
        r = self.moe.expert_range
        return (f"source={self.source}, experts=[{r.start}, {r.stop}) of {c.num_experts}, "
                f"hidden={c.hidden}, intermediate={c.intermediate}, top_k={c.top_k}")


def _call_experts(self: nn.Module, hidden_states: torch.Tensor, topk_indices: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 (transformers 4.x) ``block.moe``: its forward routes, then calls this."""
    return self.experts(hidden_states, topk_indices, topk_weights)


def _logits_gate_forward(*, top_k: int, norm_topk_prob: bool) -> Callable:
    """The forward of a transformers 4.x Mixtral / Qwen2-MoE / Qwen3-MoE block, with the expert
    loop replaced: the same routing (softmax in fp32, top-k, optional renormalisation, weights
    cast to the activation dtype), the same shared expert, the same return value."""

    def forward(self: nn.Module, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        jitter = getattr(self, "jitter_noise", 0) or 0
        if self.training and jitter > 0:
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - jitter, 1.0 + jitter)
        x = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(x)
        weights, selected = torch.topk(F.softmax(router_logits, dim=1, dtype=torch.float),
                                       top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = self.experts(x, selected, weights.to(x.dtype))
        shared = getattr(self, "shared_expert", None)
        if shared is not None:
            y = y + F.sigmoid(self.shared_expert_gate(x)) * shared(x)
        return y.reshape(batch_size, sequence_length, hidden_dim), router_logits

    return forward


# ---- finding and planning ------------------------------------------------------------------

@dataclass
class _Plan:
    name: str
    block: nn.Module
    style: str        # "experts_call" (5.x), "moe_method" (DeepSeek-V3 4.x), "logits_gate" (4.x)
    layout: ExpertsLayout
    config: MoEConfig
    device: torch.device
    norm_topk_prob: bool = True


def _looks_like_moe(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    router = getattr(module, "gate", None)
    if router is None:
        router = getattr(module, "router", None)
    return isinstance(experts, nn.Module) and isinstance(router, nn.Module)


def _find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Supported blocks in ``named_modules`` order (the same on every rank: the order in which
    the collective MegaMoE constructions happen); ValueError for an unknown MoE-like module."""
    found: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p) for p in inside):
            continue
        cls = type(module).__name__
        if cls in SUPPORTED_BLOCKS:
            found.append((name, module))
            if name == "":
                break  # the model is itself a block
            inside.append(name + ".")
        elif _looks_like_moe(module):
            raise ValueError(f"{name or 'the model'} is a {cls}, which looks like a "
                             f"mixture-of-experts block (it has .experts and a router) but is not "
                             f"a class moestream can convert; supported block classes: "
                             f"{', '.join(SUPPORTED_BLOCKS)}")
    return found


def _plan_block(name: str, block: nn.Module, *, buffer_tokens: int, block_m: int | None,
                device: torch.device | None, fmt: str = "bf16") -> _Plan:
    cls = type(block).__name__
    family = SUPPORTED_BLOCKS[cls]
    where = f"{name or 'the model'} ({cls})"
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if not isinstance(gate, nn.Module) or not isinstance(experts, nn.Module):
        raise ValueError(f"{where}: expected a router module .gate and an experts module "
                         f".experts; found children {[n for n, _ in block.named_children()]}")
    router_w = getattr(gate, "weight", None)
    if not isinstance(router_w, torch.Tensor) or router_w.dim() != 2:
        raise ValueError(f"{where}: the router .gate must have a 2D weight [E, H], got "
                         f"{type(router_w).__name__}")
    if router_w.is_meta:
        raise ValueError(f"{where}: the weights are on the meta device; load or materialise the "
                         f"model before replacing its MoE blocks")
    if device is None:
        device = router_w.device
    num_experts, hidden = router_w.shape
    if isinstance(experts, nn.ModuleList):
        layout = _per_expert_layout(experts, hidden, where)
    elif hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
        layout = _fused_layout(experts, hidden, where)
    else:
        raise ValueError(f"{where}: experts {type(experts).__name__} is neither a ModuleList of "
                         f"per-expert MLPs nor a fused module with gate_up_proj and down_proj")
    if layout.num_experts != num_experts:
        raise ValueError(f"{where}: the router scores {num_experts} experts but the block holds "
                         f"{layout.num_experts}")
    top_k = getattr(gate, "top_k", None) or getattr(block, "top_k", None)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"{where}: cannot find the experts per token (top_k) on the block or "
                         f"its router")

    norm = True
    if layout.kind == "fused":
        style = "experts_call"
    elif family == "deepseek_v3" and callable(getattr(block, "moe", None)):
        style = "moe_method"
    elif family in _SOFTMAX_FAMILIES and type(gate) is nn.Linear:
        style = "logits_gate"
        if family != "mixtral":  # Mixtral always renormalises; Qwen makes it a setting
            norm = getattr(block, "norm_topk_prob", None)
            if not isinstance(norm, bool):
                raise ValueError(f"{where}: the block has no boolean norm_topk_prob")
        if hasattr(block, "shared_expert") != hasattr(block, "shared_expert_gate"):
            raise ValueError(f"{where}: a shared_expert needs its shared_expert_gate")
    else:
        raise ValueError(f"{where}: per-expert experts with a {type(gate).__name__} router is a "
                         f"structure moestream does not recognise for {family}")
    try:
        config = MoEConfig(hidden=hidden, intermediate=layout.intermediate,
                           num_experts=num_experts, top_k=top_k,
                           max_tokens_per_rank=buffer_tokens, dtype=fmt,
                           **({} if block_m is None else {"block_m": block_m}))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    return _Plan(name, block, style, layout, config, device, norm)


def _resolve_group(group):
    """(group, ranks) as ``MegaMoE`` resolves them: None means the default group when
    torch.distributed is initialised, else one rank in this process (group None)."""
    import torch.distributed as dist
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return None, 1
    try:
        return group, dist.get_world_size(group)
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"group must be a torch.distributed process group of this process, got "
                         f"{group!r} ({e})") from e


def _check_for_ranks(plans: list[_Plan], ranks: int) -> None:
    """What several ranks need of every block: a CUDA device and experts that split evenly."""
    for p in plans:
        where = f"{p.name or 'the model'} ({type(p.block).__name__})"
        if p.device.type != "cuda":
            raise ValueError(f"{where}: with {ranks} ranks the experts and buffers must be on a "
                             f"CUDA device (symmetric memory over NVLink), but they would go to "
                             f"{p.device}; move the model to this rank's GPU first or pass "
                             f"device=")
        try:
            p.config.check_ranks(ranks)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e


def _agree(plans: list[_Plan], error: ValueError | None, group, ranks: int) -> None:
    """Collective: every rank learns whether every rank could plan, and that all planned the
    same blocks with the same sizes (the buffers are symmetric: a mismatch would corrupt peer
    memory or hang). Every rank then raises alike, so none is left waiting in a collective."""
    import torch.distributed as dist
    mine = dict(error=None if error is None else str(error),
                blocks=[(p.name, type(p.block).__name__, p.config.to_dict()) for p in plans])
    every: list = [None] * ranks
    dist.all_gather_object(every, mine, group=group)
    if error is not None:
        raise error
    me = dist.get_rank(group)
    for r, theirs in enumerate(every):
        if theirs["error"] is not None:
            raise ValueError(f"rank {r} of the group could not replace its MoE blocks, so no rank "
                             f"does: {theirs['error']}")
    for r, theirs in enumerate(every):
        if theirs["blocks"] != mine["blocks"]:
            diff = next((f"{a} vs {b}" for a, b in zip(mine["blocks"], theirs["blocks"])
                         if a != b), f"{len(mine['blocks'])} vs {len(theirs['blocks'])} blocks")
            raise ValueError(f"replace_moe_blocks must see the same MoE blocks and arguments on "
                             f"every rank of the group (rank {me} vs rank {r}: {diff})")


@torch.no_grad()
def _convert(plan: _Plan, *, group) -> None:
    moe = MegaMoE(plan.config, group=group, device=plan.device)
    w13, w2 = plan.layout.extract(plan.block.experts, moe.expert_range)
    if plan.config.fp8_tokens:   # fp8 / fp4w: quantized here, a few experts at a time
        from ..quant import convert_expert_weights_fp8, convert_expert_weights_mxfp4
        fp8 = plan.config.dtype == "fp8"
        convert = convert_expert_weights_fp8 if fp8 else convert_expert_weights_mxfp4
        scales = ("w13_scale_inv", "w2_scale_inv") if fp8 else ("w13_scale", "w2_scale")
        step = 8   # experts quantized at a time: bounds the fp32 temporaries
        for e in range(0, w13.shape[0], step):
            q = convert(w13[e:e + step].to(plan.device), w2[e:e + step].to(plan.device))
            moe.w13[e:e + step].copy_(q["w13"])
            moe.w2[e:e + step].copy_(q["w2"])
            for name in scales:
                getattr(moe, name)[e:e + step].copy_(q[name])
    else:
        moe.w13.copy_(w13)
        moe.w2.copy_(w2)
    del w13, w2
    block = plan.block
    # Dropping the block's last reference to its experts frees every expert's weights,
    # including the ones other ranks own.
    block.experts = MegaMoEExperts(moe, source=type(block).__name__)
    if plan.style == "moe_method":
        block.moe = types.MethodType(_call_experts, block)
    elif plan.style == "logits_gate":
        block.forward = types.MethodType(
            _logits_gate_forward(top_k=plan.config.top_k, norm_topk_prob=plan.norm_topk_prob),
            block)


# replace_moe_blocks' dtype -> MoEConfig.dtype (MXFP4 where this torch has the fp4 dtype)
_FORMATS = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
if hasattr(torch, "float4_e2m1fn_x2"):
    _FORMATS[torch.float4_e2m1fn_x2] = "fp4w"


def _plan_all(model: nn.Module, *, dtype: torch.dtype, buffer_tokens: int | None,
              block_m: int | None, device) -> list[_Plan]:
    """Check the arguments and every block (ValueError); changes nothing."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    fmt = _FORMATS.get(dtype)
    if fmt is None:
        raise ValueError(f"dtype must be torch.bfloat16, torch.float8_e4m3fn (fp8 experts, "
                         f"DeepSeek-V3 block scales) or torch.float4_e2m1fn_x2 (MXFP4 experts), "
                         f"got {dtype}")
    if buffer_tokens is None:
        buffer_tokens = DEFAULT_BUFFER_TOKENS
    if isinstance(buffer_tokens, bool) or not isinstance(buffer_tokens, int) or buffer_tokens <= 0:
        raise ValueError(f"buffer_tokens must be a positive int, got {buffer_tokens!r}")
    blocks = _find_blocks(model)
    if not blocks:
        raise ValueError(f"found no MoE block in {type(model).__name__}; supported block "
                         f"classes: {', '.join(SUPPORTED_BLOCKS)}")
    # Check every block before changing any, so a failure leaves the model as it was.
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch.device or a device string, got "
                             f"{device!r}") from e
    plans = [_plan_block(name, block, buffer_tokens=buffer_tokens, block_m=block_m, device=device,
                         fmt=fmt)
             for name, block in blocks]
    del blocks
    return plans


def replace_moe_blocks(model: nn.Module, *, group=None, dtype: torch.dtype = torch.bfloat16,
                       buffer_tokens: int | None = None, block_m: int | None = None,
                       device: str | torch.device | None = None) -> nn.Module:
    """Run the routed experts of a transformers MoE model on ``moestream.MegaMoE``, in place.

    Finds every Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V3 sparse MoE block, copies this
    rank's routed experts into a ``MegaMoE`` (w13 [E/R, 2I, H] gate rows then up rows, w2
    [E/R, H, I], bf16) and frees the block's original experts (all of them: the ones other ranks
    own are not needed here). The model's router, shared experts and the block's return value
    are kept. Call it after the model is loaded, and on its device unless ``device`` says where
    the experts go; inference only.

    Collective when ``group`` has several ranks: every rank calls it on the same model
    architecture with the same arguments (checked: one all_gather_object over ``group``, after
    which every rank raises alike when any rank cannot convert), and afterwards every rank must
    run the same MoE layers in the same order (each layer's forward is a collective call).
    Several ranks need the experts on CUDA devices (one GPU per rank).

    Args:
        model: a transformers model (or a single supported block).
        group: torch.distributed process group to split the experts over (rank r holds experts
            [r*E/R, (r+1)*E/R)). None: the default group when torch.distributed is initialised
            (as ``MegaMoE``), else one rank holding every expert in this process.
        dtype: the experts' format: torch.bfloat16, or torch.float8_e4m3fn to quantize them
            at conversion to fp8 with 128x128 block scales (DeepSeek-V3's format) and run the
            fp8 layer (tokens quantized per 128 channels before they cross NVLink;
            docs/quantization.md), or torch.float4_e2m1fn_x2 to quantize them to MXFP4
            (e2m1 pairs, one E8M0 scale per 32 along K) and run the fp4w layer (fp8 tokens;
            half fp8's weight memory, slower than fp8 on H200, docs/quantization.md). The
            model's experts must hold float weights.
        buffer_tokens: most tokens (batch x sequence) one rank passes to one MoE block per
            forward; each block's buffers are sized for it. Default ``DEFAULT_BUFFER_TOKENS``.
            With one rank longer inputs are split into chunks; with several it is an error.
        block_m: ``MoEConfig.block_m`` (pool rows per GEMM block); default MoEConfig's. 16 or 32
            keep Triton's CPU interpreter fast.
        device: where the experts and buffers go; default: each block's router device. Lets a
            model loaded on the CPU copy only this rank's experts to its GPU (move the rest of
            the model there afterwards: the MegaMoE weights already are).

    Returns:
        ``model`` (modified in place).

    Raises:
        ValueError: an MoE-like module of a class not in ``SUPPORTED_BLOCKS``, a supported
            block whose weights moestream cannot represent (biases, non-SiLU activation, sizes
            that are not multiples of 128, ...), no MoE block at all, or a bad argument; with
            several ranks also a non-CUDA device, experts that do not split evenly, or another
            rank's failure or different blocks. Nothing is modified when it raises.
    """
    group, ranks = _resolve_group(group)
    if ranks == 1:
        plans = _plan_all(model, dtype=dtype, buffer_tokens=buffer_tokens, block_m=block_m,
                          device=device)
    else:
        # Collective from here on: no rank builds a buffer unless every rank can.
        try:
            plans, error = _plan_all(model, dtype=dtype, buffer_tokens=buffer_tokens,
                                     block_m=block_m, device=device), None
            _check_for_ranks(plans, ranks)
        except ValueError as e:
            plans, error = [], e
        _agree(plans, error, group, ranks)
    while plans:
        _convert(plans.pop(0), group=group)
    return model
