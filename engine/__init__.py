"""A paged-attention inference engine in vLLM V1's shape (GPT-2, Llama, Qwen3, Mistral, Gemma 3, MoE).

    from engine import LLM, SamplingParams
    llm = LLM(model="tiny-gpt2")
    print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)
"""
import importlib

# Imported on first use (PEP 562), not here: `import engine.engine.core_client` must not pay for torch
# (~1.5 s), so that `serve` can start the engine-core process first and let it import torch while
# the API server imports its own half, which never needs torch (tests/engine/test_tokenizer.py).
_EXPORTS = {
    "engine.config": ("CacheConfig", "ConfigError", "EngineConfig", "ModelConfig", "SchedulerConfig"),
    "engine.hooks": ("Hooks",), "engine.entrypoints.llm": ("LLM",), "engine.engine.llm_engine": ("LLMEngine",),
    "engine.model_executor.model_loader": ("ModelNotFoundError", "UnsupportedCheckpointError"),
    "engine.outputs": ("CompletionOutput", "EngineStats", "Logprob", "RequestOutput"),
    "engine.sampling_params": ("SamplingParams", "SamplingParamsError", "StructuredOutputsParams"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "LLM", "LLMEngine", "SamplingParams", "SamplingParamsError", "StructuredOutputsParams", "RequestOutput",
    "CompletionOutput", "Logprob",
    "EngineStats", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig", "ConfigError", "Hooks",
    "ModelNotFoundError", "UnsupportedCheckpointError",
]
