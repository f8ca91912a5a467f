"""KernelsPanel: the launch list (or a profiled step's ops) over the chosen launch's programs (or
the roofline chart); see the package docstring for its four modes, one module each."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.text import Text

from tracer.state import TraceState, rank_of, step_ranks
from tracer.tui.frame import Frame
from tracer.tui.sources.base import engine_identity
from tracer.tui.widgets.kernels.launches import held_launch, launch_head, launch_table, multi_rank
from tracer.tui.widgets.kernels.profiled import profiled_head, profiled_table
from tracer.tui.widgets.kernels.programs import ProgramGrid, ProgramsView
from tracer.tui.widgets.lines import FixedText
from tracer.tui.widgets.panel import Panel
from tracer.tui.widgets.roofline import RooflineChart
from tracer.tui.widgets.rows import RowList

if TYPE_CHECKING:
    from kernels.roofline import Roofline

BUSY_HZ = 4


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


class KernelsPanel(Panel):
    def compose(self):
        yield FixedText(id="kernels-head")
        yield RowList(id="kernels-table")
        yield ProgramsView(id="kernels-programs")
        yield RooflineChart(id="kernels-roofline")

    def on_mount(self) -> None:
        self._key = None
        self._drawn_at = 0.0
        self._frame: Frame | None = None
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
        launches = self.launches(s)
        if any(k.get("profiled") for k in launches) and not self._showing_rerun(frame):
            return self._show_profiled(frame, launches)
        self._set_profiled(False)
        self._set_head(launch_head(frame, launches, self.rank))  # a line per rank under the CSS's one
        self.query_one(RowList).set_rows(*launch_table(s, launches, self.size.width or 80))
        self._show_programs()

    def _showing_rerun(self, frame: Frame) -> bool:
        """`t` re-ran the launch the engine is held before: its grid is shown, profiled or not."""
        held = held_launch(frame)
        return self.rerun is not None and held is not None and self.rerun_of == (
            held.get("step"), held.get("layer_idx"), held.get("name"))

    def _set_profiled(self, on: bool) -> None:
        if on != self._profiled:
            self._profiled = on
            self.query_one(ProgramsView).display = not on
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

    def _show_profiled(self, frame: Frame, launches: list[dict]) -> None:
        """A profiled step: every op, longest first, on this machine's roofline."""
        from tracer.roofline import by_kind, profiled_ops

        s, ranks = frame.state, multi_rank(frame.state)
        self._set_profiled(True)
        ops = profiled_ops(launches)
        roof = self._roofline(s, launches)
        self._set_head(profiled_head(frame, ops, roof, self._calibrating, self.rank, ranks), wrapped=True)
        self.query_one(RowList).set_rows(*profiled_table(ops, roof, ranks, self.size.width or 80))
        title = f"step {s.step} on the roofline: one point per op kind, its FLOPs, bytes and time summed"
        self.query_one(RooflineChart).set_points(by_kind(ops), roof, title)

    def _roofline(self, s: TraceState, launches: list[dict]) -> Roofline | None:
        """This machine's roofline for the step's device and dtype: from the cache, else
        calibrated once on a thread (about a second) while the panel draws without roofs."""
        from tracer.roofline import cached_roofline, trace_dtype

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
        from tracer.roofline import machine_roofline

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
        frame, view = self._frame, self.query_one(ProgramsView)
        if frame is None or self._profiled:
            return
        if self._showing_rerun(frame):
            return view.show_rerun(frame, held_launch(frame), self.rerun)
        launches = self.launches(frame.state)
        view.show_launch(frame, launches[min(self.query_one(RowList).cursor, len(launches) - 1)] if launches else None)
