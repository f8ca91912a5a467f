"""gpt-oss gives transformers' greedy outputs on prompts and generations longer than its window,
near-ties excepted: a random tiny GptOssForCausalLM saved by transformers (a 12-token window on
layers 0 and 2, full attention on 1 and 3: two KV-cache groups; attention sinks; q/k/v/o, router
and expert biases, all drawn at random rather than left at zero; 4 experts, top-2, with a clamped
SwiGLU whose limit the random weights reach; YaRN RoPE), on the torch and Triton backends, under
preemption, chunked prefill and prefix caching, over two tensor-parallel ranks (sinks split by
head; experts split by feature, or whole under expert parallelism) and with the core in its own
process. What it does not run (MXFP4-quantized experts) is
refused in one line."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from engine import LLM, SamplingParams, UnsupportedCheckpointError
from engine.core.block_pool import NULL_BLOCK_ID
from tests.engine.hf_reference import assert_greedy_equal
from tests.engine.test_hf_equivalence import _prompts
from tests.engine.test_sliding_window import ROOMY, _generate, _save

MAX_NEW = 16
WINDOW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(3)
    cfg = GptOssConfig(vocab_size=257, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
                       bos_token_id=256, eos_token_id=256, pad_token_id=0, initializer_range=0.25,
                       swiglu_limit=1.5)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():  # biases start at 0: random ones show they are read; sinks large enough to matter
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0, 1.0)
    return _save(tmp_path_factory.mktemp("gpt_oss"), model)


def test_checkpoint_is_read_as_gpt_oss(gpt_oss):
    llm = LLM(gpt_oss, dtype="float32", block_size=4, num_kv_blocks=64)
    try:
        core = llm.llm_engine.engine_core.engine_core
        cfg = core.model_config
        assert cfg.architecture == "GptOssForCausalLM" and cfg.layer_sliding_windows == [WINDOW, None] * 2
        assert cfg.rope_scaling["rope_type"] == "yarn" and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 1.5)
        layer = core.model.model.layers[0]
        assert layer.self_attn.sinks.shape == (4,) and layer.mlp.router.bias is not None
        assert layer.mlp.experts.w13_bias.shape == (4, 64) and layer.mlp.experts.activation == "swigluoai"
        groups = core.kv_cache_manager.kv_cache_groups  # two KV-cache groups over one pool
        assert [(g.layer_ids, g.kv_cache_spec.sliding_window) for g in groups] == [([0, 2], WINDOW), ([1, 3], None)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_rope_equals_transformers(truncate):
    """cos and sin of every position: YaRN's frequencies and its attention factor (0.1·ln 32 + 1)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from engine.model_executor.layers.rotary_embedding import get_rope

    rope = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=truncate,
                original_max_position_embeddings=4096, rope_theta=150000.0)
    cfg = GptOssConfig(head_dim=64, max_position_embeddings=512, rope_parameters=dict(rope))
    positions = torch.arange(512)
    cos, sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[None])
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    ours = get_rope(64, 512, 150000.0, scaling).cos_sin_cache[positions]
    torch.testing.assert_close(ours, torch.cat([cos[0], sin[0]], dim=-1), rtol=0, atol=1e-6)
    assert abs(float(ours[0, 0]) - (0.1 * math.log(32) + 1)) < 1e-6  # cos(0) times the attention factor


def test_torch_backend_equals_transformers(gpt_oss):
    prompts = _prompts(n=12)  # up to 47 tokens, + 16 generated: far past the 12-token window
    got, stats = _generate(gpt_oss, prompts, block_size=4, num_kv_blocks=ROOMY)
    assert stats.num_preemptions == 0
    assert_greedy_equal(got, gpt_oss, prompts, MAX_NEW)


@pytest.mark.slow
def test_triton_backend_equals_transformers(gpt_oss):
    prompts = _prompts(n=5)[2:]  # interpreted kernels: a few prompts, 7 to 15 tokens + 16 generated
    got, _ = _generate(gpt_oss, prompts, attention_backend="triton", block_size=4, num_kv_blocks=64)
    assert_greedy_equal(got, gpt_oss, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["preemption", "chunked_prefill", "prefix_caching"])
def test_scheduling_settings_equal_transformers(gpt_oss, setting):
    kwargs = dict(preemption=dict(num_kv_blocks=40), chunked_prefill=dict(max_num_batched_tokens=10),
                  prefix_caching=dict(enable_prefix_caching=True, max_num_seqs=2))[setting]
    prompts = _prompts(shared_prefix=30, n=8, seed=3) if setting == "prefix_caching" else _prompts(n=12)
    got, stats = _generate(gpt_oss, prompts, block_size=4, **{"num_kv_blocks": ROOMY, **kwargs})
    if setting == "preemption":
        assert stats.num_preemptions > 0
    if setting == "prefix_caching":
        assert stats.prefix_cache_hits > 0
    assert_greedy_equal(got, gpt_oss, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_tensor_parallel_equals_transformers(gpt_oss, expert_parallel):
    """Two ranks: each its query heads' sinks; each expert's slice (its down bias added by rank 0 only)
    or, under expert parallelism, two whole experts each with their biases."""
    prompts = _prompts(n=8)
    llm = LLM(gpt_oss, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              block_size=4, num_kv_blocks=ROOMY)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_greedy_equal([o.outputs[0].token_ids for o in outs], gpt_oss, prompts, MAX_NEW)


@pytest.mark.slow
def test_core_in_its_own_process_equals_transformers(gpt_oss):
    prompts = _prompts(n=6)
    got, _ = _generate(gpt_oss, prompts, block_size=4, multiprocess=True, num_kv_blocks=ROOMY)
    assert_greedy_equal(got, gpt_oss, prompts, MAX_NEW)


def test_a_window_holds_its_blocks_only(gpt_oss):
    llm = LLM(gpt_oss, dtype="float32", block_size=4, num_kv_blocks=ROOMY, max_num_batched_tokens=8)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": [(5 * i + j) % 256 for j in range(40)]}, params)
    bound = -(-WINDOW // 4) + 1  # ceil(window / block_size) + 1
    try:
        while engine.has_unfinished_requests():
            engine.step()
            for req in core.scheduler.running:
                sliding, full = req.kv_block_ids
                assert sum(b != NULL_BLOCK_ID for b in sliding) <= bound
                assert NULL_BLOCK_ID not in full and len(full) == -(-req.num_computed_tokens // 4)
    finally:
        llm.shutdown()


def test_quantized_checkpoint_is_refused(gpt_oss, tmp_path):
    shutil.copytree(gpt_oss, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match="mxfp4 gpt-oss weights are not supported; dequantize"):
        LLM(str(tmp_path))
