"""RejectionSampler: verify draft tokens against the target model (vLLM V1's ``v1/sample/rejection_sampler.py``).

For each request with k drafts the model runner computed k + 1 rows of logits: row j is the
target's distribution for the token after draft j - 1. The acceptance walk (kernels/
rejection_sample.py, Triton, or its PyTorch reference) keeps the drafts while the target agrees:
for a greedy request when a draft is the target's argmax; for a sampled one with probability
p(d) / q(d), q the proposer's (an n-gram proposal is a point mass, q = 1). The first rejected
draft is replaced by a draw from the normalised (p - q)+ (the argmax when greedy); after k
accepted drafts comes the bonus token, the sampler's own draw from row k. So greedy output is the
target's token for token, and sampled output is distributed exactly as without speculation.

The target's distribution at each position is the one the sampler would use there without
speculation (V1 processes the target logits the same way): the grammar's mask for that position
(the model runner's, before this), then the sampler's logits processors (allowed_token_ids,
bad_words, min_tokens, logit_bias, penalties) with the request as of that position, its output
followed by the drafts before it. Logprobs of each kept token come from its own row, unprocessed,
as the sampler's.
"""
from __future__ import annotations

import torch

from engine.sample.sampler import Sampler, argmax, logprobs_entry, processed_per_position, processed_probs


class RequestAhead:
    """A request as the sampler sees it at a draft position: its tokens so far followed by the
    drafts before that position (what penalties, bad_words and min_tokens read)."""
    __slots__ = ("params", "generator", "eos_token_id", "output_token_ids", "all_token_ids")

    def __init__(self, req, drafts: list[int]):
        self.params, self.generator, self.eos_token_id = req.params, req.generator, req.eos_token_id
        self.output_token_ids = req.output_token_ids + drafts
        self.all_token_ids = req.all_token_ids + drafts


def requests_after_drafts(requests: list, drafts: list[list[int]]) -> list:
    """Each request as of the position after its drafts (the row the sampler draws from), where its
    logits processors read its output."""
    return [RequestAhead(r, d) if d and processed_per_position(r.params) else r for r, d in zip(requests, drafts)]


def spec_logprobs(logits: torch.Tensor, drafts: list[list[int]], requests: list, kept: list) -> list | None:
    """Per request that verified drafts and asked for logprobs: (logprobs, rank) of each kept token
    from its own row's log-softmax (before any logits processor, as the sampler's); None if none asked.
    logits: every scored row, 1 + len(drafts[i]) per request."""
    if not any(d and r.params.logprobs is not None for r, d in zip(requests, drafts)):
        return None
    out: list = [None] * len(drafts)
    start = 0
    for i, (req, d) in enumerate(zip(requests, drafts)):
        if d and req.params.logprobs is not None:
            lp = torch.log_softmax(logits[start:start + len(kept[i])].float(), dim=-1)
            out[i] = [logprobs_entry(lp[j], t, req.params.logprobs) for j, t in enumerate(kept[i])]
        start += len(d) + 1
    return out


class RejectionSampler:
    def __init__(self, backend: str = "torch"):
        import kernels  # the Triton interpreter is set up before any kernel is defined

        self.kernels, self.backend = kernels, backend
        self.sampler = Sampler()  # its logits processors, applied per draft position

    def apply_logits_processors(self, draft_logits: torch.Tensor, drafts: list[list[int]],
                                requests: list) -> torch.Tensor:
        """The sampler's logits processors on each draft's row, the request as of that position
        (V1's name). Rows of requests without processors are left as they are."""
        rows, ahead, start = [], [], 0
        for req, d in zip(requests, drafts):
            if processed_per_position(req.params):
                rows += range(start, start + len(d))
                ahead += [RequestAhead(req, d[:j]) for j in range(len(d))]
            start += len(d)
        if not rows:
            return draft_logits
        processed = draft_logits.float().clone()
        processed[rows] = self.sampler.apply_logits_processors(draft_logits[rows], ahead)
        return processed

    def __call__(self, draft_logits: torch.Tensor, drafts: list[list[int]], requests: list,
                 bonus_token_ids: list[int]) -> list[list[int]]:
        """Per request: its accepted drafts, then the recovered or bonus token (1 to k + 1 tokens).
        draft_logits: the rows scoring each draft, request after request (the grammar's mask applied)."""
        draft_logits = self.apply_logits_processors(draft_logits, drafts, requests)
        flat = [t for d in drafts for t in d]
        cu = [0]
        for d in drafts:
            cu.append(cu[-1] + len(d))
        greedy = [r.params.temperature == 0.0 for r in requests]
        target_argmax = argmax(draft_logits) if flat else []
        target_probs, uniform, recovered = [1.0] * len(flat), [0.0] * len(flat), list(target_argmax)
        for r, req in enumerate(requests):
            a, b = cu[r], cu[r + 1]
            if greedy[r] or a == b:
                continue
            # the sampler's own processing of the target's rows, all of the request's drafts at once
            probs = processed_probs(draft_logits[a:b].float(), req.params)
            rows, draft = torch.arange(b - a, device=probs.device), torch.tensor(flat[a:b], device=probs.device)
            target_probs[a:b] = p = probs[rows, draft].tolist()
            uniform[a:b] = u = torch.rand(b - a, generator=req.generator).tolist()
            # Only the first rejected position's recovered token is ever used (the walk stops there), so
            # only it is drawn: a draw over the vocabulary is the verify step's largest cost on a CPU.
            j = next((j for j in range(b - a) if not u[j] < p[j]), None)  # the walk's test, with q = 1
            if j is not None:
                residual = probs[j].clone()
                residual[flat[a + j]] = 0.0  # (p - q)+ for a point-mass q on the draft
                e = torch.empty(residual.shape, dtype=residual.dtype).exponential_(generator=req.generator)
                recovered[a + j] = argmax(residual / e.to(residual.device)) if residual.sum() > 0 else flat[a + j]
        args = dict(draft_token_ids=torch.tensor(flat, dtype=torch.int64), cu_num_drafts=torch.tensor(cu),
                    target_argmax=torch.tensor(target_argmax, dtype=torch.int64),
                    target_probs=torch.tensor(target_probs), draft_probs=torch.ones(len(flat)),
                    uniform=torch.tensor(uniform), recovered_token_ids=torch.tensor(recovered, dtype=torch.int64),
                    bonus_token_ids=torch.tensor(bonus_token_ids, dtype=torch.int64),
                    is_greedy=torch.tensor(greedy), max_drafts=max(map(len, drafts)))
        if self.backend == "triton":
            device = draft_logits.device
            out = self.kernels.rejection_sample(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                                   for k, v in args.items()})
        else:
            out = self.kernels.instrument.call("rejection_sample_ref", self.kernels.rejection_sample_ref, args,
                                               reason="attention_backend=torch: PyTorch reference")
        return [[t for t in row if t >= 0] for row in out.tolist()]
