"""Structured outputs over HTTP, through the official openai client, in both server modes: OpenAI's
response_format (json_schema, json_object) and vLLM's structured_outputs (choice, regex, grammar)."""
from __future__ import annotations

import json
import re

import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "color": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer"},
        "alive": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "color", "age", "alive", "tags"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def check_person(text: str) -> None:
    """Parses and follows SCHEMA (checked by hand: each rule of the schema once)."""
    obj = json.loads(text)
    assert set(obj) == set(SCHEMA["properties"])
    assert isinstance(obj["name"], str) and obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and isinstance(obj["alive"], bool)
    assert isinstance(obj["tags"], list) and all(isinstance(t, str) for t in obj["tags"])


@pytest.mark.slow
def test_json_schema_chat_sampled(client):
    finished = 0
    for seed in range(8):
        r = client.chat.completions.create(model="tiny-gpt2", messages=MESSAGES, response_format=FORMAT,
                                           temperature=0.8, seed=seed, max_tokens=120)
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            finished += 1
            check_person(choice.message.content)
    assert finished >= 6


def test_json_schema_completion_and_stream(client):
    kw = dict(model="tiny-gpt2", prompt="A person:", max_tokens=120, temperature=0,
              extra_body={"response_format": FORMAT})
    full = client.completions.create(**kw).choices[0]
    assert full.finish_reason == "stop"
    check_person(full.text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full.text


def test_json_schema_chat_stream(client):
    chunks = client.chat.completions.create(model="tiny-gpt2", messages=MESSAGES, response_format=FORMAT,
                                            temperature=0.8, seed=3, max_tokens=120, stream=True)
    parts, finish = [], None
    for c in chunks:
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    assert finish == "stop"
    check_person("".join(parts))


@pytest.mark.slow
def test_json_object(client):
    """Any object: its keys are free strings, which the built-in model (trained on prose) seldom closes, so
    most answers reach max_tokens; every one that finishes is an object."""
    finished = 0
    for seed in range(32):  # at least 8 answers; then on until one finishes (each seed's draw is fixed)
        r = client.chat.completions.create(model="tiny-gpt2", messages=MESSAGES, temperature=0.8, seed=seed,
                                           max_tokens=120, response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert text.startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
        if finished and seed >= 7:
            break
    assert finished >= 1


def test_choice_regex_and_grammar(client):
    for seed in range(4):
        r = client.completions.create(model="tiny-gpt2", prompt="My favourite colour is", max_tokens=10, seed=seed,
                                      temperature=0.8, extra_body={"structured_outputs": {"choice": ["red", "green",
                                                                                                     "dark blue"]}})
        assert r.choices[0].text in ("red", "green", "dark blue") and r.choices[0].finish_reason == "stop"
    pattern = r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"
    r = client.completions.create(model="tiny-gpt2", prompt="Email:", max_tokens=30, temperature=0.8, seed=1,
                                  extra_body={"structured_outputs": {"regex": pattern}})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(pattern, r.choices[0].text)
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    r = client.completions.create(model="tiny-gpt2", prompt="Sum:", max_tokens=30, temperature=0.8, seed=2,
                                  extra_body={"structured_outputs": {"grammar": grammar}})
    text = r.choices[0].text
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text) if r.choices[0].finish_reason == "stop" else \
        re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\+?", text)


@pytest.mark.parametrize("body, names", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "intger"}}}}}}, "intger"),
    ({"structured_outputs": {"regex": "[a-"}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "undefined_rule"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "schema"),
])
def test_invalid_grammar_is_a_400_and_the_server_goes_on(client, http, body, names):
    r = http.post("/v1/chat/completions", json={"model": "tiny-gpt2", "messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert names in err["message"] and err["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-gpt2", messages=MESSAGES, max_tokens=5, extra_body=body)
    ok = client.completions.create(model="tiny-gpt2", prompt="Hi", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_unconstrained_neighbours_unchanged(client):
    """A constrained request in the same batch changes nothing for the others (the mask touches its own row)."""
    kw = dict(model="tiny-gpt2", prompt=["The quick brown fox", "Once upon a time"], max_tokens=12, temperature=0)
    alone = [c.text for c in client.completions.create(**kw).choices]
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(2) as pool:
        other = pool.submit(client.completions.create, model="tiny-gpt2", prompt="x", max_tokens=40, temperature=0,
                            extra_body={"structured_outputs": {"regex": "[a-z ]{30,40}"}})
        together = [c.text for c in client.completions.create(**kw).choices]
        other.result()
    assert together == alone


def test_send_flags(live, capsys, tmp_path):
    from tracer.cli import main

    assert main(["send", "Colour:", "--url", live.url, "--choice", "red,green", "--temperature", "0.8"]) == 0
    assert capsys.readouterr().out.strip() in ("red", "green")
    assert main(["send", "Code:", "--url", live.url, "--regex", "[A-Z]{3}-[0-9]{2}", "--stream"]) == 0
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", capsys.readouterr().out.strip())
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    assert main(["send", "JSON:", "--chat", "--url", live.url, "--json-schema", str(schema)]) == 0
    assert isinstance(json.loads(capsys.readouterr().out)["ok"], bool)
