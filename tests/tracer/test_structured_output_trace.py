"""Structured outputs in the trace: the compile per grammar, the mask per step (how many tokens it
allows, and which when few), the folded state the TUI draws, and event:structured_output.* breakpoints."""
import pytest
from tracer_helpers import start_loop

from engine import LLM, Hooks, SamplingParams, StructuredOutputsParams
from engine.trace_names import BITMASK, DRAFTS_VALIDATED, GRAMMAR_COMPILED, STRUCTURED_OUTPUT
from tracer.conditions import parse_condition
from tracer.session import TraceSession

T = 30


def test_compile_and_masks_are_traced_and_folded():
    hooks, events = Hooks(), []
    hooks.subscribe(lambda *e: events.append(e))
    session = TraceSession(hooks)
    llm = LLM("tiny-gpt2", hooks=hooks)
    try:
        so = StructuredOutputsParams(choice=["yes", "no"])
        out = llm.generate("Is it?", SamplingParams(temperature=0, max_tokens=5, structured_outputs=so),
                           use_tqdm=False)[0]
        rid = out.request_id
        compiled = [e for e in events if e[:2] == (STRUCTURED_OUTPUT, GRAMMAR_COMPILED)]
        assert len(compiled) == 1 and compiled[0][3] == rid
        assert compiled[0][5]["kind"] == "choice" and compiled[0][5]["compile_s"] > 0
        masks = [e[5] for e in events if e[:2] == (STRUCTURED_OUTPUT, BITMASK)]
        assert masks[0]["vocab_size"] == 4096 and masks[0]["num_allowed"][rid] >= 2
        # once the choice is written, the grammar can only end: EOS is the one token allowed
        assert masks[-1]["num_allowed"][rid] == 1 and masks[-1]["allowed"][rid] == ["<|endoftext|>"]
        session.state.update()
        view = session.state.view()
        r = view.requests[rid]
        assert r.grammar == "choice" and r.num_allowed == [m["num_allowed"][rid] for m in masks]
        assert len(r.num_allowed) == len(out.outputs[0].token_ids)
    finally:
        session.close()


def test_waiting_for_fsm_in_the_snapshot_and_the_step_mark():
    from tracer.tui.frame import Frame
    from tracer.tui.widgets.step import batch_table

    hooks = Hooks()
    session = TraceSession(hooks)
    engine = LLM("tiny-gpt2", hooks=hooks).llm_engine
    try:
        engine.add_request("g", "Pick:", SamplingParams(temperature=0, max_tokens=8, structured_outputs=
                                                       StructuredOutputsParams(regex="[ab]{4}")))
        statuses, shown = [], 0
        while engine.has_unfinished_requests():
            engine.step()
            session.state.update()
            view = session.state.view()
            statuses.append(view.requests["g"].status)
            if view.snapshot and (view.grammar_mask or {}).get("step") == view.step:
                text = batch_table(Frame.of(view, {}, 0, None)).renderables[1].plain
                assert "◆ grammar:" in text and "of 4,096 tokens allowed" in text
                shown += 1
        assert shown  # the grammar's mask was in the Step panel
        assert statuses[0] == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR" or "RUNNING" in statuses
    finally:
        session.close()


@pytest.mark.parametrize("text", ["event:structured_output.*", "event:structured_output.bitmask"])
def test_breakpoint_on_structured_output_events(text):
    cond = parse_condition(text)
    assert cond.matches(STRUCTURED_OUTPUT, BITMASK, None)
    assert cond.matches(STRUCTURED_OUTPUT, GRAMMAR_COMPILED, "1") == text.endswith("*")
    hooks = Hooks()
    session = TraceSession(hooks, start_paused=False)
    engine = LLM("tiny-gpt2", hooks=hooks).llm_engine
    ctl = session.controller
    engine.add_request("1", "x", SamplingParams(temperature=0, max_tokens=3,
                                                 structured_outputs=StructuredOutputsParams(choice=["ok"])))
    ctl.add_breakpoint(cond)
    loop = start_loop(engine)
    try:
        stop = ctl.wait_until_paused(T)
        assert stop.reason == f"breakpoint {text}"
        ctl.clear_breakpoints()
        ctl.resume()
        loop.join(T)
    finally:
        session.close()



NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# the proposer copies the prompt's JSON; the schema refuses some of it ("n": 12 where it has no "ok")
CUT_PROMPT = 'Answers: {"color": "red", "n": 12, "ok": true} {"color": "red", "n": 1'
CUT_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "n": {"type": "integer"}},
              "required": ["color", "n"]}


def test_drafts_the_grammar_cut_are_traced_folded_and_drawn():
    """With speculation, the check of a constrained request's drafts is an event (proposed, kept, cut) that
    folds into the state for the step that verifies them, and the Step panel strikes the cut drafts."""
    from tracer.tui.frame import Frame
    from tracer.tui.widgets.step import batch_table

    hooks, events = Hooks(), []
    hooks.subscribe(lambda *e: events.append(e))
    session = TraceSession(hooks)
    engine = LLM("tiny-gpt2", hooks=hooks, speculative_config=NGRAM, async_scheduling=False).llm_engine
    engine.add_request("g", CUT_PROMPT, SamplingParams(temperature=0, max_tokens=30, structured_outputs=
                                                       StructuredOutputsParams(json=CUT_SCHEMA)))
    drawn = {}
    try:
        while engine.has_unfinished_requests():
            engine.step()
            session.state.update()
            view = session.state.view()
            if view.snapshot_step == view.step and view.snapshot.get("scheduled"):
                drawn[view.step] = batch_table(Frame.of(view, {}, 0, None)).renderables[1].plain
    finally:
        session.close()
    checked = [(e[4], e[5]) for e in events if e[:2] == (STRUCTURED_OUTPUT, DRAFTS_VALIDATED)]
    assert all(a["draft"] == a["kept"] + a["cut"] for _, a in checked)
    step, cut = next((s, a) for s, a in checked if a["cut"])
    assert "the grammar cut" in drawn[step] and " ".join(map(str, cut["cut"])) in drawn[step]
    assert not any("the grammar cut" in text for s, text in drawn.items() if s not in {s for s, a in checked
                                                                                       if a["cut"]})


def test_breakpoint_on_the_drafts_check():
    hooks = Hooks()
    session = TraceSession(hooks, start_paused=False)
    engine = LLM("tiny-gpt2", hooks=hooks, speculative_config=NGRAM, async_scheduling=False).llm_engine
    ctl = session.controller
    engine.add_request("g", CUT_PROMPT, SamplingParams(temperature=0, max_tokens=20, structured_outputs=
                                                       StructuredOutputsParams(json=CUT_SCHEMA)))
    ctl.add_breakpoint(parse_condition("event:structured_output.drafts_validated"))
    loop = start_loop(engine)
    try:
        stop = ctl.wait_until_paused(T)
        assert stop.reason == "breakpoint event:structured_output.drafts_validated"
        ctl.clear_breakpoints()
        ctl.resume()
        loop.join(T)
    finally:
        session.close()
