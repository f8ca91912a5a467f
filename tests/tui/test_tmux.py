"""The TUI in a real terminal: `vllm-trace serve tiny-gpt2` in tmux, a request sent with curl
from a second shell (another tmux window), the pane captured: the request's id and its
generated text must be on screen, and `q` must stop the server."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = f"vllm-trace-tui-{os.getpid()}"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or shutil.which("curl") is None,
                                reason="needs tmux and curl (apt-get install -y tmux curl)")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.2)  # polling another process: there is nothing to wait on in-process
    raise AssertionError(f"timed out waiting for {what}")


def pane() -> str:
    return tmux("capture-pane", "-p", "-t", f"{SESSION}:0")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_shows_a_curl_request_in_the_terminal(model_cache, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # COLUMNS/LINES (set under pytest) would override the terminal size Textual reads
    env = f"env -u COLUMNS -u LINES VLLM_TRACE_CACHE={model_cache} PYTHONPATH={ROOT} TERM=xterm-256color"
    serve = f"{env} {sys.executable} -m tracer.cli serve tiny-gpt2 --port {port} --num-kv-blocks 256"
    tmux("new-session", "-d", "-s", SESSION, "-x", "160", "-y", "48", f"cd {ROOT} && {serve}; sleep 60")
    try:
        # no client is attached: fix the size, or tmux falls back to 80x24
        tmux("set-option", "-t", SESSION, "window-size", "manual")
        tmux("resize-window", "-t", f"{SESSION}:0", "-x", "160", "-y", "48")
        wait_for(lambda: healthy(url), 90, "the server")
        wait_for(lambda: "Ready." in pane(), 30, "the TUI's ready line")
        assert f"curl {url}/v1/completions" in pane()

        out = tmp_path / "response.json"
        body = json.dumps({"model": "tiny-gpt2", "prompt": "Hello, my name is", "max_tokens": 12, "temperature": 0})
        tmux("new-window", "-d", "-t", SESSION,
             f"curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}' > {out}")
        response = wait_for(lambda: out.exists() and out.stat().st_size and json.loads(out.read_text()), 60,
                            "curl's answer")
        rid, text = response["id"], response["choices"][0]["text"]

        tmux("send-keys", "-t", f"{SESSION}:0", "2")  # the Requests panel; at 160 columns the detail is beside it
        try:
            screen = wait_for(lambda: rid in pane() and text.strip()[:8] in pane() and pane(), 15, "")
        except AssertionError:
            raise AssertionError(f"request {rid} and its text {text!r} are not on screen:\n{pane()}") from None
        assert "finished" in screen and "12/12" in screen

        tmux("send-keys", "-t", f"{SESSION}:0", "q")
        wait_for(lambda: not healthy(url), 30, "the server to stop after q")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
