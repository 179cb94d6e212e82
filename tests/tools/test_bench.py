"""Benchmark helpers on the CPU: floors against the reference table, rows, table, plot, timer."""
from __future__ import annotations

import json
import time

import pytest
import torch

from moestream.tools.bench import (DEFAULT_CALIB, ROW_KEYS, append_rows, expected_touched_experts,
                             floors, load_rows, plot_rows, print_table, result_row,
                             routing_floors, slowest, time_cuda)
from moestream.config import SHAPES, MoEConfig

# The floors of the project's baseline table (2x H200, EP2, bf16): (shape, T/rank, floor µs,
# bound). The table's T=1 weight floors count the local experts its sampled routing touched:
# dsv3 8, v4flash 5, qwen3 8, mixtral 3 (floor / (3*H*I*2 B / 4 TB/s) is an integer in each
# row). The expected count under uniform routing (floors' default) gives 8 and 8 for dsv3 and
# qwen3, but 6 (75 µs) for v4flash and 2 (176 µs) for mixtral: those two rows pass the
# table's counts explicitly. From T=128 up every local expert is touched either way.
TABLE_EP2 = [
    ("dsv3", 1, 176, "weights", None), ("dsv3", 128, 2819, "weights", None),
    ("dsv3", 2048, 2819, "weights", None), ("dsv3", 8192, 7929, "compute", None),
    ("v4flash", 1, 63, "weights", 5), ("v4flash", 128, 1611, "weights", None),
    ("v4flash", 2048, 1611, "weights", None), ("v4flash", 8192, 3398, "compute", None),
    ("qwen3", 1, 19, "weights", None), ("qwen3", 128, 151, "weights", None),
    ("qwen3", 2048, 212, "compute", None), ("qwen3", 8192, 850, "compute", None),
    ("mixtral", 1, 264, "weights", 3), ("mixtral", 128, 352, "weights", None),
    ("mixtral", 2048, 1982, "compute", None), ("mixtral", 8192, 7929, "compute", None),
]


@pytest.mark.parametrize("shape, T, floor_us, bound, touched", TABLE_EP2)
def test_floors_reproduce_benchmarks_table(shape, T, floor_us, bound, touched) -> None:
    got = floors(SHAPES[shape], tokens_per_rank=T, ranks=2, touched_experts=touched)
    assert got["bound"] == bound
    assert abs(got["floor_us"] - floor_us) / floor_us <= 0.03, got
    assert got["floor_us"] == max(got["compute_us"], got["weights_us"], got["link_us"])


def test_qwen3_link_floor_matches_table_note() -> None:
    # qwen3 at 8192 tokens has its link floor (746 µs) close to compute (850 µs)
    got = floors("qwen3", tokens_per_rank=8192, ranks=2)
    assert abs(got["link_us"] - 746) / 746 <= 0.03


def test_floors_accept_config_and_name_alike() -> None:
    cfg = MoEConfig.from_shape("dsv3", max_tokens_per_rank=128)
    assert floors(cfg, tokens_per_rank=128, ranks=2) == floors("dsv3", tokens_per_rank=128,
                                                               ranks=2)


def test_fp8_floors_use_fp8_rate_and_bytes() -> None:
    bf16 = floors("mixtral", tokens_per_rank=8192, ranks=2)
    fp8 = floors("mixtral", tokens_per_rank=8192, ranks=2, dtype="fp8")
    ratio = DEFAULT_CALIB["fp8_tflops"] / DEFAULT_CALIB["bf16_tflops"]
    assert bf16["compute_us"] / fp8["compute_us"] == pytest.approx(ratio)
    assert 1.99 < bf16["weights_us"] / fp8["weights_us"] < 2.0   # 1 B + block scales vs 2 B
    assert fp8["link_us"] < bf16["link_us"]


def test_fp4w_floors_read_half_the_fp8_weight_bytes() -> None:
    # MXFP4 weights: half a byte plus one E8M0 byte per 32 (0.53 B) against fp8's ~1 B; the
    # tokens cross as fp8 (same link floor), the MMAs run at the fp8 rate
    fp8 = floors("dsv3", tokens_per_rank=8, ranks=2, dtype="fp8")
    fp4w = floors("dsv3", tokens_per_rank=8, ranks=2, dtype="fp4w")
    want = (0.5 + 1 / 32) / (1 + 4 / 128 ** 2)
    assert fp4w["weights_us"] / fp8["weights_us"] == pytest.approx(want)
    assert fp4w["link_us"] == fp8["link_us"] and fp4w["compute_us"] == fp8["compute_us"]
    # the bytes behind the weight floor: every touched expert's three H x I matrices
    H, I = SHAPES["dsv3"]["hidden"], SHAPES["dsv3"]["intermediate"]
    assert fp4w["weight_bytes"] == fp4w["touched_experts"] * 3 * H * I * (0.5 + 1 / 32)
    assert fp4w["weight_bytes"] / fp8["weight_bytes"] == pytest.approx(want)
    row = result_row(shape="dsv3", ranks=2, tokens_per_rank=8, dtype="fp4w", provider="x",
                     median_us=100.0, p20_us=99.0, p80_us=101.0)
    assert row["weight_bytes"] == fp4w["weight_bytes"]


def test_single_rank_has_no_link_floor() -> None:
    assert floors("qwen3", tokens_per_rank=512, ranks=1)["link_us"] == 0.0


@pytest.mark.parametrize("shape, T, R", [("dsv3", 1, 2), ("qwen3", 1, 2), ("v4flash", 8, 2),
                                         ("mixtral", 1, 2), ("qwen3", 4, 8)])
