"""Every key of the TUI, driven with Textual's Pilot against a real engine (no mocks):
the engine starts held, so each test decides when a step runs and checks what it did."""
from __future__ import annotations

import asyncio

import pytest

from tracer.replay import Replay
from tracer.tui.screens.breakpoints import BreakpointsScreen
from tracer.tui.screens.confirm import ConfirmQuit
from tracer.tui.screens.help import HelpScreen
from tracer.tui.screens.request import RequestScreen
from tracer.tui.widgets.header import StatusHeader
from tracer.tui.widgets.kernels import KernelsPanel
from tracer.tui.widgets.log import LogPanel
from tracer.tui.widgets.request_detail import RequestDetail

from tests.tui.helpers import shown

pytestmark = pytest.mark.asyncio


def cells(app, request_id: str) -> list[str]:
    """The Requests panel's row for a request, as drawn, cell by cell."""
    rows = app.query_one("#requests-table")
    return [text.strip() for text, _style in rows.texts[rows.keys.index(request_id)]]


def header(app) -> str:
    return shown(app.query_one(StatusHeader))


async def test_held_requests_wait_then_n_runs_exactly_one_step_and_fills_the_block_tables(live):
    async with live.app.run_test(size=(120, 36)) as pilot:
        await live.submit()
        await live.settle(pilot)
        for rid in ("r0", "r1", "r2"):
            assert cells(live.app, rid)[1] == "waiting"
            assert "not scheduled yet" in cells(live.app, rid)[5]
        assert "PAUSED" in header(live.app) and "W3 R0" in header(live.app)
        assert live.source.refresh().step is None  # nothing ran while held

        await pilot.press("n")
        stop = await live.held()
        await live.settle(pilot)
        state = live.source.refresh()
        assert stop.point == "step" and stop.step == 1  # held before step 1: exactly step 0 ran
        assert state.step == 0 and [e.step for e in live.session.bus.read(0)[0]
                                    if e.name == "step" and e.kind == "begin"] == [0]
        engine = live.engine.engine
        for rid, prompt in zip(("r0", "r1", "r2"), ("Hello there", "The quick brown fox jumps", "x")):
            n = len(prompt)  # the built-in model's tokenizer is one token per character
            assert state.requests[rid].block_table == engine.requests[rid].block_ids
            assert len(state.requests[rid].block_table) == -(-n // 4)
            assert cells(live.app, rid)[1:4] == ["running", f"{n}/{n}", "1/4"]
        assert "step 0" in header(live.app) and "R3" in header(live.app)


async def test_space_resumes_then_pauses_at_the_next_step(live):
    async with live.app.run_test() as pilot:
        streams = await live.submit(params=live_params(max_tokens=3))
        await pilot.press("space")  # resume: everything runs to completion
        for s in streams:
            assert [o async for o in s][-1].finished
        await live.settle(pilot)
        assert "RUNNING" in header(live.app)
        assert [cells(live.app, r)[1] for r in ("r0", "r1", "r2")] == ["finished"] * 3

        await pilot.press("space")  # pause: idle, so it holds once work arrives
        await live.settle(pilot)
        assert live.controller.status()["pause_requested"] and "PAUSED" in header(live.app)
        await live.submit(prefix="late")
        stop = await live.held()
        assert stop.point == "step" and stop.reason == "pause"


async def test_s_steps_into_the_phases_of_a_step(live):
    async with live.app.run_test() as pilot:
        await live.submit()
        points = []
        for _ in range(3):
            await pilot.press("s")
            points.append((await live.held()).point)
        await live.settle(pilot)
        assert points == ["execute", "postprocess", "step"]  # schedule | execute | postprocess | next step


async def test_k_stops_before_each_kernel_launch_and_the_kernels_panel_says_which(live):
    async with live.app.run_test(size=(120, 36)) as pilot:
        await live.submit()
        await pilot.press("5")
        points = []
        for _ in range(3):
            await pilot.press("k")
            points.append(await live.held())
        second = points[-1]
        await live.settle(pilot)
        # a finer step also stops at the coarser points: between schedule and execute first
        assert [p.point for p in points] == ["execute", "kernel", "kernel"]
        assert len(live.source.refresh().kernels) == 1  # the first launch ran, the second is held before
        panel = live.app.query_one(KernelsPanel)
        head = shown(panel.query_one("#kernels-head"))
        assert "held before the next launch" in head and second.info["name"] in head
        assert panel.query_one("#kernels-table").row_count == 1


async def test_b_adds_a_breakpoint_that_holds_the_engine_and_removes_it(live):
    async with live.app.run_test(size=(100, 30)) as pilot:
        streams = await live.submit(params=live_params(max_tokens=2))
        await pilot.press("b")
        assert isinstance(live.app.screen, BreakpointsScreen)
        await pilot.press(*"finish", "enter")
        assert [str(b) for b in live.controller.breakpoints] == ["finish"]
        await pilot.press("escape")
        await pilot.press("space")
        stop = await live.held()
        assert "breakpoint finish" in stop.reason
        assert live.source.refresh().finished  # it held right after a finish

        await pilot.press("b")
        await pilot.press("tab")  # to the list
        await pilot.press("d")
        assert live.controller.breakpoints == ()
        await pilot.press("escape", "space")
        for s in streams:
            assert [o async for o in s][-1].finished


async def test_bad_breakpoint_is_explained_and_nothing_is_added(live):
    async with live.app.run_test() as pilot:
        await pilot.press("b", *"finsh", "enter")
        assert "bad condition" in shown(live.app.screen.query_one("#bp-error"))
        assert live.controller.breakpoints == ()


async def test_enter_opens_the_request_with_its_tokens_timeline_and_blocks(live):
    async with live.app.run_test(size=(100, 40)) as pilot:
        await live.submit()
        await pilot.press("n")
        await live.held()
        await live.settle(pilot)
        live.app.query_one("#requests-table").focus()
        await pilot.press("enter")  # the cursor is on the first row: r0, running
        assert isinstance(live.app.screen, RequestScreen)
        await live.settle(pilot)
        text = live.app.screen.query_one(RequestDetail).text
        assert "request r0" in text and "H72" in text  # 'H' is token 72
        assert "QUEUED" in text and "SCHEDULED" in text and "tokens 0..10 (11)" in text
        assert "0→1  1→2  2→3" in text and "last block: 3/4 slots used" in text
        await pilot.press("escape")
        assert not isinstance(live.app.screen, RequestScreen)


async def test_slash_filters_the_log_by_layer_and_request(live):
    async with live.app.run_test(size=(120, 36)) as pilot:
        await live.submit()
        await pilot.press("n")
        await live.held()
        await pilot.press("6")
        await live.settle(pilot)
        await pilot.press("slash", *"scheduler request=r1", "enter")
        lines = live.app.query_one("#log-lines").plain_lines
        assert lines and all(line.startswith("[TRACE] scheduler ") and "request=r1" in line for line in lines)
        assert any("SCHEDULED" in line for line in lines)
        panel = live.app.query_one(LogPanel)
        panel.key_escape()  # esc clears the filter: every layer again
        layers = {line.split()[1] for line in live.app.query_one("#log-lines").plain_lines}
        assert {"engine", "scheduler", "block_manager", "kernel"} <= layers


async def test_question_mark_explains_every_panel_and_key(live):
    async with live.app.run_test() as pilot:
        await pilot.press("question_mark")
        assert isinstance(live.app.screen, HelpScreen)
        text = live.app.screen.query_one("Markdown").source
        for word in ("Requests", "KV cache", "Step", "Kernels", "Log", "Startup", "`space`", "`n`", "`s`", "`k`",
                     "`b`", "`enter`", "`/`", "`ctrl+p`", "`q`", "`←` / `→`"):
            assert word in text
        await pilot.press("escape")
        assert not isinstance(live.app.screen, HelpScreen)


async def test_q_asks_first_while_requests_are_in_flight(live):
    async with live.app.run_test() as pilot:
        await live.submit()
        await pilot.press("q")
        assert isinstance(live.app.screen, ConfirmQuit)
        await pilot.press("n")
        assert not isinstance(live.app.screen, ConfirmQuit) and live.app.is_running
        await pilot.press("q", "y")
        await pilot.pause()
        assert not live.app.is_running


async def test_q_quits_at_once_when_nothing_is_in_flight(live):
    async with live.app.run_test() as pilot:
        await pilot.press("q")
        await pilot.pause()
        assert not live.app.is_running


async def test_palette_sends_a_test_request_and_exports_a_replayable_trace(live, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    async with live.app.run_test(size=(100, 30)) as pilot:
        await pilot.press("ctrl+p", *"send a test", "enter")
        for _ in range(100):  # the request is queued by a task of the app's loop
            await live.settle(pilot)
            if "tui-1" in live.source.refresh().waiting:
                break
            await asyncio.sleep(0.02)
        assert "tui-1" in live.source.refresh().waiting
        await pilot.press("n")
        await live.held()
        await pilot.press("ctrl+p", *"export trace", "enter")
        for _ in range(200):
            files = list(tmp_path.glob("vllm-trace-*.jsonl"))
            if files and Replay.load(files[0]).steps:
                break
            await asyncio.sleep(0.02)
        replay = Replay.load(files[0])
        assert replay.steps == [0] and "tui-1" in replay.final().running


async def test_number_keys_and_tabs_switch_panels(live):
    async with live.app.run_test() as pilot:
        tabs = live.app.query_one("#panes")
        for key, pane in zip("123456", ("startup", "requests", "kv", "step", "kernels", "log")):
            await pilot.press(key)
            assert tabs.active == pane


def live_params(max_tokens: int):
    from engine import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
