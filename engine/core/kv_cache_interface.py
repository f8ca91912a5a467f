"""What each layer keeps in the KV cache, and how layers share block tables (vLLM V1's
``vllm/v1/kv_cache_interface.py``).

A ``KVCacheSpec`` per attention layer: ``FullAttentionSpec`` (every past token's K/V is read) or
``SlidingWindowSpec`` (a token reads only the last ``sliding_window`` positions, itself included,
as Hugging Face's mask ``key > query - sliding_window``). Layers with the same spec form one
``KVCacheGroupSpec``: they share one block table per request, so the scheduler manages a group as
one layer. A dense model has one group of all its layers.

With more than one spec (Gemma 3: five sliding-window layers to one global layer), V1 cuts every
spec's layers into groups of the same size (the smallest spec's count of layers), so that a block id
means the same memory in every group: layer j of each group shares one K/V tensor, and a block of
the shared pool belongs to whichever group took it. One block then holds group_size layers' K/V,
and a sliding-window group returns its blocks to the pool as the window passes them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that reads every past token's K/V. (The K/V shape is every layer's here: the
    model's num_kv_heads and head_size, see kv_cache_utils.py.)"""
    block_size: int

    @property
    def sliding_window(self) -> int | None:
        return None

    def max_memory_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once."""
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A layer whose token at position p reads positions p - sliding_window + 1 .. p."""
    sliding_window: int = 0  # type: ignore[assignment]  (a field here, a property of the full spec)

    def max_memory_blocks(self, num_tokens: int) -> int:
        """The window's tokens, and a block it straddles (V1's max_memory_usage_bytes, in blocks)."""
        return min(-(-num_tokens // self.block_size), -(-(self.sliding_window - 1) // self.block_size) + 1)


KVCacheSpec = FullAttentionSpec  # (a SlidingWindowSpec is one)


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table per request (V1's; layer indices where V1 has layer names)."""
    layer_ids: list[int]
    kv_cache_spec: KVCacheSpec


def get_kv_cache_groups(specs: list[KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group the layers by spec (V1's ``get_kv_cache_groups``): one group for a single spec; else
    each spec's layers cut into groups of the smallest spec's layer count (every group as large, so
    that layer j of every group can share one tensor)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        by_spec.setdefault(spec, []).append(i)
    if len(by_spec) == 1:
        return [KVCacheGroupSpec(list(range(len(specs))), specs[0])]
    size = min(map(len, by_spec.values()))
    return [KVCacheGroupSpec(layers[i:i + size], spec) for spec, layers in by_spec.items()
            for i in range(0, len(layers), size)]


def num_tensors(groups: list[KVCacheGroupSpec]) -> int:
    """K/V tensor pairs the cache holds: the largest group's layer count (layer j of every group
    shares tensor j)."""
    return max(len(g.layer_ids) for g in groups)


def tensor_of_layer(groups: list[KVCacheGroupSpec]) -> dict[int, int]:
    """Layer index -> the tensor it reads and writes."""
    return {layer: j for g in groups for j, layer in enumerate(g.layer_ids)}


def group_of_layer(groups: list[KVCacheGroupSpec]) -> dict[int, int]:
    """Layer index -> its KV-cache group."""
    return {layer: gid for gid, g in enumerate(groups) for layer in g.layer_ids}
