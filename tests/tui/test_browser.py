"""The browser view in a real browser: `serve --no-tui --web-port` (textual-serve), Debian's
chromium driven by playwright. The page's terminal (xterm.js, drawn on a canvas) is read from
its own screen buffer: the page's script is served with one line added that keeps the
terminal object where the test can reach it. Load the page, see the header, send a request
with curl's equivalent and see its id, press a key and see it act."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.tui.test_tmux import ROOT, free_port, healthy, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install playwright)")
pytest.importorskip("textual_serve", reason="needs textual-serve (pip install textual-serve)")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install -y chromium)")

KEEP_TERMINAL = "const t=new w(e,{ping:r});"  # textual-serve's page script, where it makes the terminal


def screen_text(page) -> str:
    return page.evaluate("""() => { const b = window.__vt && window.__vt.terminal.buffer.active; if (!b) return "";
        const out = []; for (let y = 0; y < b.length; y++) out.push(b.getLine(y).translateToString(true));
        return out.join("\\n"); }""")


def test_the_browser_view_shows_requests_and_takes_keys(model_cache, tmp_path):
    port, web_port = free_port(), free_port()
    url, web = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{web_port}"
    log = (tmp_path / "serve.log").open("w")
    command = [sys.executable, "-m", "tracer.cli", "serve", "tiny-gpt2", "--no-tui", "--port", str(port),
               "--web-port", str(web_port), "--num-kv-blocks", "64"]
    server = subprocess.Popen(command, cwd=ROOT, stderr=log, stdout=log,
                              env={**os.environ, "VLLM_TRACE_CACHE": model_cache})
    try:
        wait_for(lambda: healthy(url), 90, "the server")
        wait_for(lambda: _answers(web), 30, "the browser view")
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})

            def patched(route):
                body = route.fetch().text()
                assert KEEP_TERMINAL in body, "textual-serve's page script changed: update KEEP_TERMINAL"
                route.fulfill(body=body.replace(KEEP_TERMINAL, KEEP_TERMINAL + "window.__vt=t;"),
                              content_type="application/javascript")
            page.route("**/static/js/textual.js", patched)
            page.goto(web)
            wait_for(lambda: "tiny-gpt2" in screen_text(page) and "RUNNING" in screen_text(page), 60,
                     "the header in the browser")
            text = screen_text(page)
            assert "cpu · cpu" in text and "Startup" in text and "Overview" in text

            body = {"model": "tiny-gpt2", "prompt": "Hello, my name is", "max_tokens": 12, "temperature": 0}
            rid = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["id"]
            try:
                wait_for(lambda: rid in screen_text(page), 30, "the request id in the browser")
            except AssertionError:
                raise AssertionError(f"{rid} is not on the page:\n{screen_text(page)}") from None
            # the request has finished (its answer is here): the page shows that within a few refreshes
            try:
                wait_for(lambda: "finished 1" in screen_text(page), 15, "the finished request in the header")
            except AssertionError:
                raise AssertionError(f"'finished 1' is not on the page:\n{screen_text(page)}") from None

            page.click(".textual-terminal")
            page.keyboard.press("2")  # the Requests panel: its column names, the request in it
            wait_for(lambda: "why waiting / finish" in screen_text(page), 15, "the Requests panel after 2")
            page.keyboard.press("Space")  # pause: the engine (in the server) holds
            wait_for(lambda: "PAUSED" in screen_text(page), 15, "PAUSED after space")
            page.screenshot(path=str(tmp_path / "browser.png"))
            browser.close()
        assert httpx.get(f"{url}/trace/state", timeout=5).json()["controller"]["pause_requested"]
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    shown = Path(__file__).with_name("browser-view.png")
    if shown.parent.joinpath(".keep-screenshots").exists():  # for a person to look at
        shutil.copy(tmp_path / "browser.png", shown)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
