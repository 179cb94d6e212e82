"""moestream.tools.trace: the fused kernel's trace rows (interpreter: no clock, so order and
content), the overlap figures on hand-made rows, and the timeline plot."""
from __future__ import annotations

import re

import numpy as np
import pytest

from moestream import MoEConfig
from moestream.buffer import SymmBuffer
from moestream.fused import fused_tuning
from moestream.tools.trace import (collect_virtual, intervals_union, overlap_length, plot_timeline,
                             summarize)

from conftest import KERNEL_DEVICES


def _row(phase, rank, start, end, sm=0, m_block=-1):
    return [phase, rank, -1, m_block, -1, sm, start, end]


def _trace_table(monkeypatch, capsys, rows, *argv: str) -> dict[str, list[str]]:
    """`moestream trace` on hand-made ``rows`` (the GPU run replaced, one GPU per rank in
    them): its printed table as figure name -> one cell per rank."""
    import torch

    import moestream.tools.trace as trace
    from moestream.tools.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(rows[:, 1].max()) + 1)
    monkeypatch.setattr(trace, "run_trace", lambda **kw: rows)
    monkeypatch.setenv("COLUMNS", "400")   # one line per row: rich wraps narrow tables
    assert main(["trace", *argv]) == 0
    table = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line)]
        if len(cells) > 2:     # a table row: its border, the figure, one cell per rank, border
            table[cells[1]] = cells[2:-1]
    return table


def test_interval_algebra():
    # overlapping and touching intervals merge; intersections add up exactly
    u = intervals_union(np.array([[5, 7], [0, 2], [1, 3], [7, 8]]))
    assert u.tolist() == [[0, 3], [5, 8]]
    v = intervals_union(np.array([[2, 6]]))
    assert overlap_length(u, v) == 1 + 1
    assert overlap_length(u, np.zeros((0, 2))) == 0


def test_summary_figures_on_known_rows():
    # rank 0: dispatch 0-10 us on SM 0, L1 5-15 on SM 1, L2 12-20, combine 20-22 (ns stamps)
    us = 1000
    rows = np.array([
        _row(0, 0, 0, 10 * us), _row(1, 0, 5 * us, 15 * us, sm=1), _row(2, 0, 12 * us, 20 * us),
        _row(3, 0, 20 * us, 22 * us),
        # rank 1 (another GPU's clock): only dispatch then L1, no overlap
        _row(0, 1, 100 * us, 104 * us), _row(1, 1, 104 * us, 110 * us),
    ], dtype=np.int64)
    s0, s1 = summarize(rows)
    assert s0["layer_us"] == 22 and s0["timed"]
    assert s0["phases"]["L1"] == dict(tasks=1, start_us=5, end_us=15, busy_us=10, sm_us=10,
                                      task_us=10)
    # comm (0-10, 20-22) meets GEMM (5-20) for 5 us of its 12
    assert s0["comm_hidden"] == pytest.approx(5 / 12)
    assert s0["l1_during_dispatch"] == pytest.approx(5 / 10)
    assert s0["l2_during_l1"] == pytest.approx(3 / 8)
    assert s1["layer_us"] == 10 and s1["comm_hidden"] == 0 and s1["l2_during_l1"] is None
    assert s1["phases"]["combine"]["tasks"] == 0 and s1["phases"]["combine"]["task_us"] is None
    # L2 12-20 of the m-block whose L1 ran 5-15: 3 of its 8 us before its input was done
    assert s0["l2_waiting"] == pytest.approx(3 / 8) and s1["l2_waiting"] is None


def test_l2_waiting_matches_m_blocks():
    # m-block 0: L1 blocks end at 10 and 14; its L2 block starts at 12 (2 us waiting) and one
    # starting at 20 does not wait. m-block 1: L1 ends at 6, its L2 runs 4-8 (2 us, capped
    # by nothing) and one at 30-31 of an m-block without L1 rows counts 0
    us = 1000
    rows = np.array([
        _row(1, 0, 0, 10 * us, m_block=0), _row(1, 0, 2 * us, 14 * us, m_block=0),
        _row(1, 0, 0, 6 * us, m_block=1),
        _row(2, 0, 12 * us, 22 * us, m_block=0), _row(2, 0, 20 * us, 25 * us, m_block=0),
        _row(2, 0, 4 * us, 8 * us, m_block=1), _row(2, 0, 30 * us, 31 * us, m_block=7),
    ], dtype=np.int64)
    (s,) = summarize(rows)
    assert s["l2_waiting"] == pytest.approx((2 + 0 + 2 + 0) / (10 + 5 + 4 + 1))
    # the median task: L1 durations 10, 12, 6; L2 10, 5, 4, 1
    assert (s["phases"]["L1"]["task_us"], s["phases"]["L2"]["task_us"]) == (10, 4.5)


