"""The engine on our Triton kernels (interpreted on the CPU) gives the same greedy tokens as
the PyTorch backend and as transformers, through preemption, chunked prefill and prefix
caching; and every launch is observable through the engine's hooks."""
import pytest

from engine import LLM, Hooks, SamplingParams
from engine.builtin_model import builtin_path
from engine.worker.input_batch import INPUT_KERNELS
from kernels import access_map, instrument
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equivalence import _prompts

MAX_NEW = 10
PROMPTS = _prompts(shared_prefix=16, n=8)


@pytest.fixture(scope="module")
def expected():
    return hf_greedy(str(builtin_path()), PROMPTS, MAX_NEW)


def _generate(backend: str, **kw):
    llm = LLM("tiny-gpt2", attention_backend=backend, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    stats = llm.llm_engine.engine_core.engine_core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.slow
@pytest.mark.parametrize("kw, check", [
    (dict(), None),
    (dict(num_kv_blocks=10, block_size=8), "num_preemptions"),
    (dict(max_num_batched_tokens=16, block_size=32), None),
    (dict(block_size=8, num_kv_blocks=64), "prefix_cache_hits"),
], ids=["default", "preemption", "chunked-prefill", "prefix-caching"])
def test_triton_equals_torch_and_transformers(kw, check, expected):
    got, stats = _generate("triton", **kw)
    assert got == expected
    if check:
        assert getattr(stats, check) > 0
    torch_got, _ = _generate("torch", **kw)
    assert torch_got == got


def test_kernel_launches_reach_the_hooks():
    hooks, events, gates = Hooks(), [], []
    hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((layer, name, step, attrs)))
    hooks.add_gate(lambda point, info: gates.append((point, info)))
    # synchronous: the forward pass on this thread, where instrument.observe records the launches
    llm = LLM("tiny-gpt2", attention_backend="triton", num_kv_blocks=32, hooks=hooks, async_scheduling=False)
    records = []
    with instrument.observe(records.append):  # the runner's own observer nests inside this one
        llm.generate(["abc", "hello"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    kernels = [e for e in events if e[0] == "kernel"]
    n_layers, inputs = 4, INPUT_KERNELS[:4]  # post_update runs after sampling
    # two steps (prefill, decode), each: the input-building launches, then in each layer one cache
    # write and one attention launch, then (after sampling) post_update writing the tokens back
    per_step = [(name, None) for name in inputs] + [
        (name, layer) for layer in range(n_layers) for name in ("reshape_and_cache", "unified_attention")] + [
        ("post_update", None)]
    assert [(e[1], e[2], e[3]["layer_idx"]) for e in kernels] == [
        (name, step, layer) for step in (0, 1) for name, layer in per_step]
    first_attention = kernels[len(inputs) + 1][3]
    assert len(first_attention["grid"]) == 3 and first_attention["duration_ns"] > 0
    assert all(set(e[3]) == {"layer_idx", "grid", "meta", "args", "duration_ns", "timing", "reason", "rank"}
               for e in kernels)
    assert {e[3]["rank"] for e in kernels} == {0}
    # The events are plain data; the map a viewer recomputes from them and the step's batch is
    # the launch's own, program for program.
    batches = {e[2]: e[3] for e in events if e[:2] == ("model_runner", "batch")}
    assert [r.name for r in records] == [e[1] for e in kernels]
    for (_, name, step, attrs), rec in zip(kernels, records):
        assert access_map(name, attrs["meta"], attrs["grid"], batches[step]) == rec.access_map
        assert bool(rec.access_map) == (name not in INPUT_KERNELS)  # the input kernels read no KV blocks
    access = records[len(inputs) + 1].access_map
    assert {a.request for accesses in access.values() for a in accesses} == {0, 1}
    assert [g[1]["name"] for g in gates if g[0] == "kernel"][:5] == [*inputs, "reshape_and_cache"]


TRANSFORMERS_FIRST = """
import sys
from engine.builtin_model import builtin_path
from tests.engine.hf_reference import hf_greedy
prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
expected = hf_greedy(str(builtin_path()), prompts, 4)  # transformers loads a model: triton is imported, compiled
assert "triton" in sys.modules and "TRITON_INTERPRET" not in __import__("os").environ
from engine import LLM, SamplingParams
llm = LLM("tiny-gpt2", attention_backend="triton")
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=4,
                    ignore_eos=True), use_tqdm=False)
assert [o.outputs[0].token_ids for o in outs] == expected, ([o.outputs[0].token_ids for o in outs], expected)
print("ok")
"""


@pytest.mark.slow
def test_triton_works_after_transformers_imported_triton_first():
    """A notebook that compares with transformers first: transformers imports triton (the
    interpreter off) before the kernels can set TRITON_INTERPRET."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU triton compiles: the interpreter is not involved")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", TRANSFORMERS_FIRST], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
