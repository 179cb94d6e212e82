"""Timelines of the fused kernel: what every persistent program did, when, on which SM.

The fused launch built with its trace flag (``fused.run_fused(..., trace=...)``; the flag is a
compile-time constant, so the untraced kernel is unchanged) writes one row per ticket:

    phase (0 dispatch, 1 L1, 2 L2, 3 combine), rank, a, b, c, SM, start ns, end ns

(see kernels/fused.py). This module collects those rows (``collect_virtual`` for virtual
ranks in this process, ``run_trace`` across the GPUs of this machine), reduces them to overlap
figures per rank (``summarize``) and draws the timeline (``plot_timeline``). Times come from
each GPU's global timer, so figures are per rank (GPUs' timers are not synchronised).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["PHASES", "collect_virtual", "run_trace", "summarize", "plot_timeline",
           "intervals_union", "overlap_length"]

PHASES = ("dispatch", "L1", "L2", "combine")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
# trace columns
PHASE, RANK, A, B, C, SM, START, END = range(8)


def _trace_buffer(buffer, tuning, device) -> torch.Tensor:
    from ..fused import max_tickets
    return torch.full((max_tickets(buffer, tuning), 8), -1, dtype=torch.int64, device=device)


def _rows(trace: torch.Tensor) -> np.ndarray:
    t = trace.cpu().numpy()
    return t[t[:, PHASE] >= 0]


def collect_virtual(config, *, ranks: int, tokens: Sequence[int], device: str | torch.device,
                    granularity: int | str = "token", seed: int = 0, tuning=None,
                    overrides: dict | None = None) -> np.ndarray:
    """One traced fused call on ``ranks`` virtual ranks in this process (random inputs and
    weights; ``tokens[r]`` tokens on rank r, after one untraced warm-up call). ``tuning``
    (default: the policy's) with ``overrides`` (dotted ``Tuning`` names) on top.

    Returns int64 [tickets, 8] trace rows (columns as the module docstring lists)."""
    from ..buffer import SymmBuffer
    from ..fused import fused_tuning, run_fused
    from ..launch import tuning_for
    from ..testing import make_routing, make_tokens, make_weights
    if len(tokens) != ranks:
        raise ValueError(f"tokens must list one count per rank ({ranks}), got {list(tokens)}")
    g = torch.Generator().manual_seed(seed)
    buf = SymmBuffer(config, num_ranks=ranks, device=device)
    xs, idxs, ws = [], [], []
    for T in tokens:
        x = make_tokens(T, config.hidden, generator=g, device=device)
        i, w = make_routing(T, config.num_experts, config.top_k, generator=g, device=device)
        xs.append(x)
        idxs.append(i)
        ws.append(w)
    w13s, w2s = make_weights(config, ranks, generator=g, device=device)
    if overrides:
        tuning = (tuning or tuning_for(buf, max(tokens), impl="fused")).with_dotted(overrides)
    tuning = fused_tuning(buf, max(tokens), tuning=tuning, granularity=granularity)
    y = torch.empty(ranks, max(max(tokens), 1), config.hidden, dtype=torch.bfloat16,
                    device=device)
    run_fused(buf, xs, idxs, ws, w13s, w2s, y, tuning=tuning,   # compiles, warms up
              granularity=granularity)
    trace = _trace_buffer(buf, tuning, device)
    run_fused(buf, xs, idxs, ws, w13s, w2s, y, tuning=tuning, trace=trace,
              granularity=granularity)
    buf.check()
    return _rows(trace)


def _trace_worker(rank: int, world: int, shape: str, tokens: int, granularity, seed: int,
                  overrides: dict | None = None) -> np.ndarray:
    """One process per GPU: a traced fused call of the real EP layer (spawned), with
    ``Tuning`` ``overrides`` (dotted names, ``Tuning.with_dotted``) on top of the fused
    launch's defaults."""

    import torch.distributed as dist

    from .. import MoEConfig, SymmBuffer, mega_moe
    from ..fused import fused_tuning, run_fused
    from ..launch import tuning_for
    from ..testing import make_routing, make_tokens
    dev = torch.device("cuda", rank)
    cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=max(tokens, 1))
    g = torch.Generator().manual_seed(seed + 17 * rank)
    e_loc = cfg.experts_per_rank(world)
    w13 = (torch.randn(e_loc, 2 * cfg.intermediate, cfg.hidden, generator=g)
           * cfg.hidden ** -0.5).bfloat16().to(dev)
    w2 = (torch.randn(e_loc, cfg.hidden, cfg.intermediate, generator=g)
          * cfg.intermediate ** -0.5).bfloat16().to(dev)
    x = make_tokens(tokens, cfg.hidden, generator=g, device=dev)
    idx, w = make_routing(tokens, cfg.num_experts, cfg.top_k, generator=g, device=dev)
    buf = SymmBuffer(cfg, group=dist.group.WORLD)
    base = (tuning_for(buf, tokens, impl="fused").with_dotted(overrides) if overrides
            else None)
    for _ in range(3):   # compile and warm up (untraced)
        mega_moe(x, idx, w, w13, w2, buf, impl="fused", granularity=granularity, tuning=base)
    torch.cuda.synchronize()
    tuning = fused_tuning(buf, tokens, tuning=base, granularity=granularity)
    trace = _trace_buffer(buf, tuning, dev)
    y = torch.empty(1, max(tokens, 1), cfg.hidden, dtype=torch.bfloat16, device=dev)
    for _ in range(2):   # the first traced call compiles the traced kernel (ranks may differ
        torch.cuda.synchronize()   # by its compile time), the second is the one kept
        dist.barrier()
        torch.cuda.synchronize()
        trace.fill_(-1)
        run_fused(buf, [x], [idx], [w], [w13], [w2], y, tuning=tuning, trace=trace,
                  granularity=granularity)
    torch.cuda.synchronize()
    buf.check()
    rows = _rows(trace)
    buf.destroy()
    return rows


