"""Standalone quantized grouped GEMMs on one GPU: the fp8 kernels (moestream.tools.fp8) and the
MXFP4-weight kernels (moestream.tools.fp4) over the same pool, the benchmarks' timing (CUDA
events, warm-up, median of 20), one JSON row per (shape, format, kernel, tokens per expert).

    PYTHONPATH=. python3 benchmarks/quant_gemm.py --out rows.jsonl [--shapes dsv3,qwen3]

Pool: E experts of ``--experts`` (32 by default, as ``moestream bench --virtual-ranks``), M tokens
each, blocks of 128 rows for fp8. fp4w runs each of ``--fp4w-configs`` (block_m:warps:stages;
by default 64-row blocks, as L1 spills at 128 (docs/quantization.md), and 16-row blocks, the
decode size, only where M <= 128).
Weight bytes: fp8 1 B per weight (+ 128x128 block scales), fp4w 0.5 B (+ one byte per 32).
"""
from __future__ import annotations

import argparse
import json

import torch


def main(argv=None) -> int:
    from moestream.tools.bench import DEFAULT_CALIB, time_cuda
    from moestream.config import SHAPES
    from moestream.tools.fp4 import l1_fp4w, l2_fp4w
    from moestream.tools.fp8 import l1_fp8, l2_fp8, pack_block_meta
    from moestream.quant import (convert_expert_weights_fp8, convert_expert_weights_mxfp4,
                                 quantize_act_fp8)

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="dsv3,qwen3")
    p.add_argument("--tokens-per-expert", default="16,128,2048")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--fp4w-configs", default="64:8:4,16:4:3,16:8:3")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (a dry run)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        H, I, E = SHAPES[shape]["hidden"], SHAPES[shape]["intermediate"], args.experts
        w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * H ** -0.5).bfloat16()
        w2 = (torch.randn(E, H, I, generator=g, device=dev) * I ** -0.5).bfloat16()
        q8 = convert_expert_weights_fp8(w13, w2)
        q4 = convert_expert_weights_mxfp4(w13, w2)
        w13 = w2 = None
        fp4w_cfgs = [tuple(int(v) for v in c.split(":")) for c in args.fp4w_configs.split(",")]
        for M in (int(m) for m in args.tokens_per_expert.split(",")):
            runs = [("fp8", 128, 8, None)] + [
                ("fp4w", bm, w, st) for bm, w, st in fp4w_cfgs if M <= 128 or bm >= 64]
            for fmt, bm, warps, stages in runs:
                for kernel in ("l1", "l2"):
                    nblk = E * -(-M // bm)
                    meta = pack_block_meta([e for e in range(E) for _ in range(-(-M // bm))],
                                           [min(bm, M - j * bm) for _ in range(E)
                                            for j in range(-(-M // bm))], device=dev)
                    K = H if kernel == "l1" else I
                    x = torch.randn(nblk * bm, K, generator=g, device=dev)
                    xq, xs = quantize_act_fp8(x)
                    pw = torch.rand(nblk * bm, generator=g, device=dev)
                    if kernel == "l1" and fmt == "fp8":
                        fn = lambda: l1_fp8(pool_x_q=xq, pool_x_scale=xs, block_meta=meta,
                                            w13_q=q8["w13"], w13_scale_inv=q8["w13_scale_inv"],
                                            pool_weight=pw, block_m=bm, num_warps=8,
                                            num_stages=3, validate=False)
                    elif kernel == "l1":
                        fn = lambda: l1_fp4w(pool_x_q=xq, pool_x_scale=xs, block_meta=meta,
                                             w13_packed=q4["w13"], w13_scale=q4["w13_scale"],
                                             pool_weight=pw, block_m=bm, num_warps=warps,
                                             num_stages=stages, validate=False)
                    elif fmt == "fp8":
                        fn = lambda: l2_fp8(act_q=xq, act_scale=xs, block_meta=meta,
                                            w2_q=q8["w2"], w2_scale_inv=q8["w2_scale_inv"],
                                            block_m=bm, num_warps=8, num_stages=4,
                                            validate=False)
                    else:
                        fn = lambda: l2_fp4w(act_q=xq, act_scale=xs, block_meta=meta,
                                             w2_packed=q4["w2"], w2_scale=q4["w2_scale"],
                                             block_m=bm, num_warps=warps, num_stages=stages,
                                             validate=False)
                    t = time_cuda(fn, warmup=5, reps=20)
                    n_w = E * (2 * I * H if kernel == "l1" else H * I)
                    wbytes = n_w * (1.0 if fmt == "fp8" else 0.5 + 1 / 32)
                    flops = 2 * E * M * (2 * I * H if kernel == "l1" else H * I)
                    us = t["median_us"]
                    row = dict(shape=shape, format=fmt, kernel=kernel, tokens_per_expert=M,
                               experts=E, block_m=bm, num_warps=warps, num_stages=stages,
                               median_us=us,
                               weight_tbps=wbytes / us / 1e6, tflops=flops / us / 1e6,
                               weight_floor_us=wbytes / (DEFAULT_CALIB["weights_tbps"] * 1e6))
                    rows.append(row)
                    print(f"{shape} M={M:5d} {fmt:5s} bm{bm} {warps}w{stages}s "
                          f"{kernel}: {us:8.1f} us "
                          f"{row['weight_tbps']:.2f} TB/s {row['tflops']:.0f} TFLOP/s "
                          f"(weight floor {row['weight_floor_us']:.0f} us)", flush=True)
        q8 = q4 = None
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
