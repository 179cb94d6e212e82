"""What every kernel file shares: the interpreter switch, peer pointers and bounded waits.

On a machine without CUDA the kernels run in Triton's interpreter. Triton picks interpreter or
compiler when it is imported (TRITON_INTERPRET is read as its language module is decorated),
so this module sets TRITON_INTERPRET=1 before importing triton when there is no CUDA device;
on such a machine no other use of Triton is possible anyway.

Peers are reached through a table of base addresses (int64[R], one per rank's buffer); a
region of peer r lives at ``table[r] + region offset``. The same code serves virtual ranks (R
buffers in one process) and real peers (symmetric memory mapped over NVLink).
"""
from __future__ import annotations

import os
import sys

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# TRITON_INTERPRET=0 set explicitly keeps the compiler even without a GPU (ahead-of-time
# compilation checks of the kernels for sm_90 on a CPU machine).
if not INTERPRET and not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        import triton.language as _tl
        from triton.runtime.jit import JITFunction as _JITFunction
        if isinstance(_tl.cumsum, _JITFunction):
            raise ImportError("moestream needs Triton's interpreter on a machine without CUDA, "
                              "but triton was imported before moestream without "
                              "TRITON_INTERPRET=1; set TRITON_INTERPRET=1 in the environment "
                              "(or import moestream first)")
    os.environ["TRITON_INTERPRET"] = "1"
    INTERPRET = True

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import globaltimer  # noqa: E402

if INTERPRET:
    from .interpret import (enable_overflow_checks, index_scalars_with_item,
                            skip_discarded_overflow_checks, skip_repeated_patches)
    index_scalars_with_item()
    skip_repeated_patches()
    if os.environ.get("MOESTREAM_INTERPRET_CHECKS") == "1":
        enable_overflow_checks()
    else:
        skip_discarded_overflow_checks()

__all__ = ["INTERPRET", "triton", "tl", "to_bf16", "launch_context", "peer_ptr",
           "peer_ptrs", "aligned_ptr_from", "at", "rank_base",
           "wait_at_least", "wait_all_at_least", "record_stall", "now_ns", "stalled",
           "PHASE_CODES", "next_pow2", "DECODE_STORE_EVICT"]

# The L2-cache priority of what decode pieces store for the next launch: the L1's pool_act
# rows (bf16: kernels/epilogue.py ``l1_store``'s EVICT_LAST; fp8 values and scales: kernels/
# gemm_fp8.py ``l1_fp8_epilogue``'s; the L2 reads each row once per column block) and the
# L2's combine slots (``l2_epilogue``'s EVICT_LAST; the combine reads them). They are few,
# and stored at normal priority they were written back to HBM while the weights streamed
# through the cache, which the weight reads paid for (see docs/tuning.md). Whole tiles and
# tail pieces (larger calls: up to all of combine_y, a block per expert of pool_act) keep
# the normal priority. Triton's descriptor loads take no cache hint, so the weights cannot
# be marked the other way.
DECODE_STORE_EVICT = tl.constexpr("evict_last")

