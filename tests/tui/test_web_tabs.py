"""The browser view's tabs and their `vllm-trace attach` processes, loaded the way people load
the page: a plain headless Chromium (`--virtual-time-budget`, as a screenshot is taken), a
browser killed outright or frozen, a server stopped or killed with tabs open. Each tab's
process ends with its tab and with the server, in any order, and none is left behind; a tab
whose process cannot reach the server says why. The driver's own exits are tested on a
process driven through its pipes as the web view drives it, with no browser."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.tui.test_tmux import ROOT, free_port, healthy, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,900"]
pytest.importorskip("textual_serve", reason="needs textual-serve (pip install textual-serve)")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install -y chromium)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`serve --no-tui` for the tests that run their own web view or attach."""
    cache = os.environ.setdefault("VLLM_TRACE_CACHE", str(tmp_path_factory.mktemp("vtc")))
    proc, url = _serve(tmp_path_factory.mktemp("serve"), cache)
    yield url
    proc.send_signal(signal.SIGINT)
    proc.wait(30)


def _serve(tmp: Path, cache: str, web_port: int | None = None):
    port = free_port()
    command = [sys.executable, "-m", "tracer.cli", "serve", "tiny-gpt2", "--no-tui", "--port", str(port),
               "--num-kv-blocks", "64"] + (["--web-port", str(web_port)] if web_port else [])
    log = (tmp / f"serve-{port}.log").open("w")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=log, env={**os.environ, "VLLM_TRACE_CACHE": cache})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: healthy(url) or proc.poll() is not None, 90, "the server")
    finally:
        log.close()
    assert proc.poll() is None, Path(log.name).read_text()
    if web_port:
        wait_for(lambda: _answers(f"http://127.0.0.1:{web_port}"), 30, "the browser view")
    return proc, url


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def attach_processes(url: str) -> list[int]:
    """Every live `attach URL` process on this machine (the server's port makes URL unique), zombies aside."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"attach" in argv and url.encode() in argv and state != "Z":
            found.append(int(entry.name))
    return found


def chromium(url: str, *args: str) -> subprocess.Popen:
    profile = tempfile.mkdtemp(prefix="vt-chromium-")  # a fresh profile, as on a first visit
    return subprocess.Popen([CHROMIUM, *CHROMIUM_ARGS, f"--user-data-dir={profile}", *args, url],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)


def signal_browser(browser: subprocess.Popen, sig: int) -> None:
    """To the whole browser: its network process holds the websocket and answers pings by itself."""
    try:
        os.killpg(browser.pid, sig)
    except ProcessLookupError:
        pass


# ---- a plain load ------------------------------------------------------------------------------
@pytest.mark.slow
@needs_chromium
def test_a_plain_load_pictures_the_tui_and_its_tab_ends_with_the_browser(server, tmp_path):
    """`chromium --screenshot --virtual-time-budget` finishes in about a second of real time, while a
    tab's process takes longer to start: the page's held request keeps it loading until the TUI has
    drawn. Before, the picture was textual-serve's splash and the process outlived the browser."""
    from tracer.tui.web import WebView

    async def main():
        web = await WebView(server, 0).start()
        try:
            browser = chromium(web.url, "--virtual-time-budget=15000", "--dump-dom")
            dom, _ = await asyncio.to_thread(browser.communicate, timeout=120)
            shot = chromium(web.url, "--virtual-time-budget=15000", f"--screenshot={tmp_path / 'web.png'}")
            await asyncio.to_thread(shot.wait, 120)
            deadline = time.monotonic() + 10
            while web.tabs and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return dom.decode(), list(web.tabs), web.ended
        finally:
            await web.stop()

    dom, still_open, ended = asyncio.run(main())
    assert "-first-byte" in dom, f"the page settled before its terminal received anything:\n{dom[:2000]}"
    assert not still_open, "a tab outlived its browser"
    assert len(ended) == 2 and all(tab.process.returncode is not None for tab in ended)
    for tab in ended:
        assert b"tiny-gpt2" in tab.first_screen and b"RUNNING" in tab.first_screen, tab.first_screen[-2000:]
    assert (tmp_path / "web.png").stat().st_size > 30_000  # the splash alone is ~15 KB
    assert not attach_processes(server)
    shown = Path(__file__).with_name("browser-plain-load.png")
    if shown.parent.joinpath(".keep-screenshots").exists():  # for a person to look at
        shutil.copy(tmp_path / "web.png", shown)


# ---- tabs and the server, in every order ---------------------------------------------------------
@pytest.mark.slow
@needs_chromium
def test_each_tab_ends_with_its_browser_or_the_server_whichever_goes_first(tmp_path, model_cache):
    web_port = free_port()
    web = f"http://127.0.0.1:{web_port}"
    serve, url = _serve(tmp_path, model_cache, web_port)
    browsers = []
    try:
        def open_tab() -> subprocess.Popen:
            before = set(attach_processes(url))
            browser = chromium(web, "--remote-debugging-port=0")  # stays open, as a person's browser
            browsers.append(browser)
            wait_for(lambda: set(attach_processes(url)) - before, 60, "the tab's attach process")
            return browser

        killed = open_tab()
        signal_browser(killed, signal.SIGKILL)  # gone at once: the kernel closes its connections
        wait_for(lambda: not attach_processes(url), 15, "the killed browser's tab to end")

        frozen = open_tab()
        signal_browser(frozen, signal.SIGSTOP)  # gone without closing anything: only the pings notice
        wait_for(lambda: not attach_processes(url), 25, "the frozen browser's tab to end")
        signal_browser(frozen, signal.SIGKILL)

        open_tab()
        open_tab()  # two tabs open when the server stops
        assert len(attach_processes(url)) == 2
        serve.send_signal(signal.SIGINT)
        assert serve.wait(30) == 0
        time.sleep(0.5)
        assert not attach_processes(url), "attach processes outlived their server"
    finally:
        for browser in browsers:
            signal_browser(browser, signal.SIGKILL)
            browser.wait()
        if serve.poll() is None:
            serve.kill()
            serve.wait()


