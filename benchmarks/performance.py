"""docs/performance.md, its plots and the README's performance table, from the results files.

    python benchmarks/performance.py            # (make performance) rewrite them
    python benchmarks/performance.py --check    # exit 1 where they differ from the files

Reads the canonical results (benchmarks/results/<machine>/<benchmark>.jsonl); every table
names the machine, the versions, the commit and the command that made its rows. Nothing here
measures anything.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moestream.tools.bench import load_rows  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
IMG = ROOT / "docs" / "img"
README_BEGIN = "<!-- performance table: benchmarks/performance.py writes what follows -->"
README_END = "<!-- end of the performance table -->"
SHAPES = ("qwen3", "mixtral", "dsv3", "v4flash")
# the files, and the command that writes each
SOURCES = {
    "ep": ("h200x2/ep.jsonl", "make bench", "2x H200, EP2"),
    "layer": ("h200/layer.jsonl", "make bench-one-gpu", "1x H200"),
    "gemm": ("h200/gemm.jsonl", "make bench-gemm", "1x H200"),
    "hf_layer": ("h200x2/hf_layer.jsonl", "moestream bench-layer", "2x H200, EP2"),
}
DEFAULT = "staged-graph"   # the default path (impl="staged"), replayed from CUDA graphs


def _rows(name: str) -> list[dict]:
    path = RESULTS / SOURCES[name][0]
    return load_rows(path) if path.exists() else []


def _index(rows, *keys):
    return {tuple(r.get(k) for k in keys): r for r in rows}


def _us(v) -> str:
    return "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.1f}")


def _provenance(rows, name: str) -> str:
    """One line: the machine, versions, commits and dates of ``rows``, and the command."""
    path, command, machine = SOURCES[name]
    if not rows:
        return f"*{machine}: no rows yet in `benchmarks/results/{path}` (`{command}`).*"
    pick = lambda k: ", ".join(sorted({str(r.get(k)) for r in rows}))  # noqa: E731
    dates = sorted({str(r.get("date", ""))[:10] for r in rows})
    return (f"*{machine} ({pick('gpu')}), torch {pick('torch')}, triton {pick('triton')}, "
            f"commit {pick('commit')}, {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1
                                                      else "")
            + f"; `benchmarks/results/{path}`, made by `{command}`.*")


def _experts(rows, shape) -> str:
    e = {r.get("experts") for r in rows if r["shape"] == shape}
    return f"{shape} ({e.pop()} experts)" if len(e) == 1 and None not in e else shape


def readme_table() -> str:
    """The README's one table: the default path's µs and its speedup over the torch
    all_to_all + grouped GEMM layer, EP2 on 2x H200 and world size 1 on one H200."""
    ep, one = _rows("ep"), _rows("layer")
    tokens = (1, 8, 512, 2048, 8192)
    lines = ["| machine | shape | dtype | " + " | ".join(f"{t} tok" for t in tokens) + " |",
             "|---|---|---|" + "---|" * len(tokens)]
    for mark, rows in (("¹", ep), ("²", one)):
        at = _index(rows, "shape", "dtype", "tokens_per_rank", "provider")
        machine = SOURCES["ep" if mark == "¹" else "layer"][2]
        for shape in SHAPES:
            for dtype in ("bf16", "fp8"):
                prov = DEFAULT if dtype == "bf16" else f"fp8-{DEFAULT}"
                if not any((shape, dtype, t, prov) in at for t in tokens):
                    continue
                cells = []
                for t in tokens:
                    ours, ref = at.get((shape, dtype, t, prov)), at.get((shape, "bf16", t,
                                                                         "torch"))
                    if ours is None:
                        cells.append("-")
                        continue
                    cell = _us(ours["median_us"])
                    if ref is not None:
                        cell += f" ({ref['median_us'] / ours['median_us']:.1f}x)"
                    cells.append(cell)
                lines.append(f"| {machine}{mark} | {_experts(rows, shape)} | {dtype} | "
                             + " | ".join(cells) + " |")
    notes = [f"{m} {_provenance(r, n)}" for m, r, n in (("¹", ep, "ep"), ("²", one, "layer"))]
    return "\n".join(lines + [""] + [n + "  " for n in notes[:-1]] + notes[-1:])


def _layer_section(name: str, title: str) -> list[str]:
    rows = _rows(name)
    out = [f"## {title}", "", _provenance(rows, name), ""]
    if not rows:
        return out
    at = _index(rows, "shape", "dtype", "tokens_per_rank", "provider")
    tokens = sorted({r["tokens_per_rank"] for r in rows})
    out += ["Median µs per layer call (CUDA-graph replays), the floor "
            "(max of compute, weight reads and link) and efficiency = floor / time of the "
            "default path. `fused`: `impl=\"fused\"`, the persistent launch. The weight "
            "floor counts the experts uniform routing is expected to touch; a run whose "
            "routing touched fewer can beat it (efficiency above 1).", ""]
    out += ["| shape | dtype | path | " + " | ".join(f"{t}" for t in tokens) + " |",
            "|---|---|---|" + "---|" * len(tokens)]
    for shape in SHAPES:
        for dtype in ("bf16", "fp8", "fp4w"):
            pre = "" if dtype == "bf16" else f"{dtype}-"
            for label, prov in (("staged (default)", f"{pre}staged-graph"),
                                ("fused", f"{pre}fused-graph"), ("torch", "torch")):
                if prov == "torch" and dtype != "bf16":
                    continue
                got = [at.get((shape, dtype, t, prov)) for t in tokens]
                if not any(got):
                    continue
                out.append(f"| {_experts(rows, shape)} | {dtype} | {label} | "
                           + " | ".join(_us(g["median_us"]) if g else "-" for g in got) + " |")
            floor = [at.get((shape, dtype, t, f"{pre}staged-graph")) for t in tokens]
            if any(floor):
                out.append(f"| | {dtype} | floor (efficiency) | " + " | ".join(
                    f"{_us(g['floor_us'])} ({g['efficiency']:.2f})" if g else "-"
                    for g in floor) + " |")
    chunks = sorted({r["provider"] for r in rows if r["provider"].startswith("chunk")})
    if chunks:
        out += ["", "Chunked streaming (the fused launch pulling C tokens at a time) next to "
                "token streaming, same run:", "",
                "| shape | tokens | fused (token) | " + " | ".join(chunks) + " |",
                "|---|---|---|" + "---|" * len(chunks)]
        for shape in SHAPES:
            for t in tokens:
                got = [at.get((shape, "bf16", t, p)) for p in chunks]
                if any(got):
                    tok = at.get((shape, "bf16", t, "fused-graph"))
                    out.append(f"| {shape} | {t} | {_us(tok['median_us']) if tok else '-'} | "
                               + " | ".join(_us(g["median_us"]) if g else "-" for g in got)
                               + " |")
    return out


def _gemm_section() -> list[str]:
    rows = _rows("gemm")
    out = ["## The grouped GEMMs alone", "", _provenance(rows, "gemm"), ""]
    if not rows:
        return out
    variants = (("bf16", "ours:layer-call"), ("fp8", "ours:fp8-layer-call"),
                ("fp4w", "ours:fp4w-layer-call"))
    out += ["Each GEMM as the layer launches it for the call in bf16, fp8 and fp4w (an "
            "expanded fp4w call includes its expansion) against `torch._grouped_mm` (bf16) on "
            "the same data: median µs, TFLOP/s, and the weight bytes each format reads.", "",
            "| shape | GEMM | rows/expert | " + " | ".join(f"{d} µs (TFLOP/s)" for d, _ in variants)
            + " | torch µs | weight MB " + " / ".join(d for d, _ in variants) + " |",
            "|---|---|---|" + "---|" * (len(variants) + 2)]
    at = _index([r for r in rows if "tokens_per_expert" in r], "shape", "kernel",
                "tokens_per_expert", "provider")
    ms = sorted({k[2] for k in at})
    for shape in SHAPES:
        for kernel in ("l1", "l2"):
            for m in ms:
                got = [at.get((shape, kernel, m, p)) for _, p in variants]
                ref = at.get((shape, kernel, m, "torch:_grouped_mm"))
                if not any(got):
                    continue
                cells = [f"{_us(g['median_us'])} ({g['tflops_per_gpu']:.0f})" if g else "-"
                         for g in got]
                mb = [f"{g['weight_bytes'] / 1e6:.0f}" if g and g.get("weight_bytes") else "-"
                      for g in got]
                out.append(f"| {shape} | {kernel.upper()} | {m} | " + " | ".join(cells)
                           + f" | {_us(ref['median_us']) if ref else '-'} | "
                           + " / ".join(mb) + " |")
    dense = [r for r in rows if r["provider"] == "torch:_scaled_mm"]
    if dense:
        out += ["", f"Dense fp8 rate (`torch._scaled_mm`, 8192^3): "
                    f"{max(r['tflops_per_gpu'] for r in dense):.0f} TFLOP/s."]
    return out


def _hf_section() -> list[str]:
    rows = _rows("hf_layer")
    out = ["## One transformers decoder layer", "", _provenance(rows, "hf_layer"), ""]
    if not rows:
        return out
    out += ["A whole decoder layer of the model (attention, norms, router, experts) as "
            "transformers runs it and with its experts replaced by moestream "
            "(docs/integrations.md).", "",
            "| model | phase | tokens/rank | provider | median µs | vs transformers |",
            "|---|---|---|---|---|---|"]
    for r in rows:
        sp = r.get("speedup_vs_transformers")
        out.append(f"| {r['shape']} | {r.get('phase', '-')} | {r['tokens_per_rank']} | "
                   f"{r['provider']} | {_us(r['median_us'])} | "
                   f"{f'{sp:.2f}x' if sp else '-'} |")
    return out


def _plots(*, write: bool) -> list[str]:
    """The plots' Markdown lines; ``write``: draw the PNGs too."""
    from moestream.tools.bench import plot_rows
    out = []
    for name, stem, title in (("ep", "perf_ep_h200x2", "EP2 on 2x H200, bf16, CUDA graphs"),
                              ("layer", "perf_layer_h200", "one H200, world size 1")):
        rows = [r for r in _rows(name) if not r["provider"].startswith("chunk")]
        if rows:
            if write:
                plot_rows(rows, IMG / f"{stem}.png", title=title)
            out.append(f"![{title}](img/{stem}.png)")
    return out


