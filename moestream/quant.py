"""Quantization formats of the FP8 and FP4-weight modes, in pure torch (the kernels' contract).

Legend (shape suffixes): T tokens, H hidden, I intermediate, E experts, N output rows of a
weight, K its reduction (input) dimension, G = ceil(H/128) activation groups per token.

FP8 (DeepSeek-V3 style, ``float8_e4m3fn``: max 448, 3 mantissa bits, no inf):

* Activations ``x [T, H]``: one fp32 scale per token per 128 consecutive channels,
  ``scale [T, ceil(H/128)]``. For each group, ``amax = max |x|`` (in fp32) and
  ``scale = max(amax / 448, 2**-126)``; ``q = fp8(clamp(x / scale, -448, 448))`` (IEEE fp32
  division, round to nearest even by torch's cast); ``x ~= q * scale``. The floor 2**-126 (the
  smallest normal fp32) keeps an all-zero group finite (q = 0) and a tiny group off fp32
  subnormal scales; above amax = 448 * 2**-126 (about 5e-36) the formula is plain
  ``amax / 448``, as DeepSeek-V3's ``act_quant`` and DeepGEMM compute it. A last group shorter
  than 128 (H not a multiple of 128) is quantized over its own channels (zero padding).
* Weights ``w [N, K]`` or ``[E, N, K]``: one fp32 scale per 128x128 block,
  ``scale_inv [(E,) ceil(N/128), ceil(K/128)]``, blocks row-major over (N, K), partial last
  blocks zero-padded before the amax (DeepSeek-V3 README_WEIGHTS.md: "If the weight block is not
  aligned to 128, it is zero-padded to 128 before calculating the scale"). The checkpoint
  name ``weight_scale_inv`` is the factor the fp8 block is **multiplied** by to get the real
  weight: ``w[n, k] = float(q[n, k]) * scale_inv[n // 128, k // 128]`` (DeepSeek-V3
  ``inference/kernel.py:weight_dequant``: ``y = x * s``; its ``weight_quant``:
  ``s = amax / 448``, ``y = x / s``). It is the *inverse* of the quantizer's multiplier
  448 / amax, hence the name. We use the same formula as for activations (plus the 2**-126
  floor, which DeepSeek's code lacks: an all-zero block there gives NaN).
* Our expert layout: ``w13 [E, 2I, H]`` (gate rows 0..I-1, up rows I..2I-1) with
  ``w13_scale_inv [E, 2I/128, ceil(H/128)]``; ``w2 [E, H, I]`` with
  ``w2_scale_inv [E, ceil(H/128), I/128]``. I must be a multiple of 128 so no 128-row block
  mixes gate and up rows: then our w13 blocks are exactly the checkpoint's gate blocks followed
  by its up blocks, and the L1 kernel can apply one scale per (128-row, 128-K) tile.

MXFP4 weights (OCP Microscaling v1.0, stretch mode):

* ``w [(E,) N, K]`` with K a multiple of 32; blocks of 32 consecutive K elements share one
  power-of-two scale stored as E8M0 (``uint8``, ``scale = 2**(code - 127)``, 255 = NaN is never
  written); elements are E2M1 (sign, 2 exponent bits, 1 mantissa bit: magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code = sign << 3 | magnitude index), rounded to nearest with
  ties to the even code, saturating at 6.
* Packing: ``packed [(E,) N, K/2] uint8``, element 2j in the **low** nibble and 2j+1 in the
  high nibble of byte j (as OCP, gpt-oss checkpoints and torch.float4_e2m1fn_x2 store it).
  ``scales [(E,) N, K/32] uint8``. The codes can be viewed as ``torch.float8_e8m0fnu``.
* Shared exponent, ``scale_rounding="floor"`` (default, the OCP spec):
  ``floor(log2(amax)) - 2`` (2 = emax of E2M1), so ``amax / scale`` lies in [4, 8) and
  elements above 6 * scale saturate to 6 (up to 25 % error on the block's largest element).
  ``scale_rounding="ceil"``: the smallest power of two with ``amax / scale <= 6`` (no
  saturation, one exponent coarser for about half of the blocks). Exponents are clamped to
  [-127, 127]; an all-zero block gets code 0.

Every function validates its inputs (``ValueError``: wrong type/dtype/rank/shape, NaN or inf in
the values). The value checks read the tensor (a host synchronisation): these are offline
(checkpoint conversion) and reference helpers, not the hot path.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

__all__ = [
    "FP8_E4M3_MAX", "FP8_BLOCK", "FP8_MIN_SCALE", "MXFP4_BLOCK", "E2M1_VALUES", "QUANT_MODES",
    "DSV3_EXPERT_KEY",
    "quantize_act_fp8", "dequantize_act_fp8", "fake_quant_act_fp8",
    "quantize_weight_fp8_blocks", "dequantize_weight_fp8_blocks",
    "convert_expert_weights_fp8", "load_deepseek_v3_expert", "load_deepseek_v3_experts",
    "quantize_weight_mxfp4", "dequantize_weight_mxfp4", "convert_expert_weights_mxfp4",
    "fake_quant_expert_weights",
]

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128                   # channels per activation scale; rows and columns per weight scale
FP8_MIN_SCALE = 2.0 ** -126       # smallest normal fp32: the floor of every fp8 scale
MXFP4_BLOCK = 32                  # K elements per E8M0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitude of codes 0..7
QUANT_MODES = ("bf16", "fp8", "fp4w")

# Key of one expert tensor in the Hugging Face DeepSeek-V3/R1 checkpoints
# (model.safetensors.index.json): prefix = "model.layers.{L}.mlp" for the MoE layers
# L >= first_k_dense_replace (3), proj in gate_proj / up_proj / down_proj, param in
# weight (fp8 e4m3, nn.Linear layout [out, in]) / weight_scale_inv (fp32 blocks).
DSV3_EXPERT_KEY = "{prefix}.experts.{expert}.{proj}.{param}"

_FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ---- validation -----------------------------------------------------------------------------

def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _check(name: str, t: object, *, ndims: Sequence[int], dtypes: Sequence[torch.dtype],
           finite: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ndims:
        want = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(_dtype_name(d) for d in dtypes)}, "
                         f"got {_dtype_name(t.dtype)}")
    if finite and t.numel():
        if t.dtype == torch.float8_e4m3fn:
            bad = bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())   # e4m3fn's only NaN code
        elif t.dtype == torch.uint8:
            bad = False
        else:
            bad = not bool(torch.isfinite(t).all())
        if bad:
            raise ValueError(f"{name} contains NaN or inf")
    return t


def _as_f32(name: str, t: torch.Tensor) -> torch.Tensor:
    """t in fp32, checked finite after the cast (fp64 values beyond fp32's range overflow)."""
    f = t.to(torch.float32)
    if f.numel() and not bool(torch.isfinite(f).all()):
        raise ValueError(f"{name} contains NaN or inf (checked after the cast to float32)")
    return f


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_last2(t: torch.Tensor, n_to: int, k_to: int) -> torch.Tensor:
    n, k = t.shape[-2:]
    if n == n_to and k == k_to:
        return t
    return torch.nn.functional.pad(t, (0, k_to - k, 0, n_to - n))


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.clamp_min(amax / FP8_E4M3_MAX, FP8_MIN_SCALE)


def _to_fp8(v: torch.Tensor) -> torch.Tensor:
    # The clamp makes the saturation explicit: torch's CPU cast saturates, other casts need not.
    return v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


# ---- FP8 activations ------------------------------------------------------------------------

def quantize_act_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations per token per 128 channels (DeepSeek-V3 ``act_quant``).

    Args:
        x_TH: [T, H] bf16/fp16/fp32/fp64, finite; T may be 0; H >= 1 (a last group shorter
            than 128 is quantized over its own channels).

    Returns:
        (q [T, H] float8_e4m3fn, scale [T, ceil(H/128)] fp32) with ``x ~= q * scale``
        (scale of group g covers channels 128g .. 128g+127). Contiguous.
    """
    _check("x", x_TH, ndims=(2,), dtypes=_FLOAT_IN, finite=False)
    T, H = x_TH.shape
    if H == 0:
        raise ValueError(f"x must have at least one channel, got shape {tuple(x_TH.shape)}")
    G = _cdiv(H, FP8_BLOCK)
    xf = _as_f32("x", x_TH)
    xg = torch.nn.functional.pad(xf, (0, G * FP8_BLOCK - H)).view(T, G, FP8_BLOCK)
    scale = _fp8_scale(xg.abs().amax(dim=-1))                       # [T, G]
    q = _to_fp8(xg / scale[..., None]).view(T, G * FP8_BLOCK)[:, :H].contiguous()
    return q, scale.contiguous()


def dequantize_act_fp8(q_TH: torch.Tensor, scale_TG: torch.Tensor, *,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` per token per 128 channels: the inverse of ``quantize_act_fp8``.

    Args:
        q_TH: [T, H] float8_e4m3fn.
        scale_TG: [T, ceil(H/128)] fp32, finite.
        out_dtype: dtype of the result (the product is formed in fp32).

    Returns:
        [T, H] in ``out_dtype``.
    """
    _check("q", q_TH, ndims=(2,), dtypes=(torch.float8_e4m3fn,))
    _check("scale", scale_TG, ndims=(2,), dtypes=(torch.float32,))
    T, H = q_TH.shape
    G = _cdiv(H, FP8_BLOCK)
    if tuple(scale_TG.shape) != (T, G):
        raise ValueError(f"scale must have shape (T, ceil(H/128)) = {(T, G)} for q of shape "
                         f"{tuple(q_TH.shape)}, got {tuple(scale_TG.shape)}")
    s = scale_TG.repeat_interleave(FP8_BLOCK, dim=1)[:, :H]
    return (q_TH.to(torch.float32) * s).to(out_dtype)


def fake_quant_act_fp8(x_TH: torch.Tensor) -> torch.Tensor:
    """``dequantize_act_fp8(*quantize_act_fp8(x))`` in fp32: what the fp8 bytes of x carry."""
    return dequantize_act_fp8(*quantize_act_fp8(x_TH))


# ---- FP8 weights, 128x128 blocks ------------------------------------------------------------

def quantize_weight_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to fp8 e4m3 with one fp32 ``scale_inv`` per 128x128 block.

    Args:
        w: [N, K] or [E, N, K] bf16/fp16/fp32/fp64, finite (nn.Linear layout: N outputs,
            K inputs). N and K need not be multiples of 128 (partial last blocks).

    Returns:
        (q, scale_inv): q float8_e4m3fn of w's shape; scale_inv fp32
        [(E,) ceil(N/128), ceil(K/128)], ``scale_inv = max(amax_block / 448, 2**-126)``, so that
        ``w ~= q * scale_inv[block]`` (the DeepSeek-V3 checkpoint convention).
    """
    _check("w", w, ndims=(2, 3), dtypes=_FLOAT_IN, finite=False)
    squeeze = w.dim() == 2
    wf = _as_f32("w", w)
    if squeeze:
        wf = wf[None]
    E, N, K = wf.shape
    if N == 0 or K == 0:
        raise ValueError(f"w must have non-empty rows and columns, got shape {tuple(w.shape)}")
    nb, kb = _cdiv(N, FP8_BLOCK), _cdiv(K, FP8_BLOCK)
    wb = _pad_last2(wf, nb * FP8_BLOCK, kb * FP8_BLOCK).view(E, nb, FP8_BLOCK, kb, FP8_BLOCK)
    scale_inv = _fp8_scale(wb.abs().amax(dim=(2, 4)))              # [E, nb, kb]
    q = _to_fp8(wb / scale_inv[:, :, None, :, None])
    q = q.view(E, nb * FP8_BLOCK, kb * FP8_BLOCK)[:, :N, :K].contiguous()
    if squeeze:
        return q[0], scale_inv[0].contiguous()
    return q, scale_inv.contiguous()


def _expand_blocks(scale: torch.Tensor, n: int, k: int, block_n: int, block_k: int
                   ) -> torch.Tensor:
    return scale.repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)[..., :n, :k]


def dequantize_weight_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, *,
                                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` per 128x128 block (DeepSeek-V3 ``weight_dequant``).

    Args:
        q: [N, K] or [E, N, K] float8_e4m3fn (no NaN codes).
        scale_inv: fp32 [(E,) ceil(N/128), ceil(K/128)], finite.
        out_dtype: dtype of the result (the product is formed in fp32).

    Returns:
        The weight, shape of q, in ``out_dtype``.
    """
    _check("q", q, ndims=(2, 3), dtypes=(torch.float8_e4m3fn,))
    _check("scale_inv", scale_inv, ndims=(q.dim(),), dtypes=(torch.float32,))
    N, K = q.shape[-2:]
    want = (*q.shape[:-2], _cdiv(N, FP8_BLOCK), _cdiv(K, FP8_BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv must have shape {want} (one scale per 128x128 block, "
                         f"ceil-div) for q of shape {tuple(q.shape)}, got "
                         f"{tuple(scale_inv.shape)}")
    s = _expand_blocks(scale_inv, N, K, FP8_BLOCK, FP8_BLOCK)
    return (q.to(torch.float32) * s).to(out_dtype)


def _check_expert_pair(w13: torch.Tensor, w2: torch.Tensor, *, dtypes: Sequence[torch.dtype]
                       ) -> tuple[int, int, int]:
    _check("w13", w13, ndims=(3,), dtypes=dtypes)
    _check("w2", w2, ndims=(3,), dtypes=dtypes)
    E, two_i, H = w13.shape
    if two_i % 2 or two_i == 0 or H == 0:
        raise ValueError(f"w13 must have shape (E, 2I, H) with I, H >= 1, got {tuple(w13.shape)}")
    I = two_i // 2
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w2 must have shape (E, H, I) = {(E, H, I)} to match w13 "
                         f"{tuple(w13.shape)}, got {tuple(w2.shape)}")
    return E, I, H


def convert_expert_weights_fp8(w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor
                               ) -> dict[str, torch.Tensor]:
    """Quantize bf16 expert weights to our fp8 layout (the DeepSeek-V3 block format).

    Args:
        w13_E2IH: [E, 2I, H] float (gate rows 0..I-1, up rows I..2I-1); I a multiple of 128 so
            that no 128-row block holds both gate and up rows.
        w2_EHI: [E, H, I] float.

    Returns:
        ``{"w13": [E, 2I, H] fp8, "w13_scale_inv": [E, 2I/128, ceil(H/128)] fp32,
        "w2": [E, H, I] fp8, "w2_scale_inv": [E, ceil(H/128), I/128] fp32}``, each weight
        ``~= q * scale_inv[block]``. Quantizing gate and up separately gives the same bytes.
    """
    E, I, H = _check_expert_pair(w13_E2IH, w2_EHI, dtypes=_FLOAT_IN)
    if I % FP8_BLOCK:
        raise ValueError(f"the intermediate size I must be a multiple of {FP8_BLOCK} (gate and up "
                         f"rows must not share a 128-row scale block), got I={I}")
    w13_q, w13_s = quantize_weight_fp8_blocks(w13_E2IH)
    w2_q, w2_s = quantize_weight_fp8_blocks(w2_EHI)
    return {"w13": w13_q, "w13_scale_inv": w13_s, "w2": w2_q, "w2_scale_inv": w2_s}


def load_deepseek_v3_expert(state_dict: Mapping[str, torch.Tensor], *, prefix: str, expert: int,
                            key_format: str = DSV3_EXPERT_KEY) -> dict[str, torch.Tensor]:
    """One routed expert of a DeepSeek-V3/R1 fp8 checkpoint, in our layout.

    Reads the six tensors ``{prefix}.experts.{expert}.{gate_proj,up_proj,down_proj}.{weight,
    weight_scale_inv}`` (the Hugging Face checkpoint names, e.g. prefix
    ``"model.layers.3.mlp"``; another naming: pass ``key_format`` with the fields prefix,
    expert, proj, param). Checkpoint shapes: gate/up weight [I, H] float8_e4m3fn with
    weight_scale_inv [I/128, ceil(H/128)] fp32; down weight [H, I] with
    [ceil(H/128), I/128]. The checkpoint's scales are used as stored (no re-quantization).

    Args:
        state_dict: any mapping from key to tensor (a dict, or a lazy mapping over safetensors
            files); only the six keys are read.
        prefix: the MLP module's name, without a trailing dot.
        expert: the expert's global index.

    Returns:
        ``{"w13": [2I, H] fp8, "w13_scale_inv": [2I/128, ceil(H/128)] fp32,
        "w2": [H, I] fp8, "w2_scale_inv": [ceil(H/128), I/128] fp32}``.
    """
    if isinstance(expert, bool) or not isinstance(expert, int) or expert < 0:
        raise ValueError(f"expert must be a non-negative int, got {expert!r}")

    def get(proj: str, param: str) -> torch.Tensor:
        key = key_format.format(prefix=prefix, expert=expert, proj=proj, param=param)
        if key not in state_dict:
            raise ValueError(f"checkpoint has no tensor {key!r} (prefix={prefix!r}, "
                             f"expert={expert}, key_format={key_format!r})")
        return state_dict[key]

    t = {(p, q): get(p, q) for p in ("gate_proj", "up_proj", "down_proj")
         for q in ("weight", "weight_scale_inv")}
    for (p, q), v in t.items():
        if q == "weight":
            _check(f"{p}.weight", v, ndims=(2,), dtypes=(torch.float8_e4m3fn,))
        else:
            _check(f"{p}.weight_scale_inv", v, ndims=(2,), dtypes=(torch.float32,))
    I, H = t["gate_proj", "weight"].shape
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    for p, (n, k) in shapes.items():
        w, s = t[p, "weight"], t[p, "weight_scale_inv"]
        if tuple(w.shape) != (n, k):
            raise ValueError(f"{p}.weight must have shape {(n, k)} (gate_proj is {(I, H)}), "
                             f"got {tuple(w.shape)}")
        want = (_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))
        if tuple(s.shape) != want:
            raise ValueError(f"{p}.weight_scale_inv must have shape {want} for a weight of "
                             f"shape {(n, k)}, got {tuple(s.shape)}")
    if I % FP8_BLOCK:
        raise ValueError(f"the intermediate size I must be a multiple of {FP8_BLOCK} to stack "
                         f"gate and up blocks into w13, got I={I}")
    return {
        "w13": torch.cat([t["gate_proj", "weight"], t["up_proj", "weight"]]).contiguous(),
        "w13_scale_inv": torch.cat([t["gate_proj", "weight_scale_inv"],
                                    t["up_proj", "weight_scale_inv"]]).contiguous(),
        "w2": t["down_proj", "weight"].contiguous(),
        "w2_scale_inv": t["down_proj", "weight_scale_inv"].contiguous(),
    }


def load_deepseek_v3_experts(state_dict: Mapping[str, torch.Tensor], *, prefix: str,
                             experts: Sequence[int], key_format: str = DSV3_EXPERT_KEY
                             ) -> dict[str, torch.Tensor]:
    """``load_deepseek_v3_expert`` for several experts (e.g. one rank's), stacked on a new
    leading dimension E in the order given: the layout of ``convert_expert_weights_fp8``."""
    experts = list(experts)
    if not experts:
        raise ValueError("experts must name at least one expert")
    ones = [load_deepseek_v3_expert(state_dict, prefix=prefix, expert=e, key_format=key_format)
            for e in experts]
    for e, one in zip(experts[1:], ones[1:]):
        if one["w13"].shape != ones[0]["w13"].shape:
            raise ValueError(f"expert {e} has w13 of shape {tuple(one['w13'].shape)}, expert "
                             f"{experts[0]} {tuple(ones[0]['w13'].shape)}")
    return {k: torch.stack([o[k] for o in ones]) for k in ones[0]}


# ---- MXFP4 weights --------------------------------------------------------------------------

def _e2m1_encode(a: torch.Tensor) -> torch.Tensor:
    """Magnitude index 0..7 of |values| a >= 0 (fp32), nearest with ties to the even index,
    saturating at 6."""
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=a.device)
    lo = torch.bucketize(a, mids, right=False)      # ties -> lower index
    hi = torch.bucketize(a, mids, right=True)       # ties -> upper index
    return torch.where(lo % 2 == 0, lo, hi).to(torch.uint8)


