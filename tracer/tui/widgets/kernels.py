"""Kernels: the launches of this step, and for an attention launch, its programs.

A Triton launch runs a grid of programs; unified attention's is (query blocks × KV heads ×
KV segments). Choosing a launch draws that grid; choosing a program (arrows in the grid)
shows the physical KV blocks it reads through the block table. On the CPU the default
attention backend is the PyTorch reference, whose launches have no grid: start the server
with --attention-backend triton to see programs (interpreted on the CPU).
"""
from __future__ import annotations

import time

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from tracer.tui.fmt import fmt_ns, sparkline
from tracer.tui.frame import Frame
from tracer.tui.widgets.lines import FixedText
from tracer.tui.widgets.rows import RowList, cells_text

COLUMNS = [("#", 2), ("layer", 5), ("kernel", 19), ("grid", 7), ("time", 9), ("per step", 12), ("meta", 30)]
BUSY_HZ = 4
META_SHOWN = ("BLOCK_Q", "Q_BLOCKS", "TILE_N", "HEADS_PER_PROG", "NUM_SEGMENTS", "TOKENS", "BLOCK_HD", "num_warps")


def short_meta(meta: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in meta.items() if k in META_SHOWN) or "-"


class ProgramGrid(Widget, can_focus=True):
    """The launch's program grid; the cursor picks a program."""

    BINDINGS = [Binding("left", "move(-1, 0)", "program ←", show=False),
                Binding("right", "move(1, 0)", "program →", show=False),
                Binding("up", "move(0, -1)", "program ↑", show=False),
                Binding("down", "move(0, 1)", "program ↓", show=False)]
    cursor: reactive[tuple[int, int, int]] = reactive((0, 0, 0))

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.grid: tuple[int, ...] = ()
        self.access: dict | None = None
        self.frame: Frame | None = None

    def set_launch(self, grid, access: dict | None, frame: Frame) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid)) if grid else ()
        resized = grid != self.grid
        if resized:
            self.cursor = (0, 0, 0)
        self.grid, self.access, self.frame = grid, access, frame
        self.refresh(layout=resized)  # a layout pass repaints the screen: only for a new shape

    def action_move(self, dx: int, dy: int) -> None:
        if not self.grid:
            return
        x, y, z = self.cursor
        gx, gy, _ = self.grid
        if dy and gy == 1:  # a one-row grid: up/down walk the programs too
            dx, dy = dy, 0
        self.cursor = ((x + dx) % gx, (y + dy) % gy, z)

    def watch_cursor(self) -> None:
        self.refresh(layout=True)
        self.post_message(self.Chosen())

    class Chosen(Message):
        """The cursor moved to another program."""

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(1, len(self._text().plain.splitlines()))

    def render(self) -> Text:
        return self._text()

    def _text(self) -> Text:
        if not self.grid:
            return Text("")
        gx, gy, gz = self.grid
        t = Text(f"program grid {gx} × {gy}" + (f" × {gz}" if gz > 1 else "") +
                 "   (x: query blocks, y: KV heads" + (", z: KV segments" if gz > 1 else "") + ")\n", "bold")
        colors = self.frame.colors if self.frame else {}
        reqs = self.frame.state.batch.get("request_ids", []) if self.frame and self.frame.state.batch else []
        for y in range(gy):
            t.append(f"head {y:>2} ", "dim")
            for x in range(min(gx, 64)):
                work = (self.access or {}).get((x, y, self.cursor[2]), ())
                r = work[0].request if work else None
                rid = reqs[r] if r is not None and r < len(reqs) else None
                here = (x, y) == self.cursor[:2]
                style = ("reverse " if here else "") + colors.get(rid, "white")
                t.append("◆" if here else ("■" if work else "·"), style)
            if gx > 64:
                t.append(f" … +{gx - 64}", "dim")
            t.append("\n")
        return t


