"""The per-rank layer as torch custom ops, so that compiled models (``torch.compile``, CUDA
graphs, ``torch.export``) hold it in their graphs instead of breaking them.

Two ops, registered when moestream is imported::

    moestream::mega_moe(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor[] w13,
        Tensor[] w2, Tensor(a!) state, *, SymInt buffer_id, str impl, str granularity,
        str tuning) -> Tensor
    moestream::mega_moe_out(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor[] w13,
        Tensor[] w2, Tensor(a!) state, Tensor(b!) out, *, SymInt buffer_id, str impl,
        str granularity, str tuning) -> ()

- ``buffer_id``: the ``SymmBuffer``'s ``op_id`` (buffers register at construction and
  unregister at ``destroy``); an op schema cannot hold the object itself.
- ``state``: the buffer's ``op_state``, declared mutated: each call changes the buffer's memory
  (epochs, counters, pools), so a compiler must neither drop, merge nor reorder calls on one
  buffer. The memory itself is not an argument: functionalization would hand the op a copy,
  while the kernels (and peer ranks) reach the buffer through its address table.
- ``out`` (mega_moe_out): [T, H] bf16, written in place; mega_moe returns a fresh tensor
  instead (an op's output may not alias its inputs).
- ``w13``, ``w2``: [w] in bf16, [values, scale_inv] in fp8, [packed, scales] in fp4w.
- ``impl``, ``granularity``, ``tuning``: ``mega_moe``'s options as strings (``option_keys``).

The fake (meta) implementation returns an empty [T, H] bf16 tensor on x's device and never
touches the buffer. No autograd: the ops are registered as not differentiable (an autograd
fallthrough), so their outputs never require grad and no gradient flows through the layer.

``moestream.mega_moe`` checks its arguments (ValueError) and calls these ops; called directly,
the ops take arguments as ``mega_moe`` has checked them.
"""
from __future__ import annotations

import ast
import functools

import torch

from .buffer import SymmBuffer
from .checks import check_fp4w_alignment
from .fused import run_fused
from .staged import run_staged
from .tuning import Tuning

__all__ = ["mega_moe_op", "mega_moe_out_op", "runner", "option_keys", "IMPLS", "SCHEMAS"]

IMPLS = ("staged", "fused")


def runner(impl: str, granularity: int | str):
    """The run function of ``impl`` in streaming mode ``granularity`` (a malformed granularity
    is a ValueError from ``fused.fused_tuning``, before anything is launched)."""
    if impl == "staged":
        if granularity != "token":
            raise ValueError(f"granularity={granularity!r} needs impl='fused' (the staged path "
                             "streams tokens only)")
        return run_staged
    if impl == "fused":
        return functools.partial(run_fused, granularity=granularity)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


# ---- options as schema strings -------------------------------------------------------------

def _dotted(tuning: Tuning, name: str):
    part, dot, field = name.partition(".")
    return getattr(getattr(tuning, part), field) if dot else getattr(tuning, name)


# every dotted field's default, computed once: _tuning_key runs inside dynamo's trace
_DEFAULTS = {name: _dotted(Tuning(), name) for name in Tuning.dotted_names()}


def _tuning_key(tuning: Tuning) -> str:
    # "Tuning(name=value, ...)" with the dotted fields that differ from Tuning() (each an
    # int, bool or None, whose repr has no comma); plain Python that torch.compile traces to
    # a constant
    items = [f"{name}={_dotted(tuning, name)!r}" for name, default in _DEFAULTS.items()
             if _dotted(tuning, name) != default]
    return "Tuning(" + ", ".join(items) + ")"


def option_keys(granularity: int | str, tuning: Tuning | None) -> tuple[str, str]:
    """``mega_moe``'s granularity (already checked) and tuning as the ops' strings:
    "token", "expert" or the chunk size in decimal; "" for tuning=None (the per-call
    default) or "Tuning(name=value, ...)" with the dotted fields (``l1.block_n``) that differ
    from ``Tuning()``."""
    if tuning is not None and not isinstance(tuning, Tuning):
        raise ValueError(f"tuning must be a moestream.tuning.Tuning or None, got "
                         f"{type(tuning).__name__}")
    return str(granularity), "" if tuning is None else _tuning_key(tuning)


@functools.lru_cache(maxsize=64)
def _tuning(key: str) -> Tuning | None:
    if not key:
        return None
    body = key.removeprefix("Tuning(").removesuffix(")")
    changes = {}
    for item in filter(None, body.split(", ")):
        name, _, value = item.partition("=")
        changes[name] = ast.literal_eval(value)
    return Tuning().with_dotted(changes)


def _granularity(key: str) -> int | str:
    return key if key in ("token", "expert") else int(key)


def _pair(ws: list[torch.Tensor]):
    return ws[0] if len(ws) == 1 else (ws[0], ws[1])


