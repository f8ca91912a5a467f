"""RejectionSampler: verify draft tokens against the target model (vLLM V1's ``v1/sample/rejection_sampler.py``).

For each request with k drafts the model runner computed k + 1 rows of logits: row j is the
target's distribution for the token after draft j - 1. The acceptance walk (kernels/
rejection_sample.py, Triton, or its PyTorch reference) keeps the drafts while the target agrees:
for a greedy request when a draft is the target's argmax; for a sampled one with probability
p(d) / q(d), q the proposer's (an n-gram proposal is a point mass, q = 1). The first rejected
draft is replaced by a draw from the normalised (p - q)+ (the argmax when greedy); after k
accepted drafts comes the bonus token, the sampler's own draw from row k. So greedy output is the
target's token for token, and sampled output is distributed exactly as without speculation.

Every random number is keyed by the request's seed and the position it decides, as the sampler's
own draw (Model Runner V2): the acceptance uniform of the draft at position t is word 1 of
Philox(seed, t) (kernels.rand_ref, as vLLM's tl_rand32), its recovered token a Gumbel-max draw
whose noise is hashed in domain 2, the sampler's token at t one in domain 0. A request's output
then depends on nothing but its seed, its drafts and the model.

The target's distribution at each position is the one the sampler would use there without
speculation (V1 processes the target logits the same way): the grammar's mask for that position
(the model runner's, before this), then the sampler's logits processors (allowed_token_ids,
bad_words, min_tokens, logit_bias, penalties) with the request as of that position, its output
followed by the drafts before it. Logprobs of each kept token come from its own row, unprocessed,
as the sampler's.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.sample.sampler import Sampler, argmax, gumbel_sample, logprobs_entry, processed_per_position


class RequestAhead:
    """A request as the sampler sees it at a draft position: its tokens so far followed by the
    drafts before that position (what penalties, bad_words and min_tokens read, and the position
    its draw is keyed by)."""
    __slots__ = ("request_id", "params", "sampling_seed", "eos_token_id", "output_token_ids", "all_token_ids")

    def __init__(self, req, drafts: list[int]):
        self.request_id, self.params, self.eos_token_id = req.request_id, req.params, req.eos_token_id
        self.sampling_seed = req.sampling_seed
        self.output_token_ids = req.output_token_ids + drafts
        self.all_token_ids = req.all_token_ids + drafts


def sample_recovered_tokens(probs: torch.Tensor, draft_token_ids: list[int], seeds: np.ndarray, positions: list[int],
                            draft_probs: torch.Tensor | None = None, backend: str = "torch") -> list[int]:
    """The token that replaces a rejected draft, one per row: a draw from the normalised residual
    (p - q)+, p the target's row, q the proposer's (a point mass on the draft when draft_probs is
    None, as n-gram and greedy draft-model drafts are: the draft's own probability removed). Gumbel-max
    keyed by (seed, position), stream 2: independent of the acceptance draw and of the token
    sampled at that position. A residual with no mass left keeps the draft."""
    rows = torch.arange(len(draft_token_ids), device=probs.device)
    draft = torch.tensor(draft_token_ids, device=probs.device)
    if draft_probs is None:
        residual = probs.clone()
        residual[rows, draft] = 0.0
    else:
        residual = (probs - draft_probs).clamp_min(0.0)
    drawn = gumbel_sample(torch.log(residual), seeds, positions, 2, backend)
    empty = (residual.sum(-1) <= 0).tolist()
    return [d if e else t for t, d, e in zip(drawn, draft_token_ids, empty)]


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
    def __init__(self, backend: str = "torch", sampler: Sampler | None = None):
        import kernels  # the Triton interpreter is set up before any kernel is defined

        self.kernels, self.backend = kernels, backend
        # the model runner's sampler (V1 hands it over): its states by slot and its logits processors,
        # applied per draft position
        self.sampler = sampler if sampler is not None else Sampler(backend)

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
        states = self.sampler.states
        slots = states.idx_mapping(requests)
        greedy = (states.temperature[slots] == 0.0).tolist()
        target_argmax = argmax(draft_logits) if flat else []
        target_probs, uniform, recovered = [1.0] * len(flat), [0.0] * len(flat), list(target_argmax)
        rows = [i for r in range(len(requests)) if not greedy[r] for i in range(cu[r], cu[r + 1])]
        if rows:
            self._draw(draft_logits, rows, flat, cu, slots, requests, target_probs, uniform, recovered)
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

    def _draw(self, draft_logits: torch.Tensor, rows: list[int], flat: list[int], cu: list[int], slots: np.ndarray,
              requests: list, target_probs: list, uniform: list, recovered: list) -> None:
        """For the sampled requests' draft rows: the target's probability of each draft (the sampler's
        own processing of the row), the acceptance uniform keyed by (seed, position) (stream 1), and
        the recovered token of each request's first rejected position (the walk stops there and
        never reads the others: a draw over the vocabulary is the verify step's largest cost on a CPU)."""
        req_of = np.searchsorted(np.array(cu), np.array(rows), side="right") - 1
        row_slots = slots[req_of]
        positions = [len(requests[r].all_token_ids) + i - cu[r] for r, i in zip(req_of.tolist(), rows)]
        probs = self.sampler.processed_probs(draft_logits[rows], row_slots)
        p = probs[torch.arange(len(rows), device=probs.device), torch.tensor([flat[i] for i in rows],
                                                                                device=probs.device)].tolist()
        u = self.kernels.rand_ref(torch.from_numpy(self.sampler.states.seeds[row_slots]),
                                  torch.tensor(positions), stream=1).tolist()
        first, seen = [], set()
        for k, (r, i) in enumerate(zip(req_of.tolist(), rows)):
            target_probs[i], uniform[i] = p[k], u[k]
            if r not in seen and not u[k] < p[k]:  # the walk's test, with q = 1
                seen.add(r)
                first.append(k)
        if first:
            tokens = sample_recovered_tokens(probs[first], [flat[rows[k]] for k in first], row_slots[first],
                                             [positions[k] for k in first], backend=self.backend)
            for k, t in zip(first, tokens):
                recovered[rows[k]] = t
