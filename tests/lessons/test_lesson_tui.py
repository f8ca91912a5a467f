"""`--tui`: a lesson in the TUI (Pilot, the real engine), held at its checkpoints, the
narration in the side panel, the same checks as the console run."""
from __future__ import annotations

import importlib
import io
import time

import pytest
from rich.console import Console
from textual.widgets import RichLog

import lessons
from lessons.framework import Lesson, run_lesson
from lessons.tui import ABORTED, LessonApp
from tests.tui.helpers import shown
from tracer.tui.widgets.header import StatusHeader
from tracer.tui.widgets.kv_cache import KVCachePanel

SIZE = (160, 48)


def module(name: str):
    return importlib.import_module(lessons.find(name).module)


def new_lesson(mod, pause: bool) -> Lesson:
    number = int(mod.__name__.split(".")[-1][:2])
    return Lesson(number, mod.TITLE, pause_enabled=pause, console=Console(file=io.StringIO(), width=100))


def narration(app) -> str:
    """The side panel's text, wrapped lines joined back into sentences."""
    return " ".join(" ".join(strip.text for strip in app.query_one("#narration", RichLog).lines).split())


async def until(pilot, condition, what: str, timeout: float = 30) -> None:
    """Let the app run until condition() holds (the lesson thread works meanwhile)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.02)


async def next_checkpoint(pilot, app) -> None:
    await until(pilot, lambda: app.source.held is not None or app.exit_code is not None, "a checkpoint or the end")
    app.tick()
    await pilot.pause()


def requests_row(app, rid: str) -> list[str]:
    rows = app.query_one("#requests-table")
    return [text.strip() for text, _style in rows.texts[rows.keys.index(rid)]]


def kv_row(app, n: int) -> list[str]:
    """Row n of the KV cache grid as drawn: its first block id, then one cell per block."""
    lines = shown(app.query_one(KVCachePanel).query_one("#kv-grid")).split("\n")
    return lines[n].split() if n < len(lines) else []


@pytest.fixture(scope="module")
def console_checks():
    """The claims lesson 05 verifies on the console, in order: the TUI run must verify the same."""
    lesson = new_lesson(module("paged_kv_cache"), pause=False)
    assert run_lesson(lesson, module("paged_kv_cache").run) == 0
    return lesson.checks


@pytest.mark.slow
@pytest.mark.asyncio
async def test_lesson_05_holds_the_engine_at_each_checkpoint_and_ends_with_every_check(console_checks):
    mod = module("paged_kv_cache")
    lesson = new_lesson(mod, pause=True)
    app = LessonApp(lesson, mod.run)
    async with app.run_test(size=SIZE) as pilot:
        # 1st checkpoint, the prediction before the prefill: A is queued and owns no block yet
        await next_checkpoint(pilot, app)
        a = app.source.refresh().requests["A"]
        assert (a.status, a.block_table) == ("WAITING", [])
        assert "Predict" in narration(app) and "Answer:" not in narration(app)
        assert "held at a checkpoint: c continues" in shown(app.query_one(StatusHeader))
        assert app.active_bindings["c"].enabled

        await pilot.press("c")  # the answer, the prefill, three checks, then the next checkpoint
        await next_checkpoint(pilot, app)
        state = app.source.refresh()
        step = state.step
        assert state.requests["A"].block_table == [1, 2, 3]  # block 0 is the null block
        assert requests_row(app, "A")[1:3] == ["running", "40/40"]
        # beside the narration the Requests list keeps the width; `l` hides the text, the detail returns
        assert not app.query_one("#requests-detail").display
        await pilot.press("l")
        await pilot.pause()
        assert not app.narration.display and app.query_one("#requests-detail").display
        await pilot.press("l")
        await pilot.press("3")  # the KV cache panel: A's three blocks at the front of the grid
        await until(pilot, lambda: kv_row(app, 0)[2:6] == ["█", "█", "█", "·"], "A's blocks in the KV grid")
        text = narration(app)
        assert "Lesson 5: The paged KV cache" in text and "The KV cache is cut into fixed-size blocks" in text
        assert "Answer: ceil(40 / 16) = 3 blocks" in text
        assert lesson.checks == console_checks[:5]  # the null block's, then the prefill's four
        assert all(f"✓ {claim}" in text for claim in console_checks[:5])
        assert console_checks[5] not in text  # nothing past the checkpoint ran
        await pilot.pause(0.2)
        app.tick()
        assert app.source.refresh().step == step  # held: the engine did not step while we looked

        waits = 2
        while app.exit_code is None:
            await pilot.press("c")
            await next_checkpoint(pilot, app)
            waits += 1
        assert waits == 6  # 2 predictions + 3 pauses, then the end
        assert app.exit_code == 0 and lesson.checks == console_checks
        text = narration(app)
        assert all(f"✓ {claim}" in text for claim in console_checks)
        assert "What you learned" in text and "Lesson finished: every check held" in text
        # the panels follow the lesson's newest engine: the 24-request workload
        assert len(app.source.refresh().requests) == 24
        assert "c" not in app.active_bindings and "the end of the lesson" in shown(app.query_one(StatusHeader))
        await pilot.press("q")
    assert all(s._closed for s in lesson.sessions)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_q_at_a_checkpoint_stops_the_lesson_and_closes_its_engine():
    mod = module("paged_kv_cache")
    lesson = new_lesson(mod, pause=True)
    app = LessonApp(lesson, mod.run)
    async with app.run_test(size=SIZE) as pilot:
        await next_checkpoint(pilot, app)
        await pilot.press("q")
        await until(pilot, lambda: not app.is_running, "the app to exit once the lesson thread stopped")
    assert app.exit_code == ABORTED and lesson.checks == ["block 0 is not in the free queue"]
    assert app.exit_status() == 0  # the learner's choice: `vllm-trace lesson 5 --tui` exits 0 (it said 130)
    assert all(s._closed for s in lesson.sessions)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_ctrl_c_at_a_checkpoint_exits_130():
    mod = module("paged_kv_cache")
    app = LessonApp(new_lesson(mod, pause=True), mod.run)
    async with app.run_test(size=SIZE) as pilot:
        await next_checkpoint(pilot, app)
        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.is_running, "the app to exit")
    assert app.exit_status() == ABORTED


@pytest.mark.slow
@pytest.mark.asyncio
async def test_lesson_06_header_and_narration_name_the_same_step_and_its_tables_fit():
    """The header said `step 1 (a checkpoint)` beside a table titled `step 2: scheduler queues` (the
    queues before step 2), and the flattened batch's columns were cut (`block_ta…`, `positio…`) in a
    45 % side panel while the Requests list beside it was mostly empty."""
    mod = module("slot_mapping")
    app = LessonApp(new_lesson(mod, pause=True), mod.run)
    async with app.run_test(size=SIZE) as pilot:
        await next_checkpoint(pilot, app)
        assert app.source.refresh().step == 1
        assert "step 1 (done)" in shown(app.query_one(StatusHeader))
        assert "scheduler queues after step 1, before step 2" in narration(app)
        await pilot.press("c")
        await next_checkpoint(pilot, app)
        assert "step 2 (done)" in shown(app.query_one(StatusHeader))
        text = narration(app)
        for column in ("rows (query_start_loc)", "positions", "block_tables row", "slots"):
            assert column in text, text
        assert "…" not in "".join(t for t in text.split() if t.startswith(("block", "positi", "(query")))
        await pilot.pause()
        assert app.query_one("#requests-table").size.width >= 50  # the panels keep room
        await pilot.press("q")


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["slot_mapping", "when_a_request_stops", "latency"])
async def test_no_pause_runs_another_lesson_straight_through(name):
    mod = module(name)
    lesson = new_lesson(mod, pause=False)
    app = LessonApp(lesson, mod.run)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.exit_code is not None, "the lesson to end", timeout=60)
        await pilot.pause()
        assert app.exit_code == 0 and lesson.checks
        text = narration(app)
        assert all(f"✓ {claim}" in text for claim in lesson.checks)
        assert "Lesson finished" in text and "⏸" not in text  # never held


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_false_claim_shows_the_failed_check_and_exits_1(monkeypatch):
    """Break the KV-cache manager (one block too many per request): the first block-count check fails."""
    from engine.core.single_type_kv_cache_manager import SingleTypeKVCacheManager as Manager
    original = Manager.allocate_new_blocks
    monkeypatch.setattr(Manager, "allocate_new_blocks",  # every table one block longer than its tokens need
                        lambda self, request, num_tokens: original(self, request, num_tokens + self.block_size))
    mod = module("paged_kv_cache")
    lesson = new_lesson(mod, pause=False)
    app = LessonApp(lesson, mod.run)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: app.exit_code is not None, "the lesson to end")
        await pilot.pause()
        text = narration(app)
        assert app.exit_code == 1
        assert "✗ lesson 5 claims: after the prefill of a 40-token prompt" in text and "the engine disagrees" in text
        assert "Lesson stopped at the failed check" in text


def test_tui_flag_reaches_the_tui_runner(monkeypatch):
    """`--tui` (script and `vllm-trace lesson`) hands the lesson to run_in_tui; --no-pause turns pauses off."""
    import lessons.cli
    import lessons.tui
    from tracer.cli import main as cli
    seen = []
    monkeypatch.setattr(lessons.tui, "run_in_tui", lambda lesson, run: seen.append(lesson.pause_enabled) or 7)
    assert cli(["lesson", "5", "--tui", "--no-pause"]) == 7
    assert lessons.cli.main(vars(module("paged_kv_cache")), ["--tui"]) == 7
    assert seen == [False, True]
