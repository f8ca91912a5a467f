"""What profiling costs: the shared workload traced with profiling off and on, in one process,
their engines stepped in lockstep; then one op alone, plain and profiled.

    python -m benchmarks.profiling [--requests 8] [--reps 7] [--model tiny-gpt2]

  off       TraceSession (bus, recorder to a temp file, step controller), profiling off: what
            tracing costs with profiling off (benchmarks.trace_overhead measures it against no tracing)
  on        the same, after LLM.start_profile(): every op of the forward pass and of the sampler
            is a launch with its shapes, FLOPs and bytes

Per step: each mode's step time (the sum over steps of each step's median over the repetitions,
as benchmarks.trace_overhead takes it, plus the recorder's final flush and its thread's CPU), and
the launches per step each mode recorded (read back from its trace file). Profiling's cost per
op is the difference in time over the difference in launches. The share of a decode step that
the profiled launches' own durations cover (the rest: the scheduler, the trace points, Python
between ops, and profiling's own bookkeeping) is printed for the decode steps of the on mode.

Per op: a LayerNorm of one decode token (the smallest op of a step) called plainly, and as a
profiled op while the engine profiles (kernels.instrument.Op inside observe(profile=True)),
interleaved: the difference is what recording one op costs the engine thread.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.trace_overhead import Mode, lockstep_args
from benchmarks.workload import make_workload
from engine.hooks import BEGIN, END
from engine.trace_names import ENGINE, KERNEL, SCHEDULE, SCHEDULER, STEP
from tracer.events import read_trace

MODES = ["off", "on"]


def run_lockstep(model: str, workload, trace_dir: Path, rotate: int) -> dict[str, tuple[list[float], float, int]]:
    """Mode -> (each engine step's seconds, the helpers' seconds, generated tokens)."""
    runs = {}
    for mode in MODES:  # both traced, each to its own file: trace_dir/MODE/on.jsonl
        (trace_dir / mode).mkdir(exist_ok=True)
        runs[mode] = Mode("on", model, trace_dir / mode)
    for mode, run in runs.items():
        if mode == "on":
            run.engine.start_profile()
        run.add(workload)
    k = rotate
    while any(run.engine.has_unfinished_requests() for run in runs.values()):
        for i in range(len(MODES)):
            run = runs[MODES[(k + i) % len(MODES)]]
            if run.engine.has_unfinished_requests():
                run.step()
        k += 1
    runs["on"].engine.stop_profile()
    return {mode: (run.steps, run.finish(), run.tokens) for mode, run in runs.items()}


def launches_and_coverage(path: Path) -> tuple[float, list[float]]:
    """(kernel launches per step, for each decode step the share of its wall time its launches' durations cover)."""
    _, events = read_trace(path)
    steps: dict[int, dict] = defaultdict(lambda: {"n": 0, "ns": 0})
    for e in events:
        if e.layer == KERNEL and e.step is not None:
            steps[e.step]["n"] += 1
            steps[e.step]["ns"] += e.attrs["duration_ns"]
        elif (e.layer, e.name) == (ENGINE, STEP) and e.kind in (BEGIN, END):
            steps[e.step][e.kind] = e.ts_ns
        elif (e.layer, e.name, e.kind) == (SCHEDULER, SCHEDULE, "snapshot"):
            steps[e.step]["decode"] = all(s["kind"] == "decode" for s in e.attrs["scheduled"])
    done = [s for s in steps.values() if BEGIN in s and END in s]
    cover = [s["ns"] / (s[END] - s[BEGIN]) for s in done if s.get("decode")]
    return sum(s["n"] for s in done) / len(done), cover


def one_op(reps: int = 20_000) -> tuple[float, float, float]:
    """(plain, profiled, recorded duration) microseconds of one LayerNorm of a decode token."""
    from torch import nn

    from engine.worker.profiler import profiled_forward
    from kernels import instrument

    plain, wrapped = nn.LayerNorm(128), nn.LayerNorm(128)
    wrapped.forward = profiled_forward("ln_1", "norm", "layer_norm", "h.0.ln_1", wrapped)
    x = torch.randn(1, 128)
    durations = []
    times = {"plain": [], "profiled": []}
    with torch.inference_mode(), instrument.observe(lambda r: durations.append(r.duration_ns), access_maps=False,
                                                    profile=True, step=0):
        for _ in range(5):  # interleaved blocks: both see the same machine
            for name, module in (("plain", plain), ("profiled", wrapped)):
                t = time.perf_counter_ns()
                for _ in range(reps // 5):
                    module(x)
                times[name].append((time.perf_counter_ns() - t) / (reps // 5) / 1e3)
    return statistics.median(times["plain"]), statistics.median(times["profiled"]), statistics.median(durations) / 1e3


def main() -> None:
    args = lockstep_args(__doc__, requests=8, reps=7)
    workload = make_workload(args.requests)
    steps: dict[str, list[list[float]]] = {m: [] for m in MODES}
    helpers: dict[str, list[float]] = {m: [] for m in MODES}
    per_step_launches, cover = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp)
        run_lockstep(args.model, make_workload(2), trace_dir, 0)  # warm-up: model cache, allocator
        for rep in range(args.reps):
            for mode, (step_s, helper_s, tokens) in run_lockstep(args.model, workload, trace_dir, rep).items():
                steps[mode].append(step_s)
                helpers[mode].append(helper_s)
                print(f"rep {rep} {mode:>3}: {tokens / (sum(step_s) + helper_s):8.1f} tokens/s ({len(step_s)} steps, "
                      f"{sum(step_s) * 1e3:.0f} ms + helpers {helper_s * 1e3:.1f} ms)", flush=True)
            for mode in MODES:
                per_step_launches[mode], c = launches_and_coverage(trace_dir / mode / "on.jsonl")
                cover += c if mode == "on" else []
    if len({len(s) for runs in steps.values() for s in runs}) != 1:
        raise SystemExit("runs took different numbers of steps: the per-step comparison needs the same schedule")
    n = len(steps["off"][0])
    per_step = {m: (sum(map(statistics.median, zip(*steps[m]))) + statistics.median(helpers[m])) / n for m in MODES}
    extra_ops = per_step_launches["on"] - per_step_launches["off"]
    print(f"\n{args.requests} requests ({tokens} tokens), {args.reps} repetitions in lockstep, "
          f"{args.threads} torch thread(s), {n} steps a run")
    print(f"step time: profiling off {per_step['off'] * 1e3:.3f} ms, on {per_step['on'] * 1e3:.3f} ms; "
          f"on / off throughput = {per_step['off'] / per_step['on']:.3f}")
    print(f"launches a step: off {per_step_launches['off']:.1f}, on {per_step_launches['on']:.1f}")
    print(f"profiling's cost: {(per_step['on'] - per_step['off']) * 1e6:.0f} us a step, "
          f"{(per_step['on'] - per_step['off']) * 1e6 / extra_ops:.2f} us per profiled op")
    print(f"decode steps profiled: the launches' durations cover {statistics.median(cover):.0%} of the step "
          f"(median; {min(cover):.0%}..{max(cover):.0%})")
    plain, profiled, recorded = one_op()
    print(f"one op (LayerNorm, 1 x 128): plain {plain:.2f} us, profiled {profiled:.2f} us "
          f"(+{profiled - plain:.2f} us to record it), its recorded duration {recorded:.2f} us")


if __name__ == "__main__":
    main()
