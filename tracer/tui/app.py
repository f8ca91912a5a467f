"""The TUI app: a header, seven panels in tabs, the footer with the keys.

A timer (REFRESH_HZ) folds what the source has received and redraws the header and the
visible panel; panels that are not visible cost nothing. Under load (requests in flight,
the engine running) the header and the visible panel redraw together, at most BUSY_HZ times
a second (a panel whose whole content changes at every step, 64 streaming requests, cannot
keep up with every refresh): both always show the same step. The Log is the exception: it
streams the events at every refresh. When the engine goes from idle to busy the app opens the Overview (unless
the user chose a panel in the last FOLLOW_QUIET seconds), so a first request is on screen
without a key pressed. The engine thread never waits for any of this: it only publishes
into the tracer's ring buffer, and commands only flip the step controller's flags.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Input, TabbedContent, TabPane

from engine.trace_names import is_attention_kernel
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
from tracer.tui.widgets.overview import OverviewPanel
from tracer.tui.widgets.panel import WIDE, Panel  # noqa: F401  (WIDE: the lessons' TUI lays out by it too)
from tracer.tui.widgets.panes import Panes
from tracer.tui.widgets.requests import RequestsPanel
from tracer.tui.widgets.startup import StartupPanel
from tracer.tui.widgets.step import StepPanel

REFRESH_HZ = 12  # the timer drops a tick when the loop is late: 12 asked, at least 10 had under load
BUSY_HZ = 4  # under load, the header and the visible panel redraw together at most this often
PANES = [("overview", "Overview"), ("requests", "Requests"), ("kv", "KV cache"), ("step", "Step"),
         ("kernels", "Kernels"), ("log", "Log"), ("startup", "Startup")]
TEST_PROMPT, TEST_TOKENS = "The paged KV cache", 16  # the palette's test request: greedy, as `vllm-trace send`
CONTROL_ACTIONS = {"toggle_pause", "step", "breakpoints", "triton", "profile"}
TRAVEL_ACTIONS = {"travel"}
PANE_ACTIONS = {"show_pane", "cycle_pane"}  # keys that work whatever has focus (not while typing)
FOLLOW_QUIET = 5.0  # seconds after the user chose a panel during which the app does not switch


class TraceApp(App):
    """The Textual app over one Source (live, attached or replayed): the header, the panels in
    tabs and the footer's keys. It reads the source's folded state on a timer and sends the
    source commands (pause, step, breakpoints, travel through a replay); it never makes the
    engine wait (see the module docstring)."""

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
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "interrupt", show=False),  # what Ctrl-C does to any command (Textual: "press ctrl+q")
        Binding("t", "triton", "on Triton"),
        Binding("p", "profile", "profile"),
        Binding("r", "next_rank", "rank"),  # tensor parallelism only (check_action)
        Binding("i", "next_instance", "instance"),  # attached to several servers only (check_action)
        Binding("slash", "filter", "filter"),
        Binding("question_mark", "help", "help"),
        Binding("tab", "cycle_pane(1)", "next panel", show=False, priority=True),
        Binding("shift+tab", "cycle_pane(-1)", "previous panel", show=False, priority=True),
        *[Binding(str(i + 1), f"show_pane('{pane}')", title, show=False, priority=True)
          for i, (pane, title) in enumerate(PANES)],
    ]

    def __init__(self, source: Source, initial_pane: str | None = None, refresh_hz: float = REFRESH_HZ,
                 follow: bool = True):
        super().__init__()
        self.source = source
        self.refresh_hz = refresh_hz
        self.follow = follow  # open the Overview when the engine goes busy (a benchmark keeps its panel)
        self.selected: str | None = None
        self.stepping = False
        self.ticks = 0  # refreshes done (the overhead benchmark counts them)
        self.busy_ticks, self.busy_seconds = 0, 0.0  # refreshes, and time, with requests in flight
        self._last_tick: float | None = None  # when the last refresh ran
        self.frame: Frame | None = None
        self._timer = None
        self._initial_pane = initial_pane or ("overview" if source.info.mode == "replay" else "startup")
        self._busy = False  # the engine had requests at the last refresh
        self._drawn_at = -1e9  # when the header and the visible panel were last drawn (monotonic seconds)
        self._known = 0  # requests the state had at the last refresh
        self._chosen_at = -1e9  # when the user last chose a panel (monotonic seconds)
        self._held_name: str | None = None  # the launch the engine is held before
        self._ranks = 1  # tensor-parallel ranks: the footer shows `r` with more than one
        self.interrupt = None  # ctrl+c: the command's own Ctrl-C (serve: the signal), else exit with 130
    # ---- layout ----------------------------------------------------------------------------
    def compose(self):
        info = self.source.info
        yield StatusHeader(info, id="header")
        with Panes(initial=self._initial_pane, id="panes"):
            with TabPane("Overview", id="overview"):
                yield OverviewPanel()
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
            with TabPane("Startup", id="startup"):
                yield StartupPanel(info.model, info.url, info.mode)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        # Kept, not queried per refresh: queries run against the active screen (a modal one,
        # the palette) and would not find the panels there.
        try:
            self.header = self.query_one(StatusHeader)
            self.panes = self.query_one(TabbedContent)
            self.log_panel = self.query_one(LogPanel)
        except NoMatches:  # told to exit before its widgets were mounted (Ctrl-C as `serve` starts)
            return
        self.tick()
        self._timer = self.set_interval(1 / self.refresh_hz, self.tick)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Hide what the source cannot do (no engine to step in a replay, no time travel live)."""
        if action in CONTROL_ACTIONS and not self.source.can_control:
            return False
        if action in TRAVEL_ACTIONS and not self.source.can_time_travel:
            return False
        if action in PANE_ACTIONS and (len(self.screen_stack) > 1 or isinstance(self.focused, Input)):
            return False  # the key goes on to the dialog or the field being typed in
        if action == "triton" and self.frame is not None:
            from tracer.tui.widgets.kernels import held_launch
            held = held_launch(self.frame) or {}
            return is_attention_kernel(held.get("name"))  # (the footer shows t only then)
        if action == "next_rank" and self.frame is not None:
            return self.frame.state.tensor_parallel_size > 1  # the footer shows r only with several ranks
        if action == "next_instance":
            return hasattr(self.source, "next_instance")  # `attach URL1 URL2`: the footer shows i
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
        held = (frame.state.paused_at or {}).get("info", {}).get("name") if controller.get("paused") else None
        ranks = frame.state.tensor_parallel_size
        if held != self._held_name or ranks != self._ranks:  # `t` only before an attention launch, `r` with ranks
            self._held_name, self._ranks = held, ranks
            self.refresh_bindings()
        self.header.connection = self.source.disconnected()
        self.log_panel.feed(self.source.take_events())
        busy = bool(state.waiting or state.running)
        arrived = len(state.requests) > self._known  # (a short request may come and go between two refreshes)
        went_idle = not busy and (self._busy or arrived)
        went_busy = (busy or arrived) and not self._busy
        self._count_busy(busy)
        self._busy, self._known = busy, len(state.requests)
        self.ticks += 1
        if went_busy and self._may_follow():
            self.show_pane("overview")
        panel = self.active_panel()
        under_load = busy and not controller.get("paused") and panel.throttled
        now = time.monotonic()
        if under_load and not went_busy and now - self._drawn_at < 1 / BUSY_HZ:
            return  # one frame: the header and the body show the same state, so both wait
        self._drawn_at = now
        self.header.show(frame, self.stepping)
        if isinstance(self.screen, RequestScreen):
            self.screen.show(frame)
        else:
            self._show(panel, frame, went_idle or under_load)

    def _count_busy(self, busy: bool) -> None:
        """Refreshes per second while requests are in flight, what `serve` reports at exit (and
        benchmarks.tui_terminal reads): the rate that matters is the one under load."""
        now = time.monotonic()
        if self._busy and self._last_tick is not None:  # busy since the last refresh
            self.busy_seconds += now - self._last_tick
        self.busy_ticks += busy
        self._last_tick = now

    @property
    def busy_refresh_hz(self) -> float | None:
        return self.busy_ticks / self.busy_seconds if self.busy_seconds > 0.5 else None

    @staticmethod
    def _show(panel: Panel, frame: Frame, force: bool) -> None:
        if panel.is_mounted:  # (its widgets are built after the first refresh under load)
            panel.show(frame, force=force)

    def _may_follow(self) -> bool:
        return (self.follow and self.source.info.mode in ("live", "attach") and len(self.screen_stack) == 1
                and not isinstance(self.focused, Input) and time.monotonic() - self._chosen_at > FOLLOW_QUIET)

    def active_panel(self) -> Panel:
        # by the id: active_pane follows a change only once TabbedContent's messages are handled
        return self.panes.get_pane(self.panes.active).children[0]

    def show_pane(self, pane: str, chosen: bool = False) -> None:
        if chosen:
            self._chosen_at = time.monotonic()
        if self.panes.active != pane:
            self.panes.active = pane

    def on_tab_clicked(self) -> None:
        self._chosen_at = time.monotonic()  # a click on a tab is a choice, as a key is

    on_tabs_clicked = on_tab_clicked

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        panel = self.active_panel()
        if event.pane.id != self.panes.active:
            return  # an older switch: the panel now active has had (or will have) its own
        if self.frame is not None:
            self.header.show(self.frame, self.stepping)
            self._show(panel, self.frame, True)
        if len(self.screen_stack) == 1:
            panel.focus_list()

    def on_requests_panel_selected(self, message: RequestsPanel.Selected) -> None:
        self.selected = message.request_id
        if message.open:
            self.push_screen(RequestScreen(message.request_id))
        if self.frame is not None and self.panes.is_attached:  # (a Selected still queued at exit: no panes)
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

    def action_profile(self) -> None:
        """`p`: profiling on (every op of the forward pass a launch, on the roofline) or off again.
        The engine applies it between steps (a held engine: when its step ends), so the command
        runs as a worker: the keys that let the engine go on must keep working meanwhile."""
        self.tick()
        on = self.frame is not None and self.frame.state.profiling
        self.notify("stopping profiling at the next step boundary…" if on else
                    "profiling from the next step on: every op is a launch (Kernels panel, 5); p stops it")
        if not on:
            self.show_pane("kernels", chosen=True)
        self.run_worker(self._profile(not on), group="profile", exclusive=True)

    async def _profile(self, start: bool) -> None:
        if await self._command(self.source.start_profile() if start else self.source.stop_profile()):
            self.tick()

    def action_breakpoints(self) -> None:
        self.push_screen(BreakpointsScreen(self.source))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.source.can_control, self.source.can_time_travel))

    def action_show_pane(self, pane: str) -> None:
        self.show_pane(pane, chosen=True)

    def action_cycle_pane(self, delta: int) -> None:
        ids = [p for p, _ in PANES]
        self.show_pane(ids[(ids.index(self.panes.active) + delta) % len(ids)], chosen=True)

    def action_filter(self) -> None:
        panel = self.active_panel()
        if not panel.filterable:
            self.action_show_pane("log")
            panel = self.log_panel
        panel.open_filter()

    async def action_triton(self) -> None:
        """`t`: run the attention launch the engine is held before through our Triton kernel."""
        from tracer.tui.widgets.kernels import held_launch
        self.tick()  # the controller's state now, not at the last refresh
        held = held_launch(self.frame) if self.frame is not None else None
        if held is None or not is_attention_kernel(held.get("name")):
            self.notify("t runs a held attention launch on Triton: press k until the engine holds before "
                        "unified_attention", severity="warning")
            return
        self.show_pane("kernels", chosen=True)
        self.notify(f"running {held.get('name')} (layer {held.get('layer_idx')}) through the Triton kernel…")
        self.run_worker(self._triton(held), group="triton", exclusive=True)

    def action_next_rank(self) -> None:
        """`r`: the Kernels panel lists the next tensor-parallel rank's launches (then all ranks')."""
        self.show_pane("kernels", chosen=True)
        self.query_one(KernelsPanel).next_rank()

    def action_next_instance(self) -> None:
        """`i` (attached to several servers): show the next one, every panel redrawn from its state."""
        info = self.source.next_instance()
        self.header.info, self.selected = info, None
        self.notify(f"instance {info.url}")
        self.tick()
        if self.frame is not None:
            self.header.show(self.frame, self.stepping)
            self._show(self.active_panel(), self.frame, True)

    async def _triton(self, held: dict) -> None:
        try:
            result = await self.source.held_attention_on_triton()
        except Unsupported as e:
            self.notify(str(e), severity="warning")
            return
        except Exception as e:  # the engine moved on, or the kernel refused the inputs: say so
            self.notify(f"{type(e).__name__}: {e}", severity="error")
            return
        self.query_one(KernelsPanel).set_rerun(held, result)
        self.tick()

    async def action_send_test_request(self) -> None:
        try:
            what = await self.source.send_test_request(TEST_PROMPT, TEST_TOKENS)
        except Unsupported as e:
            self.notify(str(e), severity="warning")
            return
        self.notify(f"sent {TEST_PROMPT!r} ({TEST_TOKENS} tokens, greedy): {what}")

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

    def action_interrupt(self) -> None:
        """ctrl+c: the terminal is the TUI's, so the key arrives here rather than as SIGINT."""
        if self.interrupt is not None:
            self.interrupt()
        else:
            self.exit(return_code=130)

    async def on_unmount(self) -> None:
        if self._timer is not None:  # None when the app stopped before it mounted
            self._timer.stop()
        await self.source.close()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if self.source.can_control:
            yield SystemCommand("Pause / resume the engine", "space: hold at the next step boundary, or let it run",
                                self.action_toggle_pause)
            yield SystemCommand("Step over", "n: run one engine step", lambda: self.run_action("step('step')"))
            yield SystemCommand("Step into the next phase",
                                "s: schedule → execute_model → grammar bitmask → sample_tokens → update_from_output",
                                lambda: self.run_action("step('phase')"))
            yield SystemCommand("Step to the next kernel launch", "k", lambda: self.run_action("step('kernel')"))
            yield SystemCommand("Breakpoints", "b: hold on arrival, finish, preemption, a layer, a kernel, a request",
                                self.action_breakpoints)
            yield SystemCommand("Run the held attention launch on Triton", "t: its grid, programs, blocks, max |diff|",
                                self.action_triton)
            yield SystemCommand("Profile every op (start / stop)", "p: FLOPs, bytes and time of each op of the forward "
                                "pass, on this machine's roofline (Kernels panel)", self.action_profile)
        if hasattr(self.source, "next_instance"):
            yield SystemCommand("Next instance", "i: show the next server attached (`attach URL1 URL2`)",
                                self.action_next_instance)
        if self.source.can_time_travel:
            for where, title in [("back", "Step back"), ("forward", "Step forward"), ("home", "First step"),
                                 ("end", "Last step")]:
                yield SystemCommand(title, "replay: move through the recorded trace",
                                    lambda w=where: self.run_action(f"travel('{w}')"))
        if not self.source.can_time_travel:  # a replay takes no requests
            yield SystemCommand("Send a test request", f"complete {TEST_PROMPT!r}: {TEST_TOKENS} tokens, greedy "
                                "(temperature 0, as `vllm-trace send`)", self.action_send_test_request)
        yield SystemCommand("Export trace", "write the trace so far to a file (replay: Perfetto JSON)",
                            self.action_export)
        for i, (pane, title) in enumerate(PANES):
            yield SystemCommand(f"Show {title}", f"{i + 1}", lambda p=pane: self.action_show_pane(p))
        yield SystemCommand("Next panel", "tab (shift+tab: the previous one)", lambda: self.action_cycle_pane(1))
        yield SystemCommand("Filter", "/: filter requests or the log", self.action_filter)
        yield SystemCommand("Help", "?: every panel and key explained", self.action_help)