def quantize_weight_mxfp4(w: torch.Tensor, *, scale_rounding: str = "floor"
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight to MXFP4 along K (its last, reduction dimension).

    Args:
        w: [N, K] or [E, N, K] bf16/fp16/fp32/fp64, finite, K a multiple of 32.
        scale_rounding: "floor" (OCP: shared exponent floor(log2(amax)) - 2; the block's
            largest elements may saturate at 6) or "ceil" (smallest power of two with
            amax / scale <= 6: no saturation).

    Returns:
        (packed [(E,) N, K/2] uint8: element 2j in the low nibble of byte j, 2j+1 in the high;
        scales [(E,) N, K/32] uint8 E8M0 codes, scale = 2**(code - 127)).
    """
    _check("w", w, ndims=(2, 3), dtypes=_FLOAT_IN, finite=False)
    if scale_rounding not in ("floor", "ceil"):
        raise ValueError(f"scale_rounding must be 'floor' or 'ceil', got {scale_rounding!r}")
    N, K = w.shape[-2:]
    if K == 0 or K % MXFP4_BLOCK or N == 0:
        raise ValueError(f"w's last dimension K must be a positive multiple of {MXFP4_BLOCK} "
                         f"(one scale per 32 elements) and N >= 1, got shape {tuple(w.shape)}")
    wf = _as_f32("w", w).reshape(*w.shape[:-1], K // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = wf.abs().amax(dim=-1)
    # floor(log2(amax)) exactly, subnormals included: amax = m * 2**e with m in [0.5, 1).
    _, e = torch.frexp(amax)
    exp = e.to(torch.int32) - 1 - 2
    if scale_rounding == "ceil":
        over = torch.ldexp(amax, -exp.float()) > E2M1_VALUES[-1]     # amax / 2**exp in [4, 8)
        exp = exp + over.to(torch.int32)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    scaled = torch.ldexp(wf, -exp[..., None].float())                 # exact: power of two
    code = _e2m1_encode(scaled.abs()) | (torch.signbit(scaled).to(torch.uint8) << 3)
    code = code.reshape(*w.shape[:-1], K)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous()
    return packed, (exp + 127).to(torch.uint8).contiguous()


def dequantize_weight_mxfp4(packed: torch.Tensor, scales: torch.Tensor, *,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode MXFP4: the inverse of ``quantize_weight_mxfp4`` (exact in fp32).

    Args:
        packed: [(E,) N, K/2] uint8, element 2j in the low nibble of byte j.
        scales: [(E,) N, K/32] uint8 E8M0 codes (255, the NaN code, raises).
        out_dtype: dtype of the result.

    Returns:
        [(E,) N, K] in ``out_dtype``.
    """
    _check("packed", packed, ndims=(2, 3), dtypes=(torch.uint8,))
    _check("scales", scales, ndims=(packed.dim(),), dtypes=(torch.uint8,))
    half = packed.shape[-1]
    want = (*packed.shape[:-1], (2 * half) // MXFP4_BLOCK)
    if (2 * half) % MXFP4_BLOCK or tuple(scales.shape) != want:
        raise ValueError(f"scales must have shape {want} (one per 32 elements) for packed of "
                         f"shape {tuple(packed.shape)} (K = 2 * {half}, a multiple of 32), got "
                         f"{tuple(scales.shape)}")
    if scales.numel() and bool((scales == 255).any()):
        raise ValueError("scales contains the E8M0 NaN code 255")
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                       device=packed.device)
    code = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * half)
    vals = lut[code.long()]
    exp = (scales.to(torch.int32) - 127).repeat_interleave(MXFP4_BLOCK, dim=-1)
    return torch.ldexp(vals, exp.float()).to(out_dtype)


