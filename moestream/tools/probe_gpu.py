"""The probe's GPU side (``moestream probe``, ``moestream.tools.probe``): Triton kernels that
pull rows by address, re-read a buffer and bounce a flag between two GPUs, and the timed
measurements ``run_probe`` makes with them. Every spin is bounded by a poll count and a
wall-time limit."""
from __future__ import annotations

import contextlib
import functools
import statistics
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..kernels.common import next_pow2, now_ns, tl, triton

if TYPE_CHECKING:
    from .probe import ProbePlan

__all__ = ["ProbeError", "GROUPED_DIMS", "TRITON_VARIANT", "pull_rows", "reread",
           "pull_rows_kernel", "reread_kernel", "ping_pong_kernel", "dense", "hbm",
           "cache_read", "grouped_torch", "grouped_triton", "host_copies", "pulls", "ping_pong",
           "enable_peer"]

# the grouped GEMM of the calibration: dsv3's L1 (gate and up), 32 local experts
GROUPED_DIMS = dict(hidden=7168, intermediate=2048, experts=32)
TRITON_VARIANT = "layer-call"   # the L1 as the layer launches it for each call


class ProbeError(RuntimeError):
    """The probe cannot run here (no CUDA GPU, ...); the message says why."""


# ---- Triton kernels ---------------------------------------------------------------------------
@triton.jit
def pull_rows_kernel(src_table, dst, idx, n_rows, ROW_WORDS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """dst[i] = src[idx[i]] for rows i = program, program + programs, ...

    src_table: int64[1], the address of src, an int32 [*, ROW_WORDS] buffer (any GPU's, or a
    peer's mapped over NVLink); dst: int32 [n_rows, ROW_WORDS]; idx: int32 [n_rows].
    """
    i = tl.program_id(0)
    step = tl.num_programs(0)
    src = tl.load(src_table).to(tl.int64).to(tl.pointer_type(tl.int32))
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW_WORDS
    while i < n_rows:   # a while loop: bounds from program_id (also runs in the interpreter)
        s = tl.load(idx + i).to(tl.int64)
        v = tl.load(src + s * ROW_WORDS + offs, mask=mask)
        tl.store(dst + i.to(tl.int64) * ROW_WORDS + offs, v, mask=mask)
        i += step


@triton.jit
def reread_kernel(src, out, n_words, slice_words, rounds, BLOCK: tl.constexpr):
    """out[program] = fp32 sum of ``rounds`` reads of one slice of ``src`` (fp32 [n_words]) per
    round: in round r, program p reads slice (p + r) mod programs of ``slice_words`` words, so
    no program re-reads what its own SM's L1 holds, and the loads skip L1 anyway (``.cg``).
    ``slice_words`` is a multiple of BLOCK (whole, aligned blocks: 16-byte vector loads)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(rounds):
        base = tl.multiple_of(((pid + r) % nprog).to(tl.int64) * slice_words, BLOCK)
        for off in range(0, slice_words, BLOCK):
            idx = base + off + tl.arange(0, BLOCK)
            acc += tl.load(src + idx, mask=idx < n_words, other=0.0, cache_modifier=".cg")
    tl.store(out + pid, tl.sum(acc, axis=0))


def reread(src: torch.Tensor, *, rounds: int, programs: int,
           out: torch.Tensor | None = None, block: int = 1024) -> torch.Tensor:
    """Per-program sums of ``rounds`` full reads of ``src`` (fp32 [n]) by ``reread_kernel``
    with ``programs`` programs (fp32 [programs]); ``out.sum()`` is ``rounds * src.sum()`` up
    to fp32 rounding."""
    if src.dtype != torch.float32 or src.dim() != 1 or not src.is_contiguous():
        raise ValueError("src must be a contiguous fp32 [n] tensor")
    for name, v in (("rounds", rounds), ("programs", programs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if out is None:
        out = torch.empty(programs, dtype=torch.float32, device=src.device)
    n = src.numel()
    slice_words = -(-n // (programs * block)) * block   # whole blocks per program
    with torch.cuda.device(src.device) if src.is_cuda else contextlib.nullcontext():
        reread_kernel[(programs,)](src, out, n, slice_words, rounds, BLOCK=block, num_warps=4)
    return out


# not specialised on the counts: the zero-round-trip launch that compiles each side must
# compile the very kernel the timed launches run (no compilation while the other side waits)
@triton.jit(do_not_specialize=["round_trips", "warmup_round_trips", "max_spins", "timeout_ns"])
def ping_pong_kernel(table, out, round_trips, warmup_round_trips, max_spins, timeout_ns,
                     INITIATOR: tl.constexpr, USE_TIMER: tl.constexpr):
    """One side of a flag ping-pong; launch one program per side.

    table: int64[2]: [0] the address of the int32 flag this side polls (in its own memory),
    [1] the address of the flag it writes (the other side's). The initiator writes i, then
    waits for i back; the responder waits for i, then writes i back (i = 1, 2, ...). Each wait
    is bounded by ``timeout_ns`` (global timer) and ``max_spins`` polls.
    out: int64[3]: ns spent on the round trips after the warm-up ones, round trips done, ok.
    """
    mine = tl.load(table).to(tl.pointer_type(tl.int32))
    theirs = tl.load(table + 1).to(tl.pointer_type(tl.int32))
    total = round_trips + warmup_round_trips
    ok = 1
    i = 1
    t_start = now_ns(USE_TIMER)
    while (i <= total) & (ok == 1):
        t_start = tl.where(i == warmup_round_trips + 1, now_ns(USE_TIMER), t_start)
        if INITIATOR:
            tl.atomic_xchg(theirs, i, sem="release", scope="sys")
        v = tl.atomic_add(mine, 0, sem="acquire", scope="sys")
        spins = 0
        t0 = now_ns(USE_TIMER)
        while (v < i) & (spins < max_spins):
            v = tl.atomic_add(mine, 0, sem="acquire", scope="sys")
            spins += 1
            if now_ns(USE_TIMER) - t0 > timeout_ns:
                spins = max_spins
        ok = tl.where(v >= i, 1, 0)
        if not INITIATOR:
            if ok == 1:
                tl.atomic_xchg(theirs, i, sem="release", scope="sys")
        i += 1
    t_end = now_ns(USE_TIMER)
    tl.store(out, (t_end - t_start).to(tl.int64))
    tl.store(out + 1, (i - 2 + ok).to(tl.int64))   # round trips completed
    tl.store(out + 2, ok.to(tl.int64))


def pull_rows(src: torch.Tensor, idx: torch.Tensor, *, out: torch.Tensor | None = None,
              programs: int | None = None, src_address: int | None = None) -> torch.Tensor:
    """``out[i] = src[idx[i]]`` by ``pull_rows_kernel`` (rows of int32; ``src`` is read
    through its address, so it may live on another GPU with peer access enabled).

    Args:
        src: int32 [rows, W] contiguous (any device reachable from ``idx``'s device).
        idx: int32 [n] row ids on the launching device.
        out: optional int32 [n, W] on ``idx``'s device.
        programs: grid size (default n: one row per program).
        src_address: read from this address instead of ``src.data_ptr()`` (same layout).
    """
    if src.dtype != torch.int32 or src.dim() != 2 or not src.is_contiguous():
        raise ValueError("src must be a contiguous int32 [rows, W] tensor")
    if idx.dtype != torch.int32 or idx.dim() != 1:
        raise ValueError("idx must be an int32 [n] tensor")
    n, w = idx.numel(), src.shape[1]
    dev = idx.device
    if out is None:
        out = torch.empty(n, w, dtype=torch.int32, device=dev)
    table = torch.tensor([src.data_ptr() if src_address is None else src_address],
                         dtype=torch.int64, device=dev)
    _launch_pull(table, out, idx, programs)
    return out


def _launch_pull(table: torch.Tensor, out: torch.Tensor, idx: torch.Tensor,
                 programs: int | None) -> None:
    n, w = out.shape
    grid = (max(1, min(n, programs or n)),)
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        pull_rows_kernel[grid](table, out, idx, n, ROW_WORDS=w, BLOCK=next_pow2(w),
                                num_warps=4)


# ---- measurements (GPU) ------------------------------------------------------------------
def _median_us(fn: Callable[[], Any], plan: ProbePlan, device: torch.device) -> float:
    from .bench import time_cuda
    with torch.cuda.device(device):
        t = time_cuda(fn, warmup=plan.warmup, reps=plan.reps)
        torch.cuda.synchronize(device)
    return float(t["median_us"])


def dense(plan: ProbePlan, dev: torch.device) -> float:
    n = plan.dense_n
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=g, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    us = _median_us(lambda: torch.mm(a, b, out=c), plan, dev)
    return 2.0 * n ** 3 / us / 1e6


def hbm(plan: ProbePlan, dev: torch.device) -> float:
    src = torch.randint(0, 255, (plan.hbm_copy_bytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = _median_us(lambda: dst.copy_(src), plan, dev)
    return 2.0 * plan.hbm_copy_bytes / us / 1e6          # read + write, TB/s


def cache_read(plan: ProbePlan, dev: torch.device, tick: Callable[[], None]) -> list[float]:
    """TB/s of ``reread`` (read bytes counted) for each of ``plan.cache_read_bytes``, with four
    programs per SM; each size's sums are checked once against torch's."""
    programs = 4 * torch.cuda.get_device_properties(dev).multi_processor_count
    rates = []
    for nbytes in plan.cache_read_bytes:
        n = nbytes // 4
        src = (torch.arange(n, device=dev) % 7).to(torch.float32)   # exact small sums
        out = torch.empty(programs, dtype=torch.float32, device=dev)
        reread(src, rounds=plan.cache_read_rounds, programs=programs, out=out)
        want = plan.cache_read_rounds * float(src.double().sum())
        if abs(float(out.double().sum()) - want) > 1e-5 * want:
            raise ProbeError(f"cache re-read of {nbytes} B summed {float(out.sum())}, want {want}")
        us = _median_us(functools.partial(reread, src, rounds=plan.cache_read_rounds,
                                          programs=programs, out=out), plan, dev)
        rates.append(nbytes * plan.cache_read_rounds / us / 1e6)
        del src
        tick()
    return rates


def grouped_torch(plan: ProbePlan, dev: torch.device,
                  tick: Callable[[], None]) -> tuple[list[float], list[float]]:
    """TFLOP/s of torch._grouped_mm for the L1 GEMM [E*M, H] x [E, H, 2I] and the L2 GEMM
    [E*M, I] x [E, I, H], per rows per expert M."""
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
    d = GROUPED_DIMS
    H, I, E = d["hidden"], d["intermediate"], d["experts"]  # noqa: E741 - the paper's names
    g = torch.Generator(device=dev).manual_seed(0)
    # as moestream.tools.bench_kernels builds them: weights drawn on the GPU, [E, 2I, H], scaled
    w13 = (torch.randn(E, 2 * I, H, generator=g, device=dev) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device=dev) * I ** -0.5).bfloat16()
    l1, l2 = [], []
    for M in plan.grouped_tokens_per_expert:
        x = torch.randn(E * M, H, generator=g, device=dev).bfloat16()   # packed, no padding
        a = torch.randn(E * M, I, generator=g, device=dev).bfloat16()
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * M
        fn = functools.partial(torch._grouped_mm, x, w13.transpose(-2, -1), offs=offs)
        l1.append(2.0 * E * M * H * 2 * I / _median_us(fn, plan, dev) / 1e6)
        fn = functools.partial(torch._grouped_mm, a, w2.transpose(-2, -1), offs=offs)
        l2.append(2.0 * E * M * I * H / _median_us(fn, plan, dev) / 1e6)
        tick()
    return l1, l2


def grouped_triton(plan: ProbePlan, dev: torch.device,
                   tick: Callable[[], None]) -> tuple[list[float], list[float], str]:
    """TFLOP/s of moestream's L1 and L2 kernels (``bench_gemm``, one virtual rank), and a
    note."""
    from .bench_kernels import VARIANTS, bench_gemm
    if TRITON_VARIANT not in VARIANTS:
        raise RuntimeError(f"moestream.tools.bench_kernels has no variant {TRITON_VARIANT!r}")
    with torch.cuda.device(dev):
        rows = bench_gemm(shape="dsv3", tokens_per_expert=list(plan.grouped_tokens_per_expert),
                          experts_per_rank=GROUPED_DIMS["experts"], virtual_ranks=1,
                          variants=[TRITON_VARIANT], warmup=plan.warmup, reps=plan.reps,
                          progress=tick)
    ours = {r["tokens_per_expert"]: r for r in rows
            if r.get("kernel") == "l1" and r.get("provider") == f"ours:{TRITON_VARIANT}"}
    ours_l2 = {r["tokens_per_expert"]: r for r in rows
               if r.get("kernel") == "l2" and r.get("provider") == f"ours:{TRITON_VARIANT}"}
    missing = [m for m in plan.grouped_tokens_per_expert if m not in ours]
    if missing:
        raise RuntimeError(f"bench_gemm returned no L1 row for rows per expert {missing}")
    errs = [ours[m].get("l1_rel_error") for m in plan.grouped_tokens_per_expert]
    worst = max((e for e in errs if isinstance(e, (int, float))), default=None)
    note = f"bench_gemm L1 rows (variant {TRITON_VARIANT}); worst L1 rel error vs torch {worst}"
    if worst is not None and worst > 0.05:
        raise RuntimeError(f"the L1 kernel disagrees with torch (rel error {worst:.2e}); not timed")
    ms = plan.grouped_tokens_per_expert
    l2 = [float(ours_l2[m]["tflops_per_gpu"]) for m in ms] if all(m in ours_l2 for m in ms) \
        else []
    return [float(ours[m]["tflops_per_gpu"]) for m in ms], l2, note


def _copy_all(views: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for d, s in views:
        d.copy_(s)


def host_copies(plan: ProbePlan, src_dev: torch.device, dst_dev: torch.device,
                tick: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Per size: (GB/s, µs per copy) of ``dst.copy_(src)`` from src_dev to dst_dev, n copies of
    distinct slices per timed call (the copy runs on the source device's current stream)."""
    gbps, us_per = [], []
    for size in plan.host_copy_bytes:
        n = max(1, min(plan.host_copy_max_batch, plan.host_copy_batch_bytes // size))
        src = torch.randint(0, 255, (n * size,), dtype=torch.uint8, device=src_dev)
        dst = torch.empty(n * size, dtype=torch.uint8, device=dst_dev)
        views = [(dst[i * size:(i + 1) * size], src[i * size:(i + 1) * size]) for i in range(n)]
        us = _median_us(functools.partial(_copy_all, views), plan, src_dev) / n
        torch.cuda.synchronize(dst_dev)
        if not torch.equal(dst[:size].to(src_dev), src[:size]):
            raise RuntimeError(f"copy of {size} bytes from {src_dev} to {dst_dev} is wrong")
        us_per.append(us)
        gbps.append(size / us / 1e3)
        tick()
    return gbps, us_per


def pulls(plan: ProbePlan, reader: torch.device, holder: torch.device, row_bytes: Sequence[int],
          tick: Callable[[], None], *,
          programs: Sequence[int] = ()) -> tuple[list[float], list[float]]:
    """GB/s (read bytes) of ``pull_rows_kernel`` launched on ``reader`` pulling rows from a
    buffer on ``holder``: one row per program per row size, then a persistent-grid sweep over
    ``programs`` at ``plan.pull_programs_row_bytes``. The first pull is checked."""
    words = plan.pull_total_bytes // 4
    g = torch.Generator(device=holder).manual_seed(1)
    src_all = torch.randint(-2**31, 2**31 - 1, (words,), generator=g, dtype=torch.int32,
                            device=holder)
    dst_all = torch.empty(words, dtype=torch.int32, device=reader)

    def rate(rb: int, progs: int | None, check: bool) -> float:
        w = rb // 4
        n = words // w
        src = src_all[:n * w].view(n, w)
        dst = dst_all[:n * w].view(n, w)
        idx = torch.randperm(n, device=reader).to(torch.int32)
        table = torch.tensor([src.data_ptr()], dtype=torch.int64, device=reader)
        fn = functools.partial(_launch_pull, table, dst, idx, progs)   # no host work timed
        fn()
        torch.cuda.synchronize(reader)
        if check:
            want = src[idx.to(holder).long()].to(reader)
            if not torch.equal(dst, want):
                raise RuntimeError(f"pulled rows from {holder} on {reader} are wrong")
        us = _median_us(fn, plan, reader)
        return n * rb / us / 1e3

    by_row = []
    for j, rb in enumerate(row_bytes):
        by_row.append(rate(rb, None, j == 0))
        tick()
    by_prog = []
    for p in programs:
        by_prog.append(rate(plan.pull_programs_row_bytes, p, False))
        tick()
    return by_row, by_prog


def ping_pong(plan: ProbePlan, dev_a: torch.device, dev_b: torch.device) -> tuple[float, float]:
    """(round trip µs from the in-kernel timer, µs per round trip from CUDA events around the
    initiator's launch), medians over ``plan.flag_launches`` launches.

    The initiator runs on dev_a and polls a flag in dev_a's memory; the responder on dev_b
    polls one in dev_b's memory; each writes the other's flag. On one device the two kernels
    run on two streams."""
    same = dev_a == dev_b
    flag_a = torch.zeros(32, dtype=torch.int32, device=dev_a)
    flag_b = torch.zeros(32, dtype=torch.int32, device=dev_b)
    tab_a = torch.tensor([flag_a.data_ptr(), flag_b.data_ptr()], dtype=torch.int64, device=dev_a)
    tab_b = torch.tensor([flag_b.data_ptr(), flag_a.data_ptr()], dtype=torch.int64, device=dev_b)
    out_a = torch.zeros(3, dtype=torch.int64, device=dev_a)
    out_b = torch.zeros(3, dtype=torch.int64, device=dev_b)
    with torch.cuda.device(dev_a):
        stream_a = torch.cuda.Stream(dev_a)
    with torch.cuda.device(dev_b):
        stream_b = torch.cuda.Stream(dev_b)
    timeout_ns = int(plan.timeout_s * 1e9)
    spins = 2**31 - 1

    def launch(n: int, warm: int, initiator: bool) -> None:
        dev, tab, out, st = (dev_a, tab_a, out_a, stream_a) if initiator else \
            (dev_b, tab_b, out_b, stream_b)
        with torch.cuda.device(dev), torch.cuda.stream(st):
            ping_pong_kernel[(1,)](tab, out, n, warm, spins, timeout_ns, INITIATOR=initiator,
                                    USE_TIMER=True, num_warps=1)

    def sync() -> None:
        torch.cuda.synchronize(dev_a)
        if not same:
            torch.cuda.synchronize(dev_b)

    # compile both sides first (zero round trips: nothing waits), so that neither side waits
    # for the other's compilation
    launch(0, 0, True)
    launch(0, 0, False)
    sync()
    kernel_us, event_us = [], []
    n, warm = plan.flag_round_trips, plan.flag_warmup_round_trips
    for _ in range(plan.flag_launches):
        flag_a.zero_()
        flag_b.zero_()
        out_a.zero_()
        out_b.zero_()
        sync()
        launch(n, warm, False)               # the responder first: it waits for round trip 1
        with torch.cuda.device(dev_a):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream_a)
            launch(n, warm, True)
            end.record(stream_a)
        sync()
        a, b = out_a.tolist(), out_b.tolist()
        if not (a[2] == 1 and b[2] == 1):
            raise RuntimeError(f"flag ping-pong timed out after {plan.timeout_s} s (initiator "
                               f"ok={a[2]}, responder ok={b[2]})")
        kernel_us.append(a[0] / 1e3 / n)
        event_us.append(start.elapsed_time(end) * 1e3 / (n + warm))
    return statistics.median(kernel_us), statistics.median(event_us)


def _cudart_enable_peer(a: torch.device, b: torch.device) -> str:
    """Best effort: ``cudaDeviceEnablePeerAccess`` from a to b through the CUDA runtime torch
    loaded. "enabled" (it was not yet), "already" (torch had enabled it), "failed (code)", or
    "unknown" (no runtime library found)."""
    import ctypes
    lib = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            continue
    if lib is None or not hasattr(lib, "cudaDeviceEnablePeerAccess"):
        return "unknown"
    with torch.cuda.device(a):
        torch.cuda.synchronize(a)
        lib.cudaSetDevice(ctypes.c_int(a.index))   # torch's guard restores its device after
        code = int(lib.cudaDeviceEnablePeerAccess(ctypes.c_int(b.index), ctypes.c_uint(0)))
    if code == 704:                 # cudaErrorPeerAccessAlreadyEnabled
        lib.cudaGetLastError()      # clear it, so torch does not see a stale error
        return "already"
    return "enabled" if code == 0 else f"failed ({code})"


def enable_peer(a: torch.device, b: torch.device, notes: dict[str, str]) -> bool:
    """Whether a and b can read each other's memory. Enables peer access both ways: torch does
    on the first copy between two devices (its allocator also maps its expandable segments
    for the peer then); the CUDA runtime is then asked directly, which confirms it (or enables
    it where torch did not); its answer is only noted (a runtime other than torch's may answer
    for another state). Checked with a copy each way."""
    if not (torch.cuda.can_device_access_peer(a.index, b.index)
            and torch.cuda.can_device_access_peer(b.index, a.index)):
        return False
    x = torch.arange(1024, dtype=torch.int32, device=a)
    y = x.to(b)
    z = y.to(a)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)
    states = [_cudart_enable_peer(a, b), _cudart_enable_peer(b, a)]
    notes["peer access"] = (f"cudaDeviceEnablePeerAccess after torch's copies: "
                            f"cuda:{a.index}->cuda:{b.index} {states[0]}, "
                            f"cuda:{b.index}->cuda:{a.index} {states[1]}")
    return bool(torch.equal(x, z))
