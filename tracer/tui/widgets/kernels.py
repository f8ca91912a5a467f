"""Kernels: the launches of this step, and for an attention launch, its programs.

A Triton launch runs a grid of programs; unified attention's is (query blocks × KV-head groups
× KV segments). Choosing a launch (enter) draws that grid, one row per KV head, so every head
can be reached; choosing a program shows the physical KV blocks it reads through the block
table. On the CPU the default attention backend is the PyTorch reference, whose launches
have no grid: its rows show the argument shapes instead, and when the engine is held before
an attention launch (`k`), `t` runs that very launch through our Triton kernel (interpreted
on the CPU) and draws its grid, its programs and its difference from the PyTorch output.

While profiling is on (`p`, or POST /start_profile) every op of the forward pass is a launch with
its kind, FLOPs and bytes: a profiled step is listed longest op first, with its share of the step,
its arithmetic intensity, achieved rate and the roof over it (memory- or compute-bound against this
machine's measured roofline), and a roofline chart replaces the program grid below the list.

With tensor parallelism every rank's launches arrive, the collectives (all_reduce, all_gather)
among them. Then a rank column appears, `r` cycles the list through rank 0, 1, ... and all,
and a line per rank sums its launches and the share of its time spent communicating. With
one rank the panel is as it always was.
"""
from __future__ import annotations

import time

from rich.text import Text
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from engine.trace_names import ALL_GATHER, ALL_REDUCE
from kernels.instrument import ProgramAccess
from kernels.roofline import Roofline
from tracer.roofline import (
    by_kind,
    cached_roofline,
    fmt_count,
    is_profiled,
    machine_roofline,
    profiled_ops,
    trace_dtype,
)
from tracer.state import TraceState, rank_of, step_ranks
from tracer.tui.fmt import fmt_bytes, fmt_ns, sparkline
from tracer.tui.frame import Frame
from tracer.tui.sources.base import engine_identity
from tracer.tui.widgets.lines import FixedText
from tracer.tui.widgets.panel import Panel
from tracer.tui.widgets.roofline import RooflineChart
from tracer.tui.widgets.rows import RowList, cells_text

BUSY_HZ = 4
META_SHOWN = ("BLOCK_Q", "Q_BLOCKS", "TILE_N", "HEADS_PER_PROG", "NUM_SEGMENTS", "TOKENS", "BLOCK_HD", "num_warps")


def short_meta(meta: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in meta.items() if k in META_SHOWN) or "-"


def fmt_grid(grid) -> str:
    """A launch grid as x×y×z (the same in the table and over the picture)."""
    grid = tuple(grid or ())
    return "×".join(map(str, grid + (1,) * (3 - len(grid)))) if grid else "-"


def arg_shapes(args: dict | None) -> str:
    """'query 11×4×32 key_cache 64×4×4×32 …' (what a PyTorch reference call was given)."""
    if not args:
        return "-"
    return " ".join(f"{name} {'×'.join(map(str, shape)) or 'scalar'}" for name, (shape, _dtype) in args.items())


COLLECTIVES = (ALL_REDUCE, ALL_GATHER)


def collective_detail(launch: dict) -> str:
    """'2.0 KiB attn.c_proj (sum over 2 ranks)': what an all_reduce / all_gather row shows."""
    m = launch.get("meta") or {}
    over = f"{m.get('op', '?')} over {m.get('world_size', '?')} ranks"
    return f"{fmt_bytes(m.get('bytes'))} {m.get('site', '?')} ({over})"


def rank_summary(kernels: list[dict], rank: int) -> str:
    """'rank 0: 17 launches · 9.1 ms · communication 6.2 ms (68%)'."""
    mine = [k for k in kernels if rank_of(k) == rank]
    total = sum(k.get("duration_ns") or 0 for k in mine)
    comm = sum(k.get("duration_ns") or 0 for k in mine if k["name"] in COLLECTIVES)
    share = f" ({comm / total:.0%})" if total else ""
    return (f"rank {rank}: {len(mine)} launch{'' if len(mine) == 1 else 'es'} · {fmt_ns(total)} · "
            f"communication {fmt_ns(comm)}{share}")


