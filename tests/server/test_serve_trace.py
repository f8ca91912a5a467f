"""`vllm-trace serve` with tracing, as a user runs it: flags, traced startup stages, a held
engine driven over /trace, Ctrl-C while held, and the trace file afterwards."""
from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import spawn_serve
from tracer.cli import build_parser, main
from tracer.events import read_trace
from tracer.export import export_perfetto

DEADLINE = 30.0


def test_serve_help_shows_the_tracing_flags():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "tracing:" in text
    for flag in ("--trace-file", "--start-paused", "--trace-log", "--trace-log-layers", "--no-trace"):
        assert flag in text


def test_serve_no_trace_conflicts_are_one_line(capsys):
    assert main(["serve", "tiny-gpt2", "--no-trace", "--start-paused"]) == 2
    err = capsys.readouterr().err
    assert "--no-trace cannot be combined" in err and "Traceback" not in err


def poll_state(url: str, pred) -> dict:
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        body = httpx.get(url + "/trace/state").json()
        if pred(body):
            return body
        time.sleep(0.01)  # a poll interval; the condition decides
    raise AssertionError("timed out")


@pytest.mark.slow
def test_serve_start_paused_trace_file_and_ctrl_c_while_held(model_cache, tmp_path):
    trace = tmp_path / "serve.jsonl"
    proc, startup, url = spawn_serve("--num-kv-blocks", "32", "--trace-file", str(trace), "--start-paused",
                                     "--trace-log-layers", "cli", "--drain-timeout", "90")
    try:
        for stage in ("arguments", "config", "weights", "KV cache", "kernel warm-up", "HTTP ready"):
            assert re.search(rf"^  {stage}\s+[\d.]+ ms", startup, re.M), startup
        assert "[TRACE] cli args (end)" in startup and "[TRACE] engine" not in startup  # --trace-log-layers cli

        result = {}
        send = threading.Thread(target=lambda: result.update(httpx.post(
            url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "ignore_eos": True}, timeout=60).json()))
        send.start()
        held = poll_state(url, lambda b: b["controller"]["paused"] and b["state"]["waiting"])
        assert held["controller"]["reason"] == "start paused" and held["step"] == 0
        step = httpx.post(url + "/trace/step", json={"wait": True}).json()
        assert step["stop"]["step"] == 1
        ended, streaming = [], threading.Event()

        def watch() -> None:  # an open /trace/events stream must not hold up shutdown
            with httpx.stream("GET", url + "/trace/events", params={"layer": "engine"}, timeout=60) as r:
                streaming.set()  # the response has started: the stream is open on the server
                for _ in r.iter_lines():
                    pass
            ended.append(True)  # the server ended the stream properly (no protocol error)
        watcher = threading.Thread(target=watch)
        watcher.start()
        assert streaming.wait(DEADLINE)
        t_int = time.monotonic()
        proc.send_signal(signal.SIGINT)  # while held: shutdown lets the engine run free and drain
        send.join(DEADLINE)
        assert result["usage"]["completion_tokens"] == 20
        assert proc.wait(DEADLINE) == 0
        watcher.join(DEADLINE)
        assert ended == [True]
        # streams ended with the drain, not after --drain-timeout (90 s: far from any loaded CPU's drain time)
        assert time.monotonic() - t_int < 60
        assert "stopped cleanly" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    header, events = read_trace(trace)  # complete and valid after Ctrl-C
    assert header["model"] == "tiny-gpt2" and header["engine_config"]["cache"]["num_kv_blocks"] == 32
    spans = [(e.layer, e.name) for e in events if e.kind == "end" and e.layer in ("cli", "engine") and e.step is None]
    assert spans[:2] == [("cli", "args"), ("cli", "config")]
    assert ("engine", "kernel_warmup") in spans and spans[-2:] == [("cli", "http_ready"), ("cli", "serve")]
    assert [e.seq for e in events] == list(range(len(events)))
    assert [e.ts_ns for e in events if e.layer == "cli"] == sorted(e.ts_ns for e in events if e.layer == "cli")
    assert any(e.layer == "engine" and e.name == "FINISHED" for e in events)  # the drained request is in it
    export_perfetto(trace, tmp_path / "out.json")
    chrome = json.loads((tmp_path / "out.json").read_text())
    names = {e["name"] for e in chrome["traceEvents"] if e["ph"] == "X"}
    assert {"args", "config", "kernel_warmup", "http_ready"} <= names
