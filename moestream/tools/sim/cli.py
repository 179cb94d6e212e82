"""``moestream simulate``: token vs chunk streaming of one MoE layer, on the CPU.

Wire it into the main command with ``add_parser(subparsers)`` (it sets ``func=run``), or run
it alone: ``python -m moestream.tools.sim.cli --shape dsv3 --ranks 64 --tokens 128 --link rdma``.
``--validate ROWS.jsonl`` compares the model with measured ``moestream bench`` rows instead
(``moestream.tools.sim.validate``).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from ...config import SHAPES
from ..terminal import nonnegative_int, positive_int

__all__ = ["add_parser", "add_arguments", "run", "run_validate", "main", "parse_chunks"]

_DESCRIPTION = (
    "Discrete-event model of one expert-parallel MoE layer on R ranks: dispatch pulls at token "
    "granularity or in chunks of C tokens, the L1/L2 GEMM blocks as their rows arrive, the "
    "combine back. Prints layer time, link utilisation and overlap for token vs chunk "
    "granularity. Model output, calibrated on a 2x H200 pair; not a measurement.")


def parse_chunks(text: str, *, block_m: int) -> list[int | str]:
    """``"64,256,expert"`` -> [64, 256, "expert"]; ``block_m`` stands for the config's block_m."""
    from .plan import parse_granularity

    out: list[int | str] = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        if item == "block_m":
            out.append(block_m)
            continue
        try:
            g = parse_granularity(item)
        except ValueError:
            raise ValueError(f"--chunks items must be positive ints, 'block_m' or 'expert' "
                             f"(token is always included), got {item!r}") from None
        if g != "token":
            out.append(g)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .links import LINK_KINDS

    p.add_argument("--shape", default="dsv3", choices=sorted(SHAPES),
                   help="model shape (routed experts), default dsv3")
    p.add_argument("--ranks", type=positive_int, default=8,
                   help="expert-parallel ranks R (default 8)")
    p.add_argument("--tokens", type=nonnegative_int, default=128,
                   help="tokens per rank T (default 128)")
    p.add_argument("--link", default="nvlink", choices=LINK_KINDS,
                   help="fabric: nvlink (device pulls), nvlink-copy (host-issued copies), "
                        "rdma (8-GPU NVLink nodes + RDMA), nvl72 (72-GPU NVLink-5 racks + RDMA)")
    p.add_argument("--chunks", default="block_m,256,expert",
                   help="chunk granularities compared with token: ints (tokens per message), "
                        "'block_m', 'expert' (default block_m,256,expert)")
    p.add_argument("--comm-sms", type=positive_int, default=16,
                   help="SMs that issue transfers and reduce (the rest run GEMMs), default 16")
    p.add_argument("--gemm", default="triton", choices=("triton", "torch", "dense"),
                   help="GEMM rate: grouped-GEMM curve (triton, torch) or dense (default triton)")
    p.add_argument("--routing", default="uniform", choices=("uniform", "skewed"),
                   help="uniform top-k, or skewed (hot expert 0 in a share skew*K of tokens)")
    p.add_argument("--skew", type=float, default=0.3, help="hot-expert share for --routing skewed")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="routing seed (default 0)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8,
                   help="NVLink domain size of the rdma fabric (default 8)")
    p.add_argument("--dispatch-order", default="pool", choices=("pool", "source"),
                   help="pull order: pool (expert by expert, Mega MoE) or source (rank by rank)")
    p.add_argument("--exec", dest="execution", default="auto", choices=("auto", "stream", "fused"),
                   help="execution model: stream (dedicated comm SMs, standalone GEMM rates: "
                        "what a persistent kernel could do) or fused (the project's fused "
                        "kernel as built: every program takes dispatch, GEMM and combine "
                        "tickets in order, rates from kernel traces, per-call fixed cost). "
                        "auto: stream for simulations; with --validate, fused for the fused "
                        "and chunked providers and stream for staged ones")
    p.add_argument("--programs", type=positive_int, default=None,
                   help="--exec fused: programs per rank (default one per SM)")
    p.add_argument("--calib", default=None, help="calibration JSON (default: packaged 2x H200)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="also save a PNG of layer time vs granularity")
    p.add_argument("--validate", default=None, action="append", metavar="ROWS.jsonl",
                   help="instead: compare the model with measured rows of `moestream bench` "
                        "(JSON lines; repeat for several files). Uses --calib, --link, "
                        "--comm-sms, --gemm, --seed, --dispatch-order, --skew (for skewed rows "
                        "without one) and --json; shape, ranks and tokens come from the rows")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to a ``moestream`` argparse subparsers object; it sets
    ``fn`` (and ``func``) to :func:`run`."""
    p = subparsers.add_parser("simulate", help="discrete-event model: token vs chunk streaming",
                              description=_DESCRIPTION)
    add_arguments(p)
    # the moestream command dispatches on args.fn; func is argparse's usual name
    p.set_defaults(fn=run, func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the comparison the arguments describe; print the table. Returns an exit status."""
    from ..terminal import console as make_console

    from ...config import MoEConfig
    from .calib import Calibration
    from .model import compare

    if getattr(args, "validate", None):
        return run_validate(args)
    console = make_console()
    try:
        calib = Calibration.load(args.calib)
        cfg = MoEConfig.from_shape(args.shape, max_tokens_per_rank=max(1, args.tokens))
        chunks = parse_chunks(args.chunks, block_m=cfg.block_m)
        execution = getattr(args, "execution", "auto")
        if execution == "fused":
            kw = dict(execution="fused", programs=getattr(args, "programs", None))
        else:
            kw = dict(comm_sms=args.comm_sms, gemm=args.gemm,
                      dispatch_order=args.dispatch_order)
        cmp = compare(granularities=chunks, shape=args.shape, ranks=args.ranks,
                      tokens_per_rank=args.tokens, link=args.link, calib=calib,
                      routing=args.routing, skew=args.skew, seed=args.seed,
                      gpus_per_node=args.gpus_per_node, **kw)
    except ValueError as exc:
        print(f"moestream simulate: error: {exc}", file=sys.stderr)
        return 2
    console.print(cmp.to_table())
    console.print(cmp.footer())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cmp.to_dict(), f, indent=1)
        console.print(f"rows written to {args.json}")
    if args.plot:
        cmp.plot(args.plot)
        console.print(f"plot written to {args.plot}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    """``--validate``: the model against measured rows; prints the table and the share of
    rows within 20%. Returns an exit status (2 for bad input)."""
    from ..terminal import console as make_console

    from .calib import Calibration
    from .validate import load_rows, skip_reason, summarize, validate, validation_table

    console = make_console()
    try:
        calib = Calibration.load(args.calib)
        rows = load_rows(args.validate)
        results = validate(rows, calib=calib, link=args.link, comm_sms=args.comm_sms,
                           gemm=args.gemm, seed=args.seed, dispatch_order=args.dispatch_order,
                           skew=args.skew, execution=getattr(args, "execution", "auto"))
    except ValueError as exc:
        print(f"moestream simulate: error: {exc}", file=sys.stderr)
        return 2
    skipped: dict[str, int] = {}
    for r in rows:
        why = skip_reason(r)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
    execution = getattr(args, "execution", "auto")
    models = {"auto": "fused-kernel model for fused/chunked rows, stream model for staged",
              "fused": "fused-kernel model", "stream": "stream model"}[execution]
    title = (f"simulator ({models}; {args.link}, stream: {args.comm_sms} comm SMs, GEMM "
             f"{args.gemm}; calibration {calib.device or calib.path}) vs "
             f"{', '.join(args.validate)}")
    for note in validation_table(results, console=console, title=title):
        console.print(note, markup=False)
    s = summarize(results)
    if s["rows"]:
        console.print(f"[bold]{s['within_20pct']} of {s['rows']} rows within 20% "
                      f"({s['fraction_within_20pct']:.0%})[/]; measured / model: median "
                      f"{s['median_ratio']:.2f}, range {s['min_ratio']:.2f} .. "
                      f"{s['max_ratio']:.2f}")
        for prov, b in s["by_provider"].items():
            console.print(f"  {prov}: {b['within_20pct']} of {b['rows']} within 20%, "
                          f"measured / model median {b['median_ratio']:.2f} "
                          f"({b['min_ratio']:.2f} .. {b['max_ratio']:.2f})")
    else:
        console.print("no row to compare")
    if s["calibration_points"]:
        console.print(f"{s['calibration_points']} row(s) marked calib. are the calibration "
                      f"points of the per-call fixed cost, not counted")
    for why, n in skipped.items():
        console.print(f"skipped {n} row(s): {why}")
    console.print("Model output vs measurements; the stream model has no per-call fixed cost, "
                  "the fused-kernel model a calibrated one; see docs/simulator.md "
                  "\"Validation\".")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": s, "rows": results, "skipped": skipped}, f, indent=1)
        console.print(f"rows written to {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moestream.tools.sim.cli", description=_DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
