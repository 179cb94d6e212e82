"""What every launcher shares: a buffer's launch constants and region offsets, the device the
tuning policy sees, program counts, launch options, tensor descriptors built on the host,
split-K scratch, when stream order stands in for a signal, and the GEMMs' weights as the
tuning has them read (fp4w expanded to fp8 blocks)."""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Sequence

import torch

from .buffer import SymmBuffer
from .kernels import expand as _expand
from .kernels.common import INTERPRET, next_pow2, triton
from .regions import REGION_NAMES
from .tuning import Device, Tuning, select
from .tuning.settings import row_chunk, row_chunks

__all__ = ["Constants", "Offsets", "constants", "device_of", "tuning_for", "tma", "programs",
           "resident_per_sm", "launch_kw", "host_descriptors", "a_rows", "split_scratch",
           "weight_tables", "ensure_allocator", "stream_ordered", "wave_blocks",
           "row_chunk", "row_chunks", "fp4w_as_fp8", "gemm_weights", "capturing"]

# Every region's byte offset (and the reset span's), one kernel argument: offs.pool_x, ...
Offsets = namedtuple("Offsets", REGION_NAMES + ("reset",))


@dataclass(frozen=True)
class Constants:
    """Per-buffer launch arguments, computed once (the forward path stays light on Python)."""

    offs: Offsets
    R: int
    E_LOC: int
    R_PAD: int
    E_PAD: int
    K_PAD: int
    P: int
    reset_words: int
    row_words: int      # 16-bit words per token row that dispatch copies (bf16: H)
    device: Device


