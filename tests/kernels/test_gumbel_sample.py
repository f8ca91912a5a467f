"""The Gumbel-max kernel against its reference: the same token for the same (seed, position), any stream;
the noise's hash is MurmurHash3; and the reference's Philox (the acceptance uniform) is Triton's, word for word."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernels import gumbel_sample, gumbel_sample_ref, rand_ref
from kernels.reference import (
    gumbel_noise_ref,
    murmur3_hash32_ref,
    murmur3_uniform32_ref,
    philox_ref,
    uint32_to_uniform_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there, interpreted here


@triton.jit
def _philox_kernel(out_ptr, rand_ptr, seed, N: tl.constexpr):
    offsets = tl.arange(0, N)
    w0, w1, w2, w3 = tl.randint4x(seed, offsets)
    tl.store(out_ptr + offsets, w0.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + N + offsets, w1.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + 2 * N + offsets, w2.to(tl.int64) & 0xFFFFFFFF)
    tl.store(out_ptr + 3 * N + offsets, w3.to(tl.int64) & 0xFFFFFFFF)
    tl.store(rand_ptr + offsets, tl.rand(seed, offsets))


@pytest.mark.parametrize("seed", [0, 1234, -7, 2 ** 63 - 1, -2 ** 63])
def test_philox_reference_is_tritons(seed):
    words = torch.empty(4, 32, dtype=torch.int64, device=DEVICE)
    uniform = torch.empty(32, dtype=torch.float32, device=DEVICE)
    _philox_kernel[(1,)](words, uniform, seed, 32)
    ref = philox_ref(torch.tensor(seed), torch.arange(32))
    assert torch.equal(words.cpu(), torch.stack(ref))
    assert torch.equal(uniform.cpu(), uint32_to_uniform_ref(ref[0]))
    assert torch.equal(rand_ref(torch.tensor(seed), torch.arange(32), stream=0), uniform.cpu())


@pytest.mark.parametrize("stream", [0, 2])
def test_kernel_equals_reference(stream):
    g = torch.Generator().manual_seed(stream)
    logits = torch.randn(6, 300, generator=g) * 3
    logits[2, 100:] = float("-inf")  # top-k / top-p: most tokens cut
    logits[4] = float("-inf")  # nothing allowed: token 0, as the reference
    seeds = torch.tensor([0, 1, -5, 2 ** 62, 12345, -2 ** 63])
    positions = torch.tensor([0, 7, 100, 3, 2 ** 31 + 5, 9])
    got = gumbel_sample(logits.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), stream).cpu()
    assert torch.equal(got, gumbel_sample_ref(logits, seeds, positions, stream))
    assert int(got[2]) < 100 and int(got[4]) == 0


def test_streams_and_positions_are_independent_draws():
    logits = torch.zeros(64, 50)  # uniform: every token equally likely
    seeds = torch.full((64,), 99)
    positions = torch.arange(64)
    by_position = gumbel_sample_ref(logits, seeds, positions)
    assert len(set(by_position.tolist())) > 20  # another position, another draw
    assert not torch.equal(by_position, gumbel_sample_ref(logits, seeds, positions, stream=2))
    assert torch.equal(by_position, gumbel_sample_ref(logits, seeds, positions))  # and nothing else matters


def _dense_gumbel(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """The definition: every token's noise, then each row's argmax (what the kernel computes)."""
    rows, vocab = logits.shape
    hashes = murmur3_hash32_ref(seeds.numpy()[:, None], positions.numpy()[:, None],
                                np.arange(vocab, dtype=np.uint32)[None], stream)
    return torch.from_numpy((logits.numpy() + gumbel_noise_ref(murmur3_uniform32_ref(hashes))).argmax(-1))


@pytest.mark.parametrize("scale", [0.0, 0.01, 1.0, 4.0, 60.0])
def test_reference_scores_only_tokens_that_can_win_and_draws_the_dense_token(scale):
    """The reference skips the noise of tokens that cannot win: the same draw as every token's noise, on flat,
    peaked and tied rows, masked tokens, a row with nothing allowed and vocabularies of 1 to 5,000."""
    g = torch.Generator().manual_seed(int(scale * 100))
    for trial in range(12):
        rows, vocab = int(torch.randint(1, 20, (), generator=g)), int(torch.randint(1, 5000, (), generator=g))
        logits = torch.randn(rows, vocab, generator=g) * scale
        if trial % 3 == 1:
            logits = logits.round()  # ties
        if trial % 3 == 2:
            logits[:, ::3] = float("-inf")
            logits[0] = float("-inf")
        seeds = torch.randint(-2 ** 40, 2 ** 40, (rows,), generator=g)
        positions = torch.randint(0, 10_000, (rows,), generator=g)
        for stream in (0, 2):
            assert torch.equal(gumbel_sample_ref(logits, seeds, positions, stream),
                               _dense_gumbel(logits, seeds, positions, stream))


def _murmur3_x86_32(words: list[int], seed: int) -> int:
    """MurmurHash3_x86_32 of little-endian uint32 words, written out from its specification."""
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    h = seed
    for k in words:
        k = rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= 4 * len(words)
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@pytest.mark.parametrize("seed,pos,domain", [(0, 0, 0), (-5, 2 ** 31 + 5, 0), (2 ** 63 - 1, 7, 2), (-2 ** 63, 3, 0)])
def test_noise_hash_is_murmur3_of_seed_position_and_token(seed, pos, domain):
    """The reference's hash is MurmurHash3 (x86, 32-bit) of the seed's two words, the position's low
    word and the token, seeded with the stream (vLLM 0.33's murmur3_hash32)."""
    tokens = np.arange(40, dtype=np.uint32)
    got = murmur3_hash32_ref(np.array([seed]), np.array([pos]), tokens, domain).tolist()
    s = seed & 0xFFFFFFFFFFFFFFFF
    want = [_murmur3_x86_32([s & 0xFFFFFFFF, s >> 32, pos & 0xFFFFFFFF, t], domain) for t in range(40)]
    assert got == want
    # one (seed, position, token) as plain scalars broadcasts as arrays do
    assert int(murmur3_hash32_ref(seed, pos, 39, domain)) == want[39]