def test_expected_touched_experts_matches_sampling(shape, T, R) -> None:
    # Monte Carlo: T*K*R independent uniform picks, distinct experts of rank 0, averaged.
    E, K = SHAPES[shape]["num_experts"], SHAPES[shape]["top_k"]
    g = torch.Generator().manual_seed(T * 1000 + R)
    picks = torch.randint(0, E, (4000, T * K * R), generator=g)
    local = torch.zeros(4000, E // R, dtype=torch.bool)
    mask = picks < E // R
    local[torch.arange(4000)[:, None].expand_as(picks)[mask], picks[mask]] = True
    mean = local.sum(1).double().mean().item()
    got = expected_touched_experts(num_experts=E, ranks=R, tokens_per_rank=T, top_k=K)
    assert got - 1 < mean * 1.02 and mean * 0.98 <= got, (got, mean)


def test_touched_experts_saturates_and_vanishes() -> None:
    kw = dict(num_experts=256, ranks=2, top_k=8)
    counts = [expected_touched_experts(tokens_per_rank=T, **kw) for T in (0, 1, 8, 32, 128, 8192)]
    assert counts[0] == 0 and counts[-1] == 128
    assert counts == sorted(counts)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ranks=3), "ranks must be a positive int dividing"),
    (dict(tokens_per_rank=-1), "tokens_per_rank"),
    (dict(dtype="fp4"), "dtype must be one of"),
    (dict(touched_experts=129), r"touched_experts must be an int in \[0, 128\]"),
    (dict(calib={"bf16_tflops": 1.0}), "calib is missing"),
])
def test_floors_reject_bad_arguments(kwargs, match) -> None:
    args = dict(tokens_per_rank=8, ranks=2) | kwargs
    with pytest.raises(ValueError, match=match):
        floors("dsv3", **args)


def test_routing_floors_of_an_even_routing_equal_the_uniform_model() -> None:
    # every rank receives T*K picks, half from its own tokens, over 4 of its experts: what
    # floors() assumes, so each rank's floor is floors() with 4 touched experts, for bf16 and
    # fp8 alike (the weight, link and compute parts all enter)
    idx = torch.tensor([[0, 4], [1, 5], [2, 6], [3, 7]])
    shape = dict(hidden=256, intermediate=128, num_experts=8, top_k=2)
    for dtype in ("bf16", "fp8"):
        got = routing_floors(shape, topk_idxs=[idx, idx.clone()], dtype=dtype)
        want = floors(shape, tokens_per_rank=4, ranks=2, touched_experts=4, dtype=dtype)
        for r in (0, 1):
            for k in ("compute_us", "weights_us", "link_us", "floor_us", "touched_experts",
                      "remote_pairs"):
                assert got["per_rank"][r][k] == pytest.approx(want[k]), (dtype, r, k)


def test_routing_floors_follow_the_hot_rank() -> None:
    # a hot expert on rank 1 (expert 5): rank 1 computes every pick but rank 0's dropped
    # ones, so it is the slowest; -1 picks count nowhere; a rank whose experts get no pick
    # has a zero floor
    shape = dict(hidden=512, intermediate=256, num_experts=8, top_k=2)
    idx0 = torch.tensor([[5, -1], [5, 6], [5, -1]])          # 4 picks, all on rank 1
    idx1 = torch.tensor([[5, 7], [5, -1]])                    # 3 picks, on its own rank
    got = routing_floors(shape, topk_idxs=[idx0, idx1])
    assert got["rank"] == 1
    r0, r1 = got["per_rank"]
    assert r0["floor_us"] == 0.0 and r0["touched_experts"] == 0
    assert (r1["touched_experts"], r1["remote_pairs"]) == (3, 4)
    want = floors(shape, tokens_per_rank=1, ranks=2, touched_experts=3)   # 7 pairs: scale T
    assert r1["compute_us"] == pytest.approx(want["compute_us"] * 7 / 2)
    assert r1["weights_us"] == pytest.approx(want["weights_us"])
    assert got["floor_us"] == r1["floor_us"] > 0


@pytest.mark.parametrize("idxs, match", [
    ([], "one tensor per rank"),
    ([torch.zeros(2, 2, dtype=torch.long)] * 3, "one tensor per rank"),
    ([torch.zeros(2, 3, dtype=torch.long)] * 2, r"int tensor \[T, 2\]"),
    ([torch.zeros(2, 2)] * 2, r"int tensor \[T, 2\]"),
    ([torch.full((2, 2), 8)] * 2, r"outside \[-1, 8\)"),
    ([torch.full((2, 2), -2)] * 2, r"outside \[-1, 8\)"),
])
def test_routing_floors_reject_bad_routings(idxs, match) -> None:
    with pytest.raises(ValueError, match=match):
        routing_floors(dict(hidden=256, intermediate=128, num_experts=8, top_k=2),
                       topk_idxs=idxs)


# ---- rows ----------------------------------------------------------------------------------

def _row(**over):
    base = dict(shape="qwen3", ranks=2, tokens_per_rank=2048, dtype="bf16", provider="torch",
                median_us=2652.0, p20_us=2600.0, p80_us=2700.0)
    return result_row(**(base | over))


