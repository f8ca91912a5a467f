"""Log: the event stream as `[TRACE] layer name key=value` lines (the --trace-log format).

`/` opens the filter: layer names keep those layers, `request=ID` (or `#ID`) one request,
any other word must appear in the line. Under heavy load the panel writes at most
MAX_LINES_PER_TICK lines per refresh and says how many it skipped: the full stream is in the
trace file (--trace-file), and drawing every line would slow the engine the TUI watches.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Input, RichLog

from tracer.events import LAYERS, Event
from tracer.tracelog import format_event
from tracer.tui.sources.base import EventBatch

KEEP = 2000  # events kept for re-filtering
MAX_LINES_PER_TICK = 60
LAYER_STYLES = {"http": "blue", "api": "blue", "tokenizer": "cyan", "engine": "bold green", "scheduler": "yellow",
                "block_manager": "magenta", "model_runner": "cyan", "kernel": "#d19a66", "sampler": "green",
                "detokenizer": "green", "tracer": "bold red", "cli": "dim"}


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


def styled(ev: Event, line: str) -> Text:
    t = Text(line)
    start = len("[TRACE] ")
    t.stylize("dim", 0, start)
    t.stylize(LAYER_STYLES.get(ev.layer, ""), start, start + len(ev.layer))
    return t


class LogPanel(Vertical):
    def compose(self):
        yield Input(placeholder="filter: layers (scheduler kernel …), request=ID, words (enter: apply, esc: clear)",
                    id="log-filter")
        yield RichLog(id="log-lines", max_lines=KEEP, wrap=False, auto_scroll=True)

    def on_mount(self) -> None:
        self.events: deque[Event] = deque(maxlen=KEEP)
        self.filter = LogFilter()
        self._pending: list[Event] = []
        self.query_one("#log-filter").display = False

    def feed(self, batch: EventBatch) -> None:
        """Called every refresh, visible or not: events are kept, drawn when visible."""
        if batch.reset:
            self.events.clear()
            self._pending.clear()
            self.query_one(RichLog).clear()
        if batch.missed:
            note = Event(-1, 0, "tracer", "events_lost", attrs={"count": batch.missed})
            self.events.append(note)
            self._pending.append(note)
        self.events.extend(batch.events)
        self._pending.extend(batch.events)
        if len(self._pending) > KEEP:
            del self._pending[:-KEEP]

    def show(self, frame=None, limit: int = MAX_LINES_PER_TICK) -> None:
        if not self._pending:
            return
        log = self.query_one(RichLog)
        pending, self._pending = self._pending, []
        lines = [(ev, format_event(ev)) for ev in pending]
        kept = [(ev, line) for ev, line in lines if self.filter.keep(ev, line)]
        if len(kept) > limit:
            log.write(Text(f"… {len(kept) - limit} events not drawn (busy; --trace-file keeps all)", "dim italic"))
            kept = kept[-limit:]
        for ev, line in kept:
            log.write(styled(ev, line), scroll_end=False)
        log.scroll_end(animate=False)

    def open_filter(self) -> None:
        f = self.query_one("#log-filter", Input)
        f.display = True
        f.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.apply_filter(event.value)
        self.query_one(RichLog).focus()

    def apply_filter(self, text: str) -> None:
        """Redraw the kept events through the new filter."""
        self.filter = LogFilter.parse(text)
        log = self.query_one(RichLog)
        log.clear()
        self._pending = list(self.events)
        self.show(limit=KEEP)

    def key_escape(self) -> None:
        f = self.query_one("#log-filter", Input)
        f.value, f.display = "", False
        self.apply_filter("")
        self.query_one(RichLog).focus()
