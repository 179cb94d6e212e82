"""Expert-parallel layer benchmark across the GPUs of one node (``moestream.tools.bench``
protocol). The CLI composes the provider names below from --impl, --dtype, --graph,
--granularity, --per-stage, --tuning and --baselines (``compose_providers``).

Providers, measured in the same run on the same inputs:
    staged        ours: mega_moe with one launch per stage (token-granular pull dispatch)
    staged-graph  the same calls captured once per input set in a CUDA graph and replayed
                  (how an inference engine runs a decode step: no Python launch overhead)
    fused         mega_moe(impl="fused"): dispatch, L1, L2 and combine in one persistent launch
    fused-graph   the same, replayed from CUDA graphs
    chunk<C>      the fused launch in chunked mode (granularity=C tokens, a multiple of block_m,
                  or chunkexpert: whole experts), replayed from CUDA graphs like fused-graph
    torch         all_to_all_single + torch._grouped_mm + all_to_all_single (baselines)
    torch-symm    the same layer with torch's NVSHMEM all_to_all_vdev_2d dispatch and
                  all_to_all_vdev_2d_offset combine (moestream/tools/baselines/torch_symm.py;
                  no host sync). NVSHMEM must own the process's symmetric memory, so it runs in
                  its own processes after the others, on the same inputs (same seeds), checked
                  against the torch provider's output.
    fp8-staged    ours in fp8 (MoEConfig dtype "fp8", weights quantized from the same bf16
                  experts, DeepSeek-V3 block format); fp8-staged-graph: replayed from graphs.
                  Rows carry dtype "fp8" (floors of the fp8 format) and their agreement with
                  torch's bf16 output is judged against the fp8 quantization error
                  (docs/quantization.md: ~6e-2 on random data; FP8_AGREE).
    fp8-fused-graph  the fp8 layer in the fused launch, replayed from CUDA graphs.
    fp4w-staged, fp4w-staged-graph
                  ours with MXFP4 weights (MoEConfig dtype "fp4w": the fp8 tokens, weights
                  quantized from the same bf16 experts to e2m1 + E8M0 per 32); rows carry dtype
                  "fp4w" and agree with torch's bf16 output within the MXFP4 quantization error
                  (docs/quantization.md: ~0.2 on random data; FP4W_AGREE). The -stages and
                  -tuned-graph forms exist for it as for fp8.
    fp4w-fused-graph  the fp4w layer in the fused launch (weights expanded to fp8 blocks each
                  call), replayed from CUDA graphs.
    staged-tuned-graph, fp8-staged-tuned-graph
                  staged-graph / fp8-staged-graph with ``Tuning`` fields overridden
                  (``tuning=``, CLI ``--tuning gemm_claim=true,l1.block_n=128``) on top of each
                  call's defaults, so one run compares a launch option with the default on the
                  same inputs; rows carry the overrides under ``tuning``.
    staged-stages, fp8-staged-stages
                  where the staged call's time goes: each launch timed on the GPU
                  (``stage_times``); the row's time is the whole call's and ``stages_us``
                  holds each stage's median (slowest rank by total). ``plot_stages`` draws them.
                  Launched from Python, so each stage also carries its launch gap.
    staged-graph-stages, fp8-staged-graph-stages
                  the same split measured inside a CUDA graph replay (``graph_stage_times``:
                  timing events captured as graph nodes, the timed call right behind an
                  untimed one), so the stages add up to the staged-graph time.
    staged-tuned-graph-stages, fp8-staged-tuned-graph-stages
                  that split with the ``tuning`` overrides of the -tuned-graph providers.
    fused-tuned-graph, fp8-fused-tuned-graph
                  fused-graph / fp8-fused-graph with the ``tuning`` overrides on top of the
                  fused launch's defaults (``tuning.select``).

Every rank times every call (CUDA events, warm-up first, median of >= 20 calls, inputs rotated
over several sets); the slowest rank's figures are reported. Before timing, each point checks
that the providers agree (relative difference within the bf16 tolerance), so a broken kernel is
never timed as fast. With ``MOESTREAM_EP_PARTIAL=path`` set, rank 0 also appends each row to
that JSON-lines file as it is measured, so a run cut by a time limit keeps its finished points.
Rows of skewed routing (``skew``) carry the floor of the routing they ran
(``bench.routing_floors``, the mean over the input sets; ``floor_from: "routing"``): the
uniform model of ``bench.floors`` would put a hot expert's rank at the average load.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["bench_ep_worker", "run_ep_bench", "stage_times", "graph_stage_times", "plot_stages",
           "parse_tuning", "compose_providers", "check_providers", "provider_dtype",
           "provider_granularity", "is_tuned", "is_replayed", "is_stagewise", "staged_call",
           "input_sets", "randn_bf16", "gathered_routing_floor", "PROVIDERS", "BASELINES"]

PROVIDERS = ("staged", "staged-graph", "fused", "fused-graph", "torch", "fp8-staged",
             "fp8-staged-graph", "fp8-fused-graph", "torch-symm", "staged-stages",
             "fp8-staged-stages", "staged-graph-stages", "fp8-staged-graph-stages",
             "staged-tuned-graph", "fp8-staged-tuned-graph", "fp4w-staged", "fp4w-staged-graph",
             "fp4w-staged-stages", "fp4w-staged-graph-stages", "fp4w-staged-tuned-graph",
             "staged-tuned-graph-stages", "fp8-staged-tuned-graph-stages", "fused-tuned-graph",
             "fp8-fused-tuned-graph", "fp4w-fused-graph")
# fp8 vs torch's bf16 layer: the quantization error of random data (~6e-2) with headroom; a
# scale applied twice or a misplaced row is far outside
FP8_AGREE = 0.12
# fp4w (MXFP4 weights, fp8 tokens) vs torch's bf16 layer: ~0.2 on random data
# (docs/quantization.md); a scale off by 2 gives ~1
FP4W_AGREE = 0.35


def provider_dtype(provider: str) -> str:
    """The MoEConfig dtype a provider runs and its rows carry: "fp8", "fp4w" or "bf16"."""
    for fmt in ("fp8", "fp4w"):
        if provider.startswith(fmt + "-"):
            return fmt
    return "bf16"


def provider_granularity(provider: str) -> int | str | None:
    """The chunked-mode granularity a ``chunk<C>`` provider names (None: not a chunk one)."""
    if not provider.startswith("chunk"):
        return None
    c = provider[len("chunk"):]
    if c == "expert":
        return "expert"
    if c.isdigit() and int(c) > 0:
        return int(c)
    raise ValueError(f"chunked provider must be chunk<C> (C a positive multiple of block_m) "
                     f"or chunkexpert, got {provider!r}")


def is_tuned(provider: str) -> bool:
    """Providers that run with ``tuning`` overrides."""
    return provider.endswith(("-tuned-graph", "-tuned-graph-stages"))


def check_providers(providers: Sequence[str], tuning: dict | None = None) -> None:
    """ValueError naming any provider this benchmark does not know, or a tuned provider
    without overrides (``tuning``)."""
    unknown = [p for p in providers if p not in PROVIDERS and provider_granularity(p) is None]
    if unknown:
        raise ValueError(f"unknown providers {unknown}; known: {PROVIDERS} and chunk<C>, "
                         "chunkexpert")
    tuned = [p for p in providers if is_tuned(p)]
    if tuned and not tuning:
        raise ValueError(f"{tuned} need Tuning overrides (tuning=, CLI --tuning "
                         "name=value,...); without them they equal staged-graph")


BASELINES = ("torch", "torch-symm")


def compose_providers(*, impl: Sequence[str] = ("staged", "fused"),
                      dtype: Sequence[str] = ("bf16",), graph: bool = True,
                      granularity: Sequence[int | str] = ("token",), per_stage: bool = False,
                      tuned: bool = False,
                      baselines: Sequence[str] = ("torch",)) -> tuple[list[str], list[str]]:
    """The providers of a composed selection (the CLI's --impl, --dtype, --graph,
    --granularity, --per-stage, --tuning, --baselines): every (dtype, impl, granularity) the
    layer runs, plus the tuned form of each when ``tuned``, then the baselines.

    Returns (providers, skipped): ``skipped`` names each asked-for combination the layer or
    this benchmark does not run (chunked staged, fp8 chunked, per-stage fused,
    chunked without graphs, ...). ValueError when nothing of ours or the baselines is left."""
    names, skipped = [], []
    for fmt in dtype:
        pfx = "" if fmt == "bf16" else fmt + "-"
        for im in impl:
            for gran in granularity:
                what = f"{fmt} {im} granularity={gran}" + (" per stage" if per_stage else "") \
                    + ("" if graph else " without graphs")
                if gran != "token" and im == "staged":
                    continue   # granularity is the fused launch's streaming mode
                if gran != "token":
                    name = f"chunk{gran}" if fmt == "bf16" and graph and not per_stage else None
                else:
                    name = pfx + im + ("-graph" if graph else "") + ("-stages" if per_stage else "")
                forms = [name] if name in PROVIDERS or (name and name.startswith("chunk")) else []
                if forms and tuned:
                    t = name.replace("-graph", "-tuned-graph", 1)
                    forms.append(t) if t in PROVIDERS else skipped.append(what + " tuned")
                names += [n for n in forms if n not in names]
                if not forms:
                    skipped.append(what)
    names += [b for b in baselines if b not in names]
    if not names:
        raise ValueError(f"no provider runs this selection: {'; '.join(skipped)}")
    return names, skipped


def parse_tuning(text: str) -> dict:
    """``"gemm_claim=true,l1.block_n=128"`` -> ``{"gemm_claim": True, "l1.block_n": 128}``:
    ``Tuning`` fields (``Tuning.dotted_names``) with values true/false, none, integers or
    words; checked by building a Tuning with them (its ValueErrors name what is allowed)."""
    from ..tuning import Tuning
    names = set(Tuning.dotted_names())
    out: dict = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, eq, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not eq or not raw:
            raise ValueError(f"tuning override {item!r} must be name=value")
        if name not in names:
            raise ValueError(f"unknown Tuning field {name!r}; fields: {sorted(names)}")
        low = raw.lower()
        if low in ("true", "false"):
            value = low == "true"
        elif low == "none":
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                value = raw
        out[name] = value
    Tuning().with_dotted(out)
    return out


def input_sets(cfg, T: int, gen: torch.Generator, device, *, skew: float | None,
               sets: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``sets`` input sets drawn in order on ``gen``: (x [T, hidden] bf16, topk_idx [T, top_k]
    int32, topk_weights [T, top_k] fp32), routing skewed by ``skew`` (``make_routing``)."""
    from ..testing import make_routing, make_tokens
    out = []
    for _ in range(sets):
        x = make_tokens(T, cfg.hidden, generator=gen, device=device)
        idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=gen, device=device,
                              skew=skew)
        out.append((x, idx, w))
    return out


