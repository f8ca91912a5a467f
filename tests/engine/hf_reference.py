"""Hugging Face transformers as the reference: greedy outputs per prompt, no padding."""
from __future__ import annotations

import functools
import inspect

import torch

NEAR_TIE = 2e-3  # logits this close may order differently after a different (correct) sum order


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The argmax of transformers' logits at every step, through its own KV cache; <|endoftext|> is
    an ordinary token here, as with the engine's ignore_eos (generate's min_new_tokens would mask it
    out, which a trained model, unlike a random one, often picks)."""
    return [ids for ids, _ in _greedy(path, prompts, max_new_tokens)]


# (checkpoint path, prompt) -> the longest greedy run computed so far: the first k tokens of a greedy
# run are the greedy run of k, so the many tests that check the same prompts pay for transformers once
_RUNS: dict[tuple[str, tuple[int, ...]], tuple[list[int], list[float]]] = {}


def _greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Per prompt: the greedy tokens, and at each step the gap between the best and second-best logit."""
    outs = []
    for ids in prompts:
        key = (path, tuple(ids))
        run = _RUNS.get(key)
        if run is None or len(run[0]) < max_new_tokens:
            run = _RUNS[key] = _greedy_one(hf_model(path), ids, max_new_tokens)
        outs.append((run[0][:max_new_tokens], run[1][:max_new_tokens]))
    return outs


def _greedy_one(model, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    new, gaps = [], []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(max_new_tokens):
            top = out.logits[0, -1].float().topk(2)
            new.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            out = model(torch.tensor([[new[-1]]]), **_cache_kwargs(model, out), use_cache=True)
    return new, gaps


def assert_greedy_equal(got: list[list[int]], path: str, prompts: list[list[int]], max_new_tokens: int) -> int:
    """Every output equals transformers' greedy one, except that one may leave it where
    transformers' best two logits were within NEAR_TIE (a near-tie: both orders are right, and
    after it the texts differ legitimately). Returns how many outputs were cut at a near-tie."""
    ties = 0
    for i, (ours, (ref, gaps)) in enumerate(zip(got, _greedy(path, prompts, max_new_tokens), strict=True)):
        if ours == ref:
            continue
        at = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        assert gaps[at] < NEAR_TIE, (f"prompt {i}: token {at} is {ours[at]}, transformers' is {ref[at]} with a "
                                     f"margin of {gaps[at]:.2e} (not a near-tie)\nours {ours}\nref  {ref}")
        ties += 1
    assert ties <= len(got) // 4, f"{ties} of {len(got)} outputs left transformers' at a near-tie: too many to trust"
    return ties


def _cache_kwargs(model, out) -> dict:
    """The KV cache handed back: transformers 5.24 renamed `past_key_values` to `cache` (the old
    name warns, and goes in 5.40); earlier 5.x has only the old one."""
    if "cache" in inspect.signature(type(model).forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}
