"""The engine core in its own process: faults. Killing the core (kill -9) fails what is in
flight with a clear error and stops `serve` with status 1; killing `serve` (even with kill -9)
takes the core with it; a core that cannot start is one line, not a hang."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from engine.arg_utils import engine_config
from engine.engine.core_client import EngineStartupError
from tests.server.conftest import spawn_serve

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 30.0


@pytest.fixture(scope="module", autouse=True)
def model_cache(tmp_path_factory):
    old = os.environ.get("VLLM_TRACE_CACHE")
    os.environ["VLLM_TRACE_CACHE"] = old or str(tmp_path_factory.mktemp("vtc"))
    yield
    if old is None:
        os.environ.pop("VLLM_TRACE_CACHE", None)


def core_pid(startup: str) -> int:
    return int(re.search(r"engine core process .* engine core pid (\d+)", startup).group(1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pid: int, timeout: float = DEADLINE) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


@pytest.mark.slow
def test_kill_9_of_the_core_fails_requests_in_flight_and_stops_serve():
    proc, startup, url = spawn_serve("--no-tui", "--no-trace", "--num-kv-blocks", "64")
    pid = core_pid(startup)
    try:
        long = {"model": "tiny-gpt2", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True}
        blocking: dict = {}
        t = threading.Thread(target=lambda: blocking.update(
            r=httpx.post(url + "/v1/completions", json=long, timeout=DEADLINE)), daemon=True)
        t.start()
        with httpx.stream("POST", url + "/v1/completions", json={**long, "stream": True}, timeout=DEADLINE) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))  # it is generating
            end = time.monotonic() + DEADLINE  # and so is the blocking one (its thread may start late)
            while _running(url) < 2 and time.monotonic() < end:
                time.sleep(0.05)
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        errors = [json.loads(x[6:])["error"] for x in rest if x.startswith("data: {\"error\"")]
        assert errors and errors[0]["message"] == "engine core died: signal 9" and rest[-1] == "data: [DONE]"
        health = httpx.get(url + "/health", timeout=5)
        new = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
        assert health.status_code == 503 and new.status_code == 503
        assert new.json()["error"]["message"] == "engine core died: signal 9"
        t.join(DEADLINE)
        assert blocking["r"].status_code == 500
        assert blocking["r"].json()["error"]["message"] == "engine core died: signal 9"
        assert proc.wait(DEADLINE) == 1
        err = proc.stderr.read()
        assert "stopped because the engine core died: signal 9" in err and "Traceback" not in err
        assert "get --drain-timeout" not in err, err  # the requests had failed: none was left to drain
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_no_orphan_core_when_serve_dies(how):
    proc, startup, url = spawn_serve("--no-tui", "--no-trace")
    pid = core_pid(startup)
    try:
        assert alive(pid)
        os.kill(proc.pid, how)
        proc.wait(DEADLINE)
        assert wait_dead(pid), f"the engine core (pid {pid}) outlived serve"
    finally:
        if proc.poll() is None:
            proc.kill()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_core_that_cannot_start_is_one_line_not_a_hang(tmp_path):
    from engine.model_executor.model_loader import resolve

    broken = tmp_path / "broken-gpt2"
    shutil.copytree(resolve("tiny-gpt2"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # the tokenizer loads here; the weights fail in the core
    proc = subprocess.run([sys.executable, "-m", "tracer.cli", "serve", str(broken), "--port", "0", "--no-tui"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if "failed to start" in x]
    assert len(lines) == 1 and "the engine core failed to start" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_handshake_errors_raise_with_the_core_s_own_message_or_the_timeout():
    from engine.engine.async_llm import AsyncLLM

    llm = AsyncLLM(engine_config("tiny-gpt2"), core_options={"fail_startup": "no GPU left"})
    with pytest.raises(EngineStartupError, match="RuntimeError: no GPU left"):
        llm.start()
    assert llm.engine_core.proc.wait(10) is not None
    slow = AsyncLLM(engine_config("tiny-gpt2"))
    slow.launch()
    with pytest.raises(EngineStartupError, match="did not answer the handshake within 0 s"):
        slow.wait_ready(timeout=0.01)
    assert slow.engine_core.proc.poll() is not None  # not left running


def test_a_request_added_as_the_core_dies_is_refused_not_left_waiting():
    """The race the kill test can lose under load: a request passes add_request's first check of
    `dead`, then the core's monitor marks it dead and fails the streams it knows, before this one
    is registered. Here the core is killed, and its death handled, exactly in that gap."""
    import asyncio

    from engine import SamplingParams
    from engine.engine.async_llm import AsyncLLM
    from engine.engine.exceptions import EngineClosedError

    llm = AsyncLLM(engine_config("tiny-gpt2-random")).start()
    process_inputs = llm.input_processor.process_inputs

    def tokenize_then_die(request_id, prompt, params, **kw):
        out = process_inputs(request_id, prompt, params, **kw)
        os.kill(llm.engine_core.pid, signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE
        while llm.engine_core.dead is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the monitor: dead set, the streams it knew failed (none)
        return out

    llm.input_processor.process_inputs = tokenize_then_die
    raised = []

    def add():  # on a thread of its own: a send that blocks for ever would block the test too
        try:
            asyncio.run(asyncio.wait_for(llm.add_request("late", "Hello", SamplingParams(max_tokens=2)), 10))
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=add, daemon=True)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive(), "add_request blocked: sending to a dead core"
    llm.stop(0)
    assert len(raised) == 1 and isinstance(raised[0], EngineClosedError), raised
    assert str(raised[0]) == "engine core died: signal 9"


def test_the_shipper_stamps_its_pid_on_each_event_and_keeps_a_workers():
    from engine.hooks import Hooks
    from engine.serial_utils import EventShipper

    hooks = Hooks()
    shipper = EventShipper(hooks)
    launch, worker = {"grid": [1]}, {"pid": 4242, "rank": 1}
    hooks.emit_many([("kernel", "k", "instant", None, 3, launch), ("worker", "w", "instant", None, 3, worker),
                     ("engine", "e", "instant", None, 3, None)], [10, 20, 30])
    hooks.emit("engine", "one", step=4, x=1)
    events = shipper.take()
    assert [e[5]["pid"] for e in events] == [os.getpid(), 4242, os.getpid(), os.getpid()]
    assert [e[6] for e in events[:3]] == [10, 20, 30] and events[0][5] == {"grid": [1], "pid": os.getpid()}
    shipper.close()
    hooks.emit("engine", "after", step=5)
    assert not hooks.active and shipper.take() == []
