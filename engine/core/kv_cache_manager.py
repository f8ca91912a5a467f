"""The KV-cache manager: each request's block table and its prefix-cache lookups (vLLM V1's
``KVCacheManager``, ``vllm/v1/core/kv_cache_manager.py``). The scheduler asks it for room
(``allocate_slots``), for a new request's cached prefix (``get_computed_blocks``) and to ``free`` a
request; the blocks themselves, their reference counts, the free queue and the hash map live in the
``BlockPool`` (``engine/core/block_pool.py``).

- Each request's ``block_ids`` is its block table (logical block i -> physical block).
- Prefix caching: ``request.block_hashes`` is the request's hash chain over its full blocks,
  extended here as its tokens grow; a hit is a chain of cached blocks that prefixes its tokens.
"""
from __future__ import annotations

from engine.core.block_pool import BlockPool, hash_block_tokens
from engine.hooks import Hooks
from engine.request import Request
from engine.trace_names import ALLOCATE, BLOCK_MANAGER, CACHE_HIT, CACHE_MISS, FREE


class KVCacheManager:
    """Gives requests' block tables blocks from the ``BlockPool``, shares full blocks through the prefix
    cache, and gives them back when requests finish or are preempted."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, hooks: Hooks | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hooks = hooks or Hooks()
        self.block_pool = BlockPool(num_blocks, enable_caching, self.hooks)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def step(self) -> int | None:
        """The scheduler's step, stamped on this manager's and the pool's trace events."""
        return self.block_pool.step

    @step.setter
    def step(self, step: int | None) -> None:
        self.block_pool.step = step

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can hold: all but the null block."""
        return self.block_pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (``BlockPool.get_usage``)."""
        return self.block_pool.get_usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Extend the request's hash chain to its first num_full_blocks blocks."""
        bs, hashes, toks = self.block_size, request.block_hashes, request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tuple(toks[i * bs:(i + 1) * bs])))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest chain of cached blocks that prefixes this request's tokens.

        At most num_tokens - 1 tokens can hit: the last token is always computed, because
        its logits are needed to sample the next one. A request that asks for prompt logprobs
        needs the logits of every prompt position, so it hits nothing (as vLLM V1).
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return []
        bs, toks = self.block_size, request.all_token_ids
        hits = []
        for i, h in enumerate(self._block_hashes(request, (request.num_tokens - 1) // bs)):
            bid = self.block_pool.get_cached_block(h, tuple(toks[i * bs:(i + 1) * bs]))
            if bid is None:
                break
            hits.append(bid)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * bs
        if self.hooks.active:
            self._trace_lookup(request, hits)
        return hits

    # ---- allocation ---------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] = ()) -> bool:
        need = self.blocks_needed(request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                                  + num_new_tokens) - len(request.block_ids) - len(new_computed_blocks)
        reused_free = sum(1 for b in new_computed_blocks if self.block_pool.blocks[b].ref_cnt == 0)
        return need <= self.num_free_blocks - reused_free

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] = (),
                       num_lookahead_tokens: int = 0) -> bool:
        """Make room for num_new_tokens more tokens of the request (after its computed ones and any
        prefix-cache hits), and num_lookahead_tokens slots after them (where a draft model writes
        its proposals: vLLM V1's name). Returns False, changing nothing, if there are not enough blocks."""
        bs = self.block_size
        total = request.num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens + num_lookahead_tokens
        if new_computed_blocks or -(-total // bs) > len(request.block_ids):  # else: fits in its blocks
            if not self.can_allocate(request, num_new_tokens + num_lookahead_tokens, new_computed_blocks):
                return False
            self.block_pool.touch(new_computed_blocks)  # prefix-cache hits: share the block
            request.block_ids.extend(new_computed_blocks)
            new = self.block_pool.get_new_blocks(self.blocks_needed(total) - len(request.block_ids))
            request.block_ids.extend(new)
            if new and self.hooks.active:
                self._trace_allocate(request, new)
        # draft tokens' slots (lookahead) hold nothing to share yet
        self.cache_blocks(request, min(total, request.num_tokens))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to num_computed_tokens (their K/V are written this
        step) in the prefix cache."""
        num_full = num_computed_tokens // self.block_size
        if not self.enable_caching or num_full <= request.num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(request.block_ids, self._block_hashes(request, num_full),
                                          request.all_token_ids, request.num_cached_blocks, num_full, self.block_size)
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Drop the request's references. Its blocks are freed tail-first, so a request's last blocks
        are reused before its (more shareable) first ones."""
        freed = self.block_pool.free_blocks(reversed(request.block_ids))
        if self.hooks.active:
            self.hooks.emit(BLOCK_MANAGER, FREE, request_id=request.request_id, step=self.step, block_ids=freed)
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (``BlockPool.reset_prefix_cache``); False while a request holds one."""
        return self.block_pool.reset_prefix_cache()

    def _trace_lookup(self, request: Request, hits: list[int]) -> None:
        self.hooks.emit(BLOCK_MANAGER, CACHE_HIT if hits else CACHE_MISS, request_id=request.request_id,
                        step=self.step, block_ids=hits, hit_tokens=len(hits) * self.block_size,
                        query_tokens=request.num_tokens)

    def _trace_allocate(self, request: Request, new: list[int]) -> None:
        self.hooks.emit(BLOCK_MANAGER, ALLOCATE, request_id=request.request_id, step=self.step, block_ids=new,
                        block_table=list(request.block_ids))
