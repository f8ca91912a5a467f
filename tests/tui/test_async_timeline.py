"""Async scheduling in the TUI: the header names the steps in flight, the Step panel's timeline draws
the core's thread beside the forward pass (step N+1's schedule over step N's execute) and each
request's tokens in flight as placeholders, until they resolve."""
from __future__ import annotations

import pytest

from engine.trace_names import KERNEL
from tests.tui.helpers import shown
from tracer.tui.widgets.header import StatusHeader
from tracer.tui.widgets.timeline import timeline_rows


def timeline_text(live) -> str:
    return shown(live.app.query_one("#timeline-lines"))


@pytest.mark.asyncio
async def test_two_batches_in_flight_their_placeholders_and_the_overlap(live):
    async with live.app.run_test(size=(140, 40)) as pilot:
        streams = await live.submit()
        await pilot.press("4")
        for _ in range(5):  # from before step 0: into it, its forward, bitmask, sampling; then step 1's schedule
            await pilot.press("s")
            stop = await live.held()
        assert (stop.point, stop.step) == ("execute", 1)
        flight = "in flight: step 0 (sampled), step 1 (scheduled)"
        await live.settle(pilot, until=lambda: flight in timeline_text(live))
        assert flight in shown(live.app.query_one(StatusHeader)) and flight in timeline_text(live)
        # steps 0 and 1 each sample a token for every request: two placeholders each, no token out yet
        for rid in ("r0", "r1", "r2"):
            assert f"{rid}  0 tokens out, then ? ? (2 in flight: placeholders)" in timeline_text(live)

        await pilot.press("space")  # runs freely: two batches really in flight
        for s in streams:
            assert [o async for o in s][-1].finished
        await live.settle(pilot, until=lambda: "then ?" not in timeline_text(live))
        assert "then ?" not in timeline_text(live)  # every placeholder resolved into a token
        state = live.source.refresh()
        spans = {(name, step): (begin, end) for _, name, step, begin, end in state.timeline}
        over = [n for (name, n) in spans if name == "execute_model" and ("schedule", n + 1) in spans
                and spans["schedule", n + 1][0] < spans[name, n][1]]
        assert over, state.timeline  # step N+1 scheduled while step N's forward pass ran
        core, forward = (line.plain for line in timeline_rows(state, 120))
        assert core.startswith("core thread") and forward.startswith("forward pass")
        assert "S" in core and "█" in forward


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_overview_shows_the_last_step_that_ran_a_batch(live):
    """Async scheduling: the last step is scheduled while the step before it samples its requests' last
    tokens, so it schedules no request, and launches nothing; the Overview shows the step before it, the
    last that ran a batch, with that step's launches."""
    async with live.app.run_test(size=(140, 40)) as pilot:
        streams = await live.submit()
        await pilot.press("space")
        for s in streams:
            assert [o async for o in s][-1].finished

        def trailing_step_done() -> bool:
            state = live.source.refresh()
            return (state.phase == "done" and not state.in_flight and state.snapshot_step == state.step
                    and not state.snapshot.get("scheduled") and state.last_batch is not None)

        await live.settle(pilot, until=trailing_step_done)
        state = live.source.refresh()
        empty, last = state.step, state.last_batch["step"]
        assert last == empty - 1
        await pilot.press("1")
        body = live.app.query_one("#overview-body")
        await live.settle(pilot, until=lambda: f"kernels of step {last}" in shown(body))
        text = shown(body)
        assert f"step {last} (done) batch: 3 requests" in text and f"step {empty} scheduled no request" in text
        assert "batch: 0 requests" not in text and "kernels of the last step" not in text
    events, _, _ = live.session.bus.read(0)
    launches = [e.step for e in events if e.layer == KERNEL and e.step is not None]
    assert last in launches and empty not in launches
