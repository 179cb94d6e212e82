"""The expert-parallel MoE layer with torch's NVSHMEM all-to-alls: split sizes never leave the GPU.

This is the ``torch-symm`` provider: the layer of ``moe_forward_a2a`` (the ``torch`` provider),
same inputs, same output, same rounding, but dispatch and combine are torch's symmetric-memory
collectives, which take their split sizes from device memory:

    dispatch  torch.ops.symm_mem.all_to_all_vdev_2d         rows grouped by destination rank
                                                             and by the destination's experts
    combine   torch.ops.symm_mem.all_to_all_vdev_2d_offset  every row back to its sender

so nothing is read on the host: the forward has no host synchronisation at all (the topk_idx
range check, which reads values, runs only with ``validate=True``) and every shape is static.

Op signatures relied on (``check_symm_support`` checks them at run time and raises
``SymmUnavailableError`` naming the schema it found when they differ)::

    all_to_all_vdev_2d(Tensor input, Tensor(a!) out, Tensor in_splits,
                       Tensor(a!) out_splits_offsets, str group_name, int? major_align=None) -> ()
    all_to_all_vdev_2d_offset(Tensor input, Tensor(a!) out, Tensor in_splits_offsets,
                              Tensor(a!) out_splits_offsets, str group_name) -> ()

Source: the schemas registered by torch 2.13.0 (read from the installed build; its Meta kernels in
torch/distributed/_symmetric_memory/__init__.py and the inductor lowerings in
torch/_inductor/comm_lowering.py use the same names), and the CUDA kernels
(torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu) and test/distributed/test_nvshmem.py
of public pytorch sources from mid 2025 on. Versions: the 2D op first landed (June 2025,
pytorch#155058) as ``nvshmem_all_to_all_vdev_2d(input, out, in_out_splits[3, n], group_name,
major_align)``; the form above, with the separate ``in_splits`` / ``out_splits_offsets`` and the
``_offset`` combine, replaced it by Sept 2025 at the latest (pytorch#163837, Sept 2025, gave the
1D ``all_to_all_vdev`` the same split form "to be in line with the 2D version"), so torch >= 2.9
is expected to have it. Checked here: the 2.13 schemas (CPU build); the GPU machine's 2.11 only
by the GPU tests. Arguments are passed positionally, so keyword-name differences would not
matter as long as the order holds.

Semantics (R ranks, G "expert groups" per rank, S = R*G chunks; all counts in rows):

* dispatch: ``input`` holds rank-major chunks from row 0: for destination d, for group g,
  ``in_splits[d*G + g]`` rows. On rank d, ``out`` receives them group-major: group g's tile holds
  the chunks of source ranks 0..R-1 packed in that order, and every tile is padded to a multiple
  of ``major_align`` rows, with at least ``major_align`` rows even when empty (cutlass once
  rejected empty groups, pytorch#152668); padding rows are left as they were. Afterwards
  ``out_splits_offsets[0][g*R + s]`` is the chunk's row count and ``[1][g*R + s]`` its first row.
* combine: ``input``/``in_splits_offsets`` are the dispatch's ``out``/``out_splits_offsets``
  (offsets may leave gaps; gaps are never sent); rank d's ``out`` gets its chunks back
  rank-major, packed from row 0: exactly the rows of its dispatch ``input``, in the same order.
* both are pull-based (each rank reads its rows from the peers' ``input``): a first kernel puts
  the split sizes into the peers and ends in an NVSHMEM barrier (the op's entry barrier), then
  the data kernel pulls; there is no exit barrier.
* kernel limits (nvshmem_extension.cu, unchanged up to at least late 2025; pytorch#167966 is
  open): G <= 16 ("Number of experts must be smaller than NUM_TILES16") and R <= 16 (combine;
  dispatch allows 32). Every tensor argument must be contiguous, symmetric (``symm_mem.empty`` +
  ``symm_mem.rendezvous``), splits int64, and ``input.stride(0) == out.stride(0)``.

More than 16 local experts (dsv3/v4flash/qwen3 on 2 ranks have 64-128): the ops then see G <= 16
groups of E/G consecutive experts (G = E when E <= 16: the direct path, each group one expert).
Within a group the received rows are source-major, so each row carries its local expert id in 8
extra bf16 columns (16 bytes, the "id columns"), and the receiver sorts the valid rows by expert
before the grouped GEMMs and scatters the results back (the regroup path, what
``moe_forward_a2a`` does after its all_to_all_single).

Stages: ``moe_forward_symm`` is ``route``, the dispatch, ``run_experts``, the combine, then
``weighted_sum``. The three local stages are public so that the two ops can be stood in for: the
CPU tests run them on virtual ranks over ``SymmA2AContext.unshared`` contexts, the ops emulated.

Buffer reuse is race-free without extra barriers: a buffer a peer reads (``send`` during
dispatch, ``recv`` during combine) or writes into (the splits/offsets tensors) is only touched
again after the next op's entry barrier, which that peer reaches only once it is done with it.

Not CUDA-graph-tested. Symmetric memory is NVSHMEM's heap (``NVSHMEM_SYMMETRIC_SIZE`` bounds it
where NVSHMEM cannot grow it), and the backend is process-wide: it must be chosen before the
process's first symmetric allocation, ``moestream.SymmBuffer``'s included.

Legend (shape suffixes):
    T tokens of this rank, K top-k, H hidden, I intermediate, R ranks, E local experts (E_total/R),
    G expert groups per rank (the ops' "experts"), A major_align, W row width (H, or H + 8 id
    columns on the regroup path), P = T*K picks, Pm = max_tokens*K (send rows),
    N = R*Pm + G*A (recv rows: every pick of every rank landing here, plus each tile's padding),
    S = R*G chunks.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...checks import check_expert_weights, check_routing, check_tensor, check_topk_range
from .torch_a2a import _expert_mm, _has_grouped_mm

__all__ = ["ID_COLUMNS", "OP_MAX_EXPERT_GROUPS", "OP_MAX_RANKS", "RoutePlan", "SymmA2AContext",
           "SymmA2ALayout", "SymmUnavailableError", "check_symm_ops", "check_symm_support",
           "default_expert_groups", "moe_forward_symm", "route", "run_experts",
           "symm_unavailable_reason", "weighted_sum"]

OP_MAX_RANKS = 16            # combine: "world_size must be smaller than NUM_TILES" (512/32)
OP_MAX_EXPERT_GROUPS = 16    # dispatch: "Number of experts must be smaller than NUM_TILES"
ID_COLUMNS = 8               # bf16 columns (16 bytes) carrying a row's local expert id (regroup)

_DISPATCH_ARGS = ("input", "out", "in_splits", "out_splits_offsets", "group_name", "major_align")
_COMBINE_ARGS = ("input", "out", "in_splits_offsets", "out_splits_offsets", "group_name")
_OPS = {"all_to_all_vdev_2d": _DISPATCH_ARGS, "all_to_all_vdev_2d_offset": _COMBINE_ARGS}


class SymmUnavailableError(NotImplementedError):
    """torch-symm cannot run with this torch build, machine or process; the message says why.

    A NotImplementedError, hence also a RuntimeError: the benchmark skips the provider on it.
    """


# ---- availability ---------------------------------------------------------------------------

def _lookup_op(name: str):
    """The ``torch.ops.symm_mem.<name>`` packet, or None when this torch does not register it."""
    try:
        return getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return None


def check_symm_ops() -> None:
    """Raise ``SymmUnavailableError`` unless this torch registers the two ops with the schemas
    relied on (see the module docstring); needs no CUDA, NVSHMEM or process group."""
    if not dist.is_available():
        raise SymmUnavailableError(f"torch {torch.__version__} is built without torch.distributed")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        raise SymmUnavailableError(f"torch {torch.__version__}: cannot import "
                                   f"torch.distributed._symmetric_memory ({exc})") from exc
    missing = [f for f in ("empty", "rendezvous", "set_backend", "is_nvshmem_available")
               if not hasattr(symm_mem, f)]
    if missing:
        raise SymmUnavailableError(f"torch {torch.__version__}: "
                                   f"torch.distributed._symmetric_memory lacks {missing} "
                                   f"(torch-symm needs torch >= 2.9)")
    for name, want in _OPS.items():
        op = _lookup_op(name)
        if op is None:
            raise SymmUnavailableError(f"torch {torch.__version__} has no "
                                       f"torch.ops.symm_mem.{name} (torch-symm needs torch >= 2.9)")
        schema = op.default._schema
        args = list(schema.arguments)
        names = tuple(a.name for a in args)
        if names[:len(want)] != want or not all(a.has_default_value() for a in args[len(want):]):
            raise SymmUnavailableError(
                f"torch {torch.__version__}: torch.ops.symm_mem.{name} has schema {schema}; "
                f"torch-symm was written for arguments ({', '.join(want)})")


def check_symm_support(device: torch.device | str | None = None) -> None:
    """Raise ``SymmUnavailableError`` unless torch-symm can run here: the two ops with the
    expected schemas, CUDA, NVSHMEM loadable by torch, and (if ``device`` is given) a CUDA
    device with ``torch._grouped_mm`` (sm90+). Starts nothing; reads no process group."""
    check_symm_ops()
    if not torch.cuda.is_available():
        raise SymmUnavailableError("torch-symm needs CUDA GPUs "
                                   "(torch.cuda.is_available() is False)")
    import torch.distributed._symmetric_memory as symm_mem
    try:
        nvshmem = bool(symm_mem.is_nvshmem_available())
    except Exception as exc:  # any failure to probe means no NVSHMEM
        raise SymmUnavailableError(f"NVSHMEM availability check failed: {exc}") from exc
    if not nvshmem:
        raise SymmUnavailableError(
            "NVSHMEM is not available: torch could not load libnvshmem_host.so.3 (install the "
            "nvidia-nvshmem wheel matching torch's CUDA, e.g. nvidia-nvshmem-cu12)")
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            raise SymmUnavailableError(f"torch-symm needs a CUDA device, got {device}")
        if not _has_grouped_mm(device):
            raise SymmUnavailableError(f"torch._grouped_mm (bf16) needs an sm90+ GPU and torch >= "
                                       f"2.8; {device} does not qualify")


def symm_unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why torch-symm cannot run here (``check_symm_support``'s message), or None if it can."""
    try:
        check_symm_support(device)
    except SymmUnavailableError as exc:
        return str(exc)
    return None


