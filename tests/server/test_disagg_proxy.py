"""Disaggregated prefill and decode as a user runs it: two `vllm-trace serve --kv-transfer-config`
processes (P2pZmqConnector: a kv_producer and a kv_consumer) and `vllm-trace proxy` in front.
Greedy output through the proxy equals one instance's (completions and chat, streamed and not; GPT-2 and
the built-in MoE); the decode instance's /metrics and trace show the prompt's KV arriving from the prefill
instance, whose blocks are freed once pulled. Killing an instance gives the client an error, never a hang, and a
request already past it still completes."""
from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import ROOT, spawn_serve

TIMEOUT = httpx.Timeout(120.0, connect=10.0)
PROMPTS = ["The paged KV cache stores the keys and values of every token in fixed-size blocks, so requests grow",
           "A block table maps each request's logical blocks to physical ones"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_proxy(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tracer.cli", "proxy", "--prefill", prefill, "--decode", decode,
                             "--port", "0"], cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("Ready:"):
            return proc, re.search(r"at (http://\S+)", line).group(1)
    proc.kill()
    raise AssertionError("proxy exited before its ready line")


def _spawn_instance(role: str, port: int, kv_port: int, model: str = "tiny-gpt2") -> subprocess.Popen:
    """A serve on a fixed port (the proxy's URL for it stays valid if it is started again)."""
    kv = json.dumps({"kv_connector": "P2pZmqConnector", "kv_role": role,
                     "kv_connector_extra_config": {"kv_port": kv_port}})
    proc, _, _ = spawn_serve("--port", str(port), "--kv-transfer-config", kv, model=model)
    return proc


@contextlib.contextmanager
def _disagg(model: str):
    """A prefill instance, a decode instance and the proxy, serving model; killed on leaving."""
    ports = dict(p=_free_port(), d=_free_port(), p_kv=_free_port(), d_kv=_free_port())
    procs = {}
    try:
        procs["prefill"] = _spawn_instance("kv_producer", ports["p"], ports["p_kv"], model)
        procs["decode"] = _spawn_instance("kv_consumer", ports["d"], ports["d_kv"], model)
        p_url, d_url = f"http://127.0.0.1:{ports['p']}", f"http://127.0.0.1:{ports['d']}"
        procs["proxy"], x_url = _spawn_proxy(p_url, d_url)
        yield dict(procs=procs, ports=ports, p=p_url, d=d_url, x=x_url)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def disagg():
    with _disagg("tiny-gpt2") as d:
        yield d


def _complete(url: str, prompt: str, stream: bool = False, chat: bool = False, max_tokens: int = 12) -> str:
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = httpx.post(url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    text = []
    with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for c in event["choices"]:
                    text.append((c.get("delta") or {}).get("content") or "" if chat else c["text"])
    return "".join(text)


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of a metric's series (those whose labels hold `label`, e.g. 'source="local_compute"')."""
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return sum(float(v) for labels, v in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M) if label in labels)


def _trace(url: str, layer: str, want: int) -> list[dict]:
    """The first `want` events of a layer in the instance's trace (read from its start)."""
    events = []
    with httpx.stream("GET", url + "/trace/events", params={"since": 0, "layer": layer}, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == want:
                    break
    return events


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_output_through_the_proxy_equals_one_instance(disagg, chat, stream):
    for prompt in PROMPTS:
        assert _complete(disagg["x"], prompt, stream, chat) == _complete(disagg["d"], prompt, False, chat)


def test_the_decode_instance_receives_the_prompt_and_the_prefill_instance_frees_it(disagg):
    hits = _metric(disagg["d"], "vllm:external_prefix_cache_hits_total")
    local = _metric(disagg["d"], "vllm:prefix_cache_hits_total")
    r = httpx.post(disagg["x"] + "/v1/completions", json={"prompt": PROMPTS[0] + " once more", "max_tokens": 4,
                                                          "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    # all the prompt's tokens but the last came from the prefill instance, or (its first block, which the
    # tests before sent) from the decode instance's own prefix cache
    external = _metric(disagg["d"], "vllm:external_prefix_cache_hits_total") - hits
    assert external > 0 and external + _metric(disagg["d"], "vllm:prefix_cache_hits_total") - local == n - 1
    by_source = {s: _metric(disagg["d"], "vllm:prompt_tokens_by_source_total", f'source="{s}"')
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    # (vLLM's sources of prompt tokens, counted at each request's first token)
    assert by_source["external_kv_transfer"] == _metric(disagg["d"], "vllm:external_prefix_cache_hits_total")
    assert by_source["local_compute"] > 0
    deadline = time.monotonic() + 60
    while _metric(disagg["p"], "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(disagg["p"], "vllm:kv_cache_usage_perc") == 0, "the prefill instance kept the blocks"
    sent = _trace(disagg["p"], "kv_transfer", 1)
    received = _trace(disagg["d"], "kv_transfer", 1)
    assert sent[0]["name"] == "send" and received[0]["name"] == "recv"
    assert sent[0]["attrs"]["bytes"] == received[0]["attrs"]["bytes"] > 0


def test_a_request_that_stops_at_its_first_token_is_answered_by_the_decode_instance(disagg):
    """The prefill instance keeps no blocks for it (it did not stop at max_tokens): the decode instance
    computes the prompt itself, and the answer is one instance's."""
    first = _complete(disagg["d"], PROMPTS[0], max_tokens=1)
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stop": [first]}
    via_proxy = httpx.post(disagg["x"] + "/v1/completions", json=body, timeout=TIMEOUT)
    direct = httpx.post(disagg["d"] + "/v1/completions", json=body, timeout=TIMEOUT)
    assert via_proxy.status_code == 200, via_proxy.text
    assert via_proxy.json()["choices"] == direct.json()["choices"]
    assert via_proxy.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-moe"])
def test_llama_and_moe_through_the_proxy_equal_one_instance(model):
    """The built-in Llama (GQA, RoPE) and tiny-moe (a Qwen3-MoE: 8 experts, top-2) disaggregated: their KV crosses
    as GPT-2's does, the decode instance computes only the prompt's last token, and the tokens are one instance's."""
    with _disagg(model) as inst:
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(inst["x"] + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        n = r.json()["usage"]["prompt_tokens"]
        # a fresh decode instance: every prompt token but the last came from the prefill instance
        assert _metric(inst["d"], "vllm:external_prefix_cache_hits_total") == n - 1
        assert _metric(inst["d"], "vllm:prompt_tokens_by_source_total", 'source="local_compute"') == 1
        direct = httpx.post(inst["p"] + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.json()["choices"] == direct.json()["choices"]
        for prompt in PROMPTS:
            assert _complete(inst["x"], prompt, stream=True) == _complete(inst["d"], prompt)


def _long_stream(url: str, out: dict) -> None:
    """A streamed completion of 400 tokens; out["started"] is set at its first event, out["events"] its data."""
    events = out["events"] = []
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                out["started"].set()


def _kill_during_a_stream(disagg, victim: str) -> list[str]:
    out = {"started": threading.Event()}
    t = threading.Thread(target=_long_stream, args=(disagg["x"], out))
    t.start()
    assert out["started"].wait(120)
    disagg["procs"][victim].send_signal(signal.SIGKILL)
    disagg["procs"][victim].wait()
    t.join(180)
    assert not t.is_alive(), "the client hangs"
    return out["events"]


@pytest.mark.slow
def test_killing_an_instance_gives_an_error_not_a_hang(disagg):
    """Last in this module: it kills the instances. The prefill instance dies while a request decodes: that
    request completes, and a new one gets a 503 naming the instance. Started again, then the decode instance
    dies mid-stream: the client gets an error event and [DONE], and a new request a 503 naming it."""
    events = _kill_during_a_stream(disagg, "prefill")
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # all 400 tokens
    r = httpx.post(disagg["x"] + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 503 and disagg["p"] in r.json()["error"]["message"]

    ports = disagg["ports"]
    disagg["procs"]["prefill"] = _spawn_instance("kv_producer", ports["p"], ports["p_kv"])
    events = _kill_during_a_stream(disagg, "decode")
    assert events[-1] == "[DONE]" and '"error"' in events[-2] and disagg["d"] in events[-2]
    r = httpx.post(disagg["x"] + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=TIMEOUT)
    assert r.status_code == 503 and disagg["d"] in r.json()["error"]["message"]
