"""`vllm-trace export TRACE --format perfetto -o OUT.json`: a recorded trace for ui.perfetto.dev;
`vllm-trace export A.trace B.trace -o OUT.json`: several instances' traces merged (a process each, one
clock, a request's prefill linked to its decode); `vllm-trace export TRACE --roofline OUT.html`: its
profiled steps on this machine's roofline."""
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
                                   "trace-event JSON that ui.perfetto.dev and chrome://tracing open; several traces "
                                   "(disaggregated prefill's instances) go into one file, a process each, on one "
                                   "clock, with an arrow from each request's prefill to its decode. --roofline "
                                   "draws its profiled steps (recorded with profiling on: POST /start_profile, "
                                   "`p` in the TUI) on this machine's roofline, as an HTML page or an SVG image.",
                       formatter_class=HelpFormatter)
    p.add_argument("trace", nargs="+", help="a JSON-lines trace file written by --trace-file (several: merged)")
    p.add_argument("--format", choices=FORMATS, default="perfetto", help="output format")
    p.add_argument("-o", "--output", help="where to write the exported trace")
    p.add_argument("--roofline", metavar="OUT", help="write the roofline chart of the profiled steps to OUT "
                   "(.html: a self-contained page with a table; .svg: the chart alone)")
    p.add_argument("--step", type=int, default=None, help="with --roofline: chart this profiled step (default: "
                   "the last profiled prefill step and the last profiled decode step, on one chart)")
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
    if not args.output and not args.roofline:
        raise UserError("say where to write: -o OUT.json (Perfetto) and/or --roofline OUT.html")
    if args.roofline and len(args.trace) > 1:
        raise UserError("--roofline charts one trace: give one, or merge several with -o OUT.json alone")
    if args.roofline:
        roofline(args)
    return perfetto(args) if args.output else 0


def roofline(args: argparse.Namespace) -> None:
    from tracer.roofline import cached_roofline
    from tracer.roofline_chart import export_roofline

    if cached_roofline() is None:
        print("calibrating this machine's roofline once (a matmul and a copy, about a second)…", file=sys.stderr)
    try:
        steps, roof = export_roofline(args.trace[0], args.roofline, args.step)
    except OSError as e:
        raise output_error(args.roofline, e) from None
    what = " and ".join(f"{s.label} (step {s.step})" for s in steps)
    roofs = f"ridge {roof.ridge:.3g} FLOP/byte" if roof is not None else "no roofline for this device here"
    print(f"wrote the roofline of {what} to {args.roofline} ({roofs})", file=sys.stderr)


def perfetto(args: argparse.Namespace) -> int:
    from tracer.export import export_merged

    try:
        result = export_merged(args.trace, args.output)
    except OSError as e:  # the trace's own errors are TraceFileErrors (one line each): this is the output
        raise output_error(args.output, e) from None
    n = result.num_flows
    merged = (f" from {len(args.trace)} traces, a process each on one clock, {n} request{'s' * (n != 1)} linked "
              f"from prefill to decode" if len(args.trace) > 1 else "")
    print(f"wrote {result.num_events} trace events{merged} to {args.output} (open it in https://ui.perfetto.dev)",
          file=sys.stderr)
    for path in result.truncated_paths:
        print(f"vllm-trace export: warning: {path} is truncated (its last line was cut off mid-write, "
              f"as when the recording process dies): exported what precedes it", file=sys.stderr)
    return 0