# ---- sizes ----------------------------------------------------------------------------------

def default_expert_groups(local_experts: int) -> int:
    """G: every local expert its own group when the ops allow it (<= 16), else the largest
    divisor of the local expert count that is <= 16 (e.g. 128 -> 16 groups of 8, 17 -> 1)."""
    if local_experts <= OP_MAX_EXPERT_GROUPS:
        return local_experts
    return max(d for d in range(1, OP_MAX_EXPERT_GROUPS + 1) if local_experts % d == 0)


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


@dataclass(frozen=True)
class SymmA2ALayout:
    """Every size of the symmetric buffers; pure arithmetic (identical on every rank).

    Args:
        max_tokens: the most tokens (T) any rank passes in one call.
        hidden, top_k, num_experts: H, K and E_total of the layer.
        num_ranks: R, the process group's size (E_total % R == 0, R <= 16).
        major_align: A, the dispatch's row alignment of each expert-group tile (>= 1).
        expert_groups: G, groups of consecutive local experts the ops see; None = the default
            (``default_expert_groups``). Must divide E; G = E is the direct path.
    """
    max_tokens: int
    hidden: int
    top_k: int
    num_experts: int
    num_ranks: int
    major_align: int = 16
    expert_groups: int | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "hidden", "top_k", "num_experts", "num_ranks", "major_align"):
            _positive_int(name, getattr(self, name))
        if self.num_experts % self.num_ranks:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the number of "
                             f"ranks in the group ({self.num_ranks})")
        if self.num_ranks > OP_MAX_RANKS:
            raise SymmUnavailableError(f"all_to_all_vdev_2d_offset supports at most {OP_MAX_RANKS} "
                                       f"ranks, the group has {self.num_ranks}")
        e = self.num_experts // self.num_ranks
        g = default_expert_groups(e) if self.expert_groups is None else self.expert_groups
        _positive_int("expert_groups", g)
        if e % g:
            raise ValueError(f"expert_groups ({g}) must divide the local expert count ({e})")
        object.__setattr__(self, "expert_groups", g)

    @property
    def local_experts(self) -> int:
        """E, experts per rank."""
        return self.num_experts // self.num_ranks

    @property
    def experts_per_group(self) -> int:
        return self.local_experts // self.expert_groups

    @property
    def regroup(self) -> bool:
        """True when groups hold several experts: rows carry id columns and get sorted."""
        return self.expert_groups != self.local_experts

    @property
    def row_width(self) -> int:
        """W, bf16 columns of a send/recv row: H, plus ID_COLUMNS on the regroup path."""
        return self.hidden + (ID_COLUMNS if self.regroup else 0)

    @property
    def send_rows(self) -> int:
        """Pm = max_tokens * top_k: one row per pick (a token goes once per expert picked)."""
        return self.max_tokens * self.top_k

    @property
    def recv_rows(self) -> int:
        """N = R*Pm + G*A: all picks of all ranks on this rank, plus each group tile's padding
        (a tile of n rows takes max(ceil(n/A)*A, A) <= n + A rows)."""
        return self.num_ranks * self.send_rows + self.expert_groups * self.major_align

    @property
    def num_splits(self) -> int:
        """S = R*G chunks (the ops' splits length; <= 256 within the limits)."""
        return self.num_ranks * self.expert_groups

    def buffer_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of every symmetric buffer ``SymmA2AContext`` allocates."""
        W, S = self.row_width, self.num_splits
        return {
            "send": ((self.send_rows, W), torch.bfloat16),         # dispatch in, combine out
            "recv": ((self.recv_rows, W), torch.bfloat16),         # dispatch out, combine in
            "in_splits": ((S,), torch.int64),                      # dispatch in_splits
            "disp_splits_offsets": ((2, S), torch.int64),          # dispatch out = combine in
            "comb_splits_offsets": ((2, S), torch.int64),          # combine out_splits_offsets
        }

    @property
    def nbytes(self) -> int:
        """Symmetric memory per rank, in bytes."""
        total = 0
        for shape, dtype in self.buffer_shapes().values():
            n = 1
            for s in shape:
                n *= s
            total += n * dtype.itemsize
        return total


# ---- the context ----------------------------------------------------------------------------

def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch-symm needs an initialised process group (call "
                         "torch.distributed.init_process_group, or use "
                         "moestream.tools.distributed.spawn / init_from_env)")
    return dist.get_world_size(group), dist.get_rank(group)


def _select_nvshmem_backend(device: torch.device) -> None:
    import torch.distributed._symmetric_memory as symm_mem
    current = None
    get_backend = getattr(symm_mem, "get_backend", None)
    if get_backend is not None:
        try:
            current = get_backend(device)
        except Exception:  # noqa: BLE001 - only informs the message below
            current = None
    if current == "NVSHMEM":
        return
    try:
        symm_mem.set_backend("NVSHMEM")
    except Exception as exc:  # torch raises RuntimeError; report any failure
        raise SymmUnavailableError(
            f"cannot select the NVSHMEM symmetric-memory backend (current: {current}): {exc}. The "
            f"backend is process-wide and fixed by the process's first symmetric allocation "
            f"(e.g. a moestream.SymmBuffer): create the SymmA2AContext before any other, or run "
            f"torch-symm in processes of its own") from exc


def _enable_group(group_name: str) -> None:
    import torch.distributed._symmetric_memory as symm_mem
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)   # deprecated in newer torch
    if enable is None:
        return
    # already enabled, or not needed any more: either way nothing to do
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        enable(group_name)


class SymmA2AContext:
    """Symmetric buffers and process-group state for ``moe_forward_symm``, allocated once.

    Construction and ``close()`` are collective: every rank of ``group`` must call them with the
    same arguments (symmetric allocations must match). Selects the NVSHMEM backend for the whole
    process (see the module docstring), allocates and rendezvouses the buffers of
    ``SymmA2ALayout.buffer_shapes()`` (zeroed), and, with ``warmup``, runs one empty
    dispatch + combine so that NVSHMEM teams, rendezvous caches and the ops' own checks (e.g. the
    16-experts limit) are settled here rather than in the first timed call.

    Buffers (attributes; P = max_tokens * top_k, W = row width, S = R*G):
        send [P, W] bf16: dispatch input, picks sorted by global expert (rank-major, then
            expert); also the combine output (each pick's row returns to where it was sent from).
        recv [R*P + G*A, W] bf16: dispatch output (expert-group tiles); the expert outputs are
            written over their inputs and it is the combine input. Worst case: every pick of
            every rank lands here (R*P rows) plus up to A padding rows per group tile.
        in_splits [S] int64; disp_splits_offsets [2, S] int64 (dispatch out_splits_offsets,
            reused as the combine's in_splits_offsets); comb_splits_offsets [2, S] int64.

    The expert stage's elementwise passes (SwiGLU, copying expert outputs into ``recv``, the
    regroup gather/scatter) run over all R*P + G*A rows of ``recv`` whatever T is (static shapes,
    no host sync), so size the context to the token count actually run.

    Args:
        max_tokens: the most tokens any rank passes in one call.
        hidden, top_k, num_experts: H, K, E_total of the layer.
        group: process group (None = the default group).
        dtype: activation dtype; only torch.bfloat16.
        major_align: the dispatch's ``major_align`` (A); the direct path's grouped-GEMM offsets
            are multiples of it. Default 16.
        expert_groups: G (None = ``default_expert_groups``); see ``SymmA2ALayout``.
        device: CUDA device of this rank (default: the current CUDA device).
        warmup: run one empty dispatch + combine at the end of construction.

    Raises:
        SymmUnavailableError: the ops, CUDA, NVSHMEM or grouped GEMMs are missing, the group is
            too large, the backend cannot be switched to NVSHMEM, or the warm-up call failed.
        ValueError: bad sizes, dtype, device, or no initialised process group.
    """

    def __init__(self, max_tokens: int, hidden: int, top_k: int, num_experts: int,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.bfloat16, *,
                 major_align: int = 16, expert_groups: int | None = None,
                 device: torch.device | str | None = None, warmup: bool = True) -> None:
        if dtype != torch.bfloat16:
            raise ValueError(f"dtype must be torch.bfloat16 (the torch-symm provider is bf16), "
                             f"got {dtype}")
        check_symm_support()
        num_ranks, rank = _group_size_rank(group)
        self.layout = SymmA2ALayout(max_tokens=max_tokens, hidden=hidden, top_k=top_k,
                                    num_experts=num_experts, num_ranks=num_ranks,
                                    major_align=major_align, expert_groups=expert_groups)
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else \
            torch.device(device)
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"device must be a CUDA device with an index, got {device}")
        check_symm_support(device)
        self.rank = rank
        self.device = device
        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.symmetric = True
        self.closed = False
        import torch.distributed._symmetric_memory as symm_mem
        _select_nvshmem_backend(device)
        self._handles = []
        with torch.cuda.device(device):
            _enable_group(self.group_name)

            def alloc(shape, dtype):
                t = symm_mem.empty(*shape, dtype=dtype, device=device)
                self._handles.append(symm_mem.rendezvous(t, self.group_name))
                return t.zero_()
            self._alloc(alloc)
            torch.cuda.synchronize(device)
        dist.barrier(group=self.group)   # every rank's buffers exist before any peer reads them
        if warmup:
            self._warmup()

    @classmethod
    def unshared(cls, layout: SymmA2ALayout, rank: int,
                 device: torch.device | str = "cpu") -> SymmA2AContext:
        """For tests: rank ``rank`` of ``layout`` with ``buffer_shapes()`` as ordinary zeroed
        tensors on ``device`` (no process group). ``moe_forward_symm`` refuses it; ``route``,
        ``run_experts`` and ``weighted_sum`` take it, the two ops emulated in between."""
        self = cls.__new__(cls)
        self.layout, self.rank, self.device = layout, rank, torch.device(device)
        self.group = self.group_name = None
        self.symmetric, self.closed, self._handles = False, False, []
        self._alloc(lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=self.device))
        return self

    def _alloc(self, alloc) -> None:
        for name, (shape, dtype) in self.layout.buffer_shapes().items():
            setattr(self, name, alloc(shape, dtype))

    def _warmup(self) -> None:
        try:
            with torch.cuda.device(self.device):
                self.in_splits.zero_()
                _dispatch(self)
                _combine_rows(self)
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # the ops reject this configuration, or the machine
            raise SymmUnavailableError(f"torch-symm: the first all_to_all_vdev_2d / _offset call "
                                       f"failed ({type(exc).__name__}: {exc})") from exc
        dist.barrier(group=self.group)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def close(self) -> None:
        """Free the buffers (collective: waits for every rank before any memory goes)."""
        if self.closed:
            return
        if self.symmetric:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
        for name in self.layout.buffer_shapes():
            setattr(self, name, None)
        self._handles = []
        self.closed = True

    def __repr__(self) -> str:
        L = self.layout
        return (f"SymmA2AContext(rank={self.rank}/{L.num_ranks}, max_tokens={L.max_tokens}, "
                f"H={L.hidden}, K={L.top_k}, E={L.num_experts}, groups={L.expert_groups}, "
                f"major_align={L.major_align}, {L.nbytes / 2**20:.1f} MiB"
                f"{', closed' if self.closed else ''})")


# ---- the forward, in stages (the tests drive the stages with emulated ops) ------------------

@dataclass
class RoutePlan:
    """What ``route`` leaves for ``weighted_sum``: order_P [P] int64, valid_P [P] bool, T, K."""
    order_P: torch.Tensor     # [P] int64: sorted pick -> pick (t*K + k)
    valid_P: torch.Tensor     # [P] bool: sorted pick i goes to an expert (not -1)
    T: int
    K: int


def route(ctx: SymmA2AContext, x: torch.Tensor, topk_idx: torch.Tensor) -> RoutePlan:
    """Before the dispatch: x [T, H] bf16, topk_idx [T, K] int32/int64 -> ``ctx.send[:T*K]``
    bf16 rows and ``ctx.in_splits`` [S] int64. The picks are sorted by global expert
    (= rank-major, then local expert); -1 picks sort last and are not sent."""
    L = ctx.layout
    T, K = topk_idx.shape
    P, H, E_all = T * K, L.hidden, L.num_experts
    idx_P = topk_idx.reshape(-1).to(torch.int64)
    key_P = torch.where(idx_P >= 0, idx_P, E_all)
    order_P = torch.argsort(key_P, stable=True)
    key_sorted_P = key_P.index_select(0, order_P)
    counts = torch.zeros(E_all + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, key_P, torch.ones_like(key_P))
    # global expert r*E + g*(E/G) + j belongs to chunk r*G + g
    ctx.in_splits.copy_(counts[:E_all].view(L.num_splits, L.experts_per_group).sum(1))
    tok_P = torch.div(order_P, K, rounding_mode="floor")
    if L.regroup:
        ctx.send[:P, :H].copy_(x.index_select(0, tok_P))
        ctx.send.view(torch.int16)[:P, H].copy_(torch.remainder(key_sorted_P, L.local_experts))
    else:
        torch.index_select(x, 0, tok_P, out=ctx.send[:P])
    return RoutePlan(order_P, key_sorted_P < E_all, T, K)


def _dispatch(ctx: SymmA2AContext) -> None:
    torch.ops.symm_mem.all_to_all_vdev_2d(ctx.send, ctx.recv, ctx.in_splits,
                                          ctx.disp_splits_offsets, ctx.group_name,
                                          ctx.layout.major_align)


def _combine_rows(ctx: SymmA2AContext) -> None:
    torch.ops.symm_mem.all_to_all_vdev_2d_offset(ctx.recv, ctx.send, ctx.disp_splits_offsets,
                                                 ctx.comb_splits_offsets, ctx.group_name)


def _grouped(a_ND: torch.Tensor, w_EMD: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """a_ND [N, D] rows in groups [offs[e-1], offs[e]) times w_EMD[e]^T: [N, M] bf16; rows past
    offs[-1] are not computed (uninitialised on CUDA, zero on the CPU test path)."""
    if a_ND.device.type == "cuda":
        return torch._grouped_mm(a_ND, w_EMD.transpose(-2, -1), offs=offs_E)
    # CPU: only the tests' emulated runs get here; reads the offsets on the host.
    n = int(offs_E[-1]) if offs_E.numel() else 0
    out = a_ND.new_zeros(a_ND.shape[0], w_EMD.shape[1])
    counts_E = torch.diff(offs_E.to(torch.int64), prepend=offs_E.new_zeros(1, dtype=torch.int64))
    out[:n] = _expert_mm(a_ND[:n], w_EMD, counts_E)
    return out


def _ffn(a_ND: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
         offs_E: torch.Tensor) -> torch.Tensor:
    I = w13.shape[1] // 2
    h_N2I = _grouped(a_ND, w13, offs_E)
    act_NI = (F.silu(h_N2I[:, :I].float()) * h_N2I[:, I:].float()).to(a_ND.dtype)
    return _grouped(act_NI, w2, offs_E)


def run_experts(ctx: SymmA2AContext, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Between the ops: w13 [E, 2I, H], w2 [E, H, I] bf16; the expert FFN of the rows received
    in ``ctx.recv`` [N, W] bf16 (found by ``ctx.disp_splits_offsets`` [2, S] int64), in place."""
    L = ctx.layout
    E, R, A, H = L.local_experts, L.num_ranks, L.major_align, L.hidden
    so = ctx.disp_splits_offsets
    dev = ctx.recv.device
    if not L.regroup:
        # group e = expert e's tile [start_e, start_{e+1}), padding rows included (computed but
        # never sent back); the last group ends at its rows rounded up, at least A (the op
        # reserves that much, and no group is then empty).
        split_ER = so[0].view(E, R)
        start_E = so[1].view(E, R)[:, 0]
        n_last = split_ER[-1].sum()
        last_len = torch.clamp(torch.div(n_last + (A - 1), A, rounding_mode="floor") * A, min=A)
        offs_E = torch.cat([start_E[1:], (start_E[-1] + last_len).view(1)]).to(torch.int32)
        ctx.recv.copy_(_ffn(ctx.recv, w13, w2, offs_E))
        return
    # regroup: find each row's chunk, keep the rows inside their chunk, sort them by the local
    # expert id they carry; padding and unused rows sort last (expert E) and are not computed.
    N = L.recv_rows
    recv_NH = ctx.recv[:, :H]
    eid_N = ctx.recv.view(torch.int16)[:, H].to(torch.int64)
    off_S, split_S = so[1], so[0]
    row_N = torch.arange(N, device=dev)
    chunk_N = (torch.searchsorted(off_S, row_N, right=True) - 1).clamp_(min=0)
    valid_N = row_N < (off_S + split_S).index_select(0, chunk_N)
    key_N = torch.where(valid_N, eid_N, E)
    perm_N = torch.argsort(key_N, stable=True)
    counts_E = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    counts_E.scatter_add_(0, key_N, torch.ones_like(key_N))
    offs_E = counts_E[:E].cumsum(0).to(torch.int32)
    out_NH = _ffn(recv_NH.index_select(0, perm_N), w13, w2, offs_E)
    recv_NH.index_copy_(0, perm_N, out_NH)


def weighted_sum(ctx: SymmA2AContext, plan: RoutePlan,
                 topk_weights: torch.Tensor) -> torch.Tensor:
    """After the combine: y [T, H] bf16, y[t] = sum_k topk_weights[t, k] ([T, K] fp32) * the
    ``ctx.send`` row of pick (t, k), summed in fp32; -1 picks count 0."""
    T, K, H = plan.T, plan.K, ctx.layout.hidden
    P = T * K
    w_P = topk_weights.reshape(-1).index_select(0, plan.order_P)
    contrib_PH = ctx.send[:P, :H].float() * w_P[:, None]
    # rows past the sent ones hold this call's unsent copies: masked, never multiplied in
    contrib_PH = torch.where(plan.valid_P[:, None], contrib_PH, 0.0)
    y_PH = torch.empty(P, H, dtype=torch.float32, device=contrib_PH.device)
    y_PH.index_copy_(0, plan.order_P, contrib_PH)
    return y_PH.view(T, K, H).sum(1).to(torch.bfloat16)


def _validate(ctx: SymmA2AContext, x: torch.Tensor, topk_idx: torch.Tensor,
              topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
              num_experts: int, group: dist.ProcessGroup | None) -> None:
    L = ctx.layout
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts != L.num_experts:
        raise ValueError(f"num_experts ({num_experts}) differs from the context's "
                         f"({L.num_experts})")
    if ctx.symmetric:
        name = (group if group is not None else dist.group.WORLD).group_name
        if name != ctx.group_name:
            raise ValueError(f"group {name!r} differs from the context's group {ctx.group_name!r}")
    check_tensor("x", x, ndim=2, dtype=torch.bfloat16, device=ctx.device)
    check_routing(x, topk_idx, topk_weights, hidden=L.hidden, top_k=L.top_k,
                  max_tokens=L.max_tokens)
    check_tensor("w13", w13, ndim=3, dtype=torch.bfloat16, device=x.device)
    intermediate = w13.shape[1] // 2
    if w13.shape[1] % 2 or intermediate == 0:
        raise ValueError(f"w13 must have shape (E_local, 2*I, H) with I >= 1 (gate rows then up "
                         f"rows), got {tuple(w13.shape)}")
    check_expert_weights(w13, w2, experts=L.local_experts, hidden=L.hidden,
                         intermediate=intermediate, dtype=torch.bfloat16, device=x.device)


def moe_forward_symm(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                     w13: torch.Tensor, w2: torch.Tensor, *, num_experts: int,
                     ctx: SymmA2AContext, group: dist.ProcessGroup | None = None,
                     validate: bool = False) -> torch.Tensor:
    """Expert-parallel MoE forward of the calling rank via NVSHMEM all_to_all_vdev_2d.

    Rank r of the group owns the experts [r*E/R, (r+1)*E/R). Every rank of the group must call
    this together with a context built alike (the two ops are collective and barrier
    internally). No host synchronisation unless ``validate``; all shapes are static.

    Args:
        x: [T, H] bf16 tokens of this rank (0 <= T <= ctx's max_tokens), on ctx's device.
        topk_idx: [T, K] int32/int64 global expert ids in [-1, num_experts); -1 = no expert
            (never sent, contributes nothing). Out-of-range ids are not checked unless
            ``validate`` (they trip a device-side assert).
        topk_weights: [T, K] fp32 gate weights, applied as given.
        w13: [E/R, 2I, H] bf16 local experts' gate (rows 0..I-1) and up (rows I..2I-1).
        w2: [E/R, H, I] bf16 local experts' down projection.
        num_experts: E, experts over all ranks (must equal the context's).
        ctx: the ``SymmA2AContext`` holding the symmetric buffers.
        group: process group; None = the default group (must be the context's).
        validate: also check the topk_idx range (reads it: one host synchronisation).

    Returns:
        y: [T, H] bf16, y[t] = sum_k w[t,k] * w2[e] @ (silu(gate_e x[t]) * up_e x[t]).
        Rounding as ``moe_forward_a2a``: GEMMs accumulate in fp32 and round to bf16
        (torch._grouped_mm), the SwiGLU product is rounded to bf16, the sum over k is fp32.

    Raises:
        ValueError: bad shapes, dtypes, devices, or arguments that disagree with ``ctx``
            (checked before any collective); with ``validate``, expert ids out of range.
        RuntimeError: a closed context, or one made by ``SymmA2AContext.unshared``.
    """
    if not isinstance(ctx, SymmA2AContext):
        raise ValueError(f"ctx must be a SymmA2AContext, got {type(ctx).__name__}")  # noqa: TRY004
    if ctx.closed:
        raise RuntimeError("the SymmA2AContext is closed")
    _validate(ctx, x, topk_idx, topk_weights, w13, w2, num_experts=num_experts, group=group)
    if validate:
        check_topk_range(topk_idx, num_experts)
    if not ctx.symmetric:
        raise RuntimeError("this SymmA2AContext has no symmetric memory (SymmA2AContext.unshared "
                           "is for tests): build one with SymmA2AContext(...)")
    with torch.cuda.device(ctx.device):
        plan = route(ctx, x, topk_idx)
        _dispatch(ctx)
        run_experts(ctx, w13, w2)
        _combine_rows(ctx)
        return weighted_sum(ctx, plan, topk_weights)
