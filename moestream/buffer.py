"""SymmBuffer: every rank's buffer for one MoE layer, and the table of peer addresses.

Two forms with one kernel-facing interface (``table``, ``rank0``, ``local_ranks``, region
offsets):

- virtual ranks: ``SymmBuffer(config, num_ranks=R, device=...)`` allocates R buffers in this
  process; one launch serves all of them. This is how the multi-rank logic runs on one GPU and
  on the CPU under Triton's interpreter.
- real ranks: ``SymmBuffer(config, group=pg)`` allocates one torch symmetric-memory buffer per
  rank (collective) and maps every peer's copy over NVLink.

All regions are carved from ``moestream.regions``; every byte starts at zero. The buffer also
collects the kernels' diagnostics (a stalled wait, topk ids out of range) and turns them into
exceptions: ``check()`` synchronises; ``poll()`` looks only at results that already arrived.

Every buffer registers itself under an ``op_id`` while it lives: the layer's torch custom op
(``moestream.ops``) takes that int in place of the object, which an op schema cannot hold.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Sequence

import torch

from .config import MoEConfig
from .regions import DIAG_FIELDS, make_layout

__all__ = ["SymmBuffer", "KernelStallError"]

_TORCH_DTYPES = {"int32": torch.int32, "float32": torch.float32, "bfloat16": torch.bfloat16,
                 "uint8": torch.uint8}


# op_id -> live buffer. Weak: a buffer dropped without destroy() leaves no entry behind. Ids
# are never reused, so a stale id names no buffer rather than a newer one.
_LIVE: "weakref.WeakValueDictionary[int, SymmBuffer]" = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def _normalise_device(device) -> torch.device:
    """cuda means the current CUDA device, with its index (so tensor devices compare equal)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class KernelStallError(RuntimeError):
    """A kernel gave up waiting for a counter; the message names it."""


def _default_spins(device: torch.device) -> int:
    # GPU: waits are bounded by time (timeout_s); the poll count only backs it up.
    # Interpreter: polls are slow and execution is sequential, so a wait that is not satisfied
    # at once never will be; fail fast.
    return 2**31 - 1 if device.type == "cuda" else 64


