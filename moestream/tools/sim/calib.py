"""Calibration: the measured figures of one machine that the simulator's rates come from.

The numbers live in a JSON file (``moestream/tools/sim/data/calib_h200x2.json`` is the packaged
default, measured on a 2x H200 pair; see docs/simulator.md). Schema
(``"schema": "moestream.calib/1"``; every rate is per GPU, GB/s = 1e9 bytes/s)::

    num_sms              int    streaming multiprocessors per GPU
    dense_bf16_tflops    float  large dense bf16 matmul rate
    hbm_copy_tbps        float  device-to-device copy rate, read + write bytes counted
    grouped_gemm.tokens_per_expert  [int]   rows per expert of the grouped-GEMM probes (ascending)
    grouped_gemm.tflops.<provider>  [float] rate at those rows ("torch", "triton", ...)
    host_peer_copy.bytes [int], host_peer_copy.gbps [float]  host-issued peer copies by size
    device_pull.row_bytes, device_pull.peer_gbps, device_pull.local_gbps
                         Triton kernel pulling rows of row_bytes from the peer / from local HBM
    flag_round_trip_us   float  cross-GPU flag ping-pong through symmetric memory

Optional (read by the fused-kernel execution model only, ``moestream.tools.sim.fused``)::

    fused_kernel.l1_tflops_per_sm, .l1_fixed_us    L1 block (BM x 2*BN1 x H): fixed + FLOP/rate
    fused_kernel.l2_tflops_per_sm, .l2_fixed_us    L2 block (BM x BN2 x I): fixed + FLOP/rate
    fused_kernel.dispatch_local_gbps               one program's dispatch rate, local source
                                                   (bytes read + bytes written)
    fused_kernel.dispatch_remote_read_gbps         one program's read rate from a peer
    fused_kernel.combine_gbps                      one program's combine rate (read + written)
    fused_kernel.ticket_overhead_us                gap between two tickets of one program
    fused_kernel.launch_early_claims               launch race: second claims among the first P
    fused_kernel.dispatch_programs_per_sm          token-mode dispatch tasks per call / SMs (0.5)
    fused_kernel.call_fixed_us.<family>            per-call fixed cost ("graph": CUDA-graph
                                                   replay of publish, signal, layout, fused)
    fused_kernel.weight_gbps_per_sm                optional; default hbm_copy_tbps / num_sms

A file without ``fused_kernel`` gets the packaged 2x H200 derivation
(``moestream/tools/sim/data/calib_h200x2_fused.json``, written by
``python -m moestream.tools.sim.derive``) when the fused model asks for it (:meth:`Calibration.fused_kernel`).

Keys such as ``device``, ``source`` and ``note`` are free text and ignored by the model.
``math.inf`` rates are allowed in code (``dataclasses.replace``) to build analytic limits.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

import numpy as np

__all__ = ["Calibration", "FusedKernelCalib", "DEFAULT_CALIBRATION", "FUSED_CALIBRATION",
           "SCHEMA"]

SCHEMA = "moestream.calib/1"
DEFAULT_CALIBRATION = "calib_h200x2.json"
FUSED_CALIBRATION = "calib_h200x2_fused.json"


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"calibration {name} must be a positive number, got {value!r}")
    return float(value)


def _positive_list(name: str, values: Any) -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"calibration {name} must be a non-empty list of numbers, got {values!r}")
    return tuple(_positive(f"{name}[{i}]", v) for i, v in enumerate(values))


def _rate(name: str, value: Any) -> float:
    """A positive rate; ``math.inf`` allowed (analytic limits)."""
    return _positive(name, value)


def _nonneg(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"calibration {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _points(items: Any) -> tuple[tuple[str, int, int, str], ...]:
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"calibration fused_kernel.calibration_points must be a list, got "
                         f"{items!r}")
    try:
        return tuple((str(p["shape"]), int(p["ranks"]), int(p["tokens_per_rank"]),
                      str(p["provider"])) for p in items)
    except (KeyError, TypeError, ValueError):
        raise ValueError("calibration fused_kernel.calibration_points items need shape, ranks, "
                         "tokens_per_rank and provider") from None


@dataclass(frozen=True)
class FusedKernelCalib:
    """Rates of the fused persistent kernel's tasks, per program (one program per SM).

    Every figure is derived from kernel traces and micro-benchmarks by
    ``moestream.tools.sim.derive`` (see docs/simulator.md "The fused-kernel model"). Units: TFLOP/s
    per SM, GB/s (1e9 B/s) per program, µs. ``math.inf`` rates are allowed in code to build
    analytic limits.

    l1_tflops_per_sm / l1_fixed_us: an L1 block (BM rows x BN1 gate + BN1 up columns, K = H)
        computes in ``l1_fixed_us + 2*BM*2*BN1*H / rate``.
    l2_tflops_per_sm / l2_fixed_us: an L2 block (BM x BN2, K = I), the same form.
    dispatch_local_gbps: bytes a dispatch task moves per µs from its own rank's tokens
        (each token read once, written to each of its pool rows; read + written bytes).
    dispatch_remote_read_gbps: a dispatch task's read rate from a peer's tokens (its pool
        writes still go at ``dispatch_local_gbps``).
    combine_gbps: a combine task's rate (top-k rows read + the output row written).
    ticket_overhead_us: time between the end of one ticket and the start of the next on a
        program (ticket bookkeeping).
    launch_early_claims: programs whose second launch claim lands before the last programs'
        first claim (a launch race: such a program runs two of the first P tickets in a row).
    dispatch_programs_per_sm: token mode sizes dispatch tasks so that ``round(num_sms * this)``
        tasks cover a call (``Fused.dispatch_programs``: 0.5 in the kernel the calibration
        traces ran, 1.0 in the current default); a fact of the traced kernel version, kept
        with its rates.
    call_fixed_us: per-call fixed cost by provider family (``"graph"``: a CUDA-graph replay of
        the publish, signal and layout launches and the fused launch).
    weight_gbps_per_sm: HBM rate one SM gets when every SM streams weights (None: the
        calibration's ``hbm_copy_tbps / num_sms``).
    calibration_points: (shape, ranks, tokens_per_rank, provider) of the measured rows the
        fixed cost was calibrated on (validation reports them apart, not as validation).
    """

    l1_tflops_per_sm: float
    l2_tflops_per_sm: float
    dispatch_local_gbps: float
    dispatch_remote_read_gbps: float
    combine_gbps: float
    ticket_overhead_us: float = 0.0
    launch_early_claims: int = 0
    dispatch_programs_per_sm: float = 0.5
    l1_fixed_us: float = 0.0
    l2_fixed_us: float = 0.0
    call_fixed_us: Mapping[str, float] = field(default_factory=dict)
    weight_gbps_per_sm: float | None = None
    source: str = ""
    calibration_points: tuple[tuple[str, int, int, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("l1_tflops_per_sm", "l2_tflops_per_sm", "dispatch_local_gbps",
                     "dispatch_remote_read_gbps", "combine_gbps"):
            _rate(f"fused_kernel.{name}", getattr(self, name))
        for name in ("ticket_overhead_us", "l1_fixed_us", "l2_fixed_us"):
            _nonneg(f"fused_kernel.{name}", getattr(self, name))
        if isinstance(self.dispatch_programs_per_sm, bool) or not isinstance(
                self.dispatch_programs_per_sm, (int, float)) \
                or not 0 < self.dispatch_programs_per_sm <= 64:
            raise ValueError(f"calibration fused_kernel.dispatch_programs_per_sm must be in "
                             f"(0, 64], got {self.dispatch_programs_per_sm!r}")
        e = self.launch_early_claims
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ValueError(f"calibration fused_kernel.launch_early_claims must be an int >= 0, "
                             f"got {e!r}")
        if not isinstance(self.call_fixed_us, Mapping):
            raise ValueError(f"calibration fused_kernel.call_fixed_us must map family -> µs, "
                             f"got {self.call_fixed_us!r}")
        for k, v in self.call_fixed_us.items():
            _nonneg(f"fused_kernel.call_fixed_us.{k}", v)
        if self.weight_gbps_per_sm is not None:
            _rate("fused_kernel.weight_gbps_per_sm", self.weight_gbps_per_sm)

    _KEYS = ("l1_tflops_per_sm", "l2_tflops_per_sm", "dispatch_local_gbps",
             "dispatch_remote_read_gbps", "combine_gbps")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FusedKernelCalib":
        if not isinstance(d, Mapping):
            raise ValueError(f"calibration fused_kernel must be an object, got {d!r}")
        missing = [k for k in cls._KEYS if k not in d]
        if missing:
            raise ValueError(f"calibration is missing the key 'fused_kernel.{missing[0]}' "
                             f"(schema {SCHEMA}: see moestream.tools.sim.calib)")
        fixed = d.get("call_fixed_us", {})
        if not isinstance(fixed, Mapping):
            raise ValueError(f"calibration fused_kernel.call_fixed_us must map family -> µs, "
                             f"got {fixed!r}")
        return cls(**{k: d[k] for k in cls._KEYS},
                   ticket_overhead_us=d.get("ticket_overhead_us", 0.0),
                   launch_early_claims=d.get("launch_early_claims", 0),
                   dispatch_programs_per_sm=d.get("dispatch_programs_per_sm", 0.5),
                   l1_fixed_us=d.get("l1_fixed_us", 0.0), l2_fixed_us=d.get("l2_fixed_us", 0.0),
                   call_fixed_us={str(k): v for k, v in fixed.items()},
                   weight_gbps_per_sm=d.get("weight_gbps_per_sm"),
                   source=str(d.get("source", "")),
                   calibration_points=_points(d.get("calibration_points", [])))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in self._KEYS}
        out.update(ticket_overhead_us=self.ticket_overhead_us,
                   launch_early_claims=self.launch_early_claims,
                   dispatch_programs_per_sm=self.dispatch_programs_per_sm,
                   l1_fixed_us=self.l1_fixed_us,
                   l2_fixed_us=self.l2_fixed_us, call_fixed_us=dict(self.call_fixed_us))
        if self.weight_gbps_per_sm is not None:
            out["weight_gbps_per_sm"] = self.weight_gbps_per_sm
        if self.source:
            out["source"] = self.source
        if self.calibration_points:
            out["calibration_points"] = [dict(zip(("shape", "ranks", "tokens_per_rank",
                                                   "provider"), p))
                                         for p in self.calibration_points]
        return out


@dataclass(frozen=True)
class Calibration:
    """Measured rates of one GPU type and its peer link (see the module docstring for units).

    Build with :meth:`load` (a JSON file, default the packaged H200 pair) or :meth:`from_dict`.
    """

    num_sms: int
    dense_bf16_tflops: float
    hbm_copy_tbps: float
    grouped_tokens_per_expert: tuple[float, ...]
    grouped_tflops: Mapping[str, tuple[float, ...]]
    host_copy_bytes: tuple[float, ...]
    host_copy_gbps: tuple[float, ...]
    device_pull_row_bytes: float
    device_pull_peer_gbps: float
    device_pull_local_gbps: float
    flag_round_trip_us: float
    device: str = ""
    source: str = ""
    path: str | None = field(default=None, compare=False)
    fused: FusedKernelCalib | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int) or self.num_sms <= 0:
            raise ValueError(f"calibration num_sms must be a positive int, got {self.num_sms!r}")
        m = self.grouped_tokens_per_expert
        if any(b <= a for a, b in zip(m, m[1:])):
            raise ValueError(f"calibration grouped_gemm.tokens_per_expert must be strictly "
                             f"ascending, got {list(m)}")
        if not self.grouped_tflops:
            raise ValueError("calibration grouped_gemm.tflops needs at least one provider")
        for prov, rates in self.grouped_tflops.items():
            if len(rates) != len(m):
                raise ValueError(f"calibration grouped_gemm.tflops.{prov} has {len(rates)} "
                                 f"rates for {len(m)} tokens_per_expert points")
        if len(self.host_copy_bytes) != len(self.host_copy_gbps):
            raise ValueError(f"calibration host_peer_copy has {len(self.host_copy_bytes)} sizes "
                             f"and {len(self.host_copy_gbps)} rates; they must pair up")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str | None = None) -> "Calibration":
        """A calibration from the JSON object described in the module docstring."""
        if d.get("schema") != SCHEMA:
            raise ValueError(f"calibration schema must be {SCHEMA!r}, got {d.get('schema')!r}")
        try:
            gg, hc, dp = d["grouped_gemm"], d["host_peer_copy"], d["device_pull"]
            tflops = gg["tflops"]
            if not isinstance(tflops, Mapping):
                raise ValueError("calibration grouped_gemm.tflops must map provider -> rates")
            return cls(
                num_sms=d["num_sms"],
                dense_bf16_tflops=_positive("dense_bf16_tflops", d["dense_bf16_tflops"]),
                hbm_copy_tbps=_positive("hbm_copy_tbps", d["hbm_copy_tbps"]),
                grouped_tokens_per_expert=_positive_list("grouped_gemm.tokens_per_expert",
                                                         gg["tokens_per_expert"]),
                grouped_tflops={str(k): _positive_list(f"grouped_gemm.tflops.{k}", v)
                                for k, v in tflops.items()},
                host_copy_bytes=_positive_list("host_peer_copy.bytes", hc["bytes"]),
                host_copy_gbps=_positive_list("host_peer_copy.gbps", hc["gbps"]),
                device_pull_row_bytes=_positive("device_pull.row_bytes", dp["row_bytes"]),
                device_pull_peer_gbps=_positive("device_pull.peer_gbps", dp["peer_gbps"]),
                device_pull_local_gbps=_positive("device_pull.local_gbps", dp["local_gbps"]),
                flag_round_trip_us=_positive("flag_round_trip_us", d["flag_round_trip_us"]),
                device=str(d.get("device", "")), source=str(d.get("source", "")), path=path,
                fused=(FusedKernelCalib.from_dict(d["fused_kernel"]) if "fused_kernel" in d
                       else None))
        except KeyError as exc:
            raise ValueError(f"calibration is missing the key {exc.args[0]!r} (schema "
                             f"{SCHEMA}: see moestream.tools.sim.calib)") from None

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Calibration":
        """Load a calibration JSON file; ``None`` loads the packaged 2x H200 calibration."""
        if path is None:
            ref = resources.files("moestream.tools.sim") / "data" / DEFAULT_CALIBRATION
            return cls.from_dict(json.loads(ref.read_text()), path=str(ref))
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"calibration file {str(p)!r} does not exist")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"calibration file {str(p)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data, path=str(p))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "device": self.device, "source": self.source,
            "num_sms": self.num_sms, "dense_bf16_tflops": self.dense_bf16_tflops,
            "hbm_copy_tbps": self.hbm_copy_tbps,
            "grouped_gemm": {"tokens_per_expert": list(self.grouped_tokens_per_expert),
                             "tflops": {k: list(v) for k, v in self.grouped_tflops.items()}},
            "host_peer_copy": {"bytes": list(self.host_copy_bytes),
                               "gbps": list(self.host_copy_gbps)},
            "device_pull": {"row_bytes": self.device_pull_row_bytes,
                            "peer_gbps": self.device_pull_peer_gbps,
                            "local_gbps": self.device_pull_local_gbps},
            "flag_round_trip_us": self.flag_round_trip_us,
            **({"fused_kernel": self.fused.to_dict()} if self.fused is not None else {}),
        }

    def fused_kernel(self) -> FusedKernelCalib:
        """The fused-kernel rates: this file's ``fused_kernel`` section, else the packaged
        2x H200 derivation (``moestream/tools/sim/data/calib_h200x2_fused.json``)."""
        if self.fused is not None:
            return self.fused
        ref = resources.files("moestream.tools.sim") / "data" / FUSED_CALIBRATION
        fk = json.loads(ref.read_text()).get("fused_kernel")
        if fk is None:
            raise ValueError(f"the packaged {FUSED_CALIBRATION} has no fused_kernel section")
        return FusedKernelCalib.from_dict(fk)

    def weight_gbps_per_sm(self) -> float:
        """HBM rate of one SM while every SM streams weights (GB/s)."""
        fk = self.fused_kernel()
        if fk.weight_gbps_per_sm is not None:
            return fk.weight_gbps_per_sm
        return self.hbm_copy_tbps * 1e3 / self.num_sms

    # ---- derived rates --------------------------------------------------------------------
    @property
    def gemm_providers(self) -> tuple[str, ...]:
        """Names accepted by :meth:`gemm_tflops`: the grouped-GEMM curves plus ``"dense"``."""
        return tuple(self.grouped_tflops) + ("dense",)

    def gemm_tflops(self, tokens_per_expert: np.ndarray | float, *, provider: str) -> np.ndarray:
        """Whole-GPU GEMM rate (TFLOP/s, on valid rows) for experts of the given row counts.

        ``provider="dense"`` is the dense matmul rate at every size (no weight-streaming
        limit: an analytic reference, not a prediction). A grouped curve is interpolated
        linearly in log2(rows) between the measured points, held flat above the largest, and
        capped by the weight-streaming roofline ``rows x hbm_copy_tbps``: a GEMM of M rows does
        M FLOP per weight byte whatever N and K are, so the cap (and the whole curve, which
        depends on rows only) carries over to every shape. Below the smallest point the time
        stays that point's (weight bound), so the rate falls in proportion to the rows.
        """
        m = np.asarray(tokens_per_expert, dtype=np.float64)
        if provider == "dense":
            return np.full(m.shape, self.dense_bf16_tflops)
        if provider not in self.grouped_tflops:
            raise ValueError(f"unknown GEMM provider {provider!r}; known: "
                             f"{list(self.gemm_providers)}")
        pts = np.asarray(self.grouped_tokens_per_expert)
        rates = np.asarray(self.grouped_tflops[provider])
        if not np.all(np.isfinite(rates)):
            # an infinite curve is an analytic limit: every size is infinitely fast
            return np.full(m.shape, math.inf)
        safe = np.maximum(m, 1e-30)
        out = np.interp(np.log2(np.clip(safe, pts[0], pts[-1])), np.log2(pts), rates)
        out = np.where(m < pts[0], rates[0] * safe / pts[0], out)
        return np.minimum(out, safe * self.hbm_copy_tbps)

    def host_copy_model(self) -> tuple[float, float]:
        """(start-up µs, GB/s) of host-issued peer copies: t(b) = startup + b / rate.

        The rate is the largest copy's (the asymptote); the start-up minimises the squared
        relative error over all measured sizes (weights 1/t make the small copies count).
        """
        b = np.asarray(self.host_copy_bytes)
        gbps = np.asarray(self.host_copy_gbps)
        t = b / (gbps * 1e3)
        rate = float(gbps[np.argmax(b)])
        x, y = 1.0 / t, 1.0 - b / (rate * 1e3 * t)
        startup = max(0.0, float((x * y).sum() / (x * x).sum()))
        return startup, rate
