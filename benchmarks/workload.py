"""The seeded benchmark workload shared by every benchmark: varied prompt and output lengths."""
from __future__ import annotations

import random

from engine import SamplingParams


def make_workload(num_requests: int = 32, vocab_size: int = 257, seed: int = 0,
                  prompt_len: tuple[int, int] = (8, 96), output_len: tuple[int, int] = (8, 64),
                  ) -> list[tuple[list[int], SamplingParams]]:
    """num_requests (prompt_token_ids, greedy params) pairs; EOS ignored so lengths are exact."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt = [rng.randrange(vocab_size - 1) for _ in range(rng.randint(*prompt_len))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(*output_len), ignore_eos=True)
        work.append((prompt, params))
    return work
