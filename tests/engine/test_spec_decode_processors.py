"""Speculative decoding with the sampler's logits processors: at each verified position the target is
what the sampler would use there without speculation (penalties, bad_words and min_tokens count the
drafts before it as output), so greedy output is the same token for token, and the logprobs of the
kept tokens are the non-speculative ones. The prompts loop (" list of the list of the"), so the
n-gram proposer drafts exactly the tokens these settings forbid or penalise: each setting changes
the output if the drafts' rows were verified unprocessed."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
PROMPTS = ["the list of the list of the list of the", "one of the best of the best of the",
           "The number of the number of"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def engines():
    return LLM("tiny-gpt2", num_kv_blocks=128), LLM("tiny-gpt2", num_kv_blocks=128, speculative_config=NGRAM)


def _settings(tok) -> dict[str, dict]:
    lst, of, the = (tok.encode(w)[0] for w in (" list", " of", " the"))
    return {
        "repetition_penalty": dict(repetition_penalty=1.3),
        "presence_frequency": dict(presence_penalty=0.8, frequency_penalty=0.3),
        "logit_bias": dict(logit_bias={lst: -100, the: -3.0}),
        "allowed_token_ids": dict(allowed_token_ids=list(range(200, 700))),
        "bad_words": dict(bad_words=["of the", "list of"]),
        "min_tokens": dict(min_tokens=10, stop_token_ids=[lst, of]),  # position-dependent: a stop only from 10
    }


@pytest.mark.parametrize("setting", ["repetition_penalty", "presence_frequency", "logit_bias", "allowed_token_ids",
                                     "bad_words", "min_tokens"])
def test_greedy_with_speculation_equals_without(engines, setting):
    base, spec = engines
    kw = _settings(base.get_tokenizer())[setting]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, **kw)
    want = [o.outputs[0] for o in base.generate(PROMPTS, params, use_tqdm=False)]
    core = spec.llm_engine.engine_core.engine_core
    before = core.stats().spec_num_accepted_tokens
    got = [o.outputs[0] for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert core.stats().spec_num_accepted_tokens > before  # drafts were verified, some accepted
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_logprobs_of_accepted_tokens_equal_the_non_speculative_ones(engines):
    """Each kept token's logprobs come from its own row. Equal up to float rounding: the same request's
    logprobs differ by ~1e-5 without speculation too, between batch compositions (another matmul shape)."""
    base, spec = engines
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3)
    want = [o.outputs[0] for o in base.generate(PROMPTS, params, use_tqdm=False)]
    core = spec.llm_engine.engine_core.engine_core
    before = core.stats().spec_num_accepted_tokens
    got = [o.outputs[0] for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert core.stats().spec_num_accepted_tokens > before
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert lg.keys() == lw.keys()
            for t in lw:
                assert lg[t].rank == lw[t].rank and lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4)


@pytest.mark.slow
def test_two_processes_with_logprobs_and_penalties():
    """The kept tokens' logprobs cross the process boundary with them."""
    base = LLM("tiny-gpt2", num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, presence_penalty=0.5)
    want = [o.outputs[0] for o in base.generate(PROMPTS[:2], params, use_tqdm=False)]
    mp = LLM("tiny-gpt2", num_kv_blocks=128, speculative_config=NGRAM, multiprocess=True)
    try:
        got = [o.outputs[0] for o in mp.generate(PROMPTS[:2], params, use_tqdm=False)]
    finally:
        mp.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [[sorted(e) for e in o.logprobs] for o in got] == [[sorted(e) for e in o.logprobs] for o in want]


@pytest.mark.slow
def test_tensor_parallel_ships_the_kept_tokens_logprobs():
    base = LLM("tiny-gpt2", num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, repetition_penalty=1.2)
    want = [o.outputs[0] for o in base.generate(PROMPTS[:2], params, use_tqdm=False)]
    tp = LLM("tiny-gpt2", num_kv_blocks=128, speculative_config=NGRAM, tensor_parallel_size=2)
    try:
        got = [o.outputs[0] for o in tp.generate(PROMPTS[:2], params, use_tqdm=False)]
        assert tp.llm_engine.engine_core.engine_core.stats().spec_num_accepted_tokens > 0
    finally:
        tp.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [[sorted(e) for e in o.logprobs] for o in got] == [[sorted(e) for e in o.logprobs] for o in want]
