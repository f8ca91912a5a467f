"""One KV-cache group's share of a request's blocks (vLLM V1's
``vllm/v1/core/single_type_kv_cache_manager.py``): how many blocks it needs, its prefix-cache hits,
and which blocks it can give back early.

- ``FullAttentionManager``: a request keeps every block until it finishes; a prefix hit is the
  longest chain of cached blocks from the first.
- ``SlidingWindowManager``: the token at position p reads positions p - sliding_window + 1 .. p, so a
  block wholly before the next token's window is never read again. ``remove_skipped_blocks`` gives
  it back to the pool as the request advances and leaves the null block in its place (the table
  keeps its length: logical block i stays at index i). A prefix hit needs only the blocks of the
  window before the first token to compute: V1 searches from the right for
  ceil((sliding_window - 1) / block_size) consecutive cached blocks; the blocks before them are
  the null block.

A request's table for group g is ``request.kv_block_ids[g]``; block 0 is the null block.
``num_held_blocks``: the blocks the group's tables hold now (a block shared by requests counted
once; a block belongs to one group at a time), what /metrics reports per group.
"""
from __future__ import annotations

from engine.core.block_pool import NULL_BLOCK_ID, BlockPool
from engine.core.kv_cache_interface import KVCacheSpec, SlidingWindowSpec
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeKVCacheManager:
    """The blocks of one KV-cache group (one attention type), for every request."""

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int):
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.num_cached_block: dict[str, int] = {}  # request id -> its leading blocks registered in the cache
        self.num_held_blocks = 0  # distinct blocks in this group's tables (their ref_cnt > 0)

    def req_blocks(self, request: Request) -> list[int]:
        return request.kv_block_ids[self.kv_cache_group_id]

    def get_num_blocks_to_allocate(self, request: Request, num_tokens: int, new_computed_blocks: list[int]) -> int:
        """Free blocks that giving num_tokens slots (prefix hits included) takes: new blocks, and hits
        that sit in the free queue (cached but unused: taking one takes a free block)."""
        num_new = cdiv(num_tokens, self.block_size) - len(new_computed_blocks) - len(self.req_blocks(request))
        blocks = self.block_pool.blocks
        evictable = sum(1 for b in new_computed_blocks if b != NULL_BLOCK_ID and blocks[b].ref_cnt == 0)
        return max(0, num_new) + evictable

    def save_new_computed_blocks(self, request: Request, new_computed_blocks: list[int]) -> None:
        """Prefix-cache hits join the request's table (one more reference each)."""
        if new_computed_blocks:
            hits = [b for b in new_computed_blocks if b != NULL_BLOCK_ID]
            blocks = self.block_pool.blocks
            self.num_held_blocks += sum(1 for b in hits if blocks[b].ref_cnt == 0)  # not held by another request
            self.block_pool.touch(hits)
            self.req_blocks(request).extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(self.req_blocks(request))

    def allocate_new_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Fresh blocks until the table covers num_tokens slots; returns them."""
        blocks = self.req_blocks(request)
        n = cdiv(num_tokens, self.block_size) - len(blocks)
        if n <= 0:
            return []
        new = self.block_pool.get_new_blocks(n)
        blocks.extend(new)
        self.num_held_blocks += n
        return new

    def cache_blocks(self, request: Request, block_hashes: list[int], num_tokens: int) -> None:
        """Register the request's full blocks up to num_tokens (their K/V are written this step)."""
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(self.req_blocks(request), block_hashes, request.all_token_ids,
                                          num_cached, num_full, self.block_size, self.kv_cache_group_id)
        self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> list[int]:
        """Drop the request's references, tail first (its last blocks are reused before its more
        shareable first ones); returns the blocks that became free."""
        blocks = self.req_blocks(request)
        freed = self.block_pool.free_blocks(b for b in reversed(blocks) if b != NULL_BLOCK_ID)
        request.kv_block_ids[self.kv_cache_group_id] = []
        self.num_cached_block.pop(request.request_id, None)
        self.num_held_blocks -= len(freed)
        return freed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token's attention never reads (none for full attention)."""
        return 0

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> list[int]:
        """Give back the blocks wholly before the next token's window, the null block in their place;
        returns the blocks that became free."""
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped <= 0:
            return []
        blocks = self.req_blocks(request)
        passed = []
        for i in range(min(num_skipped // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] == NULL_BLOCK_ID:
                break  # the ones before were given back earlier
            passed.append(blocks[i])
            blocks[i] = NULL_BLOCK_ID
        freed = self.block_pool.free_blocks(passed)
        self.num_held_blocks -= len(freed)
        return freed

    def find_longest_cache_hit(self, request: Request, block_hashes: list[int], max_length: int) -> list[int]:
        raise NotImplementedError

    def _cached(self, request: Request, block_hashes: list[int], i: int) -> int | None:
        bs = self.block_size
        return self.block_pool.get_cached_block(block_hashes[i], tuple(request.all_token_ids[i * bs:(i + 1) * bs]),
                                                self.kv_cache_group_id)


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, request: Request, block_hashes: list[int], max_length: int) -> list[int]:
        """The longest chain of cached blocks from the first, within max_length tokens."""
        hits = []
        for i in range(min(max_length // self.block_size, len(block_hashes))):
            bid = self._cached(request, block_hashes, i)
            if bid is None:
                break
            hits.append(bid)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int):
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The next token (at position num_computed_tokens) reads from num_computed_tokens -
        sliding_window + 1 on: the tokens before are skipped."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(self, request: Request, block_hashes: list[int], max_length: int) -> list[int]:
        """The longest hit whose last ceil((sliding_window - 1) / block_size) blocks are cached (the
        window of the first token to compute), searched from the right; null blocks before them. A
        run from the first block shorter than that is a hit too (every block before its end is there)."""
        need = max(1, cdiv(self.sliding_window - 1, self.block_size))
        n = min(max_length // self.block_size, len(block_hashes))
        computed = [NULL_BLOCK_ID] * n
        run = 0
        for i in range(n - 1, -1, -1):
            bid = self._cached(request, block_hashes, i)
            if bid is None:
                run = 0
                continue
            computed[i] = bid
            run += 1
            if run >= need:
                return computed[:i + run]
        return computed[:run]


def manager_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """V1's spec_manager_map."""
    return SlidingWindowManager if isinstance(spec, SlidingWindowSpec) else FullAttentionManager

