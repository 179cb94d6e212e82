"""``moestream probe``: measure this machine's calibration for the simulator.

GPU micro-benchmarks whose results fill a calibration file in the schema of
``moestream.tools.sim.calib`` (``"schema": "moestream.calib/1"``), so that
``Calibration.load(path)`` / ``moestream simulate --calib PATH`` model this machine instead of the
packaged 2x H200 pair. Measured, in this order (single-GPU parts first, peer parts last, so a
peer fault cannot lose the other figures):

==========================  ======================================================================
``num_sms``                 SMs of the first probed GPU (device properties)
``dense_bf16_tflops``       ``torch.mm`` of two n x n bf16 matrices (n = 8192), 2 n^3 FLOP
``hbm_copy_tbps``           ``dst.copy_(src)`` of 1 GiB (256 MiB with ``quick``), read + write bytes
``grouped_gemm``            rows per expert 16/128/512/2048, 32 experts, the dsv3 L1 GEMM
                            (N = 2I = 4096, K = H = 7168), FLOP on valid rows: ``torch`` is
                            ``torch._grouped_mm``; ``triton`` is the project's L1 kernel through
                            ``moestream.tools.bench_kernels.bench_gemm`` (variant ``layer-call``);
                            the L2 GEMM (N = H, K = I) too, recorded under ``l2_tflops`` (the
                            model does not read it)
``cache_read`` (recorded)   a Triton kernel re-reading a buffer of 8 MiB .. 512 MiB many times in one
                            launch, each round a program reading another program's slice past
                            its L1 (``.cg`` loads): the L2 cache's read rate while the buffer
                            fits in it (60 MiB on an H200), HBM's beyond; not used by the model
``device_pull`` (local)     a Triton kernel pulling rows (one row per program, random order) from
                            a local buffer; read bytes counted
``host_peer_copy``          ``tensor.copy_`` from GPU0 to GPU1 (copy engine, issued from the host),
                            4 KiB .. 64 MiB in powers of 4; several copies per timed call
``device_pull`` (peer)      the same kernel reading GPU1's buffer from GPU0 through its address
                            (peer access, which torch enables on the first copy between them)
``flag_round_trip_us``      two one-program Triton kernels, on GPU0 and GPU1, bouncing a counter
                            through flags in each other's memory (``atomic_xchg`` release /
                            ``atomic_add(p, 0)`` acquire, scope "sys"); timed in-kernel with the
                            global timer over many round trips after warm-up round trips
==========================  ======================================================================

Every timing uses CUDA events (``moestream.tools.bench.time_cuda``: warm-up calls first, the median of
>= 10 calls), except the flag round trip, timed inside the kernel (CUDA events also bracket its
launches and are reported next to it). Every spin in a kernel is bounded (``timeout_s`` of wall
time and a poll count); nothing here can hang the GPU.

With one GPU (or no peer access between the first two) the peer parts fall back to the same GPU
(a local device copy, a local pull, two kernels on two streams of one GPU) and the file says so
(``probe.fallbacks`` and ``note``): such a file describes no link. A section that fails keeps the
packaged calibration's value for its keys, listed in ``probe.not_measured``.
"""
from __future__ import annotations

import datetime
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..kernels.common import triton
from . import probe_gpu as gpu
from .probe_gpu import GROUPED_DIMS, TRITON_VARIANT, ProbeError, pull_rows, reread
from .sim.calib import SCHEMA, Calibration

__all__ = ["ProbeError", "ProbePlan", "ProbeResults", "probe_plan", "run_probe",
           "assemble_calibration", "calibration_table", "pull_rows", "reread", "GEMM_PROVIDERS"]

GEMM_PROVIDERS = ("torch", "triton")
# the packaged calibration's device-pull row (7 KB): the schema keeps one row size
SCHEMA_ROW_BYTES = 7168


# ---- the plan: sizes and repetitions (pure) --------------------------------------------------
@dataclass(frozen=True)
class ProbePlan:
    """Sizes and repetitions of every probe (bytes, rows, calls). ``probe_plan`` builds one."""

    quick: bool = False
    warmup: int = 3
    reps: int = 20                       # timed calls per point (median), >= 10
    dense_n: int = 8192
    hbm_copy_bytes: int = 1 << 30
    grouped_tokens_per_expert: tuple[int, ...] = (16, 128, 512, 2048)
    host_copy_bytes: tuple[int, ...] = tuple(4096 * 4 ** i for i in range(8))  # 4 KiB..64 MiB
    host_copy_batch_bytes: int = 256 << 20   # copies per timed call: up to this many bytes
    host_copy_max_batch: int = 64            # ... and at most this many copies
    pull_row_bytes: tuple[int, ...] = (2048, 4096, SCHEMA_ROW_BYTES, 14336)
    pull_total_bytes: int = 256 << 20        # rows pulled per call (> the 50 MB L2)
    pull_programs: tuple[int, ...] = (16, 32, 66, 132, 264, 528)   # persistent-grid sweep
    pull_programs_row_bytes: int = 4096
    cache_read_bytes: tuple[int, ...] = (8 << 20, 16 << 20, 32 << 20, 48 << 20, 512 << 20)
    cache_read_rounds: int = 32              # reads of the whole buffer per launch
    flag_round_trips: int = 2000
    flag_warmup_round_trips: int = 200
    flag_launches: int = 5
    timeout_s: float = 2.0               # bound of every in-kernel wait

    def __post_init__(self) -> None:
        ints = {"warmup": (self.warmup, 0), "reps": (self.reps, 10), "dense_n": (self.dense_n, 256),
                "hbm_copy_bytes": (self.hbm_copy_bytes, 1 << 20),
                "host_copy_batch_bytes": (self.host_copy_batch_bytes, 1),
                "host_copy_max_batch": (self.host_copy_max_batch, 1),
                "pull_total_bytes": (self.pull_total_bytes, 1 << 16),
                "pull_programs_row_bytes": (self.pull_programs_row_bytes, 4),
                "cache_read_rounds": (self.cache_read_rounds, 1),
                "flag_round_trips": (self.flag_round_trips, 1),
                "flag_warmup_round_trips": (self.flag_warmup_round_trips, 0),
                "flag_launches": (self.flag_launches, 1)}
        for name, (v, lo) in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"ProbePlan.{name} must be an int >= {lo}, got {v!r}")
        for name in ("grouped_tokens_per_expert", "host_copy_bytes", "pull_row_bytes",
                     "pull_programs", "cache_read_bytes"):
            vals = getattr(self, name)
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0
                               for v in vals):
                raise ValueError(f"ProbePlan.{name} must be a non-empty tuple of positive ints, "
                                 f"got {vals!r}")
            if any(b <= a for a, b in zip(vals, vals[1:], strict=False)):
                raise ValueError(f"ProbePlan.{name} must be strictly ascending, got {vals!r}")
        if any(b % 4096 for b in self.cache_read_bytes):
            raise ValueError(f"ProbePlan.cache_read_bytes must be multiples of 4096, got "
                             f"{self.cache_read_bytes!r}")
        if any(b % 4 for b in self.pull_row_bytes + (self.pull_programs_row_bytes,)):
            raise ValueError("ProbePlan pull row sizes must be multiples of 4 bytes")
        if max(self.pull_row_bytes + (self.pull_programs_row_bytes,)) > self.pull_total_bytes:
            raise ValueError("ProbePlan.pull_total_bytes must hold at least one row")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= 60):
            raise ValueError(f"ProbePlan.timeout_s must be in (0, 60] seconds, got "
                             f"{self.timeout_s!r}")


def probe_plan(*, quick: bool = False) -> ProbePlan:
    """The full probe, or with ``quick`` the one meant to fit in a minute on an H200
    (fewer calls per point, smaller copies and pulls, the same points of the schema)."""
    if not isinstance(quick, bool):
        raise ValueError(f"quick must be a bool, got {quick!r}")
    if not quick:
        return ProbePlan()
    return ProbePlan(quick=True, warmup=2, reps=10, hbm_copy_bytes=256 << 20,
                     host_copy_batch_bytes=64 << 20, host_copy_max_batch=16,
                     pull_total_bytes=64 << 20, pull_row_bytes=(4096, SCHEMA_ROW_BYTES, 14336),
                     pull_programs=(32, 132, 528), cache_read_rounds=16, flag_round_trips=500,
                     flag_warmup_round_trips=50, flag_launches=3)


# ---- what was measured ----------------------------------------------------------------------
@dataclass
class ProbeResults:
    """Raw probe results (rates per GPU, GB/s = 1e9 B/s); ``assemble_calibration`` turns them
    into the calibration JSON. ``None`` / empty: not measured."""

    device: str = ""
    num_sms: int | None = None
    dense_bf16_tflops: float | None = None
    hbm_copy_tbps: float | None = None
    grouped_tokens_per_expert: list[int] = field(default_factory=list)
    grouped_tflops: dict[str, list[float]] = field(default_factory=dict)
    # the L2 GEMM (N = H, K = I) at the same rows: recorded, not used by the model
    grouped_l2_tflops: dict[str, list[float]] = field(default_factory=dict)
    host_copy_bytes: list[int] = field(default_factory=list)
    host_copy_gbps: list[float] = field(default_factory=list)
    host_copy_us: list[float] = field(default_factory=list)   # per copy
    host_copy_peer: bool = False        # False: a local device copy stood in (one GPU)
    pull_row_bytes: list[int] = field(default_factory=list)
    pull_local_gbps: list[float] = field(default_factory=list)
    pull_peer_gbps: list[float] = field(default_factory=list)
    pull_programs: dict[str, Any] = field(default_factory=dict)
    # buffer re-reads in one launch (L2 cache while it fits): recorded, not used by the model
    cache_read_bytes: list[int] = field(default_factory=list)
    cache_read_tbps: list[float] = field(default_factory=list)
    flag_round_trip_us: float | None = None
    flag_event_us: float | None = None  # CUDA-event time of the initiator launch / round trips
    flag_peer: bool = False             # False: both kernels on one GPU
    notes: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    quick: bool = False


def _ok_list(values: Sequence[Any], n: int) -> bool:
    return (len(values) == n and n > 0
            and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values))


