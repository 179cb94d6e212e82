"""Markdown tables of token vs chunk comparisons (the tables in docs/simulator.md).

``python -m moestream.tools.sim.report --shape dsv3 --tokens 128`` prints the EP8/EP64/EP256 x
nvlink/rdma/nvl72 grid; every number is model output.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .links import LINK_KINDS
from .model import compare

__all__ = ["grid", "main"]


def grid(*, shape: str, tokens_per_rank: int, ranks: Sequence[int] = (8, 64, 256),
         links: Sequence[str] = ("nvlink", "rdma", "nvl72"), **kwargs) -> str:
    """One markdown row per (ranks, link): layer time of each granularity and its ratio to
    token, plus token's link utilisation and overlap. Other arguments go to ``compare``."""
    lines: list[str] = []
    header: list[str] | None = None
    for R in ranks:
        for link in links:
            cmp = compare(shape=shape, ranks=R, tokens_per_rank=tokens_per_rank, link=link,
                          **kwargs)
            rows = cmp.rows()
            if header is None:
                header = (["EP", "link"] + [f"{r['granularity']} us" for r in rows]
                          + ["token util / overlap", "floors compute / link (token)"])
                lines += ["| " + " | ".join(header) + " |",
                          "|" + "---|" * len(header)]
            cells = [str(R), link, f"{rows[0]['layer_us']:.0f}"]
            cells += [f"{r['layer_us']:.0f} ({r['vs_token']:.2f}x)" for r in rows[1:]]
            cells += [f"{rows[0]['link_util']:.0%} / {rows[0]['overlap']:.0%}",
                      f"{rows[0]['compute_floor_us']:.0f} / {rows[0]['link_floor_us']:.0f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moestream.tools.sim.report", description=__doc__)
    p.add_argument("--shape", default="dsv3")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--ranks", default="8,64,256")
    p.add_argument("--links", default="nvlink,rdma,nvl72")
    p.add_argument("--comm-sms", type=int, default=16)
    args = p.parse_args(argv)
    links = [s for s in args.links.split(",") if s]
    for link in links:
        if link not in LINK_KINDS:
            print(f"error: unknown link kind {link!r}; known: {list(LINK_KINDS)}", file=sys.stderr)
            return 2
    try:
        print(grid(shape=args.shape, tokens_per_rank=args.tokens,
                   ranks=[int(r) for r in args.ranks.split(",") if r], links=links,
                   comm_sms=args.comm_sms))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
