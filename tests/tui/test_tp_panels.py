"""The panels with tensor parallelism, driven headless on synthetic 2-rank traces (as the event
contract says the engine emits them): the Kernels panel's rank column, `r` and per-rank sums,
collective rows; the KV panel's shards; the Startup panel's and `serve`'s per-rank lines; the
Perfetto export's per-rank threads. With one rank nothing of it shows."""
from __future__ import annotations

import json
from contextlib import asynccontextmanager

import pytest

from tests.tui.helpers import shown
from tests.tui.test_live_keys import footer_shows
from tests.tui.tp_events import HIDDEN, rank_ns, tp_events, write_trace
from tracer.replay import Replay
from tracer.tui.app import TraceApp
from tracer.tui.fmt import STAGE_WIDTH, fmt_ns
from tracer.tui.sources.replay import ReplaySource


def app_on(events) -> TraceApp:
    return TraceApp(ReplaySource(Replay({"model": "tiny-gpt2"}, events)))


@asynccontextmanager
async def on_pane(events, key: str, size=(140, 40)):
    """The app on these events, headless, showing the panel of this key (1-7): (app, pilot)."""
    app = app_on(events)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        await pilot.press(key)
        yield app, pilot


async def pane_text(events, key: str, selector: str) -> str:
    """What a panel's widget shows after its key."""
    async with on_pane(events, key) as (app, _):
        return shown(app.query_one(selector))


def table_rows(app) -> list[list[str]]:
    """The Kernels list's rows on screen, split into cells (the header line left out)."""
    lines = shown(app.query_one("#kernels-table")).splitlines()[1:]
    return [line.split() for line in lines if line.strip()]


@pytest.mark.asyncio
async def test_r_cycles_the_kernels_list_through_the_ranks():
    async with on_pane(tp_events(n=2), "5", (140, 60)) as (app, pilot):
        head = shown(app.query_one("#kernels-head"))
        assert footer_shows(app, "r", "rank")
        assert "step 0: 18 launches" in head and "rank all of 2" in head and "r: next rank" in head
        header = shown(app.query_one("#kernels-table")).splitlines()[0].split()
        assert header[:3] == ["#", "rank", "layer"]
        assert {row[1] for row in table_rows(app)} == {"0", "1"}
        for rank in (0, 1):
            await pilot.press("r")
            head = shown(app.query_one("#kernels-head"))
            assert f"step 0: 9 launches   rank {rank} of 2" in head
            assert {row[1] for row in table_rows(app)} == {str(rank)}
        await pilot.press("r")  # back to every rank's
        assert "rank all of 2" in shown(app.query_one("#kernels-head"))
        assert app.query_one("#kernels-table").row_count == 18


@pytest.mark.asyncio
async def test_each_rank_has_its_sums_and_collectives_show_bytes_site_and_time():
    async with on_pane(tp_events(n=2), "5", (140, 60)) as (app, pilot):
        head = shown(app.query_one("#kernels-head"))
        for r in (0, 1):
            total, comm = rank_ns(r)
            assert (f"rank {r}: 9 launches · {fmt_ns(total)} · communication {fmt_ns(comm)} "
                    f"({comm / total:.0%})") in head
        await pilot.press("r", "r")  # rank 1
        rows = table_rows(app)
        reduce = [row for row in rows if row[3] == "all_reduce"]
        assert len(reduce) == 4 and all(row[1] == "1" for row in reduce)
        assert " ".join(reduce[0][5:7]) == fmt_ns(2 * 2_000_000)  # rank 1: twice rank 0's time
        assert f"{HIDDEN * 4} B attn.c_proj (sum over 2 ranks)" in " ".join(reduce[0])  # 128 floats
        assert "mlp.c_proj" in " ".join(reduce[1])
        gather = [row for row in rows if "all_gather" in row]
        assert len(gather) == 1 and gather[0][2] == "all_gather"  # no layer: the LM head's
        assert "lm_head (all_gather over 2 ranks)" in " ".join(gather[0])
        # the cursor on a collective: what it moves, no program grid
        await pilot.press("down", "down")
        assert rows[2][3] == "all_reduce"
        text = shown(app.query_one("#program-access"))
        assert "all_reduce on rank 1" in text and "512 B from this rank" in text


