"""What tracing costs: the shared workload with tracing bypassed, off, on, and on with a
TUI-like reader, each with async scheduling on and off, in one process.

    python -m benchmarks.trace_overhead [--requests 32] [--reps 7] [--model tiny-gpt2]

  bypassed  Hooks whose `active` is never set: the engine's trace points cost one check
  off       the tracer attached and detached again: what `serve` costs with tracing off
  on        TraceSession: bus + recorder to a temp file + step controller (running freely)
  on+tui    on, plus a thread folding the bus into LiveState at 10 Hz, as the TUI does

Targets: on >= 0.90x off with async scheduling on (vLLM's default with CUDA, and ours); off within 2% of
bypassed. Then one 64-request run checks that the recorder lost no event.

How it is measured. Whole runs, interleaved: each repetition runs the workload once in every
(async setting, mode), one after another, the order rotating from one repetition to the next, and
a run is timed from tracing's start to the recorder's last flush (the TUI reader's thread and the
recorder's writer take their share of the interpreter while it runs). Each async setting keeps
two engines for the whole invocation: one with bypassed hooks, and one whose hooks the other
modes share (a TraceSession attached for an `on` run and closed after it). A mode's figure is the
median of its runs; a ratio is one of medians. Why whole runs: with async scheduling a step's
forward pass runs on the executor's thread while the core schedules the next, so one step's time
is no longer the engine's work (engines stepped in lockstep would run their forward passes over
one another), and only a whole run says what tracing costs the overlap. A shared machine's speed
drifts from one second to the next; interleaving the runs spreads that drift over every mode.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.workload import make_workload
from engine import LLM, Hooks
from tracer.events import read_trace
from tracer.session import TraceSession

MODES = ["bypassed", "off", "on", "on+tui"]
ASYNC = [True, False]  # async scheduling on (the default), then off


class BypassedHooks(Hooks):
    """Listeners and gates are refused, so `active` stays False."""

    def subscribe(self, listener):
        return lambda: None

    def add_gate(self, gate):
        return lambda: None


class TuiReader:
    """Pull from the bus and fold into LiveState ten times a second, like the TUI's timer."""

    def __init__(self, session: TraceSession):
        self.session, self.stop = session, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.wait(0.1):
            self.session.state.view()

    def close(self):
        self.stop.set()
        self.thread.join()


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds a running thread has used so far (Linux; 0 where the OS can't say)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):
        return 0.0


class Mode:
    """One mode's engine (with its tracer and helper threads, if any) and what it measured."""

    def __init__(self, mode: str, model: str, trace_dir: Path):
        hooks = BypassedHooks() if mode == "bypassed" else Hooks()
        self.session = self.reader = None
        if mode == "off":
            TraceSession(hooks).close()
        elif mode.startswith("on"):
            self.session = TraceSession(hooks, trace_file=trace_dir / f"{mode}.jsonl")
            self.reader = TuiReader(self.session) if mode == "on+tui" else None
        # stepped in lockstep with other engines (benchmarks/profiling.py): the synchronous step, whose
        # time is its own work (an async step's forward pass would run over another engine's)
        self.engine = LLM(model, hooks=hooks, async_scheduling=False).llm_engine
        self.ids = itertools.count()
        self.helpers = [t.thread for t in (self.session and self.session.recorder, self.reader) if t is not None]
        self.steps: list[float] = []
        self.tokens = 0

    def add(self, workload) -> None:
        # as LLM.generate does: only finished requests produce an output
        for prompt, params in workload:
            self.engine.add_request(str(next(self.ids)), {"prompt_token_ids": prompt},
                                    replace(params, output_kind="final_only"))
        self.cpu0 = [thread_cpu(th) for th in self.helpers]

    def step(self) -> None:
        t = time.perf_counter()
        outs = self.engine.step()
        self.steps.append(time.perf_counter() - t)
        self.tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)

    def finish(self) -> float:
        """The helpers' seconds: the recorder's final flush and its threads' CPU time."""
        helper_seconds = 0.0
        if self.session is not None and self.session.recorder is not None:
            t = time.perf_counter()
            self.session.recorder.flush()  # the recorder's work on this run's events counts
            helper_seconds = time.perf_counter() - t
        helper_seconds += sum(thread_cpu(th) - c for th, c in zip(self.helpers, self.cpu0))
        for x in (self.reader, self.session):
            if x is not None:
                x.close()
        return helper_seconds