def is_replayed(provider: str) -> bool:
    """Providers timed as CUDA-graph replays."""
    return provider.endswith("-graph") or provider_granularity(provider) is not None


def is_stagewise(provider: str) -> bool:
    """Providers timed stage by stage (``stage_times``)."""
    return provider.endswith("-stages")


def stage_times(call: Callable[[Callable[[str], None]], Any], *, reps: int,
                warmup: int) -> dict[str, Any]:
    """GPU time of each launch of the staged path on this rank (collective: every rank calls
    it together). ``call(on_stage)`` runs one layer call through ``staged.run_staged`` with
    that ``on_stage``. Each rep: the ranks meet at a barrier, then each holds its stream in the
    same sleep (``bench.QUEUE_AHEAD_CYCLES``) while the host queues the call with a CUDA event
    after every stage, so the events measure GPU time, not launch gaps; a stage's time
    includes its waits for the peers (layout waits for their inputs).

    Returns median_us / p20_us / p80_us of the whole call and ``stages_us``: the median of
    each stage (``staged.STAGES`` order)."""
    from .bench import QUEUE_AHEAD_CYCLES
    from ..staged import STAGES

    for _ in range(warmup):
        call(lambda name: None)
    per_stage: dict[str, list[float]] = {name: [] for name in STAGES}
    totals: list[float] = []
    for _ in range(reps):
        _meet()
        torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        marks: list[tuple[str, Any]] = []

        def on_stage(name: str) -> None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((name, ev))

        call(on_stage)
        torch.cuda.synchronize()
        _read_stages(start, marks, per_stage, totals)
    return _stage_summary(per_stage, totals, reps, "cuda_events")


