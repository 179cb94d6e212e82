"""Run the MoE layers of Hugging Face transformers models on moestream, and check the logits.

    python examples/hf_replace_moe.py
    python examples/hf_replace_moe.py --families mixtral,deepseek_v3 --batch 4 --seq 64

For each family (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) it builds a small 2-layer model
with random weights from a config written below (nothing is downloaded), runs it in fp32 (the
reference) and in bf16, replaces its sparse MoE blocks with ``replace_moe_blocks``, runs it
again on the same tokens and prints relative logit differences ||a - b|| / ||b||: moestream
against the original bf16 model, and each of the two bf16 runs against fp32.

Both bf16 runs differ from each other and from fp32 by rounding: expect a few 1e-3. Up to ~2e-2
can be legitimate when that noise flips a later layer's router between two near-tied experts
(random weights make near-ties common; the "vs fp32" columns show which run flipped); a wrong
result shows as 1e-1 or more, and makes the exit status 1.

Runs on the GPU when there is one (the first replaced forward includes Triton's compilation),
else on the CPU with the kernels in Triton's interpreter (about 10 s for all four families).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    # moestream before transformers: transformers' model classes import Triton, and on a machine
    # without CUDA moestream must switch Triton to its interpreter first.
    import moestream  # noqa: F401
except ImportError:   # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.integrations.transformers import SUPPORTED_BLOCKS, replace_moe_blocks  # noqa: E402
from moestream.testing import rel_error  # noqa: E402

import torch  # noqa: E402

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def build(family: str, *, vocab: int) -> torch.nn.Module:
    """A 2-layer random-weight model; hidden 256 and expert width 128 (moestream's sizes are
    multiples of 128)."""
    import transformers as tf
    common = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096)
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **common))
    if family == "qwen2_moe":   # with its sigmoid-gated shared expert
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, **common))
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            intermediate_size=256, moe_intermediate_size=128, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, head_dim=64, **common))
    if family == "deepseek_v3":  # layer 0 dense, layer 1 MoE: sigmoid, group-limited routing
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8,
            n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=64,
            q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, **common))
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


def timed_logits(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(ids).logits
        if ids.is_cuda:
            torch.cuda.synchronize()
    return logits, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated, from {', '.join(FAMILIES)}")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=128)
    args = p.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    for f in families:
        if f not in FAMILIES:
            p.error(f"unknown family {f!r}; choose from {', '.join(FAMILIES)}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The interpreter's cost grows with the number of GEMM blocks: small blocks on the CPU.
    block_m = None if device.type == "cuda" else 16
    tokens = args.batch * args.seq
    print(f"device {device} ({'compiled kernels' if device.type == 'cuda' else 'Triton interpreter'})"
          f", {args.batch} x {args.seq} tokens, bf16")
    print(f"{'family':<12} {'MoE blocks':>10} {'params':>8} {'bf16 s':>7} {'moestream s':>11} "
          f"{'vs bf16':>9} {'bf16 vs fp32':>12} {'moestream vs fp32':>17}")
    worst = 0.0
    for family in families:
        torch.manual_seed(args.seed)
        model = build(family, vocab=args.vocab).to(device).eval()
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        reference, _ = timed_logits(model, ids)
        model.to(torch.bfloat16)
        before, t_before = timed_logits(model, ids)
        replace_moe_blocks(model, buffer_tokens=max(tokens, 16), block_m=block_m)
        blocks = sum(type(m).__name__ in SUPPORTED_BLOCKS for m in model.modules())
        after, t_after = timed_logits(model, ids)
        err = rel_error(after, before)
        worst = max(worst, err)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{family:<12} {blocks:>10} {n_params / 1e6:>7.2f}M {t_before:>7.2f} "
              f"{t_after:>11.2f} {err:>9.2e} {rel_error(before, reference):>12.2e} "
              f"{rel_error(after, reference):>17.2e}")
    print(f"largest difference to the original bf16 model: {worst:.2e} (above ~2e-2 in a "
          f"'vs fp32' column: a router flipped between near-tied experts in that run)")
    return 0 if worst <= 5e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
