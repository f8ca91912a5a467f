"""The TUI in a browser: `serve --web-port PORT` and `attach URL --web-port PORT`.

textual-serve runs a small web server whose page is a terminal emulator; each browser tab
that opens it starts its own process, here `vllm-trace attach URL`, and talks to it over a
websocket. So the browser view is exactly the attached TUI (keys, panels, pause and step),
for learners on a remote GPU box or a classroom projector. It listens on 127.0.0.1 only.
It runs on the caller's asyncio loop (next to uvicorn and the terminal TUI), not in the
thread of its own that textual-serve's `Server.serve()` would start.
"""
from __future__ import annotations

import shlex
import sys

from tracer.errors import UserError

HOST = "127.0.0.1"


class WebView:
    """    web = await WebView("http://127.0.0.1:8000", 8080).start();  ...;  await web.stop()"""

    def __init__(self, server_url: str, port: int, api_key: str | None = None):
        from textual_serve.server import Server

        command = [sys.executable, "-m", "tracer.cli", "attach", server_url]
        if api_key:
            command += ["--api-key", api_key]
        self.port = port
        self.server = Server(shlex.join(command), host=HOST, port=port, title="vllm-trace")
        self._runner = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self) -> "WebView":
        from aiohttp import web


        self.server.debug = False
        app = await self.server._make_app()  # textual-serve's routes (page, websocket, static files)
        app.on_startup.clear()  # its startup prints a banner on stdout
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, self.port)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise UserError(f"cannot serve the browser view on {HOST}:{self.port}: {e.strerror}") from None
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]
        self.server.public_url = self.url  # the page tells the browser where the websocket is
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
