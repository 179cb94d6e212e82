"""The expert-parallel layer on every GPU of a node, checked against the reference.

    torchrun --nproc-per-node 8 examples/ep_layer.py        # EP8: 32 of dsv3's 256 experts per GPU
    torchrun --nproc-per-node 1 examples/ep_layer.py        # one GPU holds all experts

Each rank builds ``MegaMoE`` (its E/R experts and its symmetric buffer), routes its own tokens
and calls the layer; every rank checks its output against the pure-torch reference run on all
experts.
"""
import os

import torch
import torch.distributed as dist

from moestream import MegaMoE, MoEConfig, moe_forward, route

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))

cfg = MoEConfig.from_shape("dsv3", max_tokens_per_rank=512)   # or MoEConfig(hidden=..., ...)
moe = MegaMoE(cfg)                   # collective: this rank's experts and symmetric buffer
moe.reset_parameters(torch.Generator().manual_seed(rank))     # or load your experts' weights

x = torch.randn(128, cfg.hidden, device="cuda", dtype=torch.bfloat16)
idx, w = route(torch.randn(128, cfg.num_experts, device="cuda"), cfg.top_k)
y = moe(x, idx, w)                   # [128, H] bf16; moe.forward_logits(x, logits) routes too

# the reference needs every rank's experts: gather them (test only; the layer never does)
w13s = [torch.empty_like(moe.w13) for _ in range(world)]
w2s = [torch.empty_like(moe.w2) for _ in range(world)]
dist.all_gather(w13s, moe.w13.data)
dist.all_gather(w2s, moe.w2.data)
ref = moe_forward(x, idx, w, torch.cat(w13s), torch.cat(w2s))
err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
print(f"rank {rank}/{world}: y {tuple(y.shape)}, rel error vs reference {err:.1e} (bf16: < 1e-2)")
moe.destroy()
dist.destroy_process_group()
raise SystemExit(0 if err < 1e-2 else 1)