def test_per_sm_time_and_gaps(monkeypatch, capsys, tmp_path):
    # SM 0: dispatch 0-10, L1 12-20 (2 us gap), L2 25-30 (5 us gap); SM 3: L1 0-8 and
    # 4-12 overlapping (a second program on the SM: no gap, 12 us covered), combine 20-21
    # (8 us gap). Per SM: dispatch 10/2, L1 (8 + 8 + 8)/2, L2 5/2, combine 1/2, idle (7 + 8)/2
    us = 1000
    rows = np.array([
        _row(0, 0, 0, 10 * us), _row(1, 0, 12 * us, 20 * us), _row(2, 0, 25 * us, 30 * us),
        _row(1, 0, 0, 8 * us, sm=3), _row(1, 0, 4 * us, 12 * us, sm=3),
        _row(3, 0, 20 * us, 21 * us, sm=3),
    ], dtype=np.int64)
    (s,) = summarize(rows)
    assert s["sms"] == 2
    assert s["per_sm_us"] == pytest.approx(dict(dispatch=5, L1=12, L2=2.5, combine=0.5,
                                                idle=7.5))
    assert list(s["per_sm_us"]) == ["dispatch", "L1", "L2", "combine", "idle"]
    # `moestream trace` prints them in that order, in whole µs
    table = _trace_table(monkeypatch, capsys, rows, "--out", str(tmp_path / "t.png"))
    assert table["per SM µs: dispatch / L1 / L2 / combine / idle"] == ["5 / 12 / 2 / 0 / 8"]


