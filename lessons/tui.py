"""`--tui`: a lesson in the TUI, its engine held at each checkpoint, its narration beside it.

The lesson's `run(lesson)` is unchanged: it runs in a thread of its own and steps its engine
itself, so "held at a checkpoint" means that thread waits in `pause()` until the learner
presses `c`. Meanwhile the panels fold the session's bus on the UI thread exactly as they do
for `vllm-trace serve`; since nothing steps the engine, they show it as it was at the checkpoint.
Every update from the lesson thread goes through `App.call_from_thread`.

Quitting cancels the lesson: its next narration line or checkpoint raises LessonCancelled,
`run_lesson` catches it and closes the sessions, and the app exits once that thread is done
(a second `q` exits at once).
"""
from __future__ import annotations

import threading
import traceback
from pathlib import Path

from rich.measure import Measurement
from rich.panel import Panel as RichPanel
from rich.table import Table
from rich.text import Text
from textual.binding import Binding
from textual.widgets import RichLog

import tracer.tui.app
from lessons.framework import Lesson, LessonCancelled, Presenter, Run, run_lesson
from tracer.state import TraceState
from tracer.tui.app import WIDE, TraceApp
from tracer.tui.sources.base import EventBatch, Source, SourceInfo
from tracer.tui.sources.live import LiveSource
from tracer.tui.widgets.step import StepPanel

ABORTED = 130
NARRATION_PCT, NARRATION_MIN = 45, 36  # the side panel's share of the terminal, and its least width
PANELS_MIN = 56  # columns the panels keep when the narration widens for a table
NARRATION_CHROME = 5  # the side panel's left border, padding and scrollbar (until it is laid out)


class LessonSource(Source):
    """The engine of the lesson's most recent `lesson.engine()` (a lesson may build several):
    a LiveSource on that session, replaced when a newer session appears. No step controller:
    the lesson drives the steps, so the app hides pause/step/breakpoints."""

    can_control = False

    def __init__(self, lesson: Lesson):
        self.lesson = lesson
        # no url: nothing to send requests to (the Startup panel would print a curl line)
        self.info = SourceInfo("lesson", model=lesson.model)
        self.held: str | None = None  # the checkpoint's prompt while the lesson waits for the learner
        self.ended = False
        self._live: LiveSource | None = None
        self._switched = False

    def _follow(self) -> LiveSource | None:
        sessions = self.lesson.sessions  # appended by the lesson thread; reading [-1] is atomic
        if sessions and (self._live is None or self._live.session is not sessions[-1]):
            self._live = LiveSource(sessions[-1], self.info)
            self._switched = True  # the log starts over with the new engine
        return self._live

    def refresh(self) -> TraceState:
        live = self._follow()
        if live is None:
            return TraceState()
        llms = self.lesson.llms
        if len(llms) == len(self.lesson.sessions):  # started: the resolved device and backend
            # (the config event only has what was asked for, often "auto"); the header holds this info
            engine = llms[-1].llm_engine
            core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
            self.info.device, self.info.backend = str(core.device), core.attention_backend
        return live.refresh()

    def take_events(self) -> EventBatch:
        live = self._follow()
        batch = live.take_events() if live is not None else EventBatch()
        batch.reset, self._switched = self._switched, False
        return batch

    def now_ns(self) -> int:
        return self._live.now_ns() if self._live is not None else 0

    def controller(self) -> dict:
        """Held (the header says PAUSED) while the lesson waits at a checkpoint or has ended."""
        if self.held is not None:
            return {"paused": True, "point": "a checkpoint", "reason": "c continues", "breakpoints": []}
        if self.ended:
            return {"paused": True, "point": "the end of the lesson", "reason": "q quits", "breakpoints": []}
        return {"paused": False, "breakpoints": []}

    def in_flight(self) -> int:
        return 0  # quitting a lesson loses nothing: no confirmation


class TuiPresenter(Presenter):
    """Narration into the app's side panel; a checkpoint blocks the lesson thread on an Event."""

    def __init__(self, app: "LessonApp"):
        self.app = app
        self.cancelled = threading.Event()
        self._go = threading.Event()

    def _live(self) -> None:
        if self.cancelled.is_set():
            raise LessonCancelled("the learner quit")

    def emit(self, renderable) -> None:
        self._live()
        self.app.call_from_thread(self.app.narrate, renderable)

    def wait(self, prompt: str) -> None:
        self._go.clear()  # before the check: a cancel() from now on sets it again and wakes us
        self._live()
        self.app.call_from_thread(self.app.hold, prompt)
        self._go.wait()
        self._live()

    def resume(self) -> None:
        self._go.set()

    def cancel(self) -> None:
        self.cancelled.set()
        self._go.set()


