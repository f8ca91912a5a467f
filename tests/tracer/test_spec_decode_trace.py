"""Speculative decoding in the trace: each verification folds into the state (this step's drafts, a
request's acceptance history), the Step panel draws accepted and rejected drafts, and a breakpoint
on event:spec_decode.rejected stops the engine."""
import time

from engine import LLM, Hooks, SamplingParams
from tracer.conditions import parse_condition
from tracer.session import TraceSession
from tracer.tui.widgets.step import drafts_line

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def test_verifications_fold_into_the_state():
    hooks = Hooks()
    session = TraceSession(hooks, control=False, model="tiny-gpt2")
    try:
        llm = LLM("tiny-gpt2", num_kv_blocks=64, hooks=hooks, speculative_config=NGRAM)
        llm.generate({"prompt_token_ids": [5, 6, 7, 8] * 4}, SamplingParams(temperature=0, max_tokens=24),
                     use_tqdm=False)
        deadline = time.monotonic() + 10
        while not (view := session.state.view()).requests.get("0") or not view.requests["0"].finish_reason:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        history = view.requests["0"].spec_history
        stats = llm.llm_engine.engine_core.engine_core.stats()
        assert len(history) == stats.spec_num_drafts
        assert sum(a for _, _, a in history) == stats.spec_num_accepted_tokens
    finally:
        session.close()


def test_the_step_panel_strikes_rejected_drafts():
    line = drafts_line({"draft": [4, 5, 6], "accepted": [4], "rejected": [5, 6], "token": 9, "bonus": False}, 4)
    assert "4 " in line.plain and "→ 9" in line.plain
    struck = [s for s in line.spans if "strike" in str(s.style)]
    assert [line.plain[s.start:s.end] for s in struck] == ["5", "6"]


def test_a_breakpoint_on_a_rejection_stops_the_engine():
    hooks = Hooks()
    session = TraceSession(hooks, model="tiny-gpt2")
    try:
        llm = LLM("tiny-gpt2", num_kv_blocks=64, hooks=hooks, speculative_config=NGRAM)
        session.controller.add_breakpoint(parse_condition("event:spec_decode.rejected"))
        import threading
        done = threading.Event()
        threading.Thread(target=lambda: (llm.generate({"prompt_token_ids": [(5 * j) % 97 for j in range(30)]},
                                                      SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                                      use_tqdm=False), done.set()), daemon=True).start()
        stop = session.controller.wait_until_paused(30)
        assert stop is not None and "rejected" in str(stop.reason)
        session.controller.clear_breakpoints()
        session.controller.resume()
        assert done.wait(60)
    finally:
        session.close()
