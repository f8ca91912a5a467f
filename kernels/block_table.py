"""Block-table kernels (Triton; vLLM 0.33's ``v1/worker/gpu/block_table.py``): a step's block
tables gathered from the worker's per-slot rows, and each token's slot in the paged KV cache.

``block_tables`` [max_num_reqs, max_num_blocks] int32 holds one row per request slot (logical
block -> physical block); ``idx_mapping`` [num_reqs] picks the batch's rows (a negative entry is
a padding row, which owns no blocks). slot = block_table[pos // block_size] * block_size +
pos % block_size; PAD_SLOT_ID (-1) marks a token whose key and value are written nowhere (the
cache write skips negative slots).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import instrument
from kernels._env import INTERPRETED
from kernels.input_batch import token_block

PAD_SLOT_ID = -1


@triton.jit
def _gather_block_tables_kernel(
    idx_mapping_ptr, src_block_tables_ptr, src_stride, num_blocks_ptr, dst_block_tables_ptr, dst_stride,
    num_reqs, width,
    BLOCK_SIZE: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    dst_row_ptr = dst_block_tables_ptr + batch_idx * dst_stride
    if batch_idx >= num_reqs:  # a padding row: the null block (0) throughout
        for i in range(0, width, BLOCK_SIZE):
            offset = i + tl.arange(0, BLOCK_SIZE)
            tl.store(dst_row_ptr + offset, 0, mask=offset < width)
        return
    req_idx = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
    num_blocks = tl.load(num_blocks_ptr + req_idx)
    src_row_ptr = src_block_tables_ptr + req_idx * src_stride
    for i in range(0, width, BLOCK_SIZE):
        offset = i + tl.arange(0, BLOCK_SIZE)
        block_ids = tl.load(src_row_ptr + offset, mask=offset < num_blocks, other=0)
        tl.store(dst_row_ptr + offset, block_ids, mask=offset < width)


def gather_block_tables(idx_mapping: torch.Tensor, block_tables: torch.Tensor, num_blocks: torch.Tensor,
                        out: torch.Tensor) -> None:
    """Triton version of :func:`kernels.reference.gather_block_tables_ref` (same arguments):
    out[i] = the first num_blocks[slot] entries of row i's slot, then 0 (the null block) to
    out's width; rows of out past num_reqs (padding) are all 0."""
    num_rows, width = out.shape
    if num_rows == 0 or width == 0:
        return
    block = triton.next_power_of_2(width) if INTERPRETED else 1024
    args = dict(idx_mapping_ptr=idx_mapping, src_block_tables_ptr=block_tables, src_stride=block_tables.stride(0),
                num_blocks_ptr=num_blocks, dst_block_tables_ptr=out, dst_stride=out.stride(0),
                num_reqs=idx_mapping.shape[0], width=width)
    instrument.launch("gather_block_tables", _gather_block_tables_kernel, (num_rows,), args, dict(BLOCK_SIZE=block),
                      reason=f"one program per batch row, {block} block-table entries per iteration")


@triton.jit
def _compute_slot_mappings_kernel(
    max_num_tokens, idx_mapping_ptr, query_start_loc_ptr, pos_ptr, block_tables_ptr, block_tables_stride,
    slot_mapping_ptr,
    KV_BLOCK_SIZE: tl.constexpr, PAD_ID: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    if batch_idx == tl.num_programs(0) - 1:  # the last program: the tokens past the batch's are padding
        num_tokens = tl.load(query_start_loc_ptr + batch_idx)
        for i in range(num_tokens, max_num_tokens, BLOCK_SIZE):
            offset = i + tl.arange(0, BLOCK_SIZE)
            tl.store(slot_mapping_ptr + offset, PAD_ID, mask=offset < max_num_tokens)
        return
    req_state_idx = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
    is_real_req = req_state_idx >= 0  # a padding row owns no blocks: PAD for its tokens
    start = tl.load(query_start_loc_ptr + batch_idx)
    end = tl.load(query_start_loc_ptr + batch_idx + 1)
    real_end = tl.where(is_real_req, end, start)  # the tokens whose blocks are read
    for i in range(start, end, BLOCK_SIZE):
        offset = i + tl.arange(0, BLOCK_SIZE)
        positions = tl.load(pos_ptr + offset, mask=offset < end, other=0)
        block_indices = positions // KV_BLOCK_SIZE
        block_numbers = tl.load(block_tables_ptr + req_state_idx * block_tables_stride + block_indices,
                                mask=offset < real_end, other=0).to(tl.int64)
        slot_ids = block_numbers * KV_BLOCK_SIZE + positions % KV_BLOCK_SIZE
        tl.store(slot_mapping_ptr + offset, tl.where(is_real_req, slot_ids, PAD_ID), mask=offset < end)


def compute_slot_mappings(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor,
                          block_tables: torch.Tensor, block_size: int, slot_mapping: torch.Tensor) -> None:
    """Triton version of :func:`kernels.reference.compute_slot_mappings_ref` (same arguments):
    slot_mapping[t] = block_tables[slot, pos // block_size] * block_size + pos % block_size for
    each token t of each row (``block_tables`` the per-slot rows, read through idx_mapping);
    PAD_SLOT_ID for a padding row's tokens and for slot_mapping's entries past the batch's tokens
    (from one extra program)."""
    num_reqs = idx_mapping.shape[0]
    block, reason = token_block(query_start_loc)
    args = dict(max_num_tokens=slot_mapping.shape[0], idx_mapping_ptr=idx_mapping, query_start_loc_ptr=query_start_loc,
                pos_ptr=positions, block_tables_ptr=block_tables, block_tables_stride=block_tables.stride(0),
                slot_mapping_ptr=slot_mapping)
    meta = dict(KV_BLOCK_SIZE=block_size, PAD_ID=PAD_SLOT_ID, BLOCK_SIZE=block)
    instrument.launch("compute_slot_mappings", _compute_slot_mappings_kernel, (num_reqs + 1,), args, meta,
                      reason=reason + "; one more program pads the rest with PAD_SLOT_ID")
