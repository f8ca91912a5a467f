"""The TUI in a browser: `serve --web-port PORT` and `attach URL --web-port PORT`.

The page is textual-serve's (its xterm.js terminal, template and static files); the server
side is ours, on the caller's asyncio loop next to uvicorn and the terminal TUI. Each tab
that opens the page gets its own process, `vllm-trace attach URL` under Textual's web driver
(tracer.tui.web_driver), talking to this server over its stdin and stdout in textual-serve's
packets. So the browser view is exactly the attached TUI: keys, panels, pause and step, for
learners on a remote GPU box or a classroom projector. It listens on 127.0.0.1 only.

A tab's process is ours to end, whatever ends first:
- the tab (its websocket closes, or stops answering pings for HEARTBEAT_S: a browser that
  vanished without closing it): "quit", then SIGTERM, then SIGKILL, each after a grace;
- this server (stop()): the same for every tab;
- this process dying outright: the tab's stdin reaches its end and the driver exits.
Processes are started directly (no shell in between that a kill would stop instead) and in
their own session, so a Ctrl-C in the terminal reaches the server, which ends them in order.

A page load holds one request open (GET /first-frame/TAB) until its tab's TUI has drawn its
first screen. A browser counts a pending request as the page still loading: a headless
`chromium --screenshot --virtual-time-budget=...`, whose budget otherwise runs out in about
a second of real time while the process is still starting, then pictures the TUI, not the
splash. A process that cannot start (no server at the URL) writes its one-line error into
the tab, and the tab ends.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import sys
import time
from importlib.metadata import version
from pathlib import Path

from tracer.errors import UserError

HOST = "127.0.0.1"
HEARTBEAT_S = 5.0  # ping each tab's websocket this often; no pong within half of it ends the tab
QUIT_GRACE_S = 4.0  # after "quit", seconds before SIGTERM (the driver exits by itself within 3)
TERM_GRACE_S = 2.0  # after SIGTERM, seconds before SIGKILL
FIRST_FRAME_TIMEOUT_S = 30.0  # a page's held request is answered by then, drawn or not
SETTLE_QUIET_S, SETTLE_MAX_S = 0.4, 3.0  # after the first screen, until its output pauses: the resize the
# page sends once connected is drawn too (a busy engine's TUI redraws 12 times a second: then the cap)
PAGE_TTL_S = 120.0  # a page's tab id is forgotten if no websocket used it by then
SCREEN_BYTES = 512  # a terminal write this long is a screen drawn (Textual writes a frame at once)
REFIT_DELAY_MS = 100  # after a window resize, before the terminal refits (see _adapt)
ATTACH_DRIVER = "tracer.tui.web_driver:TabDriver"


def _package_dir() -> Path:
    import textual_serve

    return Path(textual_serve.__file__).parent


class Tab:
    """One browser tab: its websocket and its `vllm-trace attach` process."""

    def __init__(self, tab_id: str):
        self.id = tab_id
        self.process: asyncio.subprocess.Process | None = None
        self.drawn = asyncio.Event()  # its first screen went out (or it never will): the page may settle
        self.bytes_sent = 0  # terminal output sent to the browser
        self.last_output = 0.0  # when the last of it went (monotonic seconds)
        self.first_screen = b""  # the first terminal output, for tests and for a person to read
        self.error: str | None = None  # why its process did not start

    async def start(self, command: list[str], env: dict[str, str]) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)

    async def send(self, kind: bytes, payload: bytes) -> None:
        stdin = self.process.stdin
        if stdin.is_closing():
            return
        try:
            stdin.write(kind + len(payload).to_bytes(4, "big") + payload)
            await stdin.drain()
        except (ConnectionError, RuntimeError):
            pass  # the process has gone: end() reaps it

    async def send_meta(self, meta: dict) -> None:
        await self.send(b"M", json.dumps(meta).encode())

    async def end(self, quit_grace: float = QUIT_GRACE_S) -> int | None:
        """Ask the process to quit; if it has not within the grace, SIGTERM, then SIGKILL. Returns its status."""
        p = self.process
        if p is None:
            return None
        if p.returncode is None:
            await self.send_meta({"type": "quit"})
        for grace, sig in ((quit_grace, signal.SIGTERM), (TERM_GRACE_S, signal.SIGKILL)):
            try:
                return await asyncio.wait_for(asyncio.shield(p.wait()), grace)
            except asyncio.TimeoutError:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass
        return await p.wait()


class WebView:
    """    web = await WebView("http://127.0.0.1:8000", 8080).start();  ...;  await web.stop()"""

    def __init__(self, server_url: str, port: int, api_key: str | None = None, title: str = "vllm-trace"):
        self.server_url = server_url
        self.port = port
        self.api_key = api_key
        self.title = title
        self.tabs: dict[str, Tab] = {}  # open tabs, by id
        self.pages: dict[str, tuple[float, asyncio.Event]] = {}  # pages served whose held request is pending
        self.ended: list[Tab] = []  # tabs closed (the last few, for tests)
        self._handlers: set[asyncio.Task] = set()  # each open tab's websocket handler
        self._runner = None
        self._template = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tracer.cli", "attach", self.server_url]

    def environment(self, width: int, height: int) -> dict[str, str]:
        env = {**os.environ, "TEXTUAL_DRIVER": ATTACH_DRIVER, "TEXTUAL_FPS": "60",
               "TEXTUAL_COLOR_SYSTEM": "truecolor", "TERM_PROGRAM": "textual",
               "TERM_PROGRAM_VERSION": version("textual-serve"), "COLUMNS": str(width), "ROWS": str(height)}
        if self.api_key:
            env["VLLM_TRACE_API_KEY"] = self.api_key  # not on the command line, which `ps` shows to everyone
        return env

    async def start(self) -> "WebView":
        import jinja2
        from aiohttp import web

        static = _package_dir() / "static"
        self._template = jinja2.Environment(loader=jinja2.FileSystemLoader(_package_dir() / "templates"),
                                            autoescape=True).get_template("app_index.html")
        app = web.Application()
        app.add_routes([web.get("/", self._page), web.get("/ws/{tab}", self._websocket),
                        web.get("/first-frame/{tab}", self._first_frame), web.static("/static", static)])
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, self.port)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            self._runner = None
            raise UserError(f"cannot serve the browser view on {HOST}:{self.port}: {e.strerror}") from None
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """End every tab's process (they are gone when this returns), then the web server."""
        await asyncio.gather(*(tab.end(quit_grace=1.0) for tab in list(self.tabs.values())))
        if self._handlers:  # their processes have ended: they close their websockets and return
            await asyncio.wait(self._handlers, timeout=QUIT_GRACE_S)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- the page ---------------------------------------------------------------------------
    async def _page(self, request):
        from aiohttp import web

        now = time.monotonic()
        for tab_id, (served, _) in list(self.pages.items()):
            if now - served > PAGE_TTL_S:
                del self.pages[tab_id]
        tab_id = secrets.token_urlsafe(12)
        self.pages[tab_id] = (now, asyncio.Event())
        font_size = request.query.get("fontsize", "16")
        base = f"//{request.host}"  # as the browser reached us: through an SSH tunnel too
        html = self._template.render(
            font_size=int(font_size) if font_size.isdigit() else 16, app_websocket_url=f"ws:{base}/ws/{tab_id}",
            config={"static": {"url": f"{base}/static/"}}, application={"name": self.title}, ping_url="")
        return web.Response(text=_adapt(html, tab_id, base), content_type="text/html",
                            headers={"Cache-Control": "no-store"})  # a page, a tab id: never twice

    async def _first_frame(self, request):
        from aiohttp import web

        tab_id = request.match_info["tab"]
        page = self.pages.get(tab_id)
        if page is not None:
            try:
                await asyncio.wait_for(page[1].wait(), FIRST_FRAME_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
            settled_by = time.monotonic() + SETTLE_MAX_S
            while (tab := self.tabs.get(tab_id)) is not None and time.monotonic() < settled_by:
                quiet = time.monotonic() - tab.last_output
                if quiet >= SETTLE_QUIET_S:
                    break
                await asyncio.sleep(SETTLE_QUIET_S - quiet)
            self.pages.pop(tab_id, None)
        return web.Response(text="drawn", headers={"Cache-Control": "no-store"})

    # ---- a tab ------------------------------------------------------------------------------
    async def _websocket(self, request):
        from aiohttp import WSMsgType, web

        tab_id = request.match_info["tab"]
        page = self.pages.get(tab_id)  # (its held request forgets it)
        if page is None or tab_id in self.tabs:  # a page served long ago, or opened twice: a tab of its own
            tab_id = secrets.token_urlsafe(12)
        tab = Tab(tab_id)
        if page is not None:
            tab.drawn = page[1]
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S)
        await ws.prepare(request)
        self.tabs[tab.id] = tab
        self._handlers.add(handler := asyncio.current_task())
        output = None
        try:
            await tab.start(self.command(), self.environment(_size(request, "width", 80), _size(request, "height", 24)))
            output = asyncio.create_task(self._forward_output(tab, ws))
            async for message in ws:
                if message.type == WSMsgType.TEXT:
                    await self._from_browser(tab, ws, message.data)
        finally:
            tab.drawn.set()
            await tab.end()
            if output is not None:
                await output  # the process has ended: its stdout is at its end
            del self.tabs[tab.id]
            self.ended = (self.ended + [tab])[-16:]
            if not ws.closed:
                await ws.close()
            self._handlers.discard(handler)
        return ws

    async def _from_browser(self, tab: Tab, ws, data: str) -> None:
        try:
            kind, body = json.loads(data)[:2]
        except (ValueError, TypeError):
            return
        if kind == "stdin" and isinstance(body, str):
            await tab.send(b"D", body.encode())
        elif kind == "resize" and isinstance(body, dict):
            await tab.send_meta({"type": "resize", "width": body.get("width"), "height": body.get("height")})
        elif kind in ("focus", "blur"):
            await tab.send_meta({"type": kind})
        elif kind == "ping":
            await ws.send_json(["pong", body])

    async def _forward_output(self, tab: Tab, ws) -> None:
        """The process's packets to the browser, until the process ends (read to the end even
        after the tab has gone, so a process that is exiting never blocks on a full pipe)."""
        stdout = tab.process.stdout
        try:
            for _ in range(10):  # Textual's web driver announces itself before any packet
                line = await stdout.readline()
                if not line or line == b"__GANGLION__\n":
                    break
            if not line or line != b"__GANGLION__\n":
                await self._failed(tab, ws)
                return
            while True:
                kind = await stdout.readexactly(1)
                payload = await stdout.readexactly(int.from_bytes(await stdout.readexactly(4), "big"))
                if kind == b"D":
                    await self._to_browser(tab, ws, payload)
                elif kind == b"M" and json.loads(payload).get("type") == "exit" and not ws.closed:
                    await ws.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            tab.drawn.set()

    async def _to_browser(self, tab: Tab, ws, payload: bytes) -> None:
        if ws.closed:
            return
        try:
            await ws.send_bytes(payload)
        except ConnectionError:
            return  # the tab went away mid-send: its handler ends the process
        if len(payload) >= SCREEN_BYTES:  # the driver's set-up sequences come first, a few bytes each
            tab.drawn.set()
        tab.bytes_sent += len(payload)
        tab.last_output = time.monotonic()
        if len(tab.first_screen) < 1 << 16:
            tab.first_screen += payload

    async def _failed(self, tab: Tab, ws) -> None:
        """The process ended (or wrote something else) before its TUI started: show why in the tab."""
        try:
            await asyncio.wait_for(tab.process.wait(), TERM_GRACE_S)
        except asyncio.TimeoutError:
            pass  # not a TUI, still running: the tab's end ends it
        lines = (await tab.process.stderr.read()).decode("utf-8", "replace").strip().splitlines()
        tab.error = lines[-1] if lines else f"`vllm-trace attach` exited with status {tab.process.returncode}"
        print(f"vllm-trace: browser view: a tab's TUI did not start: {tab.error}", file=sys.stderr, flush=True)
        if not ws.closed:
            await ws.send_bytes(f"\r\n  {tab.error}\r\n\r\n  Reload the page to try again.\r\n".encode())
            await ws.close()


