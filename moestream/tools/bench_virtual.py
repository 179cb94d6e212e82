"""The layer on R virtual ranks in one process on one GPU (``moestream bench --virtual-ranks R
--layer``): each rank's staged and fused call as ``mega_moe_virtual`` launches them (every
launch serves all R ranks), the same inputs for every provider, replayed from CUDA graphs.

Providers: ``staged-graph``, ``fused-graph`` (bf16) and their ``fp8-`` / ``fp4w-`` forms, as
the EP bench names them (``bench_ep``). Before timing, each point checks that the fused output
agrees with the staged one (relative difference within the format's tolerance), so a broken
launch is never timed as fast. Rows carry ``ranks`` = R and ``num_gpus`` = 1.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..buffer import SymmBuffer
from ..config import MoEConfig
from ..ops import IMPLS, runner
from ..testing import TOLERANCE, make_routing, make_tokens, quantize_weights, rel_error
from .bench import result_row, time_cuda
from .bench_ep import randn_bf16

__all__ = ["bench_virtual"]


def _weights(cfg: MoEConfig, ranks: int, dtype: str, gen: torch.Generator, dev) -> tuple:
    """Per-rank experts with unit-variance activations, drawn on ``dev``, quantized for fp8 /
    fp4w."""
    e_loc, H, I = cfg.experts_per_rank(ranks), cfg.hidden, cfg.intermediate
    w13s = [randn_bf16((e_loc, 2 * I, H), H ** -0.5, gen, dev) for _ in range(ranks)]
    w2s = [randn_bf16((e_loc, H, I), I ** -0.5, gen, dev) for _ in range(ranks)]
    return (w13s, w2s) if dtype == "bf16" else quantize_weights(w13s, w2s, fmt=dtype)


def _label(cfg: MoEConfig) -> str:
    return f"h{cfg.hidden}i{cfg.intermediate}e{cfg.num_experts}k{cfg.top_k}"


def bench_virtual(*, shapes: Sequence[str | MoEConfig], tokens: Sequence[int], ranks: int,
                  dtypes: Sequence[str] = ("bf16",), impls: Sequence[str] = IMPLS,
                  experts: int | None = None, reps: int = 20, warmup: int = 5, seed: int = 0,
                  graph: bool = True, device: str | torch.device = "cuda",
                  progress: Callable[[str], None] | None = None) -> list[dict]:
    """Rows (one per shape x tokens x dtype x impl) of the layer on ``ranks`` virtual ranks.

    Args:
        shapes: names of ``moestream.config.SHAPES``, or MoEConfigs (rows named by their
            dims); tokens: T per rank (>= 1).
        ranks: R >= 1, dividing every shape's expert count (``experts`` replaces it, e.g. 32).
        dtypes: "bf16", "fp8", "fp4w"; impls: "staged", "fused".
        graph: replay each call from a CUDA graph (CUDA only); otherwise Python launches.
        progress: called with a label before each point.
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    bad = [i for i in impls if i not in IMPLS] + [d for d in dtypes if d not in TOLERANCE]
    if bad or not impls:
        raise ValueError(f"impls must be among {IMPLS} and dtypes among {tuple(TOLERANCE)}; "
                         f"got {list(impls)}, {list(dtypes)}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tokens):
        raise ValueError(f"tokens must be ints >= 1, got {list(tokens)}")
    dev = torch.device(device)
    graph = graph and dev.type == "cuda"
    over = {"num_experts": experts} if experts else {}
    cfgs = {}
    for s in shapes:
        if isinstance(s, MoEConfig):
            cfg = s.with_(max_tokens_per_rank=max(tokens), **over)
            cfgs[_label(cfg)] = cfg
        else:
            cfgs[s] = MoEConfig.from_shape(s, max_tokens_per_rank=max(tokens), **over)
    for cfg in cfgs.values():
        cfg.experts_per_rank(ranks)   # a ValueError before any weights are drawn
    gen = torch.Generator(device=dev).manual_seed(seed)   # weights, drawn on the device
    host = torch.Generator().manual_seed(seed)            # tokens and routing (testing draws)
    rows: list[dict] = []
    for shape, base in cfgs.items():
        for dtype in dtypes:
            cfg = base.with_(dtype=dtype)
            w13s, w2s = _weights(cfg, ranks, dtype, gen, dev)
            buf = SymmBuffer(cfg, num_ranks=ranks, device=dev)
            for T in tokens:
                if progress is not None:
                    progress(f"{shape} {dtype} T={T}")
                xs = [make_tokens(T, cfg.hidden, generator=host, device=dev)
                      for _ in range(ranks)]
                rts = [make_routing(T, cfg.num_experts, cfg.top_k, generator=host, device=dev)
                       for _ in range(ranks)]
                outs, stats = {}, {}
                for impl in impls:
                    y = torch.empty(ranks, T, cfg.hidden, dtype=torch.bfloat16, device=dev)

                    def call(run=runner(impl, "token"), y=y):
                        run(buf, xs, [r[0] for r in rts], [r[1] for r in rts], w13s, w2s, y)
                    call()   # compiles, warms up; a stall is reported here, not timed
                    buf.check()
                    fn = call
                    if graph:
                        torch.cuda.synchronize()
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            call()
                        fn = g.replay
                    stats[impl] = time_cuda(fn, warmup=warmup, reps=reps)
                    buf.check()
                    outs[impl] = y
                err = (rel_error(outs["fused"], outs["staged"]) if len(outs) == 2 else None)
                prefix = "" if dtype == "bf16" else f"{dtype}-"
                # one GPU does every rank's work: no per-rank floor model (bench.floors: one
                # rank per GPU), TFLOP/s of the whole GPU
                flop = 6.0 * ranks * T * cfg.top_k * cfg.hidden * cfg.intermediate
                for impl, t in stats.items():
                    rows.append(result_row(
                        shape=shape, ranks=ranks, num_gpus=1, tokens_per_rank=T, dtype=dtype,
                        provider=f"{prefix}{impl}-graph" if graph else f"{prefix}{impl}",
                        median_us=t["median_us"], p20_us=t["p20_us"], p80_us=t["p80_us"],
                        tflops_per_gpu=flop / t["median_us"] / 1e6, link_gbps=None,
                        floor_us=None, block_m=cfg.block_m, virtual_ranks=ranks,
                        **({"experts": cfg.num_experts} if experts else {}),
                        fused_vs_staged=err,
                        agrees=None if err is None else bool(err < TOLERANCE[dtype])))
            buf.destroy()
            w13s = w2s = None   # freed before the next format's weights are drawn
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows
