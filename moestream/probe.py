"""``moestream probe``: measure this machine's calibration for the simulator.

GPU micro-benchmarks whose results fill a calibration file in the schema of
``moestream.sim.calib`` (``"schema": "moestream.calib/1"``), so that
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
                            ``moestream.bench_kernels.bench_gemm`` (variant ``layer-call``);
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

Every timing uses CUDA events (``moestream.bench.time_cuda``: warm-up calls first, the median of
>= 10 calls), except the flag round trip, timed inside the kernel (CUDA events also bracket its
launches and are reported next to it). Every spin in a kernel is bounded (``timeout_s`` of wall
time and a poll count); nothing here can hang the GPU.

With one GPU (or no peer access between the first two) the peer parts fall back to the same GPU
(a local device copy, a local pull, two kernels on two streams of one GPU) and the file says so
(``probe.fallbacks`` and ``note``): such a file describes no link. A section that fails keeps the
packaged calibration's value for its keys, listed in ``probe.not_measured``.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .kernels._common import next_pow2, now_ns, tl, triton
from .sim.calib import SCHEMA, Calibration

__all__ = ["ProbeError", "ProbePlan", "ProbeResults", "probe_plan", "run_probe",
           "assemble_calibration", "calibration_table", "reread", "GEMM_PROVIDERS"]

GEMM_PROVIDERS = ("torch", "triton")
# the grouped GEMM of the calibration: dsv3's L1 (gate and up), 32 local experts
_GROUPED_DIMS = dict(hidden=7168, intermediate=2048, experts=32)
_TRITON_VARIANT = "layer-call"   # the L1 as the layer launches it for each call
# the packaged calibration's device-pull row (7 KB): the schema keeps one row size
SCHEMA_ROW_BYTES = 7168


class ProbeError(RuntimeError):
    """The probe cannot run here (no CUDA GPU, ...); the message says why."""


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
    d = _GROUPED_DIMS
    gnote = (f"bf16, {d['experts']} experts, N={2 * d['intermediate']}, K={d['hidden']} (the dsv3 "
             f"L1 GEMM), FLOP/s counted on the valid rows; torch = torch._grouped_mm, triton = "
             f"moestream's L1 kernel (bench_kernels variant {_TRITON_VARIANT})")
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


# ---- Triton kernels ---------------------------------------------------------------------------
@triton.jit
def _pull_rows_kernel(src_table, dst, idx, n_rows, ROW_WORDS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """dst[i] = src[idx[i]] for rows i = program, program + programs, ...

    src_table: int64[1], the address of src, an int32 [*, ROW_WORDS] buffer (any GPU's, or a
    peer's mapped over NVLink); dst: int32 [n_rows, ROW_WORDS]; idx: int32 [n_rows].
    """
    i = tl.program_id(0)
    step = tl.num_programs(0)
    src = tl.load(src_table).to(tl.int64).to(tl.pointer_type(tl.int32))
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW_WORDS
    while i < n_rows:   # a while loop: bounds from program_id (also runs in the interpreter)
        s = tl.load(idx + i).to(tl.int64)
        v = tl.load(src + s * ROW_WORDS + offs, mask=mask)
        tl.store(dst + i.to(tl.int64) * ROW_WORDS + offs, v, mask=mask)
        i += step


@triton.jit
def _reread_kernel(src, out, n_words, slice_words, rounds, BLOCK: tl.constexpr):
    """out[program] = fp32 sum of ``rounds`` reads of one slice of ``src`` (fp32 [n_words]) per
    round: in round r, program p reads slice (p + r) mod programs of ``slice_words`` words, so
    no program re-reads what its own SM's L1 holds, and the loads skip L1 anyway (``.cg``).
    ``slice_words`` is a multiple of BLOCK (whole, aligned blocks: 16-byte vector loads)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(rounds):
        base = tl.multiple_of(((pid + r) % nprog).to(tl.int64) * slice_words, BLOCK)
        for off in range(0, slice_words, BLOCK):
            idx = base + off + tl.arange(0, BLOCK)
            acc += tl.load(src + idx, mask=idx < n_words, other=0.0, cache_modifier=".cg")
    tl.store(out + pid, tl.sum(acc, axis=0))


def reread(src: torch.Tensor, *, rounds: int, programs: int,
           out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """Per-program sums of ``rounds`` full reads of ``src`` (fp32 [n]) by ``_reread_kernel``
    with ``programs`` programs (fp32 [programs]); ``out.sum()`` is ``rounds * src.sum()`` up
    to fp32 rounding."""
    if src.dtype != torch.float32 or src.dim() != 1 or not src.is_contiguous():
        raise ValueError("src must be a contiguous fp32 [n] tensor")
    for name, v in (("rounds", rounds), ("programs", programs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if out is None:
        out = torch.empty(programs, dtype=torch.float32, device=src.device)
    n = src.numel()
    slice_words = -(-n // (programs * block)) * block   # whole blocks per program
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        _reread_kernel[(programs,)](src, out, n, slice_words, rounds, BLOCK=block, num_warps=4)
    return out


# not specialised on the counts: the zero-round-trip launch that compiles each side must
# compile the very kernel the timed launches run (no compilation while the other side waits)
@triton.jit(do_not_specialize=["round_trips", "warmup_round_trips", "max_spins", "timeout_ns"])
def _ping_pong_kernel(table, out, round_trips, warmup_round_trips, max_spins, timeout_ns,
                      INITIATOR: tl.constexpr, USE_TIMER: tl.constexpr):
    """One side of a flag ping-pong; launch one program per side.

    table: int64[2]: [0] the address of the int32 flag this side polls (in its own memory),
    [1] the address of the flag it writes (the other side's). The initiator writes i, then
    waits for i back; the responder waits for i, then writes i back (i = 1, 2, ...). Each wait
    is bounded by ``timeout_ns`` (global timer) and ``max_spins`` polls.
    out: int64[3]: ns spent on the round trips after the warm-up ones, round trips done, ok.
    """
    mine = tl.load(table).to(tl.pointer_type(tl.int32))
    theirs = tl.load(table + 1).to(tl.pointer_type(tl.int32))
    total = round_trips + warmup_round_trips
    ok = 1
    i = 1
    t_start = now_ns(USE_TIMER)
    while (i <= total) & (ok == 1):
        t_start = tl.where(i == warmup_round_trips + 1, now_ns(USE_TIMER), t_start)
        if INITIATOR:
            tl.atomic_xchg(theirs, i, sem="release", scope="sys")
        v = tl.atomic_add(mine, 0, sem="acquire", scope="sys")
        spins = 0
        t0 = now_ns(USE_TIMER)
        while (v < i) & (spins < max_spins):
            v = tl.atomic_add(mine, 0, sem="acquire", scope="sys")
            spins += 1
            if now_ns(USE_TIMER) - t0 > timeout_ns:
                spins = max_spins
        ok = tl.where(v >= i, 1, 0)
        if not INITIATOR:
            if ok == 1:
                tl.atomic_xchg(theirs, i, sem="release", scope="sys")
        i += 1
    t_end = now_ns(USE_TIMER)
    tl.store(out, (t_end - t_start).to(tl.int64))
    tl.store(out + 1, (i - 2 + ok).to(tl.int64))   # round trips completed
    tl.store(out + 2, ok.to(tl.int64))


def pull_rows(src: torch.Tensor, idx: torch.Tensor, *, out: torch.Tensor | None = None,
              programs: int | None = None, src_address: int | None = None) -> torch.Tensor:
    """``out[i] = src[idx[i]]`` by ``_pull_rows_kernel`` (rows of int32; ``src`` is read
    through its address, so it may live on another GPU with peer access enabled).

    Args:
        src: int32 [rows, W] contiguous (any device reachable from ``idx``'s device).
        idx: int32 [n] row ids on the launching device.
        out: optional int32 [n, W] on ``idx``'s device.
        programs: grid size (default n: one row per program).
        src_address: read from this address instead of ``src.data_ptr()`` (same layout).
    """
    if src.dtype != torch.int32 or src.dim() != 2 or not src.is_contiguous():
        raise ValueError("src must be a contiguous int32 [rows, W] tensor")
    if idx.dtype != torch.int32 or idx.dim() != 1:
        raise ValueError("idx must be an int32 [n] tensor")
    n, w = idx.numel(), src.shape[1]
    dev = idx.device
    if out is None:
        out = torch.empty(n, w, dtype=torch.int32, device=dev)
    table = torch.tensor([src.data_ptr() if src_address is None else src_address],
                         dtype=torch.int64, device=dev)
    _launch_pull(table, out, idx, programs)
    return out


def _launch_pull(table: torch.Tensor, out: torch.Tensor, idx: torch.Tensor,
                 programs: int | None) -> None:
    n, w = out.shape
    grid = (max(1, min(n, programs or n)),)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        _pull_rows_kernel[grid](table, out, idx, n, ROW_WORDS=w, BLOCK=next_pow2(w),
                                num_warps=4)


# ---- measurements (GPU) ------------------------------------------------------------------
def _median_us(fn: Callable[[], Any], plan: ProbePlan, device: torch.device) -> float:
    from .bench import time_cuda
    with torch.cuda.device(device):
        t = time_cuda(fn, warmup=plan.warmup, reps=plan.reps)
        torch.cuda.synchronize(device)
    return float(t["median_us"])


def _dense(plan: ProbePlan, dev: torch.device) -> float:
    n = plan.dense_n
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=g, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    us = _median_us(lambda: torch.mm(a, b, out=c), plan, dev)
    return 2.0 * n ** 3 / us / 1e6


def _hbm(plan: ProbePlan, dev: torch.device) -> float:
    src = torch.randint(0, 255, (plan.hbm_copy_bytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = _median_us(lambda: dst.copy_(src), plan, dev)
    return 2.0 * plan.hbm_copy_bytes / us / 1e6          # read + write, TB/s


def _cache_read(plan: ProbePlan, dev: torch.device, tick: Callable[[], None]) -> list[float]:
    """TB/s of ``reread`` (read bytes counted) for each of ``plan.cache_read_bytes``, with four
    programs per SM; each size's sums are checked once against torch's."""
    programs = 4 * torch.cuda.get_device_properties(dev).multi_processor_count
    rates = []
    for nbytes in plan.cache_read_bytes:
        n = nbytes // 4
        src = (torch.arange(n, device=dev) % 7).to(torch.float32)   # exact small sums
        out = torch.empty(programs, dtype=torch.float32, device=dev)
        reread(src, rounds=plan.cache_read_rounds, programs=programs, out=out)
        want = plan.cache_read_rounds * float(src.double().sum())
        if abs(float(out.double().sum()) - want) > 1e-5 * want:
            raise ProbeError(f"cache re-read of {nbytes} B summed {float(out.sum())}, want {want}")
        us = _median_us(lambda: reread(src, rounds=plan.cache_read_rounds, programs=programs,
                                       out=out), plan, dev)
        rates.append(nbytes * plan.cache_read_rounds / us / 1e6)
        del src
        tick()
    return rates


def _grouped_torch(plan: ProbePlan, dev: torch.device,
                   tick: Callable[[], None]) -> tuple[list[float], list[float]]:
    """TFLOP/s of torch._grouped_mm for the L1 GEMM [E*M, H] x [E, H, 2I] and the L2 GEMM
    [E*M, I] x [E, I, H], per rows per expert M."""
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
    d = _GROUPED_DIMS
    H, I, E = d["hidden"], d["intermediate"], d["experts"]  # noqa: E741 - the paper's names
    g = torch.Generator(device=dev).manual_seed(0)
    # as moestream.bench_kernels builds them: weights drawn on the GPU, [E, 2I, H], scaled
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device=dev) * I ** -0.5).bfloat16()
    l1, l2 = [], []
    for M in plan.grouped_tokens_per_expert:
        x = torch.randn(E * M, H, generator=g, device=dev).bfloat16()   # packed, no padding
        a = torch.randn(E * M, I, generator=g, device=dev).bfloat16()
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * M
        fn = functools.partial(torch._grouped_mm, x, w13.transpose(-2, -1), offs=offs)
        l1.append(2.0 * E * M * H * 2 * I / _median_us(fn, plan, dev) / 1e6)
        fn = functools.partial(torch._grouped_mm, a, w2.transpose(-2, -1), offs=offs)
        l2.append(2.0 * E * M * I * H / _median_us(fn, plan, dev) / 1e6)
        tick()
    return l1, l2


def _grouped_triton(plan: ProbePlan, dev: torch.device,
                    tick: Callable[[], None]) -> tuple[list[float], list[float], str]:
    """TFLOP/s of moestream's L1 and L2 kernels (``bench_gemm``, one virtual rank), and a
    note."""
    from .bench_kernels import VARIANTS, bench_gemm
    if _TRITON_VARIANT not in VARIANTS:
        raise RuntimeError(f"moestream.bench_kernels has no variant {_TRITON_VARIANT!r}")
    with torch.cuda.device(dev):
        rows = bench_gemm(shape="dsv3", tokens_per_expert=list(plan.grouped_tokens_per_expert),
                          experts_per_rank=_GROUPED_DIMS["experts"], virtual_ranks=1,
                          variants=[_TRITON_VARIANT], warmup=plan.warmup, reps=plan.reps,
                          progress=tick)
    ours = {r["tokens_per_expert"]: r for r in rows
            if r.get("kernel") == "l1" and r.get("provider") == f"ours:{_TRITON_VARIANT}"}
    ours_l2 = {r["tokens_per_expert"]: r for r in rows
               if r.get("kernel") == "l2" and r.get("provider") == f"ours:{_TRITON_VARIANT}"}
    missing = [m for m in plan.grouped_tokens_per_expert if m not in ours]
    if missing:
        raise RuntimeError(f"bench_gemm returned no L1 row for rows per expert {missing}")
    errs = [ours[m].get("l1_rel_error") for m in plan.grouped_tokens_per_expert]
    worst = max((e for e in errs if isinstance(e, (int, float))), default=None)
    note = f"bench_gemm L1 rows (variant {_TRITON_VARIANT}); worst L1 rel error vs torch {worst}"
    if worst is not None and worst > 0.05:
        raise RuntimeError(f"the L1 kernel disagrees with torch (rel error {worst:.2e}); not timed")
    ms = plan.grouped_tokens_per_expert
    l2 = [float(ours_l2[m]["tflops_per_gpu"]) for m in ms] if all(m in ours_l2 for m in ms) \
        else []
    return [float(ours[m]["tflops_per_gpu"]) for m in ms], l2, note


def _copy_all(views: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for d, s in views:
        d.copy_(s)


def _host_copies(plan: ProbePlan, src_dev: torch.device, dst_dev: torch.device,
                 tick: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Per size: (GB/s, µs per copy) of ``dst.copy_(src)`` from src_dev to dst_dev, n copies of
    distinct slices per timed call (the copy runs on the source device's current stream)."""
    gbps, us_per = [], []
    for size in plan.host_copy_bytes:
        n = max(1, min(plan.host_copy_max_batch, plan.host_copy_batch_bytes // size))
        src = torch.randint(0, 255, (n * size,), dtype=torch.uint8, device=src_dev)
        dst = torch.empty(n * size, dtype=torch.uint8, device=dst_dev)
        views = [(dst[i * size:(i + 1) * size], src[i * size:(i + 1) * size]) for i in range(n)]
        us = _median_us(functools.partial(_copy_all, views), plan, src_dev) / n
        torch.cuda.synchronize(dst_dev)
        if not torch.equal(dst[:size].to(src_dev), src[:size]):
            raise RuntimeError(f"copy of {size} bytes from {src_dev} to {dst_dev} is wrong")
        us_per.append(us)
        gbps.append(size / us / 1e3)
        tick()
    return gbps, us_per


def _pulls(plan: ProbePlan, reader: torch.device, holder: torch.device, row_bytes: Sequence[int],
           tick: Callable[[], None], *, programs: Sequence[int] = ()) -> tuple[list[float],
                                                                               list[float]]:
    """GB/s (read bytes) of ``_pull_rows_kernel`` launched on ``reader`` pulling rows from a
    buffer on ``holder``: one row per program per row size, then a persistent-grid sweep over
    ``programs`` at ``plan.pull_programs_row_bytes``. The first pull is checked."""
    words = plan.pull_total_bytes // 4
    g = torch.Generator(device=holder).manual_seed(1)
    src_all = torch.randint(-2**31, 2**31 - 1, (words,), generator=g, dtype=torch.int32,
                            device=holder)
    dst_all = torch.empty(words, dtype=torch.int32, device=reader)

    def rate(rb: int, progs: int | None, check: bool) -> float:
        w = rb // 4
        n = words // w
        src = src_all[:n * w].view(n, w)
        dst = dst_all[:n * w].view(n, w)
        idx = torch.randperm(n, device=reader).to(torch.int32)
        table = torch.tensor([src.data_ptr()], dtype=torch.int64, device=reader)
        fn = functools.partial(_launch_pull, table, dst, idx, progs)   # no host work timed
        fn()
        torch.cuda.synchronize(reader)
        if check:
            want = src[idx.to(holder).long()].to(reader)
            if not torch.equal(dst, want):
                raise RuntimeError(f"pulled rows from {holder} on {reader} are wrong")
        us = _median_us(fn, plan, reader)
        return n * rb / us / 1e3

    by_row = []
    for j, rb in enumerate(row_bytes):
        by_row.append(rate(rb, None, j == 0))
        tick()
    by_prog = []
    for p in programs:
        by_prog.append(rate(plan.pull_programs_row_bytes, p, False))
        tick()
    return by_row, by_prog


def _ping_pong(plan: ProbePlan, dev_a: torch.device, dev_b: torch.device) -> tuple[float, float]:
    """(round trip µs from the in-kernel timer, µs per round trip from CUDA events around the
    initiator's launch), medians over ``plan.flag_launches`` launches.

    The initiator runs on dev_a and polls a flag in dev_a's memory; the responder on dev_b
    polls one in dev_b's memory; each writes the other's flag. On one device the two kernels
    run on two streams."""
    same = dev_a == dev_b
    flag_a = torch.zeros(32, dtype=torch.int32, device=dev_a)
    flag_b = torch.zeros(32, dtype=torch.int32, device=dev_b)
    tab_a = torch.tensor([flag_a.data_ptr(), flag_b.data_ptr()], dtype=torch.int64, device=dev_a)
    tab_b = torch.tensor([flag_b.data_ptr(), flag_a.data_ptr()], dtype=torch.int64, device=dev_b)
    out_a = torch.zeros(3, dtype=torch.int64, device=dev_a)
    out_b = torch.zeros(3, dtype=torch.int64, device=dev_b)
    with torch.cuda.device(dev_a):
        stream_a = torch.cuda.Stream(dev_a)
    with torch.cuda.device(dev_b):
        stream_b = torch.cuda.Stream(dev_b)
    timeout_ns = int(plan.timeout_s * 1e9)
    spins = 2**31 - 1

    def launch(n: int, warm: int, initiator: bool) -> None:
        dev, tab, out, st = (dev_a, tab_a, out_a, stream_a) if initiator else \
            (dev_b, tab_b, out_b, stream_b)
        with torch.cuda.device(dev), torch.cuda.stream(st):
            _ping_pong_kernel[(1,)](tab, out, n, warm, spins, timeout_ns, INITIATOR=initiator,
                                    USE_TIMER=True, num_warps=1)

    def sync() -> None:
        torch.cuda.synchronize(dev_a)
        if not same:
            torch.cuda.synchronize(dev_b)

    # compile both sides first (zero round trips: nothing waits), so that neither side waits
    # for the other's compilation
    launch(0, 0, True)
    launch(0, 0, False)
    sync()
    kernel_us, event_us = [], []
    n, warm = plan.flag_round_trips, plan.flag_warmup_round_trips
    for _ in range(plan.flag_launches):
        flag_a.zero_()
        flag_b.zero_()
        out_a.zero_()
        out_b.zero_()
        sync()
        launch(n, warm, False)               # the responder first: it waits for round trip 1
        with torch.cuda.device(dev_a):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream_a)
            launch(n, warm, True)
            end.record(stream_a)
        sync()
        a, b = out_a.tolist(), out_b.tolist()
        if not (a[2] == 1 and b[2] == 1):
            raise RuntimeError(f"flag ping-pong timed out after {plan.timeout_s} s (initiator "
                               f"ok={a[2]}, responder ok={b[2]})")
        kernel_us.append(a[0] / 1e3 / n)
        event_us.append(start.elapsed_time(end) * 1e3 / (n + warm))
    return statistics.median(kernel_us), statistics.median(event_us)


def _cudart_enable_peer(a: torch.device, b: torch.device) -> str:
    """Best effort: ``cudaDeviceEnablePeerAccess`` from a to b through the CUDA runtime torch
    loaded. "enabled" (it was not yet), "already" (torch had enabled it), "failed (code)", or
    "unknown" (no runtime library found)."""
    import ctypes
    lib = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            continue
    if lib is None or not hasattr(lib, "cudaDeviceEnablePeerAccess"):
        return "unknown"
    with torch.cuda.device(a):
        torch.cuda.synchronize(a)
        lib.cudaSetDevice(ctypes.c_int(a.index))   # torch's guard restores its device after
        code = int(lib.cudaDeviceEnablePeerAccess(ctypes.c_int(b.index), ctypes.c_uint(0)))
    if code == 704:                 # cudaErrorPeerAccessAlreadyEnabled
        lib.cudaGetLastError()      # clear it, so torch does not see a stale error
        return "already"
    return "enabled" if code == 0 else f"failed ({code})"


def _enable_peer(a: torch.device, b: torch.device, notes: dict[str, str]) -> bool:
    """Whether a and b can read each other's memory. Enables peer access both ways: torch does
    on the first copy between two devices (its allocator also maps its expandable segments
    for the peer then); the CUDA runtime is then asked directly, which confirms it (or enables
    it where torch did not); its answer is only noted (a runtime other than torch's may answer
    for another state). Checked with a copy each way."""
    if not (torch.cuda.can_device_access_peer(a.index, b.index)
            and torch.cuda.can_device_access_peer(b.index, a.index)):
        return False
    x = torch.arange(1024, dtype=torch.int32, device=a)
    y = x.to(b)
    z = y.to(a)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)
    states = [_cudart_enable_peer(a, b), _cudart_enable_peer(b, a)]
    notes["peer access"] = (f"cudaDeviceEnablePeerAccess after torch's copies: "
                            f"cuda:{a.index}->cuda:{b.index} {states[0]}, "
                            f"cuda:{b.index}->cuda:{a.index} {states[1]}")
    return bool(torch.equal(x, z))


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
                         "moestream/data/calib_h200x2.json")
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
            res.dense_bf16_tflops = _dense(plan, dev)
            tick()

        def hbm() -> None:
            res.hbm_copy_tbps = _hbm(plan, dev)
            tick()

        def cache() -> None:
            res.cache_read_bytes = list(plan.cache_read_bytes)
            res.cache_read_tbps = _cache_read(plan, dev, tick)

        res.grouped_tokens_per_expert = list(plan.grouped_tokens_per_expert)

        def g_torch() -> None:
            res.grouped_tflops["torch"], res.grouped_l2_tflops["torch"] = \
                _grouped_torch(plan, dev, tick)

        def g_triton() -> None:
            rates, l2, note = _grouped_triton(plan, dev, tick)
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
            res.pull_local_gbps, _ = _pulls(plan, dev, dev, plan.pull_row_bytes, tick)

        section("device_pull.local", pull_local)

        peer_ok = False
        if peer_dev is not None:
            try:
                peer_ok = _enable_peer(dev, peer_dev, res.notes)
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
            res.host_copy_gbps, res.host_copy_us = _host_copies(plan, dev, other, tick)
            res.host_copy_peer = peer_ok

        section("host_peer_copy", host)

        def pull_peer() -> None:
            peer_rates, by_prog = _pulls(plan, dev, other, plan.pull_row_bytes if peer_ok else (),
                                         tick, programs=plan.pull_programs)
            if peer_ok:
                res.pull_peer_gbps = peer_rates
            res.pull_programs = {"row_bytes": plan.pull_programs_row_bytes,
                                 "programs": list(plan.pull_programs), "gbps": by_prog,
                                 "where": "peer" if peer_ok else "local (no peer)"}

        section("device_pull.peer", pull_peer)

        def flags() -> None:
            res.flag_round_trip_us, res.flag_event_us = _ping_pong(plan, dev, other)
            res.flag_peer = peer_ok
            tick()

        section("flag_round_trip", flags)
        bar.update(task, description="done", completed=steps)

    calib = assemble_calibration(res)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(calib, indent=1) + "\n")
    return calib