def test_trace_command_prints_and_saves(monkeypatch, tmp_path, capsys):
    # `moestream trace` end to end on hand-made rows (the GPU run replaced): the table with
    # every column, the PNG and the JSON with rows and summary
    import json

    us = 1000
    rows = np.array([_row(0, 0, 0, 10 * us), _row(1, 0, 12 * us, 20 * us, m_block=0),
                     _row(2, 0, 25 * us, 30 * us, m_block=0), _row(3, 0, 30 * us, 31 * us),
                     _row(0, 1, 0, 4 * us, sm=5), _row(3, 1, 4 * us, 9 * us, sm=5)],
                    dtype=np.int64)
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    table = _trace_table(monkeypatch, capsys, rows, "--out", str(png), "--json", str(js))
    assert table[""] == ["rank 0", "rank 1"]
    # rank 0: idle 2 + 5
    assert table["per SM µs: dispatch / L1 / L2 / combine / idle"] == ["10 / 8 / 5 / 1 / 7",
                                                                       "4 / 0 / 0 / 5 / 0"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(js.read_text())
    assert saved["rows"] == rows.tolist() and saved["summary"][1]["per_sm_us"]["idle"] == 0


def test_timeline_png(tmp_path):
    us = 1000
    rows = np.array([_row(p, r, (p * 4 + r) * us, (p * 4 + r + 6) * us, sm=p + 2 * r)
                     for p in range(4) for r in range(2)], dtype=np.int64)
    path = tmp_path / "t.png"
    plot_timeline(rows, str(path), title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("granularity", ["token", 32])
def test_collected_rows_cover_every_ticket(device, granularity):
    # one row per ticket: every dispatch task, every GEMM block of the schedule, every token's
    # combine; chunked dispatch tasks cover C source tokens each
    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=6, top_k=2,
                    max_tokens_per_rank=24, block_m=16)
    tokens = [9, 20]
    rows = collect_virtual(cfg, ranks=2, tokens=tokens, device=device, granularity=granularity,
                           seed=3)
    per = {p: int((rows[:, 0] == p).sum()) for p in range(4)}
    # the task sizes this device resolves to (GPUs: multi-token dispatch and combine tasks)
    tuning = fused_tuning(SymmBuffer(cfg, num_ranks=2, device=device), max(tokens),
                          granularity=granularity)
    dt, ct = tuning.fused.dispatch_tokens, tuning.fused.combine_tile
    if granularity != "token":
        assert dt == granularity
    assert per[0] == 2 * sum(-(-T // dt) for T in tokens)   # each rank pulls from both sources
    assert per[3] == sum(-(-T // ct) for T in tokens)
    assert per[1] > 0 and per[2] > 0
    assert set(rows[:, 1].tolist()) == {0, 1}
    if device == "cpu":
        assert not summarize(rows)[0]["timed"]      # the interpreter's clock reads 0
    else:
        assert all(s["timed"] and s["layer_us"] > 0 for s in summarize(rows))
    with pytest.raises(ValueError, match="one count per rank"):
        collect_virtual(cfg, ranks=2, tokens=[3], device=device)


def test_trace_tuning_overrides_are_checked_first(monkeypatch, capsys):
    # moestream trace --tuning: a bad field or value is named before any GPU process starts
    # (run_trace checks it ahead of CUDA, the command ahead of everything else)
    import torch

    from moestream.tools.cli import main
    from moestream.tools.trace import run_trace
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="Fused.per_sm must be an int >= 1"):
        run_trace(shape="qwen3", tokens=8, tuning={"fused.per_sm": 0})
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        run_trace(shape="qwen3", tokens=8, tuning={"fused.wave_blocks": 264})
    assert main(["trace", "--tuning", "fused.wave_blok=264", "--out", "unused.png"]) == 2
    assert "unknown Tuning field 'fused.wave_blok'" in capsys.readouterr().out.replace("\n", "")


def test_trace_table_cells(monkeypatch, capsys, tmp_path):
    # `moestream trace` shows each phase's span, its tasks and their median duration; a phase
    # without tasks says so instead of printing a span
    us = 1000
    rows = np.array([_row(0, 0, 0, 10 * us), _row(0, 0, 2 * us, 5 * us),
                     _row(1, 0, 6 * us, 20 * us)], dtype=np.int64)
    table = _trace_table(monkeypatch, capsys, rows, "--out", str(tmp_path / "t.png"))
    assert table["dispatch µs (tasks x µs)"] == ["0-10 (2 x 6.5)"]
    assert table["L1 µs (tasks x µs)"] == ["6-20 (1 x 14.0)"]
    assert table["combine µs (tasks x µs)"] == ["- (0)"]


def test_trace_virtual_ranks_option(monkeypatch, capsys, tmp_path):
    # moestream trace --virtual-ranks R: one traced launch of R ranks on this GPU, the shape's
    # config with --experts routed experts, R equal token counts and the --tuning overrides;
    # R that does not divide the experts, or --ranks beside it, is refused before any launch
    import torch

    import moestream.tools.trace as trace
    from moestream.tools.cli import main
    us = 1000
    rows = np.array([_row(0, 0, 0, 4 * us), _row(1, 0, 4 * us, 9 * us, m_block=0),
                     _row(0, 1, 0, 3 * us, sm=1), _row(3, 1, 3 * us, 8 * us, sm=1)],
                    dtype=np.int64)
    calls = []

    def fake(config, **kw):
        calls.append((config, kw))
        return rows
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trace, "collect_virtual", fake)
    monkeypatch.setattr(trace, "run_trace", lambda **kw: pytest.fail("spawned GPU processes"))
    monkeypatch.setenv("COLUMNS", "400")
    argv = ["trace", "--shape", "dsv3", "--tokens", "64", "--virtual-ranks", "2",
            "--experts", "32", "--tuning", "fused.combine_tile=2", "--out",
            str(tmp_path / "t.png")]
    assert main(argv) == 0
    ((cfg, kw),) = calls
    assert cfg.num_experts == 32 and cfg.max_tokens_per_rank == 64
    assert kw["ranks"] == 2 and kw["tokens"] == [64, 64]
    assert kw["overrides"] == {"fused.combine_tile": 2}
    assert "rank 1" in capsys.readouterr().out
    assert main(["trace", "--shape", "dsv3", "--virtual-ranks", "3", "--experts", "32",
                 "--out", str(tmp_path / "t.png")]) == 2
    assert "--virtual-ranks" in capsys.readouterr().out
    assert main(argv + ["--ranks", "2"]) == 2
    assert "leave out --ranks" in capsys.readouterr().out
    assert len(calls) == 1


def test_collect_virtual_applies_tuning_overrides():
    # overrides (dotted Tuning names) reach the traced launch: combine tasks of 2 tokens
    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=4, top_k=2,
                    max_tokens_per_rank=8, block_m=16)
    rows = collect_virtual(cfg, ranks=1, tokens=[7], device="cpu", seed=1,
                           overrides={"fused.combine_tile": 2})
    assert int((rows[:, 0] == 3).sum()) == -(-7 // 2)
