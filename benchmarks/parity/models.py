"""The checkpoints both engines run: the built-in ones vLLM's CPU build accepts, and random GPT-2, Llama and
Qwen3 ones that transformers builds and saves (in ours' ``.venv``; the files are plain safetensors + config).

vLLM's CPU attention refuses head_dim 16, so the built-in ``tiny-llama`` (8 heads of 16) runs there as a
twin: the same config and tokenizer with 4 heads of 32 (2 KV heads), random weights. ``tiny-gpt2`` (4 heads
of 32) runs as it is. The random checkpoints use a wide initializer (0.25, far above the default 0.02) so that
greedy choices are decisive: few near-ties between the two best logits.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

BUILTIN = Path(__file__).resolve().parents[2] / "engine" / "builtin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SMALL = dict(vocab_size=4096, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
             initializer_range=0.25)


def _save(model, path: Path, tokenizer_from: str) -> str:
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(BUILTIN / tokenizer_from / name, path / name)
    return str(path)


def tiny_llama_twin(path: Path) -> str:
    """tiny-llama's shape with head_dim 32 (4 heads, 2 KV heads): vLLM's CPU attention takes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((BUILTIN / "tiny-llama" / "config.json").read_text())
    cfg.update(num_attention_heads=4, head_dim=32, initializer_range=0.25, torch_dtype="float32")
    torch.manual_seed(0)
    return _save(LlamaForCausalLM(LlamaConfig(**cfg)), path, "tiny-llama")


def random_gpt2(path: Path) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    cfg = GPT2Config(vocab_size=4096, n_positions=512, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                     eos_token_id=0, initializer_range=0.25)
    return _save(GPT2LMHeadModel(cfg), path, "tiny-gpt2")


def random_llama(path: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    return _save(LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)), path, "tiny-gpt2")


def random_qwen3(path: Path) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    return _save(Qwen3ForCausalLM(Qwen3Config(**SMALL, tie_word_embeddings=True, rms_norm_eps=1e-6)), path,
                 "tiny-gpt2")


BUILDERS = {"tiny-llama-hd32": tiny_llama_twin, "random-gpt2": random_gpt2, "random-llama": random_llama,
            "random-qwen3": random_qwen3}


def checkpoints(root: Path, names: list[str] | None = None) -> dict[str, str]:
    """name -> checkpoint directory: tiny-gpt2 as built in, the others built once under root."""
    out = {"tiny-gpt2": str(BUILTIN / "tiny-gpt2")}
    for name, build in BUILDERS.items():
        if names is not None and name not in names:
            continue
        path = root / name
        if not (path / "config.json").exists():
            path.mkdir(parents=True, exist_ok=True)
            build(path)
        out[name] = str(path)
    return {k: v for k, v in out.items() if names is None or k in names}
