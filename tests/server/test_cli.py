"""`vllm-trace send`, `bench` and `serve` as a user runs them."""
from __future__ import annotations

import json
import re
import signal
import socket
import time

import pytest

from tests.server.conftest import spawn_serve
from tracer.cli import build_parser, main


@pytest.mark.slow
def test_send_prints_text_then_usage(live, capsys):
    assert main(["send", "Hello", "--url", live.url, "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and re.search(r"cmpl-\w+: \d+ prompt \+ 5 completion", err)
    assert main(["send", "Hello", "--url", live.url, "--max-tokens", "5", "--stream"]) == 0
    streamed, err = capsys.readouterr()
    assert streamed == out and "5 completion" in err  # same greedy text, streamed
    assert main(["send", "Hi", "--chat", "--stream", "--url", live.url, "--max-tokens", "3"]) == 0
    assert re.search(r"chatcmpl-\w+: \d+ prompt \+ 3 completion", capsys.readouterr().err)


def test_send_n_and_priority(live, capsys):
    argv = ["send", "Hello", "--url", live.url, "--max-tokens", "4", "--n", "2", "--temperature", "0.9",
            "--priority", "1"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.count("--- choice") == 2 and "+ 8 completion" in err  # both samples count
    assert main(argv + ["--stream"]) == 0
    assert capsys.readouterr().out.count("--- choice") == 2


def test_send_reports_server_errors_and_unreachable_servers(live, capsys):
    assert main(["send", "x" * 600, "--url", live.url]) == 1
    assert "max_model_len" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["send", "Hello", "--url", f"http://127.0.0.1:{port}"]) == 2
    assert "cannot reach a server" in capsys.readouterr().err


def test_bench_reports_and_writes_json(live, tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--url", live.url, "--num-requests", "8", "--concurrency", "4", "--prompt-len", "4:12",
            "--output-len", "6", "--json", str(path), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for label in ("Mean TTFT (ms)", "Median ITL (ms)", "P99 E2E (ms)", "Output token throughput"):
        assert label in out
    result = json.loads(path.read_text())
    assert result["completed"] == 8 and result["failed"] == 0 and result["total_output_tokens"] == 48
    assert main(argv[:-3] + ["--n", "2", "--priority", "3", "--no-progress", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["total_output_tokens"] == 96  # both samples of every prompt
    assert 0 < result["ttft"]["median_ms"] <= result["e2e"]["median_ms"]


@pytest.mark.slow
def test_bench_paces_requests_over_a_duration_a_person_can_watch(live, tmp_path):
    """At its defaults bench sent everything at once and was over in a second: --request-rate (Poisson,
    as vLLM's) with --duration keeps a steady trickle for that long."""
    path = tmp_path / "bench.json"
    t0 = time.monotonic()
    assert main(["bench", "--url", live.url, "--request-rate", "4", "--duration", "2", "--output-len", "4",
                 "--prompt-len", "4", "--json", str(path), "--no-progress"]) == 0
    result = json.loads(path.read_text())
    assert time.monotonic() - t0 >= 2 and result["duration_s"] >= 1.5  # the last arrival is before the 2 s
    assert 3 <= result["completed"] <= 20 and result["failed"] == 0  # ~8 arrivals at 4/s (seeded)
    assert result["request_rate"] == 4 and result["send_duration_s"] == 2
    assert main(["bench", "--url", live.url, "--duration", "2"]) == 2  # no pace: all at once, for ever


def test_a_proxy_in_the_environment_does_not_come_between_us_and_a_local_server(live, capsys, monkeypatch):
    """HTTP_PROXY set (curl ignores that upper-case name, httpx does not): send, bench and attach
    failed with "ConnectError: All connection attempts failed" while /health answered curl."""
    from tracer.net import trust_env

    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    assert main(["send", "Hello", "--url", live.url, "--max-tokens", "3"]) == 0
    assert "3 completion" in capsys.readouterr().err
    assert main(["bench", "--url", live.url, "--num-requests", "2", "--output-len", "2", "--no-progress"]) == 0
    assert not trust_env("http://localhost:8000") and not trust_env("http://[::1]:8000")
    assert trust_env("http://gpu-box.example:8000")  # a remote server may need the proxy


def test_bench_rejects_rate_and_concurrency_together(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--request-rate", "2", "--concurrency", "2"])


def test_serve_help_is_grouped():
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for group in ("http server:", "engine:", "display:"):
        assert group in text
    for flag in ("--served-model-name", "--api-key", "--chat-template", "--max-num-seqs", "--no-tui",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--block-size", "--num-kv-blocks"):
        assert flag in text


ONE_PROCESS = pytest.mark.parametrize("mode", [(), ("--no-multiprocessing",)], ids=["mp", "inproc"])


@pytest.mark.slow
@ONE_PROCESS
def test_serve_starts_answers_and_drains_on_ctrl_c(model_cache, tmp_path, mode):
    """The real command in a subprocess: stages, ready line, then SIGINT with a request in flight;
    the engine core in its own process or in serve's."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    proc, banner, url = spawn_serve("--num-kv-blocks", "64", "--served-model-name", "tiny",
                                    "--chat-template", str(template), "--no-tui", *mode)
    try:
        for stage in ("arguments", "tokenizer", "weights", "KV cache", "HTTP ready"):  # the Startup panel's words
            assert re.search(rf"^  {stage}\s+[\d.]+ ms", banner, re.M), banner
        assert "curl " + url + "/v1/completions" in next(proc.stderr)

        import httpx
        r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
        from engine.builtin_model import builtin_path
        from engine.tokenizer import load_tokenizer
        want = len(load_tokenizer(builtin_path()).encode("<user>Hi<assistant>"))
        assert r.json()["count"] == want  # the --chat-template file is used
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 150, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            chunks = r.iter_lines()
            assert next(chunks).startswith("data: ")  # generating: now Ctrl-C
            proc.send_signal(signal.SIGINT)
            rest = [json.loads(line[6:]) for line in chunks if line.startswith("data: {")]
        assert rest[-1]["usage"]["completion_tokens"] == 150  # it was allowed to finish
        assert proc.wait(60) == 0
        assert "stopped cleanly" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@ONE_PROCESS
def test_a_second_ctrl_c_stops_at_once_without_a_traceback(model_cache, mode):
    """The first Ctrl-C lets requests in flight finish; a second one aborts them and stops the
    engine now: exit 0, a line that says so, no traceback."""
    proc, _, url = spawn_serve("--num-kv-blocks", "64", "--no-tui", *mode)
    try:
        import httpx
        body = {"model": "tiny-gpt2", "prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            chunks = r.iter_lines()
            assert next(chunks).startswith("data: ")  # generating
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            try:
                got = sum(1 for line in chunks if line.startswith("data: {"))
            except httpx.HTTPError:  # the connection may be cut rather than ended
                got = 0
        assert got < 499  # aborted, not drained
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert "stopped at a second Ctrl-C" in err and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_names_its_stages_as_the_startup_panel_does_in_one_column(capsys, monkeypatch):
    """serve --no-tui said resolve_model / tokenizer_load / model_load / kv_cache_alloc where the TUI says
    model files / tokenizer / weights / KV cache, and core_process_start pushed its time out of line."""
    from tracer.commands import serve
    from tracer.tui.fmt import STAGE_LABELS

    monkeypatch.setattr(serve, "_SHOW_STAGES", True)
    for name in STAGE_LABELS:
        serve._stage(name, 0.0123, "details")
    lines = capsys.readouterr().err.splitlines()
    assert [line[2:].split("  ")[0].strip() for line in lines] == list(STAGE_LABELS.values())
    assert "model files" in STAGE_LABELS.values() and "weights" in STAGE_LABELS.values()
    assert len({line.index("12.3 ms") for line in lines}) == 1, lines