def program_text(grid: ProgramGrid) -> Text:
    if not grid.grid:
        return Text("")
    pid = grid.cursor
    work = (grid.access or {}).get(pid)
    t = Text.assemble(("program ", "bold"), str(pid), "  ")
    if grid.access is None:
        return t + Text("(no access map for this launch)", "dim")
    if not work:
        return t + Text("idle: no work for this program in this batch", "dim")
    reqs = grid.frame.state.batch.get("request_ids", []) if grid.frame and grid.frame.state.batch else []
    for a in work:
        rid = reqs[a.request] if a.request is not None and a.request < len(reqs) else None
        t.append("\n")
        if rid is not None:
            t.append(f"request {rid} ", f"bold {grid.frame.colors.get(rid, 'white')}")
        t.append(f"rows {a.rows[0]}..{a.rows[1] - 1}  kv heads {list(a.kv_heads)}")
        if a.kv_positions:
            t.append(f"  keys {a.kv_positions[0]}..{a.kv_positions[1] - 1}")
        t.append("\n  reads physical blocks ", "dim")
        t.append(" ".join(map(str, a.blocks)) or "none", "bold cyan")
    return t


class KernelsPanel(Vertical):
    def compose(self):
        yield FixedText(id="kernels-head")
        yield RowList(id="kernels-table")
        with VerticalScroll(id="kernels-programs"):
            yield ProgramGrid(id="program-grid")
            yield Static(id="program-access")

    def on_mount(self) -> None:
        self._key = None
        self._drawn_at = 0.0
        self._frame: Frame | None = None
        self._access_text: Text | None = None  # what #program-access shows

    def show(self, frame: Frame) -> None:
        s, c = frame.state, frame.controller
        key = (s.step, len(s.kernels), c.get("point"), c.get("paused"))
        now = time.monotonic()
        if key == self._key or (not c.get("paused") and now - self._drawn_at < 1 / BUSY_HZ):
            return  # while the engine runs, at most BUSY_HZ redraws a second
        self._frame, self._key, self._drawn_at = frame, key, now
        head = Text.assemble((f"step {s.step}: {len(s.kernels)} launches", "bold"))
        if c.get("paused") and c.get("point") == "kernel":
            info = (s.paused_at or {}).get("info") or {}
            head.append(f"   held before the next launch: {info.get('name', '?')} grid {info.get('grid', [])}"
                        f" layer {info.get('layer_idx', '?')}", "yellow")
        self.query_one("#kernels-head", FixedText).update(head)
        widths = [w for _, w in COLUMNS]
        widths[-1] = max(10, (self.size.width or 80) - sum(widths[:-1]) - 2 * len(widths) - 2)
        rows = []
        for i, k in enumerate(s.kernels):
            grid = "×".join(map(str, k.get("grid") or [])) or "-"
            rows.append((str(i), cells_text([str(i), str(k.get("layer_idx", "")), k["name"], grid,
                                             fmt_ns(k.get("duration_ns")),
                                             sparkline(s.kernel_history.get(k["name"], []), 12),
                                             short_meta(k.get("meta") or {})], widths)))
        self.query_one(RowList).set_rows(cells_text([n for n, _ in COLUMNS], widths), rows)
        self._show_programs()

    def on_row_list_highlighted(self, event: RowList.Highlighted) -> None:
        self._show_programs()

    def _show_programs(self) -> None:
        frame, grid = self._frame, self.query_one(ProgramGrid)
        table = self.query_one(RowList)
        if frame is None or not frame.state.kernels:
            if frame is not None:
                grid.set_launch((), None, frame)
            self._set_access(Text("no launches yet in this step", "dim"))
            return
        k = frame.state.kernels[min(table.cursor, len(frame.state.kernels) - 1)]
        if not k.get("grid"):
            grid.set_launch((), None, frame)
            self._set_access(Text(
                f"{k['name']}: {k.get('reason', '')}.\nA PyTorch reference has no program grid; start the server with "
                "--attention-backend triton to see the Triton grid and what each program reads.", "dim"))
            return
        from tracer.tui.access import access_map
        grid.set_launch(k["grid"], access_map(k, frame.state), frame)
        self._set_access(program_text(grid))

    def _set_access(self, text: Text) -> None:
        """Static.update costs a layout pass (its height may change): only when it changed."""
        if text != self._access_text:
            self._access_text = text
            self.query_one("#program-access", Static).update(text)

    def on_program_grid_chosen(self, _) -> None:
        self._set_access(program_text(self.query_one(ProgramGrid)))
