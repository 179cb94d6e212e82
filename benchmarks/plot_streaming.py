"""The plots of docs/streaming.md, from committed measurements (no GPU needed).

    python benchmarks/plot_streaming.py \
        --calib tests/data/calib_probe_quick.json \
        --rows tests/data/ep_final.jsonl --out docs/img

bandwidth_vs_size.png   peer link rate of host-issued copies vs size, and of device-pulled
                        rows (one row per program, the token-granular pull) vs row size
time_vs_granularity.png the fused kernel's layer time per streaming granularity (token,
                        C=128 chunks, whole experts), relative to token mode, per shape and
                        tokens per rank (2x H200, CUDA-graph replays)
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GRANULARITIES = (("fused-graph", "token"), ("chunk128", "C=128"), ("chunkexpert", "expert"))


def bandwidth_vs_size(calib: dict, path: Path) -> None:
    host = calib["host_peer_copy"]
    pull = calib["device_pull"]["by_row_bytes"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(host["bytes"], host["gbps"], "o-", label="host-issued peer copy (one copy)")
    ax.plot(pull["row_bytes"], pull["peer_gbps"], "s-",
            label="device pull, one row per program (peer)")
    ax.plot(pull["row_bytes"], pull["local_gbps"], "^--", label="device pull (local HBM)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes per transfer (copy size, or row size)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"Transfer granularity on {calib.get('device', 'the probed machine')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def time_vs_granularity(rows: list[dict], path: Path) -> None:
    t = defaultdict(dict)
    for r in rows:
        t[(r["shape"], r["tokens_per_rank"])][r["provider"]] = r["median_us"]
    shapes = sorted({s for s, _ in t})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for T in sorted(T for s, T in t if s == shape):
            m = t[(shape, T)]
            if not all(p in m for p, _ in GRANULARITIES):
                continue
            rel = [m[p] / m["fused-graph"] for p, _ in GRANULARITIES]
            ax.plot([g for _, g in GRANULARITIES], rel, "o-",
                    label=f"{T} tok/rank (token {m['fused-graph']:.0f} µs)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{shape}, EP2 (2x H200), fused kernel")
        ax.set_ylabel("layer time / token-mode time")
        ax.set_xlabel("streaming granularity")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calib", default="tests/data/calib_probe_quick.json")
    p.add_argument("--rows", default="tests/data/ep_final.jsonl")
    p.add_argument("--out", default="docs/img")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(a.calib) as f:
        bandwidth_vs_size(json.load(f), out / "bandwidth_vs_size.png")
    with open(a.rows) as f:
        time_vs_granularity([json.loads(line) for line in f if line.strip()],
                            out / "time_vs_granularity.png")
    print(f"plots written to {out}")


if __name__ == "__main__":
    main()
