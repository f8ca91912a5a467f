import pytest

from engine import LLM, ConfigError, ModelNotFoundError, SamplingParams, SamplingParamsError, UnsupportedCheckpointError


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"), (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_p=2), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
])
def test_sampling_params_out_of_range(kwargs, param):
    with pytest.raises(SamplingParamsError, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def _unchanged(llm, fn):
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    before = (len(core.requests), len(core.scheduler.waiting), core.kv_cache_manager.num_free_blocks)
    with pytest.raises(ValueError) as e:
        fn()
    assert (len(core.requests), len(core.scheduler.waiting), core.kv_cache_manager.num_free_blocks) == before
    return str(e.value)


def test_engine_rejects_bad_requests_before_changing_state(llm):
    msg = _unchanged(llm, lambda: llm.generate("", use_tqdm=False))
    assert "empty" in msg
    msg = _unchanged(llm, lambda: llm.generate("x" * 600, use_tqdm=False))
    assert "max_model_len" in msg
    msg = _unchanged(llm, lambda: llm.generate("hi", SamplingParams(max_tokens=600), use_tqdm=False))
    assert "max_tokens" in msg and "max_model_len" in msg
    msg = _unchanged(llm, lambda: llm.generate({"prompt_token_ids": [1, 99999]}, use_tqdm=False))
    assert "token ids" in msg
    # a batch with one bad prompt queues nothing
    msg = _unchanged(llm, lambda: llm.generate(["fine", ""], use_tqdm=False))


def test_prompt_that_can_never_fit_in_the_cache():
    small = LLM("tiny-gpt2", num_kv_blocks=2, block_size=8)
    msg = _unchanged(small, lambda: small.generate("a" * 12, SamplingParams(max_tokens=8), use_tqdm=False))
    assert "blocks" in msg and "num_kv_blocks" in msg


def test_bad_configs():
    with pytest.raises(ConfigError, match="block_size"):
        LLM("tiny-gpt2", block_size=12)
    with pytest.raises(ConfigError, match="attention_backend"):
        LLM("tiny-gpt2", attention_backend="cuda-magic")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM("tiny-gpt2", max_model_len=100000)


def test_unknown_model_says_what_was_tried(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError) as e:
        LLM("no-such-model-anywhere")
    assert "tiny-gpt2" in str(e.value) and "cache" in str(e.value)


def test_directory_of_an_unsupported_model(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(UnsupportedCheckpointError, match="mamba.*runs GPT2LMHeadModel, LlamaForCausalLM"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UnsupportedCheckpointError, match="LlamaForCausalLM.*has no 'num_attention_heads'"):
        LLM(str(tmp_path))
    with pytest.raises(UnsupportedCheckpointError, match="config.json"):
        LLM(str(tmp_path / ".."))  # a directory without config.json


def test_abort_unknown_request_is_a_noop(llm):
    llm.llm_engine.abort_request(["never-existed"])


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", "some prompt text", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    assert core.kv_cache_manager.num_free_blocks < core.kv_cache_manager.num_usable_blocks
    engine.abort_request(["to-abort"])
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks
    assert not engine.has_unfinished_requests()
