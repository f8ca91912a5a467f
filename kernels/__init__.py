"""Paged-attention kernels (Triton) with PyTorch references and launch instrumentation.

This package knows nothing of the engine.
"""
from kernels.reference import reshape_and_cache_ref, unified_attention_ref

__all__ = ["reshape_and_cache_ref", "unified_attention_ref"]
