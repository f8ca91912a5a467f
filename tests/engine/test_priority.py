"""Priority scheduling (vLLM V1's --scheduling-policy priority): lower first, ties by arrival; the
preemption victim is the largest (priority, arrival)."""
import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError


def _finish_order(llm: LLM, priorities: list[int], max_tokens: int = 3) -> list[int]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(priorities):
        engine.add_request(f"p{p}-{i}", {"prompt_token_ids": [5 + i, 6, 7]}, params, priority=p)
    order = []
    while engine.has_unfinished_requests():
        order += [int(o.request_id[1:].split("-")[0]) for o in engine.step() if o.finished]
    return order


def test_priority_orders_the_waiting_queue():
    llm = LLM("tiny-gpt2-random", num_kv_blocks=32, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    assert _finish_order(llm, [5, 1, 3, 0, 4]) == [0, 1, 3, 4, 5]
    waiting = llm.llm_engine.engine_core.engine_core.scheduler.waiting
    assert not waiting


def test_fcfs_ignores_priority():
    llm = LLM("tiny-gpt2-random", num_kv_blocks=32, block_size=4, max_num_seqs=1)
    assert _finish_order(llm, [5, 1, 3, 0, 4]) == [5, 1, 3, 0, 4]


def test_ties_keep_arrival_order():
    llm = LLM("tiny-gpt2-random", num_kv_blocks=32, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for rid, p in [("a", 1), ("b", 0), ("c", 1), ("d", 0)]:
        engine.add_request(rid, {"prompt_token_ids": [3, 4]}, params, priority=p)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["b", "d", "a", "c"]


def test_preemption_takes_the_lowest_priority():
    """Three requests fill a 6-block cache; when one needs a block, the victim is the one with
    the largest priority value, not the most recently admitted one (FCFS's victim)."""
    llm = LLM("tiny-gpt2-random", num_kv_blocks=7, block_size=4, max_num_seqs=3, scheduling_policy="priority",
              enable_prefix_caching=False)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("low", {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}, params, priority=9)
    engine.step()  # "low" runs first: admitted before the others, FCFS would preempt "mid", the newest
    for rid, p in [("high", 0), ("mid", 5)]:
        engine.add_request(rid, {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7]}, params, priority=p)
    preempted = []
    while engine.has_unfinished_requests():
        engine.step()
        preempted += [r.request_id for r in core.scheduler.waiting if r.num_preemptions and
                      r.request_id not in preempted]
    assert preempted and preempted[0] == "low"
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks


def test_bad_policy_and_priority_are_refused():
    with pytest.raises(ConfigError, match="scheduling_policy must be one of"):
        LLM("tiny-gpt2-random", scheduling_policy="lottery")
    llm = LLM("tiny-gpt2-random", num_kv_blocks=16)
    with pytest.raises(ValueError, match="priority must be one per prompt"):
        llm.generate(["a", "b"], priority=[1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate(["a"], priority=["high"])
