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


def _gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_blocks, bs, H, D] + the request's blocks -> its first seq_len slots [seq_len, H, D]."""
    block_size = cache.shape[1]
    n = (seq_len + block_size - 1) // block_size
    return cache[block_table[:n].long()].flatten(0, 1)[:seq_len]


def unified_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole (paged) context.

    Query row i of request r sits at absolute position ``context_len + i`` where
    ``context_len = seq_len - query_len``; it sees keys at positions ``<= context_len + i``.
    Softmax is computed in fp32.
    """
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]

    # Decode rows (one query token each) are batched into one padded matmul; prefill and
    # mixed chunks are done one request at a time (their shapes differ).
    decode = [i for i, q in enumerate(query_lens) if q == 1]
    if decode:
        _decode_batch(query, key_cache, value_cache, block_tables, qsl, lens, decode, scale, group, out)
    for i, q_len in enumerate(query_lens):
        if q_len <= 1:
            continue
        s, e, seq_len = qsl[i], qsl[i + 1], lens[i]
        k = _gather(key_cache, block_tables[i], seq_len).float()
        v = _gather(value_cache, block_tables[i], seq_len).float()
        q = query[s:e].float()
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        ctx = seq_len - q_len
        mask = torch.arange(seq_len)[None, :] <= (ctx + torch.arange(q_len))[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
        )
        out[s:e] = o.transpose(0, 1).to(out.dtype)
    return out


def _decode_batch(query, key_cache, value_cache, block_tables, qsl, lens, rows, scale, group, out):
    block_size = key_cache.shape[1]
    idx = torch.tensor(rows)
    tok = torch.tensor([qsl[i] for i in rows])
    seq = torch.tensor([lens[i] for i in rows])
    max_len = int(seq.max())
    n_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[idx, :n_blocks].long()
    k = key_cache[tables].flatten(1, 2)[:, :max_len].float()  # [B, L, Hkv, D]
    v = value_cache[tables].flatten(1, 2)[:, :max_len].float()
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    q = query[tok].float()  # [B, Hq, D]
    mask = torch.arange(max_len)[None, :] < seq[:, None]  # [B, L]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        k.transpose(1, 2),  # [B, Hq, L, D]
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    out[tok] = o.squeeze(2).to(out.dtype)
