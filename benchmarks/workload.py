"""The seeded benchmark workload shared by every benchmark: varied prompt and output lengths."""
from __future__ import annotations

import random
from pathlib import Path

from engine import SamplingParams


def make_workload(num_requests: int = 32, vocab_size: int = 257, seed: int = 0,
                  prompt_len: tuple[int, int] = (8, 96), output_len: tuple[int, int] = (8, 64),
                  ) -> list[tuple[list[int], SamplingParams]]:
    """num_requests (prompt_token_ids, greedy params) pairs; EOS ignored so lengths are exact."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt = [rng.randrange(vocab_size - 1) for _ in range(rng.randint(*prompt_len))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(*output_len), ignore_eos=True)
        work.append((prompt, params))
    return work


GPT2_SHAPED = "gpt2-shaped"


def gpt2_shaped_checkpoint() -> str:
    """A local checkpoint with GPT-2 small's body (12 layers, 768 wide, 12 heads, 1024
    positions) and transformers' random init, with tiny-gpt2's tokenizer and a vocabulary of
    its size (4,096 tokens, so that text prompts work as well as token ids; real GPT-2's
    50,257-token LM head would add about 40 % to each token's compute).
    For benchmarks that need a model of the size people serve without a download; written once
    next to tiny-gpt2 and loaded through the same loader as any checkpoint."""
    import shutil
    import tempfile

    import torch
    from transformers import GPT2LMHeadModel

    from engine import builtin_model

    path = builtin_model.cache_root() / f"{GPT2_SHAPED}-v2"
    if not (path / "model.safetensors").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent))
        torch.manual_seed(0)
        GPT2LMHeadModel(gpt2_shaped_config()).save_pretrained(tmp, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(builtin_model.builtin_path() / name, tmp / name)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return str(path)


def gpt2_shaped_config():
    """gpt2-shaped's transformers config: GPT-2 small's body; the vocabulary and special tokens of
    tiny-gpt2, whose tokenizer it ships with."""
    import json

    from transformers import GPT2Config

    from engine import builtin_model

    tiny = json.loads((builtin_model.builtin_path() / "config.json").read_text())
    return GPT2Config(vocab_size=tiny["vocab_size"], n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                      bos_token_id=tiny["bos_token_id"], eos_token_id=tiny["eos_token_id"])


def resolve_model(name: str) -> str:
    """`gpt2-shaped` becomes its local checkpoint; anything else is passed to the engine."""
    return gpt2_shaped_checkpoint() if name == GPT2_SHAPED else name