@pytest.mark.slow
@pytest.mark.asyncio
async def test_one_rank_shows_no_ranks_and_r_changes_nothing():
    app = app_on(tp_events(n=1, with_rank=False))
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.pause()
        await pilot.press("5")
        head = shown(app.query_one("#kernels-head"))
        rows = table_rows(app)
        assert "rank" not in head and "rank" not in shown(app.query_one("#kernels-table")).splitlines()[0]
        assert not footer_shows(app, "r", "rank")  # one rank: no r in the footer, and r does nothing
        await pilot.press("r")
        assert shown(app.query_one("#kernels-head")) == head and table_rows(app) == rows
        await pilot.press("3")
        assert "rank" not in shown(app.query_one("#kv-summary"))
        await pilot.press("7")
        assert "rank" not in shown(app.query_one("#startup-stages"))


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_kv_panel_shows_each_ranks_share():
    summary = await pane_text(tp_events(n=2), "3", "#kv-summary")
    assert "the same blocks and block tables on every rank" in summary
    assert "rank 0: heads [0, 2) of 4 · 512.0 KiB (8.0 KiB a block)" in summary
    assert "rank 1: heads [2, 4) of 4 · 512.0 KiB (8.0 KiB a block)" in summary
    assert "per step" in summary  # the ranks' lines come under the summary, not over it


@pytest.mark.asyncio
async def test_the_startup_panel_has_a_line_per_rank_for_weights_and_kv():
    stages = await pane_text(tp_events(n=2), "7", "#startup-stages")
    lines = [line.split() for line in stages.splitlines() if line.strip()]
    names = [" ".join(line[1:3]) for line in lines]
    assert names[:6] == ["weights 500.0", "rank 0", "rank 1", "KV cache", "rank 0", "rank 1"]
    weights1, kv0 = " ".join(lines[2]), " ".join(lines[4])
    assert "40.0 ms" in weights1 and "1,000,000 parameters" in weights1
    assert "heads [2, 4) · mlp cols [256, 512) · vocab [2048, 4096)" in weights1
    assert "64 blocks × 8.0 KiB = 512.0 KiB · heads [0, 2)" in kv0


def test_a_worker_loading_its_weights_shows_in_progress():
    from tracer.state import TraceState, fold
    from tracer.tui.widgets.startup import rank_rows

    events = tp_events(n=2)
    cut = next(i for i, ev in enumerate(events) if ev.layer == "worker" and ev.kind == "end")
    s = TraceState()
    for ev in events[:cut]:
        fold(s, ev)
    rows = rank_rows(s.workers, "model_load")
    assert len(rows) == 1 and rows[0][1].strip() == "rank 0" and rows[0][3].plain == "in progress"


def test_serve_prints_each_ranks_lines_under_the_engines(capsys):
    from tracer.commands import serve

    for ev in tp_events(n=2):
        serve._print_stage(ev.layer, ev.name, ev.kind, ev.request_id, ev.step, ev.attrs or {})
    lines = capsys.readouterr().err.splitlines()
    starts = [line[:2 + STAGE_WIDTH].strip() for line in lines]
    assert starts == ["weights", "rank 0", "rank 1", "KV cache", "rank 0", "rank 1"]
    assert len({line.index(" ms ") for line in lines}) == 1  # one column of times
    assert "heads [2, 4) · mlp cols [256, 512)" in lines[2] and "64 blocks × 8.0 KiB" in lines[4]


