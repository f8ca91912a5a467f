"""Every bad input gets the right status and an OpenAI error body; never a 500."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]

BAD = [
    # (path, body, status, param)
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 16385}, 400, "n"),  # vLLM's VLLM_MAX_N_SEQUENCES
    (C, {"prompt": [[1]] * 1025}, 400, "prompt"),  # vLLM's VLLM_MAX_COMPLETION_PROMPTS
    (C, {"prompt": "x", "n": 1, "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    (C, {"prompt": "x", "seed": 2 ** 80}, 400, "seed"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    (C, {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    (C, {"prompt": "x" * 600}, 400, None),  # longer than max_model_len (512)
    (C, {"prompt": "x" * 500, "max_tokens": 100}, 400, None),  # prompt + max_tokens too long
    (C, {"prompt": "x", "max_tokens": 100_000}, 400, None),
    (C, {"prompt": ""}, 400, None),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [1, 99999]}, 400, None),  # token id outside the vocabulary
    (C, {"prompt": [[]]}, 400, None),
    (C, {"prompt": ["ok", ""]}, 400, None),  # a batch is all or nothing
    (C, {"max_tokens": 3}, 400, "prompt"),
    (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "model": "nope"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "messages": MSG}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD)])
def test_bad_input(http, live, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("content", [b"{not json", b'{"prompt": "x", "temperature": NaN}', b"[1, 2]", b'"x"', b""])
def test_malformed_json_is_400(http, content):
    r = http.post(C, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_streaming_request_errors_before_the_stream_starts(http):
    r = http.post(C, json={"prompt": "x" * 600, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")


def test_unknown_route_and_method(http):
    assert http.get("/v1/nothing").json()["error"]["message"] == "Not Found"
    r = http.get(C)
    assert r.status_code == 405 and "error" in r.json()


def test_rejected_requests_leave_nothing_behind(http, live):
    for body in [{"prompt": ["ok", ""]}, {"prompt": ["fine", "x" * 600]}]:
        assert http.post(C, json=body).status_code == 400
    assert live.all_blocks_free()


def test_api_key(live):
    """Same engine, a second app with a key (no lifespan: the live server owns the engine)."""
    from engine.entrypoints.openai import build_app

    app = build_app(live.async_engine, "tiny-gpt2", api_key="s3cret", shutdown_engine=False)
    c = TestClient(app)
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
        r = c.get("/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert c.post(C, json={"prompt": "x"}).status_code == 401
    assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # open, as in vLLM


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inproc", "mp"])
def test_a_closed_engine_answers_new_requests_503(model_cache, mode):
    """Shut down (not killed: the kill -9 tests cover a death), the engine refuses what comes next
    with a 503 that says why, for a completion, a chat and a stream alike, and /health agrees."""
    import httpx

    from engine.entrypoints.openai import build_app
    from tests.server.conftest import make_engine, start_server

    async_engine = make_engine(mode, num_kv_blocks=16)
    server, thread, url = start_server(build_app(async_engine, "tiny-gpt2"))
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
            async_engine.stop(0)
            for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                               ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})]:
                r = c.post(path, json=body)
                assert r.status_code == 503, (path, r.text)
                assert "not running" in r.json()["error"]["message"], r.text
            assert c.get("/health").status_code == 503
    finally:
        server.should_exit = True
        thread.join(30)