def convert_expert_weights_mxfp4(w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, *,
                                 scale_rounding: str = "floor") -> dict[str, torch.Tensor]:
    """Quantize expert weights to MXFP4 along each GEMM's K (H for w13, I for w2).

    Returns:
        ``{"w13": [E, 2I, H/2] uint8, "w13_scale": [E, 2I, H/32] uint8,
        "w2": [E, H, I/2] uint8, "w2_scale": [E, H, I/32] uint8}`` (H and I multiples of 32).
    """
    _check_expert_pair(w13_E2IH, w2_EHI, dtypes=_FLOAT_IN)
    w13_q, w13_s = quantize_weight_mxfp4(w13_E2IH, scale_rounding=scale_rounding)
    w2_q, w2_s = quantize_weight_mxfp4(w2_EHI, scale_rounding=scale_rounding)
    return {"w13": w13_q, "w13_scale": w13_s, "w2": w2_q, "w2_scale": w2_s}


# ---- the reference's weight path ------------------------------------------------------------

def fake_quant_expert_weights(w13: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                              w2: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
                              mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 weights a quantized layer really multiplies by.

    Args:
        w13, w2: either float tensors [E, 2I, H] / [E, H, I] (quantized here: fp8 blocks via
            ``convert_expert_weights_fp8``, MXFP4 via ``convert_expert_weights_mxfp4``), or
            pre-quantized pairs: ``(q, scale_inv)`` for mode "fp8", ``(packed, scales)`` for
            "fp4w" (e.g. from ``load_deepseek_v3_experts``), used as given.
        mode: "fp8" or "fp4w".

    Returns:
        (w13 [E, 2I, H] fp32, w2 [E, H, I] fp32), dequantized.
    """
    if mode not in ("fp8", "fp4w"):
        raise ValueError(f"mode must be 'fp8' or 'fp4w', got {mode!r}")
    given = [isinstance(w, (tuple, list)) for w in (w13, w2)]
    if given[0] != given[1]:
        raise ValueError("w13 and w2 must both be float tensors or both pre-quantized pairs")
    if given[0]:
        for name, w in (("w13", w13), ("w2", w2)):
            if len(w) != 2:
                raise ValueError(f"a pre-quantized {name} must be a pair (values, scales), got "
                                 f"{len(w)} items")
        deq = dequantize_weight_fp8_blocks if mode == "fp8" else dequantize_weight_mxfp4
        w13f, w2f = deq(*w13), deq(*w2)
        for name, w in (("w13", w13f), ("w2", w2f)):
            if w.dim() != 3:
                raise ValueError(f"pre-quantized {name} must be 3-D [E, N, K], got shape "
                                 f"{tuple(w.shape)}")
        E, I, H = _check_expert_pair(w13f, w2f, dtypes=(torch.float32,))
        if mode == "fp8" and I % FP8_BLOCK:
            raise ValueError(f"the intermediate size I must be a multiple of {FP8_BLOCK}, got "
                             f"I={I}")
        return w13f, w2f
    if mode == "fp8":
        d = convert_expert_weights_fp8(w13, w2)
        return (dequantize_weight_fp8_blocks(d["w13"], d["w13_scale_inv"]),
                dequantize_weight_fp8_blocks(d["w2"], d["w2_scale_inv"]))
    d = convert_expert_weights_mxfp4(w13, w2)
    return (dequantize_weight_mxfp4(d["w13"], d["w13_scale"]),
            dequantize_weight_mxfp4(d["w2"], d["w2_scale"]))