def test_the_perfetto_export_has_a_kernels_thread_per_rank(tmp_path):
    from tracer.export import export_perfetto

    export_perfetto(write_trace(tmp_path / "tp.jsonl", tp_events(n=2)), tmp_path / "tp.json")
    chrome = json.loads((tmp_path / "tp.json").read_text())
    threads = {e["tid"]: e["args"]["name"] for e in chrome["traceEvents"] if e["name"] == "thread_name"}
    by_name = {name: tid for tid, name in threads.items()}
    assert {"kernels rank 0", "kernels rank 1", "worker rank 0", "worker rank 1"} <= set(by_name)
    slices = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    for r in (0, 1):
        mine = [e for e in slices if e["tid"] == by_name[f"kernels rank {r}"]]
        assert len(mine) == 9 and all(e["args"]["rank"] == r for e in mine)
        loads = [e for e in slices if e["tid"] == by_name[f"worker rank {r}"]]
        assert [e["name"] for e in loads] == ["model_load", "kv_cache_alloc"]
    export_perfetto(write_trace(tmp_path / "one.jsonl", tp_events(n=1, with_rank=False)), tmp_path / "1.json")
    one = json.loads((tmp_path / "1.json").read_text())
    assert "kernels" in {e["args"]["name"] for e in one["traceEvents"] if e["name"] == "thread_name"}


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_live_two_rank_engine_in_the_tui(model_cache):
    """The real thing: LLM(tensor_parallel_size=2) held, one step, then the panels."""
    from engine import LLM, Hooks, SamplingParams
    from engine.engine.async_llm import AsyncLLM
    from tests.tui.conftest import Live
    from tracer.session import TraceSession
    from tracer.tui.sources.base import SourceInfo
    from tracer.tui.sources.live import LiveSource

    hooks = Hooks()
    session = TraceSession(hooks, start_paused=True, model="tiny-gpt2")
    llm = LLM("tiny-gpt2", hooks=hooks, block_size=4, num_kv_blocks=64, tensor_parallel_size=2)
    engine = AsyncLLM.from_engine_core(llm.llm_engine.engine_core.engine_core, drain_timeout=0).start()
    live = Live(session, engine, LiveSource(session, SourceInfo("live", "tiny-gpt2", "cpu", "torch"), engine),
                None)
    live.app = TraceApp(live.source, initial_pane="kernels")
    try:
        async with live.app.run_test(size=(140, 50)) as pilot:
            await pilot.pause()
            await live.submit(["Hello there", "x"], SamplingParams(max_tokens=2, temperature=0))
            await pilot.press("n")
            await live.held()
            await live.settle(pilot)
            await pilot.press("5")
            head = shown(live.app.query_one("#kernels-head"))
            assert "rank all of 2" in head and "rank 0: " in head and "rank 1: " in head, head
            assert footer_shows(live.app, "r", "rank") and footer_shows(live.app, "q", "quit")
            await pilot.press("r", "r")
            assert {row[1] for row in table_rows(live.app)} == {"1"}
            assert any("all_reduce" in row for row in table_rows(live.app))
            await pilot.press("3")
            assert "rank 1: heads [2, 4) of 4" in shown(live.app.query_one("#kv-summary"))
            await pilot.press("7")
            stages = shown(live.app.query_one("#startup-stages"))
            assert stages.count("rank 0") == 2 and stages.count("rank 1") == 2
    finally:
        session.close()
        engine.stop(drain_timeout=0)
        llm.shutdown()  # the workers


@pytest.mark.asyncio
async def test_the_overview_counts_rank_0s_launches():
    body = await pane_text(tp_events(n=2), "1", "#overview-body")
    assert "(9 launches on rank 0 of 2; Kernels, 5)" in body
    assert "all_reduce" in body and " 4×" in body.split("all_reduce")[1][:40]  # 2 a layer, rank 0 only


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_step_panel_says_every_worker_got_the_same_scheduler_output():
    left = await pane_text(tp_events(n=2), "4", "#step-left")
    assert "rank 0: 1 token of 1 request, digest d0000" in left and "rank 1: 1 token" in left
    assert "the same scheduler output on every rank" in left
    events = tp_events(n=2)
    bad = next(ev for ev in events if ev.name == "execute_model" and ev.attrs["rank"] == 1)
    bad.attrs = dict(bad.attrs, digest="ffff")
    assert "the ranks received different outputs!" in await pane_text(events, "4", "#step-left")
