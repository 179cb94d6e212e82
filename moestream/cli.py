"""The ``moestream`` command.

    moestream run        the main job: the EP layer on this machine, checked against the reference
    moestream check      what this install can do (versions, GPUs, symmetric memory)
    moestream bench      benchmarks: EP layer across all GPUs, or --virtual-ranks R for the GEMMs
    moestream bench-layer  one transformers MoE decoder layer, original vs moestream experts
    moestream simulate   the discrete-event model of token vs chunk streaming at scale
    moestream probe      measure this machine's calibration for the simulator (GPU)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

__all__ = ["main"]


def _console():
    import shutil

    from rich.console import Console
    # tables of results stay readable in logs and narrow terminals
    return Console(width=max(140, shutil.get_terminal_size((140, 40)).columns))


# ---- run --------------------------------------------------------------------------------

def _run_worker(rank: int, world: int, cfg_dict: dict, T: int, seed: int, provider: str):
    """One rank of `moestream run`: returns (rank, rel error vs reference, seconds)."""
    import torch

    from . import MoEConfig, SymmBuffer, mega_moe
    from .baselines.torch_a2a import moe_forward_a2a
    from .reference import moe_forward
    from .testing import make_routing, make_tokens, make_weights, rel_error
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

    from . import SymmBuffer, mega_moe_virtual
    from .reference import moe_forward_ranks
    from .testing import make_routing, make_tokens, make_weights, quantize_weights, rel_error
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
    from rich.progress import Progress
    from rich.table import Table

    from . import MoEConfig
    from .distributed import spawn
    from .testing import TOLERANCE

    con = _console()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    R = args.ranks or (gpus if gpus >= 1 else 2)
    if gpus:
        cfg = MoEConfig(hidden=2048, intermediate=768, num_experts=16 * R, top_k=8,
                        max_tokens_per_rank=args.tokens or 512)
    else:
        cfg = MoEConfig(hidden=256, intermediate=128, num_experts=4 * R, top_k=2,
                        max_tokens_per_rank=args.tokens or 24, block_m=16, block_n=64,
                        block_k=64)
    T = cfg.max_tokens_per_rank
    con.print(f"[bold]moestream run[/]: {'GPU' if gpus else 'CPU'} machine, {R} ranks, "
              f"H={cfg.hidden} I={cfg.intermediate} E={cfg.num_experts} K={cfg.top_k}, "
              f"{T} tokens per rank, bf16")
    rows = []
    tol = TOLERANCE["bf16"]
    jobs = []
    if gpus:
        jobs.append(("staged (mega_moe, NCCL ranks)", "staged", "nccl", R))
        jobs.append(("fused (mega_moe impl='fused', NCCL ranks)", "fused", "nccl", R))
        jobs.append(("torch all_to_all + grouped GEMM", "torch", "nccl", R))
    else:
        jobs.append(("torch all_to_all + per-expert GEMM (gloo)", "torch-gloo", "gloo", R))
    # the kernels on R virtual ranks in this process: each streaming mode of the layer
    chunk = 2 * cfg.block_m
    virtual = [("staged kernels", "staged", "token", cfg),
               ("fused kernel, token mode", "fused", "token", cfg),
               (f"fused kernel, {chunk}-token chunks", "fused", chunk, cfg),
               ("staged kernels, fp8 (vs the fp8-aware reference)", "staged", "token",
                cfg.with_(dtype="fp8")),
               ("staged kernels, fp4w (vs the fp4w-aware reference)", "staged", "token",
                cfg.with_(dtype="fp4w"))]
    with Progress(console=con, transient=True) as prog:
        task = prog.add_task("running", total=len(jobs) + len(virtual))
        for label, provider, backend, world in jobs:
            prog.update(task, description=label)
            res = spawn(_run_worker, world_size=world, backend=backend,
                        args=(cfg.to_dict(), T, args.seed, provider), timeout_s=900)
            err = max(r[1] for r in res)
            sec = max(r[2] for r in res)
            rows.append((label, f"{world} processes", err, sec, tol))
            prog.advance(task)
        for label, impl, gran, vcfg in virtual:
            prog.update(task, description=f"{label}, virtual ranks")
            err, sec, where = _run_virtual(vcfg, R, T, args.seed, impl=impl, granularity=gran)
            kind = "Triton interpreter" if where == "cpu" else "one GPU"
            rows.append((f"{label}, {R} virtual ranks ({kind})", "1 process", err, sec,
                         TOLERANCE[vcfg.dtype]))
            prog.advance(task)
    table = Table(title="moestream run: each provider against the fp32 reference")
    for col in ("provider", "ranks", "config", "tokens/rank", "rel error", "time", "status"):
        table.add_column(col)
    ok = True
    for label, procs, err, sec, tol in rows:
        good = err < tol
        ok &= good
        table.add_row(label, f"{R} ({procs})", f"H{cfg.hidden} I{cfg.intermediate} "
                      f"E{cfg.num_experts} K{cfg.top_k}", str(T), f"{err:.2e}",
                      f"{sec * 1e3:.1f} ms", "[green]ok[/]" if good else f"[red]> {tol}[/]")
    con.print(table)
    return 0 if ok else 1


# ---- check ------------------------------------------------------------------------------

def cmd_check(args: argparse.Namespace) -> int:
    import numpy
    import torch
    from rich.table import Table

    from . import __version__
    from .kernels._common import INTERPRET, triton

    con = _console()
    t = Table(title="moestream check")
    t.add_column("item")
    t.add_column("value")
    t.add_row("moestream", __version__)
    t.add_row("python", sys.version.split()[0])
    t.add_row("torch", torch.__version__)
    t.add_row("triton", triton.__version__)
    t.add_row("numpy", numpy.__version__ + ("" if tuple(int(v) for v in numpy.__version__.split(".")[:2]) < (2, 3)
                                            else "  (the Triton interpreter needs < 2.3)"))
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

def _ints(s: str) -> list[int]:
    try:
        return [int(v) for v in s.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _names(s: str) -> list[str]:
    return [v for v in s.split(",") if v]


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import append_rows, plot_rows, print_table

    con = _console()
    if not torch.cuda.is_available():
        con.print("[red]moestream bench needs a CUDA GPU[/] (moestream run and the tests "
                  "cover the CPU)")
        return 2
    out = args.out
    if args.virtual_ranks:
        from rich.progress import Progress

        from .bench_kernels import VARIANTS, bench_gemm
        variants = args.variants or list(VARIANTS)
        rows = []
        with Progress(console=con) as prog:
            total = len(args.shapes) * len(args.tokens_per_expert) * len(variants)
            task = prog.add_task("GEMM bench", total=total)
            for shape in args.shapes:
                rows += bench_gemm(shape=shape, tokens_per_expert=args.tokens_per_expert,
                                   experts_per_rank=args.experts_per_rank,
                                   virtual_ranks=args.virtual_ranks, variants=variants,
                                   reps=args.reps, progress=lambda: prog.advance(task))
        out = out or "benchmarks/results/gemm_h200.jsonl"
        cols = ["shape", "kernel", "tokens_per_expert", "provider", "median_us",
                "tflops_per_gpu", "weight_tbps", "efficiency", "l1_rel_error",
                "l2_rel_error"]
    else:
        from .bench_ep import parse_tuning, run_ep_bench
        try:
            tuning = parse_tuning(args.tuning)
        except ValueError as e:
            con.print(f"[red]--tuning: {e}[/]")
            return 2
        try:
            rows = run_ep_bench(shapes=args.shapes, tokens=args.tokens,
                                providers=args.providers, reps=args.reps, skew=args.skew,
                                tuning=tuning, block_m=args.block_m)
        except ValueError as e:
            con.print(f"[red]{e}[/]")
            return 2
        out = out or f"benchmarks/results/ep_{torch.cuda.device_count()}gpu.jsonl"
        cols = ["shape", "tokens_per_rank", "provider", "median_us", "p20_us", "p80_us",
                "tflops_per_gpu", "link_gbps", "floor_us", "efficiency", "rel_diff_vs_torch"]
    append_rows(out, rows)
    con.print(f"{len(rows)} rows appended to {out}")
    if args.plot and not args.virtual_ranks:
        plot_rows(rows, args.plot, title=f"EP layer, {torch.cuda.device_count()}x "
                                         f"{torch.cuda.get_device_name(0)}")
        con.print(f"plot saved to {args.plot}")
        if any(r.get("stages_us") for r in rows):
            from pathlib import Path

            from .bench_ep import plot_stages
            stages_png = Path(args.plot).with_name(Path(args.plot).stem + "_stages.png")
            plot_stages(rows, stages_png)
            con.print(f"stage breakdown saved to {stages_png}")
    print_table(rows, title="moestream bench", columns=cols)
    staged = [r for r in rows if r.get("stages_us")]
    if staged:
        from .stages import STAGES
        print_table([{**r, **{f"{n} µs": r["stages_us"].get(n) for n in STAGES}} for r in staged],
                    title="staged call, GPU time per stage (slowest rank)",
                    columns=["shape", "tokens_per_rank", "provider", "median_us"]
                    + [f"{n} µs" for n in STAGES])
    return 0


# ---- trace --------------------------------------------------------------------------------

def _granularity_arg(s: str) -> int | str:
    return int(s) if s.isdigit() else s


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
    if not torch.cuda.is_available():
        con.print("[red]moestream trace needs CUDA GPUs[/] (the interpreter has no clock; the "
                  "tests cover the trace rows on the CPU)")
        return 2
    with con.status(f"tracing {args.shape}, {args.tokens} tokens/rank, {args.granularity}"):
        rows = run_trace(shape=args.shape, tokens=args.tokens, world=args.ranks or None,
                         granularity=args.granularity, seed=args.seed, tuning=overrides)
    summary = summarize(rows)
    t = Table(title=f"fused kernel trace: {args.shape}, {args.tokens} tokens/rank, "
                    f"granularity {args.granularity}"
                    + (f", tuning {args.tuning}" if overrides else ""))
    for c in ["rank", "layer µs"] + [f"{p} µs (tasks x µs each)" for p in PHASES] + [
            "comm hidden", "L1 during dispatch", "L2 during L1", "L2 waiting on L1",
            "per SM µs: " + " / ".join(PHASES) + " / idle"]:
        t.add_column(c, justify="right")
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    for s in summary:
        ph = [_phase_cell(s["phases"][p]) for p in PHASES]
        t.add_row(str(s["rank"]), f"{s['layer_us']:.0f}", *ph, pct(s["comm_hidden"]),
                  pct(s["l1_during_dispatch"]), pct(s["l2_during_l1"]), pct(s["l2_waiting"]),
                  _per_sm_cell(s["per_sm_us"]))
    con.print(t)
    plot_timeline(rows, args.out, title=f"{args.shape}, {args.tokens} tokens/rank, "
                                        f"{torch.cuda.device_count()} GPUs, {args.granularity}")
    con.print(f"timeline saved to {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=args.shape, tokens_per_rank=args.tokens,
                           granularity=args.granularity, tuning=overrides, summary=summary,
                           rows=rows.tolist()), f)
        con.print(f"rows and summary saved to {args.json}")
    return 0


# ---- probe ------------------------------------------------------------------------------

def cmd_probe(args: argparse.Namespace) -> int:
    from .probe import ProbeError, calibration_table, run_probe

    con = _console()
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

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moestream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run the EP layer here and check it against the reference")
    r.add_argument("--ranks", type=int, default=0, help="ranks (default: every GPU, or 2 on CPU)")
    r.add_argument("--tokens", type=int, default=0, help="tokens per rank")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("check", help="versions, GPUs, symmetric memory")
    c.set_defaults(fn=cmd_check)

    b = sub.add_parser("bench", help="benchmarks (BENCHMARKS.md protocol)")
    b.add_argument("--shapes", type=_names, default=["dsv3", "v4flash", "qwen3", "mixtral"])
    b.add_argument("--tokens", type=_ints, default=[1, 8, 32, 128, 512, 2048, 8192],
                   help="tokens per rank (EP bench)")
    b.add_argument("--providers", type=_names,
                   default=["staged", "staged-graph", "fused-graph", "chunk128", "chunk256",
                            "chunkexpert", "torch", "fp8-staged-graph"],
                   help="staged, staged-graph, fused, fused-graph, chunk<C>, chunkexpert, "
                        "torch, fp8-staged, fp8-staged-graph, fp8-fused-graph, torch-symm, "
                        "staged-stages, fp8-staged-stages (GPU time of each staged launch), "
                        "staged-graph-stages, fp8-staged-graph-stages (the same in a graph), "
                        "staged-tuned-graph, fp8-staged-tuned-graph, and their -stages "
                        "forms, fused-tuned-graph, fp8-fused-tuned-graph (with --tuning)")
    b.add_argument("--skew", type=float, default=None,
                   help="hot expert's share of picks, in (0, 1] (at most 1/top-k takes "
                        "effect: one pick per token)")
    b.add_argument("--tuning", default="",
                   help="stages.Tuning overrides of the *-tuned-graph(-stages) providers, e.g. "
                        "pdl=true,l1_block_n=128 (on top of each call's defaults)")
    b.add_argument("--virtual-ranks", type=int, default=0,
                   help="GEMM bench on one GPU: L1/L2 over R virtual ranks vs torch._grouped_mm")
    b.add_argument("--tokens-per-expert", type=_ints, default=[16, 128, 512, 2048])
    b.add_argument("--experts-per-rank", type=int, default=32)
    b.add_argument("--variants", type=_names, default=None, help="GEMM variants (default all)")
    b.add_argument("--reps", type=int, default=20)
    b.add_argument("--block-m", type=int, default=None,
                   help="EP bench: our layer's m-block rows (MoEConfig.block_m) instead of "
                        "the shape's default")
    b.add_argument("--out", default=None, help="JSON-lines file the rows are appended to")
    b.add_argument("--plot", default=None, help="PNG of time vs tokens per rank")
    b.set_defaults(fn=cmd_bench)

    from .bench_layer import add_arguments as add_layer_arguments
    bl = sub.add_parser("bench-layer", help="one transformers MoE decoder layer: its experts vs "
                                            "moestream's, across every GPU (bench_layer.py)")
    add_layer_arguments(bl)
    bl.set_defaults(fn=cmd_bench_layer)

    tr = sub.add_parser("trace", help="timeline of one fused-kernel call (GPU)")
    tr.add_argument("--shape", default="qwen3")
    tr.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    tr.add_argument("--granularity", type=_granularity_arg, default="token",
                    help="token, a chunk size C (multiple of block_m) or expert")
    tr.add_argument("--ranks", type=int, default=0, help="GPUs (default: all)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--out", default="trace.png", help="timeline PNG")
    tr.add_argument("--json", default=None, help="also save the rows and the summary")
    tr.add_argument("--tuning", default="",
                    help="stages.Tuning overrides on top of the fused launch's defaults, e.g. "
                         "wave_blocks=264,fused_per_sm=1")
    tr.set_defaults(fn=cmd_trace)

    pr = sub.add_parser("probe", help="measure this machine's calibration for the simulator")
    pr.add_argument("--quick", action="store_true",
                    help="the short probe (meant to take < 1 minute on an H200)")
    pr.add_argument("--out", default="benchmarks/results/calib_probe.json",
                    help="calibration JSON to write (default benchmarks/results/calib_probe.json)")
    pr.add_argument("--gemm-providers", type=_names, default=["torch", "triton"],
                    help="grouped-GEMM curves: torch (torch._grouped_mm), triton (our L1)")
    pr.add_argument("--devices", type=_ints, default=[0, 1],
                    help="reader GPU and peer GPU (default 0,1)")
    pr.set_defaults(fn=cmd_probe)

    try:
        from .sim.cli import add_parser as add_sim
        add_sim(sub)
    except ImportError:  # pragma: no cover - the simulator ships with the package
        pass
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
