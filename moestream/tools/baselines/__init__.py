"""Baselines the fused layer is measured against: the expert-parallel MoE layer built from
collectives and grouped GEMMs, the way it is built without DeepEP."""
from .torch_a2a import moe_forward_a2a

__all__ = ["moe_forward_a2a"]
