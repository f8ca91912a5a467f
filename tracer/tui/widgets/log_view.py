"""LogView: the Log panel's lines, drawn with the line API.

RichLog renders every line it is given through Rich as it arrives; under load that is
hundreds of lines a second for a panel that shows forty. Here a line is kept as a few
(text, style) pieces and only the lines on screen are turned into strips. The virtual size
never changes (a change is a layout pass, a repaint of the whole screen): the view is always
max_lines tall and the lines sit at its bottom, like a terminal's.
"""
from __future__ import annotations

from collections import deque

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip


class LogView(ScrollView, can_focus=True):
    WIDTH = 512  # columns one can scroll to (a line longer than that is cut)

    def __init__(self, max_lines: int, **kwargs):
        super().__init__(**kwargs)
        self.max_lines = max_lines
        self.lines: deque[tuple[tuple[str, Style | None], ...]] = deque(maxlen=max_lines)

        self.follow = True  # stay at the newest line (until the user scrolls up)

    def on_mount(self) -> None:
        self.virtual_size = Size(self.WIDTH, self.max_lines)

    def on_resize(self) -> None:
        if self.follow:  # the end moves with the height: the first layout, a resized terminal
            self.scroll_end(animate=False, immediate=True)

    @property
    def plain_lines(self) -> list[str]:
        return ["".join(text for text, _ in line) for line in self.lines]

    def clear(self) -> None:
        self.lines.clear()
        self.refresh()

    def write_lines(self, lines: list[tuple[tuple[str, Style | None], ...]]) -> None:
        if self.size.height:
            self.follow = self.scroll_offset.y >= self.max_scroll_y - 1
        self.lines.extend(lines)
        if self.follow:
            self.scroll_end(animate=False, immediate=True)
        self.refresh()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        i = y + scroll_y - (self.max_lines - len(self.lines))  # the lines sit at the bottom
        width = self.scrollable_content_region.width
        if not 0 <= i < len(self.lines):
            return Strip.blank(width, self.visual_style.rich_style)
        strip = Strip([Segment(text, style) for text, style in self.lines[i]])
        return strip.crop_extend(scroll_x, scroll_x + width, self.visual_style.rich_style)
