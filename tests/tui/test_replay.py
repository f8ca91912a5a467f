"""Replay mode: ←/→ and home/end move through a recorded trace; every panel shows the
state Replay computes for that step (the same fold as live)."""
from __future__ import annotations

import pytest

from tests.tui.helpers import shown
from tracer.replay import Replay
from tracer.tui.app import TraceApp
from tracer.tui.sources.replay import ReplaySource
from tracer.tui.widgets.kernels import KernelsPanel, ProgramGrid

pytestmark = pytest.mark.asyncio


async def test_arrows_and_home_end_travel_through_the_steps(recorded_trace):
    source = ReplaySource.load(recorded_trace)
    reference = Replay.load(recorded_trace)
    app = TraceApp(source)
    async with app.run_test() as pilot:
        seen = [source.refresh().step]
        for _ in range(3):
            await pilot.press("right")
            seen.append(source.refresh().step)
        await pilot.press("left")
        seen.append(source.refresh().step)
        assert seen == [0, 1, 2, 3, 2]
        assert source.refresh().to_dict() == reference.goto(2).to_dict()
        await pilot.press("end")
        assert source.refresh().to_dict() == reference.final().to_dict()
        await pilot.press("home")
        assert source.refresh().step == 0
        await pilot.press("left")  # before the first step: the start of the trace
        assert source.refresh().step is None
        await pilot.press("end", "left")  # the first ← after end moves to the step before the last
        assert source.refresh().step == reference.steps[-2]


async def test_control_keys_are_refused_in_a_replay(recorded_trace):
    app = TraceApp(ReplaySource.load(recorded_trace))
    async with app.run_test() as pilot:
        await pilot.press("n", "space", "b")
        assert app.source.refresh().step == 0 and len(app.screen_stack) == 1
        assert not app.check_action("step", ("step",)) and app.check_action("travel", ("back",))


async def test_going_back_rewinds_the_log(recorded_trace):
    source = ReplaySource.load(recorded_trace)
    app = TraceApp(source, initial_pane="log")
    async with app.run_test(size=(120, 30)) as pilot:
        await pilot.press("right", "right")
        app.tick()
        lines = app.query_one("#log-lines").plain_lines  # the step's end, then its detokenized tokens
        assert "step=2" in lines[-1] and any("step (end) step=2" in line for line in lines[-6:])
        await pilot.press("left")
        app.tick()
        lines = app.query_one("#log-lines").plain_lines
        assert "step=1" in lines[-1] and any("step (end) step=1" in line for line in lines[-6:])
        assert not any("step=2" in line for line in lines)


async def test_a_replayed_attention_launch_shows_which_blocks_each_program_reads(recorded_trace):
    """No LaunchRecord in a file: the access map is recomputed from the step's batch with the
    kernels' own mapping, and must name the blocks of each request's block table."""
    source = ReplaySource.load(recorded_trace)
    source.replay.goto(2)
    app = TraceApp(source, initial_pane="kernels")
    async with app.run_test(size=(120, 40)) as pilot:
        app.tick()
        table = app.query_one("#kernels-table")
        attention = next(i for i, k in enumerate(source.refresh().kernels) if k["name"] == "unified_attention")
        table.move_cursor(row=attention)
        await pilot.pause()
        grid = app.query_one(ProgramGrid)
        assert grid.grid == (2, 1, 1)
        state = source.refresh()
        read = {}
        for pid, work in grid.access.items():
            for a in work:
                rid = state.batch["request_ids"][a.request]
                read.setdefault(rid, set()).update(a.blocks)
        for rid, blocks in read.items():
            assert blocks == set(state.requests[rid].block_table), rid
        grid.focus()
        heads = grid.num_heads
        assert heads == state.engine_config["model"].get("num_kv_heads", heads) and heads == 4
        seen = []
        for _ in range(heads):  # down walks every KV head of a program, then on to the next program
            seen.append(grid.cursor[:2])
            await pilot.press("down")
        assert seen == [(0, h) for h in range(heads)] and grid.cursor == (1, 0, 0)
        await pilot.pause()
        text = shown(app.query_one(KernelsPanel).query_one("#program-access"))
        assert "program (1, 0, 0)  KV head 0" in text
        for work in grid.access[(1, 0, 0)]:  # interpreted: one program may take several query blocks
            assert f"physical blocks {' '.join(map(str, work.blocks))}" in text
        # the picture and the table say the same grid
        grid_text = shown(grid)
        assert "program grid 2×1×1" in grid_text
        assert any("2×1×1" in line and "unified_attention" in line
                   for line in shown(app.query_one("#kernels-table")).splitlines())


async def test_a_replay_offers_only_what_it_can_do(recorded_trace):
    """No engine runs behind a replay: neither the Overview, the footer nor the help offers n or space."""
    from textual.widgets import Markdown

    from tracer.tui.screens.help import HelpScreen

    app = TraceApp(ReplaySource.load(recorded_trace), initial_pane="overview")
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("right")
        app.tick()
        overview = app.query_one("#overview-body").text
        assert "space" not in overview and "← / →" in overview
        footer = {b.binding.key for b in app.screen.active_bindings.values() if b.enabled and b.binding.show}
        assert {"left", "right", "question_mark"} <= footer and not footer & {"space", "n", "s", "k", "b", "t", "p"}
        palette = [c.title for c in app.get_system_commands(app.screen)]
        assert "Send a test request" not in palette and "Step over" not in palette
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = app.screen.query_one(Markdown).source
        assert "| `space` |" not in text and "| `n` |" not in text and "send a test request" not in text
        assert "| `←` / `→`, `home` / `end` |" in text and "no engine runs" in text


class _Running(ReplaySource):
    """A recorded trace played as a running engine under load: each refresh is the next step."""

    def __init__(self, replay, path):
        super().__init__(replay, path)
        self.info.mode = "live"

    def controller(self) -> dict:
        return {"paused": False, "breakpoints": []}

    def refresh(self):
        r = self.replay
        r.next() if r.step is not None and r.step < r.steps[-2] else r.goto(r.steps[0])
        return r.state


async def test_under_load_the_header_and_the_body_show_the_same_step(recorded_trace):
    import re

    app = TraceApp(_Running(Replay.load(recorded_trace), recorded_trace), initial_pane="overview", follow=False)
    async with app.run_test(size=(160, 48)) as pilot:
        seen = set()
        for _ in range(12):  # quicker than the panels redraw under load
            app.tick()
            await pilot.pause()
            header = re.search(r" step (\d+)", app.query_one("#header").text.plain).group(1)
            body = re.search(r"^step (\d+)", app.query_one("#overview-body").text, re.M).group(1)
            assert header == body
            seen.add(header)
        assert app.ticks >= 12
