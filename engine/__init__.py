"""A paged-attention inference engine for GPT-2 with vLLM v1 semantics.

    from engine import LLM, SamplingParams
    llm = LLM(model="tiny-gpt2")
    print(llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text)
"""
from engine.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from engine.hooks import Hooks
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.model_loader import ModelNotFoundError, NotAGPT2CheckpointError
from engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError

__all__ = [
    "LLM", "LLMEngine", "SamplingParams", "SamplingParamsError", "RequestOutput", "CompletionOutput", "Logprob",
    "EngineStats", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig", "ConfigError", "Hooks",
    "ModelNotFoundError", "NotAGPT2CheckpointError",
]
