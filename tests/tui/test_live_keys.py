"""Every key of the TUI, driven with Textual's Pilot against a real engine (no mocks):
the engine starts held, so each test decides when a step runs and checks what it did.

A test that steps the engine, sends it requests or sets a breakpoint takes `live`, an engine of its own:
it counts steps from step 0, names its requests r0, r1, ... and reads the trace from the engine's start,
none of which a shared engine could give it. A test that only presses keys takes `idle_live`, a new TUI
on one engine per module and mode (tests/tui/conftest.py checks that it is still held and empty)."""
from __future__ import annotations

import asyncio

import pytest

from engine.worker.input_batch import INPUT_KERNELS
from tests.tui.helpers import shown
from tracer.replay import Replay
from tracer.tui.screens.breakpoints import BreakpointsScreen
from tracer.tui.screens.confirm import ConfirmQuit
from tracer.tui.screens.help import HelpScreen
from tracer.tui.screens.request import RequestScreen
from tracer.tui.widgets.header import StatusHeader
from tracer.tui.widgets.kernels import KernelsPanel
from tracer.tui.widgets.log import LogPanel
from tracer.tui.widgets.request_detail import RequestDetail
from tracer.tui.widgets.requests import RequestsPanel

pytestmark = pytest.mark.asyncio


def cells(app, request_id: str) -> list[str]:
    """The Requests panel's row for a request, as drawn, cell by cell."""
    rows = app.query_one("#requests-table")
    return [text.strip() for text, _style in rows.texts[rows.keys.index(request_id)]]


def shows_finished(app, request_id: str) -> bool:
    """The Requests panel has the request's row and it says finished."""
    try:
        return cells(app, request_id)[1] == "finished"
    except ValueError:  # no row for it yet
        return False


def footer_shows(app, key: str, description: str) -> bool:
    """The footer draws this key, whole, inside the screen."""
    from textual.widgets._footer import FooterKey
    return any(k.key == key and k.description == description and k.region.width
               and k.region.right <= app.size.width for k in app.query(FooterKey))


def shown_state(live) -> str:
    """What the app and its source held when a check failed (for the CI log)."""
    app, state = live.app, live.source.refresh()
    panel = app.active_panel()
    return (f"pane {app.panes.active!r} ({type(panel).__name__}, mounted {panel.is_mounted}, size {panel.size}), "
            f"focused {app.focused!r}, ticks {app.ticks}, waiting {state.waiting}, running {state.running}, "
            f"paused_at {state.paused_at}, controller {live.source.controller()}")


def header(app) -> str:
    return shown(app.query_one(StatusHeader))


