"""The benchmark protocol as helpers: timing, floors, result rows, tables, plots.

Importing this module needs no GPU; only ``time_cuda`` touches CUDA, and only when it is
available. Benchmarks are scripts or CLI commands built on these helpers, never timed tests.

Floors (per rank, EP over R ranks, uniform routing), see ``floors``:
    compute = 6*T*K*H*I FLOP / dense rate
    weights = touched local experts * 3*H*I * bytes per weight / HBM read rate
    link    = remote (token, k) pairs * H * (dispatch + combine bytes per element) / peer rate
    floor   = max(compute, weights, link), efficiency = floor / measured time
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..config import SHAPES, MoEConfig

__all__ = ["DEFAULT_CALIB", "ROW_KEYS", "FLOOR_DTYPES", "WEIGHT_BYTES", "time_cuda", "slowest",
           "floors", "routing_floors", "expected_touched_experts", "result_row", "append_rows",
           "update_rows", "load_rows", "machine_label", "results_path", "print_table",
           "plot_rows"]

# Rates measured on a 2x H200 SXM (NV18) node; the floors' default calibration.
DEFAULT_CALIB: dict[str, float] = {
    "bf16_tflops": 728.0,    # dense bf16 8192^3 matmul
    "fp8_tflops": 1414.0,    # dense fp8 torch._scaled_mm
    "weights_tbps": 4.0,     # HBM read rate for expert weights (device copy, read + write)
    "link_gbps": 360.0,      # peer rate per direction over NVLink, large transfers
}

# Bytes per element: of a weight, of a dispatched activation, of a combined output row.
# fp8 (DeepSeek-V3 style) adds an fp32 scale per 128x128 weight block and per 128 activation
# channels; the combine stays bf16. fp4w: MXFP4 weights with the fp8 tokens.
_BYTES: dict[str, dict[str, float]] = {
    "bf16": dict(weight=2.0, dispatch=2.0, combine=2.0),
    "fp8": dict(weight=1.0 + 4.0 / (128 * 128), dispatch=1.0 + 4.0 / 128, combine=2.0),
    # fp4w: MXFP4 weights (half a byte + one E8M0 byte per 32), the fp8 tokens; fp8 rate
    "fp4w": dict(weight=0.5 + 1.0 / 32, dispatch=1.0 + 4.0 / 128, combine=2.0),
}
FLOOR_DTYPES = tuple(_BYTES)
# bytes per expert weight of each format (scales included)
WEIGHT_BYTES: dict[str, float] = {k: v["weight"] for k, v in _BYTES.items()}

# Keys every result row carries, in the order rows are written.
ROW_KEYS = ("gpu", "num_gpus", "torch", "triton", "commit", "date", "shape", "ranks",
            "tokens_per_rank", "dtype", "provider", "median_us", "p20_us", "p80_us",
            "tflops_per_gpu", "link_gbps", "floor_us", "efficiency")
_AUTO_KEYS = ("gpu", "torch", "triton", "commit", "date")
# What makes two rows the same measurement point (``update_rows`` keeps the newer one).
POINT_KEYS = ("shape", "experts", "ranks", "phase", "tokens_per_rank", "tokens_per_expert",
              "kernel", "dtype", "provider", "routing", "block_m", "tuning")
_REQUIRED_KEYS = ("shape", "ranks", "tokens_per_rank", "dtype", "provider", "median_us",
                  "p20_us", "p80_us")


# ---- timing ------------------------------------------------------------------------------

def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default), without numpy.
    pos = (len(sorted_vals) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


# GPU clock cycles of time_cuda's queue_ahead sleep: ~20 ms at Hopper's ~1.98 GHz, longer than
# the host needs to enqueue 20-100 launches
QUEUE_AHEAD_CYCLES = 40_000_000


def time_cuda(fn: Callable[..., Any], *, warmup: int = 5, reps: int = 20,
              rotate: list | None = None, queue_ahead: bool = False) -> dict[str, Any]:
    """Time ``fn`` per call: median and 20th/80th percentiles in microseconds.

    With CUDA, each call is bracketed by CUDA events on the current stream and the host
    synchronises once after the last call (so host-side launch gaps between calls are not
    hidden by a sync per call). Without CUDA, each call is timed with ``time.perf_counter``.

    Args:
        fn: called as ``fn()``, or ``fn(rotate[i % len(rotate)])`` for call i (warm-up
            included) when ``rotate`` is given, so inputs can rotate through more memory
            than the L2 cache holds.
        warmup: untimed calls first (>= 0).
        reps: timed calls (>= 1; the protocol uses >= 20).
        rotate: optional non-empty list of inputs.
        queue_ahead: (CUDA) hold the stream in a ~20 ms sleep kernel while the host enqueues
            the timed calls, so each call starts when the previous one ends and its events
            measure GPU time only; without it a call shorter than its host launch work (tens
            of µs of Python per launch) is timed with the host's gap. Kernel benchmarks use
            it; end-to-end ones leave it off, since users pay the host time.

    Returns:
        dict with median_us, p20_us, p80_us, reps, clock ("cuda_events" or "perf_counter"),
        host_us (the host's mean time per timed call: with CUDA, what enqueuing a call with
        its two events takes, measured apart from the GPU time when queue_ahead holds the
        stream).
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    if rotate is not None and (not isinstance(rotate, (list, tuple)) or len(rotate) == 0):
        raise ValueError(f"rotate must be a non-empty list of inputs or None, got {rotate!r}")

    def call(i: int) -> None:
        if rotate is None:
            fn()
        else:
            fn(rotate[i % len(rotate)])

    for i in range(warmup):
        call(i)
    if torch.cuda.is_available():
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        torch.cuda.synchronize()
        if queue_ahead:
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        t0 = time.perf_counter()
        for i in range(reps):
            starts[i].record()
            call(warmup + i)
            ends[i].record()
        host_us = (time.perf_counter() - t0) * 1e6 / reps
        torch.cuda.synchronize()
        times_us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        clock = "cuda_events"
    else:
        times_us = []
        for i in range(reps):
            t0 = time.perf_counter()
            call(warmup + i)
            times_us.append((time.perf_counter() - t0) * 1e6)
        host_us = statistics.fmean(times_us)
        clock = "perf_counter"
    times_us.sort()
    return dict(median_us=statistics.median(times_us), p20_us=_percentile(times_us, 0.2),
                p80_us=_percentile(times_us, 0.8), reps=reps, clock=clock, host_us=host_us)


