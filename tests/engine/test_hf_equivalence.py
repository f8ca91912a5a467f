"""Greedy outputs equal Hugging Face transformers', token for token, whatever the engine does
underneath: batching, preemption, chunked prefill, prefix caching, block sizes. On the trained
built-in tiny-gpt2; the random-weights tiny-gpt2-random (whose greedy outputs vary more) and both
Llama built-ins (tiny-llama, tiny-llama-random: RoPE, GQA) run the default and the
everything-at-once settings too, near-ties excepted (tests/engine/test_llama_family.py has the
Qwen3 and tensor-parallel ones)."""
import random

import pytest

from engine import LLM, SamplingParams
from engine.builtin_model import LLAMA_NAME, LLAMA_RANDOM_NAME, NAME, RANDOM_NAME, builtin_path
from tests.engine.hf_reference import assert_greedy_equal, hf_greedy

MAX_NEW = 24
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def _prompts(shared_prefix: int = 0, n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared_prefix)]
    # lengths 1..~70: single-token prompts, block-size multiples and ragged ones
    lengths = [1, 2, 7, 8, 15, 16, 17, 24, 31, 32, 33, 40, 47, 55, 64, 70][:n]
    return [prefix + [rng.randrange(256) for _ in range(k)] for k in lengths]


TEXT = ("The paged KV cache stores the keys and values of every token in fixed-size blocks. A block table maps "
        "each request's logical blocks to physical ones, so requests grow without copying, and blocks with the "
        "same prefix can be shared. Return a new list containing all items from the iterable in ascending order. "
        "If the file does not exist, a FileNotFoundError is raised and nothing is written.")


@pytest.fixture(scope="module")
def path():
    return str(builtin_path())


def _run(prompts, model=NAME, **llm_kwargs):
    llm = LLM(model, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.engine_core.engine_core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    assert stats.num_waiting == stats.num_running == 0
    return [o.outputs[0].token_ids for o in outs], stats


EVERY_ARCHITECTURE = [NAME, RANDOM_NAME, LLAMA_NAME, LLAMA_RANDOM_NAME]


@pytest.mark.parametrize("model", [NAME, RANDOM_NAME, LLAMA_NAME])
def test_default_settings(model):
    prompts = _prompts()
    got, _ = _run(prompts, model)
    assert_greedy_equal(got, str(builtin_path(model)), prompts, MAX_NEW)


@pytest.mark.slow
def test_english_prompts(path):
    """Real text, as the trained model sees it: prompts are slices of a tokenized paragraph."""
    llm = LLM(NAME, num_kv_blocks=64)
    ids = llm.get_tokenizer().encode(TEXT)
    prompts = [ids[:k] for k in (1, 5, 16, 17, 33, len(ids))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, MAX_NEW)


@ASYNC
def test_preemption(path, async_scheduling):
    prompts = _prompts()
    # 12 blocks of 16 tokens cannot hold 16 requests of up to 94 tokens: requests get preempted
    got, stats = _run(prompts, num_kv_blocks=12, block_size=16, async_scheduling=async_scheduling)
    assert stats.num_preemptions > 0
    assert got == hf_greedy(path, prompts, MAX_NEW)


@ASYNC
def test_chunked_prefill(path, async_scheduling):
    prompts = _prompts()
    got, _ = _run(prompts, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    assert got == hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.slow
@ASYNC
def test_prefix_caching_shared_prefix(path, async_scheduling):
    prompts = _prompts(shared_prefix=48)
    got, stats = _run(prompts, enable_prefix_caching=True, async_scheduling=async_scheduling)
    assert stats.prefix_cache_hits > 0
    assert got == hf_greedy(path, prompts, MAX_NEW)


def test_prefix_caching_across_batches_with_eviction(path):
    """Cached blocks survive their request, are hit by a later batch, and are evicted when
    blocks run short, all without changing outputs."""
    first, second = _prompts(shared_prefix=48, n=4, seed=1), _prompts(shared_prefix=48, n=8, seed=1)
    llm = LLM(NAME, num_kv_blocks=24)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in first], params, use_tqdm=False)
    hits_before = llm.llm_engine.engine_core.engine_core.stats().prefix_cache_hits
    outs = llm.generate([{"prompt_token_ids": p} for p in second], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.engine_core.stats().prefix_cache_hits > hits_before
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, second, MAX_NEW)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(path, block_size):
    prompts = _prompts()
    got, _ = _run(prompts, block_size=block_size)
    assert got == hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("model,async_scheduling", [(m, False) for m in EVERY_ARCHITECTURE] + [(NAME, True),
                                                                                             (LLAMA_NAME, True)])
def test_everything_at_once(model, async_scheduling):
    """Small cache, small token budget, shared prefixes, block size 8 (async scheduling: preemptions
    of requests whose step is in flight)."""
    prompts = _prompts(shared_prefix=20)
    got, stats = _run(prompts, model, block_size=8, num_kv_blocks=30, max_num_batched_tokens=24, max_num_seqs=6,
                      async_scheduling=async_scheduling)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_greedy_equal(got, str(builtin_path(model)), prompts, MAX_NEW)
