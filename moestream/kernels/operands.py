"""Where a GEMM block's operands come from: a launch's rank, buffer and weights
(``gemm_context``, ``expert_weights``) and the tensor descriptors of the pool rows and the
weight tiles, for whole tiles and for decode pieces (the weights as the MMA's row side)."""
from __future__ import annotations

from .common import aligned_ptr_from, at, launch_context, peer_ptr, rank_base, tl, triton


@triton.jit
def gemm_context(table, rank0, off_epoch, off_diag, host_base, w_table, s_table,
                 off_block_start, off_block_meta, FP8: tl.constexpr, W4: tl.constexpr,
                 HOST_BASE: tl.constexpr):
    """What a staged GEMM program starts from: ``launch_context``'s six values, its rank's
    buffer address from the table (``here``, for every region but the next two), its local
    rank's weight pointers (``expert_weights``), and the block count and meta pointers, which
    take the host's address where HOST_BASE (``rank_base``: the first loads do not wait for
    the table's; only these two, see there)."""
    pid, nprog, lr, rank, epoch, diag = launch_context(table, rank0, off_epoch, off_diag)
    first = rank_base(table, rank, host_base, HOST_BASE)   # for the first loads only
    here = rank_base(table, rank, 0, False)
    w, w_s = expert_weights(w_table, s_table, lr, FP8, W4 > 0)
    return (pid, nprog, lr, rank, epoch, diag, here, w, w_s,
            at(first, off_block_start, tl.int32), at(first, off_block_meta, tl.int32))


@triton.jit
def expert_weights(w_table, s_table, index, FP8: tl.constexpr, W4: tl.constexpr = False):
    """(values, scale_inv) pointers of local rank ``index``'s experts: e4m3 values and fp32
    block scales (FP8; torch allocations, 16-byte aligned), MXFP4 packed pairs and E8M0 codes
    (W4, both uint8; 16-byte aligned, checks.check_expert_weights_fp4w), or bf16 values (the
    second pointer is the first, unused)."""
    if W4:
        w = aligned_ptr_from(w_table, index, tl.uint8)
        s = aligned_ptr_from(s_table, index, tl.uint8)
    elif FP8:
        w = aligned_ptr_from(w_table, index, tl.float8e4nv)
        s = aligned_ptr_from(s_table, index, tl.float32)
    else:
        w = tl.load(w_table + index).to(tl.int64).to(tl.pointer_type(tl.bfloat16))
        s = w
    return w, s


@triton.jit
def l1_descriptors(pool_x, w13, P, H, I, E_LOC, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, ONE_DOT: tl.constexpr = False):
    """Tensor descriptors (TMA) of L1's A rows [P, H] and weight tiles [E_LOC * 2I, H];
    ONE_DOT: weight tiles [2, BN, BK] of w13 seen as [E_LOC * 2, I, H] (a column block's gate
    and up rows in one load)."""
    a_desc = tl.make_tensor_descriptor(pool_x, shape=[P, H], strides=[H, 1], block_shape=[BM, BK])
    if ONE_DOT:
        w_desc = tl.make_tensor_descriptor(w13, shape=[E_LOC * 2, I, H], strides=[I * H, H, 1],
                                           block_shape=[2, BN, BK])
    else:
        w_desc = tl.make_tensor_descriptor(w13, shape=[E_LOC * 2 * I, H], strides=[H, 1],
                                           block_shape=[BN, BK])
    return a_desc, w_desc


@triton.jit
def l2_descriptors(pool_act, w2, P, H, I, E_LOC, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr):
    """Tensor descriptors of L2's A rows [P, I] and weight tiles [E_LOC * H, I]."""
    a_desc = tl.make_tensor_descriptor(pool_act, shape=[P, I], strides=[I, 1],
                                       block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w2, shape=[E_LOC * H, I], strides=[I, 1],
                                       block_shape=[BN, BK])
    return a_desc, w_desc


@triton.jit
def decode_descriptors(a, rows, cols, row_stride, w, w_rows, w_cols, BM: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, DM: tl.constexpr,
                       SECOND: tl.constexpr = 0):
    """Tensor descriptors of decode pieces: ((A [rows, cols] in DM-row tiles, the same in
    tiles of DECODE_WIDE rows, or of SECOND rows if given: tail pieces' full tiles), weights
    [w_rows, w_cols] in [BN, BK] tiles). ``row_stride`` in elements of A (bf16 rows, or the
    fp8 layer's byte rows)."""
    a_dm = tl.make_tensor_descriptor(a, shape=[rows, cols], strides=[row_stride, 1],
                                     block_shape=[DM, BK])
    WIDE: tl.constexpr = SECOND if SECOND > 0 else (32 if BM >= 32 else BM)   # DECODE_WIDE
    a_wide = tl.make_tensor_descriptor(a, shape=[rows, cols], strides=[row_stride, 1],
                                       block_shape=[WIDE, BK])
    w_desc = tl.make_tensor_descriptor(w, shape=[w_rows, w_cols], strides=[w_cols, 1],
                                       block_shape=[BN, BK])
    return (a_dm, a_wide), w_desc


@triton.jit
def pool_piece_descriptors(table, rank, off_a, a, P, cols, A_BYTES, w, w_rows, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, DM: tl.constexpr,
                           SECOND: tl.constexpr, FP8: tl.constexpr):
    """``decode_descriptors`` of a staged GEMM's pool rows [P, cols] (bf16 ``a``, or the fp8
    layer's byte rows of A_BYTES at ``off_a`` of this rank's buffer) and its weights
    [w_rows, cols]."""
    if FP8:
        descs = decode_descriptors(peer_ptr(table, rank, off_a, tl.float8e4nv), P, cols,
                                   A_BYTES, w, w_rows, cols, BM, BN, BK, DM, SECOND)
    else:
        descs = decode_descriptors(a, P, cols, cols, w, w_rows, cols, BM, BN, BK, DM, SECOND)
    return descs


@triton.jit
def weight_tile(w, SWAP: tl.constexpr):
    """A loaded weight tile [BN, BK] as the MMA operand: transposed to [BK, BN] for rows @ w^T,
    as loaded for the decode pieces' w @ rows^T (SWAP)."""
    if not SWAP:
        w = w.T
    return w
