"""Structured outputs under speculative decoding (V1's design): a constrained request's drafts are cut
to the prefix its grammar accepts, its bitmask has a row per scored position (the mask the matcher
gives when really advanced through the drafts), and greedy output is the same token for token as
without speculation (and as transformers' argmax under the grammar's mask), in every setting."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import kernels
from engine import LLM, Hooks, SamplingParams, StructuredOutputsParams
from engine.builtin_model import builtin_path
from engine.outputs import DraftTokenIds
from engine.structured_output.backend_xgrammar import XgrammarBackend
from engine.trace_names import DRAFTS_VALIDATED, SPEC_DECODE, STRUCTURED_OUTPUT, VERIFIED
from tests.engine.hf_reference import _cache_kwargs, hf_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}, "tags": {"type": "array",
                                                                              "items": {"type": "string"}}},
          "required": ["color", "n", "ok", "tags"]}
# prompts that repeat what the grammars write, so the n-gram proposer has something to propose
JSON_PROMPT = 'Answers: {"color": "red", "n": 12, "ok": true, "tags": ["a", "b"]} {"color": "red", "n": 1'
REGEX = r"(the |a )+(cat|dog)\.( \d+)?"
CONSTRAINTS = {
    "json": (StructuredOutputsParams(json=SCHEMA), [JSON_PROMPT, JSON_PROMPT + '2, "ok": false}', "JSON:"]),
    "regex": (StructuredOutputsParams(regex=REGEX), ["the the the a the cat. the", "a dog. a dog. a", "x"]),
    "choice": (StructuredOutputsParams(choice=["the red one", "the blue one", "none of them"]),
               ["the red one or the blue one? the", "none of them, none of them", "Pick:"]),
}


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        obj = json.loads(text)
        return obj["color"] in ("red", "green", "blue") and isinstance(obj["n"], int) and isinstance(obj["ok"], bool)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CONSTRAINTS["choice"][0].choice


def _run(kind: str, max_tokens: int = 48, **llm_kwargs):
    """(token ids, finish reasons, texts) of the kind's prompts, greedy; the events it traced. The synchronous
    step unless asked."""
    llm_kwargs.setdefault("async_scheduling", False)
    so, prompts = CONSTRAINTS[kind]
    hooks, events = Hooks(), []
    hooks.subscribe(lambda *e: events.append(e))
    llm = LLM("tiny-gpt2", hooks=hooks, **llm_kwargs)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so),
                            use_tqdm=False)
        core = llm.llm_engine.engine_core.engine_core if not llm_kwargs.get("multiprocess") else None
        if core is not None:
            stats = core.stats()
            assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    finally:
        llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs], events, llm


def hf_masked_greedy(llm: LLM, prompt: str, so: StructuredOutputsParams, max_tokens: int) -> list[int]:
    """transformers' argmax under the grammar's mask, token by token (EOS, the grammar's end, included)."""
    import xgrammar as xgr

    tokenizer = llm.get_tokenizer()
    backend = XgrammarBackend(tokenizer, 4096, tokenizer.eos_token_id)
    matcher = xgr.GrammarMatcher(backend.compile_grammar(so))
    bitmask = xgr.allocate_token_bitmask(1, backend.vocab_size)
    model, out = hf_model(str(builtin_path())), []
    with torch.inference_mode():
        hf = model(torch.tensor([tokenizer.encode(prompt)]), use_cache=True)
        while not matcher.is_terminated() and len(out) < max_tokens:
            logits = hf.logits[0, -1:].clone()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            out.append(int(logits.argmax()))
            assert matcher.accept_token(out[-1])
            hf = model(torch.tensor([out[-1:]]), **_cache_kwargs(model, hf), use_cache=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_with_speculation_equals_without(kind, async_scheduling):
    """Async scheduling (V1's): a constrained request verifies placeholder drafts the worker fills with its
    own; its sampling waits for the step before it, then its grammar checks those drafts (the refused
    ones and all after them are cut) and its bitmask has a row per draft position. Same output."""
    base, _, _ = _run(kind)
    got, events, llm = _run(kind, speculative_config=NGRAM, async_scheduling=async_scheduling)
    assert got == base
    for ids, finish, text in got:
        assert finish == "length" or _valid(kind, text), text
    verified = [e for e in events if e[:2] == (SPEC_DECODE, VERIFIED)]
    assert sum(len(e[5]["accepted"]) for e in verified) > 0, "no draft of a constrained request was accepted"
    checked = [e[5] for e in events if e[:2] == (STRUCTURED_OUTPUT, DRAFTS_VALIDATED)]
    assert checked and all(c["draft"][:len(c["kept"])] == c["kept"] and c["draft"][len(c["kept"]):] == c["cut"]
                           for c in checked)
    if kind == "json":  # the proposer copies the prompt's JSON, which the schema's order and values often refuse
        assert sum(len(c["cut"]) for c in checked) > 0
        so, prompts = CONSTRAINTS[kind]
        ref = LLM("tiny-gpt2")
        assert [ids for ids, _, _ in got] == [hf_masked_greedy(ref, p, so, 48) for p in prompts]


def _engine_with(prompt: str, so: StructuredOutputsParams, **llm_kwargs):
    llm = LLM("tiny-gpt2", speculative_config=NGRAM, **{"async_scheduling": False, **llm_kwargs})
    engine = llm.llm_engine
    engine.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=40, structured_outputs=so))
    core = engine.engine_core.engine_core
    while core.requests["g"].num_output_tokens == 0:
        engine.step()  # the grammar compiles, then the prefill samples the first token
    core.requests["g"].spec_token_ids = []  # the proposer's: the test hands its own drafts in
    return llm, core