async def test_held_requests_wait_then_n_runs_exactly_one_step_and_fills_the_block_tables(live):
    async with live.app.run_test(size=(120, 36)) as pilot:
        await live.submit()
        await pilot.press("2")
        table = live.app.query_one("#requests-table")
        await live.settle(pilot, until=lambda: {"r0", "r1", "r2"} <= set(table.keys))
        assert {"r0", "r1", "r2"} <= set(table.keys), shown_state(live)
        for rid in ("r0", "r1", "r2"):
            assert cells(live.app, rid)[1] == "waiting"
            assert "not scheduled yet" in cells(live.app, rid)[5]
        assert "PAUSED" in header(live.app) and "waiting 3 · running 0 · finished 0" in header(live.app)
        assert live.source.refresh().step is None  # nothing ran while held

        await pilot.press("n")
        stop = await live.held()
        await live.settle(pilot)
        state = live.source.refresh()
        assert stop.point == "step" and stop.step == 1  # held before step 1: exactly step 0 ran
        assert state.step == 0 and [e.step for e in live.session.bus.read(0)[0]
                                    if e.name == "step" and e.kind == "begin"] == [0]
        tables = live.block_tables()
        for rid, prompt in zip(("r0", "r1", "r2"), ("Hello there", "The quick brown fox jumps", "x")):
            n = len(prompt)  # the built-in model's tokenizer is one token per character
            assert state.requests[rid].block_table == tables[rid]
            assert len(state.requests[rid].block_table) == -(-n // 4)
            # async scheduling: n is one step_with_batch_queue call; step 0's tokens come with the next one
            assert cells(live.app, rid)[1:4] == ["running", f"{n}/{n}", "0/4"]
        assert "step 0" in header(live.app) and "running 3" in header(live.app)
        assert "(n ran one call: scheduled step 0)" in header(live.app)
        await pilot.press("n")
        stop = await live.held()
        await live.settle(pilot, until=lambda: cells(live.app, "r0")[3] == "1/4")
        assert stop.step == 2 and all(cells(live.app, rid)[3] == "1/4" for rid in ("r0", "r1", "r2"))
        assert "(n ran one call: both: scheduled step 1, executed step 0)" in header(live.app)


async def test_space_resumes_then_pauses_at_the_next_step(live):
    async with live.app.run_test() as pilot:
        streams = await live.submit(params=live_params(max_tokens=3))
        await pilot.press("2", "space")  # resume: everything runs to completion
        for s in streams:
            assert [o async for o in s][-1].finished
        # The outputs and the trace come over separate channels (with "mp", separate sockets): the
        # streams can end before the trace's last events reach the panel.
        await live.settle(pilot, until=lambda: all(shows_finished(live.app, r) for r in ("r0", "r1", "r2")))
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
        for _ in range(5):
            await pilot.press("s")
            points.append((await live.held()).point)
            if points[-1] == "sample_tokens":  # the header says where it holds
                await live.settle(pilot, until=lambda: "before sample_tokens" in header(live.app))
                assert "after the grammar bitmask of step 0, before sample_tokens" in header(live.app)
        await live.settle(pilot)
        # schedule | execute_model | grammar bitmask | sample_tokens, then (async scheduling: two steps in
        # flight) the next call, which schedules step 1 before step 0's update_from_output
        assert points == ["execute", "grammar_bitmask", "sample_tokens", "step", "execute"]


async def test_k_stops_before_each_kernel_launch_and_the_kernels_panel_says_which(live):
    async with live.app.run_test(size=(120, 36)) as pilot:
        await live.submit()
        await pilot.press("5")
        points = []
        inputs = len(INPUT_KERNELS) - 1  # the launches that build the step's inputs (post_update comes after sampling)
        for _ in range(inputs + 2):
            await pilot.press("k")
            points.append(await live.held())
        second = points[-1]
        panel = live.app.query_one(KernelsPanel)
        await live.settle(pilot, until=lambda: "held before" in shown(panel.query_one("#kernels-head")))
        assert [p.point for p in points] == ["kernel"] * (inputs + 2)  # from before step 0: its first launch
        assert [p.info["name"] for p in points[:inputs]] == [f"{k}_ref" for k in INPUT_KERNELS[:inputs]]
        assert len(live.source.refresh().kernels) == inputs + 1  # the inputs' and the cache write ran
        head = shown(panel.query_one("#kernels-head"))
        assert f"held before {second.info['name']} (layer 0)" in head, shown_state(live)
        assert panel.query_one("#kernels-table").row_count == inputs + 1
        row = shown(panel.query_one("#kernels-table")).splitlines()[inputs + 1]
        assert "reshape_and_cache_ref" in row and "key 37×4×32" in row  # full name; 11 + 25 + 1 tokens: the shapes
        held = "held before the kernel launch cpu_attention_with_kv_cache (layer 0) of step 0: k runs it"
        assert held in header(live.app)  # (on a CPU: the C kernel, for the 1-token prompt, first)


@pytest.mark.slow
async def test_k_after_the_forward_pass_runs_to_the_next_steps_first_launch(live):
    """It used to stop at the step and phase boundaries on the way, while the header said
    "one launch done (k)"."""
    async with live.app.run_test(size=(160, 36)) as pilot:
        await live.submit()
        for _ in range(4):
            await pilot.press("s")
            stop = await live.held()
        assert (stop.point, stop.step) == ("step", 1)  # step 0's forward pass and sampling done (async: in flight)
        await pilot.press("k")
        stop = await live.held()
        assert (stop.point, stop.step, stop.info["name"]) == ("kernel", 1, "prepare_prefill_inputs_ref")
        await live.settle(pilot, until=lambda: "of step 1" in header(live.app))
        assert ("held before the kernel launch prepare_prefill_inputs_ref of step 1: k runs it "
                "(you stepped to the next kernel launch (k))") in header(live.app), header(live.app)


@pytest.mark.slow
async def test_t_runs_the_held_attention_launch_through_the_triton_kernel(live):
    async with live.app.run_test(size=(160, 48)) as pilot:
        await live.submit()
        await pilot.press("t")  # not held at an attention launch: says how to get there
        await live.settle(pilot)
        assert live.app.query_one(KernelsPanel).rerun is None
        for _ in range(len(INPUT_KERNELS) + 1):  # step 0's input launches, its cache write, then its attention
            await pilot.press("k")
            stop = await live.held()
        assert stop.info["name"] == "cpu_attention_with_kv_cache"  # (on a CPU: the C kernel; its 1-token prompt)
        await live.settle(pilot)
        assert footer_shows(live.app, "t", "on Triton")
        await pilot.press("t")
        panel = live.app.query_one(KernelsPanel)
        for _ in range(600):  # interpreted on the CPU: a few seconds on a busy machine
            if panel.rerun is not None:
                break
            await asyncio.sleep(0.05)
        r = panel.rerun
        assert r is not None and r["name"] == "unified_attention" and r["max_abs_diff"] < 1e-4
        await live.settle(pilot)
        await pilot.pause()  # the Static's new height takes a layout pass
        text = shown(panel.query_one("#kernels-rerun"))
        assert "max |Triton − PyTorch| =" in text and f"grid {'×'.join(map(str, r['grid']))}" in text
        grid = panel.query_one("#program-grid")
        assert grid.grid == tuple(r["grid"]) and grid.num_heads == 4  # every KV head has a row
        state = live.source.refresh()
        read = {}
        for work in grid.access.values():
            for a in work:
                read.setdefault(state.batch["request_ids"][a.request], set()).update(a.blocks)
        assert read == {rid: set(state.requests[rid].block_table) for rid in ("r0", "r1", "r2")}
        assert "physical blocks" in shown(panel.query_one("#program-access"))
        assert live.controller.status()["paused"]  # t ran the kernel, not the engine


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


@pytest.mark.slow
async def test_bad_breakpoint_is_explained_and_nothing_is_added(idle_live):
    async with idle_live.app.run_test() as pilot:
        await pilot.press("b", *"finsh", "enter")
        assert "bad condition" in shown(idle_live.app.screen.query_one("#bp-error"))
        assert idle_live.controller.breakpoints == ()


async def test_enter_opens_the_request_with_its_tokens_timeline_and_blocks(live):
    async with live.app.run_test(size=(100, 40)) as pilot:
        await live.submit()
        await pilot.press("n")
        await live.held()
        await pilot.press("2")  # opening a panel focuses its list: enter works at once
        await live.settle(pilot)
        table = live.app.query_one("#requests-table")
        assert table.keys == ["r2", "r1", "r0"] and table.cursor_key == "r2"  # newest first, followed
        # a refresh that runs between the key and anything it posts must not take the cursor back (it did in CI)
        table.action_move(1)
        live.app.query_one(RequestsPanel).show(live.app.frame, force=True)
        assert table.cursor_key == "r1"
        await pilot.press("down")
        await live.settle(pilot)
        assert table.cursor_key == "r0"  # moved by the user: it stays there
        await pilot.press("enter")
        assert isinstance(live.app.screen, RequestScreen)
        await live.settle(pilot)
        text = live.app.screen.query_one(RequestDetail).text
        assert "request r0" in text and "H·72" in text  # 'H' is token 72
        assert "QUEUED" in text and "SCHEDULED" in text and "tokens 0..10 (11)" in text
        assert "0→1  1→2  2→3" in text and "last block: 3/4 slots used" in text
        await pilot.press("escape")
        assert not isinstance(live.app.screen, RequestScreen)


@pytest.mark.slow
async def test_the_requests_cursor_follows_the_newest_request_even_one_that_came_and_went(live):
    """A request that starts and finishes while another panel is shown (or between two refreshes) was
    never active on screen: the cursor stayed on the older one, and enter opened that."""
    async with live.app.run_test(size=(120, 36)) as pilot:
        streams = await live.submit(prompts=["first"], params=live_params(max_tokens=2), prefix="old")
        await pilot.press("space")  # run freely
        assert [o async for o in streams[0]][-1].finished
        await pilot.press("2")
        table = live.app.query_one("#requests-table")
        await live.settle(pilot, until=lambda: table.keys == ["old0"])
        assert table.cursor_key == "old0"
        await pilot.press("6")  # the Log panel: the Requests panel is not drawn meanwhile
        streams = await live.submit(prompts=["second"], params=live_params(max_tokens=2), prefix="new")
        assert [o async for o in streams[0]][-1].finished
        await pilot.press("2")
        await live.settle(pilot, until=lambda: table.keys == ["new0", "old0"])
        assert table.cursor_key == "new0", table.keys
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(live.app.screen, RequestScreen) and live.app.screen.request_id == "new0"


@pytest.mark.slow
async def test_held_at_a_finish_breakpoint_the_counts_agree_with_the_finish(live):
    """With the engine core in its own process, the request has finished there while its last token
    (from the API server) is still to come: the row said 3/4 beside "length"."""
    from tracer.conditions import parse_condition

    async with live.app.run_test(size=(120, 36)) as pilot:
        await live.submit(prompts=["Hello there"])
        live.controller.add_breakpoint(parse_condition("finish"))
        await pilot.press("2", "space")
        stop = await live.held()
        assert stop.reason == "breakpoint finish"
        await live.settle(pilot, until=lambda: shows_finished(live.app, "r0"))
        row = cells(live.app, "r0")
        assert row[1] == "finished" and row[3] == "4/4" and "length" in row[5], row


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


async def test_question_mark_explains_every_panel_and_key(idle_live):
    async with idle_live.app.run_test() as pilot:
        await pilot.press("question_mark")
        assert isinstance(idle_live.app.screen, HelpScreen)
        text = idle_live.app.screen.query_one("Markdown").source
        for word in ("Overview", "Requests", "KV cache", "Step", "Kernels", "Log", "Startup", "`space`", "`n`", "`s`",
                     "`k`", "`t`", "`tab`",
                     "`b`", "`enter`", "`/`", "`ctrl+p`", "`q`"):
            assert word in text
        assert "| `←` / `→`, `home` / `end` |" not in text  # time travel is the replay's (its help lists it)
        await pilot.press("escape")
        assert not isinstance(idle_live.app.screen, HelpScreen)


@pytest.mark.slow
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


async def test_q_quits_at_once_when_nothing_is_in_flight(idle_live):
    async with idle_live.app.run_test() as pilot:
        await pilot.press("q")
        await pilot.pause()
        assert not idle_live.app.is_running


@pytest.mark.slow
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
        queued = next(e for e in live.session.bus.read(0)[0] if e.name == "QUEUED" and e.request_id == "tui-1")
        assert queued.attrs["params"]["temperature"] == 0 and queued.attrs["max_tokens"] == 16  # greedy, as it says
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


@pytest.mark.slow
async def test_number_keys_and_tab_switch_panels_whatever_has_focus(idle_live):
    panes = ("overview", "requests", "kv", "step", "kernels", "log", "startup")
    async with idle_live.app.run_test() as pilot:
        tabs = idle_live.app.query_one("#panes")
        await pilot.pause()  # (TabbedContent applies its initial tab after the app's first frame)
        for key, pane in zip("1234567", panes):
            await pilot.press(key)
            assert tabs.active == pane
            await pilot.pause()
            focused = idle_live.app.focused
            assert focused is None or pane in [a.id for a in focused.ancestors if a.id]  # its list has the keys
        await pilot.press("2", "tab")  # tab cycles the panels (README and help say so)...
        assert tabs.active == "kv"
        await pilot.press("shift+tab", "4")  # ...and the number keys still work after it
        assert tabs.active == "step"
        await pilot.press("2")
        await pilot.pause()
        assert idle_live.app.focused.id == "requests-table"  # opening a panel focuses its list
        await pilot.press("slash", "3", "1")  # typing in a filter: digits are text, not panels
        assert tabs.active == "requests" and idle_live.app.query_one("#requests-filter").value == "31"
        await pilot.press("escape", "5")
        assert tabs.active == "kernels"


async def test_a_panel_chosen_as_the_app_opens_the_overview_stays_chosen(idle_live):
    """The app opens the Overview for new work and focuses its list; that focus lands a few messages
    later, and must not take back the panel a key chose meanwhile (`4` pressed just as requests arrive)."""
    async with idle_live.app.run_test(size=(120, 36)) as pilot:
        await pilot.pause()
        idle_live.app.show_pane("overview")  # what a refresh does when work arrives and no panel was chosen
        await pilot.press("4")
        for _ in range(5):
            await pilot.pause()
        assert idle_live.app.query_one("#panes").active == "step"
        focused = idle_live.app.focused
        assert focused is not None and "step" in [w.id for w in focused.ancestors_with_self]  # its list, to scroll


@pytest.mark.slow
async def test_the_tui_opens_the_overview_when_work_arrives_unless_a_panel_was_just_chosen(live):
    async with live.app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        live.app.show_pane("startup")  # where `serve` opens
        await pilot.pause()
        body = live.app.query_one("#overview-body")
        await live.submit()
        # (under load the panel's first draw can come a refresh after the switch, as a person sees it)
        await live.settle(pilot, until=lambda: "waiting 3" in body.text)
        tabs = live.app.query_one("#panes")
        assert tabs.active == "overview", shown_state(live)  # no key pressed
        text = body.text
        assert "waiting 3" in text and "running 0" in text, shown_state(live)
        for rid in ("r0", "r1", "r2"):
            assert rid in text
        assert "not scheduled yet: the engine is held" in text
        await pilot.press("n")
        await live.held()
        await live.settle(pilot, until=lambda: "kernels of step 0" in body.text)
        text = body.text
        # async scheduling: n ran one call, which scheduled step 0; its tokens come with the next call
        assert "out 0/4" in text and "prefill 11" in text and "batch: 3 requests" in text
        assert "kernels of step 0" in text and "unified_attention_ref" in text
        line = header(live.app).splitlines()[0]
        assert "waiting 0 · running 3" not in line and "W0 R3 F0" in line  # 80 columns: abbreviated, one line
        assert footer_shows(live.app, "q", "quit")
        await pilot.press("space")
        for _ in range(400):
            await live.settle(pilot)
            if not live.source.refresh().running:
                break
            await asyncio.sleep(0.02)
        await pilot.press("3")  # a panel chosen just now: new work does not take it away
        await live.submit(prefix="late")
        await live.settle(pilot)
        assert tabs.active == "kv"


def live_params(max_tokens: int):
    from engine import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("live", ["mp"], indirect=True)
async def test_the_header_says_when_the_engine_core_dies(live):
    import os
    import signal

    async with live.app.run_test(size=(160, 48)) as pilot:
        await live.settle(pilot)
        assert "RUNNING" in header(live.app) or "PAUSED" in header(live.app)
        os.kill(live.engine.engine_core.pid, signal.SIGKILL)
        await live.settle(pilot, until=lambda: "ENGINE DEAD" in header(live.app), timeout=15)
        assert "ENGINE DEAD" in header(live.app), shown_state(live)
        assert "engine core died: signal 9: requests in flight failed, new ones get 503" in header(live.app)
        assert "RUNNING" not in header(live.app) and "PAUSED" not in header(live.app)
