"""Where the publish launch's GPU time goes: the whole launch against its two parts run alone.

For each shape and token count, on one GPU with two virtual ranks (an EP2 rank's experts):
``stages.publish`` (copy x and the picks into the buffer, number every expert's picks, zero
the counters), ``stages.pick_slots`` (the numbering alone, the same ``number_picks`` loop in a
launch of its own) and a plain device copy of x. Each is timed as a CUDA graph of 10 launches,
median of 20 replays (µs per launch): the launch's cost against the sum of its parts.

    PYTHONPATH=. python benchmarks/publish_probe.py --out benchmarks/results/publish.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from moestream import stages
from moestream.buffer import SymmBuffer
from moestream.config import MoEConfig
from moestream.testing import make_routing, make_tokens


def graph_time(fn, *, reps: int = 10, iters: int = 20) -> float:
    """Median µs per call of ``fn`` captured ``reps`` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    ts = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / reps)
    return sorted(ts)[len(ts) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3,dsv3")
    ap.add_argument("--tokens", default="1,128,2048,8192")
    ap.add_argument("--copy-warps", type=int, default=None,
                    help="stages.Tuning.copy_warps of the publish and pick_slots launches")
    ap.add_argument("--out", default=None, help="JSON file of the rows")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("publish_probe needs a CUDA GPU")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        for T in tokens:
            cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=max(tokens))
            buf = SymmBuffer(cfg, num_ranks=2, device="cuda")
            gen = torch.Generator(device="cpu").manual_seed(T)
            x = make_tokens(T, cfg.hidden, generator=gen).cuda()
            idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=gen)
            idx, w = idx.cuda().contiguous(), w.cuda().contiguous()
            t = stages.Tuning.for_call(buf, T)
            if args.copy_warps:
                t = replace(t, copy_warps=args.copy_warps)
            y = torch.empty_like(x)
            row = dict(shape=shape, T=T, gpu=torch.cuda.get_device_name(0),
                       copy_warps=t.copy_warps,
                       publish_us=round(graph_time(
                           lambda: stages.publish(buf, 0, x, idx, w, tuning=t)), 1),
                       pick_slots_us=round(graph_time(
                           lambda: stages.pick_slots(idx, cfg.num_experts, tuning=t)), 1),
                       copy_us=round(graph_time(lambda: y.copy_(x)), 1))
            print(row, flush=True)
            rows.append(row)
            buf.destroy()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
