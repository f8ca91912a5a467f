"""OffloadingConnector (--kv-offloading-size): a prefix the device pool has evicted is found in host
memory and loaded back, layer by layer, instead of computed; the output is unchanged (a plain
instance's and transformers'), sync and async scheduling. The host tier evicts its least recently
used blocks when full."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.builtin_model import LLAMA_NAME, NAME, builtin_path
from engine.config import ConfigError
from engine.hooks import Hooks
from engine.trace_names import KV_LOAD, KV_SAVE, KV_TRANSFER
from tests.engine.hf_reference import assert_greedy_equal

BLOCK = 16
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
NUM_BLOCKS = 7  # 6 usable: one 40-token request at a time, each evicting the one before


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(46)
    return [[rng.randrange(256) for _ in range(40)] for _ in range(n)]


def _llm(model: str, events: list, **kwargs) -> LLM:
    hooks = Hooks()
    hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((name, rid, attrs))
                    if layer == KV_TRANSFER else None)
    return LLM(model, hooks=hooks, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, **kwargs)


def _one(llm: LLM, prompt: list[int]):
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("model", [NAME, LLAMA_NAME])
def test_an_evicted_prefix_is_loaded_back_from_host_memory(model, async_scheduling):
    a, *others = _prompts(5)
    events = []
    llm = _llm(model, events, kv_offloading_size=0.01, async_scheduling=async_scheduling)
    core = llm.llm_engine.engine_core.engine_core
    assert core.scheduler.connector.num_cpu_blocks == core.model_runner.kv_connector.num_cpu_blocks > 4
    first = _one(llm, a)
    for p in others:  # each takes the device's blocks: a's are evicted from the device's prefix cache
        _one(llm, p)
    events.clear()
    again = _one(llm, a)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32  # two full blocks, both from host
    loads = [(rid, attrs) for name, rid, attrs in events if name == KV_LOAD]
    assert [len(attrs["block_ids"]) for _, attrs in loads] == [2] and loads[0][0] == again.request_id
    assert core.kv_cache_manager.prefix_cache_hits == 0  # none of it from the device's own cache
    plain = LLM(model, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, enable_prefix_caching=False)
    want = _one(plain, a).outputs[0].token_ids
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
    assert_greedy_equal([again.outputs[0].token_ids], str(builtin_path(model)), [a], MAX_NEW)


def test_the_host_tier_evicts_its_least_recently_used_blocks():
    prompts = _prompts(4)
    events = []
    llm = _llm(NAME, events, kv_offloading_size=4 * 65536 / 2 ** 30)  # four blocks of tiny-gpt2
    assert llm.llm_engine.engine_core.engine_core.scheduler.connector.num_cpu_blocks == 4
    for p in prompts[:3]:  # 2 blocks each: the third evicts the first's
        _one(llm, p)
    assert [len(a["block_ids"]) for name, _, a in events if name == KV_SAVE] == [2, 2, 2]
    assert llm.reset_prefix_cache()  # the device's tier empty: what hits is the host's
    assert _one(llm, prompts[0]).num_cached_tokens == 0  # evicted from host memory too
    assert _one(llm, prompts[2]).num_cached_tokens == 32  # still in host memory


def test_offloading_settings_errors():
    with pytest.raises(ConfigError, match="kv_offloading_size must be > 0 GiB"):
        LLM(NAME, kv_offloading_size=0)
    with pytest.raises(ConfigError, match="not both"):
        LLM(NAME, kv_offloading_size=1, kv_transfer_config={"kv_connector": "ExampleConnector"})
    with pytest.raises(ValueError, match="holds no block"):
        LLM(NAME, kv_offloading_size=1e-9)


def test_multi_connector_loads_from_files_then_from_host_memory(tmp_path):
    """MultiConnector [OffloadingConnector, ExampleConnector]: a prompt another instance saved to files is
    loaded from them; evicted from the device, it is then loaded from host memory (the first that has it)."""
    a, *others = _prompts(5)
    example = {"kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    LLM(NAME, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, kv_transfer_config=example).generate(
        [{"prompt_token_ids": a}], GREEDY, use_tqdm=False)  # the files
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes": 16 * 65536}}, example]}}
    events = []
    llm = _llm(NAME, events, kv_transfer_config=multi)
    first = _one(llm, a)
    for p in others:
        _one(llm, p)
    again = _one(llm, a)
    loads = [(rid, attrs["connector"], len(attrs["block_ids"])) for name, rid, attrs in events if name == KV_LOAD]
    assert loads == [(first.request_id, "ExampleConnector", 2), (again.request_id, "OffloadingConnector", 2)]
    assert first.num_cached_tokens == again.num_cached_tokens == 32
    want = LLM(NAME, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK).generate([{"prompt_token_ids": a}], GREEDY,
                                                                          use_tqdm=False)[0].outputs[0].token_ids
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
