"""``simulate`` and ``compare``: one MoE layer on R ranks, token vs chunk streaming.

The model in one paragraph (details in docs/simulator.md): after a count exchange (one flag
round trip), every rank pulls the picks of its experts from their source ranks over the
fabric's links, in pool order, one message per token or per chunk of C tokens. Its compute SMs
(all SMs but ``comm_sms``) run the L1 GEMM blocks (block_m rows x block_n columns, gate and up)
as soon as the block's rows (token and C) or its whole expert (``"expert"``) have arrived, and
each L2 block after all L1 n-blocks of its rows, taking tickets in the order of
``moestream.schedule``. A task's time on one SM is its FLOPs over 1/num_sms of the calibrated
grouped-GEMM rate at the expert's row count. Finished rows go back to their source in the same
messages, and each source reduces its tokens' top-k rows. The slowest rank sets the layer time.

``simulate(..., execution="fused")`` runs the fused-kernel model instead
(``moestream.tools.sim.fused``: the project's fused launch as built, no comm SMs, rates from
traces).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from ...config import SHAPES, MoEConfig
from .calib import Calibration
from .engine import Timeline, run_plan, union_length
from .gemm import schedule_gemm
from .links import CLASS_NAMES, LOCAL, Fabric, make_fabric
from .plan import (BLOCK_N, Granularity, Plan, build_plan, granularity_label, make_routing,
                   parse_granularity)

__all__ = ["simulate", "SimResult", "compare", "Comparison", "resolve_config", "EXECUTIONS"]

EXECUTIONS = ("stream", "fused")


@dataclass(frozen=True)
class SimResult:
    """What one simulated call did. Times in µs; per-rank arrays are [R].

    Attributes:
        layer_us: end of the slowest rank (the layer time).
        critical_rank: that rank; ``phases`` describes it: ``setup_us`` (count exchange),
            ``dispatch_us`` (its last pick arrived), ``gemm_start_us`` / ``gemm_end_us``,
            ``gemm_busy_us`` (time >= 1 compute SM was busy), ``comm_busy_us`` (time >= 1 of
            its link ports was busy), ``combine_us`` (its last top-k row came back),
            ``reduce_us`` (its top-k reduce work), ``layer_us``.
        compute_floor_us: the slowest rank's GEMM work over its compute SMs (perfect packing).
        link_floor_us: setup plus the busiest port's work (the BENCHMARKS-style link floor).
        link_util: per link class, link bytes / (R x bandwidth x layer time), per direction.
        link_busy: per link class, the share of the layer its ports were occupied (start-up
            costs and request windows included).
        overlap: share of the critical rank's link-busy time during which a GEMM ran
            (1.0 when it sent and received nothing over links).
        messages: remote dispatch messages, remote combine messages, local copies (totals).
        bytes_sent / bytes_received: link bytes per rank (dispatch + combine), counted at the
            sender's and at the receiver's side; ``traffic`` splits them by phase.
    """

    shape: str | None
    config: MoEConfig
    num_ranks: int
    tokens_per_rank: int
    granularity: Granularity
    link: str
    comm_sms: int
    compute_sms: int
    gemm: str
    routing: str
    layer_us: float
    critical_rank: int
    rank_end_us: np.ndarray
    phases: dict[str, float]
    compute_floor_us: float
    link_floor_us: float
    link_util: dict[str, float]
    link_busy: dict[str, float]
    overlap: float
    messages: dict[str, int]
    bytes_sent: np.ndarray
    bytes_received: np.ndarray
    bytes_by_class: dict[str, float]
    local_bytes: np.ndarray
    traffic: dict[str, np.ndarray] = field(repr=False)

    @property
    def label(self) -> str:
        return granularity_label(self.granularity)

    @property
    def messages_per_rank(self) -> float:
        """Remote dispatch messages a rank pulls, on average."""
        return self.messages["dispatch"] / self.num_ranks

    @property
    def link_util_max(self) -> float:
        """Utilisation of the busiest link class (0 when nothing crossed a link)."""
        return max(self.link_util.values(), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": self.shape, "config": self.config.to_dict(), "ranks": self.num_ranks,
            "tokens_per_rank": self.tokens_per_rank, "granularity": self.granularity,
            "link": self.link, "comm_sms": self.comm_sms, "compute_sms": self.compute_sms,
            "gemm": self.gemm, "routing": self.routing, "layer_us": self.layer_us,
            "critical_rank": self.critical_rank, "phases": self.phases,
            "compute_floor_us": self.compute_floor_us, "link_floor_us": self.link_floor_us,
            "link_util": self.link_util, "link_busy": self.link_busy, "overlap": self.overlap,
            "messages": self.messages, "messages_per_rank": self.messages_per_rank,
            "bytes_by_class": self.bytes_by_class,
            "rank_end_us": self.rank_end_us.tolist(),
            "bytes_sent": self.bytes_sent.tolist(), "bytes_received": self.bytes_received.tolist(),
        }


def resolve_config(*, shape: str | None, config: MoEConfig | None,
                   tokens_per_rank: int | None) -> tuple[MoEConfig, int]:
    """(config, tokens per rank) from exactly one of ``shape`` / ``config``."""
    if (shape is None) == (config is None):
        raise ValueError(f"give exactly one of shape= (one of {sorted(SHAPES)}) or config= "
                         f"(a MoEConfig)")
    if config is None:
        if tokens_per_rank is None:
            raise ValueError("tokens_per_rank is required with shape=")
        config = MoEConfig.from_shape(shape, max_tokens_per_rank=tokens_per_rank)
    elif not isinstance(config, MoEConfig):
        raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
    T = config.max_tokens_per_rank if tokens_per_rank is None else tokens_per_rank
    if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T <= 0:
        raise ValueError(f"tokens_per_rank must be a positive int, got {T!r}")
    return config, int(T)


def _routing_array(routing: str | np.ndarray, *, config: MoEConfig, ranks: int, tokens: int,
                   skew: float, seed: int) -> tuple[np.ndarray, str]:
    if isinstance(routing, str):
        return make_routing(ranks=ranks, tokens_per_rank=tokens, num_experts=config.num_experts,
                            top_k=config.top_k, kind=routing, skew=skew, seed=seed), routing
    arr = np.asarray(routing)
    if arr.ndim != 3 or arr.shape[:2] != (ranks, tokens):
        raise ValueError(f"routing array must be [ranks={ranks}, tokens_per_rank={tokens}, K], "
                         f"got shape {arr.shape}")
    return arr, "given"


def _fabric(link: str | Fabric, calib: Calibration, gpus_per_node: int) -> Fabric:
    if isinstance(link, Fabric):
        return link
    if not isinstance(link, str):
        raise ValueError(f"link must be a link kind name or a Fabric, got {type(link).__name__}")
    return make_fabric(link, calib=calib, gpus_per_node=gpus_per_node)


def simulate(*, shape: str | None = None, config: MoEConfig | None = None, ranks: int,
             tokens_per_rank: int | None = None, link: str | Fabric = "nvlink",
             granularity: Granularity | str = "token", comm_sms: int = 16,
             calib: Calibration | None = None, gemm: str = "triton",
             routing: str | np.ndarray = "uniform", skew: float = 0.3, seed: int = 0,
             dispatch_order: str = "pool", gpus_per_node: int = 8,
             execution: str = "stream", family: str = "graph",
             programs: int | None = None, block_n: int = BLOCK_N) -> SimResult:
    """Simulate one MoE layer call on ``ranks`` ranks.

    Args:
        shape / config: a benchmark shape name (``moestream.config.SHAPES``) or a MoEConfig
            (its block_m sets the GEMM blocks' rows).
        ranks: expert-parallel ranks R (num_experts must divide by it).
        tokens_per_rank: tokens T on every rank (default with config=: its max_tokens_per_rank).
        link: a kind of ``moestream.tools.sim.links.LINK_KINDS`` or a Fabric.
        granularity: ``"token"``, a chunk size C (tokens per message) or ``"expert"``.
        comm_sms: SMs reserved for transfers and the reduce; the rest run GEMMs.
        calib: rates (default: the packaged 2x H200 calibration).
        gemm: GEMM rate curve: ``"triton"``, ``"torch"`` (grouped GEMM) or ``"dense"``.
        routing: ``"uniform"``, ``"skewed"`` (hot expert 0) or an [R, T, K] array of expert ids.
        skew, seed: for generated routings.
        dispatch_order: ``"pool"`` (pull in pool order, expert by expert, as Mega MoE does) or
            ``"source"`` (source rank by source rank).
        gpus_per_node: NVLink domain size of the ``rdma`` fabric.
        execution: ``"stream"`` (this module's model: dedicated comm SMs, GEMMs at the
            grouped-GEMM curve) or ``"fused"`` (``moestream.tools.sim.fused``: the project's fused
            kernel as built; returns a :class:`~moestream.tools.sim.fused.FusedResult`, and
            ``comm_sms``, ``gemm`` and ``dispatch_order`` do not apply).
        family: fused execution only: the per-call fixed cost added (``"graph"``, ``"none"``).
        programs: fused execution only: programs per rank (default one per SM).
        block_n: stream execution: the GEMM blocks' output columns (``plan.build_plan``).
    """
    calib = Calibration.load() if calib is None else calib
    cfg, T = resolve_config(shape=shape, config=config, tokens_per_rank=tokens_per_rank)
    cfg.check_ranks(ranks)
    g = parse_granularity(granularity)
    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {list(EXECUTIONS)}, got {execution!r}")
    fabric = _fabric(link, calib, gpus_per_node)
    arr, routing_name = _routing_array(routing, config=cfg, ranks=ranks, tokens=T, skew=skew,
                                       seed=seed)
    if execution == "fused":
        from .fused import simulate_fused
        return simulate_fused(config=cfg, routing=arr, fabric=fabric, granularity=g,
                              calib=calib, family=family, programs=programs, shape=shape,
                              routing_name=routing_name)
    plan = build_plan(config=cfg, routing=arr, fabric=fabric, granularity=g, comm_sms=comm_sms,
                      calib=calib, gemm=gemm, dispatch_order=dispatch_order, block_n=block_n)
    tl, _ = run_plan(plan)
    return _result(plan, tl, shape=shape, routing=routing_name)


def _result(plan: Plan, tl: Timeline, *, shape: str | None, routing: str) -> SimResult:
    R = plan.num_ranks
    remote = plan.msg_cls != LOCAL
    layer = float(tl.rank_end.max())
    c = int(np.argmax(tl.rank_end))
    setup = plan.setup_us
    links = plan.fabric.links()
    classes = plan.fabric.classes_between(R)

    # ---- bytes, counted at both ends --------------------------------------------------------
    b = plan.msg_bytes.astype(np.float64)
    disp_sent = np.bincount(plan.msg_src[remote], weights=b[remote], minlength=R)
    arrived = remote & np.isfinite(tl.comb_arrival)
    comb_recv = np.bincount(plan.msg_src[arrived], weights=b[arrived], minlength=R)
    traffic = {"dispatch_sent": disp_sent, "dispatch_received": tl.recv_dispatch,
               "combine_sent": tl.sent_combine, "combine_received": comb_recv}
    local = ~remote
    local_bytes = np.bincount(plan.msg_dst[local], weights=b[local], minlength=R)
    bytes_by_class = {CLASS_NAMES[k]: 2.0 * float(b[plan.msg_cls == k].sum()) for k in classes}

    # ---- ports: load per direction ----------------------------------------------------------
    # incoming: own dispatch, then the combine coming back; outgoing: the reverse
    in_work = tl.din + np.bincount(plan.msg_src[remote] * 3 + plan.msg_cls[remote],
                                   weights=plan.msg_wire[remote], minlength=3 * R).reshape(R, 3)
    out_work = tl.dout + np.bincount(plan.msg_dst[remote] * 3 + plan.msg_cls[remote],
                                     weights=plan.msg_occupy[remote],
                                     minlength=3 * R).reshape(R, 3)
    link_floor = setup + float(max((max(in_work[:, k].max(), out_work[:, k].max())
                                    for k in classes), default=0.0))
    link_util, link_busy = {}, {}
    for k in classes:
        name = CLASS_NAMES[k]
        cap = R * links[k].gbps * 1e3 * layer
        link_util[name] = bytes_by_class[name] / cap if layer > 0 else 0.0
        link_busy[name] = (float(in_work[:, k].sum() + out_work[:, k].sum()) / (2 * R * layer)
                           if layer > 0 else 0.0)

    # ---- the critical rank: busy GEMM time, busy link time, their overlap ------------------
    gt = schedule_gemm(plan, tl.l1_ready, ranks=np.array([c]), record=True)
    g_st, g_en = gt.intervals
    starts, ends = [], []
    for k in classes:
        for blk in (tl.din[c, k], tl.dout[c, k]):
            if blk > 0:
                starts.append(np.array([setup]))
                ends.append(np.array([setup + blk]))
    into = remote & (plan.msg_src == c)
    fin = tl.comb_arrival[into] - plan.msg_latency[into]
    starts.append(fin - plan.msg_wire[into])
    ends.append(fin)
    outof = remote & (plan.msg_dst == c)
    starts.append(tl.comb_start[outof])
    ends.append(tl.comb_start[outof] + plan.msg_occupy[outof])
    c_st, c_en = np.concatenate(starts), np.concatenate(ends)
    comm_busy = union_length(c_st, c_en)
    gemm_busy = union_length(g_st, g_en)
    both = union_length(np.r_[c_st, g_st], np.r_[c_en, g_en])
    overlap = (comm_busy + gemm_busy - both) / comm_busy if comm_busy > 0 else 1.0

    mine = plan.msg_dst == c
    phases = {
        "setup_us": setup,
        "dispatch_us": float(tl.disp_arrival[mine].max()) if mine.any() else setup,
        "gemm_start_us": float(tl.gemm_first[c]) if np.isfinite(tl.gemm_first[c]) else math.nan,
        "gemm_end_us": float(tl.gemm_last[c]) if np.isfinite(tl.gemm_last[c]) else math.nan,
        "gemm_busy_us": gemm_busy,
        "comm_busy_us": comm_busy,
        "combine_us": float(tl.token_ready[c].max()),
        "reduce_us": float(plan.token_reduce_us[c].sum()),
        "layer_us": float(tl.rank_end[c]),
    }
    work = plan.gemm_work_us()
    return SimResult(
        shape=shape, config=plan.config, num_ranks=R, tokens_per_rank=plan.tokens_per_rank,
        granularity=plan.granularity, link=plan.fabric.name, comm_sms=plan.comm_sms,
        compute_sms=plan.compute_sms, gemm=plan.gemm, routing=routing, layer_us=layer,
        critical_rank=c, rank_end_us=tl.rank_end, phases=phases,
        compute_floor_us=float(work.max() / plan.compute_sms) if R else 0.0,
        link_floor_us=link_floor, link_util=link_util, link_busy=link_busy,
        overlap=float(min(1.0, max(0.0, overlap))),
        messages={"dispatch": int(remote.sum()), "combine": int(remote.sum()),
                  "local": int(local.sum())},
        bytes_sent=disp_sent + tl.sent_combine, bytes_received=tl.recv_dispatch + comb_recv,
        bytes_by_class=bytes_by_class, local_bytes=local_bytes, traffic=traffic)


# ---- token vs chunk ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """``simulate`` at several granularities on the same routing; ``results[0]`` is token."""

    results: tuple[SimResult, ...]

    @property
    def token(self) -> SimResult:
        return self.results[0]

    def rows(self) -> list[dict[str, Any]]:
        base = self.token.layer_us
        return [{"granularity": r.label, "messages_per_rank": r.messages_per_rank,
                 "layer_us": r.layer_us, "link_util": r.link_util_max, "overlap": r.overlap,
                 "vs_token": r.layer_us / base if base > 0 else math.nan,
                 "dispatch_us": r.phases["dispatch_us"], "gemm_busy_us": r.phases["gemm_busy_us"],
                 "compute_floor_us": r.compute_floor_us, "link_floor_us": r.link_floor_us}
                for r in self.results]

    def title(self) -> str:
        t = self.token
        if getattr(t, "execution", "stream") == "fused":
            return (f"{t.shape or 'custom'} EP{t.num_ranks}, {t.tokens_per_rank} tok/rank, "
                    f"{t.link}, {t.routing}, fused kernel ({t.tuning.programs} programs, "
                    f"fixed {t.fixed_us:.0f} us)")
        return (f"{t.shape or 'custom'} EP{t.num_ranks}, {t.tokens_per_rank} tok/rank, "
                f"{t.link}, {t.routing}, {t.comm_sms} comm SMs, GEMM {t.gemm}")

    def footer(self) -> str:
        t = self.token
        if getattr(t, "execution", "stream") == "fused":
            return (f"Model output (fused-kernel execution), not a measurement. msgs/rank = "
                    f"dispatch tasks per rank. Floors (token): task time over programs "
                    f"{t.compute_floor_us:.1f} us, link {t.link_floor_us:.1f} us; layer "
                    f"includes the per-call fixed cost {t.fixed_us:.1f} us. vs token = layer / "
                    f"token layer (> 1: slower than token).")
        return (f"Model output, not a measurement. Floors (token): compute "
                f"{t.compute_floor_us:.1f} us, link {t.link_floor_us:.1f} us. "
                f"vs token = layer / token layer (> 1: slower than token).")

    def to_table(self):
        """A ``rich.table.Table`` of the rows (print :meth:`footer` with it)."""
        from rich.table import Table

        table = Table(title=self.title())
        for col in ("granularity", "msgs/rank", "layer us", "link util", "overlap", "vs token"):
            table.add_column(col, justify="left" if col == "granularity" else "right")
        for row in self.rows():
            table.add_row(row["granularity"], f"{row['messages_per_rank']:.0f}",
                          f"{row['layer_us']:.1f}", f"{row['link_util']:.1%}",
                          f"{row['overlap']:.1%}", f"{row['vs_token']:.2f}x")
        return table

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title(), "rows": self.rows(),
                "results": [r.to_dict() for r in self.results]}

    def plot(self, path: str) -> None:
        """Save a bar chart of layer time vs granularity (PNG) to ``path``."""
        from ..terminal import require
        matplotlib = require("matplotlib", extra="plot", why="the simulator's PNG")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.rows()
        fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(rows), 4.0))
        xs = np.arange(len(rows))
        bars = ax.bar(xs, [r["layer_us"] for r in rows], color="#4C72B0")
        ax.axhline(self.token.compute_floor_us, color="#DD8452", ls="--", label="compute floor")
        ax.scatter(xs, [r["link_floor_us"] for r in rows], color="#55A868", marker="_", s=900,
                   linewidths=2, zorder=3, label="link floor")
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r['vs_token']:.2f}x\nutil {r['link_util']:.0%}\novl {r['overlap']:.0%}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [r["granularity"] for r in rows])
        heights = [r["layer_us"] for r in rows]
        if min(heights) > 0 and max(heights) / min(heights) > 10:
            ax.set_yscale("log")    # token vs chunk can differ by 100x on high start-up links
        ax.set_ylabel("layer time (us, model)")
        ax.set_title(self.title(), fontsize=9)
        ax.legend(fontsize=8, loc="best")
        ax.margins(y=0.25)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def compare(*, granularities: Sequence[Granularity | str] | None = None,
            shape: str | None = None, config: MoEConfig | None = None, ranks: int,
            tokens_per_rank: int | None = None, routing: str | np.ndarray = "uniform",
            skew: float = 0.3, seed: int = 0, calib: Calibration | None = None,
            **kwargs: Any) -> Comparison:
    """Token granularity first, then each chunking in ``granularities``, on one routing.

    ``granularities`` defaults to (block_m, 256, "expert"); "token" is always the first row.
    Other keyword arguments go to :func:`simulate`.
    """
    calib = Calibration.load() if calib is None else calib
    cfg, T = resolve_config(shape=shape, config=config, tokens_per_rank=tokens_per_rank)
    cfg.check_ranks(ranks)
    if granularities is None:
        granularities = (cfg.block_m, 256, "expert")
    gs = [parse_granularity(g) for g in granularities]
    gs = ["token"] + [g for g in dict.fromkeys(gs) if g != "token"]
    arr, name = _routing_array(routing, config=cfg, ranks=ranks, tokens=T, skew=skew, seed=seed)
    results = []
    for g in gs:
        r = simulate(shape=shape, config=cfg if shape is None else None, ranks=ranks,
                     tokens_per_rank=T, granularity=g, calib=calib, routing=arr, **kwargs)
        results.append(replace(r, routing=name))   # name the routing, not "given"
    return Comparison(tuple(results))
