"""Summarise Nsight Compute CSV reports of the GEMM kernels (``benchmarks/device_run.sh ncu``
writes them: ``ncu --csv --page raw``, one row per profiled launch) into the few numbers that
say what bounds a kernel: time, tensor pipe busy (% of active cycles), L2-cache and L1
throughput (% of peak), issue slots used, registers, and the warp stall reasons per issued
instruction (``barrier``: warps held at __syncthreads; ``long_scoreboard``: waiting for a
global/local load; ``wait``: fixed-latency dependencies; ``gmma``: waiting on a warpgroup
MMA).

    python benchmarks/ncu_summary.py $OUT/ncu_*.csv
"""
from __future__ import annotations

import argparse
import csv
import sys

COLUMNS = [  # (label, metric, scale)
    ("us", "gpu__time_duration.sum", 1e-3),
    ("tensor%", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", 1),
    ("L2%", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("L1%", "l1tex__throughput.avg.pct_of_peak_sustained_active", 1),
    ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("regs", "launch__registers_per_thread", 1),
]
STALLS = ("barrier", "long_scoreboard", "wait", "gmma", "mio_throttle", "not_selected",
          "math_pipe_throttle", "dispatch_stall")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def read_report(path: str) -> list[dict]:
    """One dict per profiled launch: kernel, grid, the COLUMNS values and ``stalls``."""
    with open(path, newline="") as f:
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    if len(rows) < 2:
        raise ValueError(f"{path}: no ncu CSV rows (header and units expected)")
    header, launches = rows[0], rows[2:]
    out = []
    for values in launches:
        m = dict(zip(header, values))
        r = {"kernel": m.get("Kernel Name", "?"), "grid": m.get("Grid Size", "?")}
        for label, metric, scale in COLUMNS:
            r[label] = _number(m.get(metric, "nan")) * scale
        r["stalls"] = {s: _number(m.get(
            f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio", "nan"))
            for s in STALLS}
        out.append(r)
    return out


def format_report(path: str, launches: list[dict]) -> str:
    lines = []
    for r in launches:
        vals = " ".join(f"{label}={r[label]:.1f}" for label, _, _ in COLUMNS)
        lines.append(f"{path}: {r['kernel'][:40]} grid {r['grid']} {vals}")
        lines.append("    stalls per issue: " + " ".join(f"{k}={v:.2f}"
                                                        for k, v in r["stalls"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="ncu --csv --page raw outputs")
    args = p.parse_args(argv)
    for path in args.reports:
        print(format_report(path, read_report(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
