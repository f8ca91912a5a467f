"""`serve` opens the TUI before the engine is built: the Startup panel shows each stage while
it runs, the weights with a progress bar of bytes read."""
import asyncio
import threading

import pytest
from textual._context import active_app

from engine import Hooks
from engine.arg_utils import engine_config
from engine.engine.async_llm import AsyncLLM
from engine.engine.core import EngineCore
from tests.tui.helpers import shown
from tracer.session import TraceSession
from tracer.tui.serve import LiveTui
from tracer.tui.widgets.header import StatusHeader
from tracer.tui.widgets.startup import StartupPanel


async def _until(predicate, timeout: float = 30) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


@pytest.mark.asyncio
async def test_the_startup_panel_shows_the_weights_loading_while_they_load():
    hooks = Hooks()
    session = TraceSession(hooks, model="tiny-gpt2")
    release, held = threading.Event(), []

    def hold_mid_load(layer, name, kind, request_id, step, attrs):  # the build thread stops here once
        if name == "model_load_progress" and not held and attrs["bytes"] < attrs["total_bytes"]:
            held.append(attrs)
            release.wait(30)

    hooks.subscribe(hold_mid_load)
    tui = LiveTui(session, "tiny-gpt2", "http://127.0.0.1:8000", headless=True)
    active_app.set(tui.app)  # this test's task reads the widgets: render them as the app would
    try:
        build = asyncio.ensure_future(asyncio.to_thread(EngineCore, engine_config("tiny-gpt2"), hooks))
        await _until(lambda: held)
        # under load the app may still be building its widgets: wait for the panel, not assume it
        await _until(lambda: tui.app.is_running and tui.app.screen_stack and tui.app.query(StartupPanel)
                     and tui.app.query_one(StartupPanel).is_mounted)
        panel = tui.app.query_one(StartupPanel)

        def text() -> str:
            if not panel.query("#startup-ready"):
                return ""
            return shown(panel.query_one("#startup-stages")) + shown(panel.query_one("#startup-ready"))
        await _until(lambda: "in progress:" in text())  # drawn by the app's own timer
        assert "✓" in text() and "in progress:" in text() and " of " in text()  # bytes read of all
        bar = panel.query_one("#startup-progress")
        assert bar.display and bar.total == held[0]["total_bytes"] and 0 < bar.progress < bar.total
        assert "starting" in text() and "Ready" not in text()  # not ready: HTTP is not up yet
        release.set()
        engine = await build
        tui.engine_ready(AsyncLLM.from_engine_core(engine))
        await _until(lambda: "cpu · cpu" in shown(tui.app.query_one(StatusHeader)))
    finally:
        release.set()
        await tui.close()
        session.close()
