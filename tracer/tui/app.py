"""The TUI app: a header, six panels in tabs, the footer with the keys.

A timer (REFRESH_HZ) folds what the source has received and redraws the header and the
visible panel; panels that are not visible cost nothing. Under load a panel whose whole
content changes at every step (64 streaming requests) redraws at most 4 times a second.
The engine thread never waits for this: it only publishes into the tracer's ring buffer,
and commands only flip the step controller's flags.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, TabbedContent, TabPane

from tracer.tui.frame import Frame
from tracer.tui.screens.breakpoints import BreakpointsScreen
from tracer.tui.screens.confirm import ConfirmQuit
from tracer.tui.screens.help import HelpScreen
from tracer.tui.screens.request import RequestScreen
from tracer.tui.sources.base import Source, Unsupported
from tracer.tui.widgets.header import StatusHeader
from tracer.tui.widgets.kernels import KernelsPanel
from tracer.tui.widgets.kv_cache import KVCachePanel
from tracer.tui.widgets.log import LogPanel
from tracer.tui.widgets.requests import RequestsPanel
from tracer.tui.widgets.startup import StartupPanel
from tracer.tui.widgets.step import StepPanel

REFRESH_HZ = 12  # the timer drops a tick when the loop is late: 12 asked, at least 10 had under load
WIDE = 140  # columns from which the Requests panel shows the selected request beside the list
PANES = [("startup", "Startup"), ("requests", "Requests"), ("kv", "KV cache"), ("step", "Step"),
         ("kernels", "Kernels"), ("log", "Log")]
TEST_PROMPT = "The paged KV cache"
CONTROL_ACTIONS = {"toggle_pause", "step", "breakpoints"}
TRAVEL_ACTIONS = {"travel"}


class TraceApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "vllm-trace"
    BINDINGS = [
        Binding("space", "toggle_pause", "pause/resume"),
        Binding("n", "step('step')", "step"),
        Binding("s", "step('phase')", "phase"),
        Binding("k", "step('kernel')", "kernel"),
        Binding("b", "breakpoints", "breaks"),
        Binding("left", "travel('back')", "◀ step", priority=True),
        Binding("right", "travel('forward')", "step ▶", priority=True),
        Binding("home", "travel('home')", "first", priority=True),
        Binding("end", "travel('end')", "last", priority=True),
        Binding("slash", "filter", "filter"),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
        *[Binding(str(i + 1), f"show_pane('{pane}')", title, show=False) for i, (pane, title) in enumerate(PANES)],
    ]

    def __init__(self, source: Source, initial_pane: str | None = None, refresh_hz: float = REFRESH_HZ):
        super().__init__()
        self.source = source
        self.refresh_hz = refresh_hz
        self.selected: str | None = None
        self.stepping = False
        self.ticks = 0  # refreshes done (the overhead benchmark counts them)
        self.frame: Frame | None = None
        self._timer = None
        self._initial_pane = initial_pane or ("requests" if source.info.mode == "replay" else "startup")

    # ---- layout ----------------------------------------------------------------------------
    def compose(self):
        info = self.source.info
        yield StatusHeader(info, id="header")
        with TabbedContent(initial=self._initial_pane, id="panes"):
            with TabPane("Startup", id="startup"):
                yield StartupPanel(info.model, info.url, info.mode)
            with TabPane("Requests", id="requests"):
                yield RequestsPanel()
            with TabPane("KV cache", id="kv"):
                yield KVCachePanel()
            with TabPane("Step", id="step"):
                yield StepPanel()
            with TabPane("Kernels", id="kernels"):
                yield KernelsPanel()
            with TabPane("Log", id="log"):
                yield LogPanel()
        yield Footer(compact=True)

    def on_mount(self) -> None:
        # Kept, not queried per refresh: queries run against the active screen (a modal one,
        # the palette) and would not find the panels there.
        self.header = self.query_one(StatusHeader)
        self.panes = self.query_one(TabbedContent)
        self.log_panel = self.query_one(LogPanel)
        self.tick()
        self._timer = self.set_interval(1 / self.refresh_hz, self.tick)

    def on_resize(self) -> None:
        wide = self.size.width >= WIDE
        self.screen_stack[0].query_one("#requests-detail").display = wide
        self.screen_stack[0].query_one(StepPanel).set_class(not wide, "-narrow")

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Hide what the source cannot do (no engine to step in a replay, no time travel live)."""
        if action in CONTROL_ACTIONS and not self.source.can_control:
            return False
        if action in TRAVEL_ACTIONS and not self.source.can_time_travel:
            return False
        return True

    # ---- the refresh -----------------------------------------------------------------------
    def tick(self) -> None:
        if not self.is_running:
            return
        try:
            self._refresh()
        except NoMatches:  # only while tearing down (widgets removed under a last timer tick)
            if self.panes.is_attached:
                raise

    def _refresh(self) -> None:
        state = self.source.refresh()
        controller = self.source.controller()
        if controller.get("paused"):
            self.stepping = False
        self.frame = frame = Frame.of(state, controller, self.source.now_ns(), self.selected)
        self.header.show(frame, self.stepping)
        self.log_panel.feed(self.source.take_events())
        if isinstance(self.screen, RequestScreen):
            self.screen.show(frame)
        else:
            self.active_panel().show(frame)
        self.ticks += 1

    def active_panel(self):
        return self.panes.active_pane.children[0]

    def on_tabbed_content_tab_activated(self) -> None:
        if self.frame is not None:
            self.active_panel().show(self.frame)

    def on_requests_panel_selected(self, message: RequestsPanel.Selected) -> None:
        self.selected = message.request_id
        if message.open:
            self.push_screen(RequestScreen(message.request_id))
        if self.frame is not None:
            self.frame.selected = self.selected
            self.active_panel().show(self.frame)

    # ---- actions ---------------------------------------------------------------------------
    async def _command(self, coro) -> bool:
        try:
            await coro
            return True
        except Unsupported as e:
            self.notify(str(e), severity="warning")
        except Exception as e:  # a server that went away, a refused command: say so, keep running
            self.notify(f"{type(e).__name__}: {e}", severity="error")
        return False

    async def action_toggle_pause(self) -> None:
        c = self.source.controller()
        if c.get("paused") or c.get("pause_requested"):
            await self._command(self.source.resume())
        else:
            await self._command(self.source.pause())
        self.stepping = False
        self.tick()

    async def action_step(self, granularity: str) -> None:
        if await self._command(self.source.step(1, granularity)):
            self.stepping = True
        self.tick()

    async def action_travel(self, where: str) -> None:
        await self._command(self.source.travel(where))
        self.tick()

    def action_breakpoints(self) -> None:
        self.push_screen(BreakpointsScreen(self.source))

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_show_pane(self, pane: str) -> None:
        self.panes.active = pane

    def action_filter(self) -> None:
        panel = self.active_panel()
        if not hasattr(panel, "open_filter"):
            self.action_show_pane("log")
            panel = self.log_panel
        panel.open_filter()

    async def action_send_test_request(self) -> None:
        try:
            what = await self.source.send_test_request(TEST_PROMPT)
        except Unsupported as e:
            self.notify(str(e), severity="warning")
            return
        self.notify(f"sent: {what}")

    async def action_export(self, path: str | None = None) -> None:
        path = path or str(Path.cwd() / time.strftime("vllm-trace-%Y%m%d-%H%M%S.jsonl"))
        if self.source.info.mode == "replay":
            path = str(Path(path).with_suffix(".perfetto.json"))
        try:
            self.notify(f"exported {await self.source.export(path)}", timeout=8)
        except Unsupported as e:
            self.notify(str(e), severity="warning")

    async def action_quit(self) -> None:
        n = self.source.in_flight()
        if n and not isinstance(self.screen, ConfirmQuit):
            def answered(yes: bool | None) -> None:
                if yes:
                    self.exit()
            self.push_screen(ConfirmQuit(n), answered)
        else:
            self.exit()

    async def on_unmount(self) -> None:
        self._timer.stop()
        await self.source.close()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if self.source.can_control:
            yield SystemCommand("Pause / resume the engine", "space: hold at the next step boundary, or let it run",
                                self.action_toggle_pause)
            yield SystemCommand("Step over", "n: run one engine step", lambda: self.run_action("step('step')"))
            yield SystemCommand("Step into the next phase", "s: schedule → execute → postprocess",
                                lambda: self.run_action("step('phase')"))
            yield SystemCommand("Step to the next kernel launch", "k", lambda: self.run_action("step('kernel')"))
            yield SystemCommand("Breakpoints", "b: hold on arrival, finish, preemption, a layer, a kernel, a request",
                                self.action_breakpoints)
        if self.source.can_time_travel:
            for where, title in [("back", "Step back"), ("forward", "Step forward"), ("home", "First step"),
                                 ("end", "Last step")]:
                yield SystemCommand(title, "replay: move through the recorded trace",
                                    lambda w=where: self.run_action(f"travel('{w}')"))
        yield SystemCommand("Send a test request", f"POST a completion of {TEST_PROMPT!r} (16 tokens)",
                            self.action_send_test_request)
        yield SystemCommand("Export trace", "write the trace so far to a file (replay: Perfetto JSON)",
                            self.action_export)
        for i, (pane, title) in enumerate(PANES):
            yield SystemCommand(f"Show {title}", f"{i + 1}", lambda p=pane: self.action_show_pane(p))
        yield SystemCommand("Filter", "/: filter requests or the log", self.action_filter)
        yield SystemCommand("Help", "?: every panel and key explained", self.action_help)
