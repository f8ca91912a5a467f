"""Robustness, small and fast: what a client sends can never make a 5xx or a traceback, a
client that leaves takes the 499 path, resume disarms run_until, big prompts are refused
before they cost anything, and a drain ends every stream with [DONE] or an error event.
(benchmarks/robustness.py runs the long versions: 2,000 fuzz cases, 256 streams, ...)"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from engine.renderers.online_renderer import OnlineRenderer
from tests.server.conftest import spawn_serve
from tests.server.test_trace_api import DEADLINE, Send, t, traced, wait_for  # noqa: F401 (fixtures)
from tracer.events import encode_event, json_safe

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]
BIG = 2 ** 70


def post_raw(http: httpx.Client, path: str, body) -> httpx.Response:
    """json.dumps writes a lone surrogate as its \\ud800 escape, as a client would send it."""
    return http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    (C, {"prompt": "x", "max_tokens": BIG}, "max_tokens"),
    (C, {"prompt": "x", "top_k": BIG}, "top_k"),
    (C, {"prompt": "x", "stop_token_ids": [BIG]}, "stop_token_ids"),
    (C, {"prompt": "x", "min_tokens": -BIG}, "min_tokens"),
    (C, {"prompt": [1, BIG]}, "prompt"),
    (CHAT, {"messages": MSG, "max_completion_tokens": BIG}, "max_completion_tokens"),
    (C, {"prompt": "\ud800x"}, "prompt"),
    (C, {"prompt": "x", "stop": ["\udfff"]}, "stop"),
    (C, {"prompt": "x", "user": "\ud800"}, "user"),
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/trace/breakpoints", {"condition": "request:\ud800"}, "condition"),
])
def test_huge_integers_and_lone_surrogates_are_400_on_a_traced_server(t, path, body, param):
    """They used to be 500s: the trace encoder raised on the integer while recording the
    request, and the tokenizer on the surrogate."""
    r = post_raw(t.http, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert t.http.post(C, json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_the_trace_encoder_never_raises_on_user_data():
    line = encode_event(1, 2, "api", "x", "instant", "r\ud800", None,
                        {"n": BIG, "s": "\ud800x", 3: {"\udfff": [-BIG, 2 ** 64 - 1]}, "set": {2, 1}})
    ev = json.loads(line)
    assert ev["request_id"] == "r\ufffd"
    assert ev["attrs"] == {"n": str(BIG), "s": "\ufffdx", "3": {"\ufffd": [str(-BIG), 2 ** 64 - 1]}, "set": [1, 2]}
    assert json_safe({"ok": [1, "a", 2.5]}) == {"ok": [1, "a", 2.5]}


def give_up_later(url: str, body: dict) -> socket.socket:
    """A raw HTTP/1.1 client's socket, its non-streamed request sent: close it to give up."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def test_a_client_that_gives_up_takes_the_499_path(t):
    """until_disconnected used to raise InvalidStateError (a traceback per request) instead."""
    sub = t.session.bus.subscribe()
    t.http.post("/trace/pause", json={})  # held: the request cannot finish before its client leaves
    client = give_up_later(t.url, {"prompt": "Hello", "max_tokens": 8})
    held = wait_for(t.http, lambda b: b["controller"]["paused"] and b["state"]["waiting"], "the request to wait")
    rid = held["state"]["waiting"][0]
    client.close()
    end, ended = time.monotonic() + DEADLINE, None
    while ended is None and time.monotonic() < end:
        ended = next((e for e in sub.pull().events if e.layer == "http" and e.kind == "end" and e.request_id == rid),
                     None)
        time.sleep(0.01)
    assert ended is not None and ended.get("status") == 499 and ended.get("disconnected") is True
    t.http.post("/trace/resume", json={})
    wait_for(t.http, lambda b: rid in b["state"]["finished"] and not b["state"]["running"], "the abort")
    assert t.http.get("/trace/state").json()["state"]["requests"][rid]["status"] == "FINISHED_ABORTED"


def test_resume_disarms_run_until(t):
    """run_until, pause, resume: the armed condition used to hold the next request forever."""
    assert t.http.post("/trace/run_until", json={"condition": "layer:scheduler"}).status_code == 200
    t.http.post("/trace/pause", json={})
    status = t.http.post("/trace/resume", json={}).json()["controller"]
    assert status["until"] is None and status["paused"] is False
    send = Send(t.url, max_tokens=2)
    send.join(DEADLINE)
    assert send.result["usage"]["completion_tokens"] == 2


def test_delete_run_until_cancels_a_pending_one(t):
    t.http.post("/trace/run_until", json={"condition": "finish:nobody"})
    assert t.http.get("/trace/state").json()["controller"]["until"] == "finish:nobody"
    r = t.http.delete("/trace/run_until")
    assert r.status_code == 200 and r.json()["controller"]["until"] is None


