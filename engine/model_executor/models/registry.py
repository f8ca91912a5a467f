"""Which model class runs a checkpoint: ``architectures`` in its config.json, looked up here
(vLLM's ``model_executor/models/registry.py``). Imported without torch: the API server resolves
a model's config before any weights are read; the model modules are imported when built."""
from __future__ import annotations

import importlib
from pathlib import Path

# architecture (as config.json names it) -> (module under engine.model_executor.models, class)
MODELS = {
    "GPT2LMHeadModel": ("gpt2", "GPT2Model"),
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "MinistralForCausalLM": ("mistral", "MinistralForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}
# checkpoints old enough to lack `architectures` still name their model_type
MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "ministral": "MinistralForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "gpt_oss": "GptOssForCausalLM"}


def architecture_of(raw_config: dict, path: Path | str = "the checkpoint") -> str:
    """The supported architecture a config.json names; one error naming the supported ones if none."""
    from engine.model_executor.model_loader import UnsupportedCheckpointError

    archs = raw_config.get("architectures") or [MODEL_TYPES.get(raw_config.get("model_type"), "")]
    for arch in archs:
        if arch in MODELS:
            return arch
    named = ", ".join(a for a in archs if a) or f"model_type {raw_config.get('model_type')!r}"
    raise UnsupportedCheckpointError(f"{path} holds a {named} model; vllm-trace runs {', '.join(MODELS)}")


def model_class(architecture: str) -> type:
    module, name = MODELS[architecture]
    return getattr(importlib.import_module(f"engine.model_executor.models.{module}"), name)


def check_tp_size(cfg, tp_size: int) -> None:
    """Raise ValueError unless the model can be split over tp_size ranks: each rank holds whole
    query heads and whole KV heads, so tp_size must divide both counts (and the MLP's width)."""
    q, kv = cfg.num_heads, cfg.num_kv_heads
    if q % tp_size or kv % tp_size:
        sizes = [d for d in range(1, kv + 1) if q % d == 0 and kv % d == 0]
        what = f"{q} attention heads" if q == kv else f"{q} query heads and {kv} KV heads"
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's {what} (each rank holds whole "
                         f"heads); choose one of {sizes}")
    if cfg.intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the MLP's {cfg.intermediate_size} features")
    if getattr(cfg, "moe_intermediate_size", 0) % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide each expert's {cfg.moe_intermediate_size} "
                         "features")
