"""Speculative decoding with a draft model (tiny-gpt2-draft proposing for tiny-gpt2): greedy output
equals transformers' token for token in every setting, the draft's own KV cache is caught up
after rejections, preemptions and prefix-cache hits, seeded sampled output is reproducible, the
scheduler reserves k lookahead slots, and a draft that does not fit the target is one clear error."""
import json
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.builtin_model import DRAFT_NAME, NAME, RANDOM_NAME, builtin_path
from engine.config import ConfigError
from engine.core.sched.output import SchedulerOutput
from tests.engine.hf_reference import hf_greedy

K = 3
DRAFT = {"method": "draft_model", "model": DRAFT_NAME, "num_speculative_tokens": K}
MAX_NEW = 32
# English-like prompts (the draft was trained on English text: its drafts get accepted), a repetitive
# one, and arbitrary ids (drafts get rejected)
PROMPTS = [[5, 6, 7, 8] * 4, [11, 12, 13] * 5 + [14], [(7 * j + 3) % 250 for j in range(23)], [42] * 3,
           [(5 * j) % 97 for j in range(40)]]


def _greedy(prompts=PROMPTS, **kw):
    llm = LLM(NAME, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    # the worker drops a finished request's draft state when the next step says it finished (V1's
    # finished_req_ids): after one more request only that one's can be left
    [last] = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4),
                          use_tqdm=False)
    assert set(core.model_runner.drafter.states) <= {last.request_id}
    return [o.outputs[0].token_ids for o in outs], stats, core


