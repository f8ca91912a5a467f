"""Mixtures of experts (Qwen3-MoE, Mixtral) give transformers' greedy outputs, near-ties
excepted: random tiny checkpoints built by transformers and saved both ways the experts are
stored (one tensor per expert and projection, as save_pretrained and the hub write them; all
experts fused in 3-D gate_up_proj / down_proj, as transformers 5 holds them), on the torch
and Triton backends, under preemption, chunked prefill and prefix caching, over two
tensor-parallel ranks and with the core in its own process. The Qwen3-MoE one renormalises
its top-k weights and has a dense layer (mlp_only_layers); the Mixtral one 4 experts, top-2."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.arg_utils import engine_config
from engine.builtin_model import write_byte_tokenizer
from engine.model_executor.layers.fused_moe import FusedMoE
from tests.engine.hf_reference import assert_greedy_equal
from tests.engine.test_hf_equivalence import _prompts

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
COMMON = dict(vocab_size=257, hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=256, eos_token_id=256, initializer_range=0.25)


def _hf_model(arch: str):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=2, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1])
        return Qwen3MoeForCausalLM(cfg)
    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                            num_experts_per_tok=2))


def _save(path: Path, model, fused: bool) -> str:
    if fused:  # the experts as transformers 5 holds them: experts.gate_up_proj [E, 2I, H], experts.down_proj
        from safetensors.torch import save_file

        model.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        model.save_pretrained(path)
    write_byte_tokenizer(path, 256)
    return str(path)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    """The per-expert checkpoint (what save_pretrained writes)."""
    return _save(tmp_path_factory.mktemp(request.param), _hf_model(request.param), fused=False)


def _generate(path, prompts, **kwargs):
    llm = LLM(path, dtype="float32", **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = llm.llm_engine.engine_core.engine_core.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        llm.shutdown()


def test_saved_checkpoint_has_one_tensor_per_expert(moe):
    from safetensors import safe_open

    with safe_open(f"{moe}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    proj = "mlp.experts.7.gate_proj" if "qwen3_moe" in moe else "block_sparse_moe.experts.3.w1"
    assert f"model.layers.0.{proj}.weight" in keys and not any("gate_up_proj" in k for k in keys)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_equals_transformers(arch, tmp_path):
    model = _hf_model(arch)
    assert any(k.endswith("experts.gate_up_proj") for k in model.state_dict())
    path = _save(tmp_path, model, fused=True)
    prompts = _prompts(n=6)
    got, _ = _generate(path, prompts)
    assert_greedy_equal(got, path, prompts, MAX_NEW)


def test_torch_backend_equals_transformers(moe):
    prompts = _prompts(n=12)
    got, _ = _generate(moe, prompts)
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


def test_sparse_and_dense_layers(moe):
    llm = LLM(moe, dtype="float32", num_kv_blocks=8)
    layers = llm.llm_engine.engine_core.engine_core.model.model.layers
    sparse = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in layers]
    assert sparse == ([True, False, True] if "qwen3_moe" in moe else [True, True, True])
    experts = layers[0].mlp.experts
    assert experts.renormalize and experts.top_k == 2
    llm.shutdown()


def test_triton_backend_equals_transformers(moe):
    prompts = _prompts(n=3)  # interpreted kernels: a few short prompts
    got, _ = _generate(moe, prompts, attention_backend="triton", block_size=8, num_kv_blocks=32)
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


@pytest.mark.parametrize("setting", ["preemption", "chunked_prefill", "prefix_caching"])
def test_scheduling_settings_equal_transformers(moe, setting):
    kwargs = dict(preemption=dict(num_kv_blocks=10, block_size=16), chunked_prefill=dict(max_num_batched_tokens=16),
                  prefix_caching=dict(enable_prefix_caching=True))[setting]
    prompts = _prompts(n=10, shared_prefix=32 if setting == "prefix_caching" else 0)
    got, stats = _generate(moe, prompts, **kwargs)
    if setting == "preemption":
        assert stats.num_preemptions > 0
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


def test_tensor_parallel_equals_transformers(moe):
    prompts = _prompts(n=8)
    got, _ = _generate(moe, prompts, tensor_parallel_size=2)
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


def test_core_in_its_own_process(moe):
    from engine.engine.async_llm import AsyncLLM

    prompts = _prompts(n=4)
    llm = AsyncLLM(engine_config(moe, dtype="float32")).start()

    async def one(i, p):
        return [o async for o in llm.generate({"prompt_token_ids": p}, GREEDY, f"r{i}")][-1].outputs[0].token_ids

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        assert llm.core_pid is not None
        got = asyncio.run(run())
    finally:
        llm.stop()
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


def test_missing_expert_is_named(tmp_path):
    from safetensors.torch import save_file

    model = _hf_model("mixtral")
    path = _save(tmp_path, model, fused=False)
    from safetensors import safe_open
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.2.block_sparse_moe.experts.3.w3.weight"}
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights of model.layers.2.mlp.experts: \['expert 3 w3'\]"):
        LLM(path, dtype="float32", num_kv_blocks=8)
