"""`vllm-trace export TRACE --format perfetto -o OUT.json`: a recorded trace for ui.perfetto.dev."""
from __future__ import annotations

import argparse
import sys

from tracer.commands import HelpFormatter
from tracer.errors import UserError

FORMATS = ["perfetto"]


def register(sub) -> None:
    p = sub.add_parser("export", help="convert a recorded trace (--trace-file) for other viewers",
                       description="Convert a trace recorded with --trace-file. 'perfetto' writes Chrome "
                                   "trace-event JSON that ui.perfetto.dev and chrome://tracing open.",
                       formatter_class=HelpFormatter)
    p.add_argument("trace", help="a JSON-lines trace file written by --trace-file")
    p.add_argument("--format", choices=FORMATS, default="perfetto", help="output format")
    p.add_argument("-o", "--output", required=True, help="where to write the exported trace")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tracer.export import export_perfetto

    try:
        chrome = export_perfetto(args.trace, args.output)
    except FileNotFoundError:
        raise UserError(f"no such trace file: {args.trace}")
    n = len(chrome["traceEvents"])
    print(f"wrote {n} trace events to {args.output} (open it in https://ui.perfetto.dev)", file=sys.stderr)
    return 0
