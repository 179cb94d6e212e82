"""Adapters that put moestream's expert-parallel layer into models from other libraries.

``moestream.integrations.transformers``: ``replace_moe_blocks(model)`` for Hugging Face
transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 models (docs/integrations.md).

Submodules are imported explicitly (``from moestream.integrations.transformers import ...``) so
that ``import moestream`` never needs the third-party library.
"""
