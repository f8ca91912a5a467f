"""The KV-cache groups of one model, over one block pool (vLLM V1's
``vllm/v1/core/kv_cache_coordinator.py``): one ``SingleTypeKVCacheManager`` per group, all taking
blocks from the same ``BlockPool``. A request needs room in every group at once, so the blocks to
allocate are summed over the groups, and a prefix hit must hold in every group.

- ``UnitaryKVCacheCoordinator``: one group (every layer the same attention type).
- ``HybridKVCacheCoordinator``: several groups (sliding-window and full-attention layers). A hit
  is the longest length every group can serve: full attention's hit shrinks to any shorter length
  for free (its blocks are a prefix chain), a sliding window's is searched again for the shorter
  length (its window moves), until all agree.
"""
from __future__ import annotations

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_interface import KVCacheGroupSpec
from engine.core.single_type_kv_cache_manager import FullAttentionManager, SingleTypeKVCacheManager, manager_for
from engine.request import Request

KVCacheBlocks = tuple[list[int], ...]  # one list of block ids per group (V1's KVCacheBlocks.get_block_ids())


class KVCacheCoordinator:
    def __init__(self, kv_cache_groups: list[KVCacheGroupSpec], block_pool: BlockPool):
        self.kv_cache_groups = kv_cache_groups
        self.block_pool = block_pool
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            manager_for(g.kv_cache_spec)(g.kv_cache_spec, block_pool, gid) for gid, g in enumerate(kv_cache_groups))
        self.block_size = kv_cache_groups[0].kv_cache_spec.block_size

    def empty_blocks(self) -> KVCacheBlocks:
        return tuple([] for _ in self.single_type_managers)

    def get_num_blocks_to_allocate(self, request: Request, num_tokens: int, new_computed_blocks: KVCacheBlocks) -> int:
        return sum(m.get_num_blocks_to_allocate(request, num_tokens, blocks)
                   for m, blocks in zip(self.single_type_managers, new_computed_blocks))

    def save_new_computed_blocks(self, request: Request, new_computed_blocks: KVCacheBlocks) -> None:
        for m, blocks in zip(self.single_type_managers, new_computed_blocks):
            m.save_new_computed_blocks(request, blocks)

    def allocate_new_blocks(self, request: Request, num_tokens: int) -> KVCacheBlocks:
        return tuple(m.allocate_new_blocks(request, num_tokens) for m in self.single_type_managers)

    def cache_blocks(self, request: Request, block_hashes: list[int], num_tokens: int) -> None:
        for m in self.single_type_managers:
            m.cache_blocks(request, block_hashes, num_tokens)

    def free(self, request: Request) -> list[int]:
        return [b for m in self.single_type_managers for b in m.free(request)]

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> KVCacheBlocks:
        return tuple(m.remove_skipped_blocks(request, num_computed_tokens) for m in self.single_type_managers)

    def get_blocks(self, request: Request) -> KVCacheBlocks:
        return tuple(request.kv_block_ids)

    def find_longest_cache_hit(self, request: Request, block_hashes: list[int],
                               max_length: int) -> tuple[KVCacheBlocks, int]:
        raise NotImplementedError


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV-cache group."""

    def find_longest_cache_hit(self, request: Request, block_hashes: list[int],
                               max_length: int) -> tuple[KVCacheBlocks, int]:
        hits = self.single_type_managers[0].find_longest_cache_hit(request, block_hashes, max_length)
        return (hits,), len(hits) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several KV-cache groups (attention types) sharing the pool."""

    def find_longest_cache_hit(self, request: Request, block_hashes: list[int],
                               max_length: int) -> tuple[KVCacheBlocks, int]:
        # full attention first: its hit bounds the others', and shrinks without a new search
        managers = sorted(self.single_type_managers, key=lambda m: not isinstance(m, FullAttentionManager))
        hits: dict[int, list[int]] = {}
        length = max_length
        while True:
            for m in managers:
                gid = m.kv_cache_group_id
                if gid in hits and isinstance(m, FullAttentionManager):
                    del hits[gid][length // self.block_size:]
                else:
                    hits[gid] = m.find_longest_cache_hit(request, block_hashes, length)
                length = min(length, len(hits[gid]) * self.block_size)
            if all(len(h) * self.block_size == length for h in hits.values()):
                return tuple(hits[g] for g in range(len(managers))), length


def get_kv_cache_coordinator(kv_cache_groups: list[KVCacheGroupSpec], block_pool: BlockPool) -> KVCacheCoordinator:
    cls = UnitaryKVCacheCoordinator if len(kv_cache_groups) == 1 else HybridKVCacheCoordinator
    return cls(kv_cache_groups, block_pool)
