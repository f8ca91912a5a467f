import threading

import pytest
import torch
from kernel_batches import DEVICE, make_batch

from kernels import (
    INTERPRETED,
    AttentionConfig,
    CacheConfig,
    choose_config,
    instrument,
    reshape_and_cache,
    unified_attention,
    unified_attention_ref,
)
from kernels.config import MIN_COMPILED_SCORE_COLUMNS

TILE = 16 if INTERPRETED else MIN_COMPILED_SCORE_COLUMNS  # compiled kernels need 32 (see kernels.config)
GPU_SHAPED = AttentionConfig(block_q=4, q_blocks_per_program=1, tile_n=TILE, heads_per_program=1)
# The cache write of three tokens as one program, as the interpreter launches it; forced so the
# GPU (one token per program) records the same grid and access map.
CACHE_ONE_PROGRAM = CacheConfig(tokens_per_program=4, block_hd=64, num_warps=1)


def _known_batch():
    # Query rows: request 0 -> [0, 1), request 1 -> [1, 7) after an 8-token prefix, request 2 -> [7, 10).
    return make_batch([1, 6, 3], [9, 14, 3], q_heads=4, kv_heads=2, head_size=32, block_size=4, seed=5)


def _record_launches(fn, **tags):
    records = []
    with instrument.observe(records.append, **tags):
        fn()
    return records


def test_recorded_grid_equals_hand_computed_grid():
    b = _known_batch()
    (rec,) = _record_launches(lambda: unified_attention(*b.args(), config=GPU_SHAPED))
    # Request r's query blocks start at qsl[r] // 4 + r: 0, 1//4 + 1 = 1, 7//4 + 2 = 3, and the
    # grid bound is num_tokens // 4 + num_seqs = 10 // 4 + 3 = 5 (block 4 is idle); 2 KV heads.
    assert rec.name == "unified_attention"
    assert rec.grid == (5, 2, 1)
    assert rec.meta["BLOCK_Q"] == 4 and rec.meta["HEADS_PER_PROG"] == 1 and rec.meta["TILE_N"] == TILE
    assert rec.args["query"] == ((10, 4, 32), "float32")
    assert rec.args["block_tables"][1] == "int32"
    assert rec.reason == "caller-supplied config"
    # CUDA events time a compiled kernel; the wall clock an interpreted one.
    assert rec.timing == ("cuda_event" if DEVICE == "cuda" else "wall_clock") and rec.duration_ns > 0


@pytest.mark.skipif(not INTERPRETED, reason="a GPU gets many small programs (tests/kernels/test_attention_config.py)")
def test_interpreter_decode_batch_is_one_program():
    # The model's decode step: 8 requests x 4 heads x 64-token contexts -> a single fat program.
    b = make_batch([1] * 8, [64] * 8, q_heads=4, kv_heads=4, head_size=32, block_size=16)
    (rec,) = _record_launches(lambda: unified_attention(*b.args()))
    cfg, reason = choose_config(num_tokens=8, num_seqs=8, num_q_heads=4, num_kv_heads=4, head_size=32,
                                block_size=16, max_query_len=1, max_seq_len=64, target="interpreter")
    assert rec.grid == (1, 1, 1)
    assert rec.reason == reason and cfg.q_blocks_per_program == 8 and cfg.heads_per_program == 4
    assert sorted(a.request for a in rec.access_map[(0, 0, 0)]) == list(range(8))


