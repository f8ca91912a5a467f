"""Rejection sampling for speculative decoding: which draft tokens the target model accepts (Triton).

One program per request walks its draft tokens in order. Draft j is accepted when the target
agrees with it: for a greedy request when it is the target's argmax, otherwise with probability
min(1, p(d) / q(d)) (p the target's, q the draft's probability of that token; an n-gram draft is a
point mass, q = 1). The first rejected draft is replaced by the recovered token (the argmax, or a
draw from the normalised (p - q)+, made by the caller) and the walk stops; if every draft is
accepted the bonus token (the target's own sample after the last draft) follows. This keeps the
output distribution exactly the target's (vLLM V1's ``v1/sample/rejection_sampler.py``).

Output: ``[num_requests, max_drafts + 1]`` token ids, -1 after each request's last token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import instrument


@triton.jit
def _rejection_sample_kernel(
    out_ptr, draft_ptr, cu_drafts_ptr, target_argmax_ptr, target_probs_ptr, draft_probs_ptr, uniform_ptr,
    recovered_ptr, bonus_ptr, is_greedy_ptr,
    stride_out, MAX_DRAFTS: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(cu_drafts_ptr + req)
    end = tl.load(cu_drafts_ptr + req + 1)
    greedy = tl.load(is_greedy_ptr + req)
    rejected = False
    for j in range(MAX_DRAFTS):
        i = start + j
        live = (i < end) & (not rejected)
        if live:
            draft = tl.load(draft_ptr + i)
            if greedy:
                accept = draft == tl.load(target_argmax_ptr + i)
            else:
                accept = tl.load(uniform_ptr + i) * tl.load(draft_probs_ptr + i) < tl.load(target_probs_ptr + i)
            if accept:
                tl.store(out_ptr + req * stride_out + j, draft)
            else:
                tl.store(out_ptr + req * stride_out + j, tl.load(recovered_ptr + i))
                rejected = True
    if not rejected:
        tl.store(out_ptr + req * stride_out + (end - start), tl.load(bonus_ptr + req))


def rejection_sample(draft_token_ids: torch.Tensor, cu_num_drafts: torch.Tensor, target_argmax: torch.Tensor,
                     target_probs: torch.Tensor, draft_probs: torch.Tensor, uniform: torch.Tensor,
                     recovered_token_ids: torch.Tensor, bonus_token_ids: torch.Tensor,
                     is_greedy: torch.Tensor, max_drafts: int) -> torch.Tensor:
    """Triton version of :func:`kernels.reference.rejection_sample_ref` (same arguments and result).

    Per draft token (flattened, request after request; ``cu_num_drafts`` [num_requests + 1] cuts
    them): the target's argmax, the target's and the draft's probability of the draft token, a
    uniform draw, and the recovered token. Per request: the bonus token and whether it is greedy."""
    num_reqs = bonus_token_ids.shape[0]
    out = torch.full((num_reqs, max_drafts + 1), -1, dtype=torch.int64, device=draft_token_ids.device)
    if num_reqs == 0:
        return out
    args = dict(out_ptr=out, draft_ptr=draft_token_ids, cu_drafts_ptr=cu_num_drafts, target_argmax_ptr=target_argmax,
                target_probs_ptr=target_probs, draft_probs_ptr=draft_probs, uniform_ptr=uniform,
                recovered_ptr=recovered_token_ids, bonus_ptr=bonus_token_ids, is_greedy_ptr=is_greedy,
                stride_out=out.stride(0))
    instrument.launch("rejection_sample", _rejection_sample_kernel, (num_reqs,), args,
                      dict(MAX_DRAFTS=max(1, max_drafts)), reason="one program per request")
    return out
