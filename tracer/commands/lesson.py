"""`vllm-trace lesson [NN | NAME]`: list the lessons, or run one.

The lessons sit above the tracer in the dependency order; this launcher finds them by name
at run time (importlib), the way a shell finds a script, so nothing in the tracer imports them.
"""
from __future__ import annotations

import argparse
import importlib


def register(sub) -> None:
    p = sub.add_parser("lesson", help="list the lessons, or run one",
                       description="Lessons teach one concept each on the real engine, pausing at the moment "
                                   "that shows it. Without an argument, list them.")
    p.add_argument("which", nargs="?", help="lesson number (5) or name (paged_kv_cache)")
    p.add_argument("--no-pause", action="store_true", help="run straight through")
    p.add_argument("--model", default="tiny-gpt2", help="model to run the lesson on (default tiny-gpt2)")
    p.add_argument("--tui", action="store_true",
                   help="open the TUI on the lesson's engine, held at each checkpoint, narration beside it")
    p.set_defaults(handler=run)


WIDTH = 80


def listing(rows: list[tuple[int, str, str, str]], width: int = WIDTH) -> str:
    """One line per lesson, at most `width` columns: number, name, title — and as much of the
    summary as fits (cut with …)."""
    name_w = max(len(name) for _, name, _, _ in rows)
    lines = ["vllm-trace lessons (run one: vllm-trace lesson NN, or by name; --no-pause, --tui)"[:width]]
    for number, name, title, summary in rows:
        line = f"{number:02d}  {name:<{name_w}}  {title}: {summary}"
        lines.append(line if len(line) <= width else line[:width - 1] + "…")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    lessons = importlib.import_module("lessons")
    if args.which is None:
        print(listing([(info.number, info.name, info.title, info.summary) for info in lessons.discover()]))
        return 0
    info = lessons.find(args.which)
    module = importlib.import_module(info.module)
    argv = ["--model", args.model] + (["--no-pause"] if args.no_pause else []) + (["--tui"] if args.tui else [])
    return importlib.import_module("lessons.framework").main(vars(module), argv)
