"""Calibration: the measured figures of one machine that the simulator's rates come from.

The numbers live in a JSON file (``moestream/data/calib_h200x2.json`` is the packaged default,
measured on this project's 2x H200 pair; see shared/BENCHMARKS.md). Schema
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

__all__ = ["Calibration", "DEFAULT_CALIBRATION", "SCHEMA"]

SCHEMA = "moestream.calib/1"
DEFAULT_CALIBRATION = "calib_h200x2.json"


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"calibration {name} must be a positive number, got {value!r}")
    return float(value)


def _positive_list(name: str, values: Any) -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"calibration {name} must be a non-empty list of numbers, got {values!r}")
    return tuple(_positive(f"{name}[{i}]", v) for i, v in enumerate(values))


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
                device=str(d.get("device", "")), source=str(d.get("source", "")), path=path)
        except KeyError as exc:
            raise ValueError(f"calibration is missing the key {exc.args[0]!r} (schema "
                             f"{SCHEMA}: see moestream.sim.calib)") from None

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Calibration":
        """Load a calibration JSON file; ``None`` loads the packaged 2x H200 calibration."""
        if path is None:
            ref = resources.files("moestream") / "data" / DEFAULT_CALIBRATION
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
        }

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