def test_result_row_has_protocol_keys_and_derived_values() -> None:
    row = _row(note="extra")
    assert list(row)[:len(ROW_KEYS)] == list(ROW_KEYS) and row["note"] == "extra"
    assert row["torch"] == torch.__version__ and row["gpu"] and row["date"]
    assert row["num_gpus"] == 2
    fl = floors("qwen3", tokens_per_rank=2048, ranks=2)
    assert row["floor_us"] == pytest.approx(fl["floor_us"])
    assert row["efficiency"] == pytest.approx(fl["floor_us"] / 2652.0)
    # At the compute floor the layer would run at exactly the calibrated dense rate.
    at_floor = _row(median_us=fl["compute_us"])
    assert at_floor["tflops_per_gpu"] == pytest.approx(DEFAULT_CALIB["bf16_tflops"])
    assert at_floor["efficiency"] == pytest.approx(1.0)
    # link GB/s counts the same remote bytes as the link floor.
    at_link = _row(median_us=fl["link_us"])
    assert at_link["link_gbps"] == pytest.approx(DEFAULT_CALIB["link_gbps"])


def test_result_row_keeps_given_fields() -> None:
    row = _row(gpu="NVIDIA H200", floor_us=100.0, num_gpus=8)
    assert row["gpu"] == "NVIDIA H200" and row["num_gpus"] == 8
    assert row["efficiency"] == pytest.approx(100.0 / 2652.0)


def test_result_row_rejects_missing_fields() -> None:
    with pytest.raises(ValueError, match="missing.*median_us"):
        result_row(shape="qwen3", ranks=2, tokens_per_rank=1, dtype="bf16", provider="torch",
                   p20_us=1.0, p80_us=2.0)
    with pytest.raises(ValueError, match="not in"):
        _row(shape="custom")


def test_append_and_load_rows(tmp_path) -> None:
    path = tmp_path / "results" / "run.jsonl"
    rows = [_row(tokens_per_rank=T, median_us=100.0 + T) for T in (1, 8)]
    assert append_rows(path, rows) == 2
    assert append_rows(path, rows[:1]) == 1
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2]) == rows[0]
    assert load_rows(path) == rows + rows[:1]


def test_print_table_lists_every_row() -> None:
    from rich.console import Console

    console = Console(record=True, width=250)
    rows = [_row(provider=p, tokens_per_rank=T) for p in ("torch", "fused") for T in (1, 128)]
    table = print_table(rows, "EP2 qwen3", console=console)
    text = console.export_text()
    assert "EP2 qwen3" in text and "fused" in text and "torch" in text
    assert table.row_count == 4


def test_plot_rows_writes_png(tmp_path) -> None:
    rows = [_row(shape=s, provider=p, tokens_per_rank=T, median_us=float(T + 50 * (p == "torch")),
                 p20_us=float(T), p80_us=float(T + 60))
            for s in ("qwen3", "dsv3") for p in ("torch", "fused") for T in (1, 8, 128, 2048)]
    out = plot_rows(rows, tmp_path / "plots" / "ep2.png", title="EP2")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError):
        plot_rows([], tmp_path / "empty.png")


# ---- timing --------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback clock")
def test_time_cuda_cpu_fallback_rotates_inputs() -> None:
    seen = []

    def fn(arg):
        seen.append(arg)
        time.sleep(0.002)

    stats = time_cuda(fn, warmup=2, reps=7, rotate=["a", "b", "c"])
    assert seen == [["a", "b", "c"][i % 3] for i in range(9)]
    assert stats["clock"] == "perf_counter" and stats["reps"] == 7
    assert 2000 <= stats["p20_us"] <= stats["median_us"] <= stats["p80_us"]
    assert stats["host_us"] >= 2000   # on the CPU the call is host time


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_cuda_separates_host_time_from_gpu_time() -> None:
    # queue_ahead holds the stream while the calls are enqueued: a call that sleeps 2 ms on
    # the host and launches nothing costs ~2 ms of host time and ~no GPU time between events
    stats = time_cuda(lambda: time.sleep(0.002), warmup=1, reps=5, queue_ahead=True)
    assert stats["host_us"] >= 2000 and stats["median_us"] < 1000, stats


def test_time_cuda_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="reps"):
        time_cuda(lambda: None, reps=0)
    with pytest.raises(ValueError, match="rotate"):
        time_cuda(lambda x: None, rotate=[])


def test_slowest_without_group_is_identity() -> None:
    stats = dict(median_us=3.0, p20_us=2.0, p80_us=4.0)
    assert slowest(stats) == stats


def test_ep_bench_provider_names():
    # chunk<C> providers name the fused launch's chunked mode; typos are a ValueError
    from moestream.tools.bench_ep import check_providers, is_replayed, provider_granularity
    assert provider_granularity("chunk256") == 256
    assert provider_granularity("chunkexpert") == "expert"
    assert provider_granularity("fused") is None
    assert is_replayed("chunk128") and is_replayed("fused-graph") and not is_replayed("fused")
    check_providers(["staged", "fused-graph", "chunk128", "chunkexpert", "torch"])
    for bad in (["fuse"], ["chunk"], ["chunk-3"], ["chunkx"]):
        with pytest.raises(ValueError, match="provider"):
            check_providers(bad)


