"""One live server per mode for the whole session: the real uvicorn on a free loopback port, in
a thread, serving the built-in tiny-gpt2 with a small KV cache (so 64 concurrent requests
also exercise preemption). Both modes serve an AsyncLLM: "inproc", the engine core stepped by a
thread of this process; "mp", the engine core in its own process. Tests that read engine
internals (`live.engine`) run in one process only: there is no engine object here in "mp"."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from engine.entrypoints.openai.background import start_background

NUM_KV_BLOCKS = 48
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """The built-in model is written once per session into a temporary cache."""
    old = os.environ.get("VLLM_TRACE_CACHE")
    os.environ["VLLM_TRACE_CACHE"] = str(tmp_path_factory.mktemp("vllm-trace-cache"))
    yield
    if old is None:
        os.environ.pop("VLLM_TRACE_CACHE", None)
    else:
        os.environ["VLLM_TRACE_CACHE"] = old


def spawn_serve(*args: str, model: str = "tiny-gpt2") -> tuple[subprocess.Popen, str, str]:
    """`vllm-trace serve MODEL --port 0 ARGS` as a subprocess, read up to its ready line.
    Returns (process, what it printed on stderr up to then, base URL); the caller stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "tracer.cli", "serve", model, "--port", "0", *args],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=os.environ.copy())
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("Ready:"):
            return proc, "".join(lines), re.search(r"at (http://\S+)", line).group(1)
    proc.kill()
    proc.wait()
    raise AssertionError("serve exited before its ready line:\n" + "".join(lines))


@contextlib.contextmanager
def serving(*args: str, model: str = "tiny-gpt2"):
    """spawn_serve, yielding (an openai client on it, its startup text). Leaving the block stops the server
    with Ctrl-C and asserts it exits 0; an error inside the block kills it."""
    proc, startup, url = spawn_serve(*args, model=model)
    try:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none"), startup
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_server(app):
    return start_background(app)


MODES = ["inproc", "mp"]


@dataclass
class Live:
    url: str
    async_engine: object  # engine.engine.async_llm.AsyncLLM (the EngineClient the app serves)
    model: str = "tiny-gpt2"
    mode: str = "inproc"

    @property
    def engine(self):
        if self.mode != "inproc":
            pytest.skip("reads the LLMEngine's internals: it lives in another process in this mode")
        return self.async_engine.engine_core.engine_core

    @property
    def tokenizer(self):
        return self.async_engine.tokenizer

    @property
    def hooks(self):
        return self.async_engine.hooks

    def stats(self):
        """The engine's stats now, asked of the core."""
        from engine.outputs import EngineStats
        return EngineStats(**self.async_engine.engine_core.call("stats"))

    def all_blocks_free(self, timeout: float = 30.0) -> bool:
        """True once no request holds a block, waiting up to timeout: an abort (a rejected
        sibling prompt, a client gone) is applied at the engine's next step boundary."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.num_free_blocks == s.num_total_blocks and not s.num_waiting and not s.num_running:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def make_engine(mode: str = "inproc", hooks=None, core_options=None, **kwargs):
    """An AsyncLLM over a core in this process (inproc: an LLM's, not started) or a started one over
    a core process (mp: launched from this thread)."""
    if mode == "mp":
        from engine.arg_utils import engine_config
        from engine.engine.async_llm import AsyncLLM

        llm = AsyncLLM(engine_config("tiny-gpt2", **kwargs), hooks, core_options=core_options)
        return llm.start()
    from engine import LLM
    from engine.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_core(LLM("tiny-gpt2", hooks=hooks, **kwargs).llm_engine.engine_core.engine_core)


@pytest.fixture(scope="session", params=MODES)
def live(model_cache, request):
    from engine.entrypoints.openai import build_app

    async_engine = make_engine(request.param, core_options={"trace": True}, num_kv_blocks=NUM_KV_BLOCKS)
    server, thread, url = start_server(build_app(async_engine, "tiny-gpt2"))
    yield Live(url, async_engine, mode=request.param)
    server.should_exit = True
    thread.join(30)


@pytest.fixture
def client(live):
    from openai import OpenAI

    with OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def http(live):
    import httpx

    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c
