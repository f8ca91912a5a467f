"""The Kernels panel on a profiled step (synthetic traces of the engine's profiled events): every
op listed longest first with its share, FLOPs, bytes, intensity, achieved rate and bound against
this machine's cached roofline; the roofline chart below it; the fold's PROFILING; and an
unprofiled step drawn as it always was."""
from __future__ import annotations

import json
from contextlib import asynccontextmanager

import pytest

from kernels import roofline
from tests.tui.helpers import shown
from tests.tui.profiled_events import ROOF, profiled_events, step_ops
from tracer.replay import Replay
from tracer.tui.app import TraceApp
from tracer.tui.fmt import fmt_ns
from tracer.tui.sources.replay import ReplaySource
from tracer.tui.widgets.kernels import KernelsPanel
from tracer.tui.widgets.roofline import RooflineChart

pytestmark = pytest.mark.asyncio


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A cache whose calibration for this machine is ROOF (100 GFLOP/s, 20 GB/s): bounds are known."""
    monkeypatch.setenv("VLLM_TRACE_CACHE", str(tmp_path))
    path = roofline.cache_path(tmp_path, "cpu", "float32")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**ROOF.to_dict(), "fingerprint": roofline.fingerprint("cpu", "float32")}))
    return path


@asynccontextmanager
async def kernels_at(events, step: int, size=(160, 60)):
    replay = Replay({"model": "tiny-gpt2"}, events)
    app = TraceApp(ReplaySource(replay))
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        await pilot.press("5")
        replay.goto(step)
        app.tick()
        await pilot.pause()
        yield app, pilot


def rows(app) -> list[list[str]]:
    """Every row of the Kernels list (scrolled out of view too), cell by cell."""
    return [[text.strip() for text, _style in row] for row in app.query_one("#kernels-table").texts]


async def test_a_profiled_prefill_lists_every_op_longest_first_with_its_roofline(machine):
    async with kernels_at(profiled_events(), 0) as (app, pilot):
        head = shown(app.query_one("#kernels-head"))
        assert "step 0: 40 ops profiled" in head and "of the step's" in head
        assert "ridge 5 FLOP/byte" in head and "100 GFLOP/s" in head and "20 GB/s" in head
        lines = rows(app)
        assert len(lines) == len(step_ops(40, 40)) == 40
        header = shown(app.query_one("#kernels-table")).splitlines()[0].split("↕")[0].split()
        assert header == ["#", "layer", "op", "kind", "share", "time", "FLOPs", "bytes", "FLOP/B", "achieved", "bound"]
        first = dict(zip(header, lines[0]))
        assert first["op"] == "lm_head" and first["kind"] == "matmul" and first["layer"] == ""  # the longest
        assert first["bound"] == "compute" and first["share"].endswith("36%")
        c_attn = dict(zip(header, next(row for row in lines if row[2] == "c_attn")))
        # c_attn over 40 tokens: 2·40·128·384 FLOPs; (40·128 + 128·384 + 40·384 + 384)·4 bytes
        assert c_attn["FLOPs"] == "3.93 M" and c_attn["bytes"] == "273.5 KiB" and c_attn["bound"] == "compute"
        assert c_attn["FLOP/B"] == f"{2 * 40 * 128 * 384 / (4 * (40 * 128 + 128 * 384 + 40 * 384 + 384)):.3g}"
        assert c_attn["achieved"] == "50 GFLOP/s"  # the synthetic ops run at half the roof
        wte = dict(zip(header, next(row for row in lines if row[2] == "wte")))
        assert wte["bound"] == "-" and wte["FLOPs"] == "-"  # no arithmetic: no place on the roofline
        chart = app.query_one(RooflineChart)
        assert chart.display and not app.query_one("#kernels-programs").display
        drawn = shown(chart)
        assert "matmul" in drawn and "ridge" in drawn and "FLOP/byte" in drawn
        await pilot.resize_terminal(120, 40)  # drawn again at another size (plotext's log axes)
        await pilot.pause()
        assert "matmul" in shown(chart) and shown(chart) != drawn


async def test_a_profiled_decode_step_is_memory_bound(machine):
    async with kernels_at(profiled_events(), 1) as (app, _):
        lines = rows(app)
        matmuls = [row for row in lines if row[3] == "matmul"]
        assert len(matmuls) == 4 * 4 + 1 and all(m[-1] == "memory" for m in matmuls)
        assert "by kind: matmul" in shown(app.query_one("#kernels-head"))


async def test_a_step_after_profiling_stopped_is_listed_as_before(machine):
    events = profiled_events(decode_steps=1)
    async with kernels_at(events, 2) as (app, _):
        head = shown(app.query_one("#kernels-head"))
        assert "8 launches" in head and "p profiles them too" in head
        assert not app.query_one(RooflineChart).display and app.query_one("#kernels-programs").display
        assert not app.source.refresh().profiling


@pytest.mark.slow
async def test_the_header_says_profiling_while_it_is_on(machine):
    async with kernels_at(profiled_events(), 1) as (app, _):
        assert app.source.refresh().profiling
        assert "PROFILING" in shown(app.query_one("#header"))


async def test_without_a_calibration_the_panel_calibrates_once_and_then_draws_the_roofs(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TRACE_CACHE", str(tmp_path))
    monkeypatch.setitem(roofline.MATMUL_SIZES, "cpu", (64,))
    monkeypatch.setitem(roofline.COPY_BYTES, "cpu", 1 << 20)
    async with kernels_at(profiled_events(), 1) as (app, pilot):
        panel = app.query_one(KernelsPanel)
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert panel.roof is not None and roofline.cached(tmp_path) == panel.roof
        assert f"ridge {panel.roof.ridge:.3g} FLOP/byte" in shown(app.query_one("#kernels-head"))


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    """A real engine run recorded with profiling on for its prefill and two decode steps, then off."""
    from engine import LLM, Hooks, SamplingParams
    from tracer.session import TraceSession

    path = tmp_path_factory.mktemp("profiled") / "trace.jsonl"
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=path, control=False, model="tiny-gpt2")
    llm = LLM("tiny-gpt2", hooks=hooks, device="cpu", async_scheduling=False)  # one whole step per step()
    llm.llm_engine.add_request("a", {"prompt_token_ids": list(range(5, 45))},
                               SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    llm.start_profile()
    for _ in range(3):
        llm.llm_engine.step()
    llm.stop_profile()
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    session.close()
    return path


@pytest.mark.slow
async def test_a_real_recorded_profiled_run_in_the_panel_and_on_the_exported_chart(real_trace, machine, tmp_path):
    from tracer.roofline_chart import export_roofline

    source = ReplaySource.load(real_trace)
    steps = source.replay.steps
    app = TraceApp(source)
    async with app.run_test(size=(160, 60)) as pilot:
        await pilot.pause()
        await pilot.press("5")
        for step, profiled in ((steps[0], True), (steps[2], True), (steps[-1], False)):
            source.replay.goto(step)
            app.tick()
            await pilot.pause()
            head = shown(app.query_one("#kernels-head"))
            assert ("ops profiled" in head) == profiled, head
            if profiled:
                table = rows(app)
                header = shown(app.query_one("#kernels-table")).splitlines()[0].split("↕")[0].split()
                cells = [dict(zip(header, r)) for r in table]
                assert len({c["op"] for c in cells}) >= 10
                assert all(c["FLOPs"] != "-" and c["bound"] in ("memory", "compute") for c in cells
                           if c["kind"] == "matmul")
                ns = [k["duration_ns"] for k in app.source.refresh().kernels if k.get("profiled")]
                assert [c["time"] for c in cells] == [fmt_ns(n) for n in sorted(ns, reverse=True)]
                assert app.query_one(RooflineChart).display and "matmul" in shown(app.query_one(RooflineChart))
    drawn, roof = export_roofline(real_trace, tmp_path / "real.html")
    assert [(s.label, s.step) for s in drawn] == [("prefill", steps[0]), ("decode", steps[2])]
    assert roof is not None and "<svg" in (tmp_path / "real.html").read_text()


@pytest.mark.slow
async def test_the_overview_lists_a_profiled_steps_longest_ops(machine):
    async with kernels_at(profiled_events(), 1) as (app, pilot):
        await pilot.press("1")
        app.tick()
        await pilot.pause()
        body = app.query_one("#overview-body").text
        lines = body[body.index("kernels of step 1"):].splitlines()[1:5]
        assert lines[0].split()[0] == "lm_head", body  # the longest op of a tiny model's decode step


async def test_a_profiled_step_of_two_ranks_has_a_rank_column_and_r_lists_one_rank(machine):
    from dataclasses import replace

    events = profiled_events()
    config = {**events[0].attrs["config"], "parallel": {"tensor_parallel_size": 2}}
    events[0] = replace(events[0], attrs={**events[0].attrs, "config": config})
    twin = [replace(e, attrs={**e.attrs, "rank": 1}) for e in events if e.layer == "kernel" and e.step == 1]
    at = max(i for i, e in enumerate(events) if e.layer == "kernel" and e.step == 1) + 1
    events = events[:at] + twin + events[at:]
    async with kernels_at(events, 1) as (app, pilot):
        header = shown(app.query_one("#kernels-table")).splitlines()[0].split("↕")[0].split()
        assert header[:3] == ["#", "rank", "layer"] and len(rows(app)) == 80
        await pilot.press("r")
        await pilot.pause()
        assert len(rows(app)) == 40 and {r[1] for r in rows(app)} == {"0"}
        assert "rank 0 of" in shown(app.query_one("#kernels-head"))
