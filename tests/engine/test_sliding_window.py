"""Sliding-window models give transformers' greedy outputs on prompts and generations longer than
the window, near-ties excepted: random tiny checkpoints saved by transformers, Mistral (a 12-token
window on every layer: one sliding-window KV-cache group), Ministral (sliding-window and
full-attention layers alternating: a hybrid cache of two groups over one block pool) and Gemma 3
(three local layers to one global, its norms, scales and two RoPE bases: four groups), on the torch
and Triton backends, under preemption, chunked prefill and prefix caching, over two
tensor-parallel ranks and with the core in its own process. And the engine's state: a request
holds no more than its window's blocks in a sliding-window group, so more requests run at once
than with full attention on the same cache."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams, UnsupportedCheckpointError
from engine.builtin_model import write_byte_tokenizer
from engine.core.block_pool import NULL_BLOCK_ID
from tests.engine.hf_reference import assert_greedy_equal
from tests.engine.test_hf_equivalence import _prompts

MAX_NEW = 16
WINDOW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# Room for every request at once (12 requests of up to 63 tokens: at most 16 blocks of 4 per group, four
# groups in Gemma 3): no preemption, as with the default 256 MiB cache, which holds ~100,000 blocks of these
# tiny models and costs each engine seconds to build its block pool and to free it again.
ROOMY = 1024
COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256, eos_token_id=256,
              initializer_range=0.25, sliding_window=WINDOW, tie_word_embeddings=False)


def _save(path, model) -> str:
    model.save_pretrained(path)
    write_byte_tokenizer(path, 256)
    return str(path)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return _save(tmp_path_factory.mktemp("mistral"), MistralForCausalLM(MistralConfig(**COMMON)))


@pytest.fixture(scope="module")
def ministral(tmp_path_factory):
    from transformers import MinistralConfig, MinistralForCausalLM

    torch.manual_seed(1)
    cfg = MinistralConfig(**COMMON | dict(num_hidden_layers=4, head_dim=8),
                          layer_types=["sliding_attention", "full_attention"] * 2)
    return _save(tmp_path_factory.mktemp("ministral"), MinistralForCausalLM(cfg))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(2)
    cfg = Gemma3TextConfig(**COMMON | dict(num_hidden_layers=4, num_attention_heads=4, head_dim=16, pad_token_id=0,
                                           tie_word_embeddings=True),
                           query_pre_attn_scalar=24,
                           layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"])
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # its norms start at 0 (a factor of 1 + 0): random ones show they are read
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.5)
    return _save(tmp_path_factory.mktemp("gemma3"), model)


def _generate(path, prompts, **kwargs):
    llm = LLM(path, dtype="float32", **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = llm.llm_engine.engine_core.engine_core.stats() if not kwargs.get("multiprocess") else None
        assert stats is None or stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.shutdown()


ARCHS = ["mistral", "ministral", "gemma3"]
HYBRID = ["ministral", "gemma3"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_torch_backend_equals_transformers(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=12)  # up to 47 tokens, + 16 generated: far past the 12-token window
    got, stats = _generate(path, prompts, block_size=4, num_kv_blocks=ROOMY)
    assert stats.num_preemptions == 0
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.parametrize("arch,num_kv_blocks", [("mistral", 16), ("ministral", 40), ("gemma3", 64)])
def test_preemption_equals_transformers(arch, num_kv_blocks, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=12)
    got, stats = _generate(path, prompts, block_size=4, num_kv_blocks=num_kv_blocks)
    assert stats.num_preemptions > 0
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_transformers(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=12)
    got, stats = _generate(path, prompts, block_size=4, max_num_batched_tokens=10, num_kv_blocks=ROOMY)
    assert stats.num_preemptions == 0
    assert_greedy_equal(got, path, prompts, MAX_NEW)


def test_async_scheduling_hybrid_equals_transformers(ministral):
    prompts = _prompts(n=8)  # a step in flight still reads its window: blocks go back a step later
    got, stats = _generate(ministral, prompts, block_size=4, max_num_batched_tokens=10, async_scheduling=True,
                           num_kv_blocks=ROOMY)
    assert stats.num_preemptions == 0
    assert_greedy_equal(got, ministral, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_equals_transformers(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(shared_prefix=30, n=8, seed=3)
    got, stats = _generate(path, prompts, block_size=4, enable_prefix_caching=True, max_num_seqs=2,
                           num_kv_blocks=ROOMY)
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions == 0
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_triton_backend_equals_transformers(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=5)[2:]  # interpreted kernels: a few prompts, 7 to 15 tokens + 16 generated
    got, _ = _generate(path, prompts, attention_backend="triton", block_size=4, num_kv_blocks=64)
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("arch,num_kv_blocks", [("ministral", 40), ("gemma3", 64)])
def test_tensor_parallel_hybrid_equals_transformers(arch, num_kv_blocks, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=8)
    got, stats = _generate(path, prompts, tensor_parallel_size=2, block_size=4, num_kv_blocks=num_kv_blocks)
    assert stats.num_preemptions > 0
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRID)
def test_core_process_hybrid_equals_transformers(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=8)
    got, _ = _generate(path, prompts, block_size=4, multiprocess=True, num_kv_blocks=ROOMY)
    assert_greedy_equal(got, path, prompts, MAX_NEW)


def _full_attention_copy(path, tmp_path) -> str:
    """The same checkpoint with no window: full attention on every layer."""
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _max_running(path, kv_cache_memory: int, check=None) -> int:
    """Run 6 requests of 40-token prompts and 40 tokens each; the most that ran in one step."""
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=kv_cache_memory, max_num_batched_tokens=8)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        engine.add_request(str(i), {"prompt_token_ids": [(7 * i + j) % 256 for j in range(40)]}, params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(core.scheduler.running))
        if check:
            check(core)
    llm.shutdown()
    return most


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_a_window_holds_its_blocks_only_and_more_requests_fit(arch, request, tmp_path):
    path = request.getfixturevalue(arch)
    bound = -(-WINDOW // 4) + 1  # ceil(window / block_size) + 1

    def check(core):
        groups = core.kv_cache_manager.kv_cache_groups
        for req in core.scheduler.running:
            for g, blocks in zip(groups, req.kv_block_ids):
                held = sum(b != NULL_BLOCK_ID for b in blocks)
                if g.kv_cache_spec.sliding_window:
                    assert held <= bound, f"{req.request_id} holds {held} blocks of a {WINDOW}-token window"
                else:
                    assert held == len(blocks) == -(-req.num_computed_tokens // 4)

    # the same bytes: 48 blocks of the full-attention model (a hybrid block holds fewer layers: more blocks)
    layers, head_dim = {"mistral": (2, 8), "ministral": (4, 8), "gemma3": (4, 16)}[arch]
    memory = 48 * 2 * layers * 4 * COMMON["num_key_value_heads"] * head_dim * 4  # K/V, layers, tokens, heads, fp32
    windowed = _max_running(path, memory, check)
    full = _max_running(_full_attention_copy(path, tmp_path), memory)
    assert windowed > full, f"the window let {windowed} run at once, full attention {full}"


def test_mistral_layer_types_are_refused(mistral, tmp_path):
    shutil.copytree(mistral, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match="ignores layer_types.*MinistralForCausalLM"):
        LLM(str(tmp_path))


def test_gemma3_asks_for_what_is_missing(gemma3, tmp_path):
    shutil.copytree(gemma3, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["final_logit_softcapping"] = 30.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match="final_logit_softcapping=30.0 is not supported"):
        LLM(str(tmp_path))