def slowest(stats: dict[str, Any], *, group: Any = None) -> dict[str, Any]:
    """The ``time_cuda`` result of the slowest rank (largest median), for every rank.

    Every rank of ``group`` must call it (one all_gather_object). Without an initialised
    process group, returns ``stats`` unchanged.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return dict(stats)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, dict(stats), group=group)
    rank = max(range(len(gathered)), key=lambda r: gathered[r]["median_us"])
    return {**gathered[rank], "slowest_rank": rank}


# ---- floors ------------------------------------------------------------------------------

def _shape_dims(config_or_shape: Any) -> tuple[int, int, int, int]:
    if isinstance(config_or_shape, MoEConfig):
        c = config_or_shape
        return c.hidden, c.intermediate, c.num_experts, c.top_k
    if isinstance(config_or_shape, str):
        if config_or_shape not in SHAPES:
            raise ValueError(f"unknown shape {config_or_shape!r}; known shapes: {sorted(SHAPES)}")
        config_or_shape = SHAPES[config_or_shape]
    if isinstance(config_or_shape, Mapping):
        keys = ("hidden", "intermediate", "num_experts", "top_k")
        missing = [k for k in keys if k not in config_or_shape]
        if missing:
            raise ValueError(f"shape dict must have keys {keys}, missing {missing}")
        dims = tuple(config_or_shape[k] for k in keys)
        for k, v in zip(keys, dims):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"shape dict {k!r} must be a positive int, got {v!r}")
        return dims  # type: ignore[return-value]
    raise ValueError(f"config_or_shape_dict must be a MoEConfig, a dict with hidden, "
                     f"intermediate, num_experts, top_k, or a name in {sorted(SHAPES)}; got "
                     f"{type(config_or_shape).__name__}")


def expected_touched_experts(*, num_experts: int, ranks: int, tokens_per_rank: int,
                             top_k: int) -> int:
    """Local experts of one rank that uniform routing is expected to touch, rounded up.

    All R ranks' T*K picks land on one rank's E/R experts; modelling them as T*K*R
    independent uniform picks over E experts, an expert is missed with probability
    (1 - 1/E)^(T*K*R), so the expected touched count is E_loc * (1 - (1 - 1/E)^(T*K*R)).
    Rounded up (a partly expected expert still costs a whole weight read) and capped at E_loc.
    (Top-k picks without replacement within a token touch slightly more at small T; the
    difference is under one expert and vanishes once every expert is hit.)
    """
    e_loc = num_experts // ranks
    picks = tokens_per_rank * top_k * ranks
    expected = e_loc * (1.0 - (1.0 - 1.0 / num_experts) ** picks)
    # The small slack keeps a float just above an integer (e.g. 8.0000000001) from rounding up.
    return min(e_loc, math.ceil(expected - 1e-9))


def floors(config_or_shape_dict: MoEConfig | Mapping[str, int] | str, *, tokens_per_rank: int,
           ranks: int, touched_experts: int | None = None, dtype: str = "bf16",
           calib: Mapping[str, float] = DEFAULT_CALIB) -> dict[str, Any]:
    """Lower bounds of one rank's layer time under uniform routing (module docstring).

    Args:
        config_or_shape_dict: a MoEConfig, a dict with hidden, intermediate, num_experts,
            top_k (e.g. ``SHAPES["dsv3"]``), or a shape name.
        tokens_per_rank: T (>= 0).
        ranks: R, expert-parallel ranks (divides num_experts).
        touched_experts: local experts whose weights are read; default
            ``expected_touched_experts`` (the expectation under uniform routing). Pass the
            count of a measured routing to get that run's floor.
        dtype: "bf16", "fp8" (fp8 weights and dispatch with fp32 block scales, bf16
            combine, fp8 dense rate) or "fp4w" (MXFP4 weights, the fp8 dispatch and rate).
        calib: rates: bf16_tflops, fp8_tflops, weights_tbps, link_gbps (DEFAULT_CALIB).

    Returns:
        dict with compute_us, weights_us, link_us, floor_us, bound ("compute", "weights" or
        "link", the largest; ties go in that order), touched_experts, remote_pairs,
        weight_bytes (of the touched experts' weights in ``dtype``, scales included).
    """
    H, I, E, K = _shape_dims(config_or_shape_dict)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks <= 0 or E % ranks:
        raise ValueError(f"ranks must be a positive int dividing num_experts ({E}), got {ranks!r}")
    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, int) \
            or tokens_per_rank < 0:
        raise ValueError(f"tokens_per_rank must be an int >= 0, got {tokens_per_rank!r}")
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {FLOOR_DTYPES}, got {dtype!r}")
    _check_calib(calib)
    e_loc = E // ranks
    if touched_experts is None:
        touched_experts = expected_touched_experts(num_experts=E, ranks=ranks,
                                                   tokens_per_rank=tokens_per_rank, top_k=K)
    elif isinstance(touched_experts, bool) or not isinstance(touched_experts, int) \
            or not 0 <= touched_experts <= e_loc:
        raise ValueError(f"touched_experts must be an int in [0, {e_loc}] (local experts), got "
                         f"{touched_experts!r}")
    T = tokens_per_rank
    # Uniform routing: a rank computes as many (token, k) pairs as it owns, T*K, of which the
    # (R-1)/R from other ranks' tokens cross the link
    return _rank_floor(H, I, pairs=T * K, touched_experts=touched_experts,
                       remote_pairs=T * K * (ranks - 1) / ranks, dtype=dtype, calib=calib)


def _check_calib(calib: Mapping[str, float]) -> None:
    missing = [k for k in ("bf16_tflops", "fp8_tflops", "weights_tbps", "link_gbps")
               if k not in calib]
    if missing:
        raise ValueError(f"calib is missing {missing}; start from {{**DEFAULT_CALIB, ...}}")


def _rank_floor(H: int, I: int, *, pairs: float, touched_experts: int, remote_pairs: float,
                dtype: str, calib: Mapping[str, float]) -> dict[str, Any]:
    """One rank's floors: ``pairs`` (token, k) rows through its experts' GEMMs, the weights
    of ``touched_experts`` read once, ``remote_pairs`` of those rows pulled from and returned
    to other ranks."""
    b = _BYTES[dtype]
    rate = calib["bf16_tflops" if dtype == "bf16" else "fp8_tflops"]   # fp4w: fp8 MMAs
    compute_us = 6.0 * pairs * H * I / (rate * 1e12) * 1e6
    weights_us = touched_experts * 3.0 * H * I * b["weight"] / (calib["weights_tbps"] * 1e12) * 1e6
    link_us = remote_pairs * H * (b["dispatch"] + b["combine"]) / (calib["link_gbps"] * 1e9) * 1e6
    parts = {"compute": compute_us, "weights": weights_us, "link": link_us}
    bound = max(parts, key=lambda k: parts[k])  # max keeps the first of equal values
    return dict(compute_us=compute_us, weights_us=weights_us, link_us=link_us,
                floor_us=parts[bound], bound=bound, touched_experts=touched_experts,
                remote_pairs=remote_pairs,
                weight_bytes=touched_experts * 3.0 * H * I * b["weight"])


def routing_floors(config_or_shape_dict: MoEConfig | Mapping[str, int] | str, *,
                   topk_idxs: Sequence[torch.Tensor], dtype: str = "bf16",
                   calib: Mapping[str, float] = DEFAULT_CALIB) -> dict[str, Any]:
    """Floors of one call with a measured routing (for skewed routing, where ``floors``'
    uniform model does not hold): each rank's floor from the picks that land on its experts
    (the rows it computes, the local experts they touch, and those from other ranks' tokens
    as its remote pairs), and the largest over the ranks, since the slowest rank bounds the
    layer.

    Args:
        config_or_shape_dict: as in ``floors``.
        topk_idxs: one int tensor [T_r, K] per rank r (R = its length, dividing num_experts),
            expert ids in [0, num_experts) or -1 for a dropped pick.
        dtype, calib: as in ``floors``.

    Returns:
        the slowest rank's ``floors``-style dict (compute_us, weights_us, link_us, floor_us,
        bound, touched_experts, remote_pairs) with ``rank`` (which one) and ``per_rank`` (every
        rank's dict).
    """
    H, I, E, K = _shape_dims(config_or_shape_dict)
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {FLOOR_DTYPES}, got {dtype!r}")
    _check_calib(calib)
    R = len(topk_idxs)
    if R == 0 or E % R:
        raise ValueError(f"topk_idxs must hold one tensor per rank, a count dividing "
                         f"num_experts ({E}); got {R}")
    owners, experts = [], []
    for r, idx in enumerate(topk_idxs):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[1] != K \
                or idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise ValueError(f"topk_idxs[{r}] must be an int tensor [T, {K}], got "
                             f"{getattr(idx, 'dtype', type(idx).__name__)} "
                             f"{tuple(getattr(idx, 'shape', ()))}")
        flat = idx.reshape(-1).long().cpu()
        if bool(((flat < -1) | (flat >= E)).any()):
            raise ValueError(f"topk_idxs[{r}] holds ids outside [-1, {E})")
        flat = flat[flat >= 0]
        experts.append(flat)
        owners.append(flat // (E // R))
    per_rank = []
    for r in range(R):
        mine = [e[o == r] for e, o in zip(experts, owners)]
        pairs = sum(m.numel() for m in mine)
        remote = sum(m.numel() for s, m in enumerate(mine) if s != r)
        touched = int(torch.cat(mine).unique().numel()) if pairs else 0
        per_rank.append(_rank_floor(H, I, pairs=pairs, touched_experts=touched,
                                    remote_pairs=remote, dtype=dtype, calib=calib))
    worst = max(range(R), key=lambda r: per_rank[r]["floor_us"])
    return {**per_rank[worst], "rank": worst, "per_rank": per_rank}


# ---- result rows -------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _commit() -> str | None:
    """The measured code's commit: ``MOESTREAM_COMMIT`` if set (a copy of the tree without
    .git), else git's short hash of this checkout, "-dirty" when moestream/ has changes."""
    if os.environ.get("MOESTREAM_COMMIT"):
        return os.environ["MOESTREAM_COMMIT"]
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--", "moestream") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _auto_fields() -> dict[str, Any]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    else:
        gpu = f"cpu ({platform.processor() or platform.machine() or 'unknown'})"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton_version, commit=_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def result_row(**fields: Any) -> dict[str, Any]:
    """One result row with the protocol's keys (``ROW_KEYS``), then any extra fields.

    Required: shape, ranks, tokens_per_rank, dtype, provider, median_us, p20_us, p80_us.
    Filled automatically unless given: gpu, torch, triton, commit, date; num_gpus (= ranks);
    and, when ``shape`` is a name in SHAPES: tflops_per_gpu (6*T*K*H*I / median), link_gbps
    (the remote bytes of the link floor / median), floor_us and weight_bytes (``floors`` with
    default touched experts: the bytes of the expert weights it reads, scales included; an
    ``experts`` field replaces the shape's expert count). efficiency = floor_us /
    median_us unless given.
    """
    missing = [k for k in _REQUIRED_KEYS if k not in fields]
    if missing:
        raise ValueError(f"result_row needs {list(_REQUIRED_KEYS)}; missing {missing}")
    row = {**_auto_fields(), "num_gpus": fields["ranks"], **fields}
    median = float(row["median_us"])
    if not median > 0:
        raise ValueError(f"median_us must be > 0, got {row['median_us']!r}")
    derived = ("tflops_per_gpu", "link_gbps", "floor_us")
    if any(k not in row for k in derived):
        if row["shape"] not in SHAPES:
            absent = [k for k in derived if k not in row]
            raise ValueError(f"shape {row['shape']!r} is not in {sorted(SHAPES)}, so pass "
                             f"{absent} explicitly")
        if row["dtype"] not in _BYTES:
            raise ValueError(f"dtype {row['dtype']!r} has no floor model (known: "
                             f"{FLOOR_DTYPES}), so pass tflops_per_gpu, link_gbps, floor_us")
        dims = {**SHAPES[row["shape"]], **({"num_experts": row["experts"]}
                                           if row.get("experts") else {})}
        H, I, E, K = _shape_dims(dims)
        T, R = row["tokens_per_rank"], row["ranks"]
        fl = floors(dims, tokens_per_rank=T, ranks=R, dtype=row["dtype"])
        b = _BYTES[row["dtype"]]
        row.setdefault("tflops_per_gpu", 6.0 * T * K * H * I / (median * 1e-6) / 1e12)
        row.setdefault("link_gbps", fl["remote_pairs"] * H * (b["dispatch"] + b["combine"])
                       / (median * 1e-6) / 1e9)
        row.setdefault("floor_us", fl["floor_us"])
        row.setdefault("weight_bytes", fl["weight_bytes"])
    if "efficiency" not in row:
        row["efficiency"] = None if row["floor_us"] is None else float(row["floor_us"]) / median
    return {**{k: row[k] for k in ROW_KEYS}, **{k: v for k, v in row.items() if k not in ROW_KEYS}}