def _meet() -> None:
    """Every queued GPU op done, then every rank at a barrier (when distributed)."""
    import torch.distributed as dist
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()


def _read_stages(start, marks: Sequence[tuple[str, Any]], per_stage: dict[str, list[float]],
                 totals: list[float]) -> None:
    """Append each stage's time (µs since the previous mark) and the call's (since start)."""
    prev = start
    for name, ev in marks:
        per_stage[name].append(prev.elapsed_time(ev) * 1e3)
        prev = ev
    totals.append(start.elapsed_time(prev) * 1e3)


def _stage_summary(per_stage: dict[str, list[float]], totals: list[float], reps: int,
                   clock: str) -> dict[str, Any]:
    from .bench import _percentile
    totals = sorted(totals)
    return dict(median_us=statistics.median(totals), p20_us=_percentile(totals, 0.2),
                p80_us=_percentile(totals, 0.8), reps=reps, clock=clock,
                stages_us={n: statistics.median(v) for n, v in per_stage.items() if v})


def graph_stage_times(call: Callable[[Callable[[str], None]], Any], *, reps: int,
                      warmup: int) -> dict[str, Any]:
    """``stage_times`` inside a CUDA graph: the graph holds two calls back to back, the second
    with a timing event after each stage (captured as event record nodes, ``external=True``),
    so the timed call starts the way replayed calls do, right behind the previous one on
    every rank, and its stages carry no launch gaps. Each rep: the ranks meet at a barrier,
    replay the graph and read the events. Collective like ``stage_times``; same result keys."""
    from ..staged import STAGES

    def event():
        return torch.cuda.Event(enable_timing=True, external=True)

    start, marks = event(), {name: event() for name in STAGES}
    call(lambda name: None)   # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(lambda name: None)
        start.record()
        call(lambda name: marks[name].record())
    for _ in range(warmup):
        g.replay()
    per_stage: dict[str, list[float]] = {name: [] for name in STAGES}
    totals: list[float] = []
    for _ in range(reps):
        _meet()
        g.replay()
        torch.cuda.synchronize()
        _read_stages(start, [(n, marks[n]) for n in STAGES], per_stage, totals)
    return _stage_summary(per_stage, totals, reps, "cuda_graph_events")


