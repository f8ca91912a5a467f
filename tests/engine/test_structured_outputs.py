"""Structured outputs in the engine core: requests wait as WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
while their grammar compiles; the mask decides every token (greedy = transformers' argmax under the
same mask); a matcher survives preemption and chunked prefill; bad grammars are refused before they
are queued."""
from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from engine import LLM, SamplingParams, SamplingParamsError, StructuredOutputsParams
from engine.builtin_model import builtin_path
from engine.engine.core_types import EngineCoreRequest
from engine.request import RequestStatus
from tests.engine.hf_reference import _cache_kwargs, hf_model

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["color", "n", "ok"]}
PROMPT = "The answer, as JSON:"


def _params(so: StructuredOutputsParams, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 40, **kw}, structured_outputs=so)


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def test_offline_choice_and_regex_are_respected():
    llm = LLM("tiny-gpt2")
    choices = ["red", "green", "dark blue"]
    outs = llm.generate([PROMPT] * 4, [_params(StructuredOutputsParams(choice=choices), temperature=0.9, seed=s)
                                       for s in range(4)], use_tqdm=False)
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outs)
    out = llm.generate(PROMPT, _params(StructuredOutputsParams(regex=r"\d{3}-[a-z]{2,4}")), use_tqdm=False)[0]
    assert re.fullmatch(r"\d{3}-[a-z]{2,4}", out.outputs[0].text)


def test_greedy_under_a_schema_is_the_masked_model_argmax():
    """Token by token, transformers' logits with the same grammar's mask give the engine's choice."""
    import xgrammar as xgr

    llm = LLM("tiny-gpt2")
    out = llm.generate(PROMPT, _params(StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    obj = json.loads(out.text)
    assert obj["color"] in ("red", "green", "blue") and isinstance(obj["n"], int) and isinstance(obj["ok"], bool)

    backend = _core(llm).structured_output_manager.backend
    matcher = xgr.GrammarMatcher(backend.compile_grammar(StructuredOutputsParams(json=SCHEMA)))
    bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    model, ids, expected = hf_model(str(builtin_path())), llm.get_tokenizer().encode(PROMPT), []
    with torch.inference_mode():
        hf = model(torch.tensor([ids]), use_cache=True)
        while not matcher.is_terminated():
            logits = hf.logits[0, -1:].clone()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            expected.append(int(logits.argmax()))
            assert matcher.accept_token(expected[-1])
            hf = model(torch.tensor([expected[-1:]]), **_cache_kwargs(model, hf), use_cache=True)
    assert out.token_ids == expected  # EOS (the grammar's end) included


def test_unconstrained_requests_in_the_batch_are_unchanged():
    llm = LLM("tiny-gpt2")
    plain = SamplingParams(temperature=0, max_tokens=20)
    alone = [o.outputs[0].token_ids for o in llm.generate(["Hello there", "Once upon"], plain, use_tqdm=False)]
    mixed = llm.generate(["Hello there", PROMPT, "Once upon"],
                         [plain, _params(StructuredOutputsParams(json=SCHEMA)), plain], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_waits_as_waiting_for_fsm_while_compiling(monkeypatch):
    llm = LLM("tiny-gpt2")
    core = _core(llm)
    mgr = core.structured_output_manager
    release, compile_ = threading.Event(), mgr._compile
    monkeypatch.setattr(mgr, "_compile", lambda params: (release.wait(30), compile_(params))[1])
    core.add_request(EngineCoreRequest("g", llm.get_tokenizer().encode(PROMPT), _params(
        StructuredOutputsParams(choice=["yes", "no"])), 0.0))
    core.add_request(EngineCoreRequest("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3), 0.0))
    for _ in range(2):
        core.step()
        snap = core.snapshot()
        assert [r["status"] for r in snap["waiting"]] == ["WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"]
        assert core.requests["g"].status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    sched = core.scheduler.schedule()  # the plain request runs meanwhile; the other waits, and says why
    assert sched.req_ids == ["plain"] and "grammar" in sched.waiting_reasons["g"]
    core.model_executor.execute_model(sched)
    grammar_output = core.scheduler.get_grammar_bitmask(sched)
    core.scheduler.update_from_output(sched, core.model_executor.sample_tokens(grammar_output))
    release.set()
    text = []
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            if o.request_id == "g":
                text += o.new_token_ids
    assert llm.get_tokenizer().decode(text, skip_special_tokens=True) in ("yes", "no")


def test_compile_failure_in_the_core_finishes_the_request(monkeypatch):
    llm = LLM("tiny-gpt2")
    core = _core(llm)

    def fail(params):
        raise RuntimeError("no such grammar")

    monkeypatch.setattr(core.structured_output_manager, "_compile", fail)
    core.add_request(EngineCoreRequest("bad", [1, 2], _params(StructuredOutputsParams(regex="a+")), 0.0))
    outs = []
    for _ in range(5):
        outs += core.step().outputs
        if outs:
            break
    assert outs[0].finish_reason == "abort" and "no such grammar" in outs[0].stop_reason
    assert not core.has_unfinished_requests()


@pytest.mark.parametrize("so", [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "intger"}}}),
    StructuredOutputsParams(regex="(a"), StructuredOutputsParams(grammar="root ::= nope"),
    StructuredOutputsParams(json="{not json")])
def test_bad_grammars_are_refused_before_queueing(so):
    llm = LLM("tiny-gpt2")
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        llm.generate(PROMPT, _params(so), use_tqdm=False)
    assert not _core(llm).has_unfinished_requests()


def test_params_need_exactly_one_constraint():
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(SamplingParamsError, match="choice"):
        StructuredOutputsParams(choice=[])


def _greedy_json(**llm_kwargs):
    llm = LLM("tiny-gpt2", **llm_kwargs)
    prompts = [PROMPT + " " + "word " * k for k in range(4)]
    outs = llm.generate(prompts, _params(StructuredOutputsParams(json=SCHEMA), max_tokens=40), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs], _core(llm)


@pytest.mark.slow
def test_matchers_survive_preemption_and_chunked_prefill():
    reference, _ = _greedy_json()
    preempted, core = _greedy_json(num_kv_blocks=20, block_size=4)
    assert core.scheduler.num_preemptions > 0
    chunked, _ = _greedy_json(max_num_batched_tokens=8)
    assert preempted == reference and chunked == reference
    for _, finish, text in reference:
        assert text.startswith('{"color": "')
        if finish == "stop":
            json.loads(text)


@pytest.mark.slow
def test_tensor_parallel_ranks_get_the_mask():
    """With two ranks the bitmask crosses to the workers with the step: rank 0 applies it."""
    p = _params(StructuredOutputsParams(json=SCHEMA), max_tokens=30)
    one = [o.outputs[0].token_ids for o in LLM("tiny-gpt2").generate(["JSON:", "x"], p, use_tqdm=False)]
    two = LLM("tiny-gpt2", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(["JSON:", "x"], p, use_tqdm=False)] == one
    finally:
        two.shutdown()

