"""The layer's public entry points.

``mega_moe``: one rank per process (each process drives one GPU), no host synchronisation.
``MegaMoE``: an nn.Module owning the buffer and this rank's experts.
``mega_moe_virtual``: all R ranks in this process (virtual ranks), lists indexed by rank.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .buffer import SymmBuffer
from .checks import (check_expert_weights, check_expert_weights_fp4w, check_expert_weights_fp8,
                     check_routing, check_tensor, check_topk_range)
from .ops import mega_moe_op, mega_moe_out_op, option_keys, runner
from .tuning import Tuning, check_granularity

__all__ = ["mega_moe", "mega_moe_virtual", "MegaMoE"]


def _prepare_rank(buffer: SymmBuffer, x: torch.Tensor, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  *, validate: bool, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = buffer.config
    check_routing(x, topk_idx, topk_weights, hidden=cfg.hidden, top_k=cfg.top_k,
                  max_tokens=cfg.max_tokens_per_rank, prefix=prefix)
    if x.device != buffer.device:
        raise ValueError(f"{prefix}x must be on the buffer's device {buffer.device}, got {x.device}")
    if x.shape[0] and x.stride(1) != 1:
        raise ValueError(f"{prefix}x must have unit stride along hidden, got strides {x.stride()}")
    dims = dict(experts=cfg.experts_per_rank(buffer.num_ranks), hidden=cfg.hidden,
                intermediate=cfg.intermediate, device=buffer.device, prefix=prefix)
    if cfg.dtype == "fp8":
        check_expert_weights_fp8(w13, w2, **dims)
    elif cfg.dtype == "fp4w":
        check_expert_weights_fp4w(w13, w2, codes=validate, **dims)
    else:
        check_expert_weights(w13, w2, dtype=torch.bfloat16, contiguous=True, **dims)
    if validate:
        check_topk_range(topk_idx, cfg.num_experts, name=f"{prefix}topk_idx")
    return topk_idx.contiguous(), topk_weights.contiguous()


def mega_moe_virtual(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor],
                     topk_weights: Sequence[torch.Tensor], w13s: Sequence[torch.Tensor],
                     w2s: Sequence[torch.Tensor], buffer: SymmBuffer, *,
                     out: torch.Tensor | None = None, validate: bool = True,
                     impl: str = "staged", tuning: Tuning | None = None,
                     granularity: int | str = "token") -> list[torch.Tensor]:
    """The expert-parallel layer for R virtual ranks held by one process.

    Runs the kernels (staged: publish, signal, layout, dispatch, L1, L2, combine, one launch
    each; fused: the last four in one launch), every launch serving all R ranks, and then
    checks the kernels' diagnostics, which synchronises
    with the device (this is a development and test path; the per-rank ``mega_moe`` is the
    one without host synchronisation): a call inside a CUDA graph capture is a ValueError.

    Args:
        xs: per rank r, x [T_r, H] bf16 with T_r <= config.max_tokens_per_rank (T_r may be 0).
        topk_idxs: per rank, [T_r, K] int32/int64 global expert ids, -1 = no expert.
        topk_weights: per rank, [T_r, K] fp32.
        w13s: per rank, [E/R, 2I, H] bf16 contiguous: rank r's experts [r*E/R, (r+1)*E/R).
            fp8 buffers (config.dtype "fp8"): a pair (values [E/R, 2I, H] float8_e4m3fn,
            scale_inv [E/R, 2I/128, H/128] fp32), as ``quant.convert_expert_weights_fp8``.
        w2s: per rank, [E/R, H, I] bf16 contiguous (fp8: (values [E/R, H, I] e4m3,
            scale_inv [E/R, H/128, I/128] fp32)). fp4w buffers: (packed, scales) pairs as
            ``mega_moe`` takes them.
        buffer: a virtual ``SymmBuffer`` with num_ranks == R.
        out: optional [R, max T_r, H] bf16 to write into (rows past T_r are left alone).
        validate: check topk id ranges on the host before launching (a synchronisation).
        impl: "staged" (one launch per stage) or "fused" (dispatch, L1, L2 and combine in one
            persistent launch; see kernels/fused.py).
        tuning: launch settings (``moestream.tuning.Tuning``; None: ``tuning.select``'s for
            this call and device).
        granularity: streaming mode of the fused launch: "token" (default), C (chunked: C
            tokens per dispatch task, L1 waits for C-row chunks; a multiple of block_m) or
            "expert" (L1 waits for the whole expert). "token" only with impl="staged".

    Returns:
        y per rank, [T_r, H] bf16 (views into ``out`` or a fresh tensor).
    """
    if not isinstance(buffer, SymmBuffer) or not buffer.is_virtual:
        raise ValueError("buffer must be a virtual SymmBuffer(config, num_ranks=R); for one "
                         "rank per process use mega_moe")
    if buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError("mega_moe_virtual reads the kernels' diagnostics on the host after "
                         "each call, which a CUDA graph capture does not allow; capture "
                         "mega_moe (one rank per process) or staged.run_staged / fused.run_fused")
    R = buffer.num_ranks
    for name, seq in (("xs", xs), ("topk_idxs", topk_idxs), ("topk_weights", topk_weights),
                      ("w13s", w13s), ("w2s", w2s)):
        if not isinstance(seq, (list, tuple)) or len(seq) != R:
            got = len(seq) if isinstance(seq, (list, tuple)) else type(seq).__name__
            raise ValueError(f"{name} must be a list with one entry per rank ({R}), got {got}")
    idxs, ws = [], []
    for r in range(R):
        i, w = _prepare_rank(buffer, xs[r], topk_idxs[r], topk_weights[r], w13s[r], w2s[r],
                             validate=validate, prefix=f"rank {r}: ")
        idxs.append(i)
        ws.append(w)
    buffer.check()  # an earlier call's stall must not pass unnoticed
    t_out = max(x.shape[0] for x in xs)
    if out is None:
        out = torch.empty(R, t_out, buffer.config.hidden, dtype=torch.bfloat16,
                          device=buffer.device)
    else:
        check_tensor("out", out, dtype=torch.bfloat16, device=buffer.device,
                     ndim=3)
        if out.shape[0] != R or out.shape[1] < t_out or out.shape[2] != buffer.config.hidden \
                or out.stride(2) != 1:
            raise ValueError(f"out must be [R={R}, >= {t_out}, H={buffer.config.hidden}] with "
                             f"unit stride along H, got shape {tuple(out.shape)} strides "
                             f"{out.stride()}")
    runner(impl, granularity)(buffer, xs, idxs, ws, w13s, w2s, out,
                                             tuning=tuning)
    buffer.check()
    return [out[r, :x.shape[0]] for r, x in enumerate(xs)]


def mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             w13: torch.Tensor, w2: torch.Tensor, buffer: SymmBuffer, *,
             out: torch.Tensor | None = None, validate: bool = False,
             impl: str = "staged", tuning: Tuning | None = None,
             granularity: int | str = "token") -> torch.Tensor:
    """The expert-parallel MoE layer for the calling rank.

    Collective: every rank of the buffer's group calls it the same number of times, in the
    same order (ranks may pass different token counts, including 0). No host synchronisation:
    the call can be captured in a CUDA graph (after one warm-up call) and replayed with new
    inputs copied into the captured tensors.

    The arguments are checked here; the layer then runs as the torch custom op
    ``torch.ops.moestream.mega_moe`` (``moestream.ops``; ``mega_moe_out`` with ``out``), so
    ``torch.compile`` keeps the call in its graph (docs/integrations.md, compiled models).
    No autograd: a backward through the result raises.

    Args:
        x: [T, H] bf16 tokens of this rank, T <= config.max_tokens_per_rank.
        topk_idx: [T, K] int32/int64 global expert ids in [-1, E); -1 = no expert.
        topk_weights: [T, K] fp32 gate weights (applied as given).
        w13: [E/R, 2I, H] bf16 contiguous, this rank's experts [rank*E/R, (rank+1)*E/R);
            rows 0..I-1 gate, I..2I-1 up. With an fp8 buffer (config.dtype "fp8"): a pair
            (values [E/R, 2I, H] float8_e4m3fn, scale_inv [E/R, 2I/128, H/128] fp32), the
            DeepSeek-V3 format (``quant.convert_expert_weights_fp8``,
            ``quant.load_deepseek_v3_experts``); x stays bf16 and is quantized per token per
            128 channels before it crosses NVLink (docs/quantization.md). With an fp4w buffer:
            a pair (packed [E/R, 2I, H/2] uint8 e2m1 pairs, scales [E/R, 2I, H/32] uint8
            E8M0), as ``quant.convert_expert_weights_mxfp4``; contiguous, 16-byte aligned.
        w2: [E/R, H, I] bf16 contiguous (fp8: (values [E/R, H, I] e4m3, scale_inv
            [E/R, H/128, I/128] fp32); fp4w: (packed [E/R, H, I/2], scales [E/R, H, I/32])).
        buffer: ``SymmBuffer(config, group=...)`` (or a virtual buffer with one rank).
        out: optional [T, H] bf16 output tensor.
        validate: also check the topk id range on the host (synchronises; under
            torch.compile a graph break), and in fp4w mode that every E8M0 code is at most
            253 (the kernels decode 254 and 255 wrongly).
            Without it, ids outside [-1, E) are ignored by the kernels and reported as a
            ValueError by a later call (or ``buffer.check()``).
        impl: "staged" (default: one launch per stage) or "fused" (one persistent launch for
            dispatch, L1, L2 and combine; fp4w weights expanded to fp8 blocks each call).
        tuning: launch settings (``moestream.tuning.Tuning``; None: ``tuning.select``'s for
            this call and device).
        granularity: streaming mode of the fused launch: "token" (default), C (chunked,
            DeepEP-normal style: C tokens per dispatch task, L1 waits for C-row chunks of an
            expert; a multiple of block_m) or "expert" (L1 waits for the whole expert).

    Returns:
        y: [T, H] bf16, sum over k of topk_weights * expert(x).
    """
    return _call_op(x, topk_idx, topk_weights, w13, w2, buffer, None, out=out,
                    validate=validate, impl=impl, tuning=tuning, granularity=granularity)


def _call_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13, w2,
             buffer: SymmBuffer, state: torch.Tensor | None, *, out: torch.Tensor | None,
             validate: bool, impl: str, tuning: Tuning | None,
             granularity: int | str) -> torch.Tensor:
    """mega_moe's checks, then the registered op (moestream.ops). ``state``: the tensor the op
    declares it mutates; None: the buffer's ``op_state`` (MegaMoE passes its registered
    buffer, the same tensor, which torch.export tracks)."""
    if isinstance(buffer, SymmBuffer) and buffer.destroyed:
        raise ValueError("buffer was destroyed (SymmBuffer.destroy / MegaMoE.destroy); create "
                         "a new one")
    if not isinstance(buffer, SymmBuffer) or buffer.local_ranks != 1:
        raise ValueError("buffer must be a SymmBuffer(config, group=...) for this rank (or a "
                         "virtual SymmBuffer with num_ranks=1); for several virtual ranks use "
                         "mega_moe_virtual")
    topk_idx, topk_weights = _prepare_rank(buffer, x, topk_idx, topk_weights, w13, w2,
                                           validate=validate, prefix="")
    state = buffer.op_state if state is None else state
    T, H = x.shape
    if out is not None:
        check_tensor("out", out, shape=(T, H), dtype=torch.bfloat16, device=buffer.device)
        if out.stride(1) != 1:
            raise ValueError(f"out must have unit stride along H, got strides {out.stride()}")
    runner(impl, granularity)   # checks impl against granularity
    if impl == "fused":
        check_granularity(granularity, buffer.config.block_m)
    gran, tun = option_keys(granularity, tuning)
    # the registered ops (moestream.ops): compiled graphs hold them as single nodes
    w13s = [w13] if isinstance(w13, torch.Tensor) else list(w13)
    w2s = [w2] if isinstance(w2, torch.Tensor) else list(w2)
    opts = dict(buffer_id=buffer.op_id, impl=impl, granularity=gran, tuning=tun)
    if out is None:
        return mega_moe_op(x, topk_idx, topk_weights, w13s, w2s, state, **opts)
    mega_moe_out_op(x, topk_idx, topk_weights, w13s, w2s, state, out, **opts)
    return out


class MegaMoE(torch.nn.Module):
    """An expert-parallel MoE layer (routed experts) for one rank: owns its buffer and its
    E/R experts' weights.

    Collective: every rank of ``group`` constructs it and calls ``forward`` together.
    Inference only (no autograd through the kernels). ``forward`` runs the custom op
    ``torch.ops.moestream.mega_moe``: the module works inside ``torch.compile`` and
    ``torch.export`` graphs.

    Args:
        config: the layer's sizes.
        group: process group, one rank per GPU (default: the default group when
            torch.distributed is initialised, else a single rank in this process).
        device: where the weights and buffer live (default: the current CUDA device, else cpu).
        scoring, renormalize: how ``forward_logits`` routes (see ``moestream.route``).

    Attributes:
        w13 [E/R, 2I, H] bf16 and w2 [E/R, H, I] bf16: this rank's experts (parameters,
            uninitialised until loaded or ``reset_parameters`` is called).
        fp8 configs (``config.dtype == "fp8"``): w13 and w2 are float8_e4m3fn of those shapes,
            with w13_scale_inv [E/R, 2I/128, H/128] and w2_scale_inv [E/R, H/128, I/128] fp32
            (the DeepSeek-V3 block format: load ``quant.load_deepseek_v3_experts`` output into
            them, or ``quant.convert_expert_weights_fp8`` of bf16 experts).
        fp4w configs: w13 [E/R, 2I, H/2] and w2 [E/R, H, I/2] uint8 (MXFP4 e2m1 pairs) with
            w13_scale [E/R, 2I, H/32] and w2_scale [E/R, H, I/32] uint8 (E8M0), as
            ``quant.convert_expert_weights_mxfp4`` writes them.
        op_state: [1] int32, a non-persistent buffer: the buffer's ``op_state``, which the op
            declares it mutates (registered so that torch.export records the mutation).
    """

    def __init__(self, config, *, group=None, device: str | torch.device | None = None,
                 scoring: str = "softmax", renormalize: bool = True) -> None:
        super().__init__()
        import torch.distributed as dist
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        if group is None:
            self.buffer = SymmBuffer(config, num_ranks=1, device=device)
        else:
            self.buffer = SymmBuffer(config, group=group, device=device)
        self.config = config
        self.scoring, self.renormalize = scoring, renormalize
        # the tensor the layer's op declares it mutates, as a module buffer: torch.export then
        # records the mutation as a buffer's (a plain tensor attribute would be a constant)
        self.register_buffer("op_state", self.buffer.op_state, persistent=False)
        e_loc = config.experts_per_rank(self.buffer.num_ranks)
        H, I = config.hidden, config.intermediate
        wdtype = {"fp8": torch.float8_e4m3fn, "fp4w": torch.uint8}.get(config.dtype,
                                                                      torch.bfloat16)

        def param(*shape, dtype=wdtype):
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device),
                                      requires_grad=False)
        if config.dtype == "fp4w":   # two e2m1 values per byte, one E8M0 code per 32 along K
            self.w13 = param(e_loc, 2 * I, H // 2)
            self.w2 = param(e_loc, H, I // 2)
            self.w13_scale = param(e_loc, 2 * I, H // 32)
            self.w2_scale = param(e_loc, H, I // 32)
        else:
            self.w13 = param(e_loc, 2 * I, H)
            self.w2 = param(e_loc, H, I)
        if config.dtype == "fp8":
            self.w13_scale_inv = param(e_loc, 2 * I // 128, H // 128, dtype=torch.float32)
            self.w2_scale_inv = param(e_loc, H // 128, I // 128, dtype=torch.float32)

    @property
    def rank(self) -> int:
        return self.buffer.rank0

    @property
    def expert_range(self) -> range:
        """Global ids of the experts this rank holds."""
        e_loc = self.w13.shape[0]
        return range(self.rank * e_loc, (self.rank + 1) * e_loc)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random experts with unit-variance activations (1/sqrt(fan_in)); fp8 and fp4w
        configs quantize them to their formats."""
        H, I = self.config.hidden, self.config.intermediate
        e_loc = self.w13.shape[0]
        w13 = torch.randn(e_loc, 2 * I, H, generator=generator) * H ** -0.5
        w2 = torch.randn(e_loc, H, I, generator=generator) * I ** -0.5
        if self.config.dtype == "fp4w":
            from .quant import convert_expert_weights_mxfp4
            q = convert_expert_weights_mxfp4(w13, w2)
            w13, w2 = q["w13"], q["w2"]
            self.w13_scale.copy_(q["w13_scale"])
            self.w2_scale.copy_(q["w2_scale"])
        if self.config.dtype == "fp8":
            from .quant import convert_expert_weights_fp8
            q = convert_expert_weights_fp8(w13, w2)
            w13, w2 = q["w13"], q["w2"]
            self.w13_scale_inv.copy_(q["w13_scale_inv"])
            self.w2_scale_inv.copy_(q["w2_scale_inv"])
        self.w13.copy_(w13)
        self.w2.copy_(w2)

    def experts(self) -> tuple:
        """(w13, w2) as ``mega_moe`` takes them: tensors, fp8 (values, scale_inv) or fp4w
        (packed, scales) pairs."""
        if self.config.dtype == "fp8":
            return (self.w13, self.w13_scale_inv), (self.w2, self.w2_scale_inv)
        if self.config.dtype == "fp4w":
            return (self.w13, self.w13_scale), (self.w2, self.w2_scale)
        return self.w13, self.w2

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H] bf16, topk_idx [T, K] int (global ids, -1 = none), topk_weights [T, K] fp32
        -> y [T, H] bf16."""
        w13, w2 = self.experts()
        # the module's op_state (the buffer's, registered): what torch.export tracks
        return _call_op(x, topk_idx, topk_weights, w13, w2, self.buffer, self.op_state,
                        out=None, validate=False, impl="staged", tuning=None,
                        granularity="token")

    def forward_logits(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Route with ``moestream.route`` (this module's scoring) and run the layer.
        router_logits: [T, E] float."""
        from .reference import route
        idx, w = route(router_logits, self.config.top_k, scoring=self.scoring,
                       renormalize=self.renormalize)
        return self.forward(x, idx, w)

    def destroy(self) -> None:
        """Free the buffer (collective)."""
        self.buffer.destroy()