def run_trace(*, shape: str, tokens: int, world: int | None = None,
              granularity: int | str = "token", seed: int = 0,
              timeout_s: float = 600, tuning: dict | None = None) -> np.ndarray:
    """A traced fused call of ``shape`` with ``tokens`` tokens per rank on ``world`` GPUs of
    this machine (default all; one process each). ``tuning``: ``Tuning`` field overrides
    (dotted names) on top of the fused launch's defaults (``tuning.select``; e.g.
    ``{"fused.wave_blocks": 264}``). Returns every rank's rows, stacked."""
    from .distributed import spawn
    from ..tuning import Tuning
    Tuning().with_dotted(tuning or {})   # a bad field or value fails here, before any spawn
    if not torch.cuda.is_available():
        raise ValueError("moestream trace needs CUDA GPUs (the interpreter has no clock)")
    world = world or torch.cuda.device_count()
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    parts = spawn(_trace_worker, world_size=world, backend="nccl",
                  args=(shape, tokens, granularity, seed, dict(tuning or {})),
                  timeout_s=timeout_s)
    return np.concatenate(parts, axis=0)


# ---- analysis ----------------------------------------------------------------------------

def intervals_union(iv: np.ndarray) -> np.ndarray:
    """Merged, sorted [n, 2] intervals covering the same time as ``iv`` [m, 2]."""
    if len(iv) == 0:
        return np.zeros((0, 2), dtype=np.float64)
    iv = iv[np.argsort(iv[:, 0], kind="stable")].astype(np.float64)
    out = [list(iv[0])]
    for s, e in iv[1:]:
        if s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return np.asarray(out)


