"""PyTorch reference implementations of the paged-attention kernels.

These define the semantics the Triton kernels must match, and they are also the engine's
``torch`` attention backend, so they are written to be reasonably fast on the CPU.

Layouts (vLLM v1):
  key, value            [num_tokens, num_kv_heads, head_size]       new K/V of this step
  key_cache, value_cache[num_blocks, block_size, num_kv_heads, head_size]
  slot_mapping          [num_tokens] int, slot = block * block_size + offset; < 0 = padding
  query                 [num_tokens, num_q_heads, head_size]        flattened new tokens
  query_start_loc       [num_seqs + 1] int32, request i owns query rows qsl[i]:qsl[i+1]
  seq_lens              [num_seqs] int32, context + new tokens of request i
  block_tables          [num_seqs, max_blocks] int32, logical -> physical block
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place)."""
    num_blocks, block_size = key_cache.shape[:2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    # A view of the cache as [num_slots, heads, head_size] makes the write one index_copy.
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:]).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:]).index_copy_(0, slots, value.to(value_cache.dtype))


@dataclass
class AttentionPlan:
    """Host-side indexing for one batch, shared by every layer of a step (same metadata)."""

    query_start_loc: list[int]
    seq_lens: list[int]
    decode_rows: torch.Tensor | None  # query rows of the requests with one new token
    decode_slots: torch.Tensor | None  # [n_decode * max_len] cache slots, padded with slot 0
    decode_mask: torch.Tensor | None  # [n_decode, max_len] True where the key exists
    prefill: list[tuple[int, int, torch.Tensor]]  # (first row, last row + 1, slots of its context)


def plan_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int) -> AttentionPlan:
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    tables = block_tables.long().cpu()
    decode = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    rows = slots = mask = None
    if decode:
        max_len = max(lens[i] for i in decode)
        pos = torch.arange(max_len)
        idx = torch.tensor(decode)
        seq = torch.tensor([lens[i] for i in decode])
        mask = pos[None, :] < seq[:, None]
        slots = (tables[idx][:, pos // block_size] * block_size + pos % block_size).masked_fill(~mask, 0)
        dev = block_tables.device
        rows, slots, mask = torch.tensor([qsl[i] for i in decode], device=dev), slots.flatten().to(dev), mask.to(dev)
    prefill = []
    for i in range(len(lens)):
        if qsl[i + 1] - qsl[i] > 1:
            pos = torch.arange(lens[i])
            prefill.append((qsl[i], qsl[i + 1],
                            (tables[i, pos // block_size] * block_size + pos % block_size).to(block_tables.device)))
    return AttentionPlan(qsl, lens, rows, slots, mask, prefill)


def unified_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole (paged) context.

    Query row i of request r sits at absolute position ``context_len + i`` where
    ``context_len = seq_len - query_len``; it sees keys at positions ``<= context_len + i``.
    Softmax is computed in fp32. ``plan`` (from ``plan_attention``) may be passed to reuse
    the indexing across layers.
    """
    num_tokens, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if plan is None:
        plan = plan_attention(query_start_loc, seq_lens, block_tables, block_size)
    # The cache viewed as one row per slot: gathering slots is one index_select (several
    # times faster than advanced indexing by block).
    k_slots = key_cache.view(num_blocks * block_size, num_kv_heads, head_size)
    v_slots = value_cache.view(num_blocks * block_size, num_kv_heads, head_size)

    # Decode rows (one query token each) are batched into one padded attention; prefill and
    # mixed chunks are done one request at a time (their shapes differ).
    if plan.decode_rows is not None:
        n, max_len = plan.decode_mask.shape
        k = k_slots.index_select(0, plan.decode_slots).view(n, max_len, num_kv_heads, head_size).float()
        v = v_slots.index_select(0, plan.decode_slots).view(n, max_len, num_kv_heads, head_size).float()
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        o = F.scaled_dot_product_attention(
            query[plan.decode_rows].float().unsqueeze(2),  # [n, Hq, 1, D]
            k.transpose(1, 2), v.transpose(1, 2),  # [n, Hq, L, D]
            attn_mask=plan.decode_mask[:, None, None, :], scale=scale)
        out[plan.decode_rows] = o.squeeze(2).to(out.dtype)
    for s, e, slots in plan.prefill:
        seq_len, q_len = slots.numel(), e - s
        k, v = k_slots.index_select(0, slots).float(), v_slots.index_select(0, slots).float()
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        ctx = seq_len - q_len
        mask = torch.arange(seq_len, device=query.device)[None, :] <= (ctx + torch.arange(q_len, device=query.device))[:, None]
        o = F.scaled_dot_product_attention(
            query[s:e].float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1).to(out.dtype)
    return out
