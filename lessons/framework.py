"""What every lesson uses: narration, showing real engine state, predictions, and checks.

A lesson is a script ``lessons/NN_name.py`` with ``TITLE``, ``SUMMARY`` and ``run(lesson)``.
It drives the real engine itself, one ``engine.step()`` at a time, so "pausing the engine"
is simply not calling ``step()`` until the learner continues. Everything shown is read from
the engine or from its trace events; every claim the text makes is checked with
``lesson.check`` against that state, so a lesson that teaches something false fails.

    lesson.say("A prompt of 40 tokens needs ceil(40/16) = 3 blocks.")
    lesson.step()                                   # one real engine step
    lesson.show(block_table(req, block_size=16))
    lesson.check(len(req.block_ids) == 3, "its block table holds 3 blocks")
    lesson.predict("How many slots of the last block are used?", "40 - 2*16 = 8")

``run_lesson`` runs one to its end with any ``Presenter``; ``lessons.cli.main`` starts it from its
script (in the terminal, or in the TUI through ``lessons.tui``, which builds on this module and
is never imported by it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from rich.console import Console, Group
from rich.markdown import Markdown
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from engine import LLM, Hooks, SamplingParams
from engine.core.block_pool import NULL_BLOCK_ID
from engine.request import Request
from tracer.events import Event
from tracer.session import TraceSession


class LessonCheckFailed(AssertionError):
    """A lesson's claim does not hold for the engine's real state."""


class LessonCancelled(Exception):
    """The learner left (quit the TUI): raised at the lesson's next checkpoint or line of narration."""


class Presenter:
    """Where a lesson's narration goes and how a checkpoint waits: the terminal (below) or the
    TUI's side panel (lessons/tui.py). The lesson's text and checks are the same for both."""

    def emit(self, renderable) -> None:
        raise NotImplementedError

    def wait(self, prompt: str) -> None:
        """Block until the learner continues; the lesson does not step the engine meanwhile."""
        raise NotImplementedError


class ConsolePresenter(Presenter):
    def __init__(self, console: Console):
        self.console = console

    def emit(self, renderable) -> None:
        self.console.print(renderable)

    def wait(self, prompt: str) -> None:
        self.console.input(f"[dim]{prompt}…[/]")


@dataclass
class Lesson:
    number: int
    title: str
    pause_enabled: bool = True
    model: str = "tiny-gpt2"
    console: Console = field(default_factory=Console)
    checks: list[str] = field(default_factory=list)  # claims verified so far, in order
    sessions: list[TraceSession] = field(default_factory=list)  # appended before the engine starts
    llms: list[LLM] = field(default_factory=list)  # appended once started (sessions[i] traces llms[i])
    presenter: Presenter | None = None  # default: the console

    def __post_init__(self) -> None:
        if self.presenter is None:
            self.presenter = ConsolePresenter(self.console)

    # ---- narration --------------------------------------------------------------------------
    def intro(self, what_you_will_see: str) -> None:
        self.presenter.emit(Rule(f"[bold]Lesson {self.number}: {self.title}"))
        self.presenter.emit(Panel(Markdown(what_you_will_see), title="What you will see", border_style="cyan"))

    def say(self, text: str) -> None:
        self.presenter.emit(Markdown(text))

    def show(self, renderable, title: str | None = None) -> None:
        self.presenter.emit(Panel(renderable, title=title, border_style="blue") if title else renderable)

    def pause(self, prompt: str = "Press Enter to continue") -> None:
        """A checkpoint: the engine stays exactly where it is until the learner continues."""
        if self.pause_enabled:
            self.presenter.wait(prompt)

    def predict(self, question: str, answer: str) -> None:
        """Ask the learner to predict something before showing it."""
        self.presenter.emit(Panel(question, title="Predict", border_style="yellow"))
        self.pause("Think, then press Enter for the answer")
        self.presenter.emit(Text("Answer: ", style="bold yellow") + Text(answer))

    def check(self, condition: bool, claim: str) -> None:
        """Verify a claim the lesson makes against real engine state."""
        if not condition:
            raise LessonCheckFailed(f"lesson {self.number} claims: {claim} — but the engine disagrees")
        self.checks.append(claim)
        self.presenter.emit(Text("  ✓ ", style="green") + Text(claim, style="dim"))

    def done(self, summary: str) -> None:
        self.presenter.emit(Panel(Markdown(summary), title="What you learned", border_style="green"))

    # ---- the engine -------------------------------------------------------------------------
    def engine(self, trace_file: str | None = None, hand_steps: bool = True, **llm_kwargs) -> tuple[LLM, TraceSession]:
        """A real engine on the lesson's model, with a trace session recording its events. hand_steps: the
        lesson calls engine.step() and reads one whole step per call, so scheduling is synchronous unless it
        passes async_scheduling=True; a lesson that only generates (hand_steps=False) gets the engine's
        default (async scheduling with CUDA, synchronous on a CPU, as vLLM)."""
        hooks = Hooks()
        session = TraceSession(hooks, trace_file=trace_file, control=False, model=self.model)
        self.sessions.append(session)
        llm_kwargs.setdefault("model", self.model)
        # a lesson that takes the step apart needs one whole step per engine.step(): under async scheduling
        # (two steps in flight) a call may return before its step ran, or with the step before's outputs
        if hand_steps:
            llm_kwargs.setdefault("async_scheduling", False)
        llm = LLM(hooks=hooks, **llm_kwargs)
        self.llms.append(llm)
        return llm, session

    def close(self) -> None:
        for s in self.sessions:
            s.close()