@pytest.fixture(scope="module")
def want():
    return hf_greedy(str(builtin_path(NAME)), PROMPTS, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("settings", ["default", "preemption", "chunked", "no_prefix_cache"])
def test_greedy_equals_transformers(settings, want):
    kw = {"default": dict(num_kv_blocks=128),
          "preemption": dict(num_kv_blocks=20, block_size=4),
          "chunked": dict(num_kv_blocks=128, max_num_batched_tokens=16, block_size=4),
          "no_prefix_cache": dict(num_kv_blocks=128, enable_prefix_caching=False)}[settings]
    got, stats, _ = _greedy(speculative_config=DRAFT, **kw)
    assert got == want
    assert stats.spec_num_drafts > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_num_draft_tokens <= K * stats.spec_num_drafts
    if settings == "preemption":
        assert stats.num_preemptions > 0


def test_a_kv_cache_too_small_for_the_lookahead_slots_still_serves():
    """3 usable blocks of 4: a 10-token prompt and 2 tokens fit, its 3 lookahead slots do not; the
    draft proposes what the block table holds, and the output is transformers'."""
    prompt = PROMPTS[4][:10]
    engine = LLM(NAME, num_kv_blocks=4, block_size=4, speculative_config=DRAFT).llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    outs = [o for _ in range(10) for o in engine.step() if o.finished]  # a bounded number of steps: no hang
    assert len(outs) == 1, "the request never ran: it waited for lookahead slots that cannot fit"
    assert outs[0].outputs[0].token_ids == hf_greedy(str(builtin_path(NAME)), [prompt], 2)[0]


def test_prefix_cache_hits_recompute_the_draft_cache(want):
    """A request whose prompt hits the prefix cache computes the draft's keys of the hit blocks itself:
    here they were filled by a request that never drafted (max_tokens=1), so the draft cache there
    holds nothing. Outputs stay exact, and it accepts as many drafts as in an engine with an empty cache."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    prompt = [{"prompt_token_ids": PROMPTS[4]}]
    fresh = LLM(NAME, num_kv_blocks=128, block_size=4, speculative_config=DRAFT)
    fresh.generate(prompt, params, use_tqdm=False)
    llm = LLM(NAME, num_kv_blocks=128, block_size=4, speculative_config=DRAFT)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    [out] = llm.generate(prompt, params, use_tqdm=False)
    assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == want[4]
    accepted = [x.llm_engine.engine_core.engine_core.stats().spec_num_accepted_tokens for x in (fresh, llm)]
    assert accepted[0] == accepted[1] > 0


def test_lookahead_slots_and_the_draft_cache_after_a_rejection():
    llm = LLM(NAME, num_kv_blocks=64, block_size=4, speculative_config=DRAFT)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    prompt = [(5 * j) % 97 for j in range(10)]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20))
    req = core.requests["r"]
    sched = core.scheduler.schedule()  # the prefill: its last token is reached, so k slots past it are reserved
    assert len(req.block_ids) * 4 >= len(prompt) + K
    core.model_executor.execute_model(sched)
    out = core.model_executor.sample_tokens(None)
    proposed = core.model_executor.take_draft_token_ids()  # the worker's proposer ran after sampling
    assert proposed.req_ids == ["r"] and core.model_executor.take_draft_token_ids() is None  # taken once
    drafts = proposed.draft_token_ids[0]
    assert len(drafts) == K
    state = core.model_runner.drafter.states["r"]
    assert state.valid == len(prompt) + 1 and state.pending == drafts[:-1]  # 1 sampled token; k - 1 drafts written
    core.scheduler.update_from_output(sched, out)
    core.scheduler.update_draft_token_ids(proposed)
    sched = core.scheduler.schedule()
    assert sched.scheduled_spec_decode_tokens == {"r": drafts} and sched.num_scheduled_tokens == {"r": 1 + K}
    assert len(req.block_ids) * 4 >= req.num_tokens + K + K  # the drafts' slots and the next drafts'
    # force a rejection: the first draft is replaced by a token the target never picks
    sched.scheduled_spec_decode_tokens["r"] = [(drafts[0] + 1) % 4096] + drafts[1:]
    core.model_executor.execute_model(sched)
    out = core.model_executor.sample_tokens(None)
    kept = out.sampled_token_ids[0]
    assert len(kept) == 1  # the target's own token: every draft rejected
    assert state.valid == req.num_tokens + 1  # nothing of the rejected drafts counted as the request's tokens
    core.scheduler.update_from_output(sched, out)
    assert req.num_computed_tokens == req.num_tokens - 1


def test_draft_proposals_match_running_the_draft_model_alone():
    """The drafts equal the greedy continuation of the draft model itself (run by transformers),
    whatever the history of its cache: after rejections, and after a preemption."""
    llm = LLM(NAME, num_kv_blocks=32, block_size=4, speculative_config=DRAFT)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    engine.add_request("r", {"prompt_token_ids": PROMPTS[2]}, SamplingParams(temperature=0, max_tokens=24,
                                                                             ignore_eos=True))
    req = core.requests["r"]
    checked = 0
    while core.has_unfinished_requests():
        if checked == 2 and not req.num_preemptions:  # its blocks are freed, and it starts over
            core.scheduler.running.remove(req)
            core.scheduler._preempt(req, SchedulerOutput(step=-1), reason="a test preempts it")
        sched = core.scheduler.schedule()
        core.model_executor.execute_model(sched)
        core.scheduler.update_from_output(sched, core.model_executor.sample_tokens(None))
        proposed = core.model_executor.take_draft_token_ids()
        if proposed is not None and proposed.req_ids:
            drafts = proposed.draft_token_ids[0]
            assert drafts == hf_greedy(str(builtin_path(DRAFT_NAME)), [list(req.all_token_ids)], len(drafts))[0]
            checked += 1
            core.scheduler.update_draft_token_ids(proposed)
    assert checked >= 4 and req.num_preemptions == 1


@pytest.mark.slow
def test_seeded_sampling_with_a_draft_model_is_reproducible():
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    a = LLM(NAME, num_kv_blocks=64, speculative_config=DRAFT).generate(prompts, params, use_tqdm=False)
    b = LLM(NAME, num_kv_blocks=64, speculative_config=DRAFT).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.slow
def test_two_processes_and_triton_backend_agree(want):
    mp = LLM(NAME, num_kv_blocks=64, speculative_config=DRAFT, multiprocess=True)
    try:
        got = mp.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                          SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want[:2]
    finally:
        mp.shutdown()
    # the Triton kernels run interpreted on a CPU: a short prompt, a few tokens
    llm = LLM(NAME, num_kv_blocks=16, attention_backend="triton", speculative_config=DRAFT)
    got = llm.generate([{"prompt_token_ids": PROMPTS[0][:8]}],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert got[0].outputs[0].token_ids == hf_greedy(str(builtin_path(NAME)), [PROMPTS[0][:8]], 8)[0]
    assert llm.llm_engine.engine_core.engine_core.stats().spec_num_drafts > 0


@pytest.mark.slow
def test_tensor_parallel_draft_model_equals_transformers(want):
    """TP=2: the target sharded over two ranks, the draft whole on rank 0 (whose output is kept)."""
    llm = LLM(NAME, num_kv_blocks=64, tensor_parallel_size=2, speculative_config=DRAFT)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
        stats = llm.llm_engine.engine_core.engine_core.stats()
        assert [o.outputs[0].token_ids for o in outs] == want[:2]
        assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
        assert stats.num_free_blocks == stats.num_total_blocks
        # seeded sampling: the same drafts (rank 0's draft is one rank's draft) and the same draws
        sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
        one = LLM(NAME, num_kv_blocks=64, speculative_config=DRAFT)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)] == \
            [o.outputs[0].token_ids for o in one.generate(prompts, sampled, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_bad_draft_model_configs_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match='needs "model"'):
        LLM(NAME, speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match='"model" is for method "draft_model"'):
        LLM(NAME, speculative_config={"method": "ngram", "model": DRAFT_NAME})
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(NAME, speculative_config={"method": "draft_model", "model": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="vocabulary of 257 tokens.*share the target's tokenizer"):
        LLM(NAME, speculative_config={"method": "draft_model", "model": RANDOM_NAME})
    # the same vocabulary size, another tokenizer: two tokens' ids swapped
    other = tmp_path / "other-tokenizer"
    shutil.copytree(builtin_path(DRAFT_NAME), other)
    (other / "SHA256SUMS").unlink()
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="another tokenizer than the target's"):
        LLM(NAME, speculative_config={"method": "draft_model", "model": str(other)})
    # fewer positions than the target's max_model_len
    short = tmp_path / "short"
    shutil.copytree(builtin_path(DRAFT_NAME), short)
    (short / "SHA256SUMS").unlink()
    cfg = json.loads((short / "config.json").read_text())
    cfg["n_positions"] = 64
    (short / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="set max_model_len <= 64"):
        LLM(NAME, speculative_config={"method": "draft_model", "model": str(short)})


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["json", "regex"])
def test_requests_with_a_grammar_equal_no_speculation(kind, async_scheduling):
    """The draft model proposes for constrained requests too; their grammar cuts what it refuses, and
    greedy output is the same token for token as without speculation. (Under async scheduling the
    worker verifies its drafts in place of the placeholders; the grammar checks them before the step
    samples, V1's update_draft_token_ids_in_output.)"""
    from tests.engine.test_structured_spec_decode import _run

    base, _, _ = _run(kind)
    got, events, _ = _run(kind, speculative_config=DRAFT, async_scheduling=async_scheduling)
    assert got == base
    verified = any(e[:2] == ("spec_decode", "verified") and e[5]["accepted"] for e in events)
    assert verified
