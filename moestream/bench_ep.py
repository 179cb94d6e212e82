"""Expert-parallel layer benchmark across the GPUs of one node (BENCHMARKS.md protocol).

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
                  all_to_all_vdev_2d_offset combine (moestream/baselines/torch_symm.py; no host
                  sync). NVSHMEM must own the process's symmetric memory, so it runs in its own
                  processes after the others, on the same inputs (same seeds), checked against
                  the torch provider's output.
    fp8-staged    ours in fp8 (MoEConfig dtype "fp8", weights quantized from the same bf16
                  experts, DeepSeek-V3 block format); fp8-staged-graph: replayed from graphs.
                  Rows carry dtype "fp8" (floors of the fp8 format) and their agreement with
                  torch's bf16 output is judged against the fp8 quantization error
                  (docs/quantization.md: ~6e-2 on random data; FP8_AGREE).
    fp8-fused-graph  the fp8 layer in the fused launch, replayed from CUDA graphs.

Every rank times every call (CUDA events, warm-up first, median of >= 20 calls, inputs rotated
over several sets); the slowest rank's figures are reported. Before timing, each point checks
that the providers agree (relative difference within the bf16 tolerance), so a broken kernel is
never timed as fast.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

__all__ = ["bench_ep_worker", "run_ep_bench"]

PROVIDERS = ("staged", "staged-graph", "fused", "fused-graph", "torch", "fp8-staged",
             "fp8-staged-graph", "fp8-fused-graph", "torch-symm")
# fp8 vs torch's bf16 layer: the quantization error of random data (~6e-2) with headroom; a
# scale applied twice or a misplaced row is far outside
FP8_AGREE = 0.12


def _dtype(provider: str) -> str:
    return "fp8" if provider.startswith("fp8-") else "bf16"


def _granularity(provider: str) -> int | str | None:
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


def check_providers(providers: Sequence[str]) -> None:
    """ValueError naming any provider this benchmark does not know."""
    unknown = [p for p in providers if p not in PROVIDERS and _granularity(p) is None]
    if unknown:
        raise ValueError(f"unknown providers {unknown}; known: {PROVIDERS} and chunk<C>, "
                         "chunkexpert")


def _inputs(cfg, T: int, gen: torch.Generator, device, *, skew: float | None, sets: int):
    from .testing import make_routing, make_tokens
    out = []
    for _ in range(sets):
        x = make_tokens(T, cfg.hidden, generator=gen, device=device)
        idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=gen, device=device,
                              skew=skew)
        out.append((x, idx, w))
    return out


def _replayed(provider: str) -> bool:
    """Providers timed as CUDA-graph replays."""
    return provider.endswith("-graph") or _granularity(provider) is not None


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
                    seed: int) -> list[dict]:
    """Runs on every rank (spawned, one per GPU). Returns rank 0's rows (others: [])."""
    import torch.distributed as dist

    from . import MoEConfig, SymmBuffer, mega_moe
    from .baselines.torch_a2a import moe_forward_a2a
    from .bench import result_row, slowest, time_cuda
    from .testing import TOLERANCE, quantize_weights, rel_error

    dev = torch.device("cuda", rank)
    rows: list[dict] = []
    progress = None
    if rank == 0:
        from rich.progress import Progress
        progress = Progress()
        progress.start()
        task = progress.add_task("ep bench", total=len(shapes) * len(tokens))
    try:
        for shape in shapes:
            cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=max(tokens))
            data = list(_weights_and_inputs(cfg, world, rank, seed, tokens, dev, skew))
            w13, w2 = data[0][:2]
            ours = [p for p in providers if p != "torch" and _dtype(p) == "bf16"]
            buf = SymmBuffer(cfg, group=dist.group.WORLD) if ours else None
            buf8 = w8 = None
            if any(_dtype(p) == "fp8" for p in providers):
                buf8 = SymmBuffer(cfg.with_(dtype="fp8"), group=dist.group.WORLD)
                (w13q,), (w2q,) = quantize_weights([w13], [w2])
                w8 = (w13q, w2q)
            for _, _, T, sets in data:
                def ours(impl, granularity="token"):
                    return lambda a: mega_moe(a[0], a[1], a[2], w13, w2, buf, impl=impl,
                                              granularity=granularity)
                def ours8(impl):
                    return lambda a: mega_moe(a[0], a[1], a[2], w8[0], w8[1], buf8, impl=impl)
                calls = {
                    "staged": ours("staged"), "staged-graph": ours("staged"),
                    "fused": ours("fused"), "fused-graph": ours("fused"),
                    "fp8-staged": ours8("staged"), "fp8-staged-graph": ours8("staged"),
                    "fp8-fused-graph": ours8("fused"),
                    "torch": lambda a: moe_forward_a2a(a[0], a[1], a[2], w13, w2,
                                                      num_experts=cfg.num_experts),
                }
                for p in providers:
                    if _granularity(p) is not None:
                        calls[p] = ours("fused", _granularity(p))
                # agreement check on the first input set before timing anything; the first
                # call of a provider also compiles its kernels (reported, so a slow compile is
                # never mistaken for a hang)
                outs, first_s, fns, graphs = {}, {}, {}, {}
                for p in providers:
                    t0 = time.perf_counter()
                    if _replayed(p):   # one CUDA graph per input set, replayed by index
                        graphs[p] = _capture(sets, calls[p])
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
                for b in (buf, buf8):
                    if b is not None:
                        b.check()
                for p in providers:
                    dist.barrier()
                    rotate = list(range(len(sets))) if _replayed(p) else sets
                    stats = slowest(time_cuda(fns[p], warmup=warmup, reps=reps, rotate=rotate))
                    if rank == 0:
                        err = agree.get(p)
                        bound = FP8_AGREE if _dtype(p) == "fp8" else 2 * TOLERANCE["bf16"]
                        rows.append(result_row(
                            shape=shape, ranks=world, tokens_per_rank=T, dtype=_dtype(p),
                            provider=p, median_us=stats["median_us"], p20_us=stats["p20_us"],
                            p80_us=stats["p80_us"], slowest_rank=stats.get("slowest_rank", 0),
                            routing="skewed" if skew else "uniform",
                            rel_diff_vs_torch=err,
                            agrees=None if err is None else bool(err < bound)))
                        progress.console.print(
                            f"{shape} T={T} {p}: {stats['median_us']:.1f} us"
                            + ("" if err is None else f" (rel diff vs torch {err:.1e})"))
                for b in (buf, buf8):
                    if b is not None:
                        b.check()
                graphs = None   # free the captured graphs' memory pools
                if progress is not None:
                    progress.advance(task)
            for b in (buf, buf8):
                if b is not None:
                    b.destroy()
            data = w13 = w2 = w8 = None   # this shape's weights go before the next one's arrive
            torch.cuda.empty_cache()
    finally:
        if progress is not None:
            progress.stop()
    return rows


