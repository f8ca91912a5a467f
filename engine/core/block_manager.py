"""The block manager: physical KV-cache blocks, block tables and the prefix cache.

- Block 0 is the **null block**, as in vLLM V1's block pool: it is never handed to a request,
  so a block table padded with 0 (a batch's ``block_tables`` rows are padded to the widest)
  points at a block that holds no request's data. ``num_blocks`` counts it; the free queue
  and ``num_usable_blocks`` do not.
- ``free``: the free-block queue, least recently used first. Blocks whose contents are still
  in the prefix cache stay here (they count as free) until they are reused: taking one for a
  new purpose *evicts* it from the cache.
- Each request's ``block_ids`` is its block table (logical block i -> physical block).
- Reference counts let requests share prefix blocks.
- Prefix caching: a full block's hash chains its parent's hash and its token ids, so a hash
  names the whole prefix up to that block. Hits are verified against the stored tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.hooks import Hooks
from engine.request import Request
from engine.trace_names import ALLOCATE, BLOCK_MANAGER, CACHE_HIT, CACHE_MISS, EVICT, FREE


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens behind `hash`, to verify hits


def hash_block(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


NULL_BLOCK_ID = 0


class BlockManager:
    """Hands out physical blocks 1..num_blocks-1 to requests' block tables, shares full blocks
    through the prefix cache (reference counts), and takes them back when requests finish."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, hooks: Hooks | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK_ID} is the null block), got {num_blocks}")
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK_ID + 1, num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> physical block id
        self.hooks = hooks or Hooks()
        self.step: int | None = None  # set by the scheduler, for trace events
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can hold: all but the null block."""
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------
    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """Extend the request's hash chain to its first num_full_blocks blocks."""
        bs, hashes, toks = self.block_size, req.block_hashes, req.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(toks[i * bs:(i + 1) * bs])))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The longest chain of cached blocks that prefixes this request's tokens.

        At most num_tokens - 1 tokens can hit: the last token is always computed, because
        its logits are needed to sample the next one. A request that asks for prompt logprobs
        needs the logits of every prompt position, so it hits nothing (as vLLM V1).
        """
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        hits = []
        for i, h in enumerate(self._block_hashes(req, (req.num_tokens - 1) // bs)):
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(req.all_token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(bid)
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += len(hits) * bs
        if self.hooks.active:
            self._trace_lookup(req, hits)
        return hits

    # ---- allocation ---------------------------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        need = self.blocks_needed(req.num_computed_tokens + len(computed_blocks) * self.block_size
                                  + num_new_tokens) - len(req.block_ids) - len(computed_blocks)
        reused_free = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        return need <= self.num_free_blocks - reused_free

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = (),
                       num_lookahead_tokens: int = 0) -> bool:
        """Make room for num_new_tokens more tokens of req (after its computed ones and any
        prefix-cache hits), and num_lookahead_tokens slots after them (where a draft model writes
        its proposals: vLLM V1's name). Returns False, changing nothing, if there are not enough blocks."""
        bs = self.block_size
        total = req.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens + num_lookahead_tokens
        if computed_blocks or -(-total // bs) > len(req.block_ids):  # else: fits in its blocks
            if not self.can_allocate(req, num_new_tokens + num_lookahead_tokens, computed_blocks):
                return False
            for bid in computed_blocks:  # prefix-cache hits: share the block
                block = self.blocks[bid]
                if block.ref_cnt == 0:
                    del self.free[bid]
                block.ref_cnt += 1
                req.block_ids.append(bid)
            new = [self.take_free_block() for _ in range(self.blocks_needed(total) - len(req.block_ids))]
            req.block_ids.extend(new)
            if new and self.hooks.active:
                self._trace_allocate(req, new)
        full = min(total, req.num_tokens) // bs  # draft tokens' slots (lookahead) hold nothing to share yet
        if self.enable_prefix_caching and full > req.num_cached_blocks:
            self.cache_full_blocks(req, full)
        return True

    def take_free_block(self) -> int:
        """The front of the free queue, for a request (ref_cnt 1); its cached contents, if any, are evicted."""
        bid, _ = self.free.popitem(last=False)  # least recently used
        block = self.blocks[bid]
        if block.hash is not None:  # its old contents leave the prefix cache now
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            if self.hooks.active:
                self.hooks.emit(BLOCK_MANAGER, EVICT, step=self.step, block_ids=[bid])
            block.hash = block.token_ids = None
        block.ref_cnt = 1
        return bid

    def cache_full_blocks(self, req: Request, num_full: int) -> None:
        """Register the request's full blocks (their K/V are written this step) in the cache."""
        bs, hashes = self.block_size, self._block_hashes(req, num_full)
        for i in range(req.num_cached_blocks, num_full):
            h, block = hashes[i], self.blocks[req.block_ids[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tuple(req.all_token_ids[i * bs:(i + 1) * bs])
                self.cached.setdefault(h, block.block_id)
        req.num_cached_blocks = num_full

    def free_request(self, req: Request) -> None:
        """Drop the request's references. Freed blocks join the queue tail-first, so a
        request's last blocks are reused before its (more shareable) first ones; blocks with
        no cached contents go to the front, to be reused before any cached block."""
        freed = []
        for bid in reversed(req.block_ids):
            block = self.blocks[bid]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[bid] = None
                if block.hash is None:
                    self.free.move_to_end(bid, last=False)
                freed.append(bid)
        if self.hooks.active:
            self.hooks.emit(BLOCK_MANAGER, FREE, request_id=req.request_id, step=self.step, block_ids=freed)
        req.block_ids = []
        req.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM V1's ``BlockPool.reset_prefix_cache``). Refused, and
        False returned, while any request holds a block: its blocks could not be told apart.
        Fires ``block_manager reset_prefix_cache`` with how many cached blocks were dropped."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        dropped = len(self.cached)
        self.cached.clear()
        for block in self.blocks:
            block.hash = block.token_ids = None
        if self.hooks.active:
            self.hooks.emit(BLOCK_MANAGER, "reset_prefix_cache", step=self.step, num_blocks=dropped)
        return True

    def _trace_lookup(self, req: Request, hits: list[int]) -> None:
        self.hooks.emit(BLOCK_MANAGER, CACHE_HIT if hits else CACHE_MISS, request_id=req.request_id, step=self.step,
                        block_ids=hits, hit_tokens=len(hits) * self.block_size, query_tokens=req.num_tokens)

    def _trace_allocate(self, req: Request, new: list[int]) -> None:
        self.hooks.emit(BLOCK_MANAGER, ALLOCATE, request_id=req.request_id, step=self.step, block_ids=new,
                        block_table=list(req.block_ids))

    def usage(self) -> float:
        """Fraction of usable blocks held by running requests (cached-but-free blocks count as
        free; the null block is not counted, as in vLLM's ``get_usage``)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks
