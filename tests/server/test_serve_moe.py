"""`vllm-trace serve tiny-moe` (the built-in mixture of experts) answers the openai client in English
words, and the trace names its architecture."""
from __future__ import annotations

import signal

import openai

from tests.server.conftest import spawn_serve
from tracer.events import read_trace


def test_serve_tiny_moe_answers(model_cache, tmp_path):
    trace = tmp_path / "serve.jsonl"
    proc, _, url = spawn_serve("--num-kv-blocks", "16", "--block-size", "16", "--trace-file", str(trace),
                               model="tiny-moe")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.completions.create(model="tiny-moe", prompt="The list type", max_tokens=12, temperature=0)
        assert r.usage.completion_tokens == 12 and any(c.isalpha() for c in r.choices[0].text)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _, events = read_trace(trace)
    resolved = next(e for e in events if e.layer == "engine" and e.name == "resolve_model" and e.kind == "end")
    assert resolved.attrs["architecture"] == "Qwen3MoeForCausalLM"
