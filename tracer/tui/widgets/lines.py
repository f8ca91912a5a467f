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
        self._strips: list[Strip] = []
        self._width = 0

    @property
    def text(self) -> str:
        """Everything it shows, as plain text (also what is scrolled out of view)."""
        return "\n".join(s.text.rstrip() for s in self._strips)

    def update(self, content: RenderableType) -> None:
        self.update_sections([(None, content)])

    def update_sections(self, sections: list[tuple[object, RenderableType]]) -> None:
        """Content in parts; a part whose key (not None) is unchanged is not rendered again
        (a request's prompt tokens: hundreds of styled pieces that never change)."""
        self._content = sections
        self._render_strips()

    def update_rows(self, rows: list[list[Segment]]) -> None:
        """Content given as ready segments, one list per line: no Rich rendering at all (the
        KV grid, thousands of cells, redrawn several times a second)."""
        self._content = []
        self._strips = [Strip(segments) for segments in rows]
        self._resize_virtual(max((s.cell_length for s in self._strips), default=0))

    def _resize_virtual(self, width: int) -> None:
        size = Size(width, sticky_height(len(self._strips), self.virtual_size.height,
                                         self.scrollable_content_region.height))
        if size != self.virtual_size:
            self.virtual_size = size  # a layout pass: only when the size changed
        self.refresh()

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
        self._strips, self._cache, self._width = strips, cache, width
        self._resize_virtual(width)

    def on_resize(self) -> None:
        if self.scrollable_content_region.width != self._width and self._content:
            self._cache.clear()
            self._render_strips()
        else:  # the height that fits without a scrollbar may have changed
            self._resize_virtual(self.virtual_size.width)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        i = y + scroll_y
        width = self.scrollable_content_region.width
        if i >= len(self._strips):
            return Strip.blank(width, self.rich_style)
        return self._strips[i].crop_extend(scroll_x, scroll_x + width, self.rich_style)


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
            base = self.rich_style  # the widget's own colours under the text's styles
            self._lines = [Strip(line).apply_style(base)
                           for line in console.render_lines(self._text, console.options.update_width(width), pad=False)]
            self._width = width
        line = self._lines[y] if y < len(self._lines) else Strip([])
        return line.crop_extend(0, width, self.rich_style)
