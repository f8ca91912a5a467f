import pytest

from kernels import choose_cache_config, choose_config

MODEL = dict(num_q_heads=4, num_kv_heads=4, head_size=32, block_size=16)


def _choose(num_seqs, max_query_len, max_seq_len, target, num_sms=132, **model):
    shape = {**MODEL, **model}
    return choose_config(num_tokens=num_seqs * max_query_len, num_seqs=num_seqs, max_query_len=max_query_len,
                         max_seq_len=max_seq_len, target=target, num_sms=num_sms, **shape)


def test_cuda_splits_a_small_long_decode_batch():
    cfg, reason = _choose(2, 1, 8192, "cuda")
    # 2 requests x 4 KV heads = 8 programs on 132 SMs: ceil(264 / 8) = 33, capped at 16.
    assert cfg.num_segments == 16 and "split-KV" in reason
    assert cfg.heads_per_program == 1 and cfg.q_blocks_per_program == 1


@pytest.mark.parametrize(
    "num_seqs,max_query_len,max_seq_len,why",
    [
        (2, 1, 300, "too short"),  # short contexts: segments would be under 4 tiles
        (128, 1, 8192, "already fill"),  # 512 programs fill 132 SMs twice over
        (2, 7, 8192, "prefill"),  # the split path is for decode-only batches
    ],
)
def test_cuda_does_not_split(num_seqs, max_query_len, max_seq_len, why):
    cfg, reason = _choose(num_seqs, max_query_len, max_seq_len, "cuda")
    assert cfg.num_segments == 1 and why in reason


def test_cuda_stacks_gqa_heads_into_16_rows():
    cfg, _ = _choose(4, 9, 100, "cuda", num_q_heads=8, num_kv_heads=2)
    assert cfg.block_q * 4 == 16  # 4 query heads per KV head x 4 tokens


def test_interpreter_never_splits_and_folds_work():
    cfg, reason = _choose(2, 1, 8192, "interpreter")
    assert cfg.num_segments == 1 and "never split" in reason
    assert cfg.heads_per_program == 4 and cfg.tile_n == 256
    cfg, _ = _choose(3, 40, 100, "interpreter", num_q_heads=12, num_kv_heads=12, head_size=64)
    # 12 heads of 64: the widest power-of-two divisor within 1024 columns is 4 heads.
    assert cfg.heads_per_program == 4 and cfg.block_q == 64


def test_cache_config_per_target():
    gpu, _ = choose_cache_config(num_tokens=100, num_kv_heads=12, head_size=64, target="cuda")
    cpu, _ = choose_cache_config(num_tokens=100, num_kv_heads=12, head_size=64, target="interpreter")
    assert gpu.tokens_per_program == 1 and cpu.tokens_per_program == 16  # 16384 // 1024 elements
