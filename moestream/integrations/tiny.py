"""Tiny random-weight transformers MoE models for tests and benchmarks (no downloads).

Shared by the integration's CPU tests, its multi-GPU tests and ``moestream bench-layer``'s CPU
check. transformers is imported inside the functions: importing this module (part of
moestream, so moestream is imported first, as Triton's interpreter switch on CPU-only machines
requires) never needs it.

Sizes: hidden 256, expert width 128 (moestream's sizes are multiples of 128), 4 experts (8 for
DeepSeek-V3, in 4 groups), top-2, vocabulary 128, 2 layers. ``initializer_range`` = 1/sqrt(H)
gives O(1) activations in every layer, so the experts' output is a large part of the logits
and a wrong expert shows in them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FAMILIES", "HIDDEN", "EXPERT_WIDTH", "VOCAB", "MODEL_CLASSES", "tiny_config",
           "tiny_model", "moe_blocks"]

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
HIDDEN, EXPERT_WIDTH, VOCAB = 256, 128, 128
MODEL_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def tiny_config(family: str, *, single_moe_layer: bool, **overrides: Any):
    """The transformers config of a tiny ``family`` model.

    ``single_moe_layer``: exactly one MoE layer, the last one (Mixtral: a 1-layer model; the
    others: layer 0 dense, layer 1 MoE), so the router of that layer sees bit-equal inputs
    whatever the experts compute; else 2 layers, both MoE. ``overrides`` replace config fields
    (e.g. ``num_hidden_layers=1``).
    """
    import transformers
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                  initializer_range=HIDDEN ** -0.5)
    if family == "mixtral":
        if single_moe_layer:
            common["num_hidden_layers"] = 1   # every Mixtral layer is an MoE layer
        return transformers.MixtralConfig(**{**dict(
            intermediate_size=EXPERT_WIDTH, num_local_experts=4, num_experts_per_tok=2),
            **common, **overrides})
    dense_first = dict(mlp_only_layers=[0]) if single_moe_layer else {}
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**{**dict(
            intermediate_size=256, moe_intermediate_size=EXPERT_WIDTH,
            shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=False), **dense_first, **common, **overrides})
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**dict(
            intermediate_size=256, moe_intermediate_size=EXPERT_WIDTH, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, head_dim=64),
            **dense_first, **common, **overrides})
    # group-limited routing: 8 experts in 4 groups, the best 2 groups, 2 experts per token
    return transformers.DeepseekV3Config(**{**dict(
        intermediate_size=256, moe_intermediate_size=EXPERT_WIDTH, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1 if single_moe_layer else 0,
        kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=64), **common, **overrides})


def tiny_model(family: str, seed: int, *, single_moe_layer: bool,
               dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> nn.Module:
    """An eval-mode causal LM of ``family`` on the CPU whose random weights depend only on
    ``seed`` (the global RNG is left as it was), in ``dtype``. DeepSeek-V3's
    ``e_score_correction_bias`` is drawn too (it is zeros after init), so tests exercise it."""
    import transformers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, MODEL_CLASSES[family])(
            tiny_config(family, single_moe_layer=single_moe_layer, **overrides))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model.to(dtype).eval()


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's sparse MoE blocks (the classes ``replace_moe_blocks`` converts), in order."""
    from .transformers import SUPPORTED_BLOCKS
    return [m for m in model.modules() if type(m).__name__ in SUPPORTED_BLOCKS]
