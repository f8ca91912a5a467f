"""LLM(multiprocess=True): the engine core in its own process gives the same greedy outputs as
the engine in this one (which the oracle tests hold to transformers'), stop strings included."""
from __future__ import annotations

import time

import pytest

from engine import LLM, Hooks, SamplingParams
from tracer.session import TraceSession

PROMPTS = ["Hello, my name is", "The paged KV cache", "x", "A longer prompt that spans a few blocks of sixteen"]


@pytest.fixture(scope="module")
def both():
    inproc = LLM("tiny-gpt2", block_size=8, num_kv_blocks=64)
    mp = LLM("tiny-gpt2", block_size=8, num_kv_blocks=64, multiprocess=True)
    yield inproc, mp
    mp.shutdown()


def test_same_greedy_tokens_and_text(both):
    inproc, mp = both
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    a, b = inproc.generate(PROMPTS, params, use_tqdm=False), mp.generate(PROMPTS, params, use_tqdm=False)
    assert type(mp.llm_engine.engine_core).__name__ == "SyncMPClient"
    assert type(inproc.llm_engine.engine_core).__name__ == "InprocClient"
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids and x.outputs[0].text == y.outputs[0].text
        assert x.outputs[0].finish_reason == y.outputs[0].finish_reason == "length"
        for ex, ey in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert {t: (lp.rank, lp.decoded_token) for t, lp in ex.items()} == \
                {t: (lp.rank, lp.decoded_token) for t, lp in ey.items()}
            # float noise only: the other process may use another number of threads
            assert all(abs(lp.logprob - ey[t].logprob) < 1e-3 for t, lp in ex.items())


def test_stop_strings_are_matched_in_the_front_end_and_end_the_request_in_the_core(both):
    inproc, mp = both
    full = inproc.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    stop = full[5:8]
    for keep in (False, True):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=keep)
        x = inproc.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        y = mp.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert (x.text, x.finish_reason, x.stop_reason) == (y.text, y.finish_reason, y.stop_reason)
        assert y.finish_reason == "stop" and y.stop_reason == stop
    # the core frees the stopped request's blocks once the abort reaches its next step boundary
    end = time.monotonic() + 30
    while (stats := mp.llm_engine.engine_core.call("stats"))["num_running"] and time.monotonic() < end:
        time.sleep(0.01)
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_bad_prompt_is_a_value_error_and_nothing_is_queued(both):
    _, mp = both
    with pytest.raises(ValueError, match="max_model_len"):
        mp.generate(["fine", "x" * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    end = time.monotonic() + 30  # the abort of "fine" reaches the core's next step boundary
    client = mp.llm_engine.engine_core
    while (stats := client.call("stats"))["num_waiting"] + stats["num_running"] and time.monotonic() < end:
        time.sleep(0.01)
    assert stats["num_waiting"] + stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.slow
def test_the_trace_shows_the_text_cut_at_a_stop_string(both):
    """The core finishes the request without its text; the API server's cut reaches the trace."""
    inproc, _ = both
    full = inproc.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    hooks = Hooks()
    session = TraceSession(hooks, control=False, model="tiny-gpt2")
    mp = LLM("tiny-gpt2", block_size=8, num_kv_blocks=64, multiprocess=True, hooks=hooks)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[full[5:8]])
        out = mp.generate(PROMPTS[0], params, use_tqdm=False)[0]
        end = time.monotonic() + 10  # the core's FINISHED may still be on its way
        while (req := session.state.view().requests.get(out.request_id)) is None or not req.finish_reason:
            assert time.monotonic() < end, "the request never finished in the trace"
            time.sleep(0.02)
        assert out.outputs[0].text == full[:5] and req.text == full[:5] and req.finish_reason == "stop"
    finally:
        mp.shutdown()
        session.close()
