"""The header: what is being traced, and whether the engine runs, is held or is stepping."""
from __future__ import annotations

from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget

from tracer.tui.frame import Frame
from tracer.tui.sources.base import SourceInfo


def engine_mode(frame: Frame, stepping: bool, mode: str) -> tuple[str, str]:
    """(label, style) for the engine's state."""
    c = frame.controller
    if mode == "replay":
        return "REPLAY", "bold black on #61afef"
    if c.get("paused"):
        return "PAUSED", "bold black on yellow"
    if stepping:
        return "STEPPING", "bold black on #c678dd"
    if c.get("pause_requested"):  # the engine will hold at its next step boundary (idle: once work arrives)
        return "PAUSED", "bold black on yellow"
    return "RUNNING", "bold black on green"


class StatusHeader(Widget):
    """model · device · backend │ STATE step N (phase) │ URL

    Not a Static: it changes at every step, Static.update asks for a layout pass each time,
    and Textual's general render path costs ~2 ms a time. This one has a fixed height, renders
    its text to lines once per change and hands those out."""

    def __init__(self, info: SourceInfo, **kwargs):
        super().__init__(**kwargs)
        self.info = info
        self._text = Text("")
        self._lines: list[Strip] = []
        self._width = -1

    @property
    def text(self) -> str:
        return self._text.plain

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if width != self._width:
            options = self.app.console.options.update_width(width)
            base = self.rich_style  # the header's own background under the text's styles
            self._lines = [Strip(line).apply_style(base)
                           for line in self.app.console.render_lines(self._text, options, pad=False)]
            self._width = width
        line = self._lines[y] if y < len(self._lines) else Strip([])
        return line.crop_extend(0, width, self.rich_style)

    def show(self, frame: Frame, stepping: bool = False) -> None:
        s, c, info = frame.state, frame.controller, self.info
        label, style = engine_mode(frame, stepping, info.mode)
        wide = self.size.width >= 100
        t = Text.assemble((" vllm-trace " if wide else "", "bold reverse"), " ", (info.model, "bold"),
                          f" · {info.device} · {info.backend} ")
        t.append(f" {label} ", style)
        step = "-" if s.step is None else str(s.step)
        t.append(f" step {step}", "bold")
        where = c.get("point") if c.get("paused") else s.phase
        if where:
            t.append(f" ({where})", "dim")
        if info.mode == "replay" and c.get("last_step") is not None:
            t.append(f"/{c['first_step']}..{c['last_step']}", "dim")
        t.append(f"  W{len(s.waiting)} R{len(s.running)} F{len(s.finished)}", "")
        if info.url:
            t.append("  " + info.url, "underline" if info.mode != "replay" else "")
        if c.get("paused") and c.get("reason"):
            t.append(f"\n held at {c.get('point')}: {c.get('reason')}", "yellow")
        elif c.get("pause_requested"):
            t.append("\n will hold before the next step", "yellow")
        elif s.events_missed:
            t.append(f"\n {s.events_missed} events missed (the viewer fell behind)", "red")
        if t != self._text:
            self._text, self._width = t, -1  # rendered again at the next repaint
            self.refresh()
