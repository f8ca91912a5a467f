"""/trace over HTTP against a live traced server: state, step control, breakpoints, the event
stream, and the full chain of a request's journey read back from the recorded file.

Synchronisation is by condition (poll /trace/state with a deadline), never by sleeping."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine import Hooks
from engine.entrypoints.openai.errors import install_error_handlers
from tests.server.conftest import MODES, make_engine, start_server
from tracer import trace_api
from tracer.bus import EventBus
from tracer.events import EVENT_KEYS, read_trace
from tracer.journey import CHAIN, TWO_PROCESS_CHAIN, layer_path, missing_links, request_events
from tracer.session import TraceSession

DEADLINE = 30.0


@pytest.fixture(scope="module", params=MODES)
def traced(model_cache, tmp_path_factory, request):
    """A live server with a TraceSession recording to a file (its own engine: tests here pause it),
    the engine core in this process (inproc) or in its own (mp: the controller is remote)."""
    from engine.entrypoints.openai import build_app

    mode = request.param
    path = tmp_path_factory.mktemp("trace") / "serve.jsonl"
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=path, model="tiny-gpt2", remote_control=mode == "mp")
    # synchronous: these tests count whole engine steps over HTTP (one /trace/step, one step's token);
    # what a step call does under async scheduling is tests/tracer/test_controller.py's
    async_engine = make_engine(mode, hooks, session.core_options(), num_kv_blocks=64, async_scheduling=False)
    if mode == "mp":
        session.bind(async_engine)
    else:
        async_engine.engine_core.engine_core.warm_up()
    app = build_app(async_engine, "tiny-gpt2")
    app.state.trace = session
    app.include_router(trace_api.router)
    server, thread, url = start_server(app)
    with httpx.Client(base_url=url, timeout=60) as http:
        yield SimpleNamespace(url=url, http=http, session=session, engine=async_engine, path=path, mode=mode)
    session.controller.close()  # never leave the engine held: the server could not drain
    trace_api.stop_event_streams(app)
    server.should_exit = True
    thread.join(30)
    session.close()


@pytest.fixture
def t(traced):
    yield traced
    traced.http.post("/trace/resume", json={})
    for bp in traced.http.get("/trace/breakpoints").json()["breakpoints"]:
        traced.http.delete(f"/trace/breakpoints/{bp['id']}")


def wait_for(http: httpx.Client, pred, what: str) -> dict:
    """Poll /trace/state until pred(body) holds."""
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        body = http.get("/trace/state").json()
        if pred(body):
            return body
        time.sleep(0.01)  # a poll interval, not a synchronisation: the condition decides
    raise AssertionError(f"timed out waiting for {what}")


class Send(threading.Thread):
    """A completion request in the background (it blocks while the engine is held)."""

    def __init__(self, url: str, **body):
        super().__init__(daemon=True)
        self.url, self.body, self.result = url, {"prompt": "Hello", "temperature": 0, **body}, None
        self.start()

    def run(self) -> None:
        self.result = httpx.post(self.url + "/v1/completions", json=self.body, timeout=60).json()


@pytest.mark.slow
def test_state_shape(t):
    body = t.http.get("/trace/state").json()
    assert set(body) == {"state", "controller", "step", "seq"}
    assert body["step"] == t.engine.step_count and 0 < body["seq"] <= t.session.bus.next_seq
    assert body["controller"]["paused"] is False
    stages = [s["stage"] for s in body["state"]["startup"]]
    if t.mode == "mp":  # the core process's own stages, between its start and the handshake
        assert stages[0] == "core_process_start" and stages[-2:] == ["kernel_warmup", "core_handshake"]
    else:
        assert stages[-1] == "kernel_warmup"


def test_pause_holds_a_request_in_waiting_and_step_runs_exactly_one(t):
    assert t.http.post("/trace/pause", json={}).json()["controller"]["pause_requested"] is True
    send = Send(t.url, max_tokens=4, ignore_eos=True)
    held = wait_for(t.http, lambda b: b["controller"]["paused"] and b["state"]["waiting"], "the request to wait")
    rid = held["state"]["waiting"][0]
    req = held["state"]["requests"][rid]
    assert req["status"] == "WAITING" and req["output_token_ids"] == [] and send.is_alive()
    assert held["controller"]["point"] == "step" and held["step"] == t.engine.step_count
    assert t.http.get("/trace/state").json()["state"]["requests"][rid]["output_token_ids"] == []  # still none

    r = t.http.post("/trace/step", json={"n": 1, "granularity": "step", "wait": True}).json()
    assert r["stop"] == {"point": "step", "step": held["step"] + 1, "reason": "step step"} and not r["timed_out"]
    after = t.http.get("/trace/state").json()
    assert after["step"] == held["step"] + 1
    req = after["state"]["requests"][rid]
    assert req["status"] == "RUNNING" and rid in after["state"]["running"]
    assert len(req["output_token_ids"]) == 1  # the prefill step sampled exactly one token

    assert t.http.post("/trace/resume", json={}).json()["controller"]["paused"] is False
    send.join(DEADLINE)
    assert send.result["id"] == rid and send.result["usage"]["completion_tokens"] == 4


def test_step_body_is_validated(t):
    r = t.http.post("/trace/step", json={"granularity": "layer"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "granularity"
    assert t.http.post("/trace/step", json={"n": 0}).status_code == 400


@pytest.mark.parametrize("method,path,body,param", [
    ("post", "/trace/step", {"n": 2 ** 64}, "n"),
    ("post", "/trace/step", {"n": 2 ** 63}, "n"),
    ("post", "/trace/step", {"n": trace_api.MAX_STEP_N + 1}, "n"),
    ("post", "/trace/step", {"n": 1, "wait": True, "timeout": 10 ** 400}, "timeout"),
    ("get", f"/trace/events?since={2 ** 64}", None, "since"),
    ("delete", f"/trace/breakpoints/{2 ** 64}", None, "bp_id"),
    ("delete", "/trace/breakpoints/-1", None, "bp_id"),
])
def test_every_integer_of_the_trace_api_is_bounded(t, method, path, body, param):
    """n = 2**64 used to be a 500: the remote controller's msgpack cannot encode it."""
    kwargs = {"json": body} if body is not None else {}
    r = getattr(t.http, method)(path, **kwargs)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not t.session.controller.status()["paused"]  # nothing was started


