"""Sliding-window attention: the Triton kernel equals its PyTorch reference, the reference equals
attention computed directly over each query's window, and the kernel's programs never load the
blocks wholly before their queries' windows (they may belong to another request by then)."""
import pytest
import torch
from kernel_batches import make_batch

from kernels import INTERPRETED, AttentionConfig, unified_attention, unified_attention_ref
from kernels.config import MIN_COMPILED_SCORE_COLUMNS

WINDOW = 20
TILE = 16 if INTERPRETED else MIN_COMPILED_SCORE_COLUMNS
# decodes far past the window and inside it, and a chunked prefill after a cached prefix; GQA 2
QUERY_LENS, SEQ_LENS = [1, 1, 6, 1], [40, 70, 50, 9]
CONFIGS = {
    "auto": None,
    "gpu": AttentionConfig(block_q=4, q_blocks_per_program=1, tile_n=TILE, heads_per_program=1),
    "split": AttentionConfig(block_q=2, q_blocks_per_program=2, tile_n=16, heads_per_program=1, num_segments=3),
}


def _batch(seed=0):
    return make_batch(QUERY_LENS, SEQ_LENS, q_heads=4, kv_heads=2, head_size=32, block_size=TILE, seed=seed)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_window_matches_reference(config):
    b = _batch()
    ref = unified_attention_ref(*b.args(), sliding_window=WINDOW)
    out = unified_attention(*b.args(), config=CONFIGS[config], sliding_window=WINDOW)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=0)
    assert not torch.allclose(ref, unified_attention_ref(*b.args()), atol=1e-3), "the window changes nothing here"


def test_reference_attends_over_the_window_only():
    b = _batch(seed=1)
    out = unified_attention_ref(*b.args(), sliding_window=WINDOW)
    bs, qsl = b.key_cache.shape[1], b.query_start_loc.tolist()
    for r, (q_len, seq_len) in enumerate(zip(QUERY_LENS, SEQ_LENS)):
        blocks = b.block_tables[r, :-(-seq_len // bs)].long()
        k = b.key_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(2, dim=1)  # [seq, q heads, dim]
        v = b.value_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(2, dim=1)
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = max(0, p - WINDOW + 1)
            q = b.query[qsl[r] + i]  # [q heads, dim]
            w = torch.softmax(torch.einsum("hd,khd->hk", q, k[lo:p + 1]) * b.scale, dim=-1)
            torch.testing.assert_close(out[qsl[r] + i], torch.einsum("hk,khd->hd", w, v[lo:p + 1]), atol=1e-4, rtol=0)


def test_programs_skip_the_blocks_before_the_window():
    # one query block per program and a tile of one block: a block wholly before the window of the
    # block's first query is never loaded, so NaN there cannot reach the output
    b = _batch(seed=2)
    ref = unified_attention_ref(*b.args(), sliding_window=WINDOW)
    bs = b.key_cache.shape[1]
    poisoned = b.block_tables.clone()
    nan_block = int(b.block_tables.max()) + 1
    key_cache = torch.cat([b.key_cache, torch.full_like(b.key_cache[:1], float("nan"))])
    value_cache = torch.cat([b.value_cache, torch.full_like(b.value_cache[:1], float("nan"))])
    skipped = 0
    for r, (q_len, seq_len) in enumerate(zip(QUERY_LENS, SEQ_LENS)):
        first_key = seq_len - q_len - WINDOW + 1
        for j in range(max(0, first_key) // bs):
            poisoned[r, j] = nan_block
            skipped += 1
    assert skipped >= 3
    out = unified_attention(b.query, key_cache, value_cache, b.query_start_loc, b.seq_lens, poisoned, b.scale,
                            config=CONFIGS["gpu"], sliding_window=WINDOW)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=0)