def _size(request, name: str, default: int) -> int:
    text = request.query.get(name, "")
    return min(int(text), 1000) if text.isdigit() and int(text) > 0 else default


def _adapt(html: str, tab_id: str, base: str) -> str:
    """textual-serve's page, with three changes. Its font comes from our server, not Google's
    (nothing leaves the machine), and the terminal starts once the font is loaded: measured
    with a fallback font, it would resize itself as soon as the font arrives. A request holds
    the page's loading until its tab has drawn (see the module's docstring). And the terminal
    refits itself to a resized window a moment later, not at once: a refit blanks it until
    its next paint, and a headless screenshot resizes the window just before it captures."""
    font = f"{base}/static/fonts/RobotoMono-VariableFont_wght.ttf"
    style = f"<style>@font-face {{ font-family: 'Roboto Mono'; src: url('{font}'); }}</style>"
    script = f"""<script>
      fetch("/first-frame/{tab_id}", {{cache: "no-store"}});
      const startTerminal = window.onload;  // textual.js's, set as its script ran
      window.onload = (e) => document.fonts.load("16px 'Roboto Mono'").finally(() => startTerminal(e));
      Object.defineProperty(window, "onresize", {{get: () => null, set: (fit) =>
        window.addEventListener("resize", () => setTimeout(fit, REFIT_DELAY_MS))}});
    </script>""".replace("REFIT_DELAY_MS", str(REFIT_DELAY_MS))
    html = re.sub(r'<link[^>]*fonts\.googleapis\.com[^>]*>', style, html)
    return html.replace("</head>", f"  {script}\n  </head>", 1)
