"""`vllm-trace attach [URL ...]`: the TUI driving a server started elsewhere (`serve --no-tui`).

It reads /trace/state once, follows /trace/events, and sends the keys' commands to the
/trace/* control endpoints; the server's engine is paused and stepped exactly as in-process.
If the server goes away the header says DISCONNECTED and the TUI reconnects when it is back.
With several URLs (disaggregated prefill's instances) it follows them all and shows one at a
time: `i` shows the next (tracer.tui.sources.instances). With --web-port it serves that TUI in a
browser instead (tracer.tui.web; one server).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from tracer.commands import HelpFormatter
from tracer.defaults import DEFAULT_URL
from tracer.errors import UserError


def register(sub) -> None:
    from tracer.commands.serve import port_number

    p = sub.add_parser("attach", help="open the TUI on a running server (started with --no-tui)",
                       description="Open the TUI on a `vllm-trace serve --no-tui` server: watch its requests, "
                                   "pause and step its engine over HTTP. Give several URLs (a prefill and a decode "
                                   "instance) to follow them all in one TUI; `i` shows the next.",
                       formatter_class=HelpFormatter)
    p.add_argument("url", nargs="*", default=[DEFAULT_URL],
                   help="the server's base URL (several: one TUI over them all, `i` shows the next)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_TRACE_API_KEY"),
                   help="the server's --api-key: a server started with one wants it for every /trace "
                        "endpoint, reads included (default: $VLLM_TRACE_API_KEY)")
    p.add_argument("--web-port", type=port_number, default=None, metavar="PORT",
                   help="serve this TUI in a browser on http://127.0.0.1:PORT instead of the terminal "
                        "(each browser tab runs its own attach); Ctrl-C stops it")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.web_port is not None and len(args.url) > 1:
        raise UserError("--web-port serves one server's TUI: give one URL (run one attach per server)")
    return asyncio.run(_attach(args.url, args.api_key, args.web_port))


async def _attach(urls: list[str], api_key: str | None, web_port: int | None = None) -> int:
    from tracer.tui.app import TraceApp
    from tracer.tui.sources.instances import InstancesSource

    sources = []
    try:
        for url in urls:
            sources.append(await _connect(url, api_key))
    except UserError:
        for source in sources:
            await source.close()
        raise
    if web_port is not None:
        await sources[0].close()
        return await _web(urls[0], api_key, web_port)
    app = TraceApp(sources[0] if len(sources) == 1 else InstancesSource(sources))
    await app.run_async()
    if app.return_code == 130:  # ctrl+c
        raise KeyboardInterrupt
    return 0


async def _connect(url: str, api_key: str | None):
    """A RemoteSource that has taken the server's state, or one UserError line."""
    from tracer.tui.sources.remote import AttachError, AttachRefused, RemoteSource

    try:
        source = RemoteSource(url, api_key)
    except AttachRefused as e:  # a malformed URL
        raise UserError(str(e)) from None
    try:
        await source.start()  # fail here, with one line, rather than inside the TUI
    except AttachRefused as e:  # a server is there: say what it said, not that none is
        await source.close()
        raise UserError(str(e)) from None
    except AttachError as e:
        await source.close()
        raise UserError(f"{e}; is `vllm-trace serve` running there?") from None
    return source


async def _web(url: str, api_key: str | None, port: int) -> int:
    from tracer.tui.web import WebView

    web = await WebView(url, port, api_key).start()
    print(f"vllm-trace attach: the TUI of {url} in a browser at {web.url} (Ctrl-C to stop)", file=sys.stderr,
          flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await web.stop()
    return 0