def _ok_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def assemble_calibration(results: ProbeResults, *, base: Calibration | None = None,
                         schema_row_bytes: int = SCHEMA_ROW_BYTES) -> dict[str, Any]:
    """The calibration JSON object (schema ``moestream.calib/1``) of ``results``.

    A figure that was not measured (``None``, an empty or malformed list) takes ``base``'s
    value (default: the packaged calibration) and is listed in ``probe.not_measured``; a
    stand-in measurement (one GPU: local copy, local pull, one-GPU ping-pong) is listed in
    ``probe.fallbacks``. ``device_pull`` keeps the row size ``schema_row_bytes`` (else the
    nearest measured one) and every measured size under ``device_pull.by_row_bytes``.
    The result is validated with ``Calibration.from_dict`` (ValueError if it does not load).
    """
    if not isinstance(results, ProbeResults):
        raise ValueError(f"results must be a ProbeResults, got {type(results).__name__}")
    base = Calibration.load() if base is None else base
    ref = base.to_dict()
    not_measured: list[str] = []
    fallbacks: dict[str, str] = {}
    errors = dict(results.errors)

    def pick(key: str, value: Any, ok: bool) -> Any:
        if ok:
            return value
        not_measured.append(key)
        return ref[key]

    num_sms = results.num_sms if isinstance(results.num_sms, int) and results.num_sms > 0 \
        else None
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "device": results.device or "unknown",
        "source": "moestream probe" + (" --quick" if results.quick else "")
        + f" ({datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')})",
        "num_sms": pick("num_sms", num_sms, num_sms is not None),
        "dense_bf16_tflops": pick("dense_bf16_tflops", results.dense_bf16_tflops,
                                  _ok_num(results.dense_bf16_tflops)),
        "hbm_copy_tbps": pick("hbm_copy_tbps", results.hbm_copy_tbps,
                              _ok_num(results.hbm_copy_tbps)),
    }

    # ---- grouped GEMM: every provider with a full curve ---------------------------------------
    tpe = [int(v) for v in results.grouped_tokens_per_expert]
    curves = {p: [float(v) for v in r] for p, r in results.grouped_tflops.items()
              if _ok_list(r, len(tpe))}
    d = GROUPED_DIMS
    gnote = (f"bf16, {d['experts']} experts, N={2 * d['intermediate']}, K={d['hidden']} (the dsv3 "
             f"L1 GEMM), FLOP/s counted on the valid rows; torch = torch._grouped_mm, triton = "
             f"moestream's L1 kernel (bench_kernels variant {TRITON_VARIANT})")
    for p in GEMM_PROVIDERS:
        if p not in curves:
            why = errors.get(f"grouped_gemm.{p}") or results.notes.get(f"grouped_gemm.{p}") \
                or "not run"
            gnote += f"; {p} not measured: {why}"
    if curves and tpe == sorted(set(tpe)):
        out["grouped_gemm"] = {"note": gnote, "tokens_per_expert": tpe, "tflops": curves}
        l2 = {p: [float(v) for v in r] for p, r in results.grouped_l2_tflops.items()
              if _ok_list(r, len(tpe))}
        if l2:
            out["grouped_gemm"]["l2_tflops"] = l2
            out["grouped_gemm"]["l2_note"] = (
                f"the L2 GEMM (N={d['hidden']}, K={d['intermediate']}) at the same rows; "
                f"recorded only: the model rates L2 tasks with the L1 curve (tflops)")
    else:
        not_measured.append("grouped_gemm")
        out["grouped_gemm"] = {**ref["grouped_gemm"],
                               "note": "not measured here: the packaged calibration's curve"}

    # ---- host-issued copies ----------------------------------------------------------------
    hb, hg = results.host_copy_bytes, results.host_copy_gbps
    if hb and _ok_list(hg, len(hb)) and _ok_list(hb, len(hb)):
        if results.host_copy_peer:
            hnote = "tensor.copy_ from GPU0 to GPU1 (peer copy issued from the host)"
        else:
            hnote = ("FALLBACK: local device-to-device copy on one GPU (no peer GPU): not a "
                     "link figure")
            fallbacks["host_peer_copy"] = "local device copy (one GPU or no peer access)"
        out["host_peer_copy"] = {"note": hnote + "; several copies per timed call, CUDA events",
                                 "bytes": [int(b) for b in hb], "gbps": [float(g) for g in hg]}
        if _ok_list(results.host_copy_us, len(hb)):
            out["host_peer_copy"]["us_per_copy"] = [float(u) for u in results.host_copy_us]
    else:
        not_measured.append("host_peer_copy")
        out["host_peer_copy"] = {**ref["host_peer_copy"],
                                 "note": "not measured here: the packaged calibration's figures"}

    # ---- device pulls ------------------------------------------------------------------------
    rows = [int(b) for b in results.pull_row_bytes]
    local_ok = _ok_list(results.pull_local_gbps, len(rows))
    peer_ok = _ok_list(results.pull_peer_gbps, len(rows))
    if local_ok:
        i = min(range(len(rows)), key=lambda j: (abs(rows[j] - schema_row_bytes), rows[j]))
        local = float(results.pull_local_gbps[i])
        pnote = "Triton kernel, one row per program, random row order, read bytes counted"
        if peer_ok:
            peer = float(results.pull_peer_gbps[i])
            pnote += "; peer = GPU0 reading GPU1's buffer through its address (peer access)"
        else:
            peer = local
            pnote += ("; FALLBACK: peer_gbps is the LOCAL pull rate (no peer GPU or peer pull "
                      "failed): not a link figure")
            fallbacks["device_pull.peer_gbps"] = "local pull rate (no peer)"
        out["device_pull"] = {
            "note": pnote, "row_bytes": rows[i], "peer_gbps": peer, "local_gbps": local,
            "by_row_bytes": {"row_bytes": rows,
                             "local_gbps": [float(v) for v in results.pull_local_gbps],
                             "peer_gbps": ([float(v) for v in results.pull_peer_gbps]
                                           if peer_ok else None)}}
        if results.pull_programs:
            out["device_pull"]["by_programs"] = dict(results.pull_programs)
    else:
        not_measured.append("device_pull")
        out["device_pull"] = {**ref["device_pull"],
                              "note": "not measured here: the packaged calibration's figures"}

    # ---- cache re-reads (recorded only) ----------------------------------------------------
    cb = [int(b) for b in results.cache_read_bytes]
    if cb and _ok_list(results.cache_read_tbps, len(cb)):
        out["cache_read"] = {
            "note": "Triton kernel re-reading a buffer of `bytes` many times in one launch, each "
                    "round a program reading another's slice with .cg loads (past L1): the L2 "
                    "cache's read rate while the buffer fits in it, HBM's beyond; recorded, "
                    "not used by the model",
            "bytes": cb, "tbps": [float(v) for v in results.cache_read_tbps]}

    # ---- flags -------------------------------------------------------------------------------
    out["flag_round_trip_us"] = pick("flag_round_trip_us", results.flag_round_trip_us,
                                     _ok_num(results.flag_round_trip_us))
    if "flag_round_trip_us" not in not_measured and not results.flag_peer:
        fallbacks["flag_round_trip_us"] = "two kernels on one GPU (no peer GPU)"

    notes = []
    if fallbacks:
        notes.append("stand-ins for peer figures (this file describes no link): "
                     + "; ".join(f"{k}: {v}" for k, v in fallbacks.items()))
    if not_measured:
        notes.append("not measured, copied from the packaged calibration: "
                     + ", ".join(not_measured))
    out["note"] = " | ".join(notes) if notes else "every figure measured on this machine"
    out["probe"] = {"quick": results.quick, "not_measured": not_measured,
                    "fallbacks": fallbacks, "errors": errors, "notes": dict(results.notes),
                    "timings_s": {k: round(v, 3) for k, v in results.timings_s.items()},
                    "versions": dict(results.versions),
                    "flag_event_us_per_round_trip": results.flag_event_us}
    Calibration.from_dict(out)   # the file must load
    return out