def test_breakpoints_add_list_delete_and_finish_holds_the_engine(t):
    r = t.http.post("/trace/breakpoints", json={"condition": "finish"})
    assert r.status_code == 201
    bp = r.json()
    assert bp["condition"] == "finish" and bp["layer"] == "engine" and bp["name"] == "FINISHED"
    assert t.http.post("/trace/breakpoints", json={"condition": "finish"}).json() == bp  # no duplicate
    t.http.post("/trace/breakpoints", json={"condition": "preempt:cmpl-x"})
    listed = t.http.get("/trace/breakpoints").json()["breakpoints"]
    assert [b["condition"] for b in listed] == ["finish", "preempt:cmpl-x"]

    send = Send(t.url, max_tokens=2)
    held = wait_for(t.http, lambda b: b["controller"]["paused"], "the finish breakpoint")
    assert held["controller"]["reason"] == "breakpoint finish" and held["controller"]["point"] == "step_end"
    (rid,) = held["state"]["finished"][-1:]
    assert held["state"]["requests"][rid]["finish_reason"] == "length" and send.is_alive()

    assert t.http.delete(f"/trace/breakpoints/{bp['id']}").status_code == 204
    assert t.http.delete(f"/trace/breakpoints/{bp['id']}").status_code == 404
    assert [b["condition"] for b in t.http.get("/trace/breakpoints").json()["breakpoints"]] == ["preempt:cmpl-x"]
    t.http.post("/trace/resume", json={})
    send.join(DEADLINE)
    assert send.result["id"] == rid


def test_bad_condition_is_a_400_with_an_openai_error_body(t):
    r = t.http.post("/trace/breakpoints", json={"condition": "whenever"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "condition" and "bad condition" in err["message"] and err["type"]


def read_sse(url: str, params: dict, stop, headers=None) -> list[dict]:
    """Events (and `missed` notices as {"missed": n}) until stop(event) is true."""
    out = []
    with httpx.stream("GET", url + "/trace/events", params=params, timeout=DEADLINE, headers=headers) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                out.append({"missed": data["count"]} if kind == "missed" else data)
                kind = None
                if stop(out[-1]):
                    return out
    raise AssertionError("the stream ended first")


def is_finished(rid):
    return lambda ev: ev.get("layer") == "engine" and ev.get("name") == "FINISHED" and ev.get("request_id") == rid


def finished_with(rid, num_tokens):
    """A stop predicate: the request's FINISHED and num_tokens NEW_TOKENS seen, in any order."""
    seen = {"finished": False, "tokens": 0}

    def stop(ev):
        seen["finished"] |= is_finished(rid)(ev)
        seen["tokens"] += (ev.get("layer"), ev.get("name")) == ("detokenizer", "NEW_TOKENS")
        return seen["finished"] and seen["tokens"] >= num_tokens
    return stop


def test_events_filtered_by_layer_and_request(t):
    since = t.http.get("/trace/state").json()["seq"]
    other = Send(t.url, prompt="other", max_tokens=3)
    rid = t.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}).json()["id"]
    other.join(DEADLINE)
    # (with the core in its own process, the last NEW_TOKENS follows the core's FINISHED: the
    # front end detokenizes the step's output after the core has sent it)
    evs = read_sse(t.url, {"since": since, "layer": "engine,detokenizer", "request_id": rid}, finished_with(rid, 3))
    assert all(set(ev) == set(EVENT_KEYS) for ev in evs)
    assert {ev["layer"] for ev in evs} == {"engine", "detokenizer"} and {ev["request_id"] for ev in evs} == {rid}
    assert [ev["name"] for ev in evs if ev["layer"] == "detokenizer"] == ["NEW_TOKENS"] * 3
    assert evs[0]["seq"] >= since and [e["seq"] for e in evs] == sorted(e["seq"] for e in evs)

    # a request's journey includes the step-level events (kernels) of the steps it ran in
    journey = read_sse(t.url, {"since": since, "request_id": rid}, is_finished(rid))
    kernels = [ev for ev in journey if ev["layer"] == "kernel"]
    assert kernels and all(ev["request_id"] is None and "launch" not in ev["attrs"] for ev in kernels)
    assert {ev["request_id"] for ev in journey} == {rid, None}

    only_kernels = read_sse(t.url, {"since": since, "layer": "kernel"}, lambda ev: True)
    assert only_kernels[0]["layer"] == "kernel"


