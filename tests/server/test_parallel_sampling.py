"""n > 1 (parallel sampling): one request fans out into n children whose outputs the
OutputProcessor gathers; through the server in both modes, streamed and not."""
from __future__ import annotations

import json


def test_completions_n3_seeded_gives_three_distinct_choices(http):
    body = {"model": "tiny-gpt2", "prompt": "The list of", "n": 3, "temperature": 0.8, "seed": 7, "max_tokens": 12}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) > 1
    assert r.json()["usage"]["completion_tokens"] == 36
    again = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in choices]  # seeded: reproducible


def test_two_prompts_times_two_samples_index_choices_prompt_major(http):
    body = {"model": "tiny-gpt2", "prompt": ["The list of", "Return the"], "n": 2, "temperature": 0,
            "max_tokens": 4}
    choices = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] and choices[2]["text"] == choices[3]["text"]  # greedy


def _stream(http, path: str, body: dict) -> dict[int, str]:
    texts: dict[int, str] = {}
    with http.stream("POST", path, json=body | {"stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    piece = c["text"] if "text" in c else (c["delta"].get("content") or "")
                    texts[c["index"]] = texts.get(c["index"], "") + piece
    return texts


def test_streamed_n2_carries_both_indices_and_equals_non_streamed(http):
    body = {"model": "tiny-gpt2", "prompt": "The list of", "n": 2, "temperature": 0.9, "seed": 3, "max_tokens": 10}
    full = {c["index"]: c["text"] for c in http.post("/v1/completions", json=body).json()["choices"]}
    assert _stream(http, "/v1/completions", body) == full and set(full) == {0, 1}


def test_chat_n2(http):
    body = {"model": "tiny-gpt2", "messages": [{"role": "user", "content": "Hello"}], "n": 2, "temperature": 0.9,
            "seed": 5, "max_tokens": 8}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert _stream(http, "/v1/chat/completions", body) == {c["index"]: c["message"]["content"] for c in choices}


def test_best_of_is_refused(http):
    r = http.post("/v1/completions", json={"model": "tiny-gpt2", "prompt": "x", "n": 1, "best_of": 3})
    assert r.status_code == 400 and "best_of" in r.text


def test_logit_bias_allowed_and_bad_words_over_http(http):
    base = {"model": "tiny-gpt2", "prompt": "The list of", "max_tokens": 5, "temperature": 0}
    r = http.post("/v1/completions", json=base | {"logit_bias": {"1234": 100}, "logprobs": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [r.json()["choices"][0]["logprobs"]["tokens"][0]] * 5
    r = http.post("/v1/completions", json=base | {"allowed_token_ids": [5, 6]})
    assert r.status_code == 200
    assert http.post("/v1/completions", json=base | {"logit_bias": {"x": 1}}).status_code == 400
    assert http.post("/v1/completions", json=base | {"allowed_token_ids": [99999]}).status_code == 400
    assert http.post("/v1/completions", json=base | {"logit_bias": {"3": 1000}}).status_code == 400

