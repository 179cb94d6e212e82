"""The ``moestream`` command. GPU: needs CUDA GPUs. Any: also runs on a CPU, where the
kernels run in Triton's interpreter (correct, not fast).

    moestream run          the layer here, every path checked against the reference (any)
    moestream check        versions, GPUs and symmetric memory of this install (any)
    moestream bench        the layer over all GPUs vs all_to_all + grouped GEMM, the
                           grouped GEMMs alone with --virtual-ranks, or the layer on R
                           virtual ranks of one GPU with --virtual-ranks R --layer (GPU)
    moestream bench-layer  one transformers MoE decoder layer, its experts vs ours (GPU)
    moestream trace        the timeline of one fused-kernel call (GPU)
    moestream probe        this machine's calibration for the simulator (GPU)
    moestream simulate     the model of token vs chunk streaming at scale (any)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from ..config import SHAPES
from .terminal import (MissingExtraError, console as _console, names_from, nonnegative_int,
                       nonnegative_ints, positive_int, positive_ints, print_table, progress)

__all__ = ["main", "build_parser"]


# ---- run --------------------------------------------------------------------------------

def _run_worker(rank: int, world: int, cfg_dict: dict, T: int, seed: int, provider: str):
    """One rank of `moestream run`: returns (rank, rel error vs reference, seconds)."""
    import torch

    from .. import MoEConfig, SymmBuffer, mega_moe
    from .baselines.torch_a2a import moe_forward_a2a
    from ..reference import moe_forward
    from ..testing import make_routing, make_tokens, make_weights, rel_error
    import torch.distributed as dist

    cfg = MoEConfig(**cfg_dict)
    dev = torch.device("cuda", rank) if torch.cuda.is_available() and provider != "torch-gloo" \
        else torch.device("cpu")
    w13s, w2s = make_weights(cfg, world, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1 + rank)
    x = make_tokens(T, cfg.hidden, generator=g, device=dev)
    idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=g, device=dev, drop=0.02)
    w13, w2 = w13s[rank].to(dev), w2s[rank].to(dev)
    if provider.startswith("torch"):
        fn = lambda: moe_forward_a2a(x, idx, w, w13, w2, num_experts=cfg.num_experts)
    else:   # "staged" or "fused"
        buf = SymmBuffer(cfg, group=dist.group.WORLD, device=dev)
        fn = lambda: mega_moe(x, idx, w, w13, w2, buf, impl=provider)
    y = fn()  # first call compiles
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()  # time the second call from a common start, not a peer's compile
    t0 = time.perf_counter()
    y = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ref = moe_forward(x, idx, w, torch.cat(w13s).to(dev), torch.cat(w2s).to(dev))
    err = rel_error(y, ref)
    if not provider.startswith("torch"):
        buf.check()
        buf.destroy()
    return rank, err, seconds


def _run_virtual(cfg, R: int, T: int, seed: int, *, impl: str = "staged",
                 granularity: int | str = "token"):
    """The layer on R virtual ranks; fp8 / fp4w configs against the quantization-aware
    reference."""
    import torch

    from .. import SymmBuffer, mega_moe_virtual
    from ..reference import moe_forward_ranks
    from ..testing import make_routing, make_tokens, make_weights, quantize_weights, rel_error
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w13s, w2s = make_weights(cfg, R, generator=torch.Generator().manual_seed(seed), device=dev)
    if cfg.fp8_tokens:
        w13s, w2s = quantize_weights(w13s, w2s, fmt=cfg.dtype)
    xs, idxs, ws = [], [], []
    for r in range(R):
        g = torch.Generator().manual_seed(seed + 1 + r)
        xs.append(make_tokens(T, cfg.hidden, generator=g, device=dev))
        i, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=g, device=dev, drop=0.02)
        idxs.append(i)
        ws.append(w)
    buf = SymmBuffer(cfg, num_ranks=R, device=dev)
    def call():
        return mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf, impl=impl, granularity=granularity)
    call()   # compile / warm up
    t0 = time.perf_counter()
    ys = call()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    refs = moe_forward_ranks(xs, idxs, ws, w13s, w2s, quant=cfg.dtype)
    return max(rel_error(y, r) for y, r in zip(ys, refs)), seconds, dev.type


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from .. import MoEConfig
    from .distributed import spawn
    from ..testing import TOLERANCE

    con = _console()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    R = args.ranks or (gpus if gpus >= 1 else 2)
    if gpus:
        cfg = MoEConfig(hidden=2048, intermediate=768, num_experts=16 * R, top_k=8,
                        max_tokens_per_rank=args.tokens or 512)
    else:
        cfg = MoEConfig(hidden=256, intermediate=128, num_experts=4 * R, top_k=2,
                        max_tokens_per_rank=args.tokens or 24, block_m=16)
    T = cfg.max_tokens_per_rank
    con.print(f"[bold]moestream run[/]: {'GPU' if gpus else 'CPU'}, {R} ranks, "
              f"H={cfg.hidden} I={cfg.intermediate} E={cfg.num_experts} K={cfg.top_k}, "
              f"{T} tokens per rank")
    jobs = []   # (label, provider, backend): one process per rank
    if gpus:
        jobs += [("staged", "staged", "nccl"), ("fused", "fused", "nccl"),
                 ("torch all_to_all", "torch", "nccl")]
    else:
        jobs.append(("torch all_to_all (gloo)", "torch-gloo", "gloo"))
    # the kernels on R virtual ranks in this process: each streaming mode and format
    chunk = 2 * cfg.block_m
    virtual = [("staged", "staged", "token", cfg),
               ("fused", "fused", "token", cfg),
               (f"fused, {chunk}-token chunks", "fused", chunk, cfg),
               ("staged fp8", "staged", "token", cfg.with_(dtype="fp8")),
               ("staged fp4w", "staged", "token", cfg.with_(dtype="fp4w")),
               ("fused fp4w", "fused", "token", cfg.with_(dtype="fp4w"))]
    rows = []
    with progress(con, transient=True) as prog:
        task = prog.add_task("running", total=len(jobs) + len(virtual))
        for label, provider, backend in jobs:
            prog.update(task, description=f"{label}, {R} processes")
            res = spawn(_run_worker, world_size=R, backend=backend,
                        args=(cfg.to_dict(), T, args.seed, provider), timeout_s=900)
            rows.append((label, f"{R} processes", "bf16", max(r[1] for r in res),
                         max(r[2] for r in res)))
            prog.advance(task)
        for label, impl, gran, vcfg in virtual:
            prog.update(task, description=f"{label}, {R} virtual ranks")
            err, sec, _ = _run_virtual(vcfg, R, T, args.seed, impl=impl, granularity=gran)
            rows.append((label, f"{R} virtual", vcfg.dtype, err, sec))
            prog.advance(task)
    ok, cells = True, []
    for label, ranks, dtype, err, sec in rows:
        tol = TOLERANCE[dtype]
        ok &= err < tol
        cells.append([label, ranks, dtype, f"{err:.2e}", f"{tol:.0e}", f"{sec * 1e3:.0f} ms",
                      "[green]ok[/]" if err < tol else "[red]FAILED[/]"])
    print_table(con, title="each path against the fp32 reference", rows=cells, keys=(0, 1, 2),
                columns=[("path", "left"), ("ranks", "left"), ("dtype", "left"),
                         ("rel error", "right"), ("tolerance", "right"), ("time", "right"),
                         ("status", "right")])
    con.print("rel error = ||y - ref|| / ||ref|| over all ranks' outputs, against the fp32 "
              "reference (fp8 / fp4w: with the same quantized weights and tokens).")
    if gpus:
        con.print("time: the second call of each path, launches included; "
                  "`moestream bench` measures performance.")
    else:
        con.print("time: the kernels ran in Triton's CPU interpreter; these are interpreter "
                  "times, not performance.")
    return 0 if ok else 1


# ---- check ------------------------------------------------------------------------------

def cmd_check(args: argparse.Namespace) -> int:
    import numpy
    import torch
    from rich.table import Table

    from .. import __version__
    from ..kernels.common import INTERPRET, triton

    con = _console()
    t = Table(title="moestream check")
    t.add_column("item")
    t.add_column("value")
    t.add_row("moestream", __version__)
    t.add_row("python", sys.version.split()[0])
    t.add_row("torch", torch.__version__)
    t.add_row("triton", triton.__version__)
    t.add_row("numpy", numpy.__version__)
    t.add_row("tested with", "torch 2.11 + triton 3.6 on H200s; torch 2.13 (CPU) + triton 3.6")
    t.add_row("kernels run", "Triton interpreter (CPU)" if INTERPRET else "compiled for the GPU")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    t.add_row("CUDA GPUs", str(n))
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        hopper = "yes" if p.major >= 9 else "no (kernels still run; no TMA)"
        t.add_row(f"  cuda:{i}", f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.0f} GiB, Hopper: {hopper}")
    try:
        import torch.distributed._symmetric_memory as symm_mem
        t.add_row("symmetric memory", "torch.distributed._symmetric_memory importable")
        try:
            t.add_row("NVSHMEM backend", str(symm_mem.is_nvshmem_available()))
        except Exception as exc:  # noqa: BLE001 - report, don't fail
            t.add_row("NVSHMEM backend", f"unknown ({type(exc).__name__})")
        has_vdev = hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d")
        t.add_row("all_to_all_vdev_2d", str(has_vdev))
    except ImportError as exc:
        t.add_row("symmetric memory", f"unavailable ({exc})")
    if n >= 2:
        t.add_row("peer access 0<->1", str(torch.cuda.can_device_access_peer(0, 1)))
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        t.add_row(var, os.environ.get(var, "(unset)"))
    con.print(t)
    return 0


# ---- bench ------------------------------------------------------------------------------

def _save_plot(con, plot, *args, **kwargs) -> None:
    """Save a plot; without matplotlib, say how to get it and go on (the rows are saved)."""
    try:
        plot(*args, **kwargs)
    except MissingExtraError as exc:
        con.print(f"[yellow]no plot: {exc}[/]")
        return
    con.print(f"plot saved to {args[1]}")


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .bench import plot_rows, print_table, results_path, update_rows

    con = _console()
    if not torch.cuda.is_available():
        con.print("[red]moestream bench needs a CUDA GPU[/] (moestream run and the tests "
                  "cover the CPU)")
        return 2
    if args.layer and not args.virtual_ranks:
        con.print("[red]--layer needs --virtual-ranks R (the layer over the GPUs is the "
                  "default without either)[/]")
        return 2
    if args.layer:
        from .bench_virtual import bench_virtual
        with progress(con) as prog:
            total = len(args.shapes) * len(args.dtype) * len(args.tokens)
            task = prog.add_task("virtual ranks", total=total)
            try:
                rows = bench_virtual(shapes=args.shapes, tokens=args.tokens,
                                     ranks=args.virtual_ranks, dtypes=args.dtype,
                                     impls=args.impl, experts=args.experts, reps=args.reps,
                                     graph=args.graph,
                                     progress=lambda label: prog.update(
                                         task, advance=1, description=label))
            except ValueError as e:
                con.print(f"[red]{e}[/]")
                return 2
        out = Path(args.out or results_path("layer_virtual", num_gpus=1))
        cols = ["shape", "ranks", "tokens_per_rank", "dtype", "provider", "median_us",
                "p20_us", "p80_us", "tflops_per_gpu", "agrees"]
    elif args.virtual_ranks:
        from .bench_kernels import VARIANTS, bench_gemm
        variants = args.variants or list(VARIANTS)
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            con.print(f"[red]--variants: {unknown} not known; choose from {', '.join(VARIANTS)}[/]")
            return 2
        rows = []
        with progress(con) as prog:
            total = len(args.shapes) * len(args.tokens_per_expert) * len(variants)
            task = prog.add_task("GEMM bench", total=total)
            for shape in args.shapes:
                rows += bench_gemm(shape=shape, tokens_per_expert=args.tokens_per_expert,
                                   experts_per_rank=args.experts_per_rank,
                                   virtual_ranks=args.virtual_ranks, variants=variants,
                                   reps=args.reps, progress=lambda: prog.advance(task))
        out = Path(args.out or results_path("gemm", num_gpus=1))
        cols = ["shape", "kernel", "tokens_per_expert", "provider", "median_us",
                "tflops_per_gpu", "weight_tbps", "efficiency"]
    else:
        from .bench_ep import compose_providers, parse_tuning, run_ep_bench
        try:
            tuning = parse_tuning(args.tuning)
        except ValueError as e:
            con.print(f"[red]--tuning: {e}[/]")
            return 2
        try:
            providers, skipped = compose_providers(
                impl=args.impl, dtype=args.dtype, graph=args.graph, granularity=args.granularity,
                per_stage=args.per_stage, tuned=bool(tuning), baselines=args.baselines)
        except ValueError as e:
            con.print(f"[red]{e}[/]")
            return 2
        if skipped:
            con.print(f"[yellow]not run (no such path): {'; '.join(skipped)}[/]")
        con.print(f"providers: {', '.join(providers)}")
        try:
            rows = run_ep_bench(shapes=args.shapes, tokens=args.tokens,
                                providers=providers, reps=args.reps, skew=args.skew,
                                tuning=tuning, block_m=args.block_m, experts=args.experts)
        except ValueError as e:
            con.print(f"[red]{e}[/]")
            return 2
        world = torch.cuda.device_count()
        out = Path(args.out or results_path("ep" if world > 1 else "layer", num_gpus=world))
        cols = ["shape", "tokens_per_rank", "dtype", "provider", "median_us", "p20_us",
                "p80_us", "floor_us", "efficiency"]
    update_rows(out, rows)
    con.print(f"{len(rows)} rows written to {out}")
    plot = None if args.no_plot else Path(args.plot or out.with_suffix(".png"))
    if plot and not args.virtual_ranks and rows:
        title = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        _save_plot(con, plot_rows, rows, plot, title=title)
        if any(r.get("stages_us") for r in rows):
            from .bench_ep import plot_stages
            _save_plot(con, plot_stages, rows, plot.with_name(plot.stem + "_stages.png"))
    print_table(rows, title="moestream bench", columns=cols, console=con)
    staged = [r for r in rows if r.get("stages_us")]
    if staged:
        from ..staged import STAGES
        print_table([{**r, **{f"{n} µs": r["stages_us"].get(n) for n in STAGES}} for r in staged],
                    title="staged call, GPU time per stage (slowest rank)",
                    columns=["shape", "tokens_per_rank", "provider", "median_us"]
                    + [f"{n} µs" for n in STAGES], console=con)
    return 0


# ---- trace --------------------------------------------------------------------------------

def _granularity_arg(s: str) -> int | str:
    if s in ("token", "expert"):
        return s
    try:
        return positive_int(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected token, expert or a chunk size in tokens, got {s!r}") from None


def _per_sm_cell(per_sm: dict) -> str:
    """`moestream trace`'s program time per SM: each phase's, then the gaps between tasks."""
    return " / ".join(f"{v:.0f}" for v in per_sm.values())


def _phase_cell(ph: dict) -> str:
    """``moestream trace`` table cell of one phase: its span, its tasks and their median µs."""
    if not ph["tasks"]:
        return "- (0)"
    return (f"{ph['start_us']:.0f}-{ph['end_us']:.0f} "
            f"({ph['tasks']} x {ph['task_us']:.1f})")


def cmd_trace(args: argparse.Namespace) -> int:
    import json

    import torch
    from rich.table import Table

    from .bench_ep import parse_tuning
    from .trace import PHASES, plot_timeline, run_trace, summarize

    con = _console()
    try:
        overrides = parse_tuning(args.tuning)
    except ValueError as e:
        con.print(f"[red]--tuning: {e}[/]")
        return 2
    if args.virtual_ranks and args.ranks:
        con.print("[red]--virtual-ranks runs on one GPU: leave out --ranks[/]")
        return 2
    if not torch.cuda.is_available():
        con.print("[red]moestream trace needs CUDA GPUs[/] (the interpreter has no clock; the "
                  "tests cover the trace rows on the CPU)")
        return 2
    with con.status(f"tracing {args.shape}, {args.tokens} tokens/rank, {args.granularity}"):
        if args.virtual_ranks:   # R ranks in one launch on this process's GPU
            from .. import MoEConfig
            from .trace import collect_virtual
            cfg = MoEConfig.from_shape(args.shape, max_tokens_per_rank=args.tokens)
            if args.experts:
                cfg = cfg.with_(num_experts=args.experts)
            try:
                cfg.experts_per_rank(args.virtual_ranks)
            except ValueError as e:
                con.print(f"[red]--virtual-ranks: {e}[/]")
                return 2
            rows = collect_virtual(cfg, ranks=args.virtual_ranks,
                                   tokens=[args.tokens] * args.virtual_ranks, device="cuda",
                                   granularity=args.granularity, seed=args.seed,
                                   overrides=overrides)
        else:
            rows = run_trace(shape=args.shape, tokens=args.tokens, world=args.ranks,
                             granularity=args.granularity, seed=args.seed, tuning=overrides)
    summary = summarize(rows)
    # one column per rank, one row per figure: fits a narrow terminal at any rank count
    t = Table(title=f"fused kernel trace: {args.shape}, {args.tokens} tokens/rank, "
                    f"granularity {args.granularity}"
                    + (f", tuning {args.tuning}" if overrides else ""))
    t.add_column("")
    for s in summary:
        t.add_column(f"rank {s['rank']}", justify="right")
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    figures = [("layer µs", lambda s: f"{s['layer_us']:.0f}")]
    figures += [(f"{p} µs (tasks x µs)", lambda s, p=p: _phase_cell(s["phases"][p]))
                for p in PHASES]
    figures += [("comm hidden", lambda s: pct(s["comm_hidden"])),
                ("L1 during dispatch", lambda s: pct(s["l1_during_dispatch"])),
                ("L2 during L1", lambda s: pct(s["l2_during_l1"])),
                ("L2 waiting on L1", lambda s: pct(s["l2_waiting"])),
                ("per SM µs: " + " / ".join(PHASES) + " / idle",
                 lambda s: _per_sm_cell(s["per_sm_us"]))]
    for name, cell in figures:
        t.add_row(name, *(cell(s) for s in summary))
    con.print(t)
    _save_plot(con, plot_timeline, rows, args.out,
               title=f"{args.shape}, {args.tokens} tokens/rank, "
                     + (f"{args.virtual_ranks} virtual ranks on one GPU" if args.virtual_ranks
                        else f"{torch.cuda.device_count()} GPUs") + f", {args.granularity}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=args.shape, tokens_per_rank=args.tokens,
                           virtual_ranks=args.virtual_ranks, experts=args.experts,
                           granularity=args.granularity, tuning=overrides, summary=summary,
                           rows=rows.tolist()), f)
        con.print(f"rows and summary saved to {args.json}")
    return 0


# ---- probe ------------------------------------------------------------------------------

def cmd_probe(args: argparse.Namespace) -> int:
    from .probe import ProbeError, calibration_table, run_probe

    con = _console()
    if args.out is None:
        import torch

        from .bench import results_path
        n = len(set(args.devices)) if torch.cuda.is_available() else 0
        args.out = str(results_path("calib_probe", num_gpus=n or None).with_suffix(".json"))
    try:
        calib = run_probe(out=args.out, quick=args.quick, gemm_providers=args.gemm_providers,
                          devices=tuple(args.devices), console=con)
    except (ProbeError, ValueError) as exc:
        print(f"moestream probe: error: {exc}", file=sys.stderr)
        return 2
    con.print(calibration_table(calib))
    con.print(f"note: {calib['note']}")
    con.print(f"calibration written to {args.out} (use: moestream simulate --calib {args.out})")
    errors = calib["probe"]["errors"]
    for name, err in errors.items():
        con.print(f"[red]failed:[/] {name}: {err}")
    return 1 if errors else 0


def cmd_bench_layer(args: argparse.Namespace) -> int:
    from .bench_layer import run_cli
    return run_cli(args, console=_console())


# ---- entry --------------------------------------------------------------------------------

def _granularities_arg(text: str) -> list[int | str]:
    items = [_granularity_arg(v.strip()) for v in text.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected token, expert or chunk sizes, comma list")
    return items


def _baselines_arg(text: str) -> list[str]:
    from .bench_ep import BASELINES
    return [] if text.strip() == "none" else names_from(BASELINES)(text)


def build_parser() -> argparse.ArgumentParser:
    shapes = sorted(SHAPES)
    p = argparse.ArgumentParser(prog="moestream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fmt = argparse.ArgumentDefaultsHelpFormatter

    r = sub.add_parser("run", formatter_class=fmt,
                       help="the layer here, checked against the reference (GPU or CPU)",
                       description="Run every path of the layer (staged, fused, chunked, fp8, "
                                   "fp4w) on this machine and check it against the fp32 "
                                   "reference. On a CPU the kernels run in Triton's "
                                   "interpreter on small shapes.")
    r.add_argument("--ranks", type=positive_int, default=None,
                   help="ranks (default: every GPU, or 2 on a CPU)")
    r.add_argument("--tokens", type=positive_int, default=None,
                   help="tokens per rank (default: 512 on a GPU, 24 on a CPU)")
    r.add_argument("--seed", type=nonnegative_int, default=0, help="random inputs' seed")
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("check", help="versions, GPUs and symmetric memory of this install")
    c.set_defaults(fn=cmd_check)

    b = sub.add_parser("bench", formatter_class=fmt,
                       help="the layer benchmark over all GPUs, or the GEMMs alone (GPU)",
                       description="The layer over every GPU of this machine (world size = "
                                   "GPUs), each provider on the same inputs, CUDA events, "
                                   "median of --reps calls. Rows update "
                                   "benchmarks/results/<machine>/ep.jsonl (layer.jsonl on "
                                   "one GPU), a PNG beside it. With --virtual-ranks: the "
                                   "grouped GEMMs as the layer launches them vs "
                                   "torch._grouped_mm (<machine>/gemm.jsonl).")
    b.add_argument("--shapes", type=names_from(shapes), default=["dsv3", "v4flash", "qwen3",
                                                                 "mixtral"],
                   help=f"comma list of {', '.join(shapes)}")
    b.add_argument("--tokens", type=positive_ints, default=[1, 8, 32, 128, 512, 2048, 8192],
                   help="tokens per rank, comma list")
    b.add_argument("--impl", type=names_from(("staged", "fused")), default=["staged", "fused"],
                   help="our launches: staged (one per stage), fused (one persistent launch)")
    b.add_argument("--dtype", type=names_from(("bf16", "fp8", "fp4w")), default=["bf16"],
                   help="our formats, comma list")
    b.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="time CUDA-graph replays of our calls (--no-graph: Python launches)")
    b.add_argument("--granularity", type=_granularities_arg, default=["token"],
                   help="the fused launch's streaming modes, comma list of token, expert and "
                        "chunk sizes C (multiples of block_m; bf16, with graphs)")
    b.add_argument("--per-stage", action="store_true",
                   help="time the staged call stage by stage (stages_us in each row)")
    b.add_argument("--baselines", type=_baselines_arg, default=["torch"],
                   help="torch (all_to_all + grouped_mm), torch-symm (NVSHMEM all_to_all_vdev), "
                        "comma list, or none")
    b.add_argument("--experts", type=positive_int, default=None,
                   help="routed experts of every shape instead of its own (e.g. 32 on one "
                        "GPU: one EP8 rank's share of dsv3)")
    b.add_argument("--skew", type=float, default=None,
                   help="hot expert's share of picks, in (0, 1]")
    b.add_argument("--tuning", default="",
                   help="Tuning overrides (dotted names), e.g. l1.block_n=128: each of our "
                        "graph-replayed calls also runs with them, in the same run")
    b.add_argument("--block-m", type=positive_int, default=None,
                   help="our layer's m-block rows instead of the shape's")
    b.add_argument("--virtual-ranks", type=positive_int, default=None,
                   help="the GEMM bench on one GPU over R virtual ranks (with --layer: the "
                        "layer)")
    b.add_argument("--layer", action="store_true",
                   help="with --virtual-ranks R: the whole layer on R virtual ranks in one "
                        "process (--impl, --dtype, --tokens, --experts, --graph)")
    b.add_argument("--tokens-per-expert", type=positive_ints, default=[16, 128, 512, 2048],
                   help="GEMM bench: rows per expert, comma list")
    b.add_argument("--experts-per-rank", type=positive_int, default=32,
                   help="GEMM bench: experts per virtual rank")
    b.add_argument("--variants", type=lambda v: [x for x in v.split(",") if x], default=None,
                   help="GEMM bench: moestream.tools.bench_kernels.VARIANTS names (default all)")
    b.add_argument("--reps", type=positive_int, default=20, help="timed calls per point")
    b.add_argument("--out", default=None,
                   help="results file (default benchmarks/results/<machine>/<bench>.jsonl)")
    b.add_argument("--plot", default=None, help="PNG of time vs tokens (default: beside --out)")
    b.add_argument("--no-plot", action="store_true", help="save no PNG")
    b.set_defaults(fn=cmd_bench)

    from .bench_layer import add_arguments as add_layer_arguments
    bl = sub.add_parser("bench-layer", help="one transformers MoE decoder layer: its experts "
                                            "vs moestream's, over every GPU (GPU)")
    add_layer_arguments(bl)
    bl.set_defaults(fn=cmd_bench_layer)

    tr = sub.add_parser("trace", formatter_class=fmt,
                        help="the timeline of one fused-kernel call (GPU)")
    tr.add_argument("--shape", default="qwen3", choices=shapes)
    tr.add_argument("--tokens", type=positive_int, default=2048, help="tokens per rank")
    tr.add_argument("--granularity", type=_granularity_arg, default="token",
                    help="token, expert, or a chunk size C in tokens (a multiple of block_m)")
    tr.add_argument("--ranks", type=positive_int, default=None, help="GPUs (default: all)")
    tr.add_argument("--virtual-ranks", type=positive_int, default=None,
                    help="R virtual ranks in one launch on one GPU instead of one process "
                         "per GPU")
    tr.add_argument("--experts", type=positive_int, default=None,
                    help="routed experts instead of the shape's (e.g. 32 on one GPU)")
    tr.add_argument("--seed", type=nonnegative_int, default=0)
    tr.add_argument("--out", default="trace.png", help="timeline PNG")
    tr.add_argument("--json", default=None, help="also save the rows and the summary")
    tr.add_argument("--tuning", default="",
                    help="Tuning overrides on top of the fused launch's defaults (dotted "
                         "names), e.g. fused.wave_blocks=264")
    tr.set_defaults(fn=cmd_trace)

    pr = sub.add_parser("probe", formatter_class=fmt,
                        help="this machine's calibration for the simulator (GPU)")
    pr.add_argument("--quick", action="store_true",
                    help="the short probe (under a minute on an H200)")
    pr.add_argument("--out", default=None,
                    help="calibration JSON (default benchmarks/results/<machine>/"
                         "calib_probe.json)")
    pr.add_argument("--gemm-providers", type=names_from(("torch", "triton")),
                    default=["torch", "triton"],
                    help="grouped-GEMM curves: torch (torch._grouped_mm), triton (our L1)")
    pr.add_argument("--devices", type=nonnegative_ints, default=[0, 1],
                    help="reader GPU and peer GPU")
    pr.set_defaults(fn=cmd_probe)

    from .sim.cli import add_parser as add_sim
    add_sim(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except MissingExtraError as exc:
        print(f"moestream {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
