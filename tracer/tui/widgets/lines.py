"""LinesView: a scrollable Rich renderable, rendered to lines once per update.

A Static asks for a layout pass on every update, and a layout pass repaints the screen (tens
of milliseconds, taken from the engine thread through the interpreter lock). This view
renders the content to strips itself and asks for layout only when its number of lines
changes, so a panel that changes every step only repaints itself.
"""
from __future__ import annotations

from rich.console import RenderableType
from rich.segment import Segment
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

ROUND = 16


def sticky_height(needed: int, current: int, visible: int, step: int = ROUND) -> int:
    """A virtual height that changes seldom: what is visible while the content fits (so no
    scrollbar), else it grows in steps and shrinks only once the content needs less than half
    of it. Every change costs a layout pass, a repaint of the whole screen (10-100 ms under
    load, taken from the engine thread through the interpreter lock)."""
    if needed <= visible:
        return visible
    if needed > current or needed <= current // 2:
        return -(-needed // step) * step
    return current


class LinesView(ScrollView):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._content: list = []
        self._cache: dict = {}
        self._strips: list[Strip | None] = []  # None: not drawn yet (update_rows)
        self._rows: list[list[Segment]] = []
        self._width = 0
        self._rewrap_due = False

    @property
    def text(self) -> str:
        """Everything it shows, as plain text (also what is scrolled out of view)."""
        return "\n".join(self._line(i).text.rstrip() for i in range(len(self._strips)))

    def update(self, content: RenderableType) -> None:
        self.update_sections([(None, content)])

    def update_sections(self, sections: list[tuple[object, RenderableType]]) -> None:
        """Content in parts; a part whose key (not None) is unchanged is not rendered again
        (a request's prompt tokens: hundreds of styled pieces that never change)."""
        self._content = sections
        self._render_strips()

    def update_rows(self, rows: list[list[Segment]]) -> None:
        """Content given as ready segments of single-width characters, one list per line: no
        Rich rendering at all (the KV grid, thousands of cells, redrawn several times a
        second). Only the lines that changed are repainted, and a line becomes a Strip only
        when it is drawn."""
        old = self._rows if not self._content else None
        self._content, self._rows = [], rows
        self._strips = [None] * len(rows)
        width = max((sum(len(seg.text) for seg in row) for row in rows), default=0)
        if old is None or len(old) != len(rows) or not self._resize_virtual(width, repaint=False):
            self.refresh()
            return
        for i, (a, b) in enumerate(zip(old, rows)):
            if a != b:
                self.refresh_line(i)  # (in content lines: it subtracts the scroll offset)

    def _line(self, i: int) -> Strip:
        strip = self._strips[i]
        if strip is None:
            strip = self._strips[i] = Strip(self._rows[i])
        return strip

    def _resize_virtual(self, width: int, repaint: bool = True) -> bool:
        """Returns whether the virtual size stayed the same."""
        size = Size(width, sticky_height(len(self._strips), self.virtual_size.height,
                                         self.scrollable_content_region.height))
        same = size == self.virtual_size
        if not same:
            self.virtual_size = size  # a layout pass: only when the size changed
        if repaint:
            self.refresh()
        return same

    def _render_strips(self) -> None:
        width = self.scrollable_content_region.width
        if width <= 0:
            return  # not laid out yet: on_resize renders it once the width is known
        console = self.app.console
        if width != self._width:
            self._cache.clear()
        strips, cache = [], {}
        for key, part in self._content:
            lines = self._cache.get(key) if key is not None else None
            if lines is None:
                options = console.options.update_width(width)
                lines = [Strip(line) for line in console.render_lines(part, options, pad=False)]
            if key is not None:
                cache[key] = lines
            strips.extend(lines)
        old, self._strips, self._cache, self._width = self._strips, strips, cache, width
        if not self._resize_virtual(width, repaint=False):
            self.refresh()
            return
        # Only the lines that changed are painted again: a streaming request's detail changes a
        # few of its lines (the counts, the text, the timeline's last rows), and Textual styles
        # every painted line anew (~0.2 ms each under load).
        start = None
        for i in range(max(len(old), len(strips)) + 1):
            same = i >= len(old) and i >= len(strips) or (i < len(old) and i < len(strips) and old[i] == strips[i])
            if not same and start is None:
                start = i
            elif same and start is not None:
                self.refresh_lines(start, i - start)
                start = None

    def _rewrap(self) -> bool:
        """Wrap the text again if the width it has to fit changed; True if it did."""
        self._rewrap_due = False
        if self.scrollable_content_region.width == self._width or not self._content:
            return False
        self._cache.clear()
        self._render_strips()
        return True

    def on_resize(self) -> None:
        if not self._rewrap():  # the height that fits without a scrollbar may have changed
            self._resize_virtual(self.virtual_size.width)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        i = y + scroll_y
        width = self.scrollable_content_region.width
        if self._content and width != self._width and width > 0 and not self._rewrap_due:
            # A vertical scrollbar came (or went) since the text was wrapped: the widget's size did
            # not change, so no resize says so. Wrapped to the old width, it would overflow by the
            # bar's width and grow a horizontal scrollbar (seen, now and then, in a snapshot).
            self._rewrap_due = True
            self.call_after_refresh(self._rewrap)
        if i >= len(self._strips):
            return Strip.blank(width, self.visual_style.rich_style)
        return self._line(i).crop_extend(scroll_x, scroll_x + width, self.visual_style.rich_style)


class FixedText(Widget):
    """Text in a box of fixed height (set in CSS) that changes often: a header, a summary.

    Not a Static: Static.update asks for a layout pass every time, and Textual's general render
    path costs ~2 ms a time. This renders its text to lines once per change (and width) and
    hands those out, so an update repaints only itself."""

    def __init__(self, text: RenderableType = "", **kwargs):
        super().__init__(**kwargs)
        self._text = text
        self._lines: list[Strip] = []
        self._width = -1

    @property
    def text(self) -> RenderableType:
        return self._text

    def update(self, text: RenderableType) -> None:
        if text != self._text:
            self._text, self._width = text, -1  # rendered again at the next repaint
            self.refresh()

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if width != self._width:
            console = self.app.console
            base = self.visual_style.rich_style  # the widget's own colours under the text's styles
            self._lines = [Strip(line).apply_style(base)
                           for line in console.render_lines(self._text, console.options.update_width(width), pad=False)]
            self._width = width
        line = self._lines[y] if y < len(self._lines) else Strip([])
        return line.crop_extend(0, width, self.visual_style.rich_style)
