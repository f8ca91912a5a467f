"""The README's picture of the TUI, docs/images/tui.svg, is what the TUI draws now: Textual's own
SVG export of a recorded run of the built-in model (five requests, three at a time), replayed at a
step with requests running and waiting, a running request's detail beside the list. Its
clock and kernel timings are fixed as for the snapshots (tests/tui/recorded.py), so it is the same
picture on every machine. When the TUI changes, `make screenshot` draws it again:

    python -m tests.tui.test_readme_screenshot
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SVG = ROOT / "docs" / "images" / "tui.svg"
SIZE, STEP, SELECTED = (150, 28), 9, "cmpl-2"
PROMPTS = ["The list type", "Return a new list", "If the file does not exist,", "This module provides",
           "The first argument is"]


def record_scene(path: Path) -> Path:
    from engine import LLM, Hooks, SamplingParams
    from tests.tui.recorded import _normalise
    from tracer.session import TraceSession

    raw = path.with_suffix(".raw.jsonl")
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=raw, control=False, model="tiny-gpt2")
    # synchronous: under async scheduling the executor thread's events interleave with the core's in an
    # order that varies from run to run, and the picture needs one order
    engine = LLM("tiny-gpt2", hooks=hooks, max_num_seqs=3, num_kv_blocks=64, device="cpu",
                 attention_backend="torch", async_scheduling=False).llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"cmpl-{i}", prompt, SamplingParams(max_tokens=12 + 4 * i, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    session.close()
    _normalise(raw, path)
    return path


async def render(trace: Path) -> str:
    from tracer.tui.app import TraceApp
    from tracer.tui.sources.replay import ReplaySource

    source = ReplaySource.load(trace)
    source.replay.goto(STEP)
    app = TraceApp(source, initial_pane="requests")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        table = app.query_one("#requests-table")
        table.focus()
        await pilot.press(*["down"] * table.keys.index(SELECTED))  # a running request: its text, its blocks
        await pilot.pause()
        await pilot.pause()
        return app.export_screenshot(title="vllm-trace")


def draw() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(render(record_scene(Path(tmp) / "scene.jsonl")))


def test_the_readme_picture_is_what_the_tui_draws(model_cache):
    assert SVG.exists(), "no docs/images/tui.svg: run `make screenshot`"
    assert draw() == SVG.read_text(), "the TUI draws something else now: run `make screenshot` and look at it"


if __name__ == "__main__":
    SVG.parent.mkdir(parents=True, exist_ok=True)
    SVG.write_text(draw())
    print(f"wrote {SVG.relative_to(ROOT)}", file=sys.stderr)
