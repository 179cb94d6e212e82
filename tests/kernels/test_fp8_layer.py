"""The quantized layers (MoEConfig(dtype="fp8"), and dtype="fp4w": the same fp8 tokens with
MXFP4 weights) on R virtual ranks: on the CPU under Triton's interpreter, on a GPU (marked gpu)
where there is one.

Routing-level invariants are checked separately from numerics:
- publish: each rank's published row holds exactly ``quant.quantize_act_fp8``'s bytes (e4m3
  values, then the fp32 scales);
- dispatch: every pick of a local expert finds the byte-identical published row of its source
  token in the pool (rows are random, so a misplaced row cannot match), once per pick;
- the layer: against the quantization-aware reference (``moe_forward(..., quant="fp8")`` or
  ``quant="fp4w"``, the same bytes) within the written tolerance, every output row written
  (outputs poisoned with NaN), tokens with only -1 picks exactly zero.
"""
from __future__ import annotations

import pytest
import torch

from moestream import MoEConfig
from moestream import staged
from moestream.tuning import FP8_L2_TILE_MIN_I, L1, L2, Tuning
from conftest import hopper
from moestream.buffer import SymmBuffer
from moestream.layer import mega_moe_virtual
from moestream.quant import quantize_act_fp8
from moestream.reference import moe_forward_ranks
from moestream.testing import (TOLERANCE, make_routing, make_tokens, make_weights,
                               quantize_weights, rel_error)

from conftest import KERNEL_DEVICES

TOL = TOLERANCE["fp8"]
FP8 = torch.float8_e4m3fn


def fp8_config(**kw) -> MoEConfig:
    base = dict(hidden=256, intermediate=256, num_experts=8, top_k=2, max_tokens_per_rank=24,
                block_m=16, dtype="fp8")
    return MoEConfig(**{**base, **kw})


def make_case(cfg, Ts, gen, device, *, drop=0.0, routing=None):
    R = len(Ts)
    w13s, w2s = make_weights(cfg, R, generator=gen)
    w13q, w2q = quantize_weights(w13s, w2s, fmt=cfg.dtype)
    xs, idxs, ws = [], [], []
    for r, T in enumerate(Ts):
        x = make_tokens(T, cfg.hidden, generator=gen)
        idx, w = make_routing(T, cfg.num_experts, cfg.top_k, generator=gen, drop=drop)
        if routing is not None:
            idx = routing(r, T).to(torch.int32)
        xs.append(x.to(device))
        idxs.append(idx.to(device))
        ws.append(w.to(device))
    to = (lambda pairs: [(q.to(device), s.to(device)) for q, s in pairs])
    return xs, idxs, ws, to(w13q), to(w2q)


