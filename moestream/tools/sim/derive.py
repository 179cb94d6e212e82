"""Derive the fused-kernel calibration (``fused_kernel`` of the calibration JSON) from
measurements: kernel traces of the fused launch, a ``moestream probe`` file, the standalone
GEMM sweep and (for the per-call fixed cost only) the 1-token rows of ``moestream bench``.

    python -m moestream.tools.sim.derive \\
        --trace tests/data/trace_qwen3_8192_token.json.gz \\
        --trace tests/data/trace_qwen3_8192_128.json.gz \\
        --probe tests/data/calib_probe_quick.json \\
        --gemm-sweep tests/data/gemm_sweep_h200.jsonl \\
        --fixed-rows tests/data/ep_final.jsonl \\
        --out moestream/tools/sim/data/calib_h200x2_fused.json

A trace file (``moestream trace``) is gzip JSON with ``shape``, ``tokens_per_rank``,
``granularity`` and ``rows``: int64 [tickets, 8] = phase (0 dispatch, 1 L1, 2 L2, 3 combine),
rank, a, b, c, SM, start ns, end ns; a ticket's start is taken before it waits for its inputs,
its end after its work. What each figure is (docs/simulator.md, "The fused-kernel model"):

- ``ticket_overhead_us``: median gap between consecutive tickets of one SM.
- ``launch_early_claims``: median over traced ranks of the first-P tickets that were a
  program's second ticket (the launch race of the claim-ahead loop).
- ``dispatch_programs_per_sm``: a token-mode trace's ``R * T / DT`` (DT: its dispatch task
  size) over its programs: which ``Fused.dispatch_programs`` the traced kernel ran.
- L1 / L2 block time: median duration of the blocks that did not wait (L1 blocks that began
  after the rank's last dispatch task ended; L2 blocks that began after their m-block's L1
  blocks ended). Split into a fixed part and a FLOP part with the K dependence of the
  standalone kernel of the same tile (``--gemm-sweep``: per-block time of the sweep's
  provider at the largest rows per expert, a line in K over the shapes; a negative intercept
  counts as 0); without a sweep the whole time scales with FLOPs.
- dispatch: per-token time of the tasks from the rank's own tokens and from the peer's
  (median over tasks). A token with a pick on the rank is read once and written to each of its
  pool rows; with uniform routing a token has ``K * E_loc / E`` rows on a rank and a pick
  there with probability ``1 - C(E - E_loc, K) / C(E, K)``. Local tasks give one rate for
  bytes read + written; a remote task's writes go at that rate, the rest of its time is the
  read from the peer.
- combine: median duration of the combine tasks that began after the rank's last L2 block,
  over ``CT * (K + 1) * token_bytes`` (K rows read, one written, per token).
- ``call_fixed_us.graph`` (only with ``--fixed-rows``): median over the 1-token rows of the
  graph-replayed fused providers (fused-graph, chunk<C>) of measured minus the model's kernel
  time. Those rows are calibration points, not validation rows.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...config import SHAPES, MoEConfig
from .calib import Calibration, FusedKernelCalib
from .fused import COMBINE_TILE

__all__ = ["load_trace", "analyse_trace", "block_k_line", "derive_fused", "fixed_cost",
           "FIXED_FAMILY_PROVIDERS", "main"]

PHASE, RANK, A, B, C, SM, START, END = range(8)
L1_SWEEP_PROVIDER = "ours:layer-default"   # tuning.gpu_defaults' L1 tile: 128 x 128, BK 64, 8 warps
L2_SWEEP_PROVIDER = "ours:l2n128w8s3"      # the fused L2 tile: 128 x 128, BK 64, 8 warps
# providers whose calls are CUDA-graph replays of publish, signal, layout and the fused launch
FIXED_FAMILY_PROVIDERS = ("fused-graph", "chunk", "chunked-", "fused-chunk")


def load_trace(path: str | Path) -> dict[str, Any]:
    """A trace file: dict with shape, tokens_per_rank, granularity, rows (int64 [n, 8])."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file {str(p)!r} does not exist")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        d = json.load(f)
    for key in ("shape", "tokens_per_rank", "rows"):
        if key not in d:
            raise ValueError(f"trace file {str(p)!r} has no {key!r}")
    rows = np.asarray(d["rows"], dtype=np.int64)
    if rows.ndim != 2 or rows.shape[1] != 8:
        raise ValueError(f"trace file {str(p)!r}: rows must be [tickets, 8], got {rows.shape}")
    return {"shape": d["shape"], "tokens_per_rank": int(d["tokens_per_rank"]),
            "granularity": d.get("granularity", "token"), "rows": rows, "path": str(p)}


