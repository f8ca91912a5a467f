"""AsyncTimeline: two batches in flight, drawn from the recorded spans (async scheduling).

Two rows over the last few steps, on one time axis: the core's thread (S schedule, G grammar
bitmask, U update_from_output) and the forward pass (the executor's thread, execute_model). Under
async scheduling step N+1's S sits over step N's forward pass: the core schedules while the model
runs. Steps alternate two colours so neighbours stand apart; a span still open reaches "now".
Below, each running request's tokens in flight: a `?` per step in flight that samples for it,
a placeholder until that step's update_from_output turns it into a token.
"""
from __future__ import annotations

from rich.console import Group
from rich.text import Text

from tracer.state import TraceState, placeholders
from tracer.tui.frame import Frame
from tracer.tui.widgets.lines import LinesView
from tracer.tui.widgets.panel import Panel

ROWS = (("core", "core thread "), ("forward", "forward pass"))
GLYPHS = {"schedule": "S", "grammar_bitmask": "G", "update_from_output": "U", "execute_model": "█"}
STEP_STYLES = ("#61afef", "#e5c07b")  # even, odd steps
LEGEND = "S schedule · G grammar bitmask · U update_from_output · █ execute_model · ? a placeholder token"


def timeline_rows(s: TraceState, width: int) -> list[Text]:
    """The two rows, `width` columns each (the label included)."""
    spans = [t for t in s.timeline if t[3] is not None]
    label = len(ROWS[0][1]) + 1
    cols = max(8, width - label)
    if not spans:
        return [Text(title + " ", style="dim") for _, title in ROWS]
    now = max(s.last_ts_ns, max(t[4] or 0 for t in spans))
    t0 = min(t[3] for t in spans)
    scale = cols / max(1, now - t0)
    lines = []
    for row, title in ROWS:
        cells: list[tuple[str, str]] = [(" ", "")] * cols
        for r, name, step, begin, end in spans:
            if r != row:
                continue
            a = min(cols - 1, int((begin - t0) * scale))
            b = max(a + 1, min(cols, int(((end if end is not None else now) - t0) * scale)))
            style = STEP_STYLES[(step or 0) % 2]
            for i in range(a, b):
                cells[i] = (GLYPHS.get(name, "·"), style)
            if row == "forward" and b - a > len(str(step)) + 1:  # the step's number inside its forward pass
                for i, ch in enumerate(str(step)):
                    cells[a + 1 + i] = (ch, f"bold black on {style}")
        line = Text(title + " ", style="bold")
        for ch, style in cells:
            line.append(ch, style)
        lines.append(line)
    return lines


def placeholder_lines(frame: Frame) -> list[Text]:
    s = frame.state
    lines = []
    for rid in s.running:
        n = placeholders(s, rid)
        if not n:
            continue
        req = s.requests.get(rid)
        known = req.num_output_tokens if req is not None else 0
        lines.append(Text.assemble((rid, f"bold {frame.color(rid)}"), f"  {known} tokens out, then ",
                                   ("? " * n, "bold yellow"), (f"({n} in flight: placeholders)", "dim")))
    return lines


def timeline(frame: Frame, width: int) -> Group:
    s = frame.state
    flight = ", ".join(f"step {step} ({status})" for step, status in s.in_flight) or "none"
    head = Text.assemble(("async scheduling: two batches in flight", "bold"), f"   in flight: {flight}")
    return Group(head, *timeline_rows(s, width), Text(LEGEND, style="dim"), *placeholder_lines(frame))


def is_async(frame: Frame) -> bool:
    """Does the engine schedule asynchronously (its configuration says so)?"""
    return bool((((frame.state.engine_config or {}).get("scheduler")) or {}).get("async_scheduling"))


class AsyncTimeline(Panel):
    """The timeline, shown above the Step panel's columns while the engine schedules asynchronously."""

    def compose(self):
        yield LinesView(id="timeline-lines")

    def show(self, frame: Frame, force: bool = False) -> None:
        self.display = is_async(frame)
        if self.display:
            self.query_one("#timeline-lines", LinesView).update(timeline(frame, max(20, self.size.width - 2)))