def test_composed_options_name_the_providers_the_layer_runs():
    # the CLI's --impl/--dtype/--graph/--granularity/--per-stage/--tuning/--baselines compose
    # into provider names; combinations the layer does not run are reported, never dropped
    # silently, and every name returned is one the benchmark runs
    from moestream.tools.bench_ep import check_providers, compose_providers
    assert compose_providers() == (["staged-graph", "fused-graph", "torch"], [])
    names, skipped = compose_providers(dtype=["bf16", "fp8", "fp4w"],
                                       granularity=["token", 128, "expert"])
    assert names == ["staged-graph", "fused-graph", "chunk128", "chunkexpert",
                     "fp8-staged-graph", "fp8-fused-graph", "fp4w-staged-graph",
                     "fp4w-fused-graph", "torch"]
    assert any(s.startswith("fp8 fused granularity=128") for s in skipped)
    check_providers(names)
    names, skipped = compose_providers(impl=["staged"], dtype=["bf16", "fp8"], per_stage=True,
                                       tuned=True, baselines=["torch", "torch-symm"])
    assert names == ["staged-graph-stages", "staged-tuned-graph-stages",
                     "fp8-staged-graph-stages", "fp8-staged-tuned-graph-stages", "torch",
                     "torch-symm"] and skipped == []
    check_providers(names, {"gemm_claim": True})
    names, skipped = compose_providers(graph=False, granularity=["token", 256], baselines=[])
    assert names == ["staged", "fused"] and skipped == ["bf16 fused granularity=256 without graphs"]
    with pytest.raises(ValueError, match="no provider runs this selection"):
        compose_providers(impl=["fused"], dtype=["fp4w"], per_stage=True, baselines=[])