class Engines:
    """One async setting's engines, kept for the whole invocation: one with bypassed hooks, and one
    whose hooks serve off (nothing attached) and on (a TraceSession attached for the run)."""

    def __init__(self, model: str, async_scheduling: bool):
        self.hooks = Hooks()
        TraceSession(self.hooks).close()  # attached and detached: what `serve` costs with tracing off
        self.bypassed = LLM(model, hooks=BypassedHooks(), async_scheduling=async_scheduling).llm_engine
        self.traced = LLM(model, hooks=self.hooks, async_scheduling=async_scheduling).llm_engine
        self.ids = itertools.count()

    def run(self, mode: str, workload, trace_file: Path) -> tuple[float, int]:
        """One whole run of the workload in `mode`: its seconds, and the tokens it generated."""
        engine = self.bypassed if mode == "bypassed" else self.traced
        session = TraceSession(self.hooks, trace_file=trace_file) if mode.startswith("on") else None
        reader = TuiReader(session) if mode == "on+tui" else None
        t = time.perf_counter()
        for prompt, params in workload:  # as LLM.generate does: only finished requests produce an output
            engine.add_request(str(next(self.ids)), {"prompt_token_ids": prompt},
                               replace(params, output_kind="final_only"))
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        core = engine.engine_core.engine_core
        while core.batch_queue:  # async scheduling: the step still in flight is this run's too
            core.step_fn()
        for x in (reader, session):  # the recorder's final flush counts
            if x is not None:
                x.close()
        return time.perf_counter() - t, tokens


def run_interleaved(model: str, workload, reps: int, trace_dir: Path, modes: list[str] = MODES,
                    log=None) -> dict[tuple[bool, str], list[float]]:
    """(async scheduling, mode) -> each repetition's whole-run seconds; every run's tokens checked equal."""
    engines = {a: Engines(model, a) for a in ASYNC}
    runs = [(a, m) for a in ASYNC for m in modes]
    seconds: dict[tuple[bool, str], list[float]] = {r: [] for r in runs}
    want = sum(p.max_tokens for _, p in workload)
    for rep in range(reps):
        for a, mode in runs[rep % len(runs):] + runs[:rep % len(runs)]:
            s, tokens = engines[a].run(mode, workload, trace_dir / f"{mode}.jsonl")
            if tokens != want:
                raise SystemExit(f"async={a} {mode}: {tokens} tokens, not the workload's {want}")
            seconds[a, mode].append(s)
            if log:
                log(f"rep {rep} async {'on ' if a else 'off'} {mode:>8}: {tokens / s:8.1f} tokens/s ({s * 1e3:.0f} ms)")
    for e in engines.values():
        for engine in (e.bypassed, e.traced):
            engine.engine_core.shutdown()
    return seconds


def check_no_loss(model: str, trace_dir: Path, num_requests: int = 64) -> str:
    hooks = Hooks()
    path = trace_dir / "no-loss.jsonl"
    with TraceSession(hooks, trace_file=path) as session:
        llm = LLM(model, hooks=hooks)
        work = make_workload(num_requests, seed=1)
        llm.generate([{"prompt_token_ids": p} for p, _ in work], [s for _, s in work], use_tqdm=False)
        published = session.bus.next_seq
    _, events = read_trace(path)
    ok = [e.seq for e in events] == list(range(published)) and session.recorder.num_lost == 0
    finished = sum(e.name == "FINISHED" for e in events)
    return (f"{'OK' if ok else 'FAILED'}: {num_requests} requests, {published} events published, "
            f"{len(events)} recorded, {session.recorder.num_lost} lost, {finished} FINISHED")


def lockstep_args(doc: str, requests: int, reps: int) -> argparse.Namespace:
    """The lockstep benchmarks' command line (--model, --requests, --reps, --threads), checked;
    torch's threads set."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--requests", type=int, default=requests)
    ap.add_argument("--reps", type=int, default=reps, help="repetitions (each runs every mode in lockstep)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    for name in ("requests", "reps", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = lockstep_args(__doc__, requests=32, reps=7)
    workload = make_workload(args.requests)
    tokens = sum(p.max_tokens for _, p in workload)
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp)
        run_interleaved(args.model, make_workload(4), 1, trace_dir)  # warm-up: model cache, allocator
        seconds = run_interleaved(args.model, workload, args.reps, trace_dir, log=lambda line: print(line, flush=True))
        no_loss = check_no_loss(args.model, trace_dir)
    med = {r: statistics.median(s) for r, s in seconds.items()}
    print(f"\n{args.requests} requests ({tokens} tokens), {args.reps} interleaved whole runs per mode, "
          f"{args.threads} torch thread(s); medians")
    print("| | async on | async off |\n|---|---:|---:|")
    for mode in MODES:
        print(f"| {mode} tok/s | {tokens / med[True, mode]:.1f} | {tokens / med[False, mode]:.1f} |")
    for label, num, den in (("on ÷ off (target >= 0.90)", "off", "on"), ("on+tui ÷ off", "off", "on+tui"),
                            ("off ÷ bypassed (target 0.98 .. 1.02)", "bypassed", "off")):
        print(f"| {label} | {med[True, num] / med[True, den]:.3f} | {med[False, num] / med[False, den]:.3f} |")
    print(f"| async ÷ sync, tracing off | {med[False, 'off'] / med[True, 'off']:.3f} | |")
    print(f"no-loss check: {no_loss}")


if __name__ == "__main__":
    main()