def _median_gap(x: np.ndarray) -> float:
    gaps = []
    for sm in np.unique(x[:, SM]):
        y = x[x[:, SM] == sm]
        y = y[np.argsort(y[:, START], kind="stable")]
        gaps.append((y[1:, START] - y[:-1, END]) / 1e3)
    g = np.concatenate(gaps) if gaps else np.zeros(0)
    return float(np.median(g)) if g.size else 0.0


def _early_claims(x: np.ndarray) -> int:
    """Tickets among the first P (P = SMs seen) that were some program's second ticket."""
    first = []
    for sm in np.unique(x[:, SM]):
        idx = np.flatnonzero(x[:, SM] == sm)
        first.append(idx[np.argmin(x[idx, START])])
    P = len(first)
    return int(P - np.count_nonzero(np.asarray(first) < P))


def analyse_trace(trace: dict[str, Any], *, ranks: int | None = None) -> list[dict[str, Any]]:
    """Per traced rank: task times of the fused kernel (µs) and the tile sizes seen."""
    cfg = MoEConfig.from_shape(trace["shape"], max_tokens_per_rank=trace["tokens_per_rank"])
    rows = trace["rows"]
    R = ranks or int(len(np.unique(rows[:, RANK])))
    T = trace["tokens_per_rank"]
    out = []
    for rank in np.unique(rows[:, RANK]):
        x = rows[rows[:, RANK] == rank]            # ticket order (the trace is indexed by ticket)
        dur = (x[:, END] - x[:, START]) / 1e3
        ph = x[:, PHASE]
        disp_end = x[ph == 0, END].max()
        l1 = ph == 1
        l2 = ph == 2
        key = x[:, A] * (1 << 32) + x[:, B]
        l1_done: dict[int, int] = {}
        for k, e in zip(key[l1].tolist(), x[l1, END].tolist()):
            l1_done[k] = max(l1_done.get(k, 0), e)
        l2_free = np.array([s >= l1_done.get(k, 0) for k, s in
                            zip(key[l2].tolist(), x[l2, START].tolist())], dtype=bool)
        comb_free = (ph == 3) & (x[:, START] >= x[l2, END].max())
        nb1 = int(len(np.unique(x[l1, C])))
        nb2 = int(len(np.unique(x[l2, C])))
        d = ph == 0
        # tokens per dispatch task: from the task's first token to the next task's (same source)
        src, t0 = x[d, A], x[d, B]
        ntok = np.empty(src.size, dtype=np.int64)
        for s in np.unique(src):
            i = np.flatnonzero(src == s)
            o = i[np.argsort(t0[i])]
            ntok[o] = np.diff(np.r_[t0[o], T])
        per_tok = dur[d] / ntok
        local = src == rank
        out.append({
            "trace": trace.get("path", ""), "shape": trace["shape"], "tokens_per_rank": T,
            "granularity": trace["granularity"], "rank": int(rank), "ranks": R,
            "programs": int(len(np.unique(x[:, SM]))),
            "ticket_gap_us": _median_gap(x), "early_claims": _early_claims(x),
            "l1_us": float(np.median(dur[l1 & (x[:, START] >= disp_end)])),
            "l1_samples": int((l1 & (x[:, START] >= disp_end)).sum()),
            "l2_us": float(np.median(dur[l2][l2_free])), "l2_samples": int(l2_free.sum()),
            "combine_us": float(np.median(dur[comb_free])), "combine_samples": int(comb_free.sum()),
            "l1_block_n": cfg.intermediate // nb1, "l2_block_n": cfg.hidden // nb2,
            "dispatch_tokens": int(ntok.max()) if ntok.size else 0,
            "dispatch_local_us_per_token": per_tok[local].tolist(),
            "dispatch_remote_us_per_token": per_tok[~local].tolist(),
        })
    return out


