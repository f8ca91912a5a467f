"""Speculative decoding (n-gram proposals, V1's rejection rule): greedy output equals transformers'
token for token in every setting, seeded sampled output is reproducible, no block leaks, and the
scheduler's lookahead slots and the rollback of rejected drafts are what V1 does."""
import pytest

from engine import LLM, SamplingParams
from engine.builtin_model import NAME, RANDOM_NAME, builtin_path
from engine.config import ConfigError
from engine.outputs import DraftTokenIds
from tests.engine.hf_reference import hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
MAX_NEW = 32
# repetitive prompts give the proposer matches; random ones test rejections
PROMPTS = [[5, 6, 7, 8] * 4, [11, 12, 13] * 5 + [14], [(7 * j + 3) % 250 for j in range(23)], [42] * 3,
           [(5 * j) % 97 for j in range(40)]]


def _greedy(model=NAME, prompts=PROMPTS, **kw):
    llm = LLM(model, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("model, settings", [(NAME, "default"), (NAME, "preemption"), (NAME, "chunked"),
                                             (NAME, "no_prefix_cache"), (RANDOM_NAME, "default"),
                                             (RANDOM_NAME, "preemption")])
def test_greedy_equals_transformers(model, settings):
    kw = {"default": dict(num_kv_blocks=128),
          "preemption": dict(num_kv_blocks=20, block_size=4),
          "chunked": dict(num_kv_blocks=128, max_num_batched_tokens=16, block_size=4),
          "no_prefix_cache": dict(num_kv_blocks=128, enable_prefix_caching=False)}[settings]
    got, stats = _greedy(model, speculative_config=NGRAM, **kw)
    assert got == hf_greedy(str(builtin_path(model)), PROMPTS, MAX_NEW)
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    if settings == "preemption":
        assert stats.num_preemptions > 0


def test_drafts_are_verified_in_one_step_with_lookahead_slots():
    # the synchronous step's hand-offs (async scheduling keeps drafts on the worker)
    llm = LLM(NAME, num_kv_blocks=64, block_size=4, speculative_config=NGRAM, async_scheduling=False)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8] * 3}, SamplingParams(temperature=0, max_tokens=20))
    engine.step()  # the prefill
    req = core.requests["r"]
    drafts = [5, 6, 7]
    core.scheduler.update_draft_token_ids(DraftTokenIds(["r"], [drafts]))  # as the worker's proposer would
    sched = core.scheduler.schedule()
    assert sched.num_scheduled_tokens == {"r": 4}  # the last token + 3 drafts
    assert sched.scheduled_spec_decode_tokens == {"r": drafts}
    assert len(req.block_ids) * 4 >= req.num_computed_tokens  # slots for the drafts, allocated ahead
    assert core.model_executor.execute_model(sched) is None  # the forward pass; sampling is the next call
    out = core.model_executor.sample_tokens(core.scheduler.get_grammar_bitmask(sched))
    before = req.num_tokens
    core.scheduler.update_from_output(sched, out)
    kept = out.sampled_token_ids[out.req_id_to_index["r"]]
    assert req.num_tokens == before + len(kept)
    assert req.num_computed_tokens == req.num_tokens - 1  # rejected drafts' slots are simply rewritten later


def test_seeded_sampling_with_speculation_is_reproducible():
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    a = LLM(NAME, num_kv_blocks=64, speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    b = LLM(NAME, num_kv_blocks=64, speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.slow
def test_two_processes_and_triton_backend_agree():
    want, _ = _greedy(num_kv_blocks=64, prompts=PROMPTS[:2])
    mp = LLM(NAME, num_kv_blocks=64, speculative_config=NGRAM, multiprocess=True)
    try:
        got = mp.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                          SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    finally:
        mp.shutdown()
    plain, _ = _greedy(num_kv_blocks=64, prompts=[PROMPTS[0][:8]])
    got, stats = _greedy(num_kv_blocks=64, prompts=[PROMPTS[0][:8]], attention_backend="triton",
                         speculative_config=NGRAM)
    assert got == plain and stats.spec_num_drafts > 0


def test_bad_speculative_configs_are_one_clear_error():
    with pytest.raises(ConfigError, match="method must be one of"):
        LLM(NAME, speculative_config={"method": "eagle9"})
    with pytest.raises(ConfigError, match="unknown key"):
        LLM(NAME, speculative_config={"method": "ngram", "k": 3})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(NAME, speculative_config={"method": "ngram", "num_speculative_tokens": 0})


@pytest.mark.slow
def test_tensor_parallel_speculation_equals_one_rank():
    """TP=2: every rank scores the drafts and runs the rejection sampler with the same draws; the output
    is rank 0's, and greedy tokens equal one rank's without speculation."""
    want, _ = _greedy(num_kv_blocks=64, prompts=PROMPTS[:2])
    llm = LLM(NAME, num_kv_blocks=64, tensor_parallel_size=2, speculative_config=NGRAM)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                            SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
        stats = llm.llm_engine.engine_core.engine_core.stats()
        assert [o.outputs[0].token_ids for o in outs] == want and stats.spec_num_drafts > 0
        assert stats.num_free_blocks == stats.num_total_blocks
        sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
        one = LLM(NAME, num_kv_blocks=64, speculative_config=NGRAM)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)] == \
            [o.outputs[0].token_ids for o in one.generate(prompts, sampled, use_tqdm=False)]  # the same draws
    finally:
        llm.shutdown()
