"""The official openai client against the live server."""
from __future__ import annotations

import pytest

PROMPT = "The quick brown fox"


def stream_completion(client, **kw) -> tuple[str, list, list]:
    chunks = list(client.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks, [c for c in chunks if c.usage]


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-gpt2"]
    assert models[0].object == "model"


def test_completion_usage_and_id(client, live):
    r = client.completions.create(model="tiny-gpt2", prompt="Hello", max_tokens=7, temperature=0)
    assert r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    prompt_ids = live.tokenizer.encode("Hello")
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == len(prompt_ids) + 7


def test_streaming_text_equals_non_streaming(client):
    kw = dict(model="tiny-gpt2", prompt=PROMPT, max_tokens=20, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    text, chunks, usage = stream_completion(client, stream_options={"include_usage": True}, **kw)
    assert text == full and len(chunks) > 2
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len(usage) == 1 and usage[0].usage.completion_tokens == 20 and not usage[0].choices


def test_stop_string_never_leaks_into_a_chunk(client):
    kw = dict(model="tiny-gpt2", prompt=PROMPT, max_tokens=20, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    # a two-character stop string from the middle of the greedy output: its first character
    # arrives a step before the second, so only hold-back keeps it out of the stream
    k = next(k for k in range(1, len(plain) - 1) if plain.index(plain[k:k + 2]) == k)
    stop = plain[k:k + 2]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == plain[:plain.index(stop)] and r.choices[0].finish_reason == "stop"
    text, chunks, _ = stream_completion(client, stop=stop, **kw)
    assert text == r.choices[0].text  # the x before '7' was held back, then dropped
    assert all(stop not in c.choices[0].text for c in chunks if c.choices)


def test_a_stream_that_ends_in_a_partial_stop_match_sends_the_held_back_text(client):
    """The output's last characters start a stop string that never completes (the stream ends
    by length first): they are held back while they might, and must still be sent at the end."""
    kw = dict(model="tiny-gpt2", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    stop = plain[-1] + "\u2603"  # the last character, then one the model never writes
    r = client.completions.create(stop=[stop], **kw).choices[0]
    assert r.text == plain and r.finish_reason == "length"
    text, chunks, _ = stream_completion(client, stop=[stop], **kw)
    assert text == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(model="tiny-gpt2", messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi there"}], max_tokens=12, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.id.startswith("chatcmpl-") and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_uses_the_default_template(client, live):
    r = client.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert r.usage.prompt_tokens == len(live.tokenizer.encode("User: Hi\nAssistant:"))


def test_max_completion_tokens_wins(client):
    r = client.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=9, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_several_prompts_and_token_ids(client, live):
    ids = live.tokenizer.encode(PROMPT)
    single = client.completions.create(model="tiny-gpt2", prompt=ids, max_tokens=6, temperature=0)
    batch = client.completions.create(model="tiny-gpt2", prompt=[PROMPT, "Hello"], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == single.choices[0].text
    assert batch.usage.completion_tokens == 12
    text, _, _ = stream_completion(client, model="tiny-gpt2", prompt=[[*ids], [*ids]], max_tokens=6, temperature=0)
    assert sorted(text) == sorted(single.choices[0].text * 2)


def test_echo_and_logprobs(client):
    r = client.completions.create(model="tiny-gpt2", prompt="Hi", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hi") and len(r.choices[0].text) > 2
    r = client.completions.create(model="tiny-gpt2", prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) >= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert lp.token_logprobs[0] == pytest.approx(max(lp.top_logprobs[0].values()))  # greedy picks the top one
    c = client.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 3


def test_seeded_sampling_is_reproducible(client):
    kw = dict(
        model="tiny-gpt2",
        prompt="Hello",
        max_tokens=10,
        temperature=1.0,
        seed=7,
        extra_body={"top_k": 50, "min_p": 0.01},
    )
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