def _weights_and_inputs(cfg, world: int, rank: int, seed: int, tokens: Sequence[int], dev,
                        skew: float | None):
    """This rank's bf16 experts and, per token count, its input sets: one generator drawn in
    one order, so every worker of a run sees the same data."""
    e_loc = cfg.experts_per_rank(world)
    g = torch.Generator().manual_seed(seed + 17 * rank)
    H, I = cfg.hidden, cfg.intermediate
    w13 = (torch.randn(e_loc, 2 * I, H, generator=g) * H ** -0.5).bfloat16().to(dev)
    w2 = (torch.randn(e_loc, H, I, generator=g) * I ** -0.5).bfloat16().to(dev)
    for T in tokens:
        yield w13, w2, T, _inputs(cfg, T, g, dev, skew=skew, sets=4)


def bench_symm_worker(rank: int, world: int, shapes: Sequence[str], tokens: Sequence[int],
                      reps: int, warmup: int, skew: float | None, seed: int) -> list[dict]:
    """The torch-symm provider on every rank (its own processes: NVSHMEM owns their symmetric
    memory). One context per token count (its static shapes scale with it). Rank 0's rows."""
    import torch.distributed as dist

    from . import MoEConfig
    from .baselines.torch_a2a import moe_forward_a2a
    from .baselines.torch_symm import SymmA2AContext, SymmUnavailableError, moe_forward_symm
    from .bench import result_row, slowest, time_cuda
    from .testing import TOLERANCE, rel_error

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    rows: list[dict] = []
    for shape in shapes:
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=max(tokens))
        E = cfg.num_experts
        for w13, w2, T, sets in _weights_and_inputs(cfg, world, rank, seed, tokens, dev, skew):
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
                    agrees=bool(err < 2 * TOLERANCE["bf16"])))
                print(f"{shape} T={T} torch-symm: {stats['median_us']:.1f} us "
                      f"(rel diff vs torch {err:.1e})", flush=True)
        torch.cuda.empty_cache()
    return rows


def run_ep_bench(*, shapes: Sequence[str], tokens: Sequence[int],
                 providers: Sequence[str] = PROVIDERS, world: int | None = None, reps: int = 20,
                 warmup: int = 5, skew: float | None = None, seed: int = 0,
                 timeout_s: float = 3000) -> list[dict]:
    """Spawn one process per GPU and run the benchmark; returns the rows (slowest rank)."""
    from .distributed import spawn
    check_providers(providers)
    world = world or torch.cuda.device_count()
    if world < 1:
        raise ValueError("the EP benchmark needs at least one CUDA GPU")
    rows: list[dict] = []
    main = [p for p in providers if p != "torch-symm"]
    if main:
        rows += spawn(bench_ep_worker, world_size=world, backend="nccl",
                      args=(list(shapes), list(tokens), main, reps, warmup, skew, seed),
                      timeout_s=timeout_s)[0]
    if "torch-symm" in providers:
        rows += spawn(bench_symm_worker, world_size=world, backend="nccl",
                      args=(list(shapes), list(tokens), reps, warmup, skew, seed),
                      timeout_s=timeout_s)[0]
    return rows
