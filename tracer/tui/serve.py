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

from tracer.tui.app import TraceApp
from tracer.tui.sources.base import SourceInfo
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
    engine = async_engine.engine
    return SourceInfo("live", model=model, device=str(engine.device), backend=engine.attention_backend, url=url)


async def run_tui(server, serving: asyncio.Task, session, async_engine, model: str, url: str,
                  api_key: str | None = None) -> None:
    """Run the TUI until the user quits or the server stops, then stop the other."""
    app = TraceApp(LiveSource(session, live_info(async_engine, model, url), async_engine, api_key))
    with _uvicorn_logs_to(_ToApp(app)):
        ui = asyncio.ensure_future(app.run_async())
        await asyncio.wait({ui, serving}, return_when=asyncio.FIRST_COMPLETED)
        if ui.done():
            # Let a held engine run free, so in-flight requests drain while uvicorn shuts down.
            if session.controller is not None:
                session.controller.close()
            server.should_exit = True
        else:
            app.exit()
        await ui
    await serving
