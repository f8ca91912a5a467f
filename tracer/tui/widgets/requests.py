"""Requests: every request the engine knows, newest and active first (running, waiting or
preempted, by arrival, newest on top), then the finished ones, most recent first. The cursor
stays on the top row (the newest request) until the user moves it. Enter opens one; on a wide
terminal its detail (with the full reason a request waits) sits beside the list."""
from __future__ import annotations

import time

from rich.text import Text
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Input

from tracer.tui.fmt import fmt_age_coarse, output_progress, prompt_progress, shorten, status_text
from tracer.tui.frame import Frame
from tracer.tui.widgets.lines import FixedText
from tracer.tui.widgets.panel import Panel
from tracer.tui.widgets.request_detail import RequestDetail, waiting_why
from tracer.tui.widgets.rows import RowList, cell, cells_text

# Under load (many rows changing at once) the list redraws at most BUSY_HZ times a second;
# the header, the counters and the selected request's detail still follow every refresh.
# Redrawing 64 changed rows costs Textual ~25 ms, taken from the engine (same interpreter).
BUSY_ROWS, BUSY_HZ = 16, 4
MAX_FINISHED = 100  # the most recent; the trace file keeps them all
# lifetime: since its arrival, until now or until it finished (so the newest request is not the "youngest")
COLUMNS = [("id", 23), ("state", 9), ("prompt", 7), ("output", 8), ("lifetime", 8), ("why waiting / finish", 40)]
ID, WHY = 0, 5  # sized to fit: the id column to the longest id shown, the reason to what is left
MAX_ID = 21  # vLLM-style ids (cmpl-<16 hex>) fit whole: the id is what a user greps the log for


def newest_first(frame: Frame) -> list[str]:
    """Active requests (running, waiting, preempted) newest first, then the finished ones,
    the most recently finished first."""
    s = frame.state
    active = set(s.running) | set(s.waiting)
    order = [rid for rid in s.requests if rid in active]  # the requests dict keeps arrival order
    return order[::-1] + list(reversed(s.finished[-MAX_FINISHED:]))


def request_rows(frame: Frame, text_filter: str = "") -> list[tuple[str, tuple]]:
    s = frame.state
    ids = newest_first(frame)
    rows = []
    for rid in ids:
        r = s.requests.get(rid)
        if r is None:
            continue
        if text_filter and text_filter not in rid and text_filter not in r.status.lower():
            continue
        prompt, out = prompt_progress(r), output_progress(r)
        why = (f"priority {r.priority} · " if r.priority else "") + waiting_why(frame, r)  # priority policy
        status = status_text(r.status)
        rows.append((rid, (cell("■ " + shorten(rid, MAX_ID), frame.color(rid)), cell(status.plain, str(status.style)),
                           prompt, out, fmt_age_coarse(frame.age(rid)), why)))
    return rows


class RequestsPanel(Panel):
    filterable = True

    class Selected(Message):
        """The cursor moved to a request (or opened it, with enter)."""

        def __init__(self, request_id: str, open: bool = False):
            super().__init__()
            self.request_id, self.open = request_id, open

    def compose(self):
        yield Input(placeholder="filter requests: part of an id or a state (esc to close)", id="requests-filter")
        with Horizontal():
            yield RowList(id="requests-table")
            yield RequestDetail(id="requests-detail")
        yield FixedText(id="requests-why")  # narrow: the selected request's reason, in full

    def on_mount(self) -> None:
        self.query_one("#requests-filter").display = False
        self._drawn_at = 0.0
        self._busy = False  # the last rows built had many changes: build them at BUSY_HZ only

    def focus_list(self) -> None:
        self.query_one(RowList).focus()

    def on_resize(self) -> None:
        self.query_one(RequestDetail).display = self.wide
        self.query_one("#requests-why").display = not self.wide

    @staticmethod
    def widths(keys: list[str], width: int) -> list[int]:
        """The id column as wide as the longest id shown, the reason column what is left."""
        widths = [w for _, w in COLUMNS]
        widths[ID] = min(MAX_ID, max((len(k) for k in keys), default=4)) + 2
        widths[WHY] = max(12, width - sum(widths[:WHY]) - 2 * len(COLUMNS) - 2)
        return widths

    def open_filter(self) -> None:
        f = self.query_one("#requests-filter", Input)
        f.display = True
        f.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(RowList).focus()

    def key_escape(self) -> None:
        f = self.query_one("#requests-filter", Input)
        f.value, f.display = "", False
        self.query_one(RowList).focus()

    def show(self, frame: Frame, force: bool = False) -> None:
        rows = self.query_one(RowList)
        now = time.monotonic()
        if force:
            self._busy = False
        if not self._busy or now - self._drawn_at >= 1 / BUSY_HZ:  # busy: not even the rows are built
            found = request_rows(frame, self.query_one("#requests-filter", Input).value.strip().lower())
            widths = self.widths([k for k, _ in found], rows.size.width or 80)
            new = [(k, cells_text(list(cells), widths)) for k, cells in found]
            changed = abs(len(new) - len(rows.texts)) + sum(a != b for (_, a), b in zip(new, rows.texts))
            self._busy = changed > BUSY_ROWS
            if force or not self._busy or now - self._drawn_at >= 1 / BUSY_HZ:
                rows.set_rows(cells_text([name for name, _ in COLUMNS], widths), new)
                self._drawn_at = now
                if not rows.moved_by_user:  # the cursor stays on the newest request until then
                    self._follow_newest(frame, rows)
        detail = self.query_one(RequestDetail)
        if detail.display:
            detail.request_id = frame.selected
            detail.show(frame)
        else:
            r = frame.state.requests.get(frame.selected) if frame.selected else None
            why = waiting_why(frame, r) if r is not None else ""
            self.query_one("#requests-why", FixedText).update(
                Text.assemble((f"{frame.selected}: ", "bold"), (why, "yellow"), ("  (enter: its detail)", "dim"))
                if why else Text("enter: the selected request's detail", "dim"))

    @staticmethod
    def _follow_newest(frame: Frame, rows: RowList) -> None:
        """The top row: the newest active request, else the one that finished last. (Following
        only active ones left the cursor on an older request when a short one came and went
        between two refreshes, or while another panel was shown: enter opened the wrong one.)"""
        if rows.keys and rows.cursor != 0:
            rows.move_cursor(0)

    def on_row_list_highlighted(self, event: RowList.Highlighted) -> None:
        self.post_message(self.Selected(event.key))

    def on_row_list_selected(self, event: RowList.Selected) -> None:
        event.stop()
        self.post_message(self.Selected(event.key, open=True))
