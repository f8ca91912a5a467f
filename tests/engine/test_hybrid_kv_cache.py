"""The hybrid KV-cache manager alone (no model): sliding-window groups give back the blocks their
window has passed (the null block in their place), prefix hits in a window need only the window's
blocks, all groups share one block pool, and layers are grouped as vLLM V1 groups them."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_pool import NULL_BLOCK_ID
from engine.core.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, get_kv_cache_groups, num_tensors
from engine.core.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, None, tokens, SamplingParams(max_tokens=64), None, 64)


def _manager(num_blocks: int, specs, caching: bool = False) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching, kv_cache_groups=get_kv_cache_groups(specs))


def _decode(bm: KVCacheManager, req: Request, steps: int) -> None:
    """Prefill, then one token a step, as the scheduler drives it."""
    assert bm.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    for _ in range(steps):
        req.append_token(7)
        assert bm.allocate_slots(req, 1)
        req.num_computed_tokens += 1


def test_layers_are_grouped_as_v1():
    full, win = FullAttentionSpec(BS), SlidingWindowSpec(BS, 8)
    groups = get_kv_cache_groups([win, full, win, full])
    assert [(g.layer_ids, g.kv_cache_spec) for g in groups] == [([0, 2], win), ([1, 3], full)]
    assert num_tensors(groups) == 2  # layer j of each group shares tensor j
    gemma = get_kv_cache_groups([win] * 5 + [full])  # five local layers to one global: groups of one
    assert len(gemma) == 6 and num_tensors(gemma) == 1
    assert [g.layer_ids for g in get_kv_cache_groups([full] * 3)] == [[0, 1, 2]]  # dense: one group


def test_window_frees_passed_blocks_and_keeps_null_in_their_place():
    window = 8
    bm = _manager(32, [SlidingWindowSpec(BS, window)])
    req = _req("a", list(range(10)))
    _decode(bm, req, 30)
    table = req.block_ids
    assert len(table) == -(-req.num_tokens // BS)  # one entry per logical block, as before
    held = [b for b in table if b != NULL_BLOCK_ID]
    assert len(held) <= -(-window // BS) + 1
    # the next token's window starts at num_computed - window + 1: every block before it is the null block
    first_needed = (req.num_computed_tokens - window + 1) // BS
    assert all(b == NULL_BLOCK_ID for b in table[:first_needed]) and NULL_BLOCK_ID not in table[first_needed:]
    assert bm.num_free_blocks == bm.num_usable_blocks - len(held)
    bm.free(req)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_full_attention_keeps_every_block():
    bm = _manager(32, [FullAttentionSpec(BS)])
    req = _req("a", list(range(10)))
    _decode(bm, req, 30)
    assert NULL_BLOCK_ID not in req.block_ids and len(req.block_ids) == -(-req.num_tokens // BS)


def test_hybrid_groups_share_one_pool_and_count_per_group():
    bm = _manager(64, [SlidingWindowSpec(BS, 8), FullAttentionSpec(BS)])
    req = _req("a", list(range(10)))
    _decode(bm, req, 30)
    sliding, full = req.kv_block_ids
    assert len(sliding) == len(full) == -(-req.num_tokens // BS)
    assert NULL_BLOCK_ID not in full and NULL_BLOCK_ID in sliding
    held = [b for b in sliding + full if b != NULL_BLOCK_ID]
    assert len(set(held)) == len(held), "a block belongs to one group at a time"
    assert bm.num_free_blocks == bm.num_usable_blocks - len(held)


def test_admission_counts_blocks_in_every_group():
    bm = _manager(6, [SlidingWindowSpec(BS, 64), FullAttentionSpec(BS)])  # 5 usable blocks
    assert not bm.allocate_slots(_req("a", list(range(12))), 12), "3 blocks per group: 6 > 5 free"
    assert bm.num_free_blocks == 5
    assert bm.allocate_slots(_req("b", list(range(8))), 8) and bm.num_free_blocks == 1


def test_sliding_window_fits_more_requests_than_full_attention():
    def admitted(spec) -> int:
        bm = _manager(20, [spec])
        reqs = [_req(str(i), list(range(i, i + 6))) for i in range(10)]
        n = 0
        for req in reqs:  # every request decodes to 40 tokens while it holds its blocks
            try:
                _decode(bm, req, 34)
            except AssertionError:
                return n
            n += 1
        return n
    assert admitted(SlidingWindowSpec(BS, 8)) > 2 * admitted(FullAttentionSpec(BS))


def test_prefix_hit_in_a_window_needs_only_the_window():
    window = 9  # a hit needs ceil((9 - 1) / 4) = 2 cached blocks before the first token to compute
    bm = _manager(32, [SlidingWindowSpec(BS, window)], caching=True)
    a = _req("a", list(range(40)))
    assert bm.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    b = _req("b", list(range(40)) + [99])
    (hit,), n = bm.get_computed_blocks(b)
    assert n == 40 and len(hit) == 10
    # the blocks before the window are the null block: only the last two are a's
    assert hit[:8] == [NULL_BLOCK_ID] * 8 and hit[8:] == a.block_ids[8:10]
    a_blocks = list(a.block_ids)
    bm.free(a)
    for bid in a_blocks[:8]:  # a's early blocks leave the cache: the hit still holds, from the window's blocks
        bm.block_pool._maybe_evict_cached_block(bm.block_pool.blocks[bid])
    (hit2,), n2 = bm.get_computed_blocks(b)
    assert n2 == 40 and hit2 == hit
    bm.block_pool._maybe_evict_cached_block(bm.block_pool.blocks[a_blocks[8]])  # and now the window's
    (hit3,), n3 = bm.get_computed_blocks(b)
    assert n3 == 0 and hit3 == []


def test_hybrid_hit_is_the_longest_every_group_serves():
    bm = _manager(64, [SlidingWindowSpec(BS, 5), FullAttentionSpec(BS)], caching=True)
    a = _req("a", list(range(24)))
    assert bm.allocate_slots(a, 24)
    a.num_computed_tokens = 24
    sliding, full = a.kv_block_ids
    b = _req("b", list(range(24)) + [1])
    (hs, hf), n = bm.get_computed_blocks(b)
    assert n == 24 and hf == full and hs[-1] == sliding[-1]
    # the sliding group's last block leaves the cache: the hit falls back to where its window holds
    bm.free(a)
    pool = bm.block_pool
    pool._maybe_evict_cached_block(pool.blocks[sliding[5]])
    (hs, hf), n = bm.get_computed_blocks(b)
    assert n == 20 and hf == full[:5] and hs[-1] == sliding[4] and len(hs) == 5


@settings(max_examples=60, deadline=None)
@given(window=st.integers(2, 20), prompt=st.integers(1, 30), steps=st.integers(0, 30), caching=st.booleans())
def test_blocks_conserved_with_windows(window, prompt, steps, caching):
    bm = _manager(48, [SlidingWindowSpec(BS, window), FullAttentionSpec(BS)], caching)
    reqs = [_req("a", [i % 3 for i in range(prompt)]), _req("b", [i % 3 for i in range(prompt)])]
    for req in reqs:
        hits, n = bm.get_computed_blocks(req)
        assert bm.allocate_slots(req, req.num_tokens - n, hits)
        req.num_computed_tokens = req.num_tokens
        for _ in range(steps):
            req.append_token(1)
            assert bm.allocate_slots(req, 1)
            req.num_computed_tokens += 1
        assert len(req.kv_block_ids[0]) == len(req.kv_block_ids[1]) == -(-req.num_tokens // BS)
        if steps:  # (a prefill holds its whole chunk until the next step)
            assert sum(b != NULL_BLOCK_ID for b in req.kv_block_ids[0]) <= -(-window // BS) + 1
    refs = [0] * bm.block_pool.num_gpu_blocks
    for req in reqs:
        for b in (b for group in req.kv_block_ids for b in group if b != NULL_BLOCK_ID):
            refs[b] += 1
    assert all(blk.ref_cnt == refs[blk.block_id] for blk in bm.block_pool.blocks[1:])
    for req in reqs:
        bm.free(req)
    assert bm.num_free_blocks == bm.num_usable_blocks
