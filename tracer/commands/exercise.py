"""`vllm-trace exercise [NN] [--start | --check FILE | --solution]`: graded exercises.

An exercise asks for one function of the engine. --check puts it into a real engine in place
of the engine's own, runs a workload and grades it with the lessons' checks. The exercises sit
above the tracer (in lessons/exercises/); this command finds them by name at run time, as
`vllm-trace lesson` finds the lessons.
"""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from tracer.errors import UserError

WIDTH = 80


def register(sub) -> None:
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
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    exercises = importlib.import_module("lessons.exercises")
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