def staged_call(buf, a, weights, mark, overrides: dict | None = None) -> torch.Tensor:
    """One staged layer call on this rank's buffer; returns y [T, hidden] bf16. ``a`` = (x,
    topk_idx, topk_weights) as ``input_sets`` makes them (valid and contiguous), ``weights`` =
    (w13, w2) in the buffer's format (bf16: [E_local, 2I, H], [E_local, H, I]; else as
    ``quantize_weights`` makes them), ``mark`` ``run_staged``'s on_stage (or None);
    ``overrides``: ``Tuning`` fields on top of the call's defaults."""
    from ..launch import tuning_for
    from ..staged import run_staged
    x = a[0]
    y = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
    tuning = None
    if overrides:
        tuning = tuning_for(buf, x.shape[0], impl="staged").with_dotted(overrides)
    run_staged(buf, [x], [a[1]], [a[2]], [weights[0]], [weights[1]], y, on_stage=mark,
               tuning=tuning)
    return y


def plot_stages(rows: Sequence[dict], path) -> None:
    """Save a PNG: one panel per shape (each with its own µs axis, so decode and prefill
    points stay readable), one horizontal bar per (provider, tokens) row that has
    ``stages_us``, split into its stages in ``staged.STAGES`` order."""
    from .terminal import require
    require("matplotlib", extra="plot", why="the stage breakdown PNG")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ..staged import STAGES

    rows = [r for r in rows if r.get("stages_us")]
    if not rows:
        raise ValueError("plot_stages needs rows with stages_us (providers *-stages)")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    colors = ["#888888", "#bbbbbb", "#dddd66", "#4c9be8", "#e8894c", "#c44ce8", "#4ce89b"]
    fig = Figure(figsize=(4.2 * len(shapes), 0.5 * max(
        sum(r["shape"] == s for r in rows) for s in shapes) + 1.6), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(shapes), squeeze=False)[0]
    for ax, shape in zip(axes, shapes):
        mine = [r for r in rows if r["shape"] == shape]
        labels = [f"{r['provider'].removesuffix('-stages')} T={r['tokens_per_rank']}"
                  for r in mine]
        left = [0.0] * len(mine)
        for name, color in zip(STAGES, colors):
            widths = [r["stages_us"].get(name, 0.0) for r in mine]
            ax.barh(labels, widths, left=left, color=color, label=name)
            left = [a + b for a, b in zip(left, widths)]
        ax.invert_yaxis()
        ax.set_title(shape)
        ax.set_xlabel("µs per stage (GPU, slowest rank)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncols=len(STAGES), fontsize=8)
    fig.savefig(str(path), dpi=120)


def _capture(sets, fn) -> list:
    """One CUDA graph per input set (after a warm-up call each): [(graph, output)]."""
    out = []
    for a in sets:
        fn(a)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = fn(a)
        out.append((g, y))
    return out


def bench_ep_worker(rank: int, world: int, shapes: Sequence[str], tokens: Sequence[int],
                    providers: Sequence[str], reps: int, warmup: int, skew: float | None,
                    seed: int, tuning: dict | None = None,
                    config: dict | None = None) -> list[dict]:
    """Runs on every rank (spawned, one per GPU). Returns rank 0's rows (others: []).
    ``config``: ``MoEConfig`` fields that replace the shape's (block_m, num_experts)."""
    import torch.distributed as dist

    from .. import MoEConfig, SymmBuffer, mega_moe
    from ..launch import tuning_for
    from .baselines.torch_a2a import moe_forward_a2a
    from .bench import result_row, slowest, time_cuda
    from ..testing import TOLERANCE, quantize_weights, rel_error

    dev = torch.device("cuda", rank)
    rows: list[dict] = []
    progress = None
    if rank == 0:
        from .terminal import progress as make_progress
        progress = make_progress()
        progress.start()
        task = progress.add_task("ep bench", total=len(shapes) * len(tokens))
    try:
        for shape in shapes:
            cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=max(tokens), **(config or {}))
            data = list(_weights_and_inputs(cfg, world, rank, seed, tokens, dev, skew))
            w13, w2 = data[0][:2]
            ours = [p for p in providers if p != "torch" and provider_dtype(p) == "bf16"]
            buf = SymmBuffer(cfg, group=dist.group.WORLD) if ours else None
            qbuf = {}   # fp8 / fp4w asked for: (buffer, (w13 pair, w2 pair))
            for fmt in ("fp8", "fp4w"):
                if any(provider_dtype(p) == fmt for p in providers):
                    (w13q,), (w2q,) = quantize_weights([w13], [w2], fmt=fmt)
                    qbuf[fmt] = (SymmBuffer(cfg.with_(dtype=fmt), group=dist.group.WORLD),
                                 (w13q, w2q))
            none = (None, (None, None))
            for _, _, T, sets in data:
                skew_floor = gathered_routing_floor(cfg, sets, world) if skew else None

                def ours(impl, granularity="token"):
                    return lambda a: mega_moe(a[0], a[1], a[2], w13, w2, buf, impl=impl,
                                              granularity=granularity)
                def ourq(fmt, impl):
                    def call(a):
                        b, (q13, q2) = qbuf[fmt]
                        return mega_moe(a[0], a[1], a[2], q13, q2, b, impl=impl)
                    return call

                def tuned(b, ws, impl="staged"):
                    def call(a):
                        t = tuning_for(b, a[0].shape[0], impl=impl).with_dotted(tuning)
                        return mega_moe(a[0], a[1], a[2], ws[0], ws[1], b, tuning=t, impl=impl)
                    return call
                calls = {
                    "staged": ours("staged"), "staged-graph": ours("staged"),
                    "fused": ours("fused"), "fused-graph": ours("fused"),
                    "fp8-staged": ourq("fp8", "staged"), "fp8-staged-graph": ourq("fp8", "staged"),
                    "fp8-fused-graph": ourq("fp8", "fused"),
                    "fp4w-staged": ourq("fp4w", "staged"),
                    "fp4w-staged-graph": ourq("fp4w", "staged"),
                    "fp4w-fused-graph": ourq("fp4w", "fused"),
                    "staged-tuned-graph": tuned(buf, (w13, w2)),
                    "fp8-staged-tuned-graph": tuned(*qbuf.get("fp8", none)),
                    "fp4w-staged-tuned-graph": tuned(*qbuf.get("fp4w", none)),
                    "fused-tuned-graph": tuned(buf, (w13, w2), "fused"),
                    "fp8-fused-tuned-graph": tuned(*qbuf.get("fp8", none), "fused"),
                    "torch": lambda a: moe_forward_a2a(a[0], a[1], a[2], w13, w2,
                                                      num_experts=cfg.num_experts),
                }
                for p in providers:
                    if provider_granularity(p) is not None:
                        calls[p] = ours("fused", provider_granularity(p))
                    if is_stagewise(p):   # staged.run_staged with an on_stage hook
                        fmt = provider_dtype(p)
                        b, ws = qbuf[fmt] if fmt != "bf16" else (buf, (w13, w2))
                        over = tuning if is_tuned(p) else None
                        calls[p] = (lambda a, mark=None, b=b, ws=ws, over=over: staged_call(
                            b, a, ws, mark, over))
                # agreement check on the first input set before timing anything; the first
                # call of a provider also compiles its kernels (reported, so a slow compile is
                # never mistaken for a hang)
                outs, first_s, fns, graphs = {}, {}, {}, {}
                for p in providers:
                    t0 = time.perf_counter()
                    if is_replayed(p):   # one CUDA graph per input set, replayed by index
                        graphs[p] = _capture(sets, calls[p])
                        graphs[p][0][1].fill_(float("nan"))   # unwritten rows fail the check
                        graphs[p][0][0].replay()
                        outs[p] = graphs[p][0][1]
                        fns[p] = lambda i, g=graphs[p]: g[i][0].replay()
                    else:
                        outs[p] = calls[p](sets[0])
                        fns[p] = calls[p]
                    torch.cuda.synchronize()
                    first_s[p] = time.perf_counter() - t0
                if progress is not None:
                    progress.console.print(f"{shape} T={T}: first calls " + ", ".join(
                        f"{p} {s:.1f}s" for p, s in first_s.items()))
                agree = {}
                if "torch" in outs:
                    for p in providers:
                        if p != "torch" and T:
                            agree[p] = rel_error(outs[p], outs["torch"])
                for b in (buf, *(q[0] for q in qbuf.values())):
                    if b is not None:
                        b.check()
                for p in providers:
                    dist.barrier()
                    rotate = list(range(len(sets))) if is_replayed(p) else sets
                    if is_stagewise(p):
                        timer = graph_stage_times if p.endswith("-graph-stages") else stage_times
                        stats = slowest(timer(lambda mark, p=p: calls[p](sets[0], mark),
                                              reps=reps, warmup=warmup))
                    else:
                        stats = slowest(time_cuda(fns[p], warmup=warmup, reps=reps,
                                                  rotate=rotate))
                    if rank == 0:
                        err = agree.get(p)
                        bound = {"fp8": FP8_AGREE, "fp4w": FP4W_AGREE}.get(
                            provider_dtype(p), 2 * TOLERANCE["bf16"])
                        rows.append(result_row(
                            shape=shape, ranks=world, tokens_per_rank=T, dtype=provider_dtype(p),
                            provider=p, median_us=stats["median_us"], p20_us=stats["p20_us"],
                            p80_us=stats["p80_us"], slowest_rank=stats.get("slowest_rank", 0),
                            routing="skewed" if skew else "uniform", block_m=cfg.block_m,
                            **({"experts": cfg.num_experts} if "num_experts" in (config or {})
                               else {}),
                            rel_diff_vs_torch=err,
                            agrees=None if err is None else bool(err < bound),
                            **({} if skew_floor is None else
                               {"floor_us": skew_floor(provider_dtype(p)),
                                "floor_from": "routing"}),
                            **({"tuning": dict(tuning)} if is_tuned(p) else {}),
                            **({"stages_us": stats["stages_us"]} if "stages_us" in stats
                               else {})))
                        if os.environ.get("MOESTREAM_EP_PARTIAL"):
                            # rows so far survive a run cut by its time limit
                            with open(os.environ["MOESTREAM_EP_PARTIAL"], "a") as f:
                                f.write(json.dumps(rows[-1]) + "\n")
                        progress.console.print(
                            f"{time.strftime('%H:%M:%S')} {shape} T={T} {p}: "
                            f"{stats['median_us']:.1f} us"
                            + ("" if err is None else f" (rel diff vs torch {err:.1e})"))
                for b in (buf, *(q[0] for q in qbuf.values())):
                    if b is not None:
                        b.check()
                graphs = None   # free the captured graphs' memory pools
                if progress is not None:
                    progress.advance(task)
            for b in (buf, *(q[0] for q in qbuf.values())):
                if b is not None:
                    b.destroy()
            data = w13 = w2 = qbuf = None   # this shape's weights go before the next one's arrive
            torch.cuda.empty_cache()
    finally:
        if progress is not None:
            progress.stop()
    return rows


