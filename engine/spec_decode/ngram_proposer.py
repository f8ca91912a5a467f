"""NgramProposer: prompt-lookup drafts (vLLM V1's ``v1/spec_decode/ngram_proposer.py``), run in
the worker after sampling, from the tokens it keeps for each request.

The request's own tokens (prompt and output) are the draft model: find the longest suffix of
prompt_lookup_max down to prompt_lookup_min tokens that occurred earlier, and propose the tokens
that followed its most recent earlier occurrence. It costs no model call, and wins where text
repeats itself: code, quotes, and a small model's greedy loops ("of the list of the list").
"""
from __future__ import annotations

from engine.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose_requests(self, requests: list, max_model_len: int) -> dict[str, list[int]]:
        """Drafts for each of the worker's requests that sampled this step (it decodes next), from
        its tokens. Every sampling setting is verified exactly (the rejection sampler applies the
        sampler's processing at each draft position)."""
        drafts = {}
        for req in requests:
            n, num_prompt = len(req.all_token_ids), req.num_prompt_tokens
            max_tokens = req.params.max_tokens if req.params.max_tokens is not None else max_model_len - num_prompt
            room = min(max_tokens - (n - num_prompt), max_model_len - n) - 1
            proposal = self.propose(req.all_token_ids, room)
            if proposal:
                drafts[req.request_id] = proposal
        return drafts

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow token_ids (none if no suffix recurs)."""
        n, limit = len(token_ids), min(self.k, max_drafts)
        if limit <= 0 or n < self.min_n + 1:
            return []
        last = token_ids[-1]
        # candidates: earlier positions holding the last token, most recent first
        ends = [i for i in range(n - 2, -1, -1) if token_ids[i] == last]
        for size in range(min(self.max_n, n - 1), self.min_n - 1, -1):
            suffix = token_ids[n - size:]
            for end in ends:
                start = end - size + 1
                if start >= 0 and token_ids[start:end + 1] == suffix:
                    return token_ids[end + 1:end + 1 + limit]
        return []
