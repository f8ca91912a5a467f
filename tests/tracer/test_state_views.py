"""What the fold keeps for the TUI (timelines, prefix-cache view of free blocks, histories),
checked against the engine's own structures after a real run."""
import json
import time

import pytest
from tracer_helpers import EngineThread

from engine import LLM, Hooks, SamplingParams
from tracer.session import TraceSession
from tracer.state import HISTORY, TraceState

SHARED = "A shared prefix, a shared prefix! "


def run_engine(**kw):
    hooks = Hooks()
    session = TraceSession(hooks, control=False)
    kw.setdefault("async_scheduling", False)  # the fold is checked against the engine after each whole step
    llm = LLM("tiny-gpt2", hooks=hooks, block_size=4, **kw)
    engine = llm.llm_engine
    return session, engine


def cached_free_blocks(engine):
    bm = engine.engine_core.engine_core.kv_cache_manager
    return {b for b in bm.block_pool.free_block_queue if bm.block_pool.blocks[b].block_hash is not None}


@pytest.mark.slow
def test_cached_free_blocks_match_the_block_pool_at_every_step():
    session, engine = run_engine(num_kv_blocks=24, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, p in enumerate([SHARED + "one", SHARED + "two", "Hello there", SHARED + "three", "x" * 30]):
        engine.add_request(str(i), p, params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        state = session.state.view()
        assert state.cached_free == cached_free_blocks(engine), state.step
        checked += 1
    # Later requests reuse cached blocks: the view must follow evictions and hits back out.
    for i, p in enumerate([SHARED + "four", "y" * 40, "z" * 40]):
        engine.add_request(f"b{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
        assert session.state.view().cached_free == cached_free_blocks(engine)
    names = [e.name for e in session.bus.read(0)[0] if e.layer == "block_manager"]
    assert "cache_hit" in names and "evict" in names and checked > 5
    session.close()


@pytest.mark.slow
def test_timeline_follows_the_request_through_prefill_chunks_decode_and_finish():
    session, engine = run_engine(max_num_batched_tokens=8, async_scheduling=True)
    engine.add_request("r", "x" * 20, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    EngineThread(engine).start().join()
    req = session.state.view().requests["r"]
    kinds = [t["event"] for t in req.timeline]
    assert kinds == ["QUEUED", "SCHEDULED", "prefill", "prefill", "prefill", "decode", "FINISHED"]
    chunks = [(t["from_token"], t["tokens"]) for t in req.timeline if t["event"] == "prefill"]
    assert chunks == [(0, 8), (8, 8), (16, 4)]
    decode = req.timeline[-2]
    assert decode["steps"] == 4 and decode["last_step"] == decode["step"] + 3  # 5 tokens: 1 from prefill
    assert req.arrival_ns <= req.timeline[2]["ts_ns"] <= req.finished_ns
    session.close()


@pytest.mark.slow
def test_histories_are_per_step_and_bounded():
    session, engine = run_engine(async_scheduling=True)
    engine.add_request("r", "hello", SamplingParams(max_tokens=HISTORY + 10, temperature=0, ignore_eos=True))
    EngineThread(engine).start().join()
    state = session.state.view()
    assert len(state.kv_usage_history) == HISTORY and 0 < max(state.kv_usage_history) < 1
    launched = {e.name for e in session.bus.read(0)[0] if e.layer == "kernel" and e.step is not None}
    assert set(state.kernel_history) == launched
    assert all(len(v) == HISTORY and min(v) > 0 for v in state.kernel_history.values())
    session.close()


def test_state_survives_a_round_trip_through_json():
    session, engine = run_engine()
    engine.add_request("r", SHARED, SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    state = session.state.view()
    again = TraceState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again.to_dict() == state.to_dict()
    assert again.requests["r"].timeline == state.requests["r"].timeline
    session.close()


def test_serve_stages_join_the_engine_stages_but_the_server_span_does_not():
    from tracer.bus import EventBus
    from tracer.state import fold
    bus, state = EventBus(), TraceState()
    for name in ("args", "config"):
        bus.publish("cli", name, "begin")
        bus.publish("cli", name, "end", attrs={"seconds": 0.5})
    bus.publish("engine", "model_load", "begin")
    bus.publish("engine", "model_load", "end", attrs={"seconds": 1.0, "params": 3})
    bus.publish("cli", "http_ready", "begin")
    bus.publish("cli", "serve", "begin", attrs={"url": "http://x"})
    for ev in bus.read(0)[0]:
        fold(state, ev)
    assert [st["stage"] for st in state.startup] == ["args", "config", "model_load"]
    assert state.startup_current["stage"] == "http_ready"  # in progress: serve's span is no stage


def _ev(seq, layer, name, kind="instant", rid=None, **attrs):
    from tracer.events import Event
    return Event(seq, seq, layer, name, kind, rid, None, attrs or None)


def test_a_live_state_keeps_only_the_latest_finished_requests():
    """A server's state must not grow with its age: the oldest finished requests are dropped
    (the trace file keeps them), refused ones when their response ends, and a dropped
    request's late events (its response ending) do not bring it back."""
    from tracer.state import fold
    s, seq = TraceState(max_finished=3), 0
    for i in range(10):
        rid = f"r{i}"
        for layer, name, kind in [("http", "POST /v1/completions", "begin"), ("engine", "QUEUED", "instant"),
                                  ("engine", "FINISHED", "instant")]:
            seq += 1
            fold(s, _ev(seq, layer, name, kind, rid))
        if i == 0:
            for _ in range(4):  # r0 is dropped before its response ends
                seq += 1
                fold(s, _ev(seq, "engine", "QUEUED", "instant", f"x{seq}"))
                seq += 1
                fold(s, _ev(seq, "engine", "FINISHED", "instant", f"x{seq - 1}"))
            seq += 1
            fold(s, _ev(seq, "http", "POST /v1/completions", "end", "r0", status=200))
    assert s.finished == ["r7", "r8", "r9"] and s.num_finished == 14
    assert set(s.requests) == {"r7", "r8", "r9"}  # r0's late end did not revive it
    seq += 1
    fold(s, _ev(seq, "http", "POST /v1/completions", "begin", "bad"))
    assert "bad" in s.requests
    seq += 1
    fold(s, _ev(seq, "http", "POST /v1/completions", "end", "bad", status=400))
    assert "bad" not in s.requests  # refused before the engine: nothing to keep
    assert TraceState.from_dict(json.loads(s.to_json())["state"]).finished == ["r7", "r8", "r9"]


def test_to_json_matches_to_dict_and_survives_what_orjson_refuses():
    session, engine = run_engine()
    engine.add_request("r", "Hello", SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    state = session.state.view()
    assert json.loads(state.to_json(seq=1)) == json.loads(json.dumps({"state": state.to_dict(), "seq": 1}))
    state.requests["r"].text = "\ud800"  # not representable in UTF-8: the slow path replaces it
    assert json.loads(state.to_json())["state"]["requests"]["r"]["text"] == "\ufffd"
    session.close()


def test_live_state_follows_the_bus_by_itself():
    session, engine = run_engine()
    session.state.follow(interval=0.01)
    engine.add_request("r", "Hello", SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    n = session.bus.next_seq
    end = time.monotonic() + 30
    while session.state.state.num_events < n and time.monotonic() < end:
        time.sleep(0.01)  # polling a condition, with a deadline
    session.state.stop_following()
    assert session.state.state.num_events == n and "r" in session.state.state.finished
    session.close()


def test_text_survives_a_finish_that_comes_before_the_last_tokens():
    """The engine core in its own process: its FINISHED (no text: it does not detokenize)
    arrives before the API server's NEW_TOKENS for that step. The answer keeps every piece;
    a FINISHED with text (one process) still has the last word (a stop string cuts)."""
    from tracer.bus import EventBus
    from tracer.state import LiveState
    bus = EventBus()
    live = LiveState(bus)
    bus.publish("engine", "QUEUED", request_id="a", attrs={"num_prompt_tokens": 2})
    bus.publish("detokenizer", "NEW_TOKENS", request_id="a", attrs={"token_ids": [1], "text": "Words"})
    bus.publish("engine", "FINISHED", request_id="a", attrs={"finish_reason": "length", "text": None})
    bus.publish("detokenizer", "NEW_TOKENS", request_id="a", attrs={"token_ids": [2], "text": " used"})
    req = live.view().requests["a"]
    assert req.text == "Words used" and req.status == "FINISHED_LENGTH" and req.output_token_ids == [1, 2]
    bus.publish("detokenizer", "NEW_TOKENS", request_id="b", attrs={"token_ids": [3], "text": "cut here"})
    bus.publish("engine", "FINISHED", request_id="b", attrs={"finish_reason": "stop", "text": "cut"})
    assert live.view().requests["b"].text == "cut"


def test_a_second_schedule_in_a_step_is_not_shown_with_the_first_ones_inputs():
    """Lesson 22 schedules by hand twice in one step: the Step panel showed the second schedule's
    table beside the first one's flattened inputs."""
    from tracer.tui.frame import Frame
    from tracer.tui.widgets.step import batch_table, flattened_inputs

    session, engine = run_engine(num_kv_blocks=64)
    core = engine.engine_core.engine_core
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8] * 3}, SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    sched = core.scheduler.schedule()
    core.scheduler.update_from_output(sched, core.model_executor.execute_model(sched))
    state = session.state.view()
    assert state.batch is not None and state.batch["request_ids"] == ["r"]  # the executed schedule's inputs
    core.scheduler.schedule()  # scheduled again, not executed: neither the first table nor its inputs are this one's
    state = session.state.view()
    assert state.snapshot_step is None and state.batch is None
    frame = Frame.of(state, {}, 0, None)
    assert "has not built" in flattened_inputs(frame).plain and "has not run" in batch_table(frame).plain
    session.close()