def overlap_length(a: np.ndarray, b: np.ndarray) -> float:
    """Length of the intersection of two unions of intervals (each merged, sorted [n, 2])."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        total += max(0.0, hi - lo)
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total


def _length(u: np.ndarray) -> float:
    return float((u[:, 1] - u[:, 0]).sum()) if len(u) else 0.0


def summarize(rows: np.ndarray) -> list[dict]:
    """Overlap figures per rank, from trace rows (times in µs from the rank's first start):

    layer_us      first task start to last task end
    phases        per phase: tasks, start_us, end_us, busy_us (union of its tasks' time),
                  sm_us (sum of its tasks' durations), task_us (their median)
    comm_hidden   share of the dispatch+combine busy time during which a GEMM task ran
    l1_during_dispatch   share of the L1 busy time before the last dispatch task ended
    l2_during_l1  share of the L2 busy time during which an L1 task ran (wave overlap)
    l2_waiting    share of the L2 tasks' time (sum of durations) spent before the last L1
                  task of their m-block ended: time an L2 program held its ticket waiting
                  for ``l1_done`` (L2 tickets claimed while their wave's L1 still runs)
    sms           SMs that ran at least one task
    per_sm_us     program time per SM: each phase's sm_us over ``sms``, and ``idle``: the
                  mean over SMs of the time between an SM's first task start and its last
                  task end that none of its tasks covered (ticket claims, gaps). Comparable
                  with the staged path's per-stage times when every SM is busy throughout.
    timed         False when every timestamp is 0 (the interpreter has no clock)
    """
    out = []
    for rank in np.unique(rows[:, RANK]):
        r = rows[rows[:, RANK] == rank]
        t0 = r[:, START].min()
        start = (r[:, START] - t0) / 1e3
        end = (r[:, END] - t0) / 1e3
        unions, phases = {}, {}
        for p, name in enumerate(PHASES):
            m = r[:, PHASE] == p
            u = intervals_union(np.stack([start[m], end[m]], axis=1))
            unions[name] = u
            phases[name] = dict(tasks=int(m.sum()),
                                start_us=float(start[m].min()) if m.any() else None,
                                end_us=float(end[m].max()) if m.any() else None,
                                busy_us=_length(u), sm_us=float((end[m] - start[m]).sum()),
                                task_us=float(np.median(end[m] - start[m])) if m.any() else None)
        both = lambda a, b: intervals_union(np.concatenate([unions[a], unions[b]]))  # noqa: E731
        comm, gemm = both("dispatch", "combine"), both("L1", "L2")
        l1 = unions["L1"]
        d_end = phases["dispatch"]["end_us"]
        before = (overlap_length(l1, np.array([[0.0, d_end]])) if d_end is not None else 0.0)
        ratio = lambda a, b: (a / b) if b > 0 else None  # noqa: E731
        sms = np.unique(r[:, SM])
        per_sm = {name: phases[name]["sm_us"] / len(sms) for name in PHASES}
        per_sm["idle"] = float(np.mean([_idle(start[r[:, SM] == s], end[r[:, SM] == s])
                                        for s in sms]))
        out.append(dict(
            rank=int(rank), layer_us=float(end.max()), phases=phases,
            comm_hidden=ratio(overlap_length(comm, gemm), _length(comm)),
            l1_during_dispatch=ratio(before, _length(l1)),
            l2_during_l1=ratio(overlap_length(unions["L2"], l1), _length(unions["L2"])),
            l2_waiting=ratio(_l2_waiting(r, start, end), phases["L2"]["sm_us"]),
            sms=len(sms), per_sm_us=per_sm, timed=bool(end.max() > 0)))
    return out


def _idle(start: np.ndarray, end: np.ndarray) -> float:
    """µs between the first start and the last end of one SM's tasks that no task covers."""
    return float(end.max() - start.min()) - _length(intervals_union(np.stack([start, end], 1)))


def _l2_waiting(r: np.ndarray, start: np.ndarray, end: np.ndarray) -> float:
    """µs the L2 rows of one rank's trace ``r`` spent before the last L1 row of their m-block
    (column B) ended."""
    l1 = r[:, PHASE] == 1
    last = {}
    for mb, e in zip(r[l1, B].tolist(), end[l1].tolist()):
        last[mb] = max(last.get(mb, e), e)
    l2 = np.flatnonzero(r[:, PHASE] == 2)
    return float(sum(min(max(last.get(int(r[i, B]), start[i]) - start[i], 0.0),
                         end[i] - start[i]) for i in l2))


def plot_timeline(rows: np.ndarray, path: str, *, title: str = "fused kernel timeline") -> None:
    """PNG: per rank, each task as a bar on its SM's row coloured by phase, and below it the
    share of each phase's tasks finished over time (where the phases overlap)."""
    from .terminal import require
    matplotlib = require("matplotlib", extra="plot", why="the timeline PNG")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = np.unique(rows[:, RANK])
    fig, axes = plt.subplots(2, len(ranks), figsize=(7 * len(ranks), 8), squeeze=False,
                             gridspec_kw=dict(height_ratios=[3, 1]))
    for col, rank in enumerate(ranks):
        r = rows[rows[:, RANK] == rank]
        t0 = r[:, START].min()
        start = (r[:, START] - t0) / 1e3
        dur = np.maximum((r[:, END] - r[:, START]) / 1e3, 1e-3)
        ax, ax2 = axes[0, col], axes[1, col]
        for p, name in enumerate(PHASES):
            m = r[:, PHASE] == p
            if not m.any():
                continue
            for sm in np.unique(r[m, SM]):
                k = m & (r[:, SM] == sm)
                ax.broken_barh(list(zip(start[k], dur[k])), (sm - 0.4, 0.8),
                               facecolors=COLORS[p], linewidth=0)
            done = np.sort(start[m] + dur[m])
            ax2.plot(done, np.arange(1, len(done) + 1) / len(done), color=COLORS[p], label=name)
        ax.set_title(f"rank {rank}")
        ax.set_ylabel("SM")
        ax2.set_xlabel("µs since the rank's first task")
        ax2.set_ylabel("tasks done")
        ax2.set_ylim(0, 1.02)
        span = (0.0, float((start + dur).max()) * 1.01)
        ax.set_xlim(span)
        ax2.set_xlim(span)
    axes[0, 0].legend(handles=[Patch(color=c, label=n) for c, n in zip(COLORS, PHASES)],
                      loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