# ---- presentation (pure) ----------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (list, tuple)):
        return " / ".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2g}" if abs(v) < 1 else f"{v:.1f}"
    return str(v)


def calibration_table(calib: Mapping[str, Any], *, reference: Calibration | None = None):
    """A ``rich.table.Table`` of a calibration dict next to ``reference`` (default: the
    packaged 2x H200 calibration), with each figure's status (measured, fallback, not
    measured)."""
    from rich.table import Table

    ref = (Calibration.load() if reference is None else reference).to_dict()
    probe = calib.get("probe", {}) if isinstance(calib.get("probe"), Mapping) else {}
    nm, fb = set(probe.get("not_measured", [])), dict(probe.get("fallbacks", {}))

    def status(*keys: str) -> str:
        for k in keys:
            if k in nm:
                return "[yellow]not measured[/]"
            if k in fb:
                return "[yellow]fallback[/]"
        return "[green]measured[/]"

    t = Table(title=f"moestream probe: {calib.get('device', '')}")
    for col, just in (("figure", "left"), ("unit", "left"), ("this machine", "right"),
                      ("packaged (2x H200)", "right"), ("status", "left")):
        t.add_column(col, justify=just)
    t.add_row("SMs", "", _fmt(calib["num_sms"]), _fmt(ref["num_sms"]), status("num_sms"))
    t.add_row("dense bf16 matmul", "TFLOP/s", _fmt(calib["dense_bf16_tflops"]),
              _fmt(ref["dense_bf16_tflops"]), status("dense_bf16_tflops"))
    t.add_row("device copy (read+write)", "TB/s", f"{calib['hbm_copy_tbps']:.2f}",
              f"{ref['hbm_copy_tbps']:.2f}", status("hbm_copy_tbps"))
    gg, rgg = calib["grouped_gemm"], ref["grouped_gemm"]
    for p in sorted(set(gg["tflops"]) | set(rgg["tflops"])):
        rows = "/".join(str(int(m)) for m in gg["tokens_per_expert"])
        t.add_row(f"grouped GEMM {p}, rows/expert {rows}", "TFLOP/s",
                  _fmt(gg["tflops"].get(p)), _fmt(rgg["tflops"].get(p)),
                  status("grouped_gemm") if p in gg["tflops"] else "[yellow]not measured[/]")
    for p, rates in (gg.get("l2_tflops") or {}).items():
        t.add_row(f"  L2 GEMM {p} (recorded, not modelled)", "TFLOP/s", _fmt(rates), "", "")
    hc, rhc = calib["host_peer_copy"], ref["host_peer_copy"]
    t.add_row("host copy, bytes", "B", _fmt([int(b) for b in hc["bytes"]]),
              _fmt([int(b) for b in rhc["bytes"]]), "")
    t.add_row("host copy, rate", "GB/s", _fmt(hc["gbps"]), _fmt(rhc["gbps"]),
              status("host_peer_copy"))
    dp, rdp = calib["device_pull"], ref["device_pull"]
    t.add_row(f"device pull {int(dp['row_bytes'])} B rows, peer", "GB/s", _fmt(dp["peer_gbps"]),
              _fmt(rdp["peer_gbps"]) + f" ({int(rdp['row_bytes'])} B)",
              status("device_pull", "device_pull.peer_gbps"))
    t.add_row(f"device pull {int(dp['row_bytes'])} B rows, local", "GB/s",
              _fmt(dp["local_gbps"]), _fmt(rdp["local_gbps"]), status("device_pull"))
    by = dp.get("by_row_bytes")
    if isinstance(by, Mapping):
        t.add_row("  pull row sizes", "B", _fmt(by.get("row_bytes")), "", "")
        t.add_row("  pull local by size", "GB/s", _fmt(by.get("local_gbps")), "", "")
        t.add_row("  pull peer by size", "GB/s", _fmt(by.get("peer_gbps")), "", "")
    bp = dp.get("by_programs")
    if isinstance(bp, Mapping):
        t.add_row(f"  pull {bp.get('row_bytes')} B rows by programs {_fmt(bp.get('programs'))}",
                  "GB/s", _fmt(bp.get("gbps")), "", bp.get("where", ""))
    cr = calib.get("cache_read")
    if isinstance(cr, Mapping):
        mib = "/".join(str(int(b) >> 20) for b in cr.get("bytes", []))
        t.add_row(f"re-read of {mib} MiB in one launch (recorded)", "TB/s", _fmt(cr.get("tbps")),
                  "", "")
    t.add_row("flag round trip", "µs", _fmt(calib["flag_round_trip_us"]),
              _fmt(ref["flag_round_trip_us"]), status("flag_round_trip_us"))
    return t


