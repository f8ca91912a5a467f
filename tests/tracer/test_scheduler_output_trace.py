"""The Step panel shows the SchedulerOutput as sent: who came whole, who as a diff, its bytes, the worker's slots."""
from engine import LLM, Hooks, SamplingParams
from tracer.session import TraceSession
from tracer.tui.frame import Frame
from tracer.tui.widgets.step import decisions


def test_the_step_panel_shows_the_diff_and_the_slots():
    hooks = Hooks()
    session = TraceSession(hooks)
    engine = LLM("tiny-gpt2", hooks=hooks, async_scheduling=False).llm_engine  # one whole step per call
    try:
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3))
        texts = []
        for _ in range(2):
            engine.step()
            session.state.update()
            texts.append("\n".join(t.plain for t in decisions(Frame.of(session.state.view(), {}, 0, None)).renderables))
        assert "new (whole): a; cached (diff): none" in texts[0] and "worker slots: a → 0" in texts[0]
        assert "new (whole): none; cached (diff): a" in texts[1] and " bytes; " in texts[1]
    finally:
        session.close()
