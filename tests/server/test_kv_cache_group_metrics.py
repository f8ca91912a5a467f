"""/metrics per KV-cache group: each group's kind, window and the blocks its block tables hold
(vllm_trace:kv_cache_group_blocks, vllm_trace:kv_cache_group_usage_perc). The engine's per-group
counts are the distinct blocks of the running requests' tables (prefix hits shared) and add up to
the pool's blocks in use at every step, the sliding-window group holding fewer than full attention;
and `vllm-trace serve` on a Ministral-shaped checkpoint (sliding-window and full-attention layers
alternating) exports both groups."""
from __future__ import annotations

import time

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_pool import NULL_BLOCK_ID
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.outputs import EngineStats
from tests.engine.test_sliding_window import COMMON, WINDOW, _save
from tests.server.conftest import spawn_serve
from tests.server.test_moe_serve import _series

LABELS = ("group", "kind", "window")


def _ministral(path) -> str:
    from transformers import MinistralConfig, MinistralForCausalLM

    torch.manual_seed(1)
    cfg = MinistralConfig(**COMMON | dict(num_hidden_layers=4, head_dim=8),
                          layer_types=["sliding_attention", "full_attention"] * 2)
    return _save(path, MinistralForCausalLM(cfg))


def test_groups_are_rendered_with_their_blocks():
    class Engine:
        step_listeners: list = []
        stats = EngineStats(3, 0, 2, 70, 100, 0, 0, 0, 0.3, kv_cache_groups=[
            dict(kind="sliding_window", sliding_window=16, layers=[0, 2], num_blocks=10),
            dict(kind="full_attention", sliding_window=None, layers=[1, 3], num_blocks=20)])

    text = ServerMetrics(Engine(), "m").render().decode()
    assert _series(text, "vllm_trace:kv_cache_group_blocks", *LABELS) == {
        ("0", "sliding_window", "16"): 10, ("1", "full_attention", ""): 20}
    assert _series(text, "vllm_trace:kv_cache_group_usage_perc", *LABELS) == {
        ("0", "sliding_window", "16"): 0.1, ("1", "full_attention", ""): 0.2}


def test_engine_counts_each_groups_blocks(tmp_path):
    path = _ministral(tmp_path / "ministral")
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=200, max_num_batched_tokens=8,
              enable_prefix_caching=True)
    engine, core = llm.llm_engine, llm.llm_engine.engine_core.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    shared = list(range(100, 120))  # a prefix the later requests find in the cache
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": shared + [(7 * i + j) % 256 for j in range(20)]}, params)
    most = [0, 0]
    try:
        while engine.has_unfinished_requests():
            engine.step()
            stats = core.stats()
            sliding, full = stats.kv_cache_groups
            assert (sliding["kind"], sliding["sliding_window"], full["kind"]) == ("sliding_window", WINDOW,
                                                                                  "full_attention")
            assert sliding["num_blocks"] + full["num_blocks"] == stats.num_total_blocks - stats.num_free_blocks
            for g, group in enumerate((sliding, full)):  # the distinct blocks of the running requests' tables
                held = {b for r in core.scheduler.running for b in r.kv_block_ids[g]} - {NULL_BLOCK_ID}
                assert group["num_blocks"] == len(held)
            most = [max(most[0], sliding["num_blocks"]), max(most[1], full["num_blocks"])]
        end = core.stats()
        assert end.prefix_cache_hits > 0 and [g["num_blocks"] for g in end.kv_cache_groups] == [0, 0]
    finally:
        llm.shutdown()
    assert 0 < most[0] < most[1], f"the window's group held {most[0]} blocks at most, full attention {most[1]}"


@pytest.mark.slow
def test_serve_exports_each_group(model_cache, tmp_path):
    path = _ministral(tmp_path / "ministral")
    proc, _, url = spawn_serve("--no-tui", "--block-size", "4", "--num-kv-blocks", "64", model=path)
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            r = client.post("/v1/completions", json={"model": path, "prompt": list(range(10, 40)), "max_tokens": 4,
                                                     "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            finished = {("0", "sliding_window", str(WINDOW)): 0.0, ("1", "full_attention", ""): 0.0}  # given back
            deadline = time.monotonic() + 60  # the stats after the request's last step are published next
            while True:
                metrics = client.get("/metrics").text
                blocks = _series(metrics, "vllm_trace:kv_cache_group_blocks", *LABELS)
                if blocks == finished or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # a poll interval, not a wait for anything
    finally:
        proc.terminate()
        proc.wait(30)
    assert blocks == finished
    assert _series(metrics, "vllm_trace:kv_cache_group_usage_perc", *LABELS) == finished
