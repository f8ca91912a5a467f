"""RowList: a keyed list of rows with a header and a cursor, drawn line by line.

Why not DataTable: it redraws the whole table whenever any cell changes, and with 64
requests whose ages and token counts change every refresh that costs the engine (same
process, same interpreter lock) a large share of its throughput. Here each row is a tuple
of (text, style) cells; a row's drawn line is cached by that tuple, so a refresh only renders the rows that
changed (and scrolling renders only what comes into view).
"""
from __future__ import annotations

from rich.cells import set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tracer.tui.widgets.lines import sticky_height

ROUND = 32
CURSOR = Style(bgcolor="#2f4a6d", bold=True)
HEADER = Style(bold=True, dim=True)
POSITION = Style(color="black", bgcolor="#61afef")  # "↕ 1–40 of 164" when the rows do not fit


Cell = tuple  # (text, style or None): one cell of a row
_styles: dict[str, Style] = {}


def cell(text, style: str | None = None) -> Cell:
    return (str(text), style)


def cells_text(cells: list, widths: list[int]) -> tuple:
    """One row: each cell cut (…) or padded to its column's width, two spaces between columns.
    Plain tuples, not Rich Text: a row is compared and drawn ten times a second."""
    out = []
    for c, width in zip(cells, widths):
        text, style = c if isinstance(c, tuple) else (str(c), None)
        if len(text) > width:
            text = text[:max(0, width - 1)] + "…"
        # one cell per character unless wide characters are possible (rich's check is slower)
        out.append((text.ljust(width) if text.isascii() else set_cell_size(text, width), style))
    return tuple(out)


def _segments(row: tuple) -> list[Segment]:
    segs = [Segment(" ")]
    for text, style in row:
        if style and style not in _styles:
            _styles[style] = Style.parse(style)
        segs.append(Segment(text, _styles[style] if style else None))
        segs.append(Segment("  "))
    return segs