# diag "phase" codes written by a kernel that gave up waiting
PHASE_CODES = {1: "layout: peer ready flag", 2: "L1: pool block arrival count",
               3: "L2: L1 column blocks of an m-block", 4: "combine: L2 rows of a token's picks",
               5: "combine: every rank's L2 finished"}


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@triton.jit
def to_bf16(x, FIX_ROUNDING: tl.constexpr):
    """fp32 -> bf16, round to nearest even. The interpreter's cast truncates (twice the error
    of the GPU's rounding); with FIX_ROUNDING the value is rounded in integer arithmetic to one
    that bf16 represents exactly, so the cast has nothing left to truncate."""
    if FIX_ROUNDING:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def zero_acc(ROWS: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """An fp32 GEMM accumulator of zeros: [ROWS, BN] (rows @ weights^T), or [BN, ROWS] with
    SWAP (decode and tail pieces: the weight tile as the MMA's row operand)."""
    if SWAP:
        acc = tl.zeros([BN, ROWS], dtype=tl.float32)
    else:
        acc = tl.zeros([ROWS, BN], dtype=tl.float32)
    return acc


@triton.jit
def peer_ptr(table, rank, byte_offset, DTYPE: tl.constexpr):
    """Pointer to ``byte_offset`` inside rank ``rank``'s buffer (rank a scalar): ``at`` the
    table's entry for that rank."""
    return at(tl.load(table + rank).to(tl.int64), byte_offset, DTYPE)


@triton.jit
def at(base, byte_offset, DTYPE: tl.constexpr):
    """Pointer to ``byte_offset`` inside the buffer at int64 address ``base``, which the
    compiler is told is 16-byte aligned: every caller passes a region start
    (moestream.regions.ALIGN) plus a multiple of 16, and buffers start 16-byte aligned
    (``SymmBuffer`` asserts it). Without that an address made from an integer is only known
    to be 1-byte aligned, and every row copy from it moved one value per instruction."""
    return tl.multiple_of((base + byte_offset).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def rank_base(table, rank, host_base, HOST_BASE: tl.constexpr):
    """int64 address of rank ``rank``'s buffer (this program's own rank): the kernel
    parameter ``host_base`` where the host passes it (HOST_BASE: a launch that serves one
    local rank, ``SymmBuffer.host_base``), else ``table[rank]``, a global load that a
    pointer made from it waits for (sm_90 SASS of the decode GEMMs: table, then block
    count, then meta, then the first TMA load).

    Kernels take only the pointers on that path from it: an address from a kernel parameter
    lives in the SM's few uniform registers, and with every region pointer of the decode L1
    there the compiler moved the TMA descriptors' addresses out of them, into more
    instructions per K step (sm_90 SASS). The whole-tile L1 does not take it at all
    (``staged.l1``: slower with it)."""
    if HOST_BASE:
        base = host_base.to(tl.int64)
    else:
        base = tl.load(table + rank).to(tl.int64)
    return base


@triton.jit
def aligned_ptr_from(table, index, DTYPE: tl.constexpr):
    """Pointer ``table[index]`` (an int64 address table, e.g. the local ranks' weights), which
    the caller guarantees 16-byte aligned (torch allocations are)."""
    return tl.multiple_of(tl.load(table + index).to(tl.int64).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def peer_ptrs(table, ranks, byte_offsets, mask, DTYPE: tl.constexpr):
    """Pointer tensor: ``byte_offsets[i]`` inside rank ``ranks[i]``'s buffer."""
    base = tl.load(table + ranks, mask=mask, other=0).to(tl.int64)
    return (base + byte_offsets).to(tl.pointer_type(DTYPE))


@triton.jit
def launch_context(table, rank0, off_epoch, off_diag, host_base=0,
                   HOST_BASE: tl.constexpr = False):
    """Where a program of a grid (programs, local ranks) stands: (program, programs, local
    rank, rank, this call's epoch, the rank's diag words). HOST_BASE: the rank's words at
    ``host_base`` (``rank_base``)."""
    lr = tl.program_id(1)
    rank = rank0 + lr
    here = rank_base(table, rank, host_base, HOST_BASE)
    epoch = tl.load(at(here, off_epoch, tl.int32))
    diag = at(here, off_diag, tl.int32)
    return tl.program_id(0), tl.num_programs(0), lr, rank, epoch, diag


@triton.jit
def stalled(diag):
    """Whether any program of this rank already gave up (so the others stop waiting too)."""
    return tl.load(diag, volatile=True) != 0


@triton.jit
def record_stall(diag, phase, rank, index, observed, expected, epoch, peer):
    """Keep the first stall's details (diag layout: moestream.regions.DIAG_FIELDS)."""
    if tl.atomic_cas(diag, 0, 1, sem="relaxed", scope="gpu") == 0:
        tl.store(diag + 1, phase)
        tl.store(diag + 2, rank)
        tl.store(diag + 3, index)
        tl.store(diag + 4, observed)
        tl.store(diag + 5, expected)
        tl.store(diag + 6, epoch)
        tl.store(diag + 7, peer)


@triton.jit
def now_ns(USE_TIMER: tl.constexpr):
    """The GPU's global timer in ns (0 under the interpreter, which bounds waits by polls)."""
    if USE_TIMER:
        t = globaltimer()
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def wait_at_least(ptr, target, diag, max_spins, timeout_ns, phase, rank, index, epoch, peer,
                  SCOPE: tl.constexpr, USE_TIMER: tl.constexpr):
    """Spin (acquire) until ``*ptr - target >= 0`` as int32 (wrap-safe for epochs).

    Bounded: after ``timeout_ns`` of wall time (GPU), ``max_spins`` polls, or as soon as
    another program of this rank has given up, records the stall in ``diag`` and returns
    False. The caller skips its work and stops.
    """
    v = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    spins = 0
    t0 = now_ns(USE_TIMER)
    while ((v - target) < 0) & (spins < max_spins):
        v = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
        spins += 1
        if stalled(diag) | (now_ns(USE_TIMER) - t0 > timeout_ns):
            spins = max_spins
    ok = (v - target) >= 0
    if not ok:
        record_stall(diag, phase, rank, index, v, target, epoch, peer)
    tl.debug_barrier()  # the data reads that follow, by any thread, come after the acquire
    return ok


@triton.jit
def wait_all_at_least(ptrs, target, mask, diag, max_spins, timeout_ns, phase, rank, index_base,
                      epoch, SCOPE: tl.constexpr, USE_TIMER: tl.constexpr):
    """Vector form of ``wait_at_least``: every ``ptrs[i]`` (where mask) reaches ``target``."""
    v = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope=SCOPE)
    short = mask & ((v - target) < 0)
    spins = 0
    t0 = now_ns(USE_TIMER)
    while (tl.sum(short.to(tl.int32), axis=0) > 0) & (spins < max_spins):
        v = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope=SCOPE)
        short = mask & ((v - target) < 0)
        spins += 1
        if stalled(diag) | (now_ns(USE_TIMER) - t0 > timeout_ns):
            spins = max_spins
    n_short = tl.sum(short.to(tl.int32), axis=0)
    ok = n_short == 0
    if not ok:
        first = tl.min(tl.where(short, tl.arange(0, ptrs.shape[0]), ptrs.shape[0]), axis=0)
        observed = tl.sum(tl.where(tl.arange(0, ptrs.shape[0]) == first, v, 0), axis=0)
        record_stall(diag, phase, rank, index_base + first, observed, target, epoch, -1)
    tl.debug_barrier()
    return ok
