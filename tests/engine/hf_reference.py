"""Hugging Face transformers as the reference: greedy outputs per prompt, no padding."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = hf_model(path)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               pad_token_id=model.config.eos_token_id)
            outs.append(y[0, len(ids):].tolist())
    return outs