def split_rows(rows_u8: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte rows [N, token_bytes] -> (values [N, H] e4m3, scales [N, H/128] fp32); the row's
    remaining bytes are padding to 16."""
    return (rows_u8[:, :hidden].contiguous().view(FP8),
            rows_u8[:, hidden:hidden + 4 * (hidden // 128)].contiguous().view(torch.float32))


def poison(buffer: SymmBuffer) -> None:
    for lr in range(buffer.local_ranks):
        for name in ("pool_x", "pool_act"):
            buffer.view(name, lr).fill_(0x7F)          # e4m3 NaN bytes (and NaN scales)
        buffer.view("combine_y", lr).fill_(float("nan"))
        buffer.view("pool_weight", lr).fill_(float("nan"))


def check_fp8_layer(ys, xs, idxs, ws, w13q, w2q, *, hidden, label="", quant="fp8"):
    refs = moe_forward_ranks([x.cpu() for x in xs], [i.cpu() for i in idxs],
                             [w.cpu() for w in ws], [(q.cpu(), s.cpu()) for q, s in w13q],
                             [(q.cpu(), s.cpu()) for q, s in w2q], quant=quant,
                             compute_dtype=torch.float64)
    for r, (y, x) in enumerate(zip(ys, xs)):
        assert y.shape == (x.shape[0], hidden), (label, r)
        assert not torch.isnan(y).any(), f"{label} rank {r}: output rows left unwritten"
        if x.shape[0] and refs[r].norm() > 0:
            err = rel_error(y.cpu(), refs[r])
            assert err < TOL, f"{label} rank {r}: rel error {err:.2e} >= {TOL}"
        assert bool((y[(idxs[r] < 0).all(dim=1)] == 0).all()), (label, r)


def test_layout_packs_values_and_scales_in_one_row():
    # the byte rows: H e4m3 values, H/128 fp32 scales, padding to a multiple of 16 bytes
    cfg = fp8_config(hidden=384, intermediate=256)
    assert cfg.token_bytes == 384 + 4 * 3 + 4 and cfg.act_bytes == 256 + 4 * 2 + 8   # 16-B rows
    assert cfg.bytes_per_element == 1
    buf = SymmBuffer(cfg, num_ranks=2, device="cpu")
    assert buf.view("x").shape == (2, cfg.max_tokens_per_rank, cfg.token_bytes)
    assert buf.view("pool_x").dtype == torch.uint8
    assert buf.view("pool_act").shape[1] == cfg.act_bytes
    assert buf.view("combine_y").dtype == torch.bfloat16     # L2 rows stay bf16


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R, Ts, e_per_rank, hidden", [
    (1, [13], 5, 256),          # R=1; 5 experts per rank (prime-ish); T not a multiple of BM
    (2, [17, 0], 4, 384),       # a rank with zero tokens; H=384: the publish tile (512 wide)
                                # holds a masked 4th scale group that must not be stored
    (3, [5, 24, 1], 3, 256),    # T=1 on one rank, T=max on another
])
def test_publish_and_dispatch_move_the_quantized_bytes(device, gen, R, Ts, e_per_rank, hidden):
    cfg = fp8_config(hidden=hidden, num_experts=R * e_per_rank, top_k=min(3, R * e_per_rank))
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    poison(buf)
    xs, idxs, ws, _, _ = make_case(cfg, Ts, gen, device, drop=0.15)
    # scale groups the quantizer treats apart: all zeros (no division: scale 2**-126, zero
    # bytes, -0.0 kept) and tiny normal values (amax / 448 below 2**-126: the scale floor)
    big = max(range(R), key=lambda r: Ts[r])
    if Ts[big] >= 2:
        xs[big][0, :128] = 0.0
        xs[big][0, 1] = -0.0
        xs[big][1, 128:256] = 1e-36 * torch.linspace(-1, 1, 128, device=device).sign()
    for lr in range(R):
        staged.publish(buf, lr, xs[lr], idxs[lr], ws[lr])
    staged.layout(buf)
    staged.dispatch(buf)
    buf.check()

    published = []
    for r in range(R):
        par = int(buf.view("epoch", r)[0]) & 1
        rows = buf.view("x", r)[par, :Ts[r]].cpu()
        q, s = split_rows(rows, hidden)
        q_ref, s_ref = quantize_act_fp8(xs[r].cpu())
        # exact: the kernel divides with correct rounding and casts to nearest even
        assert torch.equal(s, s_ref), f"rank {r}: scales differ"
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), f"rank {r}: values"
        published.append(rows)

    e_loc = cfg.experts_per_rank(R)
    for dst in range(R):
        src_code = buf.view("pool_src", dst).cpu().long()
        count = int(buf.view("block_start", dst)[e_loc]) * cfg.block_m
        pool = buf.view("pool_x", dst).cpu()
        seen = set()
        for row in range(count):
            code = int(src_code[row])
            meta = int(buf.view("block_meta", dst)[row // cfg.block_m])
            if row % cfg.block_m >= meta & 511:
                continue                                        # padding row of a block
            s, tk = divmod(code, cfg.max_tokens_per_rank * cfg.top_k)
            t, k = divmod(tk, cfg.top_k)
            assert int(idxs[s][t, k]) // e_loc == dst, "row landed on the wrong rank"
            assert torch.equal(pool[row], published[s][t]), f"pool row {row} != ({s}, {t})"
            seen.add((s, t, k))
        want = {(s, t, k) for s in range(R) for t in range(Ts[s]) for k in range(cfg.top_k)
                if int(idxs[s][t, k]) >= 0 and int(idxs[s][t, k]) // e_loc == dst}
        assert seen == want, f"rank {dst}: picks missing or duplicated"


# the layer's edge cases (R, tokens per rank, experts per rank, share of -1 picks, routing,
# what it stresses), shared by the fp8 and the fp4w layer tests
EDGE_CASES = [
    (1, [1], 4, 0.0, None, "T=1, R=1"),
    (2, [19, 0], 3, 0.2, None, "rank with zero tokens, -1 picks, 3 experts per rank"),
    (2, [24, 11], 4, 0.0, lambda r, T: torch.stack([torch.full((T,), 5), torch.full((T,), 1)],
                                                   1), "all tokens to two experts; the "
                                                       "others receive none"),
    (3, [7, 24, 1], 5, 0.1, None, "3 ranks, 5 experts per rank, T not a multiple of BM"),
    (2, [6, 9], 4, 0.0, lambda r, T: torch.full((T, 2), -1), "every pick -1: y is exactly 0"),
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("impl, granularity", [("staged", "token"), ("fused", "token"),
                                               ("fused", 32)])   # 32: chunks of 2 m-blocks
@pytest.mark.parametrize("R, Ts, e_per_rank, drop, routing, label", EDGE_CASES)
def test_fp8_layer_matches_the_quantized_reference(device, gen, impl, granularity, R, Ts,
                                                    e_per_rank, drop, routing, label):
    cfg = fp8_config(num_experts=R * e_per_rank)
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    poison(buf)
    xs, idxs, ws, w13q, w2q = make_case(cfg, Ts, gen, device, drop=drop, routing=routing)
    out = torch.full((R, max(Ts), cfg.hidden), float("nan"), dtype=torch.bfloat16, device=device)
    ys = mega_moe_virtual(xs, idxs, ws, w13q, w2q, buf, out=out, impl=impl,
                          granularity=granularity)
    check_fp8_layer(ys, xs, idxs, ws, w13q, w2q, hidden=cfg.hidden, label=label)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fp8_consecutive_calls_with_changing_routing(device, gen):
    # three calls through one buffer (both parities, counters reset by the kernels), the
    # token counts and routing change between calls; L1 blocks 256 wide (two scale groups)
    cfg = fp8_config(num_experts=6, intermediate=512)
    buf = SymmBuffer(cfg, num_ranks=2, device=device)
    tuning = Tuning(l1=L1(block_n=256), l2=L2(block_n=64))
    for Ts in ([24, 3], [0, 17], [9, 9]):
        poison(buf)
        xs, idxs, ws, w13q, w2q = make_case(cfg, Ts, gen, device, drop=0.1)
        ys = mega_moe_virtual(xs, idxs, ws, w13q, w2q, buf, tuning=tuning)
        check_fp8_layer(ys, xs, idxs, ws, w13q, w2q, hidden=cfg.hidden, label=str(Ts))


def check_tuned_fp8_layer(cfg, Ts, tuning, gen, device, *, drop=0.1, routing=None,
                          impl="staged") -> SymmBuffer:
    """One fp8 call (``impl``) with ``tuning`` on len(Ts) virtual ranks against the quantized
    reference, buffer poisoned first (``routing`` as ``make_case`` takes it); returns the
    buffer (its scratch, for the split-K tests)."""
    buf = SymmBuffer(cfg, num_ranks=len(Ts), device=device)
    poison(buf)
    xs, idxs, ws, w13q, w2q = make_case(cfg, Ts, gen, device, drop=drop, routing=routing)
    ys = mega_moe_virtual(xs, idxs, ws, w13q, w2q, buf, tuning=tuning, impl=impl)
    check_fp8_layer(ys, xs, idxs, ws, w13q, w2q, hidden=cfg.hidden, label=str(tuning))
    return buf


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning", [
    Tuning(l2=L2(block_n=128, epilogue_split=2)),             # the GPU default's epilogue
    # quarters, flat loops
    Tuning(l2=L2(block_n=128, epilogue_split=4, flat=True), wait=False, programs=3),
], ids=["split2", "split4-flat"])
def test_fp8_l2_epilogue_pieces_and_flat_loops(device, gen, tuning):
    # the L2 tile stored in column pieces (and the flat tile loops) writes the same slots
    check_tuned_fp8_layer(fp8_config(num_experts=6), [19, 7], tuning, gen, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning", [
    Tuning(l2=L2(block_n=128, epilogue_split=2), use_tma=True),   # the GPU default's loads
    # 64-wide L2 tiles, flat
    Tuning(l1=L1(block_n=256), l2=L2(block_n=64, flat=True), use_tma=True, wait=False, programs=3),
    Tuning(l2=L2(block_n=128), use_tma=False),                       # pointer loads
    # the fp8 L1 (pointer loads) with its tickets in groups of 2 m-blocks, waits on
    Tuning(l2=L2(block_n=128), l1=L1(group_m=2), use_tma=False),
    # the GPU default from FP8_L2_TILE_MIN_I on (dsv3): the L2 as whole 128-row tiles, 8 warps
    hopper(128, "fp8", hidden=256, intermediate=FP8_L2_TILE_MIN_I),
], ids=["tma", "tma-l2n64-flat", "pointers", "pointers-l1-group2", "gpu-default-tile"])
def test_fp8_tensor_descriptor_and_pointer_loads(device, gen, tuning):
    # the staged fp8 L2 reads pool_act's byte rows (values, then scales: AB bytes per row)
    # and w2 through TMA descriptors or pointers: the same slots either way; R = 3 with T not
    # a multiple of BM and a rank with one token, so descriptor rows cross experts
    check_tuned_fp8_layer(fp8_config(num_experts=9), [21, 1, 12], tuning, gen, device)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning", [
    # the 64-row pieces by descriptor
    Tuning(l2=L2(split_m=2, warps=4, stages=3, block_n=128, epilogue_split=2), use_tma=True),
    # by pointers, flat loop
    Tuning(l2=L2(split_m=2, warps=4, flat=True), use_tma=False, wait=False, programs=3),
], ids=["tma", "pointers-flat"])
def test_fp8_l2_in_row_pieces(device, gen, tuning):
    # L2 tiles of half an m-block (block_m 32: pieces of 16 rows): two experts per rank get
    # ~30 rows each, so first pieces are full and second pieces partly filled or empty
    check_tuned_fp8_layer(fp8_config(num_experts=4, block_m=32, max_tokens_per_rank=40),
                          [37, 23], tuning, gen, device, drop=0.05)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("Ts, tuning", [
    # block_m 32: blocks of ~30 rows in one 32-row piece, rows by pointer, weights by
    # descriptor
    ([37, 23], Tuning(l2=L2(block_n=128, epilogue_split=2), decode_rows=16, use_tma=True)),
    # pointer loads, 256-wide L1 blocks (two scale groups per piece), T=1 on one rank
    ([1, 30], Tuning(l1=L1(block_n=256), decode_rows=16, use_tma=False, wait=False, programs=3)),
    # claimed GEMM tickets (tuning.select's default for decode on GPUs), 2 programs for the tiles
    ([37, 23], Tuning(l2=L2(block_n=128), decode_rows=16, use_tma=True, gemm_claim=True,
                      programs=2)),
], ids=["tma", "pointers-l1n256", "claimed"])
def test_fp8_decode_pieces(device, gen, Ts, tuning):
    # fp8 L1 (scales per K step, re-quantization of each piece's rows) and L2 with the
    # weight tile as the MMA row operand
    check_tuned_fp8_layer(fp8_config(num_experts=4, block_m=32, max_tokens_per_rank=40),
                          Ts, tuning, gen, device, drop=0.05)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("impl", ["staged", "fused"])
def test_fp8_decode_pieces_of_a_full_block(device, gen, impl):
    # block_m 64, two experts, top-2: ~57 rows per expert, so two 32-row pieces per m-block
    # (r0 = 32 for the second: its rows' scales and combine slots); T=3 on one rank. The
    # fused launch: each L2 block releases its rows after the second piece
    check_tuned_fp8_layer(fp8_config(num_experts=2, block_m=64, max_tokens_per_rank=64),
                          [61, 3], Tuning(l2=L2(block_n=128), decode_rows=16, use_tma=True),
                          gen, device, drop=0.05, impl=impl)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fp8_fused_launch_in_decode_pieces(device, gen):
    # the fused fp8 launch in decode pieces: T=1 on one rank (one 16-row piece per block),
    # ~30 rows per expert on the other side (32-row pieces), pointer loads, 256-wide L1
    # blocks (two scale groups per piece)
    check_tuned_fp8_layer(fp8_config(num_experts=4, block_m=32, max_tokens_per_rank=40),
                          [1, 30], Tuning(l1=L1(block_n=256), decode_rows=16, use_tma=False),
                          gen, device, drop=0.05, impl="fused")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning", [
    # the GPU default's L2 (64-row pieces by descriptor, here 16-row ones): expert 0's 5-row
    # tail is one piece and its empty second piece is skipped; expert 1's 20-row block
    # splits into a full piece and a 4-row tail piece at row 16
    Tuning(l1=L1(tail_rows=16), l2=L2(tail_rows=16, split_m=2, block_n=128, epilogue_split=2),
           use_tma=True),
    # pointer loads everywhere, whole 32-row L2 blocks, 256-wide L1 blocks
    Tuning(l1=L1(tail_rows=16, block_n=256), l2=L2(tail_rows=16), use_tma=False, wait=False,
           programs=3),
], ids=["tma-split", "pointers-l1n256"])
def test_fp8_tail_pieces(device, gen, tuning):
    # fp8 L1 tail pieces re-quantize their rows like the usual tile; exact per-expert counts
    # (test_kernels_virtual.TAIL_COUNTS) make sure both kinds of blocks occur
    from test_kernels_virtual import TAIL_TOKENS, tail_routing
    check_tuned_fp8_layer(fp8_config(num_experts=4, block_m=32, max_tokens_per_rank=40),
                          TAIL_TOKENS, tuning, gen, device, routing=tail_routing(gen))


def test_fp8_is_close_to_the_bf16_layer(gen):
    # what quantization costs against the unquantized reference (docs/quantization.md: ~6e-2
    # on random data); a scale applied twice or not at all would be far outside
    from moestream.testing import make_weights as mw
    cfg = fp8_config(num_experts=4)
    w13s, w2s = mw(cfg, 2, generator=gen)
    w13q, w2q = quantize_weights(w13s, w2s)
    xs = [make_tokens(T, cfg.hidden, generator=gen) for T in (20, 12)]
    rt = [make_routing(x.shape[0], 4, 2, generator=gen) for x in xs]
    buf = SymmBuffer(cfg, num_ranks=2, device="cpu")
    ys = mega_moe_virtual(xs, [r[0] for r in rt], [r[1] for r in rt], w13q, w2q, buf)
    ref = moe_forward_ranks(xs, [r[0] for r in rt], [r[1] for r in rt], w13s, w2s,
                            compute_dtype=torch.float64)
    for y, r in zip(ys, ref):
        assert 0.02 < rel_error(y, r) < 0.12


def test_fp8_input_errors(gen):
    cfg = fp8_config(num_experts=4)
    buf = SymmBuffer(cfg, num_ranks=2, device="cpu")
    xs, idxs, ws, w13q, w2q = make_case(cfg, [4, 4], gen, "cpu")
    w13s, w2s = make_weights(cfg, 2, generator=gen)
    with pytest.raises(ValueError, match="pair in fp8 mode"):
        mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf)                 # bf16 weights
    bad = [(q.to(torch.bfloat16), s) for q, s in w13q]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mega_moe_virtual(xs, idxs, ws, bad, w2q, buf)                  # values not e4m3
    bad = [(q, s[:, :1]) for q, s in w2q]
    with pytest.raises(ValueError, match="w2 scale_inv must have shape"):
        mega_moe_virtual(xs, idxs, ws, w13q, bad, buf)                 # scale blocks missing
    with pytest.raises(ValueError, match="L1.block_n 128 or 256"):
        mega_moe_virtual(xs, idxs, ws, w13q, w2q, buf, tuning=Tuning(l1=L1(block_n=64)))
    with pytest.raises(ValueError, match="dtype must be one of"):
        fp8_config(dtype="fp4")


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp4w"])
def test_megamoe_module_single_rank(gen, dtype):
    # the nn.Module on one rank (no process group): its own buffer and experts, random
    # parameters from reset_parameters (fp8: quantized to the block format), forward and
    # forward_logits against the reference on the module's own parameters
    from moestream import MegaMoE
    from moestream.reference import moe_forward, route
    cfg = fp8_config(num_experts=4, dtype=dtype)
    m = MegaMoE(cfg, device="cpu")
    m.reset_parameters(generator=gen)
    if dtype == "fp8":
        assert m.w13.dtype == FP8 and m.w13_scale_inv.shape == (4, 4, 2)
    elif dtype == "fp4w":   # e2m1 pairs and one E8M0 code per 32 along K
        assert m.w13.shape == (4, 512, 128) and m.w13_scale.shape == (4, 512, 8)
        assert m.w2.dtype == torch.uint8 and m.w2_scale.shape == (4, 256, 8)
    else:
        assert m.w13.dtype == torch.bfloat16 and not hasattr(m, "w13_scale_inv")
    x = make_tokens(11, cfg.hidden, generator=gen)
    logits = torch.randn(11, cfg.num_experts, generator=gen)
    w13, w2 = m.experts()
    quant = dtype
    idx, w = route(logits, cfg.top_k)
    ref = moe_forward(x, idx, w, w13, w2, quant=quant)
    y = m.forward_logits(x, logits)
    assert rel_error(y, ref) < TOLERANCE[dtype]
    assert torch.equal(m(x, idx, w), y)


# ---- fp4w: fp8 tokens, MXFP4 weights (kernels/gemm_fp4.py inside the staged L1 / L2) ----------

def check_tuned_fp4w_layer(cfg, Ts, tuning, gen, device, *, drop=0.1, routing=None,
                           label="", impl="staged") -> None:
    """One fp4w call with ``tuning`` (None: the policy's) on len(Ts) virtual ranks against
    moe_forward(..., quant="fp4w"), buffer and output poisoned first."""
    cfg = cfg.with_(dtype="fp4w")
    R = len(Ts)
    buf = SymmBuffer(cfg, num_ranks=R, device=device)
    poison(buf)
    xs, idxs, ws, w13q, w2q = make_case(cfg, Ts, gen, device, drop=drop, routing=routing)
    out = torch.full((R, max(Ts), cfg.hidden), float("nan"), dtype=torch.bfloat16, device=device)
    ys = mega_moe_virtual(xs, idxs, ws, w13q, w2q, buf, out=out, tuning=tuning, impl=impl)
    check_fp8_layer(ys, xs, idxs, ws, w13q, w2q, hidden=cfg.hidden, label=label or str(tuning),
                    quant="fp4w")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R, Ts, e_per_rank, drop, routing, label", EDGE_CASES)
def test_fp4w_layer_matches_the_quantized_reference(device, gen, R, Ts, e_per_rank, drop,
                                                     routing, label):
    # the default tuning: pieces of min(64, block_m) = 16 rows, one per m-block
    check_tuned_fp4w_layer(fp8_config(num_experts=R * e_per_rank), Ts, Tuning(), gen,
                           device, drop=drop, routing=routing, label=label)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("R, Ts, e_per_rank, drop, routing, label", EDGE_CASES)
def test_fp4w_fused_launch_matches_the_quantized_reference(device, gen, R, Ts, e_per_rank,
                                                           drop, routing, label):
    # the fused launch with the policy's tuning: the weights expanded to fp8 blocks, the fp8
    # GEMMs inside the one launch
    check_tuned_fp4w_layer(fp8_config(num_experts=R * e_per_rank), Ts, None, gen, device,
                           drop=drop, routing=routing, label=label, impl="fused")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("tuning", [
    # 16-row pieces of 64-row blocks (the decode form): a block's rows in up to four pieces,
    # the last one partly filled; the L2 pieces store into the combine slots by offset r0
    Tuning(fp4w_rows=16),
    # whole 64-row blocks, 256-wide L1 blocks (two scale groups)
    Tuning(l1=L1(block_n=256), l2=L2(block_n=64), fp4w_rows=64),
    # 32-row pieces, no waits, three programs walking the tiles
    Tuning(fp4w_rows=32, wait=False, programs=3),
    # L1 tickets in groups of 3 m-blocks (tuning.select's choice at mixtral dims), waits on
    Tuning(l1=L1(group_m=3), fp4w_rows=32),
    # claimed GEMM tickets (tuning.select's default for fp4w), 2 programs
    Tuning(fp4w_rows=16, gemm_claim=True, programs=2),
    # the weights expanded to fp8 blocks for the call, whole tiles of the fp8 GEMMs
    Tuning(fp4w_expand=True),
    # expanded, the fp8 decode pieces with the L1 split in four K parts, no waits
    Tuning(fp4w_expand=True, decode_rows=16, l1=L1(split_k=4), wait=False, programs=3),
], ids=["rows16", "rows64-l1n256-signal-rows", "rows32-nowait", "rows32-l1-group3",
        "rows16-claimed", "expand", "expand-decode16-split4"])
def test_fp4w_layer_in_row_pieces(device, gen, tuning):
    # block_m 64, two experts per rank, top-2: ~50 rows per expert
    check_tuned_fp4w_layer(fp8_config(num_experts=4, block_m=64, max_tokens_per_rank=56,
                                      intermediate=512), [53, 3], tuning, gen, device, drop=0.05)


def test_fp4w_input_errors(gen):
    cfg = fp8_config(num_experts=4, dtype="fp4w")
    buf = SymmBuffer(cfg, num_ranks=2, device="cpu")
    xs, idxs, ws, w13q, w2q = make_case(cfg, [4, 4], gen, "cpu")
    w13s, w2s = make_weights(cfg, 2, generator=gen)
    with pytest.raises(ValueError, match="pair in fp4w mode"):
        mega_moe_virtual(xs, idxs, ws, w13s, w2s, buf)                 # bf16 weights
    q8, _ = quantize_weights(w13s, w2s, fmt="fp8")
    with pytest.raises(ValueError, match="w13 packed must have shape"):
        mega_moe_virtual(xs, idxs, ws, q8, w2q, buf)                   # fp8 pairs
    bad = [(p, s.clone().fill_(254)) for p, s in w2q]
    with pytest.raises(ValueError, match="E8M0 codes above 253"):
        mega_moe_virtual(xs, idxs, ws, w13q, bad, buf)                 # validate=True reads codes
    odd = [(torch.zeros(p.numel() + 1, dtype=torch.uint8)[1:].view(p.shape), s) for p, s in w2q]
    with pytest.raises(ValueError, match="16-byte aligned"):
        mega_moe_virtual(xs, idxs, ws, w13q, odd, buf)
    epochs = [int(buf.view("epoch", r)[0]) for r in range(2)]
    with pytest.raises(ValueError, match="fp4w_expand=True"):   # the fused launch decodes none
        mega_moe_virtual(xs, idxs, ws, w13q, w2q, buf, impl="fused", tuning=Tuning())
    assert [int(buf.view("epoch", r)[0]) for r in range(2)] == epochs   # nothing launched
    with pytest.raises(ValueError, match="fp4w_rows"):
        Tuning(fp4w_rows=48)
    # a tuning the config rejects is a ValueError before the first launch, so the buffer
    # serves the next call
    cfg32 = fp8_config(num_experts=4, dtype="fp4w", block_m=32)
    buf32 = SymmBuffer(cfg32, num_ranks=2, device="cpu")
    xs, idxs, ws, w13q, w2q = make_case(cfg32, [4, 4], gen, "cpu")
    epochs = [int(buf32.view("epoch", r)[0]) for r in range(2)]
    with pytest.raises(ValueError, match="L1.block_n 128 or 256"):
        mega_moe_virtual(xs, idxs, ws, w13q, w2q, buf32,
                         tuning=Tuning(l1=L1(block_n=64), fp4w_rows=16))
    assert [int(buf32.view("epoch", r)[0]) for r in range(2)] == epochs   # nothing launched
    ys = mega_moe_virtual(xs, idxs, ws, w13q, w2q, buf32, tuning=Tuning(fp4w_rows=16))
    check_fp8_layer(ys, xs, idxs, ws, w13q, w2q, hidden=cfg32.hidden, quant="fp4w")
    with pytest.raises(ValueError, match="fmt must be 'fp8' or 'fp4w'"):
        quantize_weights(w13s, w2s, fmt="fp4")