def append_rows(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Append rows as JSON lines to ``path`` (parent folders created); returns rows written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(dict(row)) + "\n")
            n += 1
    return n


def _point(row: Mapping[str, Any]) -> str:
    return json.dumps([row.get(k) for k in POINT_KEYS], sort_keys=True)


def update_rows(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write ``rows`` into the canonical results file ``path``: a row replaces the file's row
    of the same point (``POINT_KEYS``: shape, ranks, tokens, dtype, provider, ...), others are
    kept in their order and new points go last; the file holds one row per point. Returns the
    rows written."""
    path = Path(path)
    new = list({_point(r): dict(r) for r in rows}.values())   # a point measured twice: the last
    fresh = {_point(r) for r in new}
    old = [r for r in load_rows(path) if _point(r) not in fresh] if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        for row in old + new:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return len(new)


def machine_label(num_gpus: int | None = None) -> str:
    """The results folder of this machine: the GPU's model in lower case, ``x<N>`` for N > 1
    GPUs (``h200``, ``h200x2``), or ``cpu``."""
    if not torch.cuda.is_available():
        return "cpu"
    n = torch.cuda.device_count() if num_gpus is None else num_gpus
    name = torch.cuda.get_device_name(0).lower().replace("nvidia", "").split()
    model = next((w for w in name if any(c.isdigit() for c in w)), name[-1] if name else "gpu")
    return model + (f"x{n}" if n > 1 else "")


def results_path(benchmark: str, *, num_gpus: int | None = None,
                 root: str | Path = "benchmarks/results") -> Path:
    """``<root>/<machine>/<benchmark>.jsonl``: one canonical file per benchmark and machine."""
    return Path(root) / machine_label(num_gpus) / f"{benchmark}.jsonl"


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file written by ``append_rows`` (blank lines skipped)."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- presentation ------------------------------------------------------------------------

def _fmt(v: Any, digits: int) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and digits < 0:
        return f"{v:.1e}"
    if isinstance(v, float):
        # µs and rates above 100 gain nothing from decimals; they only widen the table.
        return f"{v:.{0 if digits == 1 and abs(v) >= 100 else digits}f}"
    return str(v)


_DEFAULT_COLUMNS = [("shape", "shape", 0), ("ranks", "R", 0), ("tokens_per_rank", "T/rank", 0),
                    ("dtype", "dtype", 0), ("provider", "provider", 0),
                    ("median_us", "median µs", 1), ("p20_us", "p20 µs", 1),
                    ("p80_us", "p80 µs", 1), ("tflops_per_gpu", "TFLOP/s", 1),
                    ("link_gbps", "GB/s", 1), ("floor_us", "floor µs", 1),
                    ("efficiency", "eff", 2)]


# Columns that name a point: repeated in each part of a table split to fit the console.
_POINT_COLUMNS = ("shape", "ranks", "tokens_per_rank", "tokens_per_expert", "kernel", "phase",
                  "dtype", "provider")


def print_table(rows: Sequence[Mapping[str, Any]], title: str = "", *,
                columns: Sequence[str] | None = None, console: Any = None) -> Any:
    """Print rows as rich tables, in the given order; returns the (first) Table.

    ``columns``: row keys to show (default: the protocol's main ones); keys naming an error or
    a difference print in scientific notation, other unknown keys with 2 decimals. No cell is
    ever cut: where the columns do not fit the console, they are printed as several tables,
    each repeating the columns that name the point (shape, tokens, provider, ...).
    ``console``: a ``rich.console.Console`` to print to (default: the terminal's width).
    """
    from .terminal import console as make_console
    from .terminal import print_table as print_columns

    known = {key: (header, digits) for key, header, digits in _DEFAULT_COLUMNS}
    if columns is None:
        columns = _DEFAULT_COLUMNS
    else:
        columns = [(k, *known.get(k, (k, -1 if "error" in k or "diff" in k else 2))) for k in columns]
    text = ("shape", "dtype", "provider", "phase", "kernel")
    tables = print_columns(
        console or make_console(), title=title or None,
        columns=[(h, "left" if k in text else "right") for k, h, _ in columns],
        rows=[[_fmt(row.get(k), digits) for k, _, digits in columns] for row in rows],
        keys=[i for i, (k, _, _) in enumerate(columns) if k in _POINT_COLUMNS])
    return tables[0]


def plot_rows(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Save a PNG: median time vs tokens per rank (log-log), one subplot per shape, one line
    per provider (p20-p80 shaded), the floor dashed. Uses the Agg canvas directly, so no
    display and no global matplotlib backend change.

    Lines are keyed by provider, plus ranks and dtype when the rows mix several.
    """
    from .terminal import require
    require("matplotlib", extra="plot", why="the benchmark's PNG")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not rows:
        raise ValueError("plot_rows needs at least one row")
    path = Path(path)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    many_ranks = len({r["ranks"] for r in rows}) > 1
    many_dtypes = len({r["dtype"] for r in rows}) > 1

    def label(r: Mapping[str, Any]) -> str:
        return (str(r["provider"]) + (f" EP{r['ranks']}" if many_ranks else "")
                + (f" {r['dtype']}" if many_dtypes else ""))

    # one colour per line across the subplots
    colour = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(map(label, rows)))}
    fig = Figure(figsize=(4.5 * len(shapes), 4.0), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(shapes), squeeze=False)[0]
    for ax, shape in zip(axes, shapes):
        lines: dict[str, list] = defaultdict(list)
        floor_pts: dict[str, dict[int, float]] = defaultdict(dict)   # per dtype
        for r in rows:
            # log axes cannot show T = 0 or a non-positive time
            if r["shape"] != shape or r["tokens_per_rank"] <= 0 or r["median_us"] <= 0:
                continue
            lines[label(r)].append(r)
            if r.get("floor_us"):
                floor_pts[r["dtype"]].setdefault(r["tokens_per_rank"], r["floor_us"])
        for name, pts in sorted(lines.items(), key=lambda kv: list(colour).index(kv[0])):
            pts.sort(key=lambda r: r["tokens_per_rank"])
            t = [r["tokens_per_rank"] for r in pts]
            ax.plot(t, [r["median_us"] for r in pts], marker="o", label=name, color=colour[name])
            ax.fill_between(t, [r["p20_us"] for r in pts], [r["p80_us"] for r in pts], alpha=0.2,
                            color=colour[name])
        for n, (dtype, pts) in enumerate(floor_pts.items()):
            t = sorted(pts)
            ax.plot(t, [pts[x] for x in t], linestyle=("--", ":", "-.")[n % 3], color="grey",
                    label=f"floor {dtype}" if many_dtypes else "floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(shape)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("time per layer call (µs)")
        ax.grid(True, which="both", alpha=0.3)
        if lines or floor_pts:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path
