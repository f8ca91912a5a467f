"""POST /reset_prefix_cache (both modes: in the engine-core process it is a utility call):
the same prompt hits the prefix cache before the reset, misses after it; refused (409) while a
request holds blocks, and the cache is then untouched."""
from __future__ import annotations

from engine import LLM, SamplingParams
from engine.core.kv_cache_manager import KVCacheManager
from engine.request import Request

PROMPT = "The first argument is the name of the file that the module reads. " * 3  # several full blocks
JSON = {"Content-Type": "application/json"}


def hits_of(http, live) -> int:
    before = live.stats().prefix_cache_hits
    r = http.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return live.stats().prefix_cache_hits - before


def test_reset_makes_the_next_prompt_miss(http, live):
    hits_of(http, live)
    assert hits_of(http, live) > 0  # the second time, its full blocks are cached
    r = http.post("/reset_prefix_cache", json={}, headers=JSON)
    assert r.status_code == 200 and r.json() == {"reset": True}, r.text
    assert hits_of(http, live) == 0
    assert hits_of(http, live) > 0  # and it caches again


def test_reset_from_a_web_page_needs_a_json_body(http):
    r = http.post("/reset_prefix_cache", headers={"Origin": "http://evil.example"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "json_required"
    assert http.post("/reset_prefix_cache").status_code == 200  # curl -X POST, as on vLLM


def test_the_kv_cache_manager_refuses_while_a_request_holds_blocks():
    bm = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    req = Request("a", None, list(range(9)), SamplingParams(max_tokens=1), None, 1)
    assert bm.allocate_slots(req, 9)
    assert len(bm.block_pool.cached_block_hash_to_block) == 2  # its two full blocks
    assert bm.reset_prefix_cache() is False and len(bm.block_pool.cached_block_hash_to_block) == 2
    bm.free(req)
    assert bm.reset_prefix_cache() is True
    assert not bm.block_pool.cached_block_hash_to_block and all(b.block_hash is None for b in bm.block_pool.blocks)
    again = Request("b", None, list(range(9)), SamplingParams(max_tokens=1), None, 1)
    assert bm.get_computed_blocks(again) == (([],), 0)


def test_llm_reset_prefix_cache(model_cache):
    llm = LLM("tiny-gpt2", num_kv_blocks=32, block_size=4)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(PROMPT, params, use_tqdm=False)
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].num_cached_tokens == 0
