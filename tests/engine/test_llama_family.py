"""Llama and Qwen3 (RoPE, grouped-query attention, RMSNorm, SwiGLU) give transformers' greedy
outputs, near-ties excepted: random tiny checkpoints built and saved by transformers itself
(8 query heads sharing 2 KV heads), on the torch backend, under forced preemption, on the
Triton kernels (interpreted: tiny sizes) and, for Llama, over two tensor-parallel ranks. The
Llama checkpoint is bfloat16, sharded with an index file, with llama3 RoPE scaling and an
untied LM head; the Qwen3 one float32, one file, with head_dim * heads != hidden_size and a
tied LM head. Also: the registry's errors, and KV-cache sizing by KV heads."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams, UnsupportedCheckpointError
from engine.builtin_model import write_byte_tokenizer
from tests.engine.hf_reference import assert_greedy_equal
from tests.engine.test_hf_equivalence import _prompts

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256, eos_token_id=256,
              initializer_range=0.25)  # far above the default 0.02: greedy outputs vary, few near-ties


def _save(path, model, **save_kwargs):
    model.save_pretrained(path, **save_kwargs)
    write_byte_tokenizer(path, 256)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=False,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=32))
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path = _save(tmp_path_factory.mktemp("llama"), model, max_shard_size="100KB")
    assert json.loads(open(f"{path}/config.json").read())["architectures"] == ["LlamaForCausalLM"]
    return path


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-6)
    return _save(tmp_path_factory.mktemp("qwen3"), Qwen3ForCausalLM(cfg))


def _generate(path, prompts, params=GREEDY, **kwargs):
    """Greedy token ids of prompts through a fresh engine, and its stats (no block leaked); for every
    checkpoint family's oracle tests."""
    llm = LLM(path, dtype="float32", **kwargs)  # transformers' reference runs in float32 (CUDA's default is 16-bit)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.engine_core.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.shutdown()


def test_sharded_bf16_checkpoint_is_read(llama):
    import os
    assert os.path.exists(f"{llama}/model.safetensors.index.json")
    llm = LLM(llama, num_kv_blocks=8, dtype="float32")
    core = llm.llm_engine.engine_core.engine_core
    assert core.model_config.architecture == "LlamaForCausalLM" and core.dtype == torch.float32
    assert core.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # bf16, cast on the CPU


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_backend_equals_transformers(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=12)
    got, _ = _generate(path, prompts)
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_preemption_equals_transformers(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=12)
    got, stats = _generate(path, prompts, num_kv_blocks=10, block_size=16)
    assert stats.num_preemptions > 0
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_equals_transformers(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts(n=4)  # interpreted kernels: a few short prompts
    got, _ = _generate(path, prompts, attention_backend="triton", block_size=8, num_kv_blocks=32)
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.slow
def test_tensor_parallel_llama_equals_transformers(llama):
    prompts = _prompts(n=8)
    got, stats = _generate(llama, prompts, tensor_parallel_size=2, num_kv_blocks=8, block_size=16)
    assert stats.num_preemptions > 0
    assert_greedy_equal(got, llama, prompts, MAX_NEW)


def test_kv_cache_holds_kv_heads_only(llama):
    llm = LLM(llama, num_kv_blocks=8, block_size=16, dtype="float32")
    core = llm.llm_engine.engine_core.engine_core
    k, v = core.kv_caches[0]
    assert k.shape == v.shape == (8, 16, 2, 8)  # [blocks, block_size, KV heads (not 8 query heads), head_dim]
    alloc = next(info for stage, _, info in core.startup if stage == "kv_cache_alloc")
    assert alloc["bytes_per_block"] == 2 * 2 * 16 * 2 * 8 * 4  # K and V, layers, tokens, KV heads, dims, fp32
    assert (alloc["num_heads"], alloc["num_kv_heads"]) == (8, 2)


def test_tp_size_must_divide_both_head_counts(llama):
    with pytest.raises(ValueError, match=r"8 query heads and 2 KV heads.*choose one of \[1, 2\]"):
        LLM(llama, tensor_parallel_size=4)


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["MambaForCausalLM"], "model_type": "mamba"}')
    with pytest.raises(UnsupportedCheckpointError, match="MambaForCausalLM.*GPT2LMHeadModel, LlamaForCausalLM, "
                                                         "Qwen3ForCausalLM"):
        LLM(str(tmp_path))


def test_unimplemented_rope_scaling_is_named(llama, tmp_path):
    import shutil
    shutil.copytree(llama, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match="'dynamic' is not implemented; implemented: default, "
                                                         "linear, llama3, yarn"):
        LLM(str(tmp_path))
