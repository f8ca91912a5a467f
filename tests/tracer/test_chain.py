"""A request's events, read back from the recorded file, form the chain through the layers.

The full chain starts and ends at `http`; the server adds those layers, so that test belongs
to the integration. Here: everything from the tokenizer to the detokenizer."""
import pytest

from engine import LLM, Hooks, SamplingParams
from tracer.events import read_trace
from tracer.journey import CHAIN, layer_path, missing_links, request_events
from tracer.session import TraceSession
from tracer_helpers import simulate_kernel_events

ENGINE_CHAIN = CHAIN[2:-1]  # tokenizer ... detokenizer


def record(path, simulate_kernels):
    hooks = Hooks()
    with TraceSession(hooks, trace_file=path, control=False):
        llm = LLM("tiny-gpt2", hooks=hooks, block_size=4)
        if simulate_kernels:
            simulate_kernel_events(llm.llm_engine)
        outs = llm.generate(["first request", "second one"], SamplingParams(max_tokens=4, temperature=0),
                            use_tqdm=False)
    return [o.request_id for o in outs], read_trace(path)[1]


@pytest.mark.xfail(strict=False, reason="kernel events wired at merge")
def test_request_chain_from_tokenizer_to_detokenizer_with_real_kernel_events(tmp_path):
    ids, events = record(tmp_path / "t.jsonl", simulate_kernels=False)
    for rid in ids:
        assert missing_links(layer_path(request_events(events, rid)), ENGINE_CHAIN) == []


def test_request_chain_with_kernel_events_in_place(tmp_path):
    """The same chain check, with kernel events emitted where the integration will emit them."""
    ids, events = record(tmp_path / "t.jsonl", simulate_kernels=True)
    for rid in ids:
        path = layer_path(request_events(events, rid))
        assert missing_links(path, ENGINE_CHAIN) == []
        assert path[:len(ENGINE_CHAIN)] == list(ENGINE_CHAIN)  # no other layer cuts in


def test_missing_links_reports_gaps_and_order():
    assert missing_links(list(CHAIN)) == []
    assert missing_links(["http", "api", "engine", "tokenizer"], ("http", "tokenizer", "engine"))[0].startswith(
        "engine missing or out of order")
    assert missing_links(["http"], ("http", "kernel")) == ["kernel missing or out of order after ['http']"]
