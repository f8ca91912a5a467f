"""End to end: a sampled request through the engine draws from the same distribution with n-gram or
draft-model speculation as without it, over many seeds (the tiny model, top-k 3 so each position has a
few likely tokens).

Compared: output index 1, the first token emitted after a run of drafts (index 0 comes from the
prefill; the prompt repeats, so the n-gram proposer drafts at once), and index 3, a later position
(its distribution mixes every path that leads there). Two-sample chi-square between the runs with
and without speculation, the tokens seen fewer than 10 times in both runs together merged into one
category, below the 0.001 critical value for its degrees of freedom. Measured (240 seeds; statistic,
degrees of freedom): n-gram 0.15 (2) at index 1, 1.63 (5) at index 3; draft model 0.30 (2) and 3.55 (6).
With the recovered token drawn without removing the draft (the broken sampler of
test_sampling_statistics), the n-gram run gives 22.7 (2) and 22.5 (5), over the critical values
13.82 and 20.52: the negative control below.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.sample import rejection_sampler

SEEDS = 240
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "model": "tiny-gpt2-draft", "num_speculative_tokens": 3}
PROMPT = "return a new list of the list of the list of the"
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}  # chi-square, p = 0.001, by degrees of freedom


def _outputs(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=4, ignore_eos=True) for s in range(SEEDS)]
    return [o.outputs[0].token_ids for o in llm.generate([PROMPT] * SEEDS, params, use_tqdm=False)]


def two_sample_chi_square(a: list[int], b: list[int]) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the hypothesis that a and b come from one distribution."""
    tokens = sorted(set(a) | set(b))
    counts = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]], float)
    small = counts.sum(0) < 10  # merged into one category
    if small.any():
        counts = np.concatenate([counts[:, ~small], counts[:, small].sum(1, keepdims=True)], 1)
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdims=True) * counts.sum(0, keepdims=True) / counts.sum()
    return float(((counts - expected) ** 2 / expected).sum()), counts.shape[1] - 1


@pytest.fixture(scope="module")
def without_speculation():
    return _outputs(LLM("tiny-gpt2", num_kv_blocks=512))


def _worst(want: list[list[int]], got: list[list[int]]) -> float:
    """The larger statistic of indices 1 and 3, each divided by its critical value (< 1: the same)."""
    ratios = []
    for index in (1, 3):
        stat, df = two_sample_chi_square([o[index] for o in want], [o[index] for o in got])
        ratios.append(stat / CRITICAL[max(df, 1)])
    return max(ratios)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft_model"])
def test_speculation_keeps_the_sampled_distribution(without_speculation, spec):
    llm = LLM("tiny-gpt2", num_kv_blocks=512, speculative_config=spec)
    got = _outputs(llm)
    assert llm.llm_engine.engine_core.engine_core.stats().spec_num_accepted_tokens > SEEDS // 4  # drafts ran
    assert _worst(without_speculation, got) < 1.0


def test_a_broken_recovered_token_is_caught_end_to_end(without_speculation, monkeypatch):
    def keeps_the_draft(probs, draft_token_ids, seeds, positions, draft_probs=None, backend="torch"):
        return rejection_sampler.gumbel_sample(probs.log(), seeds, positions, 2, backend)

    monkeypatch.setattr(rejection_sampler, "sample_recovered_tokens", keeps_the_draft)
    assert _worst(without_speculation, _outputs(LLM("tiny-gpt2", num_kv_blocks=512, speculative_config=NGRAM))) > 1.0
