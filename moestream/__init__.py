"""moestream: token-streaming expert-parallel MoE for Hopper GPUs, in Python and Triton."""
from .config import SHAPES, MoEConfig
from .regions import BufferLayout, bytes_per_rank, make_layout
from .reference import moe_forward, moe_forward_ranks, route
from .buffer import KernelStallError, SymmBuffer
from .layer import MegaMoE, mega_moe, mega_moe_virtual

__version__ = "0.1.0"
__all__ = ["MoEConfig", "SHAPES", "BufferLayout", "make_layout", "bytes_per_rank",
           "moe_forward", "moe_forward_ranks", "route", "SymmBuffer", "KernelStallError",
           "mega_moe", "mega_moe_virtual", "MegaMoE", "__version__"]