def test_access_map_lists_the_physical_blocks_of_a_program():
    b = _known_batch()
    bt = b.block_tables
    (rec,) = _record_launches(lambda: unified_attention(*b.args(), config=GPU_SHAPED))
    # Program (2, 1): request 1's second query block (rows 5, 6) on KV head 1. Its last row sits
    # at position 8 + 5 = 13, so it reads keys 0..13: logical blocks 0..3 of request 1.
    (acc,) = rec.access_map[(2, 1, 0)]
    assert (acc.request, acc.rows, acc.kv_heads, acc.kv_positions) == (1, (5, 7), (1,), (0, 14))
    assert acc.q_heads == (2, 3)  # GQA, 4 query heads on 2 KV heads: query heads 2 and 3 read KV head 1
    assert acc.blocks == tuple(bt[1, :4].tolist())
    # Its first query block (rows 1..4) stops at key 11: three blocks.
    assert rec.access_map[(1, 0, 0)][0].blocks == tuple(bt[1, :3].tolist())
    assert (4, 0, 0) not in rec.access_map  # the idle block does no work
    # Snapshot: rewriting the metadata after the launch does not change the record.
    bt.fill_(-5)
    assert rec.access_map[(2, 1, 0)][0].blocks == acc.blocks


def test_access_map_covers_every_block_the_kernel_reads():
    # Poison every cache block that no program claims to read: the output must not change.
    b = make_batch([1, 5, 1], [40, 21, 7], q_heads=2, kv_heads=2, head_size=32, block_size=8, seed=6)
    split = AttentionConfig(block_q=2, q_blocks_per_program=1, tile_n=TILE, heads_per_program=1, num_segments=2)
    for config in (None, GPU_SHAPED, split):
        k, v = b.key_cache.clone(), b.value_cache.clone()
        rec = _record_launches(lambda: unified_attention(*b.args(), config=config))[0]
        claimed = {blk for accs in rec.access_map.values() for a in accs for blk in a.blocks}
        unclaimed = [i for i in range(k.shape[0]) if i not in claimed]
        k[unclaimed] = float("nan")
        v[unclaimed] = float("nan")
        out = unified_attention(b.query, k, v, *b.args()[3:], config=config)
        torch.testing.assert_close(out, unified_attention_ref(*b.args()), atol=1e-3, rtol=0)


def test_split_kv_access_map_has_segments():
    b = make_batch([1], [40], q_heads=2, kv_heads=2, head_size=32, block_size=16, seed=7)
    cfg = AttentionConfig(block_q=1, q_blocks_per_program=1, tile_n=TILE, heads_per_program=2, num_segments=3)
    attn, reduce = _record_launches(lambda: unified_attention(*b.args(), config=cfg))
    assert (attn.name, attn.grid, reduce.name) == ("unified_attention_split_kv", (1, 1, 3), "reduce_segments")
    # One tile per segment; segment 1 reads keys [TILE, 2 TILE) of the 40: with 16-key tiles
    # [16, 32) = logical block 1, with 32-key tiles [32, 40) = logical block 2.
    (seg1,) = attn.access_map[(0, 0, 1)]
    expected_blocks = (int(b.block_tables[0, TILE // 16]),)
    assert (seg1.segment, seg1.kv_positions, seg1.blocks) == (1, (TILE, min(2 * TILE, 40)), expected_blocks)


def test_cache_write_record_and_access_map():
    key = torch.randn(3, 2, 32, device=DEVICE)
    cache = torch.zeros(4, 8, 2, 32, device=DEVICE)
    slots = torch.tensor([17, -1, 3], device=DEVICE)
    (rec,) = _record_launches(
        lambda: reshape_and_cache(key, key, cache, cache.clone(), slots, config=CACHE_ONE_PROGRAM), step=1)
    assert rec.name == "reshape_and_cache" and rec.grid == (1, 1) and rec.tags == {"step": 1}
    (acc,) = rec.access_map[(0, 0, 0)]
    assert acc.blocks == (2, 0) and acc.rows == (0, 3) and acc.kv_heads == (0, 1)


def test_before_launch_runs_before_each_launch():
    key = torch.ones(1, 1, 16, device=DEVICE)
    cache = torch.zeros(2, 8, 1, 16, device=DEVICE)
    events = []

    def before(name, grid, meta):
        # The hook runs before the kernel: the cache is still untouched.
        events.append(("before", name, grid, float(cache.sum()), meta["TOKENS"]))

    with instrument.observe(lambda r: events.append(("after", r.name, r.grid, float(cache.sum()), None)), before):
        reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0], device=DEVICE))
        reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([9], device=DEVICE))
    assert [(e[0], e[3]) for e in events] == [("before", 0.0), ("after", 16.0), ("before", 16.0), ("after", 32.0)]
    assert events[0][1:3] == ("reshape_and_cache", (1, 1)) and events[0][4] == 1