@pytest.mark.slow
@needs_chromium
def test_a_server_killed_outright_takes_its_tabs_with_it(tmp_path, model_cache):
    web_port = free_port()
    serve, url = _serve(tmp_path, model_cache, web_port)
    browser = chromium(f"http://127.0.0.1:{web_port}", "--remote-debugging-port=0")
    try:
        wait_for(lambda: attach_processes(url), 60, "the tab's attach process")
        serve.kill()  # no shutdown at all: the tab's stdin reaches its end
        serve.wait()
        wait_for(lambda: not attach_processes(url), 10, "the orphaned attach process to exit")
    finally:
        signal_browser(browser, signal.SIGKILL)
        browser.wait()
        for pid in attach_processes(url):
            os.kill(pid, signal.SIGKILL)
        for pid in _core_processes(serve.pid):
            os.kill(pid, signal.SIGKILL)


def _core_processes(parent: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == parent]


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


# ---- a tab that cannot reach its server ------------------------------------------------------------
def test_a_tab_whose_server_is_gone_shows_why_and_ends():
    from aiohttp import ClientSession, WSMsgType

    from tracer.tui.web import WebView

    dead = f"http://127.0.0.1:{free_port()}"

    async def main():
        web = await WebView(dead, 0).start()
        try:
            async with ClientSession() as http:
                page = await (await http.get(web.url)).text()
                ws_url = page.split('data-session-websocket-url="', 1)[1].split('"', 1)[0]
                got = b""
                async with http.ws_connect(f"ws:{ws_url.removeprefix('ws:')}?width=100&height=30") as ws:
                    async for message in ws:
                        if message.type == WSMsgType.BINARY:
                            got += message.data
            return got, web
        finally:
            await web.stop()

    t0 = time.monotonic()
    got, web = asyncio.run(asyncio.wait_for(main(), 60))
    ended = web.ended  # (once stop() has returned, every tab is here)
    assert b"no vllm-trace server with a trace API at " + dead.encode() in got
    assert ended[-1].process.returncode == 2 and ended[-1].error.startswith("vllm-trace attach: error:")
    assert time.monotonic() - t0 < 30


def test_a_tab_reaches_its_server_past_a_proxy_in_the_environment(server, monkeypatch):
    """With HTTP_PROXY set, a tab's attach (httpx honours it; curl, checking /health, does not)
    failed with "ConnectError: All connection attempts failed" and the page said "Application
    failed to start". Loopback never goes through a proxy now."""
    from aiohttp import ClientSession, WSMsgType

    from tracer.tui.web import WebView

    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there

    async def main():
        web = await WebView(server, 0).start()
        try:
            async with ClientSession(trust_env=False) as http:
                page = await (await http.get(web.url)).text()
                ws_url = page.split('data-session-websocket-url="', 1)[1].split('"', 1)[0]
                got = b""
                async with http.ws_connect(f"{ws_url}?width=100&height=30") as ws:
                    while b"tiny-gpt2" not in got:
                        message = await ws.receive(timeout=60)
                        assert message.type == WSMsgType.BINARY, (message, got[-500:])
                        got += message.data
            return got
        finally:
            await web.stop()

    assert b"tiny-gpt2" in asyncio.run(main())  # the TUI's header, drawn by the tab's attach


def test_attach_that_cannot_connect_exits_with_one_line():
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tracer.cli", "attach", dead], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("vllm-trace attach: error: no vllm-trace server")
    assert time.monotonic() - t0 < 30


# ---- the tab's driver, driven through its pipes -------------------------------------------------------
def _packet(kind: bytes, meta: dict) -> bytes:
    payload = json.dumps(meta).encode()
    return kind + len(payload).to_bytes(4, "big") + payload


def _tab_process(url: str) -> subprocess.Popen:
    from tracer.tui.web import WebView

    view = WebView(url, 0)
    return subprocess.Popen(view.command(), cwd=ROOT, env=view.environment(155, 42), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_a_quit_that_arrives_while_the_tui_starts_ends_the_process(server):
    """A browser that closes its tab at once (a screenshot) sends its size and then the tab's quit
    before the TUI is up. With Textual's own web driver that process kept repainting at 100 % CPU
    for ever, ignoring SIGTERM too."""
    proc = _tab_process(server)
    try:
        proc.stdin.write(_packet(b"M", {"type": "resize", "width": 155, "height": 42}))
        proc.stdin.write(_packet(b"M", {"type": "resize", "width": 155, "height": 50}))
        proc.stdin.flush()
        time.sleep(0.2)
        proc.stdin.write(_packet(b"M", {"type": "quit"}))
        proc.stdin.flush()
        assert proc.wait(20) == 0  # nobody reads its output: as a web server whose tab has gone
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_the_tab_process_exits_when_its_server_closes_the_pipe(server):
    proc = _tab_process(server)
    try:
        assert proc.stdout.readline() == b"__GANGLION__\n"  # the TUI is up
        proc.stdin.close()  # what the web server's death does
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()
