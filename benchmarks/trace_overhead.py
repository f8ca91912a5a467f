"""What tracing costs: the shared workload with tracing bypassed, off, on, and on with a
TUI-like reader, in one process, their engines stepped in lockstep.

    python -m benchmarks.trace_overhead [--requests 32] [--reps 11] [--model tiny-gpt2]

  bypassed  Hooks whose `active` is never set: the engine's trace points cost one check
  off       the tracer attached and detached again: what `serve` costs with tracing off
  on        TraceSession: bus + recorder to a temp file + step controller (running freely)
  on+tui    on, plus a thread folding the bus into LiveState at 10 Hz, as the TUI does

Targets: on >= 0.90x off; off within 2% of bypassed. Then one 64-request run checks that the
recorder lost no event.

How it is measured. Each repetition builds one engine per mode, in one process, and steps them
in lockstep: step k of every mode runs back to back (the first mode rotating from step to step)
before step k + 1 of any, so the four samples of a step are taken within milliseconds of each
other. The workload is greedy and seeded, so step k schedules the same batch in every mode. A
mode's time is the sum over steps of that step's median over the repetitions, plus the median of
its helpers' time: the recorder's final flush and the CPU time of its threads (the recorder's
writer, the TUI reader), counted in full although much of it overlaps the engine's work.
Whole-run medians are printed too. Why lockstep: a shared VM's speed drifts by tens of percent
from one second to the next, and whole runs a third of a second apart (the previous method) left
`off` and `bypassed`, the same engine code, up to 5-10 % apart in one invocation; paired steps
cancel the drift. What still differs between modes is only their own work, and what their helper
threads take from the interpreter lock while another mode steps (the TUI reader's 10 Hz folds land
on every mode's steps alike, which understates on+tui's cost a little).
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
        self.engine = LLM(model, hooks=hooks).llm_engine
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


def run_lockstep(modes: list[str], model: str, workload, trace_dir: Path,
                 rotate: int = 0) -> dict[str, tuple[list[float], float, int]]:
    """Mode -> (each engine step's seconds, the helpers' seconds, generated tokens), the modes'
    engines stepped in lockstep over the same workload."""
    runs = {mode: Mode(mode, model, trace_dir) for mode in modes}
    for run in runs.values():
        run.add(workload)
    k = rotate
    while any(run.engine.has_unfinished_requests() for run in runs.values()):
        for i in range(len(modes)):
            run = runs[modes[(k + i) % len(modes)]]
            if run.engine.has_unfinished_requests():
                run.step()
        k += 1
    return {mode: (run.steps, run.finish(), run.tokens) for mode, run in runs.items()}


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
    args = lockstep_args(__doc__, requests=32, reps=11)
    workload = make_workload(args.requests)
    steps: dict[str, list[list[float]]] = {m: [] for m in MODES}
    helpers: dict[str, list[float]] = {m: [] for m in MODES}
    tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp)
        run_lockstep(MODES, args.model, make_workload(4), trace_dir)  # warm-up: model cache, allocator
        for rep in range(args.reps):
            for mode, (step_s, helper_s, tokens) in run_lockstep(MODES, args.model, workload, trace_dir, rep).items():
                steps[mode].append(step_s)
                helpers[mode].append(helper_s)
                print(f"rep {rep} {mode:>8}: {tokens / (sum(step_s) + helper_s):8.1f} tokens/s ({len(step_s)} steps, "
                      f"{sum(step_s) * 1e3:.0f} ms + helpers {helper_s * 1e3:.1f} ms)", flush=True)
        no_loss = check_no_loss(args.model, trace_dir)
    if len({len(s) for runs in steps.values() for s in runs}) != 1:
        raise SystemExit("runs took different numbers of steps: the per-step comparison needs the same schedule")
    per_step = {m: sum(map(statistics.median, zip(*steps[m]))) + statistics.median(helpers[m]) for m in MODES}
    whole = {m: statistics.median(sum(s) + h for s, h in zip(steps[m], helpers[m])) for m in MODES}
    print(f"\n{args.requests} requests ({tokens} tokens), {args.reps} repetitions in lockstep, "
          f"{args.threads} torch thread(s), {len(steps['off'][0])} steps a run")
    for label, secs in (("sum of per-step medians (the measure)", per_step), ("median of whole runs", whole)):
        print(f"{label}: " + ", ".join(f"{m} {tokens / secs[m]:.1f} tok/s" for m in MODES))
        print(f"  on / off       = {secs['off'] / secs['on']:.3f}   (target >= 0.90)")
        print(f"  on+tui / off   = {secs['off'] / secs['on+tui']:.3f}")
        print(f"  off / bypassed = {secs['bypassed'] / secs['off']:.3f}   (target within 0.98 .. 1.02)")
    print(f"no-loss check: {no_loss}")


if __name__ == "__main__":
    main()
