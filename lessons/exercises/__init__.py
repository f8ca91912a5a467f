"""Graded exercises: write one function of the engine, and it runs INSIDE the real engine.

An exercise is a module ``lessons/exercises/NN_name.py`` with ``TITLE``, ``SUMMARY``, the
function's ``FUNCTION`` name, ``SIGNATURE`` and ``CONTRACT`` (its docstring), a reference
``SOLUTION_BODY``, and ``grade(fn, grader)``. ``grade`` puts ``fn`` into a real engine in place
of the engine's own code, runs a real workload, and checks it with the claims the lessons make
(``grader.check``): the first that does not hold ends the grading, saying which and why.

    vllm-trace exercise                    # the list
    vllm-trace exercise 1 --start          # writes exercise_01_slot_mapping.py here (a stub)
    vllm-trace exercise 1 --check exercise_01_slot_mapping.py
    vllm-trace exercise 1 --solution       # a reference that passes
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import textwrap
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from rich.console import Console
from rich.text import Text

from engine import SamplingParams

HERE = Path(__file__).parent


class CheckFailed(AssertionError):
    """One of the exercise's checks does not hold for the learner's function."""


class NotWritten(Exception):
    """The learner's function still raises NotImplementedError."""


@dataclass
class Grader:
    """Runs an exercise's checks and reports each: ✓ claim, or ✗ claim and why it failed."""

    console: Console = field(default_factory=Console)
    passed: list[str] = field(default_factory=list)

    def check(self, condition: bool, claim: str, why: str = "") -> None:
        if not condition:
            raise CheckFailed(f"{claim}" + (f"\n    why: {why}" if why else ""))
        self.passed.append(claim)
        self.console.print(Text("  ✓ ", style="green") + Text(claim, style="dim"))

    def say(self, text: str) -> None:
        self.console.print(Text(text))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run_to_end(engine) -> dict[str, list[int]]:
    """Step until every request has finished: request id -> its output token ids."""
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def learner_call(fn, *args, **kwargs):
    """Call the learner's function, telling an untouched stub apart from a bug."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        raise NotWritten(str(e)) from None


@dataclass
class ExerciseInfo:
    number: int
    name: str
    title: str
    summary: str
    module: ModuleType

    @property
    def stub_file(self) -> str:
        return f"exercise_{self.number:02d}_{self.name}.py"

    def source(self, body: str) -> str:
        m = self.module
        doc = textwrap.indent('"""' + m.CONTRACT.strip() + '\n"""', "    ")
        imports = m.IMPORTS + "\n\n\n" if getattr(m, "IMPORTS", "") else "\n\n"
        return (f'"""Exercise {self.number}: {self.title}.\n\nCheck it with: vllm-trace exercise {self.number} '
                f'--check {self.stub_file}\n"""\n{imports}{m.SIGNATURE}\n{doc}\n'
                f'{textwrap.indent(textwrap.dedent(body).strip(), "    ")}\n')

    def stub(self) -> str:
        return self.source('raise NotImplementedError("write this function")')

    def solution(self) -> str:
        return self.source(self.module.SOLUTION_BODY)


def discover() -> list[ExerciseInfo]:
    out = []
    for path in sorted(HERE.glob("[0-9][0-9]_*.py")):
        m = re.match(r"(\d\d)_(.+)\.py$", path.name)
        module = importlib.import_module(f"lessons.exercises.{path.stem}")
        out.append(ExerciseInfo(int(m.group(1)), m.group(2), module.TITLE, module.SUMMARY, module))
    return out


def find(key: str) -> ExerciseInfo:
    """By number ("1", "01") or by name (a unique prefix)."""
    exercises = discover()
    key_n = key.replace("-", "_").lower()
    for info in exercises:
        if key.isdigit() and int(key) == info.number:
            return info
    matches = [i for i in exercises if i.name.startswith(key_n)]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(f"{i.number:02d} {i.name}" for i in exercises)
    raise ValueError(f"no single exercise matches {key!r}; exercises: {names}")


def load_function(info: ExerciseInfo, path: Path):
    """The learner's function from their file; ValueError with a plain message if it can't be had."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file (write one with: vllm-trace exercise {info.number} --start)")
    spec = importlib.util.spec_from_file_location(f"_exercise_{info.number:02d}_learner", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a syntax error or a failing import in the learner's file
        raise ValueError(f"{path} does not load: {_where(e, path)}") from None
    fn = getattr(module, info.module.FUNCTION, None)
    if not callable(fn):
        raise ValueError(f"{path} defines no function {info.module.FUNCTION}()")
    return fn


def _where(e: BaseException, path: Path) -> str:
    """`ValueError: msg (line 12 of file.py)`: the learner's own frame, not ours."""
    line = getattr(e, "lineno", None) if isinstance(e, SyntaxError) else None
    for frame in traceback.extract_tb(e.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    return f"{type(e).__name__}: {e}" + (f" (line {line} of {path.name})" if line else "")


def grade(info: ExerciseInfo, path: Path, console: Console | None = None) -> int:
    """Load the learner's function, put it into the engine, run the checks. 0 = all passed."""
    console = console or Console()
    fn = load_function(info, path)
    grader = Grader(console)
    console.print(Text(f"Exercise {info.number}: {info.title}", style="bold") +
                  Text(f" — checking {info.module.FUNCTION}() from {path}, inside the real engine", style="dim"))
    try:
        info.module.grade(fn, grader)
    except NotWritten:
        console.print(Text(f"✗ {info.module.FUNCTION}() raises NotImplementedError: this is the untouched stub. "
                           f"Write its body (the docstring says what it must do), then check again.",
                           style="bold red"))
        return 1
    except CheckFailed as e:
        console.print(Text(f"✗ check failed: {e}", style="bold red"))
        console.print(Text(f"  {len(grader.passed)} check(s) passed before it.", style="dim"))
        return 1
    except Exception as e:  # the learner's function crashed inside the engine
        console.print(Text(f"✗ {info.module.FUNCTION}() raised {_where(e, path)}", style="bold red"))
        return 1
    console.print(Text(f"All {len(grader.passed)} checks passed.", style="bold green"))
    return 0