def multi_rank(s: TraceState) -> bool:
    return s.tensor_parallel_size > 1 or len(step_ranks(s)) > 1


def held_launch(frame: Frame) -> dict | None:
    """The launch the engine is held before ({name, grid, layer_idx, step}), if it is."""
    c = frame.controller
    if c.get("paused") and c.get("point") == "kernel":
        return (frame.state.paused_at or {}).get("info") or {}
    return None


def rerun_access(result: dict) -> dict:
    """kernels.rerun's programs (plain data) as the access map ProgramGrid draws."""
    m: dict = {}
    for p in result["programs"]:
        a = ProgramAccess(tuple(p["pid"]), p["request"], tuple(p["rows"]), tuple(p["kv_heads"]), tuple(p["blocks"]),
                          tuple(p["kv_positions"]) if p["kv_positions"] else None, p["segment"],
                          tuple(p["q_heads"]) if p.get("q_heads") else None)
        m[a.pid] = m.get(a.pid, ()) + (a,)
    return m


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


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


# What the list holds, said on the panel: a learner otherwise takes it for the whole forward pass.
SCOPE = ("listed: each layer's KV-cache write and paged attention, and any collectives",
         "not listed: matmuls, layer norms, MLP, LM head, sampler (p profiles them too)")
PROFILED_SCOPE = "listed: every op of the forward pass, longest first (profiling: p turns it on and off)"
BAR = 8  # cells of the share-of-the-step bar


