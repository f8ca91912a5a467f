"""LiveSource: the engine in this process (`vllm-trace serve`, and the tests).

The source folds the session's own state (``session.state``, what ``/trace/state`` answers
from) on the UI thread, at each refresh, so the panels read it without copying it. Nothing
else may mutate it meanwhile: the session's follower thread, which keeps that state current
when no TUI does, is stopped while the source lives, and ``/trace/state`` folds it on the
event loop, the UI's thread. One fold, not two: with a second subscription of its own, every
event was decoded and folded twice, and the TUI cost `serve` 0.83 of its throughput in a real
terminal instead of 0.92 (benchmarks.tui_terminal, 64 streams). The engine thread only ever
publishes into the ring buffer; it never waits for the TUI.
"""
from __future__ import annotations

import asyncio
import itertools

from tracer.conditions import parse_condition
from tracer.session import TraceSession
from tracer.state import TraceState
from tracer.tui.sources.base import EventBatch, LogBuffer, Source, SourceInfo

LOG_BACKLOG = 5000  # events kept for a log panel that is not looking (older ones are dropped)


class LiveSource(Source):
    def __init__(self, session: TraceSession, info: SourceInfo, async_engine=None, api_key: str | None = None):
        self.session = session
        self.info = info
        self.async_engine = async_engine
        self.api_key = api_key
        self._was_following = session.state.following
        session.state.stop_following()  # this source folds the state from now on (see the module docstring)
        self._log = LogBuffer(LOG_BACKLOG)
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count(1)
        if session.controller is None:
            self.can_control = False

    @property
    def _controller(self):
        return self.session.controller

    def refresh(self) -> TraceState:
        events, missed = self.session.state.update_events()
        self._log.missed += missed
        self._log.events.extend(events)
        return self.session.state.state

    def take_events(self) -> EventBatch:
        return self._log.take()

    def now_ns(self) -> int:
        bus = self.session.bus
        return bus.clock() - bus.start_ns

    def controller(self) -> dict:
        if self._controller is None:
            return {"paused": False, "breakpoints": []}
        return self._controller.status()

    # ---- commands (the controller only flips flags under its lock: nothing here waits) ----
    async def pause(self) -> None:
        self._need_controller().pause()

    async def resume(self) -> None:
        self._need_controller().resume()

    async def step(self, n: int = 1, granularity: str = "step") -> None:
        self._need_controller().step(n, granularity)

    async def add_breakpoint(self, condition: str) -> None:
        self._need_controller().add_breakpoint(parse_condition(condition))

    async def remove_breakpoint(self, condition: str) -> None:
        c = self._need_controller()
        for bp in c.breakpoints:
            if str(bp) == condition:
                c.remove_breakpoint(bp)

    def _need_controller(self):
        if self._controller is None:
            from tracer.tui.sources.base import Unsupported
            raise Unsupported("this session has no step controller")
        return self._controller

    async def start_profile(self) -> None:
        await self._profile("start")

    async def stop_profile(self) -> None:
        await self._profile("stop")

    async def _profile(self, what: str) -> None:
        """The engine's own start_profile / stop_profile when this process holds it, else the
        server's POST /start_profile, /stop_profile (`serve`: the TUI and the server share a process
        but not a handle on the engine)."""
        if self.async_engine is not None:
            await getattr(self.async_engine, f"{what}_profile")()
        elif self.info.url:
            import httpx

            from tracer.net import trust_env
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            async with httpx.AsyncClient(timeout=30, trust_env=trust_env(self.info.url)) as client:
                resp = await client.post(f"{self.info.url}/{what}_profile", json={}, headers=headers)
            if resp.status_code >= 400:
                from tracer.tui.sources.base import Unsupported
                raise Unsupported(f"POST /{what}_profile: HTTP {resp.status_code}: {resp.text[:200]}")
        else:
            await getattr(super(), f"{what}_profile")()

    async def send_test_request(self, prompt: str, max_tokens: int = 16) -> str:
        """Through HTTP when there is a server (the whole journey: http, api, tokenizer, ...),
        else straight into the engine. Returns at once: the request may wait while paused."""
        if self.info.url:
            coro = _post_completion(self.info.url, self.info.model, prompt, max_tokens, self.api_key)
            what = f"POST {self.info.url}/v1/completions"
        elif self.async_engine is not None:
            rid = f"tui-{next(self._ids)}"
            coro = _generate(self.async_engine, rid, prompt, max_tokens)
            what = f"request {rid}"
        else:
            return await super().send_test_request(prompt, max_tokens)
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return what

    async def held_attention_on_triton(self) -> dict:
        if self.async_engine is None:
            return await super().held_attention_on_triton()
        # the engine's thread is the one held: the kernel runs on another (interpreted: seconds)
        return await asyncio.to_thread(self.async_engine.held_attention_on_triton)

    async def export(self, path: str) -> str:
        from tracer.recorder import Recorder

        def write() -> int:
            # A recorder from the oldest event the ring still holds; close() drains and fsyncs.
            config = self.session.state.state.engine_config
            rec = Recorder(self.session.bus, path, self.info.model, config, poll_interval=3600)
            rec.close()
            return rec.num_written
        n = await asyncio.to_thread(write)
        return f"{n} events to {path} (vllm-trace replay {path})"

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._was_following:  # the TUI has gone: the follower keeps the session's state current again
            self._was_following = False
            self.session.state.follow()


async def _post_completion(url: str, model: str, prompt: str, max_tokens: int, api_key: str | None) -> None:
    import httpx

    from tracer.net import trust_env

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(timeout=None, trust_env=trust_env(url)) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
            async for _ in resp.aiter_bytes():
                pass


async def _generate(async_engine, request_id: str, prompt: str, max_tokens: int) -> None:
    from engine.sampling_params import SamplingParams

    async for _ in async_engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0), request_id):
        pass
