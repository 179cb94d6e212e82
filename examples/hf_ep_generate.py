"""Greedy generation with a transformers MoE model whose experts are split over the GPUs.

    torchrun --nproc-per-node 2 examples/hf_ep_generate.py        # tiny random Qwen3-MoE
    torchrun --nproc-per-node 8 examples/hf_ep_generate.py --model Qwen/Qwen3-30B-A3B
    python examples/hf_ep_generate.py                              # one process (GPU or CPU)

One process per GPU. Every rank loads the same model, keeps its E/R experts of each MoE block
(``replace_moe_blocks(model, group=WORLD)``), generates from its own prompt and prints the
text (or token ids). Every MoE layer's forward is a collective call, so ``generate`` runs with
``synced_gpus=True``: a rank that finishes early keeps stepping until all have finished.

The default model is a tiny random-weight Qwen3-MoE (nothing downloaded; fp32 outside the
experts); for it each rank also runs the original model first and reports whether the greedy
tokens are the same (a token may flip where two candidates are nearly tied: see
tests/multigpu/test_integrations_multigpu.py). Without torchrun it runs one rank: every expert in this
process, on the GPU if there is one, else on the CPU in Triton's interpreter (about 10 s).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:
    import moestream  # noqa: F401  - before transformers (Triton's interpreter switch on CPU)
except ImportError:   # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moestream.integrations.transformers import MegaMoEExperts, replace_moe_blocks  # noqa: E402

PROMPTS = ["The capital of France is", "Mixture-of-experts layers route each token to",
           "The three laws of thermodynamics", "Once upon a time"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a Hugging Face model name or path (default: "
                   "a tiny random Qwen3-MoE, no download)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    distributed = "RANK" in os.environ
    if distributed:
        from moestream.tools.distributed import init_from_env
        rank, world, device = init_from_env()
        if world > 1 and device.type != "cuda":
            p.error("several ranks need one CUDA GPU each (symmetric memory)")
    else:
        rank, world = 0, 1
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    group = dist.group.WORLD if distributed else None

    tok = None
    if args.model is None:
        from moestream.integrations.tiny import VOCAB, tiny_model
        model = tiny_model("qwen3_moe", args.seed, single_moe_layer=True, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(rank))
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
        tok = AutoTokenizer.from_pretrained(args.model)
        ids = tok(PROMPTS[rank % len(PROMPTS)], return_tensors="pt").input_ids
    ids = ids.to(device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
              do_sample=False, pad_token_id=0 if tok is None else tok.pad_token_id)

    original = None
    if args.model is None:              # small enough to run the original too
        model.to(device)
        original = model.generate(ids, **kw)
    # This rank's experts go straight to its device (a big model loaded on the CPU never holds
    # all experts on the GPU); the rest of the model follows.
    replace_moe_blocks(model, group=group, device=device,
                       block_m=16 if device.type == "cpu" else None)
    model.to(device)
    out = model.generate(ids, synced_gpus=distributed, **kw)

    new = out[0, ids.shape[1]:]
    text = new.tolist() if tok is None else repr(tok.decode(new, skip_special_tokens=True))
    line = f"rank {rank}/{world}: {text}"
    if original is not None:
        diff = (original[0, ids.shape[1]:] != new).nonzero()
        line += (" (same tokens as the original model)" if len(diff) == 0 else
                 f" (differs from the original model from step {int(diff[0])})")
    print(line, flush=True)

    for m in model.modules():           # collective: free the symmetric buffers together
        if isinstance(m, MegaMoEExperts):
            m.moe.destroy()
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