def constants(buffer: SymmBuffer) -> Constants:
    """The buffer's ``Constants``, computed at its first launch and kept with it."""
    c = getattr(buffer, "_launch_constants", None)
    if c is None:
        cfg = buffer.config
        R = buffer.num_ranks
        e_loc = cfg.experts_per_rank(R)
        offs = Offsets(**buffer.offsets())
        c = Constants(offs=offs, R=R, E_LOC=e_loc, R_PAD=next_pow2(R),
                      E_PAD=next_pow2(e_loc), K_PAD=next_pow2(cfg.top_k),
                      P=cfg.pool_capacity(R), reset_words=buffer.layout.reset_span[1] // 4,
                      row_words=cfg.token_bytes // 2, device=device_of(buffer.device))
        buffer._launch_constants = c
    return c


def device_of(device: torch.device) -> Device:
    """The policy's view of ``device``: its SM count and whether it is Hopper or newer
    (0 and False on a CPU, where the kernels run in the interpreter)."""
    if device.type != "cuda":
        return Device()
    props = torch.cuda.get_device_properties(device)
    return Device(sms=props.multi_processor_count, hopper=props.major >= 9)


def tuning_for(buffer: SymmBuffer, tokens: int, *, impl: str) -> Tuning:
    """``tuning.select`` for a call of ``tokens`` tokens per rank on ``buffer``."""
    return select(buffer.config, tokens, ranks=buffer.num_ranks,
                  device=constants(buffer).device, impl=impl)


def tma(buffer: SymmBuffer, tuning: Tuning) -> bool:
    """Whether GEMM tiles load by tensor descriptor (``Tuning.use_tma``, None: on Hopper)."""
    return constants(buffer).device.hopper if tuning.use_tma is None else tuning.use_tma


def wave_blocks(buffer: SymmBuffer, tuning: Tuning) -> int:
    """L1 blocks that close an expert wave (``Fused.wave_blocks``, None: one per SM, 8 under
    the interpreter so small test calls still form several waves)."""
    return tuning.fused.wave_blocks or constants(buffer).device.sms or 8


def _tma_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    # scratch for tensor descriptors built on the device
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator(use_tma: bool) -> None:
    if use_tma and not INTERPRET:
        from triton.runtime import _allocation
        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            triton.set_allocator(_tma_allocator)


# (kernel, constexprs and launch options, device) -> programs of it one SM holds at once
_RESIDENT: dict = {}


def resident_per_sm(*, registers: int, shared_bytes: int, warps: int, sm_registers: int = 65536,
                    sm_shared_bytes: int = 233472, sm_threads: int = 2048,
                    block_reserved_bytes: int = 1024, max_blocks: int = 32) -> int:
    """Programs (thread blocks) of a compiled kernel that one SM runs at once: the least of what
    its registers (allocated per warp in units of 256), shared memory (plus the 1 KB the
    hardware reserves per block) and threads allow. Defaults: Hopper (sm_90)."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = sm_registers // max(regs_per_warp * warps, 1)
    by_shared = sm_shared_bytes // (shared_bytes + block_reserved_bytes)
    by_threads = sm_threads // (32 * warps)
    return max(0, min(by_regs, by_shared, by_threads, max_blocks))


def programs(buffer: SymmBuffer, tuning: Tuning, per_sm: int, kernel=None, args=(),
             kw=None) -> int:
    """Persistent programs per local rank: ``Tuning.programs``, else ``per_sm`` per SM, capped
    at what one SM holds of the compiled ``kernel`` at once. Programs beyond that would wait
    for a whole earlier program to end and walk their tickets in a second pass, splitting the
    tiles that share an expert's weights in the L2 cache into two far-apart passes."""
    if tuning.programs:
        return tuning.programs
    sms = constants(buffer).device.sms
    if not sms:
        # the interpreter runs programs one after another: 2 still walks the persistent loops
        return 2
    if kernel is not None and not INTERPRET:
        key = (kernel, tuple(sorted((kw or {}).items())), buffer.device.index)
        fit = _RESIDENT.get(key)
        if fit is None:
            compiled = kernel.warmup(*args, grid=(1,), **(kw or {}))
            compiled._init_handles()
            props = torch.cuda.get_device_properties(buffer.device)
            fit = resident_per_sm(registers=compiled.n_regs, shared_bytes=compiled.metadata.shared,
                                  warps=compiled.metadata.num_warps,
                                  sm_registers=props.regs_per_multiprocessor,
                                  sm_shared_bytes=props.shared_memory_per_multiprocessor,
                                  sm_threads=props.max_threads_per_multi_processor)
            _RESIDENT[key] = fit = max(fit, 1)
        per_sm = min(per_sm, fit)
    return sms * per_sm


def launch_kw(warps: int, stages: int | None = None) -> dict:
    """Triton launch options (none under the interpreter)."""
    if INTERPRET:
        return {}
    kw = dict(num_warps=warps)
    if stages is not None:
        kw["num_stages"] = stages
    return kw


def weight_tables(buffer: SymmBuffer, ws: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) address tables of the local ranks' weights: bf16 tensors, fp8
    (values, scale_inv) or fp4w (packed, scales) pairs (in bf16 the scale table is the value
    table, unused)."""
    if buffer.config.fp8_tokens:
        return (buffer.weight_table([w[0] for w in ws]),
                buffer.weight_table([w[1] for w in ws]))
    tab = buffer.weight_table(ws)
    return tab, tab


def fp4w_as_fp8(w: Sequence[torch.Tensor], *, out: Sequence[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (packed [E, N, K/2] uint8, scales [E, N, K/32] uint8) -> the fp8 GEMMs' weights
    (values [E, N, K] float8_e4m3fn, scale_inv [E, N/128, K/128] fp32) in one launch
    (``kernels/expand.py``: exact where a 128x128 block's E8M0 codes span at most 14), into
    ``out`` (values, scale_inv) when given."""
    packed, codes = w
    E, N, KH = packed.shape
    K = 2 * KH
    q, scale_inv = out if out is not None else (
        torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=packed.device),
        torch.empty(E, N // 128, K // 128, dtype=torch.float32, device=packed.device))
    _expand.mxfp4_to_fp8_kernel[(E * N // 128, K // 128)](
        packed, codes, q, scale_inv, K, FIX_ROUNDING=INTERPRET, **launch_kw(4))
    return q, scale_inv


def gemm_weights(buffer: SymmBuffer, ws: Sequence, tuning: Tuning, gemm: str) -> Sequence:
    """The weights GEMM ``gemm`` ("l1" / "l2") reads: ``ws`` as given, or with
    ``Tuning.fp4w_expand`` the fp4w pairs expanded for this call (``fp4w_as_fp8``) into work
    tensors of the buffer (fixed addresses: the weight tables and CUDA graphs keep them)."""
    if buffer.config.dtype != "fp4w" or not tuning.fp4w_expand:
        return ws
    out = []
    for lr, (packed, codes) in enumerate(ws):
        E, N, KH = packed.shape
        dest = (buffer.scratch(f"{gemm}_fp4w_values_{lr}", (E, N, 2 * KH), torch.float8_e4m3fn),
                buffer.scratch(f"{gemm}_fp4w_scale_inv_{lr}", (E, N // 128, KH // 64),
                               torch.float32))
        out.append(fp4w_as_fp8((packed, codes), out=dest))
    return out


def capturing(buffer: SymmBuffer) -> bool:
    """Whether the launches on ``buffer``'s device are being captured into a CUDA graph."""
    return buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def host_descriptors(buffer: SymmBuffer, tuning: Tuning, use_tma: bool, *, region: str,
                     cols: int, w: torch.Tensor, w_shape: tuple, a_rows: tuple,
                     block_n: int, block_k: int) -> tuple[tuple, dict]:
    """The tensor descriptors a GEMM kernel would build in every program, built on the host
    where it may take them (``Tuning.host_descriptors`` True, or None while a CUDA graph is
    captured; ``use_tma``; one local rank): ``((ad0, ad1, wd), {"HOST_DESC": True})``, else
    ``((None, None, None), {})``.

    A: the pool ``region`` (``pool_x`` / ``pool_act``: [P, cols] bf16, or the fp8 layer's byte
    rows read as e4m3) in tiles of ``a_rows[i]`` rows (one entry for whole tiles, two for
    decode pieces), ``block_k`` columns. Weights: ``w`` (bf16, or fp8 values) seen as
    ``w_shape`` in tiles of ``block_n`` x ``block_k`` (a leading 2 where w_shape is 3-D: the
    L1's gate and up rows as one tile)."""
    on = tuning.host_descriptors
    if on is None:
        on = capturing(buffer)
    if not (use_tma and on and buffer.local_ranks == 1):
        return (None, None, None), {}
    from triton.tools.tensor_descriptor import TensorDescriptor
    a = buffer.view(region, 0)
    if buffer.config.fp8_tokens:
        a = a.view(torch.float8_e4m3fn)   # the byte rows: values first, scales after them
    a_descs = [TensorDescriptor(a, [a.shape[0], cols], [a.stride(0), 1], [rows, block_k])
               for rows in a_rows]
    w_v = w.view(w_shape)   # a view: the kernel reads w itself (the layer checks contiguity)
    w_desc = TensorDescriptor.from_tensor(
        w_v, ([2] if len(w_shape) == 3 else []) + [block_n, block_k])
    return (a_descs[0], a_descs[-1] if len(a_rows) > 1 else None, w_desc), {"HOST_DESC": True}


def a_rows(block_m: int, tile_rows: int, dm: int, second: int) -> tuple:
    """Rows of the A tiles a GEMM loads (``host_descriptors``' a_rows): whole tiles of
    ``tile_rows``, or in decode pieces (dm > 0; ``kernels/operands.decode_descriptors``) dm rows
    and the wide piece: ``second`` rows for tail pieces, else 32 or block_m if smaller."""
    if not dm:
        return (tile_rows,)
    return (dm, second if second else min(32, block_m))


def split_scratch(buffer: SymmBuffer, tuning: Tuning, gemm: str, split: int,
                  part_shape: tuple, per_sm: int | None = None) -> tuple:
    """(sums, counts) of a split-K GEMM (``gemm`` names it: l1, l2, fused_l2): fp32 partial
    sums of ``part_shape`` and an int32 count (zero between calls) for up to every program of
    every local rank (``per_sm``: programs per SM asked for, default ``gemm_per_sm``); the
    buffer's table as placeholders when the launch does not split."""
    if split == 1:
        return buffer.table, buffer.table
    most = buffer.local_ranks * programs(buffer, tuning, per_sm or tuning.gemm_per_sm)
    return (buffer.scratch(f"{gemm}_split_sums", (most, *part_shape), torch.float32),
            buffer.scratch(f"{gemm}_split_counts", (most,), torch.int32))


def stream_ordered(buffer: SymmBuffer, tuning: Tuning) -> bool:
    """Whether a staged launch may take what earlier launches of the call wrote without a
    signal: every rank's buffer is on this GPU (``SymmBuffer.one_device``), so one process
    launches each stage for every rank on one stream before the next stage, and the tuning
    relies on stream order (``wait`` off). Then the layout waits for no peer's ready flag, the
    L2 counts and releases nothing and the combine waits for nothing. Across GPUs the signals
    stay: another GPU's launches are not ordered by this stream."""
    return buffer.one_device and not tuning.wait
