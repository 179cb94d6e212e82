"""``moestream probe``: the calibration it assembles loads in the simulator, its arguments and
its CPU error path; its two Triton kernels copy rows correctly and never wait forever (the
interpreter on a CPU, the GPU where there is one) and compile for sm_90; on a GPU the quick
probe runs and gives plausible figures (two GPUs: peer figures too)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA, KERNEL_DEVICES, NUM_GPUS

from moestream.tools import probe, probe_gpu
from moestream.tools.probe import (ProbeError, ProbePlan, ProbeResults, assemble_calibration,
                             calibration_table, probe_plan, run_probe)
from moestream.tools.sim import Calibration

ROOT = Path(__file__).resolve().parents[2]


def _full_results(**overrides) -> ProbeResults:
    """Results as a 2-GPU probe produces them (made-up but plausible numbers)."""
    r = ProbeResults(
        device="2x Test GPU", num_sms=132, dense_bf16_tflops=700.0, hbm_copy_tbps=3.9,
        grouped_tokens_per_expert=[16, 128, 512, 2048],
        grouped_tflops={"torch": [40.0, 400.0, 690.0, 670.0], "triton": [60.0, 440.0, 560, 530]},
        grouped_l2_tflops={"torch": [40.0, 400.0, 630.0, 636.0], "triton": [50.0, 390, 430, 395]},
        host_copy_bytes=[4096 * 4 ** i for i in range(8)],
        host_copy_gbps=[0.4, 1.6, 6.0, 25.0, 90.0, 220.0, 320.0, 360.0],
        host_copy_us=[10.0] * 8, host_copy_peer=True,
        pull_row_bytes=[2048, 4096, 7168, 14336], pull_local_gbps=[1200.0, 1500, 1630, 1700],
        pull_peer_gbps=[300.0, 340, 354, 360],
        pull_programs={"row_bytes": 4096, "programs": [16, 132], "gbps": [50.0, 300.0],
                       "where": "peer"},
        flag_round_trip_us=2.6, flag_event_us=3.0, flag_peer=True, quick=True,
        versions={"torch": "x"})
    return replace(r, **overrides)


# ---- the plan --------------------------------------------------------------------------------
def test_plans_cover_the_schema_points():
    full, quick = probe_plan(), probe_plan(quick=True)
    for p in (full, quick):
        assert p.reps >= 10 and p.warmup >= 1
        assert p.grouped_tokens_per_expert == (16, 128, 512, 2048)
        assert p.host_copy_bytes == (4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20,
                                     64 << 20)
        assert probe.SCHEMA_ROW_BYTES in p.pull_row_bytes
        assert p.timeout_s <= 5
    assert full.dense_n == 8192 and full.hbm_copy_bytes == 1 << 30 and full.reps >= 20
    assert quick.quick and quick.hbm_copy_bytes < full.hbm_copy_bytes
    assert quick.pull_total_bytes < full.pull_total_bytes


@pytest.mark.parametrize("kwargs, match", [
    ({"reps": 5}, "reps must be an int >= 10"),
    ({"host_copy_bytes": (4096, 4096)}, "strictly ascending"),
    ({"pull_row_bytes": (4098,)}, "multiples of 4"),
    ({"pull_programs": ()}, "non-empty"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"pull_total_bytes": 1 << 16, "pull_row_bytes": (1 << 17,)}, "at least one row"),
])
def test_plan_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProbePlan(**kwargs)
    with pytest.raises(ValueError, match="quick must be a bool"):
        probe_plan(quick=1)


# ---- the calibration dict ----------------------------------------------------------------------
def test_full_results_assemble_into_a_calibration_that_loads(tmp_path):
    d = assemble_calibration(_full_results())
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    c = Calibration.load(p)
    assert d["schema"] == "moestream.calib/1"
    assert c.num_sms == 132 and c.dense_bf16_tflops == 700.0 and c.hbm_copy_tbps == 3.9
    assert c.grouped_tflops["triton"] == (60.0, 440.0, 560.0, 530.0)
    assert c.host_copy_bytes[0] == 4096 and c.host_copy_gbps[-1] == 360.0
    assert (c.device_pull_row_bytes, c.device_pull_peer_gbps, c.device_pull_local_gbps) == \
        (7168, 354.0, 1630.0)
    assert c.flag_round_trip_us == 2.6
    assert d["probe"]["not_measured"] == [] and d["probe"]["fallbacks"] == {}
    assert d["note"] == "every figure measured on this machine"
    assert d["device_pull"]["by_row_bytes"]["peer_gbps"] == [300.0, 340, 354, 360]
    assert d["device_pull"]["by_programs"]["programs"] == [16, 132]
    assert d["grouped_gemm"]["l2_tflops"]["triton"] == [50.0, 390, 430, 395]
    assert set(c.grouped_tflops) == {"torch", "triton"}      # L2 curves are not providers
    # the simulator runs on it
    startup, rate = c.host_copy_model()
    assert rate == 360.0 and startup >= 0


def test_one_gpu_results_are_marked_as_stand_ins():
    d = assemble_calibration(_full_results(host_copy_peer=False, pull_peer_gbps=[],
                                           flag_peer=False, device="Test GPU"))
    Calibration.from_dict(d)
    fb = d["probe"]["fallbacks"]
    assert set(fb) == {"host_peer_copy", "device_pull.peer_gbps", "flag_round_trip_us"}
    assert d["device_pull"]["peer_gbps"] == d["device_pull"]["local_gbps"] == 1630.0
    assert "FALLBACK" in d["host_peer_copy"]["note"] and "FALLBACK" in d["device_pull"]["note"]
    assert "describes no link" in d["note"]
    assert d["probe"]["not_measured"] == []


def test_unmeasured_sections_keep_the_packaged_values():
    base = Calibration.load()
    res = ProbeResults(device="broken", errors={"grouped_gemm.triton": "RuntimeError: boom"})
    d = assemble_calibration(res, base=base)
    c = Calibration.from_dict(d)
    assert set(d["probe"]["not_measured"]) == {
        "num_sms", "dense_bf16_tflops", "hbm_copy_tbps", "grouped_gemm", "host_peer_copy",
        "device_pull", "flag_round_trip_us"}
    assert c.dense_bf16_tflops == base.dense_bf16_tflops
    assert c.grouped_tflops == base.grouped_tflops
    assert d["probe"]["errors"] == {"grouped_gemm.triton": "RuntimeError: boom"}
    assert "not measured, copied from the packaged calibration" in d["note"]


def test_a_missing_or_partial_gemm_curve_is_left_out_and_said_so():
    res = _full_results(grouped_tflops={"torch": [40.0, 400.0, 690.0, 670.0],
                                        "triton": [60.0, 440.0]},
                        errors={"grouped_gemm.triton": "RuntimeError: kernel stalled"})
    d = assemble_calibration(res)
    assert list(d["grouped_gemm"]["tflops"]) == ["torch"]
    assert "triton not measured: RuntimeError: kernel stalled" in d["grouped_gemm"]["note"]
    c = Calibration.from_dict(d)
    with pytest.raises(ValueError, match="unknown GEMM provider 'triton'"):
        c.gemm_tflops(128, provider="triton")
    # bad values are not measurements
    d = assemble_calibration(_full_results(dense_bf16_tflops=float("nan"), num_sms=0))
    assert {"dense_bf16_tflops", "num_sms"} <= set(d["probe"]["not_measured"])


def test_the_schema_row_is_the_nearest_measured_size():
    d = assemble_calibration(_full_results(pull_row_bytes=[4096, 8192],
                                           pull_local_gbps=[1000.0, 1500.0],
                                           pull_peer_gbps=[300.0, 350.0]))
    assert d["device_pull"]["row_bytes"] == 8192 and d["device_pull"]["peer_gbps"] == 350.0
    with pytest.raises(ValueError, match="ProbeResults"):
        assemble_calibration({"num_sms": 1})


def test_the_table_shows_both_machines_and_the_status():
    from rich.console import Console

    con = Console(file=io.StringIO(), width=200)
    con.print(calibration_table(assemble_calibration(_full_results(host_copy_peer=False))))
    text = con.file.getvalue()
    for word in ("dense bf16 matmul", "grouped GEMM torch", "grouped GEMM triton", "fallback",
                 "L2 GEMM triton",
                 "measured", "flag round trip", "728", "2.6"):
        assert word in text, word


# ---- arguments and the CPU error path ------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"gemm_providers": ["cublas"]}, "gemm_providers"),
    ({"gemm_providers": ["torch", "torch"]}, "gemm_providers"),
    ({"devices": (0, 0)}, "two distinct GPU indices"),
    ({"devices": (0,)}, "two distinct GPU indices"),
    ({"quick": "yes"}, "quick must be a bool"),
    ({"plan": {"reps": 10}}, "plan must be a ProbePlan"),
])
def test_run_probe_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_probe(out=None, **kwargs)


def test_run_probe_refuses_a_directory(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        run_probe(out=tmp_path)


def test_without_cuda_the_probe_says_so(monkeypatch, tmp_path, capsys):
    from moestream.tools.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProbeError, match="needs a CUDA GPU"):
        run_probe(out=None, quick=True)
    out = tmp_path / "c.json"
    assert main(["probe", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "moestream probe: error: moestream probe needs a CUDA GPU" in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.skipif(HAS_CUDA, reason="the CPU error path of the command")
def test_the_command_exits_cleanly_without_cuda(tmp_path):
    res = subprocess.run([sys.executable, "-m", "moestream.tools.cli", "probe", "--out",
                          str(tmp_path / "c.json")], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr


def test_run_probe_runs_every_section_and_keeps_going_after_a_failure(monkeypatch, tmp_path):
    """The orchestration on a CPU: the GPU measurements are replaced by fakes (one fails)."""
    from types import SimpleNamespace

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(multi_processor_count=100, name="Fake GPU"))
    monkeypatch.setattr(probe_gpu, "enable_peer", lambda a, b, notes: True)
    monkeypatch.setattr(probe_gpu, "dense", lambda plan, dev: 500.0)
    monkeypatch.setattr(probe_gpu, "hbm", lambda plan, dev: 3.0)
    monkeypatch.setattr(probe_gpu, "cache_read",
                        lambda plan, dev, tick: [8.0 - i
                                                 for i in range(len(plan.cache_read_bytes))])

    def grouped_torch(plan, dev, tick):
        return [10.0, 100.0, 300.0, 400.0], [9.0, 90.0, 250.0, 300.0]

    def grouped_triton(plan, dev, tick):
        raise RuntimeError("no kernel today")

    def host(plan, a, b, tick):
        seen.append(("host", a.index, b.index))
        return [float(i + 1) for i in range(len(plan.host_copy_bytes))], \
            [5.0] * len(plan.host_copy_bytes)

    def pulls(plan, reader, holder, rows, tick, *, programs=()):
        seen.append(("pull", reader.index, holder.index, len(rows), len(programs)))
        return [100.0 * (i + 1) for i in range(len(rows))], [50.0] * len(programs)

    def ping(plan, a, b):
        seen.append(("flag", a.index, b.index))
        return 2.5, 3.5

    for name, fn in (("grouped_torch", grouped_torch), ("grouped_triton", grouped_triton),
                     ("host_copies", host), ("pulls", pulls), ("ping_pong", ping)):
        monkeypatch.setattr(probe_gpu, name, fn)
    out = tmp_path / "sub" / "calib.json"
    d = run_probe(out=out, quick=True, progress=False)
    assert json.loads(out.read_text()) == d
    c = Calibration.from_dict(d)
    assert (c.num_sms, c.dense_bf16_tflops, c.hbm_copy_tbps, c.flag_round_trip_us) == \
        (100, 500.0, 3.0, 2.5)
    assert list(c.grouped_tflops) == ["torch"]
    assert "triton not measured: RuntimeError: no kernel today" in d["grouped_gemm"]["note"]
    assert d["probe"]["errors"] == {"grouped_gemm.triton": "RuntimeError: no kernel today"}
    assert d["probe"]["fallbacks"] == {} and d["probe"]["not_measured"] == []
    assert c.device_pull_peer_gbps == 200.0     # the 7168-byte row of the quick plan
    assert d["cache_read"] == {**d["cache_read"],
                               "bytes": list(probe_plan(quick=True).cache_read_bytes),
                               "tbps": [8.0, 7.0, 6.0, 5.0, 4.0]}
    assert d["device_pull"]["by_programs"]["where"] == "peer"
    assert seen == [("pull", 0, 0, 3, 0), ("host", 0, 1), ("pull", 0, 1, 3, 3), ("flag", 0, 1)]
    assert set(d["probe"]["timings_s"]) >= {"dense bf16 matmul", "flag_round_trip"}
    # no peer access: every peer figure is taken on GPU 0 and marked
    seen.clear()
    monkeypatch.setattr(probe_gpu, "enable_peer", lambda a, b, notes: False)
    d = run_probe(out=None, quick=True, progress=False, gemm_providers=["torch"])
    assert seen == [("pull", 0, 0, 3, 0), ("host", 0, 0), ("pull", 0, 0, 0, 3), ("flag", 0, 0)]
    assert set(d["probe"]["fallbacks"]) == {"host_peer_copy", "device_pull.peer_gbps",
                                            "flag_round_trip_us"}
    assert d["probe"]["errors"] == {}


# ---- the kernels ---------------------------------------------------------------------------------
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("programs", [None, 3])
def test_pull_rows_copies_the_indexed_rows(device, programs, gen):
    src = torch.randint(-2**31, 2**31 - 1, (40, 12), generator=gen, dtype=torch.int32)
    idx = torch.randperm(40, generator=gen)[:29].to(torch.int32)
    src, idx = src.to(device), idx.to(device)
    out = probe.pull_rows(src, idx, programs=programs)
    assert torch.equal(out, src[idx.long()])
    # through an explicit address (how the probe reads a peer's buffer)
    out2 = probe.pull_rows(src[:1], idx, src_address=src.data_ptr(), programs=programs)
    assert torch.equal(out2, out)
    with pytest.raises(ValueError, match="int32"):
        probe.pull_rows(src.float(), idx)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_ping_pong_side_alone_gives_up(device):
    """No peer answers: the initiator stops after its bound and says so; a responder answers
    the round trips that came and then stops too."""
    use_timer = device == "cuda"
    flags = torch.zeros(2, 8, dtype=torch.int32, device=device)
    tab = torch.tensor([flags[0].data_ptr(), flags[1].data_ptr()], dtype=torch.int64,
                       device=device)
    out = torch.zeros(3, dtype=torch.int64, device=device)
    spins, timeout_ns = (2**31 - 1, 20_000_000) if use_timer else (20, 10**9)
    probe_gpu.ping_pong_kernel[(1,)](tab, out, 10, 2, spins, timeout_ns, INITIATOR=True,
                                  USE_TIMER=use_timer, num_warps=1)
    assert out.tolist()[1:] == [0, 0] and flags[1, 0].item() == 1
    flags.zero_()
    flags[0, 0] = 3          # three pings already there
    out.zero_()
    probe_gpu.ping_pong_kernel[(1,)](tab, out, 10, 0, spins, timeout_ns, INITIATOR=False,
                                  USE_TIMER=use_timer, num_warps=1)
    assert out.tolist()[1:] == [3, 0] and flags[1, 0].item() == 3
    out.zero_()              # zero round trips: nothing waits (how the probe compiles both)
    probe_gpu.ping_pong_kernel[(1,)](tab, out, 0, 0, spins, timeout_ns, INITIATOR=True,
                                  USE_TIMER=use_timer, num_warps=1)
    assert out.tolist()[1:] == [0, 1]


_COMPILE = r"""
import json, torch
from triton.runtime.driver import driver
from moestream.tools.aot import _CompileOnlyDriver
from moestream.tools import probe, probe_gpu
driver.set_active(_CompileOnlyDriver(90))
k = probe_gpu.pull_rows_kernel.warmup(torch.zeros(1, dtype=torch.int64),
    torch.zeros(8, 1792, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), 8,
    ROW_WORDS=1792, BLOCK=2048, num_warps=4, grid=(8,))