def share_bar(share: float) -> str:
    """'███▌     27%': an op's share of the step, in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, share)) * BAR * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")).ljust(BAR) + f" {share:>4.0%}"


def bound_cell(point, roof: Roofline | None) -> tuple[str, str | None]:
    if roof is None or not point.flops or not point.bytes:
        return "-", "dim"
    bound = point.bound(roof)
    return bound, "red" if bound == "memory" else "green"


def kind_shares(ops, total_ns: int) -> str:
    """'matmul 52% · attention 9% · …': where the listed time goes, by op kind."""
    sums = by_kind(ops)
    order = sorted(sums.items(), key=lambda kv: -kv[1].duration_ns)
    return " · ".join(f"{k} {p.duration_ns / total_ns:.0%}" for k, p in order) if total_ns else ""


class KernelsPanel(Panel):
    def compose(self):
        yield FixedText(id="kernels-head")
        yield RowList(id="kernels-table")
        with VerticalScroll(id="kernels-programs"):
            yield Static(id="kernels-rerun")
            yield ProgramGrid(id="program-grid")
            yield Static(id="program-access")
        yield RooflineChart(id="kernels-roofline")

    def on_mount(self) -> None:
        self._key = None
        self._drawn_at = 0.0
        self._frame: Frame | None = None
        self._texts: dict[str, Text] = {}  # what each Static shows
        self.rerun: dict | None = None  # `t`: the Triton re-run of the held launch
        self.rerun_of: tuple | None = None  # (step, layer, name) of the launch it re-ran
        self.rank: int | None = None  # `r`: the rank whose launches are listed (None: all)
        self.roof: Roofline | None = None  # this machine's roofline, for the step's device and dtype
        self._roof_for: tuple | None = None  # the (device, dtype) it was looked up for
        self._calibrating = False
        self._profiled = False  # the list shows a profiled step (the chart below it)
        self.query_one(RooflineChart).display = False

    def focus_list(self) -> None:
        self.query_one(RowList).focus()

    def set_rerun(self, held: dict, result: dict | None) -> None:
        self.rerun, self.rerun_of = result, (held.get("step"), held.get("layer_idx"), held.get("name"))
        self._key = None

    def next_rank(self) -> bool:
        """`r`: list rank 0's launches, then rank 1's, ..., then all ranks' again. False (and
        nothing changes) when the engine runs on one rank."""
        s = self._frame.state if self._frame is not None else None
        if s is None or not multi_rank(s):
            return False
        n = max([s.tensor_parallel_size] + [r + 1 for r in step_ranks(s)])
        self.rank = 0 if self.rank is None else None if self.rank + 1 >= n else self.rank + 1
        self._key = None
        self.query_one(RowList).move_cursor(0)
        self.show(self._frame, force=True)
        return True

    def launches(self, s: TraceState) -> list[dict]:
        """This step's launches as listed: the chosen rank's, or every rank's."""
        return s.kernels if self.rank is None else [k for k in s.kernels if rank_of(k) == self.rank]

    def show(self, frame: Frame, force: bool = False) -> None:
        s, c = frame.state, frame.controller
        key = (s.step, s.phase, len(s.kernels), c.get("point"), c.get("paused"), self.size.width, self.rank)
        now = time.monotonic()
        if not force and (key == self._key or (not c.get("paused") and now - self._drawn_at < 1 / BUSY_HZ)):
            return  # while the engine runs, at most BUSY_HZ redraws a second
        self._frame, self._key, self._drawn_at = frame, key, now
        launches, ranks = self.launches(s), multi_rank(s)
        if any(is_profiled(k) for k in launches) and not self._showing_rerun(frame):
            return self._show_profiled(frame, launches, ranks)
        self._set_profiled(False)
        head = Text.assemble((f"step {'-' if s.step is None else s.step}: ", "bold"),
                             (f"{len(launches)} launch{'' if len(launches) == 1 else 'es'}", "bold"),
                             (f" ({s.phase})" if s.phase not in ("done", "idle") else "", "dim"))
        held = held_launch(frame)
        if held is not None:
            head.append(f"   held before {held.get('name', '?')} (layer {held.get('layer_idx', '?')})", "yellow")
            if str(held.get("name", "")).startswith("unified_attention_ref"):
                head.append("  t: run it on Triton", "bold yellow")
        if ranks:
            head.append(f"   rank {'all' if self.rank is None else self.rank} of {s.tensor_parallel_size}", "bold")
            head.append("  (r: next rank)", "dim")
            for r in step_ranks(s):
                head.append("\n" + rank_summary(s.kernels, r), "bold" if r == self.rank else "")
        head.append("\n" + "\n".join(SCOPE), "dim")
        self._set_head(head)  # a line per rank under the CSS's one
        width = self.size.width or 80
        names = [k["name"] for k in launches]
        grids = [fmt_grid(k.get("grid")) for k in launches]
        columns = [("#", 3), *([("rank", 4)] if ranks else []), ("layer", 5),
                   ("kernel", max([6] + list(map(len, names)))),
                   ("grid", max([4] + list(map(len, grids)))), ("time", 9), ("per step", 12),
                   ("meta / argument shapes", 0)]
        widths = [w for _, w in columns]
        widths[-1] = max(10, width - sum(widths[:-1]) - 2 * len(widths) - 2)
        rows = []
        for i, k in enumerate(launches):
            if k["name"] in COLLECTIVES:
                detail = collective_detail(k)
            else:
                detail = short_meta(k["meta"]) if k.get("meta") else arg_shapes(k.get("args"))
            rank = [str(rank_of(k))] if ranks else []
            # a gather belongs to no layer; one rank keeps the table as it always was
            layer = "" if ranks and k.get("layer_idx") is None else str(k.get("layer_idx", ""))
            rows.append((str(i), cells_text([str(i), *rank, layer, k["name"], grids[i],
                                             fmt_ns(k.get("duration_ns")),
                                             sparkline(s.kernel_history.get(k["name"], []), 12), detail], widths)))
        self.query_one(RowList).set_rows(cells_text([n for n, _ in columns], widths), rows)
        self._show_programs()

    def _showing_rerun(self, frame: Frame) -> bool:
        """`t` re-ran the launch the engine is held before: its grid is shown, profiled or not."""
        held = held_launch(frame)
        return self.rerun is not None and held is not None and self.rerun_of == (
            held.get("step"), held.get("layer_idx"), held.get("name"))

    def _set_profiled(self, on: bool) -> None:
        if on != self._profiled:
            self._profiled = on
            self.query_one("#kernels-programs").display = not on
            self.query_one(RooflineChart).display = on

    def _set_head(self, head: Text, wrapped: bool = False) -> None:
        box = self.query_one("#kernels-head", FixedText)
        height = 1 + head.plain.count("\n")
        if wrapped:  # lines longer than the panel take more than one row each
            width = max(20, (self.size.width or 80) - 2)
            height = sum(max(1, -(-len(line) // width)) for line in head.plain.split("\n"))
        if box.styles.height is None or box.styles.height.value != height:
            box.styles.height = height
        box.update(head)

    def _roofline(self, s: TraceState, launches: list[dict]) -> Roofline | None:
        """This machine's roofline for the step's device and dtype: from the cache, else
        calibrated once on a thread (about a second) while the panel draws without roofs."""
        device = engine_identity(s)[0]
        device = "cuda" if str(device).startswith("cuda") else "cpu"
        want = (device, trace_dtype(launches))
        if want != self._roof_for:
            self._roof_for, self.roof = want, cached_roofline(*want)
            if self.roof is None and not self._calibrating and (device == "cpu" or _has_cuda()):
                self._calibrating = True
                self.run_worker(lambda: self._calibrate(want), thread=True, group="roofline")
        return self.roof

    def _calibrate(self, want: tuple) -> None:
        try:
            roof, _, _ = machine_roofline(*want)
        except Exception:  # no such device here: the chart stays without roofs
            roof = None
        self.app.call_from_thread(self._calibrated, want, roof)

    def _calibrated(self, want: tuple, roof: Roofline | None) -> None:
        self._calibrating = False
        if want == self._roof_for:
            self.roof, self._key = roof, None
            if self._frame is not None:
                self.show(self._frame, force=True)

    def _show_profiled(self, frame: Frame, launches: list[dict], ranks: bool) -> None:
        """A profiled step: every op, longest first, on this machine's roofline."""
        s = frame.state
        self._set_profiled(True)
        ops = profiled_ops(launches)
        roof = self._roofline(s, launches)
        total = sum(o.duration_ns for o in ops)
        head = Text.assemble((f"step {'-' if s.step is None else s.step}: ", "bold"),
                             (f"{len(ops)} ops profiled", "bold"),
                             (f" ({s.phase})" if s.phase not in ("done", "idle") else "", "dim"),
                             f" · {fmt_ns(total)}")
        if s.phase == "done" and s.step_ns:
            head.append(f" = {total / s.step_ns:.0%} of the step's {fmt_ns(s.step_ns)} wall time")
        held = held_launch(frame)
        if held is not None:
            head.append(f"   held before {held.get('name', '?')} (layer {held.get('layer_idx', '?')})", "yellow")
        if ranks:
            head.append(f"   rank {'all' if self.rank is None else self.rank} of {s.tensor_parallel_size}", "bold")
            head.append("  (r: next rank)", "dim")
        head.append("\nby kind: " + kind_shares(ops, total))
        if roof is not None:
            head.append(f"\nroofs (this machine, {roof.dtype}): {fmt_count(roof.peak_flops, 'FLOP/s')} · "
                        f"{fmt_count(roof.peak_bw, 'B/s')} · ridge {roof.ridge:.3g} FLOP/byte",
                        "cyan")
        else:
            head.append("\nroofs: " + ("calibrating this machine's roofline…" if self._calibrating else
                                        "no roofline for this device on this machine (vllm-trace roofline)"), "dim")
        head.append("\n" + PROFILED_SCOPE, "dim")
        self._set_head(head, wrapped=True)
        columns = [("#", 3), *([("rank", 4)] if ranks else []), ("layer", 5),
                   ("op", max([2] + [len(o.name) for o in ops])), ("kind", 11), ("share", BAR + 5), ("time", 9),
                   ("FLOPs", 9), ("bytes", 9), ("FLOP/B", 7), ("achieved", 12), ("bound", 7)]
        for optional in ("kind", "bytes", "achieved", "FLOPs"):  # a narrow terminal: the table still fits
            if sum(w + 2 for _, w in columns) + 1 <= (self.size.width or 80):
                break
            columns = [c for c in columns if c[0] != optional]
        names, widths = [n for n, _ in columns], [w for _, w in columns]
        rows = []
        for i, o in enumerate(ops):
            p = o.point
            cells = {"#": str(i), "rank": str(o.rank), "layer": "" if o.layer is None else str(o.layer),
                     "op": o.name, "kind": o.kind, "share": share_bar(o.duration_ns / total if total else 0.0),
                     "time": fmt_ns(o.duration_ns), "FLOPs": fmt_count(p.flops) if p.flops else "-",
                     "bytes": fmt_bytes(p.bytes) if p.bytes else "-",
                     "FLOP/B": f"{p.intensity:.3g}" if p.flops and p.bytes else "-",
                     "achieved": fmt_count(p.flops_per_s, "FLOP/s") if p.flops else fmt_count(p.bytes_per_s, "B/s"),
                     "bound": bound_cell(p, roof)}
            rows.append((str(i), cells_text([cells[n] for n in names], widths)))
        self.query_one(RowList).set_rows(cells_text(names, widths), rows)
        title = f"step {s.step} on the roofline: one point per op kind, its FLOPs, bytes and time summed"
        self.query_one(RooflineChart).set_points(by_kind(ops), roof, title)

    def on_row_list_highlighted(self, event: RowList.Highlighted) -> None:
        if self._profiled:
            return
        self._show_programs()

    def on_row_list_selected(self, event: RowList.Selected) -> None:
        event.stop()
        grid = self.query_one(ProgramGrid)
        if grid.grid:
            grid.focus()

    def on_program_grid_back(self, _) -> None:
        self.query_one(RowList).focus()

    def _show_programs(self) -> None:
        frame, grid = self._frame, self.query_one(ProgramGrid)
        if frame is None or self._profiled:
            return
        if self._showing_rerun(frame):
            return self._show_rerun(frame, held_launch(frame))
        self._set("#kernels-rerun", Text(""))
        table, launches = self.query_one(RowList), self.launches(frame.state)
        if not launches:
            grid.set_launch((), None, frame)
            self._set("#program-access", Text("no launches yet in this step", "dim"))
            return
        k = launches[min(table.cursor, len(launches) - 1)]
        if k["name"] in COLLECTIVES:
            grid.set_launch((), None, frame)
            self._set("#program-access", Text(
                f"{k['name']} on rank {rank_of(k)}: {k.get('reason', '')}.\nIt moves "
                f"{fmt_bytes((k.get('meta') or {}).get('bytes'))} from this rank in {fmt_ns(k.get('duration_ns'))} "
                "(wall clock: the wait for the slowest rank included). A collective has no program grid.", "dim"))
            return
        if not k.get("grid"):
            grid.set_launch((), None, frame)
            self._set("#program-access", Text(
                f"{k['name']}: {k.get('reason', '')}.\nA PyTorch reference has no program grid. Hold the engine "
                "before an attention launch (k) and press t to run it through our Triton kernel, or start the "
                "server with --attention-backend triton.", "dim"))
            return
        from tracer.tui.access import access_map
        grid.set_launch(k["grid"], access_map(k, frame.state), frame, (k.get("meta") or {}).get("HEADS_PER_PROG", 1))
        self._set("#program-access", program_text(grid))

    def _show_rerun(self, frame: Frame, held: dict) -> None:
        r, grid = self.rerun, self.query_one(ProgramGrid)
        where = "the Triton interpreter (CPU)" if r["interpreted"] else "the GPU"
        self._set("#kernels-rerun", Text.assemble(
            ("t: ", "bold"), f"the held launch {held.get('name')} (layer {held.get('layer_idx')}) re-run as ",
            (r["name"], "bold"), f" on {where} in {r['seconds']:.2f} s\n",
            f"grid {fmt_grid(r['grid'])} = {r['num_programs']} program{'' if r['num_programs'] == 1 else 's'} for "
            f"{r['num_tokens']} query rows of {r['num_seqs']} request{'' if r['num_seqs'] == 1 else 's'} · ",
            ("max |Triton − PyTorch| = ", "bold"), (f"{r['max_abs_diff']:.2e}", "bold green"),
            (f"\n{r['reason']}", "dim")))
        grid.set_launch(r["grid"], rerun_access(r), frame, r["meta"].get("HEADS_PER_PROG", 1))
        self._set("#program-access", program_text(grid))

    def _set(self, selector: str, text: Text) -> None:
        """Static.update costs a layout pass (its height may change): only when it changed."""
        if text != self._texts.get(selector):
            self._texts[selector] = text
            self.query_one(selector, Static).update(text)

    def on_program_grid_chosen(self, _) -> None:
        self._set("#program-access", program_text(self.query_one(ProgramGrid)))
