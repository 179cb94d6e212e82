"""The simulator against measurements: predict every measured layer call and compare.

``validate(rows)`` takes result rows as ``moestream bench`` writes them (JSON lines, one per
(provider, shape, ranks, tokens per rank); see ``moestream.tools.bench``), simulates each
(shape, ranks, tokens_per_rank, routing) with the streaming mode its provider runs, and returns
one row per measured row with the measured and predicted time.

Which provider is which model (``provider_model``; extend with ``register_provider``, undo
with ``unregister_provider``):

==============================  ==================  ============================================
provider name                   granularity         flag
==============================  ==================  ============================================
``fused-graph``                 token               (what the model describes)
``fused``                       token               flagged: not a graph replay
``chunk<C>``                    C tokens            (``moestream bench``'s chunked fused launch)
``chunked-<C>``,                C tokens            (the benchmarks' name, and aliases)
``fused-chunk<C>``
``chunkexpert``, ...            whole expert        (``chunked-expert``, ``fused-chunk-expert``)
``chunkblock_m``, ...           the shape's block_m
``staged``, ``staged-graph``    token               flagged: one launch per stage; the model is
                                                    one persistent launch
``torch``, ``torch-symm``, ...  not modelled        skipped (``skip_reason``)
==============================  ==================  ============================================

Which model predicts a row (``execution``): ``"auto"`` (default) runs the fused-kernel model
(``moestream.tools.sim.fused``: the project's fused launch as built, task rates from kernel traces,
plus the calibrated per-call fixed cost of CUDA-graph replays) for the fused and chunked
providers, and the stream model (``moestream.tools.sim.model``: dedicated comm SMs, standalone
grouped-GEMM rates, no fixed cost) for the staged ones; ``"stream"`` or ``"fused"`` force one
model for every row. Rows the fixed cost was calibrated on (the calibration's
``fused_kernel.calibration_points``) are marked ``calibration_point`` and left out of the
counts of ``summarize``.

Every comparison uses the calibration given (default: the packaged 2x H200 one), the fabric
``link`` (default ``nvlink``: device-initiated pulls) and, for the stream model, ``comm_sms``
and the GEMM curve ``gemm`` (default ``triton``, the project's kernel); see
docs/simulator.md "Validation".
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ...config import SHAPES, MoEConfig
from .calib import Calibration
from .plan import Granularity, granularity_label, parse_granularity

__all__ = ["validate", "summarize", "provider_model", "register_provider",
           "unregister_provider", "skip_reason", "load_rows", "ProviderModel", "TOLERANCE",
           "validation_table", "EXECUTIONS"]

TOLERANCE = 0.2   # "within 20%": |predicted / measured - 1| <= TOLERANCE

STAGED_FLAG = ("staged: one launch per stage (publish, signal, layout, dispatch, L1, L2, "
               "combine), stages do not overlap; the model is one persistent launch")


@dataclass(frozen=True)
class ProviderModel:
    """How the simulator models a provider.

    granularity: ``"token"``, a chunk size C (tokens per message), ``"expert"``, or
        ``"block_m"`` (the shape's block_m).
    flag: empty when the model describes the provider; else why the comparison is
        approximate (shown next to its rows).
    """

    granularity: Granularity | str
    flag: str = ""
    execution: str = "fused"      # the model "auto" picks: "fused" or "stream"
    graph: bool = True            # calls are CUDA-graph replays (the calibrated fixed cost)


NOT_GRAPH_FLAG = ("not a CUDA-graph replay: the host's launch work is not in the calibrated "
                  "per-call fixed cost")

_EXACT: dict[str, ProviderModel] = {
    "fused": ProviderModel("token", NOT_GRAPH_FLAG, graph=False),
    "fused-graph": ProviderModel("token"),
    "staged": ProviderModel("token", STAGED_FLAG, execution="stream", graph=False),
    "staged-graph": ProviderModel("token", STAGED_FLAG, execution="stream"),
}
_CHUNKED = re.compile(r"^(?:chunk|chunked-|fused-chunk-?)(?P<c>\d+|expert|block_m)$")
_NOT_MODELLED = ("torch", "torch-symm")


def register_provider(name: str, *, granularity: Granularity | str, flag: str = "",
                      execution: str = "fused", graph: bool = True) -> None:
    """Model the provider ``name`` (an exact name) at ``granularity``, with a ``flag`` if the
    model describes it only approximately; ``execution``: the model ``"auto"`` picks for it
    (``"fused"`` or ``"stream"``); ``graph``: its calls are CUDA-graph replays. Replaces an
    earlier registration of the name."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"provider name must be a non-empty str, got {name!r}")
    if granularity != "block_m":
        granularity = parse_granularity(granularity)
    if execution not in ("fused", "stream"):
        raise ValueError(f"execution must be 'fused' or 'stream', got {execution!r}")
    _EXACT[name] = ProviderModel(granularity, str(flag), execution, bool(graph))


def unregister_provider(name: str) -> None:
    """Forget the model of the exact provider name ``name`` (ValueError if it has none)."""
    if _EXACT.pop(name, None) is None:
        raise ValueError(f"no provider model is registered under the name {name!r}")


def provider_model(provider: str) -> ProviderModel | None:
    """The model of a benchmark provider name, or None if the simulator does not model it (the
    torch baselines, unknown names)."""
    if not isinstance(provider, str):
        return None
    if provider in _EXACT:
        return _EXACT[provider]
    m = _CHUNKED.match(provider)
    if m:
        c = m.group("c")
        if c in ("expert", "block_m"):
            return ProviderModel(c)
        return ProviderModel(int(c)) if int(c) > 0 else None
    return None


def _resolve_granularity(g: Granularity | str, cfg: MoEConfig) -> Granularity:
    return cfg.block_m if g == "block_m" else parse_granularity(g)


_REQUIRED = ("shape", "ranks", "tokens_per_rank", "provider", "median_us")


def _check_row(i: int, row: Any) -> None:
    if not isinstance(row, Mapping):
        raise ValueError(f"row {i} must be a dict (a JSON object), got {type(row).__name__}")
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise ValueError(f"row {i} ({row.get('provider', '?')}) is missing {missing}; rows "
                         f"need {list(_REQUIRED)} (moestream bench writes them)")


def skip_reason(row: Mapping[str, Any]) -> str | None:
    """Why ``validate`` leaves this row out (None: it is compared)."""
    prov = row.get("provider")
    if provider_model(prov) is None:
        what = "a baseline" if prov in _NOT_MODELLED or str(prov).startswith("torch") \
            else "an unknown provider"
        return f"provider {prov!r} is not modelled ({what})"
    if row.get("shape") not in SHAPES:
        return f"shape {row.get('shape')!r} is not one of {sorted(SHAPES)}"
    R, T = row.get("ranks"), row.get("tokens_per_rank")
    if isinstance(R, bool) or not isinstance(R, int) or R < 1:
        return f"ranks {R!r} is not a positive int"
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        return f"tokens_per_rank {T!r} is not a positive int"
    if SHAPES[row["shape"]]["num_experts"] % R:
        return (f"{row['shape']} has {SHAPES[row['shape']]['num_experts']} experts, not "
                f"divisible by {R} ranks")
    med = row.get("median_us")
    if isinstance(med, bool) or not isinstance(med, (int, float)) or not med > 0 \
            or not math.isfinite(med):
        return f"median_us {med!r} is not a positive number"
    return None


def load_rows(paths: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """Rows of one or more JSON-lines files (blank lines skipped), each tagged with
    ``_source`` (the file name). ValueError names a missing file or a bad line."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    rows: list[dict[str, Any]] = []
    for p in map(Path, paths):
        if not p.is_file():
            raise ValueError(f"rows file {str(p)!r} does not exist")
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{n} is not valid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{n} is not a JSON object")
            rows.append({**row, "_source": p.name})
    return rows


EXECUTIONS = ("auto", "stream", "fused")


def validate(rows: Iterable[Mapping[str, Any]], *, calib: Calibration | str | Path | None = None,
             link: str = "nvlink", comm_sms: int = 16, gemm: str = "triton", seed: int = 0,
             dispatch_order: str = "pool", skew: float = 0.3,
             execution: str = "auto") -> list[dict[str, Any]]:
    """Simulate every modelled row and compare it with its measured median.

    Args:
        rows: benchmark rows (dicts with shape, ranks, tokens_per_rank, provider, median_us;
            optional routing ("uniform" / "skewed"), skew, dtype). Rows ``skip_reason``
            rejects (torch baselines, unknown shapes, ...) are left out.
        calib: a Calibration or the path of a calibration JSON (default: packaged 2x H200).
        link, comm_sms, gemm, seed, dispatch_order: as for ``moestream.tools.sim.simulate``.
        skew: the hot expert's share of picks for skewed rows that do not record theirs.
        execution: ``"auto"`` (fused-kernel model for fused / chunked providers, stream model
            for staged ones), ``"stream"`` or ``"fused"`` (one model for every row).

    Returns:
        One dict per compared row, in input order: shape, ranks, tokens_per_rank, provider,
        granularity (label), routing, dtype, measured_us (the row's median), predicted_us (the
        model's layer time), ratio (measured / predicted; > 1: the hardware is slower than the
        model), error (predicted / measured - 1), within_20pct (|error| <= 0.2),
        compute_floor_us and link_floor_us (the model's), flag ("" or why the comparison is
        approximate), source (``_source`` of the row, if any), execution ("stream" or
        "fused"), fixed_us (the per-call fixed cost in predicted_us), calibration_point (the
        fixed cost was calibrated on this row). Times in µs.

    Raises:
        ValueError: a row lacks a required key, or bad settings (as ``simulate`` raises them).
    """
    from .model import simulate

    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {list(EXECUTIONS)}, got {execution!r}")
    if not isinstance(calib, Calibration):
        calib = Calibration.load(calib)
    points: set = set()
    fixed_known: tuple = ()
    if execution != "stream":
        fk = calib.fused_kernel()
        points = set(fk.calibration_points)
        fixed_known = tuple(fk.call_fixed_us)
    cache: dict[tuple, Any] = {}
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        _check_row(i, row)
        if skip_reason(row) is not None:
            continue
        pm = provider_model(row["provider"])
        shape, R, T = row["shape"], int(row["ranks"]), int(row["tokens_per_rank"])
        cfg = MoEConfig.from_shape(shape, max_tokens_per_rank=T)
        g = _resolve_granularity(pm.granularity, cfg)
        flags = [pm.flag] if pm.flag else []
        routing = str(row.get("routing") or "uniform")
        row_skew = row.get("skew")
        if routing not in ("uniform", "skewed"):
            flags.append(f"routing {routing!r} not modelled: uniform assumed")
            routing = "uniform"
        if routing == "skewed":
            if isinstance(row_skew, (int, float)) and not isinstance(row_skew, bool) \
                    and 0 < row_skew <= 1:
                s = float(row_skew)
            else:
                s = skew
                flags.append(f"skew not recorded: {skew} assumed")
        else:
            s = skew
        dtype = str(row.get("dtype") or "bf16")
        if dtype != "bf16":
            flags.append(f"dtype {dtype}: the calibration's GEMM curves are bf16")
        ex = pm.execution if execution == "auto" else execution
        family = "none"
        if ex == "fused":
            if "graph" in fixed_known:
                family = "graph"
            else:
                flags.append("no per-call fixed cost in the calibration")
        key = (ex, family, shape, R, T, g, routing, s if routing == "skewed" else None)
        if key not in cache:
            kw = dict(execution="fused", family=family) if ex == "fused" else \
                dict(comm_sms=comm_sms, gemm=gemm, dispatch_order=dispatch_order)
            cache[key] = simulate(shape=shape, ranks=R, tokens_per_rank=T, link=link,
                                  granularity=g, calib=calib, routing=routing, skew=s,
                                  seed=seed, **kw)
        res = cache[key]
        measured = float(row["median_us"])
        predicted = float(res.layer_us)
        err = predicted / measured - 1.0
        out.append({
            "shape": shape, "ranks": R, "tokens_per_rank": T, "provider": row["provider"],
            "granularity": granularity_label(g), "routing": routing, "dtype": dtype,
            "measured_us": measured, "predicted_us": predicted,
            "ratio": measured / predicted if predicted > 0 else math.inf,
            "error": err, "within_20pct": abs(err) <= TOLERANCE,
            "compute_floor_us": float(res.compute_floor_us),
            "link_floor_us": float(res.link_floor_us),
            "flag": "; ".join(flags), "source": row.get("_source", ""),
            "execution": ex, "fixed_us": float(getattr(res, "fixed_us", 0.0)),
            "calibration_point": ex == "fused" and (shape, R, T, row["provider"]) in points,
        })
    return out


def summarize(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts of ``validate``'s rows: total and per provider, rows within 20%, the fraction
    within, and the median and range of measured / predicted. Calibration points are left out
    of every count (``calibration_points``: how many there were)."""
    n_cal = sum(bool(r.get("calibration_point")) for r in results)
    results = [r for r in results if not r.get("calibration_point")]
    def block(rs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        ratios = [r["ratio"] for r in rs]
        n_in = sum(bool(r["within_20pct"]) for r in rs)
        return {"rows": len(rs), "within_20pct": n_in,
                "fraction_within_20pct": n_in / len(rs) if rs else math.nan,
                "median_ratio": statistics.median(ratios) if ratios else math.nan,
                "min_ratio": min(ratios) if ratios else math.nan,
                "max_ratio": max(ratios) if ratios else math.nan}

    by_provider = {}
    for p in dict.fromkeys(r["provider"] for r in results):
        by_provider[p] = block([r for r in results if r["provider"] == p])
    return {**block(results), "by_provider": by_provider, "calibration_points": n_cal}


def validation_table(results: Sequence[Mapping[str, Any]], *, console, title: str = "") -> list[str]:
    """Print ``validate``'s rows as a table on ``console`` (split by columns where it is
    narrow); flagged rows carry a footnote mark (``[n]``) whose texts are returned."""
    from ..terminal import print_table

    sources = len({r.get("source", "") for r in results}) > 1
    cols = [("shape", "left"), ("R", "right"), ("T/rank", "right"), ("provider", "left"),
            ("gran.", "left"), ("model", "left"), ("measured µs", "right"),
            ("model µs", "right"), ("meas/model", "right"), ("within 20%", "center"),
            ("flag", "left")] + ([("rows file", "left")] if sources else [])
    notes: dict[str, int] = {}
    cells = []
    for r in results:
        mark = ""
        if r["flag"]:
            mark = f"[{notes.setdefault(r['flag'], len(notes) + 1)}]"
        if r.get("calibration_point"):
            within = "calib."
        else:
            within = "[green]yes[/]" if r["within_20pct"] else "[red]no[/]"
        cells.append([r["shape"], str(r["ranks"]), str(r["tokens_per_rank"]), r["provider"],
                      r["granularity"], r.get("execution", "stream"), f"{r['measured_us']:.1f}",
                      f"{r['predicted_us']:.1f}", f"{r['ratio']:.2f}", within,
                      mark, *([str(r.get("source", ""))] if sources else [])])
    print_table(console, title=title or "simulator vs measured", columns=cols, rows=cells,
                keys=(0, 1, 2, 3))
    return [f"[{n}] {text}" for text, n in notes.items()]
