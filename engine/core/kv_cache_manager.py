"""The KV-cache manager: each request's block tables and its prefix-cache lookups (vLLM V1's
``KVCacheManager``, ``vllm/v1/core/kv_cache_manager.py``). The scheduler asks it for room
(``allocate_slots``), for a new request's cached prefix (``get_computed_blocks``) and to ``free`` a
request; the blocks themselves, their reference counts, the free queue and the hash map live in the
``BlockPool`` (``engine/core/block_pool.py``), shared by every KV-cache group.

- KV-cache groups (engine/core/kv_cache_interface.py): layers with the same attention type share a
  block table. A dense model has one group; a hybrid one (sliding-window and full-attention layers)
  has several, each run by its ``SingleTypeKVCacheManager`` under the ``KVCacheCoordinator``
  (engine/core/kv_cache_coordinator.py, single_type_kv_cache_manager.py).
- ``request.kv_block_ids[g]`` is the request's block table in group g (logical block i -> physical
  block); ``request.block_ids`` is group 0's. Blocks a sliding window has passed are back in the pool,
  the null block in their place.
- Prefix caching: ``request.block_hashes`` is the request's hash chain over its full blocks,
  extended here as its tokens grow; a hit is a chain of cached blocks that prefixes its tokens (for a
  sliding window: the blocks of the window before the first token to compute).
"""
from __future__ import annotations

from engine.core.block_pool import BlockPool, hash_block_tokens
from engine.core.kv_cache_coordinator import KVCacheBlocks, get_kv_cache_coordinator
from engine.core.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from engine.hooks import Hooks
from engine.request import Request
from engine.trace_names import ALLOCATE, BLOCK_MANAGER, CACHE_HIT, CACHE_MISS, FREE, FREE_WINDOW


