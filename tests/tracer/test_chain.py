"""A request's events, read back from the recorded file, form the chain through the layers.

The full chain starts and ends at `http`; the server adds those layers, so that test belongs
to the integration. Here: everything from the tokenizer to the detokenizer."""

import pytest

from engine import LLM, Hooks, SamplingParams
from tracer.events import read_trace
from tracer.journey import CHAIN, layer_path, missing_links, request_events
from tracer.session import TraceSession

ENGINE_CHAIN = CHAIN[2:-1]  # tokenizer ... detokenizer


def record(path):
    hooks = Hooks()
    with TraceSession(hooks, trace_file=path, control=False):
        llm = LLM("tiny-gpt2", hooks=hooks, block_size=4)
        outs = llm.generate(["first request", "second one"], SamplingParams(max_tokens=4, temperature=0),
                            use_tqdm=False)
    return [o.request_id for o in outs], read_trace(path)[1]


@pytest.mark.slow
def test_request_chain_from_tokenizer_to_detokenizer(tmp_path):
    ids, events = record(tmp_path / "t.jsonl")
    for rid in ids:
        path = layer_path(request_events(events, rid))
        assert missing_links(path, ENGINE_CHAIN) == []
        assert path[:len(ENGINE_CHAIN)] == list(ENGINE_CHAIN)  # no other layer cuts in


def test_missing_links_reports_gaps_and_order():
    assert missing_links(list(CHAIN)) == []
    assert missing_links(["http", "api", "engine", "tokenizer"], ("http", "tokenizer", "engine"))[0].startswith(
        "engine missing or out of order")
    assert missing_links(["http"], ("http", "kernel")) == ["kernel missing or out of order after ['http']"]