# ---- state, drawn ------------------------------------------------------------------------------
def greedy(n: int) -> SamplingParams:
    """n greedy tokens, EOS ignored: the lessons' runs must have the lengths their checks expect."""
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def queue_request(engine, request_id: str, prompt, params: SamplingParams) -> Request:
    """Queue a request through the front end (an LLMEngine) and return the EngineCore's own Request
    object, to watch its block table, tokens and status as the engine steps."""
    engine.add_request(request_id, prompt, params)
    return engine.engine_core.engine_core.requests[request_id]


def events_of(session: TraceSession) -> list[Event]:
    """Every event the session's bus still holds, oldest first."""
    return session.bus.subscribe(from_start=True).pull().events


def block_table(req: Request, block_size: int, title: str | None = None) -> Table:
    """A request's block table: logical block -> physical block, the positions whose K/V each
    holds, and the token ids at those positions (two columns: a lesson whose prompt ids are
    0, 1, 2, ... would otherwise read a generated token's id as its position)."""
    t = Table(title=title or f"block table of request {req.request_id}", show_lines=False)
    t.add_column("logical")
    t.add_column("physical")
    t.add_column("slots used")
    t.add_column("positions")
    t.add_column("token ids there")
    n = req.num_computed_tokens
    for i, phys in enumerate(req.block_ids):
        used = max(0, min(block_size, n - i * block_size))
        first = i * block_size
        toks = req.all_token_ids[first:first + used]
        positions = "-" if not used else str(first) if used == 1 else f"{first}–{first + used - 1}"
        t.add_row(str(i), str(phys), f"{used}/{block_size}", positions,
                  " ".join(map(str, toks[:8])) + (" …" if used > 8 else ""))
    return t


def queues(llm: LLM) -> Table:
    """The scheduler's queues, as the engine holds them now."""
    core = llm.llm_engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    s = core.scheduler
    n = core.step_count  # steps run so far: the next one is step n
    t = Table(title=f"scheduler queues {f'after step {n - 1}, ' if n else ''}before step {n}")
    for col in ("queue", "request", "status", "computed / total tokens", "blocks"):
        t.add_column(col)
    for name, reqs in (("running", s.running), ("waiting", list(s.waiting))):
        for r in reqs:
            t.add_row(name, r.request_id, r.status.value, f"{r.num_computed_tokens} / {r.num_tokens}",
                      " ".join(map(str, r.block_ids)))
    return t


def kv_blocks(llm: LLM, width: int = 32) -> Text:
    """Every physical block as a cell: a request's id if it holds the block, · if cached-free,
    ∅ for the null block (block 0, never a request's), blank if free."""
    bm = llm.llm_engine.engine_core.engine_core.kv_cache_manager
    owner: dict[int, str] = {}
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    for r in list(sched.running) + list(sched.waiting):
        for b in r.block_ids:
            owner[b] = r.request_id if b not in owner else "*"  # * = shared
    out = Text()
    for b in range(bm.block_pool.num_gpu_blocks):
        cell = owner.get(b)
        if b == NULL_BLOCK_ID:
            cell = "∅"
        elif cell is None:
            cell = "·" if bm.block_pool.blocks[b].block_hash is not None else " "
        out.append(f"{cell[-1]:>1}", style="bold" if b in owner else "dim")
        out.append("\n" if (b + 1) % width == 0 else "")
    return out


def table(columns: list[str], rows: list[list], title: str | None = None) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*map(str, r))
    return t


# ---- running a lesson ----------------------------------------------------------------------------
def run_lesson(lesson: Lesson, run: "Run") -> int:
    """Run a lesson to its end; the exit code: 0 every check held, 1 one failed, 130 interrupted.

    PyTorch runs on one thread meanwhile: the built-in model's ops are tiny, and on a busy
    machine a second thread spin-waits for a core (measured: lesson 15 took 55 s wall, 16.5 s
    CPU with 2 threads on 2 shared cores, 22 s and 6.1 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(lesson)
    except LessonCheckFailed as e:
        lesson.presenter.emit(Text(f"✗ {e}", style="bold red"))
        return 1
    except (KeyboardInterrupt, LessonCancelled):
        return 130
    finally:
        lesson.close()
        torch.set_num_threads(threads)
    return 0


Run = Callable[[Lesson], None]
__all__ = ["Lesson", "LessonCheckFailed", "LessonCancelled", "Presenter", "ConsolePresenter", "run_lesson",
           "block_table", "queues", "kv_blocks", "table", "events_of", "Group"]
