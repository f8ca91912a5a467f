"""How lessons and exercises are started: from their own script (``main``), and as the
``vllm-trace lesson`` and ``vllm-trace exercise`` subcommands (``register``).

The lessons sit above the tracer in the dependency order, so the tracer cannot import them;
instead this package adds its subcommands to the tracer's command line through the
``vllm_trace.commands`` entry point (pyproject.toml), which ``tracer.cli`` loads. Everything
heavy (torch, the engine, Textual) is imported only when a subcommand runs, so
``vllm-trace --help`` stays fast.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from pathlib import Path

from tracer.errors import UserError

WIDTH = 80


def register(sub) -> None:
    """Add `lesson` and `exercise` to vllm-trace's subparsers (the entry point's target)."""
    p = sub.add_parser("lesson", help="list the lessons, or run one",
                       description="Lessons teach one concept each on the real engine, pausing at the moment "
                                   "that shows it. Without an argument, list them.")
    p.add_argument("which", nargs="?", help="lesson number (5) or name (paged_kv_cache)")
    add_run_args(p)
    p.set_defaults(handler=run_lesson_command)

    p = sub.add_parser("exercise", help="graded exercises: write a piece of the engine, check it inside the engine",
                       description="Without arguments, list the exercises. --start writes a stub to fill in; "
                                   "--check FILE runs your function inside the real engine and grades it "
                                   "(exit 0 only when every check passes); --solution prints a reference.")
    p.add_argument("which", nargs="?", help="exercise number (1) or name (slot_mapping)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--start", action="store_true", help="write the stub exercise_NN_name.py into this directory")
    mode.add_argument("--check", metavar="FILE", help="grade the function in FILE inside the real engine")
    mode.add_argument("--solution", action="store_true", help="print a reference solution")
    p.add_argument("--force", action="store_true", help="with --start: overwrite an existing file")
    p.set_defaults(handler=run_exercise_command)


def add_run_args(p: argparse.ArgumentParser, no_pause_help: str = "run straight through") -> None:
    """The flags a lesson runs with, from its script or from `vllm-trace lesson`."""
    p.add_argument("--no-pause", action="store_true", help=no_pause_help)
    p.add_argument("--model", default="tiny-gpt2", help="model to run the lesson on (default tiny-gpt2)")
    p.add_argument("--tui", action="store_true",
                   help="open the TUI on the lesson's engine, held at each checkpoint, narration beside it")


# ---- one lesson --------------------------------------------------------------------------------
def main(module_globals: dict, argv: list[str] | None = None) -> int:
    """Run the lesson defined in a lesson module (pass ``globals()``): its exit code, 0 when
    every check held."""
    title, run = module_globals["TITLE"], module_globals["run"]
    number = int(module_globals["__file__"].rsplit("/", 1)[-1][:2])
    ap = argparse.ArgumentParser(description=title)
    add_run_args(ap, "run straight through without waiting for Enter")
    args = ap.parse_args(argv)
    from lessons.framework import Lesson, run_lesson

    if args.tui:
        from lessons.tui import run_in_tui  # Textual only when asked for
        lesson = Lesson(number, title, pause_enabled=not args.no_pause, model=args.model)
        return run_in_tui(lesson, run)
    lesson = Lesson(number, title, pause_enabled=not args.no_pause and sys.stdin.isatty(), model=args.model)
    return run_lesson(lesson, run)


# ---- vllm-trace lesson ---------------------------------------------------------------------------
def listing(rows: list[tuple[int, str, str, str]], width: int | None = WIDTH) -> str:
    """One entry per lesson: number, name, title and summary, wrapped to `width` columns under
    the title (nothing cut); width None: one line each (for a pipe, where grep reads it)."""
    name_w = max(len(name) for _, name, _, _ in rows)
    title = "vllm-trace lessons (run one: vllm-trace lesson NN, or by name; --no-pause, --tui)"
    lines = [title] if width is None else textwrap.wrap(title, width)
    for number, name, title, summary in rows:
        line = f"{number:02d}  {name:<{name_w}}  {title}: {summary}"
        indent = " " * (6 + name_w)
        if width is None:
            lines.append(line)
        else:
            lines += textwrap.wrap(line, max(width, len(indent) + 20), subsequent_indent=indent, break_on_hyphens=False)
    return "\n".join(lines)


def terminal_width() -> int | None:
    """The terminal's columns, or None when the output is not a terminal."""
    return shutil.get_terminal_size((WIDTH, 24)).columns if sys.stdout.isatty() else None


def run_lesson_command(args: argparse.Namespace) -> int:
    import importlib

    import lessons

    if args.which is None:
        rows = [(info.number, info.name, info.title, info.summary) for info in lessons.discover()]
        print(listing(rows, terminal_width()))
        return 0
    info = lessons.find(args.which)
    module = importlib.import_module(info.module)
    argv = ["--model", args.model] + (["--no-pause"] if args.no_pause else []) + (["--tui"] if args.tui else [])
    return main(vars(module), argv)


# ---- vllm-trace exercise -------------------------------------------------------------------------
def run_exercise_command(args: argparse.Namespace) -> int:
    from lessons import exercises

    if args.which is None:
        if args.start or args.check or args.solution:
            raise UserError("say which exercise: vllm-trace exercise NN --start (list them: vllm-trace exercise)")
        rows = [(i.number, i.name, i.summary) for i in exercises.discover()]
        print("vllm-trace exercises (vllm-trace exercise NN --start, then --check FILE)"[:WIDTH])
        for number, name, summary in rows:
            line = f"{number:02d}  {name:<{max(len(r[1]) for r in rows)}}  {summary}"
            print(line if len(line) <= WIDTH else line[:WIDTH - 1] + "…")
        return 0
    try:
        info = exercises.find(args.which)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.solution:
        print(info.solution(), end="")
        return 0
    if args.start:
        path = Path(info.stub_file)
        if path.exists() and not args.force:
            raise UserError(f"{path} already exists (your work?); check it with --check {path}, or --force to "
                            "overwrite it with a fresh stub")
        path.write_text(info.stub())
        print(f"wrote {path}: fill in {info.module.FUNCTION}(), then: vllm-trace exercise {info.number} --check {path}")
        return 0
    if args.check:
        try:
            return exercises.grade(info, Path(args.check))
        except ValueError as e:
            raise UserError(str(e)) from None
    print(f"Exercise {info.number}: {info.title}. {info.summary}\n"
          f"Start: vllm-trace exercise {info.number} --start, then --check {info.stub_file}")
    return 0
