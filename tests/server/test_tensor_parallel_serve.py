"""`serve --tensor-parallel-size 2`: the same answer as one rank, every rank in the trace file, and
a worker killed mid-serve takes the engine core's death path (503 with the reason, serve exits,
no process left behind)."""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from benchmarks.procfs import is_loopback, listening_addresses, unix_socket_paths
from engine import LLM, SamplingParams
from tests.engine.test_tensor_parallel import _alive
from tests.server.conftest import spawn_serve
from tracer.events import read_trace

DEADLINE = 60
# a server with two worker processes per test (12-16 s each on 2 cores): make test-slow; tensor parallelism
# stays in make test through tests/engine/test_tensor_parallel.py
pytestmark = pytest.mark.slow


def _children_of(pid: int, marker: bytes) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and marker in cmd:
            found.append(int(d))
    return found


def _workers_dir(core_pid: int) -> str:
    """The directory of the ipc sockets the engine core bound for its workers."""
    paths = [p for p in unix_socket_paths(core_pid) if "vllm-trace-workers-" in p]
    assert paths, "the engine core has no worker sockets"
    return os.path.dirname(paths[0])


def test_serve_with_two_ranks(model_cache, tmp_path):
    trace = tmp_path / "tp.jsonl"
    proc, startup, url = spawn_serve("--no-tui", "--tensor-parallel-size", "2", "--trace-file", str(trace))
    try:
        core_pid = int(re.search(r"engine core pid (\d+)", startup).group(1))
        workers = _children_of(core_pid, b"engine.executor.worker_proc")
        assert len(workers) == 2, startup
        # the rendezvous store and the backends' sockets: nothing of the tree listens beyond loopback
        listening = listening_addresses([proc.pid, core_pid, *workers])
        assert {pid for pid, _, _ in listening} >= {proc.pid, workers[0]}, listening  # uvicorn, the store
        assert all(is_loopback(addr) for _, addr, _ in listening), listening
        workers_dir = _workers_dir(core_pid)
        body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = httpx.post(url + "/v1/completions", json=body, timeout=DEADLINE).json()
        one_rank = LLM("tiny-gpt2").generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12,
                                                                                  ignore_eos=True), use_tqdm=False)
        assert got["choices"][0]["text"] == one_rank[0].outputs[0].text

        # a stream in flight when a worker is killed ends with the reason; then the server answers 503
        with httpx.stream("POST", url + "/v1/completions", timeout=DEADLINE,
                          json=dict(body, max_tokens=400, stream=True)) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")  # the first chunk: the request is running
            os.kill(workers[1], signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "died (signal 9)" in rest[-2], rest[-3:]
        r = httpx.post(url + "/v1/completions", json=body, timeout=DEADLINE)
        assert r.status_code == 503, r.text
        assert re.search(r"worker rank \d died \(signal 9\)", r.json()["error"]["message"])
        assert proc.wait(DEADLINE) == 1
        err = proc.stderr.read()
        assert re.search(r"engine core died: worker rank \d died \(signal 9\)", err) and "Traceback" not in err, err
        deadline = time.monotonic() + 10
        while any(map(_alive, [core_pid, *workers])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, [core_pid, *workers])), "orphaned engine processes"
        assert not os.path.exists(workers_dir), "the workers' socket directory was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    _, events = read_trace(trace)
    kernels = [e for e in events if e.layer == "kernel" and e.step is not None]
    assert {e.attrs["rank"] for e in kernels} == {0, 1}
    assert {e.attrs["pid"] for e in kernels} == set(workers)
    assert {e.name for e in kernels} >= {"all_reduce", "all_gather"}
    loads = [e for e in events if e.layer == "worker" and e.name == "model_load" and e.kind == "end"]
    assert sorted(e.attrs["rank"] for e in loads) == [0, 1]


def test_a_dead_worker_stops_a_one_process_server_too(model_cache):
    proc, _, url = spawn_serve("--no-tui", "--no-multiprocessing", "--tensor-parallel-size", "2")
    try:
        workers = _children_of(proc.pid, b"engine.executor.worker_proc")
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE
        while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=DEADLINE)
        assert r.status_code == 503 and "died (signal 9)" in r.json()["error"]["message"], r.text
        assert proc.wait(DEADLINE) == 1
        err = proc.stderr.read()
        assert re.search(r"stopped because the engine died: worker rank \d died \(signal 9\)", err), err
        assert "Traceback" not in err, err
        assert not any(map(_alive, workers))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_9_of_a_tensor_parallel_core_leaves_no_directory_behind(model_cache):
    proc, startup, url = spawn_serve("--no-tui", "--tensor-parallel-size", "2")
    try:
        core_pid = int(re.search(r"engine core pid (\d+)", startup).group(1))
        workers_dir = _workers_dir(core_pid)
        os.kill(core_pid, signal.SIGKILL)  # no code of the core runs: the front end must clean up
        assert proc.wait(DEADLINE) == 1
        assert "engine core died: signal 9" in proc.stderr.read()
        assert not os.path.exists(workers_dir), "the workers' socket directory was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