def test_prompts_are_tokenized_by_the_server_and_traced(t):
    """The engine gets token ids; the tokenizer's encode event comes from the API server."""
    sub = t.session.bus.subscribe()
    r = t.http.post(C, json={"prompt": "Hello there", "max_tokens": 2}).json()
    events = [e for e in sub.pull().events if e.request_id == r["id"]]
    enc = next(e for e in events if e.layer == "tokenizer" and e.name == "encode")
    assert enc.get("token_ids") == t.engine.tokenizer.encode("Hello there")
    assert "".join(enc.get("pieces")) == "Hello there"
    assert [e.name for e in events if e.layer in ("tokenizer", "engine")][:2] == ["encode", "QUEUED"]


def test_the_encode_events_pieces_are_each_tokens_text_decoded_once(live, monkeypatch):
    """A token's text for the trace is decoded the first time it is seen, then remembered."""
    proc = OnlineRenderer(live.tokenizer, live.async_engine.max_model_len, live.hooks)
    proc._pieces.clear()  # as with a tokenizer that normalizes: nothing decoded in advance
    decoded = []
    batch_decode = live.tokenizer.batch_decode
    monkeypatch.setattr(live.tokenizer, "batch_decode", lambda seqs: decoded.extend(seqs) or batch_decode(seqs))
    ids = live.tokenizer.encode("Hello there, Hello there")
    assert proc._token_pieces(ids) == batch_decode([[t] for t in ids])
    assert sorted(decoded) == sorted([t] for t in set(ids))  # each distinct token once
    proc._token_pieces(ids)
    assert len(decoded) == len(set(ids))  # and never again
    proc.close()


def test_an_over_long_text_is_refused_before_tokenizing(http, live):
    """No token decodes to more than 13 characters here, so 513 x 13 characters must be too
    long: refused untokenized (a 10 MiB prompt used to take 35 s to get its 400)."""
    proc = OnlineRenderer(live.tokenizer, live.async_engine.max_model_len, live.hooks)
    tok = live.tokenizer
    assert proc.max_token_chars == max(len(tok.decode([i])) for i in range(len(tok)))
    r = http.post(C, json={"prompt": "x" * (proc.max_prompt_chars + 1)})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    r = http.post(
        C, json={"prompt": "x" * live.async_engine.max_model_len}
    )  # within the bound: tokenized, then refused
    assert r.status_code == 400 and "tokens; max_model_len" in r.json()["error"]["message"]
    proc.close()


def test_the_body_cap_is_an_openai_413(http):
    body = b'{"prompt": "' + b"x" * 2 ** 20 + b'"}'
    r = http.post(C, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large" and "--max-request-body-mib" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(2):
            yield b"x" * 2 ** 20
        yield b'"}'
    r = http.post(C, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_openapi_documents_what_is_returned(http):
    paths = http.get("/openapi.json").json()["paths"]
    chat = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse")
    assert "content" not in paths["/health"]["get"]["responses"]["200"]  # an empty body
    assert http.get("/health").content == b""


# ---- the drain, in a real `serve` process ------------------------------------------------------
def _streams(url: str, n: int, results: list, started: threading.Barrier) -> list[threading.Thread]:
    def one(i: int) -> None:
        lines = []
        try:
            body = {"prompt": f"Count {i}", "max_tokens": 480, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + C, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if len(lines) == 1:
                            started.wait(DEADLINE)
        except httpx.HTTPError as e:
            lines.append(f"transport error: {e}")
        results.append(lines)
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for th in threads:
        th.start()
    return threads


@pytest.mark.slow
def test_drain_deadline_ends_every_stream_with_an_error_event_and_done(model_cache):
    """uvicorn's timeout used to close such connections with nothing said (and log a
    CancelledError traceback each) while the server printed 'stopped cleanly'."""
    proc, _, url = spawn_serve("--no-tui", "--drain-timeout", "0.5")
    try:
        results, started = [], threading.Barrier(5)
        threads = _streams(url, 4, results, started)
        started.wait(DEADLINE)  # every stream has its first chunk
        proc.send_signal(signal.SIGINT)
        for th in threads:
            th.join(DEADLINE)
        assert proc.wait(DEADLINE) == 0
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert len(results) == 4
    for lines in results:
        assert lines[-1] == "[DONE]", lines[-3:]
        assert "shut down before this request finished" in json.loads(lines[-2])["error"]["message"]
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert "4 response(s) still running at the --drain-timeout deadline" in err, err


@pytest.mark.slow
def test_a_second_sigterm_forces_the_exit(model_cache):
    proc, _, url = spawn_serve("--no-tui", "--drain-timeout", "60")
    try:
        results, started = [], threading.Barrier(3)
        threads = _streams(url, 2, results, started)
        started.wait(DEADLINE)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the first signal's drain has begun (no condition to wait for from outside)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(DEADLINE) == 0  # not the 60 s drain
        for th in threads:
            th.join(DEADLINE)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert all(lines[-1] == "[DONE]" for lines in results), results
    assert "stopped at a second Ctrl-C or SIGTERM" in err and "Traceback" not in err, err