def block_k_line(sweep_rows: Sequence[dict[str, Any]], *, kernel: str, provider: str,
                 num_sms: int, block_m: int = 128, block_n: int = 128) -> dict[str, Any]:
    """Per-block time of a standalone GEMM provider against its reduction length K.

    Per shape, the rows at the largest rows per expert; a block's time is the call's time times
    the SMs over the blocks (BM x block_n tiles). Returns the least-squares line
    ``t = fixed + slope * K`` (fixed clipped at 0) and the points."""
    pts = {}
    for r in sweep_rows:
        if r.get("kernel") != kernel or r.get("provider") != provider \
                or r.get("shape") not in SHAPES:
            continue
        s = SHAPES[r["shape"]]
        H, I = s["hidden"], s["intermediate"]
        m, E = int(r["tokens_per_expert"]), int(r["experts"])
        n_out, k = (I, H) if kernel == "l1" else (H, I)
        blocks = E * -(-m // block_m) * (n_out // block_n)
        t = float(r["median_us"]) * num_sms / blocks
        if r["shape"] not in pts or m > pts[r["shape"]][0]:
            pts[r["shape"]] = (m, k, [t])
        elif m == pts[r["shape"]][0]:
            pts[r["shape"]][2].append(t)
    if len({k for _, k, _ in pts.values()}) < 2:
        raise ValueError(f"the GEMM sweep has no {kernel} rows of provider {provider!r} at two "
                         f"reduction lengths")
    ks = np.array([k for _, k, _ in pts.values()], dtype=np.float64)
    ts = np.array([statistics.median(t) for _, _, t in pts.values()])
    slope, fixed = np.polyfit(ks, ts, 1)
    return {"provider": provider, "kernel": kernel, "fixed_us": max(0.0, float(fixed)),
            "fitted_intercept_us": float(fixed), "us_per_k": float(slope),
            "points": {sh: {"rows_per_expert": m, "K": k, "us_per_block": statistics.median(t)}
                       for sh, (m, k, t) in pts.items()}}


def _pick_probability(E: int, E_loc: int, K: int) -> float:
    """P(a token with K distinct uniform picks has at least one of E_loc given experts)."""
    return 1.0 - math.comb(E - E_loc, K) / math.comb(E, K) if E - E_loc >= K else 1.0


def derive_fused(traces: Sequence[dict[str, Any]], *, calib: Calibration,
                 gemm_sweep: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``fused_kernel`` section (without the fixed cost) and how each figure came about."""
    if not traces:
        raise ValueError("at least one trace is needed")
    per_rank = [r for t in traces for r in analyse_trace(t)]
    shapes = {r["shape"] for r in per_rank}
    if len(shapes) != 1:
        raise ValueError(f"traces of one shape are expected (the block times are per shape), "
                         f"got {sorted(shapes)}")
    shape = shapes.pop()
    T = per_rank[0]["tokens_per_rank"]
    R = per_rank[0]["ranks"]
    cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=T)
    H, I, K, E, BM = cfg.hidden, cfg.intermediate, cfg.top_k, cfg.num_experts, cfg.block_m
    E_loc = E // R
    tb = H * cfg.bytes_per_element
    bn1 = per_rank[0]["l1_block_n"]
    bn2 = per_rank[0]["l2_block_n"]
    med = lambda key: float(statistics.median(r[key] for r in per_rank))  # noqa: E731
    t1, t2, tc = med("l1_us"), med("l2_us"), med("combine_us")
    notes: dict[str, Any] = {}

    # GEMM blocks: fixed part from the standalone kernel's K dependence, if given
    f1 = f2 = 0.0
    if gemm_sweep:
        line1 = block_k_line(gemm_sweep, kernel="l1", provider=L1_SWEEP_PROVIDER,
                             num_sms=calib.num_sms, block_m=BM, block_n=bn1)
        line2 = block_k_line(gemm_sweep, kernel="l2", provider=L2_SWEEP_PROVIDER,
                             num_sms=calib.num_sms, block_m=BM, block_n=bn2)
        f1 = line1["fixed_us"] / (line1["fixed_us"] + line1["us_per_k"] * H)
        f2 = line2["fixed_us"] / (line2["fixed_us"] + line2["us_per_k"] * I)
        notes["l1_standalone_line"] = line1
        notes["l2_standalone_line"] = line2
    flops1 = 2.0 * BM * 2 * bn1 * H
    flops2 = 2.0 * BM * bn2 * I
    l1_fixed, l2_fixed = f1 * t1, f2 * t2
    l1_rate = flops1 / ((1 - f1) * t1) / 1e6
    l2_rate = flops2 / ((1 - f2) * t2) / 1e6

    # dispatch
    rows_per_tok = K * E_loc / E
    p_has = _pick_probability(E, E_loc, K)
    loc = statistics.median(v for r in per_rank for v in r["dispatch_local_us_per_token"])
    rem = statistics.median(v for r in per_rank for v in r["dispatch_remote_us_per_token"])
    r_local = tb * (p_has + rows_per_tok) / loc / 1e3
    write = tb * rows_per_tok / (r_local * 1e3)
    if rem <= write:
        raise ValueError(f"remote dispatch tasks ({rem:.3f} us per token) are not slower than "
                         f"their pool writes alone ({write:.3f}); cannot split the read")
    r_remote = tb * p_has / (rem - write) / 1e3
    r_comb = tb * COMBINE_TILE * (K + 1) / tc / 1e3

    fk = {
        "l1_tflops_per_sm": l1_rate, "l1_fixed_us": l1_fixed,
        "l2_tflops_per_sm": l2_rate, "l2_fixed_us": l2_fixed,
        "dispatch_local_gbps": r_local, "dispatch_remote_read_gbps": r_remote,
        "combine_gbps": r_comb, "ticket_overhead_us": med("ticket_gap_us"),
        "launch_early_claims": int(round(statistics.median(r["early_claims"] for r in per_rank))),
        "dispatch_programs_per_sm": _dispatch_programs_per_sm(per_rank),
        "call_fixed_us": {},
    }
    notes.update({
        "shape": shape, "tokens_per_rank": T, "ranks": R,
        "traces": sorted({r["trace"] for r in per_rank}),
        "per_rank": [{k: v for k, v in r.items() if not k.startswith("dispatch_")}
                     for r in per_rank],
        "l1_block_us": t1, "l2_block_us": t2, "combine_task_us": tc,
        "l1_block": f"{BM} x (2 x {bn1}) x K={H}: {flops1 / 1e6:.1f} MFLOP",
        "l2_block": f"{BM} x {bn2} x K={I}: {flops2 / 1e6:.1f} MFLOP",
        "l1_fixed_fraction": f1, "l2_fixed_fraction": f2,
        "dispatch_local_us_per_token": loc, "dispatch_remote_us_per_token": rem,
        "rows_per_token": rows_per_tok, "pick_probability": p_has,
        "dispatch_remote_write_us_per_token": write,
        "probe_by_programs_peer_gbps_per_program": _probe_per_program(calib),
        "weight_gbps_per_sm": calib.hbm_copy_tbps * 1e3 / calib.num_sms,
    })
    fk["derivation"] = notes
    return fk


def _dispatch_programs_per_sm(per_rank: Sequence[dict[str, Any]]) -> float:
    """Token mode's dispatch programs over the SMs, from a token-mode trace: its tasks of DT
    tokens cover R * T tokens, so dispatch_programs ~ R * T / DT (0.5 if no token trace)."""
    vals = [round(r["ranks"] * r["tokens_per_rank"] / r["dispatch_tokens"]) / r["programs"]
            for r in per_rank if r["granularity"] == "token" and r["dispatch_tokens"] > 1]
    return float(statistics.median(vals)) if vals else 0.5


def _probe_per_program(calib: Calibration) -> dict[str, float] | None:
    """The probe's persistent-grid peer pull, per program (a cross-check of the dispatch read
    rate; only in probe files that recorded it)."""
    path = calib.path
    try:
        d = json.loads(Path(path).read_text()) if path else {}
    except (OSError, json.JSONDecodeError):
        return None
    bp = d.get("device_pull", {}).get("by_programs")
    if not bp:
        return None
    return {str(p): g / p for p, g in zip(bp["programs"], bp["gbps"])}


def _fixed_family(provider: str) -> bool:
    return provider == "fused-graph" or any(
        provider.startswith(p) for p in FIXED_FAMILY_PROVIDERS[1:])


def fixed_cost(calib: Calibration, rows: Sequence[dict[str, Any]], *,
               tokens: int = 1) -> dict[str, Any]:
    """``call_fixed_us["graph"]``: median over the ``tokens``-token rows of the graph-replayed
    fused providers of measured minus the fused model's kernel time (no fixed cost)."""
    from .model import simulate
    from .validate import provider_model, skip_reason

    used = []
    for r in rows:
        if skip_reason(r) is not None or not _fixed_family(r["provider"]) \
                or int(r["tokens_per_rank"]) != tokens \
                or (r.get("routing") or "uniform") != "uniform":
            continue
        cfg = MoEConfig.from_shape(r["shape"], max_tokens_per_rank=tokens)
        g = provider_model(r["provider"]).granularity
        g = cfg.block_m if g == "block_m" else g
        res = simulate(shape=r["shape"], ranks=int(r["ranks"]), tokens_per_rank=tokens,
                       granularity=g, calib=calib, execution="fused", family="none")
        used.append({"shape": r["shape"], "ranks": int(r["ranks"]), "provider": r["provider"],
                     "measured_us": float(r["median_us"]), "kernel_us": res.kernel_us,
                     "residual_us": float(r["median_us"]) - res.kernel_us})
    if not used:
        raise ValueError(f"no {tokens}-token row of a graph-replayed fused provider to "
                         f"calibrate the per-call fixed cost")
    return {"graph": float(statistics.median(u["residual_us"] for u in used)), "rows": used}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moestream.tools.sim.derive",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", required=True, help="trace .json.gz (repeat)")
    p.add_argument("--probe", required=True, help="calibration JSON (moestream probe)")
    p.add_argument("--gemm-sweep", default=None,
                   help="standalone GEMM sweep JSON lines (fixed part of a block's time)")
    p.add_argument("--fixed-rows", default=None,
                   help="bench rows: the 1-token graph-replayed fused rows give the fixed cost")
    p.add_argument("--out", default=None, help="write probe + fused_kernel JSON here")
    args = p.parse_args(argv)
    try:
        calib = Calibration.load(args.probe)
        traces = [load_trace(t) for t in args.trace]
        sweep = None
        if args.gemm_sweep:
            from .validate import load_rows
            sweep = load_rows(args.gemm_sweep)
        fk = derive_fused(traces, calib=calib, gemm_sweep=sweep)
        if args.fixed_rows:
            from .validate import load_rows
            cal0 = replace(calib, fused=FusedKernelCalib.from_dict(fk))
            fc = fixed_cost(cal0, load_rows(args.fixed_rows))
            fk["call_fixed_us"] = {"graph": fc["graph"]}
            fk["calibration_points"] = [
                {"shape": u["shape"], "ranks": u["ranks"], "tokens_per_rank": 1,
                 "provider": u["provider"]} for u in fc["rows"]]
            fk["derivation"]["call_fixed_rows"] = fc["rows"]
            fk["derivation"]["call_fixed_source"] = str(args.fixed_rows)
        fk["source"] = ("python -m moestream.tools.sim.derive " + " ".join(
            sys.argv[1:] if argv is None else list(argv)))
        FusedKernelCalib.from_dict(fk)   # the result must load
    except ValueError as exc:
        print(f"derive: error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in fk.items() if k != "derivation"}
    print(json.dumps(summary, indent=1))
    if args.out:
        base = json.loads(Path(args.probe).read_text())
        base["fused_kernel"] = fk
        base["source"] = f"{base.get('source', '')}; fused_kernel: {fk['source']}"
        Path(args.out).write_text(json.dumps(base, indent=1) + "\n")
        print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