# ---- the implementation ---------------------------------------------------------------------

def _check_buffer_fits(buffer: SymmBuffer, buffer_id: int, x: torch.Tensor,
                       topk_idx: torch.Tensor, w13: list[torch.Tensor]) -> None:
    """The sizes that tie a call to its buffer (a few int compares): an id of another layer's
    buffer, e.g. in a graph saved by another process, must not reach the kernels."""
    cfg = buffer.config
    got = (buffer.local_ranks, x.device, x.shape[1], topk_idx.shape[1], len(w13),
           w13[0].shape[0])
    want = (1, buffer.device, cfg.hidden, cfg.top_k, 1 if cfg.dtype == "bf16" else 2,
            cfg.experts_per_rank(buffer.num_ranks))
    if got != want or x.shape[0] > cfg.max_tokens_per_rank:
        raise ValueError(
            f"buffer_id {buffer_id} names a buffer that does not fit this call: (local ranks, "
            f"device, hidden, top_k, weight tensors, local experts) {got} vs the buffer's "
            f"{want}, {x.shape[0]} tokens for {cfg.max_tokens_per_rank}. Op ids are per "
            f"process; moestream.mega_moe checks its arguments and passes the right one")


def _run(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
         w13: list[torch.Tensor], w2: list[torch.Tensor], out: torch.Tensor, *, buffer_id: int,
         impl: str, granularity: str, tuning: str) -> None:
    """One call of the layer on the buffer ``buffer_id`` (mega_moe's body after its checks)."""
    buffer = SymmBuffer.from_op_id(buffer_id)
    _check_buffer_fits(buffer, buffer_id, x, topk_idx, w13)
    run = runner(impl, _granularity(granularity))
    if buffer.config.dtype == "fp4w":   # addresses are not known while a graph is traced
        check_fp4w_alignment(w13, w2)
    capturing = buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:
        buffer.poll()
    run(buffer, [x], [topk_idx], [topk_weights], [_pair(w13)], [_pair(w2)], out,
        tuning=_tuning(tuning))
    if buffer.device.type != "cuda":
        buffer.check()       # the interpreter ran synchronously: report now
    elif not capturing:
        buffer.after_call()  # copied back asynchronously; the next call's poll() reports it


# ---- the registration ----------------------------------------------------------------------

_ARGS = ("Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor[] w13, Tensor[] w2, "
         "Tensor(a!) state")
_OPTIONS = "*, SymInt buffer_id, str impl, str granularity, str tuning"
SCHEMAS = {"mega_moe": f"({_ARGS}, {_OPTIONS}) -> Tensor",
           "mega_moe_out": f"({_ARGS}, Tensor(b!) out, {_OPTIONS}) -> ()"}

# torch.library's low-level registration: the real kernel for every backend, the fake one,
# and an autograd fallthrough. torch.library.custom_op would add Python autograd and
# ADInplaceOrView kernels to every call (50-70 us more per eager call on a 2-core CPU).
_lib = torch.library.Library("moestream", "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _lib.define(_name + _schema)
    # not differentiable: outputs never require grad, as the eager layer's never have
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")


def _mega_moe(x, topk_idx, topk_weights, w13, w2, state, *, buffer_id, impl, granularity,
              tuning):
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
    _run(x, topk_idx, topk_weights, w13, w2, out, buffer_id=buffer_id, impl=impl,
         granularity=granularity, tuning=tuning)
    return out


def _mega_moe_out(x, topk_idx, topk_weights, w13, w2, state, out, *, buffer_id, impl,
                  granularity, tuning):
    _run(x, topk_idx, topk_weights, w13, w2, out, buffer_id=buffer_id, impl=impl,
         granularity=granularity, tuning=tuning)


def _mega_moe_fake(x, topk_idx, topk_weights, w13, w2, state, *, buffer_id, impl,
                   granularity, tuning):
    return x.new_empty(x.shape[0], x.shape[1], dtype=torch.bfloat16)


def _mega_moe_out_fake(x, topk_idx, topk_weights, w13, w2, state, out, *, buffer_id, impl,
                       granularity, tuning):
    return None


_lib.impl("mega_moe", _mega_moe, "CompositeExplicitAutograd")
_lib.impl("mega_moe_out", _mega_moe_out, "CompositeExplicitAutograd")
torch.library.register_fake("moestream::mega_moe", _mega_moe_fake, lib=_lib)
torch.library.register_fake("moestream::mega_moe_out", _mega_moe_out_fake, lib=_lib)

# y = mega_moe_op(x, ..., state, buffer_id=..., ...): [T, H] bf16, a fresh tensor
mega_moe_op = torch.ops.moestream.mega_moe.default
# mega_moe_out_op(x, ..., state, out, buffer_id=..., ...): writes out [T, H] bf16
mega_moe_out_op = torch.ops.moestream.mega_moe_out.default