out = {"pull": k.metadata.shared}
for ini in (True, False):
    k = probe_gpu.ping_pong_kernel.warmup(torch.zeros(2, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int64), 500, 50, 2**31 - 1, 2 * 10**9, INITIATOR=ini,
        USE_TIMER=True, num_warps=1, grid=(1,))
    out["initiator" if ini else "responder"] = k.asm["ptx"]
# the cache probe as probe.reread launches it (slices of whole 1024-word blocks)
k = probe_gpu.reread_kernel.warmup(torch.zeros(1 << 20), torch.zeros(528), 1 << 20, 2048, 16,
    BLOCK=1024, num_warps=4, grid=(528,))
out["reread"] = k.asm["ptx"]
print(json.dumps(out))
"""


def test_the_probe_kernels_compile_for_sm90_with_system_scope_flags():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for side in ("initiator", "responder"):
        ptx = out[side]
        assert "atom.global.sys.release.exch" in ptx      # the write to the other side
        assert "ld.global.sys.acquire" in ptx             # atomic_add(p, 0), acquire
        assert "%globaltimer" in ptx                      # waits bounded in time
    # the cache probe reads 16 bytes per load past L1 (.cg), so it measures L2, not L1
    assert "ld.global.cg.v4" in out["reread"] and "ld.global.v4" not in out["reread"]


# ---- on a GPU ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "calib.json"
    d = run_probe(out=path, quick=True, progress=False)
    return d, path


@pytest.mark.gpu
def test_quick_probe_gives_a_plausible_calibration(quick_probe):
    d, path = quick_probe
    c = Calibration.load(path)
    assert json.loads(path.read_text()) == d
    assert d["probe"]["errors"] == {}, d["probe"]["errors"]
    assert d["probe"]["not_measured"] == []
    assert c.num_sms == torch.cuda.get_device_properties(0).multi_processor_count
    assert 100 <= c.dense_bf16_tflops <= 2000
    assert 0.5 <= c.hbm_copy_tbps <= 20
    assert set(c.grouped_tflops) == {"torch", "triton"}
    for rates in c.grouped_tflops.values():
        assert all(1 <= r <= 2000 for r in rates) and rates[-1] > rates[0]
    assert all(0.01 <= g <= 5000 for g in c.host_copy_gbps)
    assert c.host_copy_gbps[-1] > c.host_copy_gbps[0]          # start-up cost per copy
    assert 100 <= c.device_pull_local_gbps <= 10000
    assert 0.1 <= c.flag_round_trip_us <= 100
    # cache re-reads: recorded next to the schema; the largest buffer (> L2) reads from HBM
    cr = d["cache_read"]
    assert cr["bytes"] == list(probe_plan(quick=True).cache_read_bytes)
    assert all(0.5 <= t <= 100 for t in cr["tbps"]) and cr["tbps"][-1] <= 2 * c.hbm_copy_tbps
    assert sum(d["probe"]["timings_s"].values()) < 120


@pytest.mark.gpu
@pytest.mark.multigpu
def test_quick_probe_measures_the_peer_link(quick_probe):
    d, _ = quick_probe
    c = Calibration.from_dict(d)
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPUs 0 and 1 have no peer access")
    assert d["probe"]["fallbacks"] == {}, d["probe"]
    assert 10 <= c.device_pull_peer_gbps < c.device_pull_local_gbps
    assert 10 <= c.host_copy_gbps[-1] <= 2000
    assert 0.3 <= c.flag_round_trip_us <= 50
    assert d["device_pull"]["by_programs"]["where"] == "peer"


@pytest.mark.gpu
@pytest.mark.skipif(NUM_GPUS >= 2, reason="one-GPU fallbacks")
def test_quick_probe_on_one_gpu_marks_the_stand_ins(quick_probe):
    d, _ = quick_probe
    assert set(d["probe"]["fallbacks"]) == {"host_peer_copy", "device_pull.peer_gbps",
                                            "flag_round_trip_us"}


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("n, programs, rounds", [
    (4096, 4, 3),      # slices of whole blocks
    (5000, 3, 2),      # a slice that ends inside a block, a last slice cut short by n
    (100, 7, 1),       # more programs than blocks: some slices are empty
])
def test_reread_sums_every_word_once_per_round(device, n, programs, rounds, gen):
    # the cache probe's kernel: each round reads the whole buffer exactly once (spread over the
    # programs in a rotated order), so the programs' sums add up to rounds x the buffer's sum
    src = torch.randint(0, 7, (n,), generator=gen).float().to(device)
    out = probe.reread(src, rounds=rounds, programs=programs, block=256)
    assert out.shape == (programs,)
    assert float(out.double().sum()) == pytest.approx(rounds * float(src.double().sum()), rel=1e-6)
    with pytest.raises(ValueError, match="contiguous fp32"):
        probe.reread(src.double(), rounds=1, programs=1)
    with pytest.raises(ValueError, match="rounds must be an int >= 1"):
        probe.reread(src, rounds=0, programs=1)


def test_cache_read_is_recorded_when_measured():
    r = _full_results(cache_read_bytes=[8 << 20, 512 << 20], cache_read_tbps=[9.5, 4.1])
    d = assemble_calibration(r)
    assert d["cache_read"]["bytes"] == [8 << 20, 512 << 20]
    assert d["cache_read"]["tbps"] == [9.5, 4.1]
    assert "cache_read" not in assemble_calibration(_full_results())   # not measured: left out
    with pytest.raises(ValueError, match="multiples of 4096"):
        ProbePlan(cache_read_bytes=(5000,))
