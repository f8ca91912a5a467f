"""Property-based tests of the KV-cache manager and its block pool: blocks are conserved, never owned twice, and
reference counts never go negative, whatever sequence of allocations and frees happens;
block 0 is the null block, never handed out."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_pool import NULL_BLOCK_ID
from engine.core.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def _req(i: int, tokens: list[int]) -> Request:
    return Request(str(i), None, tokens, SamplingParams(max_tokens=4), None, 4)


def _check_invariants(bm: KVCacheManager, live: list[Request]) -> None:
    pool = bm.block_pool
    refs = [0] * pool.num_gpu_blocks
    for r in live:
        assert len(set(r.block_ids)) == len(r.block_ids), "a request holds a block twice"
        for b in r.block_ids:
            refs[b] += 1
    assert refs[NULL_BLOCK_ID] == 0 and NULL_BLOCK_ID not in pool.free_block_queue, "the null block was handed out"
    for block in pool.blocks[NULL_BLOCK_ID + 1:]:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == refs[block.block_id], "ref count disagrees with the block tables"
        # a block is in the free queue exactly when nobody references it
        assert (block.block_id in pool.free_block_queue) == (block.ref_cnt == 0)
    for h, bid in pool.cached_block_hash_to_block.items():
        assert pool.blocks[bid].block_hash == h
    assert bm.num_free_blocks + sum(1 for r in refs if r) == bm.num_usable_blocks == pool.num_gpu_blocks - 1


ops = st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 7), st.integers(1, 40)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 2, 4, 8]),
       prefix=st.booleans(), vocab=st.integers(1, 3))
def test_allocate_free_conserves_blocks(ops, num_blocks, block_size, prefix, vocab):
    bm = KVCacheManager(num_blocks, block_size, enable_caching=prefix)
    live: dict[int, Request] = {}
    for n, (op, slot, amount) in enumerate(ops):
        if op == "alloc" and slot not in live:
            # tiny vocabularies make shared prefixes (and so cache hits) likely
            req = _req(n, [(n * 7 + i) % vocab for i in range(amount)])
            computed, num_cached = bm.get_computed_blocks(req)
            if bm.allocate_slots(req, req.num_tokens - num_cached, computed):
                req.num_computed_tokens = req.num_tokens
                live[slot] = req
            else:
                assert req.block_ids == [], "a failed allocation must change nothing"
        elif op == "grow" and slot in live:
            req = live[slot]
            before = list(req.block_ids)
            new = [vocab - 1] * min(amount, 5)
            req.all_token_ids += new
            if bm.allocate_slots(req, len(new)):
                req.num_computed_tokens = req.num_tokens
            else:
                del req.all_token_ids[-len(new):]
                assert req.block_ids == before
        elif op == "free" and slot in live:
            bm.free(live.pop(slot))
        _check_invariants(bm, list(live.values()))
    for req in live.values():
        bm.free(req)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_block_0_is_the_null_block():
    """As vLLM V1's block pool: block 0 never joins a block table, so padding with 0 is harmless."""
    with pytest.raises(ValueError, match="null block"):
        KVCacheManager(1, 4, enable_caching=False)
    bm = KVCacheManager(3, 4, enable_caching=False)
    assert bm.num_free_blocks == bm.num_usable_blocks == 2 and bm.usage == 0.0
    a = _req(0, list(range(8)))
    assert bm.allocate_slots(a, 8) and a.block_ids == [1, 2] and bm.usage == 1.0
    assert not bm.allocate_slots(_req(1, [5]), 1), "only the null block is left, and it is not for requests"


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    bm = KVCacheManager(8, 4, enable_caching=True)
    a = _req(0, list(range(8)))
    assert bm.allocate_slots(a, 8)
    b = _req(1, list(range(8)))  # identical prompt: at most 7 tokens may hit -> 1 full block
    hit, num_hit = bm.get_computed_blocks(b)
    assert hit == (a.block_ids[:1],) and num_hit == 4
    assert bm.allocate_slots(b, 8 - 4, hit)
    assert b.block_ids[0] == a.block_ids[0] and bm.block_pool.blocks[a.block_ids[0]].ref_cnt == 2
    assert bm.prefix_cache_hits == 4 and bm.prefix_cache_queries == 8


def test_hash_collision_is_verified():
    bm = KVCacheManager(5, 2, enable_caching=True)
    pool, cached = bm.block_pool, bm.block_pool.cached_block_hash_to_block
    a = _req(0, [1, 2, 3])
    bm.allocate_slots(a, 3)
    h = a.block_hashes[0]
    pool.blocks[a.block_ids[0]].token_ids = (9, 9)  # pretend the stored block holds other tokens
    assert cached[h] == a.block_ids[0]
    assert bm.get_computed_blocks(_req(1, [1, 2, 3])) == (([],), 0)


def test_freed_cached_blocks_count_as_free_and_are_evicted_lru():
    bm = KVCacheManager(4, 2, enable_caching=True)  # 3 usable blocks besides the null block
    pool, cached = bm.block_pool, bm.block_pool.cached_block_hash_to_block
    a = _req(0, [1, 2, 3, 4, 5])
    bm.allocate_slots(a, 5)
    bm.free(a)
    assert bm.num_free_blocks == 3 and len(cached) == 2  # both full blocks stay cached
    # the partial (unhashed) block is reused first, then the *last* block of `a`
    order = list(pool.free_block_queue)
    assert pool.blocks[order[0]].block_hash is None
    assert pool.blocks[order[1]].block_hash == a.block_hashes[1]
    c = _req(1, [7, 7, 7, 7])
    bm.allocate_slots(c, 4)  # takes the unhashed block, then evicts a's last block, not its first
    assert a.block_hashes[0] in cached and a.block_hashes[1] not in cached
    assert set(c.block_hashes) <= set(cached)