class LessonApp(TraceApp):
    # Relative paths resolve against the subclass's file: point at the TUI's own stylesheet.
    CSS_PATH = str(Path(tracer.tui.app.__file__).with_name("app.tcss"))
    CSS = f"""
    #narration {{
        dock: right;
        width: {NARRATION_PCT}%;
        min-width: {NARRATION_MIN};
        border-left: solid $primary;
        padding: 0 1;
    }}
    """
    BINDINGS = [Binding("c", "continue_lesson", "continue"), Binding("l", "toggle_narration", "lesson text")]

    def __init__(self, lesson: Lesson, run: Run, initial_pane: str = "requests", **kwargs):
        super().__init__(LessonSource(lesson), initial_pane=initial_pane, **kwargs)
        self.lesson = lesson
        self.presenter = lesson.presenter = TuiPresenter(self)
        self.exit_code: int | None = None  # the lesson's, once it has ended; ABORTED if quit before
        self.quit_early = False  # q before the lesson's end: the learner's choice, not a failure
        self._side: int | None = None  # the narration's width once a table widened it
        self._thread = threading.Thread(target=self._run_lesson, args=(run,), name=f"lesson-{lesson.number:02d}",
                                        daemon=True)

    def compose(self):
        yield from super().compose()
        # min_width: RichLog renders at least 78 columns wide by default, wider than the panel
        self.narration = RichLog(id="narration", wrap=True, markup=False, min_width=20)
        yield self.narration

    # Textual runs the handlers of every class in the MRO (this one's first): no super() calls,
    # and what must follow TraceApp's handler waits for the next refresh.
    def on_mount(self) -> None:
        self.call_after_refresh(self._thread.start)  # once TraceApp.on_mount has found its panels

    def on_resize(self) -> None:
        self.call_after_refresh(self._fit)  # after TraceApp.on_resize sized the panels for the whole width

    def _fit(self) -> None:
        """TraceApp lays its panels out for the terminal's width; here they get what the
        narration leaves (the Requests list first, its detail beside it only if that is wide)."""
        side = self._side_width() if self.narration.display else 0
        wide = self.size.width - side >= WIDE
        self.screen_stack[0].query_one("#requests-detail").display = wide
        self.screen_stack[0].query_one(StepPanel).set_class(not wide, "-narrow")

    def _run_lesson(self, run: Run) -> None:  # the lesson thread
        try:
            code = run_lesson(self.lesson, run)
        except LessonCancelled:  # quit while run_lesson was reporting a failed check
            code = ABORTED
        except Exception:  # a bug, not a false claim: show it where the learner is looking
            code = 1
            self._report(Text(traceback.format_exc(), style="red"))
        try:
            self.call_from_thread(self.lesson_ended, code)
        except RuntimeError:  # the app is gone already (a second q)
            pass

    def _report(self, renderable) -> None:
        try:
            self.call_from_thread(self.narrate, renderable)
        except RuntimeError:
            pass

    def _chrome(self) -> int:
        """Columns of the side panel that are not its text."""
        n = self.narration
        return n.outer_size.width - n.scrollable_content_region.width if n.outer_size.width else NARRATION_CHROME

    def _side_width(self) -> int:
        return self._side or max(NARRATION_MIN, self.size.width * NARRATION_PCT // 100)

    def _widen_for(self, renderable) -> None:
        """A table is as wide as its columns need (cut to `block_ta…` it teaches nothing), as far
        as the panels can spare: the narration widens for it, and stays that wide."""
        table = renderable.renderable if isinstance(renderable, RichPanel) else renderable
        if not isinstance(table, Table):
            return
        options = self.console.options.update_width(max(1, self.size.width))  # (headless, the console is 80 wide)
        need = Measurement.get(self.console, options, renderable).maximum + self._chrome()
        side = min(need, max(self._side_width(), self.size.width - PANELS_MIN))
        if side > self._side_width():
            self._side = side
            self.narration.styles.width = side
            self.call_after_refresh(self._fit)

    # ---- called on the UI thread (through call_from_thread) ----------------------------------
    def narrate(self, renderable) -> None:
        self._widen_for(renderable)
        # at the width it will have (a widening is laid out after this write)
        self.narration.write(renderable, width=self._side_width() - self._chrome(), expand=True)

    def hold(self, prompt: str) -> None:
        self.source.held = prompt
        self.narrate(Text(f"⏸ {prompt.replace('Enter', 'c')}", style="bold yellow"))
        self.refresh_bindings()
        self.tick()  # the panels show the checkpoint now, not at the next timer tick

    def lesson_ended(self, code: int) -> None:
        self.exit_code = code
        self.source.ended = True
        self.refresh_bindings()
        if self.presenter.cancelled.is_set():
            self.exit()
            return
        end = {0: ("✓ Lesson finished: every check held. q quits.", "bold green"),
               1: ("✗ Lesson stopped at the failed check above. q quits.", "bold red")}
        self.narrate(Text(*end.get(code, (f"Lesson ended (exit {code}). q quits.", "bold"))))
        self.tick()

    # ---- keys --------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action == "continue_lesson":  # dimmed between checkpoints, gone once the lesson has ended
            return True if self.source.held is not None else (False if self.source.ended else None)
        return super().check_action(action, parameters)

    def action_continue_lesson(self) -> None:
        if self.source.held is None:
            return
        self.source.held = None
        self.refresh_bindings()
        self.presenter.resume()

    def action_toggle_narration(self) -> None:
        self.narration.display = not self.narration.display
        self._fit()

    async def action_quit(self) -> None:
        if self.exit_code is not None or self.presenter.cancelled.is_set():
            self.exit()  # the lesson is over, or this is the second q
            return
        self.quit_early = True
        self.presenter.cancel()
        self.source.held = None
        self.narrate(Text("Stopping the lesson…", style="dim"))

    def exit_status(self) -> int:
        """The command's: 130 for ctrl+c (or a signal), 0 for q before the end (nothing failed),
        else the lesson's own (0 every check held, 1 one failed)."""
        if self.return_code == ABORTED:
            return ABORTED
        if self.quit_early:
            return 0
        return self.exit_code if self.exit_code is not None else ABORTED


def run_in_tui(lesson: Lesson, run: Run) -> int:
    """Run the lesson in the TUI until the learner quits; the command's exit status."""
    app = LessonApp(lesson, run)
    app.run()
    app.presenter.cancel()  # the app may have gone without q (a signal): free the lesson thread
    return app.exit_status()
