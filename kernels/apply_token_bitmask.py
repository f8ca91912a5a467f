"""Structured outputs' grammar mask, applied to the logits (Triton): every token the grammar does
not allow next gets -inf, so no sampling method can pick it.

The mask is packed as xgrammar fills it, 32 tokens per int32 word: token t is allowed when bit
t % 32 of word t // 32 is set. Program (i, j) handles tokens [j * BLOCK, (j + 1) * BLOCK) of mask
row i: it loads the BLOCK / 32 words, expands each token's bit and writes -inf where it is 0 into
logits row ``indices[i]`` (only the batch's constrained requests have a mask row).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import instrument
from kernels._env import INTERPRETED


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, bitmask_ptr, indices_ptr,
    vocab_size, stride_logits, stride_bitmask,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab_size
    logits_row = tl.load(indices_ptr + row).to(tl.int64)
    words = tl.load(bitmask_ptr + row * stride_bitmask + tokens // 32, mask=in_vocab, other=0)
    allowed = ((words >> (tokens % 32)) & 1) != 0  # an arithmetic shift, but "& 1" keeps only the bit asked for
    tl.store(logits_ptr + logits_row * stride_logits + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """Triton version of :func:`kernels.reference.apply_token_bitmask_ref` (same semantics, in place)."""
    num_rows, vocab = bitmask.shape[0], logits.shape[-1]
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1, "the vocabulary dimension must be contiguous"
    assert bitmask.dtype == torch.int32 and bitmask.shape[1] * 32 >= vocab, "one bit per token, 32 per int32"
    if num_rows == 0:
        return
    if INTERPRETED:  # each program costs the interpreter a Python-level launch: a few large ones
        block, reason = min(triton.next_power_of_2(vocab), 8192), "interpreter: one program per row (<= 8192 tokens)"
    else:
        block, reason = 1024, "GPU: 1024 tokens (32 words) per program, many programs per row"
    grid = (num_rows, triton.cdiv(vocab, block))
    args = dict(logits_ptr=logits, bitmask_ptr=bitmask, indices_ptr=indices, vocab_size=vocab,
                stride_logits=logits.stride(0), stride_bitmask=bitmask.stride(0))
    instrument.launch("apply_token_bitmask", _apply_token_bitmask_kernel, grid, args,
                      dict(BLOCK=block, num_warps=4), reason=reason)