def test_stage_providers_and_plot(tmp_path):
    # *-stages providers are timed stage by stage, never replayed; plot_stages draws one
    # stacked bar per row, stages in run_staged's order, and refuses rows without stages
    from moestream.tools.bench_ep import (check_providers, is_replayed, is_stagewise, plot_stages,
                                          provider_dtype)
    from moestream.staged import STAGES
    check_providers(["staged-stages", "fp8-staged-stages", "staged-graph-stages",
                     "fp8-staged-graph-stages", "fp4w-staged-stages", "fp4w-staged-graph"])
    assert provider_dtype("fp4w-staged-graph-stages") == "fp4w"
    assert provider_dtype("staged") == "bf16"
    assert is_stagewise("staged-stages") and not is_replayed("staged-stages")
    assert is_stagewise("fp8-staged-graph-stages") and not is_replayed("staged-graph-stages")
    assert provider_dtype("fp8-staged-stages") == "fp8" and not is_stagewise("staged-graph")
    rows = [_row(shape=s, provider="staged-stages", tokens_per_rank=T, median_us=700.0,
                 stages_us={n: 10.0 * (i + 1) for i, n in enumerate(STAGES)})
            for s in ("qwen3", "dsv3") for T in (1, 8192)]
    plot_stages(rows, tmp_path / "stages.png")
    data = (tmp_path / "stages.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="stages_us"):
        plot_stages([_row(shape="dsv3", provider="staged", tokens_per_rank=1, median_us=1.0)],
                    tmp_path / "none.png")


def test_tuned_providers_and_their_overrides():
    # the *-tuned-graph providers run staged calls with Tuning fields overridden;
    # parse_tuning reads the CLI's --tuning text and rejects what Tuning would reject
    from moestream.tools.bench_ep import (check_providers, is_replayed, is_stagewise, is_tuned,
                                          parse_tuning, provider_dtype)
    assert parse_tuning("gemm_claim=true, l1.block_n=128,use_tma=None") == {
        "gemm_claim": True, "l1.block_n": 128, "use_tma": None}
    assert parse_tuning("") == {}
    check_providers(["staged-tuned-graph", "fp8-staged-tuned-graph"], {"gemm_claim": True})
    assert is_replayed("staged-tuned-graph") and provider_dtype("fp8-staged-tuned-graph") == "fp8"
    # their stage splits: timed stage by stage inside a graph, with the overrides
    check_providers(["staged-tuned-graph-stages", "fp8-staged-tuned-graph-stages"],
                    {"l1.tail_rows": 32})
    for p in ("staged-tuned-graph-stages", "fp8-staged-tuned-graph-stages"):
        assert is_tuned(p) and is_stagewise(p) and not is_replayed(p)
    assert not is_tuned("staged-graph-stages")
    # the fused launch's: replayed from graphs, with the overrides on its own defaults
    check_providers(["fused-tuned-graph", "fp8-fused-tuned-graph"], {"fused.per_sm": 1})
    assert is_tuned("fused-tuned-graph") and is_replayed("fp8-fused-tuned-graph")
    assert provider_dtype("fp8-fused-tuned-graph") == "fp8"
    with pytest.raises(ValueError, match="need Tuning overrides"):
        check_providers(["fused-tuned-graph"])
    with pytest.raises(ValueError, match="need Tuning overrides"):
        check_providers(["fp8-staged-tuned-graph-stages"])
    with pytest.raises(ValueError, match="need Tuning overrides"):
        check_providers(["staged-graph", "staged-tuned-graph"])
    for text, match in [("l1.blok_n=128", "unknown Tuning field 'l1.blok_n'"),
                        ("l2.flat", "must be name=value"), ("l2.split_m=", "must be name=value"),
                        ("l2.split_m=3", "L2.split_m must be one of"),
                        ("l2.flat=yes", "L2.flat must be a bool")]:
        with pytest.raises(ValueError, match=match):
            parse_tuning(text)


@pytest.mark.parametrize("skew", [0.0, -0.1, 1.5, True, "0.3"])
def test_ep_bench_skew_is_checked_before_any_process_starts(skew):
    # a skew make_routing would reject inside every spawned rank is a ValueError up front
    from moestream.tools.bench_ep import run_ep_bench
    with pytest.raises(ValueError, match=r"skew is the hot expert's share of picks, in \(0, 1\]"):
        run_ep_bench(shapes=["qwen3"], tokens=[1], providers=["staged"], skew=skew)


def test_ep_bench_block_m_is_checked_before_any_process_starts():
    # --block-m (run_ep_bench's block_m) is a MoEConfig.block_m: a value the config rejects
    # is a ValueError naming the allowed ones, on a machine with or without GPUs
    from moestream.tools.bench_ep import run_ep_bench
    with pytest.raises(ValueError, match="block_m must be one of"):
        run_ep_bench(shapes=["qwen3"], tokens=[1], providers=["staged"], block_m=96)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("timer", ["stage_times", "graph_stage_times"])
def test_stage_times_on_one_gpu(timer):
    # every stage of a staged call on one GPU (one virtual rank) gets a GPU time, launched
    # from Python or inside a graph replay; the stages add up to the call, and the output is
    # the layer's
    from moestream import SymmBuffer
    from moestream.tools import bench_ep
    from moestream.tools.bench_ep import staged_call
    from moestream.staged import STAGES
    from moestream.reference import moe_forward
    from moestream.testing import TOLERANCE, make_routing, make_tokens, make_weights, rel_error
    cfg = MoEConfig(hidden=512, intermediate=256, num_experts=8, top_k=2, max_tokens_per_rank=64)
    buf = SymmBuffer(cfg, num_ranks=1, device="cuda")
    gen = torch.Generator().manual_seed(0)
    x = make_tokens(50, cfg.hidden, generator=gen, device="cuda")
    idx, w = make_routing(50, cfg.num_experts, cfg.top_k, generator=gen, device="cuda")
    (w13,), (w2,) = make_weights(cfg, 1, generator=gen, device="cuda")
    stats = getattr(bench_ep, timer)(lambda mark: staged_call(buf, (x, idx, w), (w13, w2),
                                                               mark), reps=5, warmup=1)
    assert set(stats["stages_us"]) == set(STAGES)
    assert all(v > 0 for v in stats["stages_us"].values())
    assert abs(sum(stats["stages_us"].values()) - stats["median_us"]) <= 0.2 * stats["median_us"]
    y = staged_call(buf, (x, idx, w), (w13, w2), None)
    buf.check()
    ref = moe_forward(x, idx, w, w13, w2)
    assert rel_error(y, ref) <= TOLERANCE["bf16"]
    # with overrides (the -tuned-graph-stages providers): ~12 rows per expert, so with
    # decode pieces off most blocks are tail pieces of 16 rows (a few hold more rows)
    y = staged_call(buf, (x, idx, w), (w13, w2), None,
                     {"l1.tail_rows": 16, "l2.tail_rows": 16, "decode_rows": 0})
    buf.check()
    assert rel_error(y, ref) <= TOLERANCE["bf16"]


class _FakeClock:
    """Stand-ins for torch.cuda's events, graphs and syncs on a CPU machine: every event
    record reads a clock that advances 1 ms per record, so stage i of a call spans 1 ms."""

    def __init__(self):
        self.now = 0.0
        self.capture = None

    def event(self, **kw):
        clock = self

        class Event:
            t = None

            def record(self):
                if clock.capture is not None:      # captured: replayed later
                    clock.capture.append(self.record_now)
                else:
                    self.record_now()

            def record_now(self):
                clock.now += 1.0
                self.t = clock.now

            def elapsed_time(self, other):
                return other.t - self.t

        return Event()

    def graph_class(self):
        class Graph:
            def __init__(self):
                self.nodes = []

            def replay(self):
                for node in self.nodes:
                    node()
        return Graph

    def graph(self, g):
        import contextlib
        clock = self

        @contextlib.contextmanager
        def capturing():
            clock.capture = g.nodes
            try:
                yield
            finally:
                clock.capture = None
        return capturing()


@pytest.mark.parametrize("timer", ["stage_times", "graph_stage_times"])
def test_stage_timers_split_a_call_into_its_stages(monkeypatch, timer):
    # the timers' bookkeeping without a GPU: each stage's time runs from the previous mark
    # (the first from the call's start), in STAGES order, and the stages add up to the call
    from moestream.tools import bench_ep
    from moestream.staged import STAGES
    clock = _FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", clock.graph_class())
    monkeypatch.setattr(torch.cuda, "graph", clock.graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda *a: None)
    calls = []

    def call(mark):
        calls.append(mark)
        for name in STAGES:
            mark(name)

    stats = getattr(bench_ep, timer)(call, reps=4, warmup=2)
    assert list(stats["stages_us"]) == list(STAGES)
    assert all(v == 1e3 for v in stats["stages_us"].values())   # 1 ms each, in µs
    assert stats["median_us"] == len(STAGES) * 1e3 == stats["p20_us"] == stats["p80_us"]
    assert stats["reps"] == 4


def test_gemm_bench_routing_gives_every_expert_exactly_its_rows():
    # the GEMM bench gives each expert exactly M rows: T = E * M / (R * K) tokens per rank must
    # be whole. v4flash's top-6 over 32 experts at 128 rows cannot (4096 / 6): K drops to the
    # largest that fits (4), which changes where rows come from, not the GEMMs
    from moestream.tools.bench_kernels import picks_per_token, uniform_routing
    assert picks_per_token(experts=32, rows_per_expert=128, ranks=1, top_k=6) == 4
    assert picks_per_token(experts=32, rows_per_expert=128, ranks=1, top_k=8) == 8
    assert picks_per_token(experts=4, rows_per_expert=3, ranks=1, top_k=8) == 4   # K <= E
    assert picks_per_token(experts=6, rows_per_expert=2, ranks=2, top_k=4) == 3
    with pytest.raises(ValueError, match=r"tokens per expert \(7\) must be a multiple of the "
                                         r"virtual ranks \(2\)"):
        picks_per_token(experts=64, rows_per_expert=7, ranks=2, top_k=6)
    for E, M, R, top_k in ((32, 128, 1, 6), (16, 2048, 1, 6), (8, 16, 2, 8), (64, 6, 2, 6)):
        K = picks_per_token(experts=E, rows_per_expert=M, ranks=R, top_k=top_k)
        T = E * M // (R * K)
        assert T * R * K == E * M
        # every rank routes its T tokens alike (bench_kernels._prepare)
        rows = sum(torch.bincount(uniform_routing(T, E, K).flatten(), minlength=E)
                   for _ in range(R))
        assert rows.tolist() == [M] * E, (E, M, R, K)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp4w"])
def test_gemm_bench_checks_the_l2_rows_it_times(gen, dtype):
    # bench_kernels.l2_error (the GEMM bench's l2_rel_error): after a staged call on two
    # virtual ranks (random routing, ragged expert counts), each valid pool row's L2 output
    # is found in its source rank's combine slot and matches fp32 math on the L1 output; a
    # slot overwritten (a misplaced or missing row) is caught
    from moestream import staged
    from moestream.tools.bench_kernels import l2_error
    from moestream.buffer import SymmBuffer
    from moestream.testing import (TOLERANCE, make_routing, make_tokens, make_weights,
                                   quantize_weights)
    cfg = MoEConfig(hidden=256, intermediate=128, num_experts=4, top_k=2,
                    max_tokens_per_rank=12, block_m=16, dtype=dtype)
    buf = SymmBuffer(cfg, num_ranks=2, device="cpu")
    w13s, w2s = make_weights(cfg, 2, generator=gen)
    if dtype != "bf16":
        w13s, w2s = quantize_weights(w13s, w2s, fmt=dtype)
    xs = [make_tokens(T, cfg.hidden, generator=gen) for T in (11, 7)]
    rts = [make_routing(x.shape[0], cfg.num_experts, cfg.top_k, generator=gen) for x in xs]
    y = torch.empty(2, 11, cfg.hidden, dtype=torch.bfloat16)
    staged.run_staged(buf, xs, [r[0] for r in rts], [r[1] for r in rts], w13s, w2s, y)
    assert l2_error(buf, cfg, w2s[0]) < TOLERANCE[dtype]
    assert l2_error(buf, cfg, w2s[1], rank=1) < TOLERANCE[dtype]
    e = next(e for e, n in enumerate(buf.view("expert_count", 0).tolist()) if n)
    row = int(buf.view("block_start", 0)[e]) * cfg.block_m   # its first pool row
    src = int(buf.view("pool_src", 0)[row])
    slots = cfg.max_tokens_per_rank * cfg.top_k
    # shifted by 1 (outputs are ~0.1): zeroing it instead gave 0.08-0.2 with one row of ~36,
    # too close to any threshold for random inputs
    buf.view("combine_y", src // slots).view(-1, cfg.hidden)[src % slots] += 1.0
    assert l2_error(buf, cfg, w2s[0]) > 0.5


def test_layer_call_variant_times_what_the_layer_picks(monkeypatch) -> None:
    # "layer-call" times the staged layer's tuning for the bench's call (tuning.select for the
    # call's tokens on the buffer's device) with the descriptors built on the host, as the
    # layer's CUDA graphs run it; the policy's device is stood in for by an H200
    from conftest import H200
    from moestream import launch
    from moestream.tools.bench_kernels import VARIANTS
    from moestream.buffer import SymmBuffer
    from moestream.tuning import select
    cfg = MoEConfig.from_shape("qwen3", max_tokens_per_rank=4096)
    buf = SymmBuffer(cfg, num_ranks=1, device="cpu")
    monkeypatch.setattr(launch, "device_of", lambda device: H200)
    try:
        for tokens in (8, 4096):   # decode pieces; whole tiles with the one-MMA L1
            got = VARIANTS["layer-call"].tuning_for(buf, tokens)
            want = select(cfg, tokens, ranks=1, device=H200, impl="staged")
            assert got == want.with_(host_descriptors=True), tokens
        assert VARIANTS["layer-call"].tuning_for(buf, 8).decode_rows == 16
        assert VARIANTS["layer-call"].tuning_for(buf, 4096).l1.one_dot
    finally:
        buf.destroy()


def test_ncu_summary_reads_a_report(tmp_path) -> None:
    # benchmarks/ncu_summary.py on a small report in ncu's raw CSV form (header, units, one
    # row per launch; ncu's own lines before it are skipped), and on one without rows
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ncu_summary.py"
    spec = importlib.util.spec_from_file_location("ncu_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    header = ["Kernel Name", "Grid Size", "gpu__time_duration.sum",
              "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"]
    report = tmp_path / "r.csv"
    report.write_text("==PROF== Disconnected\n"
                      + "\n".join(",".join(f'"{v}"' for v in row) for row in
                                  (header, ["", "", "ns", "%", "inst"],
                                   ["l1_kernel", "(132, 1, 1)", "4,388,672", "46.16", "2.55"],
                                   ["l2_kernel", "(264, 1, 1)", "2,819,552", "38.89", "0.60"]))
                      + "\n")
    rows = mod.read_report(str(report))
    assert [r["kernel"] for r in rows] == ["l1_kernel", "l2_kernel"]
    assert rows[0]["us"] == pytest.approx(4388.672)
    assert rows[1]["tensor%"] == pytest.approx(38.89)
    assert rows[0]["stalls"]["barrier"] == pytest.approx(2.55)
    assert rows[0]["L2%"] != rows[0]["L2%"]   # a metric the report lacks is NaN, not 0
    assert "l2_kernel grid (264, 1, 1) us=2819.6" in mod.format_report("r", rows)
    empty = tmp_path / "e.csv"
    empty.write_text("==PROF== no kernels were profiled\n")
    with pytest.raises(ValueError, match="no ncu CSV rows"):
        mod.read_report(str(empty))


def test_fused_sweep_variants_parse_or_say_what_is_wrong() -> None:
    # benchmarks/fused_sweep.py: NAME:field=value,... Tuning overrides; the built-in names take
    # none; a missing name, missing overrides or an unknown field is a ValueError naming it
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_sweep.py"
    spec = importlib.util.spec_from_file_location("fused_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_variant("w2:fused.wave_blocks=264,fused.per_sm=1") == (
        "w2", {"fused.wave_blocks": 264, "fused.per_sm": 1})
    assert mod.parse_variant("staged") == ("staged", {})
    assert mod.parse_variant("default") == ("default", {})
    for bad, msg in [("w2", "NAME:field=value"), ("staged:l2_flat=true", "takes no overrides"),
                     (":fused.wave_blocks=2", "needs a name"),
                     ("x:nope=1", "unknown Tuning field"),
                     ("x:fused.per_sm=0", "Fused.per_sm must be an int >= 1")]:
        with pytest.raises(ValueError, match=msg):
            mod.parse_variant(bad)


def _ab_module():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ab_commits.py"
    spec = importlib.util.spec_from_file_location("ab_commits", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ab_summary_pairs_the_two_sides() -> None:
    # benchmarks/ab_commits.py: rows of the four runs (base, new, new, base) -> per point the
    # median of each side's medians and new / base; a point only one side measured is left out
    mod = _ab_module()
    point = dict(shape="qwen3", ranks=2, tokens_per_rank=2048, dtype="bf16",
                 provider="staged-graph")
    rows = [{**point, "median_us": t, "code": c} for t, c in
            ((470.0, "base 9ca2c9d"), (431.0, "new"), (433.0, "new"), (480.0, "base 9ca2c9d"))]
    rows.append({**point, "provider": "fused-graph", "median_us": 481.0, "code": "new"})
    (entry,) = mod.summarize(rows)
    assert entry["provider"] == "staged-graph" and entry["runs"] == (2, 2)
    assert entry["base_us"] == pytest.approx(475.0) and entry["new_us"] == pytest.approx(432.0)
    assert entry["new_over_base"] == pytest.approx(432.0 / 475.0)
    assert "staged-graph" in mod.format_summary([entry]) and "0.909" in mod.format_summary([entry])
    # GEMM rows (moestream bench --virtual-ranks): the L1 and L2 of one point stay apart
    gemm = dict(point, provider="ours:layer-call")
    rows = [{**gemm, "kernel": k, "median_us": t, "code": c} for k, t, c in
            (("l1", 1481.0, "base x"), ("l2", 776.0, "base x"), ("l1", 1400.0, "new"),
             ("l2", 780.0, "new"))]
    l1, l2 = sorted(mod.summarize(rows), key=lambda e: e["kernel"])
    assert (l1["base_us"], l1["new_us"], l2["base_us"], l2["new_us"]) == (1481, 1400, 776, 780)
    assert "ours:layer-call l2" in mod.format_summary([l2])


def test_ab_prepare_and_run_say_what_is_wrong(tmp_path) -> None:
    # prepare copies a commit's package (git archive); an unknown commit, a run without the
    # prepared folder and --out among the bench arguments are ValueErrors naming the fix
    import subprocess
    mod = _ab_module()
    if subprocess.run(["git", "-C", str(mod.ROOT), "rev-parse", "HEAD"],
                      capture_output=True).returncode:
        pytest.skip("not a git checkout")
    dest = mod.prepare("HEAD", into=tmp_path)
    assert (dest / "moestream" / "__init__.py").is_file() and dest == tmp_path / "HEAD"
    with pytest.raises(ValueError, match="git archive no-such-commit failed"):
        mod.prepare("no-such-commit", into=tmp_path)
    with pytest.raises(ValueError, match="run 'ab_commits.py prepare abc'"):
        mod.run("abc", str(tmp_path / "o.jsonl"), ["--shapes", "qwen3"], 10, into=tmp_path)
    with pytest.raises(ValueError, match="pass --out to ab_commits.py"):
        mod.run("HEAD", str(tmp_path / "o.jsonl"), ["--out", "x.jsonl"], 10, into=tmp_path)
    with pytest.raises(ValueError, match="pass --out to ab_commits.py"):
        mod.run("HEAD", str(tmp_path / "o.jsonl"), ["--shapes", "qwen3"], 10,
                base_args=["--out=x.jsonl"], into=tmp_path)
    # a base from before the tools subpackage is run through its own CLI module
    assert mod.cli_module(dest) == "moestream.tools.cli"
    old = tmp_path / "old"
    (old / "moestream").mkdir(parents=True)
    (old / "moestream" / "cli.py").write_text("")
    assert mod.cli_module(old) == "moestream.cli"


def test_bench_weights_are_drawn_per_expert_reproducibly():
    # the EP bench draws its weights on the device, one expert at a time: same seed -> same
    # weights, every expert drawn (none left empty), and the std the scale asks for
    from moestream.tools.bench_ep import randn_bf16
    draw = lambda seed: randn_bf16((5, 64, 96), 0.5, torch.Generator().manual_seed(seed), "cpu")
    a, b, c = draw(3), draw(3), draw(4)
    assert a.dtype == torch.bfloat16 and a.shape == (5, 64, 96)
    assert torch.equal(a, b) and not torch.equal(a, c)
    for e in range(5):
        assert abs(a[e].float().std().item() - 0.5) < 0.03, e
    assert not torch.equal(a[0], a[1])   # each expert its own draw


def _skew_floor_worker(rank: int, world: int, seed: int):
    # what bench_ep_worker does per token count under skew: its input sets, then the gathered
    # routing's floor (a collective over the ranks)
    from moestream.tools.bench_ep import gathered_routing_floor, input_sets
    cfg = MoEConfig.from_shape("qwen3", max_tokens_per_rank=16)
    g = torch.Generator().manual_seed(seed + 17 * rank)
    sets = input_sets(cfg, 16, g, "cpu", skew=0.3, sets=2)
    floor = gathered_routing_floor(cfg, sets, world)
    return [s[1] for s in sets], floor("bf16"), floor("fp8")


def test_skewed_bench_rows_take_the_floor_of_their_routing() -> None:
    # two gloo ranks: the floor the EP bench gives a skewed row is the mean over its input
    # sets of routing_floors on every rank's routing (gathered), the same on both ranks
    from moestream.tools.distributed import spawn
    res = spawn(_skew_floor_worker, world_size=2, backend="gloo", args=(11,), timeout_s=120)
    (idxs0, bf0, fp0), (idxs1, bf1, fp1) = res
    want = {d: sum(routing_floors("qwen3", topk_idxs=[a, b], dtype=d)["floor_us"]
                   for a, b in zip(idxs0, idxs1)) / 2 for d in ("bf16", "fp8")}
    assert (bf0, fp0) == (bf1, fp1) == pytest.approx((want["bf16"], want["fp8"]))
    assert bf0 > fp0 > 0     # fp8 reads half the weight bytes


def test_virtual_layer_bench_rows(gen):
    # bench_virtual on the CPU interpreter (2 virtual ranks, tiny dims, odd expert count):
    # one row per tokens x format x launch, each with its ranks on one GPU, the whole GPU's
    # TFLOP/s, no per-rank floor, and the fused output checked against the staged one
    from moestream.tools.bench_virtual import bench_virtual
    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=6, top_k=2,
                    max_tokens_per_rank=8, block_m=16)
    rows = bench_virtual(shapes=[cfg], tokens=[1, 7], ranks=2, dtypes=["bf16", "fp8"],
                         reps=1, warmup=0, device="cpu")
    got = [(r["tokens_per_rank"], r["dtype"], r["provider"]) for r in rows]
    assert got == [(T, d, f"{'' if d == 'bf16' else d + '-'}{i}")
                   for d in ("bf16", "fp8") for T in (1, 7) for i in ("staged", "fused")]
    for r in rows:
        assert (r["ranks"], r["num_gpus"], r["virtual_ranks"]) == (2, 1, 2)
        assert r["floor_us"] is None and r["efficiency"] is None
        assert r["tflops_per_gpu"] == pytest.approx(
            6 * 2 * r["tokens_per_rank"] * 2 * 128 * 128 / r["median_us"] / 1e6)
        assert r["agrees"] is True and r["fused_vs_staged"] < 1e-2
    alone = bench_virtual(shapes=[cfg], tokens=[3], ranks=2, impls=["fused"], reps=1,
                          warmup=0, device="cpu")
    assert [r["provider"] for r in alone] == ["fused"] and alone[0]["agrees"] is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(ranks=4), "divisible|divide"),            # 6 experts over 4 ranks
    (dict(ranks=2, impls=["chunked"]), "impls must be among"),
    (dict(ranks=2, dtypes=["fp16"]), "impls must be among"),
    (dict(ranks=2, tokens=[0]), "tokens must be ints >= 1"),
    (dict(ranks=0), "ranks must be an int >= 1"),
])
def test_virtual_layer_bench_rejects_bad_arguments(kwargs, match):
    from moestream.tools.bench_virtual import bench_virtual
    cfg = MoEConfig(hidden=128, intermediate=128, num_experts=6, top_k=2,
                    max_tokens_per_rank=8, block_m=16)
    with pytest.raises(ValueError, match=match):
        bench_virtual(**{"shapes": [cfg], "tokens": [3], "device": "cpu", **kwargs})


