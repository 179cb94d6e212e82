"""The expert-parallel transformers cases: a worker that replaces a tiny model's MoE blocks
across a process group and returns its findings, and the greedy-generation comparison that
judges them (tests/multigpu/test_integrations_multigpu.py on GPUs, tests/layer on one CPU
rank). Their tolerances and the near-tie rule are explained in the multi-GPU test's
docstring."""
from __future__ import annotations

import torch

WORLD = 2
TOL = 2e-2
FLIP_MARGIN = 0.05
NEW_TOKENS = 16
PROMPT_LEN = 8
SEED = 2024
EP_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


# ---- the worker (also run on the CPU with one rank: tests/layer/test_integrations_transformers.py) --

def _replaced(model):
    from moestream.integrations.transformers import MegaMoEExperts
    return [m for m in model.modules() if isinstance(m, MegaMoEExperts)]


def _destroy(model) -> None:
    for m in _replaced(model):      # collective: every rank frees its buffers together
        m.moe.destroy()


def _check_logits(family, rank, world, seed, dev, block_m, group) -> dict:
    """bf16 model, one MoE layer: logits before/after replacement on this rank's batch, and
    which experts this rank now holds."""
    from moestream.integrations.tiny import VOCAB, moe_blocks, tiny_model
    from moestream.integrations.transformers import replace_moe_blocks
    from moestream.testing import rel_error
    model = tiny_model(family, seed, single_moe_layer=True).to(dev)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    ids = torch.randint(0, VOCAB, (2 + rank, PROMPT_LEN), generator=g).to(dev)
    # The experts each rank should keep, in moestream's layout (5.x fused: gate rows first).
    want = []
    for b in moe_blocks(model):
        e = b.experts.gate_up_proj.shape[0]
        lo, hi = rank * e // world, (rank + 1) * e // world
        want.append((lo, hi, b.experts.gate_up_proj[lo:hi].clone(),
                     b.experts.down_proj[lo:hi].clone()))
    with torch.inference_mode():
        before = model(ids).logits
    replace_moe_blocks(model, group=group, block_m=block_m)
    held = []
    for m, (lo, hi, w13, w2) in zip(_replaced(model), want):
        r = m.moe.expert_range
        held.append(dict(range=(r.start, r.stop), want=(lo, hi),
                         weights_exact=bool(torch.equal(m.moe.w13, w13)
                                            and torch.equal(m.moe.w2, w2))))
    with torch.inference_mode():
        after = model(ids).logits
    # no_grad after inference_mode: the layer's lazily made state must not be an inference
    # tensor (generate() runs under no_grad, often after an inference_mode forward)
    with torch.no_grad():
        again = model(ids).logits
    _destroy(model)
    return dict(tokens=ids.numel(), err=rel_error(after, before),
                err_again=rel_error(again, before), held=held, blocks=len(held))


def _check_blocks(family, rank, world, seed, dev, block_m, group) -> list[float]:
    """bf16 model, two MoE layers (two buffers per rank, called in order): each block on the
    inputs the original model gave it (a router flip after the first would not be a bug)."""
    from moestream.integrations.tiny import VOCAB, moe_blocks, tiny_model
    from moestream.integrations.transformers import replace_moe_blocks
    from moestream.testing import rel_error
    model = tiny_model(family, seed + 1, single_moe_layer=False).to(dev)
    blocks = moe_blocks(model)
    seen: dict[int, tuple] = {}
    hooks = [b.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args, out)))
             for i, b in enumerate(blocks)]
    g = torch.Generator().manual_seed(seed * 100 + 50 + rank)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1 + 2 * rank, PROMPT_LEN), generator=g).to(dev))
    for h in hooks:
        h.remove()
    replace_moe_blocks(model, group=group, block_m=block_m)
    errs = []
    for i, block in enumerate(blocks):
        args, want = seen[i]
        with torch.no_grad():
            got = block(*args)
        errs.append(rel_error(got, want))
    _destroy(model)
    return errs


