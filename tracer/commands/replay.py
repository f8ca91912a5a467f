"""`vllm-trace replay TRACE.jsonl`: the TUI over a recorded trace, with time travel
(←/→ a step back or forward, home/end the first or last step)."""
from __future__ import annotations

import argparse

from tracer.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("replay", help="open a recorded trace (--trace-file) in the TUI, with time travel",
                       description="Open a trace recorded with `serve --trace-file` in the TUI. ←/→ step "
                                   "backward and forward through the engine's steps, home/end jump to the "
                                   "first/last.")
    p.add_argument("trace", help="a JSON-lines trace file written by --trace-file")
    p.add_argument("--step", type=int, default=None, help="open at this engine step (default: the first)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tracer.tui.app import TraceApp
    from tracer.tui.sources.replay import ReplaySource

    try:
        source = ReplaySource.load(args.trace)
    except FileNotFoundError:
        raise UserError(f"no such trace file: {args.trace}") from None
    if args.step is not None:
        try:
            source.replay.goto(args.step)
        except KeyError as e:
            raise UserError(str(e.args[0])) from None
    app = TraceApp(source)
    app.run()
    if app.return_code == 130:  # ctrl+c
        raise KeyboardInterrupt
    return 0
