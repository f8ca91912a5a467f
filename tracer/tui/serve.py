"""`vllm-trace serve` with the TUI: uvicorn and the Textual app on one asyncio loop.

Why one loop and not uvicorn in a thread: both are asyncio programs that mostly wait, the
engine already has its own thread, and one loop means no cross-thread hand-offs between the
HTTP handlers and the app (commands, test requests). The TUI's work per refresh is bounded
(only the visible panel redraws, the log draws at most a few dozen lines), so it cannot
starve the HTTP handlers; and neither can block the engine thread, which only publishes
into the tracer's ring buffer.

Quitting the TUI stops the server like Ctrl-C does (in-flight requests get the drain
timeout); the server stopping (a signal) closes the TUI.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from tracer.tui.app import TraceApp
from tracer.tui.fmt import plural
from tracer.tui.sources.base import SourceInfo, engine_identity
from tracer.tui.sources.live import LiveSource

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


class _ToApp:
    """A stream for uvicorn's log handlers while the TUI owns the terminal (a line printed
    there would tear the display): the lines go to Textual's log (`textual console`)."""

    def __init__(self, app: TraceApp):
        self.app = app

    def write(self, text: str) -> int:
        if text.strip():
            self.app.log.logging(text.rstrip())
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _uvicorn_logs_to(stream):
    handlers = [h for name in UVICORN_LOGGERS for h in logging.getLogger(name).handlers
                if isinstance(h, logging.StreamHandler)]
    old = [h.setStream(stream) for h in handlers]
    try:
        yield
    finally:
        for h, s in zip(handlers, old):
            h.setStream(s)


def live_info(async_engine, model: str, url: str | None) -> SourceInfo:
    return SourceInfo("live", model=model, device=str(async_engine.device), backend=async_engine.attention_backend,
                      url=url)


class LiveTui:
    """The TUI of `serve`, started before the engine is built, so the Startup panel shows the
    stages as they run (tokenizer, weights, KV cache, kernel warm-up, HTTP ready).

        tui = LiveTui(session, model, url)     # the app runs from here on
        engine = await asyncio.to_thread(...)  # the build publishes its stages on the bus
        tui.engine_ready(async_engine)
        await tui.run(server, serving)         # until the user quits or the server stops
    """

    def __init__(self, session, model: str, url: str, api_key: str | None = None, headless: bool = False):
        self.session = session
        info = SourceInfo("live", model=model, device="…", backend="…", url=url)  # known once built
        self.source = LiveSource(session, info, None, api_key)
        self.app = TraceApp(self.source)
        # ctrl+c is the signal, as without the TUI: while starting, one line and status 130; once
        # serving, the drain and the summary, as `q` (uvicorn's handler takes the signal then)
        self.app.interrupt = lambda: signal.raise_signal(signal.SIGINT)
        self._logs = _uvicorn_logs_to(_ToApp(self.app))
        self._logs.__enter__()
        self.ui = asyncio.ensure_future(self.app.run_async(headless=headless, size=(120, 40) if headless else None))

    @property
    def quit(self) -> bool:
        """The user has closed the TUI."""
        return self.ui.done()

    def engine_ready(self, async_engine) -> None:
        # device and backend: from the engine's own startup stages (the trace), not its objects
        info = self.source.info
        info.device, info.backend = engine_identity(self.source.refresh(), (info.device, info.backend))
        self.source.async_engine = async_engine

    async def close(self) -> None:
        """Close the TUI (also when startup failed or was given up). Safe to call twice."""
        if not self.ui.done():
            self.app.exit()
        try:
            await self.ui
        finally:
            if self._logs is not None:
                self._logs, logs = None, self._logs
                logs.__exit__(None, None, None)

    def summary(self, trace_file: str | None) -> str:
        """What is printed once the TUI has given the terminal back."""
        s = self.source.refresh()
        done = [s.requests[r] for r in s.finished if r in s.requests]
        aborted = sum(r.status == "FINISHED_ABORTED" for r in done)
        tokens = sum(r.num_output_tokens for r in done)
        steps = "no step" if s.step is None else plural(s.step + 1, "engine step")
        served, cut = len(done) - aborted, f", {aborted} aborted" if aborted else ""
        if s.num_finished > len(done):  # the state keeps the latest --trace-max-finished requests
            lines = [f"vllm-trace serve: {s.num_finished} requests finished in {steps}; the latest {len(done)}: "
                     f"{served} served, {tokens} tokens generated{cut}"]
        else:
            lines = [f"vllm-trace serve: {served} request{'' if served == 1 else 's'} served "
                     f"({plural(tokens, 'token')} generated{cut}) in {steps}"]
        hz = self.app.busy_refresh_hz
        if hz is not None:
            lines.append(f"  TUI: {hz:.1f} refreshes/s while requests were in flight "
                         f"({self.app.busy_ticks} in {self.app.busy_seconds:.1f} s)")
        if trace_file:
            lines.append(f"  trace: {trace_file}   replay it: vllm-trace replay {trace_file}")
        else:
            lines.append("  no trace file: add --trace-file PATH to record one, then vllm-trace replay PATH")
        return "\n".join(lines)

    async def run(self, server, serving: asyncio.Task) -> None:
        """Run until the user quits or the server stops, then stop the other."""
        try:
            await asyncio.wait({self.ui, serving}, return_when=asyncio.FIRST_COMPLETED)
            if self.ui.done():
                # Let a held engine run free, so in-flight requests drain while uvicorn shuts down.
                if self.session.controller is not None:
                    self.session.controller.close()
                server.should_exit = True
        finally:
            await self.close()
        await serving
