"""A/B of the working tree against an earlier commit in one device call, runs in the order
base, new, new, base (ABBA) so that power capping, which favours whichever runs first,
weighs on both sides alike.

On the CPU machine, copy the commit's package to benchmarks/.ab/<commit>/ (ignored by git:
hand it to the device tool's ``carry``, e.g. carry=["benchmarks/.ab"]):

    python benchmarks/ab_commits.py prepare 9ca2c9d

On the device machine (the arguments after ``--`` go to ``moestream bench``, without --out):

    python3 benchmarks/ab_commits.py run --base 9ca2c9d --out $OUT/ab.jsonl -- \\
        --shapes qwen3,dsv3 --tokens 2048,8192 --impl staged,fused

A base whose CLI predates the current options takes its own arguments (``--base-args``, one
string) and is run from whichever of ``moestream.tools.cli`` / ``moestream.cli`` it has.

Each base run starts in the base's own folder: ``python -m`` puts the current directory
first on sys.path, so PYTHONPATH alone would import the working tree's package. Every run
prints the file its moestream came from. The rows get a ``code`` field ("base <commit>" or
"new") and ``ab_run`` (0-3); the table gives the median of each side's medians and new / base.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AB_DIR = ROOT / "benchmarks" / ".ab"
ORDER = ("base", "new", "new", "base")
KEY = ("shape", "ranks", "tokens_per_rank", "dtype", "provider", "kernel")   # kernel: GEMM rows
_WHERE = "import moestream; print(moestream.__file__)"


def prepare(commit: str, *, into: Path = AB_DIR) -> Path:
    """The commit's ``moestream`` package under ``into``/<commit>/ (``git archive``)."""
    dest = into / commit
    if (dest / "moestream").is_dir():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "moestream"],
                             capture_output=True, check=False)
    if archive.returncode:
        raise ValueError(f"git archive {commit} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (shape, ranks, tokens, dtype, provider, kernel) that both sides measured
    (``kernel`` is None in EP rows): the median over each side's runs of their median times,
    and new / base."""
    sides: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        side = "base" if str(r["code"]).startswith("base") else "new"
        sides.setdefault(tuple(r.get(k) for k in KEY), {"base": [], "new": []})[side].append(
            float(r["median_us"]))
    out = []
    for key, got in sides.items():
        if not got["base"] or not got["new"]:
            continue
        base, new = statistics.median(got["base"]), statistics.median(got["new"])
        out.append({**dict(zip(KEY, key)), "base_us": base, "new_us": new,
                    "new_over_base": new / base, "runs": (len(got["base"]), len(got["new"]))})
    return out


def format_summary(entries: list[dict]) -> str:
    lines = [f"{'shape':8s} {'tokens':>6s} {'provider':24s} {'base us':>9s} {'new us':>9s} "
             f"{'new/base':>8s}"]
    for e in entries:
        what = e["provider"] + (f" {e['kernel']}" if e["kernel"] else "")
        lines.append(f"{e['shape']:8s} {e['tokens_per_rank']:6d} {what:24s} "
                     f"{e['base_us']:9.1f} {e['new_us']:9.1f} {e['new_over_base']:8.3f}")
    return "\n".join(lines)


def cli_module(root: Path) -> str:
    """The CLI module of the package under ``root``."""
    return ("moestream.tools.cli" if (root / "moestream" / "tools" / "cli.py").is_file()
            else "moestream.cli")


def run(commit: str, out: str, bench_args: list[str], timeout: int, *,
        base_args: list[str] | None = None, into: Path = AB_DIR) -> list[dict]:
    """``moestream bench`` with ``bench_args`` four times (ORDER), the base from
    ``into``/<commit>; each run's rows (with ``code`` and ``ab_run``) are appended to ``out``
    as soon as it ends. Each run is a fresh process (its own start-up and kernel compiles:
    about 90 s for two shapes on a fresh H200 machine)."""
    base = into / commit
    if not (base / "moestream").is_dir():
        raise ValueError(f"{base}/moestream is missing: run 'ab_commits.py prepare {commit}' "
                         f"on the CPU machine first (the folder travels with the tree)")
    if any(a == "--out" or a.startswith("--out=") for a in bench_args + (base_args or [])):
        raise ValueError("pass --out to ab_commits.py, not to moestream bench")
    rows: list[dict] = []
    for i, side in enumerate(ORDER):
        cwd = base if side == "base" else ROOT
        env = {**os.environ, "PYTHONPATH": str(cwd)}
        where = subprocess.run([sys.executable, "-c", _WHERE], cwd=cwd, env=env,
                               capture_output=True, text=True, check=True)
        print(f"[ab {i} {side}] moestream from {where.stdout.strip()}", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
            part = f.name
        args = base_args if side == "base" and base_args is not None else bench_args
        res = subprocess.run([sys.executable, "-m", cli_module(cwd), "bench", *args,
                              "--out", part], cwd=cwd, env=env, timeout=timeout)
        if res.returncode:
            raise RuntimeError(f"run {i} ({side}) exited with {res.returncode}")
        code = f"base {commit}" if side == "base" else "new"
        with open(part) as f:
            got = [{**json.loads(line), "code": code, "ab_run": i} for line in f if line.strip()]
        os.unlink(part)
        with open(out, "a") as f:   # after each run: a call cut short keeps the runs it finished
            for r in got:
                f.write(json.dumps(r) + "\n")
        rows += got
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="copy a commit's package to benchmarks/.ab/<commit>")
    p.add_argument("commit")
    r = sub.add_parser("run", help="base, new, new, base; moestream bench arguments after --")
    r.add_argument("--base", required=True, help="the commit given to prepare")
    r.add_argument("--out", required=True, help="JSON-lines file the rows are appended to")
    r.add_argument("--timeout", type=int, default=300, help="seconds per bench run")
    r.add_argument("--base-args", default=None,
                   help="the base's moestream bench arguments, one string (default: the same)")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(prepare(args.commit))
        return
    if not bench_args:
        ap.error("give the moestream bench arguments after --")
    base_args = shlex.split(args.base_args) if args.base_args is not None else None
    print(format_summary(summarize(run(args.base, args.out, bench_args, args.timeout,
                                       base_args=base_args))))


if __name__ == "__main__":
    main()