def test_bench_layer_option_runs_the_virtual_layer_bench(monkeypatch, tmp_path, capsys):
    # moestream bench --virtual-ranks 2 --layer: the options reach bench_virtual and its rows
    # land in --out; --layer without --virtual-ranks is refused
    import moestream.tools.bench_virtual as bv
    from moestream.tools.cli import main
    calls = []

    def fake(**kw):
        calls.append(kw)
        return [dict(shape="qwen3", ranks=2, num_gpus=1, tokens_per_rank=64, dtype="fp8",
                     provider="fp8-fused-graph", median_us=10.0, p20_us=9.0, p80_us=11.0,
                     tflops_per_gpu=1.0, agrees=True)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bv, "bench_virtual", fake)
    out = tmp_path / "vr.jsonl"
    assert main(["bench", "--virtual-ranks", "2", "--layer", "--shapes", "qwen3", "--tokens",
                 "64", "--dtype", "fp8", "--impl", "fused", "--experts", "32", "--out",
                 str(out)]) == 0
    (kw,) = calls
    assert (kw["ranks"], kw["tokens"], kw["dtypes"], kw["impls"], kw["experts"]) == (
        2, [64], ["fp8"], ["fused"], 32)
    assert [r["provider"] for r in load_rows(out)] == ["fp8-fused-graph"]
    assert main(["bench", "--layer", "--out", str(out)]) == 2
    assert "--layer needs --virtual-ranks" in capsys.readouterr().out