class SymmBuffer:
    """Buffers of one MoE layer for R ranks (virtual) or for this rank of a group (real).

    Args:
        config: the layer's sizes; buffers hold ``config.max_tokens_per_rank`` tokens per rank.
        num_ranks: virtual form: R buffers in this process (exclusive with ``group``).
        device: virtual form: where to allocate (default: cuda if available, else cpu).
        group: real form: a torch.distributed process group, one rank per GPU. Collective:
            every rank of the group must construct the buffer (and ``destroy`` it) together.
        timeout_s: seconds a kernel waits for a counter (a peer's flag, a block's tokens)
            before it gives up and reports a stall (GPU). The default, 60 s, outlasts a peer's
            first-call kernel compilation; a settable attribute.
        timeout_spins: polls before a waiting kernel gives up (the interpreter's bound, where
            waits run in sequence and a wait not met at once never will be).

    Attributes:
        op_id: int naming this buffer to ``torch.ops.moestream.mega_moe`` (``moestream.ops``)
            until ``destroy``; unique in this process, never reused.
        op_state: [1] int32 on ``device``, the tensor the op declares it mutates in place of
            the buffer's memory (so compilers keep every call, in order); its value is unused.
    """

    def __init__(self, config: MoEConfig, *, num_ranks: int | None = None,
                 device: str | torch.device | None = None, group=None,
                 timeout_s: float = 60.0, timeout_spins: int | None = None) -> None:
        if not isinstance(config, MoEConfig):
            raise ValueError(f"config must be a MoEConfig, got {type(config).__name__}")
        if (num_ranks is None) == (group is None):
            raise ValueError("pass exactly one of num_ranks= (virtual ranks in this process) "
                             "or group= (one rank per process)")
        self.config = config
        self._hdl = None
        self._weight_tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._scratch: dict[tuple, torch.Tensor] = {}
        if group is None:
            config.check_ranks(num_ranks)
            self.device = _normalise_device(device)
            self.num_ranks = num_ranks
            self.rank = None
            self.rank0 = 0
            self.layout = make_layout(config, num_ranks)
            self._storage = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8,
                                         device=self.device) for _ in range(num_ranks)]
            ptrs = [s.data_ptr() for s in self._storage]
        else:
            ptrs = self._init_group(config, group, device)
        # kernels/common.peer_ptr tells the compiler every region is 16-byte aligned
        assert all(p % 16 == 0 for p in ptrs), [hex(p) for p in ptrs]
        self.table = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        self.max_spins = int(timeout_spins) if timeout_spins else _default_spins(self.device)
        if self.max_spins <= 0:
            raise ValueError(f"timeout_spins must be positive, got {timeout_spins}")
        self.timeout_s = timeout_s
        # diag words copied back after each call (pinned host memory and an event, made once)
        self._diag_host: torch.Tensor | None = None
        self._diag_event = None
        self._pending = False
        # what the custom op takes in place of this object: the registry id, and a one-element
        # tensor that the op declares it mutates (it stands for this buffer's memory)
        with torch.inference_mode(False):   # a normal tensor even if made under inference_mode
            self.op_state = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.op_id = next(_NEXT_ID)
        _LIVE[self.op_id] = self

    @classmethod
    def from_op_id(cls, op_id: int) -> "SymmBuffer":
        """The live buffer registered under ``op_id``; ValueError if it was destroyed (or
        garbage-collected) or never existed in this process."""
        buf = _LIVE.get(op_id)
        if buf is None:
            raise ValueError(f"no live SymmBuffer has op_id {op_id}: it was destroyed or never "
                             f"created in this process (op ids are per process)")
        return buf

    @property
    def destroyed(self) -> bool:
        """Whether ``destroy`` was called (the buffer can no longer run the layer)."""
        return not self._storage

    def _init_group(self, config: MoEConfig, group, device) -> list[int]:
        import torch.distributed as dist
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        config.check_ranks(self.num_ranks)
        self.rank0 = self.rank
        self.device = _normalise_device(device)
        self.layout = make_layout(config, self.num_ranks)
        nbytes = self.layout.total_bytes
        if self.num_ranks == 1:
            self._storage = [torch.zeros(nbytes, dtype=torch.uint8, device=self.device)]
            return [self._storage[0].data_ptr()]
        if self.device.type != "cuda":
            raise ValueError("real ranks (group=...) with more than one rank need CUDA devices "
                             "and symmetric memory; use num_ranks= for virtual ranks on the CPU")
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group"):   # needed before torch 2.8
            try:
                symm_mem.enable_symm_mem_for_group(group.group_name)
            except Exception:  # noqa: BLE001 - newer torch: deprecated or already enabled
                pass
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        hdl = symm_mem.rendezvous(buf, group)
        buf.zero_()
        # buffer_ptrs may name the start of the allocation segment rather than this tensor:
        # add the tensor's offset into it (the same on every rank, checked below).
        offset = buf.data_ptr() - int(hdl.buffer_ptrs[self.rank])
        offsets = [None] * self.num_ranks
        dist.all_gather_object(offsets, offset, group=group)
        if len(set(offsets)) != 1:
            raise RuntimeError(f"symmetric buffer offsets differ across ranks: {offsets}")
        ptrs = [int(p) + offset for p in hdl.buffer_ptrs]
        assert ptrs[self.rank] == buf.data_ptr()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)   # every rank's zeros land before any peer polls them
        self._hdl = hdl
        self._storage = [buf]
        return ptrs

    @property
    def timeout_s(self) -> float:
        return self._timeout_ns / 1e9

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        if not isinstance(seconds, (int, float)) or not 0 < seconds <= 3600:
            raise ValueError(f"timeout_s must be a number of seconds in (0, 3600], got {seconds!r}")
        self._timeout_ns = int(seconds * 1e9)

    @property
    def timeout_ns(self) -> int:
        return self._timeout_ns

    # ---- what kernels and tests see --------------------------------------------------
    @property
    def is_virtual(self) -> bool:
        return self.rank is None

    @property
    def local_ranks(self) -> int:
        """How many ranks this process drives (R virtual, 1 real)."""
        return len(self._storage)

    def global_rank(self, local: int) -> int:
        return self.rank0 + local

    def address(self, local: int) -> int:
        """Local rank ``local``'s buffer address (its entry of ``table``)."""
        return self._storage[local].data_ptr()

    @property
    def host_base(self) -> int | None:
        """The local rank's buffer address where this process drives one rank (every real
        rank, one virtual rank), else None. Kernels of such launches take it as a parameter
        instead of loading ``table[rank]`` first (``kernels/common.rank_base``)."""
        return self.address(0) if len(self._storage) == 1 else None

    @property
    def one_device(self) -> bool:
        """Whether every rank's buffer is on this device (virtual ranks, or a group of one),
        so that a release at GPU scope reaches every rank's kernels."""
        return self.local_ranks == self.num_ranks

    @property
    def peer_scope(self) -> str:
        """Memory scope of the releases other ranks' kernels acquire (publish's ``ready``, the
        L2's rank signal): "gpu" where every rank is on this device, else "sys"."""
        return "gpu" if self.one_device else "sys"

    def offsets(self) -> dict[str, int]:
        """Every region's byte offset by name, and the reset span's start under "reset"."""
        return self.layout.offsets() | {"reset": self.layout.reset_span[0]}

    def view(self, name: str, local: int = 0) -> torch.Tensor:
        """Region ``name`` of local rank ``local``'s buffer as a typed tensor (no copy)."""
        r = self.layout[name]
        raw = self._storage[local][r.offset:r.end]
        return raw.view(_TORCH_DTYPES[r.dtype]).view(r.shape)

    def weight_table(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """int64 table of the local ranks' weight tensor addresses, cached by address."""
        key = tuple(t.data_ptr() for t in tensors)
        tab = self._weight_tables.get(key)
        if tab is None and self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # the table is copied from the host, which a capture cannot record
            raise ValueError(
                "the expert weights are at addresses this buffer has not seen before this CUDA "
                "graph capture: call the layer once with the same weight tensors before "
                "capturing. torch.compile(mode='reduce-overhead') keeps module parameters in "
                "place; a backend that copies graph inputs into its own memory (backend="
                "'cudagraphs') moves them and is not supported")
        if tab is None:
            if len(self._weight_tables) > 64:
                self._weight_tables.clear()
            tab = torch.tensor(list(key), dtype=torch.int64, device=self.device)
            self._weight_tables[key] = tab
        return tab

    # ---- diagnostics -------------------------------------------------------------------
    def diagnostics(self) -> list[dict[str, int]]:
        """The diag words of each local rank (reads device memory: synchronises)."""
        return [dict(zip(DIAG_FIELDS, self.view("diag", lr).tolist()))
                for lr in range(self.local_ranks)]

    def _raise_for(self, words: list[list[int]]) -> None:
        from .kernels.common import PHASE_CODES
        for lr, w in enumerate(words):
            d = dict(zip(DIAG_FIELDS, w))
            rank = self.global_rank(lr)
            if d["stalled"]:
                what = PHASE_CODES.get(d["phase"], f"phase {d['phase']}")
                peer = f", peer rank {d['peer']}" if d["peer"] >= 0 else ""
                raise KernelStallError(
                    f"rank {rank}: a kernel gave up waiting ({what}): index {d['index']}, counter "
                    f"at {d['observed']} but expected {d['expected']} (call epoch {d['epoch']}"
                    f"{peer}). The results of that call are invalid and the buffer must be "
                    f"re-created; a peer that never launched its kernels or a routing that "
                    f"differs from what was published causes this.")
            if d["bad_topk"]:
                self.view("diag", lr)[DIAG_FIELDS.index("bad_topk")] = 0
                raise ValueError(f"rank {rank}: {d['bad_topk']} topk_idx values were outside "
                                 f"[-1, {self.config.num_experts}) and were ignored; expert ids "
                                 f"must be -1 (no expert) or a valid global expert id")

    def check(self) -> None:
        """Raise for anything the kernels reported so far (synchronises with the device)."""
        self._pending = False
        self._raise_for([self.view("diag", lr).tolist() for lr in range(self.local_ranks)])

    def after_call(self) -> None:
        """Start an asynchronous copy of the diag words; ``poll`` inspects it later."""
        if self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        if self._diag_host is None:
            # a normal tensor even when the first call runs under torch.inference_mode (an
            # inference tensor could not be updated by later calls outside it)
            with torch.inference_mode(False):
                self._diag_host = torch.empty(self.local_ranks, len(DIAG_FIELDS),
                                              dtype=torch.int32, pin_memory=True)
            self._diag_event = torch.cuda.Event()
        # Stream order: this copy lands after any earlier one, and poll reads the host copy
        # only once the event of the latest copy has completed.
        for lr in range(self.local_ranks):
            self._diag_host[lr].copy_(self.view("diag", lr), non_blocking=True)
        self._diag_event.record()
        self._pending = True

    def poll(self) -> None:
        """Raise for a stall or bad input of an earlier call whose diag copy has arrived,
        without waiting for the device."""
        if self._pending and self._diag_event.query():
            self._pending = False
            self._raise_for(self._diag_host.tolist())

    def scratch(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A work tensor of this process only (not symmetric, not in the layout), zeroed
        when first asked for and kept for the buffer's life: ``name`` with its shape and
        dtype (e.g. the staged L1's split-K sums and counts, ``staged.l1``). The kernels
        that use one leave it as they need to find it next call (counts back at zero)."""
        key = (name, tuple(int(d) for d in shape), dtype)
        t = self._scratch.get(key)
        if t is None:
            t = self._scratch[key] = torch.zeros(key[1], dtype=dtype, device=self.device)
        return t

    def scratch_named(self, name: str) -> list[torch.Tensor]:
        """Every work tensor ``scratch`` has made under ``name`` (of any shape or dtype), in
        the order they were first asked for: what a check reads after a call."""
        return [t for (n, _, _), t in self._scratch.items() if n == name]

    def destroy(self) -> None:
        """Release the memory (collective in the real form)."""
        if self._hdl is not None:
            import torch.distributed as dist
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
        _LIVE.pop(self.op_id, None)
        self._storage = []
        self._hdl = None
        self._weight_tables.clear()
        self._scratch.clear()

    def __repr__(self) -> str:
        form = "virtual" if self.is_virtual else f"rank {self.rank}"
        return (f"SymmBuffer({form}, ranks={self.num_ranks}, "
                f"{self.layout.total_bytes / 2**20:.1f} MiB per rank, device={self.device})")