def randn_bf16(shape: tuple[int, ...], scale: float, gen: torch.Generator, dev) -> torch.Tensor:
    """[E, ...] bf16 normal values times ``scale``, drawn one expert (leading index) at a time
    on ``gen``'s device (the fp32 draw of a whole dsv3 rank would take 22 GB)."""
    out = torch.empty(shape, dtype=torch.bfloat16, device=dev)
    for e in range(shape[0]):
        out[e] = torch.randn(shape[1:], generator=gen, device=dev) * scale
    return out


def gathered_routing_floor(cfg, sets, world: int) -> Callable[[str], float]:
    """For skewed routing, where the uniform floor does not hold: every rank's routing of
    each input set gathered to all ranks (a collective), and a function of the dtype giving
    the mean over the sets of ``bench.routing_floors`` (the slowest rank's floor)."""
    import torch.distributed as dist

    from .bench import routing_floors
    per_set = []
    for _, idx, _ in sets:
        parts = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(parts, idx.contiguous())
        per_set.append([p.cpu() for p in parts])
    return lambda dtype: sum(routing_floors(cfg, topk_idxs=r, dtype=dtype)["floor_us"]
                             for r in per_set) / len(per_set)


def _weights_and_inputs(cfg, world: int, rank: int, seed: int, tokens: Sequence[int], dev,
                        skew: float | None):
    """This rank's bf16 experts and, per token count, its input sets: one generator drawn in
    one order, so every worker of a run sees the same data."""
    e_loc = cfg.experts_per_rank(world)
    g = torch.Generator().manual_seed(seed + 17 * rank)
    H, I = cfg.hidden, cfg.intermediate
    # weights drawn where they live: the CPU's generator takes about a minute for dsv3's 5.6 G
    # values per rank, device time that every run paid before its first row
    gw = torch.Generator(device=dev).manual_seed(seed + 17 * rank)
    w13 = randn_bf16((e_loc, 2 * I, H), H ** -0.5, gw, dev)
    w2 = randn_bf16((e_loc, H, I), I ** -0.5, gw, dev)
    for T in tokens:
        yield w13, w2, T, input_sets(cfg, T, g, dev, skew=skew, sets=4)


