"""Load and lifecycle through HTTP: many streams at once, disconnects, a paused engine."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"


class Recorder:
    """Collects engine trace events; `wait_for(name, rid)` blocks until one is seen."""

    def __init__(self, hooks):
        self.events, self.cv = [], threading.Condition()
        self.unsubscribe = hooks.subscribe(self)

    def __call__(self, layer, name, kind, request_id, step, attrs):
        with self.cv:
            self.events.append((layer, name, request_id, step, attrs))
            self.cv.notify_all()

    def find(self, name, rid=None):
        return [e for e in self.events if e[1] == name and (rid is None or e[2] == rid)]

    def wait_for(self, name, rid=None, count=1, timeout=60.0) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: len(self.find(name, rid)) >= count, timeout)


@pytest.fixture
def recorder(live):
    rec = Recorder(live.hooks)
    yield rec
    rec.unsubscribe()


@pytest.mark.asyncio
async def test_64_concurrent_streams_all_complete_once(live):
    from openai import AsyncOpenAI

    preemptions = live.stats().num_preemptions

    async def one(client, i):
        stream = await client.completions.create(
            model="tiny-gpt2", prompt=f"Request number {i}:", max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        return [chunk async for chunk in stream]

    async with AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(64)))
    ids = {chunks[0].id for chunks in results}
    assert len(ids) == 64
    for chunks in results:
        assert len({c.id for c in chunks}) == 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
    assert live.stats().num_preemptions > preemptions  # the small cache forced some recomputes
    assert live.all_blocks_free()


@pytest.mark.parametrize("live", ["inproc"], indirect=True)  # it reads the LLMEngine, which "mp" keeps in its core
def test_disconnect_mid_stream_frees_blocks_within_a_step(live, recorder, monkeypatch):
    ae, eng = live.async_engine, live.engine
    asked = {}  # request id -> engine step count when the server asked for the abort
    real_abort = ae.abort
    monkeypatch.setattr(ae, "abort", lambda rid: (asked.setdefault(rid, eng.step_count), real_abort(rid)))
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=60) as c:
        with c.stream("POST", C, json=body) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            rid = json.loads(first[6:])["id"]
        # leaving the block closes the connection with the response unread
    assert recorder.wait_for("ABORTED", rid)
    [(_, _, _, aborted_step, _)] = recorder.find("ABORTED", rid)
    assert aborted_step <= asked[rid] + 1  # at most the step already running when it was asked
    at = recorder.events.index(recorder.find("ABORTED", rid)[0])
    before, after = recorder.events[:at], recorder.events[at:]
    last_block_event = [e for e in before if e[0] == "block_manager" and e[2] == rid][-1]
    assert last_block_event[1] == "free" and last_block_event[4]["block_ids"]  # the abort freed its blocks
    assert not [e for e in after if e[1] == "NEW_TOKENS" and e[2] == rid]
    assert len(recorder.find("NEW_TOKENS", rid)) < 400
    assert live.all_blocks_free()


@pytest.mark.parametrize("live", ["inproc"], indirect=True)  # it reads the LLMEngine, which "mp" keeps in its core
def test_disconnect_during_a_non_streaming_request_aborts_it(live, recorder):
    """The engine is held in a gate, so the request cannot finish before the client gives up."""
    hold = threading.Event()
    def gate(point, info):
        if point == "step":
            with live.engine.hooks.gate_wait():
                hold.wait(30)

    remove = live.engine.hooks.add_gate(gate)
    try:
        with httpx.Client(base_url=live.url, timeout=httpx.Timeout(60, read=0.5)) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post(C, json={"prompt": "Hello", "max_tokens": 50})
        assert recorder.wait_for("ABORTED")  # aborted while still waiting, engine parked
        [(_, _, rid, _, _)] = recorder.find("ABORTED")
        assert rid.startswith("cmpl-") and not recorder.find("NEW_TOKENS", rid)
    finally:
        remove()
        hold.set()
    assert live.all_blocks_free()


@pytest.mark.parametrize("live", ["inproc"], indirect=True)  # it reads the LLMEngine, which "mp" keeps in its core
@pytest.mark.asyncio
async def test_requests_wait_while_the_engine_is_paused(live, recorder):
    eng, hold, parked = live.engine, threading.Event(), threading.Event()

    def gate(point, info):  # what the tracer's controller does on pause
        if point == "step":
            parked.set()
            with eng.hooks.gate_wait():
                hold.wait(30)

    remove = eng.hooks.add_gate(gate)
    try:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as c:
            first = asyncio.create_task(c.post(C, json={"prompt": "Hello", "max_tokens": 4}))
            assert await asyncio.to_thread(parked.wait, 10)
            steps = eng.step_count
            second = asyncio.create_task(c.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 4}))
            assert await asyncio.to_thread(recorder.wait_for, "QUEUED", None, 2)
            metrics = (await c.get("/metrics")).text
            assert 'vllm:num_requests_waiting{engine="0",model_name="tiny-gpt2"} 2.0' in metrics
            assert 'vllm:num_requests_running{engine="0",model_name="tiny-gpt2"} 0.0' in metrics
            assert [r.request_id[:4] for r in eng.scheduler.waiting] == ["cmpl", "chat"]
            assert eng.step_count == steps and not recorder.find("NEW_TOKENS")
            remove()
            hold.set()
            answers = [(await first).json(), (await second).json()]
    finally:
        remove() if eng.hooks._gates else None
        hold.set()
    assert [a["usage"]["completion_tokens"] for a in answers] == [4, 4]
    assert answers[0]["id"] == recorder.find("QUEUED")[0][2]  # the engine's id is the response's id
