"""What the TUI costs the engine, measured: stream a load through an ``AsyncLLM``
(its engine core on a thread of this process, or in a process of its own)
with the Textual app running headless on the same asyncio loop, as `serve` runs it next to
uvicorn, or without it. Lesson 17 and the benchmarks tui_overhead and two_processes use it.

In one process the TUI's refreshes take the interpreter lock from the engine's own thread; in
two, they compete only with the API server's work (SSE, detokenizing), while the core steps
in a process of its own.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from tracer.session import TraceSession

_runs = itertools.count()  # request ids stay unique across runs on one front end

Workload = list[tuple[list[int], SamplingParams]]  # (prompt token ids, params) per request


@dataclass
class LoadRun:
    tokens: int  # output tokens of all requests
    seconds: float  # wall clock, first request sent to last output received
    cpu: float  # CPU seconds of this process (all threads) meanwhile: the front end's side
    refresh_hz: float | None  # the TUI's refreshes per second during the run (None: no TUI)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


async def _stream(front, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
    n = 0
    async for out in front.generate({"prompt_token_ids": prompt_ids}, params, request_id):
        n = len(out.outputs[0].token_ids)
    return n


async def stream_load(front, workload: Workload, session: TraceSession | None = None, tui: bool = False,
                      pane: str = "requests", size: tuple[int, int] = (160, 48), model: str = "") -> LoadRun:
    """Send every request of the workload at once through `front`, each consumed as the server's
    SSE handlers do; with tui, the Textual app (fed by `session`) shows `pane` meanwhile. The app
    does not follow the engine to the Overview: the pane asked for is the one measured."""
    run = next(_runs)

    async def go(app) -> LoadRun:
        ticks0 = app.ticks if app is not None else 0
        t0, c0 = time.perf_counter(), time.process_time()
        counts = await asyncio.gather(*(_stream(front, f"load{run}-{i}", ids, params)
                                        for i, (ids, params) in enumerate(workload)))
        seconds = time.perf_counter() - t0
        hz = (app.ticks - ticks0) / seconds if app is not None else None
        return LoadRun(sum(counts), seconds, time.process_time() - c0, hz)

    if not tui:
        return await go(None)
    from tracer.tui.app import TraceApp
    from tracer.tui.serve import live_info
    from tracer.tui.sources.live import LiveSource

    if session is None:
        raise ValueError("the TUI needs the trace session that feeds it")
    app = TraceApp(LiveSource(session, live_info(front, model, None), front), initial_pane=pane, follow=False)
    try:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            while app.ticks == 0:  # its first refresh folds the ring's backlog (earlier runs): not this run's cost
                await asyncio.sleep(0.01)
            return await go(app)
    finally:
        _forget_app_caches()


def _forget_app_caches() -> None:
    """Let the widgets of an app that has exited go. Textual's StylesCache.get_inner_outer is an
    lru_cache (1,024 entries) keyed by the widget's StylesCache, so it keeps every app's caches, and
    their rendered lines, alive after the app is gone: a run opening a new app each time (as this
    module does; serve has one app for its life) carried ~34,000 more objects for the garbage
    collector to walk into each later run, and its refreshes slowed run after run."""
    from textual._styles_cache import StylesCache

    clear = getattr(StylesCache.get_inner_outer, "cache_clear", None)
    if clear is not None:  # (a private API: nothing to do if a later Textual changes it)
        clear()
