"""What each panel looks like, at 80×24 (the smallest terminal it must work in) and 160×48.

The app runs over a recorded trace (tests/tui/recorded.py: a real engine run, with its clock
and kernel timings replaced by fixed values), so every pixel is reproducible. Regenerate
after an intended change with `pytest tests/tui --snapshot-update` and look at the diff.
"""
from __future__ import annotations

import pytest

from tracer.tui.app import TraceApp
from tracer.tui.sources.replay import ReplaySource

STEP = 5  # a preemption, shared prefix blocks, a waiting request with a reason
KERNEL_STEP = 2  # a Triton attention launch with two programs
SIZES = [(80, 24), (160, 48)]
PANES = ["overview", "requests", "kv", "step", "kernels", "log", "startup"]


def app_at(trace, pane: str) -> TraceApp:
    source = ReplaySource.load(trace)
    source.replay.goto(KERNEL_STEP if pane == "kernels" else STEP)
    return TraceApp(source, initial_pane=pane)


async def _choose_attention_program(pilot) -> None:
    app = pilot.app
    # layer 0's unified_attention: after the 4 launches that build the step's inputs and its cache write
    app.query_one("#kernels-table").move_cursor(row=5)
    await pilot.pause()
    await pilot.press("enter")  # into its program grid
    await pilot.press("down", "down", "down", "down")  # (← → travel in time in a replay) 4 heads: program 1


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pane", PANES)
def test_panel(snap_compare, recorded_trace, pane, size):
    run_before = _choose_attention_program if pane == "kernels" else None
    assert snap_compare(app_at(recorded_trace, pane), terminal_size=size, run_before=run_before)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_request_detail(snap_compare, recorded_trace, size):
    async def open_preempted(pilot):
        table = pilot.app.query_one("#requests-table")
        table.focus()
        table.move_cursor(row=table.keys.index("req-3"))
        # The list behind the modal is drawn once, when the modal opens: let it lay out first
        # (its horizontal scrollbar came and went with the timing of the first refresh).
        await pilot.pause()
        await pilot.pause()
        await pilot.press("enter")
    assert snap_compare(app_at(recorded_trace, "requests"), terminal_size=size, run_before=open_preempted)


def test_help(snap_compare, recorded_trace):
    assert snap_compare(app_at(recorded_trace, "requests"), terminal_size=(80, 24), press=["question_mark"])