def _check_generate(family, rank, world, seed, dev, block_m, group, new_tokens) -> dict:
    """fp32 model with bf16-exact experts, one MoE layer: greedy generate before and after."""
    from moestream.integrations.tiny import VOCAB, moe_blocks, tiny_model
    from moestream.integrations.transformers import replace_moe_blocks
    model = tiny_model(family, seed + 2, single_moe_layer=True, dtype=torch.float32)
    with torch.no_grad():
        for b in moe_blocks(model):
            for p in b.experts.parameters():
                p.copy_(p.bfloat16().float())
    model.to(dev)
    # transformers' per-expert loop, not grouped_mm: fp32 experts through plain fp32 matmuls
    # (grouped_mm's fp32 support on CUDA depends on the torch build)
    model.set_experts_implementation("eager")
    model.generation_config.eos_token_id = None     # no early stop: equal steps on every rank
    g = torch.Generator().manual_seed(seed * 100 + 70 + rank)
    ids = torch.randint(0, VOCAB, (2 + rank, PROMPT_LEN), generator=g).to(dev)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    orig = model.generate(ids, **kw)
    orig_tokens = orig.sequences[:, PROMPT_LEN:]
    replace_moe_blocks(model, group=group, block_m=block_m)
    ours = model.generate(ids, synced_gpus=True, **kw)
    # Teacher forcing: the original's tokens through the replaced model's cached decode path.
    forced = []
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        forced.append(out.logits[:, -1])
        for s in range(new_tokens - 1):
            out = model(orig_tokens[:, s:s + 1], past_key_values=out.past_key_values,
                        use_cache=True)
            forced.append(out.logits[:, -1])
    _destroy(model)
    return dict(orig_tokens=orig_tokens, new_tokens=ours.sequences[:, PROMPT_LEN:],
                orig_logits=torch.stack(orig.logits).float(),
                new_logits=torch.stack(ours.logits).float(),
                forced_logits=torch.stack(forced).float())


def ep_worker(rank: int, world: int, seed: int, device: str, families, new_tokens: int,
              block_m: int | None) -> dict:
    """One rank (moestream.tools.distributed.spawn): findings per family.

    device "cuda": this rank's GPU (NCCL group, EP = world); "cpu": one gloo rank with the
    kernels in Triton's interpreter (the CPU test of this worker's code).
    """
    import torch.distributed as dist

    import moestream  # noqa: F401  - before transformers (Triton's interpreter switch on CPU)
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    out = {}
    for i, family in enumerate(families):
        s = seed + 1000 * i
        out[family] = dict(
            rank=rank,
            logits=_check_logits(family, rank, world, s, dev, block_m, group),
            blocks=_check_blocks(family, rank, world, s, dev, block_m, group),
            generate=_check_generate(family, rank, world, s, dev, block_m, group, new_tokens))
    return out


# ---- the parent's analysis --------------------------------------------------------------------

def compare_generation(orig_tokens: torch.Tensor, new_tokens: torch.Tensor,
                       orig_logits: torch.Tensor, new_logits: torch.Tensor,
                       forced_logits: torch.Tensor, *, tol: float = TOL,
                       flip_margin: float = FLIP_MARGIN) -> dict:
    """Compare two greedy generations of the same prompts (tokens [B, N], logits [N, B, V]).

    Row b is compared up to its first differing step d_b (N when none): the logits of steps
    0..min(d_b, N-1) share a prefix, so they must agree within ``tol``; a divergence is allowed
    only where the original's margin between its token and the other run's token is below
    ``flip_margin`` (a near-tie that rounding can flip). ``forced_logits``: the other model
    fed the original's tokens; every step must agree within ``tol``. Returns the findings;
    ``problems`` lists every violation (empty: pass).
    """
    from moestream.testing import rel_error
    B, N = orig_tokens.shape
    problems, flips, worst = [], [], 0.0
    for b in range(B):
        diff = (orig_tokens[b] != new_tokens[b]).nonzero()
        d = int(diff[0]) if len(diff) else N
        for s in range(min(d + 1, N)):
            err = rel_error(new_logits[s, b], orig_logits[s, b])
            worst = max(worst, err)
            if err > tol:
                problems.append(f"row {b} step {s}: logits differ by {err:.2e} (> {tol})")
        if d < N:
            t_o, t_n = int(orig_tokens[b, d]), int(new_tokens[b, d])
            margin = float(orig_logits[d, b, t_o] - orig_logits[d, b, t_n])
            flips.append((b, d, margin))
            if margin >= flip_margin:
                problems.append(f"row {b} step {d}: token {t_n} instead of {t_o}, but the "
                                f"original preferred {t_o} by {margin:.3f} (>= {flip_margin}): "
                                f"not a near-tie")
    forced = [rel_error(forced_logits[s], orig_logits[s]) for s in range(N)]
    for s, err in enumerate(forced):
        if err > tol:
            problems.append(f"teacher-forced step {s}: logits differ by {err:.2e} (> {tol})")
    return dict(problems=problems, flips=flips, worst_err=worst, forced_worst=max(forced))
