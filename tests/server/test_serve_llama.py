"""`vllm-trace serve tiny-llama` (a Llama with grouped-query attention) answers the openai client,
and its trace shows the GQA shapes: 8 query heads over a cache of 2 KV heads, a Triton grid over
the KV heads with 4 query heads per program (GROUP), RoPE launched before each cache write."""
from __future__ import annotations

from tests.server.conftest import serving
from tracer.events import read_trace


def test_serve_llama_answers_and_traces_gqa_launch_shapes(model_cache, tmp_path):
    trace = tmp_path / "serve.jsonl"
    with serving("--num-kv-blocks", "16", "--block-size", "16", "--attention-backend", "triton",
                 "--trace-file", str(trace), model="tiny-llama") as (client, _):
        r = client.completions.create(model="tiny-llama", prompt="The list type", max_tokens=6, temperature=0)
        assert r.usage.completion_tokens == 6 and r.choices[0].text
        chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens == 4
    _, events = read_trace(trace)
    resolved = next(e for e in events if e.layer == "engine" and e.name == "resolve_model" and e.kind == "end")
    assert resolved.attrs["architecture"] == "LlamaForCausalLM"
    launches = [e for e in events if e.layer == "kernel" and e.step is not None]
    attention = [e.attrs for e in launches if e.name.startswith("unified_attention")]
    assert attention and all(a["meta"]["GROUP"] == 4 for a in attention)  # query heads per KV head
    assert all(a["args"]["query"][0][1:] == [8, 16] and a["args"]["key_cache"][0] == [16, 16, 2, 16]
               for a in attention)  # 8 query heads; the cache [blocks, block_size, 2 KV heads, head_size]
    assert all(a["grid"][1] * a["meta"]["HEADS_PER_PROG"] == 2 for a in attention)  # the grid spans the KV heads
    layer0 = [e.name for e in launches if e.step == launches[0].step and e.attrs["layer_idx"] == 0]
    assert layer0 == ["rotary_embedding", "reshape_and_cache", "unified_attention"]
    batch = next(e for e in events if e.layer == "model_runner" and e.name == "batch")
    assert batch.attrs["rope"]["theta"] == 10000.0 and batch.attrs["positions"][:3] == [0, 1, 2]
