"""`vllm-trace replay TRACE.jsonl`: the TUI over a recorded trace, with time travel
(←/→ a step back or forward, home/end the first or last step)."""
from __future__ import annotations

import argparse
import sys

from tracer.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("replay", help="open a recorded trace (--trace-file) in the TUI, with time travel",
                       description="Open a trace recorded with `serve --trace-file` in the TUI. ←/→ step "
                                   "backward and forward through the engine's steps, home/end jump to the "
                                   "first/last. The file is indexed, not loaded: a trace of any size opens "
                                   "in bounded memory (as in the live TUI, the latest finished requests are "
                                   "kept in view, not all of them).")
    p.add_argument("trace", help="a JSON-lines trace file written by --trace-file")
    p.add_argument("--step", type=int, default=None, help="open at this engine step (default: the first)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tracer.tui.app import TraceApp
    from tracer.tui.sources.replay import ReplaySource

    source = ReplaySource.load(args.trace)  # a TraceFileError is one line (vllm-trace prints it)
    if source.replay.truncated:
        print(f"vllm-trace replay: warning: {args.trace} is truncated (its last line was cut off mid-write, "
              f"as when the recording process dies): replaying what precedes it", file=sys.stderr)
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
