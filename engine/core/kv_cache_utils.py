"""The paged KV cache: per layer, one K and one V tensor of
``[num_blocks, block_size, num_kv_heads, head_size]``, sized from a memory budget. Only KV
heads are cached: with grouped-query attention (Llama 3 8B: 32 query heads, 8 KV heads) a block
is smaller by the group factor num_heads / num_kv_heads, and that many times more tokens fit in
the same memory (lesson 20 measures it). With tensor parallelism each rank holds the K/V of its
own KV heads (num_kv_heads / N of them) for every block: the block ids, and so the block
tables, are the same on every rank.

A hybrid model (sliding-window and full-attention layers) has several KV-cache groups
(engine/core/kv_cache_interface.py) of the same number of layers; layer j of every group shares
K/V tensor j, so a block holds the K/V of group_size layers, and the pool's blocks serve whichever
group takes them."""
from __future__ import annotations

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_MEMORY, CacheConfig
from engine.core.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    get_kv_cache_groups,
    num_tensors,
    tensor_of_layer,
)
from engine.gc_utils import free_dropped_engines
from engine.model_executor.model_loader import ModelArchConfig


def kv_cache_groups_of(model: ModelArchConfig, block_size: int) -> list[KVCacheGroupSpec]:
    """The model's layers grouped by KV-cache spec (each layer's sliding window, or full attention)."""
    windows = getattr(model, "layer_sliding_windows", None) or [None] * model.num_layers
    return get_kv_cache_groups([SlidingWindowSpec(block_size, w) if w else FullAttentionSpec(block_size)
                                for w in windows])


def hybrid_capacity(groups: list[KVCacheGroupSpec], num_blocks: int, max_model_len: int) -> dict:
    """For a hybrid model (more than one KV-cache group): each group's layers and window, and how many
    requests of max_model_len tokens the cache holds at once, against the same memory with full attention
    on every layer (one group of all the layers: blocks as many times larger as there are groups, and a
    full table each). {} for one group."""
    if len(groups) < 2:
        return {}
    block_size = groups[0].kv_cache_spec.block_size
    full = -(-max_model_len // block_size)
    per_request = sum(g.kv_cache_spec.max_memory_blocks(max_model_len) if g.kv_cache_spec.sliding_window else full
                      for g in groups)
    return {"kv_cache_groups": [{"layers": g.layer_ids, "sliding_window": g.kv_cache_spec.sliding_window}
                                for g in groups],
            "blocks_per_request": per_request, "requests_at_max_len": num_blocks // per_request,
            "requests_at_max_len_full_attention": num_blocks // (len(groups) * full)}


def bytes_per_block(model: ModelArchConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """K and V, one block, all the layers that share it (on one rank: its num_kv_heads / tp_size KV
    heads): every layer for a dense model, one group's for a hybrid one."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers = num_tensors(kv_cache_groups_of(model, block_size))
    return 2 * layers * block_size * (model.num_kv_heads // tp_size) * model.head_size * elem


def num_blocks_for(cache: CacheConfig, model: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                   tp_size: int = 1, draft: ModelArchConfig | None = None) -> tuple[int, str]:
    """How many blocks to allocate (on each rank, from each rank's budget), and a sentence saying why.
    With a draft model (speculative decoding) each block also holds the draft's keys and values."""
    per_block = bytes_per_block(model, cache.block_size, dtype, tp_size)
    if draft is not None:
        per_block += bytes_per_block(draft, cache.block_size, dtype)
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks, f"num_kv_blocks={cache.num_kv_blocks} set exactly"
    if cache.kv_cache_memory is not None:
        budget, why = cache.kv_cache_memory, f"kv_cache_memory={cache.kv_cache_memory} bytes"
    elif device.type == "cuda":
        free_dropped_engines()  # an LLM dropped without shutdown() still held its KV cache (on an H100: 76.9 GB)
        free, total = torch.cuda.mem_get_info(device)
        # Memory the allocator still holds but no tensor uses is ours to reuse: the driver counts
        # it as in use, we do not.
        used = total - free - (torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        budget = int(total * cache.gpu_memory_utilization) - used
        why = (f"gpu_memory_utilization={cache.gpu_memory_utilization} of {total} bytes, "
               f"{used} already in use")
    else:
        budget, why = DEFAULT_CPU_KV_CACHE_MEMORY, f"default CPU budget of {DEFAULT_CPU_KV_CACHE_MEMORY} bytes"
    n = budget // per_block
    if n < 2:  # block 0 is the null block: one more is the least a request can use
        raise ValueError(f"KV-cache budget too small: {why} holds fewer than 2 blocks of {per_block} bytes "
                         f"(block_size={cache.block_size}); raise kv_cache_memory or set num_kv_blocks")
    return n, f"{why} / {per_block} bytes per block"


def allocate_kv_cache(num_blocks: int, block_size: int, model: ModelArchConfig, dtype: torch.dtype,
                      device: torch.device, tp_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) tensors; layers of different KV-cache groups share them (see above)."""
    shape = (num_blocks, block_size, model.num_kv_heads // tp_size, model.head_size)
    groups = kv_cache_groups_of(model, block_size)
    tensors = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
               for _ in range(num_tensors(groups))]
    tensor = tensor_of_layer(groups)
    return [tensors[tensor[i]] for i in range(model.num_layers)]
