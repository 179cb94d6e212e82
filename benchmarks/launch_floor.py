"""What a staged GEMM launch costs besides its tiles: time against the number of m-blocks it
walks, from none (the prologue and the rank signal only) to every expert's, next to an empty
Triton kernel on the same grid (the launch and the two events around it), and a plain read
of the same weight bytes (``read``: every byte loaded once and summed, no MMA, no epilogue),
which bounds what any kernel streaming those bytes can reach under this protocol, and the
L2's bytes read in the decode L2's own tile order (``read-tiles``: [128, 64] boxes by TMA,
two programs per SM, tiles dealt round-robin), which bounds that access pattern.

One GPU, one virtual rank, E experts of M rows each (the GEMM bench's pool; at M <= 128 one
m-block per expert, so k blocks = k experts' tiles). The count the kernels read
(``block_start[E/R]``) is set to k before each timing, so one compile serves every k. The
protocol is the GEMM bench's (``moestream.bench.time_cuda``, queue-ahead). A line through
the points gives each launch's fixed cost (the intercept) and its streaming rate (the
slope, in weight bytes): benchmarks/NOTES.md, session 22.

    PYTHONPATH=. python3 benchmarks/launch_floor.py --shape qwen3 --variants dec16,dec16-devdesc \\
        --out rows.jsonl --plot floor.png
    PYTHONPATH=. python3 benchmarks/launch_floor.py --device cpu --dims 256,128 --experts 2 \\
        --blocks 0,1,2 --reps 1 --warmup 0     # a dry run under Triton's interpreter
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import torch



def _empty_kernel():
    from moestream.kernels._common import tl, triton

    @triton.jit
    def empty(x_ptr, N: tl.constexpr):
        if N < 0:   # never: a program that loads nothing and stores nothing
            tl.store(x_ptr, 0)
    return empty


def _read_kernel():
    from moestream.kernels._common import tl, triton

    @triton.jit
    def read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        # a grid-stride walk over n elements in BLOCK-element steps, summed in fp32 so that
        # no load is dead; one partial sum per program
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK
        acc = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(pid * BLOCK, n, step, num_stages=STAGES):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))
    return read


def _read_tiles_kernel():
    from moestream.kernels._common import tl, triton

    @triton.jit
    def read_tiles(w_desc, out_ptr, tiles, KS, ROWS: tl.constexpr, BK: tl.constexpr,
                   STAGES: tl.constexpr):
        # the decode GEMM's access pattern without its MMA: tile t is weight rows
        # t*ROWS .. t*ROWS+ROWS-1 of [experts * rows, K], read in KS steps of [ROWS, BK]
        # boxes (TMA, as the GEMM loads them), tiles dealt round-robin
        pid = tl.program_id(0)
        acc = tl.zeros([ROWS, BK], tl.float32)
        for t in range(pid, tiles, tl.num_programs(0)):
            for i in tl.range(0, KS, num_stages=STAGES):
                acc += w_desc.load([t * ROWS, i * BK]).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))
    return read_tiles


READ_BLOCK = 4096      # elements per program per step (8 KB of bf16)
READ_PER_SM = 4        # programs per SM: ~32 KB of loads in flight per program at 4 stages


def read_bytes(read, x: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """One launch of ``read`` over the first n elements of flat ``x`` (partials into out)."""
    read[(out.numel(),)](x, out, n, BLOCK=READ_BLOCK, STAGES=4)


TILE_ROWS, TILE_K, TILE_STAGES = 128, 64, 5   # the bf16 decode L2's weight box and depth


def read_tiles_bytes(read_tiles, w2d: torch.Tensor, k: int, per_expert_rows: int,
                     out: torch.Tensor) -> None:
    """One launch of ``read_tiles`` over the first k experts' rows of ``w2d`` [rows, K]."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    desc = TensorDescriptor.from_tensor(w2d, [TILE_ROWS, TILE_K])
    read_tiles[(out.numel(),)](desc, out, k * per_expert_rows // TILE_ROWS,
                               w2d.shape[1] // TILE_K, ROWS=TILE_ROWS, BK=TILE_K,
                               STAGES=TILE_STAGES, num_warps=4)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points (>= 2 distinct x)."""
    if len({p[0] for p in points}) < 2:
        raise ValueError(f"a line needs points at two or more distinct x, got {points}")
    slope, intercept = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
    return float(intercept), float(slope)


def main(argv=None) -> int:
    from moestream import stages
    from moestream.bench import time_cuda
    from moestream.bench_kernels import VARIANTS, _prepare, picks_per_token
    from moestream.config import SHAPES, MoEConfig

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    p.add_argument("--dims", default=None, help="H,I instead of the shape's (dry runs)")
    p.add_argument("--experts", type=int, default=32, help="local experts (one rank)")
    p.add_argument("--rows", type=int, default=16, help="rows per expert (<= 128)")
    p.add_argument("--variants", default="dec16,dec16-devdesc",
                   help=f"GEMM bench variants: {', '.join(sorted(VARIANTS))}")
    p.add_argument("--blocks", default=None,
                   help="m-block counts to time (default 0, 1, 2, 4, ... and all)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON lines, appended")
    p.add_argument("--plot", default=None, help="PNG of time against weight bytes")
    p.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (a dry run)")
    a = p.parse_args(argv)
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    if not 1 <= a.rows <= 128:
        p.error(f"--rows must be 1..128 (one m-block per expert), got {a.rows}")
    if a.experts < 1:
        p.error(f"--experts must be >= 1, got {a.experts}")
    dims = SHAPES[a.shape]
    H, I = (int(v) for v in a.dims.split(",")) if a.dims else (dims["hidden"],
                                                               dims["intermediate"])
    E, M = a.experts, a.rows
    blocks = ([int(b) for b in a.blocks.split(",")] if a.blocks else
              sorted({0, E} | {1 << i for i in range(E.bit_length()) if 1 << i <= E}))
    if any(not 0 <= b <= E for b in blocks):
        p.error(f"--blocks must lie in 0..{E} (one m-block per expert), got {blocks}")
    dev = torch.device(a.device)
    gen = torch.Generator().manual_seed(0)
    gpu_gen = torch.Generator(device=dev).manual_seed(0)
    K = picks_per_token(experts=E, rows_per_expert=M, ranks=1, top_k=dims["top_k"])
    w13 = (torch.randn(E, 2 * I, H, generator=gpu_gen, device=dev) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=gpu_gen, device=dev) * I ** -0.5).bfloat16()
    rows = []
    timing = dict(warmup=a.warmup, reps=a.reps, queue_ahead=dev.type == "cuda")
    empty = _empty_kernel()
    read = _read_kernel()
    scratch = torch.zeros(1, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    partials = torch.zeros(sms * READ_PER_SM, dtype=torch.float32, device=dev)
    for kernel, w in (("l1", w13), ("l2", w2)):   # the plain read of each GEMM's weight bytes
        flat, per_expert = w.view(-1), w[0].numel()
        for k in blocks:
            t = time_cuda(lambda: read_bytes(read, flat, k * per_expert, partials), **timing)
            rows.append(dict(variant="read", kernel=kernel, blocks=k,
                             weight_bytes=k * per_expert * 2, programs=partials.numel(), **t))
        got, want = float(partials.sum()), float(flat[:blocks[-1] * per_expert].float().sum())
        assert abs(got - want) <= 1e-3 * max(1.0, float(flat.float().abs().sum())), (got, want)
    # the L2's bytes in its own tile order (read-tiles: as the decode L2 walks them, two
    # programs per SM)
    read_tiles = _read_tiles_kernel()
    tile_partials = torch.zeros(sms * 2, dtype=torch.float32, device=dev)
    w2d = w2.view(E * H, I)
    if H % TILE_ROWS == 0 and I % TILE_K == 0:
        for k in blocks:
            t = time_cuda(lambda: read_tiles_bytes(read_tiles, w2d, k, H, tile_partials),
                          **timing)
            rows.append(dict(variant="read-tiles", kernel="l2", blocks=k,
                             weight_bytes=k * H * I * 2, programs=tile_partials.numel(), **t))
        got, want = float(tile_partials.sum()), float(w2d[:blocks[-1] * H].float().sum())
        assert abs(got - want) <= 1e-3 * max(1.0, float(w2d.float().abs().sum())), (got, want)
    for name in names:
        v = VARIANTS[name]
        if v.dtype != "bf16":
            p.error(f"{name}: bf16 variants only")
        cfg = MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K, block_m=v.block_m,
                        max_tokens_per_rank=E * M // K)
        buf, _, _ = _prepare(cfg, 1, M, v, dev, gen)
        count = buf.view("block_start", 0)[E:E + 1]
        full = int(count.item())
        assert full == E, (full, E)   # one m-block per expert
        tuning = replace(v.tuning, wait=False)
        gemms = {"l1": (lambda: stages.l1(buf, [w13], tuning=tuning), 2 * I * H * 2),
                 "l2": (lambda: stages.l2(buf, [w2], tuning=tuning), H * I * 2)}
        for kernel, (fn, expert_bytes) in gemms.items():
            grid = stages._programs(buf, tuning, tuning.gemm_per_sm)
            t = time_cuda(lambda: empty[(grid,)](scratch, 1), **timing)
            rows.append(dict(variant=name, kernel=f"empty[{kernel} grid]", blocks=0,
                             weight_bytes=0, programs=grid, **t))
            for k in blocks:
                count.fill_(k)
                t = time_cuda(fn, **timing)
                rows.append(dict(variant=name, kernel=kernel, blocks=k,
                                 weight_bytes=k * expert_bytes, **t))
            count.fill_(full)
        buf.destroy()
    for r in rows:
        r.update(shape=a.shape if not a.dims else f"{H}x{I}", experts=E, rows_per_expert=M,
                 device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    summary = []
    for name in ["read", "read-tiles"] + names:
        for kernel in ("l1", "l2"):
            pts = [(r["weight_bytes"], r["median_us"]) for r in rows
                   if r["variant"] == name and r["kernel"] == kernel and r["blocks"] > 0]
            if len({x for x, _ in pts}) >= 2:
                c, s = fit_line(pts)
                summary.append(dict(variant=name, kernel=kernel, fixed_us=c,
                                    tbps=1 / s / 1e6 if s > 0 else None))
    for r in rows:
        print(f"{r['variant']:>22} {r['kernel']:>14} blocks {r['blocks']:>4} "
              f"{r['median_us']:9.2f} us (p20 {r['p20_us']:.2f}, p80 {r['p80_us']:.2f})")
    for s in summary:
        rate = f"{s['tbps']:.2f} TB/s" if s["tbps"] else "-"
        print(f"{s['variant']:>22} {s['kernel']}: fixed {s['fixed_us']:.2f} us + weights at {rate}")
    if a.out:
        with open(a.out, "a") as f:
            for r in rows + [dict(fit=True, **s) for s in summary]:
                f.write(json.dumps(r) + "\n")
    if a.plot:
        _plot(rows, names, a.plot)
    return 0


def _plot(rows, names, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kernel in zip(axes, ("l1", "l2")):
        for name in ["read", "read-tiles"] + names:
            pts = [(r["weight_bytes"] / 1e6, r["median_us"]) for r in rows
                   if r["variant"] == name and r["kernel"] == kernel]
            ax.plot(*zip(*pts), marker="o", label=name, ls="--" if name == "read" else "-")
            floor = [r["median_us"] for r in rows
                     if r["variant"] == name and r["kernel"] == f"empty[{kernel} grid]"]
            if floor:
                ax.axhline(floor[0], ls=":", lw=1, color=ax.lines[-1].get_color())
        ax.set_xlabel("weight MB streamed")
        ax.set_ylabel("µs per launch")
        ax.set_title(f"{kernel}: time vs m-blocks walked")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("dotted: an empty kernel on the GEMM's grid; dashed: a plain read of the "
                 "same weight bytes", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
