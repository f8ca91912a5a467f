"""The block pool: every physical KV-cache block, the free-block queue and the prefix cache's hash map
(vLLM V1's ``BlockPool``, ``vllm/v1/core/block_pool.py``). It knows blocks, not requests: the
``KVCacheManager`` turns a request's tokens into block hashes and block tables and asks the pool.

- Block 0 is the **null block**, as in vLLM V1: it is never handed to a request, so a block table
  padded with 0 (a batch's ``block_tables`` rows are padded to the widest) points at a block that
  holds no request's data. ``num_gpu_blocks`` counts it; the free queue and ``num_usable_blocks`` do not.
- ``free_block_queue``: the free blocks, least recently used first (an ``OrderedDict``: O(1) removal
  from the middle when a prefix hit takes a cached-but-free block, where V1 keeps a doubly linked list).
  Blocks whose contents are still in the prefix cache stay here (they count as free) until they are
  reused: taking one for a new purpose *evicts* it from the cache.
- Reference counts let requests share prefix blocks.
- ``cached_block_hash_to_block``: block hash (with its KV-cache group) -> physical block id. A full
  block's hash chains its parent's hash and its token ids, so a hash names the whole prefix up to
  that block; a hit is verified against the tokens the block stores. The same tokens have one block
  in each KV-cache group (a hybrid model's groups keep different layers' K/V), so a key is the hash
  with its group's id (V1's ``BlockHashWithGroupId``); group 0's key is the hash itself.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.hooks import Hooks
from engine.trace_names import BLOCK_MANAGER, EVICT

NULL_BLOCK_ID = 0


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens behind `block_hash`, to verify hits


def block_hash_with_group_id(block_hash: int, group_id: int) -> int:
    """A block's key in the prefix cache's map: its hash, and for groups past the first its group's id."""
    return block_hash if group_id == 0 else hash((block_hash, group_id))


def hash_block_tokens(parent_block_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A full block's hash: its parent's hash and its own tokens (vLLM V1's ``hash_block_tokens``)."""
    return hash((parent_block_hash, token_ids))


class BlockPool:
    """Hands out physical blocks 1..num_gpu_blocks-1, takes them back, and keeps the prefix cache's map."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hooks: Hooks | None = None):
        if num_gpu_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK_ID} is the null block), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK_ID + 1, num_gpu_blocks))
        self.cached_block_hash_to_block: dict[int, int] = {}
        self.hooks = hooks or Hooks()
        self.step: int | None = None  # set by the scheduler (through the KVCacheManager), for trace events

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can hold: all but the null block."""
        return self.num_gpu_blocks - 1

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free; the null
        block is not counted, as in vLLM's ``get_usage``)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...], group_id: int = 0) -> int | None:
        """The group's cached block with this hash, if it holds these tokens (a hash collision is a miss)."""
        bid = self.cached_block_hash_to_block.get(block_hash_with_group_id(block_hash, group_id))
        if bid is None or self.blocks[bid].token_ids != token_ids:
            return None
        return bid

    def cache_full_blocks(self, block_ids: list[int], block_hashes: list[int], all_token_ids: list[int],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int, group_id: int = 0) -> None:
        """Register blocks num_cached_blocks..num_full_blocks-1 of a block table (their K/V are written
        this step) in the cache; a hash already cached keeps its first block. The null block (where a
        sliding window has passed) holds nothing to register."""
        for i in range(num_cached_blocks, num_full_blocks):
            block = self.blocks[block_ids[i]]
            if block.block_hash is None and block is not self.null_block:
                block.block_hash = block_hash_with_group_id(block_hashes[i], group_id)
                block.token_ids = tuple(all_token_ids[i * block_size:(i + 1) * block_size])
                self.cached_block_hash_to_block.setdefault(block.block_hash, block.block_id)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Blocks from the front of the free queue (least recently used), each with ref_cnt 1; the
        cached contents of any of them are evicted."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = []
        for _ in range(num_blocks):
            bid, _ = self.free_block_queue.popitem(last=False)
            self._maybe_evict_cached_block(self.blocks[bid])
            self.blocks[bid].ref_cnt = 1
            ret.append(bid)
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Its old contents leave the prefix cache now; False if it had none."""
        if block.block_hash is None:
            return False
        if self.cached_block_hash_to_block.get(block.block_hash) == block.block_id:
            del self.cached_block_hash_to_block[block.block_hash]
        if self.hooks.active:
            self.hooks.emit(BLOCK_MANAGER, EVICT, step=self.step, block_ids=[block.block_id])
        block.block_hash = block.token_ids = None
        return True

    def touch(self, block_ids: Iterable[int]) -> None:
        """Prefix-cache hits: one more reference each; a hit with none (cached but free) leaves the free queue."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt == 0:
                del self.free_block_queue[bid]
            block.ref_cnt += 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each block, in eviction order (first evicted first). A block left with
        none joins the free queue: at the tail if its contents are cached (reused last, LRU), at the
        front if not (reused before any cached block). Returns the blocks that became free."""
        freed = []
        for bid in ordered_block_ids:
            block = self.blocks[bid]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[bid] = None
                if block.block_hash is None:
                    self.free_block_queue.move_to_end(bid, last=False)
                freed.append(bid)
        return freed

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused, and False returned, while any request holds a block: its
        blocks could not be told apart. Fires ``block_manager reset_prefix_cache`` with how many cached
        blocks were dropped."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        dropped = len(self.cached_block_hash_to_block)
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        if self.hooks.active:
            self.hooks.emit(BLOCK_MANAGER, "reset_prefix_cache", step=self.step, num_blocks=dropped)
        return True
