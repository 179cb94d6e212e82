"""What a staged GEMM launch costs besides its tiles: time against the number of m-blocks it
walks, from none (the prologue and the rank signal only) to every expert's, next to an empty
Triton kernel on the same grid (the launch and the two events around it), and a plain read
of the same weight bytes (``read``: every byte loaded once and summed, no MMA, no epilogue),
which bounds what any kernel streaming those bytes can reach under this protocol, and the
L2's bytes read in the decode L2's own tile order (``read-tiles``: [128, 64] boxes by TMA,
two programs per SM, tiles dealt round-robin), which bounds that access pattern.
``--tile-forms`` adds other forms of that read (``TILE_FORMS``: four programs per SM,
K-block-major boxes, pointer loads), ``--mma-tiles`` the same walk with the decode L2's MMA
(``mma-tiles``) and with its stores (``mma-tiles-store``; ``mma-tiles-store-el``: stored at L2
evict_last priority, as the decode L2 stores its slots): what the L2's MMA and its output
cost on top of its reads.

bf16 and fp8 variants (fp8: weight bytes are the e4m3 values). One GPU, one virtual rank, E
experts of M rows each (the GEMM bench's pool; at M <= 128 one
m-block per expert, so k blocks = k experts' tiles). The count the kernels read
(``block_start[E/R]``) is set to k before each timing, so one compile serves every k. The
protocol is the GEMM bench's (``moestream.bench.time_cuda``, queue-ahead). A line through
the points gives each launch's fixed cost (the intercept) and its streaming rate (the
slope, in weight bytes).

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
                   STAGES: tl.constexpr, EXPERT_ROWS: tl.constexpr, K_BLOCKED: tl.constexpr):
        # the decode GEMM's access pattern without its MMA: tile t is weight rows
        # t*ROWS .. t*ROWS+ROWS-1 of [experts * rows, K], read in KS steps of [ROWS, BK]
        # boxes (TMA, as the GEMM loads them), tiles dealt round-robin. K_BLOCKED: the same
        # bytes stored K-block-major ([experts, KS, rows, BK], seen as [experts * KS * rows,
        # BK]), so that every box is ROWS * BK contiguous elements
        pid = tl.program_id(0)
        acc = tl.zeros([ROWS, BK], tl.float32)
        for t in range(pid, tiles, tl.num_programs(0)):
            expert = (t * ROWS) // EXPERT_ROWS
            row = (t * ROWS) % EXPERT_ROWS
            for i in tl.range(0, KS, num_stages=STAGES):
                if K_BLOCKED:
                    acc += w_desc.load([(expert * KS + i) * EXPERT_ROWS + row, 0]).to(tl.float32)
                else:
                    acc += w_desc.load([t * ROWS, i * BK]).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))
    return read_tiles


def _read_tiles_ptr_kernel():
    from moestream.kernels._common import tl, triton

    @triton.jit
    def read_tiles_ptr(w_ptr, out_ptr, tiles, K, KS, ROWS: tl.constexpr, BK: tl.constexpr,
                       STAGES: tl.constexpr):
        # read_tiles' walk with pointer loads (what the L2 does with use_tma off)
        pid = tl.program_id(0)
        acc = tl.zeros([ROWS, BK], tl.float32)
        for t in range(pid, tiles, tl.num_programs(0)):
            rows = t * ROWS + tl.arange(0, ROWS)
            ptrs = w_ptr + rows[:, None].to(tl.int64) * K + tl.arange(0, BK)[None, :]
            for i in tl.range(0, KS, num_stages=STAGES):
                acc += tl.load(ptrs + i * BK).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))
    return read_tiles_ptr


def _mma_tiles_kernel():
    from moestream.kernels._common import tl, triton

    @triton.jit
    def mma_tiles(w_desc, x_desc, out_ptr, tiles, KS, ROWS: tl.constexpr, BK: tl.constexpr,
                  STAGES: tl.constexpr, EXPERT_ROWS: tl.constexpr, XROWS: tl.constexpr,
                  STORE: tl.constexpr, EVICT: tl.constexpr = ""):
        # read-tiles plus the decode L2's MMA: tile t of expert e = t*ROWS // EXPERT_ROWS
        # multiplies its [ROWS, BK] weight boxes by the expert's [XROWS, BK] row boxes (both by
        # TMA, weights as the MMA's row operand, as the GEMM does) into [ROWS, XROWS] fp32.
        # STORE: each tile's [XROWS, ROWS] result is stored in bf16 at out[e*XROWS.., column
        # block] (the decode L2's epilogue without its scattered slots), else summed per program;
        # EVICT: the stores' L2 cache priority ("" or "evict_last")
        pid = tl.program_id(0)
        total = tl.zeros([ROWS, XROWS], tl.float32)
        for t in range(pid, tiles, tl.num_programs(0)):
            expert = (t * ROWS) // EXPERT_ROWS
            acc = tl.zeros([ROWS, XROWS], tl.float32)
            for i in tl.range(0, KS, num_stages=STAGES):
                w = w_desc.load([t * ROWS, i * BK])
                x = x_desc.load([expert * XROWS, i * BK])
                acc = tl.dot(w, x.T, acc)
            if STORE:
                rows = expert * XROWS + tl.arange(0, XROWS)
                cols = (t * ROWS) % EXPERT_ROWS + tl.arange(0, ROWS)
                tl.store(out_ptr + rows[:, None] * EXPERT_ROWS + cols[None, :],
                         tl.trans(acc).to(tl.bfloat16), eviction_policy=EVICT)
            else:
                total += acc
        if not STORE:
            tl.store(out_ptr + pid, tl.sum(tl.sum(total, axis=1), axis=0))
    return mma_tiles


READ_BLOCK = 4096      # elements per program per step (8 KB of bf16)
READ_PER_SM = 4        # programs per SM: ~32 KB of loads in flight per program at 4 stages


def read_bytes(read, x: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """One launch of ``read`` over the first n elements of flat ``x`` (partials into out)."""
    read[(out.numel(),)](x, out, n, BLOCK=READ_BLOCK, STAGES=4)


TILE_ROWS, TILE_K = 128, 64   # the bf16 decode L2's weight box
# read-tiles forms: programs per SM, pipeline depth, K-block-major bytes, pointer loads.
# "read-tiles" is the decode L2 as it runs (two programs per SM, 5 stages, [E, H, I] weights
# by TMA); "-4sm": four programs per SM in 3 stages (every tile of 32 qwen3 experts in flight
# at once, one per program); "-kb": each [128, 64] box contiguous (the weights stored [E, I /
# 64, H, 64]); "-ptr": the same boxes by pointer loads (cp.async) instead of TMA
TILE_FORMS = {"read-tiles": (2, 5, False, False), "read-tiles-4sm": (4, 3, False, False),
              "read-tiles-kb": (2, 5, True, False), "read-tiles-kb-4sm": (4, 3, True, False),
              "read-tiles-ptr": (2, 5, False, True)}


def k_blocked(w2: torch.Tensor, bk: int = TILE_K) -> torch.Tensor:
    """[E, H, I] weights stored K-block-major, [E * I / bk * H, bk]: rows (e, k step, h)."""
    E, H, I = w2.shape
    return w2.view(E, H, I // bk, bk).permute(0, 2, 1, 3).contiguous().view(-1, bk)


def read_tiles_bytes(read_tiles, w2d: torch.Tensor, k: int, expert_rows: int, K: int,
                     out: torch.Tensor, *, stages: int, k_blocked: bool) -> None:
    """One launch of ``read_tiles`` over the first k experts' tiles of ``w2d`` ([rows, K], or
    ``k_blocked``'s form of it)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    desc = TensorDescriptor.from_tensor(w2d, [TILE_ROWS, TILE_K])
    read_tiles[(out.numel(),)](desc, out, k * expert_rows // TILE_ROWS, K // TILE_K,
                               ROWS=TILE_ROWS, BK=TILE_K, STAGES=stages,
                               EXPERT_ROWS=expert_rows, K_BLOCKED=k_blocked, num_warps=4)


