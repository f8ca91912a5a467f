"""`vllm-trace attach [URL]`: the TUI driving a server started elsewhere (`serve --no-tui`).

It reads /trace/state once, follows /trace/events, and sends the keys' commands to the
/trace/* control endpoints; the server's engine is paused and stepped exactly as in-process.
"""
from __future__ import annotations

import argparse
import asyncio
import os

from tracer.commands.send import DEFAULT_URL


def register(sub) -> None:
    p = sub.add_parser("attach", help="open the TUI on a running server (started with --no-tui)",
                       description="Open the TUI on a `vllm-trace serve --no-tui` server: watch its requests, "
                                   "pause and step its engine over HTTP.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("url", nargs="?", default=DEFAULT_URL, help="the server's base URL")
    p.add_argument("--api-key", default=os.environ.get("VLLM_TRACE_API_KEY"),
                   help="the server's --api-key: a server started with one wants it for every /trace "
                        "endpoint, reads included (default: $VLLM_TRACE_API_KEY)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_attach(args.url, args.api_key))


async def _attach(url: str, api_key: str | None) -> int:
    from tracer.cli import UserError
    from tracer.tui.app import TraceApp
    from tracer.tui.sources.remote import AttachError, RemoteSource

    source = RemoteSource(url, api_key)
    try:
        await source.start()  # fail here, with one line, rather than inside the TUI
    except AttachError as e:
        await source.close()
        raise UserError(f"{e}; is `vllm-trace serve` running there?") from None
    await TraceApp(source, initial_pane="requests").run_async()
    return 0
