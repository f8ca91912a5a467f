"""Paged-attention kernels (Triton) with PyTorch references and launch instrumentation.

This package knows nothing of the engine. ``kernels._env`` is imported first: it turns on the
Triton interpreter when there is no GPU, which must happen before any kernel is decorated.
"""
# isort: off
from kernels._env import INTERPRETED  # first: it turns the Triton interpreter on
# isort: on
from kernels import instrument
from kernels.access import access_map
from kernels.apply_token_bitmask import apply_token_bitmask
from kernels.block_table import PAD_SLOT_ID, compute_slot_mappings, gather_block_tables
from kernels.config import AttentionConfig, CacheConfig, choose_cache_config, choose_config
from kernels.fused_moe import fused_moe
from kernels.gumbel_sample import gumbel_sample
from kernels.input_batch import post_update, prepare_pos_seq_lens, prepare_prefill_inputs
from kernels.moe_align_block_size import moe_align_block_size
from kernels.reference import (
    apply_token_bitmask_ref,
    compute_slot_mappings_ref,
    fused_moe_ref,
    gather_block_tables_ref,
    gumbel_sample_ref,
    post_update_ref,
    prepare_pos_seq_lens_ref,
    prepare_prefill_inputs_ref,
    rand_ref,
    rejection_sample_ref,
    reshape_and_cache_ref,
    unified_attention_ref,
)
from kernels.rejection_sample import rejection_sample
from kernels.reshape_and_cache import reshape_and_cache
from kernels.unified_attention import unified_attention

__all__ = [
    "access_map",
    "apply_token_bitmask",
    "apply_token_bitmask_ref",
    "gumbel_sample",
    "gumbel_sample_ref",
    "INTERPRETED",
    "AttentionConfig",
    "CacheConfig",
    "choose_cache_config",
    "choose_config",
    "compute_slot_mappings",
    "compute_slot_mappings_ref",
    "fused_moe",
    "fused_moe_ref",
    "gather_block_tables",
    "gather_block_tables_ref",
    "instrument",
    "moe_align_block_size",
    "PAD_SLOT_ID",
    "post_update",
    "post_update_ref",
    "prepare_pos_seq_lens",
    "prepare_pos_seq_lens_ref",
    "prepare_prefill_inputs",
    "prepare_prefill_inputs_ref",
    "rand_ref",
    "rejection_sample",
    "rejection_sample_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "unified_attention",
    "unified_attention_ref",
]
