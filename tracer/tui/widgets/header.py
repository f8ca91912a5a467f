"""The header: what is being traced, and whether the engine runs, is held or is stepping."""
from __future__ import annotations

from rich.text import Text

from tracer.tui.frame import Frame
from tracer.tui.sources.base import SourceInfo
from tracer.tui.widgets.lines import FixedText


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


class StatusHeader(FixedText):
    """model · device · backend │ STATE step N (phase) │ URL"""

    def __init__(self, info: SourceInfo, **kwargs):
        super().__init__(Text(""), **kwargs)
        self.info = info

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
        finished = max(s.num_finished, len(s.finished))  # all that finished, not only the ones kept
        t.append(f"  W{len(s.waiting)} R{len(s.running)} F{finished}", "")
        if info.url:
            t.append("  " + info.url, "underline" if info.mode != "replay" else "")
        if c.get("paused") and c.get("reason"):
            t.append(f"\n held at {c.get('point')}: {c.get('reason')}", "yellow")
        elif c.get("pause_requested"):
            t.append("\n will hold before the next step", "yellow")
        elif s.events_missed:
            t.append(f"\n {s.events_missed} events missed (the viewer fell behind)", "red")
        self.update(t)
