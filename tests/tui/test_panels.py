"""The panels' own promises, each with a pilot against a real engine or a recorded trace:
fresh after a burst, a KV grid that fits, a scroll indicator that leaves the column names
alone, the full waiting reason, one-line headers, and the CLI's clean errors."""
from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from tests.tui.helpers import shown
from tracer.tui.app import TraceApp
from tracer.tui.sources.replay import ReplaySource
from tracer.tui.widgets.header import StatusHeader
from tracer.tui.widgets.kv_cache import blocks_per_cell, draw_blocks

BURST = [f"burst {i}" for i in range(12)]


async def run_burst(live, pilot, params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)):
    streams = await live.submit(BURST, params)
    await pilot.press("space")
    for s in streams:
        assert [o async for o in s][-1].finished


@pytest.mark.asyncio
async def test_every_panel_agrees_with_the_header_after_a_burst(live):
    async with live.app.run_test(size=(120, 36)) as pilot:
        await pilot.pause()
        await pilot.press("4")  # Step, chosen before the burst: it throttles itself while the engine runs
        await run_burst(live, pilot)
        await live.settle(pilot)
        state = live.source.refresh()
        last = state.step
        # async scheduling (the default) ends on an empty step: scheduled while the last tokens were in flight
        launches = 13 if state.snapshot["total_num_scheduled_tokens"] else 0  # 4 input, 2 per layer, post_update
        assert f"step {last} (done)" in shown(live.app.query_one(StatusHeader))
        assert shown(live.app.query_one("#step-left")).lstrip().startswith(f"step {last}  batch of")
        # ... which the Overview passes over for the last step that ran a batch (and its launches)
        overview = f"step {last} (done)" if launches else f"step {last} scheduled no request"
        for key, panel, says in (("5", "#kernels-head", f"step {last}: {launches} launches"),
                                 ("1", "#overview-body", overview)):
            await pilot.press(key)  # shown: drawn at once, whatever its throttle says
            assert says in shown(live.app.query_one(panel))


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_kv_grid_fits_the_screen_and_says_how_many_blocks_a_cell_is(live):
    async with live.app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await pilot.press("3")
        await run_burst(live, pilot, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        await pilot.press("1", "3")
        frame = live.app.frame
        grid = live.app.query_one("#kv-grid")
        assert grid.virtual_size.height <= grid.size.height  # no scrolling: the whole cache is on screen
        big = draw_blocks(frame, 4096, 78, 12)  # the CPU default: 4,096 blocks, 12 rows at 80 columns
        assert len(big) <= 12 and blocks_per_cell(4096, 78, 12) == 10  # 36 cells a row
        assert sum(len(seg.text) for seg in big[0]) <= 78
        summary = shown(live.app.query_one("#kv-summary"))
        assert "each cell" not in summary and "█ owned" in summary  # 64 blocks: one a cell


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_scroll_indicator_leaves_the_column_names_alone_and_the_full_reason_shows(live):
    async with live.app.run_test(size=(160, 20)) as pilot:
        await pilot.pause()
        await live.submit([f"waiting request number {i}" for i in range(30)])
        await pilot.press("2")
        table, detail = live.app.query_one("#requests-table"), live.app.query_one("#requests-detail")
        for _ in range(150):  # 30 new rows at once are drawn at most BUSY_HZ times a second: wait until they are
            await live.settle(pilot)
            head = next(iter(shown(table).splitlines()), "")  # (nothing at all before its first draw)
            if "of 30" in head and "the engine is held" in detail.text:
                break
            await asyncio.sleep(0.1)
        for name in ("id", "state", "prompt", "output", "lifetime", "why waiting / finish"):
            assert name in head
        assert "↕" in head and "of 30" in head, (table.row_count, table.size, head)
        assert "waiting: not scheduled yet: the engine is held" in detail.text  # in full, beside the list


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_header_never_wraps_and_keeps_q_quit(recorded_trace):
    for size in ((80, 24), (100, 30), (160, 48)):
        app = TraceApp(ReplaySource.load(recorded_trace))
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            first = shown(app.query_one(StatusHeader)).splitlines()[0].rstrip()
            assert len(first) <= size[0] and "step 0" in first
            if size[0] != 100:  # spelled out when wide, abbreviated at 80 (at 100 it depends on the model name)
                assert ("waiting" in first) == (size[0] > 100), first
            from tests.tui.test_live_keys import footer_shows
            assert footer_shows(app, "q", "quit")


def test_a_bad_port_is_a_usage_error_not_a_traceback(capsys):
    from tracer.cli import main
    for argv in (["serve", "tiny-gpt2", "--port", "99999"], ["serve", "tiny-gpt2", "--web-port", "x"],
                 ["attach", "--web-port", "-1"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error: argument" in err and "Traceback" not in err


def test_the_startup_hint_names_a_real_command():
    from engine.model_executor.model_loader import ModelNotFoundError, resolve
    with pytest.raises(ModelNotFoundError) as e:
        resolve("./nonexistent-model")
    assert "vllm-trace serve tiny-gpt2" in str(e.value) and "--model" not in str(e.value)



@pytest.mark.slow
@pytest.mark.asyncio
async def test_at_80_columns_the_overview_never_scrolls_sideways_and_its_gauge_is_whole(live):
    """The Overview's lines were sized to the panel: once its content needed a vertical scrollbar
    they were two columns too wide, the body scrolled sideways, the gauge read `0/4095 bloc` and a
    scrollbar thumb sat in the bottom-right corner. They leave room for that scrollbar now."""
    async with live.app.run_test(size=(80, 24)) as pilot:
        await live.submit(BURST)
        await pilot.press("n")  # held after one step: running and waiting requests, the kernels
        await live.held()
        await pilot.press("1")
        body = live.app.query_one("#overview-body")
        await live.settle(pilot, until=lambda: "KV cache" in shown(body))
        room = body.size.width - body.styles.scrollbar_size_vertical
        assert body.virtual_size.width <= room and not body.show_horizontal_scrollbar
        gauge = next(line for line in shown(body).splitlines() if "KV cache" in line)
        assert gauge[:room].rstrip().endswith("/63 blocks"), gauge  # (block 0 is the null block)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_counts_read_as_english_and_the_lifetime_column_says_what_it_is(live):
    async with live.app.run_test(size=(120, 36)) as pilot:
        await live.submit(prompts=["x"])
        for _ in range(2):  # the prefill, then one decode of one request
            await pilot.press("n")
            await live.held()
        await pilot.press("4")
        await live.settle(pilot, until=lambda: "in the batch" in shown(live.app.query_one("#step-right")))
        assert "(1 request, 1 token in the batch)" in shown(live.app.query_one("#step-right"))
        await pilot.press("2")
        await live.settle(pilot)
        head = live.app.query_one("#requests-table")._header_strip(120, 0, 0).text
        assert "lifetime" in head and " age " not in head


@pytest.mark.asyncio
@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
async def test_the_kernels_panel_says_what_it_lists_and_what_it_leaves_out(recorded_trace, size):
    """It lists two launches a layer, which a learner took for the whole forward pass."""
    source = ReplaySource.load(recorded_trace)
    source.replay.goto(2)
    app = TraceApp(source, initial_pane="kernels")
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        head = app.query_one("#kernels-head")
        text = " ".join(shown(head).split())
        assert "listed: each layer's KV-cache write and paged attention" in text, text
        assert "not listed: matmuls, layer norms, MLP, LM head, sampler" in text, text
        assert all(len(line.rstrip()) <= head.size.width for line in shown(head).splitlines())
