"""Sweep launch tunings of the fused kernel on the GPUs of this machine (EP = all of them).

Each variant is a set of ``moestream.stages.Tuning`` fields applied on top of the layer's
defaults for the call (``Tuning.for_call``); every point is checked against the default
variant's output (bf16 tolerance) before it is timed as CUDA-graph replays (BENCHMARKS.md
protocol: warm-up, median of >= 20 calls, inputs rotated over 4 sets, slowest rank).

    python benchmarks/fused_sweep.py --shapes qwen3,dsv3 --tokens 128,8192 \
        --variants base,dt4,l2n128 --out benchmarks/results/fused_sweep.jsonl
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

_DEFAULT = dict(l2_block_n=128, dispatch_programs=66, dispatch_tile=4, combine_tile=4,
                combine_chunk=512)   # Tuning.for_fused on a 132-SM GPU
VARIANTS = {
    "default": _DEFAULT,
    "eager": {**_DEFAULT, "dispatch_eager": True},
    "eager-dp132": {**_DEFAULT, "dispatch_eager": True, "dispatch_programs": 132},
    "l2n128-dp66-ct4": dict(l2_block_n=128, dispatch_programs=66, dispatch_tile=4,
                            combine_tile=4, combine_chunk=512),
    "l2n128-dp33-ct4": dict(l2_block_n=128, dispatch_programs=33, dispatch_tile=4,
                            combine_tile=4, combine_chunk=512),
    "l2n256-dp66-ct4": dict(l2_block_n=256, dispatch_programs=66, dispatch_tile=4,
                            combine_tile=4, combine_chunk=512),
    "l2n128-dp66-ct4-wave4": dict(l2_block_n=128, dispatch_programs=66, dispatch_tile=4,
                                  combine_tile=4, combine_chunk=512, wave_blocks=528),
    "l2n256": dict(l2_block_n=256),
    "l2n256-dp66": dict(l2_block_n=256, dispatch_programs=66, dispatch_tile=4),
    "l2n128-dt4": dict(l2_block_n=128, dispatch_tokens=4, dispatch_tile=4),
    "l2n128-dp132": dict(l2_block_n=128, dispatch_programs=132, dispatch_tile=4),
    "l2n128-dp66": dict(l2_block_n=128, dispatch_programs=66, dispatch_tile=4),
    "l2n128-dp33": dict(l2_block_n=128, dispatch_programs=33, dispatch_tile=4),
    "l2n128-wave4": dict(l2_block_n=128, wave_blocks=528),
    "base": {},
    "dt4": dict(dispatch_tokens=4, dispatch_tile=4),
    "dt8": dict(dispatch_tokens=8, dispatch_tile=4),
    "l2n128": dict(l2_block_n=128),
    "s3": dict(fused_stages=3),
    "dt4-l2n128": dict(dispatch_tokens=4, dispatch_tile=4, l2_block_n=128),
    "w4": dict(fused_warps=4, l1_block_n=64, l2_block_n=128),
}


def _worker(rank, world, shapes, tokens, variants, reps, seed):
    import torch.distributed as dist

    from moestream import MoEConfig, SymmBuffer, mega_moe
    from moestream.bench import slowest, time_cuda
    from moestream.bench_ep import _capture, _inputs
    from moestream.stages import Tuning
    from moestream.testing import rel_error

    dev = torch.device("cuda", rank)
    rows = []
    for shape in shapes:
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=max(tokens))
        g = torch.Generator().manual_seed(seed + 17 * rank)
        e_loc = cfg.experts_per_rank(world)
        w13 = (torch.randn(e_loc, 2 * cfg.intermediate, cfg.hidden, generator=g)
               * cfg.hidden ** -0.5).bfloat16().to(dev)
        w2 = (torch.randn(e_loc, cfg.hidden, cfg.intermediate, generator=g)
              * cfg.intermediate ** -0.5).bfloat16().to(dev)
        buf = SymmBuffer(cfg, group=dist.group.WORLD)
        for T in tokens:
            sets = _inputs(cfg, T, g, dev, skew=None, sets=4)
            ref = None
            for name in variants:
                tuning = dataclasses.replace(Tuning.for_call(buf, T), **VARIANTS[name])
                graphs = _capture(sets, lambda a: mega_moe(a[0], a[1], a[2], w13, w2, buf,
                                                           impl="fused", tuning=tuning))
                graphs[0][0].replay()
                torch.cuda.synchronize()
                buf.check()
                y = graphs[0][1].clone()
                err = 0.0 if ref is None else rel_error(y, ref)
                ref = y if ref is None else ref
                dist.barrier()
                st = slowest(time_cuda(lambda i: graphs[i][0].replay(), warmup=5, reps=reps,
                                       rotate=list(range(len(sets)))))
                buf.check()
                if rank == 0:
                    row = dict(shape=shape, ranks=world, tokens_per_rank=T, variant=name,
                               tuning=VARIANTS[name], median_us=st["median_us"],
                               p20_us=st["p20_us"], p80_us=st["p80_us"],
                               rel_diff_vs_base=err)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                graphs = None
        buf.destroy()
        w13 = w2 = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from moestream.cli import _ints, _names
    from moestream.distributed import spawn
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_names, default=["qwen3", "dsv3"])
    p.add_argument("--tokens", type=_ints, default=[128, 8192])
    p.add_argument("--variants", type=_names, default=list(VARIANTS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/fused_sweep.jsonl")
    a = p.parse_args()
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("the fused sweep needs CUDA GPUs")
    rows = spawn(_worker, world_size=torch.cuda.device_count(), backend="nccl",
                 args=(a.shapes, a.tokens, a.variants, a.reps, a.seed), timeout_s=3000)[0]
    with open(a.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
