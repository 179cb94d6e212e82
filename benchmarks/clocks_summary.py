"""Summarise a clocks log of ``benchmarks/device_run.sh`` (CLOCKS=ms): per second and GPU,
the lowest SM clock, the highest power draw and the throttle reasons seen, for the seconds in
which some GPU drew more than --watts (busy seconds only).

    python benchmarks/clocks_summary.py $OUT/clocks.csv

Reasons are nvidia-smi's clocks_event_reasons bits: 0x1 idle, 0x4 software power cap,
0x20 software thermal slowdown, 0x40 hardware thermal slowdown, 0x80 hardware power brake.
"""
from __future__ import annotations

import argparse
import csv
from collections import defaultdict


def summarise(path: str, watts: float) -> list[str]:
    per_second: dict[str, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    with open(path) as f:
        for row in csv.reader(f):
            try:
                gpu = int(row[0])
                second = row[1].split()[1][:8]
                clock = int(row[2].split()[0])
                power = float(row[3].split()[0])
                reason = int(row[5].strip(), 16)
            except (ValueError, IndexError):
                continue   # the header, or a line nvidia-smi could not fill
            per_second[second][gpu].append((clock, power, reason))
    out = []
    for second in sorted(per_second):
        gpus = per_second[second]
        if max(p for samples in gpus.values() for _, p, _ in samples) < watts:
            continue
        parts = []
        for gpu in sorted(gpus):
            s = gpus[gpu]
            reasons = 0
            for _, _, r in s:
                reasons |= r
            parts.append(f"gpu{gpu} {min(c for c, _, _ in s):4d} MHz {max(p for _, p, _ in s):5.0f} W "
                         f"0x{reasons:x}")
        out.append(f"{second}  " + "   ".join(parts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--watts", type=float, default=300.0,
                    help="show seconds in which some GPU drew more than this (default 300)")
    args = ap.parse_args()
    print("\n".join(summarise(args.path, args.watts)))


if __name__ == "__main__":
    main()