def test_events_live_from_now(t):
    with httpx.stream("GET", t.url + "/trace/events", params={"layer": "http"}, timeout=DEADLINE) as r:
        rid = t.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).json()["id"]
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert first["layer"] == "http" and first["request_id"] == rid and first["kind"] == "begin"


def test_unknown_layer_is_a_400(t):
    r = t.http.get("/trace/events", params={"layer": "gpu"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "layer"


def test_full_chain_from_http_to_http_in_the_recorded_file(t):
    rid = t.http.post("/v1/completions", json={"prompt": "The chain", "max_tokens": 3}).json()["id"]
    body = {"prompt": "A stream", "max_tokens": 3, "stream": True}
    with t.http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    sid = chunks[0]["id"]
    t.session.recorder.flush()  # both http ends were published before the responses completed
    _, events = read_trace(t.path)
    for request_id in (rid, sid):
        journey = request_events(events, request_id)
        path = layer_path(journey)
        chain = TWO_PROCESS_CHAIN if t.mode == "mp" else CHAIN
        assert missing_links(path, chain) == [], path
        assert path == list(chain)  # every layer, in order, none cutting in
        assert (journey[0].name, journey[0].kind) == ("POST /v1/completions", "begin")
        assert (journey[-1].name, journey[-1].kind) == ("POST /v1/completions", "end")


# ---- without a live server: guards, 503, the stream's missed notice ---------------------
def bare_app(host="127.0.0.1", api_key=None, session=None) -> TestClient:
    app = FastAPI()
    app.state.server = SimpleNamespace(host=host, api_key=api_key)
    app.state.trace = session
    install_error_handlers(app)
    app.include_router(trace_api.router)
    return TestClient(app)


@pytest.fixture
def bare_session():
    session = TraceSession(Hooks())
    yield session
    session.close()


def test_trace_refused_on_public_bind_without_key(bare_session):
    c = bare_app("0.0.0.0", None, bare_session)
    for method, path, body in [("post", "/trace/pause", {}), ("post", "/trace/resume", {}),
                               ("post", "/trace/step", {}), ("post", "/trace/breakpoints", {"condition": "finish"}),
                               ("delete", "/trace/breakpoints/1", None), ("delete", "/trace/run_until", None)]:
        r = c.request(method.upper(), path, json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "trace_disabled", path
    for path in ("/trace/state", "/trace/events", "/trace/breakpoints"):  # every user's prompts: not public
        r = c.get(path)
        assert r.status_code == 403 and r.json()["error"]["code"] == "trace_disabled", path
    assert bare_session.controller.status()["pause_requested"] is False


def test_trace_reads_need_the_key_when_one_is_set(bare_session):
    c = bare_app("127.0.0.1", "sesame", bare_session)
    for path in ("/trace/state", "/trace/events", "/trace/breakpoints"):
        r = c.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert c.get("/trace/breakpoints", headers={"Authorization": "Bearer sesame"}).json() == {"breakpoints": []}


def test_control_posts_from_a_web_page_must_be_json(bare_session):
    """A cross-site form can POST text/plain or a urlencoded form, never JSON (that needs a
    CORS preflight, which this server never grants): so no web page can pause the engine. A
    browser names the page's Origin on every POST; a program (curl) sends none."""
    c = bare_app("127.0.0.1", None, bare_session)
    for path in ("/trace/pause", "/trace/resume", "/trace/step", "/trace/run_until", "/trace/breakpoints"):
        for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
            headers = {"Origin": "http://evil.example", **headers}
            r = c.post(path, content=b"{}", headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "json_required", (path, headers)
    assert bare_session.controller.status()["pause_requested"] is False
    r = c.post("/trace/pause", content=b"", headers={"Content-Type": "application/json; charset=utf-8",
                                                      "Origin": "http://evil.example"})
    assert r.status_code == 200 and r.json()["controller"]["pause_requested"] is True
    c.post("/trace/resume", json={})
    r = c.post("/trace/pause")  # no Origin, no body: a program, as `curl -X POST` sends it
    assert r.status_code == 200 and r.json()["controller"]["pause_requested"] is True


def test_control_needs_the_right_key(bare_session):
    c = bare_app("0.0.0.0", "sesame", bare_session)
    assert c.post("/trace/pause", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.post("/trace/pause", json={}).status_code == 401
    r = c.post("/trace/pause", json={}, headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200 and r.json()["controller"]["pause_requested"] is True


def test_503_when_tracing_is_off():
    c = bare_app(session=None)
    for method, path in [("GET", "/trace/state"), ("GET", "/trace/events"), ("POST", "/trace/pause"),
                         ("GET", "/trace/breakpoints")]:
        r = c.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 503 and r.json()["error"]["code"] == "tracing_disabled", path


def test_stream_reports_missed_events_then_ends_when_the_bus_closes():
    bus = EventBus(capacity=4)
    for i in range(10):
        bus.publish("engine", f"e{i}")
    bus.close()  # the stream sends what is buffered, then ends
    c = bare_app(session=SimpleNamespace(bus=bus, controller=None))
    text = c.get("/trace/events", params={"since": 0}).text
    frames = [f for f in text.split("\n\n") if f]
    assert frames[0] == 'event: missed\ndata: {"count": 6}'
    assert [json.loads(f[6:])["name"] for f in frames[1:]] == ["e6", "e7", "e8", "e9"]


def test_a_draining_server_refuses_to_hold_its_engine(bare_session):
    """At shutdown the controller lets the engine go (to drain); a step with wait used to answer
    timed_out: true after milliseconds, and pause or a breakpoint to answer 200 and do nothing."""
    import concurrent.futures

    c = bare_app("127.0.0.1", None, bare_session)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.post, "/trace/step", json={"wait": True, "timeout": 30})
        time.sleep(0.5)  # it waits for a stop that will not come: the drain begins
        t0 = time.monotonic()
        bare_session.controller.close()
        r = waiting.result(30)
    assert time.monotonic() - t0 < 20  # answered at the close, not after its own 30-s timeout
    assert r.status_code == 503 and r.json()["error"]["code"] == "controller_closed", r.text
    assert "shutting down" in r.json()["error"]["message"]
    for path, body in [("/trace/step", {"wait": True}), ("/trace/pause", {}),
                       ("/trace/run_until", {"condition": "finish"}), ("/trace/breakpoints", {"condition": "finish"})]:
        r = c.post(path, json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "controller_closed", (path, r.text)
    assert c.post("/trace/resume", json={}).status_code == 200  # harmless: the engine runs anyway


def test_a_stop_string_finish_is_finished_with_its_stop_reason_in_the_cores_trace(t):
    """In two processes the front end matches the stop string and tells the core with an ABORT
    that carries finish_reason "stop": the core must trace FINISHED (stop, with the string), as the
    one-process engine does, never ABORTED."""
    # max_tokens far past the stop string: the core must still be generating when the ABORT arrives (with 16, a
    # fast core may finish by length first, and rightly trace that)
    body = {"prompt": "Once upon a time", "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    text = t.http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[4:7]
    assert stop.strip() and text.index(stop) == 4, text  # it first occurs there
    r = t.http.post("/v1/completions", json=dict(body, stop=[stop])).json()
    rid, choice = r["id"], r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[:4], choice
    # the response ends before the core has the ABORT: its FINISHED reaches the trace a moment later
    deadline = time.monotonic() + 30
    while True:
        t.session.recorder.flush()
        _, events = read_trace(t.path)
        engine_ends = [e for e in events
                       if e.request_id == rid and e.layer == "engine" and e.name in ("FINISHED", "ABORTED")]
        if engine_ends or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [(e.name, e.attrs.get("finish_reason"), e.attrs.get("stop_reason")) for e in engine_ends] == \
        [("FINISHED", "stop", stop)], engine_ends


@pytest.mark.slow
def test_a_step_with_wait_on_an_idle_engine_answers_that_it_is_idle(bare_session):
    """No request, no step to stop at: the answer says so rather than wait out the timeout."""
    c = bare_app("127.0.0.1", None, bare_session)
    r = c.post("/trace/step", json={"wait": True, "timeout": 120})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["idle"] is True and body["timed_out"] is False and body["stop"] is None
    assert "idle" in body["detail"] and "send a request" in body["detail"]
    assert body["controller"]["paused"] is False
