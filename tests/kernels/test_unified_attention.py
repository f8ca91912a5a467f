import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_batches import DEVICE, make_batch

from kernels import (
    INTERPRETED,
    AttentionConfig,
    reshape_and_cache,
    reshape_and_cache_ref,
    unified_attention,
    unified_attention_ref,
)
from kernels.config import MIN_COMPILED_SCORE_COLUMNS

# (query_lens, seq_lens, q_heads, kv_heads, head_size, block_size). Each line covers several
# items: seq_len == query_len is a fresh prompt, seq_len > query_len a cached prefix.
CASES = {
    # decode-only; contexts on and off block boundaries, including a 1-token context
    "decode": ([1, 1, 1, 1, 1], [17, 32, 1, 40, 9], 4, 4, 64, 16),
    # prefill-only; a 1-token prompt; GQA 2; head 80 (padded to 128)
    "prefill": ([7, 16, 1], [7, 16, 1], 4, 2, 80, 8),
    # mixed: decode rows, a chunked prefill after a 28-token cached prefix, a fresh prompt; GQA 4
    "mixed_gqa4": ([1, 12, 1, 5], [30, 40, 8, 5], 8, 2, 64, 32),
    # mixed with head 80, GQA 1, block 16; chunk ends exactly on a block boundary
    "mixed_h80": ([3, 1, 9], [3, 33, 32], 2, 2, 80, 16),
}

# Configs the tests force, to run every code path under the interpreter, not just the one
# choose_config picks here. "gpu" is the shape a GPU gets: one head, one query block per program.
# Tiles of 16 keys give short contexts several tiles; compiled kernels need 32 (see kernels.config).
TILE = 16 if INTERPRETED else MIN_COMPILED_SCORE_COLUMNS
CONFIGS = {
    "auto": None,
    "gpu": AttentionConfig(block_q=4, q_blocks_per_program=1, tile_n=TILE, heads_per_program=1),
    "split": AttentionConfig(block_q=2, q_blocks_per_program=2, tile_n=16, heads_per_program=1, num_segments=3),
}


def _batch(name, seed=0):
    q_lens, seq_lens, qh, kvh, d, bs = CASES[name]
    return make_batch(q_lens, seq_lens, q_heads=qh, kv_heads=kvh, head_size=d, block_size=bs, seed=seed)


@pytest.mark.parametrize(
    "case,config",
    [(c, "auto") for c in CASES] + [("decode", "gpu"), ("mixed_gqa4", "gpu"), ("prefill", "gpu"),
                                    ("decode", "split"), ("mixed_h80", "split")],
)
def test_attention_matches_reference(case, config):
    b = _batch(case)
    ref = unified_attention_ref(*b.args())
    out = unified_attention(*b.args(), config=CONFIGS[config])
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=0)


def test_split_kv_with_empty_segments():
    # 6 segments of one TILE-key tile over contexts of 1..40 keys: most programs of the short
    # requests get no tile at all and must contribute nothing to the merge.
    b = _batch("decode", seed=1)
    cfg = AttentionConfig(block_q=1, q_blocks_per_program=1, tile_n=TILE, heads_per_program=2, num_segments=6)
    torch.testing.assert_close(
        unified_attention(*b.args(), config=cfg), unified_attention_ref(*b.args()), atol=1e-3, rtol=0
    )


def test_writes_into_out_and_ignores_stale_block_table_entries():
    b = _batch("mixed_gqa4", seed=2)
    out = torch.full_like(b.query, float("nan"))
    # Garbage past each request's last block must never be followed.
    bt = b.block_tables.clone()
    bt[:, -1] = 10**6
    ret = unified_attention(b.query, b.key_cache, b.value_cache, b.query_start_loc, b.seq_lens, bt, b.scale, out)
    assert ret is out
    torch.testing.assert_close(out, unified_attention_ref(*b.args()), atol=1e-3, rtol=0)


def test_fp16_cache_accumulates_in_fp32():
    q_lens, seq_lens, qh, kvh, d, bs = CASES["mixed_h80"]
    b = make_batch(q_lens, seq_lens, q_heads=qh, kv_heads=kvh, head_size=d, block_size=bs, dtype=torch.float16)
    torch.testing.assert_close(unified_attention(*b.args()), unified_attention_ref(*b.args()), atol=2e-3, rtol=0)


