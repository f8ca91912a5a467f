"""Each per-position processor holds at the exact position where it switches, with and without speculation.

The forced-favourite trick: logit_bias +100 makes a token the model's favourite at every position, so
the output is known exactly: min_tokens lets the stop token (or EOS) through at output index
min_tokens and not one before; max_tokens cuts at max_tokens even when accepted drafts run past it;
a bad word never appears although it is the favourite. The prompt repeats that token, so the n-gram
proposer drafts it again and again: a boundary off by one under speculation (a processor applied to
a draft's row with the request as of the wrong position) emits it one position early or late. A
sampled request (temperature 1, its own seed) must hold the same boundaries. Every mode runs with
async scheduling off and on: on, a request's next positions are placeholders when the next step is
scheduled, and each processor must still switch at the position the output reaches.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, seed=7)}


MODES = ["no_spec", "ngram", "no_spec-async", "ngram-async"]


@pytest.fixture(scope="module")
def engines():
    def make(mode: str) -> LLM:
        spec = dict(speculative_config=NGRAM) if mode.startswith("ngram") else {}
        return LLM("tiny-gpt2", num_kv_blocks=128, async_scheduling=mode.endswith("async"), **spec)

    return {mode: make(mode) for mode in MODES}


def _setup(llm):
    tok = llm.get_tokenizer()
    the = tok.encode(" the")[0]
    return tok, the, " the" * 12  # the prompt: the favourite, over and over (n-gram drafts it)


def _run(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def _accepted(llm) -> int:
    return llm.llm_engine.engine_core.engine_core.stats().spec_num_accepted_tokens


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [1, 4, 5])
def test_min_tokens_lets_the_forced_stop_token_through_exactly_at_min_tokens(engines, mode, sampling, m):
    llm = engines[mode]
    _, the, prompt = _setup(llm)
    out = _run(llm, prompt, min_tokens=m, max_tokens=m + 6, stop_token_ids=[the], logit_bias={the: 100},
               **SAMPLING[sampling])
    assert out.finish_reason == "stop" and len(out.token_ids) == m + 1
    assert out.token_ids[m] == the and the not in out.token_ids[:m]


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_lets_the_forced_eos_through_exactly_at_min_tokens(engines, mode):
    llm = engines[mode]
    tok, the, prompt = _setup(llm)
    eos = tok.eos_token_id
    out = _run(llm, prompt, min_tokens=3, max_tokens=10, logit_bias={eos: 100}, temperature=0.0)
    assert out.finish_reason == "stop" and len(out.token_ids) == 4
    assert out.token_ids[3] == eos and eos not in out.token_ids[:3]


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_cuts_exactly_even_when_drafts_run_past_it(engines, mode, sampling, max_tokens):
    llm = engines[mode]
    _, the, prompt = _setup(llm)
    before = _accepted(llm) if mode.startswith("ngram") else 0
    out = _run(llm, prompt, max_tokens=max_tokens, ignore_eos=True, logit_bias={the: 100}, **SAMPLING[sampling])
    assert out.token_ids == [the] * max_tokens and out.finish_reason == "length"
    if mode.startswith("ngram") and max_tokens > 2:
        assert _accepted(llm) > before  # the forced drafts were verified and accepted


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("mode", MODES)
def test_a_bad_word_never_appears_although_it_is_the_favourite(engines, mode, sampling):
    llm = engines[mode]
    _, the, prompt = _setup(llm)
    out = _run(llm, prompt, max_tokens=12, ignore_eos=True, bad_words=[" the"], logit_bias={the: 100},
               **SAMPLING[sampling])
    assert len(out.token_ids) == 12 and the not in out.token_ids


@pytest.mark.parametrize("mode", MODES)
def test_a_two_token_bad_word_bans_its_end_right_after_its_start(engines, mode):
    """" of the": " the" (forced) is banned exactly after " of"; " of" is forced at every other position,
    so the output alternates only if the ban switches on and off at the right positions."""
    llm = engines[mode]
    tok, the, prompt = _setup(llm)
    of = tok.encode(" of")[0]
    out = _run(llm, " of the" * 8, max_tokens=12, ignore_eos=True, bad_words=[" of the"],
               logit_bias={the: 100, of: 99}, presence_penalty=2.0, temperature=0.0)
    pairs = list(zip(out.token_ids, out.token_ids[1:]))
    assert (of, the) not in pairs and the in out.token_ids and of in out.token_ids
    assert out.token_ids == _run(engines["no_spec"], " of the" * 8, max_tokens=12, ignore_eos=True,
                                 bad_words=[" of the"], logit_bias={the: 100, of: 99}, presence_penalty=2.0,
                                 temperature=0.0).token_ids


PENALTIES = {"frequency": dict(frequency_penalty=1.0), "presence_and_frequency": dict(presence_penalty=2.0,
                                                                                   frequency_penalty=0.5)}


@pytest.mark.parametrize("scheduling", ["", "-async"])
@pytest.mark.parametrize("penalty", PENALTIES)
def test_a_penalty_switches_the_favourite_at_the_same_position_with_speculation(engines, penalty, scheduling):
    """The favourite leads by a little (logit_bias); each repeat costs it more until another token wins.
    The drafts keep proposing the favourite, so the switch happens inside a verified run."""
    base, spec = engines["no_spec"], engines["ngram" + scheduling]
    _, the, prompt = _setup(base)
    kw = dict(max_tokens=16, ignore_eos=True, logit_bias={the: 6.0}, temperature=0.0, **PENALTIES[penalty])
    want = _run(base, prompt, **kw).token_ids
    assert want[0] == the and want.count(the) < len(want)  # the switch happens within the output
    before = _accepted(spec)
    assert _run(spec, prompt, **kw).token_ids == want
    assert _accepted(spec) > before