def performance_doc(*, write_plots: bool) -> str:
    parts = ["# Performance", "",
             "Generated by `benchmarks/performance.py` (`make performance`) from the results "
             "files under `benchmarks/results/`; do not edit by hand. Floors and the timing "
             "protocol: `moestream.tools.bench` (median of 20 CUDA-event timed calls after a "
             "warm-up, inputs rotated, the slowest rank reported).", "",
             "## Summary", "", "The default path's µs per layer call and its speedup over "
             "all_to_all + `torch._grouped_mm` + all_to_all:", "", readme_table(), ""]
    parts += _plots(write=write_plots) + [""]
    parts += _layer_section("ep", "The layer across two GPUs (EP2)") + [""]
    parts += _layer_section("layer", "The layer on one GPU (world size 1)") + [""]
    parts += _gemm_section() + [""] + _hf_section() + [""]
    return "\n".join(parts)


def _with_readme_table(text: str) -> str:
    head, sep, rest = text.partition(README_BEGIN)
    if not sep:
        raise SystemExit(f"README.md has no line {README_BEGIN!r}")
    _, sep, tail = rest.partition(README_END)
    if not sep:
        raise SystemExit(f"README.md has no line {README_END!r}")
    return f"{head}{README_BEGIN}\n{readme_table()}\n{README_END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 where docs/performance.md or the README's "
                        "table differ from what the results files give")
    args = p.parse_args(argv)
    doc = performance_doc(write_plots=not args.check)
    readme = _with_readme_table(README.read_text())
    if args.check:
        stale = [str(f.relative_to(ROOT)) for f, text in ((DOC, doc), (README, readme))
                 if not f.exists() or f.read_text() != text]
        for name in stale:
            print(f"{name} is stale: run make performance", file=sys.stderr)
        return 1 if stale else 0
    DOC.write_text(doc)
    README.write_text(readme)
    print(f"wrote {DOC.relative_to(ROOT)}, the README's table and docs/img/perf_*.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
