"""Requests: every request the engine knows, running first, then waiting (and preempted),
then the most recently finished. Enter opens one; on a wide terminal its detail sits beside
the list."""
from __future__ import annotations

from rich.text import Text
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import DataTable, Input
from textual.widgets.data_table import ColumnKey

from tracer.tui.fmt import fmt_age, shorten, status_text
from tracer.tui.frame import Frame
from tracer.tui.widgets.request_detail import RequestDetail

MAX_FINISHED = 100  # the most recent; the trace file keeps them all
COLUMNS = [("id", 23), ("state", 9), ("prompt", 7), ("output", 6), ("age", 5), ("why waiting / finish", 40)]
ID, WHY = 0, 5  # sized to fit: the id column to the longest id shown, the reason to what is left
MAX_ID = 21  # vLLM-style ids (cmpl-<16 hex>) fit whole: the id is what a user greps the log for


def request_rows(frame: Frame, text_filter: str = "") -> list[tuple[str, tuple]]:
    s = frame.state
    ids = list(s.running) + list(s.waiting) + list(reversed(s.finished[-MAX_FINISHED:]))
    rows = []
    for rid in ids:
        r = s.requests.get(rid)
        if r is None:
            continue
        if text_filter and text_filter not in rid and text_filter not in r.status.lower():
            continue
        prompt = f"{min(r.num_computed_tokens, r.num_prompt_tokens)}/{r.num_prompt_tokens}"
        out = f"{len(r.output_token_ids)}/{r.max_tokens}" if r.max_tokens else str(len(r.output_token_ids))
        if r.status == "PREEMPTED" or (r.status == "WAITING" and r.num_preemptions):
            why = f"preempted: {r.preempt_reason or '?'}"
        elif r.status == "WAITING":
            why = r.waiting_reason or ("not scheduled yet" if s.step is None or frame.controller.get("paused") else "")
        elif r.status.startswith("FINISHED"):
            why = r.finish_reason or ""
        else:
            why = ""
        rows.append((rid, (Text("■ ", frame.color(rid)) + Text(shorten(rid, MAX_ID)), status_text(r.status), prompt, out,
                           fmt_age(frame.age(rid)), shorten(why, 40))))
    return rows


class RequestsPanel(Vertical):
    class Selected(Message):
        """The cursor moved to a request (or opened it, with enter)."""

        def __init__(self, request_id: str, open: bool = False):
            super().__init__()
            self.request_id, self.open = request_id, open

    def compose(self):
        yield Input(placeholder="filter requests: part of an id or a state (esc to close)", id="requests-filter")
        with Horizontal():
            table = DataTable(id="requests-table", cursor_type="row", zebra_stripes=True)
            for name, width in COLUMNS:
                table.add_column(name, key=name, width=width)
            yield table
            yield RequestDetail(id="requests-detail")

    def on_mount(self) -> None:
        self.query_one("#requests-filter").display = False
        self._keys: list[str] = []
        self._cells: dict[str, tuple] = {}
        self._fitted = (0, 0)

    def _fit_columns(self, table: DataTable, keys: list[str]) -> None:
        """The id column as wide as the longest id shown, the reason column what is left
        (each column has one cell of padding on either side)."""
        id_width = min(MAX_ID, max((len(k) for k in keys), default=4)) + 2
        if (table.size.width, id_width) == self._fitted:
            return
        self._fitted = (table.size.width, id_width)
        table.columns[ColumnKey(COLUMNS[ID][0])].width = id_width
        fixed = id_width + sum(w for _, w in COLUMNS[ID + 1:WHY]) + 2 * WHY + 3
        table.columns[ColumnKey(COLUMNS[WHY][0])].width = max(12, table.size.width - fixed)
        table.refresh()

    def open_filter(self) -> None:
        f = self.query_one("#requests-filter", Input)
        f.display = True
        f.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(DataTable).focus()

    def key_escape(self) -> None:
        f = self.query_one("#requests-filter", Input)
        f.value, f.display = "", False
        self.query_one(DataTable).focus()

    def show(self, frame: Frame) -> None:
        table = self.query_one(DataTable)
        rows = request_rows(frame, self.query_one("#requests-filter", Input).value.strip().lower())
        keys = [k for k, _ in rows]
        self._fit_columns(table, keys)
        if keys != self._keys:  # a request moved between queues: rebuild, keeping the cursor on it
            current = self._keys[table.cursor_row] if self._keys and table.cursor_row < len(self._keys) else None
            table.clear()
            for k, cells in rows:
                table.add_row(*cells, key=k)
            self._keys, self._cells = keys, dict(rows)
            if current in keys:
                table.move_cursor(row=keys.index(current), animate=False)
        else:  # same rows: touch only the cells that changed (ages, token counts)
            for k, cells in rows:
                old = self._cells.get(k)
                for (name, _), new, was in zip(COLUMNS, cells, old):
                    if new != was:
                        table.update_cell(k, name, new)
                self._cells[k] = cells
        detail = self.query_one(RequestDetail)
        if detail.display:
            detail.request_id = frame.selected
            detail.show(frame)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key is not None and event.row_key.value is not None:
            self.post_message(self.Selected(event.row_key.value))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key is not None and event.row_key.value is not None:
            self.post_message(self.Selected(event.row_key.value, open=True))
