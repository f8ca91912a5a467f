"""Hugging Face transformers as the reference: greedy outputs per prompt, no padding."""
from __future__ import annotations

import functools
import inspect

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The argmax of transformers' logits at every step, through its own KV cache; <|endoftext|> is
    an ordinary token here, as with the engine's ignore_eos (generate's min_new_tokens would mask it
    out, which a trained model, unlike a random one, often picks)."""
    model = hf_model(path)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            new = []
            for _ in range(max_new_tokens):
                new.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([[new[-1]]]), **_cache_kwargs(model, out), use_cache=True)
            outs.append(new)
    return outs


def _cache_kwargs(model, out) -> dict:
    """The KV cache handed back: transformers 5.24 renamed `past_key_values` to `cache` (the old
    name warns, and goes in 5.40); earlier 5.x has only the old one."""
    if "cache" in inspect.signature(type(model).forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}
