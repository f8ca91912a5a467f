"""KV cache: every physical block as a cell, coloured by the request that owns it.

    █ owned by one request    ▓ shared (a prefix-cache hit: several block tables point at it)
    ░ free, but its contents are still cached (a new request with that prefix can reuse it)
    · free

The engine hands out blocks from the front of its free queue, so used blocks gather at low
ids; the grid draws up to the highest block in use (at least a screenful) and counts the rest.
The selected request's blocks stay in colour while everyone else's fade.
"""
from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
import time

from textual.containers import Vertical

from tracer.tui.fmt import sparkline
from tracer.tui.frame import Frame
from tracer.tui.widgets.lines import FixedText, LinesView

LABEL = 6  # "12345 " block id at the start of each row
MAX_CELLS = 4096  # blocks drawn; beyond, a count (a 16k-block CPU cache would cost every refresh)
GRID_HZ = 4  # grid redraws per second at most (the gauge and the counts follow every refresh)


def block_owners(frame: Frame) -> dict[int, list[str]]:
    s = frame.state
    owners: dict[int, list[str]] = {}
    for rid, r in s.requests.items():
        if r.block_table and not r.status.startswith("FINISHED"):
            for b in r.block_table:
                owners.setdefault(b, []).append(rid)
    return owners


def draw_blocks(frame: Frame, num_blocks: int, width: int, min_rows: int) -> list[list[Segment]]:
    """The grid as segments, one list per row; runs of cells that look alike share a segment."""
    owners = block_owners(frame)
    per_row = max(8, (width - LABEL) // 2)
    top = max(max(owners, default=-1), max(frame.state.cached_free, default=-1))
    shown = min(num_blocks, max((top // per_row + 1) * per_row, per_row * min_rows), MAX_CELLS)
    sel, cached = frame.selected, frame.state.cached_free
    rows = []
    for start in range(0, shown, per_row):
        cells = []
        for b in range(start, min(start + per_row, shown)):
            who = owners.get(b)
            if who:
                mine = sel is None or sel in who
                color = frame.color(sel if sel in who else who[0])
                cells.append(("▓ " if len(who) > 1 else "█ ", _style(color if mine else f"{color} dim")))
            elif b in cached:
                cells.append(("░ ", _style("dim")))
            else:
                cells.append(("· ", _style("#444444")))
        row = [Segment(f"{start:>{LABEL - 1}} ", _style("dim"))]
        for text, style in cells:  # merge runs: a full cache is a few segments per row, not hundreds
            if row[-1].style is style:
                row[-1] = Segment(row[-1].text + text, style)
            else:
                row.append(Segment(text, style))
        rows.append(row)
    if shown < num_blocks:
        rest = sum(1 for b in owners if b >= shown)
        note = (f"{rest} in use (not drawn)" if rest else "free, never used" if top < shown else "not drawn")
        rows.append([Segment(f"{'':>{LABEL}}blocks {shown}..{num_blocks - 1}: {note}", _style("dim"))])
    return rows


_styles: dict[str, Style] = {}


def _style(spec: str) -> Style:
    style = _styles.get(spec)
    if style is None:
        style = _styles[spec] = Style.parse(spec)
    return style


class KVCachePanel(Vertical):
    def compose(self):
        yield FixedText(id="kv-summary")
        yield LinesView(id="kv-grid")

    def on_mount(self) -> None:
        self._key = None
        self._drawn_at = 0.0
        self._drawn_key = None

    def show(self, frame: Frame) -> None:
        s = frame.state
        total = s.stats.get("num_total_blocks") or s.num_blocks or 0
        free = s.stats.get("num_free_blocks", total)
        used = total - free
        width = self.size.width or 80
        key = (s.last_seq, frame.selected, width)
        if key == self._key:
            return
        self._key = key
        owners = block_owners(frame)
        shared = sum(1 for w in owners.values() if len(w) > 1)
        usage = used / total if total else 0.0
        bar_w = max(10, min(40, width - 56))
        filled = round(usage * bar_w)
        summary = Text.assemble(
            ("KV cache ", "bold"), ("█" * filled, "green" if usage < 0.8 else "red"),
            ("░" * (bar_w - filled), "dim"),
            f" {usage:5.1%} {used}/{total} used · {shared} shared · {len(s.cached_free)} cached",
            ("\nper step ", "dim"), (sparkline(s.kv_usage_history, max(10, width - 12), top=1.0), "green"),
            ("\n█ owned  ▓ shared prefix  ░ cached, free  · free", "dim"),
            ("   (select a request to highlight its blocks)" if frame.selected is None
             else f"   highlighted: request {frame.selected}", "dim"))
        self.query_one("#kv-summary", FixedText).update(summary)
        grid = self.query_one("#kv-grid", LinesView)
        now = time.monotonic()
        if not total:
            grid.update(Text("no KV cache yet (the engine is starting)", "dim"))
        elif now - self._drawn_at >= 1 / GRID_HZ or frame.controller.get("paused") or key[1:] != self._drawn_key:
            self._drawn_at, self._drawn_key = now, key[1:]
            grid.update_rows(draw_blocks(frame, total, width, max(4, (self.size.height or 20) - 6)))
        else:
            self._key = None  # not drawn yet: look again next refresh
