"""/metrics (vLLM V1 names, values that move), /health, /version, /tokenize, and the guards."""
from __future__ import annotations

import re

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from engine.entrypoints.openai.errors import install_error_handlers
from engine.entrypoints.openai.security import control_refusal, is_loopback, require_control

NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
         "vllm:generation_tokens_total", "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
         "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
         "vllm:request_queue_time_seconds_bucket", "vllm:iteration_tokens_total_bucket",
         "vllm:request_time_per_output_token_seconds_bucket",
         "vllm_trace:request_abort_total"]  # ours, named so: vLLM does not count aborts


def sample(text: str, name: str, **labels) -> float:
    want = {"model_name": "tiny-gpt2", "engine": "0", **labels}
    for line in text.splitlines():
        m = re.match(r"([\w:]+)\{(.*)\} (\S+)$", line)
        if m and m[1] == name and dict(re.findall(r'(\w+)="([^"]*)"', m[2])) == want:
            return float(m[3])
    return 0.0


def test_metrics_names_and_counts(http):
    before = http.get("/metrics").text
    for name in NAMES:
        assert re.search(rf'^{re.escape(name)}\{{.*model_name="tiny-gpt2"', before, re.M), name
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}).json()
    after = http.get("/metrics").text
    def delta(name, **kw):
        return sample(after, name, **kw) - sample(before, name, **kw)

    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:prompt_tokens_total") == r["usage"]["prompt_tokens"]
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_time_per_output_token_seconds_count") == 1  # one per request, as vLLM
    assert delta("vllm:prefix_cache_queries_total") >= r["usage"]["prompt_tokens"]
    assert "_created" not in after


def test_health_version_tokenize(http, live):
    assert http.get("/health").status_code == 200
    assert re.match(r"\d", http.get("/version").json()["version"])
    t = http.post("/tokenize", json={"prompt": "Hi there"}).json()
    assert t["tokens"] == live.tokenizer.encode("Hi there") and t["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "Hi there"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] == len(live.tokenizer.encode("User: Hi\nAssistant:"))


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                           ("0.0.0.0", False), ("192.168.1.5", False), ("example.com", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def control_app(host: str, api_key: str | None) -> TestClient:
    """A stand-in for the trace router: one control route behind require_control."""
    from types import SimpleNamespace

    app = FastAPI()
    app.state.server = SimpleNamespace(host=host, api_key=api_key)
    install_error_handlers(app)

    @app.post("/trace/pause", dependencies=[Depends(require_control)])
    def pause():
        return {"paused": True}

    return TestClient(app)


def test_control_open_on_loopback_without_key():
    assert control_app("127.0.0.1", None).post("/trace/pause", json={}).status_code == 200
    assert control_refusal("127.0.0.1", None) is None


def test_control_refused_on_a_public_address_without_key():
    r = control_app("0.0.0.0", None).post("/trace/pause", json={})
    assert r.status_code == 403 and r.json()["error"]["code"] == "control_disabled"
    assert "0.0.0.0" in control_refusal("0.0.0.0", None)


def test_control_needs_the_key_when_one_is_set():
    c = control_app("0.0.0.0", "k")
    assert c.post("/trace/pause", json={}).status_code == 401
    assert c.post("/trace/pause", json={}, headers={"Authorization": "Bearer k"}).status_code == 200
    assert control_refusal("0.0.0.0", "k") is None
