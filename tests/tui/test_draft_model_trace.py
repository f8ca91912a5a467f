"""A draft model in the trace: its proposals are verified in the same spec_decode events as n-gram
drafts, and its kernel launches are named apart (draft:...), in the events and at kernel gates, so
the Kernels panel lists them as their own rows, beside the target's layers, with no access map
borrowed from the target's batch."""
from __future__ import annotations

import pytest

from engine import LLM, Hooks, SamplingParams
from engine.worker.input_batch import INPUT_KERNELS
from tests.tui.helpers import shown
from tracer.replay import Replay
from tracer.session import TraceSession
from tracer.tui.app import TraceApp
from tracer.tui.sources.replay import ReplaySource
from tracer.tui.widgets.kernels import KernelsPanel, ProgramGrid

DRAFT = {"method": "draft_model", "model": "tiny-gpt2-draft", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def draft_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft") / "trace.jsonl"
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=path, control=False, model="tiny-gpt2")
    # synchronous: replay at step k shows step k's launches (async, step k + 1 is under way by then)
    llm = LLM("tiny-gpt2", hooks=hooks, num_kv_blocks=32, speculative_config=DRAFT, async_scheduling=False)
    llm.generate(["The list of the", "Return a new"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    session.close()
    return path


@pytest.mark.slow
@pytest.mark.asyncio
async def test_draft_launches_are_their_own_rows_in_the_kernels_panel(draft_trace):
    replay = Replay.load(draft_trace)
    verified = [e for e in replay.events if e.layer == "spec_decode" and e.name == "verified"]
    assert verified and all(len(e.attrs["draft"]) <= 2 for e in verified)
    step = verified[0].step
    state = replay.goto(step)
    names = [k["name"] for k in state.kernels]
    draft = [n for n in names if n.startswith("draft:")]
    target = [n for n in names if not n.startswith("draft:")]
    # the target's 4 layers write and read its cache; the draft's 2 layers theirs, in each of its k = 2 passes
    assert target.count("reshape_and_cache_ref") == 4 and draft.count("draft:reshape_and_cache_ref") == 2 * 2
    assert draft and names.index(draft[0]) > max(names.index(n) for n in target)  # after the target's pass
    source = ReplaySource.load(draft_trace)
    source.replay.goto(step)
    app = TraceApp(source, initial_pane="kernels")
    async with app.run_test(size=(140, 60)) as pilot:
        app.tick()
        await pilot.pause()
        rows = shown(app.query_one(KernelsPanel).query_one("#kernels-table")).splitlines()
        attention = "cpu_attention_with_kv_cache"  # (a CPU's: verifying drafts is a short query)
        assert any(f"draft:{attention}" in r for r in rows)
        assert any(attention in r and "draft:" not in r for r in rows)
        table = app.query_one("#kernels-table")
        table.move_cursor(row=names.index(f"draft:{attention}"))
        await pilot.pause()
        assert not app.query_one(ProgramGrid).access  # the step's batch is the target's: no map for the draft's


def test_a_kernel_gate_names_the_draft_models_launches():
    """Stepping kernel by kernel (k) reaches the draft's launches after the target's, by their draft: names."""
    hooks = Hooks()
    held = []
    hooks.add_gate(lambda point, info: held.append((info["step"], info["name"])) if point == "kernel" else None)
    llm = LLM("tiny-gpt2", hooks=hooks, num_kv_blocks=16, speculative_config=DRAFT)
    llm.generate(["The list of the"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    first = [name for step, name in held if step == 0]
    assert first[:4] == [f"{k}_ref" for k in INPUT_KERNELS[:4]]  # the target's inputs are built first
    # the target's 4 layers (a short prompt: on a CPU, the C kernel attends)
    assert first[4:12] == ["reshape_and_cache_ref", "cpu_attention_with_kv_cache"] * 4
    assert first[12] == "post_update_ref"  # the target's tokens written back, before the draft proposes from them
    assert first[13:] == ["draft:reshape_and_cache_ref", "draft:cpu_attention_with_kv_cache"] * 4  # 2 layers, 2 passes


@pytest.mark.asyncio
async def test_a_newcomer_sees_the_draft_model_everywhere_and_every_launch(draft_trace):
    """The header and the Startup panel say the engine speculates with a draft model, and why the
    KV cache has fewer blocks (each also holds the draft's keys and values); the Kernels table
    fills the panel, with no `None` for the draft's layers."""
    source = ReplaySource.load(draft_trace)
    step = source.replay.steps[1]
    source.replay.goto(step)
    app = TraceApp(source, initial_pane="kernels")
    async with app.run_test(size=(160, 48)) as pilot:
        app.tick()
        await pilot.pause()
        launches = source.refresh().kernels
        table = app.query_one("#kernels-table")
        assert len(launches) >= 16 and table.size.height >= len(launches) + 1  # a header row, then every launch
        assert "None" not in shown(table)
        assert "spec tiny-gpt2-draft ×2" in app.query_one("#header").text.plain
        await pilot.press("7")
        app.tick()
        await pilot.pause()
        startup = shown(app.query_one("#startup-stages"))
        assert "speculative decoding: draft model tiny-gpt2-draft, up to 2 draft tokens a step" in startup
        assert "for the draft model's cache" in startup and "draft model" in startup.split("parameters", 1)[1]
