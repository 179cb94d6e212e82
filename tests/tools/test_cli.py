"""The command line: bad values are usage errors, help names what is valid, output fits the
terminal, and benchmark rows update one canonical file per benchmark and machine."""
from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from moestream import SHAPES
from moestream.tools.bench import load_rows, result_row, results_path, update_rows
from moestream.tools.cli import build_parser, main
from moestream.tools.terminal import MissingExtraError, print_table, progress, require


@pytest.mark.parametrize("argv", [
    ["run", "--tokens", "-5"],        # negative tokens per rank
    ["run", "--tokens", "0"],         # 0 used to mean "default"
    ["run", "--ranks", "-1"],         # a value the user gave, reported as given
    ["run", "--ranks", "0"],
    ["run", "--ranks", "two"],        # not an integer
    ["bench", "--shapes", "dsv3,gpt"],
    ["bench", "--tokens", "1,-8"],
    ["bench", "--dtype", "bf16,fp16"],   # a format the layer has not
    ["bench", "--granularity", "token,0"],
    ["bench", "--baselines", "torch,nccl"],
    ["bench", "--reps", "0"],
    ["trace", "--granularity", "0"],
    ["trace", "--shape", "llama"],
    ["simulate", "--ranks", "0"],
    ["bench-layer", "--reps", "-1"],
])
def test_bad_values_are_usage_errors_naming_the_option(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    option = next(a for a in argv if a.startswith("--"))
    assert f"argument {option}" in err
    assert "Traceback" not in err


def test_bad_values_are_reported_as_given(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--ranks", "-1"])
    assert "-1" in capsys.readouterr().err


def test_help_names_every_command_and_the_valid_shapes_and_options(capsys):
    with pytest.raises(SystemExit):     # argparse lists the valid commands in its error
        main(["no-such-command"])
    err = capsys.readouterr().err
    commands = err[err.index("choose from") + len("choose from"):].strip(" )\n").split(", ")
    commands = [c.strip("'") for c in commands]
    assert {"run", "bench", "trace", "simulate"} <= set(commands)
    top = build_parser().format_help()
    for name in commands:
        assert f"moestream {name}" in top, name
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    bench = capsys.readouterr().out
    for shape in SHAPES:
        assert shape in bench
    flat = " ".join(bench.split())
    for option in ("--impl", "--dtype", "--graph", "--no-graph", "--granularity", "--per-stage",
                   "--tuning", "--baselines"):
        assert option in flat, option


def test_progress_bar_stays_on_one_line_at_narrow_widths():
    for width in (40, 80, 100):
        buf = io.StringIO()
        con = Console(file=buf, width=width, force_terminal=True)
        with progress(con) as prog:
            task = prog.add_task("a description much longer than the narrowest terminal", total=9)
            prog.advance(task, 4)
        lines = [ln for ln in buf.getvalue().replace("\r", "\n").split("\n") if ln.strip()]
        from rich.text import Text
        assert all(Text.from_ansi(ln).cell_len <= width for ln in lines)


def test_wide_tables_split_by_columns_without_cutting_a_cell():
    cols = [("shape", "left"), ("provider", "left")] + [(f"figure {i}", "right")
                                                        for i in range(12)]
    rows = [["qwen3", "staged-graph"] + [f"{1000.5 + i:.1f}" for i in range(12)],
            ["mixtral", "fused-graph"] + [f"{2000.5 + i:.1f}" for i in range(12)]]
    buf = io.StringIO()
    tables = print_table(Console(file=buf, width=60), title="t", columns=cols, rows=rows,
                         keys=(0, 1))
    text = buf.getvalue()
    assert len(tables) > 1
    assert all(len(line) <= 60 for line in text.splitlines())
    for row in rows:
        for cell in row:
            assert cell in text
    # every part repeats the columns that name the row
    assert text.count("staged-graph") == len(tables)


def test_missing_extra_names_the_pip_command():
    with pytest.raises(MissingExtraError, match=r"pip install 'moestream\[plot\]'"):
        require("moestream_no_such_module", extra="plot", why="the plot")


def _row(provider, median, **extra):
    return result_row(shape="qwen3", ranks=2, tokens_per_rank=8, dtype="bf16",
                      provider=provider, median_us=median, p20_us=median * 0.9,
                      p80_us=median * 1.1, **extra)


def test_rows_carry_versions_commit_and_date():
    row = _row("staged-graph", 100.0)
    for key in ("gpu", "torch", "triton", "commit", "date", "floor_us", "efficiency"):
        assert key in row
    # an experts field changes the floor: fewer experts, fewer weight bytes to read
    assert _row("staged-graph", 100.0, experts=32)["floor_us"] < row["floor_us"]


def test_update_rows_replaces_a_point_and_keeps_the_others(tmp_path):
    path = tmp_path / "h200x2" / "ep.jsonl"
    update_rows(path, [_row("staged-graph", 100.0), _row("torch", 2000.0)])
    update_rows(path, [_row("staged-graph", 90.0), _row("fused-graph", 95.0)])
    rows = load_rows(path)
    assert [(r["provider"], r["median_us"]) for r in rows] == [
        ("torch", 2000.0), ("staged-graph", 90.0), ("fused-graph", 95.0)]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_results_path_is_one_file_per_benchmark_and_machine():
    path = results_path("ep", root="r")
    assert path.suffix == ".jsonl" and path.parent.parent.name == "r"