class KVCacheManager:
    """Gives requests' block tables blocks from the ``BlockPool``, shares full blocks through the prefix
    cache, gives back the blocks a sliding window has passed, and the rest when requests finish or are
    preempted. kv_cache_groups: the model's groups (None: one full-attention group)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, hooks: Hooks | None = None,
                 kv_cache_groups: list[KVCacheGroupSpec] | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hooks = hooks or Hooks()
        self.block_pool = BlockPool(num_blocks, enable_caching, self.hooks)
        self.kv_cache_groups = kv_cache_groups or [KVCacheGroupSpec([], FullAttentionSpec(block_size))]
        if any(g.kv_cache_spec.block_size != block_size for g in self.kv_cache_groups):
            raise ValueError(f"every KV-cache group must use block_size={block_size}")
        self.coordinator = get_kv_cache_coordinator(self.kv_cache_groups, self.block_pool)
        self.num_kv_cache_groups = len(self.kv_cache_groups)
        self.has_sliding_window = any(g.kv_cache_spec.sliding_window for g in self.kv_cache_groups)
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

    def group_stats(self) -> list[dict]:
        """Per KV-cache group: its kind, window, layers and the blocks its tables hold now (plain data)."""
        return [dict(kind="sliding_window" if g.kv_cache_spec.sliding_window else "full_attention",
                     sliding_window=g.kv_cache_spec.sliding_window, layers=list(g.layer_ids),
                     num_blocks=m.num_held_blocks)
                for g, m in zip(self.kv_cache_groups, self.coordinator.single_type_managers)]

    def blocks_needed(self, num_tokens: int) -> int:
        """The most blocks a request of num_tokens tokens holds at once, over all groups (a sliding
        window's group holds its window's)."""
        return sum(g.kv_cache_spec.max_memory_blocks(num_tokens) for g in self.kv_cache_groups)

    def get_block_ids(self, request: Request) -> KVCacheBlocks:
        """The request's block table in each group (V1's name)."""
        return self.coordinator.get_blocks(request)

    # ---- prefix cache -------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Extend the request's hash chain to its first num_full_blocks blocks."""
        bs, hashes, toks = self.block_size, request.block_hashes, request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tuple(toks[i * bs:(i + 1) * bs])))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's prefix-cache hit: its blocks in each group, and how many tokens they hold.

        At most num_tokens - 1 tokens can hit: the last token is always computed, because
        its logits are needed to sample the next one. A request that asks for prompt logprobs
        needs the logits of every prompt position, so it hits nothing (as vLLM V1).
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return self.coordinator.empty_blocks(), 0
        max_length = request.num_tokens - 1
        hashes = self._block_hashes(request, max_length // self.block_size)
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(request, hashes, max_length)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        if self.hooks.active:
            self._trace_lookup(request, hits, num_hit_tokens)
        return hits, num_hit_tokens

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, delay_cache_blocks: bool = False) -> bool:
        """Make room for num_new_tokens more tokens of the request (after its computed ones and any
        prefix-cache hits, new_computed_blocks), and num_lookahead_tokens slots after them (where a
        draft model writes its proposals: vLLM V1's name). First the blocks its windows have passed go
        back to the pool (even if the rest does not fit). Returns False, changing nothing else, if
        there are not enough blocks in all groups together. delay_cache_blocks: their KV arrives later
        (a KV connector's asynchronous load): not in the prefix cache until then (cache_blocks)."""
        if len(request.kv_block_ids) != self.num_kv_cache_groups:  # (a request's first allocation)
            request.kv_block_ids = [[] for _ in range(self.num_kv_cache_groups)]
        new_computed = new_computed_blocks or self.coordinator.empty_blocks()
        num_hit = len(new_computed[0]) * self.block_size
        total = request.num_computed_tokens + num_hit + num_new_tokens + num_lookahead_tokens
        # async scheduling: a step in flight still reads the window of its own tokens
        self.remove_skipped_blocks(request, request.num_computed_tokens - request.num_output_placeholders)
        if self.coordinator.get_num_blocks_to_allocate(request, total, new_computed) > self.num_free_blocks:
            return False
        self.coordinator.save_new_computed_blocks(request, new_computed)  # prefix-cache hits: share the block
        new = self.coordinator.allocate_new_blocks(request, total)
        if any(new) and self.hooks.active:
            self._trace_allocate(request, new)
        # draft tokens' slots (lookahead) hold nothing to share yet
        if not delay_cache_blocks:
            self.cache_blocks(request, min(total, request.num_tokens))
        return True

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Give back the blocks wholly before the window of the token at num_computed_tokens (the next
        one to compute), in every sliding-window group; the null block takes their place (V1's name)."""
        if not self.has_sliding_window or len(request.kv_block_ids) != self.num_kv_cache_groups:
            return  # (nothing to give back early, or it holds nothing yet)
        passed = self.coordinator.remove_skipped_blocks(request, num_computed_tokens)
        if any(passed) and self.hooks.active:
            self._trace_window(request, passed)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to num_computed_tokens (their K/V are written this
        step) in the prefix cache."""
        if self.enable_caching:
            self.coordinator.cache_blocks(
                request, self._block_hashes(request, num_computed_tokens // self.block_size), num_computed_tokens)

    def free(self, request: Request) -> None:
        """Drop the request's references in every group. Its blocks are freed tail-first, so a
        request's last blocks are reused before its (more shareable) first ones."""
        freed = self.coordinator.free(request)
        if self.hooks.active:
            self.hooks.emit(BLOCK_MANAGER, FREE, request_id=request.request_id, step=self.step, block_ids=freed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (``BlockPool.reset_prefix_cache``); False while a request holds one."""
        return self.block_pool.reset_prefix_cache()

    def _trace_lookup(self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int) -> None:
        extra = {} if len(hits) == 1 else {"kv_cache_groups": [list(h) for h in hits]}
        self.hooks.emit(BLOCK_MANAGER, CACHE_HIT if num_hit_tokens else CACHE_MISS, request_id=request.request_id,
                        step=self.step, block_ids=list(hits[0]), hit_tokens=num_hit_tokens,
                        query_tokens=request.num_tokens, **extra)

    def _trace_allocate(self, request: Request, new: KVCacheBlocks) -> None:
        extra = {} if len(new) == 1 else {"kv_block_tables": [list(b) for b in request.kv_block_ids]}  # per group
        self.hooks.emit(BLOCK_MANAGER, ALLOCATE, request_id=request.request_id, step=self.step,
                        block_ids=[b for group in new for b in group], block_table=list(request.block_ids), **extra)

    def _trace_window(self, request: Request, passed: KVCacheBlocks) -> None:
        self.hooks.emit(BLOCK_MANAGER, FREE_WINDOW, request_id=request.request_id, step=self.step,
                        block_ids=[b for group in passed for b in group], block_table=list(request.block_ids),
                        kv_block_tables=[list(b) for b in request.kv_block_ids], passed=[list(b) for b in passed],
                        num_computed_tokens=request.num_computed_tokens)
