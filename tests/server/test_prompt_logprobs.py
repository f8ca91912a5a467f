"""Prompt logprobs and `echo`: what evaluation harnesses (lm-eval's local-completions) send for a
loglikelihood, checked against Hugging Face transformers' log-softmax on the same checkpoint."""
from __future__ import annotations

import pytest
import torch

PROMPT_IDS = [(7 * j + 3) % 4000 + 1 for j in range(37)]


@pytest.fixture(scope="module")
def reference():
    from transformers import GPT2LMHeadModel

    from engine.builtin_model import builtin_path

    hf = GPT2LMHeadModel.from_pretrained(str(builtin_path())).eval()
    with torch.no_grad():
        lsm = torch.log_softmax(hf(torch.tensor([PROMPT_IDS])).logits[0].float(), -1)
    return [float(lsm[j, PROMPT_IDS[j + 1]]) for j in range(len(PROMPT_IDS) - 1)], lsm


def test_echo_logprobs_of_a_token_id_prompt_equal_transformers(http, reference):
    """lm-eval's loglikelihood request, as it sends it."""
    want, lsm = reference
    r = http.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": [PROMPT_IDS], "max_tokens": 1,
                                           "logprobs": 1, "echo": True, "temperature": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(PROMPT_IDS) + 1  # the prompt, then the generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1:len(PROMPT_IDS)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 2e-3
    # the greedy check lm-eval makes: a token is greedy iff its logprob is the top one
    for j, (tok_lp, top) in enumerate(zip(lp["token_logprobs"][1:len(PROMPT_IDS)], lp["top_logprobs"][1:])):
        greedy = int(lsm[j].argmax()) == PROMPT_IDS[j + 1]
        assert (tok_lp == max(top.values())) == greedy
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_echo_logprobs_streamed_equal_non_streamed(http):
    body = {"model": "tiny-gpt2", "prompt": "The list of the", "max_tokens": 4, "logprobs": 2, "echo": True,
            "temperature": 0}
    full = http.post("/v1/completions", json=body).json()["choices"][0]
    import json
    tokens, lps, text = [], [], ""
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                text += c["text"]
                if c["logprobs"]:
                    tokens += c["logprobs"]["tokens"]
                    lps += c["logprobs"]["token_logprobs"]
    assert text == full["text"] and tokens == full["logprobs"]["tokens"]
    assert lps == full["logprobs"]["token_logprobs"] and lps[0] is None


def test_offline_prompt_logprobs_under_chunked_prefill(reference):
    from engine import LLM, SamplingParams

    want, _ = reference
    llm = LLM("tiny-gpt2", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)  # 37 tokens: 3 chunks
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    # a second request with the same prompt would hit the prefix cache; prompt logprobs must not
    outs = llm.generate([{"prompt_token_ids": PROMPT_IDS}] * 2, params, use_tqdm=False)
    for out in outs:
        pl = out.prompt_logprobs
        assert pl[0] is None and len(pl) == len(PROMPT_IDS) and all(len(e) in (3, 4) for e in pl[1:])
        got = [pl[j + 1][PROMPT_IDS[j + 1]].logprob for j in range(len(PROMPT_IDS) - 1)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 2e-3
        assert all(e[t].rank >= 1 and e[t].decoded_token is not None for e, t in zip(pl[1:], PROMPT_IDS[1:]))
    assert outs[1].num_cached_tokens == 0
    plain = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