def test_chunked_prefill_after_cache_write_end_to_end():
    """The engine's order: write this step's K/V into the cache, then attend over it."""
    g = torch.Generator().manual_seed(3)
    heads, d, bs = 2, 64, 8
    q_lens, seq_lens = [4, 1, 6], [11, 20, 6]  # chunk after a 7-token prefix, a decode, a prompt
    b = make_batch(q_lens, seq_lens, q_heads=heads, kv_heads=heads, head_size=d, block_size=bs, seed=3)
    # Slots of the new tokens: positions seq_len - q_len .. seq_len - 1 of each request.
    slots = [int(b.block_tables[r, p // bs]) * bs + p % bs
             for r, (q, s) in enumerate(zip(q_lens, seq_lens)) for p in range(s - q, s)]
    slots = torch.tensor(slots + [-1], device=DEVICE)  # plus one padding token
    key, value = torch.randn(2, len(slots), heads, d, generator=g).to(DEVICE)
    query = torch.cat([b.query, torch.zeros(1, heads, d, device=DEVICE)])
    qsl = b.query_start_loc

    k_ref, v_ref = b.key_cache.clone(), b.value_cache.clone()
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    ref = unified_attention_ref(query, k_ref, v_ref, qsl, b.seq_lens, b.block_tables, b.scale)

    reshape_and_cache(key, value, b.key_cache, b.value_cache, slots)
    out = unified_attention(query, b.key_cache, b.value_cache, qsl, b.seq_lens, b.block_tables, b.scale)
    n = int(qsl[-1])  # the padding row is not part of any request
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-3, rtol=0)


@st.composite
def _random_batches(draw):
    n = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    contexts = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    q_heads, kv_heads = draw(st.sampled_from([(2, 2), (4, 2), (4, 1), (6, 2)]))  # incl. GQA 3 (not a power of 2)
    head_size = draw(st.sampled_from([16, 48]))
    block_size = draw(st.sampled_from([8, 16, 32]))
    config = draw(st.sampled_from(list(CONFIGS)))
    seed = draw(st.integers(0, 2**16))
    return q_lens, [q + c for q, c in zip(q_lens, contexts)], q_heads, kv_heads, head_size, block_size, config, seed


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True)
@given(_random_batches())
def test_attention_matches_reference_on_random_batches(params):
    q_lens, seq_lens, qh, kvh, d, bs, config, seed = params
    b = make_batch(q_lens, seq_lens, q_heads=qh, kv_heads=kvh, head_size=d, block_size=bs, seed=seed)
    out = unified_attention(*b.args(), config=CONFIGS[config])
    torch.testing.assert_close(out, unified_attention_ref(*b.args()), atol=1e-3, rtol=0)


@pytest.mark.skipif(not INTERPRETED, reason="only the interpreter lacks bfloat16")
def test_interpreter_rejects_bfloat16_instead_of_returning_garbage():
    b = make_batch([1], [9], q_heads=2, kv_heads=2, head_size=16, block_size=8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        unified_attention(*b.args())


def test_reference_workspace_gives_the_same_result_and_reuses_its_buffers():
    from kernels.reference import Workspace

    ws = Workspace()
    for name in ("mixed_h80", "decode", "mixed_gqa4"):
        b = _batch(name)
        out = unified_attention_ref(*b.args(), workspace=ws)
        torch.testing.assert_close(out, unified_attention_ref(*b.args()), atol=0, rtol=0)
    like = torch.zeros(1)
    first = ws.get("x", (4, 8), like)
    assert first.shape == (4, 8)
    assert ws.get("x", (2, 8), like).data_ptr() == first.data_ptr()  # smaller: the same memory
    assert ws.get("x", (5, 8), like).data_ptr() == first.data_ptr()  # within the quarter to spare
    bigger = ws.get("x", (100, 8), like)
    assert bigger.shape == (100, 8) and bigger.data_ptr() != first.data_ptr()
    assert ws.get("x", (100, 8), torch.zeros(1, dtype=torch.float64)).dtype == torch.float64
