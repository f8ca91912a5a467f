"""`p` in the TUI against a real engine (in this process and in its own process): profiling starts
at a step boundary, the header says PROFILING, the profiled steps' every op is a launch in the
Kernels panel; `p` again stops it, and the next steps have the usual launches only."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.tui.helpers import shown
from tests.tui.test_live_keys import footer_shows, header, shown_state
from tracer.tui.widgets.roofline import RooflineChart

pytestmark = pytest.mark.asyncio


def profiled(state) -> list[dict]:
    return [k for k in state.kernels if k.get("profiled")]


async def run_step(live, pilot) -> None:
    await pilot.press("n")
    await live.held()
    await live.settle(pilot)


async def test_p_starts_and_stops_profiling(live):
    async with live.app.run_test(size=(160, 48)) as pilot:
        await live.submit(prompts=["Hello there"], params=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        await live.settle(pilot)
        assert footer_shows(live.app, "p", "profile")
        palette = [c.title for c in live.app.get_system_commands(live.app.screen)]
        assert "Profile every op (start / stop)" in palette
        assert "PROFILING" not in header(live.app)
        await pilot.press("p")
        assert live.app.panes.active == "kernels"
        for _ in range(3):  # profiling begins at a step boundary: within the next steps
            await run_step(live, pilot)
            if live.source.refresh().profiling and profiled(live.source.refresh()):
                break
        state = live.source.refresh()
        assert state.profiling, shown_state(live)
        await live.settle(pilot, until=lambda: "PROFILING" in header(live.app))
        assert "PROFILING" in header(live.app)
        ops = profiled(state)
        assert len({k["name"] for k in ops}) >= 10, [k["name"] for k in state.kernels]
        assert all(k["flops"] > 0 and k["bytes"] > 0 for k in ops if k.get("op") == "matmul")
        await live.settle(pilot, until=lambda: "ops profiled" in shown(live.app.query_one("#kernels-head")))
        assert "ops profiled" in shown(live.app.query_one("#kernels-head"))
        assert live.app.query_one(RooflineChart).display

        await pilot.press("p")
        for _ in range(3):
            await run_step(live, pilot)
            if not live.source.refresh().profiling:
                break
        assert not live.source.refresh().profiling, shown_state(live)
        await run_step(live, pilot)  # a whole step after the stop
        state = live.source.refresh()
        assert not profiled(state) and state.kernels, [k["name"] for k in state.kernels]
        assert "PROFILING" not in header(live.app)
        assert not live.app.query_one(RooflineChart).display
