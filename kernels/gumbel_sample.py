"""Gumbel-max sampling keyed by (seed, position) (Triton; vLLM 0.33's ``worker/gpu/sample/gumbel.py``).

argmax(logits + g) with g_t = -log(-log(u_t)) independent Gumbel noise is a draw from
softmax(logits). Here u_t comes from a hash, as in vLLM 0.33: MurmurHash3 of (seed, position,
token t) (``murmur3_hash32``), its 32 bits made a float32 uniform in (0, 1). So a request's draw
depends only on its seed and the position of the token it samples, never on its batch-mates, on
the step it lands in, or on how many draws came before (a preempted request draws the same tokens
again). ``STREAM`` is the hash's domain: 0 for the token itself (vLLM's), 2 for a speculative
step's recovered token, so the draws at one position are independent (the acceptance uniform is
Philox's, :func:`kernels.reference.rand_ref`, as vLLM's ``tl_rand32``).

Program (i, j) takes tokens [j * BLOCK, (j + 1) * BLOCK) of row i and writes its block's best
token and value; a torch max over the blocks picks each row's token (as MRv2 does). A row of
-inf logits (nothing allowed) gives token 0. The noise is float32, log(1 - u) by a series below
0.25 (vLLM's ``_log1p_neg_stable``), so the winning tail u -> 0 keeps its precision.

Why a hash and not Philox (which this sampler used before vLLM moved off it): on a CPU the
reference hashes every token of every row, and Philox's ten rounds of 64-bit products made
sampling most of a served step (64 rows of 4,096 tokens: 84 ms with Philox in numpy, 5 ms with
the hash, on the 2-core VM). The reference then computes the noise itself (two logs) only for the
tokens whose hash leaves them a chance to win (``reference._gumbel_argmax``): the same token,
32 rows of 4,096 in two thirds of the time (2.6 -> 1.7 ms of CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import instrument
from kernels._env import INTERPRETED


@triton.jit
def _rotl32(value, shift: tl.constexpr):
    return (value << shift) | (value >> (32 - shift))


@triton.jit
def _murmur3_mix(h, key):
    key *= 0xCC9E2D51
    key = _rotl32(key, 15)
    key *= 0x1B873593
    h ^= key
    h = _rotl32(h, 13)
    return h * 5 + 0xE6546B64


@triton.jit
def _murmur3_fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def murmur3_hash32(seed, pos, offset, domain: tl.constexpr):
    """vLLM's: the seed's two words and the position's low word mixed first, the offset last."""
    seed = seed.to(tl.int64)
    pos = pos.to(tl.int64)
    h = (seed ^ seed).to(tl.uint32)
    h ^= domain
    h = _murmur3_mix(h, (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur3_mix(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur3_mix(h, (pos & 0xFFFFFFFF).to(tl.uint32))
    h = _murmur3_mix(h, offset.to(tl.uint32))
    return _murmur3_fmix32(h ^ 16)


@triton.jit
def murmur3_uniform32(random32):
    """(random32 + 0.5) / 2**32 in float32, from two exact 16-bit halves."""
    hi16 = (random32 >> 16).to(tl.int32)
    lo16 = (random32 & 0xFFFF).to(tl.int32)
    return hi16.to(tl.float32) * 1.52587890625e-05 + (lo16.to(tl.float32) + 0.5) * 2.3283064365386963e-10


@triton.jit
def _log1p_neg_stable(value):
    polynomial = 1.0 / 8.0
    polynomial = 1.0 / 7.0 + value * polynomial
    polynomial = 1.0 / 6.0 + value * polynomial
    polynomial = 1.0 / 5.0 + value * polynomial
    polynomial = 1.0 / 4.0 + value * polynomial
    polynomial = 1.0 / 3.0 + value * polynomial
    polynomial = 1.0 / 2.0 + value * polynomial
    polynomial = 1.0 + value * polynomial
    series = -value * polynomial
    direct = tl.log(tl.maximum(1.0 - value, 5.960464477539063e-08))
    return tl.where(value < 0.25, series, direct)


@triton.jit
def _gumbel_sample_kernel(
    local_argmax_ptr, local_max_ptr, logits_ptr, seeds_ptr, pos_ptr,
    vocab_size, stride_logits, num_blocks,
    BLOCK: tl.constexpr, STREAM: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    tokens = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    logits = tl.load(logits_ptr + row * stride_logits + tokens, mask=in_vocab, other=float("-inf")).to(tl.float32)
    seed = tl.load(seeds_ptr + row)
    pos = tl.load(pos_ptr + row)
    u = murmur3_uniform32(murmur3_hash32(seed, pos, tokens, STREAM))
    noise = -tl.log(-_log1p_neg_stable(u))
    scores = tl.where(in_vocab, logits + noise, float("-inf"))
    best = tl.argmax(scores, axis=0)
    tl.store(local_argmax_ptr + row * num_blocks + block, block * BLOCK + best)
    tl.store(local_max_ptr + row * num_blocks + block, tl.max(scores, axis=0))


def gumbel_sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Triton version of :func:`kernels.reference.gumbel_sample_ref` (same arguments and result):
    one token per row of ``logits`` [num_rows, vocab], drawn from softmax(row) with the noise of
    (``seeds[i]``, ``positions[i]``) int64."""
    num_rows, vocab = logits.shape
    assert logits.stride(-1) == 1, "the vocabulary dimension must be contiguous"
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    if INTERPRETED:  # each program costs the interpreter a Python-level launch: one per row
        block, reason = min(triton.next_power_of_2(vocab), 8192), "interpreter: one program per row (<= 8192 tokens)"
    else:
        block, reason = 1024, "GPU: 1024 tokens per program, a max over the blocks after"
    num_blocks = triton.cdiv(vocab, block)
    local_argmax = torch.empty(num_rows, num_blocks, dtype=torch.int64, device=logits.device)
    local_max = torch.empty(num_rows, num_blocks, dtype=torch.float32, device=logits.device)
    args = dict(local_argmax_ptr=local_argmax, local_max_ptr=local_max, logits_ptr=logits, seeds_ptr=seeds,
                pos_ptr=positions, vocab_size=vocab, stride_logits=logits.stride(0), num_blocks=num_blocks)
    instrument.launch("gumbel_sample", _gumbel_sample_kernel, (num_rows, num_blocks), args,
                      dict(BLOCK=block, STREAM=stream), reason=reason)
    return local_argmax.gather(1, local_max.argmax(-1, keepdim=True))[:, 0]