def _tokens(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def test_drafts_the_grammar_refuses_are_cut_and_the_matcher_stays():
    """update_draft_token_ids keeps the longest prefix the grammar accepts; the matcher is where it was."""
    llm, core = _engine_with("Say:", StructuredOutputsParams(regex=r"ab+a c"))
    req, sched = core.requests["g"], core.scheduler
    grammar = req.structured_output_request.grammar
    assert llm.get_tokenizer().decode(req.output_token_ids) == "a"  # the regex allows nothing else first
    before = grammar.num_processed_tokens
    b, a, c = _tokens(llm, "b")[0], _tokens(llm, "a")[0], _tokens(llm, " c")[0]
    sched.update_draft_token_ids(DraftTokenIds(["g"], [[b, b, c, a]]))  # " c" may not follow "abb"
    assert req.spec_token_ids == [b, b]
    assert grammar.num_processed_tokens == before and grammar.validate_tokens([b, a, c]) == [b, a, c]
    sched.update_draft_token_ids(DraftTokenIds(["g"], [[c]]))  # refused at once: no drafts at all
    assert req.spec_token_ids == []
    sched.update_draft_token_ids(DraftTokenIds(["g"], [[b, a, c]]))
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"g": [b, a, c]}
    core.model_executor.execute_model(out)
    grammar_output = sched.get_grammar_bitmask(out)
    assert grammar_output.grammar_bitmask.shape[0] == 4
    result = core.model_executor.sample_tokens(grammar_output)
    allowed = sched.grammar_allowed_per_pos["g"]
    sched.update_from_output(out, result)
    kept = result.sampled_token_ids[0]
    assert req.output_token_ids[1:] == kept and grammar.num_processed_tokens == before + len(kept)
    assert req.structured_output_request.num_allowed[-len(kept):] == allowed[:len(kept)]