MMA_ROWS = 16   # the decode L2's piece: 16 rows per expert


def mma_tiles_bytes(mma_tiles, w2d: torch.Tensor, x2d: torch.Tensor, k: int, expert_rows: int,
                    out: torch.Tensor, programs: int, *, store: bool, evict: str = "") -> None:
    """One launch of ``mma_tiles`` over the first k experts: w2d [E * H, I], x2d [E * 16, I];
    out is [E * 16, H] bf16 with ``store``, else ``programs`` fp32 partial sums."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    wd = TensorDescriptor.from_tensor(w2d, [TILE_ROWS, TILE_K])
    xd = TensorDescriptor.from_tensor(x2d, [MMA_ROWS, TILE_K])
    mma_tiles[(programs,)](wd, xd, out, k * expert_rows // TILE_ROWS, w2d.shape[1] // TILE_K,
                           ROWS=TILE_ROWS, BK=TILE_K, STAGES=5, EXPERT_ROWS=expert_rows,
                           XROWS=MMA_ROWS, STORE=store, EVICT=evict, num_warps=4)


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
    from moestream.testing import quantize_weights

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
    p.add_argument("--tile-forms", default="read-tiles",
                   help=f"read-tiles forms to time: {', '.join(TILE_FORMS)} (empty: none)")
    p.add_argument("--mma-tiles", action="store_true",
                   help="also time the read-tiles walk with the decode L2's MMA, summed and stored")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON lines, appended")
    p.add_argument("--plot", default=None, help="PNG of time against weight bytes")
    p.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (a dry run)")
    a = p.parse_args(argv)
    names = [n for n in a.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    forms = [f for f in a.tile_forms.split(",") if f]
    if any(f not in TILE_FORMS for f in forms):
        p.error(f"unknown --tile-forms {forms}; known: {list(TILE_FORMS)}")
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
    # the L2's bytes in its own tile order (read-tiles: as the decode L2 walks them), and the
    # other forms of TILE_FORMS asked for
    read_tiles = _read_tiles_kernel()
    read_tiles_ptr = _read_tiles_ptr_kernel()
    w2d = w2.view(E * H, I)
    w2kb = k_blocked(w2) if any(TILE_FORMS[f][2] for f in forms) else None
    if H % TILE_ROWS == 0 and I % TILE_K == 0:
        for form in forms:
            per_sm, stages_, kb, ptr = TILE_FORMS[form]
            tile_partials = torch.zeros(sms * per_sm, dtype=torch.float32, device=dev)
            src = w2kb if kb else w2d

            def launch(k):
                if ptr:
                    read_tiles_ptr[(tile_partials.numel(),)](
                        w2d, tile_partials, k * H // TILE_ROWS, I, I // TILE_K, ROWS=TILE_ROWS,
                        BK=TILE_K, STAGES=stages_, num_warps=4)
                else:
                    read_tiles_bytes(read_tiles, src, k, H, I, tile_partials, stages=stages_,
                                     k_blocked=kb)
            for k in blocks:
                t = time_cuda(lambda: launch(k), **timing)
                rows.append(dict(variant=form, kernel="l2", blocks=k,
                                 weight_bytes=k * H * I * 2, programs=tile_partials.numel(), **t))
            got = float(tile_partials.sum())
            want = float(w2d[:blocks[-1] * H].float().sum())
            assert abs(got - want) <= 1e-3 * max(1.0, float(w2d.float().abs().sum())), \
                (form, got, want)
    if a.mma_tiles and H % TILE_ROWS == 0 and I % TILE_K == 0:
        # the read-tiles walk with the decode L2's MMA (mma-tiles: summed; mma-tiles-store: each
        # tile stored as the L2's epilogue would, without the slots), two programs per SM
        mma_tiles = _mma_tiles_kernel()
        x2d = (torch.randn(E * MMA_ROWS, I, generator=gpu_gen, device=dev)).bfloat16()
        y = torch.empty(E * MMA_ROWS, H, dtype=torch.bfloat16, device=dev)
        mma_partials = torch.zeros(sms * 2, dtype=torch.float32, device=dev)
        for form, store, evict in (("mma-tiles", False, ""), ("mma-tiles-store", True, ""),
                                   ("mma-tiles-store-el", True, "evict_last")):
            out = y if store else mma_partials
            for k in blocks:
                t = time_cuda(lambda: mma_tiles_bytes(mma_tiles, w2d, x2d, k, H, out, sms * 2,
                                                      store=store, evict=evict),
                              **timing)
                rows.append(dict(variant=form, kernel="l2", blocks=k,
                                 weight_bytes=k * H * I * 2, programs=sms * 2, **t))
            if dev.type != "cuda":
                # Triton 3.6's interpreter multiplies bf16 tiles loaded by descriptor wrongly in
                # tl.dot (the loaded values store back exactly); the product kernels load by
                # pointer there, so only a GPU run checks these values
                continue
            kk = blocks[-1]
            want = torch.einsum("erk,ehk->erh", x2d[:kk * MMA_ROWS].view(kk, MMA_ROWS, I).float(),
                                w2[:kk].float())
            if store:
                got = y[:kk * MMA_ROWS].view(kk, MMA_ROWS, H).float()
                err = float((got - want).norm() / want.norm()) if kk else 0.0
                assert err <= 1e-2, (form, err)   # bf16 output
            else:
                got, ref = float(mma_partials.sum()), float(want.sum())
                assert abs(got - ref) <= 1e-3 * max(1.0, float(want.abs().sum())), (form, got, ref)
        forms = forms + ["mma-tiles", "mma-tiles-store", "mma-tiles-store-el"]
    w8 = None   # fp8 copies of the weights, made when an fp8 variant first needs them
    for name in names:
        v = VARIANTS[name]
        if v.dtype not in ("bf16", "fp8"):
            p.error(f"{name}: bf16 and fp8 variants only")
        cfg = MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K, block_m=v.block_m,
                        max_tokens_per_rank=E * M // K, dtype=v.dtype)
        buf, _, _, prepared = _prepare(cfg, 1, M, v, dev, gen)
        count = buf.view("block_start", 0)[E:E + 1]
        full = int(count.item())
        assert full == E, (full, E)   # one m-block per expert
        tuning = replace(prepared, wait=False)
        if v.dtype == "fp8":   # e4m3 weights and their 128x128 block scales (bytes: values)
            if w8 is None:
                w8 = quantize_weights([w13], [w2])
            wl1, wl2, per = w8[0], w8[1], 1
        else:
            wl1, wl2, per = [w13], [w2], 2
        gemms = {"l1": (lambda: stages.l1(buf, wl1, tuning=tuning), 2 * I * H * per),
                 "l2": (lambda: stages.l2(buf, wl2, tuning=tuning), H * I * per)}
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
    for name in ["read"] + forms + names:
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
        _plot(rows, ["read"] + forms + names, a.plot)
    return 0


def _plot(rows, names, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kernel in zip(axes, ("l1", "l2")):
        for name in names:
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
