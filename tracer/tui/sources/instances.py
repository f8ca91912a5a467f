"""InstancesSource: `vllm-trace attach URL1 URL2 ...`, several servers in one TUI (disaggregated
prefill's prefill and decode instances), shown one at a time: `i` goes to the next.

Every instance stays attached and folded while another is shown (each RemoteSource follows its own
event stream), so switching shows the instance as it is now; the Log starts over with the shown
instance's latest events (KEEP of each are kept). Reads and commands go to the instance shown; the
header's URL names it ("[2/2] http://...").
"""
from __future__ import annotations

import dataclasses
from collections import deque

from tracer.events import Event
from tracer.state import TraceState
from tracer.tui.sources.base import EventBatch, Source, SourceInfo

KEEP = 2000  # each instance's latest events, for the Log when it is shown (the Log panel keeps as many)


class InstancesSource(Source):
    can_control = True
    can_time_travel = False

    def __init__(self, sources: list[Source]):
        if len(sources) < 2:
            raise ValueError("InstancesSource needs two sources or more")
        self.sources = sources
        self.shown = 0
        self._recent: list[deque[Event]] = [deque(maxlen=KEEP) for _ in sources]
        self._switched = False

    @property
    def source(self) -> Source:
        return self.sources[self.shown]

    @property
    def info(self) -> SourceInfo:
        info = self.source.info
        return dataclasses.replace(info, url=f"[{self.shown + 1}/{len(self.sources)}] {info.url}")

    def next_instance(self) -> SourceInfo:
        """Show the next instance; returns its info."""
        self.shown = (self.shown + 1) % len(self.sources)
        self._switched = True
        return self.info

    async def start(self) -> None:
        for s in self.sources:
            await s.start()

    async def close(self) -> None:
        for s in self.sources:
            await s.close()

    def refresh(self) -> TraceState:
        for s in self.sources:  # every instance keeps folding what it receives
            if s is not self.source:
                s.refresh()
        return self.source.refresh()

    def take_events(self) -> EventBatch:
        shown = None
        for i, s in enumerate(self.sources):
            batch = s.take_events()
            if batch.reset:
                self._recent[i].clear()
            self._recent[i].extend(batch.events)
            if i == self.shown:
                shown = batch
        if self._switched:
            self._switched = False
            return EventBatch(list(self._recent[self.shown]), reset=True)
        return shown

    def now_ns(self) -> int:
        return self.source.now_ns()

    def controller(self) -> dict:
        return self.source.controller()

    def in_flight(self) -> int:
        return self.source.in_flight()

    def disconnected(self) -> str | None:
        return self.source.disconnected()

    def kernel_access(self, kernel: dict, state: TraceState) -> dict | None:
        return self.source.kernel_access(kernel, state)

    # ---- commands: the instance shown ----------------------------------------------------------
    async def pause(self) -> None:
        await self.source.pause()

    async def resume(self) -> None:
        await self.source.resume()

    async def step(self, n: int = 1, granularity: str = "step") -> None:
        await self.source.step(n, granularity)

    async def add_breakpoint(self, condition: str) -> None:
        await self.source.add_breakpoint(condition)

    async def remove_breakpoint(self, condition: str) -> None:
        await self.source.remove_breakpoint(condition)

    async def start_profile(self) -> None:
        await self.source.start_profile()

    async def stop_profile(self) -> None:
        await self.source.stop_profile()

    async def send_test_request(self, prompt: str, max_tokens: int = 16) -> str:
        return await self.source.send_test_request(prompt, max_tokens)

    async def export(self, path: str) -> str:
        return await self.source.export(path)

    async def held_attention_on_triton(self) -> dict:
        return await self.source.held_attention_on_triton()
