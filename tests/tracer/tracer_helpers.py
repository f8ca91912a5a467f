"""Helpers for the tracer tests: a traced engine run, an engine loop in a thread."""
from __future__ import annotations

import threading

from engine import LLM, Hooks, SamplingParams
from tracer.session import TraceSession

PROMPTS = ["The quick brown fox jumps", "Hello there", "A shared prefix, a shared prefix! one",
           "A shared prefix, a shared prefix! two", "x"]


def traced_run(path, prompts=PROMPTS, max_tokens=10, **llm_kwargs):
    """Run prompts through a traced LLM, recording to path. Returns (outputs, session)."""
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=path, control=False)
    llm_kwargs.setdefault("block_size", 4)
    llm = LLM("tiny-gpt2", hooks=hooks, **llm_kwargs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    session.state.update()
    session.close()
    return outs, session


class EngineThread:
    """Runs engine.step() in a background thread until no request is left (or stop())."""

    def __init__(self, engine):
        self.engine = engine
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            while self.engine.has_unfinished_requests():
                self.engine.step()
        except BaseException as e:  # surfaced by join()
            self.error = e

    def start(self):
        self.thread.start()
        return self

    def join(self, timeout=60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "engine thread did not finish"
        if self.error:
            raise self.error


class CoreProcess:
    """The engine core in its own process (AsyncLLM), driven as the controller tests drive an
    LLMEngine: add_request returns once the request is in the core's `waiting`; outputs are
    drained in the background; step_count and has_unfinished_requests come from its stats."""

    def __init__(self, session, **llm_kwargs):
        import asyncio

        from engine.arg_utils import engine_config
        from engine.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.llm = AsyncLLM(engine_config("tiny-gpt2", **llm_kwargs), session.hooks,
                            core_options=session.core_options())
        self.llm.start()  # launched from this (the test's) thread
        session.bind(self.llm)
        self._drains = []

    def add_request(self, request_id, prompt, params):
        import asyncio

        async def add():
            stream = await self.llm.add_request(request_id, prompt, params)

            async def drain():
                async for _ in stream:
                    pass
            self._drains.append(asyncio.ensure_future(drain()))
        asyncio.run_coroutine_threadsafe(add(), self.loop).result(30)

    @property
    def step_count(self) -> int:
        return self.llm.step_count

    def has_unfinished_requests(self) -> bool:
        return not self.llm._idle.is_set()

    def close(self):
        self.llm.stop(0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class CoreLoop:
    """EngineThread's interface for a CoreProcess: its loop runs by itself; join waits for idle."""

    def __init__(self, core: CoreProcess):
        self.core = core

    def start(self):
        return self

    def join(self, timeout=60):
        assert self.core.llm._idle.wait(timeout), "the engine core did not finish its requests"


def start_loop(engine):
    """Run engine's loop: a thread stepping an LLMEngine, or a CoreProcess's own loop."""
    return CoreLoop(engine) if isinstance(engine, CoreProcess) else EngineThread(engine).start()