class RowList(ScrollView, can_focus=True):
    # No scrollbar: Textual redraws a bar (~3 ms) with every repaint of the list, which under
    # load is several times a second; the header line says which rows are in view instead.
    DEFAULT_CSS = """
    RowList { scrollbar-size-vertical: 0; }
    """
    BINDINGS = [Binding("up", "move(-1)", show=False), Binding("down", "move(1)", show=False),
                Binding("pageup", "move(-10)", show=False), Binding("pagedown", "move(10)", show=False),
                Binding("home", "move(-1000000)", show=False), Binding("end", "move(1000000)", show=False),
                Binding("enter", "select", "open", show=False)]
    cursor: reactive[int] = reactive(0)

    class Highlighted(Message):
        def __init__(self, row_list: "RowList", key: str):
            super().__init__()
            self.row_list, self.key = row_list, key

    class Selected(Message):
        def __init__(self, row_list: "RowList", key: str):
            super().__init__()
            self.row_list, self.key = row_list, key

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.header: tuple = ()
        self.keys: list[str] = []
        self.texts: list[tuple] = []
        self._cache: dict[tuple, Strip] = {}
        # Set at once (not by a message) when the user moves the cursor with a key or a click: a list that
        # follows checks it on its next refresh, which may run before any message posted now is handled.
        self.moved_by_user = False

    @property
    def row_count(self) -> int:
        return len(self.keys)

    @property
    def cursor_key(self) -> str | None:
        return self.keys[self.cursor] if 0 <= self.cursor < len(self.keys) else None

    def set_rows(self, header: tuple, rows: list[tuple[str, tuple]]) -> None:
        """Replace the rows; the cursor stays on the same key if it is still there."""
        old_key = self.cursor_key
        keys, texts = [k for k, _ in rows], [t for _, t in rows]
        changed = header != self.header or keys != self.keys
        if not changed:
            dirty = {i for i, (a, b) in enumerate(zip(texts, self.texts)) if a != b}
        self.header, self.keys, self.texts = header, keys, texts
        size = Size(1 + sum(len(t) + 2 for t, _ in header), self._virtual_height())
        if size != self.virtual_size:
            self.virtual_size = size
        if old_key in keys and keys.index(old_key) != self.cursor:
            self.cursor = keys.index(old_key)
        elif self.cursor >= len(keys) and keys:
            self.cursor = len(keys) - 1
        if changed or len(self._cache) > 4 * len(keys) + 64:  # drop lines of rows that are gone
            self._cache.clear()
            self.refresh()
        else:  # one region per run of changed rows (under load: all of them, one call)
            start = None
            for i in range(len(texts) + 1):
                if i < len(texts) and i in dirty:
                    start = i if start is None else start
                elif start is not None:
                    self.refresh_lines(start + 1, i - start)  # row i is drawn under the header
                    start = None
        if self.cursor_key != old_key and self.cursor_key is not None:
            self.post_message(self.Highlighted(self, self.cursor_key))

    def move_cursor(self, row: int) -> None:
        if self.keys:
            self.cursor = max(0, min(len(self.keys) - 1, row))

    def action_move(self, delta: int) -> None:
        self.moved_by_user = True
        self.move_cursor(self.cursor + delta)

    def action_select(self) -> None:
        if self.cursor_key is not None:
            self.post_message(self.Selected(self, self.cursor_key))

    def watch_cursor(self, old: int, new: int) -> None:
        self._cache.clear()
        self.refresh()
        if self.cursor_key is not None:
            self.post_message(self.Highlighted(self, self.cursor_key))
        # keep the cursor in view (row i is drawn at line i + 1, under the header)
        top, height = int(self.scroll_offset.y), max(1, self.size.height - 1)
        if new < top:
            self.scroll_to(y=new, animate=False)
        elif new >= top + height:
            self.scroll_to(y=new - height + 1, animate=False)

    def on_click(self, event) -> None:
        row = event.y - 1 + int(self.scroll_offset.y)
        if event.y >= 1 and 0 <= row < len(self.keys):
            self.moved_by_user = True
            if row == self.cursor:
                self.action_select()
            self.cursor = row

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        scroll_x, scroll_y = self.scroll_offset
        if y == 0:
            return self._header_strip(width, scroll_x, scroll_y)
        i = y - 1 + scroll_y
        if i >= len(self.texts):
            return Strip.blank(width, self.visual_style.rich_style)
        focus = self.has_focus
        key = (self.texts[i], i == self.cursor, focus, width, scroll_x)
        strip = self._cache.get(key)
        if strip is None:
            style = CURSOR if i == self.cursor and focus else Style(bgcolor="#263040") if i == self.cursor else None
            strip = self._cache[key] = self._strip(self.texts[i], style, width, scroll_x)
        return strip

    def _header_strip(self, width: int, scroll_x: int, scroll_y: int) -> Strip:
        strip = self._strip(self.header, HEADER, width, scroll_x)
        shown, n = max(1, self.size.height - 1), len(self.keys)
        if n <= shown or width < 20:
            return strip
        # right of the column names, never over them: shorter forms when the space is short
        used = 1 + len("  ".join(text for text, _ in self.header).rstrip()) - scroll_x
        first, last = scroll_y + 1, min(n, scroll_y + shown)
        for where in (f" ↕ {first}–{last} of {n} ", f" ↕{first}–{last}/{n} ", f"↕{last}/{n}"):
            if used + 1 + len(where) <= width:
                return Strip.join([strip.crop(0, width - len(where)), Strip([Segment(where, POSITION)])])
        return strip

    def _strip(self, row: tuple, style: Style | None, width: int, scroll_x: int) -> Strip:
        strip = Strip(_segments(row)).crop_extend(scroll_x, scroll_x + width, self.visual_style.rich_style)
        return strip.apply_style(style) if style else strip

    def _virtual_height(self) -> int:
        # Requests come and go every step under load: the height moves in steps of ROUND rows.
        return sticky_height(len(self.keys) + 1, self.virtual_size.height,
                             self.scrollable_content_region.height, ROUND)

    def on_resize(self) -> None:
        height = self._virtual_height()  # what fits without scrolling may have changed
        if height != self.virtual_size.height:
            self.virtual_size = Size(self.virtual_size.width, height)

    def on_focus(self) -> None:
        self._cache.clear()
        self.refresh()

    def on_blur(self) -> None:
        self.on_focus()
