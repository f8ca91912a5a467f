"""The program grid (the Kernels panel's second mode): the chosen Triton launch's programs.

A Triton launch runs a grid of programs; unified attention's is (query blocks × KV-head groups
× KV segments). Choosing a launch (enter) draws that grid, one row per KV head, so every head
can be reached; choosing a program shows the physical KV blocks it reads through the block
table. A collective or a PyTorch reference has no grid: the view says what the launch is instead.
"""
from __future__ import annotations

from rich.text import Text
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from tracer.state import rank_of
from tracer.tui.fmt import fmt_bytes, fmt_ns
from tracer.tui.frame import Frame
from tracer.tui.widgets.kernels.launches import COLLECTIVES, fmt_grid
from tracer.tui.widgets.kernels.rerun import rerun_access, rerun_text


class ProgramGrid(Widget, can_focus=True):
    """The launch's program grid, one row per KV head; the cursor is (query block, KV head,
    segment) and picks the program that does that head. Up/down walk the heads and go on to
    the next program at the end of a column, so every cell is reachable with them alone (a
    replay keeps ← → for time travel)."""

    BINDINGS = [Binding("left", "move(-1, 0)", "program ←", show=False),
                Binding("right", "move(1, 0)", "program →", show=False),
                Binding("up", "move(0, -1)", "head ↑", show=False),
                Binding("down", "move(0, 1)", "head ↓", show=False),
                Binding("escape", "back", "launches", show=False)]
    cursor: reactive[tuple[int, int, int]] = reactive((0, 0, 0))

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.grid: tuple[int, ...] = ()
        self.heads_per_program = 1
        self.access: dict | None = None
        self.request_ids: list[str] = []
        self.frame: Frame | None = None

    @property
    def num_heads(self) -> int:
        return self.grid[1] * self.heads_per_program if self.grid else 0

    @property
    def program(self) -> tuple[int, int, int]:
        x, h, z = self.cursor
        return (x, h // self.heads_per_program, z)

    def set_launch(self, grid, access: dict | None, frame: Frame, heads_per_program: int = 1,
                   request_ids: list[str] | None = None) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid)) if grid else ()
        resized = grid != self.grid or heads_per_program != self.heads_per_program
        if resized:
            self.cursor = (0, 0, 0)
        self.grid, self.access, self.frame = grid, access, frame
        self.heads_per_program = max(1, heads_per_program)
        self.request_ids = request_ids if request_ids is not None else (
            frame.state.batch.get("request_ids", []) if frame.state.batch else [])
        self.refresh(layout=resized)  # a layout pass repaints the screen: only for a new shape

    def action_move(self, dx: int, dy: int) -> None:
        if not self.grid:
            return
        x, h, z = self.cursor
        gx, heads = self.grid[0], self.num_heads
        if dy:
            h += dy
            if not 0 <= h < heads:  # past the last head: on to the next program's first
                x, h = (x + dy) % gx, h % heads
        self.cursor = ((x + dx) % gx, h, z)

    def action_back(self) -> None:
        self.post_message(self.Back())

    def watch_cursor(self) -> None:
        self.refresh(layout=True)
        self.post_message(self.Chosen())

    class Chosen(Message):
        """The cursor moved to another program or head."""

    class Back(Message):
        """Escape: back to the list of launches."""

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(1, len(self._text().plain.splitlines()))

    def render(self) -> Text:
        return self._text()

    def _text(self) -> Text:
        if not self.grid:
            return Text("")
        gx, gy, gz = self.grid
        hp = self.heads_per_program
        ys = f"KV heads, {hp} per program" if hp > 1 else "KV heads"
        t = Text(f"program grid {fmt_grid(self.grid)}   (x: query blocks, y: {ys}, z: KV segments)\n", "bold")
        colors = self.frame.colors if self.frame else {}
        cx, ch, cz = self.cursor
        for h in range(self.num_heads):
            t.append(f"head {h:>2} ", "dim")
            for x in range(min(gx, 64)):
                pid = (x, h // hp, cz)
                work = (self.access or {}).get(pid, ())
                r = work[0].request if work else None
                rid = self.request_ids[r] if r is not None and r < len(self.request_ids) else None
                here = (x, h) == (cx, ch)
                same_program = pid == self.program
                style = ("reverse " if here else "") + colors.get(rid, "white")
                t.append("◆" if here else "◇" if same_program else ("■" if work else "·"), style)
            if gx > 64:
                t.append(f" … +{gx - 64}", "dim")
            t.append("\n")
        if hp > 1:
            t.append(f"◇ the same program: each program does {hp} KV heads\n", "dim")
        return t


def program_text(grid: ProgramGrid) -> Text:
    if not grid.grid:
        return Text("")
    pid, head = grid.program, grid.cursor[1]
    work = (grid.access or {}).get(pid)
    t = Text.assemble(("program ", "bold"), str(pid), f"  KV head {head}  ")
    if grid.access is None:
        return t + Text("(no access map for this launch)", "dim")
    if not work:
        return t + Text("idle: no work for this program in this batch", "dim")
    reqs = grid.request_ids
    for a in work:
        rid = reqs[a.request] if a.request is not None and a.request < len(reqs) else None
        t.append("\n")
        if rid is not None:
            t.append(f"request {rid} ", f"bold {grid.frame.colors.get(rid, 'white') if grid.frame else 'white'}")
        t.append(f"rows {a.rows[0]}..{a.rows[1] - 1}  kv heads {list(a.kv_heads)}")
        if a.q_heads and a.q_heads != a.kv_heads:  # GQA: the query heads that share them
            t.append(f" ← query heads {list(a.q_heads)}")
        if a.kv_positions:
            t.append(f"  keys {a.kv_positions[0]}..{a.kv_positions[1] - 1}")
        t.append(f"\n  reads for KV head {head}: physical blocks ", "dim")
        t.append(" ".join(map(str, a.blocks)) or "none", "bold cyan")
    return t


class ProgramsView(VerticalScroll):
    """Under the launch list: the chosen launch's program grid and what the chosen program reads,
    or the Triton re-run of the launch the engine is held before (`t`), or why there is no grid."""

    def compose(self):
        yield Static(id="kernels-rerun")
        yield ProgramGrid(id="program-grid")
        yield Static(id="program-access")

    def on_mount(self) -> None:
        self._texts: dict[str, Text] = {}  # what each Static shows

    def show_launch(self, frame: Frame, k: dict | None) -> None:
        grid = self.query_one(ProgramGrid)
        self._set("#kernels-rerun", Text(""))
        if k is None:
            grid.set_launch((), None, frame)
            self._set("#program-access", Text("no launches yet in this step", "dim"))
        elif k["name"] in COLLECTIVES:
            grid.set_launch((), None, frame)
            self._set("#program-access", Text(
                f"{k['name']} on rank {rank_of(k)}: {k.get('reason', '')}.\nIt moves "
                f"{fmt_bytes((k.get('meta') or {}).get('bytes'))} from this rank in {fmt_ns(k.get('duration_ns'))} "
                "(wall clock: the wait for the slowest rank included). A collective has no program grid.", "dim"))
        elif not k.get("grid"):
            grid.set_launch((), None, frame)
            self._set("#program-access", Text(
                f"{k['name']}: {k.get('reason', '')}.\nA PyTorch reference has no program grid. Hold the engine "
                "before an attention launch (k) and press t to run it through our Triton kernel, or start the "
                "server with --attention-backend triton.", "dim"))
        else:
            from tracer.tui.access import access_map
            grid.set_launch(k["grid"], access_map(k, frame.state), frame,
                            (k.get("meta") or {}).get("HEADS_PER_PROG", 1))
            self._set("#program-access", program_text(grid))

    def show_rerun(self, frame: Frame, held: dict, result: dict) -> None:
        grid = self.query_one(ProgramGrid)
        self._set("#kernels-rerun", rerun_text(held, result))
        grid.set_launch(result["grid"], rerun_access(result), frame, result["meta"].get("HEADS_PER_PROG", 1))
        self._set("#program-access", program_text(grid))

    def on_program_grid_chosen(self, _) -> None:
        self._set("#program-access", program_text(self.query_one(ProgramGrid)))

    def _set(self, selector: str, text: Text) -> None:
        """Static.update costs a layout pass (its height may change): only when it changed."""
        if text != self._texts.get(selector):
            self._texts[selector] = text
            self.query_one(selector, Static).update(text)
