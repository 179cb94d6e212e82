"""Launch settings (``settings``) and the policy that picks them per call (``policy``)."""
from .policy import (DISPATCH_TILE8_PICKS, FP4W_EXPAND_MIN_ROWS, FP8_L2_TILE_MIN_I,
                     ONE_DOT_L1_STAGES, ONE_DOT_SHALLOW_MIN_HIDDEN, Device, combine_parts_for,
                     decode_rows_for, for_fused, fp4w_expands, fp8_l1_split_for,
                     fused_l2_group_for, fused_min_split,
                     gpu_defaults, in_decode_pieces, l1_group_m_for, mean_rows_per_expert,
                     one_dot_for, select, tail_rows_for)
from .settings import (CHUNK_TILE, EXPERT_CHUNK_BLOCKS, EXPERT_CHUNK_TOKENS, L1, L2, ONE_WAVE,
                       Copy, Fused, Tuning, check_granularity)

__all__ = ["Tuning", "L1", "L2", "Copy", "Fused", "Device", "select", "gpu_defaults",
           "in_decode_pieces", "for_fused", "mean_rows_per_expert", "decode_rows_for",
           "tail_rows_for", "one_dot_for", "fp8_l1_split_for", "l1_group_m_for",
           "fused_l2_group_for", "fused_min_split", "combine_parts_for", "ONE_DOT_L1_STAGES",
           "ONE_DOT_SHALLOW_MIN_HIDDEN", "FP8_L2_TILE_MIN_I", "DISPATCH_TILE8_PICKS",
           "FP4W_EXPAND_MIN_ROWS", "fp4w_expands",
           "CHUNK_TILE", "EXPERT_CHUNK_TOKENS", "EXPERT_CHUNK_BLOCKS", "ONE_WAVE",
           "check_granularity"]
