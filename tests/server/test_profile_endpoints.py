"""POST /start_profile and /stop_profile in both modes (AsyncLLM over a core in this process, or over
the engine-core process): 200 with the window's steps, the request's steps profiled (every
op a launch) and greedy output unchanged; guarded as the other control POSTs (JSON only)."""
from __future__ import annotations

from engine.trace_names import KERNEL, PROFILE_START, PROFILE_STOP, PROFILER

JSON = {"Content-Type": "application/json"}
BODY = {"model": "tiny-gpt2", "prompt": "The cat sat on", "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def test_start_and_stop_profile(http, live):
    events = []
    unsubscribe = live.hooks.subscribe(lambda *e: events.append(e), lambda evs, at_ns=None: events.extend(evs))
    try:
        before = http.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
        r = http.post("/start_profile", json={}, headers=JSON)
        assert r.status_code == 200 and r.json()["profiling"] is True, r.text
        first = r.json()["step"]
        during = http.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
        r = http.post("/stop_profile", json={}, headers=JSON)
        assert r.status_code == 200 and r.json()["profiling"] is False, r.text
        last = r.json()["step"]
        assert http.post("/stop_profile", json={}, headers=JSON).json()["profiling"] is False  # stopped already
    finally:
        unsubscribe()
    assert during == before and last >= first + 4  # a prefill and 4 decodes at least
    window = {e[1]: e[4] for e in events if e[0] == PROFILER}
    assert window == {PROFILE_START: first, PROFILE_STOP: last}
    profiled = {e[1] for e in events if e[0] == KERNEL and e[5].get("profiled") and first <= e[4] <= last}
    assert {"c_attn", "ln_1", "lm_head", "argmax", "cpu_attention_with_kv_cache"} <= profiled  # (decodes)


def test_profile_endpoints_take_a_bare_post_but_a_web_page_needs_json(http):
    for path in ("/start_profile", "/stop_profile"):
        r = http.post(path, headers={"Origin": "http://evil.example"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "json_required"
    r = http.post("/start_profile")  # curl -X POST, as on vLLM
    assert r.status_code == 200 and r.json()["profiling"] is True, r.text
    r = http.post("/stop_profile")
    assert r.status_code == 200 and r.json()["profiling"] is False, r.text
