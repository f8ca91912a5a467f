import pytest
import torch
from kernel_batches import DEVICE

from kernels import CacheConfig, reshape_and_cache, reshape_and_cache_ref


def _inputs(num_tokens, heads, head_size, block_size, num_blocks, *, cache_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # K and V as views of one fused qkv projection: the token stride is 3x the row size.
    qkv = torch.randn(num_tokens, 3, heads, head_size, generator=g).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    # Distinct slots scattered over shuffled blocks; some tokens are padding (slot -1).
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::3] = -1
    cache = torch.full((num_blocks, block_size, heads, head_size), 7.0, dtype=cache_dtype, device=DEVICE)
    return key, value, cache, cache.clone(), slots.to(DEVICE)


@pytest.mark.parametrize(
    "num_tokens,heads,head_size,block_size,cache_dtype,config",
    [
        (1, 4, 32, 16, torch.float32, None),  # a single decode token
        (13, 2, 64, 8, torch.float32, None),
        (11, 4, 80, 32, torch.float16, None),  # non-power-of-two head, converting to fp16
        # GPU-shaped config: one token per program, head tiles that split heads mid-way.
        (9, 4, 80, 16, torch.float32, CacheConfig(tokens_per_program=1, block_hd=64)),
        (20, 2, 64, 16, torch.float32, CacheConfig(tokens_per_program=8, block_hd=32)),
    ],
)
def test_reshape_and_cache_matches_reference_exactly(num_tokens, heads, head_size, block_size, cache_dtype, config):
    key, value, key_cache, value_cache, slots = _inputs(num_tokens, heads, head_size, block_size, 6,
                                                        cache_dtype=cache_dtype)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots, config=config)
    assert torch.equal(key_cache, ref_k)
    assert torch.equal(value_cache, ref_v)
    # Padding tokens really were skipped: untouched slots keep the fill value.
    written = (slots >= 0).sum().item() * heads * head_size
    assert (key_cache != 7.0).sum().item() <= written


def test_reshape_and_cache_empty_batch_is_a_no_op():
    key, value, key_cache, value_cache, slots = _inputs(0, 2, 32, 16, 2)
    before = key_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, before)
