"""Kernel warm-up: a real forward outside the scheduler, traced as a startup stage."""
import pytest
import torch

from engine import LLM, Hooks, SamplingParams


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_warm_up_is_no_request_and_no_step(backend):
    hooks, events = Hooks(), []
    hooks.subscribe(lambda *e: events.append(e))
    llm = LLM("tiny-gpt2", hooks=hooks, attention_backend=backend, num_kv_blocks=8, block_size=4)
    engine = llm.llm_engine
    info = engine.engine_core.engine_core.warm_up()
    assert engine.engine_core.engine_core.step_count == 0 and not engine.engine_core.engine_core.requests
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks
    assert all(not k.any() and not v.any() for k, v in core.kv_caches)  # the cache is left as found
    stage = [(name, kind) for layer, name, kind, *_ in events if layer == "engine" and name == "kernel_warmup"]
    assert stage == [("kernel_warmup", "begin"), ("kernel_warmup", "end")]
    kernels = [e for e in events if e[0] == "kernel"]
    n_layers = core.model_config.n_layer
    assert len(kernels) == info["num_launches"] == 2 * 2 * n_layers  # cache write + attention, prefill + decode
    assert all(step is None and attrs["warmup"] for _, _, _, _, step, attrs in kernels)
    assert core.startup[-1][0] == "kernel_warmup"


def test_warm_up_changes_no_output_and_refuses_a_used_engine():
    params = SamplingParams(max_tokens=6, temperature=0)
    cold = LLM("tiny-gpt2", num_kv_blocks=8, block_size=4)
    warm = LLM("tiny-gpt2", num_kv_blocks=8, block_size=4)
    warm.llm_engine.engine_core.engine_core.warm_up()
    prompts = ["Hello there", "Hello there friend"]
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(RuntimeError, match="before the first engine step"):
        warm.llm_engine.engine_core.engine_core.warm_up()
    assert torch.is_grad_enabled()  # inference_mode did not leak
