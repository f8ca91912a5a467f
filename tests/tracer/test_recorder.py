import json

import pytest

from engine import LLM, Hooks, SamplingParams
from tracer.bus import EventBus
from tracer.events import EVENT_KEYS, SCHEMA_VERSION, read_trace
from tracer.recorder import Recorder
from tracer.session import TraceSession


@pytest.mark.slow
def test_no_event_lost_at_64_concurrent_requests(tmp_path):
    path = tmp_path / "t.jsonl"
    hooks = Hooks()
    # a ring far smaller than the run: only a writer that keeps up loses nothing (the first
    # step's burst, 64 arrivals and their prefill, must still fit between two polls)
    with TraceSession(hooks, trace_file=path, control=False, capacity=2048) as session:
        llm = LLM("tiny-gpt2", hooks=hooks, block_size=4)
        prompts = [f"request number {i} says hello" for i in range(64)]
        llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
        published = session.bus.next_seq
    header, events = read_trace(path)
    assert [e.seq for e in events] == list(range(published))
    assert published > 2 * 2048  # more than the ring holds: the writer kept up
    assert session.recorder.num_lost == 0
    assert header["model"] is None and header["version"] == SCHEMA_VERSION
    assert sum(e.name == "FINISHED" for e in events) == 64
    running = [len(e.attrs["running"]) for e in events if e.kind == "snapshot"]
    assert max(running) == 64
    with open(path) as f:
        for line in list(f)[1:]:
            assert tuple(json.loads(line)) == EVENT_KEYS


def test_flush_makes_events_visible_and_close_is_idempotent(tmp_path):
    bus = EventBus()
    path = tmp_path / "t.jsonl"
    rec = Recorder(bus, path, model="tiny-gpt2", engine_config={"a": 1}, flush_interval=60)
    bus.publish("engine", "QUEUED", request_id="0", step=0, attrs={"n": 1})
    rec.flush()
    header, events = read_trace(path)  # readable while recording
    assert header["model"] == "tiny-gpt2" and header["engine_config"] == {"a": 1}
    assert [(e.name, e.request_id, e.attrs) for e in events] == [("QUEUED", "0", {"n": 1})]
    bus.publish("engine", "FINISHED", request_id="0")
    rec.close()
    rec.close()
    assert [e.name for e in read_trace(path)[1]] == ["QUEUED", "FINISHED"]


def test_a_lost_stretch_is_written_into_the_trace(tmp_path):
    bus = EventBus(capacity=4)
    path = tmp_path / "t.jsonl"
    rec = Recorder(bus, path, flush_interval=60)
    rec._stop.set()  # stop the writer thread, to fall behind deterministically
    rec.thread.join()
    for i in range(10):
        bus.publish("engine", f"e{i}")
    rec.close()
    _, events = read_trace(path)
    assert (events[0].layer, events[0].name, events[0].attrs) == ("tracer", "events_lost", {"count": 6})
    assert [e.name for e in events[1:]] == ["e6", "e7", "e8", "e9"]
    assert rec.num_lost == 6


def test_close_is_prompt_even_with_a_long_poll_interval(tmp_path):
    """The writer sleeps on the bus for up to poll_interval; close() must not wait that out,
    whether the writer is already asleep or only about to be."""
    import time
    bus = EventBus()
    for _ in range(20):
        rec = Recorder(bus, tmp_path / "t.jsonl", poll_interval=3600)
        t = time.monotonic()
        rec.close()
        assert time.monotonic() - t < 3 and not rec.thread.is_alive()
