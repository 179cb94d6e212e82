"""Triton kernels only, one job per module; ``common`` first: it switches Triton to its
interpreter on a machine without CUDA before any kernel module imports Triton."""
from . import common  # noqa: F401