def test_observe_nests_and_restores_tags():
    key = torch.ones(1, 1, 16, device=DEVICE)
    cache = torch.zeros(2, 8, 1, 16, device=DEVICE)

    def write():
        reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([0], device=DEVICE))

    outer, inner = [], []
    instrument.set_tags(ignored=True)  # nobody observes: a no-op
    with instrument.observe(outer.append, step=1):
        instrument.set_tags(layer=0)
        write()
        with instrument.observe(inner.append, phase="attn"):
            assert instrument.current_tags() == {"step": 1, "layer": 0, "phase": "attn"}
            instrument.set_tags(layer=5)
            write()
        write()  # back in the outer block: its tags are as they were
    write()  # nobody observes
    assert [r.tags for r in outer] == [
        {"step": 1, "layer": 0},
        {"step": 1, "layer": 5, "phase": "attn"},
        {"step": 1, "layer": 0},
    ]
    assert [r.tags for r in inner] == [{"step": 1, "layer": 5, "phase": "attn"}]
    assert instrument.current_tags() == {}


def test_observation_is_thread_local():
    key = torch.ones(1, 1, 16, device=DEVICE)
    cache = torch.zeros(2, 8, 1, 16, device=DEVICE)
    seen = []
    with instrument.observe(seen.append, who="main"):
        slot = torch.tensor([1], device=DEVICE)
        t = threading.Thread(target=lambda: reshape_and_cache(key, key, cache, cache.clone(), slot))
        t.start()
        t.join()
        assert seen == []  # the other thread's launch was not observed here
        reshape_and_cache(key, key, cache, cache.clone(), torch.tensor([2], device=DEVICE))
    assert [r.tags for r in seen] == [{"who": "main"}]


def test_access_map_snapshot_is_taken_only_for_an_observer_that_reads_maps():
    key = torch.randn(3, 2, 32, device=DEVICE)
    cache = torch.zeros(4, 8, 2, 32, device=DEVICE)
    slots = torch.tensor([17, -1, 3], device=DEVICE)

    def write():
        reshape_and_cache(key, key, cache, cache.clone(), slots, config=CACHE_ONE_PROGRAM)

    (plain,) = _record_launches(write, access_maps=False)
    assert plain.access_map == {} and plain.grid == (1, 1)  # no metadata snapshot was taken for it
    outer, inner = [], []
    with instrument.observe(outer.append):  # one observer that reads maps is enough
        with instrument.observe(inner.append, access_maps=False):
            write()
    assert inner[0] is outer[0] and outer[0].access_map[(0, 0, 0)][0].blocks == (2, 0)


def test_each_tensor_is_described_as_it_is_at_its_launch():
    """Shapes are read at launch time (converted to plain data later, on first access), so a
    tensor changed after its launch is still described as it was; launches whose arguments
    look the same share one description."""
    seen = []
    def fn(**kw):
        return None

    shared = torch.zeros(2, 3, dtype=torch.int32)
    with instrument.observe(seen.append):
        for rows in (1, 2, 3, 4, 4):
            fresh = torch.zeros(rows, 8)  # the previous one is freed: its address may be reused
            instrument.call("f", fn, {"query": fresh, "block_tables": shared, "scale": 0.5})
            fresh.resize_(7, 7)  # after the launch: not what it was launched with
            del fresh
    assert [r.args["query"] for r in seen] == [((rows, 8), "float32") for rows in (1, 2, 3, 4, 4)]
    assert all(r.args["block_tables"] == ((2, 3), "int32") for r in seen)
    assert all(set(r.args) == {"query", "block_tables"} for r in seen)  # tensors only
    assert seen[3].args is seen[4].args and seen[2].args is not seen[3].args
