"""`vllm-trace serve tiny-moe` (the built-in mixture of experts) answers the openai client in English
words, and the trace names its architecture."""
from __future__ import annotations

from tests.server.conftest import serving
from tracer.events import read_trace


def test_serve_tiny_moe_answers(model_cache, tmp_path):
    trace = tmp_path / "serve.jsonl"
    with serving("--num-kv-blocks", "16", "--block-size", "16", "--trace-file", str(trace), model="tiny-moe") as (
            client, _):
        r = client.completions.create(model="tiny-moe", prompt="The list type", max_tokens=12, temperature=0)
        assert r.usage.completion_tokens == 12 and any(c.isalpha() for c in r.choices[0].text)
    _, events = read_trace(trace)
    resolved = next(e for e in events if e.layer == "engine" and e.name == "resolve_model" and e.kind == "end")
    assert resolved.attrs["architecture"] == "Qwen3MoeForCausalLM"