def bench_symm_worker(rank: int, world: int, shapes: Sequence[str], tokens: Sequence[int],
                      reps: int, warmup: int, skew: float | None, seed: int,
                      config: dict | None = None) -> list[dict]:
    """The torch-symm provider on every rank (its own processes: NVSHMEM owns their symmetric
    memory). One context per token count (its static shapes scale with it). Rank 0's rows."""
    import torch.distributed as dist

    from .. import MoEConfig
    from .baselines.torch_a2a import moe_forward_a2a
    from .baselines.torch_symm import SymmA2AContext, SymmUnavailableError, moe_forward_symm
    from .bench import result_row, slowest, time_cuda
    from ..testing import TOLERANCE, rel_error

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    rows: list[dict] = []
    for shape in shapes:
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=max(tokens), **(config or {}))
        E = cfg.num_experts
        for w13, w2, T, sets in _weights_and_inputs(cfg, world, rank, seed, tokens, dev, skew):
            skew_floor = gathered_routing_floor(cfg, sets, world) if skew else None
            try:
                ctx = SymmA2AContext(T, cfg.hidden, cfg.top_k, E, device=dev)
            except SymmUnavailableError as exc:
                if rank == 0:
                    print(f"torch-symm unavailable: {exc}")
                return rows
            fn = (lambda a: moe_forward_symm(a[0], a[1], a[2], w13, w2, num_experts=E,
                                             ctx=ctx))
            y = fn(sets[0])
            ref = moe_forward_a2a(*sets[0], w13, w2, num_experts=E)
            err = rel_error(y, ref)
            dist.barrier()
            stats = slowest(time_cuda(fn, warmup=warmup, reps=reps, rotate=sets))
            ctx.close()
            if rank == 0:
                rows.append(result_row(
                    shape=shape, ranks=world, tokens_per_rank=T, dtype="bf16",
                    provider="torch-symm", median_us=stats["median_us"], p20_us=stats["p20_us"],
                    p80_us=stats["p80_us"], slowest_rank=stats.get("slowest_rank", 0),
                    routing="skewed" if skew else "uniform", rel_diff_vs_torch=err,
                    agrees=bool(err < 2 * TOLERANCE["bf16"]),
                    **({"experts": E} if "num_experts" in (config or {}) else {}),
                    **({} if skew_floor is None else
                       {"floor_us": skew_floor("bf16"), "floor_from": "routing"})))
                print(f"{shape} T={T} torch-symm: {stats['median_us']:.1f} us "
                      f"(rel diff vs torch {err:.1e})", flush=True)
        torch.cuda.empty_cache()
    return rows