def test_bitmask_rows_for_draft_positions_are_the_advanced_matchers_masks():
    """Each draft position's row is the mask of a matcher really advanced through the drafts before it;
    the model runner sends each row to that position's logits (Triton kernel = PyTorch reference)."""
    import xgrammar as xgr

    so = StructuredOutputsParams(json=SCHEMA)
    llm, core = _engine_with("JSON:", so)
    engine, sched = llm.llm_engine, core.scheduler
    engine.add_request("p", {"prompt_token_ids": [5, 6, 7, 8] * 3}, SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    g, p = core.requests["g"], core.requests["p"]
    text = llm.get_tokenizer().decode(g.output_token_ids)
    drafts = _tokens(llm, '{"color": "blue", "n"'[len(text):])[:3]
    sched.update_draft_token_ids(DraftTokenIds(["p", "g"], [[5, 6], drafts]))
    assert g.spec_token_ids == drafts and p.spec_token_ids == [5, 6]
    out = sched.schedule()
    assert out.req_ids == ["g", "p"]
    core.model_executor.execute_model(out)
    grammar_output = sched.get_grammar_bitmask(out)
    assert grammar_output.structured_output_request_ids == ["g"]  # its rows start at 0
    rows = grammar_output.grammar_bitmask[:len(drafts) + 1]

    backend = core.structured_output_manager.backend
    matcher = xgr.GrammarMatcher(backend.compile_grammar(so))
    want = xgr.allocate_token_bitmask(len(drafts) + 1, backend.vocab_size)
    for t in g.output_token_ids:
        assert matcher.accept_token(t)
    for j in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(want, j)
        if j < len(drafts):
            assert matcher.accept_token(drafts[j])
    assert np.array_equal(rows, want.numpy())
    assert sched.grammar_allowed_per_pos["g"] == [int(np.unpackbits(r.view(np.uint8)).sum()) for r in want.numpy()]

    runner = core.model_executor.worker.model_runner
    logits = torch.randn(len(drafts) + 1 + 3, backend.vocab_size)  # g's 4 rows, then p's 3
    ref = logits.clone()
    runner.apply_grammar_bitmask(grammar_output, ref, out.req_ids, [drafts, [5, 6]])  # torch: the reference
    tri = logits.clone()
    indices = torch.arange(len(drafts) + 1, dtype=torch.int32)
    kernels.apply_token_bitmask(tri, torch.from_numpy(np.ascontiguousarray(grammar_output.grammar_bitmask)), indices)
    assert torch.equal(ref, tri)
    allowed = torch.from_numpy(np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")[:, :backend.vocab_size])
    assert torch.equal(torch.isinf(ref[:len(drafts) + 1]), allowed == 0)
    assert torch.equal(ref[len(drafts) + 1:], logits[len(drafts) + 1:])  # p has no grammar: untouched
    sched.update_from_output(out, core.model_executor.sample_tokens(grammar_output))


def test_rows_past_a_placeholder_that_is_no_draft_allow_every_token_and_verify_no_draft():
    """Async scheduling (V1's): a -1 ends a request's constrained drafts. Its own row is the mask after
    the drafts before it; the rows after allow every token, and the model runner verifies no draft
    there (num_acceptable_drafts): the row after the drafts it does verify is its bonus position."""
    from engine.worker.model_runner import _acceptable_drafts

    llm, core = _engine_with("Say:", StructuredOutputsParams(regex=r"ab+a c"))
    req, sched = core.requests["g"], core.scheduler
    b = _tokens(llm, "b")[0]
    sched.update_draft_token_ids(DraftTokenIds(["g"], [[b, b, b]]))
    out = sched.schedule()
    out.scheduled_spec_decode_tokens["g"] = [b, -1, -1]  # as update_draft_token_ids_in_output leaves them
    grammar_output = sched.get_grammar_bitmask(out)
    assert grammar_output.num_acceptable_drafts == [1]
    rows = grammar_output.grammar_bitmask
    assert len(rows) == 4 and (rows[2:] == -1).all() and not (rows[:2] == -1).all(axis=1).any()
    assert sched.grammar_allowed_per_pos["g"][2:] == [core.structured_output_manager.vocab_size] * 2
    assert req.structured_output_request.grammar.validate_tokens([b, b]) == [b, b]  # the matcher stayed
    # g computed 3 drafts (rows 0-3), p one (rows 4-5): g verifies the one its rows constrain, row 1 its bonus
    drafts, logits = _acceptable_drafts([[b, b, b], [5]], torch.arange(6.0)[:, None], ["g", "p"], grammar_output)
    assert drafts == [[b], [5]] and logits[:, 0].tolist() == [0, 1, 4, 5]
    core.model_executor.execute_model(out)
    sched.update_from_output(out, core.model_executor.sample_tokens(grammar_output))


@pytest.mark.slow
def test_seeded_sampling_with_speculation_is_the_same_with_async_scheduling_on_and_off():
    """A draft the grammar refuses is never verified, with async scheduling on (the worker computed it) as off
    (never scheduled): the position after the drafts kept is sampled as the bonus token either way."""
    so, prompts = CONSTRAINTS["json"]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=32, structured_outputs=so) for s in range(3)]
    runs = []
    for on in (True, False):
        llm = LLM("tiny-gpt2", speculative_config=NGRAM, async_scheduling=on)
        try:
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]


@pytest.mark.slow
@pytest.mark.parametrize("settings", ["preemption", "chunked"])
def test_preemption_and_chunked_prefill(settings):
    kw = {"preemption": dict(num_kv_blocks=36, block_size=4), "chunked": dict(max_num_batched_tokens=8)}[settings]
    base, _, _ = _run("json")
    got, events, llm = _run("json", speculative_config=NGRAM, **kw)
    assert got == base
    assert any(e[:2] == (SPEC_DECODE, VERIFIED) for e in events)
    if settings == "preemption":
        assert any(e[:2] == ("scheduler", "PREEMPTED") for e in events)


@pytest.mark.slow
def test_two_processes():
    base, _, _ = _run("regex")
    got, events, _ = _run("regex", speculative_config=NGRAM, multiprocess=True)
    assert got == base and any(e[:2] == (SPEC_DECODE, VERIFIED) and e[5]["accepted"] for e in events)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tensor_parallel_ranks_get_a_row_per_draft_position(async_scheduling):
    base, _, _ = _run("json", max_tokens=24)
    got, events, _ = _run("json", max_tokens=24, speculative_config=NGRAM, tensor_parallel_size=2,
                          async_scheduling=async_scheduling)
    assert got == base and any(e[:2] == (SPEC_DECODE, VERIFIED) and e[5]["draft"] for e in events)
