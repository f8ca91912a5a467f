"""Log: the event stream as `[TRACE] layer name key=value` lines (the --trace-log format).

`/` opens the filter: layer names keep those layers, `request=ID` (or `#ID`) one request,
any other word must appear in the line. Under heavy load the panel writes at most
MAX_LINES_PER_TICK lines per refresh and says how many it skipped: the full stream is in the
trace file (--trace-file), and drawing every line would slow the engine the TUI watches.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from rich.style import Style
from textual.widgets import Input

from engine.trace_names import (
    API,
    BLOCK_MANAGER,
    CLI,
    DETOKENIZER,
    ENGINE,
    EVENTS_LOST,
    HTTP,
    KERNEL,
    KV_TRANSFER,
    MODEL_RUNNER,
    SAMPLER,
    SCHEDULER,
    TOKENIZER,
    TRACER,
    WORKER,
)
from tracer.events import LAYERS, Event
from tracer.tracelog import format_event
from tracer.tui.sources.base import EventBatch
from tracer.tui.widgets.log_view import LogView
from tracer.tui.widgets.panel import Panel

KEEP = 2000  # events kept for re-filtering
# Formatting a line costs more than anything else here, and a busy engine publishes thousands
# of events a second: a refresh formats at most this many (the newest; the rest are counted).
MAX_LINES_PER_TICK = 100
# A busy stream scrolls every line on screen at every redraw (~10 ms of Textual's time, taken
# from the engine thread through the interpreter lock): then the log is redrawn at most BUSY_HZ
# times a second. A trickle (a paused or stepping engine) is drawn at once.
BUSY_LINES, BUSY_HZ = 8, 4
LAYER_STYLES = {HTTP: "blue", API: "blue", TOKENIZER: "cyan", ENGINE: "bold green", SCHEDULER: "yellow",
                BLOCK_MANAGER: "magenta", MODEL_RUNNER: "cyan", KERNEL: "#d19a66", SAMPLER: "green",
                DETOKENIZER: "green", TRACER: "bold red", CLI: "dim", WORKER: "bright_magenta",
                KV_TRANSFER: "bright_cyan"}


@dataclass
class LogFilter:
    layers: set[str] = field(default_factory=set)
    request_id: str | None = None
    words: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> "LogFilter":
        f = cls()
        for term in text.split():
            if term in LAYERS:
                f.layers.add(term)
            elif term.startswith(("request=", "#")):
                f.request_id = term.split("=", 1)[1] if "=" in term else term[1:]
            else:
                f.words.append(term)
        return f

    def keep(self, ev: Event, line: str) -> bool:
        return ((not self.layers or ev.layer in self.layers)
                and (self.request_id is None or ev.request_id == self.request_id)
                and all(w in line for w in self.words))


_STYLES = {layer: Style.parse(spec) for layer, spec in LAYER_STYLES.items()}
_DIM = Style.parse("dim")


def styled(ev: Event, line: str) -> tuple:
    """'[TRACE]' dim, the layer in its colour, the rest plain."""
    start = len("[TRACE] ")
    end = start + len(ev.layer)
    return ((line[:start], _DIM), (line[start:end], _STYLES.get(ev.layer)), (line[end:], None))


class LogPanel(Panel):
    filterable = True
    throttled = False  # the event stream: drawn at every refresh (a bounded number of lines each)

    def compose(self):
        yield Input(placeholder="filter: layers (scheduler kernel …), request=ID, words (enter: apply, esc: clear)",
                    id="log-filter")
        yield LogView(KEEP, id="log-lines")

    def on_mount(self) -> None:
        self.events: deque[Event] = deque(maxlen=KEEP)
        self.filter = LogFilter()
        self._pending: deque[Event] = deque(maxlen=KEEP)  # a list trimmed each refresh copied 2,000 pointers
        self._drawn_at = 0.0
        self.query_one("#log-filter").display = False

    def feed(self, batch: EventBatch) -> None:
        """Called every refresh, visible or not: events are kept, drawn when visible."""
        if batch.reset:
            self.events.clear()
            self._pending.clear()
            self.query_one(LogView).clear()
        if batch.missed:
            note = Event(-1, 0, TRACER, EVENTS_LOST, attrs={"count": batch.missed})
            self.events.append(note)
            self._pending.append(note)
        self.events.extend(batch.events)
        self._pending.extend(batch.events)

    def focus_list(self) -> None:
        self.query_one(LogView).focus()

    def show(self, frame=None, force: bool = False, limit: int = MAX_LINES_PER_TICK) -> None:
        if not self._pending:
            return
        now = time.monotonic()
        running = frame is not None and not frame.controller.get("paused")  # a replay is always "paused"
        if running and not force and len(self._pending) > BUSY_LINES and now - self._drawn_at < 1 / BUSY_HZ:
            return  # busy: drawn by a later refresh
        self._drawn_at = now
        log = self.query_one(LogView)
        pending = list(self._pending)
        self._pending.clear()
        f = self.filter
        if not f.words:  # layers and a request id need no formatting: cut first, format the newest
            pending = [ev for ev in pending if f.keep(ev, "")]
            skipped, pending = max(0, len(pending) - limit), pending[-limit:]
            kept = [styled(ev, format_event(ev)) for ev in pending]
        else:
            lines = [(ev, format_event(ev)) for ev in pending]
            kept = [styled(ev, line) for ev, line in lines if f.keep(ev, line)]
            skipped, kept = max(0, len(kept) - limit), kept[-limit:]
        if skipped:
            kept.insert(0, ((f"… {skipped} events not drawn (busy; --trace-file keeps all)", _DIM),))
        log.write_lines(kept)

    def open_filter(self) -> None:
        f = self.query_one("#log-filter", Input)
        f.display = True
        f.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.apply_filter(event.value)
        self.query_one(LogView).focus()

    def apply_filter(self, text: str) -> None:
        """Redraw the kept events through the new filter."""
        self.filter = LogFilter.parse(text)
        log = self.query_one(LogView)
        log.clear()
        self._pending = deque(self.events, maxlen=KEEP)
        self.show(limit=KEEP)

    def key_escape(self) -> None:
        f = self.query_one("#log-filter", Input)
        f.value, f.display = "", False
        self.apply_filter("")
        self.query_one(LogView).focus()
