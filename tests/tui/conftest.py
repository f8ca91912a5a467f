"""A real engine (the built-in tiny-gpt2, small KV cache) behind the TUI, held by the step
controller from the start, so every test decides exactly when a step runs."""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import pytest

from engine import LLM, Hooks, SamplingParams
from engine.engine.async_llm import AsyncLLM
from tracer.session import TraceSession
from tracer.tui.app import TraceApp
from tracer.tui.sources.base import SourceInfo
from tracer.tui.sources.live import LiveSource

PROMPTS = ["Hello there", "The quick brown fox jumps", "x"]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    if not os.environ.get("VLLM_TRACE_CACHE"):
        os.environ["VLLM_TRACE_CACHE"] = str(tmp_path_factory.mktemp("vtc"))
    return os.environ["VLLM_TRACE_CACHE"]


@dataclass
class Live:
    session: TraceSession
    engine: AsyncLLM
    source: LiveSource
    app: TraceApp

    @property
    def controller(self):
        return self.session.controller

    async def submit(self, prompts=PROMPTS, params=GREEDY, prefix="r"):
        """Queue requests (accepted while the engine is held); returns their streams."""
        return [await self.engine.add_request(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]

    async def held(self, timeout: float = 30):
        """Wait (off the event loop) until the controller holds the engine again."""
        stop = await asyncio.to_thread(self.controller.wait_until_paused, timeout)
        assert stop is not None, "the engine did not stop"
        return stop

    def block_tables(self) -> dict[str, list[int]]:
        """Each request's block table as the engine holds it (a snapshot asked of the core)."""
        snap = self.engine.engine_core.call("snapshot")
        return {r["request_id"]: r["block_table"] for r in snap["waiting"] + snap["running"]}

    async def settle(self, pilot, until=None, timeout: float = 30.0):
        """One refresh of the TUI now (the timer would do it within 100 ms) and its redraw; with
        `until` (a function of nothing), refreshes on until it returns true or `timeout` passes
        (what a user sees within a few of the app's own refreshes: CI under load twice failed on
        a check made after exactly one, which a person at the terminal never sees)."""
        self.app.tick()
        await pilot.pause()
        deadline = time.monotonic() + timeout
        while until is not None and not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            self.app.tick()
            await pilot.pause()


class SpareCore:
    """One engine-core process spawned ahead of need: it imports torch and the engine, then waits for
    its arguments on stdin (``spawn_core_process``, as ``serve`` starts it early). Each "mp" engine
    takes the spare spawned during the test before it and spawns the next, so a core's imports overlap
    a test instead of being waited for (measured on two busy cores: an mp engine up in 0.7-2.8 s from a
    spare, 5.5-8.7 s from nothing). Every engine is still a fresh process: these tests count steps,
    requests, breakpoints and trace events from a fresh start, which one shared core would not give."""

    def __init__(self):
        self.proc = None

    def take(self, spawn_next: bool):
        from engine.engine.core_client import spawn_core_process

        proc = self.proc if self.proc is not None and self.proc.poll() is None else spawn_core_process()
        self.proc = spawn_core_process() if spawn_next else None
        return proc

    def close(self):
        if self.proc is not None:  # it exits at the end of its stdin, before any engine is built
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def spare_core():
    spare = SpareCore()
    yield spare
    spare.close()


def _mp_later(request) -> bool:
    """Whether a test after this one in the session runs the "mp" engine (a spare is spawned only for it)."""
    items = request.session.items
    later = items[items.index(request.node) + 1:]
    return any("spare_core" in item.fixturenames and item.callspec.params.get("live") == "mp" for item in later)


def _held_engine(mode: str, core_proc=None):
    """A TraceSession holding a fresh engine from the start, and the AsyncLLM on it: the engine on a
    thread here ("inproc"), or the engine core in its own process ("mp", as `serve` runs it), stepped
    through the remote controller. It schedules asynchronously (vLLM's default with CUDA, `--async-scheduling` on a
    CPU), the loop whose stepping these tests check; test_controller steps both loops."""
    hooks = Hooks()
    # the byte-level random model: these tests count prompt tokens as bytes
    mp = mode == "mp"
    session = TraceSession(hooks, start_paused=True, model="tiny-gpt2-random", remote_control=mp)
    if mp:
        from engine.arg_utils import engine_config
        config = engine_config("tiny-gpt2-random", block_size=4, num_kv_blocks=64, async_scheduling=True)
        engine = AsyncLLM(config, hooks, drain_timeout=0, core_options=session.core_options(),
                          core_proc=core_proc).start()
        session.bind(engine)
    else:
        llm = LLM("tiny-gpt2-random", hooks=hooks, block_size=4, num_kv_blocks=64, async_scheduling=True)
        engine = AsyncLLM.from_engine_core(llm.llm_engine.engine_core.engine_core, drain_timeout=0).start()
    return session, engine


def _live(session, engine) -> Live:
    source = LiveSource(session, SourceInfo("live", "tiny-gpt2-random", "cpu", "torch"), engine)
    return Live(session, engine, source, TraceApp(source, initial_pane="requests"))


@pytest.fixture(params=["inproc", pytest.param("mp", marks=pytest.mark.slow)])
def live(model_cache, spare_core, request):
    """A held engine of its own and a TUI on it (see _held_engine). The engine core in its own process ("mp")
    repeats each test over the remote controller: make test-slow runs it; a test that names "mp" itself
    (parametrize("live", ["mp"], indirect=True)) runs in make test."""
    core_proc = spare_core.take(_mp_later(request)) if request.param == "mp" else None
    session, engine = _held_engine(request.param, core_proc)
    yield _live(session, engine)
    session.close()
    engine.stop(drain_timeout=0)


@pytest.fixture(scope="module", params=["inproc", "mp"])
def _idle_engine(model_cache, request):
    session, engine = _held_engine(request.param)
    yield session, engine
    session.close()
    engine.stop(drain_timeout=0)


@pytest.fixture
def idle_live(_idle_engine):
    """A fresh TUI on an engine shared by a module's tests that never step it, send it a request or
    set a breakpoint (keys, help, panels, quitting): one that did would leave its steps, requests or
    breakpoints to the next test. Each test starts from a held, empty engine, as checked here."""
    session, engine = _idle_engine
    live = _live(session, engine)
    state = live.source.refresh()
    assert state.step is None and not state.waiting and not state.running and not state.finished
    status = live.controller.status()
    assert live.controller.breakpoints == () and (status["paused"] or status["pause_requested"]), status
    yield live


@pytest.fixture(scope="session")
def recorded_trace(model_cache, tmp_path_factory):
    from tests.tui.recorded import record
    return record(tmp_path_factory.mktemp("recorded") / "trace.jsonl")