def _versions() -> dict[str, str]:
    import platform
    out = {"torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version()}
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["gpus"] = ", ".join(torch.cuda.get_device_name(i)
                                for i in range(torch.cuda.device_count()))
    return out


def run_probe(*, out: str | Path | None, quick: bool = False,
              gemm_providers: Sequence[str] = GEMM_PROVIDERS,
              devices: tuple[int, int] = (0, 1), plan: ProbePlan | None = None,
              progress: bool = True, console: Any = None) -> dict[str, Any]:
    """Measure this machine and return its calibration dict (schema ``moestream.calib/1``).

    Args:
        out: where to write the JSON (parent folders created); ``None``: do not write.
        quick: the ~1 minute probe (``probe_plan(quick=True)``) instead of the full one.
        gemm_providers: grouped-GEMM curves to measure, a subset of ``GEMM_PROVIDERS``
            ("torch": torch._grouped_mm; "triton": moestream's L1 kernel).
        devices: (GPU that runs every single-GPU probe and reads, peer GPU). The peer parts
            need both; with one visible GPU they fall back to the first (see module doc).
        plan: explicit sizes (overrides ``quick``).
        progress: show a rich progress bar.
        console: a ``rich.console.Console`` for the progress bar (default: a new one).

    Returns:
        The calibration dict (it loads with ``Calibration.from_dict``); rates per GPU, GB/s =
        1e9 B/s, TB/s = 1e12 B/s, TFLOP/s = 1e12 FLOP/s, µs.

    Raises:
        ProbeError: no CUDA GPU, or ``devices[0]`` is not a visible GPU.
        ValueError: bad arguments.
    """
    if plan is None:
        plan = probe_plan(quick=quick)
    elif not isinstance(plan, ProbePlan):
        raise ValueError(f"plan must be a ProbePlan, got {type(plan).__name__}")
    provs = list(gemm_providers)
    bad = [p for p in provs if p not in GEMM_PROVIDERS]
    if bad or len(set(provs)) != len(provs):
        raise ValueError(f"gemm_providers must be distinct names from {GEMM_PROVIDERS}, got "
                         f"{list(gemm_providers)!r}")
    if (not isinstance(devices, (tuple, list)) or len(devices) != 2
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices)
            or devices[0] == devices[1]):
        raise ValueError(f"devices must be two distinct GPU indices (reader, peer), got "
                         f"{devices!r}")
    if out is not None:
        out = Path(out)
        if out.is_dir():
            raise ValueError(f"out must be a file path, got the directory {str(out)!r}")
    if not torch.cuda.is_available():
        raise ProbeError("moestream probe needs a CUDA GPU (torch.cuda.is_available() is "
                         "False); the simulator's packaged calibration is "
                         "moestream/tools/sim/data/calib_h200x2.json")
    n_gpus = torch.cuda.device_count()
    if devices[0] >= n_gpus:
        raise ProbeError(f"devices[0]={devices[0]} is not a visible GPU ({n_gpus} visible)")
    dev = torch.device("cuda", devices[0])
    peer_dev = torch.device("cuda", devices[1]) if devices[1] < n_gpus else None

    res = ProbeResults(quick=plan.quick, versions=_versions())
    props = torch.cuda.get_device_properties(dev)
    res.num_sms = int(props.multi_processor_count)
    res.device = (f"{n_gpus}x {props.name}" if n_gpus > 1 else props.name) \
        + f", probed on cuda:{dev.index}" + (f" and cuda:{peer_dev.index}" if peer_dev else "")

    steps = (2 + len(plan.cache_read_bytes) + len(plan.grouped_tokens_per_expert) * len(provs)
             + len(plan.host_copy_bytes) + 2 * len(plan.pull_row_bytes)
             + len(plan.pull_programs) + 1)
    from .terminal import progress as make_progress
    bar = make_progress(console, disable=not progress)
    with bar:
        task = bar.add_task("probe", total=steps)
        tick = lambda: bar.advance(task)   # noqa: E731

        def section(name: str, fn: Callable[[], None]) -> None:
            bar.update(task, description=name)
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a failed section keeps the others
                res.errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                bar.console.print(f"[yellow]probe {name} failed:[/] {res.errors[name]}")
            res.timings_s[name] = time.perf_counter() - t0

        def dense() -> None:
            res.dense_bf16_tflops = gpu.dense(plan, dev)
            tick()

        def hbm() -> None:
            res.hbm_copy_tbps = gpu.hbm(plan, dev)
            tick()

        def cache() -> None:
            res.cache_read_bytes = list(plan.cache_read_bytes)
            res.cache_read_tbps = gpu.cache_read(plan, dev, tick)

        res.grouped_tokens_per_expert = list(plan.grouped_tokens_per_expert)

        def g_torch() -> None:
            res.grouped_tflops["torch"], res.grouped_l2_tflops["torch"] = \
                gpu.grouped_torch(plan, dev, tick)

        def g_triton() -> None:
            rates, l2, note = gpu.grouped_triton(plan, dev, tick)
            res.grouped_tflops["triton"] = rates
            res.grouped_l2_tflops["triton"] = l2
            res.notes["grouped_gemm.triton"] = note

        section("dense bf16 matmul", dense)
        section("device copy", hbm)
        section("cache_read", cache)
        if "torch" in provs:
            section("grouped_gemm.torch", g_torch)
        if "triton" in provs:
            section("grouped_gemm.triton", g_triton)
        else:
            res.notes["grouped_gemm.triton"] = "skipped (gemm_providers)"
        torch.cuda.empty_cache()

        def pull_local() -> None:
            res.pull_row_bytes = list(plan.pull_row_bytes)
            res.pull_local_gbps, _ = gpu.pulls(plan, dev, dev, plan.pull_row_bytes, tick)

        section("device_pull.local", pull_local)

        peer_ok = False
        if peer_dev is not None:
            try:
                peer_ok = gpu.enable_peer(dev, peer_dev, res.notes)
            except Exception as exc:  # noqa: BLE001
                res.errors["peer access"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if not peer_ok:
                res.notes["peer"] = (f"cuda:{dev.index} and cuda:{peer_dev.index} have no peer "
                                     f"access: peer figures fall back to one GPU")
        else:
            res.notes["peer"] = "one visible GPU: peer figures fall back to one GPU"
        other = peer_dev if peer_ok else dev

        def host() -> None:
            res.host_copy_bytes = list(plan.host_copy_bytes)
            res.host_copy_gbps, res.host_copy_us = gpu.host_copies(plan, dev, other, tick)
            res.host_copy_peer = peer_ok

        section("host_peer_copy", host)

        def pull_peer() -> None:
            rows = plan.pull_row_bytes if peer_ok else ()
            peer_rates, by_prog = gpu.pulls(plan, dev, other, rows, tick,
                                            programs=plan.pull_programs)
            if peer_ok:
                res.pull_peer_gbps = peer_rates
            res.pull_programs = {"row_bytes": plan.pull_programs_row_bytes,
                                 "programs": list(plan.pull_programs), "gbps": by_prog,
                                 "where": "peer" if peer_ok else "local (no peer)"}

        section("device_pull.peer", pull_peer)

        def flags() -> None:
            res.flag_round_trip_us, res.flag_event_us = gpu.ping_pong(plan, dev, other)
            res.flag_peer = peer_ok
            tick()

        section("flag_round_trip", flags)
        bar.update(task, description="done", completed=steps)

    calib = assemble_calibration(res)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(calib, indent=1) + "\n")
    return calib

