"""AsyncLLM over a core in this process (AsyncInprocClient), on its own: the loop thread,
validation, aborts, idling, gates, shutdown."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import SamplingParams
from engine.engine.exceptions import EngineClosedError

from .conftest import make_engine

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture
def async_engine(model_cache):
    ae = make_engine(num_kv_blocks=64).start()
    yield ae
    ae.stop(drain_timeout=0)


def core_idle(ae, timeout: float = 10) -> bool:
    """Wait until the core holds no request and none is pending (its loop sleeps)."""
    return ae.engine_core.busy_loop._idle.wait(timeout)


async def collect(ae, rid, prompt="Hello", params=GREEDY):
    return [out async for out in ae.generate(prompt, params, rid)]


@pytest.mark.asyncio
async def test_generate_matches_the_offline_engine(async_engine):
    from engine import LLM

    outs = await collect(async_engine, "a")
    lengths = [len(o.outputs[0].token_ids) for o in outs]  # one a step, unless the loop fell behind (merged)
    assert outs[-1].finished and lengths == sorted(set(lengths)) and lengths[-1] == 8
    offline = LLM("tiny-gpt2", num_kv_blocks=64).generate("Hello", GREEDY, use_tqdm=False)[0]
    assert outs[-1].outputs[0].token_ids == offline.outputs[0].token_ids


@pytest.mark.asyncio
async def test_a_consumer_that_falls_behind_gets_one_output_with_every_new_token(async_engine):
    """The RequestOutputCollector keeps the newest (cumulative) output: a stream not read while the
    engine ran 8 steps yields one output, finished, holding all 8 tokens, not 8 queued outputs."""
    stream = await async_engine.add_request("late", "Hello", GREEDY)
    deadline = time.monotonic() + 30
    while async_engine.engine_core.engine_core.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # the engine thread steps; nobody reads the stream
    outs = [out async for out in stream]
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 8
    assert outs[0].outputs[0].token_ids == (await collect(async_engine, "prompt"))[-1].outputs[0].token_ids


@pytest.mark.asyncio
async def test_validation_errors_are_raised_with_nothing_queued(async_engine):
    with pytest.raises(ValueError, match="max_model_len"):
        await async_engine.add_request("long", "x" * 600, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        s = await async_engine.add_request("dup", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))
        await async_engine.add_request("dup", "Hello", GREEDY)
    s.abort()
    await collect(async_engine, "after")  # the loop carries on
    eng = async_engine.engine_core.engine_core
    assert "long" not in eng.requests and not eng.scheduler.waiting


@pytest.mark.asyncio
async def test_cancelling_the_consumer_aborts_and_frees_blocks(async_engine):
    eng = async_engine.engine_core.engine_core
    stream = await async_engine.add_request("long", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))
    first_token = asyncio.Event()

    async def consume():
        async for _ in stream:
            first_token.set()

    task = asyncio.create_task(consume())
    await first_token.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the abort is applied before the next step; an idle engine applies it at once
    done = await asyncio.to_thread(core_idle, async_engine)
    assert done and "long" not in eng.requests
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_usable_blocks


def test_idle_loop_does_not_spin(async_engine):
    eng = async_engine.engine_core.engine_core
    calls = []
    original = eng.has_unfinished_requests
    eng.has_unfinished_requests = lambda: calls.append(1) or original()
    asyncio.run(collect(async_engine, "one"))
    assert core_idle(async_engine)
    before = len(calls)
    time.sleep(0.2)  # an observation window, not synchronisation: nothing may happen in it
    assert len(calls) == before


@pytest.mark.asyncio
async def test_requests_added_while_a_gate_holds_the_engine_reach_waiting(async_engine):
    eng, hold, parked = async_engine.engine_core.engine_core, threading.Event(), threading.Event()

    def gate(point, info):
        if point == "step":
            parked.set()
            with eng.hooks.gate_wait():  # parked: how a gate holds the engine
                hold.wait(30)

    remove = eng.hooks.add_gate(gate)
    try:
        first = asyncio.create_task(collect(async_engine, "first"))
        assert await asyncio.to_thread(parked.wait, 10)
        steps = eng.step_count
        second = await async_engine.add_request("second", "Hi", GREEDY)  # returns: it is in `waiting`
        assert [r.request_id for r in eng.scheduler.waiting] == ["first", "second"]
        assert async_engine.stats.num_waiting == 2 and eng.step_count == steps
        with pytest.raises(ValueError):  # and bad requests still get their error at once
            await async_engine.add_request("bad", "x" * 600, GREEDY)
    finally:
        remove()
        hold.set()
    assert (await first)[-1].finished
    assert [o async for o in second][-1].finished


@pytest.mark.asyncio
async def test_shutdown_drains_in_flight_requests_then_refuses(async_engine):
    stream = await async_engine.add_request("inflight", "Hello", SamplingParams(max_tokens=30, ignore_eos=True))
    shutdown = asyncio.create_task(async_engine.shutdown(drain_timeout=30))
    outs = [out async for out in stream]
    await shutdown
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert not async_engine.is_running
    with pytest.raises(EngineClosedError):
        await async_engine.add_request("late", "Hello", GREEDY)


@pytest.mark.asyncio
async def test_shutdown_aborts_what_does_not_finish_in_time(async_engine):
    stream = await async_engine.add_request("slow", "Hello", SamplingParams(max_tokens=500, ignore_eos=True))
    await async_engine.shutdown(drain_timeout=0)
    with pytest.raises(EngineClosedError):
        async for _ in stream:
            pass
    eng = async_engine.engine_core.engine_core
    assert not eng.requests and eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_usable_blocks


@pytest.mark.asyncio
async def test_the_engine_s_death_fails_streams_refuses_requests_and_is_reported(model_cache):
    """What the executor reports when a tensor-parallel worker dies (EngineCore.on_dead) reaches
    AsyncLLM as a core process's death would: streams fail with the reason, new requests and the
    health check are refused, and the server's on_dead hears it once."""
    from engine import LLM
    from engine.engine.async_llm import AsyncLLM
    from engine.engine.exceptions import EngineDeadError

    reported = []
    core = LLM("tiny-gpt2", num_kv_blocks=64).llm_engine.engine_core.engine_core
    ae = AsyncLLM.from_engine_core(core, drain_timeout=0, on_dead=reported.append).start()
    try:
        stream = await ae.add_request("long", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))
        core.on_dead("worker rank 1 died (signal 9)")  # (on the executor's monitor thread, in a real death)
        with pytest.raises(EngineDeadError, match="worker rank 1 died"):
            async for _ in stream:
                pass
        assert reported == ["engine died: worker rank 1 died (signal 9)"] and not ae.is_running
        with pytest.raises(EngineDeadError, match="engine died"):
            await ae.check_health()
        with pytest.raises(EngineClosedError, match="engine died"):
            await ae.add_request("late", "Hello", GREEDY)
    finally:
        ae.stop(0)
