"""Gumbel-max sampling keyed by (seed, position) (Triton; vLLM 0.33's ``worker/gpu/sample/gumbel.py``).

argmax(logits + g) with g_t = -log(-log(u_t)) independent Gumbel noise is a draw from
softmax(logits). Here u_t comes from Philox, Triton's counter-based generator: the row's key is
the first word of Philox(seed, position), and u_t = Philox(key, t) for each token t. So a
request's draw depends only on its seed and the position of the token it samples, never on its
batch-mates, on the step it lands in, or on how many draws came before (a preempted request
draws the same tokens again). ``STREAM`` picks another word of Philox(seed, position): 0 for the
token itself, 2 for a speculative step's recovered token (1 is the acceptance uniform,
:func:`kernels.reference.rand_ref`), so the draws at one position are independent.

Program (i, j) takes tokens [j * BLOCK, (j + 1) * BLOCK) of row i and writes its block's best
token and value; a torch max over the blocks picks each row's token (as MRv2 does). A row of
-inf logits (nothing allowed) gives token 0. Noise is computed in float64 with MRv2's 1e-20
guards, so u = 0 never gives an infinite value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import instrument
from kernels._env import INTERPRETED


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
    w0, w1, w2, w3 = tl.randint4x(seed, pos)
    key = w0 if STREAM == 0 else (w1 if STREAM == 1 else (w2 if STREAM == 2 else w3))
    u = tl.rand(key, tokens).to(tl.float64)
    noise = (-tl.log(-tl.log(u + 1e-20) + 1e-20)).to(tl.float32)
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