def run_ep_bench(*, shapes: Sequence[str], tokens: Sequence[int],
                 providers: Sequence[str] = PROVIDERS, world: int | None = None, reps: int = 20,
                 warmup: int = 5, skew: float | None = None, seed: int = 0,
                 timeout_s: float = 3000, tuning: dict | None = None,
                 block_m: int | None = None, experts: int | None = None) -> list[dict]:
    """Spawn one process per GPU and run the benchmark; returns the rows (slowest rank).
    ``tuning``: ``Tuning`` overrides of the *-tuned-graph providers (``parse_tuning``).
    ``block_m``: our layer's m-block rows instead of the shape's default (rows carry
    ``block_m``; the torch providers do not use it). ``experts``: the routed experts of every
    shape instead of its own (e.g. 32 on one GPU: one EP8 rank's share of dsv3; rows carry
    ``experts``). ``skew``: the hot expert's share of picks (``testing.make_routing``), in
    (0, 1]; its rows carry the floor of their routing."""
    if skew is not None and (isinstance(skew, bool) or not isinstance(skew, (int, float))
                             or not 0.0 < skew <= 1.0):
        raise ValueError(f"skew is the hot expert's share of picks, in (0, 1]; got {skew!r}")
    check_providers(providers, tuning)
    config = {**({"block_m": block_m} if block_m is not None else {}),
              **({"num_experts": experts} if experts is not None else {})}
    from ..config import MoEConfig
    # every shape's config and its split over the ranks: a ValueError before any spawn
    cfgs = [MoEConfig.from_shape(s, max_tokens_per_rank=max(tokens), **config) for s in shapes]
    world = world or torch.cuda.device_count()
    if world < 1:
        raise ValueError("the EP benchmark needs at least one CUDA GPU")
    for cfg in cfgs:
        cfg.check_ranks(world)
    from .distributed import spawn
    rows: list[dict] = []
    main = [p for p in providers if p != "torch-symm"]
    if main:
        rows += spawn(bench_ep_worker, world_size=world, backend="nccl",
                      args=(list(shapes), list(tokens), main, reps, warmup, skew, seed,
                            dict(tuning or {}), config),
                      timeout_s=timeout_s)[0]
    if "torch-symm" in providers:
        rows += spawn(bench_symm_worker, world_size=world, backend="nccl",
                      args=(list(shapes), list(tokens), reps, warmup, skew, seed, config),
                      timeout_s=timeout_s)[0]
    return rows
