"""`serve` (two processes) facing a frozen engine core and frames that are not the core's: the
front end keeps reading the core, and /health says 503 while the core does not answer (200
again once it does), but 200 while the step controller holds it."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import msgspec
import pytest
import zmq

from benchmarks.procfs import unix_socket_paths
from tests.server.conftest import spawn_serve

DEADLINE = 60
BODY = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(model_cache):
    proc, startup, url = spawn_serve("--no-tui")
    core_pid = int(re.search(r"engine core pid (\d+)", startup).group(1))
    yield proc, core_pid, url
    os.kill(core_pid, signal.SIGCONT)  # a failed test must not leave it frozen
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except Exception:
        proc.kill()
        proc.wait()


def _health(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TimeoutException:
        return 0


def _seconds_until(pred, limit: float) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < limit, f"not within {limit} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def test_frames_that_are_not_the_cores_are_skipped(server):
    """One undecodable frame used to end the thread that reads the core: every later request
    hung while /health said 200."""
    proc, _, url = server
    output = sorted({p for p in unix_socket_paths(proc.pid) if p.endswith("/output")})
    assert len(output) == 1, output
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect("ipc://" + output[0])
    garbage = [b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1, 2]),
               msgspec.msgpack.encode([[], [], [], [], [], [], None, None, False, [1]]),  # a utility answer, cut short
               msgspec.msgpack.encode([[[1]]]),  # a trace event that is no event
               os.urandom(1 << 16)]
    for frame in garbage:
        push.send(frame)
    push.send_multipart([b"\x00", b"\xff\xfe"])
    push.close(linger=2000)
    ctx.term()
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=20)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24, r.text
    assert _health(url) == 200


@pytest.mark.slow
def test_health_notices_a_frozen_core_and_its_return(server):
    proc, core_pid, url = server
    results: list[httpx.Response] = []

    def send() -> None:
        results.append(httpx.post(url + "/v1/completions", json=dict(BODY, max_tokens=200), timeout=DEADLINE * 2))

    threads = [threading.Thread(target=send, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    _seconds_until(lambda: _running(url) > 0, DEADLINE)
    os.kill(core_pid, signal.SIGSTOP)
    try:
        down = _seconds_until(lambda: _health(url) != 200, 15)
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and "has not answered" in r.json()["error"]["message"], r.text
    finally:
        os.kill(core_pid, signal.SIGCONT)
    up = _seconds_until(lambda: _health(url) == 200, 15)
    for t in threads:
        t.join(DEADLINE)
    assert [r.status_code for r in results] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in results)
    print(f"/health: 503 {down:.1f} s after SIGSTOP, 200 {up:.1f} s after SIGCONT")


@pytest.mark.slow
def test_a_core_held_by_the_step_controller_stays_healthy(server):
    _, _, url = server
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/trace/pause", json={}).status_code == 200
        try:
            t = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=BODY, timeout=DEADLINE),
                                 daemon=True)
            t.start()
            _seconds_until(lambda: http.get("/trace/state").json()["controller"]["paused"], DEADLINE)
            end = time.monotonic() + 7  # longer than the health check's ping timeout
            while time.monotonic() < end:
                assert http.get("/health").status_code == 200
                time.sleep(0.5)
        finally:
            http.post("/trace/resume", json={})
        t.join(DEADLINE)


def _running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1])
    return 0.0
