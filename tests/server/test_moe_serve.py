"""`vllm-trace serve` on a mixture of experts: it answers, and /metrics counts each expert's load
(vllm_trace:moe_expert_tokens_total per layer and expert, vllm_trace:moe_ep_rank_tokens_total per
rank): every token of every forward pass routed to top_k experts in each sparse layer."""
from __future__ import annotations

import re

import httpx
import pytest

from engine.entrypoints.openai.metrics import ServerMetrics
from engine.outputs import EngineStats
from tests.engine.test_moe import _hf_model, _save
from tests.server.conftest import spawn_serve

PROMPT = list(range(10, 22))  # 12 prompt tokens
MAX_TOKENS = 5


def _series(metrics: str, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """name's samples by the values of `labels`, in that order."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            out[tuple(found[k] for k in labels)] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.slow
def test_serve_counts_each_experts_load(model_cache, tmp_path):
    path = _save(tmp_path / "qwen3-moe", _hf_model("qwen3_moe"), fused=False)
    # synchronous: every forward pass computes exactly the prompt, then one token per new token but the last
    proc, _, url = spawn_serve("--no-tui", "--no-async-scheduling", model=path)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            r = client.post("/v1/completions", json={"model": path, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            metrics = client.get("/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    experts = _series(metrics, "vllm_trace:moe_expert_tokens_total", "layer", "expert")
    tokens = len(PROMPT) + MAX_TOKENS - 1
    assert {layer for layer, _ in experts} == {"0", "2"}  # layer 1 is dense (mlp_only_layers)
    for layer in ("0", "2"):
        assert sum(n for (la, _), n in experts.items() if la == layer) == 2 * tokens  # top-2
        assert all(0 <= int(e) < 8 for la, e in experts if la == layer)
    # one rank, two sparse layers
    assert _series(metrics, "vllm_trace:moe_ep_rank_tokens_total", "rank") == {("0",): 2 * 2 * tokens}


def test_expert_parallel_ranks_count_their_own_experts():
    """Under expert parallelism rank r holds experts [r·E/N, (r+1)·E/N): its counter sums theirs."""
    class Engine:
        step_listeners: list = []
        stats = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0.0)

    metrics = ServerMetrics(Engine(), "moe")
    load = {"0": [3, 0, 1, 2], "2": [0, 4, 1, 1]}
    metrics.on_step([], EngineStats(1, 0, 0, 0, 0, 0, 0, 0, 0.0, moe_expert_tokens=load, moe_ep_size=2), [])
    text = metrics.render().decode()
    assert _series(text, "vllm_trace:moe_ep_rank_tokens_total", "rank") == {("0",): 3 + 4, ("1",): 3 + 2}
    assert _series(text, "vllm_trace:moe_expert_tokens_total", "layer", "expert")[("2", "1")] == 4
