"""`vllm-trace export TRACE --format perfetto -o OUT.json`: a recorded trace for ui.perfetto.dev."""
from __future__ import annotations

import argparse
import os
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


def output_error(path: str, e: OSError) -> UserError:
    """One true line for an output path that cannot be written."""
    parent = os.path.dirname(path) or "."
    if isinstance(e, IsADirectoryError):
        return UserError(f"cannot write {path}: it is a directory")
    if isinstance(e, FileNotFoundError) and not os.path.isdir(parent):
        return UserError(f"cannot write {path}: no such directory {parent}")
    return UserError(f"cannot write {path}: {e.strerror or e}")


def run(args: argparse.Namespace) -> int:
    from tracer.export import export_perfetto

    try:
        result = export_perfetto(args.trace, args.output)
    except OSError as e:  # the trace's own errors are TraceFileErrors (one line each): this is the output
        raise output_error(args.output, e) from None
    print(f"wrote {result.num_events} trace events to {args.output} (open it in https://ui.perfetto.dev)",
          file=sys.stderr)
    if result.truncated:
        print(f"vllm-trace export: warning: {args.trace} is truncated (its last line was cut off mid-write, "
              f"as when the recording process dies): exported what precedes it", file=sys.stderr)
    return 0
