"""Attention sinks (gpt-oss): the Triton kernel equals its PyTorch reference with and without a
sliding window, on one program per query block, stacked programs and split-KV; the reference
equals transformers' eager computation (the sink as one more softmax column, dropped before the
values); and a launch without sinks compiles the sink out and records no sinks argument."""
import pytest
import torch
from kernel_batches import make_batch

from kernels import INTERPRETED, AttentionConfig, instrument, unified_attention, unified_attention_ref
from kernels.config import MIN_COMPILED_SCORE_COLUMNS

WINDOW = 20
TILE = 16 if INTERPRETED else MIN_COMPILED_SCORE_COLUMNS
QUERY_LENS, SEQ_LENS = [1, 1, 6, 1], [40, 70, 50, 9]  # decodes past the window and inside it; a chunk; GQA 2
CONFIGS = {
    "auto": None,
    "gpu": AttentionConfig(block_q=4, q_blocks_per_program=1, tile_n=TILE, heads_per_program=1),
    "split": AttentionConfig(block_q=2, q_blocks_per_program=2, tile_n=16, heads_per_program=1, num_segments=3),
}


def _batch(seed=0):
    b = make_batch(QUERY_LENS, SEQ_LENS, q_heads=4, kv_heads=2, head_size=32, block_size=TILE, seed=seed)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=b.query.device)  # from barely there to most of the weight
    return b, sinks


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_sinks_match_reference(config, window):
    b, sinks = _batch()
    ref = unified_attention_ref(*b.args(), sliding_window=window, sinks=sinks)
    out = unified_attention(*b.args(), config=CONFIGS[config], sliding_window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=0)
    plain = unified_attention_ref(*b.args(), sliding_window=window)
    assert not torch.allclose(ref, plain, atol=1e-2), "the sinks change nothing here"


@pytest.mark.parametrize("window", [None, WINDOW])
def test_reference_is_transformers_eager(window):
    """transformers' eager_attention_forward: logits with the sink appended, softmax, sink dropped."""
    b, sinks = _batch(seed=1)
    out = unified_attention_ref(*b.args(), sliding_window=window, sinks=sinks)
    bs, qsl = b.key_cache.shape[1], b.query_start_loc.tolist()
    for r, (q_len, seq_len) in enumerate(zip(QUERY_LENS, SEQ_LENS)):
        blocks = b.block_tables[r, :-(-seq_len // bs)].long()
        k = b.key_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(2, dim=1)  # [seq, q heads, dim]
        v = b.value_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(2, dim=1)
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = max(0, p - window + 1) if window else 0
            logits = torch.einsum("hd,khd->hk", b.query[qsl[r] + i], k[lo:p + 1]) * b.scale
            w = torch.softmax(torch.cat([logits, sinks[:, None]], dim=-1), dim=-1)[:, :-1]
            torch.testing.assert_close(out[qsl[r] + i], torch.einsum("hk,khd->hd", w, v[lo:p + 1]), atol=1e-4, rtol=0)


def test_without_sinks_nothing_is_paid():
    b, sinks = _batch(seed=2)
    records = []
    with instrument.observe(records.append):
        unified_attention(*b.args(), config=CONFIGS["gpu"])
        unified_attention(*b.args(), config=CONFIGS["gpu"], sinks=sinks)
    plain, sunk = records
    assert plain.meta["USE_SINKS"] is False and "sinks" not in plain.args
    assert sunk.meta["USE_SINKS"] is True and sunk.args["sinks"] == ((4,), "float32")
