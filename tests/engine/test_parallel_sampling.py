"""n > 1 offline: children share the prompt's blocks (reference counts), derive their seeds, and
leave no block behind, also under preemption and chunked prefill."""
from engine import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [(5 * j + 2) % 250 for j in range(24)]}


def test_children_share_the_prompt_blocks_and_free_them():
    llm = LLM("tiny-gpt2", num_kv_blocks=64, block_size=4)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    engine.add_request("p", PROMPT, SamplingParams(n=4, temperature=0.8, seed=0, max_tokens=6))
    engine.step()
    tables = [core.requests[f"{i}_p"].block_ids for i in range(4)]
    shared = tables[0][:24 // 4 - 1]  # the full prompt blocks before the last token's
    assert all(t[:len(shared)] == shared for t in tables)
    assert all(core.kv_cache_manager.block_pool.blocks[b].ref_cnt == 4 for b in shared)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    [out] = outs
    assert out.request_id == "p" and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks


def test_seeded_children_are_reproducible_and_differ():
    llm = LLM("tiny-gpt2", num_kv_blocks=64)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10)
    a = llm.generate(PROMPT, params, use_tqdm=False)[0]
    b = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    # child i draws as a single request with seed 11 + i would
    one = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=12, max_tokens=10), use_tqdm=False)[0]
    assert one.outputs[0].token_ids == a.outputs[1].token_ids


def test_n_under_preemption_and_chunked_prefill_leaks_nothing():
    llm = LLM("tiny-gpt2", num_kv_blocks=14, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True)
    outs = llm.generate([PROMPT, {"prompt_token_ids": [3] * 20}],
                        SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    assert core.scheduler.num_preemptions > 0
    for out in outs:
        assert len(out.outputs) == 3 and all(len(c.token_ids) == 12 for c in out.outputs)
        assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids  # greedy
    bm = core.kv_cache_manager
    assert bm.num_free_blocks == bm.num_usable_blocks and all(b.ref_cnt == 0 for b in bm.block_pool.blocks)


def test_the_trace_knows_each_childs_parent_and_priority():
    from engine import Hooks
    from tracer.session import TraceSession

    hooks = Hooks()
    session = TraceSession(hooks, control=False, model="tiny-gpt2")
    try:
        llm = LLM("tiny-gpt2", num_kv_blocks=64, hooks=hooks)
        llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=2), use_tqdm=False, priority=[3])
        import time
        deadline = time.monotonic() + 10
        while "1_0" not in session.state.view().requests and time.monotonic() < deadline:
            time.sleep(0.02)
        view = session.state.view().requests
        assert view["0_0"].parent_id == view["1_0"].parent_id == "0"
        assert view["1_0"].sibling_ids == ["0_0", "1_0"] and view["0_0"].priority == 3
    finally:
        session.close()
