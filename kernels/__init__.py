"""Paged-attention kernels (Triton) with PyTorch references and launch instrumentation.

This package knows nothing of the engine. ``kernels._env`` is imported first: it turns on the
Triton interpreter when there is no GPU, which must happen before any kernel is decorated.
"""
# isort: off
from kernels._env import INTERPRETED  # first: it turns the Triton interpreter on
# isort: on
from kernels import instrument
from kernels.access import access_map
from kernels.config import AttentionConfig, CacheConfig, choose_cache_config, choose_config
from kernels.reference import rejection_sample_ref, reshape_and_cache_ref, unified_attention_ref
from kernels.rejection_sample import rejection_sample
from kernels.reshape_and_cache import reshape_and_cache
from kernels.unified_attention import unified_attention

__all__ = [
    "access_map",
    "INTERPRETED",
    "AttentionConfig",
    "CacheConfig",
    "choose_cache_config",
    "choose_config",
    "instrument",
    "rejection_sample",
    "rejection_sample_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "unified_attention",
    "unified_attention_ref",
]
